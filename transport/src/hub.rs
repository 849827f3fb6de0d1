//! Many connections served by one thread: one completion channel, one receive and one send CQ,
//! one shared receive queue, one pool of send buffers and one epoll set.
//!
//! # Data path
//!
//! Every connection's queue pair receives through the hub's shared receive queue (SRQ) and
//! completes on the hub's two CQs, both on one completion channel; the receive CQ is armed
//! solicited-only, so one thread sleeps in `epoll_wait` until a solicited message from *any*
//! peer (or an error, a client, a bootstrap stream, a returned buffer) wakes it, and then
//! drains everything that arrived from every peer in one pass. A completion names its queue
//! pair; the hub maps that number to the connection and hands the completion to that
//! connection's [`Protocol`](crate::protocol) (the same pure rules a single
//! [`Connection`](crate::Connection) runs: credits, receive rules, the first failure).
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
//! [`HubEvent::Disconnected`] reported. The others carry on.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmsg_notify::{ArmMode, CqKey, EventChannel, EventTarget, Readiness, Waiter};
use rdmsg_verbs::{
    Access, AsyncElement, Buffer, CompletionChannel, CompletionQueue, Exposed, QpCaps, QueuePair,
    ReadSegment, ReadyWatch, SendRequest, SharedReceiveQueue, WorkCompletion,
};

use crate::addr::QpAddress;
use crate::bootstrap::{
    accept_next, bootstrap_err, nonce, our_hello, AfterHandshake, LocalSide, Pending,
};
use crate::connection::{errno_of, keepalive_probes, random_psn, Config, ConnStats};
use crate::credits::{Credits, Imm};
use crate::endpoint::Endpoint;
use crate::events::{self, Mailbox};
use crate::handshake::{Handshake, Hello, GOODBYE};
use crate::inbound::{Completion, RecvAction};
use crate::pool::{PoolStats, Received, RecvPool};
use crate::protocol::{Outgoing, Protocol};
use crate::read::{self, ReadDone, ReadPost};
use crate::share::{AdmitError, CreditHolder, Receipt, Share, ShareConfig};
use crate::{Error, Failure, Result};

/// How a [`Hub`] is set up.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Settings of each connection: `buf_size` is the size of the shared receive buffers (the
    /// largest message a peer may send us) and of the send buffers; `grant_slots`,
    /// `send_depth` (per queue pair), `signal_every`, `max_inline`, `path`, `keepalive`,
    /// `psk`, the handshake's limits and timeouts, `close_timeout` and `health_check` apply
    /// as for a single connection. `recv_depth` is not used: see `min_credits` and
    /// `max_credits`. Default: [`Config::default`] with 2 KiB buffers and 16 send slots per
    /// queue pair.
    pub conn: Config,
    /// Credits every connection keeps however idle it is (its initial credits). With the
    /// default 2 KiB buffers and 3 grant slots an idle connection holds 14 KiB. Default 4.
    pub min_credits: u32,
    /// Most credits one connection may hold (announced as its receive depth). Default 64.
    pub max_credits: u32,
    /// Most connections at once (accepted, connected and in handshake). The receive CQ and the
    /// SRQ are sized for this many connections at their minimum plus `shared_credits`, which
    /// must fit the device's `max_cqe` and `max_srq_wr`. Default 1024.
    pub max_connections: u32,
    /// Receive buffers kept spare beyond every connection's minimum, lent to busy
    /// connections at once (the pool grows as connections are admitted to keep them).
    /// Default 256.
    pub shared_credits: u32,
    /// Most receive buffers beyond every connection's minimum: while busy peers run out of
    /// credits with nothing spare, the pool grows towards this, so that memory follows the
    /// traffic (an idle hub holds `shared_credits`). Registered buffers stay registered (a
    /// shared receive queue cannot give posted buffers back) until the hub is dropped; what
    /// idle peers no longer use serves others. At least `shared_credits`. Default 8192.
    pub max_shared_credits: u32,
    /// Send buffers shared by every connection (messages up to `max_inline` need none).
    /// Default 256.
    pub send_buffers: u32,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            conn: Config {
                buf_size: 2048,
                send_depth: 16,
                ..Config::default()
            },
            min_credits: 4,
            max_credits: 64,
            max_connections: 1024,
            shared_credits: 256,
            max_shared_credits: 8192,
            send_buffers: 256,
        }
    }
}

impl HubConfig {
    /// Buffers reserved per connection: its minimum credits and its grant slots.
    fn per_connection(&self) -> u32 {
        self.min_credits + u32::from(self.conn.grant_slots)
    }

    /// Requests the SRQ (and so the receive CQ) must hold at most.
    fn srq_size(&self) -> u64 {
        // Room for the growth on demand and for the spare kept at admission, both at once.
        u64::from(self.max_connections) * u64::from(self.per_connection())
            + u64::from(self.max_shared_credits)
            + u64::from(self.shared_credits)
    }

    fn check(&self, endpoint: &Endpoint) -> Result<()> {
        self.conn.check()?;
        let bad = |what: String| Err(Error::Config(what));
        if self.min_credits == 0 || self.min_credits > self.max_credits {
            return bad("min_credits must be between 1 and max_credits".into());
        }
        if self.max_credits > u32::from(u16::MAX) {
            return bad("max_credits must be at most 65535".into());
        }
        if self.max_connections == 0 || self.max_connections > MAX_SLOTS {
            return bad(format!("max_connections must be between 1 and {MAX_SLOTS}"));
        }
        if self.max_shared_credits < self.shared_credits {
            return bad("max_shared_credits must be at least shared_credits".into());
        }
        if self.send_buffers == 0 {
            return bad("send_buffers must be at least 1".into());
        }
        let dev = endpoint.context().query_device()?;
        let need = self.srq_size();
        if need > u64::from(dev.max_cqe) || need > u64::from(dev.max_srq_wr) {
            return bad(format!(
                "max_connections × (min_credits + grant_slots) + max_shared_credits + shared_credits = {need} receive \
                 buffers exceeds the device's max_cqe ({}) or max_srq_wr ({}): lower \
                 max_connections or min_credits",
                dev.max_cqe, dev.max_srq_wr
            ));
        }
        Ok(())
    }
}

/// Most connection slots of a hub (keys of the epoll set keep the slot in 32 bits).
const MAX_SLOTS: u32 = 1 << 20;

/// A connection of a [`Hub`]: small, copyable, never reused for another connection (a slot's
/// generation changes when it is).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId {
    slot: u32,
    generation: u32,
}

impl PeerId {
    /// The slot of this connection in the hub: below the number of slots the hub ever used, so
    /// usable as an index into a `Vec` of per-peer state (a later connection may reuse it).
    pub fn index(self) -> usize {
        self.slot as usize
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({}.{})", self.slot, self.generation)
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {}.{}", self.slot, self.generation)
    }
}

/// What happened in a [`Hub`].
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
    /// A message from `peer`. Its buffer is the hub's until dropped: holding many holds back
    /// that peer (and, past the spare buffers, others).
    Message {
        /// Who sent it.
        peer: PeerId,
        /// The bytes, in their receive buffer.
        msg: Received,
    },
    /// The connection ended; everything it delivered came before this, and its id is dead.
    Disconnected {
        /// The connection.
        peer: PeerId,
        /// Why ([`Failure::PeerClosed`] after a graceful close by the peer,
        /// [`Failure::Closed`] after [`Hub::close`]).
        failure: Failure,
    },
    /// An RDMA read this hub posted for `peer` ([`Hub::post_read`]) finished (or was flushed
    /// by the peer's failure: then it comes before its [`HubEvent::Disconnected`]).
    Read {
        /// Whose memory it read.
        peer: PeerId,
        /// The read.
        read: ReadDone,
    },
    /// A handshake failed: a client accepted from the listener ( `peer: None`), or one that
    /// [`Hub::connect`] started. The hub and every other connection go on.
    HandshakeFailed {
        /// The connection [`Hub::connect`] returned, if it was ours.
        peer: Option<PeerId>,
        /// Why.
        error: Error,
    },
}

/// What a hub did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Connections established now.
    pub connections: usize,
    /// Handshakes under way now.
    pub handshakes: usize,
    /// Connections accepted, ever.
    pub accepted: u64,
    /// Connections established by [`Hub::connect`], ever.
    pub connected: u64,
    /// Handshakes that failed.
    pub handshakes_failed: u64,
    /// Clients turned away at once because `max_connections` were open.
    pub refused: u64,
    /// Connections that ended.
    pub disconnected: u64,
    /// Data messages received, all connections.
    pub received: u64,
    /// Data messages sent, all connections.
    pub sent: u64,
    /// `ibv_post_srq_recv` calls.
    pub srq_posts: u64,
    /// Times the receive pool grew because busy peers ran out of credits.
    pub pool_growths: u64,
    /// Receive buffers registered (the SRQ's pool).
    pub recv_buffers: usize,
    /// Bytes registered for receive and send buffers.
    pub registered_bytes: u64,
    /// Posted receive buffers backing no connection.
    pub spare_buffers: u32,
    /// Messages the transport solicited although the sender did not ask (they spent a
    /// peer's last credit, or returned credits to a peer that may be blocked), all
    /// connections, past and present.
    pub forced_solicited: u64,
    /// Times a send waited for a credit, all connections, past and present.
    pub credit_waits: u64,
}

/// Epoll keys: the fixed descriptors, then `SLOT_KEY | slot` for each connection's stream.
const KEY_CHANNEL: u64 = 0;
const KEY_WAKE: u64 = 1;
const KEY_ASYNC: u64 = 2;
const KEY_LISTEN: u64 = 3;
const SLOT_KEY: u64 = 1 << 32;

/// Longest wait for a failed connection's sends to be flushed back.
const FLUSH_WAIT: Duration = Duration::from_millis(500);

/// The hub's completion channel, with everything else that ends its sleep, in one epoll set.
#[derive(Debug)]
struct HubChannel {
    channel: CompletionChannel,
    watch: ReadyWatch,
    /// Keys other than the channel's reported by the last waits, not yet looked at.
    ready: Vec<u64>,
    /// Registered in `watch`: kept open here.
    _wake: std::os::unix::net::UnixStream,
}

impl EventChannel<CompletionQueue> for HubChannel {
    fn next_event(&mut self, cqs: &[CompletionQueue]) -> rdmsg_notify::Result<Option<EventTarget>> {
        self.channel.next_event(cqs)
    }

    fn wait_readable(&mut self, timeout: Option<Duration>) -> rdmsg_notify::Result<Readiness> {
        let before = self.ready.len();
        if self.watch.wait_keys(timeout, &mut self.ready)? == 0 {
            return Ok(Readiness::TimedOut);
        }
        let mut channel = false;
        let mut i = before;
        while i < self.ready.len() {
            if self.ready[i] == KEY_CHANNEL {
                channel = true;
                self.ready.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(if channel {
            Readiness::Events
        } else {
            Readiness::Other
        })
    }
}

/// A hub connection's local side while its handshake runs: the queue pair (on the hub's
/// queues) and, once the peer's hello is known, the peer.
#[derive(Debug)]
struct HubSide {
    qp: QueuePair,
    psn: u32,
    peer: Option<Hello>,
}

impl LocalSide for HubSide {
    fn connect(
        &mut self,
        endpoint: &Endpoint,
        config: &Config,
        peer: &Hello,
        _send_buffers: u32,
    ) -> Result<QpAddress> {
        endpoint.connect_qp(&mut self.qp, self.psn, &peer.addr, &config.path)?;
        self.peer = Some(*peer);
        Ok(endpoint.address_of(&self.qp, self.psn))
    }
}

/// An established connection (or one whose queue pair is connected and whose handshake is
/// finishing).
#[derive(Debug)]
struct Link {
    qp: QueuePair,
    stream: TcpStream,
    peer: Hello,
    max_message: usize,
    max_inline: usize,
    sq_depth: usize,
    /// The stream is in the epoll set.
    watched: bool,
    /// The peer said goodbye (or its stream ended): it is failed as vanished if its close
    /// message has not arrived by then.
    vanish_at: Option<Instant>,
    /// Failed: when its queue pair was moved to the error state.
    draining_since: Option<Instant>,
    /// Closing: its close message is posted, and it is closed at this deadline if not
    /// delivered by then.
    closing: Option<Instant>,
}

#[derive(Debug)]
enum Phase {
    /// Handshake under way (its local side inside, once created).
    Handshake(Box<Pending<HubSide>>),
    /// Queue pair connected.
    Linked(Box<Link>),
    /// Queue pair destroyed; released once the CQs have been polled after that.
    Retired,
}

/// One slot of the hub's connection table.
#[derive(Debug)]
struct Slot {
    generation: u32,
    accepted: bool,
    /// The hub reported it [`HubEvent::Connected`].
    announced: bool,
    /// Holds buffers of the shared pool ([`Share::admit`]).
    admitted: bool,
    proto: Protocol,
    phase: Phase,
    /// Messages that arrived before the handshake finished, delivered after `Connected`.
    early: Vec<Received>,
    /// In `Hub::touched` this round.
    touched: bool,
    /// Its queue pair's number, once it has one (kept until released).
    qpn: Option<u32>,
    /// `proto` holds the real books (the peer's hello is known), not the placeholder.
    books: bool,
}

impl CreditHolder for Slot {
    fn credits(&self) -> &Credits {
        self.proto.credits()
    }
    fn credits_mut(&mut self) -> &mut Credits {
        self.proto.credits_mut()
    }
}

impl Slot {
    fn id(&self, slot: usize) -> PeerId {
        PeerId {
            slot: slot as u32,
            generation: self.generation,
        }
    }

    fn link(&self) -> Option<&Link> {
        match &self.phase {
            Phase::Linked(l) => Some(l),
            _ => None,
        }
    }

    fn link_mut(&mut self) -> Option<&mut Link> {
        match &mut self.phase {
            Phase::Linked(l) => Some(l),
            _ => None,
        }
    }

    fn qp_mut(&mut self) -> Option<&mut QueuePair> {
        match &mut self.phase {
            Phase::Linked(l) => Some(&mut l.qp),
            Phase::Handshake(p) => p.setup.as_mut().map(|s| &mut s.qp),
            Phase::Retired => None,
        }
    }
}

/// Many RC connections driven by one thread: one completion channel, one receive and one
/// send CQ, one shared receive queue and one pool of send buffers for all of them. One
/// solicited message from any peer wakes the thread, which then takes everything every peer
/// sent.
///
/// Each connection keeps its own credits, backed by buffers of the shared pool: an idle one
/// keeps `min_credits` and its grant slots, a busy one grows towards `max_credits`, and no
/// peer ever meets receiver-not-ready. A connection that fails (its peer vanished, broke the
/// credit protocol, or its queue pair broke) fails alone: everything it delivered comes
/// first, then [`HubEvent::Disconnected`]; the others carry on.
///
/// Everything goes through it: [`Hub::listen`] and [`Hub::connect`] start handshakes (none
/// blocks the others: a silent or hostile client holds a socket and a slot, never the hub),
/// [`Hub::next_event`] sleeps until something happens and returns it (a connection, a message,
/// a disconnection), [`Hub::send`] sends to one peer. [`Hub::step`] is the non-blocking
/// step, and the hub is [`AsFd`], for an application's own event loop.
pub struct Hub {
    endpoint: Endpoint,
    config: HubConfig,
    waiter: Waiter<CompletionQueue, HubChannel>,
    recv_key: CqKey,
    send_key: CqKey,
    srq: SharedReceiveQueue,
    pool: RecvPool,
    share: Share,
    send_bufs: Vec<Buffer>,
    send_bytes: u64,
    /// Sends posted and not yet retired, all queue pairs: bounded by the send CQ's size.
    sends_outstanding: usize,
    send_cq_entries: usize,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<usize>,
    next_generation: u32,
    by_qpn: HashMap<u32, usize>,
    listener: Option<TcpListener>,
    events: VecDeque<HubEvent>,
    completions: Vec<(CqKey, WorkCompletion)>,
    touched: Vec<usize>,
    /// Slots whose queue pair is in the error state, waiting to be retired.
    draining: Vec<usize>,
    /// Slots whose queue pair was destroyed, released after the next poll.
    retired: Vec<usize>,
    /// Slots with a deadline: a handshake, a goodbye waited for.
    timed: Vec<usize>,
    mailbox: Arc<Mailbox>,
    inline_scratch: Vec<u8>,
    last_tick: Instant,
    /// A failure of the whole hub (its queues or channel): every later call reports it.
    fatal: Option<Failure>,
    stats: HubStats,
    sends_since_progress: u32,
    /// The last [`Hub::step`] marked the pool asleep for an external wait.
    stepped_asleep: bool,
}

impl fmt::Debug for Hub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hub")
            .field("endpoint", &self.endpoint)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl AsFd for Hub {
    /// The hub's epoll set: readable whenever the hub has something to do. Call
    /// [`Hub::step`] (then [`Hub::try_event`]) when it is; the hub also has timers (handshake
    /// deadlines, the health check), so step at least every [`Hub::next_timeout`].
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.waiter.channel().watch.as_fd()
    }
}

impl Hub {
    /// A hub on `endpoint`'s device and port.
    pub fn new(endpoint: &Endpoint, config: HubConfig) -> Result<Self> {
        config.check(endpoint)?;
        let ctx = endpoint.context();
        let pd = endpoint.pd();
        let srq_size = config.srq_size() as u32;
        let channel = CompletionChannel::new(ctx)?;
        channel.set_nonblocking(true)?;
        let dev = ctx.query_device()?;
        let send_cq_entries = (4 * config.send_buffers).max(1024).min(dev.max_cqe.max(1));
        let recv_cq = CompletionQueue::new(ctx, srq_size, Some(&channel))?;
        let send_cq = CompletionQueue::new(ctx, send_cq_entries, Some(&channel))?;
        let srq = SharedReceiveQueue::new(pd, srq_size)?;
        let buf_size = config.conn.buf_size as usize;
        let pool = RecvPool::new(pd, config.shared_credits.max(1) as usize, buf_size)?;
        let send_bufs = pd
            .register(config.send_buffers as usize * buf_size, Access::LOCAL_WRITE)?
            .chunks(buf_size)?;
        let watch = ReadyWatch::new()?;
        watch.add_keyed(channel.as_fd(), KEY_CHANNEL)?;
        let wake = pool.wake_handle().map_err(Error::WakePipe)?;
        watch.add_keyed(wake.as_fd(), KEY_WAKE)?;
        // Shared with any connection of the device asleep on it: one of the sleepers is woken
        // and routes every event to its owner (see the `events` module).
        watch.add_keyed_exclusive(ctx.async_fd(), KEY_ASYNC)?;
        let mut waiter = Waiter::new(
            HubChannel {
                channel,
                watch,
                ready: Vec::new(),
                _wake: wake,
            },
            config.conn.policy,
        );
        let recv_key = waiter.add(recv_cq, config.conn.recv_arm);
        let send_key = waiter.add(send_cq, ArmMode::SolicitedOnly);
        let mailbox = Mailbox::new(Some(pool.waker().map_err(Error::WakePipe)?));
        // Events of the hub's CQs and SRQ; each queue pair registers itself too.
        endpoint.register_async(
            HUB_ROUTE,
            vec![
                waiter.cq(recv_key)?.as_raw() as usize,
                waiter.cq(send_key)?.as_raw() as usize,
            ],
            &mailbox,
        );
        let share = Share::new(ShareConfig {
            min_credits: config.min_credits,
            max_credits: config.max_credits,
            grant_slots: config.conn.grant_slots,
        })
        .map_err(|e| Error::Config(e.to_string()))?;
        let mut hub = Self {
            endpoint: endpoint.clone(),
            send_bytes: send_bufs.len() as u64 * buf_size as u64,
            inline_scratch: vec![0; config.conn.max_inline as usize],
            config,
            waiter,
            recv_key,
            send_key,
            srq,
            pool,
            share,
            send_bufs,
            sends_outstanding: 0,
            send_cq_entries: send_cq_entries as usize,
            slots: Vec::new(),
            free_slots: Vec::new(),
            next_generation: 1,
            by_qpn: HashMap::new(),
            listener: None,
            events: VecDeque::new(),
            completions: Vec::new(),
            touched: Vec::new(),
            draining: Vec::new(),
            retired: Vec::new(),
            timed: Vec::new(),
            mailbox,
            last_tick: Instant::now(),
            fatal: None,
            stats: HubStats::default(),
            sends_since_progress: 0,
            stepped_asleep: false,
        };
        hub.repost()?;
        Ok(hub)
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Listens for clients at `addr` (`"0.0.0.0:0"` picks a port); returns the address bound.
    /// Their handshakes run inside the hub; each established one is a
    /// [`HubEvent::Connected`] with `accepted: true`.
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
        self.watch().add_keyed(tcp.as_fd(), KEY_LISTEN)?;
        self.listener = Some(tcp);
        Ok(local)
    }

    /// Starts a connection to a [`Listener`](crate::Listener) or another hub at `addr`: the
    /// TCP connection is made here (within `handshake_timeout`), the handshake runs inside
    /// the hub. The connection is usable once [`HubEvent::Connected`] names it (sending to it
    /// before waits for that); if the handshake fails, [`HubEvent::HandshakeFailed`] does.
    ///
    /// At most a quarter of `max_pending_handshakes` of ours run at once: a server evicts the
    /// oldest of its pending handshakes beyond its own bound (32 by default), and counts ours
    /// pending until it has read our last byte, a little after we are done. Beyond that, this
    /// drives the hub until one finishes.
    pub fn connect(&mut self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<PeerId> {
        self.check_fatal()?;
        let timeout = self.config.conn.handshake_timeout;
        let most = (self.config.conn.max_pending_handshakes as usize / 4).max(1);
        while self.outgoing_handshakes() >= most {
            self.wait_for_progress(Some(timeout), false)?;
        }
        let resolved = addr
            .to_socket_addrs()
            .map_err(|source| Error::Connect {
                addr: format!("{addr:?}"),
                source,
            })?
            .next()
            .ok_or_else(|| Error::Connect {
                addr: format!("{addr:?}"),
                source: io::ErrorKind::NotFound.into(),
            })?;
        let stream =
            TcpStream::connect_timeout(&resolved, timeout).map_err(|source| Error::Connect {
                addr: format!("{addr:?}"),
                source,
            })?;
        self.connect_stream(stream)
    }

    /// The hub's configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// Starts a connection over a TCP stream already connected to a hub or listener (made by
    /// an async runtime, say): never blocks. Unlike [`Hub::connect`] it does not wait while a
    /// quarter of `max_pending_handshakes` of our own handshakes are in flight; pace by
    /// [`Hub::pending_connects`].
    pub fn connect_stream(&mut self, stream: TcpStream) -> Result<PeerId> {
        self.check_fatal()?;
        stream
            .set_nonblocking(true)
            .map_err(|source| Error::Bootstrap {
                stage: "making the stream non-blocking",
                source,
            })?;
        let slot = self.new_slot(false)?;
        let conn = self.config.conn.clone();
        let made = self.create_side(slot).and_then(|side| {
            let ours = self.hello(Some(self.endpoint.address_of(&side.qp, side.psn)));
            let hs = Handshake::client(ours, conn.limits(), conn.psk.clone(), nonce()?);
            Pending::new(stream, hs, Some(side), &conn)
        });
        let pending = match made {
            Ok(p) => p,
            Err(e) => {
                self.abandon(slot);
                return Err(e);
            }
        };
        self.start_handshake(slot, pending)?;
        let id = self.slot(slot).id(slot);
        // The client speaks first: its hello is written at once.
        self.advance_handshake(slot);
        Ok(id)
    }

    /// Handshakes started by [`Hub::connect`] or [`Hub::connect_stream`] and not finished.
    pub fn pending_connects(&self) -> usize {
        self.outgoing_handshakes()
    }

    /// Handshakes started by [`Hub::connect`] and not finished.
    fn outgoing_handshakes(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| !s.accepted && matches!(s.phase, Phase::Handshake(_)))
            .count()
    }

    /// The next event, waiting at most `timeout` (`None`: as long as it takes); `Ok(None)` if
    /// nothing happened in time. An error is the hub's own (its queues or channel failed):
    /// every connection has been failed with it.
    pub fn next_event(&mut self, timeout: Option<Duration>) -> Result<Option<HubEvent>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(ev) = self.events.pop_front() {
                return Ok(Some(ev));
            }
            self.check_fatal()?;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            self.sleep(left)?;
        }
    }

    /// An event already queued, after one non-blocking [`Hub::step`].
    pub fn try_event(&mut self) -> Result<Option<HubEvent>> {
        if self.events.is_empty() {
            self.check_fatal()?;
            self.step()?;
        }
        Ok(self.events.pop_front())
    }

    /// The non-blocking step, for event loops: reads the completion channel, polls both CQs,
    /// accepts clients, moves handshakes on, looks at every readable bootstrap stream and the
    /// device's asynchronous events, re-posts returned buffers and sends due grants. Events
    /// it produces are queued for [`Hub::try_event`]; returns how many are queued.
    pub fn step(&mut self) -> Result<usize> {
        self.check_fatal()?;
        self.resume();
        let mut got = std::mem::take(&mut self.completions);
        let polled = self.waiter.step(&mut |key, wc| got.push((key, wc.clone())));
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
    /// [`crate::Connection::resume`].
    pub fn resume(&mut self) {
        if std::mem::take(&mut self.stepped_asleep) {
            self.pool.awake(false);
        }
    }

    /// Longest an event loop may wait on [`AsFd`] before calling [`Hub::step`]: the nearest
    /// handshake or goodbye deadline, or the health check.
    pub fn next_timeout(&self) -> Option<Duration> {
        let now = Instant::now();
        let nearest = self
            .timed
            .iter()
            .filter_map(|&s| self.deadline_of(s))
            .min()
            .map(|d| d.saturating_duration_since(now));
        match (nearest, self.config.conn.health_check) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
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
        let max = self.max_message(peer)?;
        if data.len() > max {
            return Err(Error::TooLarge {
                len: data.len(),
                max,
            });
        }
        match self.send_with(peer, solicited, timeout, |buf| {
            buf[..data.len()].copy_from_slice(data);
            Some(data.len())
        }) {
            Err(Error::Timeout(_)) => Ok(false),
            other => other,
        }
    }

    /// Sends a message that `fill` writes straight into a registered send buffer of
    /// [`Hub::max_message`] bytes, returning its length (`None`: nothing is sent, no credit
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
        let mut buf = self.send_bufs.pop().expect("wait_to_send ensured a buffer");
        let (max, max_inline) = {
            let link = self.slot(slot).link().expect("wait_to_send ensured a link");
            (link.max_message, link.max_inline)
        };
        let len = match fill(&mut buf.as_mut_slice()[..max]) {
            Some(len) if len <= max => len,
            other => {
                self.send_bufs.push(buf);
                return match other {
                    None => Ok(false),
                    Some(len) => Err(Error::TooLarge { len, max }),
                };
            }
        };
        let out = self
            .slot_mut(slot)
            .proto
            .data(solicited, 0)
            .expect("wait_to_send ensured a credit");
        self.stats.sent += 1;
        if len <= max_inline {
            self.slot_mut(slot).proto.stats_mut().sent_inline += 1;
            let mut scratch = std::mem::take(&mut self.inline_scratch);
            scratch[..len].copy_from_slice(&buf.as_slice()[..len]);
            self.send_bufs.push(buf);
            let res = self.post(slot, SendRequest::inline(&scratch[..len]), out);
            self.inline_scratch = scratch;
            res?;
        } else {
            self.post(slot, SendRequest::buffer(buf, len), out)?;
        }
        Ok(true)
    }

    /// A handle that makes the hub's descriptor readable (and ends its blocking waits) from
    /// any thread.
    pub fn waker(&self) -> Result<crate::Waker> {
        Ok(crate::Waker::new(
            self.pool.waker().map_err(Error::WakePipe)?,
        ))
    }

    /// Exposes `bytes` to RDMA reads by peers under a key of their own (see
    /// [`Endpoint::expose`]); a rendezvous sender tells only the peer it sends to.
    pub fn expose(&self, bytes: rdmsg_verbs::Bytes) -> Result<Exposed> {
        self.endpoint.expose(bytes)
    }

    /// Registers `len` bytes that reads may land in (see [`Endpoint::register`]).
    pub fn register(&self, len: usize) -> Result<Buffer> {
        self.endpoint.register(len)
    }

    /// Posts RDMA reads of `peer`'s memory into `into` (see
    /// [`crate::Connection::post_read`]); [`ReadPost::Busy`] if its send queue (or the
    /// hub's send completion queue) has no room for them now. The end of the read is a
    /// [`HubEvent::Read`]. A bad key or address fails that peer alone.
    pub fn post_read(
        &mut self,
        peer: PeerId,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> Result<ReadPost> {
        let slot = self.live_slot(peer)?;
        let need = segments.len();
        if let Some(depth) = self.slot(slot).link().map(|l| l.sq_depth) {
            if need > depth {
                return Err(Error::Config(format!(
                    "a read of {need} segments needs more than the {depth} send queue slots"
                )));
            }
        }
        let room = |hub: &Self| {
            let s = hub.slot(slot);
            s.link()
                .is_some_and(|l| l.qp.send_outstanding() + need <= l.sq_depth)
                && hub.sends_outstanding + need <= hub.send_cq_entries
        };
        if !room(self) {
            self.step()?;
            self.live_slot(peer)?;
            if !room(self) {
                return Ok(ReadPost::Busy(into));
            }
        }
        let s = self.slots[slot].as_mut().expect("a live slot");
        let link = match &mut s.phase {
            Phase::Linked(l) => l,
            _ => return Ok(ReadPost::Busy(into)),
        };
        match link.qp.post_read(into, segments) {
            Ok(id) => {
                s.proto.posted(id, true);
                self.sends_outstanding += need;
                Ok(ReadPost::Posted(id))
            }
            Err(e)
                if e.posted == 0 && matches!(e.error, rdmsg_verbs::Error::InvalidArgument(_)) =>
            {
                Err(e.error.into())
            }
            Err(e) => {
                self.sends_outstanding += e.posted;
                let err: Error = e.error.into();
                let errno = errno_of(&err);
                self.fail(
                    slot,
                    Failure::Local {
                        op: "posting a read (ibv_post_send)",
                        errno,
                    },
                );
                Err(err)
            }
        }
    }

    /// Closes `peer` gracefully and waits until it is closed: see [`Hub::start_close`]. Waits
    /// (driving the hub) until the close message is delivered, at most `close_timeout`
    /// ([`Error::Timeout`]).
    pub fn close(&mut self, peer: PeerId) -> Result<()> {
        self.start_close(peer)?;
        let timeout = self.config.conn.close_timeout;
        let deadline = Instant::now() + timeout;
        loop {
            // Released already: its `Disconnected` event, queued, says how it ended.
            let Ok(slot) = self.find(peer) else {
                return Ok(());
            };
            match self.slot(slot).proto.failure() {
                Some(Failure::Closed) => return Ok(()),
                Some(f) => return Err(f.into()),
                None => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            self.wait_for_progress(Some(left), true)?;
        }
    }

    /// Starts closing `peer` gracefully: a close message after everything sent so far (once
    /// a credit is there: waits for one, driving the hub, at most `close_timeout`); nothing
    /// more may be sent to it. Once the message is delivered the hub says goodbye on the
    /// bootstrap stream and reports [`HubEvent::Disconnected`] with [`Failure::Closed`]; the
    /// peer receives everything, then [`Failure::PeerClosed`]. If it is not delivered within
    /// `close_timeout`, the connection is failed with [`Failure::Closed`] all the same. Keep
    /// driving the hub until then: dropping it first fails the peer as vanished.
    pub fn start_close(&mut self, peer: PeerId) -> Result<()> {
        let slot = self.live_slot(peer)?;
        let timeout = self.config.conn.close_timeout;
        self.wait_to_send(slot, peer, Some(timeout))?;
        let out = self
            .slot_mut(slot)
            .proto
            .data(true, Imm::CLOSE)
            .expect("wait_to_send ensured a credit");
        self.slot_mut(slot).proto.force_signal();
        self.post(slot, SendRequest::empty(), out)?;
        if let Some(link) = self.slot_mut(slot).link_mut() {
            link.closing = Some(Instant::now() + timeout);
        }
        self.timed.push(slot);
        Ok(())
    }

    /// The close message of a closing connection was delivered: goodbye, and closed.
    fn finish_close(&mut self, slot: usize) {
        if let Some(link) = self.slot_mut(slot).link_mut() {
            let _ = (&link.stream).write_all(&[GOODBYE]);
        }
        self.fail(slot, Failure::Closed);
    }

    /// The largest message `peer` accepts.
    pub fn max_message(&self, peer: PeerId) -> Result<usize> {
        let slot = self.find(peer)?;
        match &self.slot(slot).phase {
            Phase::Linked(l) => Ok(l.max_message),
            _ => Err(Error::UnknownPeer(peer)),
        }
    }

    /// Data messages `peer` may be sent right now without waiting.
    pub fn credits(&self, peer: PeerId) -> Result<u32> {
        Ok(self.slot(self.find(peer)?).proto.credits().available())
    }

    /// Why `peer` failed, if it did (until its [`HubEvent::Disconnected`] is taken).
    pub fn failure(&self, peer: PeerId) -> Option<Failure> {
        self.find(peer)
            .ok()
            .and_then(|s| self.slot(s).proto.failure())
    }

    /// Statistics of one connection.
    pub fn conn_stats(&self, peer: PeerId) -> Option<ConnStats> {
        self.find(peer).ok().map(|s| self.slot(s).proto.stats())
    }

    /// The peer's handshake.
    pub fn peer_hello(&self, peer: PeerId) -> Option<Hello> {
        self.find(peer)
            .ok()
            .and_then(|s| self.slot(s).link().map(|l| l.peer))
    }

    /// Established connections that have not failed.
    pub fn peers(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            let s = s.as_ref()?;
            (s.announced && s.proto.failure().is_none()).then(|| s.id(i))
        })
    }

    /// Statistics of the hub.
    pub fn stats(&self) -> HubStats {
        let mut s = self.stats;
        s.connections = 0;
        s.handshakes = 0;
        for slot in self.slots.iter().flatten() {
            match slot.phase {
                Phase::Handshake(_) => s.handshakes += 1,
                Phase::Linked(_) if slot.announced => s.connections += 1,
                _ => {}
            }
        }
        for slot in self.slots.iter().flatten() {
            let c = slot.proto.stats();
            s.forced_solicited += c.forced_solicited;
            s.credit_waits += c.credit_waits;
        }
        s.recv_buffers = self.pool.stats(0).total;
        s.registered_bytes =
            (s.recv_buffers as u64) * u64::from(self.config.conn.buf_size) + self.send_bytes;
        s.spare_buffers = self.share.spare();
        s
    }

    /// Counts of the shared receive pool's buffers.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats(self.srq.recv_outstanding())
    }

    /// Wake-up statistics of the hub's waits.
    pub fn wait_stats(&self) -> rdmsg_notify::Stats {
        self.waiter.stats()
    }

    /// The credits the hub lets `peer` hold at most now (its quota in the shared pool).
    pub fn quota(&self, peer: PeerId) -> Option<u32> {
        self.find(peer).ok().and_then(|s| self.share.quota(s))
    }

    // ----- slots -----

    fn watch(&self) -> &ReadyWatch {
        &self.waiter.channel().watch
    }

    fn slot(&self, i: usize) -> &Slot {
        self.slots[i].as_ref().expect("a live slot")
    }

    fn slot_mut(&mut self, i: usize) -> &mut Slot {
        self.slots[i].as_mut().expect("a live slot")
    }

    fn find(&self, peer: PeerId) -> Result<usize> {
        let i = peer.slot as usize;
        match self.slots.get(i).and_then(Option::as_ref) {
            Some(s) if s.generation == peer.generation => Ok(i),
            _ => Err(Error::UnknownPeer(peer)),
        }
    }

    /// The slot of a connection that may be sent to (established or finishing its
    /// handshake), or its failure.
    fn live_slot(&self, peer: PeerId) -> Result<usize> {
        self.check_fatal()?;
        let i = self.find(peer)?;
        let s = self.slot(i);
        match s.proto.failure() {
            Some(f) => Err(f.into()),
            None if s.link().is_some_and(|l| l.closing.is_some()) => Err(Failure::Closed.into()),
            None => Ok(i),
        }
    }

    fn new_slot(&mut self, accepted: bool) -> Result<usize> {
        let used = self.slots.len() - self.free_slots.len();
        if used >= self.config.max_connections as usize {
            return Err(Error::Config(format!(
                "the hub has max_connections ({}) connections",
                self.config.max_connections
            )));
        }
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        let slot = Slot {
            generation,
            accepted,
            announced: false,
            admitted: false,
            proto: Protocol::new(self.placeholder_credits(), self.config.conn.signal_every),
            phase: Phase::Retired,
            early: Vec::new(),
            touched: false,
            qpn: None,
            books: false,
        };
        let i = match self.free_slots.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[i] = Some(slot);
        Ok(i)
    }

    /// Books of a connection whose peer is not known yet: the peer holds the minimum.
    fn placeholder_credits(&self) -> Credits {
        let c = &self.config;
        Credits::shared(c.max_credits, c.conn.grant_slots, 0, 3, 0, c.min_credits)
    }

    /// What this hub announces.
    fn hello(&self, addr: Option<QpAddress>) -> Hello {
        let mut h = our_hello(&self.endpoint, &self.config.conn, addr);
        h.recv_depth = self.config.max_credits;
        h.initial_credits = self.config.min_credits;
        h
    }

    /// Creates the queue pair of slot `slot` on the hub's queues, with its share of the
    /// receive buffers set aside (the pool grows if it must).
    fn create_side(&mut self, slot: usize) -> Result<HubSide> {
        self.admit(slot)?;
        let caps = QpCaps {
            max_send_wr: self.config.conn.send_depth,
            max_recv_wr: 0,
            max_inline_data: self.config.conn.max_inline,
        };
        let made = (|| {
            let mut qp = QueuePair::new_rc_with_srq(
                self.endpoint.pd(),
                self.waiter.cq(self.send_key)?,
                self.waiter.cq(self.recv_key)?,
                &self.srq,
                caps,
            )?;
            qp.to_init(self.endpoint.port())?;
            Ok::<_, Error>(qp)
        })();
        let qp = match made {
            Ok(qp) => qp,
            Err(e) => {
                // Nothing can have been consumed: no queue pair.
                self.unadmit(slot);
                return Err(e);
            }
        };
        self.by_qpn.insert(qp.qp_num(), slot);
        self.slot_mut(slot).qpn = Some(qp.qp_num());
        self.endpoint
            .register_async(qp.qp_num(), Vec::new(), &self.mailbox);
        Ok(HubSide {
            psn: random_psn(qp.qp_num()),
            qp,
            peer: None,
        })
    }

    /// Sets aside a new connection's minimum share, growing the pool so that
    /// `shared_credits` buffers stay spare for busy peers beyond everyone's minimum (as far as
    /// the SRQ's size allows).
    fn admit(&mut self, slot: usize) -> Result<()> {
        let cost = self.share.admission_cost();
        let room = u64::from(self.srq.max_wr())
            .saturating_sub(self.pool.stats(0).total as u64)
            .min(u64::from(u32::MAX)) as u32;
        let short = (cost + self.config.shared_credits).saturating_sub(self.share.spare());
        let admitted_now = short == 0 || room == 0;
        let admitted_now = admitted_now && self.share.admit(slot).is_ok();
        if !admitted_now {
            // Grow by a batch (a 64th of the room left), at least what is short.
            let grow = short.max(room / 64).min(room);
            if grow + self.share.spare() < cost {
                return Err(Error::Config(format!(
                    "the shared receive queue is full ({} buffers)",
                    self.srq.max_wr()
                )));
            }
            self.pool.grow(self.endpoint.pd(), grow as usize)?;
            // Admitted before the connections waiting take the new buffers.
            self.pool.collect_returns();
            let bufs = self.pool.take_free();
            let n = bufs.len();
            if let Err(e) = self.srq.post_recv(bufs) {
                for b in e.unposted {
                    self.pool.put_back(b);
                }
                let posted = e.posted as u32;
                self.share
                    .on_posted(posted, &mut self.slots, &mut self.touched);
                return Err(self.hub_failure(e.error.into()));
            }
            self.stats.srq_posts += 1;
            match self
                .share
                .admit_posted(slot, n as u32, &mut self.slots, &mut self.touched)
            {
                Ok(()) => {}
                Err(AdmitError::NoRoom { spare, cost }) => {
                    return Err(Error::Config(format!(
                        "no room for another connection: {spare} spare receive buffers, \
                         {cost} needed"
                    )))
                }
                Err(e) => return Err(Error::Config(e.to_string())),
            }
        }
        self.slot_mut(slot).admitted = true;
        Ok(())
    }

    /// Gives a connection's share of the buffers back (its queue pair can consume nothing
    /// more, and everything it did consume has been polled).
    fn unadmit(&mut self, slot: usize) {
        let s = self.slots[slot].as_mut().expect("a live slot");
        if std::mem::take(&mut s.admitted) {
            self.share.release(slot, &mut self.slots, &mut self.touched);
        }
    }

    fn start_handshake(&mut self, slot: usize, pending: Pending<HubSide>) -> Result<()> {
        if let Err(e) = self
            .watch()
            .add_keyed(pending.stream.as_fd(), SLOT_KEY | slot as u64)
        {
            self.abandon(slot);
            return Err(e.into());
        }
        self.slot_mut(slot).phase = Phase::Handshake(Box::new(pending));
        self.timed.push(slot);
        Ok(())
    }

    /// Frees a slot that never got a queue pair to drain.
    fn abandon(&mut self, slot: usize) {
        self.unadmit(slot);
        self.slots[slot] = None;
        self.free_slots.push(slot);
    }

    // ----- waiting -----

    /// Sleeps until something happens (at most `timeout`), then handles it.
    fn sleep(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.wait_for_progress(timeout, false)
    }

    fn wait_for_progress(&mut self, timeout: Option<Duration>, blocked: bool) -> Result<()> {
        if !self.pool.going_to_sleep() {
            self.after_wake(true)?;
            return Ok(());
        }
        // A blocked sender must hear of any grant and any send completion.
        let (recv_mode, send_mode) = if blocked {
            (ArmMode::Next, ArmMode::Next)
        } else {
            (self.config.conn.recv_arm, self.send_arm())
        };
        self.set_modes(recv_mode, send_mode)?;
        let limit = [self.next_timeout(), timeout].into_iter().flatten().min();
        let mut got = std::mem::take(&mut self.completions);
        let res = self
            .waiter
            .wait(limit, &mut |key, wc| got.push((key, wc.clone())));
        self.pool.awake(!matches!(res, Ok(n) if n > 0));
        self.completions = got;
        self.handle_completions();
        let n = match res {
            Ok(n) => n,
            Err(e) => return Err(self.hub_failure(e.into())),
        };
        self.after_wake(n == 0)
    }

    fn set_modes(&mut self, recv: ArmMode, send: ArmMode) -> Result<()> {
        for (key, mode) in [(self.recv_key, recv), (self.send_key, send)] {
            if self.waiter.mode(key)? != mode {
                self.waiter.set_mode(key, mode)?;
            }
        }
        Ok(())
    }

    /// The send CQ is armed for any completion while a signaled send is outstanding on any
    /// queue pair (see [`Protocol::send_arm`]): counted, not searched.
    fn send_arm(&self) -> ArmMode {
        if self.sends_outstanding > 0 {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        }
    }

    /// Everything but completions: the descriptors that were readable, timers, drained
    /// connections, returned buffers, grants.
    fn after_wake(&mut self, look_everywhere: bool) -> Result<()> {
        let mut ready = std::mem::take(&mut self.waiter.channel_mut().ready);
        if look_everywhere {
            // A non-blocking step, or a wake-up for something else: look at what is ready now.
            let _ = self
                .waiter
                .channel()
                .watch
                .wait_keys(Some(Duration::ZERO), &mut ready);
        }
        ready.sort_unstable();
        ready.dedup();
        // Streams before the listener: a handshake whose next bytes are here is not evicted to
        // make room for a newcomer.
        let mut listen = false;
        for key in ready.drain(..) {
            match key {
                KEY_CHANNEL => {}
                KEY_WAKE => {
                    // A dropped handle, or an asynchronous event routed to our mailbox (the
                    // last-WQE events of closing queue pairs on 6.12, say): drain the socket,
                    // or an event loop waiting on the hub would find it readable for ever.
                    self.pool.awake(true);
                    self.async_events();
                }
                KEY_ASYNC => self.async_events(),
                KEY_LISTEN => listen = true,
                k if k & SLOT_KEY != 0 => self.stream_ready((k & !SLOT_KEY) as usize),
                _ => {}
            }
        }
        if listen {
            self.accept_all();
        }
        self.waiter.channel_mut().ready = ready;
        self.timers();
        self.retire_drained()?;
        self.grow_for_demand()?;
        self.repost()?;
        self.grants();
        if self.last_tick.elapsed() >= Duration::from_secs(1) {
            self.last_tick = Instant::now();
            self.share.tick(&mut self.slots, &mut self.touched);
        }
        Ok(())
    }

    // ----- completions -----

    fn handle_completions(&mut self) {
        let mut got = std::mem::take(&mut self.completions);
        let recv_key = self.recv_key;
        // The first real error of each connection is recorded before its flushes are looked at.
        for (key, wc) in &got {
            let c = Completion::of(*key == recv_key, wc);
            if matches!(
                c.status,
                rdmsg_verbs::WcStatus::Success | rdmsg_verbs::WcStatus::WrFlushErr
            ) {
                continue;
            }
            if let Some(&slot) = self.by_qpn.get(&wc.qp_num()) {
                if self.slot_mut(slot).proto.begin_batch([c]) {
                    self.after_first_failure(slot);
                }
            }
        }
        for (key, wc) in got.drain(..) {
            if key == recv_key {
                self.on_recv(&wc);
            } else {
                self.on_send(&wc);
            }
        }
        self.completions = got;
    }

    fn on_recv(&mut self, wc: &WorkCompletion) {
        let Some(buf) = self.srq.take_recv(wc) else {
            return;
        };
        let Some(&slot) = self.by_qpn.get(&wc.qp_num()) else {
            // A queue pair already released: nothing of it is accounted any more.
            self.share.on_stray();
            self.pool.put_back(buf);
            return;
        };
        let c = Completion::of(true, wc);
        let s = self.slots[slot].as_mut().expect("a mapped slot");
        let before = s.proto.credits().must_be_posted();
        // SRQ receives are not flushed by a queue pair's error: nothing to explain.
        let (action, first) = s.proto.on_recv(&c, || None);
        let accounted = s.proto.credits().must_be_posted() < before;
        let receipt = match action {
            RecvAction::Grant => Receipt::Grant,
            // A close message spends a data credit too.
            RecvAction::Deliver | RecvAction::Recycle if accounted => Receipt::Data,
            _ => Receipt::Unaccounted,
        };
        if s.admitted {
            self.share.on_consumed(slot, s, receipt, &mut self.touched);
        } else {
            self.share.on_stray();
        }
        match action {
            RecvAction::Deliver => {
                self.stats.received += 1;
                let len = wc.byte_len() as usize;
                let msg = self.pool.lend(buf, len);
                let s = self.slots[slot].as_mut().expect("a mapped slot");
                if s.announced {
                    let peer = s.id(slot);
                    self.events.push_back(HubEvent::Message { peer, msg });
                } else {
                    s.early.push(msg);
                }
            }
            RecvAction::Grant | RecvAction::Recycle => self.pool.put_back(buf),
        }
        self.touch(slot);
        if first {
            self.after_first_failure(slot);
        }
    }

    fn on_send(&mut self, wc: &WorkCompletion) {
        let Some(&slot) = self.by_qpn.get(&wc.qp_num()) else {
            return;
        };
        let s = self.slots[slot].as_mut().expect("a mapped slot");
        let Some(qp) = s.qp_mut() else { return };
        let before = qp.send_outstanding();
        let mut reads = Vec::new();
        qp.complete_send_split(wc, &mut self.send_bufs, &mut reads);
        let retired = before - qp.send_outstanding();
        self.sends_outstanding -= retired;
        if !reads.is_empty() {
            let peer = s.id(slot);
            self.events
                .extend(read::finished(wc, reads).map(|read| HubEvent::Read { peer, read }));
        }
        let c = Completion::of(false, wc);
        if s.proto.on_send(&c, wc.wr_id()) {
            self.after_first_failure(slot);
        } else if s.proto.failure().is_none()
            && s.link()
                .is_some_and(|l| l.closing.is_some() && l.qp.send_outstanding() == 0)
        {
            self.finish_close(slot);
        }
        self.touch(slot);
    }

    fn touch(&mut self, slot: usize) {
        let s = self.slots[slot].as_mut().expect("a live slot");
        if !std::mem::replace(&mut s.touched, true) {
            self.touched.push(slot);
        }
    }

    // ----- buffers and grants -----

    /// Busy peers ran out of credits with nothing spare: registers more buffers (in chunks of
    /// at least 64), up to `max_shared_credits` beyond everyone's minimum; `repost` posts them.
    fn grow_for_demand(&mut self) -> Result<()> {
        let demand = self.share.take_demand();
        if demand == 0 {
            return Ok(());
        }
        let admitted = self.slots.iter().flatten().filter(|s| s.admitted).count() as u64;
        let minimums = admitted * u64::from(self.share.admission_cost());
        let limit = (minimums + u64::from(self.config.max_shared_credits))
            .min(u64::from(self.srq.max_wr()));
        let room = limit.saturating_sub(self.pool.stats(0).total as u64);
        let grow = u64::from(demand).max(64).min(room);
        if grow > 0 {
            self.pool.grow(self.endpoint.pd(), grow as usize)?;
            self.stats.pool_growths += 1;
        }
        Ok(())
    }

    /// Posts every free receive buffer to the SRQ and lets the share hand them out.
    fn repost(&mut self) -> Result<()> {
        self.pool.collect_returns();
        let free = self.pool.free_count();
        if free == 0 {
            return Ok(());
        }
        let bufs = self.pool.take_free();
        let n = bufs.len();
        let posted = match self.srq.post_recv(bufs) {
            Ok(()) => n,
            Err(e) => {
                let posted = e.posted;
                for b in e.unposted {
                    self.pool.put_back(b);
                }
                self.share
                    .on_posted(posted as u32, &mut self.slots, &mut self.touched);
                return Err(self.hub_failure(e.error.into()));
            }
        };
        self.stats.srq_posts += 1;
        self.share
            .on_posted(posted as u32, &mut self.slots, &mut self.touched);
        Ok(())
    }

    /// Sends the grants due on connections touched this round.
    fn grants(&mut self) {
        let mut touched = std::mem::take(&mut self.touched);
        let mut keep = Vec::new();
        for slot in touched.drain(..) {
            let Some(s) = self.slots[slot].as_mut() else {
                continue;
            };
            s.touched = false;
            if s.proto.failure().is_some() {
                continue;
            }
            let Some(link) = s.link() else { continue };
            if link.qp.send_outstanding() >= link.sq_depth
                || self.sends_outstanding >= self.send_cq_entries
            {
                // No room for the grant now: a send completion will bring us back.
                keep.push(slot);
                continue;
            }
            if let Some(g) = s.proto.grant() {
                let _ = self.post(slot, SendRequest::empty(), g);
            }
        }
        for slot in keep {
            self.touch(slot);
        }
        if self.touched.is_empty() {
            self.touched = touched;
        }
    }

    fn post(&mut self, slot: usize, req: SendRequest<'_>, out: Outgoing) -> Result<()> {
        let low_bufs = self.send_bufs.is_empty();
        let near_cq_limit = self.sends_outstanding + 1 >= self.send_cq_entries;
        let s = self.slots[slot].as_mut().expect("a live slot");
        let link = match &mut s.phase {
            Phase::Linked(l) => l,
            _ => unreachable!("posting needs a link"),
        };
        let signaled = s.proto.signal_next(
            link.qp.send_outstanding() + 1 >= link.sq_depth || low_bufs || near_cq_limit,
        );
        let req = req
            .imm(out.imm.encode())
            .solicited(out.solicited)
            .signaled(signaled);
        match link.qp.post_send_one(req) {
            Ok(id) => {
                s.proto.posted(id, signaled);
                self.sends_outstanding += 1;
                Ok(())
            }
            Err(e) => {
                self.send_bufs.extend(e.unposted);
                let err: Error = e.error.into();
                let errno = errno_of(&err);
                self.fail(
                    slot,
                    Failure::Local {
                        op: "posting a send (ibv_post_send)",
                        errno,
                    },
                );
                Err(err)
            }
        }
    }

    fn can_send(&self, slot: usize) -> bool {
        let s = self.slot(slot);
        let Some(link) = s.link() else { return false };
        s.announced
            && s.proto.can_send_data()
            && link.qp.send_outstanding() < link.sq_depth
            && self.sends_outstanding < self.send_cq_entries
            && !self.send_bufs.is_empty()
    }

    fn wait_to_send(&mut self, slot: usize, peer: PeerId, timeout: Option<Duration>) -> Result<()> {
        self.sends_since_progress += 1;
        if self.sends_since_progress >= 16 || !self.can_send(slot) || self.pool.has_returns() {
            self.sends_since_progress = 0;
            self.step()?;
            self.live_slot(peer)?;
        }
        if self.can_send(slot) {
            return Ok(());
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        {
            let s = self.slot_mut(slot);
            if s.proto.credits().available() == 0 {
                s.proto.stats_mut().credit_waits += 1;
            } else {
                s.proto.stats_mut().send_slot_waits += 1;
            }
        }
        loop {
            self.live_slot(peer)?;
            if self.can_send(slot) {
                return Ok(());
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Err(Error::Timeout(timeout.unwrap_or_default()));
            }
            self.wait_for_progress(left, true)?;
        }
    }

    // ----- listener, handshakes, streams -----

    fn accept_all(&mut self) {
        loop {
            let Some(listener) = &self.listener else {
                return;
            };
            let stream = match accept_next(listener) {
                Ok(Some(s)) => s,
                Ok(None) => return,
                Err(source) => {
                    // Out of descriptors, most likely: the listener stays readable, so the next
                    // step tries again; report it once per step.
                    self.stats.handshakes_failed += 1;
                    self.events.push_back(HubEvent::HandshakeFailed {
                        peer: None,
                        error: Error::Bootstrap {
                            stage: "accepting",
                            source,
                        },
                    });
                    return;
                }
            };
            self.take_client(stream);
        }
    }

    fn take_client(&mut self, stream: TcpStream) {
        let pending_accepted = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.accepted && matches!(s.phase, Phase::Handshake(_)))
            .count();
        if pending_accepted >= self.config.conn.max_pending_handshakes as usize {
            // Evict the oldest pending client.
            let oldest = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| {
                    let s = s.as_ref()?;
                    match &s.phase {
                        Phase::Handshake(p) if s.accepted => Some((p.deadline, i)),
                        _ => None,
                    }
                })
                .min();
            if let Some((_, i)) = oldest {
                if let Phase::Handshake(p) = &self.slot(i).phase {
                    let e = p.evicted(self.config.conn.max_pending_handshakes);
                    self.handshake_failed(i, e);
                }
            }
        }
        let slot = match self.new_slot(true) {
            Ok(s) => s,
            Err(_) => {
                // Full: the client sees its stream end.
                self.stats.refused += 1;
                return;
            }
        };
        let conn = self.config.conn.clone();
        let made = nonce().and_then(|n| {
            let hs = Handshake::server(self.hello(None), conn.limits(), conn.psk.clone(), n);
            Pending::new(stream, hs, None, &conn)
        });
        match made {
            Ok(p) => {
                if self.start_handshake(slot, p).is_err() {
                    self.stats.handshakes_failed += 1;
                }
            }
            Err(error) => {
                self.abandon(slot);
                self.stats.handshakes_failed += 1;
                self.events
                    .push_back(HubEvent::HandshakeFailed { peer: None, error });
            }
        }
    }

    fn stream_ready(&mut self, slot: usize) {
        let Some(s) = self.slots.get(slot).and_then(Option::as_ref) else {
            return;
        };
        match s.phase {
            Phase::Handshake(_) => self.advance_handshake(slot),
            Phase::Linked(_) => self.check_stream(slot),
            Phase::Retired => {}
        }
    }

    fn advance_handshake(&mut self, slot: usize) {
        let Phase::Handshake(mut pending) =
            std::mem::replace(&mut self.slot_mut(slot).phase, Phase::Retired)
        else {
            return;
        };
        let endpoint = self.endpoint.clone();
        let res = {
            let mut create = |_: &Config| self.create_side(slot);
            pending.advance(&endpoint, &mut create)
        };
        // Once the peer's hello is known and the queue pair connected, the books are real
        // (the peer may send as soon as its side is in RTS).
        if let Some(peer) = pending.setup.as_ref().and_then(|side| side.peer) {
            let c = &self.config;
            let books = Credits::shared(
                c.max_credits,
                c.conn.grant_slots,
                peer.recv_depth,
                peer.grant_slots,
                peer.initial_credits,
                c.min_credits,
            );
            let signal_every = c.conn.signal_every;
            let s = self.slot_mut(slot);
            if !std::mem::replace(&mut s.books, true) {
                debug_assert_eq!(books.must_be_posted(), s.proto.credits().must_be_posted());
                s.proto = Protocol::new(books, signal_every);
            }
        }
        match res {
            Ok(false) => self.slot_mut(slot).phase = Phase::Handshake(pending),
            Ok(true) => self.establish(slot, *pending),
            Err(e) => {
                self.slot_mut(slot).phase = Phase::Handshake(pending);
                self.handshake_failed(slot, e);
            }
        }
    }

    /// The handshake of `slot` is done: the connection is announced, with what arrived early.
    fn establish(&mut self, slot: usize, pending: Pending<HubSide>) {
        let Pending {
            stream, setup, hs, ..
        } = pending;
        let side = setup.expect("a finished handshake has its queue pair");
        let peer = *hs.peer().expect("a finished handshake knows its peer");
        if let Some(limit) = self.config.conn.keepalive {
            let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive_probes(limit));
        }
        let max_inline = side
            .qp
            .caps()
            .max_inline_data
            .min(self.config.conn.max_inline) as usize;
        let sq_depth = side.qp.caps().max_send_wr.min(self.config.conn.send_depth) as usize;
        let link = Link {
            max_message: peer.buf_size.min(self.config.conn.buf_size) as usize,
            max_inline,
            sq_depth,
            qp: side.qp,
            stream,
            peer,
            watched: true,
            vanish_at: None,
            draining_since: None,
            closing: None,
        };
        let s = self.slot_mut(slot);
        s.phase = Phase::Linked(Box::new(link));
        s.announced = true;
        let id = s.id(slot);
        let accepted = s.accepted;
        let early = std::mem::take(&mut s.early);
        if accepted {
            self.stats.accepted += 1;
        } else {
            self.stats.connected += 1;
        }
        self.events
            .push_back(HubEvent::Connected { peer: id, accepted });
        for msg in early {
            self.events.push_back(HubEvent::Message { peer: id, msg });
        }
        if let Some(f) = self.slot(slot).proto.failure() {
            // Failed while finishing (its first message broke the protocol, say).
            let _ = f;
            self.after_first_failure(slot);
        }
        self.touch(slot);
    }

    fn handshake_failed(&mut self, slot: usize, error: Error) {
        self.stats.handshakes_failed += 1;
        let s = self.slot(slot);
        let peer = (!s.accepted).then(|| s.id(slot));
        self.events
            .push_back(HubEvent::HandshakeFailed { peer, error });
        let Phase::Handshake(pending) =
            std::mem::replace(&mut self.slot_mut(slot).phase, Phase::Retired)
        else {
            return;
        };
        let _ = self.watch().remove(pending.stream.as_fd());
        let _ = pending.stream.shutdown(std::net::Shutdown::Both);
        let _ = self
            .slot_mut(slot)
            .proto
            .record_failure(Failure::PeerVanished);
        match pending.setup {
            // A queue pair may have received already: destroy it, poll, then release.
            Some(side) => {
                let _ = side.qp.destroy();
                self.retired.push(slot);
            }
            None => self.abandon(slot),
        }
    }

    /// Looks at a readable bootstrap stream: after the handshake only a goodbye may come.
    fn check_stream(&mut self, slot: usize) {
        let close_timeout = self.config.conn.close_timeout;
        let Some(link) = self.slot_mut(slot).link_mut() else {
            return;
        };
        let news = AfterHandshake::read(&link.stream);
        match news {
            AfterHandshake::Nothing => return,
            AfterHandshake::Garbage(byte) => {
                self.fail(slot, Failure::BootstrapGarbage { byte });
                return;
            }
            AfterHandshake::Goodbye | AfterHandshake::Ended => {}
        }
        // Its close message may still be in flight: wait for it (not here: the hub goes on).
        // Closing ourselves, the end of the stream is the peer having taken our close message
        // (it shuts its stream at once): the close completes on its own deadline.
        if link.closing.is_none() {
            link.vanish_at = Some(Instant::now() + news.grace(close_timeout));
        }
        self.unwatch_stream(slot);
        self.timed.push(slot);
    }

    fn unwatch_stream(&mut self, slot: usize) {
        let s = self.slots[slot].as_mut().expect("a live slot");
        if let Some(link) = s.link_mut() {
            if std::mem::take(&mut link.watched) {
                let _ = self.waiter.channel().watch.remove(link.stream.as_fd());
            }
        }
    }

    fn deadline_of(&self, slot: usize) -> Option<Instant> {
        let s = self.slots.get(slot)?.as_ref()?;
        match &s.phase {
            Phase::Handshake(p) => Some(p.deadline),
            Phase::Linked(l) if s.proto.failure().is_none() => {
                [l.vanish_at, l.closing].into_iter().flatten().min()
            }
            Phase::Linked(l) => l.draining_since.map(|t| t + FLUSH_WAIT),
            Phase::Retired => None,
        }
    }

    /// Handshakes past their deadline fail; peers whose goodbye was not followed by their
    /// close message in time are vanished.
    fn timers(&mut self) {
        if self.timed.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut timed = std::mem::take(&mut self.timed);
        timed.sort_unstable();
        timed.dedup();
        timed.retain(|&slot| {
            let Some(deadline) = self.deadline_of(slot) else {
                return false;
            };
            if deadline > now {
                return true;
            }
            let s = self.slot(slot);
            let timed_out = match &s.phase {
                Phase::Handshake(p) => Some(p.timed_out()),
                _ => None,
            };
            let live = s.proto.failure().is_none();
            let closing = s
                .link()
                .is_some_and(|l| l.closing.is_some_and(|c| c <= now));
            let vanished = s
                .link()
                .is_some_and(|l| l.vanish_at.is_some_and(|v| v <= now));
            if let Some(e) = timed_out {
                self.handshake_failed(slot, e);
            } else if live && vanished {
                self.fail(slot, Failure::PeerVanished);
            } else if live && closing {
                self.fail(slot, Failure::Closed);
            }
            false
        });
        timed.append(&mut self.timed);
        self.timed = timed;
    }

    // ----- failures -----

    /// Fails one connection (the first failure is kept).
    fn fail(&mut self, slot: usize, f: Failure) {
        if self.slot_mut(slot).proto.record_failure(f) {
            self.after_first_failure(slot);
        }
    }

    /// After a connection's first failure: tells the peer (the end of the bootstrap stream),
    /// moves the queue pair to error so that its sends are flushed back, and queues it to be
    /// retired.
    fn after_first_failure(&mut self, slot: usize) {
        self.unwatch_stream(slot);
        let s = self.slot_mut(slot);
        let Some(link) = s.link_mut() else {
            // Still in its handshake: that fails it.
            if matches!(s.phase, Phase::Handshake(_)) {
                let f = s.proto.failure();
                self.handshake_failed(slot, f.map_or(Error::Config("failed".into()), Error::from));
            }
            return;
        };
        let _ = link.stream.shutdown(std::net::Shutdown::Both);
        let _ = link.qp.to_error();
        if s.admitted {
            // Its buffers stop being refilled; what backs it comes back at release.
            self.share.retire(slot);
        }
        let Some(link) = self.slot_mut(slot).link_mut() else {
            return;
        };
        if link.draining_since.is_none() {
            link.draining_since = Some(Instant::now());
            self.draining.push(slot);
            self.timed.push(slot);
        }
    }

    /// Destroys the queue pairs of failed connections once their sends came back (or the
    /// flush wait passed), taking back every send buffer; the next poll of the CQs sees
    /// anything of theirs still queued, after which they are released.
    fn retire_drained(&mut self) -> Result<()> {
        // Queue pairs destroyed since the last poll (a failed handshake's) are released after
        // the poll below, like those retired here.
        let mut destroyed = !self.retired.is_empty();
        if self.draining.is_empty() && !destroyed {
            return Ok(());
        }
        let now = Instant::now();
        let mut draining = std::mem::take(&mut self.draining);
        draining.retain(|&slot| {
            let s = self.slots[slot].as_mut().expect("a draining slot");
            let Some(link) = s.link_mut() else {
                return false;
            };
            let flushed = link.qp.send_outstanding() == 0;
            let late = link
                .draining_since
                .is_some_and(|t| now.duration_since(t) >= FLUSH_WAIT);
            if !(flushed || late) {
                return true;
            }
            let Phase::Linked(link) = std::mem::replace(&mut s.phase, Phase::Retired) else {
                unreachable!()
            };
            let before = link.qp.send_outstanding();
            match link.qp.destroy() {
                Ok(bufs) => {
                    self.sends_outstanding -= before;
                    self.send_bufs.extend(bufs);
                }
                Err(_) => {
                    // Leaked with the queue pair; its sends no longer count.
                    self.sends_outstanding -= before;
                }
            }
            destroyed = true;
            self.retired.push(slot);
            false
        });
        self.draining = draining;
        if destroyed {
            // Whatever of theirs was still queued is handled now, before they are released.
            let mut got = std::mem::take(&mut self.completions);
            let polled = self
                .waiter
                .poll_all(&mut |key, wc| got.push((key, wc.clone())));
            self.completions = got;
            self.handle_completions();
            if let Err(e) = polled {
                return Err(self.hub_failure(e.into()));
            }
            for slot in std::mem::take(&mut self.retired) {
                self.release(slot);
            }
        }
        Ok(())
    }

    /// A retired connection: its share of the buffers goes back, it is reported gone, its slot
    /// is free.
    fn release(&mut self, slot: usize) {
        let Some(s) = self.slots[slot].as_mut() else {
            return;
        };
        if let Some(qpn) = s.qpn {
            self.by_qpn.remove(&qpn);
        }
        let announced = s.announced;
        let peer = s.id(slot);
        let c = s.proto.stats();
        self.stats.forced_solicited += c.forced_solicited;
        self.stats.credit_waits += c.credit_waits;
        let failure = s.proto.failure().unwrap_or(Failure::QpError);
        self.unadmit(slot);
        if announced {
            self.stats.disconnected += 1;
            self.events
                .push_back(HubEvent::Disconnected { peer, failure });
        }
        self.slots[slot] = None;
        self.free_slots.push(slot);
    }

    /// Routes the device's asynchronous events; those of our queue pairs fail them, those of
    /// the hub's queues (or the device, or the port) fail everything.
    fn async_events(&mut self) {
        if let Err(e) = self.endpoint.route_async_events() {
            let _ = self.hub_failure(e);
            return;
        }
        for ev in self.mailbox.take() {
            if !events::is_fatal(ev.kind) {
                continue;
            }
            let f = Failure::AsyncEvent(ev.kind);
            match ev.element {
                AsyncElement::Qp(n) => {
                    if let Some(&slot) = self.by_qpn.get(&n) {
                        self.fail(slot, f);
                    }
                }
                _ => {
                    let _ = self.hub_failure(Error::Connection(f));
                }
            }
        }
    }

    /// A failure of the hub's own queues or channel: every connection fails with it.
    fn hub_failure(&mut self, e: Error) -> Error {
        let f = match &e {
            Error::Connection(f) => *f,
            other => Failure::Local {
                op: "driving the hub's queues",
                errno: errno_of(other),
            },
        };
        if self.fatal.is_none() {
            self.fatal = Some(f);
            for slot in 0..self.slots.len() {
                if self.slots[slot].is_some() {
                    self.fail(slot, f);
                }
            }
        }
        e
    }

    fn check_fatal(&self) -> Result<()> {
        match self.fatal {
            Some(f) => Err(f.into()),
            None => Ok(()),
        }
    }
}

/// Route key of the hub's own queues in the device's event router (no queue pair has this
/// number: they are 24 bits).
const HUB_ROUTE: u32 = u32::MAX;
