//! A hub's graceful close of one connection: the close message after everything sent, then the
//! goodbye, within `close_timeout` (the sequence is `drive::start_close`'s, as a connection's).

use std::time::Instant;

use rdmsg_verbs::deadline_after;

use super::{PeerId, RawHub, RawHubEvent};
use crate::drive;
use crate::error::{Error, Failure, Result};

impl RawHub {
    /// Closes `peer` gracefully and waits until it is closed: see [`RawHub::start_close`]. Waits
    /// (driving the hub) until the close message is delivered, at most `close_timeout`
    /// ([`Error::Timeout`]).
    pub fn close(&mut self, peer: PeerId) -> Result<()> {
        let deadline = deadline_after(self.begin_turn(), self.config.conn.close_timeout);
        self.close_by(peer, deadline)
    }

    /// [`RawHub::close`] that ends by `deadline` rather than `close_timeout` from now (see
    /// [`RawHub::start_close_by`]).
    pub fn close_by(&mut self, peer: PeerId, deadline: Instant) -> Result<()> {
        self.start_close_by(peer, deadline)?;
        let timeout = self.config.conn.close_timeout;
        loop {
            // Released already: its `Disconnected` event, queued, says how it ended.
            let Ok(slot) = self.find(peer) else {
                return match self.events.iter().find_map(|ev| match ev {
                    RawHubEvent::Disconnected {
                        peer: p, failure, ..
                    } if *p == peer => Some(*failure),
                    _ => None,
                }) {
                    Some(f) => crate::core::close_outcome(f, timeout),
                    None => Ok(()),
                };
            };
            let core = &self.slot(slot).core;
            if let Some(ended) = core.close_result(timeout) {
                return ended;
            }
            let left = core.time_to_next(self.clock.now());
            self.wait_for_progress(left, true)?;
        }
    }

    /// Starts closing `peer` gracefully: a close message after everything sent so far (once
    /// a credit is there: waits for one, driving the hub, at most `close_timeout`); nothing
    /// more may be sent to it. Once the message is delivered the hub says goodbye on the
    /// bootstrap stream and reports [`RawHubEvent::Disconnected`] with [`Failure::Closed`]; the
    /// peer receives everything, then [`Failure::PeerClosed`]. If it is not delivered within
    /// `close_timeout`, or no credit came for it by then, the connection is failed with
    /// [`Failure::CloseTimedOut`]; if the peer's stream ended without a goodbye (it went
    /// without closing), with [`Failure::PeerVanished`] 50 ms after that end. Keep driving
    /// the hub until then: dropping it first fails the peer as vanished.
    pub fn start_close(&mut self, peer: PeerId) -> Result<()> {
        let deadline = deadline_after(self.begin_turn(), self.config.conn.close_timeout);
        self.start_close_by(peer, deadline)
    }

    /// [`RawHub::start_close`] whose close ends by `deadline` rather than `close_timeout`
    /// from now: for a layer above whose close began earlier and waited for other things
    /// first (the peer's reads of what it was lent, queued messages), so that the whole close
    /// lasts one `close_timeout`. The wait for a credit and the close message's deadline
    /// both spend what is left. A close that found no credit by then has ended all the same:
    /// the connection is failed with [`Failure::CloseTimedOut`] ([`Error::Timeout`] here, its
    /// `Disconnected` follows), rather than left open with nobody closing it.
    pub fn start_close_by(&mut self, peer: PeerId, deadline: Instant) -> Result<()> {
        // A resumable session: a lost connection ends it from now on; a suspended one ends
        // now (its `Disconnected` is queued).
        if self.session_closing(peer) {
            return Ok(());
        }
        let slot = self.live_slot(peer)?;
        let timeout = self.config.conn.close_timeout;
        let left = deadline.saturating_duration_since(self.begin_turn());
        match self.wait_to_send(slot, peer, Some(left)) {
            Ok(()) => {}
            Err(Error::Timeout(_)) => {
                // Still ours: a wait that timed out left it as it was.
                if let Ok(slot) = self.live_slot(peer) {
                    self.fail(slot, Failure::CloseTimedOut);
                    self.schedule(slot);
                }
                return Err(Error::timeout(
                    "closing",
                    crate::error::WAIT_CLOSE_CREDIT,
                    timeout,
                ));
            }
            Err(e) => return Err(e),
        }
        let now = self.clock.now();
        let started = drive::start_close(&mut self.queues(slot), deadline, now)?;
        assert!(started, "wait_to_send ensured a credit");
        self.schedule(slot);
        Ok(())
    }
}
