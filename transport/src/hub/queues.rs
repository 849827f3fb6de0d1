//! What lies under one hub connection's core, for the one driver ([`crate::drive`]): its queue
//! pair on the hub's shared receive queue and CQs, the hub's send buffers and receive pool, and
//! its bootstrap stream (or rdma_cm id).

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rdmsg_verbs::{Buffer, Exposed};

use super::slots::Resources;
use super::{RawHub, RawHubEvent};
use crate::core::{Command, Core, Post, Receipt, RecvAction, Room};
use crate::drive::{Exposes, Queues};
use crate::error::{Error, Result};
use crate::peer_id::PeerId;
use crate::send::{self, Payload};
use crate::share;

/// One connection of the hub, as the driver sees it.
pub(super) struct SlotQueues<'a> {
    pub(super) hub: &'a mut RawHub,
    pub(super) slot: usize,
    /// The receive group whose CQ the completion being handled came from.
    pub(super) recv_group: Option<usize>,
}

impl RawHub {
    /// Connection `slot` (live) for the driver.
    pub(super) fn queues(&mut self, slot: usize) -> SlotQueues<'_> {
        SlotQueues {
            hub: self,
            slot,
            recv_group: None,
        }
    }
}

impl SlotQueues<'_> {
    #[inline]
    fn slot(&self) -> &super::slots::Slot {
        self.hub.slot(self.slot)
    }
}

impl Queues for SlotQueues<'_> {
    type Buf = Buffer;
    type Payload = Payload;

    #[inline]
    fn core(&mut self) -> &mut Core {
        &mut self.hub.slot_mut(self.slot).core
    }

    #[inline]
    fn next_command(&mut self) -> Option<Command> {
        // A handshake that fails without a queue pair frees its slot at once.
        self.hub.table.slots[self.slot]
            .as_mut()
            .and_then(|s| s.core.poll_command())
    }

    #[inline]
    fn clock(&self) -> impl FnOnce() -> Instant + 'static {
        // Asked only on the rare paths (a failure's drain, a close's linger), which a public
        // call may reach without a turn of its own: the clock itself, never an old turn's.
        Instant::now
    }

    #[inline]
    fn names(&self) -> (u32, Option<PeerId>) {
        let s = self.slot();
        (s.qpn.unwrap_or(0), Some(s.id(self.slot)))
    }

    #[inline]
    fn room(&self) -> Room {
        self.hub.room(self.slot)
    }

    #[inline]
    fn post(&mut self, payload: Payload, post: Post) -> Result<()> {
        self.hub.post(self.slot, payload, post)
    }

    #[inline]
    fn note(&mut self) -> Payload {
        let note = self.hub.slot(self.slot).core.note();
        self.hub.send.note(note)
    }

    #[inline]
    fn note_in(&self, buf: &Buffer, byte_len: u32) -> Option<u32> {
        send::note_of(buf.as_slice(), byte_len)
    }

    #[inline]
    fn received(&mut self, receipt: Receipt) {
        let Some(group) = self.recv_group else {
            return;
        };
        let hub = &mut *self.hub;
        let s = hub.table.slots[self.slot].as_mut().expect("a mapped slot");
        let share_receipt = match receipt.action {
            RecvAction::Grant => share::Consumed::Grant,
            // A close message spends a data credit too.
            _ if receipt.spent_credit => share::Consumed::Data,
            _ => share::Consumed::Unaccounted,
        };
        let share = &mut hub.groups[group].share;
        if s.admitted && s.group == Some(group) {
            share.on_consumed(self.slot, s, share_receipt, &mut hub.touched);
            // The peer may have returned all it could: its grant slots may sleep.
            share.park_slots(self.slot, &mut hub.table.slots, &mut hub.touched);
        } else {
            share.on_stray();
        }
    }

    #[inline]
    fn deliver(&mut self, buf: Buffer, byte_len: u32) {
        let hub = &mut *self.hub;
        hub.stats.received += 1;
        let msg = hub.pool.lend(buf, byte_len as usize);
        let s = hub.table.slots[self.slot].as_mut().expect("a mapped slot");
        if s.announced {
            let peer = s.id(self.slot);
            hub.events.push_back(RawHubEvent::Message { peer, msg });
        } else {
            s.early.push(msg);
        }
    }

    #[inline]
    fn recycle(&mut self, buf: Buffer) {
        self.hub.pool.put_back(buf);
    }

    // A shared receive queue's receives are not flushed by a queue pair's error: nothing to
    // explain (the default).

    fn post_probe(&mut self) -> Result<()> {
        let hub = &mut *self.hub;
        let s = hub.table.slots[self.slot].as_mut().expect("a live slot");
        let Resources::Linked(link) = &mut s.resources else {
            unreachable!("a slot with room for a probe is linked")
        };
        let before = link.qp.send_outstanding();
        let posted = link.qp.post_probe();
        hub.budget.follow(before, link.qp.send_outstanding());
        let wr_id = posted.map_err(Error::from)?;
        // The core first: the hub's count of unsignaled sends follows the core's, which the
        // signaled probe brings to 0.
        s.core.probe_posted(wr_id);
        hub.stats.liveness_probes += 1;
        hub.follow_unsignaled(self.slot);
        Ok(())
    }

    fn bind(&mut self, window: &mut Exposed) -> Result<()> {
        let hub = &mut *self.hub;
        let s = hub.table.slots[self.slot].as_mut().expect("a live slot");
        let Resources::Linked(link) = &mut s.resources else {
            unreachable!("a send could go");
        };
        let before = link.qp.send_outstanding();
        let bound = link.qp.bind(window);
        hub.budget.follow(before, link.qp.send_outstanding());
        match bound {
            Ok(wr_id) => {
                s.core.posted(wr_id, true);
                hub.follow_unsignaled(self.slot);
                Ok(())
            }
            Err(e) => Err(hub.local_failure(
                self.slot,
                "binding a memory window (ibv_post_send)",
                e.into(),
            )),
        }
    }

    fn say_goodbye(&mut self) {
        if let Some(link) = self.hub.slot_mut(self.slot).established_mut() {
            link.control.say_goodbye();
        }
    }

    fn unwatch_stream(&mut self) {
        let hub = &mut *self.hub;
        let s = hub.table.slots[self.slot].as_mut().expect("a live slot");
        if let Resources::Linked(link) = &mut s.resources {
            if std::mem::take(&mut link.watched) {
                let _ = hub.waiter.channel().watch.remove(link.control.as_fd());
            }
        }
    }

    fn fail_unlinked(&mut self) -> bool {
        let s = self.hub.slot(self.slot);
        if s.is_handshaking() {
            if let Some(e) = s.core.failure().map(Error::from) {
                self.hub.handshake_failed(self.slot, e);
            }
            return true;
        }
        // Failing or retired already: its queue pair is in the error state or gone.
        s.established().is_none()
    }

    fn shut_down_stream(&mut self) {
        if let Some(link) = self.hub.slot_mut(self.slot).established_mut() {
            link.control.shut_down();
        }
    }

    fn to_error(&mut self) {
        if let Some(qp) = self.hub.slot_mut(self.slot).qp_mut() {
            let _ = qp.to_error();
        }
    }

    fn flushing(&mut self) {
        self.hub.start_draining(self.slot);
    }

    #[inline]
    fn flushes_outstanding(&self) -> usize {
        // The queue pair's sends: its receives came from the shared queue, which keeps them.
        match &self.slot().resources {
            Resources::Linked(link) => link.qp.send_outstanding(),
            Resources::Failing(qp) => qp.send_outstanding(),
            _ => 0,
        }
    }
}

impl Exposes for SlotQueues<'_> {
    fn endpoint(&self) -> &crate::endpoint::Endpoint {
        &self.hub.endpoint
    }

    fn sq_depth(&self) -> Option<usize> {
        self.slot().established().map(|l| l.sq_depth)
    }

    fn wait_for_send_slots(&mut self, reserve: usize, timeout: Option<Duration>) -> Result<()> {
        let peer = self.slot().id(self.slot);
        self.hub.budget.set_reserve(reserve);
        let waited = self.hub.wait_to_send(self.slot, peer, timeout);
        self.hub.budget.set_reserve(0);
        waited
    }
}
