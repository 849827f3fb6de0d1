//! What a call's wait takes in for the application: messages (a hub's events) kept in order
//! until it receives them, bounded in bytes per peer ([`SessionConfig::max_held_bytes`]).
//!
//! A kept message is out of its receive buffer (its credit back to the peer, which may need
//! it to send the answer), so credits no longer bound what is kept: this does. Once a peer's
//! messages kept reach the bound, the session or hub stops taking that peer's messages in
//! ([`crate::peer::RecvSide::hold_back`]): they stay unread in their receive buffers, the
//! peer's credits with them, and the peer stops. (A hub's receive buffers are a shared pool
//! that would return the peer's credits from other buffers: it holds the peer back there too,
//! [`rdmsg_transport::RawHub::hold_back`].) The application receiving kept messages brings the
//! peer under its bound again, and its frames are taken in.
//!
//! [`SessionConfig::max_held_bytes`]: crate::SessionConfig::max_held_bytes

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// What a kept item costs beyond its body: its place in the queue and what it carries
/// (an envelope, an event, an error), so that items with no body (bad frames) count too.
const fn overhead<T>() -> usize {
    std::mem::size_of::<T>()
}

/// Items kept in order, each charged to a peer (`K`: `()` for a session, the peer for a
/// hub) for its body's bytes and [`overhead`].
#[derive(Debug)]
pub(crate) struct Held<K, T> {
    items: VecDeque<(T, Option<K>, usize)>,
    /// Per peer with items kept: their count and the bytes charged.
    load: HashMap<K, Load>,
    /// The bound per peer.
    max: usize,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Load {
    items: usize,
    bytes: usize,
}

impl<K: Copy + Eq + Hash, T> Held<K, T> {
    /// Nothing kept; each peer's items bounded to `max` bytes (one item always fits).
    pub(crate) fn new(max: usize) -> Self {
        Self {
            items: VecDeque::new(),
            load: HashMap::new(),
            max,
        }
    }

    /// Keeps `item` behind the others, charged to `who` (`None`: to nobody, as an event of
    /// the hub's own) for `body` bytes. Whether `who` is now full ([`Held::is_full`]).
    pub(crate) fn push(&mut self, who: Option<K>, item: T, body: usize) -> bool {
        let cost = body.saturating_add(overhead::<T>());
        self.items.push_back((item, who, cost));
        let Some(k) = who else {
            return false;
        };
        let load = self.load.entry(k).or_default();
        load.items += 1;
        load.bytes = load.bytes.saturating_add(cost);
        self.is_full(k)
    }

    /// The oldest item, with whom it was charged to and whether that one went from full to
    /// not full by its leaving (its messages are to be taken in again).
    pub(crate) fn pop(&mut self) -> Option<(T, Option<K>, bool)> {
        let (item, who, cost) = self.items.pop_front()?;
        let Some(k) = who else {
            return Some((item, None, false));
        };
        let was_full = self.is_full(k);
        if let Some(load) = self.load.get_mut(&k) {
            load.items -= 1;
            load.bytes -= cost;
            if load.items == 0 {
                self.load.remove(&k);
            }
        }
        Some((item, who, was_full && !self.is_full(k)))
    }

    /// Whether `who` holds all it may: no more of its messages are to be taken in. A peer
    /// with nothing kept never is, whatever the bound (one message always fits).
    pub(crate) fn is_full(&self, who: K) -> bool {
        self.load
            .get(&who)
            .is_some_and(|l| l.items > 0 && l.bytes >= self.max)
    }

    /// The bytes charged to `who` (bodies and [`overhead`]).
    pub(crate) fn bytes(&self, who: K) -> usize {
        self.load.get(&who).map_or(0, |l| l.bytes)
    }

    /// Items kept, of every peer.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const O: usize = overhead::<u32>();

    #[test]
    fn a_peer_is_full_at_its_bound_and_free_again_once_under_it() {
        let mut h: Held<u8, u32> = Held::new(1000 + 2 * O);
        assert!(!h.is_full(1));
        assert!(!h.push(Some(1), 10, 600));
        assert!(h.push(Some(1), 11, 400), "at the bound: full");
        assert_eq!(h.bytes(1), 1000 + 2 * O);
        assert!(h.push(Some(1), 12, 700), "still full");
        assert_eq!(h.pop(), Some((10, Some(1), false)), "still over its bound");
        assert_eq!(h.pop(), Some((11, Some(1), true)), "under it: free again");
        assert!(!h.is_full(1));
        assert_eq!(h.pop(), Some((12, Some(1), false)));
        assert_eq!((h.pop(), h.bytes(1), h.len()), (None, 0, 0));
    }

    #[test]
    fn one_item_always_fits_and_items_without_a_body_count() {
        let mut h: Held<(), u32> = Held::new(0);
        assert!(!h.is_full(()), "nothing kept: never full");
        assert!(
            h.push(Some(()), 1, 1 << 30),
            "one message beyond the bound is kept"
        );
        assert_eq!(h.pop(), Some((1, Some(()), true)));
        let mut h: Held<(), u32> = Held::new(100 * O);
        for i in 0..99 {
            assert!(!h.push(Some(()), i, 0));
        }
        assert!(h.push(Some(()), 99, 0), "a hundred errors fill it");
    }

    #[test]
    fn each_peer_has_its_own_bound_in_one_order() {
        let mut h: Held<u8, u32> = Held::new(100);
        assert!(h.push(Some(1), 1, 100), "a streaming peer fills its part");
        assert!(!h.push(Some(2), 2, 10), "another is not held back");
        assert!(
            !h.push(None, 3, 1 << 20),
            "the hub's own events count for nobody"
        );
        assert!(h.is_full(1) && !h.is_full(2));
        let order: Vec<u32> = std::iter::from_fn(|| h.pop().map(|(i, _, _)| i)).collect();
        assert_eq!(order, [1, 2, 3], "one order for all");
        assert!(h.is_empty());
    }
}
