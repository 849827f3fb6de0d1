//! Routing received messages by type to handlers or to channels read by worker threads.

use std::collections::hash_map::{Entry, HashMap};
use std::ops::ControlFlow;
use std::sync::Arc;

use crossbeam::channel::{Receiver, Sender};
use rdmsg_transport::PeerId;
use serde::de::DeserializeOwned;

use crate::codec::Envelope;
use crate::{Error, Hub, HubEvent, Message, Result, Session};

/// A route: called with the message's peer, if it came from a hub.
type Handler<P> = Box<dyn FnMut(Option<P>, &Envelope) -> Result<()> + Send>;

/// What a [`Dispatcher`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatchStats {
    /// Messages handed to a handler or channel.
    pub dispatched: u64,
    /// Messages of a tag with no handler (dropped).
    pub unknown: u64,
    /// Messages whose body did not decode (dropped).
    pub undecodable: u64,
    /// Non-fatal errors from the session (frames it dropped), or a hub's
    /// [`HubEvent::BadFrame`]s, skipped.
    pub bad_frames: u64,
    /// Messages for a channel whose receivers are all gone (dropped).
    pub orphaned: u64,
    /// Messages for a route that needs their peer ([`Dispatcher::on_from`],
    /// [`Dispatcher::channel_from`]) dispatched without one (dropped).
    pub no_peer: u64,
    /// A hub's connections, disconnections and failed handshakes seen by
    /// [`Dispatcher::run_hub`].
    pub peer_events: u64,
}

/// The routing table, generic in the peer type only so that host tests can route with peers
/// they make up (a [`PeerId`] comes only from a hub).
struct Routes<P> {
    /// Per tag: the type it was registered for, and its route.
    handlers: HashMap<u32, (&'static str, Handler<P>)>,
    /// The routed types by name, for [`Error::UnknownTag`] (made as routes are added).
    registered: Arc<[(&'static str, u32)]>,
    stats: DispatchStats,
}

impl<P> Default for Routes<P> {
    fn default() -> Self {
        Self {
            handlers: HashMap::new(),
            registered: Arc::new([]),
            stats: DispatchStats::default(),
        }
    }
}

impl<P: Copy + Send + 'static> Routes<P> {
    /// Adds the route of `M`, unless its tag has one already.
    fn route<M: Message>(&mut self, handler: Handler<P>) -> Result<()> {
        let new = std::any::type_name::<M>();
        match self.handlers.entry(M::TAG) {
            Entry::Occupied(e) => Err(Error::DuplicateTag {
                tag: M::TAG,
                existing: e.get().0,
                new,
            }),
            Entry::Vacant(e) => {
                e.insert((new, handler));
                let mut types: Vec<_> = self
                    .handlers
                    .iter()
                    .map(|(&tag, &(name, _))| (name, tag))
                    .collect();
                types.sort_unstable();
                self.registered = types.into();
                Ok(())
            }
        }
    }

    fn on<M: Message + DeserializeOwned + 'static>(
        &mut self,
        mut f: impl FnMut(M) + Send + 'static,
    ) -> Result<()> {
        self.route::<M>(Box::new(move |_, env: &Envelope| {
            f(env.decode::<M>()?);
            Ok(())
        }))
    }

    fn on_from<M: Message + DeserializeOwned + 'static>(
        &mut self,
        mut f: impl FnMut(P, M) + Send + 'static,
    ) -> Result<()> {
        self.route::<M>(Box::new(move |peer, env: &Envelope| {
            let peer = peer.ok_or(Error::NoPeer(M::TAG))?;
            f(peer, env.decode::<M>()?);
            Ok(())
        }))
    }

    fn channel<M: Message + DeserializeOwned + Send + 'static>(
        &mut self,
        capacity: usize,
    ) -> Result<Receiver<M>> {
        let (tx, rx): (Sender<M>, Receiver<M>) = crossbeam::channel::bounded(capacity);
        self.route::<M>(Box::new(move |_, env: &Envelope| {
            tx.send(env.decode::<M>()?)
                .map_err(|_| Error::ReceiverGone(M::TAG))
        }))?;
        Ok(rx)
    }

    fn channel_from<M: Message + DeserializeOwned + Send + 'static>(
        &mut self,
        capacity: usize,
    ) -> Result<Receiver<(P, M)>> {
        let (tx, rx) = crossbeam::channel::bounded(capacity);
        self.route::<M>(Box::new(move |peer, env: &Envelope| {
            let peer = peer.ok_or(Error::NoPeer(M::TAG))?;
            tx.send((peer, env.decode::<M>()?))
                .map_err(|_| Error::ReceiverGone(M::TAG))
        }))?;
        Ok(rx)
    }

    fn dispatch(&mut self, peer: Option<P>, env: &Envelope) -> Result<()> {
        let Some((_, h)) = self.handlers.get_mut(&env.tag()) else {
            self.stats.unknown += 1;
            return Err(Error::UnknownTag {
                tag: env.tag(),
                registered: self.registered.clone(),
            });
        };
        match h(peer, env) {
            Ok(()) => {
                self.stats.dispatched += 1;
                Ok(())
            }
            Err(e @ Error::ReceiverGone(_)) => {
                self.stats.orphaned += 1;
                Err(e)
            }
            Err(e @ Error::NoPeer(_)) => {
                self.stats.no_peer += 1;
                Err(e)
            }
            Err(e) => {
                self.stats.undecodable += 1;
                Err(e)
            }
        }
    }
}

/// Routes messages by tag. Each tag has one route, a handler ([`Dispatcher::on`],
/// [`Dispatcher::on_from`]) or a channel ([`Dispatcher::channel`],
/// [`Dispatcher::channel_from`]); routing a tag twice is an [`Error::DuplicateTag`].
///
/// The `_from` routes hand over the sending peer of a [`Hub`] with each message, so one
/// dispatcher serves many peers; the others serve a [`Session`] and a hub alike.
#[derive(Default)]
pub struct Dispatcher {
    routes: Routes<PeerId>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field(
                "routes",
                &self
                    .routes
                    .handlers
                    .values()
                    .map(|(t, _)| t)
                    .collect::<Vec<_>>(),
            )
            .field("stats", &self.routes.stats)
            .finish()
    }
}

impl Dispatcher {
    /// A dispatcher with no routes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls `f` with every `M`, on the dispatching thread. [`Error::DuplicateTag`] if `M`'s
    /// tag is routed already (to a handler or a channel, of `M` or of another type).
    pub fn on<M: Message + DeserializeOwned + 'static>(
        &mut self,
        f: impl FnMut(M) + Send + 'static,
    ) -> Result<&mut Self> {
        self.routes.on(f)?;
        Ok(self)
    }

    /// Calls `f` with every `M` and the hub peer that sent it, on the dispatching thread. An
    /// `M` dispatched without a peer (from a [`Session`]) is dropped with [`Error::NoPeer`].
    /// [`Error::DuplicateTag`] if `M`'s tag is routed already.
    pub fn on_from<M: Message + DeserializeOwned + 'static>(
        &mut self,
        f: impl FnMut(PeerId, M) + Send + 'static,
    ) -> Result<&mut Self> {
        self.routes.on_from(f)?;
        Ok(self)
    }

    /// Sends every `M` into a bounded channel (`capacity` messages; the dispatcher blocks
    /// when it is full, which holds back the sender through the credits). Clone the receiver
    /// for several worker threads. [`Error::DuplicateTag`] if `M`'s tag is routed already.
    pub fn channel<M: Message + DeserializeOwned + Send + 'static>(
        &mut self,
        capacity: usize,
    ) -> Result<Receiver<M>> {
        self.routes.channel(capacity)
    }

    /// Sends every `M` with the hub peer that sent it into a bounded channel, like
    /// [`Dispatcher::channel`]: workers see whom to answer. A full channel blocks the
    /// dispatching thread, and so every peer of its hub. An `M` dispatched without a peer is
    /// dropped with [`Error::NoPeer`].
    pub fn channel_from<M: Message + DeserializeOwned + Send + 'static>(
        &mut self,
        capacity: usize,
    ) -> Result<Receiver<(PeerId, M)>> {
        self.routes.channel_from(capacity)
    }

    /// Routes one message that came without a peer (from a [`Session`]). Errors (unknown
    /// tag, undecodable body, a route that needs a peer) are counted and returned; the
    /// message is dropped either way.
    pub fn dispatch(&mut self, env: &Envelope) -> Result<()> {
        self.routes.dispatch(None, env)
    }

    /// Routes one message from `peer`, as [`Dispatcher::dispatch`].
    pub fn dispatch_from(&mut self, peer: PeerId, env: &Envelope) -> Result<()> {
        self.routes.dispatch(Some(peer), env)
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
            let skipped = &mut self.routes.stats.bad_frames;
            match crate::drive::next_message(&mut recv, |_| *skipped += 1) {
                Ok(env) => {
                    let _ = self.routes.dispatch(None, &env);
                }
                Err(e) => return e,
            }
        }
    }

    /// Receives from every peer of `hub` and routes each message with its peer, until the
    /// hub itself fails (its error is returned; a peer that fails or closes is only a
    /// [`HubEvent::Disconnected`]). Bad frames are counted and skipped, connection events
    /// counted.
    pub fn run_hub(&mut self, hub: &mut Hub) -> Error {
        loop {
            // Ends only with an error: the callback never breaks.
            if let Err(e) = self.run_hub_with(hub, |_, _| ControlFlow::Continue(())) {
                return e;
            }
        }
    }

    /// [`Dispatcher::run_hub`], handing every event to `on_event` with the hub (messages after
    /// they were routed), so that it can answer, greet new peers, note who left, or end the
    /// loop: `Ok(())` once it returns [`ControlFlow::Break`], else the hub's fatal error.
    pub fn run_hub_with(
        &mut self,
        hub: &mut Hub,
        mut on_event: impl FnMut(&mut Hub, HubEvent) -> ControlFlow<()>,
    ) -> Result<()> {
        loop {
            let event = match hub.recv() {
                Ok(ev) => ev,
                Err(e) if e.is_fatal() => return Err(e),
                // Not something a hub's `recv` returns (its peers' errors are events), but a
                // per-call error must not end the loop.
                Err(_) => {
                    self.routes.stats.bad_frames += 1;
                    continue;
                }
            };
            match &event {
                HubEvent::Message { peer, msg } => {
                    let _ = self.routes.dispatch(Some(*peer), msg);
                }
                HubEvent::BadFrame { .. } => self.routes.stats.bad_frames += 1,
                HubEvent::Connected { .. }
                | HubEvent::Unread { .. }
                | HubEvent::Unconfirmed { .. }
                | HubEvent::Writable { .. }
                | HubEvent::CallEnded { .. }
                | HubEvent::Disconnected { .. }
                | HubEvent::HandshakeFailed { .. } => self.routes.stats.peer_events += 1,
            }
            if on_event(hub, event).is_break() {
                return Ok(());
            }
        }
    }

    /// Statistics.
    pub fn stats(&self) -> DispatchStats {
        self.routes.stats
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::codec::{self, Decoder, FrameBytes};
    use crate::frame::{self, FIRST, LAST};

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Ask(u32);
    crate::message!(Ask);

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Tell(String);
    crate::message!(Tell);

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Tick;
    crate::message!(Tick);

    fn envelope<M: Message>(m: &M) -> Envelope {
        let mut buf = vec![0u8; 256];
        let n = codec::encode_single(m, 0, &mut buf).unwrap().unwrap();
        buf.truncate(n);
        Decoder::new(1 << 20)
            .push(FrameBytes::Owned(buf))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn routes_from_peers_see_the_peer_and_plain_routes_serve_both() {
        let mut r: Routes<u16> = Routes::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        r.on_from::<Ask>(move |p, a| sink.lock().unwrap().push((p, a.0)))
            .unwrap();
        let tells = r.channel_from::<Tell>(4).unwrap();
        let ticks = Arc::new(Mutex::new(0));
        let count = ticks.clone();
        r.on::<Tick>(move |_| *count.lock().unwrap() += 1).unwrap();

        r.dispatch(Some(7), &envelope(&Ask(1))).unwrap();
        r.dispatch(Some(9), &envelope(&Ask(2))).unwrap();
        r.dispatch(Some(9), &envelope(&Tell("hi".into()))).unwrap();
        r.dispatch(Some(3), &envelope(&Tick)).unwrap();
        r.dispatch(None, &envelope(&Tick)).unwrap();
        assert_eq!(*seen.lock().unwrap(), [(7, 1), (9, 2)]);
        assert_eq!(tells.try_recv().unwrap(), (9, Tell("hi".into())));
        assert_eq!(*ticks.lock().unwrap(), 2);
        assert_eq!(r.stats.dispatched, 5);
    }

    #[test]
    fn a_route_that_needs_a_peer_drops_a_message_without_one() {
        let mut r: Routes<u16> = Routes::default();
        r.on_from::<Ask>(|_, _| panic!("called without a peer"))
            .unwrap();
        let tells = r.channel_from::<Tell>(4).unwrap();
        let e = r.dispatch(None, &envelope(&Ask(1))).unwrap_err();
        assert!(matches!(e, Error::NoPeer(t) if t == Ask::TAG), "{e:?}");
        assert!(!e.is_fatal());
        assert!(matches!(
            r.dispatch(None, &envelope(&Tell("x".into()))),
            Err(Error::NoPeer(_))
        ));
        assert!(tells.is_empty());
        assert_eq!((r.stats.no_peer, r.stats.dispatched), (2, 0));
    }

    #[test]
    fn peer_routes_count_unknown_undecodable_and_orphaned_messages() {
        let mut r: Routes<u16> = Routes::default();
        let asks = r.channel_from::<Ask>(1).unwrap();
        assert!(matches!(
            r.on_from::<Ask>(|_, _| {}),
            Err(Error::DuplicateTag { .. })
        ));
        assert!(matches!(
            r.channel::<Ask>(1),
            Err(Error::DuplicateTag { .. })
        ));
        assert!(matches!(
            r.dispatch(Some(1), &envelope(&Tick)),
            Err(Error::UnknownTag { .. })
        ));
        // An Ask's tag over a body that is not one.
        let forged = frame::build(FIRST | LAST, Ask::TAG, 0, 0, &[0xff; 9]);
        let forged = Decoder::new(1 << 20)
            .push(FrameBytes::Owned(forged))
            .unwrap()
            .unwrap();
        assert!(matches!(
            r.dispatch(Some(1), &forged),
            Err(Error::Decode { .. })
        ));
        drop(asks);
        assert!(matches!(
            r.dispatch(Some(1), &envelope(&Ask(5))),
            Err(Error::ReceiverGone(_))
        ));
        let s = r.stats;
        assert_eq!((s.unknown, s.undecodable, s.orphaned), (1, 1, 1));
    }
}
