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
//! Handles are `Clone + Send + Sync` and work on the multi-thread runtime: any number of tasks
//! may send while one receives.
//!
//! # Cancellation
//! - `recv`: cancel-safe. A message is taken from the session only in the poll that returns
//!   it: a dropped future has taken nothing.
//! - `send`: a dropped future either sent the message or did not. A message that needs several
//!   frames is committed once its first frame goes; if the future is dropped after that, the
//!   rest go out, in order and before anything sent later, on the next call that sends, flushes,
//!   closes or waits (a `recv` that finds nothing included).
//! - `flush`: cancel-safe (a flush not sent stays pending).
//! - [`AsyncListener::accept`]: cancel-safe. Handshakes are moved on by a blocking task whose
//!   result stays in the listener for the next call.
//! - [`AsyncSession::connect`]: a dropped future leaves no connection (one made meanwhile is
//!   dropped, which the peer sees as a vanished client).
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
mod session;
mod shared;

pub use error::{Error, Result};
pub use hub::AsyncHub;
pub use listener::AsyncListener;
pub use session::AsyncSession;
