//! [`Bulk`]: a byte payload that a message carries by reference when it goes by rendezvous.

use std::cell::RefCell;
use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes a message carries that need not be copied to be sent.
///
/// It serializes as a byte string, exactly as `Vec<u8>` with `serde_bytes` does, so a type
/// with a `Bulk` field and one with a `&[u8]` (or `serde_bytes::ByteBuf`) field in its place
/// encode alike and can share a tag: a receiver decodes a borrowed view of the message and
/// reads the payload in place, from the registered buffer the rendezvous read it into.
///
/// When the message goes by rendezvous (see [`crate::SessionConfig::rendezvous_threshold`]),
/// these bytes are not serialized into an encoding: they are exposed to the peer as they are
/// (under a key of their own, for reading only), and the peer's device reads them straight
/// into its buffer. The bytes are immutable and shared ([`Bytes`]), so nobody can change them
/// while they are exposed; cloning a `Bulk` clones the handle, not the bytes. Decoding a
/// `Bulk` copies, except with [`crate::Envelope::decode_shared`], which hands out a `Bulk`
/// sharing the received bytes: the same owned type then serves for sending and for
/// zero-copy receiving.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Bulk(Bytes);

impl Bulk {
    /// The payload.
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Self(bytes.into())
    }

    /// The bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// The bytes, by value.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Bulk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bulk({} bytes)", self.0.len())
    }
}

impl From<Vec<u8>> for Bulk {
    fn from(v: Vec<u8>) -> Self {
        Self(v.into())
    }
}

impl From<Bytes> for Bulk {
    fn from(b: Bytes) -> Self {
        Self(b)
    }
}

impl std::ops::Deref for Bulk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

thread_local! {
    /// While a message is encoded for rendezvous on this thread: the `Bulk` payloads met so
    /// far, so that the encoder can tell their bytes from the rest when they are written.
    static CAPTURE: RefCell<Option<Vec<Bytes>>> = const { RefCell::new(None) };
}

thread_local! {
    /// While a message is decoded by [`crate::Envelope::decode_shared`] on this thread: the
    /// bytes its body is in, which `Bulk` payloads of that body share instead of copying.
    static SOURCE: RefCell<Option<Bytes>> = const { RefCell::new(None) };
}

/// Runs `decode` with `source` as the bytes that `Bulk` payloads found in it share.
pub(crate) fn sharing<T>(source: Bytes, decode: impl FnOnce() -> T) -> T {
    struct Reset(Option<Bytes>);
    impl Drop for Reset {
        fn drop(&mut self) {
            SOURCE.with(|s| *s.borrow_mut() = self.0.take());
        }
    }
    let _reset = Reset(SOURCE.with(|s| s.borrow_mut().replace(source)));
    decode()
}

/// `v` as a `Bulk`: sharing the bytes of the body being decoded if it lies in them and is
/// large enough to be worth it, else copied.
fn shared_or_copied(v: &[u8]) -> Bulk {
    if v.len() >= MIN_BY_REFERENCE {
        let shared = SOURCE.with(|s| {
            s.borrow().as_ref().and_then(|src| {
                let (start, end) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
                let p = v.as_ptr() as usize;
                (p >= start && p + v.len() <= end).then(|| src.slice_ref(v))
            })
        });
        if let Some(b) = shared {
            return Bulk(b);
        }
    }
    Bulk(Bytes::copy_from_slice(v))
}

/// Payloads smaller than this are copied into the encoding all the same: exposing them
/// would cost more than the copy.
pub(crate) const MIN_BY_REFERENCE: usize = 4096;

impl Serialize for Bulk {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.0.len() >= MIN_BY_REFERENCE {
            CAPTURE.with(|c| {
                if let Some(list) = c.borrow_mut().as_mut() {
                    list.push(self.0.clone());
                }
            });
        }
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bulk {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Bulk;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bulk, E> {
                Ok(shared_or_copied(v))
            }
            fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<Bulk, E> {
                Ok(shared_or_copied(v))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bulk, E> {
                Ok(Bulk(v.into()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bulk, A::Error> {
                let mut v = Vec::new();
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(Bulk(v.into()))
            }
        }
        deserializer.deserialize_bytes(Visit)
    }
}

/// One piece of a message encoded for rendezvous, in order: bytes the encoder wrote, or a
/// [`Bulk`] payload left where it is.
#[derive(Debug, Clone)]
pub enum Piece {
    /// Encoded bytes.
    Encoded(Vec<u8>),
    /// A payload, by reference.
    Bulk(Bytes),
}

impl Piece {
    /// Its length.
    pub fn len(&self) -> usize {
        match self {
            Piece::Encoded(v) => v.len(),
            Piece::Bulk(b) => b.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Piece::Encoded(v) => v,
            Piece::Bulk(b) => b,
        }
    }
}

/// A bincode writer that leaves captured payloads out of the bytes it copies.
struct PieceWriter<'a> {
    pieces: &'a mut Vec<Piece>,
    current: Vec<u8>,
}

impl bincode::enc::write::Writer for PieceWriter<'_> {
    // Inline: a long sequence of scalars writes a few bytes per element.
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
        if bytes.len() < MIN_BY_REFERENCE || !self.left_by_reference(bytes) {
            self.current.extend_from_slice(bytes);
        }
        Ok(())
    }
}

impl PieceWriter<'_> {
    /// Whether `bytes` are a captured payload's, now left as a piece by reference.
    #[inline(never)]
    fn left_by_reference(&mut self, bytes: &[u8]) -> bool {
        let found = CAPTURE.with(|c| {
            c.borrow().as_ref().and_then(|list| {
                list.iter()
                    .rev()
                    .find(|b| b.as_ptr() == bytes.as_ptr() && b.len() == bytes.len())
                    .cloned()
            })
        });
        let Some(b) = found else {
            return false;
        };
        if !self.current.is_empty() {
            self.pieces
                .push(Piece::Encoded(std::mem::take(&mut self.current)));
        }
        self.pieces.push(Piece::Bulk(b));
        true
    }
}

impl Drop for PieceWriter<'_> {
    fn drop(&mut self) {
        if !self.current.is_empty() {
            self.pieces
                .push(Piece::Encoded(std::mem::take(&mut self.current)));
        }
    }
}

/// Encodes `value` into pieces whose concatenation is its bincode encoding, [`Bulk`]
/// payloads of at least [`MIN_BY_REFERENCE`] bytes left by reference.
pub(crate) fn encode_pieces<T: Serialize + ?Sized>(
    value: &T,
    config: impl bincode::config::Config,
) -> Result<Vec<Piece>, bincode::error::EncodeError> {
    struct Reset(Option<Vec<Bytes>>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let old = self.0.take();
            CAPTURE.with(|c| *c.borrow_mut() = old);
        }
    }
    // Nested encodings (a Serialize impl that encodes) restore the outer capture.
    let _reset = Reset(CAPTURE.with(|c| c.borrow_mut().replace(Vec::new())));
    let mut pieces = Vec::new();
    bincode::serde::encode_into_writer(
        value,
        PieceWriter {
            pieces: &mut pieces,
            current: Vec::new(),
        },
        config,
    )?;
    Ok(pieces)
}
