//! A deterministic simulator of RC queue pairs, for testing the real protocol [`Core`] on a
//! host without RDMA (tests only).
//!
//! The network holds *connections* (each driven like a [`Connection`](crate::Connection): its
//! own receive queue, send queue and completion queues) and at most one *hub* (many cores over
//! one shared receive queue and shared CQs, its buffers lent by the real
//! [`Share`], driven like a [`RawHub`](crate::RawHub)). Links join two ends in order. Time is
//! simulated. The verbs rules the simulated device keeps:
//!
//! - messages on one link arrive in order, each consuming a posted receive; one that finds none
//!   is a receiver-not-ready (counted: the credit protocol promises none);
//! - a send's completion comes once the peer took it; unsignaled sends retire silently with a
//!   later signaled one, in order;
//! - a queue pair in the error state flushes every posted request with `WrFlushErr` (a shared
//!   receive queue's buffers stay posted); a message sent to it (or to a dead peer) completes
//!   with `RetryExcErr` at the sender, or, on a network that retries for ever
//!   ([`Net::retry_for_ever`]: rxe with `retry_cnt` 7), never completes;
//! - a completion queue armed solicited-only fires for a solicited receive or an error, one
//!   armed for the next completion for any, each arm once; completions queued before the arm
//!   fire nothing (the driver polls after arming, as the real ones do).
//!
//! Drivers follow the core's manual: inputs, then every action; they sleep only when the
//! core and their queues leave nothing to do, and wake only when an arm fires, a deadline of
//! the core passes, or their application hands a buffer back. Faults are injected by tests:
//! a peer that dies (its queue pair fails and its stream ends), one that stops granting
//! (its application holds every buffer), a CQ overrun (an asynchronous event), and the
//! schedule itself reorders completions across queue pairs. [`Net::drive`] runs until
//! nothing is left to do and fails a run that never gets there.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmsg_notify::ArmMode;
use rdmsg_verbs::WcStatus;

use crate::core::{Core, StreamNews};
use crate::credits::Credits;
use crate::drive::{self, Queues};
use crate::error::Failure;
use crate::hub::table::SlotTable;
use crate::share::{Share, ShareConfig};

mod conn;
mod device;
mod hub;
mod queues;
#[cfg(test)]
mod tests;

pub(crate) use conn::SimConn;
use device::{Cq, Cqe, Packet, SendQueue};
pub(crate) use hub::{HubSlot, SimHub};

/// One end of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A connection, by index.
    Conn(usize),
    /// A slot of the hub.
    Hub(usize),
    /// The end of wire `n` whose queue pair is gone (a released hub slot, whose index a later
    /// connection may take): what is sent to it fails at the sender.
    Gone(usize),
}

/// What a simulated application does with one connection.
#[derive(Debug, Default)]
pub(crate) struct App {
    /// Messages it still wants to send.
    pub backlog: u64,
    /// Sequence numbers sent so far.
    pub sent: u64,
    /// Sequence numbers received, in order of arrival.
    pub received: Vec<u64>,
    /// Received buffers it holds.
    pub held: u32,
    /// Most buffers it holds before handing one back on its own (`u32::MAX`: only when told).
    pub hold: u32,
    /// Every how many messages one is solicited (the last of a batch); 0: never asked.
    pub solicit_every: u64,
}

/// How a simulated connection is shaped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Receive buffers for data (its announced depth and initial credits).
    pub depth: u32,
    /// Grant slots.
    pub slots: u8,
    /// Send queue depth (a send buffer per slot).
    pub send_depth: u32,
    /// A signaled send every this many.
    pub signal_every: u32,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            depth: 8,
            slots: 3,
            send_depth: 8,
            signal_every: 4,
        }
    }
}

/// A link between two ends, with what is on the wire each way.
#[derive(Debug)]
struct Wire {
    a: End,
    b: End,
    a_to_b: VecDeque<Packet>,
    b_to_a: VecDeque<Packet>,
}

/// The simulated network.
#[derive(Debug)]
pub(crate) struct Net {
    pub now: Instant,
    pub conns: Vec<SimConn>,
    pub hub: Option<SimHub>,
    wires: Vec<Wire>,
    /// Receiver-not-ready events: a message that found no posted receive.
    pub rnr: u64,
    close_timeout: Duration,
    /// A message that no queue pair takes is retried for ever (see [`Net::retry_for_ever`]).
    endless_retries: bool,
    /// Liveness probes posted, all ends.
    pub probes: u64,
}

impl Net {
    pub(crate) fn new(close_timeout: Duration) -> Self {
        Self {
            now: Instant::now(),
            conns: Vec::new(),
            hub: None,
            wires: Vec::new(),
            rnr: 0,
            close_timeout,
            endless_retries: false,
            probes: 0,
        }
    }

    /// From now on a message to a dead peer, or to a queue pair in the error state, is never
    /// acknowledged and its sender's device never gives up on it, as rxe with `retry_cnt` 7
    /// (the default): the request stays posted until the sender's own queue pair fails.
    pub(crate) fn retry_for_ever(&mut self) {
        self.endless_retries = true;
    }

    /// Two connections linked to each other: (a, b).
    pub(crate) fn pair(&mut self, a: Shape, b: Shape) -> (usize, usize) {
        let ia = self.conns.len();
        let ct = self.close_timeout;
        self.conns
            .push(SimConn::new(a, b.depth, b.slots, b.depth, ct));
        self.conns
            .push(SimConn::new(b, a.depth, a.slots, a.depth, ct));
        self.wires.push(Wire {
            a: End::Conn(ia),
            b: End::Conn(ia + 1),
            a_to_b: VecDeque::new(),
            b_to_a: VecDeque::new(),
        });
        (ia, ia + 1)
    }

    /// A hub whose share lends `shared` spare buffers beyond its connections' minimums.
    pub(crate) fn with_hub(&mut self, cfg: ShareConfig, shared: u32) {
        let mut share = Share::new(cfg).expect("a valid share");
        let mut table = SlotTable::new(usize::MAX);
        let mut touched = Vec::new();
        share.on_posted(shared, &mut table.slots, &mut touched);
        self.hub = Some(SimHub {
            share,
            table,
            srq_posted: shared,
            free: 0,
            total: shared,
            recv_cq: Cq::default(),
            send_cq: Cq::default(),
            touched,
            asleep: false,
            last_tick: self.now,
            ended: Vec::new(),
            shared,
            held: 0,
            held_order: VecDeque::new(),
            next_wr: 1 << 40,
        });
    }

    /// A peer shaped `peer` joins the hub (the pool grows by what admission needs, as the
    /// hub's does); returns (hub slot, peer's connection).
    pub(crate) fn join_hub(&mut self, peer: Shape) -> (usize, usize) {
        let ct = self.close_timeout;
        let hub = self.hub.as_mut().expect("a hub");
        let cfg = hub.share.config();
        let books = Credits::shared(
            cfg.max_credits,
            cfg.grant_slots,
            peer.depth,
            peer.slots,
            peer.depth,
            cfg.min_credits,
        );
        // As the hub does: the slot from its table first (a freed one reused), then its
        // admission, in which `shared` buffers stay spare beyond everyone's minimum.
        let slot = hub
            .table
            .insert(|generation| HubSlot {
                core: Core::new(books, peer.signal_every, ct),
                app: App {
                    hold: u32::MAX,
                    ..App::default()
                },
                admitted: false,
                sq: SendQueue::default(),
                sq_depth: 8,
                touched: false,
                generation,
            })
            .expect("the simulated hub takes any number");
        let cost = cfg.admission_cost();
        let short = (cost + hub.shared).saturating_sub(hub.share.spare());
        if short == 0 {
            hub.share.admit(slot).expect("spare covers it");
        } else {
            hub.total += short;
            hub.srq_posted += short;
            hub.share
                .admit_posted(slot, short, &mut hub.table.slots, &mut hub.touched)
                .expect("grown by what was short");
        }
        hub.table.slots[slot]
            .as_mut()
            .expect("inserted above")
            .admitted = true;
        let c = self.conns.len();
        self.conns.push(SimConn::new(
            peer,
            cfg.max_credits,
            cfg.grant_slots,
            cfg.min_credits,
            ct,
        ));
        self.wires.push(Wire {
            a: End::Hub(slot),
            b: End::Conn(c),
            a_to_b: VecDeque::new(),
            b_to_a: VecDeque::new(),
        });
        (slot, c)
    }

    pub(crate) fn hub(&mut self) -> &mut SimHub {
        self.hub.as_mut().expect("a hub")
    }

    fn wire_of(&self, end: End) -> Option<usize> {
        self.wires.iter().position(|l| l.a == end || l.b == end)
    }

    fn peer_of(&self, end: End) -> Option<End> {
        let l = &self.wires[self.wire_of(end)?];
        Some(if l.a == end { l.b } else { l.a })
    }

    fn wire_from(&mut self, end: End) -> Option<&mut VecDeque<Packet>> {
        let i = self.wire_of(end)?;
        let l = &mut self.wires[i];
        Some(if l.a == end {
            &mut l.a_to_b
        } else {
            &mut l.b_to_a
        })
    }

    /// Does what the core of `end` asks for.
    fn do_commands(&mut self, end: End) {
        if !matches!(end, End::Gone(_)) {
            drive::run_commands(&mut self.queues(end));
        }
    }

    /// The bootstrap stream of `to` brings `news` (first news only: it is unwatched after).
    pub(crate) fn tell_stream(&mut self, to: Option<End>, news: StreamNews) {
        match to {
            Some(End::Conn(i)) => {
                let c = &mut self.conns[i];
                if c.stream_news.is_none() {
                    c.stream_news = Some(news);
                    c.asleep = false;
                }
            }
            Some(End::Gone(_)) | None => {}
            Some(End::Hub(s)) => {
                let now = self.now;
                let h = self.hub();
                h.asleep = false;
                if h.table.slots[s].is_some() {
                    drive::on_stream(&mut self.queues(End::Hub(s)), news, now);
                }
            }
        }
    }

    // ----- faults -----

    /// Connection `i`'s process dies: its queue pair stops answering, its stream ends.
    pub(crate) fn kill(&mut self, i: usize) {
        self.conns[i].dead = true;
        let peer = self.peer_of(End::Conn(i));
        self.tell_stream(peer, StreamNews::Ended);
        if let Some(w) = self.wire_from(End::Conn(i)) {
            w.clear();
        }
    }

    /// Connection `i`'s host stops answering: nothing it sent arrives any more and its stream
    /// says nothing (until keepalive would give up).
    pub(crate) fn crash(&mut self, i: usize) {
        self.conns[i].dead = true;
        if let Some(w) = self.wire_from(End::Conn(i)) {
            w.clear();
        }
    }

    /// Connection `i` posts an RDMA read of `segments` pieces, as `Connection::post_read` does;
    /// whether it could (`false`: no room now, or [`crate::Error::ReadTooLarge`] never).
    pub(crate) fn post_read(&mut self, i: usize, segments: usize) -> Result<bool, crate::Error> {
        let c = &mut self.conns[i];
        c.core.check_send()?;
        c.core.read_fits(segments, c.sq_depth)?;
        if c.room().sq < segments {
            return Ok(false);
        }
        for k in 0..segments {
            // Only the last piece is signaled: its completion covers the others.
            let wr_id = self.post_read_request(End::Conn(i), k + 1 == segments);
            if k + 1 == segments {
                self.conns[i].core.posted(wr_id, true);
            }
        }
        Ok(true)
    }

    /// Send completions of connection `i` polled with an error (flushes included).
    pub(crate) fn send_failures(&self, i: usize) -> usize {
        self.conns[i].sends_failed
    }

    /// Connection `i`'s receive CQ overruns: the device reports an asynchronous event (not
    /// yet read) and the queue pair breaks, flushing its receives; the flushes are explained
    /// by the event, as `Connection` asks the event router when nothing else explains them.
    pub(crate) fn overrun(&mut self, i: usize) {
        self.conns[i].pending_event = Some(Failure::AsyncEvent(rdmsg_verbs::AsyncEventKind::CqErr));
        self.break_queue_pair(End::Conn(i));
    }

    /// An asynchronous event (a CQ overrun, say) fails `end`.
    pub(crate) fn async_failure(&mut self, end: End, f: Failure) {
        let live = match end {
            End::Conn(_) => true,
            End::Hub(s) => self.hub().table.slots[s].is_some(),
            End::Gone(_) => false,
        };
        if live {
            drive::fail(&mut self.queues(end), f);
        }
    }

    /// Starts a graceful close of connection `i`; whether it could.
    pub(crate) fn close(&mut self, i: usize) -> bool {
        self.close_end(End::Conn(i))
    }

    /// Starts a graceful close of hub slot `s`; whether it could.
    pub(crate) fn close_hub_slot(&mut self, s: usize) -> bool {
        self.hub().table.slots[s].is_some() && self.close_end(End::Hub(s))
    }

    fn close_end(&mut self, end: End) -> bool {
        let now = self.now;
        let mut q = self.queues(end);
        let deadline = q.core().close_deadline(now);
        drive::start_close(&mut q, deadline, now).expect("simulated posts do not fail")
    }

    /// Posts an RDMA read request on `end`'s queue pair (a probe is a zero-length one): it
    /// takes a send queue slot and none of the peer's receives, and completes once the peer's
    /// device answered (at once flushed, if the queue pair is in the error state). Its
    /// request id.
    pub(super) fn post_read_request(&mut self, end: End, signaled: bool) -> u64 {
        let wr_id = self.next_wr_id(end);
        let (sq, _, _) = self.sender(end).expect("a live queue pair");
        sq.posted.push_back((wr_id, signaled));
        if sq.error {
            self.flush_sends(end);
        } else if let Some(w) = self.wire_from(end) {
            w.push_back(Packet {
                imm: 0,
                solicited: false,
                seq: None,
                wr_id,
                read: true,
                rnr: 0,
            });
        }
        wr_id
    }

    /// The next request id of `end`'s queue pair.
    pub(super) fn next_wr_id(&mut self, end: End) -> u64 {
        let next = match end {
            End::Conn(i) => &mut self.conns[i].next_wr,
            End::Hub(_) => &mut self.hub().next_wr,
            End::Gone(_) => unreachable!("a gone queue pair posts nothing"),
        };
        *next += 1;
        *next
    }

    // ----- driving -----

    /// Every end that still has a wire to deliver from.
    fn ends(&self) -> Vec<End> {
        self.wires.iter().flat_map(|l| [l.a, l.b]).collect()
    }

    /// Delivers everything deliverable; whether anything moved.
    pub(crate) fn deliver_all(&mut self) -> bool {
        let mut any = false;
        loop {
            let mut moved = false;
            for end in self.ends() {
                moved |= self.deliver(end);
            }
            if !moved {
                return any;
            }
            any = true;
        }
    }

    /// Takes one turn of every end awake (or all, with `everyone`).
    pub(crate) fn turns(&mut self, everyone: bool) -> bool {
        let mut busy = false;
        for i in 0..self.conns.len() {
            if everyone || !self.conns[i].asleep {
                busy |= self.turn(i);
            }
        }
        if self.hub.as_ref().is_some_and(|h| everyone || !h.asleep) {
            busy |= self.hub_turn();
        }
        busy
    }

    /// The earliest deadline of any core.
    fn next_deadline(&self) -> Option<Instant> {
        let conns = self
            .conns
            .iter()
            .filter(|c| !c.dead)
            .filter_map(|c| c.core.next_timeout());
        let hub = self
            .hub
            .iter()
            .flat_map(|h| h.table.slots.iter().flatten())
            .filter_map(|s| s.core.next_timeout());
        conns.chain(hub).min()
    }

    /// Runs until nothing is left to do: every end asleep with nothing deliverable and no
    /// deadline due, advancing time to the next deadline when only deadlines remain. Fails
    /// (panics) after `bound` rounds: a run that never goes idle. Ends that are asleep wake
    /// only when an arm fires (or their stream has news): a hang the health check would hide
    /// is a failure here.
    pub(crate) fn drive(&mut self, bound: usize) {
        self.drive_until(None, bound);
    }

    /// [`Net::drive`] that also stops once the next deadline is after `until` (time then stands
    /// at the last deadline before it): for ends whose timers never stop, as probing ones.
    pub(crate) fn drive_until(&mut self, until: Option<Instant>, bound: usize) {
        for _ in 0..bound {
            let mut busy = self.deliver_all();
            busy |= self.turns(false);
            busy |= self.deliver_all();
            if busy {
                continue;
            }
            if self
                .wires
                .iter()
                .any(|l| !l.a_to_b.is_empty() || !l.b_to_a.is_empty())
            {
                // Messages wait on receivers not ready: the retry comes after the RNR timer.
                self.advance(Duration::from_millis(1));
                continue;
            }
            match self.next_deadline() {
                Some(at) if until.is_some_and(|u| at > u) => return,
                Some(at) => {
                    self.now = self.now.max(at);
                    // Deadlines are the cores' own timers: their drivers wake for them.
                    self.turns(true);
                }
                None => return,
            }
        }
        panic!("the network did not go idle within {bound} rounds: {self:#?}");
    }

    /// Advances simulated time.
    pub(crate) fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// Whether connection `i` sleeps with work left it cannot do: a message to send and no
    /// credit.
    pub(crate) fn stuck(&self, i: usize) -> bool {
        let c = &self.conns[i];
        c.app.backlog > 0 && c.core.failure().is_none()
    }
}
