//! Sessions that outlive their connection: the transport's half of a resume.
//!
//! A connection made with [`Config::resume_window`](crate::Config::resume_window) on both sides carries a *session token*
//! (drawn by the connecting side, agreed in the handshake, covered by its MACs when there is
//! a pre-shared key). When the connection is lost for a reason a network can cause
//! ([`Failure::may_resume`](crate::Failure::may_resume)), the typed layer keeps its session
//! and asks its [`Resume`] for a successor: the connecting side dials the same bootstrap
//! address again from a thread of its own, with jittered backoff, presenting the token
//! ([`Resumption::Resume`]); the accepting side's [`Listener`](crate::Listener) matches the
//! token to the session's slot and puts the new connection there instead of returning it
//! from `accept`. A token the listener does not know (its process restarted, the session
//! ended there) is refused with [`Reject::UnknownSession`], which ends the resume. What went
//! over the old connection and what goes again is the typed layer's business.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::handshake::{Reject, TOKEN_LEN};
use std::net::TcpStream;

/// A session's name in the handshake.
pub(crate) type Token = [u8; TOKEN_LEN];

/// First wait of the connecting side before dialing again; it doubles per attempt up to
/// [`MAX_BACKOFF`], each wait drawn at random between half and all of it, so that the many
/// peers of a hub that lost its link do not all dial at once.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// Longest wait between two attempts: a link that comes back is found within about this.
const MAX_BACKOFF: Duration = Duration::from_millis(800);

/// Longest one attempt's TCP connect may take: a SYN lost while the link was down is
/// retried by the kernel only after 1, 3, 7, 15 s, so a new attempt (a fresh SYN) after
/// this finds a link that came back sooner.
pub(crate) const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);

/// Where a session's next connection is put (by the listener, or the thread that dials).
pub(crate) struct Slot<C> {
    next: Mutex<Option<Result<C>>>,
    came: Condvar,
    /// Set while `next` holds something: looked at without the lock.
    full: AtomicBool,
    /// The session's current bootstrap stream (a second handle): cut when a new connection
    /// comes, so that a session that has not seen its connection fail sees it now and takes
    /// the new one (the peer resumed first). Nothing is looked at per message.
    current: Mutex<Option<TcpStream>>,
}

impl<C> Default for Slot<C> {
    fn default() -> Self {
        Self {
            next: Mutex::new(None),
            came: Condvar::new(),
            full: AtomicBool::new(false),
            current: Mutex::new(None),
        }
    }
}

impl<C> Slot<C> {
    pub(crate) fn put(&self, next: Result<C>) {
        let mut slot = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        // A successor not yet taken is replaced: the newer one is the one the peer uses.
        *slot = Some(next);
        self.full.store(true, Ordering::Release);
        self.came.notify_all();
        drop(slot);
        if let Some(s) = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn take(&self, timeout: Option<Duration>) -> Option<Result<C>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut slot = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(next) = slot.take() {
                self.full.store(false, Ordering::Release);
                return Some(next);
            }
            slot = match deadline {
                None => self.came.wait(slot).unwrap_or_else(PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.came
                        .wait_timeout(slot, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

/// Whether a resume's token names a session that may take it: asked by a handshake before
/// anything is set up for the resume.
pub(crate) trait KnowsSessions: Send + Sync {
    fn knows(&self, token: &Token) -> bool;
}

impl fmt::Debug for dyn KnowsSessions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KnowsSessions")
    }
}

impl<C: Send> KnowsSessions for Sessions<C> {
    fn knows(&self, token: &Token) -> bool {
        self.find(token).is_some()
    }
}

/// A listener's resumable sessions, by token.
pub(crate) struct Sessions<C> {
    by_token: Mutex<HashMap<Token, Weak<Slot<C>>>>,
}

impl<C> Default for Sessions<C> {
    fn default() -> Self {
        Self {
            by_token: Mutex::default(),
        }
    }
}

impl<C> fmt::Debug for Sessions<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.by_token.lock().map_or(0, |m| m.len());
        f.debug_struct("Sessions").field("sessions", &n).finish()
    }
}

impl<C> Sessions<C> {
    /// A new resumable session accepted with `token`: its slot. A token already in use (by a
    /// session still alive) is not taken over: `None`, and the connection is not resumable.
    pub(crate) fn register(&self, token: Token) -> Option<Arc<Slot<C>>> {
        let mut map = self.by_token.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(&token).is_some_and(|w| w.strong_count() > 0) {
            return None;
        }
        let slot = Arc::new(Slot::default());
        map.insert(token, Arc::downgrade(&slot));
        Some(slot)
    }

    /// The slot of the session `token` names, if it is alive.
    pub(crate) fn find(&self, token: &Token) -> Option<Arc<Slot<C>>> {
        let map = self.by_token.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(token).and_then(Weak::upgrade)
    }

    fn forget(&self, token: &Token) {
        let mut map = self.by_token.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(token).is_some_and(|w| w.strong_count() == 0) {
            map.remove(token);
        }
        // And any entry left behind by a session that went while a handshake held its slot
        // for a moment.
        map.retain(|_, w| w.strong_count() > 0);
    }
}

/// How a resumable session gets a new connection after its connection was lost: taken from
/// the connection ([`Connection::take_resume`](crate::Connection::take_resume)) by the session that lives on it, and kept
/// across its successors. Dropping it ends the session for resumes: the listener forgets
/// its token, a thread dialing stops.
pub struct Resume<C> {
    token: Token,
    window: Duration,
    slot: Arc<Slot<C>>,
    way: Way<C>,
}

/// Dials a new connection resuming the session, within the time given.
pub(crate) type Dial<C> = Arc<dyn Fn(Duration) -> Result<C> + Send + Sync>;

enum Way<C> {
    /// The connecting side dials again.
    Dial {
        dial: Dial<C>,
        addr: SocketAddr,
        /// Longest one attempt may take (the handshake's timeout).
        patience: Duration,
        /// Set to stop the thread that dials (the session ended or resumed meanwhile).
        stop: Arc<AtomicBool>,
        /// Set while a thread dials; cleared before it hands over its outcome, so that a
        /// session whose new connection failed at once starts dialing again.
        dialing: Arc<AtomicBool>,
    },
    /// The accepting side waits for its listener.
    Accept { sessions: Arc<Sessions<C>> },
}

impl<C> fmt::Debug for Resume<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let way = match &self.way {
            Way::Dial { addr, .. } => format!("dials {addr}"),
            Way::Accept { .. } => "accepts".to_owned(),
        };
        f.debug_struct("Resume")
            .field("window", &self.window)
            .field("way", &way)
            .finish_non_exhaustive()
    }
}

impl<C: Send + 'static> Resume<C> {
    pub(crate) fn dialing(
        dial: Dial<C>,
        addr: SocketAddr,
        patience: Duration,
        token: Token,
        window: Duration,
    ) -> Self {
        Self {
            token,
            window,
            slot: Arc::new(Slot::default()),
            way: Way::Dial {
                dial,
                addr,
                patience,
                stop: Arc::new(AtomicBool::new(false)),
                dialing: Arc::new(AtomicBool::new(false)),
            },
        }
    }

    pub(crate) fn accepted(
        sessions: &Arc<Sessions<C>>,
        slot: Arc<Slot<C>>,
        token: Token,
        window: Duration,
    ) -> Self {
        Self {
            token,
            window,
            slot,
            way: Way::Accept {
                sessions: sessions.clone(),
            },
        }
    }

    /// How long the session may stay suspended ([`Config::resume_window`](crate::Config::resume_window)).
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Whether this side dials the new connection (it connected the first).
    pub fn dials(&self) -> bool {
        matches!(self.way, Way::Dial { .. })
    }

    /// The connection was lost: the connecting side starts dialing again (once; a thread of
    /// its own, with jittered backoff, until it has a connection, is refused, or `until`
    /// passes). The accepting side waits for its listener: nothing to start.
    pub fn begin(&mut self, until: Instant) {
        let Way::Dial {
            dial,
            patience,
            stop,
            dialing,
            ..
        } = &mut self.way
        else {
            return;
        };
        if dialing.swap(true, Ordering::AcqRel) {
            return;
        }
        stop.store(false, Ordering::Release);
        let (dial, patience, stop) = (dial.clone(), *patience, stop.clone());
        let (slot, running) = (self.slot.clone(), dialing.clone());
        let spawned = thread::Builder::new()
            .name("rdmsg-resume".into())
            .spawn(move || {
                let first = FIRST_BACKOFF;
                dial_until(
                    &*dial,
                    patience,
                    first,
                    &|c| slot.put(c),
                    &stop,
                    until,
                    &running,
                );
            });
        if spawned.is_err() {
            dialing.store(false, Ordering::Release);
        }
    }

    /// The new connection, once there (waiting at most `timeout`; `None`: as long as it
    /// takes): `Some(Err)` if the peer refused the resume ([`Reject::UnknownSession`]) or
    /// dialing stopped for good.
    pub fn take(&self, timeout: Option<Duration>) -> Option<Result<C>> {
        self.slot.take(timeout)
    }

    /// Whether a new connection (or the end of dialing) waits to be taken.
    pub fn has_successor(&self) -> bool {
        self.slot.full.load(Ordering::Acquire)
    }

    /// The session's current bootstrap stream (see `Resume::watch`).
    pub(crate) fn watch_stream(&self, stream: Option<TcpStream>) {
        *self
            .slot
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = stream;
    }
}

impl<C> Resume<C> {
    /// The session ended: no new connection can take it up (the listener forgets it, a
    /// thread dialing stops).
    pub fn end(&mut self) {
        match &mut self.way {
            Way::Dial { stop, .. } => stop.store(true, Ordering::Release),
            Way::Accept { sessions } => {
                let sessions = sessions.clone();
                self.slot = Arc::default();
                sessions.forget(&self.token);
            }
        }
    }
}

impl<C> Drop for Resume<C> {
    fn drop(&mut self) {
        // Ours is the only strong handle the listener's entry points to (besides a listener
        // putting a connection right now): it goes with us.
        self.end();
    }
}

impl Error {
    /// Whether the peer refused a resume: it has no such session (it restarted, or the
    /// session ended there), so no attempt can succeed.
    pub fn refuses_resume(&self) -> bool {
        matches!(
            self,
            Error::Rejected(Reject::UnknownSession) | Error::BadHandshake(Reject::UnknownSession)
        )
    }
}

/// The dialing thread: attempts with jittered exponential backoff until one connects, the
/// peer refuses, `stop` is set or `until` passes. The outcome goes to `hand_over` (nothing
/// if stopped).
pub(crate) fn dial_until<C>(
    dial: &(dyn Fn(Duration) -> Result<C> + Send + Sync),
    most: Duration,
    first: Duration,
    hand_over: &dyn Fn(Result<C>),
    stop: &AtomicBool,
    until: Instant,
    running: &AtomicBool,
) {
    // The outcome is handed over first: a session that takes it and finds it failed at once
    // may start another attempt only once this one is done, so that one attempt the peer has
    // not answered yet is not given up for a new one that would cut it.
    let put = |outcome: Result<C>| {
        hand_over(outcome);
        running.store(false, Ordering::Release);
    };
    let mut backoff = first.clamp(FIRST_BACKOFF, MAX_BACKOFF);
    loop {
        // Half to all of the backoff, at random: peers that lost one link spread out.
        let mut r = [0u8; 2];
        let _ = getrandom::fill(&mut r);
        let frac = 0.5 + f64::from(u16::from_le_bytes(r)) / f64::from(u16::MAX) / 2.0;
        let pause = backoff.mul_f64(frac);
        let now = Instant::now();
        if now + pause >= until {
            let left = until.saturating_duration_since(now);
            thread::sleep(left);
            if stop.load(Ordering::Acquire) {
                running.store(false, Ordering::Release);
            } else {
                put(Err(Error::timeout(
                    "resuming the session",
                    "a new connection",
                    left,
                )));
            }
            return;
        }
        thread::sleep(pause);
        if stop.load(Ordering::Acquire) {
            running.store(false, Ordering::Release);
            return;
        }
        let patience = most.min(until.saturating_duration_since(Instant::now()));
        match dial(patience) {
            Ok(conn) => {
                if stop.load(Ordering::Acquire) {
                    running.store(false, Ordering::Release);
                } else {
                    put(Ok(conn));
                }
                return;
            }
            Err(e) if e.refuses_resume() => {
                put(Err(e));
                return;
            }
            Err(_) => backoff = (backoff * 2).min(MAX_BACKOFF),
        }
        if stop.load(Ordering::Acquire) {
            running.store(false, Ordering::Release);
            return;
        }
    }
}

/// A fresh random token for a new resumable session.
pub(crate) fn new_token() -> Result<Token> {
    let mut t = [0u8; TOKEN_LEN];
    getrandom::fill(&mut t).map_err(|e| Error::Bootstrap {
        stage: "drawing a session token",
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(t)
}
