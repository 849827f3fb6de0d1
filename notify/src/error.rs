//! Errors of the notify layer.

/// Result alias for notify.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failure while arming, waiting or polling.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verb failed. Displays as the verbs error itself (which names the verb and why).
    #[error(transparent)]
    Verbs(#[from] rdmsg_verbs::Error),
    /// A key that names no queue of this waiter.
    #[error("no completion queue with key {0}")]
    UnknownCq(usize),
}

// `Debug` is the report (see `Report`): advice, not variants.
rdmsg_verbs::debug_as_report!(Error);

#[cfg(test)]
mod tests {
    use super::*;

    /// EINVAL on Linux (notify does not depend on libc).
    const EINVAL: i32 = 22;

    #[test]
    fn a_verbs_error_displays_as_the_verb_that_failed_and_why() {
        let os = std::io::Error::from_raw_os_error(EINVAL);
        let e = Error::from(rdmsg_verbs::Error::ReqNotifyCq {
            solicited_only: true,
            source: std::io::Error::from_raw_os_error(EINVAL),
        });
        assert_eq!(
            e.to_string(),
            "ibv_req_notify_cq (solicited_only=true) failed (EINVAL)"
        );
        assert_eq!(
            rdmsg_testkit::error_chain(&e),
            format!("ibv_req_notify_cq (solicited_only=true) failed (EINVAL): {os}")
        );
        assert_eq!(
            Error::UnknownCq(3).to_string(),
            "no completion queue with key 3"
        );
    }
}
