//! A connection of the simulated network, driven as [`crate::Connection`] drives its core.

use std::time::Duration;

use rdmsg_notify::ArmMode;
use rdmsg_verbs::WcStatus;

use super::*;
use crate::core::{Core, Room, StreamNews};
use crate::credits::Credits;
use crate::drive;

/// A connection driven like [`crate::Connection`].
#[derive(Debug)]
pub(crate) struct SimConn {
    pub core: Core,
    pub app: App,
    pub(super) recv_posted: u32,
    /// Receive buffers free and not posted.
    pub(super) free: u32,
    pub(super) total_bufs: u32,
    pub(super) sq_depth: usize,
    pub(super) sq: SendQueue,
    pub(super) recv_cq: Cq,
    pub(super) send_cq: Cq,
    pub(super) asleep: bool,
    /// The other end's stream ended or said goodbye: news for the next turn.
    pub(super) stream_news: Option<StreamNews>,
    /// Its bootstrap stream is shut (it said so to the peer).
    pub(super) stream_shut: bool,
    /// The process is gone: it does nothing any more.
    pub(super) dead: bool,
    pub(super) next_wr: u64,
    /// Send completions polled with an error status (flushes included).
    pub(super) sends_failed: usize,
    /// An asynchronous event the device reported for it and nobody has read yet.
    pub(super) pending_event: Option<Failure>,
}

impl SimConn {
    pub(super) fn new(
        ours: Shape,
        peer_depth: u32,
        peer_slots: u8,
        initial: u32,
        close: Duration,
    ) -> Self {
        let books = Credits::new(ours.depth, ours.slots, peer_depth, peer_slots, initial);
        let total = ours.depth + u32::from(ours.slots);
        Self {
            core: Core::new(books, ours.signal_every, close),
            app: App {
                hold: u32::MAX,
                ..App::default()
            },
            recv_posted: total,
            free: 0,
            total_bufs: total,
            sq_depth: ours.send_depth as usize,
            sq: SendQueue::default(),
            recv_cq: Cq::default(),
            send_cq: Cq::default(),
            asleep: false,
            stream_news: None,
            stream_shut: false,
            dead: false,
            next_wr: 1,
            sends_failed: 0,
            pending_event: None,
        }
    }

    pub(super) fn room(&self) -> Room {
        self.sq.room(self.sq_depth)
    }

    /// Every receive buffer is somewhere: posted, in the CQ, free, or held by the application;
    /// and what is posted (or taken but not yet polled) is what the books need.
    pub(super) fn check(&self) {
        let polled_not = self.recv_cq.entries.len() as u32;
        assert_eq!(
            self.recv_posted + polled_not + self.free + self.app.held,
            self.total_bufs,
            "a connection's receive buffers"
        );
        if self.core.failure().is_none() {
            assert_eq!(
                self.recv_posted + polled_not,
                self.core.credits().must_be_posted(),
                "posted receives match the books"
            );
        }
    }
}

impl Net {
    // ----- a connection's turn -----

    /// One turn of connection `i`, as `Connection::step` and its application do it; returns
    /// whether it did anything.
    pub(crate) fn turn(&mut self, i: usize) -> bool {
        if self.conns[i].dead {
            return false;
        }
        let now = self.now;
        let mut busy = false;
        busy |= self.poll_conn(i);
        // The liveness check reads the events nothing else asked for.
        if let Some(f) = self.conns[i].pending_event.take() {
            drive::fail(&mut self.queues(End::Conn(i)), f);
            busy = true;
        }
        // The application hands back what it holds beyond its bound.
        let c = &mut self.conns[i];
        while c.app.held > c.app.hold {
            c.app.held -= 1;
            c.free += 1;
            busy = true;
        }
        if let Some(news) = self.conns[i].stream_news.take() {
            drive::on_stream(&mut self.queues(End::Conn(i)), news, now);
            busy = true;
        }
        busy |= drive::fire_timers(&mut self.queues(End::Conn(i)), now);
        busy |= self.drain_conn(i);
        busy |= self.repost_and_grant(i);
        busy |= self.app_send(End::Conn(i));
        busy |= self.repost_and_grant(i);
        // Arm; what is already queued fires nothing, so a side with completions waiting stays
        // awake for its next turn (the drivers poll again after arming).
        let c = &mut self.conns[i];
        let blocked = c.app.backlog > 0 && c.core.failure().is_none() && !c.core.may_send(c.room());
        // A sender out of credits arms both queues for any completion, as the drivers do:
        // grants sent before the peer saw us exhausted are not solicited.
        let draining = c.core.failure().is_some() && !c.core.lingering() && !c.core.is_drained();
        let (recv, send) = drive::arm_modes(
            drive::wakes_for_any(&c.core, blocked, draining),
            ArmMode::SolicitedOnly,
            c.core.send_arm(),
        );
        c.recv_cq.arm = Some(recv);
        c.send_cq.arm = Some(send);
        c.recv_cq.fired = false;
        c.send_cq.fired = false;
        let pending = !c.recv_cq.entries.is_empty() || !c.send_cq.entries.is_empty();
        c.asleep = !pending;
        c.check();
        busy
    }

    pub(super) fn poll_conn(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        let mut batch: Vec<Cqe> = c.recv_cq.entries.drain(..).collect();
        batch.extend(c.send_cq.entries.drain(..));
        if batch.is_empty() {
            return false;
        }
        c.core.begin_batch(batch.iter().map(|e| e.c));
        for e in batch {
            let mut q = self.queues(End::Conn(i));
            if e.c.recv {
                drive::on_recv(&mut q, &e.c, e.seq, 0);
            } else {
                // The requests (and send buffers) this completion covers come back.
                let c = &mut q.net.conns[i];
                c.sq.retire(e.wr_id);
                c.sends_failed += usize::from(e.c.status != WcStatus::Success);
                c.core.handle_send(&e.c, e.wr_id);
            }
            drive::run_commands(&mut q);
        }
        true
    }

    /// After a failure, the connection waits for its receives' flushes (bounded by the core).
    pub(super) fn drain_conn(&mut self, i: usize) -> bool {
        let c = &self.conns[i];
        if c.core.failure().is_none() || c.core.is_drained() {
            return false;
        }
        let now = self.now;
        drive::drained(&mut self.queues(End::Conn(i)), now);
        true
    }

    pub(super) fn repost_and_grant(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        let mut busy = false;
        if c.core.refill_due(c.free as usize) {
            c.recv_posted += c.free;
            c.core.reposted(c.free);
            c.free = 0;
            busy = true;
        }
        let room = self.conns[i].room();
        busy |= drive::grant(&mut self.queues(End::Conn(i)), room)
            .expect("simulated posts do not fail");
        busy
    }

    /// The application of `end` sends what its credits allow.
    pub(super) fn app_send(&mut self, end: End) -> bool {
        let mut busy = false;
        loop {
            let (app, core, room) = match end {
                End::Conn(i) => {
                    let c = &mut self.conns[i];
                    let room = c.room();
                    (&mut c.app, &mut c.core, room)
                }
                End::Hub(s) => {
                    let Some(slot) = self.hub.as_ref().expect("a hub").table.slots[s].as_ref()
                    else {
                        return busy;
                    };
                    // As `RawHub::wait_to_send`: its grant slots are backed before it sends.
                    if slot.app.backlog > 0 {
                        self.hub_wake_slots(s);
                    }
                    let h = self.hub.as_mut().expect("a hub");
                    let slot = h.table.slots[s].as_mut().expect("live");
                    let room = slot.room();
                    (&mut slot.app, &mut slot.core, room)
                }
                End::Gone(_) => return busy,
            };
            if app.backlog == 0 || !core.may_send(room) {
                return busy;
            }
            let seq = app.sent;
            let solicited =
                app.solicit_every > 0 && (seq + 1) % app.solicit_every == 0 || app.backlog == 1;
            app.sent += 1;
            app.backlog -= 1;
            drive::send_data(&mut self.queues(end), solicited, false, Some(seq))
                .expect("simulated posts do not fail");
            busy = true;
        }
    }
}
