//! Resuming on a new connection: a cut at each point of a message's life, then both sides
//! suspend, exchange their counts, and the sender goes again from the peer's; every message
//! is handed to the application once, in order, under its own number.

use super::*;
use crate::error::Unresumable;

fn keeping() -> SessionConfig {
    SessionConfig {
        keep_unconfirmed: Some(1 << 20),
        ..config(100)
    }
}

/// One side of a session: its machine, and the wire its frames go out on.
struct Side {
    m: PeerMachine,
    out: Wire,
    /// What its application took, in order: (number, message).
    got: Vec<(u32, Blob)>,
}

impl Side {
    fn new() -> Self {
        Self {
            m: PeerMachine::new(
                SendSide::new(&keeping(), 64),
                receiver(),
                Outbox::new(1 << 20),
            ),
            out: Wire::new(256),
            got: Vec::new(),
        }
    }

    fn send(&mut self, m: &Blob) {
        self.m.send.send_as(&mut self.out, m, false).unwrap();
    }

    /// The first `n` frames on the wire reach `to` (the rest are lost when the link is cut).
    fn deliver_frames(&mut self, to: &mut Side, n: usize) {
        let n = n.min(self.out.frames.len());
        for (f, _) in self.out.frames.drain(..n) {
            to.m.recv.arrive(FrameBytes::Owned(f));
        }
    }

    /// Its application takes up to `n` of what arrived.
    fn take(&mut self, n: usize) {
        for _ in 0..n {
            let Some(got) = self.m.recv.pop() else { break };
            let env = got.unwrap();
            self.got.push((env.seq(), env.decode::<Blob>().unwrap()));
        }
        took(&mut self.m.send, &mut self.m.recv);
    }

    /// The link is cut: what is on the wire is lost.
    fn cut(&mut self) -> u32 {
        self.out.frames.clear();
        self.m.suspend(None)
    }
}

/// Both sides suspend, tell each other their counts and resume; what goes again is sent.
fn resume(a: &mut Side, b: &mut Side) -> (usize, usize) {
    let (a_took, b_took) = (a.cut(), b.cut());
    let again = (a.m.resume(b_took).unwrap(), b.m.resume(a_took).unwrap());
    assert!(a.m.send.send_committed(&mut a.out).unwrap());
    assert!(b.m.send.send_committed(&mut b.out).unwrap());
    again
}

fn blobs(from: u8, n: u8) -> Vec<Blob> {
    // Every fifth is fragmented (a 256-byte wire).
    (from..from + n)
        .map(|i| Blob(vec![i; 20 + 600 * usize::from(i % 5 == 4)]))
        .collect()
}

fn numbered(all: &[Blob]) -> Vec<(u32, Blob)> {
    (0..).zip(all.iter().map(|b| Blob(b.0.clone()))).collect()
}

#[test]
fn a_cut_before_the_frames_arrive_sends_the_rest_again_once_in_order() {
    let (mut a, mut b) = (Side::new(), Side::new());
    let sent = blobs(0, 10);
    for m in &sent {
        a.send(m);
    }
    // Three frames arrive, two are taken; the rest (a fragmented message among them) is lost.
    a.deliver_frames(&mut b, 3);
    b.take(2);
    let (again, _) = resume(&mut a, &mut b);
    assert_eq!(again, 8, "everything from the peer's count on");
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(b.got, numbered(&sent));
    assert_eq!(a.m.stats().resumed_messages, 8);
    assert_eq!(a.m.stats().resumes, 1);
    // Later messages follow under the next numbers.
    a.send(&Blob(vec![99; 5]));
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(b.got.last().unwrap(), &(10, Blob(vec![99; 5])));
}

#[test]
fn a_cut_after_the_peer_took_but_before_the_record_came_back_sends_nothing_again() {
    let (mut a, mut b) = (Side::new(), Side::new());
    let sent = blobs(0, 5);
    for m in &sent {
        a.send(m);
    }
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(
        a.m.send.delivery(None).taken,
        0,
        "the record never came back"
    );
    let (again, _) = resume(&mut a, &mut b);
    assert_eq!(again, 0);
    assert_eq!(a.m.send.delivery(None), Delivery { sent: 5, taken: 5 });
    a.send(&Blob(vec![7; 3]));
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    let mut want = numbered(&sent);
    want.push((5, Blob(vec![7; 3])));
    assert_eq!(b.got, want, "once each");
}

#[test]
fn a_cut_in_the_middle_of_a_fragmented_message_sends_it_again_whole() {
    let (mut a, mut b) = (Side::new(), Side::new());
    let sent = vec![Blob(vec![1; 10]), Blob(vec![2; 2000]), Blob(vec![3; 10])];
    for m in &sent {
        a.send(m);
    }
    // The small one and two fragments of the large one.
    a.deliver_frames(&mut b, 3);
    b.take(usize::MAX);
    assert_eq!(b.got.len(), 1);
    assert!(b.m.recv.decoder().partial().is_some(), "in reassembly");
    let (again, _) = resume(&mut a, &mut b);
    assert_eq!(again, 2);
    assert!(b.m.recv.decoder().partial().is_none(), "dropped at the cut");
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(b.got, numbered(&sent));
}

#[test]
fn a_cut_while_a_message_waits_for_its_read_drops_it_to_come_again() {
    let mut b = Side::new();
    // A descriptor for message 0, waiting (the test wire reads nothing), and message 1
    // behind it.
    b.m.recv
        .on_descriptor(Blob::TAG, 0, one_remote_piece(100_000));
    let mut a = Side::new();
    a.m.send.seq = 1;
    a.send(&Blob(vec![1; 10]));
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert!(b.got.is_empty(), "held behind the read");
    assert_eq!(b.cut(), 0, "nothing taken");
    assert!(!b.m.recv.has_waiting() && !b.m.recv.has_ready());
    // The peer sends both again from 0, the large one now in fragments.
    let mut again = Side::new();
    again.send(&Blob(vec![0; 3000]));
    again.send(&Blob(vec![1; 10]));
    again.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(b.got, numbered(&[Blob(vec![0; 3000]), Blob(vec![1; 10])]));
}

#[test]
fn a_cut_during_a_call_sends_the_answer_the_caller_never_got_again() {
    let (mut a, mut b) = (Side::new(), Side::new());
    // A's request reaches B and is taken; B's answer is lost with the link.
    a.send(&Blob(vec![1; 8]));
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    b.send(&Blob(vec![2; 8]));
    let (a_again, b_again) = resume(&mut a, &mut b);
    assert_eq!(
        (a_again, b_again),
        (0, 1),
        "the request was taken; the answer goes again"
    );
    b.deliver_frames(&mut a, usize::MAX);
    a.take(usize::MAX);
    assert_eq!(a.got, numbered(&[Blob(vec![2; 8])]));
    assert_eq!(b.got, numbered(&[Blob(vec![1; 8])]));
}

#[test]
fn messages_committed_and_not_sent_follow_those_sent_again() {
    let (mut a, mut b) = (Side::new(), Side::new());
    let sent = blobs(0, 4);
    for m in &sent[..2] {
        a.send(m);
    }
    // No credit: the next two wait committed, unnumbered.
    a.out.room = 0;
    for m in &sent[2..] {
        a.m.send.commit_as(&mut a.out, m, false).unwrap();
    }
    a.out.room = usize::MAX;
    let (again, _) = resume(&mut a, &mut b);
    assert_eq!(again, 2);
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(b.got, numbered(&sent));
}

#[test]
fn several_cuts_in_a_row_lose_and_repeat_nothing() {
    let (mut a, mut b) = (Side::new(), Side::new());
    let sent = blobs(0, 60);
    let mut next = 0;
    for round in 0..12usize {
        for m in &sent[next..(next + 5).min(sent.len())] {
            a.send(m);
        }
        next = (next + 5).min(sent.len());
        a.deliver_frames(&mut b, round % 4);
        b.take(round % 3);
        // Sometimes the record comes back first.
        if round % 2 == 0 {
            b.m.send.send_as(&mut b.out, &Blob(vec![]), false).unwrap();
            b.deliver_frames(&mut a, usize::MAX);
            exchange_acks(&mut a.m.send, &mut a.m.recv, 256);
            a.take(usize::MAX);
        }
        resume(&mut a, &mut b);
    }
    a.deliver_frames(&mut b, usize::MAX);
    b.take(usize::MAX);
    assert_eq!(b.got, numbered(&sent));
    assert_eq!(a.m.stats().resumes, 12);
}

#[test]
fn a_count_that_cannot_be_true_refuses_the_resume() {
    let mut a = Side::new();
    for m in &blobs(0, 5) {
        a.send(m);
    }
    a.m.send.learn_taken(3);
    a.cut();
    let refused = |a: &mut Side, peer: u32| match a.m.resume(peer) {
        Err(Error::CannotResume(why)) => why,
        other => panic!("refused, not {other:?}"),
    };
    assert_eq!(
        refused(&mut a, 0),
        Unresumable::PeerRestarted { known: 3, peer: 0 },
        "behind what the peer told us: its numbers are gone"
    );
    assert_eq!(
        refused(&mut a, 6),
        Unresumable::BeyondSent { sent: 5, peer: 6 }
    );
    assert!(Error::CannotResume(Unresumable::NoCopies).is_fatal());
    // The record is as it was: a true count still resumes.
    assert_eq!(a.m.resume(4).unwrap(), 1);
    let mut plain = PeerMachine::new(
        SendSide::new(&config(100), 64),
        receiver(),
        Outbox::new(1 << 20),
    );
    plain
        .send
        .send_as(&mut Wire::new(256), &Blob(vec![1]), false)
        .unwrap();
    assert!(matches!(
        plain.resume(0),
        Err(Error::CannotResume(Unresumable::NoCopies))
    ));
}
