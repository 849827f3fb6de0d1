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

/// Tag of a request's frame (its body: call number, request tag, request; see
/// [`crate::call`]).
pub const CALL_TAG: u32 = tag("rdmsg.call");
/// Tag of an answer's frame (its body: call number, status, response).
pub const REPLY_TAG: u32 = tag("rdmsg.reply");

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
/// # Tags
///
/// A message's tag is the FNV-1a hash ([`tag`]) of a *wire name*. By default the wire name is
/// the type's name as written, `Reading` for `message!(Reading)`: it does not change when the
/// type moves to another module or crate, and two programs that both call their type
/// `Reading` agree on it. `tag = "..."` pins the wire name explicitly, in the spirit of serde's
/// `#[serde(rename)]` or a protobuf field number: declare one for anything that crosses a
/// boundary you do not control (another program, another version), and keep it when you
/// rename the type.
///
/// A type that is not a plain name (a path such as `net::Ping`, a generic such as
/// `Frame<'_>` or `Wrapper<u32>`) must declare its tag: how a path or a generic type is
/// written is not a wire format. Two types with the same name in one program (say
/// `sensor::Reading` and `billing::Reading`) get the same default tag and must declare tags
/// too; registering both ([`crate::Session::register`], [`crate::Dispatcher::on`],
/// [`crate::Dispatcher::channel`]) fails with [`crate::Error::DuplicateTag`] rather than
/// mixing them up.
///
/// A borrowed *view* of a type declares its owned type's tag on purpose, so that it travels
/// and decodes like it; register the owned type only.
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
/// #[derive(Serialize, Deserialize)]
/// struct Blob<'a> { #[serde(borrow)] name: &'a str }
///
/// rdmsg_msg::message!(Reading, solicited = false);         // tag of "Reading"
/// rdmsg_msg::message!(Alarm);                              // wakes the receiver by default
/// rdmsg_msg::message!(Ping, tag = "example.ping");         // wire name pinned
/// rdmsg_msg::message!(Blob<'_>, tag = "example.blob");     // generic: the tag must be declared
/// assert_eq!(<Reading as rdmsg_msg::Message>::TAG, rdmsg_msg::tag("Reading"));
/// assert_ne!(<Reading as rdmsg_msg::Message>::TAG, <Alarm as rdmsg_msg::Message>::TAG);
/// ```
///
/// Without a tag, a generic type does not compile:
///
/// ```compile_fail
/// #[derive(serde::Serialize)]
/// struct Wrapper<T>(T);
/// rdmsg_msg::message!(Wrapper<u32>);
/// ```
#[macro_export]
macro_rules! message {
    ($name:ident) => {
        $crate::message!($name, tag = stringify!($name), solicited = true);
    };
    ($name:ident, solicited = $s:expr) => {
        $crate::message!($name, tag = stringify!($name), solicited = $s);
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
    ($ty:ty $(, solicited = $s:expr)?) => {
        compile_error!(concat!(
            "rdmsg_msg::message!(",
            stringify!($ty),
            "): only a plain type name gets a default tag; declare one with `tag = \"...\"`"
        ));
    };
}
