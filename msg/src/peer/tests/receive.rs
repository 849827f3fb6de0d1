//! The receiving side: rendezvous reads, held frames, a hub's reassembly budget.

use super::*;

/// A descriptor of a message of `total` bytes lying whole in the peer's memory.
pub(super) fn one_remote_piece(total: u32) -> Descriptor {
    Descriptor {
        total,
        segments: vec![Segment::Remote {
            len: total,
            addr: 0x1000,
            rkey: 9,
        }],
    }
}

pub(super) fn receiver() -> RecvSide {
    RecvSide::new(Decoder::new(1 << 20), ReadPool::new(1 << 20))
}

#[test]
fn frames_behind_a_head_that_waits_for_room_are_held_unread_then_delivered_after_it() {
    // The application holds nearly all of the read pool: the head cannot be read yet.
    let pool = ReadPool::new(1 << 20);
    pool.occupy((1 << 20) - 1000);
    let mut rx = RecvSide::new(Decoder::new(1 << 20), pool);
    rx.on_descriptor(Blob::TAG, 0, one_remote_piece(100_000));
    let mut wire = Wire::new(256);
    rx.advance(&mut wire).unwrap();
    // The peer goes on sending fragmented messages behind it.
    let mut tx = SendSide::new(&config(100), 64);
    tx.seq = 1;
    for i in 0..200u8 {
        tx.send_as(&mut wire, &Blob(vec![i; 1000]), false).unwrap();
    }
    let frames = wire.frames.len();
    arrive_all(&mut wire, &mut rx);
    assert_eq!(
        rx.parked.len(),
        frames,
        "held as they came, their buffers with them"
    );
    assert_eq!(rx.order.len(), 1, "nothing decoded behind the head");
    assert_eq!(rx.decoder.buffered(), 0, "nothing copied");
    assert!(rx.pop().is_none());
    assert!(rx.has_waiting());
    // The connection fails: the head fails in its place, then everything held, in order.
    rx.abandon_reads();
    assert!(matches!(
        rx.pop(),
        Some(Err(Error::ReadFailed { seq: 0, .. }))
    ));
    for i in 0..200u8 {
        let got: Blob = rx.pop().unwrap().unwrap().decode().unwrap();
        assert_eq!(got, Blob(vec![i; 1000]));
    }
    assert!(rx.pop().is_none());
}

#[test]
fn a_hub_bounds_the_messages_its_peers_reassemble_at_once() {
    // Room for one message of 2,000 bytes in reassembly, hub-wide.
    let budget = ReassemblyBudget::new(3000, TIMEOUT);
    let peer =
        || RecvSide::new(Decoder::new(1 << 16), ReadPool::new(1 << 20)).with_budget(budget.clone());
    let (mut a, mut b) = (peer(), peer());
    let (mut wa, mut wb) = (Wire::new(256), Wire::new(256));
    SendSide::new(&config(100), 64)
        .send_as(&mut wa, &Blob(vec![1; 2000]), false)
        .unwrap();
    SendSide::new(&config(100), 64)
        .send_as(&mut wb, &Blob(vec![2; 2000]), false)
        .unwrap();
    let mut a_frames = std::mem::take(&mut wa.frames).into_iter();
    a.arrive(FrameBytes::Owned(a_frames.next().unwrap().0));
    assert_eq!(
        budget.used(),
        2003,
        "a's message reserves what its first fragment announced"
    );
    let b_frames = wb.frames.len();
    arrive_all(&mut wb, &mut b);
    assert_eq!(b.parked.len(), b_frames, "b waits, its frames held unread");
    assert!(b.pop().is_none() && b.has_waiting());
    for (f, _) in a_frames {
        a.arrive(FrameBytes::Owned(f));
    }
    let got: Blob = a.pop().unwrap().unwrap().decode().unwrap();
    assert_eq!(got, Blob(vec![1; 2000]));
    assert_eq!(budget.used(), 0, "released once a's message is whole");
    b.advance(&mut wb).unwrap();
    let got: Blob = b.pop().unwrap().unwrap().decode().unwrap();
    assert_eq!(got, Blob(vec![2; 2000]));
    assert_eq!(budget.used(), 0);
}

#[test]
fn a_peer_reads_into_at_most_its_part_of_a_shared_pool() {
    let pool = ReadPool::new(1 << 20);
    assert!(
        pool.within_share(0, 1 << 20),
        "one with nothing under way always may"
    );
    pool.reading(true);
    assert!(
        pool.within_share(512 << 10, 512 << 10),
        "alone: the whole pool"
    );
    pool.reading(true);
    pool.reading(true);
    pool.reading(true);
    // Four peers reading: a quarter each.
    assert!(pool.within_share(128 << 10, 128 << 10));
    assert!(!pool.within_share(200 << 10, 100 << 10));
    assert!(
        pool.within_share(0, 1 << 20),
        "a newcomer still gets one read"
    );
    for _ in 0..3 {
        pool.reading(false);
    }
    assert!(pool.within_share(512 << 10, 512 << 10), "alone again");
}

#[test]
fn a_peer_that_fails_mid_message_gives_its_reassembly_budget_back() {
    let budget = ReassemblyBudget::new(1 << 16, TIMEOUT);
    let mut rx =
        RecvSide::new(Decoder::new(1 << 16), ReadPool::new(1 << 20)).with_budget(budget.clone());
    let mut wire = Wire::new(256);
    SendSide::new(&config(100), 64)
        .send_as(&mut wire, &Blob(vec![1; 2000]), false)
        .unwrap();
    rx.arrive(FrameBytes::Owned(wire.frames.remove(0).0));
    assert_eq!(budget.used(), 2003, "what the message announced");
    // The connection fails with the message half reassembled.
    rx.abandon_reads();
    assert_eq!(budget.used(), 0, "given back at the failure");
    drop(rx);
    assert_eq!(budget.used(), 0, "and not twice");
}

/// The progress deadline of the budget tests ([`SessionConfig::reassembly_timeout`]).
const TIMEOUT: Duration = Duration::from_secs(10);

/// The defaults of a hub: 16 MiB messages, 256 MiB in reassembly for all peers.
const MAX_MESSAGE: usize = 16 << 20;
const MAX_REASSEMBLY: usize = 256 << 20;

/// A hub's peer with the default bounds, on `budget`.
fn hub_peer(budget: &ReassemblyBudget) -> RecvSide {
    RecvSide::new(Decoder::new(MAX_MESSAGE), ReadPool::new(1 << 20)).with_budget(budget.clone())
}

/// The frames of a `Blob` of `len` bytes sent as message `seq`, in fragments of 256 bytes.
fn blob_frames(seq: u32, fill: u8, len: usize) -> Vec<Vec<u8>> {
    let mut wire = Wire::new(256);
    let fragments = SessionConfig {
        rendezvous_threshold: None,
        ..config(100)
    };
    let mut tx = SendSide::new(&fragments, 64);
    tx.seq = seq;
    tx.send_as(&mut wire, &Blob(vec![fill; len]), false)
        .unwrap();
    wire.frames.into_iter().map(|(f, _)| f).collect()
}

fn arrive(rx: &mut RecvSide, frames: impl IntoIterator<Item = Vec<u8>>) {
    for f in frames {
        rx.arrive(FrameBytes::Owned(f));
    }
}

fn pop_blob(rx: &mut RecvSide) -> Blob {
    match rx.pop() {
        Some(Ok(env)) => env.decode().unwrap(),
        other => panic!("a message, not {other:?}"),
    }
}

#[test]
fn stalled_small_messages_reserve_what_they_announced_not_max_message() {
    let budget = ReassemblyBudget::new(MAX_REASSEMBLY, TIMEOUT);
    // 16 peers each send the first fragment of a 2,000-byte message, then nothing.
    let mut stalled: Vec<RecvSide> = (0..16).map(|_| hub_peer(&budget)).collect();
    for (i, rx) in stalled.iter_mut().enumerate() {
        let first = blob_frames(0, i as u8, 2000).swap_remove(0);
        arrive(rx, [first]);
        assert!(rx.pop().is_none() && !rx.has_waiting(), "under way");
    }
    assert!(
        budget.used() < 16 * 2100,
        "each holds what its message announced: {} bytes held",
        budget.used()
    );
    // A 17th peer's message in fragments goes through at once.
    let mut late = hub_peer(&budget);
    arrive(&mut late, blob_frames(0, 0xee, 5000));
    assert!(!late.has_waiting(), "nothing parked");
    assert_eq!(pop_blob(&mut late), Blob(vec![0xee; 5000]));
    // And the stalled ones still finish when their fragments come.
    for (i, rx) in stalled.iter_mut().enumerate() {
        arrive(rx, blob_frames(0, i as u8, 2000).into_iter().skip(1));
        assert_eq!(pop_blob(rx), Blob(vec![i as u8; 2000]));
    }
    assert_eq!(budget.used(), 0);
}

#[test]
fn stalled_large_messages_time_out_alone_and_give_their_budget_back() {
    let budget = ReassemblyBudget::new(MAX_REASSEMBLY, TIMEOUT);
    // A message of exactly max_message, in fragments of 64 KiB: 16 of them fill the budget.
    let body = vec![0u8; MAX_MESSAGE];
    let big = crate::codec::fragment(&body, Blob::TAG, 0, 1 << 16, MAX_MESSAGE).unwrap();
    let t0 = Instant::now();
    let mut stalled: Vec<RecvSide> = (0..16).map(|_| hub_peer(&budget)).collect();
    for rx in &mut stalled {
        arrive(rx, [big[0].clone()]);
        rx.handle_timeout(t0);
        assert_eq!(rx.poll_timeout(), Some(t0 + TIMEOUT));
    }
    assert_eq!(budget.used(), MAX_REASSEMBLY, "the budget is full");
    // A 17th peer's message waits for room, its frames unread.
    let mut late = hub_peer(&budget);
    let frames = blob_frames(0, 0xee, 5000);
    let count = frames.len();
    arrive(&mut late, frames);
    assert_eq!(late.parked.len(), count);
    assert!(late.pop().is_none());
    // Not before the deadline...
    for rx in &mut stalled {
        rx.handle_timeout(t0 + TIMEOUT - Duration::from_millis(1));
        assert!(rx.pop().is_none());
    }
    assert_eq!(budget.used(), MAX_REASSEMBLY);
    // ...but at it, each stalled message fails alone, in its place.
    for rx in &mut stalled {
        rx.handle_timeout(t0 + TIMEOUT);
        match rx.pop() {
            Some(Err(Error::ReassemblyTimedOut {
                tag,
                seq: 0,
                received,
                after: TIMEOUT,
            })) => {
                assert_eq!((tag, received), (Blob::TAG, big[0].len() - 24));
            }
            other => panic!("ReassemblyTimedOut in its place, not {other:?}"),
        }
        assert_eq!(rx.poll_timeout(), None, "nothing left to watch");
    }
    assert_eq!(budget.used(), 0, "every reservation went back");
    // The 17th goes through now.
    late.advance(&mut Wire::new(256)).unwrap();
    assert_eq!(pop_blob(&mut late), Blob(vec![0xee; 5000]));
    assert_eq!(budget.used(), 0);
    // Late fragments of a message that timed out are dropped quietly; the peer's next
    // message is whole.
    let rx = &mut stalled[0];
    arrive(rx, big[1..4].iter().cloned());
    assert!(rx.pop().is_none(), "dropped quietly");
    assert_eq!(budget.used(), 0, "nothing reserved for them");
    arrive(rx, blob_frames(1, 7, 3000));
    assert_eq!(pop_blob(rx), Blob(vec![7; 3000]));
    assert_eq!(budget.used(), 0);
}

#[test]
fn a_message_whose_fragments_keep_coming_does_not_time_out() {
    let budget = ReassemblyBudget::new(MAX_REASSEMBLY, TIMEOUT);
    let mut rx = hub_peer(&budget);
    let frames = blob_frames(0, 3, 2000);
    let t0 = Instant::now();
    let secs = |s| t0 + Duration::from_secs(s);
    arrive(&mut rx, [frames[0].clone()]);
    rx.handle_timeout(t0);
    arrive(&mut rx, [frames[1].clone()]);
    // A fragment came: the deadline moves on from when the owner next looks.
    rx.handle_timeout(secs(8));
    assert_eq!(rx.poll_timeout(), Some(secs(18)));
    rx.handle_timeout(secs(17));
    assert!(rx.pop().is_none(), "still under way");
    arrive(&mut rx, frames[2..].iter().cloned());
    rx.handle_timeout(secs(30));
    assert_eq!(pop_blob(&mut rx), Blob(vec![3; 2000]));
    assert_eq!(rx.poll_timeout(), None);
    assert_eq!(budget.used(), 0);
}

#[test]
fn a_peer_that_keeps_sending_large_messages_cannot_starve_another() {
    // Room for one message of 40,000 bytes at a time.
    let budget = ReassemblyBudget::new(1 << 16, TIMEOUT);
    let peer =
        || RecvSide::new(Decoder::new(1 << 16), ReadPool::new(1 << 20)).with_budget(budget.clone());
    let (mut a, mut b) = (peer(), peer());
    let a1 = blob_frames(0, 1, 40_000);
    arrive(&mut a, [a1[0].clone()]);
    // b starts one too: no room, it waits its turn.
    arrive(&mut b, blob_frames(0, 2, 40_000));
    assert!(b.has_waiting() && b.pop().is_none());
    // a finishes its message and at once starts the next one, before b looks again.
    arrive(&mut a, a1[1..].iter().cloned());
    assert_eq!(pop_blob(&mut a), Blob(vec![1; 40_000]));
    let a2 = blob_frames(1, 3, 40_000);
    arrive(&mut a, a2.iter().cloned());
    assert!(
        a.has_waiting() && a.pop().is_none(),
        "a waits behind b, who waited first"
    );
    b.advance(&mut Wire::new(256)).unwrap();
    assert_eq!(pop_blob(&mut b), Blob(vec![2; 40_000]));
    a.advance(&mut Wire::new(256)).unwrap();
    assert_eq!(pop_blob(&mut a), Blob(vec![3; 40_000]));
    assert_eq!(budget.used(), 0);
}

#[test]
fn a_peer_that_goes_away_while_it_waits_does_not_hold_up_the_others() {
    let budget = ReassemblyBudget::new(1 << 16, TIMEOUT);
    let peer =
        || RecvSide::new(Decoder::new(1 << 16), ReadPool::new(1 << 20)).with_budget(budget.clone());
    let (mut a, mut b, mut c) = (peer(), peer(), peer());
    let a1 = blob_frames(0, 1, 40_000);
    arrive(&mut a, [a1[0].clone()]);
    arrive(&mut b, blob_frames(0, 2, 40_000));
    arrive(&mut c, blob_frames(0, 3, 40_000));
    assert!(b.has_waiting() && c.has_waiting());
    // b, first in line, goes.
    drop(b);
    arrive(&mut a, a1[1..].iter().cloned());
    assert_eq!(pop_blob(&mut a), Blob(vec![1; 40_000]));
    c.advance(&mut Wire::new(256)).unwrap();
    assert_eq!(pop_blob(&mut c), Blob(vec![3; 40_000]));
    assert_eq!(budget.used(), 0);
}

/// While the application holds as much of a peer's messages as it may (a call's wait keeps
/// them), the receiver takes no new message in: the frames stay parked in their receive
/// buffers, so the peer's credits stop coming back and its sends stop, however it sends
/// (fragments, whose buffers would otherwise return at once). A message under way finishes;
/// acknowledgements still pass; released, everything comes, in order.
#[test]
fn a_held_back_receiver_stops_a_streaming_peer_by_its_credits() {
    let credits = 16;
    let mut tx = SendSide::new(&config(100), 64);
    let mut wire = Wire {
        room: credits,
        ..Wire::new(256)
    };
    let mut rx = receiver();
    // Five fragments each; the first message is under way when the hold begins.
    let blob = |i: u32| Blob(vec![i as u8; 1000]);
    assert!(tx.try_send_as(&mut wire, &blob(0), false).unwrap());
    assert!(tx.send_committed(&mut wire).unwrap());
    let mut first = std::mem::take(&mut wire.frames).into_iter();
    rx.arrive(FrameBytes::Owned(first.next().unwrap().0));
    rx.hold_back(true);
    for (f, _) in first {
        rx.arrive(FrameBytes::Owned(f));
    }
    assert_eq!(rx.order.len(), 1, "the message under way finished");
    assert!(rx.parked.is_empty());
    wire.room += 5;
    // The peer streams; a frame taken in gives its credit back, a parked one keeps it.
    let mut sent = 1u32;
    for _ in 0..100 {
        while tx.try_send_as(&mut wire, &blob(sent), false).unwrap() {
            sent += 1;
        }
        tx.send_committed(&mut wire).unwrap();
        let (arrived, parked) = (wire.frames.len(), rx.parked.len());
        arrive_all(&mut wire, &mut rx);
        wire.room += arrived - (rx.parked.len() - parked);
    }
    assert_eq!(
        (wire.room, rx.parked.len()),
        (0, credits),
        "the peer is out of credits, every one of them in a parked frame"
    );
    assert!(sent <= 5, "the peer stopped after {sent} messages");
    assert_eq!(rx.decoder.buffered(), 0, "nothing reassembled");
    assert_eq!(rx.order.len(), 1, "nothing new to hand over");
    assert!(tx.queued_frames() > 0, "its last message waits for credits");
    // Acknowledgements are not held back.
    let mut acks = SendSide::new(&config(100), 64);
    acks.queue_acks(&[0], 256);
    let mut ack_wire = Wire::new(256);
    acks.send_committed(&mut ack_wire).unwrap();
    arrive_all(&mut ack_wire, &mut rx);
    assert_eq!(rx.take_acked(), [0]);
    // Released: the parked frames come in, the peer's credits with them, and everything
    // arrives once, in order.
    rx.hold_back(false);
    let mut got = Vec::new();
    loop {
        rx.advance(&mut wire).unwrap();
        while let Some(env) = rx.pop() {
            got.push(env.unwrap().decode::<Blob>().unwrap());
        }
        wire.room += credits;
        tx.send_committed(&mut wire).unwrap();
        if wire.frames.is_empty() && rx.parked.is_empty() {
            break;
        }
        arrive_all(&mut wire, &mut rx);
    }
    assert_eq!(got, (0..sent).map(blob).collect::<Vec<_>>());
}

#[test]
fn new_limits_apply_to_every_peer_at_once() {
    // Room for both messages at first; then a lower bound and a shorter timeout, set while
    // the peers are connected (`Hub::set_limits`).
    let budget = ReassemblyBudget::new(1 << 16, TIMEOUT);
    let (mut a, mut b) = (hub_peer(&budget), hub_peer(&budget));
    let mut a_frames = blob_frames(0, 1, 2000).into_iter();
    arrive(&mut a, a_frames.next());
    let used = budget.used();
    assert!(used > 2000);
    budget.set_limits(used, Duration::from_millis(5));
    // The message under way goes on; a new one beyond the bound waits its turn.
    arrive(&mut b, blob_frames(0, 2, 2000));
    assert!(
        b.pop().is_none() && b.has_waiting(),
        "b waits under the lower bound"
    );
    let t0 = Instant::now();
    a.handle_timeout(t0);
    assert_eq!(a.poll_timeout(), Some(t0 + Duration::from_millis(5)));
    arrive(&mut a, a_frames);
    assert_eq!(pop_blob(&mut a), Blob(vec![1; 2000]));
    b.advance(&mut Wire::new(256)).unwrap();
    assert_eq!(pop_blob(&mut b), Blob(vec![2; 2000]));
}
