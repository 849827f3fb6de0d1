//! Framed, typed messages for rdmsg, where the sender decides per message who wakes up.
//!
//! # Quick start
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use transport::{Config, Endpoint};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Reading { sensor: u16, value: f32 }
//! #[derive(Serialize, Deserialize)]
//! struct Alarm { sensor: u16 }
//! msg::message!(Reading, solicited = false); // telemetry: lands silently
//! msg::message!(Alarm);                      // wakes the receiver
//!
//! # fn main() -> Result<(), msg::Error> {
//! let ep = Endpoint::open_default()?;
//! let mut tx = msg::Session::new(ep.connect("receiver:18600", &Config::default())?);
//! tx.send(&Reading { sensor: 1, value: 20.5 })?;
//! tx.send(&Alarm { sensor: 1 })?; // the receiver wakes once and gets both, in order
//! # Ok(()) }
//! ```
//!
//! The receiver: `let env = session.recv()?; if env.is::<Alarm>() { env.decode::<Alarm>()? }`,
//! or a [`Dispatcher`] routing types to handlers or to crossbeam channels read by workers.
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
//! where carrying on could overrun buffers. bincode decodes under an allocation limit, so a
//! forged length cannot exhaust memory.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod codec;
mod dispatch;
mod error;
pub mod frame;
mod message;
pub mod policy;
mod session;

pub use codec::Envelope;
pub use dispatch::{DispatchStats, Dispatcher};
pub use error::{DecodeFailure, Error, Result};
pub use message::{tag, Message};
pub use session::{Session, SessionConfig, SessionStats};

#[doc(hidden)]
pub use serde;
