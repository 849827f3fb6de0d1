//! Typed message passing over RDMA reliable-connected queue pairs, with receivers that sleep
//! until a sender says a message is worth waking up for (`IBV_SEND_SOLICITED` and
//! solicited-only arming).
//!
//! This is the crate to depend on. Its root holds what a typed-message application needs:
//! an [`Endpoint`] on a device port, connections made by [`Endpoint::connect`] and
//! [`Listener::accept`] with a [`Config`], [`Session`]s that send and receive [`Message`]s, a
//! [`Hub`] that does the same with many peers from one thread, a [`Dispatcher`] that routes
//! them. The layers underneath are modules, for whoever needs more.
//!
//! # Quick start
//!
//! ```no_run
//! use rdmsg::{message, Config, Endpoint, Session};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Reading { sensor: u16, value: f64 }
//! message!(Reading, solicited = false); // lands silently, read on the next wake-up
//!
//! # fn main() -> Result<(), rdmsg::Error> {
//! let endpoint = Endpoint::open_default()?; // $RDMSG_DEVICE, port 1
//! let mut tx = Session::new(endpoint.connect("collector:18600", &Config::default())?);
//! let readings: Vec<Reading> = (0..8).map(|i| Reading { sensor: 1, value: i.into() }).collect();
//! tx.send_batch(&readings)?; // the last one is solicited: one wake-up for the batch
//! # Ok(()) }
//! ```
//!
//! The receiving side: `Session::new(endpoint.listen(addr)?.accept(&Config::default())?)`,
//! then `recv()` sleeps until a solicited message arrives and hands out everything that
//! arrived before it, in order; `env.decode::<Reading>()` deserializes one. The README's
//! quick start is a complete program with both sides.
//!
//! # Which layer do I need
//!
//! | you want | use |
//! |---|---|
//! | typed messages, one wake-up per batch or alarm, handlers per type | the root: [`Session`], [`Message`], [`message!`], [`Dispatcher`] |
//! | calls: a request answered by its response, with a deadline, many in flight | the root: [`request!`], [`Session::call`] / [`Session::start_call`], [`Envelope::responder`] and [`Responder`] on the serving side |
//! | a server that never waits for one slow peer | the root: [`Hub::post`] (a bounded outbox per peer, [`HubEvent::Writable`]) |
//! | the same with many peers, served by one thread | the root: [`Hub`] with a [`HubConfig`], [`HubEvent`]s naming a [`PeerId`] |
//! | the same on tokio: sends, receives and accepts as futures | `rdmsg::tokio` (feature `tokio`): `AsyncSession`, `AsyncListener`, `AsyncHub` |
//! | raw bytes with credits, zero-copy receive buffers, failures typed | [`transport`]: [`transport::Connection`] |
//! | your own event loop over completion queues: arm, wait, ack, re-arm, drain | [`notify`]: [`notify::Waiter`] |
//! | queue pairs, memory regions and completion queues as safe RAII handles | [`verbs`] (raw bindings in `verbs::ffi`) |
//!
//! Each layer is also a crate of its own (`rdmsg-verbs`, `rdmsg-notify`, `rdmsg-transport`,
//! `rdmsg-msg`, library names with underscores), so their names never collide with other
//! crates (the file-system `notify` crate, say). Async support is the optional `tokio` feature
//! (crate `rdmsg-tokio`); the default build has no runtime. Spans and events through the
//! `tracing` crate (connects, closes, failures, credit stalls, rendezvous reads) are the
//! optional `tracing` feature; without it no event code is compiled. Counters are always on:
//! [`SessionStats`], and the transport's `ConnStats` and `HubStats`.
//!
//! # Good to know
//!
//! - **Any end meets any other.** A plain [`Session`] (from [`Endpoint::connect`]) can be the
//!   client of a [`Hub`] serving it from [`Hub::listen`]; a hub's [`Hub::connect`] reaches a
//!   [`Listener`] or another hub. Only buffer sizes differ: a [`Connection`] posts 4 KiB
//!   receive buffers ([`Config::buf_size`]), a hub 2 KiB ones; a connection sends frames as
//!   large as its peer's buffers, a hub no larger than its own. So frames are 4 KiB between two
//!   sessions and 2 KiB whenever a hub is at either end: larger messages go in fragments up to
//!   [`SessionConfig::rendezvous_threshold`] (16 KiB), and from there by rendezvous (the peer
//!   reads them from our memory).
//! - **A wake-up is a sleep, not a message.** `wait_stats().wakeups`
//!   ([`Connection::wait_stats`], `session.connection().wait_stats()`, a hub's
//!   `transport().wait_stats()`) counts the times the thread slept in the kernel and was woken
//!   by its completion channel (a solicited message, an error completion, or, while a send
//!   waits for credits, any completion). Messages already there when a receive looks cost no
//!   sleep and count nothing; one wake-up takes everything that arrived before it. Timeouts
//!   and other descriptors (a returned buffer, the peer's stream) are not counted.
//!   `AsyncSession::wakeups` and `AsyncHub::wakeups` (feature `tokio`) count the times a
//!   waiting task was woken by the descriptor becoming readable, those causes included.
//! - **`try_send` never waits.** `Ok(false)` means nothing of the message was sent: no credit
//!   or send slot, or, for a large message, no room under
//!   [`SessionConfig::max_rendezvous_bytes`] or no credit for its descriptor or first fragment.
//! - **A [`Bulk`] goes by reference wherever it is** in the message (a field, an enum variant,
//!   a `Vec<Bulk>`): every `Bulk` of at least 4 KiB that serialization meets in a message going
//!   by rendezvous is exposed to the peer, not copied. It counts toward
//!   [`SessionConfig::max_message`] (16 MiB) on both sides.
//!
//! # Requirements
//!
//! Linux, libibverbs with a provider, and an RDMA device (hardware or Soft-RoCE:
//! `modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <iface>`, as root). Building needs
//! `libibverbs-dev`, `pkg-config` and libclang ≤ 15 for `rdma-sys`' bindgen (Debian 12's
//! works). The crates are not on crates.io: depend on a clone by path
//! (`rdmsg = { path = "/path/to/rdmsg/rdmsg" }`) or on the repository by git; the README says
//! how, and how to run a program in a VM with Soft-RoCE (`cargo xtask vm -- CMD`).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use rdmsg_msg::{
    message, request, tag, Bulk, Call, CallStats, Closed, DecodeFailure, Delivery, DispatchStats,
    Dispatcher, Envelope, Error, Hub, HubEvent, HubLimits, Message, OutboxStats, Posted, RecvHalf,
    Request, RequestFate, Responder, Result, SendHalf, Session, SessionConfig, SessionStats,
    Unresumable,
};
pub use rdmsg_transport::{
    Config, Connection, Endpoint, Failure, HubConfig, Listener, PeerId, Psk, Received,
};

/// Safe RAII handles over libibverbs: the only layer with `unsafe` code (crate `rdmsg-verbs`).
pub use rdmsg_verbs as verbs;

/// Completion-notification policy: arm, wait, ack, re-arm, drain (crate `rdmsg-notify`).
pub use rdmsg_notify as notify;

/// RC connections: TCP bootstrap, receive pools, credit flow control, typed failures (crate
/// `rdmsg-transport`).
pub use rdmsg_transport as transport;

/// Framed typed messages and their sessions (crate `rdmsg-msg`).
pub use rdmsg_msg as msg;

/// Sessions, listeners and hubs on tokio, their waits as futures (crate `rdmsg-tokio`; feature
/// `tokio`).
#[cfg(feature = "tokio")]
pub use rdmsg_tokio as tokio;

/// The README's quick start, compiled (not run: it needs a device) with the crate's doctests,
/// so it cannot drift from the API (with the `tokio` feature, which the workspace's own builds
/// turn on: the README shows the async server too).
#[doc = include_str!("../../README.md")]
#[cfg(all(doctest, feature = "tokio"))]
pub struct ReadmeDoctests;
