//! Typed messages to and from many peers, served by one thread: the many-peer counterpart of
//! [`crate::Session`] over a transport [`rdmsg_transport::RawHub`].

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmsg_transport::{Endpoint, Failure, HubConfig, PeerId};

use crate::call::{
    self, Call, CallOut, CallStats, Calls, Outgoing, Owned, OwnedReply, Replies, Request, Responder,
};
use crate::codec::{Decoder, Envelope, FrameBytes};
use crate::error::{unread_error, unsent_error};
use crate::held::Held;
use crate::peer::{
    self, Closing, Delivery, HubPeerIo, Outbox, OutboxStats, PeerIo, PeerTable, ReassemblyBudget,
    RecvSide, SendSide,
};
use crate::rendezvous::ReadPool;
use crate::{Error, Message, Result, SessionConfig, SessionStats};

/// What happened in a [`Hub`]. Per peer, events come in order: `Connected`, its messages and
/// bad frames, then `Disconnected`.
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
            | HubEvent::Disconnected { peer, .. } => Some(*peer),
            HubEvent::HandshakeFailed { peer, .. } => *peer,
        }
    }
}

/// What the hub keeps per peer: what a [`crate::Session`] keeps for its connection.
#[derive(Debug)]
struct PeerState {
    sender: SendSide,
    receiver: RecvSide,
    /// Listed in [`Hub::unflushed`].
    listed: bool,
    /// [`Hub::start_close`] under way: the transport's close starts once it is due.
    closing: Option<Closing>,
    /// Messages waiting for the peer's credits ([`Hub::post`], answers).
    outbox: Outbox,
}

impl PeerState {
    fn stats(&self) -> SessionStats {
        peer::stats(&self.sender, &self.receiver)
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

/// Longest wait while a peer's flush before a wait found no free send slot.
const UNFLUSHED_RETRY: Duration = Duration::from_millis(1);

/// Typed messages to and from many peers, driven by one thread.
///
/// Each peer gets what a [`crate::Session`] has: its own sequence numbers, solicitation
/// policy (the bounds of one [`SessionConfig`]; the default run is a quarter of that peer's
/// announced depth), decoder and statistics, made when it connects and dropped when it
/// disconnects. Types are registered once, on the hub, for every peer.
///
/// [`Hub::recv`] returns [`HubEvent`]s: connections, messages, bad frames (not fatal: the
/// peer goes on), disconnections. Sending to one peer may wait for its credits; the hub is
/// driven meanwhile, and whatever happens to others waits as events. Only the hub's own
/// failure (its queues or completion channel) is an `Err` from `recv`; a failed peer is a
/// [`HubEvent::Disconnected`], and sending to it gives its failure.
#[derive(Debug)]
pub struct Hub {
    transport: rdmsg_transport::RawHub,
    config: SessionConfig,
    /// The registered types, never fed a frame: each new peer's decoder is a copy.
    registry: Decoder,
    peers: PeerTable<PeerId, PeerState>,
    /// Counts of peers gone.
    departed: SessionStats,
    /// Peers that may have been sent something unsolicited since their last solicited frame:
    /// flushed before the hub waits (see [`Hub::recv`]).
    unflushed: Vec<PeerId>,
    /// When an event loop should step again for a pending flush (see [`Hub::next_timeout`]).
    retry_at: Option<Instant>,
    /// Transport events a send took in while it waited for rendezvous room: taken before
    /// the transport's next ones.
    stash: VecDeque<rdmsg_transport::RawHubEvent>,
    /// Typed events ready to be returned, in order, each message's with its number: handing
    /// it to the application counts it taken ([`Hub::take_ready`]).
    ready: VecDeque<(HubEvent, Option<u32>)>,
    /// The registered buffers rendezvous reads land in, shared by every peer.
    pool: ReadPool,
    /// What all peers' messages in reassembly may hold.
    budget: ReassemblyBudget,
    /// Peers with descriptors waiting for buffer room or a send slot.
    reads_waiting: Vec<PeerId>,
    /// Peers with a message in reassembly, watched for progress
    /// ([`SessionConfig::reassembly_timeout`]), and the nearest of their deadlines.
    reassembling: Vec<PeerId>,
    reassembly_at: Option<Instant>,
    /// A peer joined `reassembling` since the last look: its deadline starts at the next one,
    /// which an event loop should take at once ([`Hub::next_timeout`]).
    reassembly_unwatched: bool,
    /// Peers whose [`Hub::start_close`] waits for them to finish reading our messages.
    closing: Vec<PeerId>,
    /// Peers whose outboxes hold messages.
    outboxed: Vec<PeerId>,
    /// Our calls waiting for answers.
    calls: Calls,
    /// Answers to peers' requests given on other threads (or by dropped responders).
    replies: Arc<Replies>,
    /// Events taken in while a call waited for its answer: handed out first. Each peer's
    /// are bounded by [`SessionConfig::max_held_bytes`] (see [`Hub::keep`]).
    held: Held<PeerId, HubEvent>,
    /// A call's wait (or [`Hub::poll_calls`]) is receiving: what it takes is kept in `held`,
    /// which it does not hand out.
    holding: bool,
    /// A call's wait is receiving: an answer ends the receive.
    waiting_call: bool,
    /// An answer was taken in since the last look.
    answered: bool,
    /// The outbox counts of peers gone.
    departed_outboxes: OutboxStats,
}

/// Queues `peer`'s messages that are ready, in order, as events (a message that could not be
/// taken as its `BadFrame`).
fn queue_ready(
    peer: PeerId,
    receiver: &mut RecvSide,
    ready: &mut VecDeque<(HubEvent, Option<u32>)>,
) {
    while let Some((seq, r)) = receiver.pop_numbered() {
        let ev = match r {
            Ok(msg) => HubEvent::Message { peer, msg },
            Err(error) => HubEvent::BadFrame { peer, error },
        };
        ready.push_back((ev, seq));
    }
}

impl Hub {
    /// A hub on `endpoint`, with default per-peer bounds.
    pub fn new(endpoint: &Endpoint, config: HubConfig) -> Result<Self> {
        Self::with_config(endpoint, config, SessionConfig::default())
    }

    /// A hub on `endpoint` whose peers each have the bounds of `session`.
    pub fn with_config(
        endpoint: &Endpoint,
        config: HubConfig,
        session: SessionConfig,
    ) -> Result<Self> {
        let transport = rdmsg_transport::RawHub::new(endpoint, config)?;
        Ok(Self::from_transport(transport, session))
    }

    /// Typed messages over a transport hub. Its connections so far are taken up as they
    /// show themselves (an event, a send).
    pub fn from_transport(transport: rdmsg_transport::RawHub, config: SessionConfig) -> Self {
        // What we read is bounded by what we announce in every handshake, for all peers.
        let pool = ReadPool::new(transport.config().conn.announced_max_read() as usize);
        if let Ok(waker) = transport.waker() {
            // A read buffer given back on another thread while a descriptor waits for room
            // wakes the hub.
            pool.set_waker(waker);
        }
        let replies = Replies::new(transport.waker().ok());
        Self {
            outboxed: Vec::new(),
            calls: Calls::default(),
            replies,
            held: Held::new(config.max_held_bytes),
            holding: false,
            waiting_call: false,
            answered: false,
            departed_outboxes: OutboxStats::default(),
            pool,
            budget: ReassemblyBudget::new(config.max_reassembly_bytes, config.reassembly_timeout),
            reads_waiting: Vec::new(),
            reassembling: Vec::new(),
            reassembly_at: None,
            reassembly_unwatched: false,
            closing: Vec::new(),
            transport,
            registry: Decoder::new(config.max_message),
            config,
            peers: PeerTable::default(),
            departed: SessionStats::default(),
            unflushed: Vec::new(),
            retry_at: None,
            stash: VecDeque::new(),
            ready: VecDeque::new(),
        }
    }

    /// Accept only registered types from now on, from every peer, present and future; others
    /// are [`HubEvent::BadFrame`]s with [`Error::UnknownTag`]. [`Error::DuplicateTag`] if `M`'s
    /// tag is registered already.
    pub fn register<M: Message>(&mut self) -> Result<&mut Self> {
        self.registry.register::<M>()?;
        for p in self.peers.values_mut() {
            // Every decoder was made from the registry, so it takes what the registry took.
            p.receiver.register::<M>()?;
        }
        Ok(self)
    }

    /// Listens for clients at `addr` (`"0.0.0.0:0"` picks a port); returns the address bound.
    /// Each client is a [`HubEvent::Connected`] with `accepted: true` once its handshake,
    /// which runs inside the hub, is done.
    pub fn listen(&mut self, addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<SocketAddr> {
        Ok(self.transport.listen(addr)?)
    }

    /// Starts a connection to a listener or another hub at `addr`; its handshake runs inside
    /// the hub ([`HubEvent::Connected`], or [`HubEvent::HandshakeFailed`], names it later).
    /// Sending to it before it is connected waits for that.
    pub fn connect(&mut self, addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<PeerId> {
        Ok(self.transport.connect(addr)?)
    }

    /// Listens for clients through the RDMA connection manager at `addr` (an IP address of
    /// the hub's device, or a wildcard, and a port), beside any TCP listener; returns the
    /// address bound. See [`rdmsg_transport::RawHub::listen_cm`].
    pub fn listen_cm(&mut self, addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<SocketAddr> {
        Ok(self.transport.listen_cm(addr)?)
    }

    /// Starts a connection through the RDMA connection manager to a CM listener or another
    /// hub at `addr` (an IP address and port); everything after the call runs inside the hub,
    /// as with [`Hub::connect`]. See [`rdmsg_transport::RawHub::connect_cm`].
    pub fn connect_cm(&mut self, addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<PeerId> {
        Ok(self.transport.connect_cm(addr)?)
    }

    /// [`Hub::connect_cm`] without waiting for our earlier handshakes: never blocks. See
    /// [`rdmsg_transport::RawHub::start_connect_cm`].
    pub fn start_connect_cm(&mut self, addr: SocketAddr) -> Result<PeerId> {
        Ok(self.transport.start_connect_cm(addr)?)
    }

    /// The transport hub underneath.
    pub fn transport(&self) -> &rdmsg_transport::RawHub {
        &self.transport
    }

    /// The transport hub underneath, to send raw bytes or look at a connection. Events taken
    /// from it directly bypass this hub (a message is not decoded); per-peer state copes.
    pub fn transport_mut(&mut self) -> &mut rdmsg_transport::RawHub {
        &mut self.transport
    }

    /// Established connections that have not failed.
    pub fn peers(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.transport.peers()
    }

    /// Totals over every peer, present and past.
    pub fn stats(&self) -> SessionStats {
        let mut total = self.departed;
        for p in self.peers.values() {
            total.add(&p.stats());
        }
        total.credit_waits = self.transport.stats().credit_stalls;
        total
    }

    /// The delivery record of `peer` (see [`crate::Session::delivery`]); `None` for a peer
    /// unknown or gone.
    pub fn delivery(&self, peer: PeerId) -> Option<Delivery> {
        let note = self.transport.peer_note(peer);
        self.peers.get(peer).map(|s| s.sender.delivery(note))
    }

    /// What was exchanged with `peer`, while it is connected.
    pub fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        let stalls = self
            .transport
            .conn_stats(peer)
            .map_or(0, |c| c.credit_stalls);
        self.peers.get(peer).map(|p| SessionStats {
            credit_waits: stalls,
            ..p.stats()
        })
    }

    /// Sends `m` to `peer`, solicited or not as its type says ([`Message::SOLICITED`]).
    pub fn send<M: Message>(&mut self, peer: PeerId, m: &M) -> Result<()> {
        self.send_as(peer, m, M::SOLICITED)
    }

    /// Sends `m` to `peer`, solicited or not as given (the peer's policy may still solicit
    /// it); like [`crate::Session::send_as`]. Waits for the peer's credits (and, if it is
    /// still connecting, for its handshake), driving the hub meanwhile.
    pub fn send_as<M: Message>(&mut self, peer: PeerId, m: &M, solicited: bool) -> Result<()> {
        self.with_sender(peer, |s, link| s.send_as(link, m, solicited))
    }

    /// Sends `m` to `peer` as [`Hub::send_as`] does, but waits at most `timeout` for the
    /// peer's credit and a send slot: `Ok(false)`, nothing sent, if none came in time.
    /// `Duration::ZERO` never waits: for a loop that must go on draining its own receives
    /// (a peer's credits come back only as fast as it reads, and it may be waiting for ours).
    /// A message too large for one frame has its first frame bounded so; once that is there,
    /// the rest of its frames wait as long as it takes (a message is never left half sent).
    pub fn send_timeout<M: Message>(
        &mut self,
        peer: PeerId,
        m: &M,
        solicited: bool,
        timeout: Duration,
    ) -> Result<bool> {
        peer::in_time(self.with_sender_waiting(peer, Some(timeout), |s, link| {
            s.send_within(link, m, solicited, Some(timeout))
        }))
    }

    /// Sends a batch to `peer`: every message unsolicited but the last, which is solicited.
    pub fn send_batch<'a, M: Message + 'a>(
        &mut self,
        peer: PeerId,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> Result<usize> {
        self.with_sender(peer, |s, link| s.send_batch(link, batch))
    }

    /// If anything went unsolicited to `peer` since the last solicited frame, sends it a
    /// payload-less solicited frame so that it looks now (see [`crate::Session::flush`]).
    pub fn flush(&mut self, peer: PeerId) -> Result<()> {
        self.with_sender(peer, |s, link| s.flush(link))
    }

    /// Closes `peer` gracefully (see [`rdmsg_transport::RawHub::close`]): it receives everything
    /// sent so far, then [`Failure::PeerClosed`]; here [`HubEvent::Disconnected`] follows with
    /// [`Failure::Closed`]. As [`crate::Session::close`] does, within one `close_timeout`: its
    /// outbox and committed messages go first, then the close waits for the peer to finish
    /// reading what it was lent by rendezvous (with
    /// [`SessionConfig::keep_unconfirmed`], for its application to take everything).
    /// [`Error::Unread`] says how many lent messages it had not read by then, and
    /// [`Error::Unsent`] how many messages found no room (the connection is closed all the
    /// same).
    pub fn close(&mut self, peer: PeerId) -> Result<()> {
        let record = self.config.keep_unconfirmed.is_some();
        let timeout = self.transport.config().conn.close_timeout;
        let closing = Closing::begin(Instant::now(), timeout, record);
        // Answers given on other threads join the outbox first.
        self.queue_replies();
        let left = closing.deadline().saturating_duration_since(Instant::now());
        let waited = self.with_peer_waiting(peer, Some(left), |send, outbox, io| {
            closing.wait(send, io, outbox)
        });
        let unsent = self.peers.get_mut(peer).map_or(0, |state| {
            state.sender.committed_waiting() + state.outbox.clear()
        });
        waited.and_then(|w| {
            // The transport's close (a credit, then the acknowledgement) spends what is left.
            self.transport.close_by(peer, closing.deadline())?;
            unread_error(w.unread)?;
            unsent_error(unsent)
        })
    }

    /// Starts closing `peer` gracefully without waiting (see
    /// [`rdmsg_transport::RawHub::start_close`]); its [`HubEvent::Disconnected`] follows. The
    /// same close as [`Hub::close`], driven by the hub's later calls: once its outbox and
    /// committed messages went and the peer read what it was lent (at most
    /// `close_timeout`), the transport's close starts; lent messages it had not read by then
    /// are a [`HubEvent::Unread`], and messages that found no room are counted in
    /// [`OutboxStats::dropped`].
    pub fn start_close(&mut self, peer: PeerId) -> Result<()> {
        let record = self.config.keep_unconfirmed.is_some();
        let timeout = self.transport.config().conn.close_timeout;
        let closing = Closing::begin(Instant::now(), timeout, record);
        let Some(state) = self.peers.get_mut(peer) else {
            // Nothing of ours waits for it.
            return Ok(self.transport.start_close_by(peer, closing.deadline())?);
        };
        state.closing = Some(closing);
        if !self.closing.contains(&peer) {
            self.closing.push(peer);
        }
        // At once if nothing waits; else as the hub's calls drive it.
        self.finish_closes(Instant::now());
        Ok(())
    }

    /// When the first close waiting for its peer runs out of time.
    fn earliest_close(&self) -> Option<Instant> {
        self.closing
            .iter()
            .filter_map(|&p| self.peers.get(p).and_then(|s| s.closing))
            .map(|c| c.deadline())
            .min()
    }

    /// Starts the transport's close of the peers whose close is due (everything of ours
    /// went and the peer is done reading, or time ran out); asks those waiting for the
    /// record about what went.
    fn finish_closes(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.closing.len() {
            let peer = self.closing[i];
            let Some(state) = self.peers.get_mut(peer) else {
                self.closing.swap_remove(i);
                continue;
            };
            let Some(closing) = state.closing else {
                self.closing.swap_remove(i);
                continue;
            };
            if !closing.due(now, &state.sender, &state.outbox) {
                if closing.ask(&mut state.sender, &state.outbox) && !state.listed {
                    state.listed = true;
                    self.unflushed.push(peer);
                }
                i += 1;
                continue;
            }
            state.closing = None;
            self.closing.swap_remove(i);
            // What found no room in time is counted dropped.
            state.outbox.clear();
            let messages = state.sender.lent();
            if messages > 0 {
                self.ready
                    .push_back((HubEvent::Unread { peer, messages }, None));
            }
            // The transport's close spends what is left of the time this one began with
            // (none, if it ran out waiting for the peer: then only a credit there now lets
            // the close message go). A peer gone meanwhile: its Disconnected tells.
            let _ = self.transport.start_close_by(peer, closing.deadline());
        }
    }

    /// Starts a connection over a TCP stream already connected (see
    /// [`rdmsg_transport::RawHub::connect_stream`]): never blocks.
    pub fn connect_stream(&mut self, stream: std::net::TcpStream) -> Result<PeerId> {
        Ok(self.transport.connect_stream(stream)?)
    }

    /// [`Hub::flush`] without waiting: sends `peer`'s committed frames and flush if they can
    /// go now; whether nothing is left to send to it.
    pub fn try_flush(&mut self, peer: PeerId) -> Result<bool> {
        self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
            s.send_committed(link)?;
            s.flush_within(link, Some(Duration::ZERO))?;
            Ok(!s.pending() && s.queued_frames() == 0)
        })
    }

    /// Sends `m` to `peer` without ever waiting: at once if it can go (nothing queued before
    /// it, a credit and a send slot free), else queued in `peer`'s outbox behind what waits
    /// there, within [`SessionConfig::max_outbox_bytes`]; beyond that, handed back
    /// ([`Posted::Full`]), and [`HubEvent::Writable`] tells when there is room. Queued
    /// messages go in order as the peer's credits come, driven by the hub's later calls
    /// ([`Hub::recv`], [`Hub::try_recv`], [`Hub::step`]). So one slow or stalled peer costs
    /// its outbox's memory and nothing else: the thread serving every peer never waits for
    /// it. What is still queued when the peer disconnects is dropped (counted in
    /// [`OutboxStats::dropped`]).
    pub fn post<M: Message + Send + 'static>(&mut self, peer: PeerId, m: M) -> Result<Posted<M>> {
        self.post_as(peer, m, M::SOLICITED)
    }

    /// [`Hub::post`], solicited or not as given.
    pub fn post_as<M: Message + Send + 'static>(
        &mut self,
        peer: PeerId,
        m: M,
        solicited: bool,
    ) -> Result<Posted<M>> {
        let Some(empty) = self.outbox_empty(peer) else {
            return Ok(Posted::PeerGone(m));
        };
        if empty {
            let mut went = false;
            let sent = peer::in_time(
                self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
                    let before = s.next_seq();
                    let sent = s.try_send_as(link, &m, solicited);
                    went = s.next_seq() != before;
                    sent
                })
                .and_then(|sent| {
                    if sent {
                        Ok(())
                    } else {
                        let none = crate::error::WAIT_NONE;
                        Err(rdmsg_transport::Error::timeout("posting", none, Duration::ZERO).into())
                    }
                }),
            );
            match sent {
                Ok(true) => return Ok(Posted::Sent),
                Ok(false) => {}
                // It went (in part, at least) before the peer failed: sent, its fate is the
                // peer's record's (`Disconnected`, `Unconfirmed`), not handed back twice.
                Err(_) if went => return Ok(Posted::Sent),
                // The send itself found the peer gone (or failed it): as when that was
                // known before, not an error (issue 45: a job queue's coordinator exited on it).
                Err(_) if self.outbox_empty(peer).is_none() => return Ok(Posted::PeerGone(m)),
                // This message alone (too large, not encodable).
                Err(e) => return Err(e),
            }
        }
        let size = call::encoded_len(&m);
        if !self.room(peer, size) {
            self.state(peer).outbox.refuse();
            return Ok(Posted::Full(m));
        }
        self.queue(peer, Box::new(Owned { m, solicited }), size);
        Ok(Posted::Queued)
    }

    /// Whether `peer`'s outbox is empty; `None` for a peer gone (failed).
    fn outbox_empty(&mut self, peer: PeerId) -> Option<bool> {
        // Failed, or its slot released (`Disconnected` handed out): gone.
        if self.transport.failure(peer).is_some() || self.transport.credits(peer).is_err() {
            return None;
        }
        Some(self.peers.get(peer).map_or(true, |s| s.outbox.is_empty()))
    }

    /// Whether `peer`'s outbox has room for `size` more bytes (one message always fits an
    /// empty one).
    fn room(&mut self, peer: PeerId, size: usize) -> bool {
        self.state(peer).outbox.has_room(size)
    }

    /// An answer to `peer`'s call `id` could not be queued (no room): "no answer" goes in its
    /// place, past the bound (a few bytes, one per request the peer sent), so that the caller
    /// does not wait for its deadline. Counted dropped.
    fn refuse_answer(&mut self, peer: PeerId, id: u64) {
        call::lock(&self.calls).answer_dropped();
        let no = call::no_answer(id);
        let size = no.size();
        self.state(peer).outbox.count_dropped();
        self.queue(peer, Box::new(no), size);
    }

    /// Queues `msg` in `peer`'s outbox (room checked by the caller).
    fn queue(&mut self, peer: PeerId, msg: Box<dyn Outgoing>, size: usize) {
        if self.state(peer).outbox.push(msg, size) {
            self.outboxed.push(peer);
        }
    }

    /// Sends what the outboxes hold as far as credits allow, in order per peer, never
    /// waiting; queues the answers given on other threads first.
    fn drain_outboxes(&mut self) {
        self.queue_replies();
        self.send_outboxes();
        // Closes waiting for their outboxes go once those went.
        if !self.closing.is_empty() {
            self.finish_closes(Instant::now());
        }
    }

    /// Moves the answers given on other threads into their peers' outboxes.
    fn queue_replies(&mut self) {
        if self.replies.waiting() {
            for r in self.replies.take() {
                let Some(peer) = r.peer else { continue };
                if self.peers.get(peer).is_none() || self.transport.failure(peer).is_some() {
                    // Gone: its calls failed on its side.
                    call::lock(&self.calls).answer_dropped();
                    continue;
                }
                let size = r.msg.size();
                if self.room(peer, size) {
                    self.queue(peer, r.msg, size);
                } else {
                    self.refuse_answer(peer, r.id);
                }
            }
        }
    }

    /// Sends what the outboxes hold as far as credits allow, in order per peer.
    fn send_outboxes(&mut self) {
        let mut i = 0;
        while i < self.outboxed.len() {
            let peer = self.outboxed[i];
            let (writable, listed, empty) = {
                let Some((state, mut link)) = self.split(peer) else {
                    self.outboxed.swap_remove(i);
                    continue;
                };
                state.sender.learn_note(link.hub.peer_note(peer));
                // A failing peer: its Disconnected tells (and drops the rest). A message
                // failing alone (too large, not encodable) is dropped and counted.
                let _ = state.outbox.send_ready(&mut state.sender, &mut link);
                let writable = state.outbox.take_writable();
                let listed = state.sender.queued_frames() > 0 && !state.listed;
                state.listed |= listed;
                (writable, listed, state.outbox.is_empty())
            };
            if writable {
                self.ready.push_back((HubEvent::Writable { peer }, None));
            }
            if listed {
                self.unflushed.push(peer);
            }
            if empty {
                self.outboxed.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Whether outboxes hold messages, or answers given by [`Responder`]s wait to be queued:
    /// they go as credits come, with the calls that drive the hub ([`Hub::recv`],
    /// [`Hub::step`], ...).
    pub fn outboxes_waiting(&self) -> bool {
        !self.outboxed.is_empty() || self.replies.waiting()
    }

    /// Runs `hook` whenever a [`Responder`] of this hub answers (see
    /// [`crate::Session::on_answer`]).
    pub fn on_answer(&mut self, hook: impl Fn() + Send + Sync + 'static) {
        self.replies.set_hook(Arc::new(hook));
    }

    /// Every outbox's counts in all, peers gone included (`messages` and `bytes`: what
    /// waits now).
    pub fn outbox_totals(&self) -> OutboxStats {
        let mut total = self.departed_outboxes;
        total.messages = 0;
        total.bytes = 0;
        for s in self.peers.values() {
            total.add(&s.outbox.stats());
        }
        total
    }

    /// `peer`'s outbox ([`Hub::post`]); `None` for a peer unknown or gone.
    pub fn outbox(&self, peer: PeerId) -> Option<OutboxStats> {
        self.peers.get(peer).map(|s| s.outbox.stats())
    }

    /// Answers a request received from a peer at once, on the hub's thread, as
    /// [`Hub::post`] sends: never waiting; queued in the peer's outbox if it cannot go now;
    /// if that is full, dropped (counted in [`OutboxStats::dropped`]; the caller's call
    /// times out) and the value handed back. From another thread, use
    /// [`Responder::respond`].
    pub fn reply<T: Message + Send + 'static>(
        &mut self,
        responder: Responder<T>,
        value: T,
    ) -> Result<Posted<T>> {
        let Some(origin) = responder.into_origin() else {
            return Ok(Posted::Sent);
        };
        if !Arc::ptr_eq(&origin.replies, &self.replies) {
            // Dropped: it answers "no answer" through its own session or hub.
            return Err(crate::Error::ForeignResponder);
        }
        let (id, peer) = origin.disarm();
        let peer = peer.ok_or(crate::Error::ForeignResponder)?;
        let Some(empty) = self
            .outbox_empty(peer)
            .filter(|_| self.peers.get(peer).is_some())
        else {
            // Gone (its Disconnected says so): the answer cannot go.
            call::lock(&self.calls).answer_dropped();
            return Ok(Posted::PeerGone(value));
        };
        if empty {
            let out = call::ReplyOut {
                id,
                status: 0,
                value: Some(&value),
            };
            let sent = self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
                s.try_send_as(link, &out, true)
            });
            match sent {
                Ok(true) => return Ok(Posted::Sent),
                Ok(false) | Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => {}
                Err(_) if self.outbox_empty(peer).is_none() => {
                    call::lock(&self.calls).answer_dropped();
                    return Ok(Posted::PeerGone(value));
                }
                // This answer alone (too large, not encodable): the caller hears "no answer".
                Err(e) => {
                    self.refuse_answer(peer, id);
                    return Err(e);
                }
            }
        }
        let reply = OwnedReply {
            id,
            status: 0,
            value: Some(value),
        };
        let size = reply.size();
        if !self.room(peer, size) {
            self.refuse_answer(peer, id);
            return Ok(Posted::Full(reply.value.expect("built with a value")));
        }
        self.queue(peer, Box::new(reply), size);
        Ok(Posted::Queued)
    }

    /// Calls `peer` (see [`crate::Session::call`]): sends `request` and waits for its
    /// answer, all within `timeout`, driving the hub meanwhile (events that come wait for
    /// [`Hub::recv`], in order).
    pub fn call<R>(&mut self, peer: PeerId, request: &R, timeout: Duration) -> Result<R::Response>
    where
        R: Request,
        R::Response: serde::de::DeserializeOwned,
    {
        let call = self.start_call(peer, request, timeout)?;
        self.wait(call)
    }

    /// Starts a call to `peer` without waiting for its answer (see
    /// [`crate::Session::start_call`]): waits at most `timeout` to send the request;
    /// `Duration::ZERO`-bounded sends are [`Hub::try_start_call`].
    pub fn start_call<R: Request>(
        &mut self,
        peer: PeerId,
        request: &R,
        timeout: Duration,
    ) -> Result<Call<R::Response>> {
        let deadline = call::deadline(timeout);
        let id = call::lock(&self.calls).start::<R>(Some(peer));
        let out = CallOut { id, m: request };
        let sent = self.with_sender_waiting(peer, Some(timeout), |s, link| {
            s.send_within(link, &out, R::SOLICITED, Some(timeout))
        });
        call::started::<R>(&self.calls, id, peer::in_time(sent), timeout, deadline)
    }

    /// Starts a call to `peer` without ever waiting (see [`Hub::post`]): the request goes at
    /// once or waits in `peer`'s outbox; `Ok(None)` if the outbox is full (nothing sent).
    /// The call's deadline is `timeout` from now, whatever the outbox.
    pub fn try_start_call<R: Request + Clone + Send + 'static>(
        &mut self,
        peer: PeerId,
        request: &R,
        timeout: Duration,
    ) -> Result<Option<Call<R::Response>>> {
        let deadline = call::deadline(timeout);
        let id = call::lock(&self.calls).start::<R>(Some(peer));
        let out = call::CallOwned {
            id,
            request: request.clone(),
        };
        let request = std::any::type_name::<R>();
        match self.post(peer, out) {
            Ok(Posted::Sent | Posted::Queued) => Ok(Some(Call::new(
                id,
                self.calls.clone(),
                request,
                timeout,
                deadline,
            ))),
            Ok(Posted::Full(_)) => {
                call::lock(&self.calls).forget(id);
                Ok(None)
            }
            Ok(Posted::PeerGone(_)) => {
                call::lock(&self.calls).forget(id);
                Err(rdmsg_transport::Error::UnknownPeer(peer).into())
            }
            Err(e) => {
                call::lock(&self.calls).forget(id);
                Err(e)
            }
        }
    }

    /// Waits for `call`'s answer until its deadline, driving the hub (events wait for
    /// [`Hub::recv`]). As in [`crate::Session::wait`], an answer already here when the
    /// deadline is judged is the answer.
    pub fn wait<T>(&mut self, call: Call<T>) -> Result<T>
    where
        T: Message + serde::de::DeserializeOwned,
    {
        let mut calls = vec![call];
        let (_, outcome) = self.wait_any(&mut calls).expect("one call to wait for");
        outcome
    }

    /// Waits for the first of `calls` to end (see [`crate::Session::wait_any`]), driving the
    /// hub (events wait for [`Hub::recv`]). Each peer's events kept so are bounded by
    /// [`SessionConfig::max_held_bytes`]: a peer at its bound is taken nothing more from (its
    /// messages stay in their receive buffers with its credits, so it stops; a call to it
    /// ends at its deadline if its answer is behind them), while the others go on.
    pub fn wait_any<T>(&mut self, calls: &mut Vec<Call<T>>) -> Option<(usize, Result<T>)>
    where
        T: Message + serde::de::DeserializeOwned,
    {
        loop {
            // Past a deadline, what has happened is taken in first (the hub's own failure
            // comes from the next receive).
            let ended = call::first_ended(calls, || {
                let _ = self.poll_calls();
            });
            let left = match ended {
                call::Next::Ended(i, outcome) => return Some((i, outcome)),
                call::Next::NoneLeft => return None,
                call::Next::Wait(left) => left,
            };
            self.holding = true;
            self.waiting_call = true;
            self.answered = false;
            let got = self.recv_timeout(left);
            self.waiting_call = false;
            self.holding = false;
            match got {
                Ok(Some(ev)) => self.keep(ev),
                Ok(None) => {}
                // The hub's own failure.
                Err(e) => {
                    drop(calls.remove(0));
                    return Some((0, Err(e)));
                }
            }
        }
    }

    /// Takes in, without waiting, everything that has happened: answers go to their calls,
    /// other events wait for [`Hub::recv`] (or [`Hub::try_recv`]), each peer's within
    /// [`SessionConfig::max_held_bytes`] (see [`Hub::wait_any`]). Whether it took in any
    /// event. For event loops and async runtimes that wait for calls.
    pub fn poll_calls(&mut self) -> Result<bool> {
        let before = self.held.len();
        self.holding = true;
        let out = loop {
            match self.try_recv() {
                Ok(Some(ev)) => self.keep(ev),
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.holding = false;
        out.map(|()| self.held.len() != before)
    }

    /// Keeps an event a call's wait took in for [`Hub::recv`], its message out of its
    /// receive buffer (whose credit the peer may need to send the answer). Once a peer's
    /// kept events reach [`SessionConfig::max_held_bytes`], its frames are parked unread
    /// (their buffers hold its credits: it stops sending) and nothing more of it is queued
    /// ([`Hub::collect`]), until [`Hub::recv`] takes some of what is kept; other peers go on.
    fn keep(&mut self, ev: HubEvent) {
        let (who, body, ev) = match ev {
            HubEvent::Message { peer, mut msg } => {
                msg.release_credit();
                let body = msg.body().len();
                (Some(peer), body, HubEvent::Message { peer, msg })
            }
            HubEvent::BadFrame { peer, error } => {
                (Some(peer), 0, HubEvent::BadFrame { peer, error })
            }
            // Once per connection, or the hub's own doing.
            ev => (None, 0, ev),
        };
        if self.held.push(who, ev, body) {
            if let Some(peer) = who {
                if let Some(state) = self.peers.get_mut(peer) {
                    state.receiver.hold_back(true);
                }
                // The buffers its parked frames keep are lent out of the pool every peer
                // shares: returning its credits would let it draw the pool dry.
                self.transport.hold_back(peer, true);
            }
        }
    }

    /// The oldest event a call's wait kept (none while a call's wait receives: what it takes
    /// goes behind them). A peer below its bound again has its frames taken in.
    fn take_held(&mut self) -> Option<HubEvent> {
        if self.holding {
            return None;
        }
        let (ev, who, freed) = self.held.pop()?;
        if let (true, Some(peer)) = (freed, who) {
            if let Some(state) = self.peers.get_mut(peer) {
                state.receiver.hold_back(false);
                if !self.reads_waiting.contains(&peer) {
                    self.reads_waiting.push(peer);
                }
            }
            self.transport.hold_back(peer, false);
        }
        Some(ev)
    }

    /// Bytes of `peer`'s messages that calls' waits took in and keep for the next receive
    /// (their bodies and a few dozen bytes each): at most
    /// [`SessionConfig::max_held_bytes`] and one message.
    pub fn held_bytes(&self, peer: PeerId) -> usize {
        self.held.bytes(peer)
    }

    /// The answer of a call whose waiter gave up (see [`crate::Session::expire`]).
    pub fn expire<T>(&mut self, call: Call<T>) -> Result<T>
    where
        T: Message + serde::de::DeserializeOwned,
    {
        call.expire_or_take().and_then(call::finish)
    }

    /// The call's answer if it is in, without waiting (`None`: not yet).
    pub fn try_wait<T>(&mut self, call: &Call<T>) -> Option<Result<T>>
    where
        T: Message + serde::de::DeserializeOwned,
    {
        call.take_outcome().map(call::finish)
    }

    /// Counts of calls made and served, over every peer, present and past.
    pub fn call_stats(&self) -> CallStats {
        call::lock(&self.calls).stats()
    }

    /// Counts of calls to `peer` and of its requests served here, while it is connected
    /// (in flight, late answers, ...); `None` for a peer unknown or gone.
    pub fn peer_call_stats(&self, peer: PeerId) -> Option<CallStats> {
        self.peers.get(peer)?;
        Some(call::lock(&self.calls).peer_stats(peer))
    }

    /// Whether unsolicited sends may wait within a bound
    /// ([`SessionConfig::max_unsolicited_delay`]; see [`crate::Session::delays_unsolicited`]).
    pub fn delays_unsolicited(&self) -> bool {
        self.config.max_unsolicited_delay.is_some()
    }

    /// Whether a message its sender asked to solicit (`requested`) or not goes solicited when
    /// another thread or task may be asleep on this hub (`others_waiting`): see
    /// [`crate::policy::solicit_for`].
    pub fn solicit_for(&self, requested: bool, others_waiting: bool) -> bool {
        crate::policy::solicit_for(requested, others_waiting, self.delays_unsolicited())
    }

    /// The next event, waiting as long as it takes. An `Err` is the hub's own failure, which
    /// every later call reports too.
    ///
    /// Before it waits, every peer sent something unsolicited since its last solicited frame
    /// is flushed, as [`crate::Session::recv`] does, without waiting for any one of them
    /// (counted in [`SessionStats::wait_flushes`]).
    pub fn recv(&mut self) -> Result<HubEvent> {
        crate::drive::wait_until_some(|| self.recv_timeout(None))
    }

    /// The next event, waiting at most `timeout` (`None`: as long as it takes); `Ok(None)` if
    /// nothing happened in time.
    pub fn recv_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<HubEvent>> {
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        if let Some(ev) = self.take_held() {
            return Ok(Some(ev));
        }
        loop {
            if let Some(ev) = self.take_ready() {
                return Ok(Some(ev));
            }
            if self.waiting_call && std::mem::take(&mut self.answered) {
                return Ok(None);
            }
            self.advance_reads(Instant::now());
            self.drain_outboxes();
            if let Some(ev) = self.take_ready() {
                return Ok(Some(ev));
            }
            let mut left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !self.unflushed.is_empty() {
                if let Some(ev) = self.try_recv()? {
                    return Ok(Some(ev));
                }
                let (stuck, nearest) = self.flush_before_wait();
                // A send slot frees as soon as an earlier send completes: look again soon.
                let retry = if stuck {
                    Some(UNFLUSHED_RETRY)
                } else {
                    nearest.map(|d| d.saturating_duration_since(Instant::now()))
                };
                if let Some(r) = retry {
                    left = Some(left.map_or(r, |l| l.min(r)));
                }
            }
            // A close waiting for its peer ends at its deadline, event or not; so does a
            // message in reassembly whose sender stalled.
            for at in self.earliest_close().into_iter().chain(self.reassembly_at) {
                let r = at.saturating_duration_since(Instant::now());
                left = Some(left.map_or(r, |l| l.min(r)));
            }
            // An outbox waiting for credits: its failed send armed the hub to wake for the
            // grant (or the send completion) that lets it go, which is no event: `wait`
            // returns after any wake-up.
            if self.waiting_call && std::mem::take(&mut self.answered) {
                return Ok(None);
            }
            let raw = match self.transport.queued_event() {
                Some(raw) => Some(raw),
                None if left == Some(Duration::ZERO) => None,
                None => {
                    self.transport.wait(left)?;
                    self.transport.queued_event()
                }
            };
            let Some(raw) = raw else {
                if deadline.map_or(true, |d| Instant::now() < d) {
                    continue;
                }
                return Ok(None);
            };
            self.take(raw);
        }
    }

    /// The next typed event ready, taking in what a waiting send stashed first. A message
    /// (or the error in its place) handed out is taken: its peer's record moves on, and a
    /// request of the peer's it reaches is answered.
    fn take_ready(&mut self) -> Option<HubEvent> {
        loop {
            while self.ready.is_empty() {
                let raw = self.stash.pop_front()?;
                self.take(raw);
            }
            let (ev, seq) = self.ready.pop_front()?;
            if let (Some(seq), Some(peer)) = (seq, ev.peer()) {
                self.took(peer, seq);
            }
            match ev {
                HubEvent::Message { peer, msg } => {
                    let routed =
                        call::route(msg, Some(peer), &self.calls, &self.replies, &self.registry);
                    match routed {
                        Ok(call::Routed::Deliver(msg)) => {
                            return Some(HubEvent::Message { peer, msg })
                        }
                        Ok(call::Routed::Consumed) => self.answered = true,
                        Err(error) => return Some(HubEvent::BadFrame { peer, error }),
                    }
                }
                ev => return Some(ev),
            }
        }
    }

    /// The application took `peer`'s message `seq`.
    fn took(&mut self, peer: PeerId, seq: u32) {
        let Some((state, mut link)) = self.split(peer) else {
            return;
        };
        state.receiver.mark_taken(seq);
        let _ = link.hub.set_note(peer, state.receiver.taken());
        if peer::took(&mut state.sender, &mut state.receiver) {
            // A failing peer: its Disconnected tells.
            let _ = state.sender.send_committed(&mut link);
            if state.sender.queued_frames() > 0 && !state.listed {
                state.listed = true;
                self.unflushed.push(peer);
            }
        }
    }

    /// Posts the reads that wait for buffer room or a send slot, and takes in the frames
    /// parked for want of room, for every peer, once messages in reassembly whose senders
    /// stalled until `now` are dropped (which gives their room to the others).
    fn advance_reads(&mut self, now: Instant) {
        self.watch_reassembly(now);
        for peer in std::mem::take(&mut self.reads_waiting) {
            self.collect(peer);
        }
    }

    /// Gives each peer's message in reassembly its look at the clock
    /// ([`RecvSide::handle_timeout`]): one that got no fragment for
    /// [`SessionConfig::reassembly_timeout`] fails in its place
    /// ([`crate::Error::ReassemblyTimedOut`], a [`HubEvent::BadFrame`]) and its reservation
    /// returns. Keeps the nearest deadline for the waits ([`Hub::next_timeout`]).
    fn watch_reassembly(&mut self, now: Instant) {
        let mut nearest: Option<Instant> = None;
        let mut i = 0;
        while i < self.reassembling.len() {
            let peer = self.reassembling[i];
            let Some(state) = self.peers.get_mut(peer) else {
                self.reassembling.swap_remove(i);
                continue;
            };
            state.receiver.handle_timeout(now);
            if !state.receiver.reassembling() {
                self.reassembling.swap_remove(i);
                queue_ready(peer, &mut state.receiver, &mut self.ready);
                continue;
            }
            if let Some(d) = state.receiver.poll_timeout() {
                nearest = Some(nearest.map_or(d, |n| n.min(d)));
            }
            i += 1;
        }
        self.reassembly_at = nearest;
        self.reassembly_unwatched = false;
    }

    /// After `peer`'s receiving side took something in: posts its waiting reads, hands
    /// acknowledgements over (ours go out as they can), and queues its messages that are
    /// ready, in order (unless calls' waits keep all they may of its messages: they wait in
    /// its receiver, the peer under [`RecvSide::hold_back`]).
    fn collect(&mut self, peer: PeerId) {
        let Some((state, mut link)) = self.split(peer) else {
            return;
        };
        // A failing peer: its Disconnected event tells.
        let _ = state.receiver.advance(&mut link);
        state.sender.learn_note(link.hub.peer_note(peer));
        let frame_max = link.max_message().unwrap_or(0);
        if peer::exchange_acks(&mut state.sender, &mut state.receiver, frame_max) {
            let _ = state.sender.send_committed(&mut link);
        }
        let list = state.sender.queued_frames() > 0 && !state.listed;
        state.listed |= list;
        let (waiting, reassembling) = (state.receiver.has_waiting(), state.receiver.reassembling());
        if waiting && !self.reads_waiting.contains(&peer) {
            self.reads_waiting.push(peer);
        }
        if reassembling && !self.reassembling.contains(&peer) {
            // Watched from the next look at the clock on (see `advance_reads`).
            self.reassembling.push(peer);
            self.reassembly_unwatched = true;
        }
        if let Some(state) = self.peers.get_mut(peer) {
            if !self.held.is_full(peer) {
                queue_ready(peer, &mut state.receiver, &mut self.ready);
            }
        }
        if list {
            self.unflushed.push(peer);
        }
    }

    /// An event that has already happened, without waiting (for event loops over
    /// [`AsFd`]: call it until `Ok(None)` whenever the hub's descriptor is readable, and at
    /// least every [`rdmsg_transport::RawHub::next_timeout`]).
    pub fn try_recv(&mut self) -> Result<Option<HubEvent>> {
        if let Some(ev) = self.take_held() {
            return Ok(Some(ev));
        }
        self.drain_outboxes();
        loop {
            if let Some(ev) = self.take_ready() {
                return Ok(Some(ev));
            }
            match self.transport.try_event()? {
                Some(raw) => self.take(raw),
                None => return Ok(None),
            }
        }
    }

    /// The events, until the hub's own failure (which [`Hub::recv`] then reports).
    pub fn incoming(&mut self) -> impl Iterator<Item = HubEvent> + '_ {
        std::iter::from_fn(move || self.recv().ok()).fuse()
    }

    /// Turns a transport event into typed ones (queued in [`Hub::ready`]), keeping per-peer
    /// state: none for a frame that completed nothing (a fragment, a nudge, a descriptor
    /// whose read is under way).
    fn take(&mut self, raw: rdmsg_transport::RawHubEvent) {
        use rdmsg_transport::RawHubEvent as Raw;
        let ev = match raw {
            Raw::Connected { peer, accepted } => {
                self.state(peer);
                HubEvent::Connected { peer, accepted }
            }
            Raw::Message { peer, msg } => {
                let wakeup = self.transport.wakeups();
                let receiver = &mut self.state(peer).receiver;
                receiver.woken(wakeup);
                receiver.arrive(FrameBytes::Received(msg));
                return self.collect(peer);
            }
            Raw::Read { peer, read } => {
                // A read of a peer already gone was counted out of the pool with it: its
                // buffer is dropped.
                if let Some(state) = self.peers.get_mut(peer) {
                    state.receiver.read_done(read);
                    self.collect(peer);
                }
                return;
            }
            Raw::Disconnected {
                peer,
                failure,
                last_note,
            } => {
                {
                    let mut calls = call::lock(&self.calls);
                    calls.fail_peer(Some(peer), || {
                        rdmsg_transport::Error::Connection(failure).into()
                    });
                    calls.forget_peer(peer);
                }
                if let Some(mut gone) = self.peers.remove(peer) {
                    gone.outbox.clear();
                    self.departed_outboxes.add(&gone.outbox.stats());
                    // Its last word: what its application took, as of its last grant or close.
                    gone.sender.learn_note(last_note);
                    // What arrived comes first: messages whose reads can no longer complete
                    // fail in their place, the others behind them are delivered.
                    gone.receiver.abandon_reads();
                    queue_ready(peer, &mut gone.receiver, &mut self.ready);
                    self.departed.add(&gone.stats());
                    let delivery = gone.sender.delivery(None);
                    if gone.sender.keeps_copies() && delivery.unconfirmed() > 0 {
                        let messages = gone.sender.take_unconfirmed();
                        let ev = HubEvent::Unconfirmed {
                            peer,
                            delivery,
                            messages,
                        };
                        self.ready.push_back((ev, None));
                    }
                }
                HubEvent::Disconnected { peer, failure }
            }
            Raw::HandshakeFailed { peer, error } => {
                if let Some(p) = peer {
                    let mut calls = call::lock(&self.calls);
                    calls.fail_peer(Some(p), || {
                        rdmsg_transport::Error::Connection(rdmsg_transport::Failure::Closed).into()
                    });
                    calls.forget_peer(p);
                }
                if let Some(gone) = peer.and_then(|p| self.peers.remove(p)) {
                    self.departed.add(&gone.stats());
                }
                HubEvent::HandshakeFailed {
                    peer,
                    error: error.into(),
                }
            }
        };
        self.ready.push_back((ev, None));
    }

    /// `peer`'s state, made on first sight: normally at its `Connected`, but also when that
    /// event was taken from the transport directly, or a send came first.
    fn state(&mut self, peer: PeerId) -> &mut PeerState {
        if self.peers.get(peer).is_none() {
            // A connected peer has announced its depth; 0 (solicit every other message) only
            // if it is gone meanwhile, when nothing will be sent to it anyway.
            let hello = self.transport.peer_hello(peer);
            let depth = hello.map_or(0, |h| h.recv_depth);
            // Gone meanwhile: nothing will be sent, by rendezvous or otherwise.
            let max_read = hello.map_or(0, |h| h.max_read);
            let fresh = PeerState {
                sender: SendSide::new(&self.config, depth).with_peer_max_read(max_read),
                receiver: RecvSide::new(self.registry.fresh(), self.pool.clone())
                    .with_budget(self.budget.clone()),
                listed: false,
                closing: None,
                outbox: Outbox::new(self.config.max_outbox_bytes),
            };
            // A slot reused before its previous peer's `Disconnected` came through here.
            if let Some((_, stale)) = self.peers.insert(peer, fresh) {
                self.departed.add(&stale.stats());
            }
        }
        self.peers.get_mut(peer).expect("inserted above")
    }

    /// Runs `f` with `peer`'s sender and a link to it. A peer still in its handshake is
    /// waited for first, as the transport's send would (a send that fills nothing), so that
    /// its policy starts from its announced depth.
    fn with_sender<T>(
        &mut self,
        peer: PeerId,
        f: impl FnOnce(&mut SendSide, &mut HubPeerIo<'_>) -> Result<T>,
    ) -> Result<T> {
        self.with_sender_waiting(peer, None, f)
    }

    /// [`Hub::with_sender`], the first frame waiting at most `timeout` (a peer still
    /// connecting too).
    fn with_sender_waiting<T>(
        &mut self,
        peer: PeerId,
        timeout: Option<Duration>,
        f: impl FnOnce(&mut SendSide, &mut HubPeerIo<'_>) -> Result<T>,
    ) -> Result<T> {
        self.with_peer_waiting(peer, timeout, |send, _, io| f(send, io))
    }

    /// [`Hub::with_sender_waiting`], with the peer's outbox.
    fn with_peer_waiting<T>(
        &mut self,
        peer: PeerId,
        timeout: Option<Duration>,
        f: impl FnOnce(&mut SendSide, &mut Outbox, &mut HubPeerIo<'_>) -> Result<T>,
    ) -> Result<T> {
        if self.peers.get(peer).is_none() && self.transport.peer_hello(peer).is_none() {
            self.transport.send_with(peer, false, timeout, |_| None)?;
        }
        // Events an earlier wait stashed go to their peers first: this peer's older ones must
        // come before what this send's wait takes in.
        while let Some(raw) = self.stash.pop_front() {
            self.take(raw);
        }
        self.state(peer);
        let Self {
            transport,
            peers,
            stash,
            ..
        } = self;
        let PeerState {
            sender,
            receiver,
            listed,
            outbox,
            ..
        } = peers.get_mut(peer).expect("made above");
        let mut link = HubPeerIo {
            hub: transport,
            peer,
            stash: Some(stash),
            receiver: Some(receiver),
        };
        sender.learn_note(link.hub.peer_note(peer));
        let out = f(sender, outbox, &mut link);
        let list = (sender.pending() || sender.queued_frames() > 0) && !*listed;
        *listed |= list;
        if list {
            self.unflushed.push(peer);
        }
        // What a wait for rendezvous room took in for this peer.
        if self.peers.get(peer).is_some_and(|s| {
            let r = &s.receiver;
            r.has_ready() || r.has_acks() || r.has_waiting() || r.reassembling()
        }) {
            self.collect(peer);
        }
        out
    }

    /// `peer`'s state and a link to it, borrowed together.
    fn split(&mut self, peer: PeerId) -> Option<(&mut PeerState, HubPeerIo<'_>)> {
        let Self {
            transport, peers, ..
        } = self;
        Some((
            peers.get_mut(peer)?,
            HubPeerIo {
                hub: transport,
                peer,
                stash: None,
                receiver: None,
            },
        ))
    }

    /// About to wait: sends what committed frames can go, and flushes every peer left with
    /// unsolicited messages (see [`crate::Session::recv`] for why; with a
    /// [`SessionConfig::max_unsolicited_delay`], those whose delay ran out), never waiting for
    /// any one of them. Returns whether some are still pending for want of a send slot or
    /// credit (the wait should then be short), and the nearest flush deadline.
    fn flush_before_wait(&mut self) -> (bool, Option<Instant>) {
        let mut i = 0;
        let mut stuck = false;
        let mut nearest: Option<Instant> = None;
        while i < self.unflushed.len() {
            let peer = self.unflushed[i];
            let credits = self.transport.credits(peer).unwrap_or(0);
            let done = match self.split(peer) {
                None => true,
                Some((state, mut link)) => {
                    let sender = &mut state.sender;
                    // A failing peer: its Disconnected event tells.
                    let all_sent = sender.send_committed(&mut link).unwrap_or(true);
                    let flushed = !sender.flush_due()
                        || sender
                            .flush_before_wait(&mut link, credits, Some(Duration::ZERO))
                            .unwrap_or(true);
                    stuck |= !all_sent || !flushed;
                    if let Some(d) = sender.flush_deadline() {
                        nearest = Some(nearest.map_or(d, |n| n.min(d)));
                    }
                    let done = !sender.pending() && sender.queued_frames() == 0;
                    state.listed = !done;
                    done
                }
            };
            if done {
                self.unflushed.swap_remove(i);
            } else {
                i += 1;
            }
        }
        (stuck, nearest)
    }

    /// Sends `m` to `peer` if it can go without waiting (see
    /// [`crate::Session::try_send_as`]): `Ok(false)`, nothing sent, if `peer` has no credit
    /// or is still connecting, or no send slot is free. A fragmented message is committed
    /// once its first frame goes; the rest follow as `peer`'s credits come, on later calls.
    pub fn try_send_as<M: Message>(
        &mut self,
        peer: PeerId,
        m: &M,
        solicited: bool,
    ) -> Result<bool> {
        peer::in_time(
            self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
                s.try_send_as(link, m, solicited)
            })
            .and_then(|sent| {
                if sent {
                    Ok(())
                } else {
                    let none = crate::error::WAIT_NONE;
                    Err(rdmsg_transport::Error::timeout("sending", none, Duration::ZERO).into())
                }
            }),
        )
    }

    /// [`Hub::try_send_as`] with the type's own solicitation.
    pub fn try_send<M: Message>(&mut self, peer: PeerId, m: &M) -> Result<bool> {
        self.try_send_as(peer, m, M::SOLICITED)
    }

    /// The non-blocking step for an event loop over [`AsFd`]: sends committed frames that can
    /// go, flushes peers as a wait would ([`Hub::recv`]), then steps the transport hub
    /// ([`rdmsg_transport::RawHub::step`]); take its events with [`Hub::try_recv`]. Wait at most
    /// [`Hub::next_timeout`] before the next step.
    pub fn step(&mut self) -> Result<usize> {
        let queued = self.ready.len();
        self.advance_reads(Instant::now());
        let outboxes = self.outboxed.len();
        self.drain_outboxes();
        let drained = usize::from(self.outboxed.len() != outboxes);
        let (stuck, nearest) = self.flush_before_wait();
        self.retry_at = if stuck {
            Some(Instant::now() + UNFLUSHED_RETRY)
        } else {
            nearest
        };
        // Events this step queued count as work (those queued before were counted then).
        Ok(self.transport.step()? + self.ready.len().saturating_sub(queued) + drained)
    }

    /// See [`rdmsg_transport::RawHub::nobody_waits`]: after a wait on the descriptor, when nobody else
    /// waits on it.
    pub fn nobody_waits(&mut self) {
        self.transport.nobody_waits();
    }

    /// Longest an event loop may wait before the next [`Hub::step`]: the transport hub's
    /// timers, and sooner while a flush is pending, a close waits for its deadline, or a
    /// message in reassembly for its progress deadline
    /// ([`SessionConfig::reassembly_timeout`]).
    pub fn next_timeout(&self) -> Option<Duration> {
        if self.reassembly_unwatched {
            // A message in reassembly whose deadline the next step starts.
            return Some(Duration::ZERO);
        }
        let close = self.earliest_close();
        let flush = self
            .retry_at
            .filter(|_| !self.unflushed.is_empty())
            .into_iter()
            .chain(close)
            .chain(self.reassembly_at)
            .min()
            .map(|d| d.saturating_duration_since(Instant::now()));
        match (self.transport.next_timeout(), flush) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl AsFd for Hub {
    /// The transport hub's descriptor: readable whenever the hub has something to do (see
    /// [`Hub::try_recv`]).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.transport.as_fd()
    }
}
