//! The sending side of one peer: sequence, solicitation, encoding or fragmenting, rendezvous
//! exposures and their acknowledgements.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{SessionConfig, SessionStats};
use crate::bulk::Piece;
use crate::codec::{self, NUDGE_TAG};
use crate::frame::{self, ASK, FIRST, HEADER_LEN, LAST, PACK, PACK_ENTRY};
use crate::policy::SolicitPolicy;
use crate::rendezvous::Lent;
use crate::trace::trace_event;
use crate::{Message, Result};

use super::*;

/// Encoded pieces that travel inside a descriptor at most (larger ones are exposed).
pub(super) const INLINE_PIECE: usize = 1024;

/// The pieces of a message, joined: its body.
pub(super) fn concat(pieces: Vec<Piece>) -> Vec<u8> {
    match <[Piece; 1]>::try_from(pieces) {
        Ok([Piece::Encoded(v)]) => v,
        Ok([p]) => p.bytes().to_vec(),
        Err(pieces) => {
            let mut all = Vec::with_capacity(pieces.iter().map(Piece::len).sum());
            for p in &pieces {
                all.extend_from_slice(p.bytes());
            }
            all
        }
    }
}

/// The sending side of one connection: the next sequence number, the solicitation policy,
/// and the send counters of [`SessionStats`].
#[derive(Debug)]
pub(crate) struct SendSide {
    pub(super) policy: SolicitPolicy,
    pub(super) seq: u32,
    pub(super) max_message: usize,
    pub(super) stats: SessionStats,
    /// Frames of a fragmented message committed by a non-blocking send (its sequence number
    /// taken, its first frame gone) that are still to go, each with its solicitation, and
    /// rendezvous acknowledgements. They go before anything else, whoever drives the link
    /// next.
    pub(super) outgoing: VecDeque<(Vec<u8>, bool)>,
    /// Encoded messages at least this long go by rendezvous (`None`: never).
    pub(super) rendezvous_threshold: Option<usize>,
    /// Messages the peer may be reading.
    pub(super) lent: Lent,
    /// What the peer's application has taken of our messages, and copies of the rest.
    pub(super) record: Record,
    /// The count of the peer's messages our application took, for our frames to carry.
    pub(super) taken_to_tell: u32,
    /// The largest message the peer reads from us, as its handshake announced: larger ones
    /// go in fragments.
    pub(super) peer_max_read: usize,
    /// Whole messages committed by [`SendSide::commit_as`] that could not go at once, encoded:
    /// they go after `outgoing`, in order, before anything sent later.
    pub(super) committed: VecDeque<Committed>,
    /// A committed message is being sent: waits within its send (for room) send frames
    /// only, so that nothing committed after it overtakes it.
    pub(super) draining: bool,
    /// Where a packed frame is put together ([`SendSide::send_batch`]), kept between batches.
    pack_buf: Vec<u8>,
    /// Whether the application was told its messages go in fragments.
    told_fragments: bool,
    /// Where a single frame's body is copied for the record (reused: no allocation).
    scratch: Vec<u8>,
}

/// The copy of a message that went, for the record ([`SendSide::finish`]).
pub(super) enum Copied {
    /// None is kept.
    No,
    /// This body.
    Owned(Vec<u8>),
    /// The body in the sender's scratch buffer.
    Scratch,
}

/// Where a sending side's numbers stood before a send: afterwards, whether the message sent
/// went and under which number (a call's request learns it so).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Numbering {
    next: u32,
    /// No committed message waited: anything that moved the numbers is the send's own.
    clear: bool,
}

impl Numbering {
    pub(crate) fn before(send: &SendSide) -> Self {
        Self {
            next: send.next_seq(),
            clear: send.committed.is_empty(),
        }
    }

    /// The number the message went under, if it went (sent, or sent before an error of what
    /// followed it): the last to go, since committed messages go before a send's own and
    /// nothing after it.
    pub(crate) fn went(self, send: &SendSide, sent: &Result<bool>) -> Option<u32> {
        let next = send.next_seq();
        let moved = next != self.next;
        (moved && (self.clear || matches!(sent, Ok(true)))).then(|| next.wrapping_sub(1))
    }

    /// Whether nothing was numbered since: neither the message nor a committed one before it
    /// went, so a send that failed sent nothing of its own.
    pub(crate) fn nothing_went(&self, send: &SendSide) -> bool {
        send.next_seq() == self.next
    }
}

/// A message offered to a packed frame ([`pack`]): what to encode, and whether it asks to be
/// solicited.
pub(crate) trait Packable {
    fn offer(&self) -> (&dyn Encode, bool);
}

/// A batch's message: its solicitation is the batch's (its last).
impl<M: Message> Packable for &M {
    fn offer(&self) -> (&dyn Encode, bool) {
        (*self, false)
    }
}

/// A message that queued up, with its own solicitation.
impl Packable for (&dyn Encode, bool) {
    fn offer(&self) -> (&dyn Encode, bool) {
        *self
    }
}

/// Packs the next of `waiting`'s messages into `buf` behind a header's room, as many as fit
/// and at most `room`, each taken from `waiting` once it is in: the one left starts the next
/// frame, or goes alone (fragmented, or to fail alone). Returns the end of what is packed,
/// how many, and whether any asked to be solicited.
fn pack<I>(
    buf: &mut [u8],
    room: usize,
    waiting: &mut std::iter::Peekable<I>,
) -> (usize, usize, bool)
where
    I: Iterator,
    I::Item: Packable,
{
    let (mut end, mut count, mut solicited) = (HEADER_LEN, 0, false);
    while count < room {
        let Some(next) = waiting.peek() else { break };
        let (m, wants) = next.offer();
        match m.encode_entry(&mut buf[end..]) {
            Ok(Some(len)) => {
                end += len;
                count += 1;
                solicited |= wants;
                waiting.next();
            }
            Ok(None) | Err(_) => break,
        }
    }
    (end, count, solicited)
}

/// How long a send may wait for room.
#[derive(Debug, Clone, Copy)]
enum Patience {
    Not,
    Until(Instant),
    Forever,
}

impl Patience {
    /// A wait of at most `timeout` (`None`: as long as it takes).
    fn from_timeout(timeout: Option<Duration>) -> Self {
        match timeout {
            Some(t) if t.is_zero() => Patience::Not,
            // A timeout too long to add to the clock is no deadline at all.
            Some(t) => Instant::now()
                .checked_add(t)
                .map_or(Patience::Forever, Patience::Until),
            None => Patience::Forever,
        }
    }

    /// What is left of it, as a timeout.
    fn left(self) -> Option<Duration> {
        match self {
            Patience::Not => Some(Duration::ZERO),
            Patience::Until(d) => Some(d.saturating_duration_since(Instant::now())),
            Patience::Forever => None,
        }
    }

    /// Its deadline, for the waits that take one.
    fn deadline(self) -> Option<Instant> {
        match self {
            Patience::Not => Some(Instant::now()),
            Patience::Until(d) => Some(d),
            Patience::Forever => None,
        }
    }
}

/// What a send needs of a message: its tag and its encodings. A typed message, or one
/// encoded already ([`Committed`]).
pub(crate) trait Encode {
    /// The type's tag.
    fn tag(&self) -> u32;
    /// It whole as one frame written into `out` (header included): the frame's length, or
    /// `None` if it does not fit.
    fn encode_single(&self, seq: u32, out: &mut [u8]) -> Result<Option<usize>>;
    /// Its pieces, [`crate::Bulk`] payloads by reference.
    fn encode_pieces(&self) -> Result<Vec<Piece>>;
    /// It as one entry of a packed frame ([`frame::PACK_ENTRY`] bytes of head, then its body)
    /// written into `out`: the entry's length, or `None` if it does not fit.
    fn encode_entry(&self, out: &mut [u8]) -> Result<Option<usize>>;
}

impl<M: Message> Encode for M {
    fn tag(&self) -> u32 {
        M::TAG
    }
    fn encode_single(&self, seq: u32, out: &mut [u8]) -> Result<Option<usize>> {
        codec::encode_single(self, seq, out)
    }
    fn encode_pieces(&self) -> Result<Vec<Piece>> {
        codec::encode_pieces(self)
    }
    fn encode_entry(&self, out: &mut [u8]) -> Result<Option<usize>> {
        codec::encode_entry(self, out)
    }
}

/// A message committed to go, encoded once (payloads by reference), with its solicitation.
#[derive(Debug)]
pub(crate) struct Committed {
    tag: u32,
    pieces: Vec<Piece>,
    total: usize,
    solicited: bool,
}

impl Committed {
    /// Its body, for the record of messages not confirmed.
    fn body(&self) -> Vec<u8> {
        concat(self.pieces.clone())
    }
}

impl Encode for Committed {
    fn tag(&self) -> u32 {
        self.tag
    }
    fn encode_single(&self, seq: u32, out: &mut [u8]) -> Result<Option<usize>> {
        let len = HEADER_LEN + self.total;
        if out.len() < len {
            return Ok(None);
        }
        frame::Header {
            flags: FIRST | LAST,
            tag: self.tag,
            seq,
            frag: 0,
            len: self.total as u32,
        }
        .write(&mut out[..HEADER_LEN]);
        let mut at = HEADER_LEN;
        for p in &self.pieces {
            out[at..at + p.len()].copy_from_slice(p.bytes());
            at += p.len();
        }
        Ok(Some(len))
    }
    fn encode_pieces(&self) -> Result<Vec<Piece>> {
        Ok(self.pieces.clone())
    }
    fn encode_entry(&self, out: &mut [u8]) -> Result<Option<usize>> {
        let len = PACK_ENTRY + self.total;
        if out.len() < len {
            return Ok(None);
        }
        frame::write_entry(out, self.tag, self.total as u32);
        let mut at = PACK_ENTRY;
        for p in &self.pieces {
            out[at..at + p.len()].copy_from_slice(p.bytes());
            at += p.len();
        }
        Ok(Some(len))
    }
}

impl SendSide {
    /// The sender for a peer announcing `peer_depth` receive buffers (its credit window),
    /// within `config`'s bounds.
    pub(crate) fn new(config: &SessionConfig, peer_depth: u32) -> Self {
        let run = config.max_unsolicited_run.unwrap_or(peer_depth / 4);
        Self {
            policy: SolicitPolicy::new(run, config.max_unsolicited_bytes)
                .with_max_delay(config.max_unsolicited_delay),
            seq: 0,
            max_message: config.max_message,
            stats: SessionStats::default(),
            outgoing: VecDeque::new(),
            rendezvous_threshold: config.rendezvous_threshold,
            lent: Lent::new(config.max_rendezvous_bytes),
            record: Record::new(config.keep_unconfirmed, config.max_message),
            taken_to_tell: 0,
            peer_max_read: usize::MAX,
            committed: VecDeque::new(),
            draining: false,
            pack_buf: Vec::new(),
            told_fragments: false,
            scratch: Vec::new(),
        }
    }

    /// This sender for a peer that reads messages of at most `max_read` bytes from us (its
    /// handshake said so): it sends larger ones in fragments, never a descriptor the peer
    /// would refuse.
    pub(crate) fn with_peer_max_read(mut self, max_read: u32) -> Self {
        self.peer_max_read = max_read as usize;
        self
    }

    /// What the peer's application has taken of our messages (with what the peer's latest
    /// grant said, `note`, if it says more).
    pub(crate) fn delivery(&self, note: Option<u32>) -> Delivery {
        let d = self.record.delivery();
        note.map_or(d, |n| d.learned_in_full(n))
    }

    /// The peer's count of our messages taken, as its latest credit grant (or its close)
    /// carried it, in full: the same note read again later changes nothing.
    pub(crate) fn learn_note(&mut self, note: Option<u32>) {
        if let Some(n) = note {
            self.record.learn_in_full(n);
        }
    }

    /// Whether copies of unconfirmed messages are kept.
    pub(crate) fn keeps_copies(&self) -> bool {
        self.record.keeps()
    }

    /// The copies of the messages the peer's application has not taken, in order.
    /// Messages committed but never sent (the connection ended first) follow them.
    pub(crate) fn take_unconfirmed(&mut self) -> Vec<crate::Envelope> {
        let mut all = self.record.take_unconfirmed();
        if self.record.keeps() {
            let (seq, max) = (self.seq, self.max_message);
            all.extend(self.committed.drain(..).enumerate().map(|(i, c)| {
                crate::Envelope::returned(c.tag, seq.wrapping_add(i as u32), c.body(), max)
            }));
        }
        all
    }

    /// Resumes on a new connection, given the peer's count `taken` of our messages (what its
    /// resume said): the messages it has not taken go again first, in order and under their
    /// own numbers, from their copies, queued as committed messages are (the last solicited,
    /// so that a peer asleep wakes for them); messages committed and not sent yet follow.
    /// Whatever belonged to the old connection is dropped: frames of a fragmented message
    /// under way (the message goes again whole), acknowledgements of reads (the peer's
    /// exposures went with its queue pair), our exposures. Returns how many go again.
    pub(crate) fn rewind(&mut self, taken: u32) -> Result<usize> {
        let copies = self
            .record
            .rewind(taken)
            .map_err(crate::Error::CannotResume)?;
        self.seq = self.record.delivery().sent as u32;
        self.outgoing.clear();
        self.lent = Lent::new(self.lent.max());
        self.draining = false;
        let again = copies.len();
        let last = again.wrapping_sub(1);
        for (i, (tag, body)) in copies.into_iter().enumerate().rev() {
            self.committed.push_front(Committed {
                tag,
                total: body.len(),
                pieces: vec![Piece::Encoded(body)],
                solicited: i == last,
            });
        }
        self.stats.resumed_messages += again as u64;
        self.stats.resumes += 1;
        Ok(again)
    }

    /// The peer's count of our messages taken, as one of its frames carried it.
    pub(crate) fn learn_taken(&mut self, taken: u16) {
        self.record.learn(taken);
    }

    /// Our count of the peer's messages taken, for the frames we send from now on.
    pub(crate) fn tell_taken(&mut self, taken: u32) {
        self.taken_to_tell = taken;
    }

    /// Answers a request for our record: a payload-less frame, solicited (the peer may be
    /// asleep waiting for it), carrying the count like every frame.
    pub(crate) fn queue_answer(&mut self) {
        let f = frame::build(FIRST | LAST, NUDGE_TAG, self.seq, 0, &[]);
        self.outgoing.push_back((f, true));
    }

    /// Asks the peer to say once its application took everything sent before `through`.
    fn queue_ask(&mut self, through: u32) {
        let f = frame::build(FIRST | LAST | ASK, 0, through, 0, &[]);
        self.outgoing.push_back((f, true));
    }

    /// Asks the peer about everything sent so far (a close that waits for the record).
    pub(crate) fn ask_all(&mut self) {
        if let Some(through) = self.record.ask_all() {
            self.queue_ask(through);
        }
    }

    /// Waits, taking in what arrives, until the window of unconfirmed messages has room
    /// ([`crate::frame::ASK`] asked for it), or `deadline` passes
    /// ([`rdmsg_transport::Error::Timeout`] of `timeout`).
    fn wait_for_record(
        &mut self,
        link: &mut impl PeerIo,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Result<()> {
        while !self.record.has_room() {
            if let Some(through) = self.record.ask_due() {
                self.queue_ask(through);
            }
            self.send_committed(link)?;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) || !self.wait_and_take_acks(link, left)? {
                let waited = timeout.unwrap_or_default();
                return Err(rdmsg_transport::Error::timeout(
                    "sending",
                    crate::error::WAIT_RECORD,
                    waited,
                )
                .into());
            }
        }
        Ok(())
    }

    /// A message too large for one frame, encoded once into pieces ([`Bulk`](crate::Bulk)
    /// payloads by reference), and its length, within `max_message`.
    pub(super) fn encode_large<E: Encode + ?Sized>(&self, m: &E) -> Result<(Vec<Piece>, usize)> {
        let pieces = m.encode_pieces()?;
        let total: usize = pieces.iter().map(Piece::len).sum();
        if total > self.max_message {
            return Err(crate::Error::TooLarge {
                len: total,
                max: self.max_message,
            });
        }
        Ok((pieces, total))
    }

    /// Whether a message of `total` encoded bytes goes by rendezvous.
    pub(super) fn by_rendezvous(&self, total: usize) -> bool {
        self.rendezvous_threshold.is_some_and(|t| total >= t)
            && total <= self.lent.max().min(self.peer_max_read)
            && u32::try_from(total).is_ok()
    }

    /// Sends `m`, solicited as asked or as the policy forces: straight into a registered send
    /// buffer when it fits, else fragmented, the last fragment alone carrying the solicitation.
    pub(crate) fn send_as<M: Message>(
        &mut self,
        link: &mut impl PeerIo,
        m: &M,
        solicited: bool,
    ) -> Result<()> {
        self.send_within(link, m, solicited, None)
    }

    /// [`SendSide::send_as`], its first frame waiting at most `first_timeout` for a credit and a
    /// send slot ([`rdmsg_transport::Error::Timeout`]: nothing sent); the other frames of a
    /// fragmented message wait as long as it takes, so that none is left half sent.
    pub(crate) fn send_within<E: Encode + ?Sized>(
        &mut self,
        link: &mut impl PeerIo,
        m: &E,
        solicited: bool,
        first_timeout: Option<Duration>,
    ) -> Result<()> {
        // Frames committed earlier go first; until they have, nothing of `m` is sent.
        if !self.drain(link, first_timeout)? {
            let waited = first_timeout.unwrap_or_default();
            return Err(rdmsg_transport::Error::timeout(
                "sending",
                crate::error::WAIT_COMMITTED,
                waited,
            )
            .into());
        }
        let tag = m.tag();
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = first_timeout.and_then(|t| Instant::now().checked_add(t));
        self.wait_for_record(link, deadline, first_timeout)?;
        let seq = self.seq;
        let want = self.policy.decide(solicited);
        let mut outcome: Result<Option<usize>> = Ok(None);
        let (keep, taken) = (self.record.keeps(), self.taken_to_tell);
        let scratch = &mut self.scratch;
        let sent = link.send_with(want, first_timeout, |buf| {
            outcome = m.encode_single(seq, buf);
            let n = outcome.as_ref().ok().copied().flatten()?;
            frame::stamp_taken(&mut buf[..n], taken);
            if keep {
                scratch.clear();
                scratch.extend_from_slice(&buf[HEADER_LEN..n]);
            }
            Some(n)
        })?;
        let copy = if keep { Copied::Scratch } else { Copied::No };
        let single = outcome?;
        if sent {
            self.sent_single(single);
            self.finish(want, solicited, single.unwrap_or(0), 1, tag, copy);
            self.send_committed(link)?;
            return Ok(());
        }
        let (pieces, total) = self.encode_large(m)?;
        let frame_max = link.max_message()?;
        if self.by_rendezvous(total) && Self::descriptor_fits(pieces.len(), frame_max) {
            let waited = first_timeout.unwrap_or_default();
            let timed_out =
                || rdmsg_transport::Error::timeout("sending", crate::error::WAIT_LENT, waited);
            self.stats.rendezvous_waits += u64::from(!self.lent.has_room(total));
            while !self.lent.has_room(total) {
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                if left == Some(Duration::ZERO) || !self.wait_and_take_acks(link, left)? {
                    return Err(timed_out().into());
                }
            }
            return match self.send_rendezvous(
                link,
                tag,
                seq,
                pieces,
                total,
                solicited,
                first_timeout,
            )? {
                true => Ok(()),
                false => Err(timed_out().into()),
            };
        }
        let body = concat(pieces);
        let mut frames = codec::fragment(&body, tag, seq, frame_max, self.max_message)?;
        let body_len = body.len() as u64;
        let copy = match keep {
            true => Copied::Owned(body),
            false => Copied::No,
        };
        let count = frames.len();
        let mut bytes = 0;
        for (i, f) in frames.iter_mut().enumerate() {
            let last = i + 1 == count;
            frame::stamp_taken(f, self.taken_to_tell);
            // Without a timeout a frame always goes (or the link failed).
            link.send(f, last && want, None)?;
            bytes += f.len();
        }
        self.fragmented(frame_max, body_len);
        self.stats.bytes_sent += body_len;
        self.finish(want, solicited, bytes, count as u64, tag, copy);
        self.send_committed(link)?;
        Ok(())
    }

    /// The number the next message will carry: a send that moved it sent (or committed)
    /// its message, whatever error followed.
    pub(crate) fn next_seq(&self) -> u32 {
        self.seq
    }

    /// Sends `m` if it can go without waiting: `Ok(false)` (nothing of it sent) if the peer
    /// has no credit, no send slot is free, or frames committed earlier are still waiting. A
    /// message needing fragments is committed once its first frame is sent: the rest are
    /// queued and go out as credits allow, on any later call that drives the link
    /// ([`SendSide::send_committed`]), before anything else.
    pub(crate) fn try_send_as<E: Encode + ?Sized>(
        &mut self,
        link: &mut impl PeerIo,
        m: &E,
        solicited: bool,
    ) -> Result<bool> {
        if !self.send_committed(link)? {
            return Ok(false);
        }
        if !self.try_send_now(link, m, solicited, Patience::Not)? {
            return Ok(false);
        }
        // It went (its first frame at least): an error of what follows it recurs on the next
        // call, and the caller must not take the message for unsent.
        let _ = self.send_committed(link);
        Ok(true)
    }

    /// Commits `m`: sends it now if it can go ([`SendSide::try_send_as`]), else encodes it
    /// and queues it to go, in order, before anything sent later, as credits come (any
    /// later call that drives the link sends it). Only an error (too large, not encodable,
    /// the link failed) leaves it unsent, and nothing of it committed.
    pub(crate) fn commit_as<E: Encode + ?Sized>(
        &mut self,
        link: &mut impl PeerIo,
        m: &E,
        solicited: bool,
    ) -> Result<()> {
        if self.send_committed(link)? {
            let before = self.seq;
            match self.try_send_now(link, m, solicited, Patience::Not) {
                Ok(true) => {
                    // It went: an error of what follows it recurs on the next call.
                    let _ = self.send_committed(link);
                    return Ok(());
                }
                Ok(false) => {}
                // It went, then the link failed: that recurs on the next call.
                Err(_) if self.seq != before => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        let (pieces, total) = self.encode_large(m)?;
        self.committed.push_back(Committed {
            tag: m.tag(),
            pieces,
            total,
            solicited,
        });
        Ok(())
    }

    /// Sends `m` if it can go within `patience`, committed frames aside (the caller sent
    /// them): `Ok(false)`, nothing of it sent, if no room came. Its first frame, or its
    /// descriptor, is what waits; a fragmented message's other frames are queued in
    /// `outgoing`, which goes first whoever drives the link next.
    fn try_send_now<E: Encode + ?Sized>(
        &mut self,
        link: &mut impl PeerIo,
        m: &E,
        solicited: bool,
        patience: Patience,
    ) -> Result<bool> {
        let tag = m.tag();
        if !self.record.has_room() {
            if matches!(patience, Patience::Not) {
                // The peer is asked for its record (once): its answer, solicited, wakes us.
                if let Some(through) = self.record.ask_due() {
                    self.queue_ask(through);
                }
                self.drain_frames(link, Patience::Not)?;
                return Ok(false);
            }
            match self.wait_for_record(link, patience.deadline(), patience.left()) {
                Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => {
                    return Ok(false)
                }
                other => other?,
            }
        }
        let seq = self.seq;
        let want = self.policy.decide(solicited);
        let mut outcome: Result<Option<usize>> = Ok(None);
        let mut asked = false;
        let (keep, taken) = (self.record.keeps(), self.taken_to_tell);
        let scratch = &mut self.scratch;
        let sent = match link.send_with(want, patience.left(), |buf| {
            asked = true;
            outcome = m.encode_single(seq, buf);
            let n = outcome.as_ref().ok().copied().flatten()?;
            frame::stamp_taken(&mut buf[..n], taken);
            if keep {
                scratch.clear();
                scratch.extend_from_slice(&buf[HEADER_LEN..n]);
            }
            Some(n)
        }) {
            Ok(sent) => sent,
            Err(rdmsg_transport::Error::Timeout(_)) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let single = outcome?;
        if sent {
            self.sent_single(single);
            let copy = if keep { Copied::Scratch } else { Copied::No };
            self.finish(want, solicited, single.unwrap_or(0), 1, tag, copy);
            return Ok(true);
        }
        if !asked {
            return Ok(false);
        }
        let (pieces, total) = self.encode_large(m)?;
        let frame_max = link.max_message()?;
        if self.by_rendezvous(total) && Self::descriptor_fits(pieces.len(), frame_max) {
            while !self.lent.has_room(total) {
                // Acknowledgements make room; nothing committed goes meanwhile.
                let left = patience.left();
                if left == Some(Duration::ZERO) || !self.wait_and_take_acks(link, left)? {
                    return Ok(false);
                }
            }
            let left = patience.left();
            return match self.send_rendezvous(link, tag, seq, pieces, total, solicited, left) {
                Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => Ok(false),
                other => other,
            };
        }
        let body = concat(pieces);
        let frames = codec::fragment(&body, tag, seq, frame_max, self.max_message)?;
        let body_len = body.len() as u64;
        let copy = match keep {
            true => Copied::Owned(body),
            false => Copied::No,
        };
        let count = frames.len();
        let mut frames = frames.into_iter().enumerate();
        let (_, mut first) = frames.next().expect("a message has a first frame");
        frame::stamp_taken(&mut first, taken);
        if !link.send(&first, count == 1 && want, patience.left())? {
            // The credit seen a moment ago is still there (only we spend it): a send slot.
            return Ok(false);
        }
        let bytes: usize = first.len();
        let rest: Vec<(Vec<u8>, bool)> = frames.map(|(i, f)| (f, i + 1 == count && want)).collect();
        let bytes = bytes + rest.iter().map(|(f, _)| f.len()).sum::<usize>();
        self.outgoing.extend(rest);
        self.fragmented(frame_max, body_len);
        self.stats.bytes_sent += body_len;
        self.finish(want, solicited, bytes, count as u64, tag, copy);
        Ok(true)
    }

    /// Sends committed frames that can go without waiting; whether none is left.
    pub(crate) fn send_committed(&mut self, link: &mut impl PeerIo) -> Result<bool> {
        self.drain(link, Some(Duration::ZERO))
    }

    /// Messages committed and not sent yet (a fragmented one whose first frame went
    /// excluded: it went).
    pub(crate) fn committed_waiting(&self) -> usize {
        self.committed.len()
    }

    /// Whether the window of messages not yet confirmed has room for one more.
    pub(crate) fn has_room(&self) -> bool {
        self.record.has_room()
    }

    /// Frames and messages committed but not sent yet.
    pub(crate) fn queued_frames(&self) -> usize {
        self.outgoing.len() + self.committed.len()
    }

    /// With [`crate::SessionConfig::max_unsolicited_delay`], when what went unsolicited must be
    /// flushed at the latest.
    pub(crate) fn flush_deadline(&self) -> Option<Instant> {
        self.policy.deadline()
    }

    /// Whether a session about to wait should flush now: something went unsolicited, and
    /// either no delay is allowed or it has run out by `now` (the clock is read only if a
    /// delay runs and the caller had no time).
    pub(crate) fn flush_due(&self, now: Option<Instant>) -> bool {
        self.policy.pending()
            && match self.flush_deadline() {
                None => self.policy.max_delay().is_none(),
                Some(d) => now.unwrap_or_else(Instant::now) >= d,
            }
    }

    /// Whether unsolicited sends may wait up to a bound ([`crate::SessionConfig::max_unsolicited_delay`]).
    pub(crate) fn delay_allowed(&self) -> bool {
        self.policy.max_delay().is_some()
    }

    /// A message of `len` encoded bytes went in fragments of `frame_max`-byte frames: counted,
    /// and once they are a good share of what goes (a quarter of at least 64 messages), the
    /// `tracing` feature says what to raise, once per connection.
    fn fragmented(&mut self, frame_max: usize, len: u64) {
        let s = &mut self.stats;
        s.fragmented += 1;
        if !self.told_fragments && s.fragmented >= 64 && s.fragmented * 4 >= s.sent {
            self.told_fragments = true;
            trace_event!(
                WARN,
                fragmented = s.fragmented,
                sent = s.sent,
                frame = frame_max,
                bytes = len,
                "messages go in fragments: raise the receive buffers on both sides above the \
                 messages' encoded size (Config::buf_size; a hub's HubConfig::conn and its pool), \
                 or send them by rendezvous (SessionConfig::rendezvous_threshold)"
            );
        }
        #[cfg(not(feature = "tracing"))]
        let _ = (frame_max, len, s);
    }

    /// A message went whole in one frame of `frame_len` bytes: its body is counted.
    fn sent_single(&mut self, frame_len: Option<usize>) {
        let body = frame_len.map_or(0, |n| n.saturating_sub(HEADER_LEN));
        self.stats.bytes_sent += body as u64;
    }

    /// A message of type `tag` went (`copy`: its encoded body, if the record keeps copies).
    pub(super) fn finish(
        &mut self,
        solicited: bool,
        requested: bool,
        bytes: usize,
        frames: u64,
        tag: u32,
        copy: Copied,
    ) {
        let copy = match &copy {
            Copied::No => None,
            Copied::Owned(body) => Some(&body[..]),
            Copied::Scratch => Some(&self.scratch[..]),
        };
        self.record.sent(tag, copy);
        if let Some(through) = self.record.ask_due() {
            self.queue_ask(through);
        }
        self.seq = self.seq.wrapping_add(1);
        self.policy.record(solicited, bytes);
        self.stats.sent += 1;
        self.stats.frames_sent += frames;
        self.stats.sent_solicited += u64::from(solicited);
        self.stats.policy_solicited += u64::from(solicited && !requested);
    }

    /// Sends every message unsolicited but the last, which is solicited, packed: as many
    /// whole messages to a frame as fit one of the peer's receive buffers
    /// ([`frame::PACK`]), so that a batch of small messages spends one buffer and one credit
    /// of the peer's per frame, not per message. A frame is solicited if it holds the last
    /// (or the policy says so), so nobody wakes later than one frame per message would wake
    /// it. A message too large to share a frame goes alone, as [`SendSide::send_as`] sends it.
    pub(crate) fn send_batch<'a, M: Message + 'a>(
        &mut self,
        link: &mut impl PeerIo,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> Result<usize> {
        let mut iter = batch.into_iter().peekable();
        let mut n = 0;
        while iter.peek().is_some() {
            let packed = self.send_packed(link, &mut iter)?;
            n += packed;
            if packed == 0 {
                let m = iter.next().expect("peeked");
                self.send_as(link, m, iter.peek().is_none())?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Sends as many of `batch`'s next messages as fit one frame, in one frame: how many went
    /// (none when the next one does not fit a frame whole, or does not encode: it goes
    /// alone).
    fn send_packed<'a, M: Message + 'a>(
        &mut self,
        link: &mut impl PeerIo,
        batch: &mut std::iter::Peekable<impl Iterator<Item = &'a M>>,
    ) -> Result<usize> {
        // Committed frames go first, and the window of unconfirmed messages needs room.
        if !self.drain(link, None)? {
            let e = rdmsg_transport::Error::timeout(
                "sending",
                crate::error::WAIT_COMMITTED,
                Duration::ZERO,
            );
            return Err(e.into());
        }
        self.wait_for_record(link, None, None)?;
        let mut buf = self.take_pack_buf(link)?;
        let room = self.pack_room();
        let (end, count, _) = pack(&mut buf, room, batch);
        let last = batch.peek().is_none();
        let sent = self.send_pack(link, &mut buf, end, count, last, None);
        self.pack_buf = buf;
        sent.map(|_| count)
    }

    /// Sends the next of `waiting`'s messages (each with its solicitation), at least two,
    /// packed in one frame if they can go now without waiting: how many went (none: each
    /// goes alone, as one frame would not hold two, or no credit or send slot is free, or
    /// frames committed earlier still wait). For messages that queued up while the peer had
    /// no credit (an outbox, committed messages): they go as fast as credits come back.
    pub(crate) fn try_send_packed<'a>(
        &mut self,
        link: &mut impl PeerIo,
        waiting: impl Iterator<Item = (&'a dyn Encode, bool)>,
    ) -> Result<usize> {
        if link.credits() == 0 || !self.send_committed(link)? {
            return Ok(0);
        }
        let room = self.pack_room();
        if room < 2 {
            return Ok(0);
        }
        let mut buf = self.take_pack_buf(link)?;
        let (end, count, solicited) = pack(&mut buf, room, &mut waiting.peekable());
        let sent = match count {
            0 | 1 => Ok(false),
            _ => self.send_pack(link, &mut buf, end, count, solicited, Some(Duration::ZERO)),
        };
        self.pack_buf = buf;
        Ok(if sent? { count } else { 0 })
    }

    /// How many more messages one packed frame may hold: the record's room, within the 16
    /// bits that count them.
    fn pack_room(&self) -> usize {
        self.record.room().min(u64::from(u16::MAX)) as usize
    }

    /// The buffer a packed frame is put together in, one frame of the peer's long (put it
    /// back in `pack_buf` once sent).
    fn take_pack_buf(&mut self, link: &mut impl PeerIo) -> Result<Vec<u8>> {
        let frame_max = link.max_message()?;
        let mut buf = std::mem::take(&mut self.pack_buf);
        buf.resize(frame_max.max(HEADER_LEN), 0);
        Ok(buf)
    }

    /// Sends the `count` entries packed in `buf[HEADER_LEN..end]` as one frame (one alone as a
    /// frame of its own), solicited if `last` asks or the policy says so, waiting at most
    /// `timeout` for a credit and a send slot (`Ok(false)`: nothing sent), and counts each
    /// message sent: its number, its copy in the record, the counters.
    fn send_pack(
        &mut self,
        link: &mut impl PeerIo,
        buf: &mut [u8],
        end: usize,
        count: usize,
        last: bool,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        if count == 0 {
            return Ok(false);
        }
        let seq = self.seq;
        let keep = self.record.keeps();
        let want = self.policy.decide(last);
        if count == 1 {
            let tag = u32::from_be_bytes(buf[HEADER_LEN..HEADER_LEN + 4].try_into().expect("4"));
            buf.copy_within(HEADER_LEN + PACK_ENTRY..end, HEADER_LEN);
            let len = end - PACK_ENTRY;
            let header = frame::Header {
                flags: FIRST | LAST,
                tag,
                seq,
                frag: 0,
                len: (len - HEADER_LEN) as u32,
            };
            header.write(buf);
            frame::stamp_taken(&mut buf[..len], self.taken_to_tell);
            if !link.send(&buf[..len], want, timeout)? {
                return Ok(false);
            }
            if keep {
                self.scratch.clear();
                self.scratch.extend_from_slice(&buf[HEADER_LEN..len]);
            }
            let copy = if keep { Copied::Scratch } else { Copied::No };
            self.sent_single(Some(len));
            self.finish(want, last, len, 1, tag, copy);
            return Ok(true);
        }
        let header = frame::Header {
            flags: FIRST | LAST | PACK,
            tag: 0,
            seq,
            frag: count as u16,
            len: (end - HEADER_LEN) as u32,
        };
        header.write(buf);
        frame::stamp_taken(&mut buf[..end], self.taken_to_tell);
        if !link.send(&buf[..end], want, timeout)? {
            return Ok(false);
        }
        let entries = frame::unpack(seq, count as u16, &buf[HEADER_LEN..end])
            .expect("our own packed frame adds up");
        for (_, tag, body) in entries {
            self.stats.bytes_sent += body.len() as u64;
            let body = HEADER_LEN + body.start..HEADER_LEN + body.end;
            self.record.sent(tag, keep.then(|| &buf[body]));
        }
        if let Some(through) = self.record.ask_due() {
            self.queue_ask(through);
        }
        self.seq = self.seq.wrapping_add(count as u32);
        self.policy.record(want, end);
        self.stats.sent += count as u64;
        self.stats.packed += count as u64;
        self.stats.frames_sent += 1;
        self.stats.sent_solicited += u64::from(want);
        self.stats.policy_solicited += u64::from(want && !last);
        Ok(true)
    }

    /// A payload-less solicited frame if anything went unsolicited since the last solicited
    /// one.
    pub(crate) fn flush(&mut self, link: &mut impl PeerIo) -> Result<()> {
        self.flush_within(link, None).map(|_| ())
    }

    /// [`SendSide::flush`], waiting at most `timeout` for a credit: `Ok(false)` if none came
    /// (nothing sent; still pending).
    pub(crate) fn flush_within(
        &mut self,
        link: &mut impl PeerIo,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        // Committed frames go first (a flush promises everything sent so far is on its way,
        // and the nudge's number follows theirs).
        if !self.drain(link, timeout)? {
            return Ok(false);
        }
        if !self.policy.pending() {
            return Ok(true);
        }
        let mut nudge = frame::build(FIRST | LAST, NUDGE_TAG, self.seq, 0, &[]);
        frame::stamp_taken(&mut nudge, self.taken_to_tell);
        if !link.send(&nudge, true, timeout)? {
            return Ok(false);
        }
        self.policy.record(true, 0);
        Ok(true)
    }

    /// Sends every committed frame, then every committed message, in order, all within
    /// `timeout`; whether all went. A committed message that fails for a reason of its own
    /// (the connection still up) is dropped and its error returned, once: it would fail again
    /// and hold up everything behind it.
    pub(crate) fn drain(
        &mut self,
        link: &mut impl PeerIo,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        let patience = Patience::from_timeout(timeout);
        loop {
            if !self.drain_frames(link, patience)? {
                return Ok(false);
            }
            if self.draining {
                // A wait within a committed message's send: it stays first.
                return Ok(self.committed.is_empty());
            }
            if self.committed.len() >= 2 {
                let committed = std::mem::take(&mut self.committed);
                let waiting = committed.iter().map(|c| (c as &dyn Encode, c.solicited));
                let packed = self.try_send_packed(link, waiting);
                self.committed = committed;
                let packed = packed?;
                if packed > 0 {
                    self.committed.drain(..packed);
                    continue;
                }
            }
            let Some(next) = self.committed.pop_front() else {
                return Ok(true);
            };
            self.draining = true;
            let before = self.seq;
            let sent = self.try_send_now(link, &next, next.solicited, patience);
            self.draining = false;
            match sent {
                Ok(true) => {}
                // It went; what failed after it recurs on the next call.
                Err(e) if self.seq != before => return Err(e),
                Ok(false) | Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => {
                    self.committed.push_front(next);
                    return Ok(false);
                }
                Err(e) if e.is_fatal() => {
                    // The connection failed: it is among the messages not confirmed.
                    self.committed.push_front(next);
                    return Err(e);
                }
                Err(e) => {
                    self.stats.committed_dropped += 1;
                    return Err(e);
                }
            }
        }
    }

    /// Sends every committed frame within `patience`; whether all went.
    fn drain_frames(&mut self, link: &mut impl PeerIo, patience: Patience) -> Result<bool> {
        let taken = self.taken_to_tell;
        while let Some((f, solicited)) = self.outgoing.front_mut() {
            frame::stamp_taken(f, taken);
            if !link.send(f, *solicited, patience.left())? {
                return Ok(false);
            }
            self.outgoing.pop_front();
        }
        Ok(true)
    }

    /// Whether something went unsolicited since the last solicited frame.
    pub(crate) fn pending(&self) -> bool {
        self.policy.pending()
    }

    /// The receiving side is about to wait for the peer: what went to it unsolicited has not
    /// woken it, and if it sleeps solicited-only waiting for exactly that (a request whose
    /// answer we are about to wait for), both would wait for ever. So it is flushed first,
    /// waiting at most `timeout` for a send slot; `Ok(false)` if it is still pending. With no
    /// credit nothing is sent: the message that spent the peer's last credit went solicited
    /// (the transport solicits it), so the peer looks anyway.
    pub(crate) fn flush_before_wait(
        &mut self,
        link: &mut impl PeerIo,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        if !self.policy.pending() {
            return Ok(true);
        }
        if link.credits() == 0 {
            // The message that spent the peer's last credit went solicited (the transport
            // solicits it): the run is flushed, and its deadline with it.
            self.policy.record(true, 0);
            return Ok(true);
        }
        let flushed = self.flush_within(link, timeout)?;
        self.stats.wait_flushes += u64::from(flushed);
        Ok(flushed)
    }
}
