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
    /// The new connection is up ([`RawHubEvent::Resumed`] came): every frame of the peer's
    /// from now on is the new connection's, the first its count.
    ///
    /// [`RawHubEvent::Resumed`]: rdmsg_transport::RawHubEvent::Resumed
    up: bool,
    /// Our count went over the new connection.
    told: bool,
    /// The peer's first frame on the new connection: its count (`None`: something else).
    peer_count: Option<Option<u32>>,
}

impl Hub {
    /// Whether `peer`'s connection was lost and its session waits for a new one (or for the
    /// peer's count on it), or is about to (its connection failed for a reason a network can
    /// cause and is being released): sends to it wait, posts queue.
    pub fn is_suspended(&self, peer: PeerId) -> bool {
        self.resumable && (self.suspended_now(peer) || self.transport.will_resume(peer))
    }

    /// Whether `peer` is suspended now (cheap: for every send).
    #[inline]
    pub(super) fn suspended_now(&self, peer: PeerId) -> bool {
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
        // Lost again before the resume was done: the suspension goes on.
        let since = state
            .suspension
            .as_ref()
            .map_or_else(Instant::now, |s| s.since);
        state.suspension = Some(Suspension {
            since,
            taken,
            up: false,
            told: false,
            peer_count: None,
        });
        state.listed = false;
        self.untold.retain(|p| *p != peer);
        trace_event!(WARN, peer = %peer, taken, "peer suspended");
    }

    /// `peer`'s session goes on over a new connection: our count goes first.
    pub(super) fn peer_resumed(&mut self, peer: PeerId) {
        let Some(susp) = self.peers.get_mut(peer).and_then(|s| s.suspension.as_mut()) else {
            return;
        };
        susp.up = true;
        self.tell_count(peer);
    }

    /// Sends our count to `peer`'s new connection if it can go now (else later:
    /// [`Hub::tell_counts`]), and finishes the resume if the peer's came.
    fn tell_count(&mut self, peer: PeerId) {
        let Some(taken) = self
            .peers
            .get(peer)
            .and_then(|s| s.suspension.as_ref())
            .filter(|s| s.up && !s.told)
            .map(|s| s.taken)
        else {
            return;
        };
        match self
            .transport
            .try_send(peer, &frame::resume_frame(taken), true)
        {
            Ok(true) => {
                if let Some(s) = self.peers.get_mut(peer).and_then(|s| s.suspension.as_mut()) {
                    s.told = true;
                }
                self.untold.retain(|p| *p != peer);
                self.finish_resume(peer);
            }
            // No credit or send slot yet: the next turn tries again.
            Ok(false) => {
                if !self.untold.contains(&peer) {
                    self.untold.push(peer);
                }
            }
            // The new connection failed at once: the transport suspends the session again
            // (or ends it), which its next event says.
            Err(_) => self.untold.retain(|p| *p != peer),
        }
    }

    /// Our counts that found no room on their new connections, tried again.
    pub(super) fn tell_counts(&mut self) {
        for peer in self.untold.clone() {
            self.tell_count(peer);
        }
    }

    /// A frame of a suspended `peer`: what the old connection still brought (dropped: it
    /// comes again), or the new connection's first, the peer's count.
    pub(super) fn resume_frame_came(&mut self, peer: PeerId, msg: rdmsg_transport::Received) {
        let count = frame::resume_count(msg.bytes());
        drop(msg);
        let Some(susp) = self
            .peers
            .get_mut(peer)
            .and_then(|s| s.suspension.as_mut())
            .filter(|s| s.up && s.peer_count.is_none())
        else {
            return;
        };
        susp.peer_count = Some(count);
        self.finish_resume(peer);
    }

    /// Once both counts crossed: the peer's count settles what goes again (a count that
    /// cannot be true, or no count, ends the peer: a `BadFrame` says why, and the
    /// connection is closed).
    fn finish_resume(&mut self, peer: PeerId) {
        let Some(state) = self.peers.get_mut(peer) else {
            return;
        };
        let Some((since, count)) = state
            .suspension
            .as_ref()
            .filter(|s| s.told)
            .and_then(|s| Some((s.since, s.peer_count?)))
        else {
            return;
        };
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
                state.suspension = None;
                self.ready
                    .push_back((HubEvent::BadFrame { peer, error }, None));
                // Its end is the transport's Disconnected.
                let _ = self.transport.start_close(peer);
            }
        }
    }

    /// Runs a send `f` to `peer` (waiting at most `timeout`, as [`Hub::with_sender_waiting`]);
    /// if the peer's connection was lost and its session resumes, waits until it resumed
    /// (within the same time) and runs `f` again, unless the message went before the loss
    /// (it was numbered: it is among those sent again). `went` is what `f` returns for a
    /// message that went, `not_yet` what it returns when the time ran out first (`None`: the
    /// error).
    #[inline]
    pub(super) fn with_sender_resuming<T>(
        &mut self,
        peer: PeerId,
        timeout: Option<Duration>,
        went: T,
        not_yet: Option<T>,
        f: impl FnMut(&mut SendSide, &mut HubPeerIo<'_>) -> Result<T>,
    ) -> Result<T> {
        if !self.resumable {
            // Nothing resumes here: the send as it always was, nothing more per message.
            return self.with_sender_waiting(peer, timeout, f);
        }
        self.send_resuming(peer, timeout, went, not_yet, f)
    }

    /// [`Hub::with_sender_resuming`] of a hub whose peers may resume.
    fn send_resuming<T>(
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
                Err(e) if self.is_suspended(peer) => e,
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
        while self.is_suspended(peer) {
            // What an earlier wait stashed first: its order is older.
            self.take_stashed();
            while let Some(raw) = self.transport.queued_event() {
                self.take(raw);
            }
            self.tell_counts();
            if !self.is_suspended(peer) {
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
