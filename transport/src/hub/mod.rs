//! Many connections served by one thread: a slab of protocol [`Core`]s over one completion
//! channel, one receive and one send CQ, one shared receive queue, one pool of send buffers and
//! one epoll set. The hub is their driver: it polls, posts, waits and moves bytes; every rule
//! of a connection is its core's, and every rule of the shared buffers is [`Share`]'s.
//!
//! # Data path
//!
//! Every connection's queue pair receives through the hub's shared receive queue (SRQ) and
//! completes on the hub's two CQs, both on one completion channel; the receive CQ is armed
//! solicited-only, so one thread sleeps in `epoll_wait` until a solicited message from *any*
//! peer (or an error, a client, a bootstrap stream, a returned buffer) wakes it, and then
//! drains everything that arrived from every peer in one pass. A completion names its queue
//! pair; the hub maps that number to the connection and hands the completion to that
//! connection's core (the same rules a single [`Connection`](crate::Connection) runs).
//!
//! # Credits over a shared receive queue
//!
//! Each connection still has its own credits, but the buffers behind them are shared: the
//! hub's [`Share`] hands every buffer posted to the SRQ to a connection (a missing grant slot
//! first, then one below its minimum, then a busy one below its quota) or keeps it spare.
//! Every credit a peer holds and every grant slot it may use is backed by a posted buffer, so
//! no peer meets receiver-not-ready; an idle connection keeps `min_credits` and its grant
//! slots, a busy one grows towards `max_credits` from the spare buffers.
//!
//! # Failure isolation
//!
//! A connection that fails (its peer vanished, lied about credits, or its queue pair broke)
//! is failed alone: its bootstrap stream is shut, its queue pair moved to error and, once its
//! sends are flushed back, destroyed; the CQs are polled once more so that everything that
//! arrived from it is delivered, and only then is its share of the buffers released and
//! [`RawHubEvent::Disconnected`] reported. The others carry on.
//!
//! # Files
//!
//! `slots` (the connection table), `accept` (listener, handshakes, bootstrap streams), `cm`
//! (the same through rdma_cm),
//! `completions` (polled completions to cores, the cores' actions), `buffers` (receive pool,
//! admission, grants, posting sends), `wait` (the channel, sleeping, what follows a wake-up),
//! `retire` (deadlines, failures, draining and releasing connections).

mod accept;
mod budget;
mod buffers;
mod close;
mod cm;
mod cm_pending;
mod completions;
mod config;
mod events;
mod groups;
mod liveness;
mod queues;
mod reads;
mod retire;
mod sessions;
mod side;
mod slots;
pub(crate) mod table;
mod wait;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmsg_notify::{ArmMode, CqKey, Waiter};
use rdmsg_verbs::{Access, CompletionChannel, CompletionQueue, ReadyWatch, WorkCompletion};

pub use config::HubConfig;
pub use events::{ConnectTimes, HubStats, PeerId, RawHubEvent};

use crate::clock::TurnClock;
use crate::core::{earliest, ConnStats};
use crate::device_events::Mailbox;
use crate::drive;
use crate::endpoint::Endpoint;
use crate::error::{Error, Failure, Result};
use crate::handshake::{Handshake, Hello};
use crate::handshake_set::Underway;
use crate::pool::{PoolStats, RecvPool, Waker};
use crate::send::{self, Payload, SendBuffers};
use crate::setup::nonce;
use crate::stream::bootstrap_err;
use crate::token::Token;
use slots::{Resources, Slot};
use wait::HubChannel;

/// Many RC connections driven by one thread: one completion channel, one receive and one
/// send CQ, one shared receive queue and one pool of send buffers for all of them. One
/// solicited message from any peer wakes the thread, which then takes everything every peer
/// sent.
///
/// Each connection keeps its own credits, backed by buffers of the shared pool: an idle one
/// keeps `min_credits` and its grant slots, a busy one grows towards `max_credits`, and no
/// peer ever meets receiver-not-ready. A connection that fails (its peer vanished, broke the
/// credit protocol, or its queue pair broke) fails alone: everything it delivered comes
/// first, then [`RawHubEvent::Disconnected`]; the others carry on.
///
/// Everything goes through it: [`RawHub::listen`] and [`RawHub::connect`] start handshakes (none
/// blocks the others: a silent or hostile client holds a socket and a slot, never the hub),
/// [`RawHub::next_event`] sleeps until something happens and returns it (a connection, a message,
/// a disconnection), [`RawHub::send`] sends to one peer. [`RawHub::step`] is the non-blocking
/// step, and the hub is [`AsFd`], for an application's own event loop.
pub struct RawHub {
    endpoint: Endpoint,
    config: HubConfig,
    waiter: Waiter<CompletionQueue, HubChannel>,
    send_key: CqKey,
    /// Receive groups (an SRQ, its CQ and its books), made as connections come.
    groups: Vec<groups::RecvGroup>,
    /// The group of each CQ key (`None`: the send CQ).
    key_group: Vec<Option<usize>>,
    group_size: config::GroupSize,
    pool: RecvPool,
    send: SendBuffers,
    send_bytes: u64,
    /// What the connections may post on the send CQ and buffers they share (see [`budget`]).
    budget: budget::SendBudget,
    /// The connections, by slot (see [`table`]).
    table: table::SlotTable<Slot>,
    listener: Option<TcpListener>,
    cm_listener: Option<cm_pending::CmListening>,
    events: VecDeque<RawHubEvent>,
    /// Events taken from `events`, ever: a layer above counts them as progress (taking a
    /// peer's acknowledgement can free room another task waits for).
    events_taken: u64,
    completions: Vec<(CqKey, WorkCompletion)>,
    /// Slots whose credits changed this round: grants may be due.
    touched: Vec<usize>,
    /// Slots whose queue pair is in the error state, waiting to be retired.
    draining: Vec<usize>,
    /// Slots whose queue pair was destroyed, released after the next poll.
    retired: Vec<usize>,
    /// Deadlines of slots (a handshake's, or one of their core's), nearest first. An entry is
    /// a hint: the slot's deadline is asked again when it comes up (see `RawHub::schedule`).
    timers: BinaryHeap<Reverse<(Instant, usize)>>,
    /// Liveness, watched per peer host (see [`liveness`]).
    liveness: liveness::Liveness,
    /// Handshakes under way, accepted (by slot and generation, oldest first) and our own.
    handshakes: Underway<(usize, u32)>,
    /// Connections holding buffers of the shared pool.
    admitted: usize,
    mailbox: Arc<Mailbox>,
    last_tick: Instant,
    /// The time of this turn (see [`TurnClock`]).
    clock: TurnClock,
    /// A failure of the whole hub (its queues or channel): every later call reports it.
    fatal: Option<Failure>,
    stats: HubStats,
    /// The last [`RawHub::step`] marked the pool asleep for an external wait.
    stepped_asleep: bool,
    /// Slots whose last bounded send found no credit or send slot (their core says whether it
    /// still waits): while any does, the hub wakes for any completion (see `RawHub::arm`).
    blocked: Vec<usize>,
    /// Sends since the hub last stepped.
    sends_since_step: u32,
    /// Steps that found the completion channel fired (see [`RawHub::wakeups`]).
    step_wakeups: u64,
    /// Resumable sessions (see [`sessions`]).
    sessions: sessions::HubSessions,
}

impl fmt::Debug for RawHub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawHub")
            .field("endpoint", &self.endpoint)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl AsFd for RawHub {
    /// The hub's epoll set: readable whenever the hub has something to do. Call
    /// [`RawHub::step`] (then [`RawHub::try_event`]) when it is; the hub also has timers (handshake
    /// deadlines, the health check), so step at least every [`RawHub::next_timeout`].
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.waiter.channel().watch.as_fd()
    }
}

impl RawHub {
    /// A hub on `endpoint`'s device and port.
    pub fn new(endpoint: &Endpoint, config: HubConfig) -> Result<Self> {
        config.check(endpoint)?;
        let max_connections = config.max_connections as usize;
        let probe_every = config.conn.keepalive.map(crate::core::probe_interval);
        let ctx = endpoint.context();
        let pd = endpoint.pd();
        let channel = CompletionChannel::new(ctx)?;
        channel.set_nonblocking(true)?;
        let dev = ctx.query_device()?;
        let group_size = config.group_size(dev.max_cqe, dev.max_srq_wr)?;
        let send_buffers = config.send_buffers as usize;
        let send_cq_entries = (4 * config.send_buffers).max(1024).min(dev.max_cqe.max(1));
        let send_cq = CompletionQueue::new(ctx, send_cq_entries, Some(&channel))?;
        let buf_size = config.conn.buf_size as usize;
        let pool = RecvPool::new(pd, config.shared_credits.max(1) as usize, buf_size)?;
        let send_bufs = pd
            .register(config.send_buffers as usize * buf_size, Access::LOCAL_WRITE)?
            .chunks(buf_size)?;
        let watch = ReadyWatch::new()?;
        watch.add_keyed(channel.as_fd(), Token::Channel.key())?;
        let wake = pool.wake_handle().map_err(Error::WakePipe)?;
        watch.add_keyed(wake.as_fd(), Token::Wake.key())?;
        // Shared with any connection of the device asleep on it: one of the sleepers is woken
        // and routes every event to its owner (see the `device_events` module).
        watch.add_keyed_exclusive(ctx.async_fd(), Token::Async.key())?;
        let mut waiter = Waiter::new(HubChannel::new(channel, watch, wake), config.conn.policy);
        let send_key = waiter.add(send_cq, ArmMode::SolicitedOnly);
        let mailbox = Mailbox::new(Some(pool.waker().map_err(Error::WakePipe)?));
        // Events of the hub's send CQ; each receive group and queue pair registers itself too.
        endpoint.register_async(None, vec![waiter.cq(send_key)?.as_raw() as usize], &mailbox);
        let mut hub = Self {
            endpoint: endpoint.clone(),
            send_bytes: send_bufs.len() as u64 * buf_size as u64,
            send: SendBuffers::new(send_bufs, config.conn.max_inline as usize),
            config,
            waiter,
            send_key,
            groups: Vec::new(),
            key_group: Vec::new(),
            group_size,
            pool,
            budget: budget::SendBudget::new(send_cq_entries as usize, send_buffers),
            table: table::SlotTable::new(max_connections),
            listener: None,
            cm_listener: None,
            events: VecDeque::new(),
            events_taken: 0,
            completions: Vec::new(),
            touched: Vec::new(),
            draining: Vec::new(),
            retired: Vec::new(),
            timers: BinaryHeap::new(),
            liveness: liveness::Liveness::new(probe_every),
            handshakes: Underway::default(),
            admitted: 0,
            mailbox,
            last_tick: Instant::now(),
            clock: TurnClock::default(),
            fatal: None,
            stats: HubStats::default(),
            stepped_asleep: false,
            blocked: Vec::new(),
            sends_since_step: 0,
            step_wakeups: 0,
            sessions: sessions::HubSessions::default(),
        };
        hub.new_group()?;
        hub.repost()?;
        Ok(hub)
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The hub's configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// Listens for clients at `addr` (`"0.0.0.0:0"` picks a port); returns the address bound.
    /// Their handshakes run inside the hub; each established one is a
    /// [`RawHubEvent::Connected`] with `accepted: true`.
    pub fn listen(&mut self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<SocketAddr> {
        let tcp = TcpListener::bind(&addr).map_err(|source| Error::Listen {
            addr: format!("{addr:?}"),
            source,
        })?;
        tcp.set_nonblocking(true)
            .map_err(bootstrap_err("making the listener non-blocking"))?;
        let local = tcp
            .local_addr()
            .map_err(bootstrap_err("reading the listening address"))?;
        if let Some(old) = self.listener.take() {
            let _ = self.watch().remove(old.as_fd());
        }
        self.watch().add_keyed(tcp.as_fd(), Token::Listen.key())?;
        self.listener = Some(tcp);
        Ok(local)
    }

    /// Starts a connection to a [`Listener`](crate::Listener) or another hub at `addr`: the
    /// TCP connection is made here (within `handshake_timeout`), the handshake runs inside
    /// the hub. The connection is usable once [`RawHubEvent::Connected`] names it (sending to it
    /// before waits for that); if the handshake fails, [`RawHubEvent::HandshakeFailed`] does.
    ///
    /// At most a quarter of `max_pending_handshakes` of ours run at once: a server evicts the
    /// oldest of its pending handshakes beyond its own bound (32 by default), and counts ours
    /// pending until it has read our last byte, a little after we are done. Beyond that, this
    /// drives the hub until one finishes.
    pub fn connect(&mut self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<PeerId> {
        self.check_fatal()?;
        let timeout = self.config.conn.handshake_timeout;
        let most = (self.config.conn.max_pending_handshakes as usize / 4).max(1);
        // A call from the application begins a turn: the waits below count from it.
        self.clock.new_turn();
        while self.outgoing_handshakes() >= most {
            self.wait_for_progress(Some(timeout), false)?;
        }
        let connect_err = |source| Error::Connect {
            addr: format!("{addr:?}"),
            source,
        };
        let stream = addr
            .to_socket_addrs()
            .map_err(connect_err)
            .and_then(|mut all| {
                all.next()
                    .ok_or_else(|| connect_err(io::ErrorKind::NotFound.into()))
            })
            .and_then(|to| TcpStream::connect_timeout(&to, timeout).map_err(connect_err));
        let stream = stream.inspect_err(|e| crate::trace::connect_failed(&addr, e))?;
        self.connect_stream(stream)
    }

    /// Starts a connection over a TCP stream already connected to a hub or listener (made by
    /// an async runtime, say): never blocks. Unlike [`RawHub::connect`] it does not wait while a
    /// quarter of `max_pending_handshakes` of our own handshakes are in flight; pace by
    /// [`RawHub::pending_connects`].
    pub fn connect_stream(&mut self, stream: TcpStream) -> Result<PeerId> {
        let session = crate::bootstrap::offer(&self.config.conn)?;
        self.connect_stream_as(stream, session, None)
    }

    /// [`RawHub::connect_stream`] carrying `session` in the handshake; `name`: the id of the
    /// session it resumes (see `sessions`), whose own events it reports.
    fn connect_stream_as(
        &mut self,
        stream: TcpStream,
        session: crate::handshake::Resumption,
        name: Option<PeerId>,
    ) -> Result<PeerId> {
        self.check_fatal()?;
        stream
            .set_nonblocking(true)
            .map_err(bootstrap_err("making the stream non-blocking"))?;
        let slot = self.new_slot(false)?;
        if let (Some(name), crate::handshake::Resumption::Resume(token)) = (name, session) {
            let s = self.slot_mut(slot);
            s.name = Some(name);
            s.session = Some(token);
        }
        let conn = self.config.conn.clone();
        let started = Instant::now();
        let made = self.create_side(slot).and_then(|side| {
            let ours = self.hello(Some(self.endpoint.address_of(&side.qp, side.psn)));
            let hs =
                Handshake::client_with(ours, conn.limits(), conn.psk.clone(), nonce()?, session);
            crate::bootstrap::Pending::new(stream, hs, Some(side), &conn)
        });
        let mut pending = match made {
            Ok(p) => p,
            Err(e) => {
                self.abandon(slot);
                return Err(e);
            }
        };
        // Its time counts from its queue pair's making.
        pending.started = started;
        let to = pending.peer_addr;
        self.start_handshake(slot, pending)?;
        let id = self.slot(slot).id(slot);
        crate::trace::hub_connecting(id, to);
        // The client speaks first: its hello is written at once.
        self.advance_handshake(slot);
        Ok(id)
    }

    /// Takes a client whose TCP connection was accepted elsewhere (by a [`crate::HubGroup`]'s
    /// acceptor, or an async runtime): its handshake runs inside the hub as if the hub's own
    /// listener had accepted it; never blocks. The outcome is a [`RawHubEvent::Connected`]
    /// with `accepted: true`, or a [`RawHubEvent::HandshakeFailed`]; an error (and no event)
    /// if the handshake could not start ([`Error::HubFull`], say).
    pub fn accept_stream(&mut self, stream: TcpStream) -> Result<()> {
        self.check_fatal()?;
        stream
            .set_nonblocking(true)
            .map_err(bootstrap_err("making the stream non-blocking"))?;
        self.take_client(stream)
    }

    /// Waits until something happens (at most `timeout`; `None`: as long as it takes) and
    /// handles it, without waiting for an event: returns after a wake-up that produced none
    /// too (a grant, a send completion, a [`Waker`]). Events it produced are queued for
    /// [`RawHub::try_event`]; returns how many are queued.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<usize> {
        self.check_fatal()?;
        if self.events.is_empty() {
            // A call from the application begins a turn (the wait reads its time).
            self.clock.new_turn();
            self.wait_for_progress(timeout, false)?;
        }
        Ok(self.events.len())
    }

    /// [`RawHub::wait`] with the caller's time: `timeout` counts from `now`, which begins the
    /// hub's turn, so that a caller that has just read the clock for its own turn spares the
    /// hub reading it before it sleeps. `now` must be that fresh: the sleep is longer by its
    /// age. After a wait that slept, [`RawHub::turn_now`] is the time the hub woke.
    pub fn wait_from(&mut self, now: Instant, timeout: Option<Duration>) -> Result<usize> {
        self.check_fatal()?;
        if self.events.is_empty() {
            self.clock.new_turn_at(now);
            self.wait_for_progress(timeout, false)?;
        }
        Ok(self.events.len())
    }

    /// The time of the hub's current turn: as read when its last wait woke (or its last call
    /// or step began), read now only if no step of the turn needed it yet. Meaningful right
    /// after a wait; between calls it may be as old as the last one.
    pub fn turn_now(&self) -> Instant {
        self.clock.now()
    }

    /// An event already queued, without stepping the hub.
    pub fn queued_event(&mut self) -> Option<RawHubEvent> {
        let event = self.events.pop_front();
        self.events_taken += u64::from(event.is_some());
        if let Some(RawHubEvent::Resumed { peer }) = &event {
            self.resumed_taken(*peer);
        }
        event
    }

    /// Handshakes started by [`RawHub::connect`] or [`RawHub::connect_stream`] and not finished.
    pub fn pending_connects(&self) -> usize {
        self.outgoing_handshakes()
    }

    /// The next event, waiting at most `timeout` (`None`: as long as it takes); `Ok(None)` if
    /// nothing happened in time. An error is the hub's own (its queues or channel failed):
    /// every connection has been failed with it.
    pub fn next_event(&mut self, timeout: Option<Duration>) -> Result<Option<RawHubEvent>> {
        // A timeout too long to add to the clock is no deadline at all.
        // A call from the application begins a turn (the clock is read only if it is needed).
        self.clock.new_turn();
        let deadline = timeout.and_then(|t| self.clock.now().checked_add(t));
        loop {
            if let Some(ev) = self.events.pop_front() {
                if let RawHubEvent::Resumed { peer } = &ev {
                    self.resumed_taken(*peer);
                }
                return Ok(Some(ev));
            }
            self.check_fatal()?;
            let left = deadline.map(|d| d.saturating_duration_since(self.clock.now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            self.wait_for_progress(left, false)?;
        }
    }

    /// Events queued for [`RawHub::try_event`].
    pub fn queued(&self) -> usize {
        self.events.len()
    }

    /// Events taken ([`RawHub::try_event`], [`RawHub::queued_event`]) since the hub was made.
    pub fn events_taken(&self) -> u64 {
        self.events_taken
    }

    /// An event already queued, after one non-blocking [`RawHub::step`].
    pub fn try_event(&mut self) -> Result<Option<RawHubEvent>> {
        if self.events.is_empty() {
            self.check_fatal()?;
            self.step()?;
        }
        Ok(self.queued_event())
    }

    /// The non-blocking step, for event loops: reads the completion channel, polls both CQs,
    /// accepts clients, moves handshakes on, looks at every readable bootstrap stream and the
    /// device's asynchronous events, fires the deadlines that passed, re-posts returned
    /// buffers and sends due grants. Events it produces are queued for [`RawHub::try_event`];
    /// returns how many are queued.
    pub fn step(&mut self) -> Result<usize> {
        self.clock.new_turn();
        self.check_fatal()?;
        self.nobody_waits();
        self.arm(false)?;
        let events = self.waiter.stats().events;
        let mut got = std::mem::take(&mut self.completions);
        let polled = self.waiter.step(&mut |key, wc| got.push((key, wc.clone())));
        self.step_wakeups += u64::from(self.waiter.stats().events != events);
        self.completions = got;
        self.handle_completions();
        if let Err(e) = polled {
            return Err(self.hub_failure(e.into()));
        }
        self.after_wake(true)?;
        // From here a dropped handle makes the descriptor readable (its buffer must be
        // re-posted and its credit returned), unless one came back meanwhile: re-post first.
        let mut asleep = self.pool.going_to_sleep();
        if !asleep {
            self.after_wake(false)?;
            asleep = self.pool.going_to_sleep();
        }
        self.stepped_asleep = asleep;
        Ok(self.events.len())
    }

    /// Tells the hub that nobody waits on its descriptor any more: see
    /// [`crate::Connection::nobody_waits`].
    pub fn nobody_waits(&mut self) {
        if std::mem::take(&mut self.stepped_asleep) {
            self.pool.awake(false);
        }
    }

    /// Longest an event loop may wait on [`AsFd`] before calling [`RawHub::step`]: the nearest
    /// deadline (a handshake's, a close's, a peer's after its goodbye), or the health check.
    pub fn next_timeout(&self) -> Option<Duration> {
        // Asked between turns: however long ago the last one was, the answer is from now.
        self.clock.new_turn();
        let now = self.clock.now();
        let nearest = self
            .nearest_deadline()
            .map(|at| at.saturating_duration_since(now));
        earliest(nearest, self.config.conn.health_check)
    }

    /// The nearest timer or liveness deadline. It may be stale (its deadline moved or went):
    /// then the hub wakes early once, and `fire_deadlines` drops it.
    pub(super) fn nearest_deadline(&self) -> Option<Instant> {
        let nearest = match (self.timers.peek(), self.liveness.deadline()) {
            (Some(Reverse((at, _))), Some(l)) => Some((*at).min(l)),
            (Some(Reverse((at, _))), None) => Some(*at),
            (None, l) => l,
        };
        match self.sessions.deadline() {
            Some(s) => Some(nearest.map_or(s, |n| n.min(s))),
            None => nearest,
        }
    }

    /// Sends `data` to `peer`, solicited (waking a receiver asleep solicited-only) or not.
    /// Waits while the peer has no credit for us (or no send slot is free), driving the hub
    /// meanwhile: whatever happens to others is queued as events.
    pub fn send(&mut self, peer: PeerId, data: &[u8], solicited: bool) -> Result<()> {
        self.send_timeout(peer, data, solicited, None).map(|_| ())
    }

    /// Sends `data` if it can go now; `Ok(false)` if `peer` has no credit or no send slot is
    /// free (nothing sent).
    pub fn try_send(&mut self, peer: PeerId, data: &[u8], solicited: bool) -> Result<bool> {
        self.send_timeout(peer, data, solicited, Some(Duration::ZERO))
    }

    /// Sends `data`, waiting at most `timeout` (`None`: as long as it takes) for `peer`'s
    /// credit and a send slot; `Ok(false)` if none came in time (nothing sent).
    pub fn send_timeout(
        &mut self,
        peer: PeerId,
        data: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        let fill = send::copy_of(data, self.max_message(peer)?)?;
        send::in_time(self.send_with(peer, solicited, timeout, fill))
    }

    /// Sends a message that `fill` writes straight into a registered send buffer of
    /// [`RawHub::max_message`] bytes, returning its length (`None`: nothing is sent, no credit
    /// spent, `Ok(false)`). Waits at most `timeout` (`None`: as long as it takes) for a credit
    /// and a send slot ([`Error::Timeout`]).
    pub fn send_with(
        &mut self,
        peer: PeerId,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<bool> {
        let slot = self.live_slot(peer)?;
        self.wait_to_send(slot, peer, timeout)?;
        let link = self
            .slot(slot)
            .established()
            .expect("wait_to_send ensured a link");
        let (max, max_inline) = (link.max_message, link.max_inline);
        let Some(payload) = self.send.fill(max, max_inline, fill)? else {
            return Ok(false);
        };
        let inline = matches!(payload, Payload::Inline(_));
        self.stats.sent += 1;
        drive::send_data(&mut self.queues(slot), solicited, inline, payload)?;
        Ok(true)
    }

    /// A handle that makes the hub's descriptor readable (and ends its blocking waits) from
    /// any thread.
    pub fn waker(&self) -> Result<Waker> {
        Ok(Waker::new(self.pool.waker().map_err(Error::WakePipe)?))
    }

    /// The largest message `peer` accepts.
    pub fn max_message(&self, peer: PeerId) -> Result<usize> {
        let slot = self.find(peer)?;
        match self.slot(slot).established() {
            Some(l) => Ok(l.max_message),
            None => Err(Error::UnknownPeer(peer)),
        }
    }

    /// Data messages `peer` may be sent right now without waiting.
    pub fn credits(&self, peer: PeerId) -> Result<u32> {
        Ok(self.slot(self.find(peer)?).core.credits().available())
    }

    /// The word every grant to `peer` carries from now on (see [`crate::Connection::set_note`]).
    pub fn set_note(&mut self, peer: PeerId, note: u32) -> Result<()> {
        let slot = self.find(peer)?;
        self.slot_mut(slot).core.set_note(note);
        Ok(())
    }

    /// The word `peer`'s latest grant carried, if one came (see [`crate::Connection::set_note`]).
    pub fn peer_note(&self, peer: PeerId) -> Option<u32> {
        let slot = self.table.find(peer)?;
        self.slot(slot).core.peer_note()
    }

    /// Whether `peer` is a session whose connection failed and which is suspended (or will
    /// be, once the connection is released: [`RawHubEvent::Suspended`] follows) rather than
    /// ended: a resumable session whose failure a network can cause, in a sound hub.
    pub fn will_resume(&self, peer: PeerId) -> bool {
        let Ok(slot) = self.find(peer) else {
            return self.fatal.is_none() && self.sessions.is_suspended(peer);
        };
        let s = self.slot(slot);
        self.fatal.is_none()
            && s.session.is_some()
            && s.announced
            && s.core.failure().is_some_and(|f| f.may_resume())
    }

    /// Why `peer` failed, if it did (until its [`RawHubEvent::Disconnected`] is taken).
    pub fn failure(&self, peer: PeerId) -> Option<Failure> {
        self.find(peer)
            .ok()
            .and_then(|s| self.slot(s).core.failure())
    }

    /// Statistics of one connection.
    pub fn conn_stats(&self, peer: PeerId) -> Option<ConnStats> {
        self.find(peer).ok().map(|s| self.slot(s).core.stats())
    }

    /// The peer's handshake.
    pub fn peer_hello(&self, peer: PeerId) -> Option<Hello> {
        self.find(peer)
            .ok()
            .and_then(|s| self.slot(s).established().map(|l| l.peer))
    }

    /// Established connections that have not failed.
    pub fn peers(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.table.slots.iter().enumerate().filter_map(|(i, s)| {
            let s = s.as_ref()?;
            (s.announced && s.core.failure().is_none()).then(|| s.id(i))
        })
    }

    /// Statistics of the hub.
    pub fn stats(&self) -> HubStats {
        let mut s = self.stats;
        s.connections = 0;
        s.handshakes = 0;
        for slot in self.table.slots.iter().flatten() {
            match slot.resources {
                Resources::Handshake(_) | Resources::CmHandshake(_) => s.handshakes += 1,
                Resources::Linked(_) if slot.announced => s.connections += 1,
                _ => {}
            }
            let c = slot.core.stats();
            s.forced_solicited += c.forced_solicited;
            s.credit_waits += c.credit_waits;
            s.credit_stalls += c.credit_stalls;
        }
        debug_assert_eq!(
            s.handshakes,
            self.handshakes.accepted() + self.handshakes.outgoing(),
            "handshakes counted as they start and end"
        );
        s.recv_buffers = self.pool.stats(0).total;
        s.registered_bytes =
            (s.recv_buffers as u64) * u64::from(self.config.conn.buf_size) + self.send_bytes;
        s.spare_buffers = self.groups.iter().map(|g| g.share.spare()).sum();
        s.recv_groups = self.groups.len() as u32;
        s.sends_outstanding = self.budget.outstanding();
        s.send_buffers_free = self.send.free.len();
        s
    }

    /// Counts of the shared receive pool's buffers.
    pub fn pool_stats(&self) -> PoolStats {
        let posted = self.groups.iter().map(|g| g.srq.recv_outstanding()).sum();
        self.pool.stats(posted)
    }

    /// Wake-up statistics of the hub's waits.
    pub fn wait_stats(&self) -> rdmsg_notify::Stats {
        self.waiter.stats()
    }

    /// Times the hub was woken by its completion channel: its own waits that slept until an
    /// event came (`wait_stats().wakeups`), and [`RawHub::step`]s that found an event (an
    /// event loop's wake-ups, or a busy sender's look every few sends). It moves once per
    /// wake-up: everything taken between two changes came with one wake-up (or none).
    #[inline]
    pub fn wakeups(&self) -> u64 {
        self.waiter.stats().wakeups + self.step_wakeups
    }

    /// Holds `peer` back (`on`) or lets it go: while held, the hub returns it no credits (not
    /// even its minimum; those owed and not yet announced go back to the pool), so it stops
    /// once it spent what it holds. For a consumer that leaves `peer`'s messages unread in
    /// their receive buffers until it takes more of them (rdmsg's hub while a call waits,
    /// `SessionConfig::max_held_bytes`): the buffers it keeps are lent out of the shared
    /// pool, and each credit returned meanwhile would let `peer` take one more from the
    /// other peers, up to `max_shared_credits`, after which nobody gets a credit back. Let go,
    /// it gets buffers and its grant as soon as the pool has them. Its grant slots are kept
    /// backed either way. Nothing for a peer unknown, gone or not yet admitted.
    pub fn hold_back(&mut self, peer: PeerId, on: bool) {
        let Ok(slot) = self.find(peer) else {
            return;
        };
        let s = self.slot(slot);
        let Some(group) = s.group.filter(|_| s.admitted) else {
            return;
        };
        self.groups[group]
            .share
            .hold(slot, on, &mut self.table.slots, &mut self.touched);
        if !on {
            // Buffers free and not yet posted go to it (a failed post is the hub's failure,
            // which its next call reports).
            let _ = self.repost();
        }
        // Owed credits withdrawn went to others, or spare went to this one: their grants.
        self.grants();
    }

    /// Whether `peer` is held back ([`RawHub::hold_back`]).
    pub fn is_held_back(&self, peer: PeerId) -> bool {
        let Ok(slot) = self.find(peer) else {
            return false;
        };
        let s = self.slot(slot);
        s.group
            .filter(|_| s.admitted)
            .is_some_and(|g| self.groups[g].share.is_held(slot))
    }

    /// The credits the hub lets `peer` hold at most now (its quota in the shared pool).
    pub fn quota(&self, peer: PeerId) -> Option<u32> {
        let slot = self.find(peer).ok()?;
        let group = self.slot(slot).group?;
        self.groups[group].share.quota(slot)
    }

    /// Test hook: cuts the bootstrap stream of `peer`'s connection, as a network that lost
    /// it would: both sides then see the peer vanish, while the queue pairs still work.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn sever_bootstrap(&self, peer: PeerId) {
        let Ok(slot) = self.find(peer) else {
            return;
        };
        if let Some(l) = self.slot(slot).established() {
            if let crate::control::Control::Tcp(s) = &l.control {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    fn watch(&self) -> &ReadyWatch {
        &self.waiter.channel().watch
    }

    fn check_fatal(&self) -> Result<()> {
        match self.fatal {
            Some(f) => Err(f.into()),
            None => Ok(()),
        }
    }
}
