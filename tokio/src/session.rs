//! An async session.

use std::net::ToSocketAddrs;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rdmsg_msg::{Envelope, Message, Request, Session, SessionConfig, SessionStats};
use rdmsg_transport::{Config, Endpoint};

use crate::shared::{Drive, Locked, SharedDriver};
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use futures_core::Stream;
use futures_sink::Sink;

use crate::stream::{poll_wait, Receives, Waiting};

use crate::{Error, Result};

/// A typed-message session on tokio. Clones share the session: send from any number of tasks,
/// receive from one (or several, each message going to one of them), close from any. See the
/// crate docs for cancellation.
#[derive(Debug, Clone)]
pub struct AsyncSession {
    pub(crate) shared: Arc<SharedDriver<Session>>,
}

/// Room for one message, reserved by [`AsyncSession::reserve`]: [`SendPermit::send`] hands
/// the message over at once, without waiting. Dropping it unused gives the room back.
#[derive(Debug)]
#[must_use = "a permit reserves room until it is used or dropped"]
pub struct SendPermit {
    shared: Arc<SharedDriver<Session>>,
}

impl SendPermit {
    /// Commits `m`, solicited or not as its type says: see [`SendPermit::send_as`].
    pub fn send<M: Message>(self, m: &M) -> Result<()> {
        self.send_as(m, M::SOLICITED)
    }

    /// Commits `m` without waiting: once this returns `Ok`, the message goes, in order, before
    /// anything sent later (at once if it can, else as credits come, driven by the session's
    /// tasks). `Err` (too large, not encodable, the connection failed, the session closed):
    /// nothing of it was sent. The crate docs' solicitation rule applies.
    pub fn send_as<M: Message>(self, m: &M, solicited: bool) -> Result<()> {
        commit(&self.shared, m, solicited)
    }
}

impl Drop for SendPermit {
    fn drop(&mut self) {
        self.shared.permits.fetch_sub(1, Ordering::SeqCst);
        // A task waiting in `reserve` may take the room.
        self.shared.changed.notify_waiters();
    }
}

/// Commits `m` on the shared session (see [`Session::commit_as`]), waking the tasks that must
/// know, and a background sender if part of it waits to go.
pub(crate) fn commit<M: Message>(
    shared: &Arc<SharedDriver<Session>>,
    m: &M,
    solicited: bool,
) -> Result<()> {
    let s = shared.lock()?;
    commit_locked(shared, s, m, solicited)
}

/// [`commit`] on the session locked already.
fn commit_locked<M: Message>(
    shared: &Arc<SharedDriver<Session>>,
    mut s: Locked<'_, Session>,
    m: &M,
    solicited: bool,
) -> Result<()> {
    // Read under the mutex: a receiver counts itself before it steps (and flushes) under it.
    let waiting = shared.receivers.load(Ordering::SeqCst) > 0;
    let solicit = s.solicit_for(solicited, waiting);
    let (mark, was_pending) = (s.mark(), s.unsolicited_pending());
    s.commit_as(m, solicit)?;
    if s.mark() != mark || (!was_pending && s.unsolicited_pending()) {
        // Moved on, or a new flush deadline that waiters must time their waits by.
        shared.changed.notify_waiters();
    }
    let queued = s.has_queued_frames();
    drop(s);
    if queued {
        // The rest goes as credits come, whether or not a task waits on the session.
        shared.send_in_background();
    }
    Ok(())
}

impl AsyncSession {
    /// Wraps a session; call within a tokio runtime (its descriptor is registered there):
    /// [`Error::NoRuntime`] outside one. The async session does not resume after a lost
    /// connection yet ([`Session::forgo_resume`]): a resume would change the descriptor the
    /// runtime waits on.
    pub fn new(mut session: Session) -> Result<Self> {
        session.forgo_resume();
        Ok(Self {
            shared: SharedDriver::start(session, "AsyncSession::new")?,
        })
    }

    /// Connects to a [`Listener`](rdmsg_transport::Listener) (or an [`AsyncListener`](crate::AsyncListener)) at `addr`. The TCP connect and
    /// the handshake run on a blocking task: the runtime's threads never wait for them.
    pub async fn connect(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + std::fmt::Debug + Send + 'static,
        config: Config,
        session: SessionConfig,
    ) -> Result<Self> {
        Self::connect_through(endpoint, addr, config, session, false).await
    }

    /// Connects to a [`CmListener`](rdmsg_transport::CmListener) at `addr` through the RDMA
    /// connection manager ([`Endpoint::connect_cm`]), on rdmsg's worker threads like
    /// [`AsyncSession::connect`].
    pub async fn connect_cm(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + std::fmt::Debug + Send + 'static,
        config: Config,
        session: SessionConfig,
    ) -> Result<Self> {
        Self::connect_through(endpoint, addr, config, session, true).await
    }

    /// Connects on rdmsg's worker threads, through the TCP bootstrap or (`cm`) the
    /// connection manager. The session too is made there: it registers memory.
    async fn connect_through(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + std::fmt::Debug + Send + 'static,
        config: Config,
        session: SessionConfig,
        cm: bool,
    ) -> Result<Self> {
        let endpoint = endpoint.clone();
        crate::error::runtime(if cm {
            "AsyncSession::connect_cm"
        } else {
            "AsyncSession::connect"
        })?;
        let session = crate::offload::spawn(move || {
            let conn = if cm {
                endpoint.connect_cm(addr, &config)?
            } else {
                endpoint.connect(addr, &config)?
            };
            Ok::<_, Error>(Session::with_config(conn, session))
        })
        .await
        .ok_or(Error::Blocking { op: "connect" })??;
        Self::new(session)
    }

    /// Sends `m`, solicited or not as its type says, waiting for room as long as it takes
    /// (cancel-safe: see [`AsyncSession::send_as`]).
    pub async fn send<M: Message>(&self, m: &M) -> Result<()> {
        self.send_as(m, M::SOLICITED).await
    }

    /// Sends `m`, solicited or not as given (see [`Session::send_as`] and the crate docs'
    /// solicitation rule), waiting for room as long as it takes. Cancel-safe: the message is
    /// committed only in the poll that returns `Ok`, so a future dropped before that sent
    /// nothing. Once committed it goes, in order, before anything sent later; a message of
    /// several frames has its other frames sent by the session's tasks as credits come.
    /// [`AsyncSession::reserve`] splits the wait from the hand-over.
    pub async fn send_as<M: Message>(&self, m: &M, solicited: bool) -> Result<()> {
        if let Some(committed) = self.commit_if_free(m, solicited) {
            return committed;
        }
        self.reserve().await?.send_as(m, solicited)
    }

    /// The common case of a send, without a permit: room now, and nobody holding one.
    fn commit_if_free<M: Message>(&self, m: &M, solicited: bool) -> Option<Result<()>> {
        let s = match self.shared.lock() {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        let free = self.shared.permits.load(Ordering::SeqCst) == 0 && s.ready_to_send();
        free.then(|| commit_locked(&self.shared, s, m, solicited))
    }

    /// Waits until a message can go, reserving room for it, and commits nothing: cancel-safe,
    /// so a timeout around it means nothing was sent. The permit's
    /// [`send`](SendPermit::send) then hands the message over without waiting. Room is a
    /// credit of the peer's not promised to another permit, with nothing committed still
    /// waiting to go; a permit's message that finds the room taken after all (by a
    /// [`AsyncSession::try_send_as`], or a large message short of rendezvous room) is queued
    /// and goes first as credits come.
    pub async fn reserve(&self) -> Result<SendPermit> {
        self.shared
            .run(false, |s, shared| Ok(reserve(s, shared).then_some(())))
            .await?;
        Ok(SendPermit {
            shared: self.shared.clone(),
        })
    }

    /// [`AsyncSession::reserve`] without waiting: `None` if there is no room now.
    pub fn try_reserve(&self) -> Result<Option<SendPermit>> {
        let s = self.shared.lock()?;
        Ok(reserve(&s, &self.shared).then(|| SendPermit {
            shared: self.shared.clone(),
        }))
    }

    /// Sends `m` only if it can go at once: `Ok(false)`, nothing sent, if the peer has no
    /// credit or no send slot is free.
    pub fn try_send_as<M: Message>(&self, m: &M, solicited: bool) -> Result<bool> {
        let mut s = self.shared.lock()?;
        // Read under the mutex: a receiver counts itself before it steps (and flushes) under it.
        let waiting = self.shared.receivers.load(Ordering::SeqCst) > 0;
        let solicit = s.solicit_for(solicited, waiting);
        let (mark, was_pending) = (s.mark(), s.unsolicited_pending());
        let sent = s.try_send_as(m, solicit)?;
        if s.mark() != mark || (!was_pending && s.unsolicited_pending()) {
            // Moved on, or a new flush deadline that waiters must time their waits by.
            self.shared.changed.notify_waiters();
        }
        let queued = s.has_queued_frames();
        drop(s);
        if queued {
            self.shared.send_in_background();
        }
        Ok(sent)
    }

    /// Calls the peer (see [`Session::call`]): sends `request` and waits for its answer, all
    /// within `timeout` ([`rdmsg_msg::Error::CallTimedOut`] past it). Cancel-safe in the
    /// sense that matters for calls: dropping the future cancels the call (its answer, if
    /// it comes, is dropped and counted late); the request may or may not have gone.
    /// Messages that arrive meanwhile wait for [`AsyncSession::recv`]. A request received
    /// here is answered with its [`rdmsg_msg::Responder::respond`], from any task: the
    /// session's driver sends it without blocking anyone.
    pub async fn call<R>(&self, request: &R, timeout: std::time::Duration) -> Result<R::Response>
    where
        R: Request,
        R::Response: serde::de::DeserializeOwned,
    {
        let request_type = std::any::type_name::<R>();
        // One deadline however often the start finds no room: each try gets what is left.
        let left = crate::shared::time_left(timeout);
        self.shared
            .call(timeout, request_type, |s, shared| {
                let waiting = shared.receivers.load(Ordering::SeqCst) > 0;
                let solicit = s.solicit_for(R::SOLICITED, waiting);
                Ok(s.try_start_call(request, solicit, left())?)
            })
            .await
    }

    /// Receives the next message (cancel-safe).
    pub async fn recv(&self) -> Result<Envelope> {
        self.shared.recv().await
    }

    /// A message that has already arrived, without waiting.
    pub fn try_recv(&self) -> Result<Option<Envelope>> {
        self.shared.try_recv()
    }

    /// Sends what was committed and, if anything went unsolicited since the last solicited
    /// frame, a payload-less solicited frame (see [`Session::flush`]), waiting for credits as
    /// long as it takes. Cancel-safe: what is not sent yet stays committed.
    pub async fn flush(&self) -> Result<()> {
        self.shared
            .run(false, |s, _| Ok(s.try_flush()?.then_some(())))
            .await
    }

    /// The session's statistics (once closed, the last ones).
    pub fn stats(&self) -> SessionStats {
        self.shared.stats()
    }

    /// The delivery record: messages sent, and how many of them the peer's application took
    /// (see [`Session::delivery`]); once closed, the record its close ended with.
    pub fn delivery(&self) -> rdmsg_msg::Delivery {
        match self.shared.lock() {
            Ok(s) => s.delivery(),
            Err(_) => {
                let ended = self.shared.ended();
                ended.as_ref().and_then(|e| e.delivery).unwrap_or_default()
            }
        }
    }

    /// Once the connection has ended (or the session was closed), the messages the peer's
    /// application was not seen to take, in order (see [`Session::take_unconfirmed`]);
    /// `None` while it is up.
    pub fn take_unconfirmed(&self) -> Option<Vec<Envelope>> {
        match self.shared.lock() {
            Ok(mut s) => s.take_unconfirmed(),
            Err(_) => self.shared.ended().as_mut()?.unconfirmed.take(),
        }
    }

    /// How many times a waiting task was woken by the session's descriptor (a completion
    /// event, a returned buffer, the peer's stream): the async counterpart of the blocking
    /// receiver's [`rdmsg_transport::Connection::wait_stats`] wake-ups.
    pub fn wakeups(&self) -> u64 {
        self.shared.wakeups.load(Ordering::Relaxed)
    }

    /// Runs `f` on the session (to register types, read its connection's figures): `f` must
    /// not block. [`Error::Closed`] once closed.
    pub fn with_session<R>(&self, f: impl FnOnce(&mut Session) -> R) -> Result<R> {
        Ok(f(&mut *self.shared.lock()?))
    }

    /// The messages received, as a [`futures_core::Stream`] (see [`SessionStream`]).
    pub fn stream(&self) -> SessionStream {
        SessionStream::new(self.clone())
    }

    /// A [`futures_sink::Sink`] of messages of type `M` over this session (see
    /// [`SessionSink`]). Sinks of several types may share the session.
    pub fn sink<M: Message>(&self) -> SessionSink<M> {
        SessionSink::new(self.clone())
    }

    /// The sending and the receiving half, for two tasks: [`AsyncSession::sink`] and
    /// [`AsyncSession::stream`]. (Every handle can do both; these are two of them.)
    pub fn split<M: Message>(&self) -> (SessionSink<M>, SessionStream) {
        (self.sink(), self.stream())
    }

    /// Closes gracefully (see [`Session::close`]) for every handle, from any of them: what
    /// was committed goes first (within `close_timeout`; what found no room by then is
    /// [`rdmsg_msg::Error::Unsent`]), then the close; tasks waiting on the session, and every later
    /// call, get [`Error::Closed`]. The close and the verbs teardown run on rdmsg's own
    /// threads. A peer
    /// already gone makes it return at once with the peer's failure (see
    /// [`rdmsg_msg::Error::is_peer_closed`]). Dropping the future does not stop the close.
    /// Called again, or after another handle closed, [`Error::Closed`].
    pub async fn close(&self) -> Result<()> {
        let session = self.shared.take().ok_or(Error::Closed)?;
        let shared = self.shared.clone();
        let closed = crate::offload::spawn(move || {
            let closed = session.close_with_delivery();
            let mut ended = shared.ended();
            let ended = ended.get_or_insert_with(Default::default);
            ended.delivery = Some(closed.delivery);
            ended.unconfirmed = Some(closed.unconfirmed);
            closed.result
        })
        .await
        .ok_or(Error::Blocking { op: "close" })?;
        Ok(closed?)
    }
}

/// Whether a permit can be had now (and if so, counts it).
fn reserve(s: &Session, shared: &SharedDriver<Session>) -> bool {
    let held = shared.permits.load(Ordering::SeqCst);
    let room = s.ready_to_send() && s.connection().credits() as usize > held;
    if room {
        shared.permits.fetch_add(1, Ordering::SeqCst);
    }
    room
}

/// The messages a session receives, in order, as a [`Stream`] ([`AsyncSession::stream`]).
///
/// It ends (`None`) after the peer's graceful close, and after the first fatal error, which
/// it yields; errors that cost one message only ([`Error::is_fatal`] false: a bad frame, an
/// unknown tag) are yielded and it goes on. Dropping it, or a `next()` future, loses
/// nothing: a message is taken only in the poll that returns it.
#[must_use = "streams do nothing unless polled"]
#[derive(Debug)]
pub struct SessionStream {
    session: AsyncSession,
    receives: Receives<Session>,
}

impl SessionStream {
    pub(crate) fn new(session: AsyncSession) -> Self {
        Self {
            session,
            receives: Receives::new(),
        }
    }

    /// The session it reads.
    pub fn session(&self) -> &AsyncSession {
        &self.session
    }
}

impl Stream for SessionStream {
    type Item = Result<Envelope>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        this.receives.poll_next(&this.session.shared, cx)
    }
}

/// Messages of type `M` sent over a session, as a [`Sink`] ([`AsyncSession::sink`]; one
/// per type sent, or an enum of them as `M`).
///
/// `poll_ready` is [`AsyncSession::reserve`]: it waits for room and commits nothing;
/// `start_send` then commits the message at once ([`SendPermit::send`]), solicited as its
/// type says. `poll_flush` is [`AsyncSession::flush`]: everything committed sent, and a
/// wake-up for what went unsolicited. `poll_close` flushes; it does not close the session
/// ([`AsyncSession::close`] does, from any handle).
#[must_use = "sinks do nothing unless polled"]
pub struct SessionSink<M> {
    session: AsyncSession,
    permit: Option<SendPermit>,
    reserving: Option<Waiting<Result<SendPermit>>>,
    flushing: Option<Waiting<Result<()>>>,
    /// `fn` so that the sink is `Send`, `Sync` and `Unpin` whatever `M` is.
    sends: PhantomData<fn(M)>,
}

impl<M> std::fmt::Debug for SessionSink<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionSink")
            .field("ready", &self.permit.is_some())
            .field("reserving", &self.reserving.is_some())
            .field("flushing", &self.flushing.is_some())
            .finish()
    }
}

impl<M> SessionSink<M> {
    pub(crate) fn new(session: AsyncSession) -> Self {
        Self {
            session,
            permit: None,
            reserving: None,
            flushing: None,
            sends: PhantomData,
        }
    }

    /// The session it sends over.
    pub fn session(&self) -> &AsyncSession {
        &self.session
    }

    fn poll_reserve(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.permit.is_some() {
            return Poll::Ready(Ok(()));
        }
        if self.reserving.is_none() {
            if let Some(permit) = self.session.try_reserve()? {
                self.permit = Some(permit);
                return Poll::Ready(Ok(()));
            }
        }
        let session = &self.session;
        let got = ready!(poll_wait(&mut self.reserving, cx, || {
            let session = session.clone();
            Box::pin(async move { session.reserve().await })
        }));
        self.permit = Some(got?);
        Poll::Ready(Ok(()))
    }

    fn poll_flushed(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let session = &self.session;
        poll_wait(&mut self.flushing, cx, || {
            let session = session.clone();
            Box::pin(async move { session.flush().await })
        })
    }
}

impl<M: Message> Sink<M> for SessionSink<M> {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_reserve(cx)
    }

    /// Commits `item` (see [`SendPermit::send`]). Without a `poll_ready` first it is
    /// committed all the same, queued behind what waits to go.
    fn start_send(self: Pin<&mut Self>, item: M) -> Result<()> {
        let this = self.get_mut();
        match this.permit.take() {
            Some(permit) => permit.send(&item),
            None => crate::session::commit(&this.session.shared, &item, M::SOLICITED),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_flushed(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        this.permit = None;
        this.reserving = None;
        this.poll_flushed(cx)
    }
}
