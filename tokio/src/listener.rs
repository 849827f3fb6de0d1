//! An async listener: handshakes on blocking tasks, accepted sessions handed out by `accept`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmsg_msg::{Session, SessionConfig};
use rdmsg_transport::{Config, Connection, Endpoint, Listener};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::error::{io, register};
use crate::{AsyncSession, Result};

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
