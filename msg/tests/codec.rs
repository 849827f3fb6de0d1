//! Frames and the codec without a device: round trips of arbitrary messages through every
//! path (one frame straight into a buffer, fragments), and every kind of bad input giving its
//! typed error without a panic.

use msg::codec::{self, Decoder, FrameBytes};
use msg::frame::{self, FrameError, FIRST, LAST};
use msg::{Error, Message};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Sample {
    id: u64,
    name: String,
    values: Vec<f64>,
    flag: Option<bool>,
}
msg::message!(Sample, solicited = false);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Other(u8);
msg::message!(Other, tag = "tests.other");

fn sample() -> impl Strategy<Value = Sample> {
    (
        any::<u64>(),
        ".{0,40}",
        prop::collection::vec(
            any::<f64>().prop_filter("not NaN", |v| !v.is_nan()),
            0..3000,
        ),
        any::<Option<bool>>(),
    )
        .prop_map(|(id, name, values, flag)| Sample {
            id,
            name,
            values,
            flag,
        })
}

/// Encodes as the session does: one frame if it fits in `frame_max`, else fragments.
fn frames_of(m: &Sample, seq: u32, frame_max: usize) -> Vec<Vec<u8>> {
    let mut buf = vec![0u8; frame_max];
    match codec::encode_single(m, seq, &mut buf).unwrap() {
        Some(n) => vec![buf[..n].to_vec()],
        None => codec::encode_fragments(m, seq, frame_max, 1 << 24).unwrap(),
    }
}

fn decode_all(dec: &mut Decoder, frames: Vec<Vec<u8>>) -> Vec<Result<Option<Sample>, String>> {
    frames
        .into_iter()
        .map(|f| match dec.push(FrameBytes::Owned(f)) {
            Ok(Some(env)) => env.decode::<Sample>().map(Some).map_err(|e| e.to_string()),
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn round_trip(m in sample(), seq in any::<u32>(), frame_max in 64usize..5000) {
        let frames = frames_of(&m, seq, frame_max);
        prop_assert!(frames.iter().all(|f| f.len() <= frame_max));
        let mut dec = Decoder::new(1 << 24);
        let out = decode_all(&mut dec, frames);
        let (last, rest) = out.split_last().unwrap();
        prop_assert!(rest.iter().all(|r| matches!(r, Ok(None))));
        prop_assert_eq!(last.clone().unwrap(), Some(m));
    }

    /// Arbitrary bytes, and arbitrary corruptions of valid frames, never panic.
    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200),
                            m in sample(), flip in any::<(usize, u8)>()) {
        let mut dec = Decoder::new(1 << 16);
        let _ = dec.push(FrameBytes::Owned(bytes));
        for mut f in frames_of(&m, 7, 512) {
            let i = flip.0 % f.len();
            f[i] ^= flip.1 | 1;
            if let Ok(Some(env)) = dec.push(FrameBytes::Owned(f)) {
                let _ = env.decode::<Sample>();
            }
        }
    }
}

fn push(dec: &mut Decoder, f: Vec<u8>) -> msg::Result<Option<msg::Envelope>> {
    dec.push(FrameBytes::Owned(f))
}

#[test]
fn header_errors_are_typed() {
    let good = frame::build(FIRST | LAST, Sample::TAG, 1, 0, &[1, 2, 3]);
    assert!(frame::parse(&good).is_ok());
    assert_eq!(frame::parse(&good[..5]), Err(FrameError::TooShort(5)));
    let mut bad = good.clone();
    bad[0] = 0;
    assert!(matches!(frame::parse(&bad), Err(FrameError::BadMagic(_))));
    let mut bad = good.clone();
    bad[2] = 9;
    assert_eq!(frame::parse(&bad), Err(FrameError::BadVersion(9)));
    let mut bad = good.clone();
    bad[3] |= 0x80;
    assert_eq!(frame::parse(&bad), Err(FrameError::Reserved));
    assert_eq!(
        frame::parse(&good[..good.len() - 1]),
        Err(FrameError::Length {
            declared: 3,
            actual: 2
        })
    );
}

#[test]
fn body_errors_are_typed() {
    let mut dec = Decoder::new(1 << 20);
    // Truncated bincode: a String whose length prefix promises more than is there.
    let env = push(
        &mut dec,
        frame::build(FIRST | LAST, Sample::TAG, 0, 0, &[1, 40, 65]),
    )
    .unwrap()
    .unwrap();
    assert!(matches!(env.decode::<Sample>(), Err(Error::Decode { .. })));
    assert!(matches!(
        env.decode::<Other>(),
        Err(Error::WrongType { .. })
    ));
    // Trailing bytes after a valid body.
    let env = push(
        &mut dec,
        frame::build(FIRST | LAST, Other::TAG, 0, 0, &[5, 0]),
    )
    .unwrap()
    .unwrap();
    assert!(matches!(
        env.decode::<Other>(),
        Err(Error::Decode {
            source: msg::DecodeFailure::Trailing(1),
            ..
        })
    ));
    // A forged huge length prefix is refused by the allocation limit, not allocated.
    let forged = [0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f];
    let env = push(
        &mut dec,
        frame::build(FIRST | LAST, Sample::TAG, 0, 0, &forged),
    )
    .unwrap()
    .unwrap();
    assert!(matches!(env.decode::<Sample>(), Err(Error::Decode { .. })));
}

#[test]
fn unknown_tags_and_disordered_fragments_are_dropped_with_errors() {
    let mut dec = Decoder::new(1 << 20);
    dec.register::<Sample>();
    let r = push(&mut dec, frame::build(FIRST | LAST, Other::TAG, 0, 0, &[5]));
    assert!(matches!(r, Err(Error::UnknownTag(t)) if t == Other::TAG));
    // A middle fragment without a first one.
    let r = push(&mut dec, frame::build(0, Sample::TAG, 1, 1, &[1]));
    assert!(matches!(
        r,
        Err(Error::BadFrame(FrameError::OutOfOrder { seq: 1, frag: 1 }))
    ));
    // A skipped fragment.
    push(&mut dec, frame::build(FIRST, Sample::TAG, 2, 0, &[1])).unwrap();
    let r = push(&mut dec, frame::build(LAST, Sample::TAG, 2, 2, &[1]));
    assert!(matches!(
        r,
        Err(Error::BadFrame(FrameError::OutOfOrder { .. }))
    ));
    // A message beyond the bound.
    let mut small = Decoder::new(4);
    push(
        &mut small,
        frame::build(FIRST, Sample::TAG, 3, 0, &[1, 2, 3]),
    )
    .unwrap();
    let r = push(&mut small, frame::build(LAST, Sample::TAG, 3, 1, &[4, 5]));
    assert!(matches!(r, Err(Error::BadFrame(FrameError::TooLarge(4)))));
    // And afterwards a good message still goes through.
    let m = Sample {
        id: 1,
        name: "x".into(),
        values: vec![1.0; 20],
        flag: None,
    };
    let out = decode_all(
        &mut dec,
        codec::encode_fragments(&m, 4, 64, 1 << 20).unwrap(),
    );
    assert!(
        matches!(out.last(), Some(Ok(Some(s))) if *s == m),
        "{out:?}"
    );
}

#[test]
fn tags_are_stable_and_distinct() {
    assert_eq!(msg::tag("tests.other"), Other::TAG);
    assert_ne!(Sample::TAG, Other::TAG);
    assert_ne!(msg::tag(""), 0);
    // FNV-1a of "a": a fixed point of the wire format.
    assert_eq!(msg::tag("a"), 0xe40c_292c);
}

/// An owned message with bulk bytes, and a view of it that borrows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Blob {
    name: String,
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
}
msg::message!(Blob, tag = "tests.blob");

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct BlobView<'a> {
    name: &'a str,
    #[serde(borrow, with = "serde_bytes")]
    bytes: &'a [u8],
}
msg::message!(BlobView<'_>, tag = "tests.blob");

#[test]
fn views_decode_in_place_and_travel_like_their_owned_type() {
    let owned = Blob {
        name: "firmware".into(),
        bytes: (0..=255).collect(),
    };
    let mut buf = vec![0u8; 1024];
    let len = codec::encode_single(&owned, 7, &mut buf).unwrap().unwrap();
    let mut d = Decoder::new(1 << 20);
    d.register::<Blob>();
    let env = d
        .push(FrameBytes::Owned(buf[..len].to_vec()))
        .unwrap()
        .unwrap();
    let view: BlobView = env.decode_borrowed().unwrap();
    assert_eq!((view.name, view.bytes), ("firmware", &owned.bytes[..]));
    let body = env.body().as_ptr_range();
    assert!(
        body.contains(&view.bytes.as_ptr()),
        "read in place, not copied"
    );
    // A view encodes exactly like the owned value, and decodes back into it.
    let mut again = vec![0u8; 1024];
    let len2 = codec::encode_single(&view, 7, &mut again).unwrap().unwrap();
    assert_eq!(again[..len2], buf[..len]);
    assert_eq!(env.decode::<Blob>().unwrap(), owned);
    // The tag still guards the type.
    assert!(matches!(
        env.decode_borrowed::<Other>(),
        Err(Error::WrongType { .. })
    ));
}
