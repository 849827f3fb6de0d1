//! What a driver has free for a send, and how much of a queue may be left unsignaled.

/// What the driver has free for a send right now (`usize::MAX` for what it does not count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Room {
    /// Free slots of the queue pair's send queue.
    pub sq: usize,
    /// Free send buffers.
    pub buffers: usize,
    /// Free entries of the send completion queue, where queue pairs share it.
    pub cq: usize,
    /// Most sends this queue pair may leave unsignaled behind its last signaled one, where it
    /// shares a send completion queue: its part of that queue. They occupy it until a later
    /// signaled send of the same queue pair completes (or all flush back if it fails), so a
    /// queue pair that falls silent would otherwise hold them for ever.
    pub unsignaled: usize,
}

/// Each queue pair's part of the unsignaled sends that `queue_pairs` sharing a send CQ of
/// `cq_entries` may leave behind their last signaled ones: half of it, shared out.
pub(crate) fn unsignaled_share(cq_entries: usize, queue_pairs: usize) -> usize {
    cq_entries / 2 / queue_pairs.max(1)
}

/// Most sends a queue pair of `sq_depth` send slots may leave unsignaled behind its last
/// signaled one: fewer than half. Unsignaled sends hold their slots until a later signaled one
/// retires them, so a queue full of them would never free a slot (and a send that waits for
/// one, or for the several a memory-window bind or a read takes, would wait for ever); with
/// at most half so held, at least half the queue frees once the last signaled send completes,
/// room for anything [`max_in_one_go`] allows.
pub(crate) fn unsignaled_in_queue(sq_depth: usize) -> usize {
    (sq_depth / 2).saturating_sub(1)
}

/// Most work requests one operation (a bind of several memory windows and the send after it,
/// a read of several segments) may need at once on a send queue of `sq_depth` slots: what
/// half of it always has free (see [`unsignaled_in_queue`]).
pub(crate) fn max_in_one_go(sq_depth: usize) -> usize {
    (sq_depth / 2).max(1)
}

/// [`Room::unsignaled`] for a queue pair that has `own` unsignaled sends behind its last
/// signaled one, when all `queue_pairs` sharing a send CQ of `cq_entries` have `total`: its
/// part ([`unsignaled_share`]), and never beyond half the CQ altogether, whenever the queue
/// pairs came (a part counted when few shared the CQ stays with a queue pair that fell
/// silent). Otherwise queue pairs whose traffic stopped fill the CQ with sends that only
/// their next signaled one would retire: a hub's 1,024 peers each holding a few unsignaled
/// grants did, and every send then waited for the one allowed to be signaled.
pub(crate) fn unsignaled_room(
    cq_entries: usize,
    queue_pairs: usize,
    own: usize,
    total: usize,
) -> usize {
    unsignaled_share(cq_entries, queue_pairs).min(own + (cq_entries / 2).saturating_sub(total))
}
