//! Errors of the notify layer.

/// Result alias for notify.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failure while arming, waiting or polling.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verb failed.
    #[error("verbs call failed")]
    Verbs(#[from] verbs_core::Error),
    /// A key that names no queue of this waiter.
    #[error("no completion queue with key {0}")]
    UnknownCq(usize),
}
