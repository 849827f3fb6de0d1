//! Reliable-connected RDMA connections for rdmsg: TCP bootstrap, self-refilling receive pools,
//! credit flow control that never provokes receiver-not-ready, and typed failures.
//!
//! # Quick start
//!
//! ```no_run
//! use rdmsg_transport::{Config, Endpoint};
//!
//! # fn main() -> Result<(), rdmsg_transport::Error> {
//! let endpoint = Endpoint::open_default()?; // $RDMSG_DEVICE, port 1
//! let listener = endpoint.listen("0.0.0.0:18515")?;
//! let mut conn = listener.accept(&Config::default())?;
//! let msg = conn.recv()?; // sleeps until a solicited message (or an error) arrives
//! println!("{} bytes", msg.len());
//! drop(msg); // the buffer goes back to the pool and its credit to the peer
//! # Ok(()) }
//! ```
//!
//! The other side: `endpoint.connect("server:18515", &Config::default())?.send(b"hi", true)?`.
//!
//! # Connection setup
//!
//! The bootstrap TCP stream carries the [`handshake`], a versioned exchange written as a pure
//! state machine (bytes in, bytes and actions out; no I/O, no clock): the client's
//! [`handshake::Hello`] (queue pair address, path MTU, buffer size, receive depth, grant slots,
//! initial credits) and a nonce, the server's hello and verdict, the client's verdict, the
//! server's queue pair address once it is in RTS, the client's "ready" once it is. Every
//! receive buffer is posted before RTR.
//!
//! Hostile or buggy peers are bounded:
//!
//! - **What a peer announces does not decide what we pin.** Its buffer size is the size of
//!   our send buffers: [`Config::max_peer_buf_size`] (1 MiB), [`Config::max_peer_recv_depth`]
//!   and [`Config::max_send_memory`] (64 MiB: fewer send buffers beyond it) bound it, and a
//!   hello beyond them is rejected ([`handshake::Reject::Limits`]), the peer told why.
//! - **The server allocates nothing for a client before its hello passed** every check (and
//!   its key proof): the client speaks first, and the server creates its queue pair, receive
//!   pool and send buffers only then. A silent or forged client costs a socket.
//! - **Nobody waits for a slow client.** [`Listener::accept`] runs up to
//!   [`Config::max_pending_handshakes`] handshakes at once from one poll loop, each with its
//!   own deadline ([`Config::handshake_timeout`] for the whole exchange), and returns the first
//!   that completes; a silent, trickling or garbage-sending client delays no other (a good
//!   client behind a silent one connects in about 20 ms on rxe0, where it used to wait the
//!   whole 5 s timeout). A failed handshake is that call's error; the listener stays usable.
//! - **Optional authentication.** With [`Config::psk`] ([`Psk`]) both sides prove they know a
//!   pre-shared key (HMAC-SHA256 over both hellos and both nonces, checked in constant time);
//!   a wrong key, or a key on one side only, is a typed rejection on both sides.
//! - **After the handshake the stream carries at most a goodbye.** [`Connection::close`]
//!   writes [`handshake::GOODBYE`] once its close message was delivered; the peer then waits up
//!   to its `close_timeout` for that message. End-of-file without it is how a peer whose
//!   process died is noticed, within milliseconds ([`Failure::PeerVanished`]); any other byte
//!   fails the connection once ([`Failure::BootstrapGarbage`]).
//!
//! For interoperating with rdma-core's examples, [`QpAddress`] speaks the `LID:QPN:PSN:GID`
//! record of `ibv_rc_pingpong`, and [`Endpoint::connect_qp`] performs the INIT → RTR → RTS
//! transitions with explicit [`PathParams`].
//!
//! # Flow control
//!
//! See [`credits`]: a data message is only sent with a credit (a receive buffer the peer has
//! posted); credits come back on every message's immediate data or in explicit grants that
//! use reserved slots; a grant a blocked peer waits for is solicited.
//!
//! # Many connections on one thread: the hub
//!
//! A [`RawHub`] serves many connections from one thread: every queue pair receives through one
//! shared receive queue and completes on one pair of CQs on one completion channel, so one
//! solicited message from any peer wakes the thread, which then takes what every peer sent.
//! Each connection keeps its own credits, backed by buffers [`share`] lends from the shared
//! pool; one that fails fails alone ([`RawHubEvent::Disconnected`]). Handshakes run inside the
//! hub, none blocking another. [`RawHub::step`] and [`AsFd`](std::os::fd::AsFd) serve an
//! application's own event loop.
//!
//! # One protocol, two drivers
//!
//! The rules of a connection (credits and grants, the receive rules, which failure wins,
//! signalling, arming, close, a peer that leaves, the drain after a failure, their deadlines)
//! live once, in a sans-IO core that never touches verbs, a socket or the clock. A
//! [`Connection`] drives one core on its own queues; the hub drives a slab of them on shared
//! ones. A deterministic simulator of RC queue pairs drives the same core in `cargo test`, on
//! a host without RDMA.
//!
//! # Failures
//!
//! A peer that closes gracefully ([`Connection::close`]) is reported as
//! [`Failure::PeerClosed`] after everything it sent; one whose process dies, whose side of the
//! connection fails, or whose host stops answering TCP keepalive ([`Config::keepalive`]) as
//! [`Failure::PeerVanished`]; completion errors, asynchronous events (a CQ overrun is
//! `AsyncEvent(CqErr)`; a fatal device error or an error of the port fails every connection
//! of the device), a queue pair that entered the error state unexplained
//! ([`Failure::QpError`]), protocol violations, and a verb the connection drives that fails
//! locally ([`Failure::Local`]: a post, a poll, an arm, a wait) have their own variants.
//! Failures are sticky: the first is kept and every later call reports it. Messages that
//! arrived before a failure are delivered before it is reported, whichever way it was
//! noticed. A failure shuts the bootstrap stream (so the peer fails at once too) and moves the
//! queue pair to the error state so that every posted buffer is flushed back to its pool;
//! the failure is reported once they are back (or after 500 ms), and waiting for them is a
//! state of the connection, not a sleep: [`Connection::step`] never waits.
//!
//! A sleeping connection is woken by a solicited message, by the completion of a signaled send
//! (so send errors wake it: rxe never marks them solicited), by the end of its
//! bootstrap stream, by an asynchronous event routed to it by its endpoint, and at the latest
//! after [`Config::health_check`] (1 s), when it polls for errors its provider did not signal
//! (Linux 6.12's rxe does not wake a solicited-only receiver for flushed receives).
//! Receiver-not-ready is retried a finite number of times ([`PathParams::rnr_retry`], 6): an
//! RNR NAK means a peer that lies about its buffers, and it surfaces as `RnrRetryExcErr`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod addr;
mod bootstrap;
mod clock;
mod cm;
mod config;
mod connection;
mod control;
mod core;
pub mod credits;
mod device_events;
mod drive;
mod endpoint;
mod error;
mod failed;
mod group;
pub mod handshake;
mod handshake_set;
mod hub;
mod peer_id;
mod pool;
mod read;
mod resume;
mod send;
mod setup;
pub mod share;
#[cfg(test)]
mod sim;
mod stream;
mod token;
mod trace;

pub use crate::core::ConnStats;
pub use addr::QpAddress;
pub use bootstrap::loopback_pair;
pub use bootstrap::Listener;
pub use cm::CmListener;
pub use config::Config;
#[cfg(feature = "test-hooks")]
pub use config::{Fault, TestHooks};
pub use connection::Connection;
pub use endpoint::{Endpoint, GidChoice, PathParams};
pub use error::{Brief, Error, Failure, Result, TimedOut};
pub use group::{GroupConfig, GroupHandle, GroupPeer, HubGroup, Member, MemberStats, Placement};
pub use handshake::Psk;
pub use hub::{ConnectTimes, HubConfig, HubStats, PeerId, RawHub, RawHubEvent};
pub use pool::{PoolStats, Received, RecvPool, Waker};
/// The epoll set a thread sharing a connection sleeps on (see `rdmsg_msg`'s split halves).
pub use rdmsg_verbs::ReadyWatch;
pub use rdmsg_verbs::{debug_as_report, Buffer, Bytes, Exposed, ReadSegment, Report};
pub use read::{Arrival, ReadDone, ReadPost};
pub use resume::Resume;
pub use setup::random_psn;
