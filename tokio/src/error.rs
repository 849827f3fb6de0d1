//! The errors of the async layer.

use std::os::fd::OwnedFd;

use rdmsg_transport::Brief;
use tokio::io::unix::AsyncFd;

/// What can fail here.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The session, hub or connection failed, or refused the call.
    #[error(transparent)]
    Msg(#[from] rdmsg_msg::Error),
    /// Registering a descriptor with the runtime, or connecting the TCP stream, failed.
    #[error("{op} failed: {}", Brief(.source))]
    Io {
        /// What was being done.
        op: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The task that made, accepted or closed a connection off the runtime's threads
    /// panicked.
    #[error("the blocking {op} task did not finish")]
    Blocking {
        /// What it was doing.
        op: &'static str,
    },
    /// A client failed its handshake with an [`AsyncListener`](crate::AsyncListener) (it
    /// went away, spoke garbage, was refused, or its side could not be set up): that
    /// client only, the listener goes on ([`AsyncListener::incoming`](crate::AsyncListener::incoming)
    /// yields these).
    #[error("a client failed its handshake: {0}")]
    Handshake(#[source] rdmsg_transport::Error),
    /// A constructor that needs a tokio runtime (it registers descriptors with the runtime's
    /// reactor and spawns tasks) was called outside one.
    #[error(
        "`{op}` must be called within a tokio runtime (inside `#[tokio::main]`, a task, or \
         `Runtime::enter`)"
    )]
    NoRuntime {
        /// The constructor: `AsyncSession::new`, `AsyncHub::new`, `AsyncListener::bind`.
        op: &'static str,
    },
    /// The session was closed through another clone of this handle: every operation on any of
    /// its handles returns this from then on. Not the peer's close
    /// ([`is_peer_closed`](Error::is_peer_closed) is false).
    #[error("the session was closed (by `close` on one of its handles); make a new connection")]
    Closed,
}

// `Debug` is the report (see `Report`): advice, not variants.
rdmsg_transport::debug_as_report!(Error);

impl Error {
    /// Whether this error will recur, as [`rdmsg_msg::Error::is_fatal`] says for the layers
    /// below: the session or hub is unusable (or the setup is wrong) and a loop that retries
    /// must stop. Fatal: a failed connection, an I/O error (registering a descriptor with the
    /// runtime, connecting), a blocking task that did not finish, no runtime, a session
    /// closed through another handle. Not fatal: what costs one message or call only, and a
    /// client's failed handshake ([`Error::Handshake`]: the listener goes on).
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::Msg(e) => e.is_fatal(),
            Error::Io { .. } | Error::Blocking { .. } | Error::NoRuntime { .. } | Error::Closed => {
                true
            }
            Error::Handshake(_) => false,
        }
    }

    /// Whether this is the peer's graceful close: everything it sent has been received (see
    /// [`rdmsg_msg::Error::is_peer_closed`]). A close through one of our own handles is
    /// [`Error::Closed`] instead.
    pub fn is_peer_closed(&self) -> bool {
        match self {
            Error::Msg(e) => e.is_peer_closed(),
            _ => false,
        }
    }
}

impl From<rdmsg_transport::Error> for Error {
    fn from(e: rdmsg_transport::Error) -> Self {
        Error::Msg(e.into())
    }
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { op, source }
}

/// The runtime `op` (a constructor) was called within, or [`Error::NoRuntime`]: tokio would
/// otherwise panic when the descriptor is registered or a task spawned.
pub(crate) fn runtime(op: &'static str) -> Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime { op })
}

/// Registers `fd` with the runtime for readability. Tokio deprecated its safe registration (PR 8587)
/// because an arbitrary `AsRawFd` might report another descriptor later; its condition (a
/// valid descriptor, the same one, open as long as the `AsyncFd`) is what an [`OwnedFd`]
/// moved into the `AsyncFd` guarantees, so the deprecated safe form is sound here, and this
/// crate keeps no `unsafe`.
#[allow(deprecated)]
pub(crate) fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_failure_shows_the_os_text() {
        let e = io("connecting the bootstrap stream")(std::io::Error::from_raw_os_error(111));
        assert_eq!(
            e.to_string(),
            "connecting the bootstrap stream failed: connection refused"
        );
        assert!(e.is_fatal() && !e.is_peer_closed());
    }

    #[test]
    fn debug_is_the_message_then_the_os_words() {
        let e = io("connecting the bootstrap stream")(std::io::Error::from_raw_os_error(111));
        let os = std::io::Error::from_raw_os_error(111).to_string();
        assert_eq!(format!("{e:?}"), format!("{e}\n\nCaused by:\n    {os}"));
        assert!(!format!("{e:?}").contains("Io {"));
    }

    #[test]
    fn debug_does_not_repeat_a_cause_the_message_holds() {
        // The handshake's message quotes its cause.
        let e = Error::Handshake(rdmsg_transport::Error::Connection(
            rdmsg_transport::Failure::PeerVanished,
        ));
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(format!("{e:?}"), e.to_string());
    }

    #[test]
    fn a_descriptor_limit_says_what_to_do() {
        let e = io("duplicating the descriptor")(std::io::Error::from_raw_os_error(24));
        assert!(
            e.to_string().starts_with(
                "duplicating the descriptor failed: too many open files (EMFILE): this process \
                 reached its descriptor limit (`ulimit -n`"
            ),
            "{e}"
        );
        assert!(
            e.to_string().ends_with(
                "raise it, or serve many peers from one `Hub` (one descriptor per peer; a \
                 session holds about 9) instead of a session each"
            ),
            "{e}"
        );
    }

    #[test]
    fn outside_a_runtime_the_constructor_says_where_to_call_it() {
        let e = runtime("AsyncSession::new").unwrap_err();
        assert!(
            matches!(
                e,
                Error::NoRuntime {
                    op: "AsyncSession::new"
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "`AsyncSession::new` must be called within a tokio runtime (inside \
             `#[tokio::main]`, a task, or `Runtime::enter`)"
        );
        assert!(e.is_fatal() && !e.is_peer_closed());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _in = rt.enter();
        assert!(runtime("AsyncSession::new").is_ok());
    }

    #[test]
    fn a_session_closed_through_another_handle_is_fatal_and_not_the_peers_close() {
        let e = Error::Closed;
        assert_eq!(
            e.to_string(),
            "the session was closed (by `close` on one of its handles); make a new connection"
        );
        assert!(e.is_fatal() && !e.is_peer_closed());
        let e = Error::Handshake(rdmsg_transport::Error::Connection(
            rdmsg_transport::Failure::PeerVanished,
        ));
        assert!(
            e.to_string().starts_with("a client failed its handshake: "),
            "{e}"
        );
        assert!(!e.is_fatal() && !e.is_peer_closed());
        let e = Error::Blocking { op: "connect" };
        assert!(e.is_fatal() && !e.is_peer_closed());
    }

    #[test]
    fn the_layers_below_decide_for_their_errors() {
        use rdmsg_transport::{Error as T, Failure};
        let closed = Error::from(T::Connection(Failure::PeerClosed));
        assert_eq!(closed.to_string(), "the peer closed the connection");
        assert!(closed.is_peer_closed() && closed.is_fatal());
        let vanished = Error::from(T::Connection(Failure::PeerVanished));
        assert!(!vanished.is_peer_closed() && vanished.is_fatal());
        let timeout = Error::from(T::timeout(
            "sending",
            "waiting",
            std::time::Duration::from_millis(1),
        ));
        assert!(!timeout.is_fatal() && !timeout.is_peer_closed());
        let not_served = Error::from(rdmsg_msg::Error::NotServed { request: "Get" });
        assert!(!not_served.is_fatal());
    }
}
