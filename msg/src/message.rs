//! Message types and their tags.

use serde::Serialize;

/// A type that travels as a message. Implement it with [`crate::message!`].
///
/// Receiving an owned value ([`crate::Envelope::decode`]) needs `DeserializeOwned` as well. A
/// *view* with borrowed fields (`&[u8]` marked `#[serde(borrow, with = "serde_bytes")]`, `&str`)
/// and the same layout can share the owned type's tag: it is then decoded straight from the
/// receive buffer ([`crate::Envelope::decode_borrowed`]) and sent without building the owned
/// value first.
pub trait Message: Serialize {
    /// The tag that identifies the type on the wire (never 0, which frames without a message
    /// use).
    const TAG: u32;
    /// Whether `send` wakes a receiver sleeping solicited-only by default: `true` for
    /// requests and alarms, `false` for telemetry that may wait for the next wake-up.
    const SOLICITED: bool = true;
}

/// A tag from a name: 32-bit FNV-1a, never 0. Stable across builds and platforms.
pub const fn tag(name: &str) -> u32 {
    let bytes = name.as_bytes();
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    if hash == 0 {
        1
    } else {
        hash
    }
}

/// Implements [`Message`] for a type.
///
/// ```
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Reading { sensor: u16, value: f32 }
/// #[derive(Serialize, Deserialize)]
/// struct Alarm { sensor: u16 }
/// #[derive(Serialize, Deserialize)]
/// struct Ping;
///
/// msg::message!(Reading, solicited = false);         // tag derived from the type's path
/// msg::message!(Alarm);                              // wakes the receiver by default
/// msg::message!(Ping, tag = "example.ping");         // tag declared by name
/// assert_ne!(<Reading as msg::Message>::TAG, <Alarm as msg::Message>::TAG);
/// ```
#[macro_export]
macro_rules! message {
    ($ty:ty) => {
        $crate::message!(
            $ty,
            tag = concat!(module_path!(), "::", stringify!($ty)),
            solicited = true
        );
    };
    ($ty:ty, solicited = $s:expr) => {
        $crate::message!(
            $ty,
            tag = concat!(module_path!(), "::", stringify!($ty)),
            solicited = $s
        );
    };
    ($ty:ty, tag = $name:expr) => {
        $crate::message!($ty, tag = $name, solicited = true);
    };
    ($ty:ty, tag = $name:expr, solicited = $s:expr) => {
        impl $crate::Message for $ty {
            const TAG: u32 = $crate::tag($name);
            const SOLICITED: bool = $s;
        }
    };
}
