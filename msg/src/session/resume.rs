//! A session that outlives its connection ([`Config::resume_window`] on both sides).
//!
//! When the connection is lost for a reason a network can cause
//! ([`Failure::may_resume`]), the session *suspends* instead of failing: what the peer's
//! application has not taken of ours stays in the record's copies, what arrived of the
//! peer's and was not taken is dropped (it comes again), calls keep waiting, the outbox keeps
//! its messages ([`PeerMachine::suspend`]). The transport's [`Resume`] brings a new
//! connection (the connecting side dials again, the accepting side's listener hands it
//! over). On it each side first sends a resume frame carrying its count of the other's
//! messages taken ([`frame::RESUME`]) and reads the other's; then each sends again, in
//! order and under their own numbers, the messages the other had not taken
//! ([`PeerMachine::resume`]), and goes on. So every message is handed to the peer's
//! application once. Nothing of this runs while the connection is up: the session notices
//! a loss where it notices any failure, in its error paths.
//!
//! [`Config::resume_window`]: rdmsg_transport::Config::resume_window
//! [`Failure::may_resume`]: rdmsg_transport::Failure::may_resume

use rdmsg_transport::{Arrival, Failure, Resume};

use super::*;
use crate::error::Unresumable;

/// When a suspension that began at `since` ends (far in the future for a huge window).
fn end_of(since: Instant, window: Duration) -> Instant {
    since
        .checked_add(window)
        .unwrap_or_else(|| since + Duration::from_secs(100 * 365 * 86_400))
}
use crate::frame;
use crate::trace::trace_event;
use crate::Error;

/// How long a call may wait for a resume: not at all (the clock is read only if the session
/// is suspended), or until a deadline (`None`: as the window allows).
#[derive(Debug, Clone, Copy)]
pub(super) enum Until {
    Now,
    At(Option<Instant>),
}

/// A resumable session's state across its connections.
#[derive(Debug)]
pub(super) struct Resuming {
    way: Resume<Connection>,
    /// When the connection was lost (`None`: up).
    since: Option<Instant>,
    /// Our count of the peer's messages taken when it was lost: told the new connection.
    taken: u32,
    /// Time spent suspended, over the suspensions that ended.
    suspended: Duration,
    /// The window ran out or the peer refused: the session failed for good.
    ended: bool,
}

impl Resuming {
    /// See [`Session::successor_waiting`].
    pub(super) fn successor_waiting(&self) -> bool {
        !self.ended && self.way.has_successor()
    }

    pub(super) fn new(way: Resume<Connection>) -> Self {
        Self {
            way,
            since: None,
            taken: 0,
            suspended: Duration::ZERO,
            ended: false,
        }
    }
}

impl Session {
    /// Whether the session resumes after a lost connection (both sides set
    /// [`Config::resume_window`](rdmsg_transport::Config::resume_window)).
    pub fn is_resumable(&self) -> bool {
        self.resume.as_ref().is_some_and(|r| !r.ended)
    }

    /// Whether the session is suspended: its connection was lost and a new one is awaited.
    pub fn is_suspended(&self) -> bool {
        self.suspended
    }

    /// Gives up resuming: from now on a lost connection ends the session, as without
    /// [`Config::resume_window`](rdmsg_transport::Config::resume_window) (the listener
    /// forgets the session, a dialing thread stops).
    /// For drivers that wait on the session's descriptor ([`Session::split`], the tokio
    /// layer), which a resume would change under them.
    pub fn forgo_resume(&mut self) {
        if !self.suspended {
            self.resume = None;
        }
    }

    /// Time spent suspended in all (the current suspension included).
    pub(super) fn time_suspended(&self) -> Duration {
        self.resume.as_ref().map_or(Duration::ZERO, |r| {
            r.suspended + r.since.map_or(Duration::ZERO, |s| s.elapsed())
        })
    }

    /// Whether the connection's failure suspends the session rather than ending it.
    pub(super) fn suspends(&self) -> bool {
        match (&self.resume, self.conn.failure()) {
            (Some(r), Some(f)) => !r.ended && f.may_resume(),
            _ => false,
        }
    }

    /// Whether a new connection waits for a session whose connection still looks up (the
    /// peer noticed the loss first and resumed): looked at only after a wait that brought
    /// nothing.
    pub(super) fn successor_waiting(&self) -> bool {
        self.resume
            .as_ref()
            .is_some_and(Resuming::successor_waiting)
    }

    /// The connection was lost: suspends the session (once per connection) and starts
    /// looking for a new one.
    fn suspend(&mut self) {
        let conn = &self.conn;
        let Some(r) = self.resume.as_mut() else {
            return;
        };
        if r.since.is_some() {
            return;
        }
        let now = Instant::now();
        r.since = Some(now);
        r.taken = self.machine.suspend(conn.peer_note());
        r.way.begin(end_of(now, r.way.window()));
        self.suspended = true;
        trace_event!(
            WARN,
            failure = ?conn.failure(),
            window = ?r.way.window(),
            "session suspended"
        );
    }

    /// The connection failed (or a new one waits for us): suspends the session, then waits
    /// until it resumed on a new connection (`Ok(true)`) or `deadline` passed (`Ok(false)`;
    /// `None`: as long as the window allows). An error ends the session: the window ran
    /// out (the connection's failure, as without resume), the peer refused the resume or
    /// gave a count that cannot be true; the calls and the outbox then end as on any
    /// failure.
    pub(super) fn resume_until(&mut self, until: Until) -> Result<bool> {
        let deadline = match until {
            Until::Now => Some(Instant::now()),
            Until::At(d) => d,
        };
        self.suspend();
        loop {
            let Some(r) = self.resume.as_mut() else {
                return Ok(true);
            };
            let Some(since) = r.since else {
                return Ok(true);
            };
            let end = end_of(since, r.way.window());
            let now = Instant::now();
            if now >= end {
                let f = self.conn.failure();
                let e = rdmsg_transport::Error::Connection(f.unwrap_or(Failure::PeerVanished));
                return self.resume_failed(e.into());
            }
            let until = deadline.map_or(end, |d| d.min(end));
            match r.way.take(Some(until.saturating_duration_since(now))) {
                None if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(false),
                None => {}
                Some(Err(e)) if e.refuses_resume() => {
                    return self.resume_failed(Error::CannotResume(Unresumable::UnknownSession));
                }
                // The window ran out while dialing (or dialing failed for good): the session
                // fails as it would have without resume.
                Some(Err(_)) => {
                    let f = self.conn.failure().unwrap_or(Failure::PeerVanished);
                    return self.resume_failed(rdmsg_transport::Error::Connection(f).into());
                }
                Some(Ok(next)) => match self.adopt(next) {
                    Ok(()) => return Ok(true),
                    Err(e @ Error::CannotResume(_)) => return self.resume_failed(e),
                    // The new connection failed too: look for another.
                    Err(e) => {
                        let _ = &e;
                        trace_event!(WARN, error = %e, "resume attempt failed");
                        if let Some(r) = self.resume.as_mut() {
                            r.way.begin(end);
                        }
                    }
                },
            }
        }
    }

    /// The session cannot resume: it fails as it would have without resume, with `e`.
    fn resume_failed(&mut self, e: Error) -> Result<bool> {
        if let Some(r) = self.resume.as_mut() {
            r.ended = true;
            if let Some(since) = r.since.take() {
                r.suspended += since.elapsed();
            }
        }
        self.suspended = false;
        // No later connection can take the session up: the listener forgets it, dialing
        // stops (its time suspended stays in the stats).
        if let Some(r) = self.resume.as_mut() {
            r.way.end();
        }
        trace_event!(WARN, error = %e, "session not resumed");
        let (dropped, lost) = self.machine.connection_failed(self.conn.peer_note());
        let failure = self.conn.failure().unwrap_or(Failure::PeerVanished);
        call::lock(&self.calls).fail_peer(None, &lost, || {
            rdmsg_transport::Error::Connection(failure).into()
        });
        self.drop_replies(dropped);
        Err(e)
    }

    /// Takes `next` as the session's connection: tells our count, reads the peer's (its
    /// first frame, within the handshake's timeout), and queues again what it had not taken.
    fn adopt(&mut self, mut next: Connection) -> Result<()> {
        let Some(r) = self.resume.as_mut() else {
            return Ok(());
        };
        let patience = next.config().handshake_timeout;
        if !next.send_timeout(&frame::resume_frame(r.taken), true, Some(patience))? {
            return Err(rdmsg_transport::Error::timeout(
                "resuming",
                "a credit for the resume frame",
                patience,
            )
            .into());
        }
        let started = Instant::now();
        let deadline = end_of(started, patience);
        let peer_taken = loop {
            let now = Instant::now();
            match next.recv_any_interruptible_until(Some(deadline), now, |_| false)? {
                Some(Arrival::Message(m)) => match frame::resume_count(m.bytes()) {
                    Some(count) => break count,
                    None => {
                        return Err(Error::CannotResume(Unresumable::NoCount));
                    }
                },
                Some(Arrival::Read(_)) => {}
                None if Instant::now() >= deadline => {
                    return Err(rdmsg_transport::Error::timeout(
                        "resuming",
                        "the peer's resume frame",
                        patience,
                    )
                    .into());
                }
                None => {}
            }
        };
        // The peer's count settles what goes again; a count that cannot be true ends it.
        let again = self.machine.resume(peer_taken)?;
        let _ = again;
        let old = std::mem::replace(&mut self.conn, next);
        drop(old);
        if let Ok(w) = self.conn.waker() {
            self.machine.recv.set_pool_waker(w);
        }
        if self.replies.has_waker() {
            if let Ok(w) = self.conn.waker() {
                self.replies.set_waker(w);
            }
        }
        let r = self.resume.as_mut().expect("checked");
        r.way.watch(&self.conn);
        let suspended = r.since.take().map_or(Duration::ZERO, |s| s.elapsed());
        r.suspended += suspended;
        self.suspended = false;
        trace_event!(
            INFO,
            again,
            suspended = ?suspended,
            taken = peer_taken,
            "session resumed"
        );
        // What goes again goes now, as far as credits allow; the rest with the next call
        // (which also reports a failure of the new connection).
        let _ = self.machine.send.send_committed(&mut self.conn);
        Ok(())
    }

    /// Runs a send `op`; if the connection was lost and the session suspends, waits until
    /// it resumed (at most `patience` more; `None`: as the window allows) and runs `op`
    /// again, unless the message went before the loss (it was numbered: it is among those
    /// sent again). `went` is what `op` returns for a message that went, `not_yet` what it
    /// returns when `patience` ran out first (`None`: the error).
    // Inlined: every send of a session runs through it; only its error path is resume's.
    #[inline(always)]
    pub(super) fn sending<T>(
        &mut self,
        patience: Option<Duration>,
        went: T,
        not_yet: Option<T>,
        mut op: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        let mut went = Some(went);
        let mut not_yet = not_yet;
        let mut deadline = None;
        loop {
            // Committed messages go before ours: ours went if more than they were numbered.
            let (seq, queued) = (
                self.machine.send.next_seq(),
                self.machine.send.committed_waiting(),
            );
            let e = match op(self) {
                Err(e)
                    if self.resume.is_some()
                        && (self.suspended || self.suspends() || self.successor_waiting()) =>
                {
                    e
                }
                r => return r,
            };
            let numbered = self.machine.send.next_seq().wrapping_sub(seq) as usize > queued;
            let deadline = *deadline
                .get_or_insert_with(|| patience.and_then(|p| Instant::now().checked_add(p)));
            let resumed = self.resume_until(Until::At(deadline));
            if numbered {
                // It went, under the number after the committed ones: it is among those sent
                // again on the new connection (or, if the session ended, among its copies).
                self.went_as = Some(seq.wrapping_add(queued as u32));
                return Ok(went.take().expect("once"));
            }
            if !resumed? {
                return not_yet.take().ok_or(e);
            }
        }
    }
}
