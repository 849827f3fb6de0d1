//! The sending and receiving sides over a simulated link: frames, fragments, rendezvous,
//! acknowledgements, and the peer table.

use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmsg_transport::{Buffer, Exposed, ReadPost, ReadSegment};

use super::SessionConfig;
use super::*;
use crate::codec::{Decoder, Envelope, FrameBytes};
use crate::rendezvous::{Descriptor, ReadPool, Segment};
use crate::Error;
use crate::{Message, Result};

mod pack;
mod receive;
mod resume;
use receive::{one_remote_piece, receiver};

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

impl PeerIo for Wire {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        if self.full || self.room == 0 {
            let waited = timeout.unwrap_or_default();
            return Err(rdmsg_transport::Error::timeout("sending", "(test)", waited));
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

    fn credits(&self) -> u32 {
        u32::try_from(self.room).unwrap_or(u32::MAX)
    }

    /// The test wire has no grants: the record rides frames only.
    fn peer_note(&self) -> Option<u32> {
        None
    }

    fn set_note(&mut self, _taken: u32) {}

    fn failed(&self) -> bool {
        false
    }

    fn expose_all(
        &mut self,
        _: Vec<Bytes>,
        _: Option<Duration>,
    ) -> rdmsg_transport::Result<Vec<Exposed>> {
        Err(rdmsg_transport::Error::Config(
            "no device under the test wire".into(),
        ))
    }

    fn max_exposures(&self) -> usize {
        15
    }

    fn register(&self, _: usize) -> rdmsg_transport::Result<Buffer> {
        Err(rdmsg_transport::Error::Config(
            "no device under the test wire".into(),
        ))
    }

    fn post_read(&mut self, into: Buffer, _: &[ReadSegment]) -> rdmsg_transport::Result<ReadPost> {
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

/// The machine's sequences lend the receiving side to the I/O; the test wire takes nothing
/// in while a send waits, so it lends itself.
impl LendsRecv for Wire {
    type Absorbing<'a> = &'a mut Wire;

    fn absorbing<'a>(&'a mut self, _: &'a mut RecvSide) -> &'a mut Wire {
        self
    }
}

impl PeerIo for &mut Wire {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        (**self).send_with(solicited, timeout, fill)
    }
    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        (**self).max_message()
    }
    fn credits(&self) -> u32 {
        (**self).credits()
    }
    fn peer_note(&self) -> Option<u32> {
        (**self).peer_note()
    }
    fn set_note(&mut self, taken: u32) {
        (**self).set_note(taken)
    }
    fn failed(&self) -> bool {
        (**self).failed()
    }
    fn expose_all(
        &mut self,
        pieces: Vec<Bytes>,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<Vec<Exposed>> {
        (**self).expose_all(pieces, timeout)
    }
    fn max_exposures(&self) -> usize {
        (**self).max_exposures()
    }
    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        (**self).register(len)
    }
    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        (**self).post_read(into, segments)
    }
    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        (**self).send(frame, solicited, timeout)
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
fn a_read_without_a_buffer_is_refused_alone_and_acknowledged() {
    // The test wire registers nothing, as a device over its memory-lock limit.
    let mut wire = Wire::new(256);
    let mut rx = receiver();
    rx.on_descriptor(Blob::TAG, 7, one_remote_piece(100_000));
    rx.advance(&mut wire).expect("the connection goes on");
    match rx.pop() {
        Some(Err(Error::ReadRefused { seq: 7, .. })) => {}
        other => panic!("ReadRefused in its place, not {other:?}"),
    }
    assert_eq!(rx.take_acks(), [7], "its sender frees it");
    assert!(!rx.has_waiting());
}

#[cfg(feature = "tracing")]
#[test]
fn a_refused_read_is_reported_with_its_message() {
    use rdmsg_testkit::events::recording;

    let ((), events) = recording(|| {
        let mut wire = Wire::new(256);
        let mut rx = receiver();
        rx.on_descriptor(Blob::TAG, 7, one_remote_piece(100_000));
        rx.advance(&mut wire).expect("the connection goes on");
    });
    let refused: Vec<_> = events
        .iter()
        .filter(|e| e.message == "rendezvous read refused")
        .collect();
    assert_eq!(refused.len(), 1, "{events:#?}");
    let e = refused[0];
    assert_eq!(e.level, tracing::Level::WARN);
    assert_eq!(
        (e.field("seq"), e.field("bytes")),
        (Some("7"), Some("100000"))
    );
    assert!(e.field("error").is_some());
}

#[cfg(feature = "tracing")]
#[test]
fn messages_that_fragment_a_lot_say_once_what_to_raise() {
    use rdmsg_testkit::events::recording;

    let ((), events) = recording(|| {
        let mut wire = Wire::new(256);
        let mut tx = SendSide::new(&config(1000), 0);
        for i in 0..300 {
            // Three in four too large for a frame.
            let len = if i % 4 == 0 { 10 } else { 600 };
            tx.send_as(&mut wire, &Blob(vec![0; len]), false).unwrap();
        }
    });
    let told: Vec<_> = events
        .iter()
        .filter(|e| e.message.starts_with("messages go in fragments"))
        .collect();
    assert_eq!(told.len(), 1, "once: {events:#?}");
    assert_eq!(told[0].level, tracing::Level::WARN);
    assert_eq!(
        (told[0].field("fragmented"), told[0].field("frame")),
        (Some("64"), Some("256"))
    );
    assert!(told[0].message.contains("Config::buf_size"));
}

#[test]
fn acknowledgements_that_cannot_go_are_merged_into_few_frames() {
    // A peer that withholds credits while we read 100,000 of its messages.
    let mut tx = SendSide::new(&config(100), 64);
    let frame_max = 4096;
    for seq in 0..100_000u32 {
        tx.queue_acks(&[seq], frame_max);
    }
    let per = (frame_max - crate::frame::HEADER_LEN) / 4;
    assert_eq!(tx.queued_frames(), 100_000usize.div_ceil(per));
    let mut seen = Vec::new();
    for (f, solicited) in &tx.outgoing {
        assert!(*solicited);
        assert!(f.len() <= frame_max);
        let (h, body) = crate::frame::parse(f).unwrap();
        assert_ne!(h.flags & crate::frame::DONE, 0);
        seen.extend(crate::rendezvous::parse_done(body).unwrap());
    }
    assert_eq!(
        seen,
        (0..100_000).collect::<Vec<_>>(),
        "each once, in order"
    );
}

/// The one flush before a wait, as a session's receive and a hub's wait run it: committed
/// frames first (none of the flush goes while one waits), then the flush if it is due by the
/// time given (with a delay allowed, not before it runs out).
#[test]
fn the_flush_before_a_wait_sends_committed_frames_then_flushes_when_due() {
    let zero = Some(Duration::ZERO);
    let delayed = SessionConfig {
        max_unsolicited_delay: Some(Duration::from_millis(5)),
        ..config(100)
    };
    let mut m = PeerMachine::new(
        SendSide::new(&delayed, 64),
        RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20)),
        Outbox::new(1 << 20),
    );
    let mut wire = Wire {
        room: 0,
        ..Wire::new(256)
    };
    m.send
        .commit_as(&mut wire, &Blob(vec![5; 600]), false)
        .unwrap();
    assert!(m.unflushed());
    // Room for one frame of three: some went, the rest and the flush wait.
    wire.room = 1;
    let f = m.flush_before_wait(&mut wire, zero, None).unwrap();
    assert!(!f.drained && f.sent && !f.flushed && f.stuck());
    assert_eq!(wire.frames.len(), 1);
    wire.room = 10;
    // All went; the flush is not due before its delay runs out.
    let sent_at = m.send.flush_deadline().expect("a delay runs") - Duration::from_millis(5);
    let f = m.flush_before_wait(&mut wire, zero, Some(sent_at)).unwrap();
    assert!(f.drained && f.sent && f.flushed && !f.stuck());
    assert_eq!(wire.frames.len(), 3);
    assert!(m.unflushed(), "still pending until the delay runs out");
    // Once it has: the solicited nudge, and nothing left.
    let late = sent_at + Duration::from_millis(5);
    let f = m.flush_before_wait(&mut wire, zero, Some(late)).unwrap();
    assert!(f.drained && !f.sent && f.flushed);
    assert_eq!(wire.frames.len(), 4);
    assert!(wire.frames[3].1, "the nudge is solicited");
    assert!(!m.unflushed());
}

#[test]
fn a_wait_flushes_what_went_unsolicited_once_and_only_with_a_credit() {
    let mut tx = SendSide::new(&config(100), 64);
    let mut wire = Wire::new(256);
    let zero = Some(Duration::ZERO);
    assert!(tx.flush_before_wait(&mut wire, zero).unwrap());
    assert!(wire.frames.is_empty(), "nothing pending, nothing sent");
    tx.send_as(&mut wire, &Other(1), false).unwrap();
    // No credit: the transport solicited the message that spent the last one, so the run
    // counts as flushed (its deadline too).
    let room = std::mem::replace(&mut wire.room, 0);
    assert!(tx.flush_before_wait(&mut wire, zero).unwrap());
    wire.room = room;
    assert_eq!(wire.frames.len(), 1);
    assert!(!tx.pending());
    tx.send_as(&mut wire, &Other(2), false).unwrap();
    // No send slot now: still pending, nothing sent, no sequence number used.
    wire.full = true;
    assert!(!tx.flush_before_wait(&mut wire, zero).unwrap());
    assert!(tx.pending());
    wire.full = false;
    assert!(tx.flush_before_wait(&mut wire, zero).unwrap());
    assert_eq!(wire.frames.len(), 3);
    assert!(wire.frames[2].1, "the nudge is solicited");
    assert!(!tx.pending());
    assert!(tx.flush_before_wait(&mut wire, zero).unwrap());
    assert_eq!((wire.frames.len(), tx.stats.wait_flushes), (3, 1));
}

#[test]
fn a_send_that_times_out_sends_nothing_and_keeps_its_number() {
    let mut tx = SendSide::new(&config(100), 64);
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
    let mut tx = SendSide::new(&config(100), 64);
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
    assert!(tx.send_committed(&mut wire).unwrap());
    assert!(tx.try_send_as(&mut wire, &Other(2), true).unwrap());
    let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
    assert_eq!(solicited, [false, false, false, false, true, true]);
    let mut rx = RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
    let got: Vec<Envelope> = deliver(&wire, &mut rx)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].decode::<Blob>().unwrap(), Blob(vec![7; 1000]));
    assert_eq!(got[1].decode::<Other>().unwrap(), Other(2));
}

/// A commit with no room queues the message whole (nothing on the wire, its number not
/// taken yet); what is sent later goes after it, in order, one frame or many; a record that
/// keeps copies lists a committed message the connection never sent.
#[test]
fn a_commit_without_room_queues_the_message_and_it_goes_first() {
    let mut tx = SendSide::new(&config(100), 64);
    let mut wire = Wire {
        room: 0,
        ..Wire::new(256)
    };
    tx.commit_as(&mut wire, &Other(1), true).unwrap();
    tx.commit_as(&mut wire, &Blob(vec![5; 600]), false).unwrap();
    assert_eq!((tx.seq, wire.frames.len(), tx.queued_frames()), (0, 0, 2));
    // Later sends wait behind them.
    assert!(!tx.try_send_as(&mut wire, &Other(3), true).unwrap());
    // Room for one frame: the first goes, the fragmented one waits whole.
    wire.room = 1;
    assert!(!tx.send_committed(&mut wire).unwrap());
    assert_eq!((tx.seq, wire.frames.len(), tx.queued_frames()), (1, 1, 1));
    wire.room = 10;
    assert!(tx.try_send_as(&mut wire, &Other(3), true).unwrap());
    assert_eq!((tx.seq, tx.queued_frames()), (3, 0));
    let mut rx = RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
    let got: Vec<Envelope> = deliver(&wire, &mut rx)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(got.len(), 3);
    assert_eq!(got[0].decode::<Other>().unwrap(), Other(1));
    assert_eq!(got[1].decode::<Blob>().unwrap(), Blob(vec![5; 600]));
    assert_eq!(got[2].decode::<Other>().unwrap(), Other(3));
    // Too large: an error, and nothing committed.
    let mut small = SendSide::new(
        &SessionConfig {
            max_message: 100,
            ..config(100)
        },
        64,
    );
    wire.room = 0;
    assert!(small
        .commit_as(&mut wire, &Blob(vec![1; 500]), true)
        .is_err());
    assert_eq!(small.queued_frames(), 0);
    // Kept copies include what was committed and never sent.
    let mut keeping = SendSide::new(
        &SessionConfig {
            keep_unconfirmed: Some(1024),
            ..config(100)
        },
        64,
    );
    keeping.commit_as(&mut wire, &Other(9), true).unwrap();
    let left = keeping.take_unconfirmed();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].decode::<Other>().unwrap(), Other(9));
}

#[test]
fn a_flush_goes_after_the_queued_frames() {
    let mut tx = SendSide::new(&config(100), 64);
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
    let mut tx = SendSide::new(&config(100), 64);
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
fn deliver(wire: &Wire, rx: &mut RecvSide) -> Vec<Result<Envelope>> {
    let mut out = Vec::new();
    for (f, _) in &wire.frames {
        rx.arrive(FrameBytes::Owned(f.clone()));
        // A packed frame brings several.
        while let Some(got) = rx.pop() {
            out.push(got);
        }
    }
    out
}

#[test]
fn small_messages_go_whole_large_ones_in_fragments_solicited_last() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(100), 0);
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
    let mut rx = RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
    let envelopes: Vec<Envelope> = deliver(&wire, &mut rx)
        .into_iter()
        .map(|e| e.unwrap())
        .collect();
    let bodies: u64 = envelopes.iter().map(|e| e.body().len() as u64).sum();
    let got: Vec<Blob> = envelopes.iter().map(|e| e.decode().unwrap()).collect();
    assert_eq!(got, [Blob(vec![1; 10]), Blob(vec![2; 1000])]);
    let rs = stats(&tx, &rx);
    assert_eq!(rs.received, 2);
    // Bodies, not frames: the headers of the 6 frames are left out.
    assert!(bodies >= 1010, "{bodies}");
    assert_eq!((st.bytes_sent, rs.bytes_received), (bodies, bodies));
}

#[test]
fn a_hub_wake_up_counts_once_for_a_peer_however_many_frames_it_brought() {
    let mut rx = receiver();
    for wakeup in [0, 0, 0, 3, 3, 4] {
        rx.woken(wakeup);
    }
    assert_eq!(rx.wakeups, 3);
}

#[test]
fn the_policy_solicits_long_runs_and_flush_ends_a_burst() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(3), 64);
    for i in 0..5 {
        tx.send_as(&mut wire, &Blob(vec![i]), false).unwrap();
    }
    tx.flush(&mut wire).unwrap();
    tx.flush(&mut wire).unwrap();
    let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
    assert_eq!(solicited, [false, false, false, true, false, true]);
    assert_eq!(tx.stats.policy_solicited, 1);
    let mut rx = RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
    assert_eq!(
        deliver(&wire, &mut rx).len(),
        5,
        "the nudge carries nothing"
    );
}

#[test]
fn a_batch_solicits_its_last_message_only() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(100), 0);
    let batch: Vec<Blob> = (0..4).map(|i| Blob(vec![i])).collect();
    assert_eq!(tx.send_batch(&mut wire, &batch).unwrap(), 4);
    let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
    assert_eq!(
        solicited,
        [true],
        "packed into one frame, which holds the last"
    );
    let seqs: Vec<u32> = deliver(
        &wire,
        &mut RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20)),
    )
    .into_iter()
    .map(|e| e.unwrap().seq())
    .collect();
    assert_eq!(seqs, [0, 1, 2, 3]);
}

#[test]
fn the_default_run_is_a_quarter_of_the_peer_depth() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&SessionConfig::default(), 8);
    for _ in 0..3 {
        tx.send_as(&mut wire, &Blob(vec![]), false).unwrap();
    }
    let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
    assert_eq!(solicited, [false, false, true]);
}

#[test]
fn a_dropped_frame_is_counted_and_the_next_one_decodes() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(100), 0);
    tx.send_as(&mut wire, &Other(1), true).unwrap();
    tx.send_as(&mut wire, &Blob(vec![1]), true).unwrap();
    wire.frames.insert(0, (b"garbage".to_vec(), true));
    let mut decoder = Decoder::new(1 << 20);
    decoder.register::<Blob>().unwrap();
    let mut rx = RecvSide::new(decoder, ReadPool::new(1 << 20));
    let got = deliver(&wire, &mut rx);
    assert!(matches!(got[0], Err(Error::BadFrame(_))));
    assert!(matches!(got[1], Err(Error::UnknownTag { tag, .. }) if tag == Other::TAG));
    assert_eq!(
        got[2].as_ref().unwrap().decode::<Blob>().unwrap(),
        Blob(vec![1])
    );
    let st = stats(&tx, &rx);
    assert_eq!((st.received, st.dropped_frames), (1, 2));
}

/// Frames a receiver takes in, as a connection hands them over.
fn arrive_all(wire: &mut Wire, rx: &mut RecvSide) {
    for (f, _) in wire.frames.drain(..) {
        rx.arrive(FrameBytes::Owned(f));
    }
}

#[test]
fn the_record_says_what_the_peer_took_and_hands_back_the_rest_in_order() {
    let keep = SessionConfig {
        keep_unconfirmed: Some(1 << 20),
        ..config(100)
    };
    let (mut a_tx, mut a_rx) = (SendSide::new(&keep, 64), receiver());
    let (mut b_tx, mut b_rx) = (SendSide::new(&config(100), 64), receiver());
    let (mut ab, mut ba) = (Wire::new(256), Wire::new(256));
    // Small ones whole, a large one in fragments.
    let sent: Vec<Blob> = (0..10u8)
        .map(|i| Blob(vec![i; 30 + 100 * usize::from(i == 7)]))
        .collect();
    for m in &sent {
        a_tx.send_as(&mut ab, m, false).unwrap();
    }
    arrive_all(&mut ab, &mut b_rx);
    for _ in 0..6 {
        b_rx.pop().unwrap().unwrap();
    }
    // B's next frame, whatever it is, carries its count.
    took(&mut b_tx, &mut b_rx);
    b_tx.send_as(&mut ba, &Other(1), false).unwrap();
    arrive_all(&mut ba, &mut a_rx);
    exchange_acks(&mut a_tx, &mut a_rx, 256);
    assert_eq!(a_tx.delivery(None), Delivery { sent: 10, taken: 6 });
    let back = a_tx.take_unconfirmed();
    let seqs: Vec<u32> = back.iter().map(Envelope::seq).collect();
    assert_eq!(seqs, [6, 7, 8, 9], "the untaken ones, in order");
    for env in &back {
        assert_eq!(env.decode::<Blob>().unwrap(), sent[env.seq() as usize]);
    }
    // A count behind one already seen (an older frame) changes nothing.
    a_tx.learn_taken(2);
    assert_eq!(a_tx.delivery(None).taken, 6);
}

#[test]
fn a_sender_out_of_room_asks_once_and_the_answer_comes_when_the_peer_took_that_far() {
    let (mut a_tx, mut a_rx) = (SendSide::new(&config(100), 64), receiver());
    let (mut b_tx, mut b_rx) = (SendSide::new(&config(100), 64), receiver());
    let (mut ab, mut ba) = (Wire::new(256), Wire::new(256));
    let window = MAX_UNCONFIRMED as usize;
    for _ in 0..window {
        assert!(a_tx.try_send_as(&mut ab, &Other(0), false).unwrap());
    }
    assert!(
        !a_tx.try_send_as(&mut ab, &Other(0), false).unwrap(),
        "out of room"
    );
    assert!(
        a_tx.send_as(&mut ab, &Other(0), false).is_err(),
        "a send that cannot wait for the record times out"
    );
    let asks: Vec<u32> = ab
        .frames
        .iter()
        .filter_map(|(f, solicited)| {
            let (h, _) = crate::frame::parse(f).unwrap();
            (h.flags & crate::frame::ASK != 0).then(|| {
                assert!(*solicited, "a request wakes the peer");
                h.seq
            })
        })
        .collect();
    assert_eq!(asks, [window as u32 / 2], "asked once, at half the window");
    arrive_all(&mut ab, &mut b_rx);
    for _ in 0..window / 2 - 1 {
        b_rx.pop().unwrap().unwrap();
    }
    assert!(!took(&mut b_tx, &mut b_rx), "not that far yet");
    b_rx.pop().unwrap().unwrap();
    assert!(took(&mut b_tx, &mut b_rx), "answered");
    assert!(b_tx.send_committed(&mut ba).unwrap());
    assert!(ba.frames.iter().all(|(_, solicited)| *solicited));
    arrive_all(&mut ba, &mut a_rx);
    exchange_acks(&mut a_tx, &mut a_rx, 256);
    assert_eq!(a_tx.delivery(None).taken, window as u64 / 2);
    assert!(
        a_tx.try_send_as(&mut ab, &Other(0), false).unwrap(),
        "room again"
    );
}

#[test]
fn a_close_sends_in_order_drops_a_message_failing_alone_and_ends_by_its_deadline() {
    let small = SessionConfig {
        max_message: 100,
        ..config(100)
    };
    let mut tx = SendSide::new(&small, 64);
    let mut wire = Wire {
        room: 0,
        ..Wire::new(256)
    };
    tx.commit_as(&mut wire, &Other(1), true).unwrap();
    let mut outbox = Outbox::new(1 << 20);
    let owned = |m: Box<dyn Outgoing>| {
        let size = m.size();
        (m, size)
    };
    for (m, size) in [
        owned(Box::new(Owned {
            m: Other(2),
            solicited: true,
        })),
        // Larger than `max_message`: it fails alone.
        owned(Box::new(Owned {
            m: Blob(vec![1; 500]),
            solicited: true,
        })),
        owned(Box::new(Owned {
            m: Other(3),
            solicited: true,
        })),
    ] {
        outbox.push(m, size);
    }
    // No room and no time: the close gives up at once, nothing sent, nothing settled.
    let now = Instant::now();
    let hurried = Closing::begin(now, Duration::ZERO, false);
    let waited = hurried.wait(&mut tx, &mut wire, &mut outbox).unwrap();
    // The outbox joined the committed messages; the one that cannot go is dropped and
    // counted, and the rest go on.
    assert_eq!(waited.dropped, 1);
    assert!(wire.frames.is_empty());
    assert!(!hurried.settled(&tx, &outbox));
    assert!(hurried.due(Instant::now(), &tx, &outbox), "out of time");
    // With room: what was committed first, then the outbox in order.
    wire.room = 10;
    let closing = Closing::begin(Instant::now(), Duration::from_secs(5), false);
    assert!(!closing.due(Instant::now(), &tx, &outbox));
    let waited = closing.wait(&mut tx, &mut wire, &mut outbox).unwrap();
    assert_eq!((waited.unread, waited.dropped), (0, 0));
    assert!(closing.settled(&tx, &outbox));
    assert_eq!(outbox.stats().dropped, 1);
    let mut rx = RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20));
    let got: Vec<Other> = deliver(&wire, &mut rx)
        .into_iter()
        .map(|r| r.unwrap().decode::<Other>().unwrap())
        .collect();
    assert_eq!(got, [Other(1), Other(2), Other(3)]);
}

#[test]
fn a_close_waiting_for_the_record_asks_once_everything_went() {
    let keeping = SessionConfig {
        keep_unconfirmed: Some(1 << 20),
        ..config(100)
    };
    let mut tx = SendSide::new(&keeping, 64);
    let mut wire = Wire::new(256);
    tx.send_as(&mut wire, &Other(1), true).unwrap();
    let mut outbox = Outbox::new(1 << 20);
    outbox.push(
        Box::new(Owned {
            m: Other(2),
            solicited: true,
        }),
        2,
    );
    let closing = Closing::begin(Instant::now(), Duration::from_secs(5), true);
    assert!(!closing.ask(&mut tx, &outbox), "not while the outbox waits");
    outbox.send_ready(&mut tx, &mut wire).unwrap();
    assert!(closing.ask(&mut tx, &outbox), "asked about both");
    assert!(!closing.settled(&tx, &outbox), "the ask is still to go");
    tx.send_committed(&mut wire).unwrap();
    assert!(
        !closing.settled(&tx, &outbox),
        "the peer has not said it took them"
    );
    assert!(!closing.ask(&mut tx, &outbox), "asked once");
}
