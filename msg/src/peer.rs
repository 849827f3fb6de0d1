//! What a [`crate::Session`] keeps for its connection and a [`crate::Hub`] keeps for each of
//! its peers: the sending side (sequence, solicitation policy, encoding and fragmenting) and
//! the receiving side (decoder), written once over a [`Link`] so that both drive the same code.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmsg_transport::{Connection, PeerId};

use crate::codec::{self, Decoder, Envelope, FrameBytes, NUDGE_TAG};
use crate::frame::{self, FIRST, LAST};
use crate::policy::SolicitPolicy;
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
    /// taken, its first frame gone) that are still to go, each with its solicitation. They
    /// go before anything else, whoever drives the link next.
    outgoing: VecDeque<(Vec<u8>, bool)>,
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
        }
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
        let frames = codec::encode_fragments(m, seq, link.max_message()?, self.max_message)?;
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
        let frames = codec::encode_fragments(m, seq, link.max_message()?, self.max_message)?;
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

/// The receiving side of one connection: its decoder (reassembly, registered tags) and the
/// receive counters of [`SessionStats`].
#[derive(Debug)]
pub(crate) struct Receiver {
    decoder: Decoder,
    received: u64,
    dropped_frames: u64,
}

impl Receiver {
    pub(crate) fn new(decoder: Decoder) -> Self {
        Self {
            decoder,
            received: 0,
            dropped_frames: 0,
        }
    }

    pub(crate) fn register<M: Message>(&mut self) -> Result<()> {
        self.decoder.register::<M>()
    }

    /// Takes one frame: a message once complete, `None` for a stored fragment or a nudge, or
    /// the typed error of a frame that was dropped (counted).
    pub(crate) fn take(&mut self, frame: FrameBytes) -> Result<Option<Envelope>> {
        match self.decoder.push(frame) {
            Ok(Some(env)) => {
                self.received += 1;
                Ok(Some(env))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.dropped_frames += 1;
                Err(e)
            }
        }
    }
}

/// The counters of both sides.
pub(crate) fn stats(sender: &Sender, receiver: &Receiver) -> SessionStats {
    SessionStats {
        received: receiver.received,
        dropped_frames: receiver.dropped_frames,
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
        let mut rx = Receiver::new(Decoder::new(1 << 20));
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
        let mut rx = Receiver::new(Decoder::new(1 << 20));
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
        let mut rx = Receiver::new(Decoder::new(1 << 20));
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
        let seqs: Vec<u32> = deliver(&wire, &mut Receiver::new(Decoder::new(1 << 20)))
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
        let mut rx = Receiver::new(decoder);
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
