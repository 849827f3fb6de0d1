//! A hub's RDMA reads and exposures: what it lends its peers to read (memory windows bound to
//! one peer's queue pair) and the reads it posts, within a fair part of its shared send CQ.

use std::time::Duration;

use rdmsg_verbs::{Buffer, Exposed, ReadSegment};

use super::slots::Resources;
use super::{PeerId, RawHub};
use crate::drive;
use crate::error::Result;
use crate::read::ReadPost;

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

impl RawHub {
    /// Exposes `bytes` to RDMA reads by peers under a key of their own (see
    /// [`Endpoint::expose`](crate::Endpoint::expose)); a rendezvous sender tells only the peer it sends to.
    pub fn expose(&self, bytes: rdmsg_verbs::Bytes) -> Result<Exposed> {
        self.endpoint.expose(bytes)
    }

    /// Exposes `pieces` to RDMA reads by `peer` alone, bound to its queue pair (see
    /// [`crate::Connection::expose_to_peer`]): the keys read nothing through any other
    /// connection of the hub. Waits as a send to `peer` does, at most `timeout`, driving the
    /// hub.
    pub fn expose_to_peer(
        &mut self,
        peer: PeerId,
        pieces: Vec<rdmsg_verbs::Bytes>,
        timeout: Option<Duration>,
    ) -> Result<Vec<Exposed>> {
        let slot = self.live_slot(peer)?;
        drive::expose(&mut self.queues(slot), pieces, timeout)
    }

    /// The most pieces [`RawHub::expose_to_peer`] binds at once for `peer`.
    pub fn max_exposures(&self, peer: PeerId) -> Result<usize> {
        let slot = self.live_slot(peer)?;
        Ok(self.slot(slot).established().map_or(0, |l| {
            crate::core::max_in_one_go(l.sq_depth)
                .saturating_sub(1)
                .max(1)
        }))
    }

    /// Registers `len` bytes that reads may land in (see [`Endpoint::register`](crate::Endpoint::register)).
    pub fn register(&self, len: usize) -> Result<Buffer> {
        self.endpoint.register(len)
    }

    /// Posts RDMA reads of `peer`'s memory into `into` (see
    /// [`crate::Connection::post_read`]); [`ReadPost::Busy`] if its send queue (or the
    /// hub's send completion queue) has no room for them now. The end of the read is a
    /// [`RawHubEvent::Read`](super::RawHubEvent::Read). A bad key or address fails that peer alone.
    pub fn post_read(
        &mut self,
        peer: PeerId,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> Result<ReadPost> {
        let slot = self.live_slot(peer)?;
        let need = segments.len();
        if let Some(depth) = self.slot(slot).established().map(|l| l.sq_depth) {
            self.slot(slot).core.read_fits(need, depth)?;
        }
        let room = |hub: &Self| {
            let r = hub.room(slot);
            hub.slot(slot).established().is_some()
                && r.sq >= need
                && r.cq >= need
                && hub.read_room(slot, need)
        };
        if !room(self) {
            self.step()?;
            self.live_slot(peer)?;
            if !room(self) {
                return Ok(ReadPost::Busy(into));
            }
        }
        let s = self.table.slots[slot].as_mut().expect("a live slot");
        let Resources::Linked(link) = &mut s.resources else {
            return Ok(ReadPost::Busy(into));
        };
        let before = link.qp.send_outstanding();
        let posted = link.qp.post_read(into, segments);
        self.send_cq.follow(before, link.qp.send_outstanding());
        match posted {
            Ok(id) => {
                s.core.posted_read(id);
                self.peers_reading += usize::from(s.reads.is_empty());
                s.reads.push_back((id, need));
                self.read_wrs += need;
                Ok(ReadPost::Posted(id))
            }
            Err(e)
                if e.posted == 0 && matches!(e.error, rdmsg_verbs::Error::InvalidArgument(_)) =>
            {
                Err(e.error.into())
            }
            Err(e) => {
                Err(self.local_failure(slot, "posting a read (ibv_post_send)", e.error.into()))
            }
        }
    }

    /// Whether `slot` may post a read of `need` work requests: reads of all peers fill at
    /// most half the send CQ (a few peers whose reads do not complete, their queue pairs
    /// stalled, never hold back everyone's sends and grants), and each reading peer at most
    /// its share of that half (at least one read of the most pieces a descriptor names).
    fn read_room(&self, slot: usize, need: usize) -> bool {
        let own: usize = self.slot(slot).reads.iter().map(|(_, n)| n).sum();
        fair_read_room(
            self.send_cq.entries(),
            self.read_wrs,
            self.peers_reading,
            own,
            need,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut own = [0usize; 64];
        for _ in 0..100 {
            for i in 0..own.len() {
                let all: usize = own.iter().sum();
                let readers = own.iter().filter(|&&o| o > 0).count();
                if fair_read_room(1024, all, readers, own[i], 1) {
                    own[i] += 1;
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
    }
}
