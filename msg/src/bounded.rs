//! A serde deserializer wrapper that bounds what decoding a message may allocate by a number
//! of bytes chosen at run time ([`crate::SessionConfig::max_message`]), which bincode's own
//! limit (a const generic) cannot be.
//!
//! Forged lengths are the danger: serde preallocates a container from the length its prefix
//! claims (up to 1 MiB each), and bincode allocates an owned string or byte buffer of the
//! claimed length before reading it. So the wrapper
//!
//! - gives containers no size hint: a `Vec` grows only with elements actually decoded (any
//!   visitor may trust a hint, and not all cap it as serde's own containers do);
//! - reads owned strings and byte buffers as borrowed ones (which bincode checks against the
//!   bytes present, allocating nothing) and lets the visitor copy what is really there;
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
//! the stack within `max`. Every nested value decoded through the wrapper (each seed: the
//! message itself, a sequence or map element, a map key, an enum variant and its content, an
//! `Option`'s `Some`, a newtype's content) is one level deeper, and the decode fails beyond
//! [`MAX_DEPTH`] levels.

use std::cell::Cell;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess};
use serde::de::{VariantAccess, Visitor};

/// How deeply values may nest in a decoded message: the number of nested values (the message
/// itself, a sequence or map element or key, an enum variant, an `Option`'s `Some`, a newtype's
/// content) on the path to the innermost one. Deeper input fails to decode
/// ([`crate::DecodeFailure::TooDeep`]) instead of overflowing the stack. A value of a
/// recursive type such as `enum Expr { Lit(u8), Neg(Box<Expr>) }` may nest about this many
/// times (one level per `Neg`, plus the message).
pub const MAX_DEPTH: usize = 128;

/// What a decode may still allocate, and how deep it is.
#[derive(Debug)]
pub(crate) struct Budget {
    left: Cell<usize>,
    exceeded: Cell<bool>,
    depth: Cell<usize>,
    max_depth: usize,
    too_deep: Cell<bool>,
}

impl Budget {
    #[inline]
    pub(crate) fn new(max: usize) -> Self {
        Self {
            left: Cell::new(max),
            exceeded: Cell::new(false),
            depth: Cell::new(0),
            max_depth: MAX_DEPTH,
            too_deep: Cell::new(false),
        }
    }

    /// Whether a decode failed because the budget ran out.
    #[inline]
    pub(crate) fn exceeded(&self) -> bool {
        self.exceeded.get()
    }

    /// Whether a decode failed because values nested deeper than the limit.
    #[inline]
    pub(crate) fn too_deep(&self) -> bool {
        self.too_deep.get()
    }

    /// Runs `f` one level deeper, or fails if that is beyond the limit.
    #[inline(always)]
    fn nested<T, E: de::Error>(&self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let depth = self.depth.get();
        if depth >= self.max_depth {
            self.too_deep.set(true);
            return Err(E::custom("decoded message nests too deeply"));
        }
        self.depth.set(depth + 1);
        let r = f();
        self.depth.set(depth);
        r
    }

    #[inline(always)]
    fn charge<E: de::Error>(&self, n: usize) -> Result<(), E> {
        match self.left.get().checked_sub(n) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.exceeded.set(true);
                Err(E::custom("decoded message exceeds its size bound"))
            }
        }
    }

    #[inline(always)]
    fn charge_value<T, E: de::Error>(&self) -> Result<(), E> {
        self.charge(std::mem::size_of::<T>().max(1))
    }
}

/// Deserializes with `seed` from `de`, within `budget`.
pub(crate) struct Bounded<'b, S> {
    pub(crate) seed: S,
    pub(crate) budget: &'b Budget,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Bounded<'_, S> {
    type Value = S::Value;

    #[inline(always)]
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<S::Value, D::Error> {
        let budget = self.budget;
        budget.nested(|| self.seed.deserialize(De { inner: de, budget }))
    }
}

struct De<'b, D> {
    inner: D,
    budget: &'b Budget,
}

struct Vis<'b, V> {
    inner: V,
    budget: &'b Budget,
    /// Whether a sequence or map it visits has a claimed length, so that its elements are
    /// charged (not the fields of a struct, a tuple's or an array's elements).
    container: bool,
}

impl<'b, D> De<'b, D> {
    #[inline]
    fn wrap<V>(&self, inner: V) -> Vis<'b, V> {
        Vis {
            inner,
            budget: self.budget,
            container: false,
        }
    }

    #[inline]
    fn wrap_container<V>(&self, inner: V) -> Vis<'b, V> {
        Vis {
            inner,
            budget: self.budget,
            container: true,
        }
    }
}

/// Scalars: bincode (the only format wrapped here) hands a scalar's visitor the scalar and
/// nothing else, so the visitor goes unwrapped, and the call stays small enough to inline.
macro_rules! forward_scalar {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[inline(always)]
            fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* v: V) -> Result<V::Value, D::Error> {
                self.inner.$method($($arg,)* v)
            }
        )*
    };
}

macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[inline]
            fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* v: V) -> Result<V::Value, D::Error> {
                let v = self.wrap(v);
                self.inner.$method($($arg,)* v)
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for De<'_, D> {
    type Error = D::Error;

    forward_scalar! {
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_i128();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_u128();
        deserialize_f32();
        deserialize_f64();
        deserialize_char();
    }

    forward! {
        deserialize_str();
        deserialize_bytes();
        deserialize_option();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str);
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier();
        deserialize_ignored_any();
    }

    // What `any` finds may be a sequence or map of claimed length.
    #[inline]
    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        let v = self.wrap_container(v);
        self.inner.deserialize_any(v)
    }

    #[inline]
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        let v = self.wrap_container(v);
        self.inner.deserialize_seq(v)
    }

    #[inline]
    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        let v = self.wrap_container(v);
        self.inner.deserialize_map(v)
    }

    // Owned strings and byte buffers are read in place (checked against the bytes present)
    // and copied by the visitor, instead of allocated at their claimed length first.
    #[inline]
    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        let v = self.wrap(v);
        self.inner.deserialize_str(v)
    }

    #[inline]
    fn deserialize_byte_buf<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        let v = self.wrap(v);
        self.inner.deserialize_bytes(v)
    }

    #[inline]
    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

macro_rules! forward_visit {
    ($($method:ident($ty:ty);)*) => {
        $(
            #[inline]
            fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
                self.inner.$method(v)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Vis<'_, V> {
    type Value = V::Value;

    #[inline]
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit! {
        visit_bool(bool);
        visit_i8(i8);
        visit_i16(i16);
        visit_i32(i32);
        visit_i64(i64);
        visit_i128(i128);
        visit_u8(u8);
        visit_u16(u16);
        visit_u32(u32);
        visit_u64(u64);
        visit_u128(u128);
        visit_f32(f32);
        visit_f64(f64);
        visit_char(char);
    }

    #[inline]
    fn visit_str<E: de::Error>(self, v: &str) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_str(v)
    }

    #[inline]
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_borrowed_str(v)
    }

    #[inline]
    fn visit_string<E: de::Error>(self, v: String) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_string(v)
    }

    #[inline]
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_bytes(v)
    }

    #[inline]
    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_borrowed_bytes(v)
    }

    #[inline]
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_byte_buf(v)
    }

    #[inline]
    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    #[inline]
    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    #[inline]
    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        let budget = self.budget;
        budget.nested(|| self.inner.visit_some(De { inner: de, budget }))
    }

    #[inline]
    fn visit_newtype_struct<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        let budget = self.budget;
        budget.nested(|| self.inner.visit_newtype_struct(De { inner: de, budget }))
    }

    #[inline]
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.inner.visit_seq(Seq {
            inner: seq,
            budget: self.budget,
            charge: self.container,
        })
    }

    #[inline]
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(Map {
            inner: map,
            budget: self.budget,
            charge: self.container,
        })
    }

    #[inline]
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.inner.visit_enum(Enum {
            inner: data,
            budget: self.budget,
        })
    }
}

struct Seq<'b, A> {
    inner: A,
    budget: &'b Budget,
    charge: bool,
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Seq<'_, A> {
    type Error = A::Error;

    #[inline(always)]
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        let budget = self.budget;
        let value = self.inner.next_element_seed(Bounded { seed, budget })?;
        if self.charge && value.is_some() {
            budget.charge_value::<T::Value, _>()?;
        }
        Ok(value)
    }

    // serde's own `next_element` is not always inlined, and a call per element of a long
    // sequence costs more than decoding it.
    #[inline(always)]
    fn next_element<T: de::Deserialize<'de>>(&mut self) -> Result<Option<T>, A::Error> {
        self.next_element_seed(std::marker::PhantomData)
    }

    // No hint: the length was claimed by the peer, not proven.
    #[inline]
    fn size_hint(&self) -> Option<usize> {
        if self.charge {
            None
        } else {
            self.inner.size_hint()
        }
    }
}

struct Map<'b, A> {
    inner: A,
    budget: &'b Budget,
    charge: bool,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<'_, A> {
    type Error = A::Error;

    #[inline(always)]
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        let budget = self.budget;
        let key = self.inner.next_key_seed(Bounded { seed, budget })?;
        if self.charge && key.is_some() {
            budget.charge_value::<K::Value, _>()?;
        }
        Ok(key)
    }

    #[inline(always)]
    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        let budget = self.budget;
        let value = self.inner.next_value_seed(Bounded { seed, budget })?;
        if self.charge {
            budget.charge_value::<T::Value, _>()?;
        }
        Ok(value)
    }

    #[inline]
    fn size_hint(&self) -> Option<usize> {
        if self.charge {
            None
        } else {
            self.inner.size_hint()
        }
    }
}

struct Enum<'b, A> {
    inner: A,
    budget: &'b Budget,
}

impl<'de, 'b, A: EnumAccess<'de>> EnumAccess<'de> for Enum<'b, A> {
    type Error = A::Error;
    type Variant = Variant<'b, A::Variant>;

    #[inline]
    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self::Variant), A::Error> {
        let budget = self.budget;
        let (value, inner) = self.inner.variant_seed(Bounded { seed, budget })?;
        Ok((value, Variant { inner, budget }))
    }
}

struct Variant<'b, A> {
    inner: A,
    budget: &'b Budget,
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Variant<'_, A> {
    type Error = A::Error;

    #[inline]
    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    #[inline]
    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        let budget = self.budget;
        self.inner.newtype_variant_seed(Bounded { seed, budget })
    }

    #[inline]
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, v: V) -> Result<V::Value, A::Error> {
        let budget = self.budget;
        let v = Vis {
            inner: v,
            budget,
            container: false,
        };
        self.inner.tuple_variant(len, v)
    }

    #[inline]
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, A::Error> {
        let budget = self.budget;
        let v = Vis {
            inner: v,
            budget,
            container: false,
        };
        self.inner.struct_variant(fields, v)
    }
}
