//! An async hub.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rdmsg_msg::{Hub, HubEvent, Message, Posted, Request, Responder, SessionStats};
use rdmsg_transport::PeerId;

use crate::error::io;
use crate::shared::{Locked, SharedDriver};
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use futures_core::Stream;
use futures_sink::Sink;

use crate::stream::{poll_wait, Receives, Waiting};

use crate::{Error, Result};

/// A typed hub on tokio: many peers, one descriptor. Clones share the hub; the last one
/// dropped has it torn down on rdmsg's own threads.
#[derive(Debug, Clone)]
pub struct AsyncHub {
    shared: Arc<SharedDriver<Hub>>,
}

impl AsyncHub {
    /// Wraps a hub; call within a tokio runtime ([`crate::Error::NoRuntime`] outside one).
    pub fn new(hub: Hub) -> Result<Self> {
        Ok(Self {
            shared: SharedDriver::start(hub, "AsyncHub::new")?,
        })
    }

    /// The hub, locked. A hub is never taken out of its handles (only sessions close so).
    fn hub(&self) -> Locked<'_, Hub> {
        self.shared
            .lock()
            .unwrap_or_else(|_| unreachable!("a hub is never closed through its handles"))
    }

    /// Runs `f` on the hub (to listen, register types, read figures): `f` must not block.
    pub fn with_hub<R>(&self, f: impl FnOnce(&mut Hub) -> R) -> R {
        let mut hub = self.hub();
        self.shared.signalling(&mut hub, f)
    }

    /// The hub's events as a [`futures_core::Stream`] (see [`HubEvents`]).
    pub fn events(&self) -> HubEvents {
        HubEvents::new(self.clone())
    }

    /// A [`futures_sink::Sink`] of messages of type `M` to `peer` through its outbox (see
    /// [`PeerSink`]).
    pub fn sink_to<M: Message + Send + 'static>(&self, peer: PeerId) -> PeerSink<M> {
        PeerSink::new(self.clone(), peer)
    }

    /// Posts `m` to `peer` (see [`Hub::post`]), waiting while its outbox is too full for it:
    /// for a writer that may wait for its peer. Cancel-safe: `m` is handed over only in the
    /// poll that returns `Ok` (dropping the future drops `m`, unsent). A peer that left:
    /// [`rdmsg_transport::Error::UnknownPeer`].
    pub async fn post_when_room<M: Message + Send + 'static>(
        &self,
        peer: PeerId,
        m: M,
    ) -> Result<()> {
        let mut item = Some(m);
        self.shared
            .run(false, |h, _| {
                let Some(m) = item.take() else {
                    return Ok(Some(()));
                };
                match h.post(peer, m)? {
                    Posted::Sent | Posted::Queued => Ok(Some(())),
                    Posted::Full(m) => {
                        item = Some(m);
                        Ok(None)
                    }
                    Posted::PeerGone(_) => Err(rdmsg_transport::Error::UnknownPeer(peer).into()),
                }
            })
            .await?;
        self.send_queued();
        Ok(())
    }

    /// Waits until `peer`'s outbox is empty: everything posted to it handed to the transport
    /// (a peer that left has nothing waiting).
    pub async fn outbox_sent(&self, peer: PeerId) -> Result<()> {
        self.shared
            .run(false, |h, _| {
                Ok(h.outbox(peer)
                    .map_or(true, |o| o.messages == 0)
                    .then_some(()))
            })
            .await
    }

    /// Starts a connection to the hub or listener at `addr`: the TCP connect is awaited, then
    /// the handshake goes on in the hub (its outcome is an event). Waits first while a quarter
    /// of `max_pending_handshakes` of our own handshakes are in flight.
    pub async fn connect(&self, addr: impl tokio::net::ToSocketAddrs) -> Result<PeerId> {
        self.room_to_connect().await?;
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(io("connecting the bootstrap stream"))?;
        let stream = stream
            .into_std()
            .map_err(io("taking the bootstrap stream from the runtime"))?;
        let peer = self.with_hub(|h| h.connect_stream(stream))?;
        Ok(peer)
    }

    /// Starts a connection through the RDMA connection manager to the CM listener or hub at
    /// `addr`: everything after the call runs in the hub, without a thread of its own (its
    /// outcome is an event). Waits first while a quarter of `max_pending_handshakes` of our
    /// own handshakes are in flight.
    pub async fn connect_cm(&self, addr: std::net::SocketAddr) -> Result<PeerId> {
        self.room_to_connect().await?;
        Ok(self.with_hub(|h| h.start_connect_cm(addr))?)
    }

    /// Waits while a quarter of `max_pending_handshakes` of our own handshakes are in flight.
    async fn room_to_connect(&self) -> Result<()> {
        let most = self
            .with_hub(|h| (h.transport().config().conn.max_pending_handshakes as usize / 4).max(1));
        self.shared
            .run(false, |h, _| {
                Ok((h.transport().pending_connects() < most).then_some(()))
            })
            .await
    }

    /// Waits until `look` finds something on the hub, which goes on stepping meanwhile (its
    /// events still queue for [`AsyncHub::recv`]).
    #[cfg(feature = "tower")]
    pub(crate) async fn wait_for<T>(&self, mut look: impl FnMut(&Hub) -> Option<T>) -> Result<T> {
        self.shared.run(false, |h, _| Ok(look(h))).await
    }

    /// The next event (cancel-safe).
    pub async fn recv(&self) -> Result<HubEvent> {
        self.shared.recv().await
    }

    /// An event that has already happened, without waiting.
    pub fn try_recv(&self) -> Result<Option<HubEvent>> {
        self.shared.try_recv()
    }

    /// Sends `m` to `peer`, solicited or not as its type says, waiting for its credits (and
    /// its handshake).
    pub async fn send<M: Message>(&self, peer: PeerId, m: &M) -> Result<()> {
        self.send_as(peer, m, M::SOLICITED).await
    }

    /// Sends `m` to `peer`, solicited or not as given, waiting for its credits as long as it
    /// takes; the crate docs' solicitation rule applies.
    pub async fn send_as<M: Message>(&self, peer: PeerId, m: &M, solicited: bool) -> Result<()> {
        self.shared
            .run(false, |h, shared| {
                let waiting = shared.receivers.load(Ordering::SeqCst) > 0;
                let solicit = h.solicit_for(solicited, waiting);
                Ok(h.try_send_as(peer, m, solicit)?.then_some(()))
            })
            .await
    }

    /// Sends `m` to `peer` only if it can go at once.
    pub fn try_send_as<M: Message>(&self, peer: PeerId, m: &M, solicited: bool) -> Result<bool> {
        self.with_hub(|h| {
            // Read under the mutex (see `AsyncSession::try_send_as`).
            let waiting = self.shared.receivers.load(Ordering::SeqCst) > 0;
            let solicit = h.solicit_for(solicited, waiting);
            Ok(h.try_send_as(peer, m, solicit)?)
        })
    }

    /// Sends `m` to `peer` without ever waiting (see [`Hub::post`]): at once, or queued in
    /// its bounded outbox, or handed back if that is full ([`HubEvent::Writable`] follows
    /// once it has room). Queued messages go as the peer's credits come, driven by the tasks
    /// that wait on the hub.
    pub fn post<M: Message + Send + 'static>(&self, peer: PeerId, m: M) -> Result<Posted<M>> {
        let posted = self.with_hub(|h| h.post(peer, m))?;
        self.send_queued();
        Ok(posted)
    }

    /// What waits in outboxes goes as credits come, even while no task waits on the hub.
    fn send_queued(&self) {
        if self.hub().outboxes_waiting() {
            self.shared.send_in_background();
        }
    }

    /// Answers a request from a peer without waiting (see [`Hub::reply`]).
    /// [`Responder::respond`] does the same from any task or thread.
    pub fn reply<T: Message + Send + 'static>(
        &self,
        responder: Responder<T>,
        value: T,
    ) -> Result<Posted<T>> {
        let posted = self.with_hub(|h| h.reply(responder, value))?;
        self.send_queued();
        Ok(posted)
    }

    /// Calls `peer` (see [`Hub::call`]): the request goes at once or through `peer`'s
    /// outbox, and its answer is awaited, all within `timeout`. Dropping the future cancels
    /// the call. Other events wait for [`AsyncHub::recv`].
    pub async fn call<R>(
        &self,
        peer: PeerId,
        request: &R,
        timeout: std::time::Duration,
    ) -> Result<R::Response>
    where
        R: Request + Clone + Send + 'static,
        R::Response: serde::de::DeserializeOwned,
    {
        let request_type = std::any::type_name::<R>();
        // One deadline however often the start finds the outbox full: each try gets what is
        // left.
        let left = crate::shared::time_left(timeout);
        self.shared
            .call(timeout, request_type, |h, _| {
                Ok(h.try_start_call(peer, request, left())?)
            })
            .await
    }

    /// Flushes `peer` (see [`Hub::flush`]) without waiting: whether nothing is left pending.
    pub fn try_flush(&self, peer: PeerId) -> Result<bool> {
        self.with_hub(|h| Ok(h.try_flush(peer)?))
    }

    /// Closes `peer` gracefully; its `Disconnected` event follows (after `Unread` if the peer
    /// had not finished reading what it was lent within `close_timeout`).
    pub fn close(&self, peer: PeerId) -> Result<()> {
        self.with_hub(|h| Ok(h.start_close(peer)?))
    }

    /// The hub's statistics over all peers.
    pub fn stats(&self) -> SessionStats {
        self.shared.stats()
    }

    /// How many times a waiting task was woken by the hub's descriptor.
    pub fn wakeups(&self) -> u64 {
        self.shared.wakeups.load(Ordering::Relaxed)
    }
}

/// A hub's events as a [`Stream`] ([`AsyncHub::events`]): it ends after the first fatal
/// error of the hub itself, which it yields (a peer's failure is an event, not an error).
/// Cancel-safe as [`AsyncHub::recv`].
#[must_use = "streams do nothing unless polled"]
#[derive(Debug)]
pub struct HubEvents {
    hub: Arc<SharedDriver<Hub>>,
    receives: Receives<Hub>,
}

impl HubEvents {
    pub(crate) fn new(hub: AsyncHub) -> Self {
        Self {
            hub: hub.shared,
            receives: Receives::new(),
        }
    }
}

impl Stream for HubEvents {
    type Item = Result<HubEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        this.receives.poll_next(&this.hub, cx)
    }
}

/// Messages of type `M` to one peer of a hub, as a [`Sink`] ([`AsyncHub::sink_to`]): a
/// writer that never holds up the hub or its other peers.
///
/// `start_send` posts the message ([`AsyncHub::post`]): sent at once or queued in the peer's
/// bounded outbox. If the outbox is full, the sink keeps the message and the next
/// `poll_ready` (or `poll_flush`) waits until the peer has read enough for it to fit: a slow
/// peer slows its own writer only. `poll_flush` also waits until the outbox is empty (every
/// message handed to the transport). A peer that left fails the send with
/// [`rdmsg_transport::Error::UnknownPeer`].
#[must_use = "sinks do nothing unless polled"]
pub struct PeerSink<M> {
    hub: AsyncHub,
    peer: PeerId,
    /// A message the full outbox refused, being posted once it fits.
    held: Option<Waiting<Result<()>>>,
    flushing: Option<Waiting<Result<()>>>,
    sends: PhantomData<fn(M)>,
}

impl<M> std::fmt::Debug for PeerSink<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSink")
            .field("peer", &self.peer)
            .field("holding", &self.held.is_some())
            .finish()
    }
}

impl<M> PeerSink<M> {
    pub(crate) fn new(hub: AsyncHub, peer: PeerId) -> Self {
        Self {
            hub,
            peer,
            held: None,
            flushing: None,
            sends: PhantomData,
        }
    }

    /// The peer it writes to.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    fn poll_held(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let Some(held) = self.held.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let posted = ready!(held.as_mut().poll(cx));
        self.held = None;
        Poll::Ready(posted)
    }
}

impl<M: Message + Send + 'static> Sink<M> for PeerSink<M> {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_held(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: M) -> Result<()> {
        let this = self.get_mut();
        let peer = this.peer;
        if let Some(before) = this.held.take() {
            // Sent without waiting for `poll_ready`: it waits behind the one held, in order.
            let hub = this.hub.clone();
            this.held = Some(Box::pin(async move {
                before.await?;
                hub.post_when_room(peer, item).await
            }));
            return Ok(());
        }
        match this.hub.post(peer, item)? {
            rdmsg_msg::Posted::Sent | rdmsg_msg::Posted::Queued => Ok(()),
            rdmsg_msg::Posted::Full(item) => {
                let hub = this.hub.clone();
                this.held = Some(Box::pin(
                    async move { hub.post_when_room(peer, item).await },
                ));
                Ok(())
            }
            rdmsg_msg::Posted::PeerGone(_) => Err(rdmsg_transport::Error::UnknownPeer(peer).into()),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_held(cx))?;
        let (hub, peer) = (&this.hub, this.peer);
        poll_wait(&mut this.flushing, cx, || {
            let hub = hub.clone();
            Box::pin(async move { hub.outbox_sent(peer).await })
        })
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.poll_flush(cx)
    }
}
