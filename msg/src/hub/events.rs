//! What a hub hands out ([`HubEvent`]) and what a post did ([`Posted`]).

use super::*;

/// What happened in a [`Hub`]. Per peer, events come in order: `Connected`, its messages and
/// bad frames (and the ends of the calls to it that the hub watches), then `Unconfirmed` and
/// `Disconnected`.
#[derive(Debug)]
pub enum HubEvent {
    /// A connection is established: accepted from the hub's listener (`accepted`), or one that
    /// [`Hub::connect`] started.
    Connected {
        /// The connection.
        peer: PeerId,
        /// Accepted (else connected by us).
        accepted: bool,
    },
    /// A message from `peer`. A single-frame message is still in its receive buffer, which it
    /// holds until dropped (holding many holds back that peer, and past the hub's spare
    /// buffers, others).
    Message {
        /// Who sent it.
        peer: PeerId,
        /// The message, still encoded: [`Envelope::decode`] it.
        msg: Envelope,
    },
    /// A frame from `peer` was dropped: malformed, out of order, of an unregistered tag
    /// ([`Error::BadFrame`], [`Error::UnknownTag`]), or a message sent by rendezvous could
    /// not be read ([`Error::ReadFailed`]: its place in the order, then the next). A bad frame
    /// does not fail the peer: the next good message from it is delivered. (A read fails
    /// when the connection does, and comes before its `Disconnected`.)
    BadFrame {
        /// Who sent it.
        peer: PeerId,
        /// Why it was dropped (never fatal).
        error: Error,
    },
    /// A close started by [`Hub::start_close`] ran out of `close_timeout` before `peer`
    /// finished reading `messages` messages lent to it by rendezvous (their reads fail, see
    /// [`Error::Unread`]); the close goes on, and `Disconnected` follows.
    Unread {
        /// The connection closing.
        peer: PeerId,
        /// Messages it had not finished reading.
        messages: usize,
    },
    /// The connection ended with messages sent to `peer` that its application was not seen
    /// to take: copies kept with [`SessionConfig::keep_unconfirmed`], in order, to be sent
    /// elsewhere (see [`crate::Session::take_unconfirmed`] for what "seen" means after a
    /// failure). `Disconnected` follows.
    Unconfirmed {
        /// The connection that ended.
        peer: PeerId,
        /// Its delivery record at the end.
        delivery: Delivery,
        /// The messages not taken, as they went.
        messages: Vec<Envelope>,
    },
    /// The connection ended; everything it delivered came before this, and its id is dead.
    Disconnected {
        /// The connection.
        peer: PeerId,
        /// Why ([`Failure::PeerClosed`] after a graceful close by the peer,
        /// [`Failure::Closed`] after [`Hub::close`] or [`Hub::start_close`], or
        /// [`Failure::CloseTimedOut`] when the peer did not take the close in time).
        failure: Failure,
    },
    /// `peer`'s outbox, which refused a [`Hub::post`] (or an answer) for want of room, has
    /// drained to half of [`SessionConfig::max_outbox_bytes`]: it can take more.
    Writable {
        /// The peer.
        peer: PeerId,
    },
    /// A call handed to [`Hub::watch`] ended: its answer (an envelope of the response type:
    /// [`Envelope::decode`] it), or why it failed ([`Error::CallTimedOut`] at its deadline,
    /// [`Error::CallFailed`] when its peer's connection failed, [`Error::NoAnswer`],
    /// [`Error::NotServed`]). Before the peer's `Disconnected` when that failed it.
    CallEnded {
        /// The peer called.
        peer: PeerId,
        /// The call's number ([`Call::id`], what [`Hub::watch`] returned).
        call: u64,
        /// What it came to.
        result: Result<Envelope>,
    },
    /// A handshake failed: a client accepted from the listener (`peer: None`), or one that
    /// [`Hub::connect`] started. The hub and every other connection go on.
    HandshakeFailed {
        /// The connection [`Hub::connect`] returned, if it was ours.
        peer: Option<PeerId>,
        /// Why.
        error: Error,
    },
}

impl HubEvent {
    /// The peer the event concerns (`None` for a client that failed its handshake).
    pub fn peer(&self) -> Option<PeerId> {
        match self {
            HubEvent::Connected { peer, .. }
            | HubEvent::Message { peer, .. }
            | HubEvent::BadFrame { peer, .. }
            | HubEvent::Unread { peer, .. }
            | HubEvent::Unconfirmed { peer, .. }
            | HubEvent::Writable { peer }
            | HubEvent::CallEnded { peer, .. }
            | HubEvent::Disconnected { peer, .. } => Some(*peer),
            HubEvent::HandshakeFailed { peer, .. } => *peer,
        }
    }
}

/// What [`Hub::post`] (or [`Hub::reply`]) did with a message.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a message handed back was not sent"]
pub enum Posted<M> {
    /// Sent at once.
    Sent,
    /// Queued in the peer's outbox, behind what was there: it goes as the peer's credits
    /// come, driven by the hub's later calls.
    Queued,
    /// The peer's outbox is full ([`SessionConfig::max_outbox_bytes`]): nothing was queued,
    /// and here is the message back. After a [`Hub::post`], [`HubEvent::Writable`] says when
    /// it has room. After a [`Hub::reply`], the caller is told "no answer" at once (a few
    /// bytes that go past the bound), since a responder answers only once.
    Full(M),
    /// The peer is gone (its [`HubEvent::Disconnected`] is, or will be, among the events):
    /// nothing was sent, and here is the message back. Not an error: a request handed out
    /// before its peer's disconnection is still answered with `reply`, and lands here.
    PeerGone(M),
}
