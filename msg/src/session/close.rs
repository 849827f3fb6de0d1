//! A session's close: the one close of `peer/close.rs` (`Closing`), then the connection's.

use super::*;

impl Session {
    /// Closes gracefully (see [`Connection::close`]), once every committed frame went and the
    /// peer finished reading what it was lent by rendezvous (with
    /// [`SessionConfig::keep_unconfirmed`], once its application took everything), waiting at
    /// most `close_timeout` for that: [`Error::Unread`](crate::Error::Unread) says how many
    /// lent messages it had not read by then (the connection is closed all the same). The
    /// close message tells the peer how many of its messages we took.
    pub fn close(self) -> Result<()> {
        let keep = self.machine.send.keeps_copies();
        self.close_inner(keep).0
    }

    /// [`Session::close`], waiting (at most `close_timeout`) until the peer's application took
    /// every message, with or without copies kept: what it comes to, the delivery record at
    /// the end, and the messages not taken (copies, with [`SessionConfig::keep_unconfirmed`]),
    /// in order.
    pub fn close_with_record(self) -> Closed {
        let (result, delivery, unconfirmed) = self.close_inner(true);
        Closed {
            result,
            delivery,
            unconfirmed,
        }
    }

    /// [`Session::close`], returning with its outcome the delivery record at the end and,
    /// with [`SessionConfig::keep_unconfirmed`], the messages the peer's application was not
    /// seen to take (committed ones never sent included), without waiting for its record
    /// as [`Session::close_with_record`] does.
    pub fn close_with_delivery(self) -> Closed {
        let keep = self.machine.send.keeps_copies();
        let (result, delivery, unconfirmed) = self.close_inner(keep);
        Closed {
            result,
            delivery,
            unconfirmed,
        }
    }

    pub(super) fn close_inner(mut self, record: bool) -> (Result<()>, Delivery, Vec<Envelope>) {
        // One clock for the whole close (`peer/close.rs`): what it waits for here and the
        // connection's own close spend the same `close_timeout`.
        let closing = Closing::begin(Instant::now(), self.conn.config().close_timeout, record);
        // Answers given before the close go before it.
        self.queue_replies();
        let waited = self.machine.close_wait(&closing, &mut self.conn);
        if let Ok(w) = &waited {
            let mut calls = call::lock(&self.calls);
            for _ in 0..w.dropped {
                calls.answer_dropped();
            }
        }
        // Answers that found no room in time: their callers time out.
        let lost = self.machine.outbox.clear();
        self.drop_replies(lost);
        self.machine.learn_note(&self.conn);
        let delivery = self.machine.send.delivery(None);
        let unsent = self.machine.send.committed_waiting();
        let unconfirmed = self.machine.send.take_unconfirmed();
        // The connection's close whatever came before (a failed one says so at once).
        let closed = self.conn.close_by(closing.deadline());
        let result = waited.and_then(|w| {
            closed?;
            unread_error(w.unread)?;
            crate::error::unsent_error(unsent)
        });
        (result, delivery, unconfirmed)
    }
}

/// How a [`Session::close_with_record`] ended.
#[derive(Debug)]
#[non_exhaustive]
pub struct Closed {
    /// What [`Session::close`] would have returned.
    pub result: Result<()>,
    /// The delivery record at the end: `delivery.taken == delivery.sent` when the peer's
    /// application took everything.
    pub delivery: Delivery,
    /// The messages it did not take, in order (copies kept with
    /// [`SessionConfig::keep_unconfirmed`]; none without it).
    pub unconfirmed: Vec<Envelope>,
}
