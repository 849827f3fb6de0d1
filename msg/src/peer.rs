//! What a [`crate::Session`] keeps for its connection and a [`crate::Hub`] keeps for each of
//! its peers: the sending side (sequence, solicitation policy, encoding and fragmenting) and
//! the receiving side (decoder), written once over a [`Link`] so that both drive the same code.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmsg_transport::{
    Arrival, Buffer, Connection, Exposed, PeerId, ReadDone, ReadPost, ReadSegment,
};

use crate::bulk::Piece;
use crate::codec::{self, Decoded, Decoder, Envelope, FrameBytes, NUDGE_TAG};
use crate::frame::{self, FIRST, LAST};
use crate::policy::SolicitPolicy;
use crate::rendezvous::{self, Descriptor, Lent, ReadBuf, ReadPool, Segment};
use crate::{Message, Result, SessionConfig, SessionStats};

/// Where a [`Sender`]'s frames go: a connection, or one peer of a transport hub.
pub(crate) trait Link {
    /// Sends what `fill` writes into a registered send buffer (`None`: nothing sent,
    /// `Ok(false)`), waiting at most `timeout` (`None`: as long as it takes) for a credit
    /// and a send slot ([`rdmsg_transport::Error::Timeout`]).
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool>;

    /// The largest frame the peer accepts.
    fn max_message(&self) -> rdmsg_transport::Result<usize>;

    /// Exposes `bytes` to the peer's RDMA reads, under a key of their own.
    fn expose(&self, bytes: Bytes) -> rdmsg_transport::Result<Exposed>;

    /// Registers `len` bytes that reads may land in.
    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer>;

    /// Posts RDMA reads of the peer's memory into `into`.
    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost>;

    /// Waits at most `timeout` for anything to arrive and hands it to the receiving side
    /// (which reads what the peer lends us meanwhile, so that two peers each waiting for the
    /// other's acknowledgement both go on): how a send short of rendezvous room waits.
    /// `None` if this link cannot wait so (a send then finds no room and does not wait).
    fn absorb(&mut self, _timeout: Option<Duration>) -> Result<Option<Absorbed>> {
        Ok(None)
    }

    /// Sends one frame, waiting at most `timeout` as [`Link::send_with`] does; `Ok(false)`
    /// if nothing came in time (nothing sent).
    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool>;
}

impl Link for Connection {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        Connection::send_with(self, solicited, timeout, fill)
    }

    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        Connection::send_timeout(self, frame, solicited, timeout)
    }

    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        Ok(Connection::max_message(self))
    }

    fn expose(&self, bytes: Bytes) -> rdmsg_transport::Result<Exposed> {
        Connection::expose(self, bytes)
    }

    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        Connection::register(self, len)
    }

    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        Connection::post_read(self, into, segments)
    }
}

/// What [`Link::absorb`] took in: acknowledgements each way.
#[derive(Debug, Default)]
pub(crate) struct Absorbed {
    /// The peer is done reading these messages of ours.
    pub(crate) acked: Vec<u32>,
    /// We are done reading these messages of the peer's: to be told.
    pub(crate) acks: Vec<u32>,
}

impl Absorbed {
    fn from(receiver: &mut Receiver) -> Self {
        Self {
            acked: receiver.take_acked(),
            acks: receiver.take_acks(),
        }
    }
}

/// A session's connection with its receiving side, for a send that may wait for room
/// ([`Link::absorb`]).
#[derive(Debug)]
pub(crate) struct Absorbing<'a> {
    pub(crate) conn: &'a mut Connection,
    pub(crate) receiver: &'a mut Receiver,
}

/// Everything but [`Link::absorb`] is the connection's own [`Link`].
impl Link for Absorbing<'_> {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        Link::send_with(self.conn, solicited, timeout, fill)
    }

    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        Link::send(self.conn, frame, solicited, timeout)
    }

    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        Link::max_message(self.conn)
    }

    fn expose(&self, bytes: Bytes) -> rdmsg_transport::Result<Exposed> {
        Link::expose(self.conn, bytes)
    }

    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        Link::register(self.conn, len)
    }

    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        Link::post_read(self.conn, into, segments)
    }

    fn absorb(&mut self, timeout: Option<Duration>) -> Result<Option<Absorbed>> {
        if let Some(a) = self.conn.recv_any_timeout(timeout)? {
            self.receiver.accept(a);
        }
        self.receiver.advance(self.conn)?;
        Ok(Some(Absorbed::from(self.receiver)))
    }
}

/// Encoded pieces that travel inside a descriptor at most (larger ones are exposed).
const INLINE_PIECE: usize = 1024;

/// The pieces of a message, joined: its body.
fn concat(pieces: Vec<Piece>) -> Vec<u8> {
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

/// What a send bounded by a timeout came to: `Ok(false)` if it timed out (nothing sent).
pub(crate) fn in_time(sent: Result<()>) -> Result<bool> {
    match sent {
        Ok(()) => Ok(true),
        Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => Ok(false),
        Err(e) => Err(e),
    }
}

/// One peer of a transport hub, as a [`Link`].
#[derive(Debug)]
pub(crate) struct HubLink<'a> {
    pub(crate) hub: &'a mut rdmsg_transport::Hub,
    pub(crate) peer: PeerId,
    /// Where a waiting send keeps the events of other peers it takes (see
    /// [`Link::absorb`]), and this peer's receiving side; `None`: it does not wait for
    /// rendezvous room.
    pub(crate) stash: Option<&'a mut VecDeque<rdmsg_transport::HubEvent>>,
    pub(crate) receiver: Option<&'a mut Receiver>,
}

impl Link for HubLink<'_> {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        self.hub.send_with(self.peer, solicited, timeout, fill)
    }

    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        self.hub.send_timeout(self.peer, frame, solicited, timeout)
    }

    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        self.hub.max_message(self.peer)
    }

    fn expose(&self, bytes: Bytes) -> rdmsg_transport::Result<Exposed> {
        self.hub.expose(bytes)
    }

    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        self.hub.register(len)
    }

    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        self.hub.post_read(self.peer, into, segments)
    }

    fn absorb(&mut self, timeout: Option<Duration>) -> Result<Option<Absorbed>> {
        let (Some(stash), Some(receiver)) = (self.stash.take(), self.receiver.take()) else {
            return Ok(None);
        };
        let taken = self.hub.next_event(timeout);
        let out = match taken {
            Err(e) => Err(e.into()),
            Ok(ev) => {
                let gone = match ev {
                    Some(rdmsg_transport::HubEvent::Message { peer, msg }) if peer == self.peer => {
                        receiver.arrive(FrameBytes::Received(msg));
                        None
                    }
                    Some(rdmsg_transport::HubEvent::Read { peer, read }) if peer == self.peer => {
                        receiver.read_done(read);
                        None
                    }
                    Some(other) => {
                        // Others' events wait for the hub's next call; this peer's end ends
                        // the wait.
                        let gone = match &other {
                            rdmsg_transport::HubEvent::Disconnected { peer, failure }
                                if *peer == self.peer =>
                            {
                                Some(*failure)
                            }
                            _ => None,
                        };
                        stash.push_back(other);
                        gone
                    }
                    None => None,
                };
                match gone {
                    Some(f) => Err(rdmsg_transport::Error::from(f).into()),
                    None => receiver
                        .advance(self)
                        .map(|()| Some(Absorbed::from(receiver))),
                }
            }
        };
        self.stash = Some(stash);
        self.receiver = Some(receiver);
        out
    }
}

/// The sending side of one connection: the next sequence number, the solicitation policy,
/// and the send counters of [`SessionStats`].
#[derive(Debug)]
pub(crate) struct Sender {
    policy: SolicitPolicy,
    seq: u32,
    max_message: usize,
    stats: SessionStats,
    /// Frames of a fragmented message committed by a non-blocking send (its sequence number
    /// taken, its first frame gone) that are still to go, each with its solicitation, and
    /// rendezvous acknowledgements. They go before anything else, whoever drives the link
    /// next.
    outgoing: VecDeque<(Vec<u8>, bool)>,
    /// Encoded messages at least this long go by rendezvous (`None`: never).
    rendezvous_threshold: Option<usize>,
    /// Messages the peer may be reading.
    lent: Lent,
}

impl Sender {
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
        }
    }

    /// A message too large for one frame, encoded once into pieces ([`Bulk`](crate::Bulk)
    /// payloads by reference), and its length, within `max_message`.
    fn encode_large<M: Message>(&self, m: &M) -> Result<(Vec<Piece>, usize)> {
        let pieces = codec::encode_pieces(m)?;
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
    fn by_rendezvous(&self, total: usize) -> bool {
        self.rendezvous_threshold.is_some_and(|t| total >= t)
            && total <= self.lent.max()
            && u32::try_from(total).is_ok()
    }

    /// The peer is done reading these messages: their exposures end.
    pub(crate) fn acknowledged(&mut self, seqs: &[u32]) {
        for &seq in seqs {
            if !self.lent.done(seq) {
                self.stats.stray_acks += 1;
            }
        }
    }

    /// Messages the peer may still be reading.
    pub(crate) fn lent(&self) -> usize {
        self.lent.count()
    }

    /// Waits, taking in what arrives ([`Link::absorb`]), until the peer is done reading our
    /// messages or `deadline` passes: closing under a read would fail it.
    pub(crate) fn wait_until_returned(
        &mut self,
        link: &mut impl Link,
        deadline: Instant,
    ) -> Result<()> {
        while self.lent() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.take_in(link, Some(left))? {
                break;
            }
        }
        Ok(())
    }

    /// Waits at most `timeout` for what arrives ([`Link::absorb`]), takes in the peer's
    /// acknowledgements and sends ours as they can go; `false` if the link cannot wait so.
    fn take_in(&mut self, link: &mut impl Link, timeout: Option<Duration>) -> Result<bool> {
        let Some(got) = link.absorb(timeout)? else {
            return Ok(false);
        };
        self.acknowledged(&got.acked);
        let frame_max = link.max_message()?;
        self.queue_acks(&got.acks, frame_max);
        self.pump(link)?;
        Ok(true)
    }

    /// Queues acknowledgements of messages we are done reading, solicited (the peer may wait
    /// for room), to go with the next frames sent.
    pub(crate) fn queue_acks(&mut self, seqs: &[u32], frame_max: usize) {
        for f in rendezvous::done_frames(seqs, frame_max) {
            self.outgoing.push_back((f, true));
        }
    }

    /// Sends `pieces` (message `seq` of type `tag`, `total` bytes) by rendezvous: exposes
    /// what does not travel in the descriptor, then sends the descriptor, solicited, waiting
    /// at most `timeout` for a credit. `Ok(false)`: not sent (nothing exposed any more).
    /// `Err` with nothing sent if the descriptor cannot fit a frame.
    #[allow(clippy::too_many_arguments)]
    fn send_rendezvous(
        &mut self,
        link: &mut impl Link,
        tag: u32,
        seq: u32,
        mut pieces: Vec<Piece>,
        total: usize,
        requested: bool,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        let frame_max = link.max_message()?;
        if pieces.len() > rendezvous::MAX_PIECES {
            // Too many payloads to name one by one: copy them into one piece.
            pieces = vec![Piece::Encoded(concat(pieces))];
        }
        // Small encoded pieces travel in the descriptor, as far as the frame allows.
        let mut room = frame_max.saturating_sub(rendezvous::remote_frame_len(pieces.len()));
        let mut segments = Vec::with_capacity(pieces.len());
        let mut exposed = Vec::new();
        for p in pieces {
            match p {
                Piece::Encoded(v)
                    if v.len() + rendezvous::INLINE_HEAD <= room && v.len() <= INLINE_PIECE =>
                {
                    room -= v.len() + rendezvous::INLINE_HEAD;
                    segments.push(Segment::Inline(v));
                }
                other => {
                    let bytes = match other {
                        Piece::Encoded(v) => Bytes::from(v),
                        Piece::Bulk(b) => b,
                    };
                    let e = link.expose(bytes)?;
                    segments.push(Segment::Remote {
                        len: e.len() as u32,
                        addr: e.addr(),
                        rkey: e.rkey(),
                    });
                    exposed.push(e);
                }
            }
        }
        let descriptor = Descriptor {
            total: total as u32,
            segments,
        };
        let mut len = 0;
        let sent = link.send_with(true, timeout, |buf| {
            len = descriptor.write_frame(tag, seq, buf)?;
            Some(len)
        })?;
        if !sent {
            return Ok(false);
        }
        self.lent.lend(seq, exposed, total);
        self.stats.rendezvous_sent += 1;
        self.finish(true, requested, len, 1);
        Ok(true)
    }

    /// Whether a descriptor of `pieces` can fit in a frame of `frame_max` bytes.
    fn descriptor_fits(pieces: usize, frame_max: usize) -> bool {
        rendezvous::remote_frame_len(pieces.min(rendezvous::MAX_PIECES)) <= frame_max
    }

    /// Sends `m`, solicited as asked or as the policy forces: straight into a registered send
    /// buffer when it fits, else fragmented, the last fragment alone carrying the solicitation.
    pub(crate) fn send_as<M: Message>(
        &mut self,
        link: &mut impl Link,
        m: &M,
        solicited: bool,
    ) -> Result<()> {
        self.send_within(link, m, solicited, None)
    }

    /// [`Sender::send_as`], its first frame waiting at most `first_timeout` for a credit and a
    /// send slot ([`rdmsg_transport::Error::Timeout`]: nothing sent); the other frames of a
    /// fragmented message wait as long as it takes, so that none is left half sent.
    pub(crate) fn send_within<M: Message>(
        &mut self,
        link: &mut impl Link,
        m: &M,
        solicited: bool,
        first_timeout: Option<Duration>,
    ) -> Result<()> {
        // Frames committed earlier go first; until they have, nothing of `m` is sent.
        if !self.drain(link, first_timeout)? {
            let waited = first_timeout.unwrap_or_default();
            return Err(rdmsg_transport::Error::Timeout(waited).into());
        }
        let seq = self.seq;
        let want = self.policy.decide(solicited);
        let mut outcome: Result<Option<usize>> = Ok(None);
        let sent = link.send_with(want, first_timeout, |buf| {
            outcome = codec::encode_single(m, seq, buf);
            outcome.as_ref().ok().copied().flatten()
        })?;
        let single = outcome?;
        if sent {
            self.finish(want, solicited, single.unwrap_or(0), 1);
            return Ok(());
        }
        let (pieces, total) = self.encode_large(m)?;
        let frame_max = link.max_message()?;
        if self.by_rendezvous(total) && Self::descriptor_fits(pieces.len(), frame_max) {
            // A timeout too long to add to the clock is no deadline at all.
            let deadline = first_timeout.and_then(|t| Instant::now().checked_add(t));
            let timed_out = || rdmsg_transport::Error::Timeout(first_timeout.unwrap_or_default());
            self.stats.rendezvous_waits += u64::from(!self.lent.has_room(total));
            while !self.lent.has_room(total) {
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                if left == Some(Duration::ZERO) || !self.take_in(link, left)? {
                    return Err(timed_out().into());
                }
            }
            return match self.send_rendezvous(
                link,
                M::TAG,
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
        let frames = codec::fragment(&concat(pieces), M::TAG, seq, frame_max, self.max_message)?;
        let count = frames.len();
        let mut bytes = 0;
        for (i, f) in frames.iter().enumerate() {
            let last = i + 1 == count;
            // Without a timeout a frame always goes (or the link failed).
            link.send(f, last && want, None)?;
            bytes += f.len();
        }
        self.stats.fragmented += 1;
        self.finish(want, solicited, bytes, count as u64);
        Ok(())
    }

    /// Sends `m` if it can go without waiting: `Ok(false)` (nothing of it sent) if the peer
    /// has no credit, no send slot is free, or frames committed earlier are still waiting. A
    /// message needing fragments is committed once its first frame is sent: the rest are
    /// queued and go out as credits allow, on any later call that drives the link
    /// ([`Sender::pump`]), before anything else.
    pub(crate) fn try_send_as<M: Message>(
        &mut self,
        link: &mut impl Link,
        m: &M,
        solicited: bool,
    ) -> Result<bool> {
        if !self.pump(link)? {
            return Ok(false);
        }
        let seq = self.seq;
        let want = self.policy.decide(solicited);
        let mut outcome: Result<Option<usize>> = Ok(None);
        let mut asked = false;
        let sent = match link.send_with(want, Some(Duration::ZERO), |buf| {
            asked = true;
            outcome = codec::encode_single(m, seq, buf);
            outcome.as_ref().ok().copied().flatten()
        }) {
            Ok(sent) => sent,
            Err(rdmsg_transport::Error::Timeout(_)) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let single = outcome?;
        if sent {
            self.finish(want, solicited, single.unwrap_or(0), 1);
            return Ok(true);
        }
        if !asked {
            return Ok(false);
        }
        let (pieces, total) = self.encode_large(m)?;
        let frame_max = link.max_message()?;
        if self.by_rendezvous(total) && Self::descriptor_fits(pieces.len(), frame_max) {
            if !self.lent.has_room(total) {
                return Ok(false);
            }
            let zero = Some(Duration::ZERO);
            return match self.send_rendezvous(link, M::TAG, seq, pieces, total, solicited, zero) {
                Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => Ok(false),
                other => other,
            };
        }
        let frames = codec::fragment(&concat(pieces), M::TAG, seq, frame_max, self.max_message)?;
        let count = frames.len();
        let mut frames = frames.into_iter().enumerate();
        let (_, first) = frames.next().expect("a message has a first frame");
        if !link.send(&first, count == 1 && want, Some(Duration::ZERO))? {
            // The credit seen a moment ago is still there (only we spend it): a send slot.
            return Ok(false);
        }
        let bytes: usize = first.len();
        let rest: Vec<(Vec<u8>, bool)> = frames.map(|(i, f)| (f, i + 1 == count && want)).collect();
        let bytes = bytes + rest.iter().map(|(f, _)| f.len()).sum::<usize>();
        self.outgoing.extend(rest);
        self.stats.fragmented += 1;
        self.finish(want, solicited, bytes, count as u64);
        self.pump(link)?;
        Ok(true)
    }

    /// Sends committed frames that can go without waiting; whether none is left.
    pub(crate) fn pump(&mut self, link: &mut impl Link) -> Result<bool> {
        self.drain(link, Some(Duration::ZERO))
    }

    /// Frames committed but not sent yet.
    pub(crate) fn queued_frames(&self) -> usize {
        self.outgoing.len()
    }

    /// With [`crate::SessionConfig::max_unsolicited_delay`], when what went unsolicited must be
    /// flushed at the latest.
    pub(crate) fn flush_deadline(&self) -> Option<Instant> {
        self.policy.deadline()
    }

    /// Whether a session about to wait should flush now: something went unsolicited, and
    /// either no delay is allowed or it has run out.
    pub(crate) fn flush_due(&self) -> bool {
        self.policy.pending()
            && match self.policy.max_delay() {
                None => true,
                Some(_) => self.flush_deadline().is_some_and(|d| Instant::now() >= d),
            }
    }

    /// Whether unsolicited sends may wait up to a bound ([`crate::SessionConfig::max_unsolicited_delay`]).
    pub(crate) fn delay_allowed(&self) -> bool {
        self.policy.max_delay().is_some()
    }

    fn finish(&mut self, solicited: bool, requested: bool, bytes: usize, frames: u64) {
        self.seq = self.seq.wrapping_add(1);
        self.policy.record(solicited, bytes);
        self.stats.sent += 1;
        self.stats.frames_sent += frames;
        self.stats.sent_solicited += u64::from(solicited);
        self.stats.policy_solicited += u64::from(solicited && !requested);
    }

    /// Sends every message unsolicited but the last, which is solicited.
    pub(crate) fn send_batch<'a, M: Message + 'a>(
        &mut self,
        link: &mut impl Link,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> Result<usize> {
        let mut iter = batch.into_iter().peekable();
        let mut n = 0;
        while let Some(m) = iter.next() {
            self.send_as(link, m, iter.peek().is_none())?;
            n += 1;
        }
        Ok(n)
    }

    /// A payload-less solicited frame if anything went unsolicited since the last solicited
    /// one.
    pub(crate) fn flush(&mut self, link: &mut impl Link) -> Result<()> {
        self.flush_within(link, None).map(|_| ())
    }

    /// [`Sender::flush`], waiting at most `timeout` for a credit: `Ok(false)` if none came
    /// (nothing sent; still pending).
    pub(crate) fn flush_within(
        &mut self,
        link: &mut impl Link,
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
        let nudge = frame::build(FIRST | LAST, NUDGE_TAG, self.seq, 0, &[]);
        if !link.send(&nudge, true, timeout)? {
            return Ok(false);
        }
        self.policy.record(true, 0);
        Ok(true)
    }

    /// Sends every committed frame, waiting at most `timeout` for each; whether all went.
    pub(crate) fn drain(
        &mut self,
        link: &mut impl Link,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        while let Some((f, solicited)) = self.outgoing.front() {
            if !link.send(f, *solicited, timeout)? {
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
    /// credit (`credits` 0) nothing is sent: the message that spent the peer's last credit
    /// went solicited (the transport solicits it), so the peer looks anyway.
    pub(crate) fn flush_before_wait(
        &mut self,
        link: &mut impl Link,
        credits: u32,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        if !self.policy.pending() {
            return Ok(true);
        }
        if credits == 0 {
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

/// The receiving side of one connection: its decoder (reassembly, registered tags), the
/// rendezvous reads under way, and the receive counters of [`SessionStats`]. Messages come
/// out in their sequence order, a message being read holding back those after it.
#[derive(Debug)]
pub(crate) struct Receiver {
    decoder: Decoder,
    received: u64,
    dropped_frames: u64,
    rendezvous_received: u64,
    /// Messages (or the errors of dropped frames) in order; some still being read.
    order: VecDeque<Slot>,
    /// Descriptors whose reads are not posted yet (no buffer room, or no send slot).
    waiting: VecDeque<WaitingRead>,
    /// Reads posted: read id → (seq, tag, length, the buffer's size).
    reading: std::collections::HashMap<u64, (u32, u32, usize, usize)>,
    /// Our reads that finished: their senders are to be told.
    acks: Vec<u32>,
    /// The peer's acknowledgements of our messages, for the sender.
    acked: Vec<u32>,
    pool: ReadPool,
}

#[derive(Debug)]
enum Slot {
    Ready(Result<Envelope>),
    Reading(u32),
}

#[derive(Debug)]
struct WaitingRead {
    seq: u32,
    tag: u32,
    descriptor: Descriptor,
}

/// Most messages a receiver reads at once (the queue pair keeps up to 16 reads in flight).
const MAX_READS_POSTED: usize = 8;

/// Most descriptors a receiver keeps waiting for room: an honest sender's are bounded by its
/// own room; beyond this one is refused (and acknowledged).
const MAX_WAITING_READS: usize = 1024;

impl Receiver {
    pub(crate) fn new(decoder: Decoder, pool: ReadPool) -> Self {
        Self {
            decoder,
            received: 0,
            dropped_frames: 0,
            rendezvous_received: 0,
            order: VecDeque::new(),
            waiting: VecDeque::new(),
            reading: std::collections::HashMap::new(),
            acks: Vec::new(),
            acked: Vec::new(),
            pool,
        }
    }

    pub(crate) fn register<M: Message>(&mut self) -> Result<()> {
        self.decoder.register::<M>()
    }

    /// Takes one frame: a message (or the typed error of a frame that was dropped, counted)
    /// joins the queue in order; a descriptor queues its read; an acknowledgement is kept for
    /// the sender ([`Receiver::take_acked`]).
    #[cfg(test)]
    pub(crate) fn take(&mut self, frame: FrameBytes) -> Result<Option<Envelope>> {
        self.arrive(frame);
        self.pop().transpose()
    }

    /// Takes what a connection handed out.
    pub(crate) fn accept(&mut self, a: Arrival) {
        match a {
            Arrival::Message(m) => self.arrive(FrameBytes::Received(m)),
            Arrival::Read(r) => self.read_done(r),
        }
    }

    /// [`Receiver::take`] without taking the next message out.
    pub(crate) fn arrive(&mut self, frame: FrameBytes) {
        let descriptor_seq = frame::parse(frame.bytes())
            .ok()
            .filter(|(h, _)| h.flags & frame::RNDV != 0)
            .map(|(h, _)| h.seq);
        match self.decoder.take(frame) {
            Ok(Decoded::Message(env)) => {
                self.received += 1;
                self.order.push_back(Slot::Ready(Ok(env)));
            }
            Ok(Decoded::Nothing) => {}
            Ok(Decoded::Done(seqs)) => self.acked.extend(seqs),
            Ok(Decoded::Rendezvous {
                tag,
                seq,
                descriptor,
            }) => self.on_descriptor(tag, seq, descriptor),
            Err(e) => {
                // A descriptor refused is acknowledged all the same: its sender frees it.
                self.acks.extend(descriptor_seq);
                self.drop_frame(e);
            }
        }
    }

    fn drop_frame(&mut self, e: crate::Error) {
        self.dropped_frames += 1;
        self.order.push_back(Slot::Ready(Err(e)));
    }

    fn on_descriptor(&mut self, tag: u32, seq: u32, descriptor: Descriptor) {
        let len = descriptor.total as usize;
        let max = self.decoder.max_message().min(self.pool.max());
        if len > max {
            self.acks.push(seq);
            return self.drop_frame(crate::Error::TooLarge { len, max });
        }
        if self.waiting.len() >= MAX_WAITING_READS {
            self.acks.push(seq);
            let e = frame::FrameError::Rendezvous("too many messages waiting to be read");
            return self.drop_frame(e.into());
        }
        self.order.push_back(Slot::Reading(seq));
        self.waiting.push_back(WaitingRead {
            seq,
            tag,
            descriptor,
        });
    }

    /// Posts the reads of waiting descriptors, as far as buffer room and send slots allow.
    pub(crate) fn advance(&mut self, link: &mut impl Link) -> Result<()> {
        while let Some(w) = self.waiting.front() {
            if self.reading.len() >= MAX_READS_POSTED {
                // Enough to keep the link busy; more would only register more buffers.
                return Ok(());
            }
            let len = w.descriptor.total as usize;
            let Some(mut buf) = self.pool.acquire(len, |n| link.register(n))? else {
                return Ok(());
            };
            let mut segments = Vec::new();
            let mut at = 0;
            for seg in &w.descriptor.segments {
                match seg {
                    Segment::Inline(v) => {
                        buf.as_mut_slice()[at..at + v.len()].copy_from_slice(v);
                    }
                    Segment::Remote { len, addr, rkey } => segments.push(ReadSegment {
                        local_offset: at,
                        len: *len,
                        remote_addr: *addr,
                        rkey: *rkey,
                    }),
                }
                at += seg.len();
            }
            let (seq, tag) = (w.seq, w.tag);
            if segments.is_empty() {
                self.waiting.pop_front();
                self.acks.push(seq);
                self.complete(seq, tag, buf, len);
                continue;
            }
            let cap = buf.len();
            match link.post_read(buf, &segments) {
                Ok(ReadPost::Posted(id)) => {
                    self.waiting.pop_front();
                    self.reading.insert(id, (seq, tag, len, cap));
                }
                Ok(ReadPost::Busy(buf)) => {
                    self.pool.release(buf);
                    return Ok(());
                }
                Err(e) => {
                    // The buffer went with the refused post: count it out of the pool.
                    self.pool.forget(cap);
                    if let rdmsg_transport::Error::Config(_) = e {
                        // More pieces than our send queue takes at once: refused alone.
                        self.waiting.pop_front();
                        self.acks.push(seq);
                        self.fill(seq, Err(crate::Error::Transport(e)));
                        continue;
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// One of our reads finished: its message takes its place in the order, and its sender
    /// is to be told.
    pub(crate) fn read_done(&mut self, done: ReadDone) {
        let Some((seq, tag, len, _)) = self.reading.remove(&done.id) else {
            // Not one of ours: it was never counted in the pool.
            return;
        };
        self.acks.push(seq);
        if done.ok {
            self.complete(seq, tag, done.buffer, len);
        } else {
            self.pool.release(done.buffer);
            self.fill(seq, Err(crate::Error::ReadFailed { tag, seq }));
        }
    }

    fn complete(&mut self, seq: u32, tag: u32, buf: Buffer, len: usize) {
        let env = self
            .decoder
            .read_message(tag, seq, ReadBuf::new(buf, len, self.pool.clone()));
        self.received += 1;
        self.rendezvous_received += 1;
        self.fill(seq, Ok(env));
    }

    fn fill(&mut self, seq: u32, what: Result<Envelope>) {
        if let Some(slot) = self
            .order
            .iter_mut()
            .find(|s| matches!(s, Slot::Reading(n) if *n == seq))
        {
            *slot = Slot::Ready(what);
        }
    }

    /// The next message (or dropped frame's error) in order, if it is there.
    pub(crate) fn pop(&mut self) -> Option<Result<Envelope>> {
        match self.order.front()? {
            Slot::Ready(_) => match self.order.pop_front() {
                Some(Slot::Ready(r)) => Some(r),
                _ => None,
            },
            Slot::Reading(_) => None,
        }
    }

    /// Whether [`Receiver::pop`] has something.
    pub(crate) fn has_ready(&self) -> bool {
        matches!(self.order.front(), Some(Slot::Ready(_)))
    }

    /// Whether descriptors wait for room or a send slot (a step should try again).
    pub(crate) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Sequence numbers of the peer's messages we are done reading.
    pub(crate) fn take_acks(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.acks)
    }

    /// The peer's acknowledgements of our messages.
    pub(crate) fn take_acked(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.acked)
    }

    /// Whether acknowledgements wait to be handed over (either way).
    pub(crate) fn has_acks(&self) -> bool {
        !self.acks.is_empty() || !self.acked.is_empty()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // Reads still under way end with the connection, their buffers with it (a queue pair
        // destroyed drops them): they leave the pool's count.
        for &(_, _, _, cap) in self.reading.values() {
            self.pool.forget(cap);
        }
    }
}

/// Hands acknowledgements between the two sides of one peer: the peer's to our sender, ours
/// to be sent. Whether any of ours were queued.
pub(crate) fn exchange_acks(
    sender: &mut Sender,
    receiver: &mut Receiver,
    frame_max: usize,
) -> bool {
    if !receiver.has_acks() {
        return false;
    }
    sender.acknowledged(&receiver.take_acked());
    let ours = receiver.take_acks();
    sender.queue_acks(&ours, frame_max);
    !ours.is_empty()
}

/// The counters of both sides.
pub(crate) fn stats(sender: &Sender, receiver: &Receiver) -> SessionStats {
    SessionStats {
        received: receiver.received,
        dropped_frames: receiver.dropped_frames,
        rendezvous_received: receiver.rendezvous_received,
        rendezvous_registered: receiver.pool.registered() as u64,
        ..sender.stats
    }
}

/// A key naming a slot that later keys may reuse ([`PeerId`]).
pub(crate) trait SlotKey: Copy + Eq {
    fn index(self) -> usize;
}

impl SlotKey for PeerId {
    fn index(self) -> usize {
        PeerId::index(self)
    }
}

/// Per-peer state in a `Vec` indexed by slot, each entry keeping the key it was made for, so
/// that a stale key (its slot reused by a later connection) finds nothing.
#[derive(Debug)]
pub(crate) struct PeerTable<K, V> {
    slots: Vec<Option<(K, V)>>,
}

impl<K, V> Default for PeerTable<K, V> {
    fn default() -> Self {
        Self { slots: Vec::new() }
    }
}

impl<K: SlotKey, V> PeerTable<K, V> {
    pub(crate) fn get(&self, key: K) -> Option<&V> {
        match self.slots.get(key.index()) {
            Some(Some((k, v))) if *k == key => Some(v),
            _ => None,
        }
    }

    pub(crate) fn get_mut(&mut self, key: K) -> Option<&mut V> {
        match self.slots.get_mut(key.index()) {
            Some(Some((k, v))) if *k == key => Some(v),
            _ => None,
        }
    }

    /// Puts `value` in `key`'s slot; returns what was there, under whatever key (a stale entry
    /// whose removal was missed).
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<(K, V)> {
        let i = key.index();
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i].replace((key, value))
    }

    /// Removes `key`'s entry; a stale key removes nothing.
    pub(crate) fn remove(&mut self, key: K) -> Option<V> {
        let slot = self.slots.get_mut(key.index())?;
        if !matches!(slot, Some((k, _)) if *k == key) {
            return None;
        }
        slot.take().map(|(_, v)| v)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.slots.iter().flatten().map(|(_, v)| v)
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> + '_ {
        self.slots.iter_mut().flatten().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// A slot and a generation, as a transport hub makes them.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Key(usize, u32);

    impl SlotKey for Key {
        fn index(self) -> usize {
            self.0
        }
    }

    #[test]
    fn a_reused_slot_does_not_answer_to_its_old_key() {
        let mut t = PeerTable::default();
        assert!(t.insert(Key(3, 1), "a").is_none());
        assert!(t.insert(Key(0, 2), "b").is_none());
        assert_eq!(t.get(Key(3, 1)), Some(&"a"));
        assert_eq!(t.get(Key(3, 9)), None, "another generation");
        assert_eq!(t.get(Key(7, 1)), None, "beyond the slots");
        assert_eq!(t.remove(Key(3, 9)), None, "a stale key removes nothing");
        assert_eq!(t.remove(Key(3, 1)), Some("a"));
        assert_eq!(t.get(Key(3, 1)), None);
        assert!(t.insert(Key(3, 4), "c").is_none(), "the slot is reused");
        assert_eq!(t.get(Key(3, 1)), None);
        *t.get_mut(Key(3, 4)).unwrap() = "d";
        assert_eq!(t.get(Key(3, 4)), Some(&"d"));
        assert_eq!(
            t.remove(Key(3, 1)),
            None,
            "the old key cannot remove the new entry"
        );
        let mut all: Vec<_> = t.values().copied().collect();
        all.sort_unstable();
        assert_eq!(all, ["b", "d"]);
    }

    #[test]
    fn a_missed_removal_is_handed_back_by_the_next_insert() {
        let mut t = PeerTable::default();
        t.insert(Key(1, 1), 10);
        assert_eq!(t.insert(Key(1, 2), 20), Some((Key(1, 1), 10)));
        assert_eq!(t.get(Key(1, 2)), Some(&20));
        assert_eq!(t.values().count(), 1);
        for v in t.values_mut() {
            *v += 1;
        }
        assert_eq!(t.get(Key(1, 2)), Some(&21));
    }

    /// A link that keeps the frames it is given; while `full`, nothing can go (as if no
    /// credit or send slot came within the timeout).
    struct Wire {
        max: usize,
        frames: Vec<(Vec<u8>, bool)>,
        full: bool,
        /// Frames that can go before the wire is full (credits).
        room: usize,
    }

    impl Link for Wire {
        fn send_with(
            &mut self,
            solicited: bool,
            timeout: Option<Duration>,
            fill: impl FnOnce(&mut [u8]) -> Option<usize>,
        ) -> rdmsg_transport::Result<bool> {
            if self.full || self.room == 0 {
                return Err(rdmsg_transport::Error::Timeout(timeout.unwrap_or_default()));
            }
            let mut buf = vec![0; self.max];
            let Some(n) = fill(&mut buf) else {
                return Ok(false);
            };
            buf.truncate(n);
            self.frames.push((buf, solicited));
            self.room -= 1;
            Ok(true)
        }

        fn max_message(&self) -> rdmsg_transport::Result<usize> {
            Ok(self.max)
        }

        fn expose(&self, _: Bytes) -> rdmsg_transport::Result<Exposed> {
            Err(rdmsg_transport::Error::Config(
                "no device under the test wire".into(),
            ))
        }

        fn register(&self, _: usize) -> rdmsg_transport::Result<Buffer> {
            Err(rdmsg_transport::Error::Config(
                "no device under the test wire".into(),
            ))
        }

        fn post_read(
            &mut self,
            into: Buffer,
            _: &[ReadSegment],
        ) -> rdmsg_transport::Result<ReadPost> {
            Ok(ReadPost::Busy(into))
        }

        fn send(
            &mut self,
            frame: &[u8],
            solicited: bool,
            timeout: Option<Duration>,
        ) -> rdmsg_transport::Result<bool> {
            assert!(frame.len() <= self.max);
            match self.send_with(solicited, timeout, |buf| {
                buf[..frame.len()].copy_from_slice(frame);
                Some(frame.len())
            }) {
                Err(rdmsg_transport::Error::Timeout(_)) => Ok(false),
                other => other,
            }
        }
    }

    impl Wire {
        /// An empty wire taking frames of up to `max` bytes, not full.
        fn new(max: usize) -> Self {
            Self {
                max,
                frames: Vec::new(),
                full: false,
                room: usize::MAX,
            }
        }
    }

    #[test]
    fn a_wait_flushes_what_went_unsolicited_once_and_only_with_a_credit() {
        let mut tx = Sender::new(&config(100), 64);
        let mut wire = Wire::new(256);
        let zero = Some(Duration::ZERO);
        assert!(tx.flush_before_wait(&mut wire, 5, zero).unwrap());
        assert!(wire.frames.is_empty(), "nothing pending, nothing sent");
        tx.send_as(&mut wire, &Other(1), false).unwrap();
        // No credit: the transport solicited the message that spent the last one, so the run
        // counts as flushed (its deadline too).
        assert!(tx.flush_before_wait(&mut wire, 0, zero).unwrap());
        assert_eq!(wire.frames.len(), 1);
        assert!(!tx.pending());
        tx.send_as(&mut wire, &Other(2), false).unwrap();
        // No send slot now: still pending, nothing sent, no sequence number used.
        wire.full = true;
        assert!(!tx.flush_before_wait(&mut wire, 5, zero).unwrap());
        assert!(tx.pending());
        wire.full = false;
        assert!(tx.flush_before_wait(&mut wire, 5, zero).unwrap());
        assert_eq!(wire.frames.len(), 3);
        assert!(wire.frames[2].1, "the nudge is solicited");
        assert!(!tx.pending());
        assert!(tx.flush_before_wait(&mut wire, 5, zero).unwrap());
        assert_eq!((wire.frames.len(), tx.stats.wait_flushes), (3, 1));
    }

    #[test]
    fn a_send_that_times_out_sends_nothing_and_keeps_its_number() {
        let mut tx = Sender::new(&config(100), 64);
        let mut wire = Wire {
            full: true,
            ..Wire::new(256)
        };
        let err = tx
            .send_within(&mut wire, &Other(1), true, Some(Duration::ZERO))
            .unwrap_err();
        assert!(matches!(
            err,
            crate::Error::Transport(rdmsg_transport::Error::Timeout(_))
        ));
        assert_eq!((tx.seq, tx.stats.sent), (0, 0));
        wire.full = false;
        tx.send_within(&mut wire, &Other(2), true, Some(Duration::ZERO))
            .unwrap();
        assert_eq!((tx.seq, tx.stats.sent, wire.frames.len()), (1, 1, 1));
    }

    #[test]
    fn a_non_blocking_send_commits_a_fragmented_message_and_queues_its_rest_first() {
        let mut tx = Sender::new(&config(100), 64);
        let mut wire = Wire {
            room: 0,
            ..Wire::new(256)
        };
        // No credit: nothing sent, nothing committed, no number used.
        assert!(!tx
            .try_send_as(&mut wire, &Blob(vec![7; 1000]), true)
            .unwrap());
        assert_eq!((tx.seq, tx.queued_frames()), (0, 0));
        // Room for two frames of five: committed, three queued.
        wire.room = 2;
        assert!(tx
            .try_send_as(&mut wire, &Blob(vec![7; 1000]), true)
            .unwrap());
        assert_eq!((tx.seq, wire.frames.len(), tx.queued_frames()), (1, 2, 3));
        // Nothing else goes before them.
        wire.room = 1;
        assert!(!tx.try_send_as(&mut wire, &Other(1), true).unwrap());
        assert_eq!((tx.seq, tx.queued_frames()), (1, 2));
        wire.room = 10;
        assert!(tx.pump(&mut wire).unwrap());
        assert!(tx.try_send_as(&mut wire, &Other(2), true).unwrap());
        let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
        assert_eq!(solicited, [false, false, false, false, true, true]);
        let mut rx = Receiver::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
        let got: Vec<Envelope> = deliver(&wire, &mut rx)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].decode::<Blob>().unwrap(), Blob(vec![7; 1000]));
        assert_eq!(got[1].decode::<Other>().unwrap(), Other(2));
    }

    #[test]
    fn a_flush_goes_after_the_queued_frames() {
        let mut tx = Sender::new(&config(100), 64);
        let mut wire = Wire {
            room: 1,
            ..Wire::new(256)
        };
        assert!(tx
            .try_send_as(&mut wire, &Blob(vec![1; 600]), false)
            .unwrap());
        assert!(tx.pending() && tx.queued_frames() == 2);
        assert!(!tx.flush_within(&mut wire, Some(Duration::ZERO)).unwrap());
        wire.room = 10;
        assert!(tx.flush_within(&mut wire, Some(Duration::ZERO)).unwrap());
        assert_eq!(wire.frames.len(), 4, "three fragments, then the nudge");
        assert!(wire.frames[3].1 && !tx.pending());
    }

    #[test]
    fn a_flush_sends_the_queued_frames_of_a_solicited_message_too() {
        let mut tx = Sender::new(&config(100), 64);
        let mut wire = Wire {
            room: 1,
            ..Wire::new(256)
        };
        assert!(tx
            .try_send_as(&mut wire, &Blob(vec![3; 600]), true)
            .unwrap());
        assert!(
            !tx.pending() && tx.queued_frames() == 2,
            "solicited: nothing to flush"
        );
        wire.room = 10;
        assert!(tx.flush_within(&mut wire, None).unwrap());
        assert_eq!(
            (wire.frames.len(), tx.queued_frames()),
            (3, 0),
            "the tail went"
        );
        assert!(
            wire.frames[2].1,
            "the last fragment carries the solicitation"
        );
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Blob(Vec<u8>);
    crate::message!(Blob, solicited = false);

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Other(u8);
    crate::message!(Other);

    fn config(run: u32) -> SessionConfig {
        SessionConfig {
            max_unsolicited_run: Some(run),
            ..SessionConfig::default()
        }
    }

    /// What a receiver makes of the frames on the wire, in order.
    fn deliver(wire: &Wire, rx: &mut Receiver) -> Vec<Result<Envelope>> {
        wire.frames
            .iter()
            .filter_map(|(f, _)| rx.take(FrameBytes::Owned(f.clone())).transpose())
            .collect()
    }

    #[test]
    fn small_messages_go_whole_large_ones_in_fragments_solicited_last() {
        let mut wire = Wire::new(256);
        let mut tx = Sender::new(&config(100), 0);
        tx.send_as(&mut wire, &Blob(vec![1; 10]), false).unwrap();
        tx.send_as(&mut wire, &Blob(vec![2; 1000]), true).unwrap();
        let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
        assert_eq!(solicited.len(), 1 + 1000usize.div_ceil(256 - 20));
        assert_eq!(solicited.iter().filter(|s| **s).count(), 1);
        assert!(
            solicited.last().unwrap(),
            "only the last fragment is solicited"
        );
        let st = tx.stats;
        assert_eq!((st.sent, st.fragmented, st.sent_solicited), (2, 1, 1));
        assert_eq!(st.frames_sent, solicited.len() as u64);
        let mut rx = Receiver::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
        let got: Vec<Blob> = deliver(&wire, &mut rx)
            .into_iter()
            .map(|e| e.unwrap().decode().unwrap())
            .collect();
        assert_eq!(got, [Blob(vec![1; 10]), Blob(vec![2; 1000])]);
        assert_eq!(stats(&tx, &rx).received, 2);
    }

    #[test]
    fn the_policy_solicits_long_runs_and_flush_ends_a_burst() {
        let mut wire = Wire::new(256);
        let mut tx = Sender::new(&config(3), 64);
        for i in 0..5 {
            tx.send_as(&mut wire, &Blob(vec![i]), false).unwrap();
        }
        tx.flush(&mut wire).unwrap();
        tx.flush(&mut wire).unwrap();
        let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
        assert_eq!(solicited, [false, false, false, true, false, true]);
        assert_eq!(tx.stats.policy_solicited, 1);
        let mut rx = Receiver::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
        assert_eq!(
            deliver(&wire, &mut rx).len(),
            5,
            "the nudge carries nothing"
        );
    }

    #[test]
    fn a_batch_solicits_its_last_message_only() {
        let mut wire = Wire::new(256);
        let mut tx = Sender::new(&config(100), 0);
        let batch: Vec<Blob> = (0..4).map(|i| Blob(vec![i])).collect();
        assert_eq!(tx.send_batch(&mut wire, &batch).unwrap(), 4);
        let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
        assert_eq!(solicited, [false, false, false, true]);
        let seqs: Vec<u32> = deliver(
            &wire,
            &mut Receiver::new(Decoder::new(1 << 20), ReadPool::new(1 << 20)),
        )
        .into_iter()
        .map(|e| e.unwrap().seq())
        .collect();
        assert_eq!(seqs, [0, 1, 2, 3]);
    }

    #[test]
    fn the_default_run_is_a_quarter_of_the_peer_depth() {
        let mut wire = Wire::new(256);
        let mut tx = Sender::new(&SessionConfig::default(), 8);
        for _ in 0..3 {
            tx.send_as(&mut wire, &Blob(vec![]), false).unwrap();
        }
        let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
        assert_eq!(solicited, [false, false, true]);
    }

    #[test]
    fn a_dropped_frame_is_counted_and_the_next_one_decodes() {
        let mut wire = Wire::new(256);
        let mut tx = Sender::new(&config(100), 0);
        tx.send_as(&mut wire, &Other(1), true).unwrap();
        tx.send_as(&mut wire, &Blob(vec![1]), true).unwrap();
        wire.frames.insert(0, (b"garbage".to_vec(), true));
        let mut decoder = Decoder::new(1 << 20);
        decoder.register::<Blob>().unwrap();
        let mut rx = Receiver::new(decoder, ReadPool::new(1 << 20));
        let got = deliver(&wire, &mut rx);
        assert!(matches!(got[0], Err(Error::BadFrame(_))));
        assert!(matches!(got[1], Err(Error::UnknownTag(t)) if t == Other::TAG));
        assert_eq!(
            got[2].as_ref().unwrap().decode::<Blob>().unwrap(),
            Blob(vec![1])
        );
        let st = stats(&tx, &rx);
        assert_eq!((st.received, st.dropped_frames), (1, 2));
    }
}
