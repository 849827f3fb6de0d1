//! The simulated device: wires, send queues, completion queues with their one-shot arms, and
//! the verbs rules a message meets on its way (see the module docs).

use std::collections::VecDeque;

use rdmsg_notify::ArmMode;
use rdmsg_verbs::{WcOpcode, WcStatus};

use super::*;
use crate::core::{Completion, Post, Room};

/// A message on the wire.
#[derive(Debug, Clone, Copy)]
pub(super) struct Packet {
    pub(super) imm: u32,
    pub(super) solicited: bool,
    /// The application's sequence number of a data message.
    pub(super) seq: Option<u64>,
    /// The sender's request id.
    pub(super) wr_id: u64,
    /// An RDMA read of the receiver's memory: it consumes no receive.
    pub(super) read: bool,
    /// Times it met a receiver not ready.
    pub(super) rnr: u8,
}

/// A completion as a simulated CQ holds it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cqe {
    pub(super) c: Completion,
    pub(super) wr_id: u64,
    /// The queue pair (an index of the hub's slots, or 0 for a connection).
    pub(super) qp: usize,
    pub(super) seq: Option<u64>,
}

/// A simulated completion queue with its one-shot arm.
#[derive(Debug, Default)]
pub(super) struct Cq {
    pub(super) entries: VecDeque<Cqe>,
    pub(super) arm: Option<ArmMode>,
    /// An arm fired and the driver has not looked yet.
    pub(super) fired: bool,
}

impl Cq {
    pub(super) fn push(&mut self, e: Cqe) {
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
    pub(super) fn solicited(&self) -> bool {
        // Carried in the opcode slot's vendor bits of the simulated completion.
        self.c.vendor_err & SOLICITED != 0
    }
}

/// Retries of a message that meets a receiver not ready (`PathParams::rnr_retry`).
pub(super) const RNR_RETRY: u8 = 6;

/// Marks a simulated receive completion of a solicited message.
pub(super) const SOLICITED: u32 = 1 << 31;

/// A queue pair's send queue: requests in posting order (id, signaled), each held until a
/// polled completion covers it (an unsignaled one, by a later signaled one).
#[derive(Debug, Default)]
pub(super) struct SendQueue {
    pub(super) posted: VecDeque<(u64, bool)>,
    /// Requests up to this id were taken by the peer (or failed).
    pub(super) done_to: u64,
    pub(super) error: bool,
}

impl SendQueue {
    /// What is free for a send on a queue of `depth` slots (a send buffer per slot; the CQ is
    /// not what the simulation bounds).
    pub(super) fn room(&self, depth: usize) -> Room {
        let sq = depth.saturating_sub(self.posted.len());
        Room {
            sq,
            buffers: sq,
            cq: usize::MAX,
            unsignaled: usize::MAX,
        }
    }

    /// The requests a polled completion of `wr_id` retires.
    pub(super) fn retire(&mut self, wr_id: u64) {
        while self.posted.front().is_some_and(|&(id, _)| id <= wr_id) {
            self.posted.pop_front();
        }
    }
}

pub(super) fn recv_completion(status: WcStatus, imm: Option<u32>, solicited: bool) -> Completion {
    Completion {
        recv: true,
        status,
        opcode: WcOpcode::Recv,
        vendor_err: if solicited { SOLICITED } else { 0 },
        imm,
        wr_id: 0,
    }
}

pub(super) fn send_completion(status: WcStatus) -> Completion {
    Completion {
        recv: false,
        status,
        opcode: WcOpcode::Send,
        vendor_err: 0,
        imm: None,
        wr_id: 0,
    }
}

impl Net {
    /// Posts `post` with an optional data `seq` from `from`: onto the wire (a queue pair in
    /// the error state flushes it at once).
    pub(super) fn post_send(&mut self, from: End, post: Post, seq: Option<u64>) {
        let wr_id = self.next_wr_id(from);
        let (sq, _, _) = self.sender(from).expect("a live queue pair");
        sq.posted.push_back((wr_id, post.signaled));
        let error = sq.error;
        match from {
            End::Conn(i) => self.conns[i].core.posted(wr_id, post.signaled),
            End::Hub(s) => self.hub().table.slots[s]
                .as_mut()
                .expect("a live slot")
                .core
                .posted(wr_id, post.signaled),
            End::Gone(_) => {}
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
    pub(super) fn sender(&mut self, end: End) -> Option<(&mut SendQueue, &mut Cq, usize)> {
        match end {
            End::Conn(i) => {
                let c = &mut self.conns[i];
                Some((&mut c.sq, &mut c.send_cq, 0))
            }
            End::Hub(s) => {
                let h = self.hub.as_mut().expect("a hub");
                // A released slot's queue pair is gone: nothing completes on it.
                let slot = h.table.slots[s].as_mut()?;
                Some((&mut slot.sq, &mut h.send_cq, s))
            }
            End::Gone(_) => None,
        }
    }

    /// The peer took request `wr_id` of `end` (`Success`), or its retries ran out: a
    /// completion if it is signaled or failed; a failed one moves the queue pair to the error
    /// state, which flushes what follows it.
    pub(super) fn complete_send(&mut self, end: End, wr_id: u64, status: WcStatus) {
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
    pub(super) fn flush_sends(&mut self, end: End) {
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
    pub(super) fn break_queue_pair(&mut self, end: End) {
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
        // Error completions fire even a solicited-only arm (the specification; Linux 6.12's
        // rxe bends it for flushed receives, which the drivers' health check covers).
        self.wake_if_fired(end);
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
            End::Hub(s) => self.hub.as_ref().expect("a hub").table.slots[s]
                .as_ref()
                .is_none_or(|slot| slot.sq.error),
            End::Gone(_) => true,
        };
        if receiver_error {
            // No acknowledgement will ever come: the sender's retries run out, or go on for
            // ever.
            self.wire_from(from).expect("a link").pop_front();
            if self.endless_retries {
                return true;
            }
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
            End::Gone(_) => unreachable!("a gone end fails the sender above"),
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
            End::Gone(_) => unreachable!("a gone end fails the sender above"),
        }
        self.wire_from(from).expect("a link").pop_front();
        self.complete_send(from, p.wr_id, WcStatus::Success);
        self.wake_if_fired(from);
        true
    }

    pub(super) fn wake_if_fired(&mut self, end: End) {
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
            End::Gone(_) => {}
        }
    }
}
