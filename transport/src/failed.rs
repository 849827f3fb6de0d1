//! The rule every listener follows about its clients' failures: a client that fails its
//! handshake (garbage, a wrong key, silence past its deadline, gone half-way, evicted to make
//! room, or what this side could not set up for it) failed its own, not the listener's.
//! [`Listener`](crate::Listener) and [`CmListener`](crate::CmListener) count each such
//! failure, trace it (`handshake failed`), and keep it for the callers who want every
//! client's outcome (`accept_outcome_timeout`); `accept` and `accept_timeout` skip it. Only
//! the listener's own failure (its socket, channel or epoll set, descriptors exhausted when
//! accepting, a bad [`Config`](crate::Config)) is an `Err` of theirs.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::error::Error;
use crate::trace;

/// Most failures kept for `accept_outcome_timeout` until taken: a flood of failing clients
/// between two calls costs this many errors, not one per client; older ones are only counted
/// and traced.
const KEPT: usize = 64;

/// A listener's failed handshakes: how many so far, and the newest not yet reported.
#[derive(Debug, Default)]
pub(crate) struct FailedHandshakes {
    count: AtomicU64,
    unreported: Mutex<VecDeque<Error>>,
}

impl FailedHandshakes {
    /// The handshake of the client at `from` failed with `error`.
    pub(crate) fn record(&self, from: Option<SocketAddr>, error: Error) {
        self.count.fetch_add(1, Ordering::Relaxed);
        trace::handshake_failed(from, None, &error);
        let mut kept = self.lock();
        if kept.len() >= KEPT {
            kept.pop_front();
        }
        kept.push_back(error);
    }

    /// The oldest failure not yet reported.
    pub(crate) fn take(&self) -> Option<Error> {
        self.lock().pop_front()
    }

    /// How many clients failed so far.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Error>> {
        self.unreported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_is_counted_and_the_newest_are_kept_in_order() {
        let failed = FailedHandshakes::default();
        for i in 0..KEPT + 3 {
            failed.record(None, Error::Config(format!("client {i}")));
        }
        assert_eq!(failed.count(), (KEPT + 3) as u64);
        let kept: Vec<String> = std::iter::from_fn(|| failed.take())
            .map(|e| e.to_string())
            .collect();
        assert_eq!(kept.len(), KEPT);
        assert!(kept[0].contains("client 3"), "{}", kept[0]);
        assert!(kept[KEPT - 1].contains(&format!("client {}", KEPT + 2)));
        // Taken once: the count stays.
        assert!(failed.take().is_none());
        assert_eq!(failed.count(), (KEPT + 3) as u64);
    }
}
