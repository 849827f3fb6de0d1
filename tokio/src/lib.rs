//! rdmsg on tokio: a session, a listener and a hub whose waits are futures.
//!
//! Nothing here polls. Each handle keeps its session (or hub) behind a mutex taken only for
//! non-blocking steps, and waits on the session's descriptor (its epoll set: completion channel,
//! wake-up socket, asynchronous events, bootstrap stream) through
//! [`tokio::io::unix::AsyncFd`]. Before a task waits, the step has re-armed the completion
//! queues and polled them once more, so no completion that arrives afterwards is missed; a
//! receiver still sleeps solicited-only, as a blocking one does, and is woken by the messages
//! their senders solicited. Tasks sharing a handle wake each other when one moved the
//! connection on (queued a message, took a credit grant).
//!
//! Handles are `Clone + Send + Sync` and work on the multi-thread and the `current_thread`
//! runtime alike: any number of tasks may send while one receives, and any of them may close.
//! Every handle is made inside a runtime ([`Error::NoRuntime`] outside one). A session's
//! verbs setup and teardown never run on the runtime's threads: connecting, accepting, closing
//! and the teardown of the last handle dropped run on threads of rdmsg's own, which a runtime
//! thread only hands the work to (not tokio's blocking pool, which creates a thread on the
//! caller's when its own are busy). An [`AsyncHub`] accepts, connects and retires its peers
//! within its steps, on the thread that drives it.
//!
//! # Sending without waiting for room twice
//! [`AsyncSession::reserve`] waits for room and commits nothing; the [`SendPermit`] it gives
//! then hands a message over synchronously. So a timeout around the wait means "nothing
//! sent", and the message is never half sent:
//!
//! ```no_run
//! # async fn f(session: rdmsg_tokio::AsyncSession, m: impl rdmsg_msg::Message) -> rdmsg_tokio::Result<()> {
//! use std::time::Duration;
//! match tokio::time::timeout(Duration::from_millis(50), session.reserve()).await {
//!     Ok(permit) => permit?.send(&m)?, // committed: it goes, in order
//!     Err(_) => { /* nothing was sent: keep `m`, retry or give up */ }
//! }
//! # Ok(()) }
//! ```
//!
//! [`SessionSink`]'s `poll_ready` is that wait, and `start_send` that hand-over.
//!
//! # Cancellation
//! Cancel-safe, as tokio's own docs use the word (dropping the future, as a `select!` branch
//! that lost or a timeout does, loses nothing and commits nothing):
//! - [`AsyncSession::recv`], [`AsyncHub::recv`], and the streams over them: a message is
//!   taken only in the poll that returns it.
//! - [`AsyncSession::send`], [`AsyncSession::send_as`] and [`AsyncSession::reserve`]: a
//!   message is committed only in the poll that returns `Ok`. A dropped future sent nothing;
//!   a completed one committed its message, which goes whole, in order, before anything sent
//!   later (a message of many frames has its other frames sent by the session's tasks as
//!   credits come; [`AsyncSession::flush`] waits for them).
//! - [`AsyncHub::send`], [`AsyncHub::post_when_room`]: the same, per peer.
//! - [`AsyncSession::flush`] and the sinks' `poll_flush`: what is not sent yet stays committed.
//! - [`AsyncListener::accept`] and [`AsyncListener::incoming`]: handshakes are moved on by a
//!   blocking task whose result stays in the listener for the next call.
//! - [`AsyncSession::connect`]: a dropped future leaves no connection (one made meanwhile is
//!   dropped, which the peer sees as a vanished client).
//! - [`AsyncSession::close`]: the close goes on when its future is dropped.
//! - Calls ([`AsyncSession::call`], [`AsyncHub::call`]): dropping the future cancels the
//!   call; its request may have gone, and its answer, if it comes, is dropped and counted
//!   late.
//!
//! # The solicitation rule
//! While a task waits in `recv`, a message another task sends without solicitation goes
//! solicited, unless [`rdmsg_msg::SessionConfig::max_unsolicited_delay`] is set, in which case
//! the waiting task flushes once the delay runs out: the receiver may wait for the answer to
//! exactly that message, and the peer, asleep solicited-only, would not see it.
#![forbid(unsafe_code)]

mod error;
mod hub;
mod listener;
mod offload;
#[cfg(feature = "tower")]
mod service;
mod session;
mod shared;
mod stream;

pub use error::{Error, Result};
pub use hub::{AsyncHub, HubEvents, PeerSink};
pub use listener::{AsyncListener, Incoming};
#[cfg(feature = "tower")]
pub use service::{CallService, PeerServices};
pub use session::{AsyncSession, SendPermit, SessionSink, SessionStream};
