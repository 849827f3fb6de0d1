//! A hub's resumable sessions ([`Config::resume_window`](crate::Config::resume_window) on
//! both sides): the token and handshake of a single connection's resume
//! ([`crate::resume`]), driven by the hub.
//!
//! A session keeps the [`PeerId`] of its first connection (its *name*) across its
//! connections: that slot's index stays reserved for it (so no other connection is ever
//! given the name's index), and each later connection answers to the name. When a session's
//! connection ends for a reason a network can cause ([`Failure::may_resume`]), the hub
//! reports [`RawHubEvent::Suspended`] instead of `Disconnected`, after everything the
//! connection delivered. The connecting side dials the same address again from a thread
//! (the jittered backoff of a connection's resume) and runs the resume's handshake inside
//! the hub; the accepting side waits for the peer's. The new connection is
//! [`RawHubEvent::Resumed`] under the name. A session whose window runs out is
//! `Disconnected` with the failure that suspended it; one whose peer refuses the resume (it
//! restarted) with [`Failure::ResumeRefused`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::{PeerId, RawHub, RawHubEvent};
use crate::error::{Error, Failure};
use crate::handshake::Resumption;
use crate::pool::Waker;
use crate::resume::{dial_until, KnowsSessions, Token, CONNECT_ATTEMPT};

/// The tokens of the sessions a hub may resume, for the check a resume's handshake makes
/// before anything is set up for it.
#[derive(Default)]
pub(super) struct Known(Mutex<HashSet<Token>>);

impl KnowsSessions for Known {
    fn knows(&self, token: &Token) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(token)
    }
}

/// Streams the dialing threads connected, waiting for the hub to run their handshakes.
#[derive(Default)]
struct Dialed {
    streams: Mutex<Vec<(Token, TcpStream)>>,
    any: AtomicBool,
}

/// One resumable session.
struct Session {
    /// The id the application knows it by: its first connection's.
    name: PeerId,
    /// The slot of its connection, while it has one.
    slot: Option<usize>,
    /// Where the connecting side dials again (`None`: this side accepted it).
    dial: Option<SocketAddr>,
    window: Duration,
    suspended: Option<Suspension>,
    /// A new connection (the peer resumed before this side saw the old one fail), announced
    /// once the old one is released: its slot and generation.
    successor: Option<(usize, u32)>,
    /// Its new connection, announced ([`RawHubEvent::Resumed`] queued) and not yet handed
    /// out: the name answers to it once the event is taken, so that nothing is sent over it
    /// before the layer above knows of the resume.
    pending: Option<usize>,
    /// The application closes it: a lost connection ends it.
    closing: bool,
    /// Dialing attempts since it was suspended: the backoff goes on from there.
    attempts: u32,
}

struct Suspension {
    until: Instant,
    failure: Failure,
    last_note: Option<u32>,
    /// Set to stop the thread that dials.
    stop: Arc<AtomicBool>,
    /// Set while a thread dials.
    dialing: Arc<AtomicBool>,
}

/// A hub's resumable sessions, by token.
#[derive(Default)]
pub(super) struct HubSessions {
    by_token: HashMap<Token, Session>,
    by_name: HashMap<PeerId, Token>,
    /// Sessions suspended now: at most `max_connections`.
    suspended: usize,
    /// When suspended sessions' windows end, nearest first (hints: a session that resumed or
    /// ended meanwhile is skipped).
    ends: BinaryHeap<Reverse<(Instant, Token)>>,
    dialed: Arc<Dialed>,
    pub(super) known: Arc<Known>,
}

impl std::fmt::Debug for HubSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubSessions")
            .field("sessions", &self.by_token.len())
            .finish_non_exhaustive()
    }
}

impl Drop for HubSessions {
    fn drop(&mut self) {
        for s in self.by_token.values() {
            if let Some(susp) = &s.suspended {
                susp.stop.store(true, Ordering::Release);
            }
        }
    }
}

impl HubSessions {
    /// Whether the session named `peer` is suspended, or resumed and not yet handed out.
    pub(super) fn is_suspended(&self, peer: PeerId) -> bool {
        if self.by_name.is_empty() {
            return false;
        }
        self.by_name
            .get(&peer)
            .and_then(|t| self.by_token.get(t))
            .is_some_and(|s| s.suspended.is_some() || s.pending.is_some())
    }

    /// The nearest end of a suspended session's window.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.ends.peek().map(|Reverse((at, _))| *at)
    }
}

/// How a linked connection is announced.
pub(super) enum Announce {
    /// A new connection ([`RawHubEvent::Connected`]).
    Connected,
    /// A session's new connection ([`RawHubEvent::Resumed`]).
    Resumed,
    /// Once the session's old connection is released.
    Later,
    /// Never: its session ended meanwhile (it is failed).
    Never,
}

impl RawHub {
    /// The session a connection linked at `slot` carries (`session`: the handshake's field,
    /// when both sides agreed to resume; `dial`: where we dialed, if we did): how to announce
    /// it.
    pub(super) fn session_linked(
        &mut self,
        slot: usize,
        session: Option<Resumption>,
        dial: Option<SocketAddr>,
    ) -> Announce {
        let window = self.config.conn.resume_window;
        match (session, window) {
            (Some(Resumption::Offer(token)), Some(window)) => {
                if self.sessions.by_token.contains_key(&token) {
                    // A token in use: this connection is not resumable.
                    return Announce::Connected;
                }
                let name = self.slot(slot).id(slot);
                self.sessions.by_token.insert(
                    token,
                    Session {
                        name,
                        slot: Some(slot),
                        dial,
                        window,
                        suspended: None,
                        successor: None,
                        pending: None,
                        closing: false,
                        attempts: 0,
                    },
                );
                self.sessions.by_name.insert(name, token);
                self.sessions
                    .known
                    .0
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(token);
                self.slot_mut(slot).session = Some(token);
                self.table.reserve(slot);
                Announce::Connected
            }
            (Some(Resumption::Resume(token)), _) => {
                let Some(sess) = self.sessions.by_token.get_mut(&token) else {
                    // The session ended since its token was checked.
                    self.fail(slot, Failure::ResumeRefused);
                    return Announce::Never;
                };
                let (name, old, earlier) = (sess.name, sess.slot, sess.successor.take());
                let generation = self.slot(slot).generation;
                let s = self.slot_mut(slot);
                s.session = Some(token);
                s.name = Some(name);
                if let Some(earlier) = earlier.and_then(|e| self.live(e)) {
                    // Replaced by a newer one: the peer uses the newer.
                    self.fail(earlier, Failure::PeerVanished);
                }
                match old {
                    Some(old) => {
                        // The peer resumed before we saw the old connection fail: it fails now,
                        // and this one is announced once it is released.
                        if let Some(sess) = self.sessions.by_token.get_mut(&token) {
                            sess.successor = Some((slot, generation));
                        }
                        self.fail(old, Failure::PeerVanished);
                        Announce::Later
                    }
                    None => {
                        self.session_resumed(token, slot);
                        Announce::Resumed
                    }
                }
            }
            _ => Announce::Connected,
        }
    }

    /// The slot a `(slot, generation)` names, while it holds that connection.
    fn live(&self, (slot, generation): (usize, u32)) -> Option<usize> {
        self.table
            .slots
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.generation == generation)
            .then_some(slot)
    }

    /// The session `token` names goes on over the connection at `slot` (its name answers
    /// to it once its [`RawHubEvent::Resumed`] is taken: [`RawHub::resumed_taken`]).
    fn session_resumed(&mut self, token: Token, slot: usize) {
        let Some(sess) = self.sessions.by_token.get_mut(&token) else {
            return;
        };
        if let Some(susp) = sess.suspended.take() {
            susp.stop.store(true, Ordering::Release);
            self.stats.resumes += 1;
            self.sessions.suspended -= 1;
        }
        sess.slot = Some(slot);
        sess.successor = None;
        sess.pending = Some(slot);
        sess.attempts = 0;
        crate::trace::hub_resumed(sess.name, slot);
    }

    /// The [`RawHubEvent::Resumed`] of `peer` was taken: its name answers to its new
    /// connection from now on.
    pub(super) fn resumed_taken(&mut self, peer: PeerId) {
        let Some(token) = self.sessions.by_name.get(&peer) else {
            return;
        };
        if let Some(sess) = self.sessions.by_token.get_mut(token) {
            if let Some(slot) = sess.pending.take() {
                if sess.slot == Some(slot) {
                    self.table.alias(peer, slot);
                }
            }
        }
    }

    /// The application closes `peer`: a lost connection ends its session from now on
    /// ([`RawHubEvent::Disconnected`] with [`Failure::Closed`]); a suspended one ends now.
    /// Whether it was lost (nothing more to close).
    pub(super) fn session_closing(&mut self, peer: PeerId) -> bool {
        let Some(&token) = self.sessions.by_name.get(&peer) else {
            return false;
        };
        let Some(sess) = self.sessions.by_token.get_mut(&token) else {
            return false;
        };
        sess.closing = true;
        if sess.suspended.is_some() || sess.pending.is_some() && sess.slot.is_none() {
            self.session_gone(token, Some(Failure::Closed));
            return true;
        }
        // Its connection failed and is being released: the release ends it.
        sess.slot
            .is_some_and(|s| self.slot(s).core.failure().is_some())
    }

    /// An unannounced connection of session `token` at `slot` was released: a successor
    /// waiting for the old connection is no more.
    pub(super) fn unannounced_released(&mut self, token: Token, slot: usize, generation: u32) {
        if let Some(sess) = self.sessions.by_token.get_mut(&token) {
            if sess.successor == Some((slot, generation)) {
                sess.successor = None;
            }
        }
    }

    /// The hub failed: every suspended session ends with it.
    pub(super) fn sessions_failed(&mut self, f: Failure) {
        let suspended: Vec<Token> = self
            .sessions
            .by_token
            .iter()
            .filter(|(_, s)| s.suspended.is_some())
            .map(|(t, _)| *t)
            .collect();
        for token in suspended {
            self.session_gone(token, Some(f));
        }
    }

    /// The connection at `slot`, announced, of the session `token` names, is released with
    /// `failure`: the session is suspended (reported: `None`) if the failure allows and the
    /// hub is sound; else it ends, and the caller reports it disconnected with the failure
    /// returned (`Closed` for a session the application was closing when its connection was
    /// lost).
    pub(super) fn session_released(
        &mut self,
        token: Token,
        slot: usize,
        failure: Failure,
        last_note: Option<u32>,
    ) -> Option<Failure> {
        let now = self.clock.now();
        let fatal = self.fatal.is_some();
        let Some(sess) = self.sessions.by_token.get_mut(&token) else {
            return Some(failure);
        };
        if sess.slot != Some(slot) {
            // A connection the session had already left (a replaced successor).
            return Some(failure);
        }
        sess.slot = None;
        sess.pending = None;
        self.table.unalias(sess.name);
        if sess.closing && failure.may_resume() {
            self.end_session(token);
            return Some(Failure::Closed);
        }
        // One too many suspended ends.
        let full = self.sessions.suspended >= self.config.max_connections as usize;
        if fatal || !failure.may_resume() || full {
            self.end_session(token);
            return Some(failure);
        }
        let until = now
            .checked_add(sess.window)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
        sess.suspended = Some(Suspension {
            until,
            failure,
            last_note,
            stop: Arc::new(AtomicBool::new(false)),
            dialing: Arc::new(AtomicBool::new(false)),
        });
        let (name, successor, dials) = (sess.name, sess.successor.take(), sess.dial.is_some());
        self.sessions.suspended += 1;
        self.sessions.ends.push(Reverse((until, token)));
        self.stats.suspended += 1;
        crate::trace::hub_suspended(name, failure);
        self.events.push_back(RawHubEvent::Suspended {
            peer: name,
            failure,
            last_note,
        });
        if let Some(next) = successor.and_then(|s| self.live(s)) {
            self.session_resumed(token, next);
            self.announce(next, true);
        } else if dials {
            self.dial_again(token);
        }
        None
    }

    /// The session ends: forgotten, its name's slot free once empty, a successor failed.
    fn end_session(&mut self, token: Token) {
        let Some(sess) = self.sessions.by_token.remove(&token) else {
            return;
        };
        self.sessions.by_name.remove(&sess.name);
        if sess.suspended.is_some() {
            self.sessions.suspended -= 1;
        }
        self.sessions
            .known
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&token);
        if let Some(susp) = &sess.suspended {
            susp.stop.store(true, Ordering::Release);
        }
        self.table.unalias(sess.name);
        self.table.unreserve(sess.name.slot as usize);
        if let Some(next) = sess.successor.and_then(|s| self.live(s)) {
            self.fail(next, Failure::ResumeRefused);
        }
    }

    /// A suspended session ends: reported disconnected with `failure` (its own, or the
    /// peer's refusal).
    fn session_gone(&mut self, token: Token, failure: Option<Failure>) {
        let Some(sess) = self.sessions.by_token.get(&token) else {
            return;
        };
        let Some(susp) = &sess.suspended else {
            return;
        };
        let (peer, last_note) = (sess.name, susp.last_note);
        let failure = failure.unwrap_or(susp.failure);
        self.end_session(token);
        self.report_disconnected(peer, failure, last_note);
    }

    /// Suspended sessions whose windows ended by `now` end.
    pub(super) fn expire_sessions(&mut self, now: Instant) {
        while let Some(&Reverse((at, token))) = self.sessions.ends.peek() {
            if at > now {
                return;
            }
            self.sessions.ends.pop();
            let expired = self
                .sessions
                .by_token
                .get(&token)
                .and_then(|s| s.suspended.as_ref())
                .is_some_and(|s| s.until <= now);
            if expired {
                self.session_gone(token, None);
            }
        }
    }

    /// The connecting side of suspended session `token` dials again (a thread, once at a
    /// time).
    fn dial_again(&mut self, token: Token) {
        let patience = self.config.conn.handshake_timeout;
        let Some(sess) = self.sessions.by_token.get_mut(&token) else {
            return;
        };
        // A handshake that failed dials again after the backoff reached so far.
        let first = crate::resume::FIRST_BACKOFF * (1 << sess.attempts.min(5));
        let (Some(addr), Some(susp)) = (sess.dial, &sess.suspended) else {
            return;
        };
        if susp.dialing.swap(true, Ordering::AcqRel) {
            return;
        }
        sess.attempts += 1;
        let Ok(wake) = self.pool.waker() else {
            susp.dialing.store(false, Ordering::Release);
            return;
        };
        let waker = Waker::new(wake);
        let (stop, running, until) = (susp.stop.clone(), susp.dialing.clone(), susp.until);
        let dialed = self.sessions.dialed.clone();
        let spawned = thread::Builder::new()
            .name("rdmsg-hub-resume".into())
            .spawn(move || {
                let dial = |most: Duration| {
                    let most = most.min(CONNECT_ATTEMPT).max(Duration::from_millis(1));
                    TcpStream::connect_timeout(&addr, most).map_err(|source| Error::Connect {
                        addr: addr.to_string(),
                        source,
                    })
                };
                let hand_over = |outcome: crate::error::Result<TcpStream>| {
                    // Done before the hub hears: a handshake that fails at once dials again.
                    running.store(false, Ordering::Release);
                    if let Ok(stream) = outcome {
                        dialed
                            .streams
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push((token, stream));
                        dialed.any.store(true, Ordering::Release);
                    }
                    // The window's end (no stream) is the hub's own deadline.
                    waker.wake();
                };
                dial_until(&dial, patience, first, &hand_over, &stop, until, &running);
            });
        if spawned.is_err() {
            susp.dialing.store(false, Ordering::Release);
        }
    }

    /// Starts the resume handshakes of the streams the dialing threads connected (after
    /// every wake-up: a load when none came).
    #[inline]
    pub(super) fn take_dialed(&mut self) {
        if self.sessions.dialed.any.load(Ordering::Acquire) {
            self.start_dialed();
        }
    }

    fn start_dialed(&mut self) {
        if !self.sessions.dialed.any.swap(false, Ordering::AcqRel) {
            return;
        }
        let streams = std::mem::take(
            &mut *self
                .sessions
                .dialed
                .streams
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (token, stream) in streams {
            let Some(sess) = self.sessions.by_token.get(&token) else {
                continue;
            };
            if sess.suspended.is_none() {
                continue;
            }
            let name = sess.name;
            if self
                .connect_stream_as(stream, Resumption::Resume(token), Some(name))
                .is_err()
            {
                self.dial_again(token);
            }
        }
    }

    /// The handshake of a resume we dialed (session `token`) failed with `error`: a refusal
    /// ends the session, anything else dials again.
    pub(super) fn resume_attempt_failed(&mut self, token: Token, error: &Error) {
        crate::trace::resume_attempt_failed(error);
        if error.refuses_resume() {
            self.session_gone(token, Some(Failure::ResumeRefused));
        } else {
            self.dial_again(token);
        }
    }
}
