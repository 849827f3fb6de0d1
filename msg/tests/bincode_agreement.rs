//! The body decoder reads bincode's format itself (see `codec::decode_body`): on every kind of
//! value serde has, and on valid bodies cut, lengthened or corrupted, it must agree with
//! bincode's own serde decoder: the same value, the same bytes used, or the same error.

use std::collections::BTreeMap;

use proptest::prelude::*;
use rdmsg_msg::{codec, DecodeFailure, Error, Message};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Unit;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Newtype(i64);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Pair(u16, i16);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Shape {
    Empty,
    Circle(f32),
    Rect(u32, u32),
    Named { name: String, sides: u8 },
}

/// Every part of serde's data model that bincode supports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Every {
    b: bool,
    u8_: u8,
    i8_: i8,
    u16_: u16,
    i16_: i16,
    u32_: u32,
    i32_: i32,
    u64_: u64,
    i64_: i64,
    u128_: u128,
    i128_: i128,
    f32_: f32,
    f64_: f64,
    c: char,
    s: String,
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
    seq: Vec<Option<Vec<i32>>>,
    unit: (),
    unit_struct: Unit,
    newtype: Newtype,
    tuple: (u8, char, bool),
    pair: Pair,
    map: BTreeMap<u16, String>,
    shapes: Vec<Shape>,
    array: [u64; 3],
}
rdmsg_msg::message!(Every);

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        Just(Shape::Empty),
        any::<f32>().prop_map(Shape::Circle),
        any::<(u32, u32)>().prop_map(|(w, h)| Shape::Rect(w, h)),
        (".{0,8}", any::<u8>()).prop_map(|(name, sides)| Shape::Named { name, sides }),
    ]
}

fn every() -> impl Strategy<Value = Every> {
    let scalars = (
        any::<(bool, u8, i8, u16, i16, u32, i32)>(),
        any::<(u64, i64, u128, i128, f32, f64, char)>(),
    );
    let rest = (
        ".{0,20}",
        prop::collection::vec(any::<u8>(), 0..40),
        prop::collection::vec(
            prop::option::of(prop::collection::vec(any::<i32>(), 0..5)),
            0..5,
        ),
        any::<(u8, char, bool, u16, i16, i64)>(),
        prop::collection::btree_map(any::<u16>(), ".{0,6}", 0..4),
        prop::collection::vec(shape(), 0..4),
        any::<[u64; 3]>(),
    );
    (scalars, rest).prop_map(
        |(
            ((b, u8_, i8_, u16_, i16_, u32_, i32_), (u64_, i64_, u128_, i128_, f32_, f64_, c)),
            (s, bytes, seq, (t0, t1, t2, p0, p1, n), map, shapes, array),
        )| Every {
            b,
            u8_,
            i8_,
            u16_,
            i16_,
            u32_,
            i32_,
            u64_,
            i64_,
            u128_,
            i128_,
            f32_,
            f64_,
            c,
            s,
            bytes,
            seq,
            unit: (),
            unit_struct: Unit,
            newtype: Newtype(n),
            tuple: (t0, t1, t2),
            pair: Pair(p0, p1),
            map,
            shapes,
            array,
        },
    )
}

fn encode(m: &Every) -> Vec<u8> {
    bincode::serde::encode_to_vec(m, bincode::config::standard()).unwrap()
}

/// Both decoders' verdicts on `body`, as comparable text: the value re-encoded (floats may be
/// NaN), or the error; bincode's trailing bytes are refused as ours are. bincode runs under a
/// limit, or a forged string length would have it allocate that much; a body far below the
/// limit that exceeds it claims more than it holds, which ours reports as its end.
fn verdicts(body: &[u8]) -> (Result<Vec<u8>, String>, Result<Vec<u8>, String>) {
    let ours = match codec::decode_body::<Every>(Every::TAG, body, 1 << 24) {
        Ok(m) => Ok(encode(&m)),
        Err(Error::Decode {
            source: DecodeFailure::Bincode(e),
            ..
        }) => Err(format!("{e:?}")),
        Err(Error::Decode {
            source: DecodeFailure::Trailing(n),
            ..
        }) => Err(format!("trailing {n}")),
        Err(e) => Err(format!("other: {e:?}")),
    };
    let limited = bincode::config::standard().with_limit::<{ 1 << 20 }>();
    let theirs = match bincode::serde::decode_from_slice::<Every, _>(body, limited) {
        Ok((m, used)) if used == body.len() => Ok(encode(&m)),
        Ok((_, used)) => Err(format!("trailing {}", body.len() - used)),
        Err(bincode::error::DecodeError::LimitExceeded) if matches!(&ours, Err(e) if e.starts_with("UnexpectedEnd")) => {
            ours.clone()
        }
        Err(e) => Err(format!("{e:?}")),
    };
    match (ours, theirs) {
        (Err(o), Err(t)) => {
            let (o, t) = same_names(o, t);
            (Err(o), Err(t))
        }
        other => other,
    }
}

/// bincode 2.0.1's fast varint paths name the wrong expected type in two refusals: its `u64`
/// says `U32` (`I32` for an `i64`) and its `u128` says `Usize` for a reserved tag; ours names
/// the type read. Only those pairs are taken as the same.
fn same_names(ours: String, theirs: String) -> (String, String) {
    let quirks = [
        ("expected: U64,", "expected: U32,"),
        ("expected: I64,", "expected: I32,"),
        ("expected: U128,", "expected: Usize,"),
        ("expected: I128,", "expected: Isize,"),
    ];
    for (o, t) in quirks {
        if ours.replace(o, t) == theirs {
            return (theirs.clone(), theirs);
        }
    }
    (ours, theirs)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn valid_bodies_decode_alike(m in every()) {
        let body = encode(&m);
        let (ours, theirs) = verdicts(&body);
        prop_assert_eq!(&ours, &theirs);
        prop_assert_eq!(ours, Ok(body));
    }

    /// Cut short, lengthened, or with a byte changed (a varint's tag, a length, a variant
    /// index, a bool, a char's UTF-8...): the same verdict.
    #[test]
    fn damaged_bodies_fail_alike(m in every(), at in any::<prop::sample::Index>(),
                                 byte in any::<u8>(), how in 0u8..4) {
        let mut body = encode(&m);
        let i = at.index(body.len());
        match how {
            0 => body.truncate(i),
            1 => body[i] = byte,
            2 => body.insert(i, byte),
            _ => body[i] = [251, 252, 253, 254, 255, 0xc3, 0xf5, 2][usize::from(byte % 8)],
        }
        let (ours, theirs) = verdicts(&body);
        prop_assert_eq!(ours, theirs, "at {} of {:?}", i, body);
    }
}

/// Each integer width refuses a wider varint tag before reading it, naming both types, as
/// bincode does; lengths that fit no `usize`... cannot happen on 64 bits, so not tested.
#[test]
fn narrow_integers_refuse_wide_tags_alike() {
    #[derive(Debug, Serialize, Deserialize)]
    struct Narrow(u16, i32);
    rdmsg_msg::message!(Narrow);
    for body in [
        vec![252, 1, 0, 0, 0, 0],
        vec![1, 253, 0, 0, 0, 0, 0, 0, 0, 0],
        vec![255, 0],
        vec![251, 1],
        vec![1, 252, 1, 2],
    ] {
        let ours = match codec::decode_body::<Narrow>(Narrow::TAG, &body, 1 << 20) {
            Err(Error::Decode {
                source: DecodeFailure::Bincode(e),
                ..
            }) => format!("{e:?}"),
            r => panic!("{body:?}: {r:?}"),
        };
        let theirs =
            bincode::serde::decode_from_slice::<Narrow, _>(&body, bincode::config::standard())
                .unwrap_err();
        assert_eq!(ours, format!("{theirs:?}"), "{body:?}");
    }
}
