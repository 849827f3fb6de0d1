//! A hub's peers that outlive their connections ([`rdmsg_transport::Config::resume_window`]
//! on both sides): the typed half of the transport hub's resumable sessions.
//!
//! The transport reports a lost connection as [`RawHubEvent::Suspended`] (after everything
//! it delivered): the peer's state stays, with its calls, outbox and copies of what the peer
//! had not taken ([`PeerMachine::suspend`]); messages already queued for the application
//! count as taken, as they will be handed out. Posts queue in the outbox, blocking sends
//! wait (within their timeouts) for the resume. On [`RawHubEvent::Resumed`] each side sends
//! its count of the other's messages taken ([`frame::RESUME`]); the peer's count, its first
//! frame on the new connection, sends again what it had not taken, in order, under the same
//! numbers ([`PeerMachine::resume`]). A window that runs out or a peer that restarted is the
//! transport's `Disconnected`, handled as any.
//!
//! [`RawHubEvent::Suspended`]: rdmsg_transport::RawHubEvent::Suspended
//! [`RawHubEvent::Resumed`]: rdmsg_transport::RawHubEvent::Resumed

use super::*;
use crate::error::Unresumable;
use crate::frame;
use crate::trace::trace_event;

/// A peer whose connection was lost, until its session goes on.
#[derive(Debug)]
pub(super) struct Suspension {
    since: Instant,
    /// Our count of the peer's messages taken when it was lost: told the new connection.
    taken: u32,
    /// The new connection is up and our count went: the peer's count is its next frame.
    resumed: bool,
}

impl Hub {
    /// Whether `peer`'s connection was lost and its session waits for a new one (or for the
    /// peer's count on it).
    pub fn is_suspended(&self, peer: PeerId) -> bool {
        self.peers.get(peer).is_some_and(|s| s.suspension.is_some())
    }

    /// The transport suspended `peer`'s session: see the module's documentation.
    pub(super) fn suspend_peer(&mut self, peer: PeerId, last_note: Option<u32>) {
        // Its messages queued for the application will be handed out: they count as taken.
        let queued = self
            .ready
            .iter()
            .rev()
            .find_map(|(ev, seq)| seq.filter(|_| ev.peer() == Some(peer)));
        let Some(state) = self.peers.get_mut(peer) else {
            return;
        };
        if let Some(seq) = queued {
            state.machine.recv.mark_taken(seq);
        }
        let taken = state.machine.suspend(last_note);
        state.suspension = Some(Suspension {
            since: Instant::now(),
            taken,
            resumed: false,
        });
        state.listed = false;
        trace_event!(WARN, peer = %peer, taken, "peer suspended");
    }

    /// `peer`'s session goes on over a new connection: our count goes first.
    pub(super) fn peer_resumed(&mut self, peer: PeerId) {
        let patience = self.transport.config().conn.handshake_timeout;
        let Some(taken) = self
            .peers
            .get(peer)
            .and_then(|s| s.suspension.as_ref())
            .map(|s| s.taken)
        else {
            return;
        };
        // A failure of the new connection at once: the transport suspends the session again
        // (or ends it), which its next event says.
        let sent =
            self.transport
                .send_timeout(peer, &frame::resume_frame(taken), true, Some(patience));
        if matches!(sent, Ok(true)) {
            if let Some(s) = self.peers.get_mut(peer).and_then(|s| s.suspension.as_mut()) {
                s.resumed = true;
            }
        }
    }

    /// A frame of a suspended `peer`: its count of our messages taken, once the new
    /// connection is up; anything else (or a count that cannot be true) ends the peer: a
    /// `BadFrame` says why, and the connection is closed.
    pub(super) fn resume_frame_came(&mut self, peer: PeerId, msg: rdmsg_transport::Received) {
        let count = frame::resume_count(msg.bytes());
        drop(msg);
        let Some(state) = self.peers.get_mut(peer) else {
            return;
        };
        let Some(susp) = state.suspension.as_ref().filter(|s| s.resumed) else {
            // What the old connection still brought: it comes again.
            return;
        };
        let since = susp.since;
        let resumed = match count {
            Some(count) => state.machine.resume(count),
            None => Err(Error::CannotResume(Unresumable::NoCount)),
        };
        match resumed {
            Ok(again) => {
                state.suspension = None;
                state.suspended_for += since.elapsed();
                let _ = again;
                trace_event!(INFO, peer = %peer, again, "peer resumed");
                // What goes again goes now, as far as credits allow; the outbox after it.
                if let Some((state, mut link)) = self.split(peer) {
                    let _ = state.machine.send.send_committed(&mut link);
                }
                let (listed, outboxed) = match self.peers.get_mut(peer) {
                    Some(s) => (s.join_list(), !s.machine.outbox.is_empty()),
                    None => (false, false),
                };
                if listed {
                    self.unflushed.push(peer);
                }
                if outboxed && !self.outboxed.contains(&peer) {
                    self.outboxed.push(peer);
                }
            }
            Err(error) => {
                trace_event!(WARN, peer = %peer, error = %error, "peer not resumed");
                self.ready
                    .push_back((HubEvent::BadFrame { peer, error }, None));
                // Its end is the transport's Disconnected.
                let _ = self.transport.start_close(peer);
            }
        }
    }

    /// Whether `peer`'s session is suspended or about to be (its connection failed for a
    /// reason a network can cause, and the transport will say so once it is released).
    pub(super) fn resuming(&self, peer: PeerId) -> bool {
        self.is_suspended(peer) || self.transport.will_resume(peer)
    }

    /// Runs a send `f` to `peer` (waiting at most `timeout`, as [`Hub::with_sender_waiting`]);
    /// if the peer's connection was lost and its session resumes, waits until it resumed
    /// (within the same time) and runs `f` again, unless the message went before the loss
    /// (it was numbered: it is among those sent again). `went` is what `f` returns for a
    /// message that went, `not_yet` what it returns when the time ran out first (`None`: the
    /// error).
    pub(super) fn with_sender_resuming<T>(
        &mut self,
        peer: PeerId,
        timeout: Option<Duration>,
        went: T,
        not_yet: Option<T>,
        mut f: impl FnMut(&mut SendSide, &mut HubPeerIo<'_>) -> Result<T>,
    ) -> Result<T> {
        let (mut went, mut not_yet) = (Some(went), not_yet);
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            let left = match deadline {
                Some(Some(d)) => Some(d.saturating_duration_since(Instant::now())),
                _ => timeout,
            };
            let mut numbered = false;
            let out = self.with_sender_waiting(peer, left, |s, link| {
                // Committed messages go before ours: ours went if more than they were numbered.
                let (seq, queued) = (s.next_seq(), s.committed_waiting());
                let r = f(s, link);
                numbered = s.next_seq().wrapping_sub(seq) as usize > queued;
                r
            });
            let e = match out {
                Err(e) if self.resuming(peer) => e,
                r => return r,
            };
            let d = *deadline
                .get_or_insert_with(|| timeout.and_then(|t| Instant::now().checked_add(t)));
            let resumed = self.wait_resumed(peer, d)?;
            if numbered {
                return Ok(went.take().expect("once"));
            }
            if !resumed {
                let _ = e;
                return not_yet.take().ok_or_else(|| {
                    rdmsg_transport::Error::timeout(
                        "sending",
                        "the peer's session to resume",
                        timeout.unwrap_or_default(),
                    )
                    .into()
                });
            }
            if self.peers.get(peer).is_none() {
                // The session ended (its Disconnected is queued).
                return Err(e);
            }
        }
    }

    /// Waits until `peer`'s session is no longer suspended (resumed, or ended), at most until
    /// `deadline`; taking in what comes meanwhile. `Ok(false)` if the deadline came first.
    pub(super) fn wait_resumed(&mut self, peer: PeerId, deadline: Option<Instant>) -> Result<bool> {
        while self.resuming(peer) {
            while let Some(raw) = self.transport.queued_event() {
                self.take(raw);
            }
            if !self.resuming(peer) {
                break;
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(false);
            }
            self.transport.wait(left)?;
        }
        Ok(true)
    }
}
