//! Polled completions go to the core of the connection whose queue pair they name, and the
//! hub does what the cores then ask for.

use rdmsg_verbs::{WcStatus, WorkCompletion};

use super::queues::SlotQueues;
use super::slots::Resources;
use super::{RawHub, RawHubEvent};
use crate::core::Completion;
use crate::drive;
use crate::read;

impl RawHub {
    pub(super) fn handle_completions(&mut self) {
        let mut got = std::mem::take(&mut self.completions);
        let send_key = self.send_key;
        // The first real error of each connection is recorded before its flushes are looked at.
        for (key, wc) in &got {
            if matches!(wc.status(), WcStatus::Success | WcStatus::WrFlushErr) {
                continue;
            }
            if let Some(slot) = self.table.slot_of_qp(wc.qp_num()) {
                let c = Completion::of(*key != send_key, wc);
                self.slot_mut(slot).core.begin_batch([c]);
                self.do_commands(slot);
            }
        }
        for (key, wc) in got.drain(..) {
            match self.group_of_key(key) {
                Some(group) => self.on_recv(group, &wc),
                None => self.on_send(&wc),
            }
        }
        self.completions = got;
    }

    fn on_recv(&mut self, group: usize, wc: &WorkCompletion) {
        let g = &mut self.groups[group];
        let Some(buf) = g.srq.take_recv(wc) else {
            return;
        };
        let Some(slot) = self.table.slot_of_qp(wc.qp_num()) else {
            // A queue pair already released: nothing of it is accounted any more.
            g.share.on_stray();
            self.pool.put_back(buf);
            return;
        };
        if let Resources::CmHandshake(p) = &mut self.slot_mut(slot).resources {
            // An accepted client's first message before its ESTABLISHED: tell the CM.
            p.peer_sent();
        }
        let c = Completion::of(true, wc);
        let mut q = SlotQueues {
            hub: self,
            slot,
            recv_group: Some(group),
        };
        drive::on_recv(&mut q, &c, buf, wc.byte_len());
        q.hub.touch(slot);
        drive::run_commands(&mut q);
        // A close message sets a deadline (the goodbye is waited for until then).
        if self.table.slots[slot]
            .as_ref()
            .is_some_and(|s| s.core.failure().is_some())
        {
            self.schedule(slot);
        }
    }

    fn on_send(&mut self, wc: &WorkCompletion) {
        let Some(slot) = self.table.slot_of_qp(wc.qp_num()) else {
            return;
        };
        let s = self.table.slots[slot].as_mut().expect("a mapped slot");
        let Some(qp) = s.qp_mut() else { return };
        let before = qp.send_outstanding();
        let mut reads = Vec::new();
        qp.complete_send_split(wc, &mut self.send.free, &mut reads);
        self.budget.follow(before, qp.send_outstanding());
        for (id, _) in &reads {
            if let Some(i) = s.reads.iter().position(|(r, _)| r == id) {
                let (_, wrs) = s.reads.remove(i).expect("found");
                self.budget.reads_over(wrs, s.reads.is_empty());
            }
        }
        if !reads.is_empty() {
            let peer = s.id(slot);
            self.events
                .extend(read::finished(wc, reads).map(|read| RawHubEvent::Read { peer, read }));
        }
        s.core.handle_send(&Completion::of(false, wc), wc.wr_id());
        self.touch(slot);
        self.do_commands(slot);
    }

    /// Does what the core of `slot` asks for.
    pub(super) fn do_commands(&mut self, slot: usize) {
        drive::run_commands(&mut self.queues(slot));
    }

    /// Posts a liveness probe on `slot`, if its send queue and the hub's send CQ have room;
    /// whether it did (see [`drive::probe`]; without room, the hub's liveness watch asks
    /// again, or judges by the signaled send in flight).
    pub(super) fn probe(&mut self, slot: usize) -> bool {
        drive::probe(&mut self.queues(slot))
    }

    /// A failed handshake's queue pair goes to the error state and is drained as a linked
    /// one's (see [`Resources::Failing`]).
    pub(super) fn drain_failed_side(&mut self, slot: usize, mut qp: rdmsg_verbs::QueuePair) {
        let _ = qp.to_error();
        self.slot_mut(slot).resources = Resources::Failing(qp);
        let now = self.clock.now();
        self.slot_mut(slot).core.flushing_since(now);
        self.start_draining(slot);
    }

    /// `slot`'s queue pair is in the error state from now on: its requests come back flushed,
    /// waited for until its core's drain deadline.
    pub(super) fn start_draining(&mut self, slot: usize) {
        let s = self.slot(slot);
        let group = s.group.filter(|_| s.admitted);
        self.post_drain_marker(slot);
        if let Some(group) = group {
            // Its buffers stop being refilled; what backs it comes back at release.
            self.groups[group].share.retire(slot);
        }
        self.draining.push(slot);
        self.schedule(slot);
    }

    /// Posts a drain marker behind `slot`'s outstanding requests (its queue pair just went
    /// to the error state), so that its flushed completion retires them all. Without it a
    /// send left unsignaled that the peer had acknowledged (a rendezvous descriptor, say,
    /// before a peer that then died) produces no completion, flushed or not: nothing would
    /// retire it, and the connection's end waited out the whole drain deadline (500 ms)
    /// instead of the moment the flushes came. Only with room in the shared send CQ for its
    /// completion; refused, the deadline ends the wait as before.
    fn post_drain_marker(&mut self, slot: usize) {
        if self.budget.cq_free() == 0 {
            return;
        }
        let Some(qp) = self.table.slots[slot].as_mut().and_then(|s| s.qp_mut()) else {
            return;
        };
        let before = qp.send_outstanding();
        if before == 0 {
            return;
        }
        let _ = qp.post_drain_marker();
        self.budget.follow(before, qp.send_outstanding());
    }
}
