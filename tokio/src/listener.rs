//! An async listener: handshakes on blocking tasks, accepted sessions handed out by `accept`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmsg_msg::{Session, SessionConfig};
use rdmsg_transport::{CmListener, Config, Connection, Endpoint, Listener};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::error::{io, register, runtime};
use crate::stream::{poll_wait, Waiting};
use crate::{AsyncSession, Result};
use futures_core::Stream;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

/// A client's outcome (`Ok(Err)`: its handshake failed), or the listener's own failure.
pub(crate) type Outcome = Result<Result<AsyncSession>>;

/// A [`Listener`] on tokio: [`AsyncListener::accept`] is cancel-safe, and a client that
/// fails its handshake never stops it.
#[derive(Debug, Clone)]
pub struct AsyncListener {
    inner: Arc<ListenerInner>,
}

/// The listener underneath: the TCP bootstrap's, or rdma_cm's (kept behind a lock: its ids
/// are not to be shared between threads).
#[derive(Debug)]
enum AnyListener {
    Tcp(Listener),
    Cm(Mutex<CmListener>),
}

/// A client's outcome as the listener underneath reports it (see
/// [`Listener::accept_outcome_timeout`]), or the listener's own failure.
type Made<T> = rdmsg_transport::Result<rdmsg_transport::Result<T>>;

impl AnyListener {
    fn accept_outcome_timeout(
        &self,
        config: &Config,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<Option<rdmsg_transport::Result<Connection>>> {
        match self {
            AnyListener::Tcp(l) => l.accept_outcome_timeout(config, timeout),
            AnyListener::Cm(l) => lock(l).accept_outcome_timeout(config, timeout),
        }
    }

    fn next_timeout(&self) -> Option<Duration> {
        match self {
            AnyListener::Tcp(l) => l.next_timeout(),
            AnyListener::Cm(l) => lock(l).next_timeout(),
        }
    }

    fn local_addr(&self) -> rdmsg_transport::Result<SocketAddr> {
        match self {
            AnyListener::Tcp(l) => l.local_addr(),
            AnyListener::Cm(l) => lock(l).local_addr().ok_or_else(|| {
                rdmsg_transport::Error::Config("the CM listener has no local address".into())
            }),
        }
    }

    /// A duplicate of the descriptor that is readable when there is something to accept.
    fn fd(&self) -> std::io::Result<OwnedFd> {
        match self {
            AnyListener::Tcp(l) => l.as_fd().try_clone_to_owned(),
            AnyListener::Cm(l) => lock(l).as_fd().try_clone_to_owned(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct ListenerInner {
    /// `None` only while dropping (see the `Drop` impl).
    listener: Option<AnyListener>,
    /// The address listened on, read once: a CM listener's lock may be held by a blocking
    /// task for a while, and this is asked on the runtime's threads.
    local: SocketAddr,
    config: Config,
    session: SessionConfig,
    /// `None` only while dropping.
    fd: Option<AsyncFd<OwnedFd>>,
    /// Clients' outcomes (sessions or failed handshakes) a blocking task found, or the
    /// listener's own failure, for the next `accept`.
    done: Mutex<std::collections::VecDeque<Made<Session>>>,
    /// Clients whose handshake failed, skipped by `accept`.
    failed: AtomicU64,
    /// A blocking task is moving handshakes on.
    working: AtomicBool,
    /// The last task stopped at an error: look again without waiting for readiness.
    again: AtomicBool,
    /// When the earliest handshake in progress times out, as the last task left it: read
    /// here, since the listener's own answer waits while a task holds it.
    deadline: Mutex<Option<std::time::Instant>>,
    finished: Notify,
}

impl ListenerInner {
    fn listener(&self) -> &AnyListener {
        self.listener
            .as_ref()
            .expect("only Drop takes the listener")
    }

    fn fd(&self) -> &AsyncFd<OwnedFd> {
        self.fd.as_ref().expect("only Drop takes the descriptor")
    }
}

/// Ends a handshake task: another may start, and `accept`s waiting for it look.
struct Finished<'a>(&'a ListenerInner);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.working.store(false, Ordering::SeqCst);
        self.0.finished.notify_waiters();
    }
}

impl Drop for ListenerInner {
    /// Handshakes in progress and sessions not taken hold queue pairs and registered memory:
    /// they are torn down on rdmsg's own threads, never on a runtime thread.
    fn drop(&mut self) {
        let listener = self.listener.take();
        let done = std::mem::take(self.done.get_mut().unwrap_or_else(|p| p.into_inner()));
        crate::offload::tear_down((listener, done, self.fd.take()));
    }
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
        runtime("AsyncListener::bind")?;
        Self::over(AnyListener::Tcp(endpoint.listen(addr)?), config, session)
    }

    /// Listens through the RDMA connection manager on `addr` (an IP address of the endpoint's
    /// device, or a wildcard, and a port) for clients of
    /// [`AsyncSession::connect_cm`](crate::AsyncSession::connect_cm) or
    /// [`Endpoint::connect_cm`], each becoming a session with `session`'s bounds; otherwise
    /// as [`AsyncListener::bind`].
    pub fn bind_cm(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + std::fmt::Debug,
        config: Config,
        session: SessionConfig,
    ) -> Result<Self> {
        runtime("AsyncListener::bind_cm")?;
        let listener = endpoint.listen_cm(addr)?;
        Self::over(AnyListener::Cm(Mutex::new(listener)), config, session)
    }

    fn over(listener: AnyListener, config: Config, session: SessionConfig) -> Result<Self> {
        let fd = listener
            .fd()
            .map_err(io("duplicating the listener's descriptor"))?;
        let local = listener.local_addr()?;
        Ok(Self {
            inner: Arc::new(ListenerInner {
                listener: Some(listener),
                local,
                config,
                session,
                fd: Some(register(fd).map_err(io("registering the listener with the runtime"))?),
                done: Mutex::new(Default::default()),
                working: AtomicBool::new(false),
                again: AtomicBool::new(false),
                deadline: Mutex::new(None),
                finished: Notify::new(),
                failed: AtomicU64::new(0),
            }),
        })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.inner.local)
    }

    /// The next client whose handshake completes, as a session (cancel-safe). Clients that
    /// fail their handshake are skipped (counted in [`AsyncListener::failed_handshakes`],
    /// and traced with the `tracing` feature; [`AsyncListener::incoming`] yields them), so
    /// `Err` is the listener's own failure only, by the rule every rdmsg listener follows
    /// ([`Listener::accept_outcome_timeout`]): a bad configuration, its descriptor failing,
    /// or descriptors exhausted when accepting (after which it goes on taking clients
    /// 100 ms later). `while let Ok(client) = listener.accept().await` stops at any of them.
    pub async fn accept(&self) -> Result<AsyncSession> {
        loop {
            if let Ok(client) = self.next_client().await? {
                return Ok(client);
            }
        }
    }

    /// Every client's outcome as a [`futures_core::Stream`] (see [`Incoming`]): a failed
    /// handshake is an `Err` item, and the stream goes on.
    pub fn incoming(&self) -> Incoming {
        Incoming::new(self.clone())
    }

    /// How many clients failed their handshake so far.
    pub fn failed_handshakes(&self) -> u64 {
        self.inner.failed.load(Ordering::Relaxed)
    }

    /// The next client's outcome: `Ok(Ok)` a session, `Ok(Err)` a client whose handshake
    /// failed, `Err` the listener's own failure.
    pub(crate) async fn next_client(&self) -> Outcome {
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
                return match made {
                    // Failing to take one client (its descriptor, at the limit) is that
                    // client's failure: the listener goes on.
                    Ok(Ok(session)) => Ok(AsyncSession::new(session).inspect_err(|_| {
                        inner.failed.fetch_add(1, Ordering::Relaxed);
                    })),
                    Ok(Err(e)) => {
                        inner.failed.fetch_add(1, Ordering::Relaxed);
                        Ok(Err(crate::Error::Handshake(e)))
                    }
                    // The listener's own (a bad configuration, its descriptor, out of
                    // descriptors when accepting).
                    Err(e) => Err(e.into()),
                };
            }
            if inner.working.load(Ordering::SeqCst) {
                // A blocking task is at it: wait for its result.
                finished.as_mut().await;
                continue;
            }
            // Wait until there is something to do (a client, handshake bytes, a handshake's
            // deadline), then let a blocking task move the handshakes on: they create queue
            // pairs and register memory, which has no place on the runtime's threads.
            let deadline = *inner.deadline.lock().unwrap_or_else(|p| p.into_inner());
            let timer = async {
                match deadline {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            };
            if !inner.again.swap(false, Ordering::SeqCst) {
                tokio::select! {
                    ready = inner.fd().readable() => {
                        ready.map_err(io("waiting for the listener"))?.clear_ready();
                    }
                    _ = timer => {}
                    // A task that finished between the look and now.
                    _ = &mut finished => continue,
                }
            }
            if !inner.working.swap(true, Ordering::SeqCst) {
                let task = self.inner.clone();
                crate::offload::run(move || {
                    // However the task ends (a panic included), the next `accept` can start
                    // another.
                    let _done = Finished(&task);
                    // Everything that can go on now: each call returns at the first client's
                    // outcome, so call again until there is none.
                    while let Some(made) = task
                        .listener()
                        .accept_outcome_timeout(&task.config, Some(Duration::ZERO))
                        .transpose()
                    {
                        let own = made.is_err();
                        // The session registers memory: made here too.
                        let made = made.map(|client| {
                            client.map(|c| Session::with_config(c, task.session.clone()))
                        });
                        task.done
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push_back(made);
                        if own {
                            // One error of the listener's own per look (a bad configuration
                            // would recur); the next `accept` looks again at once.
                            task.again.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                    let next = task.listener().next_timeout();
                    *task.deadline.lock().unwrap_or_else(|p| p.into_inner()) =
                        next.and_then(|t| std::time::Instant::now().checked_add(t));
                });
            }
        }
    }
}

/// Clients as they come, as a [`Stream`] ([`AsyncListener::incoming`]): a client that fails
/// its handshake is an [`crate::Error::Handshake`] item (not fatal) and the stream goes on; an
/// error of the listener itself (fatal) is yielded and ends it.
#[must_use = "streams do nothing unless polled"]
pub struct Incoming {
    listener: AsyncListener,
    next: Option<Waiting<crate::listener::Outcome>>,
    done: bool,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("waiting", &self.next.is_some())
            .field("done", &self.done)
            .finish()
    }
}

impl Incoming {
    pub(crate) fn new(listener: AsyncListener) -> Self {
        Self {
            listener,
            next: None,
            done: false,
        }
    }
}

impl Stream for Incoming {
    type Item = Result<AsyncSession>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let listener = &this.listener;
        let got = ready!(poll_wait(&mut this.next, cx, || {
            let listener = listener.clone();
            Box::pin(async move { listener.next_client().await })
        }));
        Poll::Ready(Some(match got {
            Ok(client) => client,
            Err(e) => {
                this.done = true;
                Err(e)
            }
        }))
    }
}
