//! The serde deserializer for message bodies: bincode 2's standard format (varints, little
//! endian), read straight from the body, with what decoding may allocate bounded by a number
//! of bytes chosen at run time ([`crate::SessionConfig::max_message`]), which bincode's own
//! limit (a const generic) cannot be. Bodies are still encoded by bincode; this reads exactly
//! what bincode's serde decoder reads (the fuzzer and the host tests compare the two), but as
//! one type whose every step inlines into the message's own decode, so a long sequence of
//! scalars costs no call per element (through a wrapper around bincode's deserializer it cost
//! two to three times bincode's own time).
//!
//! Forged lengths are the danger: serde preallocates a container from the length its prefix
//! claims (up to 1 MiB each), and bincode allocates an owned string or byte buffer of the
//! claimed length before reading it. So the reader
//!
//! - gives containers no size hint: a `Vec` grows only with elements actually decoded (any
//!   visitor may trust a hint, and not all cap it as serde's own containers do);
//! - reads owned strings and byte buffers as borrowed ones (checked against the bytes
//!   present, allocating nothing) and lets the visitor copy what is really there;
//! - charges every string and byte string (its length) and every element of a sequence or map
//!   of claimed length (its size, at least one byte, so that a sequence of zero-sized values
//!   is bounded too) to a budget, and fails the decode as soon as the budget is exceeded.
//!   Struct fields, tuples and arrays, whose length the type fixes, cost nothing themselves.
//!
//! The decoded value thus holds at most `max` bytes in its strings and containers (a growing
//! `Vec` may briefly have twice the capacity of its elements), whatever the input claims.
//!
//! Heap allocations behind a pointer (`Box<E>`, `Rc<E>`, `Arc<E>`) are invisible to serde:
//! the pointer's `Deserialize` decodes an `E` and moves it to the heap. A container element
//! is charged at the size of its own type, so `Vec<Box<E>>` pays `size_of::<Box<E>>()` (8
//! bytes) per element while each element allocates `size_of::<E>()` more: such a container
//! may hold up to `1 + size_of::<E>() / 8` times the bound (likewise for boxes inside a
//! container element's type). Message types should not box large types in containers (a
//! `Vec<E>` is charged in full). Boxes outside containers are bounded by the type and by the
//! depth limit. `Box<[T]>` and `Box<str>` are decoded as a `Vec` and a `String` and charged
//! in full.
//!
//! Recursion is bounded too: bincode has no recursion limit, and a recursive type (`enum Expr
//! { Lit(u8), Neg(Box<Expr>) }`) nests one level per input byte or so, enough to overflow
//! the stack within `max`. Every compound value (a struct, tuple, sequence, map, enum with
//! its variant's fields, newtype or `Option`'s `Some`) is one level deeper than the value
//! holding it, and the decode fails beyond [`MAX_DEPTH`] levels. Scalars, strings and byte
//! strings cannot recurse and cost no level.

use bincode::error::{AllowedEnumVariants, DecodeError, IntegerType};
use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, IntoDeserializer, MapAccess};
use serde::de::{SeqAccess, VariantAccess, Visitor};

/// How deeply values may nest in a decoded message: the number of nested compound values (a
/// struct, tuple, sequence, map, enum, newtype or `Option`'s `Some`, the message itself
/// included) on the path to the innermost one. Deeper input fails to decode
/// ([`crate::DecodeFailure::TooDeep`]) instead of overflowing the stack. A value of a
/// recursive type such as `enum Expr { Lit(u8), Neg(Box<Expr>), Add(Box<Expr>, Box<Expr>) }`
/// may nest about this many times: an enum's variant and its fields are the enum's one
/// level, so each `Neg` or `Add` is one.
pub const MAX_DEPTH: usize = 128;

/// bincode's varint tags: a first byte below `U16` is the value itself; these say that a
/// little-endian integer of their width follows; 255 is reserved.
const U16: u8 = 251;
const U32: u8 = 252;
const U64: u8 = 253;
const U128: u8 = 254;

/// Reads one message body: the input left, what the decoded value may still allocate, how
/// deep it is, and why it stopped when the format was not the reason.
#[derive(Debug)]
pub(crate) struct BodyReader<'de> {
    input: &'de [u8],
    left: usize,
    depth: usize,
    too_large: bool,
    too_deep: bool,
}

impl<'de> BodyReader<'de> {
    /// A reader of `input` whose decoded value may hold at most `max` bytes.
    #[inline]
    pub(crate) fn new(input: &'de [u8], max: usize) -> Self {
        Self {
            input,
            left: max,
            depth: 0,
            too_large: false,
            too_deep: false,
        }
    }

    /// Bytes not read yet.
    #[inline]
    pub(crate) fn remaining(&self) -> usize {
        self.input.len()
    }

    /// Whether a decode failed because the budget ran out.
    #[inline]
    pub(crate) fn exceeded(&self) -> bool {
        self.too_large
    }

    /// Whether a decode failed because values nested deeper than the limit.
    #[inline]
    pub(crate) fn too_deep(&self) -> bool {
        self.too_deep
    }

    /// Runs `f` one level deeper, or fails if that is beyond the limit.
    #[inline(always)]
    fn nested<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, DecodeError>,
    ) -> Result<T, DecodeError> {
        if self.depth >= MAX_DEPTH {
            self.too_deep = true;
            return Err(DecodeError::Other("decoded message nests too deeply"));
        }
        self.depth += 1;
        let r = f(self);
        self.depth -= 1;
        r
    }

    #[inline(always)]
    fn charge(&mut self, n: usize) -> Result<(), DecodeError> {
        match self.left.checked_sub(n) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => {
                self.too_large = true;
                Err(DecodeError::Other("decoded message exceeds its size bound"))
            }
        }
    }

    /// What bincode says when `wanted` bytes are asked of less.
    #[cold]
    #[inline(never)]
    fn end(&self, wanted: usize) -> DecodeError {
        DecodeError::UnexpectedEnd {
            additional: wanted - self.input.len(),
        }
    }

    #[inline(always)]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        match self.input.split_first_chunk::<N>() {
            Some((head, rest)) => {
                self.input = rest;
                Ok(*head)
            }
            None => Err(self.end(N)),
        }
    }

    #[inline(always)]
    fn byte(&mut self) -> Result<u8, DecodeError> {
        match self.input.split_first() {
            Some((&b, rest)) => {
                self.input = rest;
                Ok(b)
            }
            None => Err(self.end(1)),
        }
    }

    #[inline(always)]
    fn slice(&mut self, len: usize) -> Result<&'de [u8], DecodeError> {
        if len > self.input.len() {
            return Err(self.end(len));
        }
        let (head, rest) = self.input.split_at(len);
        self.input = rest;
        Ok(head)
    }

    /// A varint no wider than `widest` (the tag of the type's own width, at most `U64`), for
    /// a value of type `ty`: every width inline (random `u32`s are mostly five bytes), the
    /// refusals and a short input out of line.
    #[inline(always)]
    fn varint(&mut self, ty: IntegerType, widest: u8) -> Result<u64, DecodeError> {
        if let Some((&tag, rest)) = self.input.split_first() {
            if tag < U16 {
                self.input = rest;
                return Ok(u64::from(tag));
            }
            if tag <= widest {
                macro_rules! le {
                    ($n:literal, $int:ty) => {
                        if let Some((bytes, rest)) = rest.split_first_chunk::<$n>() {
                            self.input = rest;
                            return Ok(u64::from(<$int>::from_le_bytes(*bytes)));
                        }
                    };
                }
                match tag {
                    U16 => le!(2, u16),
                    U32 => le!(4, u32),
                    _ => le!(8, u64),
                }
            }
        }
        self.wide_varint(ty, widest).map(|n| n as u64)
    }

    /// A `u128` or `i128` varint: only the one-byte case inline.
    #[inline]
    fn varint128(&mut self, ty: IntegerType) -> Result<u128, DecodeError> {
        match self.input.split_first() {
            Some((&b, rest)) if b < U16 => {
                self.input = rest;
                Ok(u128::from(b))
            }
            _ => self.wide_varint(ty, U128),
        }
    }

    #[cold]
    #[inline(never)]
    fn wide_varint(&mut self, ty: IntegerType, widest: u8) -> Result<u128, DecodeError> {
        let tag = self.byte()?;
        if tag < U16 {
            return Ok(u128::from(tag));
        }
        if tag > widest {
            let found = match tag {
                U32 => IntegerType::U32,
                U64 => IntegerType::U64,
                U128 => IntegerType::U128,
                _ => IntegerType::Reserved,
            };
            let found = if is_signed(&ty) { signed(found) } else { found };
            return Err(DecodeError::InvalidIntegerType {
                expected: ty,
                found,
            });
        }
        Ok(match tag {
            U16 => u128::from(u16::from_le_bytes(self.array()?)),
            U32 => u128::from(u32::from_le_bytes(self.array()?)),
            U64 => u128::from(u64::from_le_bytes(self.array()?)),
            _ => u128::from_le_bytes(self.array()?),
        })
    }

    /// A length: a `u64` varint, named `ty` when refused (bincode reads a string's as a
    /// `U64`, and its serde decoder a sequence's or map's as a `Usize`).
    #[inline(always)]
    fn len(&mut self, ty: IntegerType) -> Result<usize, DecodeError> {
        let n = self.varint(ty, U64)?;
        usize::try_from(n).map_err(|_| DecodeError::OutsideUsizeRange(n))
    }

    #[inline]
    fn char(&mut self) -> Result<char, DecodeError> {
        let mut utf8 = [0u8; 4];
        utf8[0] = self.byte()?;
        let width = match utf8[0] {
            0x00..=0x7f => return Ok(char::from(utf8[0])),
            0xc2..=0xdf => 2,
            0xe0..=0xef => 3,
            0xf0..=0xf4 => 4,
            _ => return Err(DecodeError::InvalidCharEncoding(utf8)),
        };
        utf8[1..width].copy_from_slice(self.slice(width - 1)?);
        std::str::from_utf8(&utf8[..width])
            .ok()
            .and_then(|s| s.chars().next())
            .ok_or(DecodeError::InvalidCharEncoding(utf8))
    }

    #[inline(always)]
    fn str(&mut self) -> Result<&'de str, DecodeError> {
        let bytes = self.bytes()?;
        std::str::from_utf8(bytes).map_err(|inner| DecodeError::Utf8 { inner })
    }

    /// A string or byte string: its length, then its bytes, charged to the budget.
    #[inline(always)]
    fn bytes(&mut self) -> Result<&'de [u8], DecodeError> {
        let len = self.len(IntegerType::U64)?;
        let bytes = self.slice(len)?;
        self.charge(len)?;
        Ok(bytes)
    }

    /// A sequence's elements (`charge`: of claimed length, each charged) or a tuple's, one
    /// level deeper.
    #[inline(always)]
    fn seq<V: Visitor<'de>>(
        &mut self,
        len: usize,
        charge: bool,
        v: V,
    ) -> Result<V::Value, DecodeError> {
        self.nested(|de| de.fields(len, charge, v))
    }

    /// The elements or fields themselves, at this level: an enum's tuple or struct variant,
    /// whose enum already took the level.
    #[inline(always)]
    fn fields<V: Visitor<'de>>(
        &mut self,
        len: usize,
        charge: bool,
        v: V,
    ) -> Result<V::Value, DecodeError> {
        v.visit_seq(Elements {
            de: self,
            left: len,
            charge,
        })
    }
}

fn is_signed(ty: &IntegerType) -> bool {
    matches!(
        ty,
        IntegerType::I8
            | IntegerType::I16
            | IntegerType::I32
            | IntegerType::I64
            | IntegerType::I128
            | IntegerType::Isize
    )
}

/// bincode reports a signed type's bad tag with the signed names.
fn signed(ty: IntegerType) -> IntegerType {
    match ty {
        IntegerType::U8 => IntegerType::I8,
        IntegerType::U16 => IntegerType::I16,
        IntegerType::U32 => IntegerType::I32,
        IntegerType::U64 => IntegerType::I64,
        IntegerType::U128 => IntegerType::I128,
        IntegerType::Usize => IntegerType::Isize,
        other => other,
    }
}

/// Unsigned varints of each width.
macro_rules! unsigned {
    ($($method:ident, $visit:ident, $ty:ty, $int:ident, $tag:ident;)*) => {
        $(
            #[inline(always)]
            fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
                let n = self.varint(IntegerType::$int, $tag)? as $ty;
                v.$visit(n)
            }
        )*
    };
}

/// Signed varints of each width: zigzag over the unsigned one.
macro_rules! signed {
    ($($method:ident, $visit:ident, $ty:ty, $uty:ty, $int:ident, $tag:ident;)*) => {
        $(
            #[inline(always)]
            fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
                let n = self.varint(IntegerType::$int, $tag)? as $uty;
                let half = (n >> 1) as $ty;
                v.$visit(if n & 1 == 0 { half } else { !half })
            }
        )*
    };
}

impl<'de> Deserializer<'de> for &mut BodyReader<'de> {
    type Error = DecodeError;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, DecodeError> {
        Err(bincode::serde::DecodeError::AnyNotSupported.into())
    }

    #[inline(always)]
    fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        match self.byte()? {
            0 => v.visit_bool(false),
            1 => v.visit_bool(true),
            b => Err(DecodeError::InvalidBooleanValue(b)),
        }
    }

    #[inline(always)]
    fn deserialize_u8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let b = self.byte()?;
        v.visit_u8(b)
    }

    #[inline(always)]
    fn deserialize_i8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let b = self.byte()?;
        v.visit_i8(b as i8)
    }

    unsigned! {
        deserialize_u16, visit_u16, u16, U16, U16;
        deserialize_u32, visit_u32, u32, U32, U32;
        deserialize_u64, visit_u64, u64, U64, U64;
    }

    signed! {
        deserialize_i16, visit_i16, i16, u16, I16, U16;
        deserialize_i32, visit_i32, i32, u32, I32, U32;
        deserialize_i64, visit_i64, i64, u64, I64, U64;
    }

    #[inline]
    fn deserialize_u128<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let n = self.varint128(IntegerType::U128)?;
        v.visit_u128(n)
    }

    #[inline]
    fn deserialize_i128<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let n = self.varint128(IntegerType::I128)?;
        let half = (n >> 1) as i128;
        v.visit_i128(if n & 1 == 0 { half } else { !half })
    }

    #[inline(always)]
    fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let x = f32::from_le_bytes(self.array()?);
        v.visit_f32(x)
    }

    #[inline(always)]
    fn deserialize_f64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let x = f64::from_le_bytes(self.array()?);
        v.visit_f64(x)
    }

    #[inline]
    fn deserialize_char<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let c = self.char()?;
        v.visit_char(c)
    }

    // Strings and byte strings are lent from the body (checked against the bytes present);
    // a visitor that wants them owned copies what is really there.
    #[inline]
    fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let s = self.str()?;
        v.visit_borrowed_str(s)
    }

    #[inline]
    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        self.deserialize_str(v)
    }

    #[inline]
    fn deserialize_bytes<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let b = self.bytes()?;
        v.visit_borrowed_bytes(b)
    }

    #[inline]
    fn deserialize_byte_buf<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        self.deserialize_bytes(v)
    }

    #[inline]
    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        match self.byte()? {
            0 => v.visit_none(),
            1 => self.nested(|de| v.visit_some(de)),
            found => Err(DecodeError::UnexpectedVariant {
                type_name: "Option<T>",
                allowed: &AllowedEnumVariants::Range { min: 0, max: 1 },
                found: u32::from(found),
            }),
        }
    }

    #[inline]
    fn deserialize_unit<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        v.visit_unit()
    }

    #[inline]
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, DecodeError> {
        v.visit_unit()
    }

    #[inline]
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, DecodeError> {
        self.nested(|de| v.visit_newtype_struct(de))
    }

    #[inline]
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let len = self.len(IntegerType::Usize)?;
        self.seq(len, true, v)
    }

    #[inline]
    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, v: V) -> Result<V::Value, DecodeError> {
        self.seq(len, false, v)
    }

    #[inline]
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        len: usize,
        v: V,
    ) -> Result<V::Value, DecodeError> {
        self.seq(len, false, v)
    }

    #[inline]
    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, DecodeError> {
        let len = self.len(IntegerType::Usize)?;
        self.nested(|de| v.visit_map(Entries { de, left: len }))
    }

    #[inline]
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, DecodeError> {
        self.seq(fields.len(), false, v)
    }

    #[inline]
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, DecodeError> {
        self.nested(|de| v.visit_enum(de))
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, _: V) -> Result<V::Value, DecodeError> {
        Err(bincode::serde::DecodeError::IdentifierNotSupported.into())
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, DecodeError> {
        Err(bincode::serde::DecodeError::IgnoredAnyNotSupported.into())
    }

    #[inline]
    fn is_human_readable(&self) -> bool {
        false
    }
}

/// A sequence's or tuple's elements.
struct Elements<'a, 'de> {
    de: &'a mut BodyReader<'de>,
    left: usize,
    /// Whether the length was claimed by the peer (a sequence), so that each element is
    /// charged, at least one byte so that zero-sized ones are bounded too; a tuple's or a
    /// struct's length is fixed by its type.
    charge: bool,
}

impl<'de> SeqAccess<'de> for Elements<'_, 'de> {
    type Error = DecodeError;

    #[inline(always)]
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DecodeError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        if self.charge {
            self.de.charge(std::mem::size_of::<T::Value>().max(1))?;
        }
        seed.deserialize(&mut *self.de).map(Some)
    }

    // serde's own `next_element` is not always inlined, and a call per element of a long
    // sequence costs more than decoding it.
    #[inline(always)]
    fn next_element<T: de::Deserialize<'de>>(&mut self) -> Result<Option<T>, DecodeError> {
        self.next_element_seed(std::marker::PhantomData)
    }

    // No hint for a claimed length: it was claimed by the peer, not proven.
    #[inline]
    fn size_hint(&self) -> Option<usize> {
        (!self.charge).then_some(self.left)
    }
}

/// A map's entries, each key and value charged like a sequence's elements.
struct Entries<'a, 'de> {
    de: &'a mut BodyReader<'de>,
    left: usize,
}

impl<'de> MapAccess<'de> for Entries<'_, 'de> {
    type Error = DecodeError;

    #[inline(always)]
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DecodeError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        self.de.charge(std::mem::size_of::<K::Value>().max(1))?;
        seed.deserialize(&mut *self.de).map(Some)
    }

    #[inline(always)]
    fn next_value_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<T::Value, DecodeError> {
        self.de.charge(std::mem::size_of::<T::Value>().max(1))?;
        seed.deserialize(&mut *self.de)
    }

    #[inline]
    fn size_hint(&self) -> Option<usize> {
        None
    }
}

impl<'de> EnumAccess<'de> for &mut BodyReader<'de> {
    type Error = DecodeError;
    type Variant = Self;

    #[inline]
    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self), DecodeError> {
        let index = self.varint(IntegerType::U32, U32)? as u32;
        let value = seed.deserialize(index.into_deserializer())?;
        Ok((value, self))
    }
}

impl<'de> VariantAccess<'de> for &mut BodyReader<'de> {
    type Error = DecodeError;

    #[inline]
    fn unit_variant(self) -> Result<(), DecodeError> {
        Ok(())
    }

    #[inline]
    fn newtype_variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<S::Value, DecodeError> {
        seed.deserialize(self)
    }

    #[inline]
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, v: V) -> Result<V::Value, DecodeError> {
        self.fields(len, false, v)
    }

    #[inline]
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, DecodeError> {
        self.fields(fields.len(), false, v)
    }
}
