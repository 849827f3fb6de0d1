//! The errors of the async layer.

use std::os::fd::OwnedFd;

use rdmsg_transport::Brief;
use tokio::io::unix::AsyncFd;

/// What can fail here.
#[derive(Debug, thiserror::Error)]
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
    /// The blocking task that made or accepted a connection panicked or was cancelled.
    #[error("the blocking {op} task did not finish")]
    Blocking {
        /// What it was doing.
        op: &'static str,
    },
    /// The session was closed (by [`AsyncSession::close`](crate::AsyncSession::close) on
    /// one of its handles).
    #[error("the session was closed (by close on one of its handles): make a new connection")]
    Closed,
    /// A handle was made outside a tokio runtime.
    #[error("{op} must be called within a tokio runtime (inside #[tokio::main], a task, or Runtime::enter)")]
    NoRuntime {
        /// What was called.
        op: &'static str,
    },
}

impl From<rdmsg_transport::Error> for Error {
    fn from(e: rdmsg_transport::Error) -> Self {
        Error::Msg(e.into())
    }
}

impl Error {
    /// Whether the handle is done for: a loop that retries must stop (see
    /// [`rdmsg_msg::Error::is_fatal`]). The runtime's own failures, a blocking task that did
    /// not finish and a closed session are fatal; a handle made outside a runtime is not (make
    /// it inside one).
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::Msg(e) => e.is_fatal(),
            Error::Io { .. } | Error::Blocking { .. } | Error::Closed => true,
            Error::NoRuntime { .. } => false,
        }
    }

    /// Whether this is the peer's graceful close: everything it sent has been received (see
    /// [`rdmsg_msg::Error::is_peer_closed`]).
    pub fn is_peer_closed(&self) -> bool {
        matches!(self, Error::Msg(e) if e.is_peer_closed())
    }
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The runtime `op` is called in ([`Error::NoRuntime`] outside one).
pub(crate) fn runtime(op: &'static str) -> Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime { op })
}

pub(crate) fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { op, source }
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
    }
}
