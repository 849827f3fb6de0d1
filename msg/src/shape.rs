//! Message types whose decode nothing in the input can inflate: *plain* types, made only of
//! fixed-size values (numbers, `bool`, `char`, unit) in structs, tuples, tuple structs,
//! newtypes and arrays. No length prefix, option, variant or string is read for them, so no
//! input can make their decode allocate or recurse, and a valid encoding is at most a length
//! the type fixes. They skip the bounded deserializer (`bounded.rs`) and decode at plain
//! bincode's cost; every other type goes through it.
//!
//! Whether a type is plain is found once per type, by deserializing it from a probe that
//! answers every fixed-size request with zero and refuses everything else; [`crate::message!`]
//! keeps the answer in a static of the type's own. Types implementing [`Message`] by hand keep
//! the bounded path.
//!
//! A hand-written `Deserialize` may ask for other things on other input than the probe's
//! zeros. The fast path stays bounded for it anyway: it runs only on bodies no longer than the
//! plain shape's longest encoding (so any nesting is shallower than that many bytes), under
//! bincode's own limit on what a length prefix may claim ([`PLAIN_LIMIT`]).

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::Ordering;

use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::Message;

/// What a length prefix may claim on the fast path, should a hand-written `Deserialize` ask
/// for a string or container the probe did not see.
pub(crate) const PLAIN_LIMIT: usize = 64 << 10;

/// How deeply the probe follows nested structs before it calls a type not plain (a type that
/// nests itself with no option or variant between, which no input can end, is caught here).
const MAX_PROBE_DEPTH: usize = 32;

/// A plain type's longest encoding may not exceed this (beyond, the type takes the bounded
/// path: its decode is long anyway).
const MAX_PLAIN_LEN: usize = 1 << 16;

/// The cache's states: not probed yet, or not plain; above, a plain type's longest encoding
/// plus [`PLAIN_BASE`].
const UNKNOWN: u32 = 0;
const NOT_PLAIN: u32 = 1;
const PLAIN_BASE: u32 = 2;

/// The longest valid encoding of `M` if it is plain, probed on first use and kept in the
/// type's own cache ([`Message::decode_shape`]); `None` if it is not, or has no cache.
#[inline]
pub(crate) fn plain_max_len<'de, M: Message + Deserialize<'de>>() -> Option<usize> {
    let cache = M::decode_shape()?;
    match cache.load(Ordering::Relaxed) {
        UNKNOWN => {
            let found = probe::<M>();
            let state = found.map_or(NOT_PLAIN, |n| n as u32 + PLAIN_BASE);
            cache.store(state, Ordering::Relaxed);
            found
        }
        NOT_PLAIN => None,
        n => Some((n - PLAIN_BASE) as usize),
    }
}

/// Deserializes `M` from the probe: its longest encoding if it is plain.
#[cold]
fn probe<'de, M: Deserialize<'de>>() -> Option<usize> {
    let len = Cell::new(0);
    M::deserialize(Probe {
        depth: 0,
        len: &len,
    })
    .ok()?;
    Some(len.get()).filter(|&n| n <= MAX_PLAIN_LEN)
}

/// The probe refused a request: the type is not plain.
#[derive(Debug)]
struct NotPlain;

impl fmt::Display for NotPlain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a plain type")
    }
}

impl std::error::Error for NotPlain {}

impl de::Error for NotPlain {
    fn custom<T: fmt::Display>(_: T) -> Self {
        NotPlain
    }
}

/// A deserializer that answers fixed-size requests with zero, counting the longest encoding
/// bincode's standard configuration gives each, and refuses the rest.
struct Probe<'a> {
    depth: usize,
    len: &'a Cell<usize>,
}

impl Probe<'_> {
    /// One value of at most `bytes` encoded.
    fn take(&self, bytes: usize) {
        self.len.set(self.len.get().saturating_add(bytes));
    }

    fn deeper(&self) -> Result<Self, NotPlain> {
        if self.depth >= MAX_PROBE_DEPTH {
            return Err(NotPlain);
        }
        Ok(Probe {
            depth: self.depth + 1,
            len: self.len,
        })
    }
}

/// Longest varint encodings (bincode's standard configuration): a byte below 251, else a
/// marker byte and the value's own width.
const VARINT_16: usize = 3;
const VARINT_32: usize = 5;
const VARINT_64: usize = 9;
const VARINT_128: usize = 17;

macro_rules! fixed {
    ($($method:ident => $visit:ident($zero:expr), $bytes:expr;)*) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, NotPlain> {
            self.take($bytes);
            visitor.$visit($zero)
        })*
    };
}

macro_rules! refused {
    ($($method:ident,)*) => {
        $(fn $method<V: Visitor<'de>>(self, _: V) -> Result<V::Value, NotPlain> {
            Err(NotPlain)
        })*
    };
}

impl<'de> Deserializer<'de> for Probe<'_> {
    type Error = NotPlain;

    fixed! {
        deserialize_bool => visit_bool(false), 1;
        deserialize_i8 => visit_i8(0), 1;
        deserialize_u8 => visit_u8(0), 1;
        deserialize_i16 => visit_i16(0), VARINT_16;
        deserialize_u16 => visit_u16(0), VARINT_16;
        deserialize_i32 => visit_i32(0), VARINT_32;
        deserialize_u32 => visit_u32(0), VARINT_32;
        deserialize_i64 => visit_i64(0), VARINT_64;
        deserialize_u64 => visit_u64(0), VARINT_64;
        deserialize_i128 => visit_i128(0), VARINT_128;
        deserialize_u128 => visit_u128(0), VARINT_128;
        deserialize_f32 => visit_f32(0.0), 4;
        deserialize_f64 => visit_f64(0.0), 8;
        deserialize_char => visit_char('\0'), 4;
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, NotPlain> {
        visitor.visit_unit()
    }

    refused! {
        deserialize_any,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any,
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, NotPlain> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, NotPlain> {
        visitor.visit_newtype_struct(self.deeper()?)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, NotPlain> {
        let probe = self.deeper()?;
        visitor.visit_seq(Fields { probe, left: len })
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, NotPlain> {
        self.deserialize_tuple(len, visitor)
    }

    /// As bincode reads a struct: its fields in order, as a tuple.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, NotPlain> {
        self.deserialize_tuple(fields.len(), visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, NotPlain> {
        Err(NotPlain)
    }

    fn is_human_readable(&self) -> bool {
        false
    }
}

/// The fields of a struct or tuple: exactly as many as its type says, as bincode gives them.
struct Fields<'a> {
    probe: Probe<'a>,
    left: usize,
}

impl<'de> SeqAccess<'de> for Fields<'_> {
    type Error = NotPlain;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, NotPlain> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(Probe {
            depth: self.probe.depth,
            len: self.probe.len,
        })
        .map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    fn probed<'de, T: Deserialize<'de>>() -> Option<usize> {
        probe::<T>()
    }

    #[derive(Serialize, Deserialize)]
    struct Reading {
        sensor: u16,
        seq: u64,
        value: f64,
    }

    #[derive(Serialize, Deserialize)]
    struct Nested(Reading, [u32; 3], (bool, char, i128), ());

    #[derive(Serialize, Deserialize)]
    struct Named {
        name: String,
    }

    #[derive(Serialize, Deserialize)]
    enum Expr {
        Lit(u8),
        Neg(Box<Expr>),
    }

    /// No input ends it: only the probe's depth does.
    #[derive(Serialize, Deserialize)]
    struct Endless(Box<Endless>);

    #[test]
    fn fixed_size_types_are_plain_with_their_longest_encoding() {
        assert_eq!(probed::<Reading>(), Some(3 + 9 + 8));
        assert_eq!(
            probed::<Nested>(),
            Some(20 + 3 * 5 + 1 + 4 + 17),
            "structs, arrays, tuples and unit nest"
        );
        assert_eq!(probed::<u8>(), Some(1));
    }

    #[test]
    fn types_with_lengths_options_variants_or_no_end_are_not() {
        assert_eq!(probed::<Named>(), None, "a string");
        assert_eq!(probed::<Vec<u8>>(), None, "a length prefix");
        assert_eq!(probed::<Option<u8>>(), None, "an option");
        assert_eq!(probed::<Expr>(), None, "a variant");
        assert_eq!(probed::<Endless>(), None, "nests itself for ever");
        assert_eq!(probed::<&str>(), None, "borrowed");
    }

    /// Each plain type's longest encoding is what bincode writes for its largest values.
    #[test]
    fn the_longest_encoding_is_bincodes_for_the_largest_values() {
        let max = Nested(
            Reading {
                sensor: u16::MAX,
                seq: u64::MAX,
                value: f64::MAX,
            },
            [u32::MAX; 3],
            (true, char::MAX, i128::MIN),
            (),
        );
        let n = bincode::serde::encode_to_vec(&max, bincode::config::standard()).unwrap();
        assert_eq!(Some(n.len()), probed::<Nested>());
    }
}
