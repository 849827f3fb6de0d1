//! Packed frames: a batch of small messages shares frames, each message delivered once, in
//! order, with its number; solicitation per frame; a frame that does not add up fails alone.

use super::*;
use crate::frame::{self, FIRST, LAST, PACK};

fn blobs(n: usize, len: usize) -> Vec<Blob> {
    (0..n).map(|i| Blob(vec![i as u8; len])).collect()
}

#[test]
fn a_batch_is_packed_and_each_message_arrives_once_in_order() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(1000), 0);
    let batch = blobs(100, 10);
    assert_eq!(tx.send_batch(&mut wire, &batch).unwrap(), 100);
    // 236 bytes of body a frame, 19 a message (8 of entry head, 1 of length, 10 of bytes).
    assert_eq!(wire.frames.len(), 9, "12 messages to a frame");
    assert!(wire.frames.iter().all(|(f, _)| f.len() <= 256));
    let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
    assert_eq!(
        solicited,
        [false, false, false, false, false, false, false, false, true]
    );
    assert_eq!(
        (
            tx.stats.sent,
            tx.stats.packed,
            tx.stats.frames_sent,
            tx.stats.sent_solicited
        ),
        (100, 100, 9, 1)
    );
    assert_eq!(tx.next_seq(), 100);
    let mut rx = receiver();
    let got = deliver(&wire, &mut rx);
    let got: Vec<(u32, Blob)> = got
        .into_iter()
        .map(|e| {
            let e = e.unwrap();
            (e.seq(), e.decode::<Blob>().unwrap())
        })
        .collect();
    let want: Vec<(u32, Blob)> = (0..100u32).zip(blobs(100, 10)).collect();
    assert_eq!(got, want);
    assert_eq!((rx.received, rx.frames_received), (100, 9));
    assert_eq!(rx.taken(), 100, "every message counted taken");
}

#[test]
fn the_policy_solicits_packed_frames_by_frame_and_the_last_frame_always() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(3), 0);
    tx.send_batch(&mut wire, &blobs(100, 10)).unwrap();
    let solicited: Vec<bool> = wire.frames.iter().map(|f| f.1).collect();
    assert_eq!(
        solicited,
        [false, false, false, true, false, false, false, true, true]
    );
    assert_eq!(tx.stats.policy_solicited, 2);
}

#[test]
fn a_message_too_large_to_share_a_frame_goes_alone_in_its_place() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(1000), 0);
    let mut batch = blobs(5, 10);
    batch.insert(2, Blob(vec![7; 1000]));
    batch.insert(4, Blob(vec![9; 220]));
    assert_eq!(tx.send_batch(&mut wire, &batch).unwrap(), 7);
    let mut rx = receiver();
    let got: Vec<Blob> = deliver(&wire, &mut rx)
        .into_iter()
        .map(|e| e.unwrap().decode::<Blob>().unwrap())
        .collect();
    assert_eq!(got, batch);
    let flags: Vec<u8> = wire.frames.iter().map(|(f, _)| f[3]).collect();
    assert_eq!(flags[0], FIRST | LAST | PACK, "the first two share a frame");
    assert_eq!(flags[1], FIRST, "the large one is fragmented");
    assert!(
        flags
            .iter()
            .all(|f| f & PACK == 0 || *f == FIRST | LAST | PACK),
        "{flags:?}"
    );
    assert_eq!(tx.stats.fragmented, 1);
    // The one of 220 shares with neither neighbour: it and the one before went alone.
    assert_eq!(tx.stats.packed, 4);
    assert_eq!(wire.frames.last().map(|f| f.1), Some(true));
}

#[test]
fn a_packed_frame_that_does_not_add_up_fails_alone_and_counts_its_messages_taken() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(1000), 0);
    tx.send_batch(&mut wire, &blobs(3, 10)).unwrap();
    tx.send_batch(&mut wire, &blobs(2, 10)).unwrap();
    // The first frame claims four messages: it holds three.
    wire.frames[0].0[12..14].copy_from_slice(&4u16.to_be_bytes());
    let mut rx = receiver();
    let got = deliver(&wire, &mut rx);
    assert_eq!(got.len(), 3, "one error, then the next frame's two");
    assert!(matches!(
        got[0],
        Err(Error::BadFrame(frame::FrameError::Packed {
            seq: 0,
            count: 4
        }))
    ));
    assert_eq!(got[1].as_ref().unwrap().seq(), 3);
    assert_eq!(rx.taken(), 5, "the bad frame's messages count as taken");

    // Entries whose lengths run past the body, or stop short of it.
    for forged_len in [200u32, 5, u32::MAX, u32::MAX - 7] {
        let mut f = wire.frames[1].0.clone();
        f[20 + 4..20 + 8].copy_from_slice(&forged_len.to_be_bytes());
        let mut rx = receiver();
        rx.arrive(FrameBytes::Owned(f));
        assert!(matches!(
            rx.pop(),
            Some(Err(Error::BadFrame(frame::FrameError::Packed { .. })))
        ));
        assert!(rx.pop().is_none());
    }
}

#[test]
fn a_packed_message_of_an_unknown_type_fails_in_its_place_only() {
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&config(1000), 0);
    tx.send_batch(&mut wire, &[Blob(vec![1]), Blob(vec![2]), Blob(vec![3])])
        .unwrap();
    // The second entry gets another type's tag.
    let f = &mut wire.frames[0].0;
    let second = 20 + 8 + 2;
    f[second..second + 4].copy_from_slice(&Other::TAG.to_be_bytes());
    let mut decoder = Decoder::new(1 << 20);
    decoder.register::<Blob>().unwrap();
    let mut rx = RecvSide::new(decoder, ReadPool::new(1 << 20));
    let got = deliver(&wire, &mut rx);
    assert_eq!(got.len(), 3);
    assert_eq!(
        got[0].as_ref().unwrap().decode::<Blob>().unwrap(),
        Blob(vec![1])
    );
    assert!(matches!(got[1], Err(Error::UnknownTag { tag, .. }) if tag == Other::TAG));
    assert_eq!(got[2].as_ref().unwrap().seq(), 2);
}

#[test]
fn packed_messages_keep_their_copies_and_share_one_buffer_until_detached() {
    let keep = SessionConfig {
        keep_unconfirmed: Some(1 << 20),
        ..config(1000)
    };
    let mut wire = Wire::new(256);
    let mut tx = SendSide::new(&keep, 0);
    let batch = blobs(20, 10);
    tx.send_batch(&mut wire, &batch).unwrap();
    let back: Vec<(u32, Blob)> = tx
        .take_unconfirmed()
        .into_iter()
        .map(|e| (e.seq(), e.decode::<Blob>().unwrap()))
        .collect();
    assert_eq!(back, (0..20u32).zip(blobs(20, 10)).collect::<Vec<_>>());

    let mut rx = receiver();
    let mut got: Vec<Envelope> = deliver(&wire, &mut rx)
        .into_iter()
        .map(|e| e.unwrap())
        .collect();
    assert!(got
        .iter()
        .all(|e| matches!(e.frame_bytes(), FrameBytes::Packed(_))));
    got[0].detach();
    assert!(matches!(got[0].frame_bytes(), FrameBytes::Shared(_)));
    assert_eq!(got[0].decode::<Blob>().unwrap(), batch[0]);
}

#[test]
fn a_forged_pack_header_is_refused_by_the_frame_parser() {
    let mut f = frame::build(FIRST | LAST | PACK, 0, 0, 0, &[]);
    assert_eq!(
        frame::parse(&f),
        Err(frame::FrameError::Reserved),
        "no messages"
    );
    f = frame::build(FIRST | LAST | PACK, 7, 0, 1, &[]);
    assert_eq!(frame::parse(&f), Err(frame::FrameError::Reserved), "a tag");
    f = frame::build(FIRST | PACK, 0, 0, 1, &[]);
    assert_eq!(
        frame::parse(&f),
        Err(frame::FrameError::Reserved),
        "a fragment"
    );
    let mut d = Decoder::new(1 << 20);
    let one = frame::build(FIRST | LAST | PACK, 0, 0, 1, &[0, 0, 0, 9, 0, 0, 0, 0]);
    assert!(matches!(
        d.push(FrameBytes::Owned(one)),
        Err(Error::BadFrame(frame::FrameError::NotSingle(1)))
    ));
}

#[test]
fn messages_committed_while_the_peer_had_no_credit_go_packed_when_credit_comes() {
    let mut wire = Wire::new(256);
    wire.room = 0;
    let mut tx = SendSide::new(&config(1000), 0);
    let sent = blobs(20, 10);
    for (i, m) in sent.iter().enumerate() {
        tx.commit_as(&mut wire, m, i == 4).unwrap();
    }
    assert_eq!((tx.committed_waiting(), wire.frames.len()), (20, 0));
    wire.room = 1;
    assert!(
        !tx.send_committed(&mut wire).unwrap(),
        "one frame's worth went"
    );
    assert_eq!(wire.frames.len(), 1);
    assert_eq!(tx.committed_waiting(), 8, "12 to a frame");
    assert!(wire.frames[0].1, "solicited: it holds a solicited message");
    wire.room = usize::MAX;
    assert!(tx.send_committed(&mut wire).unwrap());
    assert_eq!(wire.frames.len(), 2);
    assert!(!wire.frames[1].1, "nothing in it asked to be solicited");
    let got: Vec<(u32, Blob)> = deliver(&wire, &mut receiver())
        .into_iter()
        .map(|e| {
            let e = e.unwrap();
            (e.seq(), e.decode::<Blob>().unwrap())
        })
        .collect();
    assert_eq!(got, (0..20u32).zip(sent).collect::<Vec<_>>());
    assert_eq!(tx.stats.packed, 20);
}

#[test]
fn an_outbox_that_queued_up_goes_packed_in_order() {
    use super::super::outbox::{Outbox, Outgoing, Owned};
    let mut wire = Wire::new(256);
    wire.room = 0;
    let mut tx = SendSide::new(&config(1000), 0);
    let mut outbox = Outbox::new(1 << 20);
    for i in 0..30u8 {
        let m = Owned {
            m: Blob(vec![i; 10]),
            solicited: false,
        };
        let size = m.size();
        outbox.push(Box::new(m), size);
    }
    assert_eq!(outbox.send_ready(&mut tx, &mut wire).unwrap(), 0);
    assert_eq!(outbox.stats().messages, 30, "no credit: all wait");
    wire.room = usize::MAX;
    assert_eq!(outbox.send_ready(&mut tx, &mut wire).unwrap(), 0);
    assert!(outbox.is_empty());
    assert_eq!(outbox.stats().bytes, 0);
    assert_eq!(wire.frames.len(), 3, "12, 12 and 6 to a frame");
    let got: Vec<Blob> = deliver(&wire, &mut receiver())
        .into_iter()
        .map(|e| e.unwrap().decode::<Blob>().unwrap())
        .collect();
    assert_eq!(
        got,
        (0..30u8).map(|i| Blob(vec![i; 10])).collect::<Vec<_>>()
    );
}
