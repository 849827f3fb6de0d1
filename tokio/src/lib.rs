//! rdmsg on tokio: a session, a listener and a hub whose waits are futures.
//!
//! Nothing here polls. Each handle keeps its session (or hub) behind a mutex taken only for
//! non-blocking steps, and waits on the session's descriptor (its epoll set: completion channel,
//! wake-up socket, asynchronous events, bootstrap stream) through
//! [`tokio::io::unix::AsyncFd`]. Before a task waits, the step has re-armed the completion
//! queues and polled them once more, so no completion that arrives afterwards is missed; a
//! receiver still sleeps solicited-only, as a blocking one does, and is woken by the messages
//! their senders solicited. Tasks sharing a handle wake each other when one moved the
//! connection on (queued a message, took a credit grant).
//!
//! Handles are `Clone + Send + Sync` and work on the multi-thread runtime: any number of tasks
//! may send while one receives.
//!
//! # Cancellation
//! - `recv`: cancel-safe. A message is taken from the session only in the poll that returns
//!   it: a dropped future has taken nothing.
//! - `send`: a dropped future either sent the message or did not. A message that needs several
//!   frames is committed once its first frame goes; if the future is dropped after that, the
//!   rest go out, in order and before anything sent later, on the next call that sends, flushes,
//!   closes or waits (a `recv` that finds nothing included).
//! - `flush`: cancel-safe (a flush not sent stays pending).
//! - [`AsyncListener::accept`]: cancel-safe. Handshakes are moved on by a blocking task whose
//!   result stays in the listener for the next call.
//! - [`AsyncSession::connect`]: a dropped future leaves no connection (one made meanwhile is
//!   dropped, which the peer sees as a vanished client).
//!
//! # The solicitation rule
//! While a task waits in `recv`, a message another task sends without solicitation goes
//! solicited, unless [`rdmsg_msg::SessionConfig::max_unsolicited_delay`] is set, in which case
//! the waiting task flushes once the delay runs out: the receiver may wait for the answer to
//! exactly that message, and the peer, asleep solicited-only, would not see it.
#![forbid(unsafe_code)]

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdmsg_msg::{Envelope, Hub, HubEvent, Message, Session, SessionConfig, SessionStats};
use rdmsg_transport::{Config, Connection, Endpoint, Listener, PeerId};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

/// What can fail here.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The session, hub or connection failed, or refused the call.
    #[error(transparent)]
    Msg(#[from] rdmsg_msg::Error),
    /// Registering a descriptor with the runtime, or connecting the TCP stream, failed.
    #[error("{op} failed")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The blocking task that made or accepted a connection panicked or was cancelled.
    #[error("the blocking {op} task did not finish")]
    Blocking {
        /// What it was doing.
        op: &'static str,
    },
    /// [`AsyncSession::close`] was called while other clones of the handle exist.
    #[error("the session is shared by other handles")]
    Shared,
}

impl From<rdmsg_transport::Error> for Error {
    fn from(e: rdmsg_transport::Error) -> Self {
        Error::Msg(e.into())
    }
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { op, source }
}

/// Registers `fd` with the runtime for readability. Tokio deprecated its safe registration (PR 8587)
/// because an arbitrary `AsRawFd` might report another descriptor later; its condition (a
/// valid descriptor, the same one, open as long as the `AsyncFd`) is what an [`OwnedFd`]
/// moved into the `AsyncFd` guarantees, so the deprecated safe form is sound here, and this
/// crate keeps no `unsafe`.
#[allow(deprecated)]
fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)
}

/// What a shared handle drives: a session or a hub.
trait Drive: AsFd + Send + 'static {
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
}

impl Drive for Session {
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
}

impl Drive for Hub {
    fn step(&mut self) -> Result<bool> {
        Ok(Hub::step(self)? > 0)
    }
    fn next_timeout(&self) -> Option<Duration> {
        Hub::next_timeout(self)
    }
    fn mark(&self) -> u64 {
        let s = self.transport().stats();
        s.received + s.sent + s.accepted + s.connected + s.disconnected + s.handshakes_failed
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
}

/// The state behind every clone of a handle.
#[derive(Debug)]
struct Shared<D> {
    inner: Mutex<D>,
    /// A duplicate of the driven descriptor, registered with the runtime.
    fd: AsyncFd<OwnedFd>,
    /// Signalled when a task moved the connection on, or a new flush deadline appeared.
    changed: Notify,
    /// Tasks waiting in `recv`.
    receivers: AtomicUsize,
    /// Waits ended by the descriptor (see [`AsyncSession::wakeups`]).
    wakeups: AtomicU64,
    /// Tasks awaiting the descriptor (counted under the mutex, after their step marked the
    /// pool asleep); the last to wake takes the mark back.
    sleepers: AtomicUsize,
}

/// Counts a waiting task (a receiver, or one on the descriptor) for as long as it waits,
/// cancellation included.
struct Counted<'a>(&'a AtomicUsize);

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

impl<D: Drive> Shared<D> {
    /// The shared state, and a ticker task that wakes its waiters every [`Drive::tick`] (the
    /// health check) for as long as a handle lives.
    fn start(driven: D) -> Result<Arc<Self>> {
        let tick = driven.tick();
        let shared = Arc::new(Self::new(driven)?);
        if let Some(every) = tick {
            let weak = Arc::downgrade(&shared);
            tokio::spawn(async move {
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

    fn new(driven: D) -> Result<Self> {
        let fd = driven
            .as_fd()
            .try_clone_to_owned()
            .map_err(io("duplicating the descriptor"))?;
        Ok(Self {
            inner: Mutex::new(driven),
            fd: register(fd).map_err(io("registering the descriptor with the runtime"))?,
            changed: Notify::new(),
            receivers: AtomicUsize::new(0),
            wakeups: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, D> {
        // A task that panicked mid-step left the session as consistent as any failed call.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the locked session or hub, and signals the other tasks if it moved the
    /// connection on (what they wait for may be what it took in).
    fn signalling<R>(&self, d: &mut D, f: impl FnOnce(&mut D) -> R) -> R {
        let mark = d.mark();
        let r = f(d);
        if d.mark() != mark {
            self.changed.notify_waiters();
        }
        r
    }

    /// Runs `attempt` (under the lock, never blocking) until it gives a value, waiting in
    /// between for the descriptor, another task's signal, or the next timer.
    async fn run<T>(
        &self,
        receiving: bool,
        mut attempt: impl FnMut(&mut D, &Self) -> Result<Option<T>>,
    ) -> Result<T> {
        // The fast path: what is there already is taken without the bookkeeping of a wait. A
        // receiver with nothing queued goes straight to the loop, which looks (polls) once.
        let fast = {
            let mut d = self.lock();
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

    /// [`Shared::run`] past its fast path.
    async fn wait_and_run<T>(
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
                let mut d = self.lock();
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
                ready = self.fd.readable() => {
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

/// A typed-message session on tokio. Clones share the session: send from any number of tasks,
/// receive from one (or several, each message going to one of them). See the crate docs for
/// cancellation.
#[derive(Debug, Clone)]
pub struct AsyncSession {
    shared: Arc<Shared<Session>>,
}

impl AsyncSession {
    /// Wraps a session; call within a tokio runtime (its descriptor is registered there).
    pub fn new(session: Session) -> Result<Self> {
        Ok(Self {
            shared: Shared::start(session)?,
        })
    }

    /// Connects to a [`Listener`] (or an [`AsyncListener`]) at `addr`. The TCP connect and
    /// the handshake run on a blocking task: the runtime's threads never wait for them.
    pub async fn connect(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + std::fmt::Debug + Send + 'static,
        config: Config,
        session: SessionConfig,
    ) -> Result<Self> {
        let endpoint = endpoint.clone();
        let conn = tokio::task::spawn_blocking(move || endpoint.connect(addr, &config))
            .await
            .map_err(|_| Error::Blocking { op: "connect" })??;
        Self::new(Session::with_config(conn, session))
    }

    /// Sends `m`, solicited or not as its type says, waiting for credits as long as it
    /// takes.
    pub async fn send<M: Message>(&self, m: &M) -> Result<()> {
        self.send_as(m, M::SOLICITED).await
    }

    /// Sends `m`, solicited or not as given (see [`Session::send_as`] and the crate docs'
    /// solicitation rule), waiting for credits as long as it takes.
    pub async fn send_as<M: Message>(&self, m: &M, solicited: bool) -> Result<()> {
        self.shared
            .run(false, |s, shared| {
                let waiting = shared.receivers.load(Ordering::SeqCst) > 0;
                let solicit = solicited || (waiting && !s.delays_unsolicited());
                let was_pending = s.unsolicited_pending();
                let sent = s.try_send_as(m, solicit)?;
                if sent && !was_pending && s.unsolicited_pending() {
                    // A new flush deadline: waiting tasks must time their waits by it.
                    shared.changed.notify_waiters();
                }
                Ok(sent.then_some(()))
            })
            .await?;
        // A fragmented message's other frames: wait until they are gone too.
        self.shared
            .run(false, |s, _| {
                if s.has_queued_frames() {
                    Session::step(s)?;
                }
                Ok((!s.has_queued_frames()).then_some(()))
            })
            .await
    }

    /// Sends `m` only if it can go at once: `Ok(false)`, nothing sent, if the peer has no
    /// credit or no send slot is free.
    pub fn try_send_as<M: Message>(&self, m: &M, solicited: bool) -> Result<bool> {
        let mut s = self.shared.lock();
        // Read under the mutex: a receiver counts itself before it steps (and flushes) under it.
        let waiting = self.shared.receivers.load(Ordering::SeqCst) > 0;
        let solicit = solicited || (waiting && !s.delays_unsolicited());
        let (mark, was_pending) = (s.mark(), s.unsolicited_pending());
        let sent = s.try_send_as(m, solicit)?;
        if s.mark() != mark || (!was_pending && s.unsolicited_pending()) {
            // Moved on, or a new flush deadline that waiters must time their waits by.
            self.shared.changed.notify_waiters();
        }
        Ok(sent)
    }

    /// Receives the next message (cancel-safe).
    pub async fn recv(&self) -> Result<Envelope> {
        self.shared.run(true, |s, _| Ok(s.try_recv()?)).await
    }

    /// A message that has already arrived, without waiting.
    pub fn try_recv(&self) -> Result<Option<Envelope>> {
        let mut s = self.shared.lock();
        Ok(self.shared.signalling(&mut s, |s| s.try_recv())?)
    }

    /// If anything went unsolicited since the last solicited frame, sends a payload-less
    /// solicited frame (see [`Session::flush`]), waiting for a credit as long as it takes.
    pub async fn flush(&self) -> Result<()> {
        self.shared
            .run(false, |s, _| Ok(s.try_flush()?.then_some(())))
            .await
    }

    /// The session's statistics.
    pub fn stats(&self) -> SessionStats {
        self.shared.lock().stats()
    }

    /// How many times a waiting task was woken by the session's descriptor (a completion
    /// event, a returned buffer, the peer's stream): the async counterpart of the blocking
    /// receiver's [`rdmsg_transport::Connection::wait_stats`] wake-ups.
    pub fn wakeups(&self) -> u64 {
        self.shared.wakeups.load(Ordering::Relaxed)
    }

    /// Runs `f` on the session (to register types, read its connection's figures): `f` must
    /// not block.
    pub fn with_session<R>(&self, f: impl FnOnce(&mut Session) -> R) -> R {
        f(&mut self.shared.lock())
    }

    /// Closes gracefully (see [`Session::close`]) on a blocking task, once this is the last
    /// handle ([`Error::Shared`] otherwise).
    pub async fn close(self) -> Result<()> {
        let shared = Arc::try_unwrap(self.shared).map_err(|_| Error::Shared)?;
        let session = shared.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        tokio::task::spawn_blocking(move || session.close())
            .await
            .map_err(|_| Error::Blocking { op: "close" })??;
        Ok(())
    }
}

/// A [`Listener`] on tokio: [`AsyncListener::accept`] is cancel-safe.
#[derive(Debug, Clone)]
pub struct AsyncListener {
    inner: Arc<ListenerInner>,
}

#[derive(Debug)]
struct ListenerInner {
    listener: Listener,
    config: Config,
    session: SessionConfig,
    fd: AsyncFd<OwnedFd>,
    /// Connections (or handshake failures) a blocking task finished, for the next `accept`.
    done: Mutex<std::collections::VecDeque<rdmsg_transport::Result<Connection>>>,
    /// A blocking task is moving handshakes on.
    working: AtomicBool,
    /// The last task stopped at an error: look again without waiting for readiness.
    again: AtomicBool,
    finished: Notify,
}

impl AsyncListener {
    /// Listens on `addr` for connections made with `config`, each becoming a session with
    /// `session`'s bounds.
    pub fn bind(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + std::fmt::Debug,
        config: Config,
        session: SessionConfig,
    ) -> Result<Self> {
        let listener = endpoint.listen(addr)?;
        let fd = listener
            .as_fd()
            .try_clone_to_owned()
            .map_err(io("duplicating the listener's descriptor"))?;
        Ok(Self {
            inner: Arc::new(ListenerInner {
                listener,
                config,
                session,
                fd: register(fd).map_err(io("registering the listener with the runtime"))?,
                done: Mutex::new(Default::default()),
                working: AtomicBool::new(false),
                again: AtomicBool::new(false),
                finished: Notify::new(),
            }),
        })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.inner.listener.local_addr()?)
    }

    /// The next client whose handshake completes, as a session. A client that fails its
    /// handshake makes this return its error; the listener goes on.
    pub async fn accept(&self) -> Result<AsyncSession> {
        let inner = &self.inner;
        loop {
            // Enabled before looking: a blocking task finishing after the look is not missed.
            let finished = inner.finished.notified();
            tokio::pin!(finished);
            finished.as_mut().enable();
            let next = inner
                .done
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            if let Some(made) = next {
                return AsyncSession::new(Session::with_config(made?, inner.session.clone()));
            }
            if inner.working.load(Ordering::SeqCst) {
                // A blocking task is at it: wait for its result.
                finished.as_mut().await;
                continue;
            }
            // Wait until there is something to do (a client, handshake bytes, a handshake's
            // deadline), then let a blocking task move the handshakes on: they create queue
            // pairs and register memory, which has no place on the runtime's threads.
            let deadline = inner.listener.next_timeout();
            let timer = async {
                match deadline {
                    Some(t) => tokio::time::sleep(t).await,
                    None => std::future::pending().await,
                }
            };
            if !inner.again.swap(false, Ordering::SeqCst) {
                tokio::select! {
                    ready = inner.fd.readable() => {
                        ready.map_err(io("waiting for the listener"))?.clear_ready();
                    }
                    _ = timer => {}
                }
            }
            if !inner.working.swap(true, Ordering::SeqCst) {
                let task = self.inner.clone();
                tokio::task::spawn_blocking(move || {
                    // Everything that can go on now: each call returns at the first handshake
                    // that completes (or fails), so call again until none does.
                    while let Some(made) = task
                        .listener
                        .accept_timeout(&task.config, Some(Duration::ZERO))
                        .transpose()
                    {
                        let failed = made.is_err();
                        task.done
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push_back(made);
                        if failed {
                            // One error per look (a bad configuration would recur); the next
                            // `accept` looks again at once.
                            task.again.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                    task.working.store(false, Ordering::SeqCst);
                    task.finished.notify_waiters();
                });
            }
        }
    }
}

/// A typed hub on tokio: many peers, one descriptor. Clones share the hub.
#[derive(Debug, Clone)]
pub struct AsyncHub {
    shared: Arc<Shared<Hub>>,
}

impl AsyncHub {
    /// Wraps a hub; call within a tokio runtime.
    pub fn new(hub: Hub) -> Result<Self> {
        Ok(Self {
            shared: Shared::start(hub)?,
        })
    }

    /// Runs `f` on the hub (to listen, register types, read figures): `f` must not block.
    pub fn with_hub<R>(&self, f: impl FnOnce(&mut Hub) -> R) -> R {
        let mut hub = self.shared.lock();
        self.shared.signalling(&mut hub, f)
    }

    /// Starts a connection to the hub or listener at `addr`: the TCP connect is awaited, then
    /// the handshake goes on in the hub (its outcome is an event). Waits first while a quarter
    /// of `max_pending_handshakes` of our own handshakes are in flight.
    pub async fn connect(&self, addr: impl tokio::net::ToSocketAddrs) -> Result<PeerId> {
        let most = self
            .with_hub(|h| (h.transport().config().conn.max_pending_handshakes as usize / 4).max(1));
        self.shared
            .run(false, |h, _| {
                Ok((h.transport().pending_connects() < most).then_some(()))
            })
            .await?;
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(io("connecting the bootstrap stream"))?;
        let stream = stream
            .into_std()
            .map_err(io("taking the bootstrap stream from the runtime"))?;
        let peer = self.with_hub(|h| h.connect_stream(stream))?;
        Ok(peer)
    }

    /// The next event (cancel-safe).
    pub async fn recv(&self) -> Result<HubEvent> {
        self.shared.run(true, |h, _| Ok(h.try_recv()?)).await
    }

    /// An event that has already happened, without waiting.
    pub fn try_recv(&self) -> Result<Option<HubEvent>> {
        self.with_hub(|h| Ok(h.try_recv()?))
    }

    /// Sends `m` to `peer`, solicited or not as its type says, waiting for its credits (and
    /// its handshake).
    pub async fn send<M: Message>(&self, peer: PeerId, m: &M) -> Result<()> {
        self.send_as(peer, m, M::SOLICITED).await
    }

    /// Sends `m` to `peer`, solicited or not as given, waiting for its credits as long as it
    /// takes; the crate docs' solicitation rule applies.
    pub async fn send_as<M: Message>(&self, peer: PeerId, m: &M, solicited: bool) -> Result<()> {
        self.shared
            .run(false, |h, shared| {
                let waiting = shared.receivers.load(Ordering::SeqCst) > 0;
                let delays = h.delays_unsolicited();
                Ok(h.try_send_as(peer, m, solicited || (waiting && !delays))?
                    .then_some(()))
            })
            .await
    }

    /// Sends `m` to `peer` only if it can go at once.
    pub fn try_send_as<M: Message>(&self, peer: PeerId, m: &M, solicited: bool) -> Result<bool> {
        self.with_hub(|h| {
            // Read under the mutex (see `AsyncSession::try_send_as`).
            let waiting = self.shared.receivers.load(Ordering::SeqCst) > 0;
            let delays = h.delays_unsolicited();
            Ok(h.try_send_as(peer, m, solicited || (waiting && !delays))?)
        })
    }

    /// Flushes `peer` (see [`Hub::flush`]) without waiting: whether nothing is left pending.
    pub fn try_flush(&self, peer: PeerId) -> Result<bool> {
        self.with_hub(|h| Ok(h.try_flush(peer)?))
    }

    /// Closes `peer` gracefully; its `Disconnected` event follows.
    pub fn close(&self, peer: PeerId) -> Result<()> {
        self.with_hub(|h| Ok(h.start_close(peer)?))
    }

    /// The hub's statistics over all peers.
    pub fn stats(&self) -> SessionStats {
        self.shared.lock().stats()
    }

    /// How many times a waiting task was woken by the hub's descriptor.
    pub fn wakeups(&self) -> u64 {
        self.shared.wakeups.load(Ordering::Relaxed)
    }
}
