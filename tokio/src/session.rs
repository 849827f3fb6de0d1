//! An async session.

use std::net::ToSocketAddrs;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rdmsg_msg::{Envelope, Message, Request, Session, SessionConfig, SessionStats};
use rdmsg_transport::{Config, Endpoint};

use crate::shared::{Drive, SharedDriver};
use crate::{Error, Result};

/// A typed-message session on tokio. Clones share the session: send from any number of tasks,
/// receive from one (or several, each message going to one of them). See the crate docs for
/// cancellation.
#[derive(Debug, Clone)]
pub struct AsyncSession {
    shared: Arc<SharedDriver<Session>>,
}

impl AsyncSession {
    /// Wraps a session; call within a tokio runtime (its descriptor is registered there).
    pub fn new(session: Session) -> Result<Self> {
        Ok(Self {
            shared: SharedDriver::start(session)?,
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
        self.shared
            .call(timeout, request_type, |s, shared| {
                let waiting = shared.receivers.load(Ordering::SeqCst) > 0;
                let solicit = R::SOLICITED || (waiting && !s.delays_unsolicited());
                Ok(s.try_start_call(request, solicit, timeout)?)
            })
            .await
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

    /// The delivery record: messages sent, and how many of them the peer's application took
    /// (see [`Session::delivery`]).
    pub fn delivery(&self) -> rdmsg_msg::Delivery {
        self.shared.lock().delivery()
    }

    /// Once the connection has ended, the messages the peer's application was not seen to
    /// take, in order (see [`Session::take_unconfirmed`]); `None` while it is up.
    pub fn take_unconfirmed(&self) -> Option<Vec<Envelope>> {
        self.shared.lock().take_unconfirmed()
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
    /// handle ([`Error::SharedDriver`] otherwise).
    pub async fn close(self) -> Result<()> {
        let shared = Arc::try_unwrap(self.shared).map_err(|_| Error::SharedDriver)?;
        let session = shared.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        tokio::task::spawn_blocking(move || session.close())
            .await
            .map_err(|_| Error::Blocking { op: "close" })??;
        Ok(())
    }
}
