//! The hub's connection table: a slot per connection, holding its protocol core and the I/O
//! resources of its phase (the handshake's, or the link's), addressed by [`PeerId`].

use std::net::IpAddr;

use rdmsg_verbs::{Gid, QueuePair};

use super::cm_pending::CmPending;
use super::side::HubSide;
use super::table::Generational;
use super::{PeerId, RawHub};
use crate::addr::QpAddress;
use crate::bootstrap::Pending;
use crate::control::Control;
use crate::core::Core;
use crate::credits::Credits;
use crate::error::{Error, Result};
use crate::handshake::Hello;
use crate::pool::Received;
use crate::setup::our_hello;
use crate::share::CreditHolder;

/// The I/O side of an established connection (or one whose queue pair is connected and whose
/// handshake is finishing): its deadlines and state are its core's.
#[derive(Debug)]
pub(super) struct Established {
    pub(super) qp: QueuePair,
    /// The bootstrap stream, or the connection manager's id.
    pub(super) control: Control,
    pub(super) peer: Hello,
    pub(super) max_message: usize,
    pub(super) max_inline: usize,
    pub(super) sq_depth: usize,
    /// The stream is in the epoll set.
    pub(super) watched: bool,
    /// The peer's host, as the liveness watch groups connections.
    pub(super) host: HostKey,
}

/// The I/O resources a slot holds.
#[derive(Debug)]
pub(super) enum Resources {
    /// Handshake under way (its local side inside, once created).
    Handshake(Box<Pending<HubSide>>),
    /// Connection manager handshake under way: the id's events drive it.
    CmHandshake(Box<CmPending>),
    /// Queue pair connected.
    Linked(Box<Established>),
    /// A failed handshake's queue pair, in the error state: destroyed once the device said its
    /// last receive left it (or the drain deadline passed), as a linked one is. Destroyed at
    /// once, a receive the device had taken from the shared queue for it would vanish with
    /// it while the books count it posted.
    Failing(QueuePair),
    /// Queue pair destroyed; released once the CQs have been polled after that.
    Retired,
}

/// One slot of the hub's connection table.
#[derive(Debug)]
pub(super) struct Slot {
    pub(super) generation: u32,
    pub(super) accepted: bool,
    /// The hub reported it [`super::RawHubEvent::Connected`].
    pub(super) announced: bool,
    /// Holds buffers of the shared pool ([`crate::share::Share::admit`]).
    pub(super) admitted: bool,
    /// Its receive group, once it has one (kept until released: its completions name it).
    pub(super) group: Option<usize>,
    pub(super) core: Core,
    pub(super) resources: Resources,
    /// Messages that arrived before the handshake finished, delivered after `Connected`.
    pub(super) early: Vec<Received>,
    /// In `RawHub::touched` this round.
    pub(super) touched: bool,
    /// Its queue pair's number, once it has one (kept until released).
    pub(super) qpn: Option<u32>,
    /// Its sends left unsignaled behind the last signaled one, as of its last post (counted
    /// in `RawHub::unsignaled_total`).
    pub(super) unsignaled: usize,
    /// Its RDMA reads under way, in posting order: wr_id and work requests (counted in
    /// `RawHub::read_wrs`).
    pub(super) reads: std::collections::VecDeque<(u64, usize)>,
    /// The deadline of its entry in `RawHub::timers`, if it has one.
    pub(super) timer_at: Option<std::time::Instant>,
    /// Its credit stall under way, for its events (nothing without the `tracing` feature).
    pub(super) stall: crate::trace::Stall,
    /// The resumable session it carries or resumes (see `sessions`).
    pub(super) session: Option<crate::resume::Token>,
    /// The id of the session it resumes: its id once it is announced.
    pub(super) name: Option<PeerId>,
}

impl Generational for Slot {
    fn generation(&self) -> u32 {
        self.generation
    }
}

impl CreditHolder for Slot {
    fn credits(&self) -> &Credits {
        self.core.credits()
    }
    fn credits_mut(&mut self) -> &mut Credits {
        self.core.credits_mut()
    }
}

impl Slot {
    pub(super) fn id(&self, slot: usize) -> PeerId {
        match self.name {
            Some(name) => name,
            None => PeerId {
                slot: slot as u32,
                generation: self.generation,
            },
        }
    }

    pub(super) fn established(&self) -> Option<&Established> {
        match &self.resources {
            Resources::Linked(l) => Some(l),
            _ => None,
        }
    }

    pub(super) fn established_mut(&mut self) -> Option<&mut Established> {
        match &mut self.resources {
            Resources::Linked(l) => Some(l),
            _ => None,
        }
    }

    pub(super) fn qp_mut(&mut self) -> Option<&mut QueuePair> {
        match &mut self.resources {
            Resources::Linked(l) => Some(&mut l.qp),
            Resources::Handshake(p) => p.setup.as_mut().map(|s| &mut s.qp),
            Resources::CmHandshake(p) => p.side.as_mut().map(|s| &mut s.qp),
            Resources::Failing(qp) => Some(qp),
            Resources::Retired => None,
        }
    }

    pub(super) fn is_handshaking(&self) -> bool {
        matches!(
            self.resources,
            Resources::Handshake(_) | Resources::CmHandshake(_)
        )
    }
}

impl RawHub {
    #[inline]
    pub(super) fn slot(&self, i: usize) -> &Slot {
        self.table.slots[i].as_ref().expect("a live slot")
    }

    #[inline]
    pub(super) fn slot_mut(&mut self, i: usize) -> &mut Slot {
        self.table.slots[i].as_mut().expect("a live slot")
    }

    #[inline]
    pub(super) fn find(&self, peer: PeerId) -> Result<usize> {
        // A match, not `ok_or`: an error built eagerly is dropped on every send (60
        // instructions per round trip in the cost check).
        match self.table.find(peer) {
            Some(i) => Ok(i),
            None => Err(Error::UnknownPeer(peer)),
        }
    }

    /// The slot of a connection that may be sent to (established or finishing its
    /// handshake), or why not (its failure, or [`crate::Failure::Closed`] once closing).
    pub(super) fn live_slot(&self, peer: PeerId) -> Result<usize> {
        self.check_fatal()?;
        let i = self.find(peer)?;
        self.slot(i).core.check_send()?;
        Ok(i)
    }

    /// Handshakes started by [`RawHub::connect`] and not finished.
    pub(super) fn outgoing_handshakes(&self) -> usize {
        self.handshakes.outgoing()
    }

    pub(super) fn new_slot(&mut self, accepted: bool) -> Result<usize> {
        let conn = &self.config.conn;
        let core = Core::handshaking(
            self.placeholder_credits(),
            conn.signal_every,
            conn.close_timeout,
        )
        .on_shared_receive_queue();
        let slot = |generation| Slot {
            generation,
            accepted,
            announced: false,
            admitted: false,
            group: None,
            core,
            resources: Resources::Retired,
            early: Vec::new(),
            touched: false,
            qpn: None,
            unsignaled: 0,
            reads: std::collections::VecDeque::new(),
            timer_at: None,
            stall: crate::trace::Stall::default(),
            session: None,
            name: None,
        };
        self.table.insert(slot).ok_or(Error::HubFull {
            max: self.config.max_connections,
        })
    }

    /// Books of a connection whose peer is not known yet: the peer holds the minimum.
    fn placeholder_credits(&self) -> Credits {
        let c = &self.config;
        Credits::shared(c.max_credits, c.conn.grant_slots, 0, 3, 0, c.min_credits)
    }

    /// The books of a connection to `peer`.
    pub(super) fn books_for(&self, peer: &Hello) -> Credits {
        let c = &self.config;
        Credits::shared(
            c.max_credits,
            c.conn.grant_slots,
            peer.recv_depth,
            peer.grant_slots,
            peer.initial_credits,
            c.min_credits,
        )
    }

    /// What this hub announces.
    pub(super) fn hello(&self, addr: Option<QpAddress>) -> Hello {
        let mut h = our_hello(&self.endpoint, &self.config.conn, addr);
        h.recv_depth = self.config.max_credits;
        h.initial_credits = self.config.min_credits;
        h
    }

    /// Frees a slot that has no queue pair to drain (none made, or one dropped before it
    /// could receive).
    pub(super) fn abandon(&mut self, slot: usize) {
        self.unadmit(slot);
        self.forget_queue_pair(slot);
        self.table.remove(slot);
    }

    /// The queue pair of `slot` is gone or going: its number may name another one next, of
    /// this hub or not, and its unsignaled sends no longer count.
    pub(super) fn forget_queue_pair(&mut self, slot: usize) {
        let Some(s) = self.table.slots[slot].as_mut() else {
            return;
        };
        self.budget
            .follow_unsignaled(std::mem::take(&mut s.unsignaled), 0);
        if let Some(qpn) = s.qpn.take() {
            self.table.unmap_qp(qpn);
            self.endpoint.unregister_async(qpn, &self.mailbox);
        }
    }

    pub(super) fn touch(&mut self, slot: usize) {
        let s = self.table.slots[slot].as_mut().expect("a live slot");
        if !std::mem::replace(&mut s.touched, true) {
            self.touched.push(slot);
        }
    }
}

/// Where a peer's device answers: its port's GID and LID when its hello names them (the TCP
/// bootstrap), else its IP address (rdma_cm, where the address is the CM's business), else
/// nothing shared: the connection alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum HostKey {
    Device(Gid, u16),
    Ip(IpAddr),
    Alone(usize, u32),
}
