//! The hub's listener, the handshakes it runs (accepted and its own), and the bootstrap
//! streams of established connections.

use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rdmsg_verbs::{QpCaps, QueuePair};

use super::sessions::Announce;
use super::side::HubSide;
use super::slots::{Established, HostKey, Resources};
use super::{RawHub, RawHubEvent};
use crate::bootstrap::Pending;
use crate::config::Config;
use crate::control::Control;
use crate::drive;
use crate::error::{Error, Failure, Result};
use crate::handshake::{Handshake, Hello};
use crate::handshake_set::{to_evict, Bound, Waiting};
use crate::setup::{nonce, random_psn};
use crate::stream::accept_next;
use crate::token::Token;
use crate::trace;

impl RawHub {
    pub(super) fn accept_all(&mut self) {
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
                    let error = Error::Bootstrap {
                        stage: "accepting",
                        source,
                    };
                    trace::client_refused(&error);
                    self.events
                        .push_back(RawHubEvent::HandshakeFailed { peer: None, error });
                    return;
                }
            };
            // Refused (full): the client sees its stream end, and the hub counts it.
            let _ = self.take_client(stream);
        }
    }

    /// Starts the handshake of an accepted client; an error if it could not start (the hub
    /// is full, or no socket or handshake state could be made: counted, and the client sees
    /// its stream end).
    pub(super) fn take_client(&mut self, stream: TcpStream) -> Result<()> {
        self.evict_oldest_pending();
        let slot = match self.new_slot(true) {
            Ok(slot) => slot,
            Err(e) => {
                // Full: the client sees its stream end.
                trace::client_refused(&e);
                self.stats.refused += 1;
                return Err(e);
            }
        };
        let conn = self.config.conn.clone();
        let made = nonce().and_then(|n| {
            let hs = Handshake::server(self.hello(None), conn.limits(), conn.psk.clone(), n)
                .resuming(conn.resume_window.is_some());
            Pending::new(stream, hs, None, &conn)
        });
        match made {
            Ok(mut p) => {
                if conn.resume_window.is_some() {
                    p.sessions = Some(self.sessions.known.clone());
                }
                trace::handshake_started(p.peer_addr, Some(self.slot(slot).id(slot)));
                self.start_handshake(slot, p).inspect_err(|e| {
                    trace::handshake_failed(None, None, e);
                    self.stats.handshakes_failed += 1;
                })
            }
            Err(error) => {
                trace::handshake_failed(None, None, &error);
                self.abandon(slot);
                self.stats.handshakes_failed += 1;
                self.events
                    .push_back(RawHubEvent::HandshakeFailed { peer: None, error });
                Ok(())
            }
        }
    }

    /// Makes room for one more accepted handshake when `max_pending_handshakes` are under
    /// way: the oldest pending one (the first started still handshaking, over TCP or rdma_cm)
    /// fails.
    pub(super) fn evict_oldest_pending(&mut self) {
        let max_pending = self.config.conn.max_pending_handshakes;
        if self.handshakes.accepted() < max_pending as usize {
            return;
        }
        // Entries of handshakes that ended are skipped (and dropped as they reach the front).
        let slots = &self.table.slots;
        let waiting = self
            .handshakes
            .oldest_accepted()
            .filter_map(|&(i, generation)| {
                let s = slots.get(i)?.as_ref()?;
                let deadline = match &s.resources {
                    Resources::Handshake(p) if s.generation == generation => p.deadline,
                    Resources::CmHandshake(p) if s.generation == generation => p.hs.deadline(),
                    _ => return None,
                };
                Some(Waiting {
                    key: i,
                    deadline,
                    memory: 0,
                })
            });
        let bound = Bound {
            most: max_pending as usize,
            cap: u64::MAX,
        };
        let Some((i, _)) = to_evict(waiting, bound, 0) else {
            return;
        };
        let e = match &self.slot(i).resources {
            Resources::Handshake(p) => p.evicted(max_pending),
            Resources::CmHandshake(p) => p.evicted(max_pending),
            _ => unreachable!("a waiting handshake"),
        };
        self.handshake_failed(i, e);
    }

    /// Creates the queue pair of slot `slot` on the hub's queues, with its share of the
    /// receive buffers set aside (the pool grows if it must).
    pub(super) fn create_side(&mut self, slot: usize) -> Result<HubSide> {
        let start = Instant::now();
        let admitted = self.admit(slot);
        let admitted_at = Instant::now();
        self.stats.connect_times.admission += admitted_at - start;
        let group = admitted?;
        let caps = QpCaps {
            max_send_wr: self.config.conn.send_depth,
            max_recv_wr: 0,
            max_inline_data: self.config.conn.max_inline,
        };
        let made = (|| {
            let g = &self.groups[group];
            let mut qp = QueuePair::new_rc_with_srq(
                self.endpoint.pd(),
                self.waiter.cq(self.send_key)?,
                self.waiter.cq(g.key)?,
                &g.srq,
                caps,
            )?;
            qp.to_init(self.endpoint.port())?;
            Ok::<_, Error>(qp)
        })();
        self.stats.connect_times.queue_pairs += admitted_at.elapsed();
        let qp = match made {
            Ok(qp) => qp,
            Err(e) => {
                // Nothing can have been consumed: no queue pair.
                self.unadmit(slot);
                return Err(e);
            }
        };
        self.table.map_qp(qp.qp_num(), slot);
        self.slot_mut(slot).qpn = Some(qp.qp_num());
        self.endpoint
            .register_async(Some(qp.qp_num()), Vec::new(), &self.mailbox);
        Ok(HubSide {
            psn: random_psn(qp.qp_num()),
            qp,
            peer: None,
            transitions: Duration::ZERO,
        })
    }

    pub(super) fn start_handshake(&mut self, slot: usize, pending: Pending<HubSide>) -> Result<()> {
        self.watch_handshake(slot, pending.stream.as_fd())?;
        self.slot_mut(slot).resources = Resources::Handshake(Box::new(pending));
        self.handshake_started(slot);
        Ok(())
    }

    /// Watches the descriptor a handshake of `slot` moves on (its stream, or its CM id's
    /// channel) under the slot's key; frees the slot if it cannot.
    pub(super) fn watch_handshake(
        &mut self,
        slot: usize,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<()> {
        let key = Token::Stream(slot as u32).key();
        if let Err(e) = self.watch().add_keyed(fd, key) {
            self.abandon(slot);
            return Err(e.into());
        }
        Ok(())
    }

    /// The handshake of `slot` started: it counts as pending until it ends, and wakes the hub
    /// at its deadline.
    pub(super) fn handshake_started(&mut self, slot: usize) {
        let s = self.slot(slot);
        let (accepted, generation) = (s.accepted, s.generation);
        self.handshakes.started((slot, generation), accepted);
        self.schedule(slot);
    }

    /// The handshake of `slot` ended (established or failed): it no longer counts.
    pub(super) fn handshake_ended(&mut self, slot: usize) {
        let slots = &self.table.slots;
        let live = |&(i, generation): &(usize, u32)| {
            slots
                .get(i)
                .and_then(Option::as_ref)
                .is_some_and(|s| s.generation == generation && s.is_handshaking())
        };
        self.handshakes.ended(self.slot(slot).accepted, live);
    }

    pub(super) fn stream_ready(&mut self, slot: usize) {
        let Some(s) = self.table.slots.get(slot).and_then(Option::as_ref) else {
            return;
        };
        match s.resources {
            Resources::Handshake(_) => self.advance_handshake(slot),
            Resources::CmHandshake(_) => self.advance_cm_handshake(slot),
            Resources::Linked(_) => self.check_stream(slot),
            Resources::Failing(_) | Resources::Retired => {}
        }
    }

    pub(super) fn advance_handshake(&mut self, slot: usize) {
        let Resources::Handshake(mut pending) =
            std::mem::replace(&mut self.slot_mut(slot).resources, Resources::Retired)
        else {
            return;
        };
        let endpoint = self.endpoint.clone();
        let start = Instant::now();
        let before = self.stats.connect_times;
        let res = {
            let mut create = |_: &Config| self.create_side(slot);
            pending.advance(&endpoint, &mut create)
        };
        // What the call did beside creating and connecting the queue pair is the hellos'.
        let times = &mut self.stats.connect_times;
        let transitions = pending
            .setup
            .as_mut()
            .map_or(Duration::ZERO, |side| std::mem::take(&mut side.transitions));
        times.transitions += transitions;
        let created =
            (times.admission - before.admission) + (times.queue_pairs - before.queue_pairs);
        times.hellos += start.elapsed().saturating_sub(created + transitions);
        // Once the peer's hello is known and the queue pair connected, the books are real
        // (the peer may send as soon as its side is in RTS).
        if let Some(peer) = pending.setup.as_ref().and_then(|side| side.peer) {
            let books = self.books_for(&peer);
            self.slot_mut(slot).core.learn_peer(books);
        }
        match res {
            Ok(false) => self.slot_mut(slot).resources = Resources::Handshake(pending),
            Ok(true) => self.establish(slot, *pending),
            Err(e) => {
                self.slot_mut(slot).resources = Resources::Handshake(pending);
                self.handshake_failed(slot, e);
            }
        }
    }

    /// The handshake of `slot` is done: the connection is announced, with what arrived early.
    fn establish(&mut self, slot: usize, pending: Pending<HubSide>) {
        let Pending {
            stream,
            setup,
            hs,
            peer_addr,
            started,
            ..
        } = pending;
        let side = setup.expect("a finished handshake has its queue pair");
        let peer = *hs.peer().expect("a finished handshake knows its peer");
        let session = hs.resumable().then(|| hs.session());
        let dial = peer_addr.filter(|_| !self.slot(slot).accepted);
        // No TCP keepalive: the hub probes silent peer hosts itself (see `liveness`); the
        // stream still tells of a peer process's end.
        self.finish_handshake(slot, side, Control::Tcp(stream), peer, peer_addr, started);
        // A resumable session: a new one is announced as any connection, a resume under
        // the session's id (or once its old connection is released).
        let announce = self.session_linked(slot, session, dial);
        match announce {
            Announce::Connected => self.announce(slot, false),
            Announce::Resumed => self.announce(slot, true),
            Announce::Later | Announce::Never => {}
        }
        self.after_linked(slot);
    }

    /// The handshake of `slot` (over TCP or rdma_cm), begun at `started`, is done: the
    /// connection is linked (the caller announces it, then calls `after_linked`). Its stream
    /// or CM channel stays in the hub's watch.
    pub(super) fn finish_handshake(
        &mut self,
        slot: usize,
        side: HubSide,
        control: Control,
        peer: Hello,
        peer_addr: Option<std::net::SocketAddr>,
        started: Instant,
    ) {
        self.handshake_ended(slot);
        let times = &mut self.stats.connect_times;
        times.established += 1;
        times.wall += started.elapsed();
        let accepted = self.slot(slot).accepted;
        let id = self.slot(slot).id(slot);
        trace::hub_linked(id, peer_addr, accepted, side.qp.qp_num(), peer.addr.qpn);
        let conn = &self.config.conn;
        let caps = side.qp.caps();
        let generation = self.slot(slot).generation;
        let host = if peer.addr.gid != rdmsg_verbs::Gid::default() || peer.addr.lid != 0 {
            HostKey::Device(peer.addr.gid, peer.addr.lid)
        } else if let Some(at) = peer_addr {
            // rdma_cm's hello leaves the address to the CM: the peer's IP names its host.
            HostKey::Ip(at.ip())
        } else {
            HostKey::Alone(slot, generation)
        };
        let link = Established {
            host,
            max_message: peer.buf_size.min(conn.buf_size) as usize,
            max_inline: caps.max_inline_data.min(conn.max_inline) as usize,
            sq_depth: caps.max_send_wr.min(conn.send_depth) as usize,
            qp: side.qp,
            control,
            peer,
            watched: true,
        };
        self.liveness.opened(self.clock.now());
        let s = self.slot_mut(slot);
        s.resources = Resources::Linked(Box::new(link));
        s.core.handshake_done();
        if accepted {
            self.stats.accepted += 1;
        } else {
            self.stats.connected += 1;
        }
    }

    /// The linked connection at `slot` is reported ([`RawHubEvent::Connected`], or
    /// [`RawHubEvent::Resumed`] for a session's new connection), with what arrived early.
    pub(super) fn announce(&mut self, slot: usize, resumed: bool) {
        let s = self.slot_mut(slot);
        let accepted = s.accepted;
        s.announced = true;
        let id = s.id(slot);
        let early = std::mem::take(&mut s.early);
        self.events.push_back(if resumed {
            RawHubEvent::Resumed { peer: id }
        } else {
            RawHubEvent::Connected { peer: id, accepted }
        });
        for msg in early {
            self.events
                .push_back(RawHubEvent::Message { peer: id, msg });
        }
        // Grants held back while it was not announced.
        self.touch(slot);
    }

    /// What follows linking `slot`, announced or not.
    pub(super) fn after_linked(&mut self, slot: usize) {
        if self.slot(slot).core.failure().is_some() {
            // Failed while finishing (its first message broke the protocol, say): its
            // queue pair is failed now that it has one.
            drive::fail_queue_pair(&mut self.queues(slot));
        }
        self.touch(slot);
        // Its core's deadlines (the probe's) wake the hub.
        if self.table.slots[slot].is_some() {
            self.schedule(slot);
        }
    }

    pub(super) fn handshake_failed(&mut self, slot: usize, error: Error) {
        self.stats.handshakes_failed += 1;
        let s = self.slot(slot);
        let from = match &s.resources {
            Resources::Handshake(p) => p.peer_addr,
            Resources::CmHandshake(p) => p.peer_addr,
            _ => None,
        };
        trace::handshake_failed(from, Some(s.id(slot)), &error);
        let peer = (!s.accepted).then(|| s.id(slot));
        match (s.name, s.session) {
            // Our attempt to resume a session: the session's business, not an event.
            (Some(_), Some(token)) if !s.accepted => self.resume_attempt_failed(token, &error),
            _ => self
                .events
                .push_back(RawHubEvent::HandshakeFailed { peer, error }),
        }
        let side = match std::mem::replace(&mut self.slot_mut(slot).resources, Resources::Retired) {
            Resources::Handshake(pending) => {
                let _ = self.watch().remove(pending.stream.as_fd());
                let _ = pending.stream.shutdown(std::net::Shutdown::Both);
                pending.setup
            }
            Resources::CmHandshake(pending) => {
                let _ = self.watch().remove(pending.channel.as_fd());
                // Dropping the id refuses or disconnects the peer.
                pending.side
            }
            other => {
                self.slot_mut(slot).resources = other;
                return;
            }
        };
        self.handshake_ended(slot);
        let core = &mut self.slot_mut(slot).core;
        core.handle_failure(Failure::PeerVanished);
        // Its queue pair (if any) goes now, not through the core's actions.
        while core.poll_command().is_some() {}
        match side {
            // Its queue pair may have taken receives of the shared queue already: drained
            // like a linked one's before it is destroyed, then polled, then released.
            Some(side) => self.drain_failed_side(slot, side.qp),
            None => self.abandon(slot),
        }
    }

    /// Looks at a readable bootstrap stream: after the handshake only a goodbye may come.
    fn check_stream(&mut self, slot: usize) {
        let Some(link) = self.slot_mut(slot).established_mut() else {
            return;
        };
        let news = link.control.news();
        let now = self.clock.now();
        drive::on_stream(&mut self.queues(slot), news, now);
        // Its close message may still be in flight: waited for (not here: the hub goes on)
        // until the core's deadline.
        self.schedule(slot);
    }
}
