//! What the [`futures_core::Stream`]s and [`futures_sink::Sink`]s over the async handles share
//! (they live beside their handles: `SessionStream` and `SessionSink` in `session`,
//! `HubEvents` and `PeerSink` in `hub`, `Incoming` in `listener`). Each holds a clone of its
//! handle (or, for the receive streams, of the session's or hub's shared driver) and boxes the
//! one wait it has in progress (a receive, a reservation, a flush), so a
//! message already there is taken without a future, and the usual path allocates nothing.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use crate::shared::{Drive, SharedDriver};
use crate::{Error, Result};

/// The one wait a stream or sink has in progress.
pub(crate) type Waiting<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a stream yields for `e`, and whether it ends.
pub(crate) fn ending<T>(done: &mut bool, e: Error) -> Option<Result<T>> {
    if e.is_peer_closed() {
        *done = true;
        return None;
    }
    *done = e.is_fatal();
    Some(Err(e))
}

/// Polls the wait in `slot`, started by `start` if none is in progress; clears the slot once
/// it is done.
pub(crate) fn poll_wait<T>(
    slot: &mut Option<Waiting<T>>,
    cx: &mut Context<'_>,
    start: impl FnOnce() -> Waiting<T>,
) -> Poll<T> {
    let done = ready!(slot.get_or_insert_with(start).as_mut().poll(cx));
    *slot = None;
    Poll::Ready(done)
}

/// A stream of a session's or hub's receives: what is there is taken without a future, else
/// one boxed wait; it ends at the peer's graceful close or after a fatal error (see
/// [`ending`]). The stream that holds it holds the handle and gives its shared driver to
/// each poll.
pub(crate) struct Receives<D: Drive> {
    next: Option<Waiting<Result<D::Received>>>,
    done: bool,
}

impl<D: Drive> std::fmt::Debug for Receives<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receives")
            .field("waiting", &self.next.is_some())
            .field("done", &self.done)
            .finish()
    }
}

impl<D: Drive> Receives<D> {
    pub(crate) fn new() -> Self {
        Self {
            next: None,
            done: false,
        }
    }

    pub(crate) fn poll_next(
        &mut self,
        shared: &Arc<SharedDriver<D>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<D::Received>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.next.is_none() {
            match shared.try_recv() {
                Ok(Some(item)) => return Poll::Ready(Some(Ok(item))),
                Ok(None) => {}
                Err(e) => return Poll::Ready(ending(&mut self.done, e)),
            }
        }
        let got = ready!(poll_wait(&mut self.next, cx, || {
            let shared = Arc::clone(shared);
            Box::pin(async move { shared.recv().await })
        }));
        Poll::Ready(match got {
            Ok(item) => Some(Ok(item)),
            Err(e) => ending(&mut self.done, e),
        })
    }
}
