//! What lies under a simulated end's core, for the one driver ([`crate::drive`]): the same
//! sequences `Connection` and the hub run, over the simulated device.

use std::time::Instant;

use super::{End, Net};
use crate::core::{Command, Core, Post, Receipt, RecvAction, Room, StreamNews};
use crate::drive::Queues;
use crate::error::{Failure, Result};
use crate::peer_id::PeerId;
use crate::share;

/// One end of the simulated network (a connection, or a live hub slot), as the driver sees it.
pub(super) struct SimQueues<'a> {
    pub(super) net: &'a mut Net,
    pub(super) end: End,
}

impl Net {
    /// End `end` for the driver.
    pub(super) fn queues(&mut self, end: End) -> SimQueues<'_> {
        SimQueues { net: self, end }
    }
}

impl Queues for SimQueues<'_> {
    /// A receive's sequence number, if it carried data.
    type Buf = Option<u64>;
    /// A data message's sequence number.
    type Payload = Option<u64>;

    fn core(&mut self) -> &mut Core {
        match self.end {
            End::Conn(i) => &mut self.net.conns[i].core,
            End::Hub(s) => {
                &mut self.net.hub().table.slots[s]
                    .as_mut()
                    .expect("a live slot")
                    .core
            }
            End::Gone(_) => unreachable!("a gone end has no core"),
        }
    }

    fn next_command(&mut self) -> Option<Command> {
        match self.end {
            End::Conn(i) => self.net.conns[i].core.poll_command(),
            End::Hub(s) => self.net.hub().table.slots[s]
                .as_mut()
                .and_then(|slot| slot.core.poll_command()),
            End::Gone(_) => None,
        }
    }

    fn clock(&self) -> impl FnOnce() -> Instant + 'static {
        let now = self.net.now;
        move || now
    }

    fn names(&self) -> (u32, Option<PeerId>) {
        // An end's index stands for its queue pair.
        match self.end {
            End::Conn(i) | End::Hub(i) | End::Gone(i) => (i as u32, None),
        }
    }

    fn room(&self) -> Room {
        match self.end {
            End::Conn(i) => self.net.conns[i].room(),
            End::Hub(s) => self.net.hub.as_ref().expect("a hub").table.slots[s]
                .as_ref()
                .expect("a live slot")
                .room(),
            End::Gone(_) => unreachable!("a gone end sends nothing"),
        }
    }

    fn post(&mut self, seq: Option<u64>, post: Post) -> Result<()> {
        self.net.post_send(self.end, post, seq);
        Ok(())
    }

    fn note(&mut self) -> Option<u64> {
        // Simulated grants carry no bytes.
        None
    }

    fn note_in(&self, _seq: &Option<u64>, _byte_len: u32) -> Option<u32> {
        None
    }

    fn explain_flush(&mut self) -> Option<Failure> {
        match self.end {
            // As `Connection` asks the event router.
            End::Conn(i) => self.net.conns[i].pending_event.take(),
            // A shared receive queue's receives are not flushed.
            _ => None,
        }
    }

    fn received(&mut self, receipt: Receipt) {
        let End::Hub(s) = self.end else {
            return;
        };
        let h = self.net.hub();
        let slot = h.table.slots[s].as_mut().expect("a live slot");
        let r = match receipt.action {
            RecvAction::Grant => share::Consumed::Grant,
            _ if receipt.spent_credit => share::Consumed::Data,
            _ => share::Consumed::Unaccounted,
        };
        if slot.admitted {
            h.share.on_consumed(s, slot, r, &mut h.touched);
            h.share.park_slots(s, &mut h.table.slots, &mut h.touched);
        } else {
            h.share.on_stray();
        }
    }

    fn deliver(&mut self, seq: Option<u64>, _byte_len: u32) {
        let seq = seq.expect("data carries a sequence");
        match self.end {
            End::Conn(i) => {
                let c = &mut self.net.conns[i];
                c.app.received.push(seq);
                c.app.held += 1;
            }
            End::Hub(s) => {
                let h = self.net.hub();
                let slot = h.table.slots[s].as_mut().expect("a live slot");
                slot.app.received.push(seq);
                slot.app.held += 1;
                h.held += 1;
                h.held_order.push_back(s);
            }
            End::Gone(_) => {}
        }
    }

    fn recycle(&mut self, _seq: Option<u64>) {
        match self.end {
            End::Conn(i) => self.net.conns[i].free += 1,
            End::Hub(_) => self.net.hub().free += 1,
            End::Gone(_) => {}
        }
    }

    fn post_probe(&mut self) -> Result<()> {
        // A zero-length read: it takes a send queue slot and no receive of the peer's, and
        // completes (signaled) once the peer's device answered.
        let wr_id = self.net.post_read_request(self.end, true);
        self.net.probes += 1;
        self.core().probe_posted(wr_id);
        Ok(())
    }

    fn bind(&mut self, _window: &mut rdmsg_verbs::Exposed) -> Result<()> {
        unreachable!("an exposure needs a registered region: the simulator makes none")
    }

    fn say_goodbye(&mut self) {
        let peer = self.net.peer_of(self.end);
        self.net.tell_stream(peer, StreamNews::Goodbye);
    }

    fn unwatch_stream(&mut self) {
        // Simulated streams bring their news once: nothing to unwatch.
    }

    fn shut_down_stream(&mut self) {
        let peer = self.net.peer_of(self.end);
        self.net.tell_stream(peer, StreamNews::Ended);
        if let End::Conn(i) = self.end {
            self.net.conns[i].stream_shut = true;
        }
    }

    fn to_error(&mut self) {
        self.net.break_queue_pair(self.end);
    }

    fn flushing(&mut self) {
        if let End::Hub(s) = self.end {
            let h = self.net.hub();
            if h.table.slots[s].as_ref().is_some_and(|slot| slot.admitted) {
                // Its buffers stop being refilled; released at the end.
                h.share.retire(s);
            }
        }
    }

    fn flushes_outstanding(&self) -> usize {
        match self.end {
            // Receives the queue pair still holds: posted, or completed and not yet polled.
            End::Conn(i) => {
                let c = &self.net.conns[i];
                c.recv_posted as usize + c.recv_cq.entries.len()
            }
            // The hub waits for its sends (the shared queue keeps its receives).
            End::Hub(s) => self.net.hub.as_ref().expect("a hub").table.slots[s]
                .as_ref()
                .map_or(0, |slot| slot.sq.posted.len()),
            End::Gone(_) => 0,
        }
    }
}
