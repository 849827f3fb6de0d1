//! The one rule for the handshakes an accepting side has waiting, whether a TCP [`Listener`]
//! (`bootstrap.rs`), a [`CmListener`] (`cm.rs`) or a hub (`hub/accept.rs`): at most `most` wait
//! at once, and the memory they registered stays within `cap`; a newcomer that would break
//! either evicts the oldest waiting (the nearest deadline: every handshake has the same
//! timeout), which fails as that client's own. Pure: each side keeps its handshakes as it must
//! (a table of streams, lists of accepted and proving connections, slots) and asks this which
//! one goes.
//!
//! A hub also keeps its handshakes' counts and order here ([`Underway`]).
//!
//! [`Listener`]: crate::Listener
//! [`CmListener`]: crate::CmListener

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

/// A handshake waiting, as the rule sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waiting<K> {
    /// How its side names it.
    pub(crate) key: K,
    /// When it fails if not done.
    pub(crate) deadline: Instant,
    /// Bytes registered for it.
    pub(crate) memory: u64,
}

/// What the waiting handshakes may hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bound {
    /// Most waiting at once (at least one always may).
    pub(crate) most: usize,
    /// Most bytes registered for them all (`u64::MAX`: no bound), unless only one waits.
    pub(crate) cap: u64,
}

/// Why a handshake was evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Crowded {
    /// So many were waiting.
    Count(usize),
    /// Their receive buffers held so many bytes, and the newcomer's would not fit the cap.
    Memory {
        /// Bytes the waiting held.
        held: u64,
        /// The cap.
        cap: u64,
    },
}

impl fmt::Display for Crowded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Crowded::Count(n) => write!(f, "{n} handshakes were waiting"),
            Crowded::Memory { held, cap } => write!(
                f,
                "their receive buffers ({held} bytes) left no room within {cap}"
            ),
        }
    }
}

/// The waiting handshake to evict so that a newcomer costing `memory` fits, and why: none
/// while fewer than `bound.most` wait and their memory with the newcomer's stays within
/// `bound.cap` (or none waits: one always fits); else the oldest (the first of those with the
/// nearest deadline, in `waiting`'s order).
pub(crate) fn to_evict<K>(
    waiting: impl IntoIterator<Item = Waiting<K>>,
    bound: Bound,
    memory: u64,
) -> Option<(K, Crowded)> {
    let (mut count, mut held) = (0usize, 0u64);
    let mut oldest: Option<Waiting<K>> = None;
    for w in waiting {
        count += 1;
        held = held.saturating_add(w.memory);
        if oldest.as_ref().map_or(true, |o| w.deadline < o.deadline) {
            oldest = Some(w);
        }
    }
    let most = bound.most.max(1);
    let why = if count >= most {
        Crowded::Count(count)
    } else if count > 0 && held.saturating_add(memory) > bound.cap {
        Crowded::Memory {
            held,
            cap: bound.cap,
        }
    } else {
        return None;
    };
    oldest.map(|o| (o.key, why))
}

/// The handshakes a hub has under way, counted as they start and end (so that accepting or
/// connecting the ten-thousandth peer visits no other), and its accepted ones in the order
/// they started (so by deadline: every handshake has the same timeout), for [`to_evict`].
/// An ended handshake's entry stays in the order until it reaches the front, or until the
/// ended ones outnumber the live: then they are dropped all at once.
#[derive(Debug)]
pub(crate) struct Underway<K> {
    accepted: usize,
    outgoing: usize,
    order: VecDeque<K>,
}

impl<K> Default for Underway<K> {
    fn default() -> Self {
        Self {
            accepted: 0,
            outgoing: 0,
            order: VecDeque::new(),
        }
    }
}

impl<K: Copy> Underway<K> {
    /// Handshake `key` started: `accepted` (a client's) or our own.
    pub(crate) fn started(&mut self, key: K, accepted: bool) {
        if accepted {
            self.accepted += 1;
            self.order.push_back(key);
        } else {
            self.outgoing += 1;
        }
    }

    /// A handshake ended (established or failed); `live` says of an entry whether its
    /// handshake is still under way.
    pub(crate) fn ended(&mut self, accepted: bool, live: impl Fn(&K) -> bool) {
        if !accepted {
            self.outgoing -= 1;
            return;
        }
        self.accepted -= 1;
        while self.order.front().is_some_and(|k| !live(k)) {
            self.order.pop_front();
        }
        if self.order.len() > 2 * self.accepted + 64 {
            self.order.retain(|k| live(k));
        }
    }

    /// Accepted handshakes under way.
    pub(crate) fn accepted(&self) -> usize {
        self.accepted
    }

    /// Our own handshakes under way.
    pub(crate) fn outgoing(&self) -> usize {
        self.outgoing
    }

    /// The accepted ones, oldest first, with entries of some that ended among them.
    pub(crate) fn oldest_accepted(&self) -> impl Iterator<Item = &K> {
        self.order.iter()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn waiting(at: Instant, deadlines: &[(u32, u64, u64)]) -> Vec<Waiting<u32>> {
        deadlines
            .iter()
            .map(|&(key, ms, memory)| Waiting {
                key,
                deadline: at + Duration::from_millis(ms),
                memory,
            })
            .collect()
    }

    #[test]
    fn below_the_bound_nobody_goes_at_it_the_oldest_does() {
        let now = Instant::now();
        let w = waiting(now, &[(1, 300, 0), (2, 100, 0), (3, 200, 0)]);
        let bound = Bound {
            most: 4,
            cap: u64::MAX,
        };
        assert_eq!(to_evict(w.clone(), bound, 0), None);
        let bound = Bound {
            most: 3,
            cap: u64::MAX,
        };
        assert_eq!(to_evict(w, bound, 0), Some((2, Crowded::Count(3))));
    }

    #[test]
    fn memory_evicts_until_the_newcomer_fits_but_one_always_fits() {
        let now = Instant::now();
        let bound = Bound {
            most: 63,
            cap: 1000,
        };
        let w = waiting(now, &[(1, 100, 400), (2, 200, 400)]);
        assert_eq!(to_evict(w.clone(), bound, 200), None, "1000 fits");
        assert_eq!(
            to_evict(w, bound, 201),
            Some((
                1,
                Crowded::Memory {
                    held: 800,
                    cap: 1000
                }
            ))
        );
        assert_eq!(
            to_evict(Vec::<Waiting<u32>>::new(), bound, 5000),
            None,
            "alone, a handshake beyond the cap still runs"
        );
    }

    #[test]
    fn of_equal_deadlines_the_first_listed_goes_and_most_is_at_least_one() {
        let now = Instant::now();
        let w = waiting(now, &[(7, 100, 0), (8, 100, 0)]);
        assert_eq!(
            to_evict(
                w,
                Bound {
                    most: 0,
                    cap: u64::MAX
                },
                0
            ),
            Some((7, Crowded::Count(2)))
        );
    }

    #[test]
    fn handshakes_under_way_are_counted_and_ended_entries_do_not_pile_up() {
        let mut u = Underway::default();
        let mut live = std::collections::HashSet::new();
        for k in 0..10u32 {
            u.started(k, true);
            live.insert(k);
        }
        u.started(100, false);
        assert_eq!((u.accepted(), u.outgoing()), (10, 1));
        // The oldest ends: its entry goes at once; one in the middle stays until it reaches
        // the front.
        live.remove(&0);
        u.ended(true, |k| live.contains(k));
        live.remove(&5);
        u.ended(true, |k| live.contains(k));
        assert_eq!(u.accepted(), 8);
        assert_eq!(u.oldest_accepted().next(), Some(&1));
        assert!(u.oldest_accepted().any(|k| *k == 5), "dropped lazily");
        u.ended(false, |_| unreachable!("ours are not in the order"));
        assert_eq!(u.outgoing(), 0);
        // Thousands start and end out of order: the entries stay within twice the live ones
        // and 64.
        for k in 1000..5000u32 {
            u.started(k, true);
            live.insert(k);
            if k % 2 == 1 {
                live.remove(&(k - 1));
                u.ended(true, |k| live.contains(k));
            }
        }
        assert!(u.oldest_accepted().count() <= 2 * u.accepted() + 64);
        assert_eq!(u.accepted(), live.len());
    }
}
