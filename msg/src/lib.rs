//! Framed, typed messages for rdmsg, where the sender decides per message who wakes up.
//!
//! # Quick start
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use rdmsg_transport::{Config, Endpoint};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Reading { sensor: u16, value: f32 }
//! #[derive(Serialize, Deserialize)]
//! struct Alarm { sensor: u16 }
//! rdmsg_msg::message!(Reading, solicited = false); // telemetry: lands silently; tag of "Reading"
//! rdmsg_msg::message!(Alarm);                      // wakes the receiver; tag of "Alarm"
//!
//! # fn main() -> Result<(), rdmsg_msg::Error> {
//! let ep = Endpoint::open_default()?;
//! let mut tx = rdmsg_msg::Session::new(ep.connect("receiver:18600", &Config::default())?);
//! tx.send(&Reading { sensor: 1, value: 20.5 })?;
//! tx.send(&Alarm { sensor: 1 })?; // the receiver wakes once and gets both, in order
//! # Ok(()) }
//! ```
//!
//! The receiver: `let env = session.recv()?; if env.is::<Alarm>() { env.decode::<Alarm>()? }`,
//! or a [`Dispatcher`] routing types to handlers or to crossbeam channels read by workers.
//!
//! # Many peers
//!
//! A [`Hub`] serves many connections from one thread over a transport
//! [`rdmsg_transport::RawHub`]: `send(peer, &m)` and friends per peer, and `recv()` returning
//! [`HubEvent`]s (connected, a message with its peer, a bad frame, disconnected). Each peer
//! has what a session has (sequence, solicitation policy, decoder, statistics), by the same
//! code; types are registered once, for all. [`Dispatcher::on_from`],
//! [`Dispatcher::channel_from`] and [`Dispatcher::run_hub`] route with the sending peer.
//!
//! # Tags
//!
//! Each message carries its type's 32-bit tag, the FNV-1a hash of a wire name: by default the
//! type's name as written (`Reading`), so that it survives moving the type and two programs
//! naming their types alike agree; `message!(T, tag = "...")` pins it, like serde's `rename`
//! or a protobuf field number (see [`message!`]). Registering a tag twice (two types of the
//! same name, with [`Session::register`], [`Dispatcher::on`] or [`Dispatcher::channel`]) is
//! an [`Error::DuplicateTag`] naming both types, found at start-up rather than on the wire.
//!
//! # Frames
//!
//! Each RC message is one [`frame`]: a 20-byte header (magic, version, flags, tag, sequence,
//! fragment index, length) and a bincode 2 body, serialized straight into the registered send
//! buffer. Larger messages are fragmented and reassembled.
//!
//! # Solicitation
//!
//! `send` follows the type's [`Message::SOLICITED`]; `send_as` overrides it; `send_batch`
//! solicits only the last message; a fragmented message is solicited on its last fragment
//! only. On top of that, [`policy`] solicits after long unsolicited runs, and the transport
//! solicits what a blocked peer needs. So a receiver asleep solicited-only never sleeps on a
//! backlog forever.
//!
//! # Bad input
//!
//! Each RC message is a whole frame, so a bad one never desynchronises the next: it is dropped
//! and counted, and `recv` returns its typed error ([`Error::BadFrame`], [`Error::UnknownTag`];
//! `decode` gives [`Error::Decode`]), none of which is fatal ([`Error::is_fatal`]). The
//! connection is closed only for transport-level breaches (credit protocol, immediate data),
//! where carrying on could overrun buffers.
//!
//! Nothing a peer claims is allocated before it is there: once types are registered, a
//! fragmented message of an unknown tag is refused at its first fragment, before anything of
//! it is buffered; reassembly stops at [`SessionConfig::max_message`]; and decoding never
//! preallocates from a claimed length, and fails ([`DecodeFailure::TooLarge`]) once the value's
//! strings and container elements would exceed `max_message`, or
//! ([`DecodeFailure::TooDeep`]) once values nest deeper than [`codec::MAX_DEPTH`].
//!
//! # Errors that end loops
//!
//! [`Error::is_fatal`] sorts every error: per-message ones (bad frames, unknown tags, bodies
//! that do not decode, transport timeouts) are skipped by [`Session::incoming`] and
//! [`Dispatcher::run`]; anything that would recur (a failed connection, a verb, wait or
//! bootstrap call that failed, an unknown transport error) ends them at once, so that a broken
//! device never makes a receive loop spin.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod bounded;
mod bulk;
pub mod call;
pub mod codec;
mod dispatch;
mod drive;
mod error;
pub mod frame;
mod held;
mod hub;
mod message;
mod peer;
pub mod policy;
pub mod rendezvous;
mod session;
mod split;
mod trace;

pub use bulk::{Bulk, Piece};
pub use call::{Call, CallStats, Request, Responder};
pub use codec::Envelope;
pub use dispatch::{DispatchStats, Dispatcher};
pub use error::{DecodeFailure, Error, RequestFate, Result, Unresumable};
pub use hub::{Hub, HubEvent, HubLimits, Posted};
pub use message::{tag, Message};
pub use peer::{
    Delivery, OutboxStats, SessionConfig, SessionStats, DEFAULT_REASSEMBLY_TIMEOUT,
    DEFAULT_RENDEZVOUS_THRESHOLD,
};
pub use session::{Closed, Session, RESUME_KEEP};
pub use split::{RecvHalf, SendHalf};

#[doc(hidden)]
pub use serde;
