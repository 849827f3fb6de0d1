//! Routing received messages by type to handlers or to channels read by worker threads.

use std::collections::HashMap;

use crossbeam::channel::{Receiver, Sender};
use serde::de::DeserializeOwned;

use crate::codec::Envelope;
use crate::{Error, Message, Result, Session};

type Handler = Box<dyn FnMut(&Envelope) -> Result<()> + Send>;

/// What a [`Dispatcher`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatchStats {
    /// Messages handed to a handler or channel.
    pub dispatched: u64,
    /// Messages of a tag with no handler (dropped).
    pub unknown: u64,
    /// Messages whose body did not decode (dropped).
    pub undecodable: u64,
    /// Frames the session dropped.
    pub bad_frames: u64,
    /// Messages for a channel whose receivers are all gone (dropped).
    pub orphaned: u64,
}

/// Routes messages by tag.
#[derive(Default)]
pub struct Dispatcher {
    handlers: HashMap<u32, Handler>,
    stats: DispatchStats,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("tags", &self.handlers.keys().collect::<Vec<_>>())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Dispatcher {
    /// A dispatcher with no routes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls `f` with every `M`, on the dispatching thread.
    pub fn on<M: Message + DeserializeOwned + 'static>(
        &mut self,
        mut f: impl FnMut(M) + Send + 'static,
    ) -> &mut Self {
        self.handlers.insert(
            M::TAG,
            Box::new(move |env: &Envelope| {
                f(env.decode::<M>()?);
                Ok(())
            }),
        );
        self
    }

    /// Sends every `M` into a bounded channel (`capacity` messages; the dispatcher blocks
    /// when it is full, which holds back the sender through the credits). Clone the receiver
    /// for several worker threads.
    pub fn channel<M: Message + DeserializeOwned + Send + 'static>(
        &mut self,
        capacity: usize,
    ) -> Receiver<M> {
        let (tx, rx): (Sender<M>, Receiver<M>) = crossbeam::channel::bounded(capacity);
        self.handlers.insert(
            M::TAG,
            Box::new(move |env: &Envelope| {
                tx.send(env.decode::<M>()?)
                    .map_err(|_| Error::ReceiverGone(M::TAG))
            }),
        );
        rx
    }

    /// Routes one message. Errors (unknown tag, undecodable body) are counted and returned;
    /// the message is dropped either way.
    pub fn dispatch(&mut self, env: &Envelope) -> Result<()> {
        let Some(h) = self.handlers.get_mut(&env.tag()) else {
            self.stats.unknown += 1;
            return Err(Error::UnknownTag(env.tag()));
        };
        match h(env) {
            Ok(()) => {
                self.stats.dispatched += 1;
                Ok(())
            }
            Err(e @ Error::ReceiverGone(_)) => {
                self.stats.orphaned += 1;
                Err(e)
            }
            Err(e) => {
                self.stats.undecodable += 1;
                Err(e)
            }
        }
    }

    /// Receives and routes until the session fails or the peer closes; non-fatal errors are
    /// counted and skipped. Returns the fatal error that ended it (for a graceful close,
    /// `Failure::PeerClosed` inside [`Error::Transport`]).
    pub fn run(&mut self, session: &mut Session) -> Error {
        loop {
            match session.recv() {
                Ok(env) => {
                    let _ = self.dispatch(&env);
                }
                Err(e) if e.is_fatal() => return e,
                Err(_) => self.stats.bad_frames += 1,
            }
        }
    }

    /// Statistics.
    pub fn stats(&self) -> DispatchStats {
        self.stats
    }
}
