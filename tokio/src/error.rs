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
    /// [`AsyncSession::close`](crate::AsyncSession::close) was called while other clones of the handle exist.
    #[error("the session is shared by other handles")]
    SharedDriver,
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
