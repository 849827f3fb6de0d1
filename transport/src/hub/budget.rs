//! What the hub's connections may post on what they share, sans-IO: the send CQ's entries
//! (every queue pair's sends, binds, reads and probes complete there), the sends left
//! unsignaled (each holds a send buffer until a later signaled one retires it), and the RDMA
//! reads (at most half the CQ, shared fairly). The hub tells [`SendBudget`] what its queue
//! pairs posted and retired, and asks it for a connection's [`Room`]; nothing here touches a
//! verb, so every rule is host-tested below.

use crate::core::{unsignaled_in_queue, unsignaled_room, Room};

/// Work requests of reads a peer may always have under way, whatever its share: one read of
/// the most pieces a rendezvous descriptor names.
const MIN_READ_SHARE: usize = 16;

/// Whether a peer with `own` read work requests under way may post `need` more, when all
/// peers have `all` under way on a send CQ of `cq_entries`, `readers` of them with some:
/// reads fill at most half the CQ, and each reader at most an equal part of that half (at
/// least [`MIN_READ_SHARE`]).
fn fair_read_room(cq_entries: usize, all: usize, readers: usize, own: usize, need: usize) -> bool {
    let half = cq_entries / 2;
    let readers = readers + usize::from(own == 0);
    let share = (half / readers.max(1)).max(MIN_READ_SHARE);
    all + need <= half.max(need) && own + need <= share
}

/// The hub's send CQ, shared by every queue pair: its entries, and the requests (sends,
/// binds, reads, probes) posted on any queue pair and not yet retired, each of which may
/// still fill one entry. The count follows the queue pairs' own counts
/// ([`rdmsg_verbs::QueuePair::send_outstanding`]), read before and after every post,
/// completion and retirement, whatever a post returned: a failed post the provider did not
/// point at may have gone, is counted by its queue pair, and so here, until its completion
/// or its queue pair's retirement takes it off again. One rule for every kind of request,
/// so the count never drifts from what may really fill the CQ. Beside it, the sends left
/// unsignaled and the reads under way, over all queue pairs, and the slots set aside while
/// an exposure waits to be bound.
#[derive(Debug)]
pub(super) struct SendBudget {
    entries: usize,
    outstanding: usize,
    /// Send buffers: unsignaled sends may hold at most half of what the CQ and they allow.
    send_buffers: usize,
    /// Sends left unsignaled behind their queue pair's last signaled one, all queue pairs.
    unsignaled: usize,
    /// Work requests of RDMA reads under way, all queue pairs, and how many queue pairs have
    /// some.
    read_wrs: usize,
    readers: usize,
    /// Send queue and send CQ slots set aside while an exposure waits to be bound (see
    /// [`RawHub::expose_to_peer`](super::RawHub::expose_to_peer)).
    reserve: usize,
}

impl SendBudget {
    /// A send CQ of `entries` and `send_buffers` buffers, nothing posted.
    pub(super) fn new(entries: usize, send_buffers: usize) -> Self {
        Self {
            entries,
            outstanding: 0,
            send_buffers,
            unsignaled: 0,
            read_wrs: 0,
            readers: 0,
            reserve: 0,
        }
    }

    /// Requests posted on every queue pair and not yet retired.
    #[inline]
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Entries no outstanding request may still fill.
    #[inline]
    pub(super) fn cq_free(&self) -> usize {
        self.entries.saturating_sub(self.outstanding)
    }

    /// One queue pair's count of outstanding send requests went from `before` to `after`.
    #[inline]
    pub(super) fn follow(&mut self, before: usize, after: usize) {
        let outstanding = (self.outstanding + after).checked_sub(before);
        debug_assert!(
            outstanding.is_some(),
            "a queue pair retired more than it posted"
        );
        self.outstanding = outstanding.unwrap_or(0);
    }

    /// Sets `n` send-queue and CQ slots aside (0: none).
    pub(super) fn set_reserve(&mut self, n: usize) {
        self.reserve = n;
    }

    /// What is free for a send of a queue pair of `sq_depth` (none: not linked yet) with
    /// `sq_outstanding` requests posted, `own_unsignaled` of them unsignaled behind its last
    /// signaled one, `buffers` send buffers free, among `connections` sharing the CQ.
    #[inline]
    pub(super) fn room(
        &self,
        sq_depth: Option<usize>,
        sq_outstanding: usize,
        own_unsignaled: usize,
        buffers: usize,
        connections: usize,
    ) -> Room {
        let depth = sq_depth.unwrap_or(0);
        Room {
            sq: sq_depth.map_or(0, |d| d.saturating_sub(sq_outstanding + self.reserve)),
            buffers,
            cq: self.cq_free().saturating_sub(self.reserve),
            // Unsignaled sends hold their buffers until a later signaled one on their queue
            // pair retires them, and a peer that falls silent posts none: at most half the
            // send buffers (as of the CQ) may be so held, whatever the peers do.
            unsignaled: unsignaled_room(
                self.entries.min(self.send_buffers),
                connections,
                own_unsignaled,
                self.unsignaled,
            )
            .min(unsignaled_in_queue(depth)),
        }
    }

    /// A queue pair's count of sends left unsignaled went from `was` to `now` (0: its queue
    /// pair is gone, or a signaled send retired them).
    #[inline]
    pub(super) fn follow_unsignaled(&mut self, was: usize, now: usize) {
        self.unsignaled = self.unsignaled - was + now;
    }

    /// Whether a peer with `own` read work requests under way may post `need` more: reads
    /// of all peers fill at most half the send CQ (a few peers whose reads do not complete,
    /// their queue pairs stalled, never hold back everyone's sends and grants), and each
    /// reading peer at most its share of that half (at least one read of the most pieces a
    /// descriptor names).
    pub(super) fn read_fits(&self, own: usize, need: usize) -> bool {
        fair_read_room(self.entries, self.read_wrs, self.readers, own, need)
    }

    /// A read of `wrs` work requests was posted by a peer, its `first` under way.
    pub(super) fn read_posted(&mut self, first: bool, wrs: usize) {
        self.readers += usize::from(first);
        self.read_wrs += wrs;
    }

    /// Reads of `wrs` work requests of a peer that had some under way are over (completed,
    /// or their queue pair retired); `none_left` if it has no other.
    pub(super) fn reads_over(&mut self, wrs: usize, none_left: bool) {
        self.read_wrs -= wrs;
        self.readers -= usize::from(none_left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue pair's own count of outstanding requests, as verbs-core keeps it: a post that
    /// failed without the provider naming the request counts (it may have gone).
    struct Books(usize);

    #[test]
    fn a_post_that_may_have_gone_is_counted_until_its_completion() {
        let mut cq = SendBudget::new(1024, 1024);
        let mut qp = Books(0);
        // Two sends posted, then one that failed but may have gone, then a bind.
        for _ in 0..4 {
            let before = qp.0;
            qp.0 += 1;
            cq.follow(before, qp.0);
        }
        assert_eq!((cq.outstanding(), cq.cq_free()), (4, 1020));
        // A signaled completion of the last retires all four on the queue pair.
        let before = qp.0;
        qp.0 = 0;
        cq.follow(before, qp.0);
        assert_eq!(
            (cq.outstanding(), cq.cq_free()),
            (0, 1024),
            "the count neither wraps nor leaks an entry"
        );
        // A retired queue pair takes off what it still held.
        let mut other = Books(0);
        cq.follow(other.0, 3);
        other.0 = 3;
        cq.follow(other.0, 0);
        assert_eq!(cq.cq_free(), 1024);
    }

    #[test]
    fn reads_fill_half_the_send_cq_at_most_each_reader_its_part() {
        // Alone, a peer may read up to half the CQ.
        assert!(fair_read_room(1024, 0, 0, 0, 16));
        assert!(fair_read_room(1024, 496, 1, 496, 16));
        assert!(
            !fair_read_room(1024, 512, 1, 512, 1),
            "half the CQ is for sends"
        );
        // 64 peers whose reads never complete hold half the CQ between them, and no more:
        // every peer's sends and grants keep the other half.
        let mut budget = SendBudget::new(1024, 1024);
        let mut own = [0usize; 64];
        for _ in 0..100 {
            for o in own.iter_mut() {
                if budget.read_fits(*o, 1) {
                    budget.read_posted(*o == 0, 1);
                    *o += 1;
                }
            }
        }
        let all: usize = own.iter().sum();
        assert!(all <= 512, "{all}");
        assert!(
            own.iter().all(|&o| o <= 16),
            "each within its part: {own:?}"
        );
        // A newcomer still gets its minimum while others read within their shares.
        assert!(fair_read_room(1024, 256, 32, 0, 16));
        assert!(
            !fair_read_room(1024, 256, 32, 16, 16),
            "beyond an equal part"
        );
        // Reads that end give their part back, the last of a peer its place among readers.
        for o in own.iter_mut().filter(|o| **o > 0) {
            budget.reads_over(*o, true);
            *o = 0;
        }
        assert_eq!((budget.read_wrs, budget.readers), (0, 0));
        assert!(budget.read_fits(0, 512));
    }

    #[test]
    fn unsignaled_sends_hold_at_most_half_the_buffers_whoever_holds_them() {
        // 8 connections on a CQ of 64 entries and 64 buffers: each may leave a few sends
        // unsignaled, all of them together at most 32.
        let mut budget = SendBudget::new(64, 64);
        let mut own = [0usize; 8];
        for _ in 0..100 {
            for o in own.iter_mut() {
                let room = budget.room(Some(128), *o, *o, 64, 8);
                if *o < room.unsignaled {
                    budget.follow_unsignaled(*o, *o + 1);
                    *o += 1;
                }
            }
        }
        let all: usize = own.iter().sum();
        assert!(all <= 32, "{all} of 64 buffers held unsignaled: {own:?}");
        assert!(own.iter().all(|&o| o > 0), "everyone had a part: {own:?}");
        // A connection gone takes its count along.
        budget.follow_unsignaled(own[0], 0);
        assert_eq!(budget.unsignaled, all - own[0]);
    }

    #[test]
    fn a_reserve_takes_from_the_send_queue_and_the_cq_alike() {
        let mut budget = SendBudget::new(64, 64);
        budget.follow(0, 10);
        let room = budget.room(Some(16), 10, 0, 64, 1);
        assert_eq!((room.sq, room.cq), (6, 54));
        budget.set_reserve(4);
        let room = budget.room(Some(16), 10, 0, 64, 1);
        assert_eq!((room.sq, room.cq), (2, 50));
        let unlinked = budget.room(None, 0, 0, 64, 1);
        assert_eq!(
            (unlinked.sq, unlinked.unsignaled),
            (0, 0),
            "nothing before a link"
        );
    }
}
