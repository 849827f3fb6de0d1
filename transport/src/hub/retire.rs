//! Deadlines, failures, and the end of a connection: drained, destroyed, polled once more,
//! then released with its [`RawHubEvent::Disconnected`].

use std::cmp::Reverse;
use std::time::Instant;

use rdmsg_verbs::{AsyncElement, AsyncEventKind};

use super::slots::Resources;
use super::{PeerId, RawHub, RawHubEvent};
use crate::device_events;
use crate::drive;
use crate::error::{errno_of, Error, Failure, Result};

impl RawHub {
    /// The deadline of `slot`: its handshake's, or its core's.
    pub(super) fn deadline_of(&self, slot: usize) -> Option<Instant> {
        let s = self.table.slots.get(slot)?.as_ref()?;
        match &s.resources {
            Resources::Handshake(p) => Some(p.deadline),
            Resources::CmHandshake(p) => Some(p.hs.deadline()),
            Resources::Linked(_) | Resources::Failing(_) => s.core.next_timeout(),
            Resources::Retired => None,
        }
    }

    /// Makes sure `slot` wakes the hub at its deadline, if it has one (a handshake's, or one
    /// of its core's): call whenever one may have been set or brought forward.
    pub(super) fn schedule(&mut self, slot: usize) {
        let Some(deadline) = self.deadline_of(slot) else {
            return;
        };
        let s = self.slot_mut(slot);
        if s.timer_at.is_some_and(|t| t <= deadline) {
            return;
        }
        s.timer_at = Some(deadline);
        self.timers.push(Reverse((deadline, slot)));
    }

    /// Handshakes past their deadline fail; the cores of the others are told the time. Only
    /// the deadlines that passed are visited.
    pub(super) fn fire_deadlines(&mut self, now: Instant) {
        if self.sessions.deadline().is_some_and(|at| at <= now) {
            self.expire_sessions(now);
        }
        while let Some(&Reverse((at, slot))) = self.timers.peek() {
            if at > now {
                return;
            }
            self.timers.pop();
            // An entry whose slot was released, or replaced by a nearer one, is stale.
            let Some(s) = self.table.slots.get_mut(slot).and_then(Option::as_mut) else {
                continue;
            };
            if s.timer_at != Some(at) {
                continue;
            }
            s.timer_at = None;
            let Some(deadline) = self.deadline_of(slot) else {
                continue;
            };
            if deadline <= now {
                match &self.slot(slot).resources {
                    Resources::Handshake(p) => {
                        let e = p.timed_out();
                        self.handshake_failed(slot, e);
                        continue;
                    }
                    Resources::CmHandshake(p) => {
                        let e = p.timed_out(self.config.conn.handshake_timeout);
                        self.handshake_failed(slot, e);
                        continue;
                    }
                    _ => {}
                }
                drive::fire_timers(&mut self.queues(slot), now);
            }
            // Another deadline of its core may still be ahead (or this one moved later).
            if self.table.slots[slot].is_some() {
                self.schedule(slot);
            }
        }
    }

    /// Fails one connection (the first failure is kept).
    pub(super) fn fail(&mut self, slot: usize, f: Failure) {
        drive::fail(&mut self.queues(slot), f);
    }

    /// Destroys the queue pairs of failed connections once their sends came back (or the
    /// drain deadline passed), taking back every send buffer; the next poll of the CQs sees
    /// anything of theirs still queued, after which they are released.
    pub(super) fn retire_drained(&mut self) -> Result<()> {
        // Queue pairs destroyed since the last poll (a failed handshake's) are released after
        // the poll below, like those retired here.
        let mut destroyed = !self.retired.is_empty();
        if self.draining.is_empty() && !destroyed {
            return Ok(());
        }
        let now = self.clock.now();
        // Compacted in place: the slots still waiting stay, the list keeps its allocation.
        let mut draining = std::mem::take(&mut self.draining);
        let mut kept = 0;
        for i in 0..draining.len() {
            let slot = draining[i];
            let phase = &self.slot(slot).resources;
            if !matches!(phase, Resources::Linked(_) | Resources::Failing(_)) {
                continue;
            }
            if !drive::drained(&mut self.queues(slot), now) {
                // Its drain deadline may have come nearer (the last-WQE wait).
                self.schedule(slot);
                draining[kept] = slot;
                kept += 1;
                continue;
            }
            let s = self.table.slots[slot].as_mut().expect("a draining slot");
            let qp = match std::mem::replace(&mut s.resources, Resources::Retired) {
                Resources::Linked(link) => link.qp,
                Resources::Failing(qp) => qp,
                _ => unreachable!("matched above"),
            };
            // Destroyed or not (a failed destruction leaks them with the queue pair), its
            // sends no longer count.
            self.budget.follow(qp.send_outstanding(), 0);
            if !s.reads.is_empty() {
                let wrs = s.reads.drain(..).map(|(_, n)| n).sum();
                self.budget.reads_over(wrs, true);
            }
            self.stats.queue_pairs_drained += 1;
            if let Ok(bufs) = qp.destroy() {
                self.send.free.extend(bufs);
            }
            destroyed = true;
            self.retired.push(slot);
        }
        draining.truncate(kept);
        // Nothing here starts a drain, but one that did would join the list, not be lost.
        draining.append(&mut self.draining);
        self.draining = draining;
        if destroyed {
            // Whatever of theirs was still queued is handled now, before they are released.
            self.poll_now()?;
            for slot in std::mem::take(&mut self.retired) {
                self.release(slot);
            }
        }
        Ok(())
    }

    /// A retired connection: its share of the buffers goes back, it is reported gone, its slot
    /// is free.
    fn release(&mut self, slot: usize) {
        if self.table.slots[slot].is_none() {
            return;
        }
        self.forget_queue_pair(slot);
        let Some(s) = self.table.slots[slot].as_mut() else {
            return;
        };
        let announced = s.announced;
        let peer = s.id(slot);
        let c = s.core.stats();
        self.stats.forced_solicited += c.forced_solicited;
        self.stats.credit_waits += c.credit_waits;
        self.stats.credit_stalls += c.credit_stalls;
        let failure = s.core.failure().unwrap_or(Failure::QpError);
        let last_note = s.core.peer_note();
        let (session, generation) = (s.session, s.generation);
        self.unadmit(slot);
        // A resumable session's connection: suspended (nothing more to report), or ended.
        let ended = match session {
            Some(token) if announced => self.session_released(token, slot, failure, last_note),
            Some(token) => {
                self.unannounced_released(token, slot, generation);
                Some(failure)
            }
            None => Some(failure),
        };
        if let Some(failure) = ended.filter(|_| announced) {
            self.report_disconnected(peer, failure, last_note);
        }
        self.table.remove(slot);
    }

    /// `peer` ended with `failure`: counted, traced, and reported ([`RawHubEvent::Disconnected`]).
    pub(super) fn report_disconnected(
        &mut self,
        peer: PeerId,
        failure: Failure,
        last_note: Option<u32>,
    ) {
        crate::trace::disconnected(peer, failure);
        self.stats.disconnected += 1;
        self.events.push_back(RawHubEvent::Disconnected {
            peer,
            failure,
            last_note,
        });
    }

    /// Routes the device's asynchronous events; those of our queue pairs fail them, those of
    /// the hub's queues (or the device, or the port) fail everything.
    pub(super) fn async_events(&mut self) {
        if let Err(e) = self.endpoint.route_async_events() {
            let _ = self.hub_failure(e);
            return;
        }
        for ev in self.mailbox.take() {
            if let (AsyncEventKind::QpLastWqeReached, AsyncElement::Qp(n)) = (ev.kind, ev.element) {
                if let Some(slot) = self.table.slot_of_qp(n) {
                    self.slot_mut(slot).core.last_wqe_reached();
                    self.stats.last_wqe_events += 1;
                }
                continue;
            }
            if !device_events::is_fatal(ev.kind) {
                continue;
            }
            let f = Failure::AsyncEvent(ev.kind);
            match ev.element {
                AsyncElement::Qp(n) => {
                    if let Some(slot) = self.table.slot_of_qp(n) {
                        self.fail(slot, f);
                    }
                }
                _ => {
                    let _ = self.hub_failure(Error::Connection(f));
                }
            }
        }
    }

    /// A failure of the hub's own queues or channel: every connection fails with it.
    pub(super) fn hub_failure(&mut self, e: Error) -> Error {
        let f = match &e {
            Error::Connection(f) => *f,
            other => Failure::Local {
                op: "driving the hub's queues",
                errno: errno_of(other),
            },
        };
        if self.fatal.is_none() {
            crate::trace::hub_failed(f);
            self.fatal = Some(f);
            for slot in 0..self.table.slots.len() {
                if self.table.slots[slot].is_some() {
                    self.fail(slot, f);
                }
            }
            self.sessions_failed(f);
        }
        e
    }
}
