//! [`Stream`] and [`Sink`] over the async handles: for `StreamExt`/`SinkExt` combinators,
//! `forward`, and code written against the traits rather than this crate.
//!
//! Each wraps a clone of its handle and boxes the one wait it has in progress (a receive, a
//! reservation, a flush), so a message already there is taken without a future, and the
//! usual path allocates nothing.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use futures_core::Stream;
use futures_sink::Sink;
use rdmsg_msg::{Envelope, HubEvent, Message};
use rdmsg_transport::PeerId;

use crate::session::SendPermit;
use crate::{AsyncHub, AsyncListener, AsyncSession, Error, Result};

type Waiting<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The messages a session receives, in order, as a [`Stream`] ([`AsyncSession::stream`]).
///
/// It ends (`None`) after the peer's graceful close, and after the first fatal error, which
/// it yields; errors that cost one message only ([`Error::is_fatal`] false: a bad frame, an
/// unknown tag) are yielded and it goes on. Dropping it, or a `next()` future, loses
/// nothing: a message is taken only in the poll that returns it.
#[must_use = "streams do nothing unless polled"]
pub struct SessionStream {
    session: AsyncSession,
    next: Option<Waiting<Result<Envelope>>>,
    done: bool,
}

impl std::fmt::Debug for SessionStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStream")
            .field("waiting", &self.next.is_some())
            .field("done", &self.done)
            .finish()
    }
}

impl SessionStream {
    pub(crate) fn new(session: AsyncSession) -> Self {
        Self {
            session,
            next: None,
            done: false,
        }
    }

    /// The session it reads.
    pub fn session(&self) -> &AsyncSession {
        &self.session
    }
}

/// What a stream yields for `e`, and whether it ends.
fn ending<T>(done: &mut bool, e: Error) -> Option<Result<T>> {
    if e.is_peer_closed() {
        *done = true;
        return None;
    }
    *done = e.is_fatal();
    Some(Err(e))
}

impl Stream for SessionStream {
    type Item = Result<Envelope>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.next.is_none() {
            // What has arrived already, without a future.
            match this.session.try_recv() {
                Ok(Some(env)) => return Poll::Ready(Some(Ok(env))),
                Ok(None) => {}
                Err(e) => return Poll::Ready(ending(&mut this.done, e)),
            }
            let session = this.session.clone();
            this.next = Some(Box::pin(async move { session.recv().await }));
        }
        let got = ready!(this
            .next
            .as_mut()
            .map_or(Poll::Pending, |f| f.as_mut().poll(cx)));
        this.next = None;
        Poll::Ready(match got {
            Ok(env) => Some(Ok(env)),
            Err(e) => ending(&mut this.done, e),
        })
    }
}

/// Messages sent over a session, as a [`Sink`] of any [`Message`] type
/// ([`AsyncSession::sink`]).
///
/// `poll_ready` is [`AsyncSession::reserve`]: it waits for room and commits nothing;
/// `start_send` then commits the message at once ([`SendPermit::send`]), solicited as its
/// type says. `poll_flush` is [`AsyncSession::flush`]: everything committed sent, and a
/// wake-up for what went unsolicited. `poll_close` flushes; it does not close the session
/// ([`AsyncSession::close`] does, from any handle).
#[must_use = "sinks do nothing unless polled"]
pub struct SessionSink {
    session: AsyncSession,
    permit: Option<SendPermit>,
    reserving: Option<Waiting<Result<SendPermit>>>,
    flushing: Option<Waiting<Result<()>>>,
}

impl std::fmt::Debug for SessionSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionSink")
            .field("ready", &self.permit.is_some())
            .field("reserving", &self.reserving.is_some())
            .field("flushing", &self.flushing.is_some())
            .finish()
    }
}

impl SessionSink {
    pub(crate) fn new(session: AsyncSession) -> Self {
        Self {
            session,
            permit: None,
            reserving: None,
            flushing: None,
        }
    }

    /// The session it sends over.
    pub fn session(&self) -> &AsyncSession {
        &self.session
    }

    fn poll_reserve(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.permit.is_some() {
            return Poll::Ready(Ok(()));
        }
        if self.reserving.is_none() {
            if let Some(permit) = self.session.try_reserve()? {
                self.permit = Some(permit);
                return Poll::Ready(Ok(()));
            }
            let session = self.session.clone();
            self.reserving = Some(Box::pin(async move { session.reserve().await }));
        }
        let got = ready!(self
            .reserving
            .as_mut()
            .map_or(Poll::Pending, |f| f.as_mut().poll(cx)));
        self.reserving = None;
        self.permit = Some(got?);
        Poll::Ready(Ok(()))
    }

    fn poll_flushed(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.flushing.is_none() {
            let session = self.session.clone();
            self.flushing = Some(Box::pin(async move { session.flush().await }));
        }
        let done = ready!(self
            .flushing
            .as_mut()
            .map_or(Poll::Pending, |f| f.as_mut().poll(cx)));
        self.flushing = None;
        Poll::Ready(done)
    }
}

impl<M: Message> Sink<M> for SessionSink {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_reserve(cx)
    }

    /// Commits `item` (see [`SendPermit::send`]). Without a `poll_ready` first it is
    /// committed all the same, queued behind what waits to go.
    fn start_send(self: Pin<&mut Self>, item: M) -> Result<()> {
        let this = self.get_mut();
        match this.permit.take() {
            Some(permit) => permit.send(&item),
            None => crate::session::commit(&this.session.shared, &item, M::SOLICITED),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_flushed(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        this.permit = None;
        this.reserving = None;
        this.poll_flushed(cx)
    }
}

/// A hub's events as a [`Stream`] ([`AsyncHub::events`]): it ends after the first fatal
/// error of the hub itself, which it yields (a peer's failure is an event, not an error).
/// Cancel-safe as [`AsyncHub::recv`].
#[must_use = "streams do nothing unless polled"]
pub struct HubEvents {
    hub: AsyncHub,
    next: Option<Waiting<Result<HubEvent>>>,
    done: bool,
}

impl std::fmt::Debug for HubEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubEvents")
            .field("waiting", &self.next.is_some())
            .field("done", &self.done)
            .finish()
    }
}

impl HubEvents {
    pub(crate) fn new(hub: AsyncHub) -> Self {
        Self {
            hub,
            next: None,
            done: false,
        }
    }
}

impl Stream for HubEvents {
    type Item = Result<HubEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.next.is_none() {
            match this.hub.try_recv() {
                Ok(Some(ev)) => return Poll::Ready(Some(Ok(ev))),
                Ok(None) => {}
                Err(e) => return Poll::Ready(ending(&mut this.done, e)),
            }
            let hub = this.hub.clone();
            this.next = Some(Box::pin(async move { hub.recv().await }));
        }
        let got = ready!(this
            .next
            .as_mut()
            .map_or(Poll::Pending, |f| f.as_mut().poll(cx)));
        this.next = None;
        Poll::Ready(match got {
            Ok(ev) => Some(Ok(ev)),
            Err(e) => ending(&mut this.done, e),
        })
    }
}

/// Messages to one peer of a hub, as a [`Sink`] of any [`Message`] type
/// ([`AsyncHub::sink_to`]): a writer that never holds up the hub or its other peers.
///
/// `start_send` posts the message ([`AsyncHub::post`]): sent at once or queued in the peer's
/// bounded outbox. If the outbox is full, the sink keeps the message and the next
/// `poll_ready` (or `poll_flush`) waits until the peer has read enough for it to fit: a slow
/// peer slows its own writer only. `poll_flush` also waits until the outbox is empty (every
/// message handed to the transport). A peer that left fails the send with
/// [`rdmsg_transport::Error::UnknownPeer`].
#[must_use = "sinks do nothing unless polled"]
pub struct PeerSink {
    hub: AsyncHub,
    peer: PeerId,
    /// A message the full outbox refused, being posted once it fits.
    held: Option<Waiting<Result<()>>>,
    flushing: Option<Waiting<Result<()>>>,
}

impl std::fmt::Debug for PeerSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSink")
            .field("peer", &self.peer)
            .field("holding", &self.held.is_some())
            .finish()
    }
}

impl PeerSink {
    pub(crate) fn new(hub: AsyncHub, peer: PeerId) -> Self {
        Self {
            hub,
            peer,
            held: None,
            flushing: None,
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

impl<M: Message + Send + 'static> Sink<M> for PeerSink {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_held(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: M) -> Result<()> {
        let this = self.get_mut();
        let peer = this.peer;
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
        if this.flushing.is_none() {
            let (hub, peer) = (this.hub.clone(), this.peer);
            this.flushing = Some(Box::pin(async move { hub.outbox_sent(peer).await }));
        }
        let done = ready!(this
            .flushing
            .as_mut()
            .map_or(Poll::Pending, |f| f.as_mut().poll(cx)));
        this.flushing = None;
        Poll::Ready(done)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        <Self as Sink<M>>::poll_flush(self, cx)
    }
}

/// Clients as they come, as a [`Stream`] ([`AsyncListener::incoming`]): a client that fails
/// its handshake is an [`Error::Handshake`] item (not fatal) and the stream goes on; an
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
        if this.next.is_none() {
            let listener = this.listener.clone();
            this.next = Some(Box::pin(async move { listener.next_client().await }));
        }
        let got = ready!(this
            .next
            .as_mut()
            .map_or(Poll::Pending, |f| f.as_mut().poll(cx)));
        this.next = None;
        Poll::Ready(Some(match got {
            Ok(client) => client,
            Err(e) => {
                this.done = true;
                Err(e)
            }
        }))
    }
}
