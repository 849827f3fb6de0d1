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
    self, Closing, Delivery, Encode, HubPeerIo, Outbox, OutboxStats, PeerMachine, PeerTable,
    ReassemblyBudget, RecvSide, SendSide,
};
use crate::rendezvous::ReadPool;
use crate::{Error, Message, Result, SessionConfig, SessionStats};

mod calls;
mod close;
mod events;
mod limits;
mod post;
mod receive;
mod resume;
mod send;

pub use events::{HubEvent, Posted};
pub use limits::HubLimits;

/// What the hub keeps per peer: what a [`crate::Session`] keeps for its connection.
#[derive(Debug)]
struct PeerState {
    /// The peer's protocol state: sending side, receiving side, outbox (messages waiting
    /// for the peer's credits: [`Hub::post`], answers).
    machine: PeerMachine,
    /// Listed in [`Hub::unflushed`].
    listed: bool,
    /// [`Hub::start_close`] under way: the transport's close starts once it is due.
    closing: Option<Closing>,
    /// Its connection was lost and its session waits for a new one (see [`resume`]).
    suspension: Option<resume::Suspension>,
    /// Time spent suspended, over the suspensions that ended.
    suspended_for: Duration,
}

impl PeerState {
    fn stats(&self) -> SessionStats {
        let mut s = self.machine.stats();
        s.time_suspended = self.suspended_for;
        s
    }

    /// Whether the peer is to join [`Hub::unflushed`] now: it has frames or a flush waiting
    /// ([`PeerMachine::unflushed`]) and is not listed yet (it is, from now on).
    fn join_list(&mut self) -> bool {
        let list = !self.listed && self.machine.unflushed();
        self.listed |= list;
        list
    }
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
    /// The bounds over all peers (the budget's).
    limits: HubLimits,
    /// Peers with descriptors waiting for buffer room or a send slot.
    reads_waiting: Vec<PeerId>,
    /// Peers with a message in reassembly, watched for progress
    /// ([`HubLimits::reassembly_timeout`]), and the nearest of their deadlines.
    reassembling: Vec<PeerId>,
    reassembly_at: Option<Instant>,
    /// A peer joined `reassembling` since the last look: its deadline starts at the next one,
    /// which an event loop should take at once ([`Hub::next_timeout`]).
    reassembly_unwatched: bool,
    /// Peers whose [`Hub::start_close`] waits for them to finish reading our messages.
    closing: Vec<PeerId>,
    /// Peers whose outboxes hold messages.
    outboxed: Vec<PeerId>,
    /// Resumed peers whose new connection had no room for our count yet.
    untold: Vec<PeerId>,
    /// The transport's sessions may resume ([`rdmsg_transport::Config::resume_window`]).
    resumable: bool,
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
    /// A call's wait is receiving, and whether an answer came: it ends the receive.
    answer_watch: call::AnswerWatch,
    /// The outbox counts of peers gone.
    departed_outboxes: OutboxStats,
    /// Peers whose failure was taken in and not handed out yet, with what their records say
    /// of the calls to them: the calls fail when the `Disconnected` is handed out.
    failing: Vec<(PeerId, call::LostCalls)>,
    /// Calls whose ends are events ([`Hub::watch`]), with their peers.
    watched: std::collections::HashMap<u64, (PeerId, Call<()>)>,
    /// Their deadlines, nearest first.
    watch_deadlines: std::collections::BTreeSet<(Instant, u64)>,
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
        // Resumable peers keep copies of what they have not taken: they go again.
        let config = match (
            transport.config().conn.resume_window,
            config.keep_unconfirmed,
        ) {
            (Some(_), None) => SessionConfig {
                keep_unconfirmed: Some(crate::RESUME_KEEP),
                ..config
            },
            _ => config,
        };
        // What we read is bounded by what we announce in every handshake, for all peers.
        let pool = ReadPool::new(transport.config().conn.announced_max_read() as usize);
        if let Ok(waker) = transport.waker() {
            // A read buffer given back on another thread while a descriptor waits for room
            // wakes the hub.
            pool.set_waker(waker);
        }
        let replies = Replies::new(transport.waker().ok());
        let limits = HubLimits::from_session(&config);
        Self {
            outboxed: Vec::new(),
            untold: Vec::new(),
            resumable: transport.config().conn.resume_window.is_some(),
            calls: Calls::default(),
            replies,
            held: Held::new(config.max_held_bytes),
            holding: false,
            answer_watch: call::AnswerWatch::default(),
            departed_outboxes: OutboxStats::default(),
            failing: Vec::new(),
            watched: std::collections::HashMap::new(),
            watch_deadlines: std::collections::BTreeSet::new(),
            pool,
            budget: ReassemblyBudget::new(limits.max_reassembly_bytes, limits.reassembly_timeout),
            limits,
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
            p.machine.recv.register::<M>()?;
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

    /// Whether this hub started closing `peer` ([`Hub::start_close`]) and the close has not
    /// ended: the peer is still among [`Hub::peers`], but takes nothing new.
    pub fn is_closing(&self, peer: PeerId) -> bool {
        self.peers.get(peer).is_some_and(|s| s.closing.is_some())
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
        self.peers.get(peer).map(|s| s.machine.send.delivery(note))
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

    /// Starts a connection over a TCP stream already connected (see
    /// [`rdmsg_transport::RawHub::connect_stream`]): never blocks.
    pub fn connect_stream(&mut self, stream: std::net::TcpStream) -> Result<PeerId> {
        Ok(self.transport.connect_stream(stream)?)
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
                machine: PeerMachine::new(
                    SendSide::new(&self.config, depth).with_peer_max_read(max_read),
                    RecvSide::new(self.registry.fresh(), self.pool.clone())
                        .with_budget(self.budget.clone()),
                    Outbox::new(self.config.max_outbox_bytes),
                ),
                listed: false,
                closing: None,
                suspension: None,
                suspended_for: Duration::ZERO,
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
        self.with_peer_waiting(peer, timeout, |machine, io| machine.lending(io, f))
    }

    /// [`Hub::with_sender_waiting`] with the peer's whole machine, and its link not yet lent
    /// the receiving side (the machine lends it: [`PeerMachine::lending`]).
    #[inline]
    fn with_peer_waiting<T>(
        &mut self,
        peer: PeerId,
        timeout: Option<Duration>,
        f: impl FnOnce(&mut PeerMachine, &mut HubPeerIo<'_>) -> Result<T>,
    ) -> Result<T> {
        if self.peers.get(peer).is_none() && self.transport.peer_hello(peer).is_none() {
            self.transport.send_with(peer, false, timeout, |_| None)?;
        }
        // Events an earlier wait stashed go to their peers first: this peer's older ones must
        // come before what this send's wait takes in (and its suspension before its send).
        self.take_stashed();
        if self.resumable && self.suspended_now(peer) {
            // Its session waits for a new connection: so does the send, within its time.
            let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
            if !self.wait_resumed(peer, deadline)? {
                return Err(rdmsg_transport::Error::timeout(
                    "sending",
                    "the peer's session to resume",
                    timeout.unwrap_or_default(),
                )
                .into());
            }
        }
        self.state(peer);
        let Self {
            transport,
            peers,
            stash,
            ..
        } = self;
        let state = peers.get_mut(peer).expect("made above");
        let mut link = HubPeerIo {
            hub: transport,
            peer,
            stash: Some(stash),
            receiver: None,
        };
        state.machine.learn_note(&link);
        let out = f(&mut state.machine, &mut link);
        if state.join_list() {
            self.unflushed.push(peer);
        }
        // What a wait for rendezvous room took in for this peer.
        if self.peers.get(peer).is_some_and(|s| {
            let r = &s.machine.recv;
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
    fn flush_before_wait(&mut self, now: Instant) -> (bool, Option<Instant>) {
        let mut i = 0;
        let mut stuck = false;
        let mut nearest: Option<Instant> = None;
        while i < self.unflushed.len() {
            let peer = self.unflushed[i];
            let done = match self.split(peer) {
                None => true,
                // Its frames go once it resumes (which lists it again).
                Some((state, _)) if state.suspension.is_some() => {
                    state.listed = false;
                    true
                }
                Some((state, mut link)) => {
                    let machine = &mut state.machine;
                    // A failing peer: its Disconnected event tells.
                    stuck |= machine
                        .flush_before_wait(&mut link, Some(Duration::ZERO), Some(now))
                        .is_ok_and(|f| f.stuck());
                    if let Some(d) = machine.send.flush_deadline() {
                        nearest = Some(nearest.map_or(d, |n| n.min(d)));
                    }
                    state.listed = machine.unflushed();
                    !state.listed
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

    /// The non-blocking step for an event loop over [`AsFd`]: sends committed frames that can
    /// go, flushes peers as a wait would ([`Hub::recv`]), then steps the transport hub
    /// ([`rdmsg_transport::RawHub::step`]); take its events with [`Hub::try_recv`]. Wait at most
    /// [`Hub::next_timeout`] before the next step. Returns how much this step did: the events
    /// it queued (not those already waiting to be taken, or a waiter that takes none, such
    /// as a wait for an outbox's room, would step for ever) and the outboxes it emptied.
    pub fn step(&mut self) -> Result<usize> {
        let queued = self.ready.len();
        // Raw events queued before this step, not by the transport steps it may run inside.
        let raw = self.transport.queued();
        // The clock, once for the step.
        let now = Instant::now();
        self.advance_reads(now);
        let outboxes = self.outboxed.len();
        self.drain_outboxes_at(Some(now));
        let drained = usize::from(self.outboxed.len() != outboxes);
        let (stuck, nearest) = self.flush_before_wait(now);
        // Closes that waited for those frames go now, not at their deadlines.
        if !self.closing.is_empty() {
            self.finish_closes(now);
        }
        self.retry_at = if stuck {
            Some(now + UNFLUSHED_RETRY)
        } else {
            nearest
        };
        // Events this step queued count as work (those queued before were counted then).
        let raw = self.transport.step()?.saturating_sub(raw);
        Ok(raw + self.ready.len().saturating_sub(queued) + drained)
    }

    /// See [`rdmsg_transport::RawHub::nobody_waits`]: after a wait on the descriptor, when nobody else
    /// waits on it.
    pub fn nobody_waits(&mut self) {
        self.transport.nobody_waits();
    }

    /// Longest an event loop may wait before the next [`Hub::step`]: the transport hub's
    /// timers, and sooner while a flush is pending, a close waits for its deadline, or a
    /// message in reassembly for its progress deadline
    /// ([`HubLimits::reassembly_timeout`]).
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
            .chain(self.watch_deadline())
            .min()
            .map(|d| d.saturating_duration_since(Instant::now()));
        crate::drive::earliest(self.transport.next_timeout(), flush)
    }
}

impl AsFd for Hub {
    /// The transport hub's descriptor: readable whenever the hub has something to do (see
    /// [`Hub::try_recv`]).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.transport.as_fd()
    }
}
