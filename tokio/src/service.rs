//! Calls as a [`tower_service::Service`] (feature `tower`): timeouts, retries, concurrency
//! limits and load balancing from the tower ecosystem over a session's or a hub peer's calls.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rdmsg_msg::Request;
use rdmsg_transport::PeerId;

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
