//! A hub's reassembly budget, shared by all its peers' receiving sides.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// What all peers of a hub may hold in messages being reassembled from fragments, and how
/// long one may hold its part without progress.
///
/// - **Room.** A message reserves the length its first fragment announces
///   ([`crate::frame::announced_total`], at most `max_message`) until it is whole or dropped: messages
///   under way always finish, and the total never passes the bound. One message may always be
///   under way, whatever the bound (an empty budget takes any message).
/// - **Turns.** Each peer has at most one message in reassembly. A peer whose message finds no
///   room parks its frames (see [`super::RecvSide::parked`]) and takes a place in line; while anyone
///   waits, only the first in line may reserve, as soon as its message fits. So a peer that
///   finishes a message and starts the next cannot take the room back from those waiting, and
///   small messages cannot keep a large one out for ever: each waiting peer gets its turn once
///   the messages ahead of it end.
/// - **Progress.** A message that gets no fragment for `timeout`
///   ([`crate::HubLimits::reassembly_timeout`]) is dropped, its reservation returned
///   ([`super::RecvSide::handle_timeout`]): a stalled or stopped peer holds its part for that long at
///   most.
#[derive(Debug, Clone)]
pub(crate) struct ReassemblyBudget {
    shares: Arc<Mutex<Shares>>,
    /// The progress timeout in nanoseconds, changed in place for every peer
    /// ([`crate::Hub::set_limits`]).
    timeout_ns: Arc<AtomicU64>,
}

#[derive(Debug, Default)]
struct Shares {
    /// Bytes reserved.
    used: usize,
    /// Tickets of the peers waiting for room, in the order they came.
    line: VecDeque<u64>,
    next_ticket: u64,
    /// The bound on `used` (one message always fits).
    max: usize,
}

impl ReassemblyBudget {
    pub(crate) fn new(max: usize, timeout: Duration) -> Self {
        let budget = Self {
            shares: Arc::default(),
            timeout_ns: Arc::default(),
        };
        budget.set_limits(max, timeout);
        budget
    }

    /// New limits for every peer at once: a lower bound holds back only messages not yet
    /// started; a timeout runs from each message's last progress as before.
    pub(crate) fn set_limits(&self, max: usize, timeout: Duration) {
        self.shares().max = max;
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        self.timeout_ns.store(ns, Ordering::Relaxed);
    }

    pub(super) fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    fn shares(&self) -> std::sync::MutexGuard<'_, Shares> {
        // Nothing panics while holding it; the counts stay whole either way.
        self.shares.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves `need` bytes for the holder of `ticket`, if it is its turn and they fit (or
    /// nothing is reserved); otherwise it takes (or keeps) a place in line.
    pub(super) fn try_reserve(&self, ticket: &mut Option<u64>, need: usize) -> bool {
        let mut s = self.shares();
        let turn = s.line.front().map_or(true, |first| Some(*first) == *ticket);
        if turn && (s.used == 0 || s.used + need <= s.max) {
            s.used += need;
            if ticket.take().is_some() {
                s.line.pop_front();
            }
            return true;
        }
        if ticket.is_none() {
            let t = s.next_ticket;
            s.next_ticket += 1;
            s.line.push_back(t);
            *ticket = Some(t);
        }
        false
    }

    /// Gives up a place in line.
    pub(super) fn leave(&self, ticket: &mut Option<u64>) {
        if let Some(t) = ticket.take() {
            self.shares().line.retain(|w| *w != t);
        }
    }

    pub(super) fn release(&self, n: usize) {
        self.shares().used -= n;
    }

    /// Bytes reserved now.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.shares().used
    }
}
