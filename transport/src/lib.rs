//! Reliable-connected RDMA connections for rdmsg: TCP bootstrap, self-refilling receive pools,
//! credit flow control that never provokes receiver-not-ready, and typed failures.
//!
//! # Quick start
//!
//! ```no_run
//! use transport::{Config, Endpoint};
//!
//! # fn main() -> Result<(), transport::Error> {
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
//! The bootstrap TCP stream carries a versioned [`handshake::Hello`] each way (queue pair
//! address, path MTU, buffer size, receive depth, grant slots, initial credits), a verdict byte
//! each way (a garbage, mismatched or stalled peer gets a clear error, on both sides where
//! possible, and the listener stays usable), then a "ready" byte once each queue pair is in
//! RTS. Every receive buffer is posted before RTR. The stream then stays open: its
//! end-of-file is how a peer whose process died is noticed, within milliseconds.
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
//! # Failures
//!
//! A peer that closes gracefully ([`Connection::close`]) is reported as
//! [`Failure::PeerClosed`] after everything it sent; one whose process dies, whose side of the
//! connection fails, or whose host stops answering TCP keepalive ([`Config::keepalive`]) as
//! [`Failure::PeerVanished`]; completion errors, asynchronous events (a CQ overrun is
//! `AsyncEvent(CqErr)`), a queue pair that entered the error state unexplained
//! ([`Failure::QpError`]) and protocol violations have their own variants. A failure shuts the
//! bootstrap stream (so the peer fails at once too) and moves the queue pair to the error state
//! so that every posted buffer is flushed back to its pool.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod addr;
mod connection;
pub mod credits;
mod endpoint;
mod error;
pub mod handshake;
mod pool;

pub use addr::QpAddress;
pub use connection::{random_psn, Config, ConnStats, Connection};
pub use endpoint::{loopback_pair, Endpoint, GidChoice, Listener, PathParams};
pub use error::{Error, Failure, Result};
pub use pool::{PoolStats, Received, RecvPool};
