//! Frames and the codec without a device: round trips of arbitrary messages through every
//! path (one frame straight into a buffer, fragments), and every kind of bad input giving its
//! typed error without a panic.

use proptest::prelude::*;
use rdmsg_msg::codec::{self, Decoder, FrameBytes};
use rdmsg_msg::frame::{self, FrameError, FIRST, LAST};
use rdmsg_msg::{Error, Message};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Sample {
    id: u64,
    name: String,
    values: Vec<f64>,
    flag: Option<bool>,
}
rdmsg_msg::message!(Sample, solicited = false);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Other(u8);
rdmsg_msg::message!(Other, tag = "tests.other");

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

/// A first fragment by hand: it announces the message's body length (`total`) ahead of its
/// part of the body.
fn first(tag: u32, seq: u32, total: u32, part: &[u8]) -> Vec<u8> {
    let mut body = total.to_be_bytes().to_vec();
    body.extend_from_slice(part);
    frame::build(FIRST, tag, seq, 0, &body)
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

fn push(dec: &mut Decoder, f: Vec<u8>) -> rdmsg_msg::Result<Option<rdmsg_msg::Envelope>> {
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
    // The delivery record rides in the old reserved field: any value parses.
    let mut stamped = good.clone();
    frame::stamp_taken(&mut stamped, 0x1_2345);
    assert!(frame::parse(&stamped).is_ok());
    assert_eq!(frame::taken_of(&stamped), Some(0x2345));
    // A request for the record is a bare whole frame of tag 0.
    let ask = frame::build(FIRST | LAST | frame::ASK, 0, 7, 0, &[]);
    assert!(frame::parse(&ask).is_ok());
    let ask_with_body = frame::build(FIRST | LAST | frame::ASK, 0, 7, 0, &[1]);
    assert_eq!(frame::parse(&ask_with_body), Err(FrameError::Reserved));
    let ask_fragment = frame::build(FIRST | frame::ASK, 0, 7, 0, &[]);
    assert_eq!(frame::parse(&ask_fragment), Err(FrameError::Reserved));
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
            source: rdmsg_msg::DecodeFailure::Trailing(1),
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
    dec.register::<Sample>().unwrap();
    let r = push(&mut dec, frame::build(FIRST | LAST, Other::TAG, 0, 0, &[5]));
    assert!(matches!(r, Err(Error::UnknownTag { tag, .. }) if tag == Other::TAG));
    // A middle fragment without a first one.
    let r = push(&mut dec, frame::build(0, Sample::TAG, 1, 1, &[1]));
    assert!(matches!(
        r,
        Err(Error::BadFrame(FrameError::OutOfOrder { seq: 1, frag: 1 }))
    ));
    // A skipped fragment.
    push(&mut dec, first(Sample::TAG, 2, 3, &[1])).unwrap();
    let r = push(&mut dec, frame::build(LAST, Sample::TAG, 2, 2, &[1]));
    assert!(matches!(
        r,
        Err(Error::BadFrame(FrameError::OutOfOrder { .. }))
    ));
    // A message beyond the bound: refused by the length its first fragment announces,
    // nothing of it buffered, the rest of it dropped quietly.
    let mut small = Decoder::new(4);
    let r = push(&mut small, first(Sample::TAG, 3, 5, &[1, 2, 3]));
    assert!(matches!(r, Err(Error::BadFrame(FrameError::TooLarge(4)))));
    assert_eq!(small.buffered(), 0);
    let r = push(&mut small, frame::build(LAST, Sample::TAG, 3, 1, &[4, 5]));
    assert!(matches!(r, Ok(None)), "{r:?}");
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
    assert_eq!(rdmsg_msg::tag("tests.other"), Other::TAG);
    assert_ne!(Sample::TAG, Other::TAG);
    assert_ne!(rdmsg_msg::tag(""), 0);
    // FNV-1a of "a": a fixed point of the wire format.
    assert_eq!(rdmsg_msg::tag("a"), 0xe40c_292c);
}

/// An owned message with bulk bytes, and a view of it that borrows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Blob {
    name: String,
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
}
rdmsg_msg::message!(Blob, tag = "tests.blob");

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct BlobView<'a> {
    name: &'a str,
    #[serde(borrow, with = "serde_bytes")]
    bytes: &'a [u8],
}
rdmsg_msg::message!(BlobView<'_>, tag = "tests.blob");

#[test]
fn views_decode_in_place_and_travel_like_their_owned_type() {
    let owned = Blob {
        name: "firmware".into(),
        bytes: (0..=255).collect(),
    };
    let mut buf = vec![0u8; 1024];
    let len = codec::encode_single(&owned, 7, &mut buf).unwrap().unwrap();
    let mut d = Decoder::new(1 << 20);
    d.register::<Blob>().unwrap();
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

#[test]
fn default_tags_are_the_type_name() {
    assert_eq!(Sample::TAG, rdmsg_msg::tag("Sample"));
}

/// bincode's varint for a length that only exists in the peer's claim.
fn claimed_len(n: u64) -> Vec<u8> {
    let mut v = vec![253];
    v.extend_from_slice(&n.to_le_bytes());
    v
}

#[derive(Debug, Serialize, Deserialize)]
struct Numbers {
    values: Vec<u64>,
}
rdmsg_msg::message!(Numbers);

#[derive(Debug, Serialize, Deserialize)]
struct Units {
    values: Vec<()>,
}
rdmsg_msg::message!(Units);

#[test]
fn decoding_is_bounded_by_max_message() {
    let max = 4096;
    // A Vec claiming 2^40 elements in a 9-byte body: refused, not preallocated.
    let r = codec::decode_body::<Numbers>(Numbers::TAG, &claimed_len(1 << 40), max);
    assert!(matches!(r, Err(Error::Decode { .. })), "{r:?}");
    // Real elements (one byte each on the wire, 8 decoded) beyond the bound.
    let m = Numbers {
        values: vec![1; 1000],
    };
    let mut buf = vec![0u8; 2048];
    let len = codec::encode_single(&m, 0, &mut buf).unwrap().unwrap();
    let body = &buf[frame::HEADER_LEN..len];
    assert!(body.len() < max, "small on the wire");
    let r = codec::decode_body::<Numbers>(Numbers::TAG, body, max);
    assert!(
        matches!(
            r,
            Err(Error::Decode {
                source: rdmsg_msg::DecodeFailure::TooLarge { max: 4096 },
                ..
            })
        ),
        "{r:?}"
    );
    // The same message within a larger bound, and through an envelope of a decoder with it.
    assert_eq!(
        codec::decode_body::<Numbers>(Numbers::TAG, body, 8000)
            .unwrap()
            .values,
        m.values
    );
    let env = push(&mut Decoder::new(max), buf[..len].to_vec())
        .unwrap()
        .unwrap();
    assert!(matches!(
        env.decode::<Numbers>(),
        Err(Error::Decode {
            source: rdmsg_msg::DecodeFailure::TooLarge { .. },
            ..
        })
    ));
    // Zero-sized elements cost no memory, but 2^40 of them would cost hours: bounded too.
    let r = codec::decode_body::<Units>(Units::TAG, &claimed_len(1 << 40), max);
    assert!(
        matches!(
            r,
            Err(Error::Decode {
                source: rdmsg_msg::DecodeFailure::TooLarge { .. },
                ..
            })
        ),
        "{r:?}"
    );
}

/// A recursive message type: each `Neg` is one more level of nesting, one byte on the wire.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Expr {
    Lit(u8),
    Neg(Box<Expr>),
}
rdmsg_msg::message!(Expr);

/// The body of `Neg` nested `depth` times around `Lit(7)`, built as bytes (variant indices as
/// varints), not by recursion.
fn nested_expr(depth: usize) -> Vec<u8> {
    let mut body = vec![1u8; depth];
    body.extend_from_slice(&[0, 7]);
    body
}

#[test]
fn decoding_is_bounded_in_depth() {
    // 100 levels decode (and agree with what bincode encodes).
    let mut expected = Expr::Lit(7);
    for _ in 0..100 {
        expected = Expr::Neg(Box::new(expected));
    }
    let mut buf = vec![0u8; 256];
    let len = codec::encode_single(&expected, 0, &mut buf)
        .unwrap()
        .unwrap();
    assert_eq!(&buf[frame::HEADER_LEN..len], &nested_expr(100)[..]);
    let decoded = codec::decode_body::<Expr>(Expr::TAG, &nested_expr(100), 1 << 24).unwrap();
    assert_eq!(decoded, expected);
    // 100 000 levels, within max_message, would overflow the stack: refused, not fatal.
    let body = nested_expr(100_000);
    for r in [
        codec::decode_body::<Expr>(Expr::TAG, &body, 1 << 24),
        codec::decode_body_borrowed::<Expr>(Expr::TAG, &body, 1 << 24),
    ] {
        match r {
            Err(
                e @ Error::Decode {
                    source: rdmsg_msg::DecodeFailure::TooDeep { max },
                    ..
                },
            ) => {
                assert_eq!(max, codec::MAX_DEPTH);
                assert!(!e.is_fatal());
            }
            r => panic!("{r:?}"),
        }
    }
    // Exactly at the limit: the message is one level and each `Neg` one (the `Lit`'s `u8`, a
    // scalar, none).
    let deepest = codec::MAX_DEPTH - 1;
    assert!(codec::decode_body::<Expr>(Expr::TAG, &nested_expr(deepest), 1 << 24).is_ok());
    assert!(matches!(
        codec::decode_body::<Expr>(Expr::TAG, &nested_expr(deepest + 1), 1 << 24),
        Err(Error::Decode {
            source: rdmsg_msg::DecodeFailure::TooDeep { .. },
            ..
        })
    ));
}

/// A recursive type through tuple and struct variants: an enum and its variant's fields are
/// one level together, as a newtype variant is.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Tree {
    Leaf(u8),
    Pair(Box<Tree>, u8),
    Node { child: Box<Tree> },
}
rdmsg_msg::message!(Tree);

#[test]
fn tuple_and_struct_variants_nest_one_level_each() {
    let pairs = |n: usize| {
        let mut body = vec![1u8; n];
        body.extend_from_slice(&[0, 7]);
        body.extend(std::iter::repeat(9).take(n));
        body
    };
    let nodes = |n: usize| {
        let mut body = vec![2u8; n];
        body.extend_from_slice(&[0, 7]);
        body
    };
    let mut expected = Tree::Leaf(7);
    for _ in 0..3 {
        expected = Tree::Pair(Box::new(expected), 9);
    }
    let mut buf = vec![0u8; 64];
    let len = codec::encode_single(&expected, 0, &mut buf)
        .unwrap()
        .unwrap();
    assert_eq!(&buf[frame::HEADER_LEN..len], &pairs(3)[..]);
    // The message is one level, each `Pair` or `Node` one more.
    let deepest = codec::MAX_DEPTH - 1;
    for body in [pairs, nodes] {
        assert!(codec::decode_body::<Tree>(Tree::TAG, &body(deepest), 1 << 24).is_ok());
        assert!(matches!(
            codec::decode_body::<Tree>(Tree::TAG, &body(deepest + 1), 1 << 24),
            Err(Error::Decode {
                source: rdmsg_msg::DecodeFailure::TooDeep { .. },
                ..
            })
        ));
    }
}

/// Reports the size hint the decoder gives for a sequence (serde's `Vec` preallocates that
/// many elements, up to 1 MiB, before reading any).
#[derive(Debug)]
struct HintProbe(Option<usize>);
impl Serialize for HintProbe {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(std::iter::empty::<u8>())
    }
}
impl<'de> Deserialize<'de> for HintProbe {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = HintProbe;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<HintProbe, A::Error> {
                Ok(HintProbe(seq.size_hint()))
            }
        }
        d.deserialize_seq(V)
    }
}
rdmsg_msg::message!(HintProbe);

/// A sequence of bytes that records the size hint it was given.
#[derive(Debug)]
struct Hinted(Option<usize>);
impl<'de> Deserialize<'de> for Hinted {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Hinted;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Hinted, A::Error> {
                let hint = seq.size_hint();
                while seq.next_element::<u8>()?.is_some() {}
                Ok(Hinted(hint))
            }
        }
        d.deserialize_seq(V)
    }
}

impl Serialize for Hinted {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(std::iter::empty::<u8>())
    }
}
rdmsg_msg::message!(Hinted);

/// A sequence of [`Hinted`] that records its own hint and theirs, then one more [`Hinted`].
#[derive(Debug)]
struct NestedHints {
    outer: Option<usize>,
    inner: Vec<Option<usize>>,
    after: Option<usize>,
}
impl Serialize for NestedHints {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(std::iter::empty::<u8>())
    }
}
impl<'de> Deserialize<'de> for NestedHints {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Outer(Option<usize>, Vec<Option<usize>>);
        impl<'de> Deserialize<'de> for Outer {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> serde::de::Visitor<'de> for V {
                    type Value = Outer;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("a sequence of sequences")
                    }
                    fn visit_seq<A: serde::de::SeqAccess<'de>>(
                        self,
                        mut seq: A,
                    ) -> Result<Outer, A::Error> {
                        let hint = seq.size_hint();
                        let mut inner = Vec::new();
                        while let Some(Hinted(h)) = seq.next_element()? {
                            inner.push(h);
                        }
                        Ok(Outer(hint, inner))
                    }
                }
                d.deserialize_seq(V)
            }
        }
        let (Outer(outer, inner), Hinted(after)) = <(Outer, Hinted)>::deserialize(d)?;
        Ok(NestedHints {
            outer,
            inner,
            after,
        })
    }
}
rdmsg_msg::message!(NestedHints);

/// Reports how an owned string reached its visitor.
#[derive(Debug)]
struct StringProbe(&'static str);
impl Serialize for StringProbe {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0)
    }
}
impl<'de> Deserialize<'de> for StringProbe {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = StringProbe;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E>(self, _: &str) -> Result<StringProbe, E> {
                Ok(StringProbe("copied from the input"))
            }
            fn visit_string<E>(self, _: String) -> Result<StringProbe, E> {
                Ok(StringProbe("allocated by the decoder"))
            }
        }
        d.deserialize_string(V)
    }
}
rdmsg_msg::message!(StringProbe);

#[test]
fn claimed_lengths_are_never_trusted_for_allocation() {
    // No size hint from a length the peer claims: a Vec grows with what really arrives.
    let probe = codec::decode_body::<HintProbe>(HintProbe::TAG, &claimed_len(1 << 40), 1 << 20);
    assert_eq!(probe.unwrap().0, None);
    // An owned string is checked against the bytes present before anything is allocated
    // (bincode would allocate the claimed length first).
    let probe = codec::decode_body::<StringProbe>(StringProbe::TAG, &[3, b'a', b'b', b'c'], 64);
    assert_eq!(probe.unwrap().0, "copied from the input");
    let mut forged = vec![0]; // Sample::id
    forged.extend(claimed_len(8 << 20)); // Sample::name, 8 MiB claimed, none present
    let r = codec::decode_body::<Sample>(Sample::TAG, &forged, 16 << 20);
    assert!(
        matches!(
            r,
            Err(Error::Decode {
                source: rdmsg_msg::DecodeFailure::Bincode(
                    bincode::error::DecodeError::UnexpectedEnd { .. }
                ),
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn no_claimed_length_is_a_size_hint_even_one_the_input_could_hold() {
    // Any visitor may trust a hint (not all cap it as serde's `Vec` does): a claimed length
    // is never one, even three elements whose three bytes are present.
    let probe = codec::decode_body::<Hinted>(Hinted::TAG, &[3, 1, 2, 3], 64);
    assert_eq!(probe.unwrap().0, None);
    let input = [2, 2, 1, 2, 2, 3, 4, 1, 9];
    let probe = codec::decode_body::<NestedHints>(NestedHints::TAG, &input, 64).unwrap();
    assert_eq!(
        (probe.outer, probe.inner, probe.after),
        (None, vec![None, None], None)
    );
}

#[test]
fn an_unknown_first_fragment_is_refused_without_buffering() {
    let mut dec = Decoder::new(1 << 20);
    dec.register::<Sample>().unwrap();
    let chunk = vec![7u8; 1000];
    // A known first fragment is buffered (the control)...
    push(&mut dec, first(Sample::TAG, 1, 100_000, &chunk)).unwrap();
    assert_eq!(dec.buffered(), 1000);
    // ...an unknown one is refused at once, and the partial message before it is dropped.
    let r = push(&mut dec, first(Other::TAG, 2, 51_000, &chunk));
    assert!(
        matches!(r, Err(Error::UnknownTag { tag, .. }) if tag == Other::TAG),
        "{r:?}"
    );
    assert_eq!(dec.buffered(), 0);
    assert_eq!(dec.lost_partials(), 1);
    // Its other fragments are dropped quietly, unbuffered.
    for frag in 1..50 {
        let r = push(&mut dec, frame::build(0, Other::TAG, 2, frag, &chunk));
        assert!(matches!(r, Ok(None)), "{r:?}");
        assert_eq!(dec.buffered(), 0);
    }
    assert!(matches!(
        push(&mut dec, frame::build(LAST, Other::TAG, 2, 50, &chunk)),
        Ok(None)
    ));
    // The next message goes through whole.
    let m = Sample {
        id: 3,
        name: "after".into(),
        values: vec![2.0; 300],
        flag: Some(true),
    };
    let out = decode_all(
        &mut dec,
        codec::encode_fragments(&m, 3, 512, 1 << 20).unwrap(),
    );
    assert!(
        matches!(out.last(), Some(Ok(Some(s))) if *s == m),
        "{out:?}"
    );
    // A stray later fragment of the refused message is out of order again, not skipped.
    let r = push(&mut dec, frame::build(0, Other::TAG, 2, 51, &chunk));
    assert!(matches!(
        r,
        Err(Error::BadFrame(FrameError::OutOfOrder { .. }))
    ));
}

mod sensor {
    #[derive(serde::Serialize, serde::Deserialize)]
    pub struct Reading(pub u8);
    rdmsg_msg::message!(Reading);
}
mod billing {
    #[derive(serde::Serialize, serde::Deserialize)]
    pub struct Reading(pub u8);
    rdmsg_msg::message!(Reading);
}

#[test]
fn registering_a_tag_twice_is_an_error() {
    // Two types with the same name share the default tag: caught at registration.
    assert_eq!(sensor::Reading::TAG, billing::Reading::TAG);
    let mut dec = Decoder::new(1 << 20);
    dec.register::<sensor::Reading>().unwrap();
    let e = dec.register::<billing::Reading>().unwrap_err();
    assert!(
        matches!(
            e,
            Error::DuplicateTag { tag, existing, new }
                if tag == sensor::Reading::TAG
                    && existing.ends_with("sensor::Reading")
                    && new.ends_with("billing::Reading")
        ),
        "{e:?}"
    );
    assert!(e.is_fatal());
    // So is the same type twice, or a view next to its owned type (register one of them).
    assert!(dec.register::<sensor::Reading>().is_err());
    dec.register::<Blob>().unwrap();
    assert!(matches!(
        dec.register::<BlobView>(),
        Err(Error::DuplicateTag { .. })
    ));

    // The dispatcher: any second route for a tag, handler or channel.
    let mut d = rdmsg_msg::Dispatcher::new();
    d.on::<sensor::Reading>(|_| {}).unwrap();
    assert!(matches!(
        d.on::<billing::Reading>(|_| {}),
        Err(Error::DuplicateTag { .. })
    ));
    assert!(matches!(
        d.channel::<sensor::Reading>(1),
        Err(Error::DuplicateTag { .. })
    ));
    let _rx = d.channel::<Sample>(1).unwrap();
    assert!(matches!(
        d.on::<Sample>(|_| {}),
        Err(Error::DuplicateTag { .. })
    ));
}

#[test]
fn fragments_must_bring_exactly_what_their_first_announced() {
    let mut dec = Decoder::new(1 << 20);
    let good = |dec: &mut Decoder, seq: u32| {
        let m = Sample {
            id: seq.into(),
            name: "next".into(),
            values: vec![1.5; 100],
            flag: None,
        };
        let out = decode_all(dec, codec::encode_fragments(&m, seq, 128, 1 << 20).unwrap());
        assert!(
            matches!(out.last(), Some(Ok(Some(s))) if *s == m),
            "{out:?}"
        );
    };
    // Fewer bytes than announced by the last fragment.
    push(&mut dec, first(Sample::TAG, 1, 10, &[1, 2, 3])).unwrap();
    let r = push(&mut dec, frame::build(LAST, Sample::TAG, 1, 1, &[4]));
    assert!(
        matches!(
            r,
            Err(Error::BadFrame(FrameError::Announced {
                seq: 1,
                announced: 10,
                received: 4
            }))
        ),
        "{r:?}"
    );
    good(&mut dec, 2);
    // More: refused at the fragment that passes it, nothing more buffered.
    push(&mut dec, first(Sample::TAG, 3, 4, &[1, 2, 3])).unwrap();
    let r = push(&mut dec, frame::build(0, Sample::TAG, 3, 1, &[4, 5]));
    assert!(
        matches!(
            r,
            Err(Error::BadFrame(FrameError::Announced {
                seq: 3,
                announced: 4,
                received: 5
            }))
        ),
        "{r:?}"
    );
    assert_eq!(dec.buffered(), 0);
    good(&mut dec, 4);
    // A first fragment too short to announce anything.
    let r = push(&mut dec, frame::build(FIRST, Sample::TAG, 5, 0, &[0, 0, 1]));
    assert!(
        matches!(r, Err(Error::BadFrame(FrameError::NoTotal { seq: 5 }))),
        "{r:?}"
    );
    let r = push(&mut dec, frame::build(LAST, Sample::TAG, 5, 1, &[1]));
    assert!(matches!(r, Ok(None)), "the rest dropped quietly: {r:?}");
    good(&mut dec, 6);
}

#[test]
fn a_first_fragment_announces_the_body_length_and_frames_stay_within_bounds() {
    let body: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
    for frame_max in [21, 24, 25, 26, 64, 1019, 1020, 1023, 1024, 1025] {
        let frames = codec::fragment(&body, Sample::TAG, 9, frame_max, 1 << 20).unwrap();
        let mut joined = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let (h, b) = frame::parse(f).unwrap();
            assert_eq!(usize::from(h.frag), i);
            if frames.len() == 1 {
                assert_eq!(h.flags, FIRST | LAST);
                joined.extend_from_slice(b);
                continue;
            }
            assert!(
                f.len() <= frame_max.max(frame::HEADER_LEN + frame::TOTAL_LEN + 1),
                "frame_max {frame_max}"
            );
            if i == 0 {
                assert_eq!(frame::announced_total(h.flags, b), Some(1000));
                joined.extend_from_slice(&b[frame::TOTAL_LEN..]);
            } else {
                assert_eq!(frame::announced_total(h.flags, b), None);
                joined.extend_from_slice(b);
            }
        }
        assert_eq!(joined, body, "frame_max {frame_max}");
    }
}
