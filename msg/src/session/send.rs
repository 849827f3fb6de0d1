//! A session's sends: blocking, bounded, without waiting, committed; flushes and the
//! solicitation rule.

use super::*;

impl Session {
    /// Sends `m`, solicited or not as its type says ([`Message::SOLICITED`]).
    pub fn send<M: Message>(&mut self, m: &M) -> Result<()> {
        self.send_as(m, M::SOLICITED)
    }

    /// Sends `m`, solicited or not as given (the policy may still solicit it). Encoded
    /// straight into a registered send buffer when it fits; larger messages are fragmented,
    /// only their last fragment solicited.
    pub fn send_as<M: Message>(&mut self, m: &M, solicited: bool) -> Result<()> {
        self.sending(None, (), None, |s| {
            s.machine.send_as(&mut s.conn, m, solicited)
        })
    }

    /// Sends a batch: every message unsolicited but the last, which is solicited. One
    /// wake-up for the whole batch. Small messages go packed, as many to a frame as fit the
    /// peer's receive buffer: one buffer and one credit of the peer's per frame, not per
    /// message.
    pub fn send_batch<'a, M: Message + 'a>(
        &mut self,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> Result<usize> {
        self.machine.send_batch(&mut self.conn, batch)
    }

    /// If anything went unsolicited since the last solicited frame, sends a payload-less
    /// solicited frame so that the receiver looks now. Call it when a burst ends.
    pub fn flush(&mut self) -> Result<()> {
        self.sending(None, (), None, |s| s.machine.flush(&mut s.conn))
    }

    /// Sends `m` as [`Session::send_as`] does, but waits at most `timeout` for the peer's
    /// credit and a send slot: `Ok(false)`, nothing sent, if none came in time.
    /// `Duration::ZERO` never waits. A message too large for one frame has its first frame
    /// bounded so; once that is there, the rest wait as long as it takes (a message is never
    /// left half sent).
    pub fn send_timeout<M: Message>(
        &mut self,
        m: &M,
        solicited: bool,
        timeout: Duration,
    ) -> Result<bool> {
        self.sending(Some(timeout), true, Some(false), |s| {
            peer::in_time(
                s.machine
                    .send_within(&mut s.conn, m, solicited, Some(timeout)),
            )
        })
    }

    /// Sends `m` if it can go without waiting (see [`Session::send_as`] for `solicited`):
    /// `Ok(false)`, nothing of it sent, if the peer has no credit or no send slot is free.
    /// A message needing several frames is committed once its first frame goes; the rest
    /// follow as credits come, driven by any later call (a [`Session::step`] included),
    /// before anything sent after it. For event loops and async runtimes: it never blocks.
    pub fn try_send_as<M: Message>(&mut self, m: &M, solicited: bool) -> Result<bool> {
        self.sending(Some(Duration::ZERO), true, Some(false), |s| {
            s.machine.learn_note(&s.conn);
            s.machine.send.try_send_as(&mut s.conn, m, solicited)
        })
    }

    /// Commits `m` to go, without waiting: it is sent now if it can go, else encoded
    /// ([`crate::Bulk`] payloads by reference) and queued to go before anything sent later,
    /// as credits come, driven by any later call that sends, flushes, steps or closes. Only
    /// an error (too large, not encodable, the connection failed) leaves it unsent; once
    /// this returned `Ok`, the message is the session's to deliver (see
    /// [`Session::delivery`]; a message committed but never sent because the connection
    /// ended is among [`Session::take_unconfirmed`]'s). For the async layer's
    /// reserve-then-send: wait for [`Session::ready_to_send`], then commit.
    pub fn commit_as<M: Message>(&mut self, m: &M, solicited: bool) -> Result<()> {
        self.machine.learn_note(&self.conn);
        self.machine.send.commit_as(&mut self.conn, m, solicited)
    }

    /// Whether a message can very likely go at once: nothing committed waits before it, the
    /// peer has a credit, and the window of messages not yet confirmed has room. (A send
    /// slot, or rendezvous room for a large message, may still be missing.)
    pub fn ready_to_send(&self) -> bool {
        self.machine.send.queued_frames() == 0
            && self.conn.credits() > 0
            && self.machine.send.has_room()
    }

    /// [`Session::try_send_as`] with the type's own solicitation.
    pub fn try_send<M: Message>(&mut self, m: &M) -> Result<bool> {
        self.try_send_as(m, M::SOLICITED)
    }

    /// Whether a sent message's frames are still waiting for credits (see
    /// [`Session::try_send_as`]).
    pub fn has_queued_frames(&self) -> bool {
        self.machine.send.queued_frames() > 0
    }

    /// Whether anything went unsolicited since the last solicited frame.
    pub fn unsolicited_pending(&self) -> bool {
        self.machine.send.pending()
    }

    /// [`Session::flush`] without waiting: sends the committed frames and the flush that can
    /// go now; whether nothing is left to send (no frame queued, nothing unsolicited unflushed).
    pub fn try_flush(&mut self) -> Result<bool> {
        self.machine.send.send_committed(&mut self.conn)?;
        self.machine
            .send
            .flush_within(&mut self.conn, Some(Duration::ZERO))?;
        Ok(!self.machine.send.pending() && self.machine.send.queued_frames() == 0)
    }

    /// Whether unsolicited sends may wait for a solicited one within a bound
    /// ([`SessionConfig::max_unsolicited_delay`] set). Code that shares the session between
    /// threads or tasks solicits a message sent while a receiver waits unless this holds
    /// (see [`Session::split`]).
    pub fn delays_unsolicited(&self) -> bool {
        self.machine.send.delay_allowed()
    }

    /// Whether a message its sender asked to solicit (`requested`) or not goes solicited when
    /// another thread or task may be asleep on this session (`others_waiting`): see
    /// [`crate::policy::solicit_for`], the one rule code that shares a session follows.
    pub fn solicit_for(&self, requested: bool, others_waiting: bool) -> bool {
        crate::policy::solicit_for(requested, others_waiting, self.delays_unsolicited())
    }
}
