//! The per-connection protocol as one piece of pure logic: credits, the receive rules, the
//! first failure, signalling and statistics. No verbs, no clock, no I/O: a [`Connection`]
//! (one queue pair, its own queues) and a [`Hub`] (many queue pairs, shared queues) both drive
//! it, so that the rules exist once.
//!
//! The driver tells it what happened (a polled batch, a receive, a send completion, a post)
//! and does what it answers: deliver or recycle a buffer, post a message with this immediate
//! data and these flags, and, when a failure is recorded for the first time, tell the peer and
//! move the queue pair to the error state.
//!
//! [`Connection`]: crate::Connection
//! [`Hub`]: crate::Hub

use rdmsg_notify::ArmMode;

use crate::connection::ConnStats;
use crate::credits::{Credits, Imm};
use crate::inbound::{Completion, Inbound, RecvAction};
use crate::Failure;

/// A message to post: its immediate data and whether it must be solicited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outgoing {
    /// Immediate data (credits returned, echo, flags).
    pub imm: Imm,
    /// Whether the message is posted solicited.
    pub solicited: bool,
}

/// Everything one connection's protocol keeps.
#[derive(Debug)]
pub(crate) struct Protocol {
    credits: Credits,
    inbound: Inbound,
    failure: Option<Failure>,
    stats: ConnStats,
    signal_every: u32,
    unsignaled: u32,
    /// wr_id of the last signaled send, until a completion retires it.
    last_signaled: Option<u64>,
}

impl Protocol {
    pub(crate) fn new(credits: Credits, signal_every: u32) -> Self {
        Self {
            credits,
            inbound: Inbound::default(),
            failure: None,
            stats: ConnStats::default(),
            signal_every: signal_every.max(1),
            unsignaled: 0,
            last_signaled: None,
        }
    }

    pub(crate) fn credits(&self) -> &Credits {
        &self.credits
    }

    pub(crate) fn credits_mut(&mut self) -> &mut Credits {
        &mut self.credits
    }

    pub(crate) fn stats(&self) -> ConnStats {
        self.stats
    }

    pub(crate) fn stats_mut(&mut self) -> &mut ConnStats {
        &mut self.stats
    }

    /// The first failure, if any.
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.failure
    }

    /// Whether the peer's close message has arrived.
    pub(crate) fn peer_closed(&self) -> bool {
        self.inbound.peer_closed()
    }

    /// Records `f` if it is the first failure; `true` if so (the driver then tells the peer
    /// and moves the queue pair to the error state). Later failures are dropped: the first
    /// one is what every later call reports.
    #[must_use]
    pub(crate) fn record_failure(&mut self, f: Failure) -> bool {
        if self.failure.is_some() {
            return false;
        }
        self.failure = Some(f);
        true
    }

    /// Before a polled batch is handled: records the failure its first real error stands for,
    /// so that flushes in the batch are explained by it. `true` if that was the first failure.
    #[must_use]
    pub(crate) fn begin_batch(&mut self, batch: impl IntoIterator<Item = Completion>) -> bool {
        match Inbound::first_error(self.failure, batch) {
            Some(f) => self.record_failure(f),
            None => false,
        }
    }

    /// A receive completion whose buffer came back: what to do with the buffer, and whether
    /// a failure was recorded for the first time. `explain_flush` is asked what explains a
    /// flush nothing else does (an asynchronous event).
    pub(crate) fn on_recv(
        &mut self,
        c: &Completion,
        explain_flush: impl FnOnce() -> Option<Failure>,
    ) -> (RecvAction, bool) {
        let (action, failure) =
            self.inbound
                .on_recv(c, &mut self.credits, self.failure, explain_flush);
        match action {
            RecvAction::Deliver => self.stats.received += 1,
            RecvAction::Grant => self.stats.grants_received += 1,
            RecvAction::Recycle => {}
        }
        let first = failure.is_some_and(|f| self.record_failure(f));
        (action, first)
    }

    /// A send completion of request `wr_id`: retires the outstanding signaled send it covers;
    /// `true` if it recorded a failure for the first time.
    #[must_use]
    pub(crate) fn on_send(&mut self, c: &Completion, wr_id: u64) -> bool {
        // Completions come in posting order and wr_ids grow: this one retires every signaled
        // send up to it.
        if self.last_signaled.is_some_and(|id| wr_id >= id) {
            self.last_signaled = None;
        }
        Inbound::on_send(c).is_some_and(|f| self.record_failure(f))
    }

    /// Whether a data message can be sent as far as the protocol goes (a credit, no failure).
    pub(crate) fn can_send_data(&self) -> bool {
        self.failure.is_none() && self.credits.available() > 0
    }

    /// The immediate data of a data message about to be posted, spending a credit; `flags`
    /// may carry [`Imm::CLOSE`]. The message is solicited if the caller asked, or if the
    /// protocol needs it (our last credit, or credits for a peer that may be blocked). `None`
    /// without a credit.
    pub(crate) fn data(&mut self, solicited: bool, flags: u8) -> Option<Outgoing> {
        let (imm, must) = self.credits.take_for_data(flags)?;
        if flags & Imm::CLOSE == 0 {
            self.stats.sent += 1;
            self.stats.forced_solicited += u64::from(must && !solicited);
            self.stats.sent_solicited += u64::from(solicited || must);
        }
        Some(Outgoing {
            imm,
            solicited: solicited || must,
        })
    }

    /// A credit grant, if one is due (its credits count as returned: post it).
    pub(crate) fn grant(&mut self) -> Option<Outgoing> {
        let g = self.credits.take_grant()?;
        self.stats.grants_sent += 1;
        Some(Outgoing {
            imm: g.imm,
            solicited: g.solicited,
        })
    }

    /// Whether the next send is signaled: every `signal_every`-th, and always when `must`
    /// (the send queue or the send buffers are about to run out, so that a blocked sender
    /// has a completion coming).
    pub(crate) fn signal_next(&mut self, must: bool) -> bool {
        let signaled = must || self.unsignaled + 1 >= self.signal_every;
        self.unsignaled = if signaled { 0 } else { self.unsignaled + 1 };
        signaled
    }

    /// The next send is signaled whatever the count (a close message, whose delivery is
    /// waited for).
    pub(crate) fn force_signal(&mut self) {
        self.unsignaled = self.signal_every;
    }

    /// A send was posted as `wr_id`.
    pub(crate) fn posted(&mut self, wr_id: u64, signaled: bool) {
        if signaled {
            self.last_signaled = Some(wr_id);
        }
    }

    /// How the send queue is armed: for any completion while a signaled send is outstanding,
    /// so that its completion, or the error a failed send turns it into, wakes a sleeper (rxe
    /// never marks send-side errors solicited, although the specification has every error
    /// completion fire a solicited-only arm), and a full send queue (whose last send is always
    /// signaled) does not hold back a due grant. Solicited-only otherwise, so that a sleep
    /// with only unsignaled sends behind it skips the pre-sleep drain of the channel.
    pub(crate) fn send_arm(&self) -> ArmMode {
        if self.last_signaled.is_some() {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        }
    }

    /// Whether `free` buffers should be re-posted now (own receive queue): once an eighth of
    /// the depth is free, or at once if a grant slot is missing, or the peer runs low or may be
    /// blocked.
    pub(crate) fn refill_due(&self, free: usize) -> bool {
        let c = &self.credits;
        let batch = (c.depth() as usize / 8).max(1);
        free > 0
            && (free >= batch
                || c.slots_missing() > 0
                || c.peer_credits() <= c.depth() / 4
                || c.peer_may_be_blocked())
    }

    /// `n` receive buffers were re-posted for this connection.
    pub(crate) fn reposted(&mut self, n: u32) {
        self.stats.refills += 1;
        self.credits.on_reposted(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmsg_verbs::{WcOpcode, WcStatus};

    fn recv(imm: Imm) -> Completion {
        Completion {
            recv: true,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            vendor_err: 0,
            imm: Some(imm.encode()),
        }
    }

    #[test]
    fn the_first_failure_is_kept_and_reported_once() {
        let mut p = Protocol::new(Credits::new(4, 3, 4, 3, 4), 4);
        assert!(p.record_failure(Failure::PeerVanished));
        assert!(!p.record_failure(Failure::QpError));
        assert_eq!(p.failure(), Some(Failure::PeerVanished));
        assert!(!p.can_send_data());
    }

    #[test]
    fn signalling_follows_the_count_and_the_must() {
        let mut p = Protocol::new(Credits::new(4, 3, 4, 3, 4), 3);
        let got: Vec<bool> = (0..6).map(|_| p.signal_next(false)).collect();
        assert_eq!(got, [false, false, true, false, false, true]);
        assert!(p.signal_next(true));
        p.posted(7, true);
        assert_eq!(p.send_arm(), ArmMode::Next);
        let ok = Completion {
            recv: false,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            vendor_err: 0,
            imm: None,
        };
        assert!(!p.on_send(&ok, 7));
        assert_eq!(p.send_arm(), ArmMode::SolicitedOnly);
    }

    #[test]
    fn the_last_credit_is_solicited_and_counted() {
        let mut p = Protocol::new(Credits::new(4, 3, 2, 3, 2), 16);
        let first = p.data(false, 0).unwrap();
        assert!(!first.solicited);
        let last = p.data(false, 0).unwrap();
        assert!(last.solicited && last.imm.is_exhausted());
        assert!(p.data(true, 0).is_none());
        let s = p.stats();
        assert_eq!((s.sent, s.sent_solicited, s.forced_solicited), (2, 1, 1));
        let (action, failed) = p.on_recv(
            &recv(Imm {
                credits: 2,
                echo: 0,
                flags: 0,
            }),
            || None,
        );
        assert_eq!((action, failed), (RecvAction::Deliver, false));
        assert_eq!(p.credits().available(), 2);
    }
}
