//! The rendezvous protocol without a device: descriptors and acknowledgements round-trip and
//! every malformed one is a typed error, never a panic; a message with `Bulk` payloads encodes
//! into pieces that join into exactly its ordinary encoding, the payloads left by reference;
//! the decoder hands descriptors and acknowledgements out without disturbing a message being
//! reassembled.

use proptest::prelude::*;
use rdmsg_msg::codec::{self, Decoded, Decoder, FrameBytes};
use rdmsg_msg::frame::{self, FrameError, DONE, FIRST, LAST, RNDV};
use rdmsg_msg::rendezvous::{self, Descriptor, Segment, MAX_PIECES};
use rdmsg_msg::{Bulk, Error, Message, Piece};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Carrier {
    id: u32,
    first: Bulk,
    name: String,
    second: Bulk,
    small: Bulk,
}
rdmsg_msg::message!(Carrier, tag = "tests.carrier");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Plain {
    id: u32,
    #[serde(with = "serde_bytes")]
    first: Vec<u8>,
    name: String,
    #[serde(with = "serde_bytes")]
    second: Vec<u8>,
    #[serde(with = "serde_bytes")]
    small: Vec<u8>,
}
rdmsg_msg::message!(Plain, tag = "tests.carrier.plain");

fn segment() -> impl Strategy<Value = Segment> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Segment::Inline),
        (1u32..u32::MAX / 32, any::<u64>(), any::<u32>())
            .prop_map(|(len, addr, rkey)| Segment::Remote { len, addr, rkey }),
    ]
}

fn descriptor() -> impl Strategy<Value = Descriptor> {
    prop::collection::vec(segment(), 1..=MAX_PIECES).prop_map(|segments| Descriptor {
        total: segments.iter().map(|s| s.len() as u32).sum(),
        segments,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn descriptors_round_trip(d in descriptor(), tag in 1u32.., seq in any::<u32>()) {
        let mut buf = vec![0u8; d.encoded_len() + frame::HEADER_LEN];
        let n = d.write_frame(tag, seq, &mut buf).expect("fits exactly");
        prop_assert_eq!(n, buf.len());
        prop_assert!(d.write_frame(tag, seq, &mut buf[..n - 1]).is_none(), "one byte short");
        let (h, body) = frame::parse(&buf).expect("a frame");
        prop_assert_eq!((h.flags, h.tag, h.seq), (FIRST | LAST | RNDV, tag, seq));
        prop_assert_eq!(Descriptor::parse(body).expect("parses"), d);
    }

    #[test]
    fn arbitrary_bodies_never_panic(body in prop::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(d) = Descriptor::parse(&body) {
            // Whatever parses is consistent: pieces add up, none empty, within the count.
            prop_assert!(!d.segments.is_empty() && d.segments.len() <= MAX_PIECES);
            prop_assert_eq!(d.segments.iter().map(|s| s.len() as u64).sum::<u64>(), u64::from(d.total));
            prop_assert!(d.segments.iter().all(|s| !s.is_empty()));
        }
        let _ = rendezvous::parse_done(&body);
    }

    #[test]
    fn corrupting_one_byte_of_a_descriptor_is_an_error_or_another_valid_one(
        d in descriptor(), at in any::<prop::sample::Index>(), x in 1u8..,
    ) {
        let mut buf = vec![0u8; d.encoded_len() + frame::HEADER_LEN];
        d.write_frame(7, 1, &mut buf).expect("fits");
        let i = frame::HEADER_LEN + at.index(d.encoded_len());
        buf[i] ^= x;
        match Descriptor::parse(&buf[frame::HEADER_LEN..]) {
            Ok(other) => prop_assert_ne!(other, d),
            Err(FrameError::Rendezvous(_)) => {}
            Err(e) => prop_assert!(false, "unexpected {:?}", e),
        }
    }

    #[test]
    fn acknowledgements_round_trip(seqs in prop::collection::vec(any::<u32>(), 1..3000), max in 24usize..5000) {
        let frames = rendezvous::done_frames(&seqs, max);
        let mut back = Vec::new();
        for f in &frames {
            prop_assert!(f.len() <= max.max(frame::HEADER_LEN + 4));
            let (h, body) = frame::parse(f).expect("a frame");
            prop_assert_eq!(h.flags, FIRST | LAST | DONE);
            back.extend(rendezvous::parse_done(body).expect("parses"));
        }
        prop_assert_eq!(back, seqs);
    }

    #[test]
    fn bulk_payloads_are_left_by_reference_and_the_pieces_join_into_the_encoding(
        a in 0usize..20_000, b in 0usize..20_000, small in 0usize..4096, name in ".{0,20}",
    ) {
        let m = Carrier {
            id: 3,
            first: Bulk::from(vec![1u8; a]),
            name: name.clone(),
            second: Bulk::from(vec![2u8; b]),
            small: Bulk::from(vec![3u8; small]),
        };
        let pieces = codec::encode_pieces(&m).expect("encodes");
        let joined: Vec<u8> = pieces.iter().flat_map(|p| p.bytes().to_vec()).collect();
        let plain = Plain {
            id: 3,
            first: vec![1u8; a],
            name,
            second: vec![2u8; b],
            small: vec![3u8; small],
        };
        let whole = codec::encode_fragments(&plain, 0, usize::MAX, usize::MAX).expect("encodes");
        prop_assert_eq!(&joined[..], &whole[0][frame::HEADER_LEN..], "the same bytes");
        // Payloads of 4 KiB and more are pieces by reference, pointing at the message's own
        // bytes (not copies); smaller ones are copied.
        let by_ref: Vec<&Piece> = pieces.iter().filter(|p| matches!(p, Piece::Bulk(_))).collect();
        let expected = usize::from(a >= 4096) + usize::from(b >= 4096);
        prop_assert_eq!(by_ref.len(), expected);
        for p in by_ref {
            let Piece::Bulk(bytes) = p else { unreachable!() };
            prop_assert!(
                bytes.as_ptr() == m.first.as_ptr() || bytes.as_ptr() == m.second.as_ptr()
            );
        }
        // And the ordinary decode reads it back.
        let back: Carrier = codec::decode_body(Carrier::TAG, &joined, usize::MAX).expect("decodes");
        prop_assert_eq!(back, m);
    }
}

#[test]
fn malformed_descriptors_are_typed_errors() {
    let good = Descriptor {
        total: 3,
        segments: vec![Segment::Inline(vec![1, 2, 3])],
    };
    let mut buf = vec![0u8; 64];
    let n = good.write_frame(9, 0, &mut buf).expect("fits");
    let body = buf[frame::HEADER_LEN..n].to_vec();
    assert_eq!(Descriptor::parse(&body).expect("good"), good);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("short", body[..5].to_vec()),
        (
            "no pieces",
            [&0u32.to_be_bytes()[..], &[0, 0, 0, 0]].concat(),
        ),
        ("sum off", {
            let mut b = body.clone();
            b[3] = 4;
            b
        }),
        ("reserved", {
            let mut b = body.clone();
            b[7] = 1;
            b
        }),
        ("kind", {
            let mut b = body.clone();
            b[8] = 5;
            b
        }),
        ("trailing", [&body[..], &[0]].concat()),
        ("empty piece", {
            let mut b = [
                &0u32.to_be_bytes()[..],
                &[0, 1, 0, 0],
                &[0],
                &0u32.to_be_bytes(),
            ]
            .concat();
            b.truncate(13);
            b
        }),
        ("too many", {
            let mut b = [&17u32.to_be_bytes()[..], &[0, 17, 0, 0]].concat();
            for _ in 0..17 {
                b.extend([0, 0, 0, 0, 1, 7]);
            }
            b
        }),
    ];
    for (what, body) in cases {
        assert!(
            matches!(Descriptor::parse(&body), Err(FrameError::Rendezvous(_))),
            "{what}"
        );
    }
    // A descriptor flag with fragments, or both flags at once, is not a frame.
    let mut f = frame::build(FIRST | RNDV, 9, 0, 0, &body_of(&good));
    assert_eq!(frame::parse(&f), Err(FrameError::Reserved));
    f[3] = FIRST | LAST | RNDV | DONE;
    assert_eq!(frame::parse(&f), Err(FrameError::Reserved));
    assert!(rendezvous::parse_done(&[1, 2, 3]).is_err());
    assert!(rendezvous::parse_done(&[]).is_err());
}

fn body_of(d: &Descriptor) -> Vec<u8> {
    let mut buf = vec![0u8; d.encoded_len() + frame::HEADER_LEN];
    d.write_frame(1, 0, &mut buf).expect("fits");
    buf[frame::HEADER_LEN..].to_vec()
}

#[test]
fn the_decoder_hands_rendezvous_frames_out_between_fragments() {
    let mut dec = Decoder::new(1 << 20);
    dec.register::<Plain>().expect("registered");
    let plain = Plain {
        id: 1,
        first: vec![5; 300],
        name: "x".into(),
        second: vec![],
        small: vec![],
    };
    let frames = codec::encode_fragments(&plain, 4, 128, 1 << 20).expect("fragments");
    assert!(frames.len() > 2);
    let d = Descriptor {
        total: 10,
        segments: vec![Segment::Remote {
            len: 10,
            addr: 1,
            rkey: 2,
        }],
    };
    let mut rndv = vec![0u8; 64];
    let n = d.write_frame(Plain::TAG, 5, &mut rndv).expect("fits");
    rndv.truncate(n);
    let done = rendezvous::done_frames(&[4, 9], 64).remove(0);
    let mut out = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        if i == 1 {
            out.push(
                dec.take(FrameBytes::Owned(rndv.clone()))
                    .expect("a descriptor"),
            );
            out.push(dec.take(FrameBytes::Owned(done.clone())).expect("an ack"));
        }
        out.push(dec.take(FrameBytes::Owned(f.clone())).expect("a fragment"));
    }
    assert!(
        matches!(&out[1], Decoded::Rendezvous { tag, seq: 5, descriptor } if *tag == Plain::TAG && *descriptor == d)
    );
    assert!(matches!(&out[2], Decoded::Done(s) if s == &[4, 9]));
    let Some(Decoded::Message(env)) = out.last() else {
        panic!("the fragmented message is whole: {out:?}")
    };
    assert_eq!(env.decode::<Plain>().expect("decodes"), plain);
    // A descriptor of a type nobody registered: refused before anything is read.
    let n = d.write_frame(0x1234, 6, &mut [0u8; 64]).expect("fits");
    let mut other = vec![0u8; 64];
    d.write_frame(0x1234, 6, &mut other).expect("fits");
    other.truncate(n);
    assert!(matches!(
        dec.take(FrameBytes::Owned(other)),
        Err(Error::UnknownTag { tag: 0x1234, .. })
    ));
}
