//! A hub's RDMA reads and exposures: what it lends its peers to read (memory windows bound to
//! one peer's queue pair) and the reads it posts, within a fair part of its shared send CQ.

use std::time::Duration;

use rdmsg_verbs::{Buffer, Exposed, ReadSegment};

use super::slots::Resources;
use super::{PeerId, RawHub};
use crate::drive;
use crate::error::Result;
use crate::read::ReadPost;

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
        self.budget.follow(before, link.qp.send_outstanding());
        match posted {
            Ok(id) => {
                s.core.posted_read(id);
                self.budget.read_posted(s.reads.is_empty(), need);
                s.reads.push_back((id, need));
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
        self.budget.read_fits(own, need)
    }
}
