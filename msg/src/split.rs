//! A session shared by threads: [`Session::split`] gives a sending half (cloneable, for any
//! number of sending threads) and a receiving half, so that a thread blocked in `recv` keeps
//! nobody from sending.
//!
//! Both halves hold the session behind one mutex, taken only for non-blocking steps: nobody
//! sleeps holding it. Of the threads that must wait, one at a time (the *sleeper*) sleeps on
//! the session's descriptor, after a [`Session::step`] that armed its queues; the others wait
//! on a condition variable that the sleeper signals each time it wakes. A thread that moved the
//! connection on while another sleeps (queued a message, took a credit grant) wakes it through
//! the connection's wake-up socket, since what it consumed may be what the sleeper waits for.
//!
//! Credits need no sharing of their own: they live in the one connection, and every send,
//! from whichever thread, takes them under the mutex.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdmsg_transport::{ReadyWatch, Waker};

use crate::codec::Envelope;
use crate::{Message, Result, Session, SessionStats};

/// Longest a waiting thread that is not the sleeper waits before looking again (it is
/// normally signalled much sooner: this only bounds a lost signal's cost).
const FOLLOWER_SLICE: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct SharedSession {
    core: Mutex<SplitState>,
    /// Signalled whenever the sleeper wakes or someone moved the connection on.
    turn: Condvar,
    /// Ends the sleeper's wait.
    waker: Waker,
    /// The session's descriptor, watched by the sleeper (outside the mutex).
    watch: ReadyWatch,
    /// Keeps the watched descriptor open as long as the watch.
    _fd: OwnedFd,
}

#[derive(Debug)]
struct SplitState {
    session: Session,
    /// A thread sleeps on the descriptor.
    sleeping: bool,
    /// The sleeper armed the queues for any completion (a blocked send's grant).
    armed_for_send: bool,
    /// Threads inside `RecvHalf::recv*` waiting for a message.
    receivers_waiting: u32,
}

impl Session {
    /// Splits the session into a sending half and a receiving half that may live on different
    /// threads (both are `Send`; the sending half is also `Sync` and `Clone`, for several
    /// sending threads). [`RecvHalf::reunite`] puts them back together.
    ///
    /// While a receiver waits, a message sent without solicitation goes solicited anyway,
    /// unless [`crate::SessionConfig::max_unsolicited_delay`] is set: the waiting receiver may
    /// be waiting for the answer to exactly that message, and the peer, asleep solicited-only,
    /// would not see it. With the delay set, the waiting receiver flushes when it runs out.
    ///
    /// The halves do not resume after a lost connection yet ([`Session::forgo_resume`]): a
    /// resume would change the descriptor they wait on.
    pub fn split(mut self) -> Result<(SendHalf, RecvHalf)> {
        self.forgo_resume();
        let waker = self.connection().waker()?;
        let fd = self
            .as_fd()
            .try_clone_to_owned()
            .map_err(rdmsg_transport::Error::WakePipe)?;
        let watch = ReadyWatch::new().map_err(rdmsg_transport::Error::from)?;
        watch
            .add(fd.as_fd(), 0)
            .map_err(rdmsg_transport::Error::from)?;
        let shared = Arc::new(SharedSession {
            core: Mutex::new(SplitState {
                session: self,
                sleeping: false,
                armed_for_send: false,
                receivers_waiting: 0,
            }),
            turn: Condvar::new(),
            waker,
            watch,
            _fd: fd,
        });
        Ok((
            SendHalf {
                shared: shared.clone(),
            },
            RecvHalf { shared },
        ))
    }
}

impl SharedSession {
    fn lock(&self) -> MutexGuard<'_, SplitState> {
        // A panic in another thread mid-step leaves the session as consistent as any failed
        // call does: carry on with it.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `attempt` until it gives a value or `deadline` passes (`Ok(None)`), waiting in
    /// between: as the sleeper on the descriptor if nobody is, else for the sleeper's signal.
    fn run<T>(
        &self,
        deadline: Option<Instant>,
        role: Role,
        mut attempt: impl FnMut(&mut SplitState) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        let mut core = self.lock();
        loop {
            let seen = core.session.connection().handled();
            let got = attempt(&mut core);
            if core.session.connection().handled() != seen {
                self.turn.notify_all();
                if core.sleeping {
                    self.waker.wake();
                }
            }
            if let Some(v) = got? {
                return Ok(Some(v));
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            let left = deadline.map(|d| d - now);
            let receiving = role == Role::Receive;
            core.receivers_waiting += u32::from(receiving);
            if core.sleeping {
                if role == Role::Send && !core.armed_for_send {
                    // The sleeper armed for messages only: have it re-arm for our grant.
                    self.waker.wake();
                }
                let slice = left.map_or(FOLLOWER_SLICE, |l| l.min(FOLLOWER_SLICE));
                core = self
                    .turn
                    .wait_timeout(core, slice)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                core.receivers_waiting -= u32::from(receiving);
                continue;
            }
            let busy = match core.session.step() {
                Ok(busy) => busy,
                Err(e) => {
                    core.receivers_waiting -= u32::from(receiving);
                    self.turn.notify_all();
                    return Err(e);
                }
            };
            if busy || (receiving && core.session.has_ready()) {
                core.receivers_waiting -= u32::from(receiving);
                self.turn.notify_all();
                continue;
            }
            core.sleeping = true;
            core.armed_for_send = core.session.connection().send_blocked();
            let limit = crate::drive::earliest(left, core.session.next_timeout());
            drop(core);
            let slept = self.watch.wait(limit);
            core = self.lock();
            core.sleeping = false;
            // The only thread on the descriptor is awake.
            core.session.nobody_waits();
            core.receivers_waiting -= u32::from(receiving);
            self.turn.notify_all();
            slept.map_err(rdmsg_transport::Error::from)?;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Send,
    Receive,
}

/// The sending half of a [split](Session::split) session: `Send + Sync + Clone`, so any number
/// of threads may send at once; each message goes whole, in the order the sends took the
/// session's lock.
#[derive(Debug, Clone)]
pub struct SendHalf {
    shared: Arc<SharedSession>,
}

impl SendHalf {
    /// Sends `m`, solicited or not as its type says, waiting as long as it takes for credits.
    pub fn send<M: Message>(&self, m: &M) -> Result<()> {
        self.send_as(m, M::SOLICITED)
    }

    /// Sends `m`, solicited or not as given (see [`Session::send_as`] and
    /// [`Session::split`]), waiting as long as it takes.
    pub fn send_as<M: Message>(&self, m: &M, solicited: bool) -> Result<()> {
        self.send_timeout(m, solicited, None).map(|_| ())
    }

    /// Sends `m` if the peer's credit and a send slot come within `timeout` (`None`: as long
    /// as it takes): `Ok(false)`, nothing sent, if not. A message of several frames is
    /// committed once its first frame goes; this then waits for the rest, however long.
    pub fn send_timeout<M: Message>(
        &self,
        m: &M,
        solicited: bool,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let sent = self.shared.run(deadline, Role::Send, |core| {
            let others_wait = core.receivers_waiting > 0 || core.sleeping;
            let s = &mut core.session;
            let solicit = s.solicit_for(solicited, others_wait);
            let was_pending = s.unsolicited_pending();
            if !s.try_send_as(m, solicit)? {
                return Ok(None);
            }
            if !was_pending && s.unsolicited_pending() && core.sleeping {
                // A new flush deadline: the sleeper must wake for it.
                self.shared.waker.wake();
            }
            Ok(Some(()))
        })?;
        if sent.is_none() {
            return Ok(false);
        }
        self.wait_for_frames()?;
        Ok(true)
    }

    /// Waits until every committed frame has gone (a fragmented message's rest).
    fn wait_for_frames(&self) -> Result<()> {
        self.shared.run(None, Role::Send, |core| {
            let s = &mut core.session;
            if s.has_queued_frames() {
                s.step()?;
            }
            Ok((!s.has_queued_frames()).then_some(()))
        })?;
        Ok(())
    }

    /// Sends `m` only if it can go at once (see [`Session::try_send_as`]).
    pub fn try_send_as<M: Message>(&self, m: &M, solicited: bool) -> Result<bool> {
        self.send_timeout(m, solicited, Some(Duration::ZERO))
    }

    /// If anything went unsolicited since the last solicited frame, sends a payload-less
    /// solicited frame (see [`Session::flush`]), waiting as long as it takes for a credit.
    pub fn flush(&self) -> Result<()> {
        self.shared.run(None, Role::Send, |core| {
            let s = &mut core.session;
            Ok(s.try_flush()?.then_some(()))
        })?;
        Ok(())
    }

    /// The session's statistics.
    pub fn stats(&self) -> SessionStats {
        self.shared.lock().session.stats()
    }

    /// The delivery record (see [`Session::delivery`]).
    pub fn delivery(&self) -> crate::Delivery {
        self.shared.lock().session.delivery()
    }
}

/// The receiving half of a [split](Session::split) session: `Send`, one receiving thread at a
/// time (messages come in order).
#[derive(Debug)]
pub struct RecvHalf {
    shared: Arc<SharedSession>,
}

impl RecvHalf {
    /// Receives the next message, waiting as long as it takes (see [`Session::recv`]).
    pub fn recv(&mut self) -> Result<Envelope> {
        crate::drive::wait_until_some(|| self.recv_timeout(None))
    }

    /// Receives the next message, waiting at most `timeout`; `Ok(None)` if none came.
    pub fn recv_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<Envelope>> {
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        self.shared
            .run(deadline, Role::Receive, |core| core.session.try_recv())
    }

    /// A message that has already arrived, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Envelope>> {
        self.recv_timeout(Some(Duration::ZERO))
    }

    /// The session's statistics.
    pub fn stats(&self) -> SessionStats {
        self.shared.lock().session.stats()
    }

    /// The session again, once every clone of its sending half is dropped but `send`;
    /// otherwise both halves back.
    pub fn reunite(self, send: SendHalf) -> std::result::Result<Session, (RecvHalf, SendHalf)> {
        if !Arc::ptr_eq(&self.shared, &send.shared) {
            return Err((self, send));
        }
        drop(send);
        match Arc::try_unwrap(self.shared) {
            Ok(shared) => Ok(shared
                .core
                .into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .session),
            Err(shared) => Err((
                RecvHalf {
                    shared: shared.clone(),
                },
                SendHalf { shared },
            )),
        }
    }
}
