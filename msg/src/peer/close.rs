//! A graceful close of one peer, the same for a [`crate::Session`] and each peer of a
//! [`crate::Hub`], blocking ([`crate::Session::close`], [`crate::Hub::close`]) or driven by the
//! hub's turns ([`crate::Hub::start_close`]).
//!
//! One order, one deadline. The close's time (`close_timeout`) is read once, when it begins,
//! and bounds all of it, the transport's own close (a credit for the close message, then its
//! acknowledgement) included. In order: the outbox goes, then the committed frames and
//! messages (a message is never left half sent), then the close waits until the peer has read
//! what it was lent by rendezvous (closing under a read would fail it) and, with a delivery
//! record, until its application took everything; a last flush tells it our count of its
//! messages taken; the transport's close ends it. An error of one message's own is counted
//! and the close goes on; only a failed connection ends it early.

use std::time::{Duration, Instant};

use rdmsg_verbs::deadline_after;

use crate::Result;

use super::{Outbox, PeerIo, SendSide};

/// One close under way: when it must end, and whether it waits for the delivery record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Closing {
    deadline: Instant,
    record: bool,
}

/// What the steps before the transport's close came to.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Waited {
    /// Messages the peer had not finished reading by the deadline.
    pub(crate) unread: usize,
    /// Outbox messages dropped for a reason of their own (not encodable, too large).
    pub(crate) dropped: u64,
}

impl Closing {
    /// A close begun at `now`, within `timeout`, waiting for the delivery record or not.
    pub(crate) fn begin(now: Instant, timeout: Duration, record: bool) -> Self {
        Self {
            deadline: deadline_after(now, timeout),
            record,
        }
    }

    /// For a close driven by turns: with the record, once everything of ours went, asks the
    /// peer about all of it (once; a later message is asked about again); whether a frame
    /// was queued to go.
    pub(crate) fn ask(&self, send: &mut SendSide, outbox: &Outbox) -> bool {
        if !self.record || !outbox.is_empty() || send.queued_frames() > 0 {
            return false;
        }
        send.ask_all();
        send.queued_frames() > 0
    }

    /// When the whole close must have ended.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether nothing keeps the transport's close waiting: nothing of ours left to send
    /// (the outbox, committed frames and messages), nothing the peer may still be reading,
    /// and with the record, nothing its application has not taken.
    pub(crate) fn settled(&self, send: &SendSide, outbox: &Outbox) -> bool {
        outbox.is_empty()
            && send.queued_frames() == 0
            && send.lent() == 0
            && !(self.record && send.delivery(None).unconfirmed() > 0)
    }

    /// Whether the transport's close should start now: settled, or out of time.
    pub(crate) fn due(&self, now: Instant, send: &SendSide, outbox: &Outbox) -> bool {
        now >= self.deadline || self.settled(send, outbox)
    }

    /// The blocking close's steps before the transport's, each within the deadline, in the
    /// order above. Only a fatal error (a failed connection above all) ends them early; the
    /// front end closes the transport all the same.
    pub(crate) fn wait(
        &self,
        send: &mut SendSide,
        io: &mut impl PeerIo,
        outbox: &mut Outbox,
    ) -> Result<Waited> {
        // The outbox joins the committed messages: the flush sends them all in order.
        let dropped = outbox.commit_all(send, io)?;
        self.flush(send, io)?;
        let unread = loop {
            match send.wait_until_returned(io, self.deadline, self.record) {
                Ok(unread) => break unread,
                Err(e) if io.failed() || e.is_fatal() => return Err(e),
                // One message's own error (counted where it happened): the wait goes on.
                Err(_) if Instant::now() < self.deadline => {}
                Err(_) => break send.lent(),
            }
        };
        self.flush(send, io)?;
        Ok(Waited { unread, dropped })
    }

    /// Committed frames and messages, then a flush, within the deadline. A committed
    /// message failing alone is dropped (counted in its statistics) and the rest go on.
    fn flush(&self, send: &mut SendSide, io: &mut impl PeerIo) -> Result<()> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            match send.flush_within(io, Some(left)) {
                Err(e) if e.is_fatal() => return Err(e),
                Err(_) if !left.is_zero() => continue,
                _ => return Ok(()),
            }
        }
    }
}
