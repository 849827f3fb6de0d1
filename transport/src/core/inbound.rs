//! What polled completions mean for a connection: pure rules, no device, no buffers.
//!
//! The connection hands each batch of polled completions to [`Inbound`] in polling order and
//! does what it answers (deliver a buffer, recycle it, record a failure). Two rules matter:
//!
//! - **Nothing that arrived is lost on failure.** Every successful data receive is delivered,
//!   in order, whether it was polled before a failure, in the same batch as the error that
//!   caused it, in a later batch, or among the flushes that follow. Only the stream of
//!   receives itself breaking (an error completion, or a message that breaks the protocol)
//!   stops delivery after that point, and the peer's close message ends it.
//! - **The first real error wins.** A send that exhausted its retries moves the queue pair to
//!   error, which flushes the receives, and the receive queue may be polled first: the batch
//!   is searched for a real (non-flush) error before any flush is explained.

use rdmsg_verbs::{WcOpcode, WcStatus};

use crate::credits::{Credits, Imm, Violation};
use crate::error::Failure;

/// A polled completion, as the rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completion {
    /// From the receive queue (else the send queue).
    pub recv: bool,
    /// Outcome.
    pub status: WcStatus,
    /// Opcode (meaningless on error completions).
    pub opcode: WcOpcode,
    /// Provider error code.
    pub vendor_err: u32,
    /// Immediate data.
    pub imm: Option<u32>,
    /// The request's wr_id (a send's tells a liveness probe from the rest).
    pub wr_id: u64,
}

impl Completion {
    pub(crate) fn of(recv: bool, wc: &rdmsg_verbs::WorkCompletion) -> Self {
        Self {
            recv,
            status: wc.status(),
            opcode: wc.opcode(),
            vendor_err: wc.vendor_err(),
            imm: wc.imm_data(),
            wr_id: wc.wr_id(),
        }
    }

    fn is_real_error(&self) -> bool {
        !matches!(self.status, WcStatus::Success | WcStatus::WrFlushErr)
    }

    fn failure(&self) -> Failure {
        Failure::Completion {
            status: self.status,
            opcode: self.opcode,
            vendor_err: self.vendor_err,
        }
    }
}

/// What to do with a receive completion's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvAction {
    /// A data message: hand it to the user.
    Deliver,
    /// A credit grant: back to the pool (and counted).
    Grant,
    /// A close, an error or a message past a broken point: back to the pool.
    Recycle,
}

/// The receive-side rules of one connection.
#[derive(Debug, Default)]
pub(crate) struct Inbound {
    /// The stream of receives broke: nothing after that point is delivered.
    broken: bool,
    /// The peer's close message arrived: nothing follows it.
    peer_closed: bool,
}

impl Inbound {
    /// Whether the peer's close message has arrived.
    pub(crate) fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Before a batch is handled: the failure its first real error stands for, to be recorded
    /// before any flush in the batch is looked at (`None` if the batch has none, or a failure
    /// is already known).
    pub(crate) fn first_error(
        known: Option<Failure>,
        batch: impl IntoIterator<Item = Completion>,
        probe: Option<u64>,
    ) -> Option<Failure> {
        if known.is_some() {
            return None;
        }
        batch.into_iter().find(Completion::is_real_error).map(|c| {
            // A liveness probe nobody answered: the peer's host is gone (or cut off).
            if !c.recv && c.status == WcStatus::RetryExcErr && Some(c.wr_id) == probe {
                Failure::PeerVanished
            } else {
                c.failure()
            }
        })
    }

    /// A send completion: the failure it stands for, if any (flushes explain nothing).
    pub(crate) fn on_send(c: &Completion) -> Option<Failure> {
        c.is_real_error().then(|| c.failure())
    }

    /// A receive completion, in polling order. `known` is the connection's failure so far;
    /// `explain_flush` asks what else (an asynchronous event) explains a flush when nothing
    /// does. Returns what to do with the buffer and the failure to record, if any.
    pub(crate) fn on_recv(
        &mut self,
        c: &Completion,
        credits: &mut Credits,
        known: Option<Failure>,
        explain_flush: impl FnOnce() -> Option<Failure>,
    ) -> (RecvAction, Option<Failure>) {
        if c.status != WcStatus::Success {
            self.broken = true;
            let failure = match (known, c.status) {
                (Some(_), _) => None,
                (None, WcStatus::WrFlushErr) => Some(explain_flush().unwrap_or(Failure::QpError)),
                (None, _) => Some(c.failure()),
            };
            return (RecvAction::Recycle, failure);
        }
        if self.broken || self.peer_closed {
            return (RecvAction::Recycle, None);
        }
        let violation = match c.imm.map(Imm::decode) {
            None => Failure::MissingImm,
            Some(None) => Failure::Protocol(Violation::BadImm),
            Some(Some(imm)) => match credits.on_receive(imm) {
                Err(v) => Failure::Protocol(v),
                Ok(true) => return (RecvAction::Grant, None),
                Ok(false) if imm.flags & Imm::CLOSE != 0 => {
                    // Its slot was a data credit: the buffer is re-posted but never returned.
                    self.peer_closed = true;
                    return (RecvAction::Recycle, Some(Failure::PeerClosed));
                }
                Ok(false) => return (RecvAction::Deliver, None),
            },
        };
        self.broken = true;
        (RecvAction::Recycle, Some(violation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEPTH: u32 = 16;
    const NO_FLAGS: Imm = Imm {
        credits: 0,
        echo: 0,
        flags: 0,
    };

    fn fresh_credits() -> Credits {
        Credits::new(DEPTH, 3, DEPTH, 3, DEPTH)
    }

    fn data() -> Completion {
        Completion {
            recv: true,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            vendor_err: 0,
            imm: Some(NO_FLAGS.encode()),
            wr_id: 0,
        }
    }

    fn with(status: WcStatus, recv: bool) -> Completion {
        Completion {
            recv,
            status,
            opcode: WcOpcode::Other(0),
            vendor_err: 7,
            imm: None,
            wr_id: 0,
        }
    }

    /// Drives one batch the way the connection does: first error recorded, then each
    /// completion in order. Returns (delivered, failure).
    fn handle(
        inbound: &mut Inbound,
        credits: &mut Credits,
        failure: &mut Option<Failure>,
        batch: &[Completion],
    ) -> usize {
        if let Some(f) = Inbound::first_error(*failure, batch.iter().copied(), None) {
            failure.get_or_insert(f);
        }
        let mut delivered = 0;
        for c in batch {
            if c.recv {
                let (action, f) = inbound.on_recv(c, credits, *failure, || None);
                delivered += usize::from(action == RecvAction::Deliver);
                if let Some(f) = f {
                    failure.get_or_insert(f);
                }
            } else if let Some(f) = Inbound::on_send(c) {
                failure.get_or_insert(f);
            }
        }
        delivered
    }

    #[test]
    fn messages_in_the_same_batch_as_an_error_are_delivered_and_the_error_wins() {
        let (mut inbound, mut credits, mut failure) = (Inbound::default(), fresh_credits(), None);
        let retry = with(WcStatus::RetryExcErr, false);
        let mut batch = vec![data(); 5];
        batch.push(with(WcStatus::WrFlushErr, true));
        batch.push(retry);
        let delivered = handle(&mut inbound, &mut credits, &mut failure, &batch);
        assert_eq!(delivered, 5);
        assert_eq!(
            failure,
            Some(retry.failure()),
            "the real error explains the flush"
        );
    }

    #[test]
    fn messages_polled_after_a_failure_noticed_elsewhere_are_delivered() {
        let (mut inbound, mut credits) = (Inbound::default(), fresh_credits());
        // The peer vanished (its bootstrap stream ended): what had arrived is still delivered,
        // in a later batch and among the flushes.
        let mut failure = Some(Failure::PeerVanished);
        assert_eq!(
            handle(&mut inbound, &mut credits, &mut failure, &[data(); 3]),
            3
        );
        let flushes = [data(), data(), with(WcStatus::WrFlushErr, true), data()];
        assert_eq!(
            handle(&mut inbound, &mut credits, &mut failure, &flushes),
            2
        );
        assert_eq!(
            failure,
            Some(Failure::PeerVanished),
            "the first failure is kept"
        );
    }

    #[test]
    fn nothing_after_a_broken_receive_or_a_close_is_delivered() {
        let (mut inbound, mut credits, mut failure) = (Inbound::default(), fresh_credits(), None);
        let mut bad = data();
        bad.imm = None;
        let n = handle(
            &mut inbound,
            &mut credits,
            &mut failure,
            &[data(), bad, data()],
        );
        assert_eq!((n, failure), (1, Some(Failure::MissingImm)));

        let (mut inbound, mut credits, mut failure) = (Inbound::default(), fresh_credits(), None);
        let mut close = data();
        close.imm = Some(
            Imm {
                flags: Imm::CLOSE,
                ..NO_FLAGS
            }
            .encode(),
        );
        let n = handle(
            &mut inbound,
            &mut credits,
            &mut failure,
            &[data(), data(), close, data()],
        );
        assert_eq!((n, failure), (2, Some(Failure::PeerClosed)));
        assert!(inbound.peer_closed());
    }

    #[test]
    fn an_unexplained_flush_asks_what_else_explains_it() {
        let (mut inbound, mut credits) = (Inbound::default(), fresh_credits());
        let flush = with(WcStatus::WrFlushErr, true);
        let overrun = Failure::AsyncEvent(rdmsg_verbs::AsyncEventKind::CqErr);
        let (_, f) = inbound.on_recv(&flush, &mut credits, None, || Some(overrun));
        assert_eq!(f, Some(overrun));
        let (_, f) = Inbound::default().on_recv(&flush, &mut credits, None, || None);
        assert_eq!(f, Some(Failure::QpError));
    }

    #[test]
    fn a_credit_overrun_breaks_the_stream() {
        let mut credits = Credits::new(2, 3, 2, 3, 2);
        let (mut inbound, mut failure) = (Inbound::default(), None);
        let n = handle(&mut inbound, &mut credits, &mut failure, &[data(); 4]);
        assert_eq!(n, 2);
        assert_eq!(failure, Some(Failure::Protocol(Violation::Overrun)));
    }
}
