//! What the [`futures_core::Stream`]s and [`futures_sink::Sink`]s over the async handles share
//! (they live beside their handles: `SessionStream` and `SessionSink` in `session`,
//! `HubEvents` and `PeerSink` in `hub`, `Incoming` in `listener`). Each wraps a clone of its
//! handle and boxes the one wait it has in progress (a receive, a reservation, a flush), so a
//! message already there is taken without a future, and the usual path allocates nothing.

use std::future::Future;
use std::pin::Pin;

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
