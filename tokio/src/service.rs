//! Calls as a [`tower_service::Service`] (feature `tower`): timeouts, retries, concurrency
//! limits and load balancing from the tower ecosystem over a session's or a hub peer's calls,
//! and a hub's peers as a set that changes ([`PeerServices`]) for tower's balancers.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use rdmsg_msg::{Hub, Request};
use rdmsg_transport::PeerId;
use tower::discover::Change;

use crate::{AsyncHub, AsyncSession, Error, Result};

/// Calls of one request type `R` to one peer, as a [`tower_service::Service`]: each call
/// sends a request and resolves to its answer, within the service's `timeout` (the call's
/// deadline, which travels with the request). Made by [`AsyncSession::service`] or
/// [`AsyncHub::service`]; clones call the same peer.
///
/// Always ready: a call waits for room (a credit, or room in a hub peer's outbox) within its
/// own deadline, so limits on calls in flight are tower's (`ConcurrencyLimit`). An error is
/// the call's, [`Error::Msg`] around [`rdmsg_msg::Error::CallTimedOut`],
/// [`rdmsg_msg::Error::CallFailed`] with what became of the request, and so on, for a retry
/// policy to judge.
pub struct CallService<R> {
    to: To,
    timeout: Duration,
    request: PhantomData<fn(R)>,
}

#[derive(Clone, Debug)]
enum To {
    Session(AsyncSession),
    Peer(AsyncHub, PeerId),
}

impl<R> Clone for CallService<R> {
    fn clone(&self) -> Self {
        Self {
            to: self.to.clone(),
            timeout: self.timeout,
            request: PhantomData,
        }
    }
}

impl<R> std::fmt::Debug for CallService<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallService")
            .field("request", &std::any::type_name::<R>())
            .field("to", &self.to)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<R> CallService<R> {
    /// Its peer: `None` for a session's.
    pub fn peer(&self) -> Option<PeerId> {
        match &self.to {
            To::Session(_) => None,
            To::Peer(_, peer) => Some(*peer),
        }
    }
}

impl AsyncSession {
    /// This session's calls of type `R` as a [`tower_service::Service`], each within
    /// `timeout` (feature `tower`).
    pub fn service<R: Request>(&self, timeout: Duration) -> CallService<R> {
        CallService {
            to: To::Session(self.clone()),
            timeout,
            request: PhantomData,
        }
    }
}

impl AsyncHub {
    /// Calls of type `R` to `peer` as a [`tower_service::Service`], each within `timeout`
    /// (feature `tower`). A peer failed or gone fails each call with
    /// [`rdmsg_msg::Error::CallFailed`] and [`rdmsg_msg::RequestFate::NotSent`].
    pub fn service<R: Request>(&self, peer: PeerId, timeout: Duration) -> CallService<R> {
        CallService {
            to: To::Peer(self.clone(), peer),
            timeout,
            request: PhantomData,
        }
    }
}

impl<R> tower_service::Service<R> for CallService<R>
where
    R: Request + Clone + Send + Sync + 'static,
    R::Response: serde::de::DeserializeOwned + Send + 'static,
{
    type Response = R::Response;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<R::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: R) -> Self::Future {
        let (to, timeout) = (self.to.clone(), self.timeout);
        Box::pin(async move {
            match to {
                To::Session(session) => session.call(&request, timeout).await,
                To::Peer(hub, peer) => hub.call(peer, &request, timeout).await,
            }
        })
    }
}

/// The peers of an [`AsyncHub`] as a set that changes, each as a [`CallService`]: a stream of
/// [`Change`]s, and so a `tower::discover::Discover` for tower's balancers. A peer is inserted
/// once its handshake is done and removed once its connection fails or closes, or this hub
/// starts closing it ([`Hub::is_closing`]), before its `Disconnected` is received: a balancer
/// stops choosing a dead worker by itself. Made by [`AsyncHub::discover`] or
/// [`AsyncHub::discover_where`].
///
/// While polled, the set is looked at each time the hub makes progress, over all the hub's
/// peers: meant for the tens or hundreds of servers a client's hub connects to. Polling it
/// also drives the hub (accepts, handshakes), as any wait on an [`AsyncHub`] does. A stream
/// polled once and then left (a balancer nobody calls) keeps one waiter registered on the hub
/// until it is polled again or dropped. The hub's events still go to [`AsyncHub::recv`]: an
/// application that never reads them lets every peer's `Connected` and `Disconnected` queue
/// (one of each per peer that came and went).
pub struct PeerServices<R> {
    hub: AsyncHub,
    timeout: Duration,
    keep: Keep,
    known: BTreeSet<PeerId>,
    changes: VecDeque<Change<PeerId, CallService<R>>>,
    looking: Option<Looking>,
}

type Keep = Arc<dyn Fn(PeerId, &Hub) -> bool + Send + Sync>;

/// A wait for the chosen peers to differ from those reported: they, now.
type Looking = Pin<Box<dyn Future<Output = Result<BTreeSet<PeerId>>> + Send>>;

impl<R> std::fmt::Debug for PeerServices<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServices")
            .field("request", &std::any::type_name::<R>())
            .field("known", &self.known)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl AsyncHub {
    /// Every peer of this hub as a [`CallService`] of `R` (each call within `timeout`), in a
    /// set that follows the connections ([`PeerServices`]; feature `tower`). For a hub whose
    /// peers all serve `R`; otherwise [`AsyncHub::discover_where`].
    pub fn discover<R: Request>(&self, timeout: Duration) -> PeerServices<R> {
        self.discover_where(timeout, |_, _| true)
    }

    /// The peers of this hub that `keep` chooses (asked each time the set is looked at, with
    /// the hub: for instance what the peer said in its handshake,
    /// `hub.transport().peer_hello(peer)`), as in [`AsyncHub::discover`].
    pub fn discover_where<R: Request>(
        &self,
        timeout: Duration,
        keep: impl Fn(PeerId, &Hub) -> bool + Send + Sync + 'static,
    ) -> PeerServices<R> {
        PeerServices {
            hub: self.clone(),
            timeout,
            keep: Arc::new(keep),
            known: BTreeSet::new(),
            changes: VecDeque::new(),
            looking: None,
        }
    }
}

impl<R: Request> Stream for PeerServices<R> {
    type Item = Result<Change<PeerId, CallService<R>>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(change) = this.changes.pop_front() {
                return Poll::Ready(Some(Ok(change)));
            }
            let looking = this.looking.get_or_insert_with(|| {
                let (hub, keep, known) = (this.hub.clone(), this.keep.clone(), this.known.clone());
                Box::pin(async move {
                    hub.wait_for(move |h| {
                        let now: BTreeSet<PeerId> = h
                            .peers()
                            .filter(|&p| !h.is_closing(p) && keep(p, h))
                            .collect();
                        (now != known).then_some(now)
                    })
                    .await
                })
            });
            let now = ready!(looking.as_mut().poll(cx));
            this.looking = None;
            let now = match now {
                Ok(now) => now,
                Err(e) => return Poll::Ready(Some(Err(e))),
            };
            for &gone in this.known.difference(&now) {
                this.changes.push_back(Change::Remove(gone));
            }
            for &new in now.difference(&this.known) {
                let service = this.hub.service(new, this.timeout);
                this.changes.push_back(Change::Insert(new, service));
            }
            this.known = now;
        }
    }
}
