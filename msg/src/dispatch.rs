//! Routing received messages by type to handlers or to channels read by worker threads.

use std::collections::hash_map::{Entry, HashMap};

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
    /// Non-fatal errors from the session (frames it dropped), skipped.
    pub bad_frames: u64,
    /// Messages for a channel whose receivers are all gone (dropped).
    pub orphaned: u64,
}

/// Routes messages by tag. Each tag has one route, a handler ([`Dispatcher::on`]) or a
/// channel ([`Dispatcher::channel`]); routing a tag twice is an [`Error::DuplicateTag`].
#[derive(Default)]
pub struct Dispatcher {
    /// Per tag: the type it was registered for, and its route.
    handlers: HashMap<u32, (&'static str, Handler)>,
    stats: DispatchStats,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field(
                "routes",
                &self.handlers.values().map(|(t, _)| t).collect::<Vec<_>>(),
            )
            .field("stats", &self.stats)
            .finish()
    }
}

impl Dispatcher {
    /// A dispatcher with no routes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the route of `M`, unless its tag has one already.
    fn route<M: Message>(&mut self, handler: Handler) -> Result<()> {
        let new = std::any::type_name::<M>();
        match self.handlers.entry(M::TAG) {
            Entry::Occupied(e) => Err(Error::DuplicateTag {
                tag: M::TAG,
                existing: e.get().0,
                new,
            }),
            Entry::Vacant(e) => {
                e.insert((new, handler));
                Ok(())
            }
        }
    }

    /// Calls `f` with every `M`, on the dispatching thread. [`Error::DuplicateTag`] if `M`'s
    /// tag is routed already (to a handler or a channel, of `M` or of another type).
    pub fn on<M: Message + DeserializeOwned + 'static>(
        &mut self,
        mut f: impl FnMut(M) + Send + 'static,
    ) -> Result<&mut Self> {
        self.route::<M>(Box::new(move |env: &Envelope| {
            f(env.decode::<M>()?);
            Ok(())
        }))?;
        Ok(self)
    }

    /// Sends every `M` into a bounded channel (`capacity` messages; the dispatcher blocks
    /// when it is full, which holds back the sender through the credits). Clone the receiver
    /// for several worker threads. [`Error::DuplicateTag`] if `M`'s tag is routed already.
    pub fn channel<M: Message + DeserializeOwned + Send + 'static>(
        &mut self,
        capacity: usize,
    ) -> Result<Receiver<M>> {
        let (tx, rx): (Sender<M>, Receiver<M>) = crossbeam::channel::bounded(capacity);
        self.route::<M>(Box::new(move |env: &Envelope| {
            tx.send(env.decode::<M>()?)
                .map_err(|_| Error::ReceiverGone(M::TAG))
        }))?;
        Ok(rx)
    }

    /// Routes one message. Errors (unknown tag, undecodable body) are counted and returned;
    /// the message is dropped either way.
    pub fn dispatch(&mut self, env: &Envelope) -> Result<()> {
        let Some((_, h)) = self.handlers.get_mut(&env.tag()) else {
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
    /// counted and skipped. Returns the first fatal error ([`Error::is_fatal`]), which ends
    /// it: for a graceful close, `Failure::PeerClosed` inside [`Error::Transport`]; a verb or
    /// a wait that failed ends it too rather than being retried.
    pub fn run(&mut self, session: &mut Session) -> Error {
        self.run_from(|| session.recv())
    }

    /// [`Dispatcher::run`] over any source of messages: a session shared some other way, or
    /// a scripted sequence in a test. Calls `recv` until it returns a fatal error.
    pub fn run_from(&mut self, mut recv: impl FnMut() -> Result<Envelope>) -> Error {
        loop {
            let skipped = &mut self.stats.bad_frames;
            match crate::drive::next_message(&mut recv, |_| *skipped += 1) {
                Ok(env) => {
                    let _ = self.dispatch(&env);
                }
                Err(e) => return e,
            }
        }
    }

    /// Statistics.
    pub fn stats(&self) -> DispatchStats {
        self.stats
    }
}
