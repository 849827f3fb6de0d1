//! Polled completions go to the core of the connection whose queue pair they name, and the
//! hub does what the cores then ask for.

use std::os::fd::AsFd;
use std::time::Instant;

use rdmsg_verbs::{WcStatus, WorkCompletion};

use super::slots::Phase;
use super::{RawHub, RawHubEvent};
use crate::core::{Action, Completion, RecvAction};
use crate::error::Error;
use crate::read;
use crate::send;
use crate::share::Receipt;

impl RawHub {
    pub(super) fn handle_completions(&mut self) {
        let mut got = std::mem::take(&mut self.completions);
        let send_key = self.send_key;
        // The first real error of each connection is recorded before its flushes are looked at.
        for (key, wc) in &got {
            if matches!(wc.status(), WcStatus::Success | WcStatus::WrFlushErr) {
                continue;
            }
            if let Some(&slot) = self.by_qpn.get(&wc.qp_num()) {
                let c = Completion::of(*key != send_key, wc);
                self.slot_mut(slot).core.begin_batch([c]);
                self.do_actions(slot);
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
        let Some(&slot) = self.by_qpn.get(&wc.qp_num()) else {
            // A queue pair already released: nothing of it is accounted any more.
            g.share.on_stray();
            self.pool.put_back(buf);
            return;
        };
        let c = Completion::of(true, wc);
        let s = self.slots[slot].as_mut().expect("a mapped slot");
        if let Phase::CmHandshake(p) = &mut s.phase {
            // An accepted client's first message before its ESTABLISHED: tell the CM.
            p.peer_sent();
        }
        // SRQ receives are not flushed by a queue pair's error: nothing to explain.
        let receipt = s.core.handle_recv(&c, || None, Instant::now);
        // A close message sets a deadline (the goodbye is waited for until then).
        let failed = s.core.failure().is_some();
        let share_receipt = match receipt.action {
            RecvAction::Grant => Receipt::Grant,
            // A close message spends a data credit too.
            _ if receipt.spent_credit => Receipt::Data,
            _ => Receipt::Unaccounted,
        };
        let share = &mut self.groups[group].share;
        if s.admitted && s.group == Some(group) {
            share.on_consumed(slot, s, share_receipt, &mut self.touched);
            // The peer may have returned all it could: its grant slots may sleep.
            share.park_slots(slot, &mut self.slots, &mut self.touched);
        } else {
            share.on_stray();
        }
        match receipt.action {
            RecvAction::Deliver => {
                self.stats.received += 1;
                let msg = self.pool.lend(buf, wc.byte_len() as usize);
                let s = self.slots[slot].as_mut().expect("a mapped slot");
                if s.announced {
                    let peer = s.id(slot);
                    self.events.push_back(RawHubEvent::Message { peer, msg });
                } else {
                    s.early.push(msg);
                }
            }
            // A grant, or the peer's close (the one recycled message that spent a credit),
            // may carry the peer's note.
            RecvAction::Grant | RecvAction::Recycle => {
                let carries = receipt.action == RecvAction::Grant || receipt.spent_credit;
                if let Some(note) = carries
                    .then(|| send::note_of(buf.as_slice(), wc.byte_len()))
                    .flatten()
                {
                    let s = self.slots[slot].as_mut().expect("a mapped slot");
                    s.core.note_received(note);
                }
                self.pool.put_back(buf);
            }
        }
        self.touch(slot);
        self.do_actions(slot);
        if failed && self.slots[slot].is_some() {
            self.schedule(slot);
        }
    }

    fn on_send(&mut self, wc: &WorkCompletion) {
        let Some(&slot) = self.by_qpn.get(&wc.qp_num()) else {
            return;
        };
        let s = self.slots[slot].as_mut().expect("a mapped slot");
        let Some(qp) = s.qp_mut() else { return };
        let before = qp.send_outstanding();
        let mut reads = Vec::new();
        qp.complete_send_split(wc, &mut self.send.free, &mut reads);
        self.send_cq.follow(before, qp.send_outstanding());
        for (id, _) in &reads {
            if let Some(i) = s.reads.iter().position(|(r, _)| r == id) {
                let (_, wrs) = s.reads.remove(i).expect("found");
                self.read_wrs -= wrs;
                self.peers_reading -= usize::from(s.reads.is_empty());
            }
        }
        if !reads.is_empty() {
            let peer = s.id(slot);
            self.events
                .extend(read::finished(wc, reads).map(|read| RawHubEvent::Read { peer, read }));
        }
        s.core.handle_send(&Completion::of(false, wc), wc.wr_id());
        self.touch(slot);
        self.do_actions(slot);
    }

    /// Does what the core of `slot` asks for.
    pub(super) fn do_actions(&mut self, slot: usize) {
        // A handshake that fails without a queue pair frees its slot at once.
        while let Some(action) = self.slots[slot].as_mut().and_then(|s| s.core.poll_action()) {
            match action {
                Action::SayGoodbye => {
                    if let Some(link) = self.slot_mut(slot).link_mut() {
                        link.control.say_goodbye();
                    }
                }
                Action::UnwatchStream => self.unwatch_stream(slot),
                Action::FailQueuePair => self.fail_queue_pair(slot),
                Action::Probe => {
                    self.probe(slot);
                }
            }
        }
    }

    /// Posts a liveness probe on `slot`, if its send queue and the hub's send CQ have room;
    /// whether it did (without room, the hub's liveness watch asks again, or judges by the
    /// signaled send in flight). A post that fails fails the connection (its core's actions
    /// are the caller's to run).
    pub(super) fn probe(&mut self, slot: usize) -> bool {
        let room = self.room(slot);
        if room.sq == 0 || room.cq == 0 {
            return false;
        }
        let Some(s) = self.slots[slot].as_mut() else {
            return false;
        };
        let Phase::Linked(link) = &mut s.phase else {
            return false;
        };
        let before = link.qp.send_outstanding();
        let posted = link.qp.post_probe();
        self.send_cq.follow(before, link.qp.send_outstanding());
        match posted {
            Ok(id) => {
                s.core.probe_posted(id);
                self.stats.liveness_probes += 1;
                self.follow_unsignaled(slot);
                true
            }
            Err(e) => {
                s.core.handle_failure(crate::error::Failure::Local {
                    op: "posting a liveness probe (ibv_post_send)",
                    errno: crate::error::errno_of(&Error::from(e)),
                });
                false
            }
        }
    }

    /// After a connection's first failure: tells the peer (the end of the bootstrap stream),
    /// moves the queue pair to error so that its sends are flushed back, and queues it to be
    /// retired; a handshake under way fails as a handshake.
    pub(super) fn fail_queue_pair(&mut self, slot: usize) {
        self.unwatch_stream(slot);
        let s = self.slot_mut(slot);
        if s.is_handshaking() {
            let e = s.core.failure().map(Error::from);
            if let Some(e) = e {
                self.handshake_failed(slot, e);
            }
            return;
        }
        let group = s.group.filter(|_| s.admitted);
        let (qpn, id, failure) = (s.qpn.unwrap_or(0), s.id(slot), s.core.failure());
        let Some(link) = s.link_mut() else {
            return;
        };
        crate::trace::ended(qpn, Some(id), failure);
        link.control.shut_down();
        let _ = link.qp.to_error();
        self.start_draining(slot, group);
    }

    /// A failed handshake's queue pair goes to the error state and is drained as a linked
    /// one's (see [`Phase::Failing`]).
    pub(super) fn drain_failed_side(&mut self, slot: usize, mut qp: rdmsg_verbs::QueuePair) {
        let _ = qp.to_error();
        let s = self.slot_mut(slot);
        let group = s.group.filter(|_| s.admitted);
        s.phase = Phase::Failing(qp);
        self.start_draining(slot, group);
    }

    /// `slot`'s queue pair is in the error state from now on: its requests come back flushed,
    /// waited for until its core's drain deadline.
    fn start_draining(&mut self, slot: usize, group: Option<usize>) {
        self.slot_mut(slot).core.flushing_since(Instant::now());
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
        if self.send_cq.room() == 0 {
            return;
        }
        let Some(qp) = self.slots[slot].as_mut().and_then(|s| s.qp_mut()) else {
            return;
        };
        let before = qp.send_outstanding();
        if before == 0 {
            return;
        }
        let _ = qp.post_drain_marker();
        self.send_cq.follow(before, qp.send_outstanding());
    }

    pub(super) fn unwatch_stream(&mut self, slot: usize) {
        let s = self.slots[slot].as_mut().expect("a live slot");
        if let Phase::Linked(link) = &mut s.phase {
            if std::mem::take(&mut link.watched) {
                let _ = self.waiter.channel().watch.remove(link.control.as_fd());
            }
        }
    }
}
