//! A hub's closes of its peers: the one close of `peer/close.rs` (`Closing`), blocking or
//! driven by the hub's turns.

use super::*;

impl Hub {
    /// Closes `peer` gracefully (see [`rdmsg_transport::RawHub::close`]): it receives everything
    /// sent so far, then [`Failure::PeerClosed`]; here [`HubEvent::Disconnected`] follows with
    /// [`Failure::Closed`]. As [`crate::Session::close`] does, within one `close_timeout`: its
    /// outbox and committed messages go first, then the close waits for the peer to finish
    /// reading what it was lent by rendezvous (with
    /// [`SessionConfig::keep_unconfirmed`], for its application to take everything).
    /// [`Error::Unread`] says how many lent messages it had not read by then, and
    /// [`Error::Unsent`] how many messages found no room (the connection is closed all the
    /// same).
    pub fn close(&mut self, peer: PeerId) -> Result<()> {
        let record = self.config.keep_unconfirmed.is_some();
        let timeout = self.transport.config().conn.close_timeout;
        let now = Instant::now();
        let closing = Closing::begin(now, timeout, record);
        if self.is_suspended(peer) {
            // Its connection is lost: closing ends its session (its `Disconnected` follows,
            // after `Unconfirmed` with the copies the peer had not taken).
            return Ok(self.transport.start_close_by(peer, closing.deadline())?);
        }
        // Answers given on other threads join the outbox first.
        self.queue_replies();
        let left = closing.deadline().saturating_duration_since(now);
        let waited = self.with_peer_waiting(peer, Some(left), |machine, io| {
            machine.close_wait(&closing, io)
        });
        let unsent = self.peers.get_mut(peer).map_or(0, |state| {
            state.machine.send.committed_waiting() + state.machine.outbox.clear()
        });
        // The transport's close (a credit, then the acknowledgement) spends what is left,
        // whatever came before (a peer still connecting is closed too).
        let closed = self.transport.close_by(peer, closing.deadline());
        waited.and_then(|w| {
            closed?;
            unread_error(w.unread)?;
            unsent_error(unsent)
        })
    }

    /// Starts closing `peer` gracefully without waiting (see
    /// [`rdmsg_transport::RawHub::start_close`]); its [`HubEvent::Disconnected`] follows. The
    /// same close as [`Hub::close`], driven by the hub's later calls: once its outbox and
    /// committed messages went and the peer read what it was lent (at most
    /// `close_timeout`), the transport's close starts; lent messages it had not read by then
    /// are a [`HubEvent::Unread`], and what its outbox still holds then is counted in
    /// [`OutboxStats::dropped`].
    pub fn start_close(&mut self, peer: PeerId) -> Result<()> {
        let record = self.config.keep_unconfirmed.is_some();
        let timeout = self.transport.config().conn.close_timeout;
        let now = Instant::now();
        let closing = Closing::begin(now, timeout, record);
        let Some(state) = self.peers.get_mut(peer) else {
            // Nothing of ours waits for it.
            return Ok(self.transport.start_close_by(peer, closing.deadline())?);
        };
        state.closing = Some(closing);
        if !self.closing.contains(&peer) {
            self.closing.push(peer);
        }
        // At once if nothing waits; else as the hub's calls drive it.
        self.finish_closes(now);
        Ok(())
    }

    /// When the first close waiting for its peer runs out of time.
    pub(super) fn earliest_close(&self) -> Option<Instant> {
        self.closing
            .iter()
            .filter_map(|&p| self.peers.get(p).and_then(|s| s.closing))
            .map(|c| c.deadline())
            .min()
    }

    /// Starts the transport's close of the peers whose close is due (everything of ours
    /// went and the peer is done reading, or time ran out); asks those waiting for the
    /// record about what went.
    pub(super) fn finish_closes(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.closing.len() {
            let peer = self.closing[i];
            let Some(state) = self.peers.get_mut(peer) else {
                self.closing.swap_remove(i);
                continue;
            };
            let Some(closing) = state.closing else {
                self.closing.swap_remove(i);
                continue;
            };
            if !closing.due(now, &state.machine.send, &state.machine.outbox) {
                if closing.ask(&mut state.machine.send, &state.machine.outbox) && state.join_list()
                {
                    self.unflushed.push(peer);
                }
                i += 1;
                continue;
            }
            state.closing = None;
            self.closing.swap_remove(i);
            // What found no room in time is counted dropped.
            state.machine.outbox.clear();
            let messages = state.machine.send.lent();
            if messages > 0 {
                self.ready
                    .push_back((HubEvent::Unread { peer, messages }, None));
            }
            // The transport's close spends what is left of the time this one began with
            // (none, if it ran out waiting for the peer: then only a credit there now lets
            // the close message go). A peer gone meanwhile: its Disconnected tells.
            let _ = self.transport.start_close_by(peer, closing.deadline());
        }
    }
}
