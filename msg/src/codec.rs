//! Encoding messages into frames and decoding frames into messages, without I/O.

use std::collections::HashSet;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::frame::{self, Header, Reassembler, FIRST, HEADER_LEN, LAST};
use crate::{DecodeFailure, Error, Message, Result};

/// Largest message (reassembled body) accepted by default: 16 MiB.
pub const DEFAULT_MAX_MESSAGE: usize = 16 << 20;

/// bincode's standard configuration with an allocation limit, so that a forged length prefix
/// cannot make the decoder allocate more than a message may hold.
fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DEFAULT_MAX_MESSAGE>()
}

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
    if body.len() > max_message {
        return Err(Error::TooLarge {
            len: body.len(),
            max: max_message,
        });
    }
    let chunk = frame_max.saturating_sub(HEADER_LEN).max(1);
    let count = body.len().div_ceil(chunk).max(1);
    if count > usize::from(u16::MAX) + 1 {
        return Err(Error::TooLarge {
            len: body.len(),
            max: chunk * (usize::from(u16::MAX) + 1),
        });
    }
    let mut frames = Vec::with_capacity(count);
    for i in 0..count {
        let part = &body[(i * chunk).min(body.len())..((i + 1) * chunk).min(body.len())];
        let mut flags = 0;
        if i == 0 {
            flags |= FIRST;
        }
        if i + 1 == count {
            flags |= LAST;
        }
        frames.push(frame::build(flags, M::TAG, seq, i as u16, part));
    }
    Ok(frames)
}

/// Decodes a message body into an owned value.
pub fn decode_body<M: Message + DeserializeOwned>(tag: u32, body: &[u8]) -> Result<M> {
    decode_body_borrowed(tag, body)
}

/// Decodes a message body into a value that may borrow from it (no copy of byte strings).
pub fn decode_body_borrowed<'de, M: Message + Deserialize<'de>>(
    tag: u32,
    body: &'de [u8],
) -> Result<M> {
    if tag != M::TAG {
        return Err(Error::WrongType {
            expected: M::TAG,
            got: tag,
        });
    }
    let (m, used) =
        bincode::serde::borrow_decode_from_slice(body, config()).map_err(|e| Error::Decode {
            tag,
            source: DecodeFailure::Bincode(e),
        })?;
    if used != body.len() {
        return Err(Error::Decode {
            tag,
            source: DecodeFailure::Trailing(body.len() - used),
        });
    }
    Ok(m)
}

/// The bytes of a received frame: a zero-copy transport buffer or owned bytes.
#[derive(Debug)]
pub enum FrameBytes {
    /// A receive buffer of the transport, returned to its pool when dropped.
    Received(transport::Received),
    /// Owned bytes.
    Owned(Vec<u8>),
}

impl FrameBytes {
    fn bytes(&self) -> &[u8] {
        match self {
            FrameBytes::Received(r) => r,
            FrameBytes::Owned(v) => v,
        }
    }
}

/// A received message: its tag and body, still encoded. Single-frame messages keep their
/// transport buffer (zero-copy) until dropped.
#[derive(Debug)]
pub struct Envelope {
    tag: u32,
    seq: u32,
    frame: FrameBytes,
    offset: usize,
}

impl Envelope {
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

    /// Decodes the body as an `M`.
    pub fn decode<M: Message + DeserializeOwned>(&self) -> Result<M> {
        decode_body(self.tag, self.body())
    }

    /// Decodes the body as an `M` that borrows from the envelope: byte strings and strings are
    /// read in place, from the receive buffer of a single-frame message.
    pub fn decode_borrowed<'a, M: Message + Deserialize<'a>>(&'a self) -> Result<M> {
        decode_body_borrowed(self.tag, self.body())
    }
}

/// Turns received frames into messages: checks each frame, reassembles fragments, filters
/// tags. Bad frames give a typed error and are dropped; the decoder carries on with the next.
#[derive(Debug)]
pub struct Decoder {
    reassembler: Reassembler,
    known: HashSet<u32>,
    lost_partials: u64,
}

impl Decoder {
    /// A decoder for messages of at most `max_message` bytes, accepting every tag until
    /// [`Decoder::register`] is called.
    pub fn new(max_message: usize) -> Self {
        Self {
            reassembler: Reassembler::new(max_message),
            known: HashSet::new(),
            lost_partials: 0,
        }
    }

    /// Accepts `M` (and, from now on, only registered types).
    pub fn register<M: Message>(&mut self) {
        self.known.insert(M::TAG);
    }

    fn check_tag(&self, tag: u32) -> Result<()> {
        if !self.known.is_empty() && !self.known.contains(&tag) {
            return Err(Error::UnknownTag(tag));
        }
        Ok(())
    }

    /// Takes one frame. `Ok(None)`: a fragment was stored, or the frame carried no message.
    pub fn push(&mut self, frame: FrameBytes) -> Result<Option<Envelope>> {
        let (h, body) = frame::parse(frame.bytes())?;
        if h.flags == FIRST | LAST {
            if self.reassembler.in_progress() {
                // The fragmented message before this one lost its tail. Drop it, keep this one.
                self.reassembler = Reassembler::new(self.reassembler.max_size());
                self.lost_partials += 1;
            }
            if h.tag == NUDGE_TAG {
                return Ok(None);
            }
            self.check_tag(h.tag)?;
            return Ok(Some(Envelope {
                tag: h.tag,
                seq: h.seq,
                frame,
                offset: HEADER_LEN,
            }));
        }
        match self.reassembler.push(&h, body)? {
            None => Ok(None),
            Some((tag, joined)) => {
                self.check_tag(tag)?;
                Ok(Some(Envelope {
                    tag,
                    seq: h.seq,
                    frame: FrameBytes::Owned(joined),
                    offset: 0,
                }))
            }
        }
    }

    /// Fragmented messages dropped because a complete message arrived before their last
    /// fragment.
    pub fn lost_partials(&self) -> u64 {
        self.lost_partials
    }
}
