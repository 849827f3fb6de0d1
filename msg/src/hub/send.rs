//! A hub's sends to one peer: blocking, bounded, without waiting; flushes and the
//! solicitation rule.

use super::*;

impl Hub {
    /// Sends `m` to `peer`, solicited or not as its type says ([`Message::SOLICITED`]).
    pub fn send<M: Message>(&mut self, peer: PeerId, m: &M) -> Result<()> {
        self.send_as(peer, m, M::SOLICITED)
    }

    /// Sends `m` to `peer`, solicited or not as given (the peer's policy may still solicit
    /// it); like [`crate::Session::send_as`]. Waits for the peer's credits (and, if it is
    /// still connecting, for its handshake), driving the hub meanwhile.
    pub fn send_as<M: Message>(&mut self, peer: PeerId, m: &M, solicited: bool) -> Result<()> {
        self.with_sender_resuming(peer, None, (), None, |s, link| {
            s.send_as(link, m, solicited)
        })
    }

    /// Sends `m` to `peer` as [`Hub::send_as`] does, but waits at most `timeout` for the
    /// peer's credit and a send slot: `Ok(false)`, nothing sent, if none came in time.
    /// `Duration::ZERO` never waits: for a loop that must go on draining its own receives
    /// (a peer's credits come back only as fast as it reads, and it may be waiting for ours).
    /// A message too large for one frame has its first frame bounded so; once that is there,
    /// the rest of its frames wait as long as it takes (a message is never left half sent).
    pub fn send_timeout<M: Message>(
        &mut self,
        peer: PeerId,
        m: &M,
        solicited: bool,
        timeout: Duration,
    ) -> Result<bool> {
        peer::in_time(
            self.with_sender_resuming(peer, Some(timeout), (), None, |s, link| {
                s.send_within(link, m, solicited, Some(timeout))
            }),
        )
    }

    /// Sends a batch to `peer`: every message unsolicited but the last, which is solicited,
    /// small ones packed several to a frame (see [`crate::Session::send_batch`]).
    pub fn send_batch<'a, M: Message + 'a>(
        &mut self,
        peer: PeerId,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> Result<usize> {
        self.with_sender(peer, |s, link| s.send_batch(link, batch))
    }

    /// If anything went unsolicited to `peer` since the last solicited frame, sends it a
    /// payload-less solicited frame so that it looks now (see [`crate::Session::flush`]).
    pub fn flush(&mut self, peer: PeerId) -> Result<()> {
        self.with_sender_resuming(peer, None, (), None, |s, link| s.flush(link))
    }

    /// [`Hub::flush`] without waiting: sends `peer`'s committed frames and flush if they can
    /// go now; whether nothing is left to send to it.
    pub fn try_flush(&mut self, peer: PeerId) -> Result<bool> {
        self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
            s.send_committed(link)?;
            s.flush_within(link, Some(Duration::ZERO))?;
            Ok(!s.pending() && s.queued_frames() == 0)
        })
    }

    /// Whether unsolicited sends may wait within a bound
    /// ([`SessionConfig::max_unsolicited_delay`]; see [`crate::Session::delays_unsolicited`]).
    pub fn delays_unsolicited(&self) -> bool {
        self.config.max_unsolicited_delay.is_some()
    }

    /// Whether a message its sender asked to solicit (`requested`) or not goes solicited when
    /// another thread or task may be asleep on this hub (`others_waiting`): see
    /// [`crate::policy::solicit_for`].
    pub fn solicit_for(&self, requested: bool, others_waiting: bool) -> bool {
        crate::policy::solicit_for(requested, others_waiting, self.delays_unsolicited())
    }

    /// Sends `m` to `peer` if it can go without waiting (see
    /// [`crate::Session::try_send_as`]): `Ok(false)`, nothing sent, if `peer` has no credit
    /// or is still connecting, or no send slot is free. A fragmented message is committed
    /// once its first frame goes; the rest follow as `peer`'s credits come, on later calls.
    pub fn try_send_as<M: Message>(
        &mut self,
        peer: PeerId,
        m: &M,
        solicited: bool,
    ) -> Result<bool> {
        peer::went(self.with_sender_resuming(
            peer,
            Some(Duration::ZERO),
            true,
            Some(false),
            |s, link| s.try_send_as(link, m, solicited),
        ))
    }

    /// [`Hub::try_send_as`] with the type's own solicitation.
    pub fn try_send<M: Message>(&mut self, peer: PeerId, m: &M) -> Result<bool> {
        self.try_send_as(peer, m, M::SOLICITED)
    }
}
