//! Encoding messages into frames and decoding frames into messages, without I/O.

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::bounded::BodyReader;
pub use crate::bounded::MAX_DEPTH;
use crate::bulk::Piece;
use crate::frame::{
    self, FrameError, Header, Reassembler, ASK, DONE, FIRST, HEADER_LEN, LAST, RNDV, TOTAL_LEN,
};
use crate::message::{CALL_TAG, REPLY_TAG};
use crate::rendezvous::{self, Descriptor, ReadBuf};
use crate::{DecodeFailure, Error, Message, Result};

/// Largest message (reassembled body, and decoded value) accepted by default: 16 MiB.
pub const DEFAULT_MAX_MESSAGE: usize = 16 << 20;

/// bincode's standard configuration. Decoding is bounded by [`crate::bounded`] at run time
/// (bincode's own limit is a compile-time constant), so that a forged length prefix cannot
/// make the decoder allocate more than a message may hold.
fn config() -> impl bincode::config::Config {
    bincode::config::standard()
}

/// Decodes a `T` at the start of `body`: the value and how many bytes it took (`None` if
/// it does not decode). For the fixed headers of requests and answers.
pub(crate) fn decode_prefix<T: DeserializeOwned>(body: &[u8]) -> Option<(T, usize)> {
    bincode::serde::decode_from_slice(body, config()).ok()
}

/// What the registry calls the tags of requests and answers (never listed as types).
const CALL_NAME: &str = "rdmsg request";
const REPLY_NAME: &str = "rdmsg answer";

/// Tag of frames without a message (a [`crate::Session::flush`] nudge).
pub const NUDGE_TAG: u32 = 0;

/// Encodes `m` as one complete frame straight into `out`. `Ok(None)` if it does not fit.
pub fn encode_single<M: Message>(m: &M, seq: u32, out: &mut [u8]) -> Result<Option<usize>> {
    if out.len() < HEADER_LEN {
        return Ok(None);
    }
    let (head, body) = out.split_at_mut(HEADER_LEN);
    match bincode::serde::encode_into_slice(m, body, config()) {
        Ok(len) => {
            Header {
                flags: FIRST | LAST,
                tag: M::TAG,
                seq,
                frag: 0,
                len: len as u32,
            }
            .write(head);
            Ok(Some(HEADER_LEN + len))
        }
        Err(bincode::error::EncodeError::UnexpectedEnd) => Ok(None),
        Err(source) => Err(Error::Encode {
            tag: M::TAG,
            source,
        }),
    }
}

/// `v` encoded as bincode, as frames encode bodies: the head of a request or an answer whose
/// body goes as it came ([`crate::Hub::forward`]).
pub(crate) fn encode_head<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(v, config()).map_err(|source| Error::Encode {
        tag: crate::message::CALL_TAG,
        source,
    })
}

/// Encodes `m` as one entry of a packed frame ([`frame::PACK_ENTRY`] bytes of head, then its
/// body) straight into `out`: the entry's length, or `Ok(None)` if it does not fit.
pub(crate) fn encode_entry<M: Message>(m: &M, out: &mut [u8]) -> Result<Option<usize>> {
    let Some(body) = out.get_mut(frame::PACK_ENTRY..) else {
        return Ok(None);
    };
    match bincode::serde::encode_into_slice(m, body, config()) {
        Ok(len) => {
            frame::write_entry(out, M::TAG, len as u32);
            Ok(Some(frame::PACK_ENTRY + len))
        }
        Err(bincode::error::EncodeError::UnexpectedEnd) => Ok(None),
        Err(source) => Err(Error::Encode {
            tag: M::TAG,
            source,
        }),
    }
}

/// Encodes `m` as frames of at most `frame_max` bytes each.
pub fn encode_fragments<M: Message>(
    m: &M,
    seq: u32,
    frame_max: usize,
    max_message: usize,
) -> Result<Vec<Vec<u8>>> {
    let body = bincode::serde::encode_to_vec(m, config()).map_err(|source| Error::Encode {
        tag: M::TAG,
        source,
    })?;
    fragment(&body, M::TAG, seq, frame_max, max_message)
}

/// Cuts an encoded body into frames of at most `frame_max` bytes each: one whole frame if it
/// fits, else fragments, the first announcing the body's length ([`frame::announced_total`]:
/// [`frame::TOTAL_LEN`] bytes ahead of its part of the body).
pub fn fragment(
    body: &[u8],
    tag: u32,
    seq: u32,
    frame_max: usize,
    max_message: usize,
) -> Result<Vec<Vec<u8>>> {
    if body.len() > max_message {
        return Err(Error::TooLarge {
            len: body.len(),
            max: max_message,
        });
    }
    let chunk = frame_max.saturating_sub(HEADER_LEN).max(1);
    if body.len() <= chunk {
        return Ok(vec![frame::build(FIRST | LAST, tag, seq, 0, body)]);
    }
    let total = u32::try_from(body.len()).map_err(|_| Error::TooLarge {
        len: body.len(),
        max: u32::MAX as usize,
    })?;
    // The announced length and the body, as one run cut into frames (a first frame always
    // holds the whole length and one byte, even under a nonsensical `frame_max`).
    let chunk = chunk.max(TOTAL_LEN + 1);
    let run = TOTAL_LEN + body.len();
    let count = run.div_ceil(chunk);
    if count > usize::from(u16::MAX) + 1 {
        return Err(Error::TooManyFragments {
            len: body.len(),
            max: chunk * (usize::from(u16::MAX) + 1) - TOTAL_LEN,
        });
    }
    let mut frames = Vec::with_capacity(count);
    let mut first = Vec::with_capacity(chunk);
    first.extend_from_slice(&total.to_be_bytes());
    first.extend_from_slice(&body[..chunk - TOTAL_LEN]);
    frames.push(frame::build(FIRST, tag, seq, 0, &first));
    for i in 1..count {
        let part = &body[i * chunk - TOTAL_LEN..((i + 1) * chunk - TOTAL_LEN).min(body.len())];
        let flags = if i + 1 == count { LAST } else { 0 };
        frames.push(frame::build(flags, tag, seq, i as u16, part));
    }
    Ok(frames)
}

/// Encodes `m` into pieces whose concatenation is its body, [`crate::Bulk`] payloads left
/// by reference (see [`crate::bulk::Piece`]).
pub fn encode_pieces<M: Message>(m: &M) -> Result<Vec<Piece>> {
    crate::bulk::encode_pieces(m, config()).map_err(|source| Error::Encode {
        tag: M::TAG,
        source,
    })
}

/// Decodes a message body into an owned value holding at most `max` bytes in its strings and
/// containers (see [`DecodeFailure::TooLarge`]; a session passes
/// [`crate::SessionConfig::max_message`]) and nesting at most [`MAX_DEPTH`] levels deep
/// ([`DecodeFailure::TooDeep`]).
pub fn decode_body<M: Message + DeserializeOwned>(tag: u32, body: &[u8], max: usize) -> Result<M> {
    decode_body_borrowed(tag, body, max)
}

/// Decodes a message body into a value that may borrow from it (no copy of byte strings),
/// within the same bound as [`decode_body`] (borrowed bytes count as if copied).
pub fn decode_body_borrowed<'de, M: Message + Deserialize<'de>>(
    tag: u32,
    body: &'de [u8],
    max: usize,
) -> Result<M> {
    if tag != M::TAG {
        return Err(wrong_type::<M>(tag, None));
    }
    let mut reader = BodyReader::new(body, max);
    let m = M::deserialize(&mut reader).map_err(|e| Error::Decode {
        tag,
        source: if reader.too_deep() {
            DecodeFailure::TooDeep { max: MAX_DEPTH }
        } else if reader.exceeded() {
            DecodeFailure::TooLarge { max }
        } else {
            DecodeFailure::Bincode(e)
        },
    })?;
    if reader.remaining() != 0 {
        return Err(Error::Decode {
            tag,
            source: DecodeFailure::Trailing(reader.remaining()),
        });
    }
    Ok(m)
}

/// [`Error::WrongType`]: `M` asked of a message of `tag` (of type `actual`, if known).
pub(crate) fn wrong_type<M: Message>(tag: u32, actual: Option<&'static str>) -> Error {
    Error::WrongType {
        expected: std::any::type_name::<M>(),
        expected_tag: M::TAG,
        tag,
        actual,
    }
}

/// The bytes of a received frame: a zero-copy transport buffer or owned bytes.
#[derive(Debug)]
pub enum FrameBytes {
    /// A receive buffer of the transport, returned to its pool when dropped.
    Received(rdmsg_transport::Received),
    /// Owned bytes.
    Owned(Vec<u8>),
    /// A message's body read by rendezvous into a registered buffer, returned to its pool
    /// when dropped (no header: the descriptor carried it).
    Read(ReadBuf),
    /// Bytes shared with payloads decoded from them ([`Envelope::decode_shared`]).
    Shared(bytes::Bytes),
    /// One message's body in a receive buffer it shares with the other messages of its
    /// packed frame ([`frame::PACK`]): the buffer, and its credit, go back once all of them
    /// are dropped.
    Packed(bytes::Bytes),
}

impl FrameBytes {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            FrameBytes::Received(r) => r,
            FrameBytes::Owned(v) => v,
            FrameBytes::Read(r) => r.bytes(),
            FrameBytes::Shared(b) | FrameBytes::Packed(b) => b,
        }
    }

    /// The frame as shared bytes, for the messages of a packed frame to share.
    fn into_shared(self) -> bytes::Bytes {
        match self {
            FrameBytes::Received(r) => bytes::Bytes::from_owner(r),
            FrameBytes::Owned(v) => bytes::Bytes::from(v),
            FrameBytes::Read(r) => bytes::Bytes::copy_from_slice(r.bytes()),
            FrameBytes::Shared(b) | FrameBytes::Packed(b) => b,
        }
    }
}

/// A packed frame's messages, still together ([`Decoded::Packed`]); [`Decoder::unpack`]
/// hands them out.
#[derive(Debug)]
pub struct Packed {
    frame: bytes::Bytes,
    seq: u32,
    count: u16,
}

impl Packed {
    /// The number of its last message.
    pub fn last_seq(&self) -> u32 {
        self.seq.wrapping_add(self.count() - 1)
    }

    /// How many messages it holds (at least one).
    pub fn count(&self) -> u32 {
        u32::from(self.count)
    }
}

/// What one frame came to ([`Decoder::take`]).
#[derive(Debug)]
pub enum Decoded {
    /// A whole message.
    Message(Envelope),
    /// Nothing yet (a fragment stored or dropped with its message, a nudge).
    Nothing,
    /// A rendezvous descriptor: message `seq` of type `tag` waits to be read (its tag was
    /// checked against the registered types).
    Rendezvous {
        /// The message's tag.
        tag: u32,
        /// Its sequence number.
        seq: u32,
        /// Where it is.
        descriptor: Descriptor,
    },
    /// The peer is done reading these messages of ours.
    Done(Vec<u32>),
    /// The peer asks to be told once our application has taken its messages before `seq`.
    Ask(u32),
    /// Several whole messages in one frame, checked to add up ([`Decoder::unpack`]).
    Packed(Packed),
}

/// A received message: its tag and body, still encoded. Single-frame messages keep their
/// transport buffer (zero-copy) until dropped.
#[derive(Debug)]
pub struct Envelope {
    tag: u32,
    /// The type registered under `tag` with the decoder that made it, if any (for
    /// [`Error::WrongType`]).
    ty: Option<&'static str>,
    seq: u32,
    frame: FrameBytes,
    offset: usize,
    /// Bound on the decoded value.
    max: usize,
    /// Where a request's answer goes (see [`Envelope::responder`]): a `call::Origin`, which
    /// answers "no answer" when dropped unanswered (opaque here, so that frames know nothing
    /// of calls).
    origin: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Envelope {
    /// A message of ours that the peer's application did not take, handed back from its kept
    /// copy (see [`crate::SessionConfig::keep_unconfirmed`]).
    pub(crate) fn returned(tag: u32, seq: u32, body: Vec<u8>, max: usize) -> Self {
        Self {
            tag,
            ty: None,
            seq,
            frame: FrameBytes::Owned(body),
            offset: 0,
            max,
            origin: None,
        }
    }

    /// A request's envelope: its body starts `used` bytes on, it has the request's own tag
    /// (and name), and it carries where its answer goes.
    pub(crate) fn unwrap_request(
        &mut self,
        used: usize,
        (tag, ty): (u32, Option<&'static str>),
        origin: Box<dyn std::any::Any + Send + Sync>,
    ) {
        self.skip(used);
        self.tag = tag;
        self.ty = ty;
        self.origin = Some(origin);
    }

    /// Where a request's answer goes, if it is a request.
    pub(crate) fn origin_ref(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        self.origin.as_deref()
    }

    /// Where a request's answer goes, taken out.
    pub(crate) fn take_origin(&mut self) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        self.origin.take()
    }

    /// The body starts `n` bytes further on.
    pub(crate) fn skip(&mut self, n: usize) {
        self.offset = (self.offset + n).min(self.frame.bytes().len());
    }

    /// An answer's envelope takes its response type's tag (and name).
    pub(crate) fn retag(&mut self, tag: u32, ty: &'static str) {
        self.tag = tag;
        self.ty = Some(ty);
    }

    /// Whether this is a request someone waits to have answered (see
    /// [`Envelope::responder`]).
    pub fn is_request(&self) -> bool {
        self.origin.is_some()
    }

    /// Copies the body out of a receive buffer, if it is in one, so that keeping this
    /// envelope does not keep the peer's credit (a rendezvous read buffer is kept: it holds
    /// no credit).
    pub(crate) fn release_credit(&mut self) {
        if matches!(self.frame, FrameBytes::Received(_) | FrameBytes::Packed(_)) {
            self.detach();
        }
    }

    /// Copies the body out of a registered buffer (a receive buffer, or one a rendezvous
    /// read landed in) into memory of its own, so that keeping this envelope no longer holds
    /// the buffer (and, for a receive buffer, the peer's credit). Nothing to do for a body
    /// that is already owned. A detached request forwarded ([`crate::Hub::forward`]) goes
    /// on by reference, without another copy.
    pub fn detach(&mut self) {
        if matches!(
            self.frame,
            FrameBytes::Received(_) | FrameBytes::Read(_) | FrameBytes::Packed(_)
        ) {
            let body = self.body().to_vec();
            self.frame = FrameBytes::Shared(bytes::Bytes::from(body));
            self.offset = 0;
        }
    }

    /// The body by reference, if it is in memory of its own (detached, or shared by
    /// [`Envelope::decode_shared`]).
    pub(crate) fn shared_body(&self) -> Option<bytes::Bytes> {
        match &self.frame {
            FrameBytes::Shared(b) => Some(b.slice(self.offset..)),
            _ => None,
        }
    }

    /// Decodes the body as an `M` whose [`crate::Bulk`] fields share the received bytes
    /// instead of copying them: one owned type serves for sending and for zero-copy
    /// receiving, with no borrowed twin to keep in step (and its tag checked:
    /// [`Error::WrongType`] for another type's message).
    ///
    /// Sharing keeps the bytes where they are: a large message reassembled from fragments
    /// costs nothing to share; one read by rendezvous stays in its registered buffer for as
    /// long as any of its payloads lives. So that payloads kept for long cannot hold the
    /// registered memory every peer's large messages need, payloads share a rendezvous
    /// buffer only while shared ones hold at most half of the read pool
    /// ([`rdmsg_transport::Config::max_read_bytes`]); past that they are copied, as are
    /// payloads under 4 KiB and messages still in a receive buffer (whose credit the peer
    /// waits for): a payload shares when its address lies in [`Envelope::body`].
    pub fn decode_shared<M: Message + DeserializeOwned>(&mut self) -> Result<M> {
        if self.tag != M::TAG {
            return Err(wrong_type::<M>(self.tag, self.ty));
        }
        let frame = std::mem::replace(&mut self.frame, FrameBytes::Owned(Vec::new()));
        self.frame = match frame {
            FrameBytes::Owned(v) => FrameBytes::Shared(bytes::Bytes::from(v)),
            FrameBytes::Read(mut r) => {
                if r.share() {
                    FrameBytes::Shared(bytes::Bytes::from_owner(r))
                } else {
                    FrameBytes::Read(r)
                }
            }
            other => other,
        };
        let FrameBytes::Shared(b) = &self.frame else {
            return self.decode();
        };
        let source = b.slice(self.offset..);
        crate::bulk::sharing(source, || {
            decode_body_borrowed(self.tag, self.body(), self.max)
        })
    }

    /// Where its bytes are.
    #[cfg(test)]
    pub(crate) fn frame_bytes(&self) -> &FrameBytes {
        &self.frame
    }

    /// The message's tag.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// The sender's sequence number of this message.
    pub fn seq(&self) -> u32 {
        self.seq
    }

    /// Whether it holds an `M`.
    pub fn is<M: Message>(&self) -> bool {
        self.tag == M::TAG
    }

    /// The encoded body.
    pub fn body(&self) -> &[u8] {
        &self.frame.bytes()[self.offset..]
    }

    /// The type registered under this message's tag with the session, hub or decoder that
    /// received it (`std::any::type_name`), if one was.
    pub fn type_name(&self) -> Option<&'static str> {
        self.ty
    }

    /// Decodes the body as an `M`, holding at most the decoder's `max_message` bytes
    /// ([`DecodeFailure::TooLarge`] otherwise). A message of another tag is
    /// [`Error::WrongType`], naming both types as far as they are known; nothing is decoded.
    pub fn decode<M: Message + DeserializeOwned>(&self) -> Result<M> {
        self.check::<M>()?;
        decode_body(self.tag, self.body(), self.max)
    }

    /// Decodes the body as an `M` that borrows from the envelope: byte strings and strings are
    /// read in place, from the receive buffer of a single-frame message.
    pub fn decode_borrowed<'a, M: Message + Deserialize<'a>>(&'a self) -> Result<M> {
        self.check::<M>()?;
        decode_body_borrowed(self.tag, self.body(), self.max)
    }

    fn check<M: Message>(&self) -> Result<()> {
        if self.tag != M::TAG {
            return Err(wrong_type::<M>(self.tag, self.ty));
        }
        Ok(())
    }
}

/// The registered types by name, for [`Error::UnknownTag`].
fn registered(known: &HashMap<u32, &'static str>) -> Arc<[(&'static str, u32)]> {
    let mut types: Vec<_> = known
        .iter()
        .filter(|(&tag, _)| tag != CALL_TAG && tag != REPLY_TAG)
        .map(|(&tag, &name)| (name, tag))
        .collect();
    types.sort_unstable();
    types.into()
}

/// Turns received frames into messages: checks each frame, reassembles fragments, filters
/// tags. Bad frames give a typed error and are dropped; the decoder carries on with the next.
///
/// Once a type is registered, only registered tags are accepted, and a fragmented message is
/// judged by its first fragment: one of an unknown tag is refused at once
/// ([`Error::UnknownTag`]) and its other fragments are dropped without being buffered.
#[derive(Debug)]
pub struct Decoder {
    reassembler: Reassembler,
    /// Registered tags and the type each was registered for.
    known: HashMap<u32, &'static str>,
    /// The same, by name, for [`Error::UnknownTag`] (made at registration, shared by every
    /// error).
    registered: Arc<[(&'static str, u32)]>,
    /// `(tag, seq)` of a fragmented message refused by its first fragment, whose other
    /// fragments are dropped quietly.
    skipping: Option<(u32, u32)>,
    lost_partials: u64,
}

impl Decoder {
    /// A decoder for messages of at most `max_message` bytes (reassembled, and decoded),
    /// accepting every tag until [`Decoder::register`] is called.
    pub fn new(max_message: usize) -> Self {
        Self {
            reassembler: Reassembler::new(max_message),
            known: HashMap::new(),
            registered: Arc::new([]),
            skipping: None,
            lost_partials: 0,
        }
    }

    /// Accepts `M` (and, from now on, only registered types). A tag can be registered once:
    /// [`Error::DuplicateTag`] if another type (or `M` itself) holds it already.
    pub fn register<M: Message>(&mut self) -> Result<()> {
        let new = std::any::type_name::<M>();
        match self.known.entry(M::TAG) {
            Entry::Occupied(e) => Err(Error::DuplicateTag {
                tag: M::TAG,
                existing: e.get(),
                new,
            }),
            Entry::Vacant(e) => {
                e.insert(new);
                // Requests and answers travel under tags of their own: a side that filters
                // by type still takes them (a request's own type is checked once unwrapped).
                self.known.entry(CALL_TAG).or_insert(CALL_NAME);
                self.known.entry(REPLY_TAG).or_insert(REPLY_NAME);
                self.registered = registered(&self.known);
                Ok(())
            }
        }
    }

    /// A decoder with the same bound and registrations and nothing in progress: how a hub
    /// gives every new peer the types registered on it.
    pub(crate) fn fresh(&self) -> Decoder {
        Self {
            known: self.known.clone(),
            registered: self.registered.clone(),
            ..Decoder::new(self.max_message())
        }
    }

    /// The bound on a message, reassembled and decoded.
    pub fn max_message(&self) -> usize {
        self.reassembler.max_size()
    }

    /// Whether a message is half reassembled.
    pub fn in_progress(&self) -> bool {
        self.reassembler.in_progress()
    }

    /// Bytes held for a message being reassembled.
    pub fn buffered(&self) -> usize {
        self.reassembler.buffered()
    }

    /// The message being reassembled: its tag, sequence number and the body bytes received.
    pub fn partial(&self) -> Option<(u32, u32, usize)> {
        self.reassembler.partial()
    }

    /// Gives up the message being reassembled (its sender stalled): dropped, and its
    /// fragments that come later are dropped quietly. What [`Decoder::partial`] said of it.
    pub(crate) fn abandon_partial(&mut self) -> Option<(u32, u32, usize)> {
        let (tag, seq, received) = self.reassembler.abandon()?;
        self.skipping = Some((tag, seq));
        Some((tag, seq, received))
    }

    /// Forgets the message being reassembled and any that was being skipped: the connection
    /// it came over is gone, and the peer sends it again whole on the next
    /// ([`crate::Session`]'s resume).
    pub(crate) fn reset(&mut self) {
        let _ = self.reassembler.abandon();
        self.skipping = None;
    }

    /// Whether messages of `tag` are taken: every tag until a type is registered, then the
    /// registered ones.
    pub(crate) fn accepts(&self, tag: u32) -> bool {
        self.known.is_empty() || self.known.contains_key(&tag)
    }

    /// The type registered under `tag`, if any.
    pub(crate) fn type_of(&self, tag: u32) -> Option<&'static str> {
        self.known.get(&tag).copied()
    }

    /// Whether `tag` is accepted, and the type registered under it.
    fn check_tag(&self, tag: u32) -> Result<Option<&'static str>> {
        if self.known.is_empty() {
            return Ok(None);
        }
        match self.known.get(&tag) {
            Some(&name) => Ok(Some(name)),
            None => Err(Error::UnknownTag {
                tag,
                registered: self.registered.clone(),
            }),
        }
    }

    fn drop_partial(&mut self) {
        if self.reassembler.in_progress() {
            // The fragmented message before this one lost its tail.
            self.reassembler = Reassembler::new(self.reassembler.max_size());
            self.lost_partials += 1;
        }
    }

    fn envelope(
        &self,
        tag: u32,
        ty: Option<&'static str>,
        seq: u32,
        frame: FrameBytes,
        offset: usize,
    ) -> Envelope {
        Envelope {
            tag,
            ty,
            seq,
            frame,
            offset,
            max: self.max_message(),
            origin: None,
        }
    }

    /// Takes one frame. `Ok(None)`: a fragment was stored or dropped with its message, the
    /// frame carried no message, or it was a rendezvous frame (see [`Decoder::take`], which
    /// hands those out). A packed frame ([`frame::PACK`]) is refused whole
    /// ([`frame::FrameError::NotSingle`]): [`Decoder::take`] hands out its messages.
    pub fn push(&mut self, frame: FrameBytes) -> Result<Option<Envelope>> {
        Ok(match self.take(frame)? {
            Decoded::Message(env) => Some(env),
            Decoded::Packed(p) => return Err(Error::BadFrame(FrameError::NotSingle(p.count))),
            _ => None,
        })
    }

    /// A message read by rendezvous: its body, under the tag and number its descriptor gave.
    pub fn read_message(&self, tag: u32, seq: u32, body: ReadBuf) -> Envelope {
        let ty = self.known.get(&tag).copied();
        self.envelope(tag, ty, seq, FrameBytes::Read(body), 0)
    }

    /// Takes one frame: a message, nothing yet, or a rendezvous frame. A descriptor or an
    /// acknowledgement does not disturb a message being reassembled (they may come between
    /// its fragments). A descriptor that does not parse, or of a tag not registered, is an
    /// error (the caller still acknowledges it, so that the sender frees its memory).
    pub fn take(&mut self, frame: FrameBytes) -> Result<Decoded> {
        let (h, body) = frame::parse(frame.bytes())?;
        if h.flags & DONE != 0 {
            return Ok(Decoded::Done(rendezvous::parse_done(body)?));
        }
        if h.flags & ASK != 0 {
            return Ok(Decoded::Ask(h.seq));
        }
        if h.flags & frame::PACK != 0 {
            // Whole messages: a fragmented one before them lost its tail.
            self.skipping = None;
            self.drop_partial();
            frame::check_packed(h.seq, h.frag, &frame.bytes()[HEADER_LEN..])?;
            return Ok(Decoded::Packed(Packed {
                frame: frame.into_shared(),
                seq: h.seq,
                count: h.frag,
            }));
        }
        if h.flags & RNDV != 0 {
            self.check_tag(h.tag)?;
            return Ok(Decoded::Rendezvous {
                tag: h.tag,
                seq: h.seq,
                descriptor: Descriptor::parse(body)?,
            });
        }
        self.take_message(h, frame).map(|m| match m {
            Some(env) => Decoded::Message(env),
            None => Decoded::Nothing,
        })
    }

    fn take_message(&mut self, h: Header, frame: FrameBytes) -> Result<Option<Envelope>> {
        let body = &frame.bytes()[HEADER_LEN..];
        if h.flags & FIRST != 0 {
            self.skipping = None;
        } else if let Some((tag, seq)) = self.skipping {
            if (h.tag, h.seq) == (tag, seq) {
                // The rest of a message refused by its first fragment.
                if h.flags & LAST != 0 {
                    self.skipping = None;
                }
                return Ok(None);
            }
            self.skipping = None;
        }
        if h.flags == FIRST | LAST {
            // Keep this one, drop a fragmented message that lost its tail.
            self.drop_partial();
            if h.tag == NUDGE_TAG {
                return Ok(None);
            }
            let ty = self.check_tag(h.tag)?;
            return Ok(Some(self.envelope(h.tag, ty, h.seq, frame, HEADER_LEN)));
        }
        if h.flags & FIRST != 0 {
            if let Err(e) = self.check_tag(h.tag) {
                // Judged by its first fragment: nothing of it is buffered.
                self.drop_partial();
                self.skipping = Some((h.tag, h.seq));
                return Err(e);
            }
        }
        let pushed = self.reassembler.push(&h, body).inspect_err(|_| {
            if h.flags & FIRST != 0 && !self.reassembler.in_progress() {
                // Refused by its first fragment (too large, no length): the rest of it is
                // dropped quietly.
                self.skipping = Some((h.tag, h.seq));
            }
        })?;
        match pushed {
            None => Ok(None),
            Some((tag, joined)) => {
                let ty = self.check_tag(tag)?;
                Ok(Some(self.envelope(
                    tag,
                    ty,
                    h.seq,
                    FrameBytes::Owned(joined),
                    0,
                )))
            }
        }
    }

    /// The messages of a packed frame, in order, each with its number: its envelope (sharing
    /// the frame's buffer), or the error of its own that stands in its place (a tag not
    /// registered, a nudge's tag where a message belongs).
    pub fn unpack<'a>(
        &'a self,
        p: &'a Packed,
    ) -> impl Iterator<Item = (u32, Result<Envelope>)> + 'a {
        let body = &p.frame[HEADER_LEN..];
        // Checked whole when the frame was taken.
        let entries = frame::unpack(p.seq, p.count, body)
            .ok()
            .into_iter()
            .flatten();
        entries.map(move |(seq, tag, range)| {
            let ty = match tag {
                NUDGE_TAG => Err(Error::BadFrame(frame::FrameError::Packed {
                    seq: p.seq,
                    count: p.count,
                })),
                _ => self.check_tag(tag),
            };
            let at = HEADER_LEN + range.start..HEADER_LEN + range.end;
            let env =
                ty.map(|ty| self.envelope(tag, ty, seq, FrameBytes::Packed(p.frame.slice(at)), 0));
            (seq, env)
        })
    }

    /// Fragmented messages dropped because a complete message, or the first fragment of a
    /// refused one, arrived before their last fragment.
    pub fn lost_partials(&self) -> u64 {
        self.lost_partials
    }
}
