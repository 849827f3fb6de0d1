//! What every async handle shares: the session or hub behind a mutex held only for steps, its descriptor registered with the runtime, and the waits that cannot lose a wake-up.

use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdmsg_msg::{Call, Delivery, Envelope, Hub, HubEvent, Message, Session, SessionStats};
use serde::de::DeserializeOwned;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::error::{io, register, runtime};
use crate::{Error, Result};

/// What a shared handle drives: a session or a hub.
pub(crate) trait Drive: AsFd + Send + 'static {
    /// What a receive hands out: a session's message, a hub's event.
    type Received: Send + 'static;
    /// What has arrived, without waiting (see `Session::try_recv`, `Hub::try_recv`).
    fn try_recv(&mut self) -> rdmsg_msg::Result<Option<Self::Received>>;
    /// The non-blocking step before a wait; whether it handled anything.
    fn step(&mut self) -> Result<bool>;
    /// Longest wait before the next step.
    fn next_timeout(&self) -> Option<Duration>;
    /// Changes whenever the connection moves on (for waking the other tasks).
    fn mark(&self) -> u64;
    /// The periodic step (the health check) a ticker task covers, so that waits need no
    /// timer of their own unless something is due sooner.
    fn tick(&self) -> Option<Duration>;
    /// Whether something received waits to be taken without polling.
    fn has_queued(&self) -> bool;
    /// Nobody waits on the descriptor any more (see `Connection::nobody_waits`).
    fn nobody_waits(&mut self);
    /// Whether something must still go out that only a step sends (answers given by
    /// responders, a hub's outboxes).
    fn outgoing(&self) -> bool;
    /// Runs `hook` whenever a responder answers.
    fn on_answer(&mut self, hook: Box<dyn Fn() + Send + Sync>);
    /// Its counters.
    fn stats(&self) -> SessionStats;
    /// Takes in what arrived: answers to their calls, the rest held (see `Session::poll_calls`).
    fn poll_calls(&mut self) -> rdmsg_msg::Result<bool>;
    /// `call`'s answer, if it is in.
    fn try_wait<T: Message + DeserializeOwned>(
        &mut self,
        call: &Call<T>,
    ) -> Option<rdmsg_msg::Result<T>>;
    /// `call`'s answer if it came, else its timeout (see `Session::expire`).
    fn expire<T: Message + DeserializeOwned>(&mut self, call: Call<T>) -> rdmsg_msg::Result<T>;
}

/// The [`Drive`] methods for receives and calls, the same on a session and a hub.
macro_rules! drive_calls {
    ($ty:ty) => {
        fn try_recv(&mut self) -> rdmsg_msg::Result<Option<Self::Received>> {
            <$ty>::try_recv(self)
        }
        fn poll_calls(&mut self) -> rdmsg_msg::Result<bool> {
            <$ty>::poll_calls(self)
        }
        fn try_wait<T: Message + DeserializeOwned>(
            &mut self,
            call: &Call<T>,
        ) -> Option<rdmsg_msg::Result<T>> {
            <$ty>::try_wait(self, call)
        }
        fn expire<T: Message + DeserializeOwned>(&mut self, call: Call<T>) -> rdmsg_msg::Result<T> {
            <$ty>::expire(self, call)
        }
    };
}

impl Drive for Session {
    type Received = Envelope;
    fn step(&mut self) -> Result<bool> {
        Ok(Session::step(self)?)
    }
    fn next_timeout(&self) -> Option<Duration> {
        Session::next_timeout(self)
    }
    fn mark(&self) -> u64 {
        self.connection().handled()
    }
    fn tick(&self) -> Option<Duration> {
        self.connection().config().health_check
    }
    fn has_queued(&self) -> bool {
        Session::has_ready(self)
    }
    fn nobody_waits(&mut self) {
        Session::nobody_waits(self);
    }
    fn outgoing(&self) -> bool {
        self.answers_waiting() || self.has_queued_frames()
    }
    fn on_answer(&mut self, hook: Box<dyn Fn() + Send + Sync>) {
        Session::on_answer(self, hook);
    }
    fn stats(&self) -> SessionStats {
        Session::stats(self)
    }
    drive_calls!(Session);
}

impl Drive for Hub {
    type Received = HubEvent;
    fn step(&mut self) -> Result<bool> {
        Ok(Hub::step(self)? > 0)
    }
    fn next_timeout(&self) -> Option<Duration> {
        Hub::next_timeout(self)
    }
    fn mark(&self) -> u64 {
        let s = self.transport().stats();
        // Events taken count too: a receiver that takes a peer's acknowledgement frees room a
        // sender waits for, and that sender's step counts only what it queued itself.
        s.received
            + s.sent
            + s.accepted
            + s.connected
            + s.disconnected
            + s.handshakes_failed
            + self.transport().events_taken()
    }
    fn tick(&self) -> Option<Duration> {
        self.transport().config().conn.health_check
    }
    fn has_queued(&self) -> bool {
        true // events are cheap to look for: always take the fast path
    }
    fn nobody_waits(&mut self) {
        Hub::nobody_waits(self);
    }
    fn outgoing(&self) -> bool {
        self.outboxes_waiting()
    }
    fn on_answer(&mut self, hook: Box<dyn Fn() + Send + Sync>) {
        Hub::on_answer(self, hook);
    }
    fn stats(&self) -> SessionStats {
        Hub::stats(self)
    }
    drive_calls!(Hub);
}

/// The state behind every clone of a handle.
#[derive(Debug)]
pub(crate) struct SharedDriver<D: Send + 'static> {
    /// `None` once closed ([`SharedDriver::take`]).
    inner: Mutex<Option<D>>,
    /// A duplicate of the driven descriptor, registered with the runtime.
    /// `None` only while dropping (see the `Drop` impl).
    fd: Option<AsyncFd<OwnedFd>>,
    /// Signalled when a task moved the connection on, or a new flush deadline appeared.
    pub(crate) changed: Notify,
    /// Tasks waiting in `recv`.
    pub(crate) receivers: AtomicUsize,
    /// Waits ended by the descriptor (see [`AsyncSession::wakeups`]).
    pub(crate) wakeups: AtomicU64,
    /// Tasks awaiting the descriptor (counted under the mutex, after their step marked the
    /// pool asleep); the last to wake takes the mark back.
    pub(crate) sleepers: AtomicUsize,
    /// A task sends what waits to go out ([`SharedDriver::send_in_background`]).
    flushing: std::sync::atomic::AtomicBool,
    /// Send permits handed out and neither used nor dropped yet (a session's).
    pub(crate) permits: AtomicUsize,
    /// What a closed session left for its handles to read.
    pub(crate) ended: Mutex<Option<Ended>>,
    /// The runtime the handle was made in, for its background tasks.
    pub(crate) runtime: tokio::runtime::Handle,
}

/// What a closed session leaves: its last counters, and its delivery record and the
/// messages not confirmed once its close finished.
#[derive(Debug, Default)]
pub(crate) struct Ended {
    pub(crate) stats: SessionStats,
    pub(crate) delivery: Option<Delivery>,
    pub(crate) unconfirmed: Option<Vec<Envelope>>,
}

/// The locked session or hub of a handle not closed.
pub(crate) struct Locked<'a, D>(MutexGuard<'a, Option<D>>);

impl<D> Deref for Locked<'_, D> {
    type Target = D;
    fn deref(&self) -> &D {
        // Checked when locked; only `take`, under this same lock, empties it.
        self.0.as_ref().expect("a locked handle is open")
    }
}

impl<D> DerefMut for Locked<'_, D> {
    fn deref_mut(&mut self) -> &mut D {
        self.0.as_mut().expect("a locked handle is open")
    }
}

impl<D: Send + 'static> Drop for SharedDriver<D> {
    /// Verbs teardown (destroying queue pairs, deregistering memory) can take milliseconds:
    /// it runs on rdmsg's own threads ([`crate::offload`]), never on a runtime thread.
    /// The registration goes there too: leaving the runtime's reactor and closing the
    /// descriptor cost a system call each.
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        crate::offload::tear_down((inner.take(), self.fd.take()));
    }
}

/// Counts a waiting task (a receiver, or one on the descriptor) for as long as it waits,
/// cancellation included.
pub(crate) struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<D: Drive> SharedDriver<D> {
    /// What has arrived (a message, a hub's event), without waiting.
    pub(crate) fn try_recv(&self) -> Result<Option<D::Received>> {
        let mut d = self.lock()?;
        Ok(self.signalling(&mut d, |d| d.try_recv())?)
    }

    /// The next arrival (a message, a hub's event), waited for (cancel-safe). `run`'s own
    /// future, not one wrapped around it: a receive polls one state machine fewer.
    pub(crate) fn recv(&self) -> impl std::future::Future<Output = Result<D::Received>> + '_ {
        self.run(true, |d, _| Ok(d.try_recv()?))
    }

    /// The shared state, and a ticker task that wakes its waiters every [`Drive::tick`] (the
    /// health check) for as long as a handle lives.
    pub(crate) fn start(driven: D, op: &'static str) -> Result<Arc<Self>> {
        // Outside a runtime, `driven` is dropped here: not a runtime's thread.
        let runtime = runtime(op)?;
        let tick = driven.tick();
        let shared = Arc::new(Self::new(driven, runtime.clone())?);
        // An answer given while no task waits on the session or hub would wait for the next
        // one that does: a task sends it.
        let weak = Arc::downgrade(&shared);
        shared.lock()?.on_answer(Box::new(move || {
            if let Some(s) = weak.upgrade() {
                s.send_in_background();
            }
        }));
        if let Some(every) = tick {
            let weak = Arc::downgrade(&shared);
            shared.runtime.spawn(async move {
                let mut interval = tokio::time::interval(every);
                interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                interval.tick().await;
                loop {
                    interval.tick().await;
                    match weak.upgrade() {
                        Some(s) => s.changed.notify_waiters(),
                        None => break,
                    }
                }
            });
        }
        Ok(shared)
    }

    fn new(driven: D, runtime: tokio::runtime::Handle) -> Result<Self> {
        let fd = driven.as_fd().try_clone_to_owned();
        let _entered = runtime.enter();
        let fd = fd
            .map_err(io("duplicating the descriptor"))
            .and_then(|fd| register(fd).map_err(io("registering the descriptor with the runtime")));
        // Failed: what it was given is torn down off the runtime's threads too.
        let fd = match fd {
            Ok(fd) => fd,
            Err(e) => {
                crate::offload::tear_down(driven);
                return Err(e);
            }
        };
        Ok(Self {
            inner: Mutex::new(Some(driven)),
            fd: Some(fd),
            changed: Notify::new(),
            receivers: AtomicUsize::new(0),
            wakeups: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            flushing: std::sync::atomic::AtomicBool::new(false),
            permits: AtomicUsize::new(0),
            ended: Mutex::new(None),
            runtime,
        })
    }

    fn fd(&self) -> &AsyncFd<OwnedFd> {
        self.fd.as_ref().expect("only Drop takes the descriptor")
    }

    /// Takes the session or hub out (closing it for every handle): the waiting tasks wake
    /// to find it gone ([`Error::Closed`]). `None` if it was taken already.
    pub(crate) fn take(&self) -> Option<D> {
        let taken = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let taken = inner.take();
            if let Some(d) = &taken {
                let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
                ended.get_or_insert_with(Ended::default).stats = d.stats();
            }
            taken
        };
        self.changed.notify_waiters();
        taken
    }

    /// Its counters, or the last ones if it was closed.
    pub(crate) fn stats(&self) -> SessionStats {
        match self.lock() {
            Ok(d) => d.stats(),
            Err(_) => self.ended().as_ref().map(|e| e.stats).unwrap_or_default(),
        }
    }

    /// What a closed session left.
    pub(crate) fn ended(&self) -> MutexGuard<'_, Option<Ended>> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Unless a task does already, spawns one that drives the session or hub until what waits
    /// to go out (answers, outboxes) has gone: nobody else may be waiting on it.
    pub(crate) fn send_in_background(self: &Arc<Self>) {
        if self.flushing.swap(true, Ordering::SeqCst) {
            return;
        }
        let me = Arc::downgrade(self);
        self.runtime.spawn(async move {
            // Holds the session or hub only for a second at a time, and stops once only it
            // holds it (every handle gone) or a step fails (the failure is the next caller's).
            loop {
                let Some(s) = me.upgrade() else { return };
                if Arc::strong_count(&s) <= 1 {
                    return;
                }
                let round = s.run(false, |d, _| {
                    d.step()?;
                    Ok((!d.outgoing()).then_some(()))
                });
                match tokio::time::timeout(Duration::from_secs(1), round).await {
                    Err(_) => continue,
                    Ok(Err(_)) => {
                        s.flushing.store(false, Ordering::SeqCst);
                        return;
                    }
                    Ok(Ok(())) => {
                        s.flushing.store(false, Ordering::SeqCst);
                        // An answer given after the last look but before the flag fell.
                        if s.lock().is_ok_and(|d| d.outgoing()) {
                            s.send_in_background();
                        }
                        return;
                    }
                }
            }
        });
    }

    /// A call of `request`'s type: `start` sends the request once it can (or says the call is
    /// under way), then its answer is awaited (other messages or events wait for the
    /// receiving tasks), all within `timeout`. Dropping the future cancels the call.
    pub(crate) async fn call<T>(
        &self,
        timeout: Duration,
        request: &'static str,
        start: impl FnMut(&mut D, &Self) -> Result<Option<Call<T>>>,
    ) -> Result<T>
    where
        T: Message + DeserializeOwned,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let call = match tokio::time::timeout_at(deadline, self.run(false, start)).await {
            Ok(call) => call?,
            Err(_) => {
                let after = timeout;
                return Err(rdmsg_msg::Error::CallTimedOut { request, after }.into());
            }
        };
        let answer = self.run(true, |d, shared| {
            if let Some(done) = d.try_wait(&call) {
                return Ok(Some(done?));
            }
            if d.poll_calls()? {
                // Messages (or events) for the receiving tasks.
                shared.changed.notify_waiters();
            }
            Ok(d.try_wait(&call).transpose()?)
        });
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(answer) => answer,
            // Its answer, if it came meanwhile (what arrived is taken in first, as a blocking
            // wait does past a deadline); else the timeout.
            Err(_) => {
                let mut d = self.lock()?;
                if d.poll_calls().unwrap_or(false) {
                    self.changed.notify_waiters();
                }
                Ok(d.expire(call)?)
            }
        }
    }

    /// The session or hub, locked; [`Error::Closed`] once closed.
    pub(crate) fn lock(&self) -> Result<Locked<'_, D>> {
        // A task that panicked mid-step left the session as consistent as any failed call.
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match *inner {
            Some(_) => Ok(Locked(inner)),
            None => Err(Error::Closed),
        }
    }

    /// Runs `f` on the locked session or hub, and signals the other tasks if it moved the
    /// connection on (what they wait for may be what it took in).
    pub(crate) fn signalling<R>(&self, d: &mut D, f: impl FnOnce(&mut D) -> R) -> R {
        let mark = d.mark();
        let r = f(d);
        if d.mark() != mark {
            self.changed.notify_waiters();
        }
        r
    }

    /// Runs `attempt` (under the lock, never blocking) until it gives a value, waiting in
    /// between for the descriptor, another task's signal, or the next timer.
    pub(crate) async fn run<T>(
        &self,
        receiving: bool,
        mut attempt: impl FnMut(&mut D, &Self) -> Result<Option<T>>,
    ) -> Result<T> {
        // The fast path: what is there already is taken without the bookkeeping of a wait. A
        // receiver with nothing queued goes straight to the loop, which looks (polls) once.
        let fast = {
            let mut d = self.lock()?;
            if receiving && !d.has_queued() {
                None
            } else {
                Some(self.signalling(&mut d, |d| attempt(d, self)))
            }
        };
        if let Some(got) = fast {
            if let Some(v) = got? {
                return Ok(v);
            }
        }
        self.wait_and_run(receiving, attempt).await
    }

    /// [`SharedDriver::run`] past its fast path.
    pub(crate) async fn wait_and_run<T>(
        &self,
        receiving: bool,
        mut attempt: impl FnMut(&mut D, &Self) -> Result<Option<T>>,
    ) -> Result<T> {
        let _counted = receiving.then(|| Counted::new(&self.receivers));
        let mut woke = false;
        loop {
            // Enabled before looking, so that a signal sent after the look is not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (timeout, sleeping) = {
                let mut d = self.lock()?;
                if std::mem::take(&mut woke) && self.sleepers.load(Ordering::SeqCst) == 0 {
                    // The last task on the descriptor is awake.
                    d.nobody_waits();
                }
                if let Some(v) = self.signalling(&mut d, |d| attempt(d, self))? {
                    return Ok(v);
                }
                let busy = self.signalling(&mut d, |d| d.step())?;
                if busy {
                    continue;
                }
                // The ticker covers the health check; a timer only for what is due sooner.
                let timeout = match (d.next_timeout(), d.tick()) {
                    (Some(t), Some(tick)) if t >= tick => None,
                    (t, _) => t,
                };
                // Counted under the mutex, after the step that marked the pool asleep.
                (timeout, Counted::new(&self.sleepers))
            };
            let timer = async {
                match timeout {
                    Some(t) => tokio::time::sleep(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ready = self.fd().readable() => {
                    // The next step drains what made it readable (and re-arms).
                    ready.map_err(io("waiting for the descriptor"))?.clear_ready();
                    self.wakeups.fetch_add(1, Ordering::Relaxed);
                }
                _ = &mut notified => {}
                _ = timer => {}
            }
            drop(sleeping);
            woke = true;
        }
    }
}

/// What is left of `timeout` from now, each time it is asked: a call's start that is tried
/// again (no room yet) keeps the call's one deadline, which its request carries.
pub(crate) fn time_left(timeout: Duration) -> impl Fn() -> Duration {
    let until = std::time::Instant::now().checked_add(timeout);
    move || {
        until.map_or(timeout, |u| {
            u.saturating_duration_since(std::time::Instant::now())
        })
    }
}
