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
//! # Requirements
//!
//! Linux, libibverbs with a provider, and an RDMA device (hardware or Soft-RoCE). Building
//! needs libclang ≤ 15 for `rdma-sys`' bindgen (Debian 12's works).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use rdmsg_msg::{
    message, request, tag, Bulk, Call, CallStats, Closed, DecodeFailure, Delivery, DispatchStats,
    Dispatcher, Envelope, Error, Hub, HubEvent, Message, OutboxStats, Posted, RecvHalf, Request,
    Responder, Result, SendHalf, Session, SessionConfig, SessionStats,
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
