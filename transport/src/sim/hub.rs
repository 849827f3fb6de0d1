//! The simulated hub: cores over one shared receive queue, lent by the real [`Share`], driven
//! as [`crate::RawHub`] drives its cores.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmsg_notify::ArmMode;
use rdmsg_verbs::WcStatus;

use super::*;
use crate::core::{Core, Room};
use crate::credits::Credits;
use crate::drive;
use crate::error::Failure;
use crate::hub::table::{Generational, SlotTable};
use crate::share::{CreditHolder, Share};

/// The hub's record of one connection.
#[derive(Debug)]
pub(crate) struct HubSlot {
    pub core: Core,
    pub app: App,
    pub(super) admitted: bool,
    pub(super) sq: SendQueue,
    pub(super) sq_depth: usize,
    pub(super) touched: bool,
    /// Its holder's generation, as the hub's table gives it.
    pub(super) generation: u32,
}

impl Generational for HubSlot {
    fn generation(&self) -> u32 {
        self.generation
    }
}

impl HubSlot {
    /// The hub's send buffers and CQ are not what the simulation bounds: its queue pairs are.
    pub(super) fn room(&self) -> Room {
        self.sq.room(self.sq_depth)
    }
}

impl CreditHolder for HubSlot {
    fn credits(&self) -> &Credits {
        self.core.credits()
    }
    fn credits_mut(&mut self) -> &mut Credits {
        self.core.credits_mut()
    }
}

/// A hub driven like [`crate::RawHub`].
#[derive(Debug)]
pub(crate) struct SimHub {
    pub share: Share,
    /// The connections, in the hub's own table: a slot freed is reused as the hub reuses it.
    pub table: SlotTable<HubSlot>,
    pub(super) srq_posted: u32,
    pub(super) free: u32,
    pub(super) total: u32,
    pub(super) recv_cq: Cq,
    pub(super) send_cq: Cq,
    pub(super) touched: Vec<usize>,
    pub(super) asleep: bool,
    pub(super) last_tick: Instant,
    /// Connections that ended, with how.
    pub ended: Vec<(usize, Failure)>,
    /// Buffers kept spare beyond every connection's minimum (`HubConfig::shared_credits`).
    pub(super) shared: u32,
    /// Every buffer the hub holds for its application, all slots.
    pub(super) held: u32,
    /// The slot of each buffer held, in order of arrival (the application's queue).
    pub(super) held_order: VecDeque<usize>,
    pub(super) next_wr: u64,
}

impl Net {
    // ----- the hub's turn -----

    /// One turn of the hub, as `Hub::step` does it; returns whether it did anything.
    pub(crate) fn hub_turn(&mut self) -> bool {
        let now = self.now;
        let mut busy = false;
        busy |= self.poll_hub();
        let h = self.hub();
        // Its application hands back what it holds beyond each slot's bound.
        let mut back = 0;
        for (s, slot) in h.table.slots.iter_mut().enumerate() {
            let Some(slot) = slot else { continue };
            while slot.app.held > slot.app.hold {
                slot.app.held -= 1;
                back += 1;
                let at = h.held_order.iter().position(|&x| x == s).expect("held");
                h.held_order.remove(at);
            }
        }
        h.held -= back;
        h.free += back;
        busy |= back > 0;
        // Deadlines of the cores.
        let due: Vec<usize> = (0..self.hub().table.slots.len())
            .filter(|&s| {
                self.hub.as_ref().expect("a hub").table.slots[s]
                    .as_ref()
                    .and_then(|x| x.core.next_timeout())
                    .is_some_and(|at| at <= now)
            })
            .collect();
        for s in due {
            if self.hub().table.slots[s].is_some() {
                busy |= drive::fire_timers(&mut self.queues(End::Hub(s)), now);
            }
        }
        busy |= self.retire_drained();
        // Every free buffer goes back to the SRQ, the share hands it out.
        let h = self.hub();
        if h.free > 0 {
            h.srq_posted += h.free;
            let n = std::mem::take(&mut h.free);
            h.share.on_posted(n, &mut h.table.slots, &mut h.touched);
            busy = true;
        }
        if now.duration_since(h.last_tick) >= Duration::from_secs(1) {
            h.last_tick = now;
            h.share.tick(&mut h.table.slots, &mut h.touched);
        }
        // Grants where the books changed.
        let touched: Vec<usize> = std::mem::take(&mut self.hub().touched);
        for s in touched {
            let h = self.hub();
            let Some(slot) = h.table.slots[s].as_mut() else {
                continue;
            };
            slot.touched = false;
            let room = slot.room();
            let books = slot.core.credits();
            if books.grant_needs_slots() && books.grant_due().is_some() && !self.hub_wake_slots(s) {
                continue;
            }
            busy |= drive::grant(&mut self.queues(End::Hub(s)), room)
                .expect("simulated posts do not fail");
        }
        for s in 0..self.hub().table.slots.len() {
            busy |= self.app_send(End::Hub(s));
        }
        let h = self.hub();
        let blocked =
            h.table.slots.iter().flatten().any(|s| {
                s.app.backlog > 0 && s.core.failure().is_none() && !s.core.may_send(s.room())
            });
        // As `RawHub::arm`: the send CQ for any completion while any send is outstanding.
        let outstanding = h
            .table
            .slots
            .iter()
            .flatten()
            .any(|s| !s.sq.posted.is_empty());
        let send_arm = if outstanding {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        };
        let (recv, send) = drive::arm_modes(blocked, ArmMode::SolicitedOnly, send_arm);
        h.recv_cq.arm = Some(recv);
        h.send_cq.arm = Some(send);
        h.recv_cq.fired = false;
        h.send_cq.fired = false;
        h.asleep = h.recv_cq.entries.is_empty() && h.send_cq.entries.is_empty();
        self.check_hub();
        busy
    }

    /// Backs the dormant grant slots of `s` before it sends, as `RawHub::wake_slots`: from
    /// spare, else the pool grows at once and the new buffers back them first.
    pub(super) fn hub_wake_slots(&mut self, s: usize) -> bool {
        let h = self.hub();
        if !h.table.slots[s].as_ref().is_some_and(|x| x.admitted) {
            return false;
        }
        if h.share.wake_slots(s, &mut h.table.slots, &mut h.touched) {
            return true;
        }
        let wanted = h.share.take_slot_demand();
        h.total += wanted;
        h.srq_posted += wanted;
        h.share
            .on_posted(wanted, &mut h.table.slots, &mut h.touched);
        h.table.slots[s]
            .as_ref()
            .is_some_and(|x| x.core.credits().slots_ready())
    }

    pub(super) fn poll_hub(&mut self) -> bool {
        let h = self.hub();
        let mut batch: Vec<Cqe> = h.recv_cq.entries.drain(..).collect();
        batch.extend(h.send_cq.entries.drain(..));
        if batch.is_empty() {
            return false;
        }
        for e in &batch {
            if !matches!(e.c.status, WcStatus::Success | WcStatus::WrFlushErr) {
                if let Some(slot) = self.hub().table.slots[e.qp].as_mut() {
                    slot.core.begin_batch([e.c]);
                }
                self.do_commands(End::Hub(e.qp));
            }
        }
        for e in batch {
            let h = self.hub();
            let Some(slot) = h.table.slots[e.qp].as_mut() else {
                if e.c.recv {
                    h.share.on_stray();
                    h.free += 1;
                }
                continue;
            };
            if !e.c.recv {
                slot.sq.retire(e.wr_id);
                slot.core.handle_send(&e.c, e.wr_id);
            }
            let mut q = self.queues(End::Hub(e.qp));
            if e.c.recv {
                drive::on_recv(&mut q, &e.c, e.seq, 0);
            }
            let h = q.net.hub();
            let slot = h.table.slots[e.qp].as_mut().expect("live");
            if !std::mem::replace(&mut slot.touched, true) {
                h.touched.push(e.qp);
            }
            drive::run_commands(&mut q);
        }
        true
    }

    /// Failed slots whose sends came back are destroyed, then released with their event.
    pub(super) fn retire_drained(&mut self) -> bool {
        let mut busy = false;
        let n = self.hub().table.slots.len();
        let now = self.now;
        for s in 0..n {
            let h = self.hub();
            let Some(slot) = h.table.slots[s].as_mut() else {
                continue;
            };
            if slot.core.failure().is_none() {
                continue;
            }
            if !drive::drained(&mut self.queues(End::Hub(s)), now) {
                continue;
            }
            let h = self.hub();
            let slot = h.table.slots[s].as_mut().expect("live");
            let failure = slot.core.failure().expect("failed");
            // Its messages still held by the application come back with it.
            h.held -= slot.app.held;
            h.free += slot.app.held;
            slot.app.held = 0;
            h.held_order.retain(|&x| x != s);
            if slot.admitted {
                h.share.release(s, &mut h.table.slots, &mut h.touched);
            }
            h.table.remove(s);
            h.ended.push((s, failure));
            // Its queue pair is gone (a later connection may take the slot): its wire's end
            // becomes a tombstone, so that what the peer still sends fails at the peer.
            for (k, w) in self.wires.iter_mut().enumerate() {
                for end in [&mut w.a, &mut w.b] {
                    if *end == End::Hub(s) {
                        *end = End::Gone(k);
                    }
                }
            }
            busy = true;
        }
        busy
    }

    pub(super) fn check_hub(&self) {
        let Some(h) = &self.hub else { return };
        let polled_not = h.recv_cq.entries.len() as u32;
        assert_eq!(
            h.share.posted(),
            h.srq_posted + polled_not,
            "the share counts what is posted (and taken, not yet polled)"
        );
        assert_eq!(
            h.srq_posted + polled_not + h.free + h.held,
            h.total,
            "the hub's buffers"
        );
        if let Err(e) = h.share.audit(&h.table.slots) {
            panic!("{e}");
        }
    }

    /// The hub's application handles the `n` oldest messages it holds, whoever sent them.
    pub(crate) fn hub_consume(&mut self, n: u32) {
        let h = self.hub();
        for _ in 0..n {
            let Some(s) = h.held_order.pop_front() else {
                break;
            };
            h.table.slots[s].as_mut().expect("a live slot").app.held -= 1;
            h.held -= 1;
            h.free += 1;
        }
        h.asleep = false;
    }
}
