//! A deterministic simulator of RC queue pairs, for testing the real protocol [`Core`] on a
//! host without RDMA (tests only).
//!
//! The network holds *connections* (each driven like a [`Connection`](crate::Connection): its
//! own receive queue, send queue and completion queues) and at most one *hub* (many cores over
//! one shared receive queue and shared CQs, its buffers lent by the real
//! [`Share`], driven like a [`Hub`](crate::Hub)). Links join two ends in order. Time is
//! simulated. The verbs rules the simulated device keeps:
//!
//! - messages on one link arrive in order, each consuming a posted receive; one that finds none
//!   is a receiver-not-ready (counted: the credit protocol promises none);
//! - a send's completion comes once the peer took it; unsignaled sends retire silently with a
//!   later signaled one, in order;
//! - a queue pair in the error state flushes every posted request with `WrFlushErr` (a shared
//!   receive queue's buffers stay posted); a message sent to it completes with
//!   `RetryExcErr` at the sender;
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
use rdmsg_verbs::{WcOpcode, WcStatus};

use crate::core::{Action, Completion, Core, Post, RecvAction, Room, StreamNews};
use crate::credits::Credits;
use crate::error::Failure;
use crate::share::{CreditHolder, Receipt, Share, ShareConfig};

#[cfg(test)]
mod tests;

/// One end of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A connection, by index.
    Conn(usize),
    /// A slot of the hub.
    Hub(usize),
}

/// A message on the wire.
#[derive(Debug, Clone, Copy)]
struct Packet {
    imm: u32,
    solicited: bool,
    /// The application's sequence number of a data message.
    seq: Option<u64>,
    /// The sender's request id.
    wr_id: u64,
    /// An RDMA read of the receiver's memory: it consumes no receive.
    read: bool,
    /// Times it met a receiver not ready.
    rnr: u8,
}

/// A completion as a simulated CQ holds it.
#[derive(Debug, Clone, Copy)]
struct Cqe {
    c: Completion,
    wr_id: u64,
    /// The queue pair (an index of the hub's slots, or 0 for a connection).
    qp: usize,
    seq: Option<u64>,
}

/// A simulated completion queue with its one-shot arm.
#[derive(Debug, Default)]
struct Cq {
    entries: VecDeque<Cqe>,
    arm: Option<ArmMode>,
    /// An arm fired and the driver has not looked yet.
    fired: bool,
}

impl Cq {
    fn push(&mut self, e: Cqe) {
        let fires = match self.arm {
            Some(ArmMode::Next) => true,
            Some(ArmMode::SolicitedOnly) => {
                e.c.status != WcStatus::Success || (e.c.recv && e.solicited())
            }
            None => false,
        };
        if fires {
            self.arm = None;
            self.fired = true;
        }
        self.entries.push_back(e);
    }
}

impl Cqe {
    fn solicited(&self) -> bool {
        // Carried in the opcode slot's vendor bits of the simulated completion.
        self.c.vendor_err & SOLICITED != 0
    }
}

/// Retries of a message that meets a receiver not ready (`PathParams::rnr_retry`).
const RNR_RETRY: u8 = 6;

/// Marks a simulated receive completion of a solicited message.
const SOLICITED: u32 = 1 << 31;

/// A queue pair's send queue: requests in posting order (id, signaled), each held until a
/// polled completion covers it (an unsignaled one, by a later signaled one).
#[derive(Debug, Default)]
struct SendQueue {
    posted: VecDeque<(u64, bool)>,
    /// Requests up to this id were taken by the peer (or failed).
    done_to: u64,
    error: bool,
}

impl SendQueue {
    /// The requests a polled completion of `wr_id` retires.
    fn retire(&mut self, wr_id: u64) {
        while self.posted.front().is_some_and(|&(id, _)| id <= wr_id) {
            self.posted.pop_front();
        }
    }
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

/// A connection driven like [`crate::Connection`].
#[derive(Debug)]
pub(crate) struct SimConn {
    pub core: Core,
    pub app: App,
    recv_posted: u32,
    /// Receive buffers free and not posted.
    free: u32,
    total_bufs: u32,
    sq_depth: usize,
    sq: SendQueue,
    recv_cq: Cq,
    send_cq: Cq,
    asleep: bool,
    /// The other end's stream ended or said goodbye: news for the next turn.
    stream_news: Option<StreamNews>,
    /// Its bootstrap stream is shut (it said so to the peer).
    stream_shut: bool,
    /// The process is gone: it does nothing any more.
    dead: bool,
    next_wr: u64,
    /// Send completions polled with an error status (flushes included).
    sends_failed: usize,
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

/// The hub's record of one connection.
#[derive(Debug)]
pub(crate) struct HubSlot {
    pub core: Core,
    pub app: App,
    admitted: bool,
    sq: SendQueue,
    sq_depth: usize,
    touched: bool,
}

impl HubSlot {
    /// The hub's send buffers and CQ are not what the simulation bounds: its queue pairs are.
    fn room(&self) -> Room {
        let sq = self.sq_depth.saturating_sub(self.sq.posted.len());
        Room {
            sq,
            buffers: sq,
            cq: usize::MAX,
        }
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

/// A hub driven like [`crate::Hub`].
#[derive(Debug)]
pub(crate) struct SimHub {
    pub share: Share,
    pub slots: Vec<Option<HubSlot>>,
    srq_posted: u32,
    free: u32,
    total: u32,
    recv_cq: Cq,
    send_cq: Cq,
    touched: Vec<usize>,
    asleep: bool,
    last_tick: Instant,
    /// Connections that ended, with how.
    pub ended: Vec<(usize, Failure)>,
    /// Buffers kept spare beyond every connection's minimum (`HubConfig::shared_credits`).
    shared: u32,
    /// Every buffer the hub holds for its application, all slots.
    held: u32,
    /// The slot of each buffer held, in order of arrival (the application's queue).
    held_order: VecDeque<usize>,
    next_wr: u64,
}

/// A link between two ends, with what is on the wire each way.
#[derive(Debug)]
struct Link {
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
    links: Vec<Link>,
    /// Receiver-not-ready events: a message that found no posted receive.
    pub rnr: u64,
    close_timeout: Duration,
}

fn recv_completion(status: WcStatus, imm: Option<u32>, solicited: bool) -> Completion {
    Completion {
        recv: true,
        status,
        opcode: WcOpcode::Recv,
        vendor_err: if solicited { SOLICITED } else { 0 },
        imm,
    }
}

fn send_completion(status: WcStatus) -> Completion {
    Completion {
        recv: false,
        status,
        opcode: WcOpcode::Send,
        vendor_err: 0,
        imm: None,
    }
}

impl SimConn {
    fn new(ours: Shape, peer_depth: u32, peer_slots: u8, initial: u32, close: Duration) -> Self {
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
        }
    }

    fn room(&self) -> Room {
        let sq = self.sq_depth.saturating_sub(self.sq.posted.len());
        Room {
            sq,
            buffers: sq,
            cq: usize::MAX,
        }
    }

    /// Every receive buffer is somewhere: posted, in the CQ, free, or held by the application;
    /// and what is posted (or taken but not yet polled) is what the books need.
    fn check(&self) {
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
    pub(crate) fn new(close_timeout: Duration) -> Self {
        Self {
            now: Instant::now(),
            conns: Vec::new(),
            hub: None,
            links: Vec::new(),
            rnr: 0,
            close_timeout,
        }
    }

    /// Two connections linked to each other: (a, b).
    pub(crate) fn pair(&mut self, a: Shape, b: Shape) -> (usize, usize) {
        let ia = self.conns.len();
        let ct = self.close_timeout;
        self.conns
            .push(SimConn::new(a, b.depth, b.slots, b.depth, ct));
        self.conns
            .push(SimConn::new(b, a.depth, a.slots, a.depth, ct));
        self.links.push(Link {
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
        let mut slots: Vec<Option<HubSlot>> = Vec::new();
        let mut touched = Vec::new();
        share.on_posted(shared, &mut slots, &mut touched);
        self.hub = Some(SimHub {
            share,
            slots,
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
        let slot = match hub.slots.iter().position(Option::is_none) {
            Some(s) => s,
            None => {
                hub.slots.push(None);
                hub.slots.len() - 1
            }
        };
        // As the hub admits: `shared` buffers stay spare beyond everyone's minimum.
        let cost = cfg.admission_cost();
        let short = (cost + hub.shared).saturating_sub(hub.share.spare());
        if short == 0 {
            hub.share.admit(slot).expect("spare covers it");
        } else {
            hub.total += short;
            hub.srq_posted += short;
            hub.share
                .admit_posted(slot, short, &mut hub.slots, &mut hub.touched)
                .expect("grown by what was short");
        }
        let books = Credits::shared(
            cfg.max_credits,
            cfg.grant_slots,
            peer.depth,
            peer.slots,
            peer.depth,
            cfg.min_credits,
        );
        hub.slots[slot] = Some(HubSlot {
            core: Core::new(books, peer.signal_every, ct),
            app: App {
                hold: u32::MAX,
                ..App::default()
            },
            admitted: true,
            sq: SendQueue::default(),
            sq_depth: 8,
            touched: false,
        });
        let c = self.conns.len();
        self.conns.push(SimConn::new(
            peer,
            cfg.max_credits,
            cfg.grant_slots,
            cfg.min_credits,
            ct,
        ));
        self.links.push(Link {
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

    fn link_of(&self, end: End) -> Option<usize> {
        self.links.iter().position(|l| l.a == end || l.b == end)
    }

    fn peer_of(&self, end: End) -> Option<End> {
        let l = &self.links[self.link_of(end)?];
        Some(if l.a == end { l.b } else { l.a })
    }

    fn wire_from(&mut self, end: End) -> Option<&mut VecDeque<Packet>> {
        let i = self.link_of(end)?;
        let l = &mut self.links[i];
        Some(if l.a == end {
            &mut l.a_to_b
        } else {
            &mut l.b_to_a
        })
    }

    /// Posts `post` with an optional data `seq` from `from`: onto the wire (a queue pair in
    /// the error state flushes it at once).
    fn post_send(&mut self, from: End, post: Post, seq: Option<u64>) {
        let wr_id = match from {
            End::Conn(i) => {
                let c = &mut self.conns[i];
                c.next_wr += 1;
                c.next_wr
            }
            End::Hub(_) => {
                let h = self.hub();
                h.next_wr += 1;
                h.next_wr
            }
        };
        let (sq, _, _) = self.sender(from).expect("a live queue pair");
        sq.posted.push_back((wr_id, post.signaled));
        let error = sq.error;
        match from {
            End::Conn(i) => self.conns[i].core.posted(wr_id, post.signaled),
            End::Hub(s) => self.hub().slots[s]
                .as_mut()
                .expect("a live slot")
                .core
                .posted(wr_id, post.signaled),
        }
        if error {
            self.flush_sends(from);
            return;
        }
        if let Some(w) = self.wire_from(from) {
            w.push_back(Packet {
                imm: post.imm.encode(),
                solicited: post.solicited,
                seq,
                wr_id,
                read: false,
                rnr: 0,
            });
        }
    }

    /// The send queue and send CQ of an end, and its queue pair's index in that CQ.
    fn sender(&mut self, end: End) -> Option<(&mut SendQueue, &mut Cq, usize)> {
        match end {
            End::Conn(i) => {
                let c = &mut self.conns[i];
                Some((&mut c.sq, &mut c.send_cq, 0))
            }
            End::Hub(s) => {
                let h = self.hub.as_mut().expect("a hub");
                // A released slot's queue pair is gone: nothing completes on it.
                let slot = h.slots[s].as_mut()?;
                Some((&mut slot.sq, &mut h.send_cq, s))
            }
        }
    }

    /// The peer took request `wr_id` of `end` (`Success`), or its retries ran out: a
    /// completion if it is signaled or failed; a failed one moves the queue pair to the error
    /// state, which flushes what follows it.
    fn complete_send(&mut self, end: End, wr_id: u64, status: WcStatus) {
        let Some((sq, cq, qp)) = self.sender(end) else {
            return;
        };
        sq.done_to = sq.done_to.max(wr_id);
        let signaled = sq
            .posted
            .iter()
            .find(|&&(id, _)| id == wr_id)
            .is_some_and(|&(_, s)| s);
        if signaled || status != WcStatus::Success {
            cq.push(Cqe {
                c: send_completion(status),
                wr_id,
                qp,
                seq: None,
            });
        }
        if status != WcStatus::Success {
            self.flush_sends(end);
        }
    }

    /// Flushes every request of `end`'s send queue the peer has not taken (its queue pair is
    /// in the error state); those it took stay held until destroyed, unless a completion
    /// already covers them.
    fn flush_sends(&mut self, end: End) {
        let Some((sq, cq, qp)) = self.sender(end) else {
            return;
        };
        sq.error = true;
        let from = sq.done_to;
        for &(id, _) in sq.posted.iter().filter(|&&(id, _)| id > from) {
            cq.push(Cqe {
                c: send_completion(WcStatus::WrFlushErr),
                wr_id: id,
                qp,
                seq: None,
            });
        }
        sq.done_to = sq.posted.back().map_or(from, |&(id, _)| id.max(from));
    }

    /// Moves `end`'s queue pair to the error state: its sends and (own queue) receives are
    /// flushed.
    fn break_queue_pair(&mut self, end: End) {
        self.flush_sends(end);
        if let End::Conn(i) = end {
            let c = &mut self.conns[i];
            for _ in 0..std::mem::take(&mut c.recv_posted) {
                c.recv_cq.push(Cqe {
                    c: recv_completion(WcStatus::WrFlushErr, None, false),
                    wr_id: 0,
                    qp: 0,
                    seq: None,
                });
            }
        }
    }

    /// Delivers the next packet from `from`, if any; `false` if there was none (or it met a
    /// receiver not ready, and waits).
    pub(crate) fn deliver(&mut self, from: End) -> bool {
        let Some(to) = self.peer_of(from) else {
            return false;
        };
        let Some(&p) = self.wire_from(from).and_then(|w| w.front()) else {
            return false;
        };
        let receiver_error = match to {
            End::Conn(i) => self.conns[i].sq.error || self.conns[i].dead,
            End::Hub(s) => self.hub.as_ref().expect("a hub").slots[s]
                .as_ref()
                .is_none_or(|slot| slot.sq.error),
        };
        if receiver_error {
            // No acknowledgement will ever come: the sender's retries run out.
            self.wire_from(from).expect("a link").pop_front();
            self.complete_send(from, p.wr_id, WcStatus::RetryExcErr);
            self.wake_if_fired(from);
            return true;
        }
        if p.read {
            // Served by the responder's device: nothing of its receives is touched.
            self.wire_from(from).expect("a link").pop_front();
            self.complete_send(from, p.wr_id, WcStatus::Success);
            self.wake_if_fired(from);
            return true;
        }
        let cqe = Cqe {
            c: recv_completion(WcStatus::Success, Some(p.imm), p.solicited),
            wr_id: p.wr_id,
            qp: 0,
            seq: p.seq,
        };
        let no_receive = match to {
            End::Conn(i) => self.conns[i].recv_posted == 0,
            End::Hub(_) => self.hub.as_ref().expect("a hub").srq_posted == 0,
        };
        if no_receive {
            // Receiver not ready: retried `RNR_RETRY` times, then the sender's request fails.
            self.rnr += 1;
            let w = self.wire_from(from).expect("a link");
            let head = w.front_mut().expect("a packet");
            head.rnr += 1;
            if head.rnr > RNR_RETRY {
                w.pop_front();
                self.complete_send(from, p.wr_id, WcStatus::RnrRetryExcErr);
                self.wake_if_fired(from);
                return true;
            }
            return false;
        }
        match to {
            End::Conn(i) => {
                let c = &mut self.conns[i];
                c.recv_posted -= 1;
                c.recv_cq.push(cqe);
                if c.recv_cq.fired {
                    c.asleep = false;
                }
            }
            End::Hub(s) => {
                let h = self.hub.as_mut().expect("a hub");
                h.srq_posted -= 1;
                h.recv_cq.push(Cqe { qp: s, ..cqe });
                if h.recv_cq.fired {
                    h.asleep = false;
                }
            }
        }
        self.wire_from(from).expect("a link").pop_front();
        self.complete_send(from, p.wr_id, WcStatus::Success);
        self.wake_if_fired(from);
        true
    }

    fn wake_if_fired(&mut self, end: End) {
        match end {
            End::Conn(i) => {
                let c = &mut self.conns[i];
                if c.send_cq.fired || c.recv_cq.fired {
                    c.asleep = false;
                }
            }
            End::Hub(_) => {
                let h = self.hub.as_mut().expect("a hub");
                if h.send_cq.fired || h.recv_cq.fired {
                    h.asleep = false;
                }
            }
        }
    }

    /// Does what the core of `end` asks for.
    fn do_actions(&mut self, end: End) {
        loop {
            let action = match end {
                End::Conn(i) => self.conns[i].core.poll_action(),
                End::Hub(s) => self.hub().slots[s]
                    .as_mut()
                    .and_then(|s| s.core.poll_action()),
            };
            let Some(action) = action else { return };
            let peer = self.peer_of(end);
            match action {
                Action::SayGoodbye => self.tell_stream(peer, StreamNews::Goodbye),
                Action::UnwatchStream => {}
                Action::FailQueuePair => {
                    self.tell_stream(peer, StreamNews::Ended);
                    self.break_queue_pair(end);
                    let now = self.now;
                    match end {
                        End::Conn(i) => {
                            self.conns[i].stream_shut = true;
                            self.conns[i].core.flushing_since(now);
                        }
                        End::Hub(s) => {
                            let h = self.hub();
                            if let Some(slot) = h.slots[s].as_mut() {
                                slot.core.flushing_since(now);
                                if slot.admitted {
                                    // Its buffers stop being refilled; released at the end.
                                    h.share.retire(s);
                                }
                            }
                        }
                    }
                }
            }
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
            Some(End::Hub(s)) => {
                let now = self.now;
                let h = self.hub();
                if let Some(slot) = h.slots[s].as_mut() {
                    slot.core.handle_stream(news, now);
                }
                h.asleep = false;
                self.do_actions(End::Hub(s));
            }
            None => {}
        }
    }

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
        // The application hands back what it holds beyond its bound.
        let c = &mut self.conns[i];
        while c.app.held > c.app.hold {
            c.app.held -= 1;
            c.free += 1;
            busy = true;
        }
        if let Some(news) = self.conns[i].stream_news.take() {
            self.conns[i].core.handle_stream(news, now);
            self.do_actions(End::Conn(i));
            busy = true;
        }
        if self.conns[i]
            .core
            .next_timeout()
            .is_some_and(|at| at <= now)
        {
            self.conns[i].core.handle_timeout(now);
            self.do_actions(End::Conn(i));
            busy = true;
        }
        busy |= self.drain_conn(i);
        busy |= self.repost_and_grant(i);
        busy |= self.app_send(End::Conn(i));
        busy |= self.repost_and_grant(i);
        // Arm, then poll once more: what came meanwhile would fire nothing.
        let c = &mut self.conns[i];
        let blocked = c.app.backlog > 0 && c.core.failure().is_none() && !c.core.may_send(c.room());
        // A sender out of credits arms both queues for any completion, as the drivers do:
        // grants sent before the peer saw us exhausted are not solicited.
        let (recv, send) = if blocked {
            (ArmMode::Next, ArmMode::Next)
        } else {
            (ArmMode::SolicitedOnly, c.core.send_arm())
        };
        c.recv_cq.arm = Some(recv);
        c.send_cq.arm = Some(send);
        c.recv_cq.fired = false;
        c.send_cq.fired = false;
        let pending = !c.recv_cq.entries.is_empty() || !c.send_cq.entries.is_empty();
        c.asleep = !pending;
        c.check();
        busy
    }

    fn poll_conn(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        let mut batch: Vec<Cqe> = c.recv_cq.entries.drain(..).collect();
        batch.extend(c.send_cq.entries.drain(..));
        if batch.is_empty() {
            return false;
        }
        c.core.begin_batch(batch.iter().map(|e| e.c));
        for e in batch {
            let c = &mut self.conns[i];
            if e.c.recv {
                let receipt = c.core.handle_recv(&e.c, || None);
                match receipt.action {
                    RecvAction::Deliver => {
                        c.app.received.push(e.seq.expect("data carries a sequence"));
                        c.app.held += 1;
                    }
                    RecvAction::Grant | RecvAction::Recycle => c.free += 1,
                }
            } else {
                // The requests (and send buffers) this completion covers come back.
                c.sq.retire(e.wr_id);
                c.sends_failed += usize::from(e.c.status != WcStatus::Success);
                let outstanding = c.sq.posted.len();
                c.core.handle_send(&e.c, e.wr_id, outstanding);
            }
            self.do_actions(End::Conn(i));
        }
        true
    }

    /// After a failure, the connection waits for its receives' flushes (bounded by the core).
    fn drain_conn(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        if c.core.failure().is_none() || c.core.is_drained() {
            return false;
        }
        c.core.handle_flushed(c.recv_posted as usize);
        true
    }

    fn repost_and_grant(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        let mut busy = false;
        if c.core.refill_due(c.free as usize) {
            c.recv_posted += c.free;
            c.core.reposted(c.free);
            c.free = 0;
            busy = true;
        }
        let room = c.room();
        if let Some(g) = c.core.grant(room) {
            self.post_send(End::Conn(i), g, None);
            busy = true;
        }
        busy
    }

    /// The application of `end` sends what its credits allow.
    fn app_send(&mut self, end: End) -> bool {
        let mut busy = false;
        loop {
            let (app, core, room) = match end {
                End::Conn(i) => {
                    let c = &mut self.conns[i];
                    let room = c.room();
                    (&mut c.app, &mut c.core, room)
                }
                End::Hub(s) => {
                    let h = self.hub.as_mut().expect("a hub");
                    let Some(slot) = h.slots[s].as_mut() else {
                        return busy;
                    };
                    let room = slot.room();
                    (&mut slot.app, &mut slot.core, room)
                }
            };
            if app.backlog == 0 || !core.may_send(room) {
                return busy;
            }
            let seq = app.sent;
            let solicited =
                app.solicit_every > 0 && (seq + 1) % app.solicit_every == 0 || app.backlog == 1;
            let post = core.data(solicited, room).expect("may_send said so");
            app.sent += 1;
            app.backlog -= 1;
            self.post_send(end, post, Some(seq));
            busy = true;
        }
    }

    // ----- the hub's turn -----

    /// One turn of the hub, as `Hub::step` does it; returns whether it did anything.
    pub(crate) fn hub_turn(&mut self) -> bool {
        let now = self.now;
        let mut busy = false;
        busy |= self.poll_hub();
        let h = self.hub();
        // Its application hands back what it holds beyond each slot's bound.
        let mut back = 0;
        for (s, slot) in h.slots.iter_mut().enumerate() {
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
        let due: Vec<usize> = (0..self.hub().slots.len())
            .filter(|&s| {
                self.hub.as_ref().expect("a hub").slots[s]
                    .as_ref()
                    .and_then(|x| x.core.next_timeout())
                    .is_some_and(|at| at <= now)
            })
            .collect();
        for s in due {
            if let Some(slot) = self.hub().slots[s].as_mut() {
                slot.core.handle_timeout(now);
            }
            self.do_actions(End::Hub(s));
            busy = true;
        }
        busy |= self.retire_drained();
        // Every free buffer goes back to the SRQ, the share hands it out.
        let h = self.hub();
        if h.free > 0 {
            h.srq_posted += h.free;
            let n = std::mem::take(&mut h.free);
            h.share.on_posted(n, &mut h.slots, &mut h.touched);
            busy = true;
        }
        if now.duration_since(h.last_tick) >= Duration::from_secs(1) {
            h.last_tick = now;
            h.share.tick(&mut h.slots, &mut h.touched);
        }
        // Grants where the books changed.
        let touched: Vec<usize> = std::mem::take(&mut self.hub().touched);
        for s in touched {
            let h = self.hub();
            let Some(slot) = h.slots[s].as_mut() else {
                continue;
            };
            slot.touched = false;
            let room = slot.room();
            if let Some(g) = slot.core.grant(room) {
                self.post_send(End::Hub(s), g, None);
                busy = true;
            }
        }
        for s in 0..self.hub().slots.len() {
            busy |= self.app_send(End::Hub(s));
        }
        let h = self.hub();
        let blocked =
            h.slots.iter().flatten().any(|s| {
                s.app.backlog > 0 && s.core.failure().is_none() && !s.core.may_send(s.room())
            });
        let outstanding = h.slots.iter().flatten().any(|s| !s.sq.posted.is_empty());
        h.recv_cq.arm = Some(if blocked {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        });
        h.send_cq.arm = Some(if outstanding || blocked {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        });
        h.recv_cq.fired = false;
        h.send_cq.fired = false;
        h.asleep = h.recv_cq.entries.is_empty() && h.send_cq.entries.is_empty();
        self.check_hub();
        busy
    }

    fn poll_hub(&mut self) -> bool {
        let h = self.hub();
        let mut batch: Vec<Cqe> = h.recv_cq.entries.drain(..).collect();
        batch.extend(h.send_cq.entries.drain(..));
        if batch.is_empty() {
            return false;
        }
        for e in &batch {
            if !matches!(e.c.status, WcStatus::Success | WcStatus::WrFlushErr) {
                if let Some(slot) = self.hub().slots[e.qp].as_mut() {
                    slot.core.begin_batch([e.c]);
                }
                self.do_actions(End::Hub(e.qp));
            }
        }
        for e in batch {
            let h = self.hub();
            let Some(slot) = h.slots[e.qp].as_mut() else {
                if e.c.recv {
                    h.share.on_stray();
                    h.free += 1;
                }
                continue;
            };
            if e.c.recv {
                let receipt = slot.core.handle_recv(&e.c, || None);
                let r = match receipt.action {
                    RecvAction::Grant => Receipt::Grant,
                    _ if receipt.spent_credit => Receipt::Data,
                    _ => Receipt::Unaccounted,
                };
                if slot.admitted {
                    h.share.on_consumed(e.qp, slot, r, &mut h.touched);
                } else {
                    h.share.on_stray();
                }
                let slot = h.slots[e.qp].as_mut().expect("live");
                match receipt.action {
                    RecvAction::Deliver => {
                        slot.app
                            .received
                            .push(e.seq.expect("data carries a sequence"));
                        slot.app.held += 1;
                        h.held += 1;
                        h.held_order.push_back(e.qp);
                    }
                    _ => h.free += 1,
                }
            } else {
                slot.sq.retire(e.wr_id);
                let outstanding = slot.sq.posted.len();
                slot.core.handle_send(&e.c, e.wr_id, outstanding);
            }
            let slot = h.slots[e.qp].as_mut().expect("live");
            if !std::mem::replace(&mut slot.touched, true) {
                h.touched.push(e.qp);
            }
            self.do_actions(End::Hub(e.qp));
        }
        true
    }

    /// Failed slots whose sends came back are destroyed, then released with their event.
    fn retire_drained(&mut self) -> bool {
        let mut busy = false;
        let n = self.hub().slots.len();
        for s in 0..n {
            let h = self.hub();
            let Some(slot) = h.slots[s].as_mut() else {
                continue;
            };
            if slot.core.failure().is_none() {
                continue;
            }
            slot.core.handle_flushed(slot.sq.posted.len());
            if !slot.core.is_drained() {
                continue;
            }
            let failure = slot.core.failure().expect("failed");
            // Its messages still held by the application come back with it.
            h.held -= slot.app.held;
            h.free += slot.app.held;
            slot.app.held = 0;
            h.held_order.retain(|&x| x != s);
            if slot.admitted {
                h.share.release(s, &mut h.slots, &mut h.touched);
            }
            h.slots[s] = None;
            h.ended.push((s, failure));
            // Its queue pair is gone: a later connection may take the slot.
            self.links
                .retain(|l| l.a != End::Hub(s) && l.b != End::Hub(s));
            busy = true;
        }
        busy
    }

    fn check_hub(&self) {
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
        if let Err(e) = h.share.audit(&h.slots) {
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
            h.slots[s].as_mut().expect("a live slot").app.held -= 1;
            h.held -= 1;
            h.free += 1;
        }
        h.asleep = false;
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
            let c = &mut self.conns[i];
            c.next_wr += 1;
            let wr_id = c.next_wr;
            // Only the last piece is signaled: its completion covers the others.
            let signaled = k + 1 == segments;
            c.sq.posted.push_back((wr_id, signaled));
            if signaled {
                c.core.posted(wr_id, true);
            }
            let error = c.sq.error;
            if error {
                self.flush_sends(End::Conn(i));
                continue;
            }
            if let Some(w) = self.wire_from(End::Conn(i)) {
                w.push_back(Packet {
                    imm: 0,
                    solicited: false,
                    seq: None,
                    wr_id,
                    read: true,
                    rnr: 0,
                });
            }
        }
        Ok(true)
    }

    /// Send completions of connection `i` polled with an error (flushes included).
    pub(crate) fn send_failures(&self, i: usize) -> usize {
        self.conns[i].sends_failed
    }

    /// An asynchronous event (a CQ overrun, say) fails `end`.
    pub(crate) fn async_failure(&mut self, end: End, f: Failure) {
        match end {
            End::Conn(i) => self.conns[i].core.handle_failure(f),
            End::Hub(s) => {
                if let Some(slot) = self.hub().slots[s].as_mut() {
                    slot.core.handle_failure(f);
                }
            }
        }
        self.do_actions(end);
    }

    /// Starts a graceful close of connection `i`; whether it could.
    pub(crate) fn close(&mut self, i: usize) -> bool {
        let now = self.now;
        let Some(post) = self.conns[i].core.start_close(now) else {
            return false;
        };
        self.post_send(End::Conn(i), post, None);
        true
    }

    /// Starts a graceful close of hub slot `s`; whether it could.
    pub(crate) fn close_hub_slot(&mut self, s: usize) -> bool {
        let now = self.now;
        let Some(post) = self.hub().slots[s]
            .as_mut()
            .and_then(|slot| slot.core.start_close(now))
        else {
            return false;
        };
        self.post_send(End::Hub(s), post, None);
        true
    }

    // ----- driving -----

    /// Every end that still has a wire to deliver from.
    fn ends(&self) -> Vec<End> {
        self.links.iter().flat_map(|l| [l.a, l.b]).collect()
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
            .flat_map(|h| h.slots.iter().flatten())
            .filter_map(|s| s.core.next_timeout());
        conns.chain(hub).min()
    }

    /// Runs until nothing is left to do: every end asleep with nothing deliverable and no
    /// deadline due, advancing time to the next deadline when only deadlines remain. Fails
    /// (panics) after `bound` rounds: a run that never goes idle. Ends that are asleep wake
    /// only when an arm fires (or their stream has news): a hang the health check would hide
    /// is a failure here.
    pub(crate) fn drive(&mut self, bound: usize) {
        for _ in 0..bound {
            let mut busy = self.deliver_all();
            busy |= self.turns(false);
            busy |= self.deliver_all();
            if busy {
                continue;
            }
            if self
                .links
                .iter()
                .any(|l| !l.a_to_b.is_empty() || !l.b_to_a.is_empty())
            {
                // Messages wait on receivers not ready: the retry comes after the RNR timer.
                self.advance(Duration::from_millis(1));
                continue;
            }
            match self.next_deadline() {
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
