//! A group of hubs, one per thread, behind one listening address: every core of a machine
//! serves peers, and each hub still sleeps until a solicited message for one of its own.
//!
//! # What is shared, what is per hub
//!
//! Each member hub owns everything on its data path: its completion channel, CQs, shared
//! receive queues, receive and send buffers, epoll set and connection table; no lock is
//! taken between a completion and the application's handler. Between threads sit only:
//!
//! - one acceptor thread, asleep in `accept(2)`, that places each client on a member (the
//!   least loaded, or one chosen by the application's key) and hands the TCP stream over;
//! - one inbox per member (a mutex-protected queue and the hub's [`Waker`]) through which
//!   any thread sends to, or closes, a peer of that member: the member's thread posts it;
//! - a load counter per member (atomic), read by the acceptor.
//!
//! The protection domain (and so memory registration) is the endpoint's, shared by all
//! members: a key a member exposes to one of its peers is bound to that peer's queue pair
//! (see [`RawHub::expose_to_peer`]).

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::hub::{HubConfig, HubStats, PeerId, RawHub, RawHubEvent};
use crate::pool::Waker;
use crate::stream::bootstrap_err;

/// How a [`HubGroup`] picks the member hub of a new client.
#[derive(Clone)]
pub enum Placement {
    /// The member with the fewest connections (established or in handshake).
    LeastLoaded,
    /// The member `key(client address) % members`: clients the application groups by
    /// address (a rack, a tenant behind one host) share a hub.
    ByKey(Arc<dyn Fn(&SocketAddr) -> u64 + Send + Sync>),
}

impl fmt::Debug for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::LeastLoaded => f.write_str("LeastLoaded"),
            Placement::ByKey(_) => f.write_str("ByKey(..)"),
        }
    }
}

/// A peer of a [`HubGroup`]: its member hub and its id there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupPeer {
    /// The member hub (its index).
    pub hub: usize,
    /// The peer in that hub.
    pub peer: PeerId,
}

impl fmt::Display for GroupPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of hub {}", self.peer, self.hub)
    }
}

/// How a [`HubGroup`] is set up.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// Member hubs, one thread each. Default 2.
    pub hubs: usize,
    /// Each member's configuration (`max_connections` is per member).
    pub hub: HubConfig,
    /// Where clients go.
    pub placement: Placement,
    /// Messages queued for one member by other threads, at most ([`GroupHandle::send`]
    /// refuses more). Default 65536.
    pub max_queued: usize,
}

impl Default for GroupConfig {
    fn default() -> Self {
        Self {
            hubs: 2,
            hub: HubConfig::default(),
            placement: Placement::LeastLoaded,
            max_queued: 65536,
        }
    }
}

/// What one member's thread hands the application's handler with each event.
#[derive(Debug)]
pub struct Member<'a> {
    /// The member's index.
    pub index: usize,
    /// The member's hub: send to its own peers directly, with any of its methods.
    pub hub: &'a mut RawHub,
    /// Sends to peers of any member.
    pub group: &'a GroupHandle,
}

impl Member<'_> {
    /// `peer` of this member as a [`GroupPeer`].
    pub fn peer(&self, peer: PeerId) -> GroupPeer {
        GroupPeer {
            hub: self.index,
            peer,
        }
    }
}

/// Counts of one member, beyond its hub's [`HubStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemberStats {
    /// Clients the acceptor placed on it.
    pub placed: u64,
    /// Messages other threads queued for it.
    pub queued: u64,
    /// Queued messages dropped because their peer was gone or failed.
    pub dropped: u64,
}

enum Command {
    Accept(TcpStream),
    Send {
        peer: PeerId,
        data: Vec<u8>,
        solicited: bool,
    },
    Close(PeerId),
}

struct MemberShared {
    inbox: Mutex<VecDeque<Command>>,
    /// Set with every command pushed, taken by the member before it waits: a wake-up byte
    /// its own step drained cannot hide a command.
    pending: AtomicBool,
    /// Messages queued (inbox and outbox) and not yet sent or dropped.
    in_flight: AtomicUsize,
    waker: Waker,
    /// Connections established or in handshake.
    load: AtomicUsize,
    placed: AtomicU64,
    queued: AtomicU64,
    dropped: AtomicU64,
}

struct Shared {
    members: Vec<MemberShared>,
    stop: AtomicBool,
    max_queued: usize,
}

impl Shared {
    fn push(&self, hub: usize, cmd: Command) {
        let m = &self.members[hub];
        m.inbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(cmd);
        m.pending.store(true, Ordering::Release);
        m.waker.wake();
    }
}

/// Sends to and closes peers of any member, from any thread (cheap to clone).
#[derive(Clone)]
pub struct GroupHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for GroupHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupHandle")
            .field("hubs", &self.hubs())
            .finish_non_exhaustive()
    }
}

impl GroupHandle {
    /// Member hubs.
    pub fn hubs(&self) -> usize {
        self.shared.members.len()
    }

    /// Queues `data` for `to`; its member's thread sends it, in the order queued, as soon as
    /// the peer has a credit (never blocking that thread). `Ok(false)` if the member already
    /// has `max_queued` messages waiting to go (nothing queued): a peer without credits holds
    /// at most that much memory of its member. A message to a peer that is gone by then is
    /// dropped and counted ([`MemberStats::dropped`]).
    pub fn send(&self, to: GroupPeer, data: impl Into<Vec<u8>>, solicited: bool) -> Result<bool> {
        let m = self.member(to)?;
        if m.in_flight.fetch_add(1, Ordering::AcqRel) >= self.shared.max_queued {
            m.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Ok(false);
        }
        m.queued.fetch_add(1, Ordering::Relaxed);
        self.shared.push(
            to.hub,
            Command::Send {
                peer: to.peer,
                data: data.into(),
                solicited,
            },
        );
        Ok(true)
    }

    /// Starts closing `to` gracefully (after what was queued for it before).
    pub fn close(&self, to: GroupPeer) -> Result<()> {
        self.member(to)?;
        self.shared.push(to.hub, Command::Close(to.peer));
        Ok(())
    }

    /// Connections of each member (established or in handshake).
    pub fn loads(&self) -> Vec<usize> {
        self.shared
            .members
            .iter()
            .map(|m| m.load.load(Ordering::Relaxed))
            .collect()
    }

    /// Counts of each member.
    pub fn member_stats(&self) -> Vec<MemberStats> {
        self.shared
            .members
            .iter()
            .map(|m| MemberStats {
                placed: m.placed.load(Ordering::Relaxed),
                queued: m.queued.load(Ordering::Relaxed),
                dropped: m.dropped.load(Ordering::Relaxed),
            })
            .collect()
    }

    fn member(&self, to: GroupPeer) -> Result<&MemberShared> {
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(Error::UnknownPeer(to.peer));
        }
        // A match, not `ok_or`: an error built eagerly is dropped on every send.
        match self.shared.members.get(to.hub) {
            Some(m) => Ok(m),
            None => Err(Error::UnknownPeer(to.peer)),
        }
    }
}

/// Hubs on several threads behind one listening address: an acceptor places each client on a
/// member hub, each member's thread runs the application's handler for its own events, and
/// any thread sends to any peer through a [`GroupHandle`] (an inbox per member, drained by
/// its thread). Nothing else is shared but the endpoint.
///
/// ```no_run
/// use rdmsg_transport::{Endpoint, GroupConfig, HubGroup, RawHubEvent};
///
/// let ep = Endpoint::open_default()?;
/// let group = HubGroup::start(&ep, "0.0.0.0:7000", GroupConfig::default(), |_index| {
///     |member: &mut rdmsg_transport::Member<'_>, event: RawHubEvent| {
///         if let RawHubEvent::Message { peer, msg } = event {
///             // Echo, from this member's thread, to its own peer.
///             let _ = member.hub.try_send(peer, &msg, true);
///         }
///     }
/// })?;
/// println!("serving on {}", group.local_addr());
/// # Ok::<(), rdmsg_transport::Error>(())
/// ```
pub struct HubGroup {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    members: Vec<JoinHandle<Result<HubStats>>>,
}

impl fmt::Debug for HubGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubGroup")
            .field("addr", &self.addr)
            .field("hubs", &self.members.len())
            .finish_non_exhaustive()
    }
}

impl HubGroup {
    /// Listens at `addr` and starts `config.hubs` member hubs, each on a thread of its own
    /// running the handler `make_handler(index)` returns for every event of that member.
    pub fn start<F, H>(
        endpoint: &Endpoint,
        addr: impl ToSocketAddrs + fmt::Debug,
        config: GroupConfig,
        make_handler: F,
    ) -> Result<Self>
    where
        F: Fn(usize) -> H,
        H: FnMut(&mut Member<'_>, RawHubEvent) + Send + 'static,
    {
        if config.hubs == 0 {
            return Err(Error::Config("a hub group needs at least one hub".into()));
        }
        let listener = TcpListener::bind(&addr).map_err(|source| Error::Listen {
            addr: format!("{addr:?}"),
            source,
        })?;
        let local = listener
            .local_addr()
            .map_err(bootstrap_err("reading the listening address"))?;
        let mut hubs = Vec::with_capacity(config.hubs);
        let mut members = Vec::with_capacity(config.hubs);
        for _ in 0..config.hubs {
            let hub = RawHub::new(endpoint, config.hub.clone())?;
            members.push(MemberShared {
                inbox: Mutex::new(VecDeque::new()),
                pending: AtomicBool::new(false),
                in_flight: AtomicUsize::new(0),
                waker: hub.waker()?,
                load: AtomicUsize::new(0),
                placed: AtomicU64::new(0),
                queued: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
            });
            hubs.push(hub);
        }
        let shared = Arc::new(Shared {
            members,
            stop: AtomicBool::new(false),
            max_queued: config.max_queued,
        });
        let handle = GroupHandle {
            shared: shared.clone(),
        };
        let threads = hubs
            .into_iter()
            .enumerate()
            .map(|(index, hub)| {
                let handler = make_handler(index);
                let handle = handle.clone();
                std::thread::Builder::new()
                    .name(format!("rdmsg-hub-{index}"))
                    .spawn(move || run_member(index, hub, handle, handler))
                    .map_err(Error::WakePipe)
            })
            .collect::<Result<Vec<_>>>()?;
        let acceptor = {
            let shared = shared.clone();
            let placement = config.placement;
            std::thread::Builder::new()
                .name("rdmsg-hub-accept".into())
                .spawn(move || accept_loop(listener, &shared, &placement))
                .map_err(Error::WakePipe)?
        };
        Ok(Self {
            addr: local,
            shared,
            acceptor: Some(acceptor),
            members: threads,
        })
    }

    /// The address the group listens at.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle to send to peers of any member, from any thread.
    pub fn handle(&self) -> GroupHandle {
        GroupHandle {
            shared: self.shared.clone(),
        }
    }

    /// Stops accepting, stops every member's thread (dropping its hub: its peers see the
    /// connections vanish; close them first for a graceful end) and returns each member's
    /// hub statistics, or the error that stopped it.
    pub fn stop(mut self) -> Vec<Result<HubStats>> {
        self.stop_all()
    }

    fn stop_all(&mut self) -> Vec<Result<HubStats>> {
        self.shared.stop.store(true, Ordering::Release);
        for m in &self.shared.members {
            m.waker.wake();
        }
        // The acceptor sleeps in accept(2): a connection of our own wakes it to see the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        self.members
            .drain(..)
            .enumerate()
            .map(|(member, t)| t.join().unwrap_or(Err(Error::MemberPanicked { member })))
            .collect()
    }
}

impl Drop for HubGroup {
    fn drop(&mut self) {
        if self.acceptor.is_some() || !self.members.is_empty() {
            self.stop_all();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: &Shared, placement: &Placement) {
    let n = shared.members.len();
    loop {
        let accepted = listener.accept();
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok((stream, from)) = accepted else {
            // Out of descriptors, most likely: try again a little later.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let hub = match placement {
            Placement::LeastLoaded => (0..n)
                .min_by_key(|&i| shared.members[i].load.load(Ordering::Relaxed))
                .unwrap_or(0),
            Placement::ByKey(key) => (key(&from) % n as u64) as usize,
        };
        let m = &shared.members[hub];
        m.load.fetch_add(1, Ordering::Relaxed);
        m.placed.fetch_add(1, Ordering::Relaxed);
        shared.push(hub, Command::Accept(stream));
    }
}

/// What other threads queued for a peer of this member.
enum Outgoing {
    Data {
        peer: PeerId,
        data: Vec<u8>,
        solicited: bool,
    },
    Close(PeerId),
}

impl Outgoing {
    fn peer(&self) -> PeerId {
        match self {
            Outgoing::Data { peer, .. } | Outgoing::Close(peer) => *peer,
        }
    }
}

fn run_member<H>(
    index: usize,
    mut hub: RawHub,
    group: GroupHandle,
    mut handler: H,
) -> Result<HubStats>
where
    H: FnMut(&mut Member<'_>, RawHubEvent),
{
    let shared = group.shared.clone();
    let me = &shared.members[index];
    let mut commands = VecDeque::new();
    let mut outbox: VecDeque<Outgoing> = VecDeque::new();
    let mut blocked: Vec<PeerId> = Vec::new();
    // Peers the acceptor placed here (the handler may connect to others itself).
    let mut accepted: HashSet<PeerId> = HashSet::new();
    loop {
        me.pending.store(false, Ordering::Release);
        std::mem::swap(
            &mut commands,
            &mut *me.inbox.lock().unwrap_or_else(PoisonError::into_inner),
        );
        for cmd in commands.drain(..) {
            match cmd {
                Command::Accept(stream) => {
                    if hub.accept_stream(stream).is_err() {
                        me.load.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                Command::Send {
                    peer,
                    data,
                    solicited,
                } => outbox.push_back(Outgoing::Data {
                    peer,
                    data,
                    solicited,
                }),
                // Behind what was queued for it: closed once those went.
                Command::Close(peer) => outbox.push_back(Outgoing::Close(peer)),
            }
        }
        if shared.stop.load(Ordering::Acquire) {
            return Ok(hub.stats());
        }
        // In order per peer: a peer without credit keeps its later messages behind, others
        // go on.
        blocked.clear();
        outbox.retain(|out| {
            let peer = out.peer();
            if blocked.contains(&peer) {
                return true;
            }
            let sent = match out {
                Outgoing::Data {
                    peer,
                    data,
                    solicited,
                } => hub.try_send(*peer, data, *solicited),
                // A close waits for a credit: only once there is one (until then, a bounded
                // send that sends nothing arms the hub for the grant).
                Outgoing::Close(peer) => match hub.credits(*peer) {
                    Ok(0) => hub
                        .send_with(*peer, false, Some(Duration::ZERO), |_| None)
                        .map(|_| false),
                    Ok(_) => hub.start_close(*peer).map(|()| true),
                    Err(e) => Err(e),
                },
            };
            let done = match sent {
                Ok(true) => true,
                Ok(false) | Err(Error::Timeout(_)) => {
                    blocked.push(peer);
                    false
                }
                Err(_) => {
                    me.dropped.fetch_add(1, Ordering::Relaxed);
                    true
                }
            };
            if done && matches!(out, Outgoing::Data { .. }) {
                me.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
            !done
        });
        while let Some(event) = hub.queued_event() {
            match &event {
                RawHubEvent::Connected {
                    peer,
                    accepted: true,
                } => {
                    accepted.insert(*peer);
                }
                RawHubEvent::HandshakeFailed { peer: None, .. } => {
                    me.load.fetch_sub(1, Ordering::Relaxed);
                }
                RawHubEvent::Disconnected { peer, .. } if accepted.remove(peer) => {
                    me.load.fetch_sub(1, Ordering::Relaxed);
                }
                _ => {}
            }
            let mut member = Member {
                index,
                hub: &mut hub,
                group: &group,
            };
            handler(&mut member, event);
        }
        // A command pushed since the inbox was taken: look again before sleeping (its wake-up
        // byte may have been drained by a step above).
        if me.pending.swap(false, Ordering::AcqRel) {
            continue;
        }
        // A peer without credit arms the hub for any completion: its grant ends this wait.
        hub.wait(None)?;
    }
}
