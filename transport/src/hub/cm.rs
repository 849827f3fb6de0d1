//! The hub's connections through the RDMA connection manager: a CM listener beside (or
//! instead of) the TCP one, and connects. Each handshake is the exchange of private data of
//! [`crate::cm`], driven by its id's own event channel, watched like a bootstrap stream under
//! its slot's key; it counts against `max_pending_handshakes` and ends at `handshake_timeout`
//! as a TCP one does, so a silent or half-connected peer holds its slot and never the hub.
//! Once linked, the channel is the connection's [`Control`]: a disconnect is the end of its
//! stream, and the hub's liveness watch of its host (`liveness`) stands in for keepalive.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::Instant;

use rdmsg_verbs::{CmEvent, CmEventChannel, CmEventKind, CmId, ConnParams};

use super::cm_pending::{CmListening, CmPending};
use super::slots::Resources;
use super::{PeerId, RawHub, RawHubEvent};
use crate::cm::machine::{CmHandshake, CmNext};
use crate::cm::{
    check_answer, check_device, check_request, cm_failure, conn_params, read_params, refuse_psk,
    socket_addr, tuning,
};
use crate::control::{CmLink, Control};
use crate::error::{Error, Result};
use crate::handshake::cm::{encode_hello, encode_reject};
use crate::handshake::{Hello, Reject};
use crate::token::Token;
use crate::trace;

impl RawHub {
    /// Listens for connection requests through the RDMA connection manager at `addr` (an IP
    /// address of the hub's device, or a wildcard, and a port; port 0 picks one), beside the
    /// TCP listener of [`RawHub::listen`] if there is one; returns the address bound. Clients
    /// connect with [`Endpoint::connect_cm`](crate::Endpoint::connect_cm) or another hub's
    /// [`RawHub::connect_cm`]; each established one is a [`RawHubEvent::Connected`] with
    /// `accepted: true`, and a refused one is told the reason in the reject. Refused with
    /// [`Config::psk`](crate::Config::psk): a hub does not prove a key over rdma_cm yet (a
    /// [`CmListener`](crate::CmListener) does).
    pub fn listen_cm(&mut self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<SocketAddr> {
        self.check_fatal()?;
        refuse_psk(&self.config.conn)?;
        let listen_err = |source| Error::Listen {
            addr: format!("{addr:?}"),
            source,
        };
        let bind = socket_addr(&addr).map_err(|e| match e {
            Error::Connect { source, .. } => listen_err(source),
            e => e,
        })?;
        let channel = CmEventChannel::new()?;
        let mut id = CmId::new(&channel)?;
        let backlog = self.config.conn.max_pending_handshakes.clamp(1, 1024) as i32;
        id.bind(bind)
            .and_then(|()| id.listen(backlog))
            .map_err(|e| match e {
                rdmsg_verbs::Error::Cm { source, .. } => listen_err(source),
                e => e.into(),
            })?;
        let local = id.local_addr().unwrap_or(bind);
        if let Some(old) = self.cm_listener.take() {
            let _ = self.watch().remove(old.channel.as_fd());
        }
        self.watch()
            .add_keyed(channel.as_fd(), Token::CmListen.key())?;
        self.cm_listener = Some(CmListening { _id: id, channel });
        Ok(local)
    }

    /// Starts a connection through the RDMA connection manager to a
    /// [`CmListener`](crate::CmListener) or another hub's [`RawHub::listen_cm`] at `addr` (an
    /// IP address and port): address and route resolution, the request and its answer all
    /// run inside the hub, within `handshake_timeout`. The outcome is a
    /// [`RawHubEvent::Connected`] or a [`RawHubEvent::HandshakeFailed`] naming the returned
    /// peer, as with [`RawHub::connect`], whose bound on our pending handshakes it shares.
    pub fn connect_cm(&mut self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<PeerId> {
        self.check_fatal()?;
        let dst = socket_addr(&addr)?;
        let timeout = self.config.conn.handshake_timeout;
        let most = (self.config.conn.max_pending_handshakes as usize / 4).max(1);
        // A call from the application begins a turn: the waits below count from it.
        self.clock.new_turn();
        while self.outgoing_handshakes() >= most {
            self.wait_for_progress(Some(timeout), false)?;
        }
        self.start_connect_cm(dst)
    }

    /// [`RawHub::connect_cm`] to an address already resolved, without waiting while a quarter
    /// of `max_pending_handshakes` of ours are in flight (pace by
    /// [`RawHub::pending_connects`]): never blocks, for async runtimes.
    pub fn start_connect_cm(&mut self, dst: SocketAddr) -> Result<PeerId> {
        self.check_fatal()?;
        refuse_psk(&self.config.conn)?;
        let timeout = self.config.conn.handshake_timeout;
        let channel = CmEventChannel::new()?;
        let mut id = CmId::new(&channel)?;
        id.resolve_addr(None, dst, timeout)?;
        let slot = self.new_slot(false)?;
        let pending = CmPending {
            id,
            channel,
            side: None,
            hs: CmHandshake::client(self.begin_turn(), timeout),
            peer_addr: Some(dst),
            notified: false,
        };
        self.start_cm_handshake(slot, pending)?;
        let id = self.slot(slot).id(slot);
        trace::hub_connecting(id, Some(dst));
        Ok(id)
    }

    /// Takes every connection request waiting on the CM listener.
    pub(super) fn accept_cm_all(&mut self) {
        loop {
            let Some(listening) = &self.cm_listener else {
                return;
            };
            match listening.channel.next_event() {
                Ok(Some(ev)) if ev.kind == CmEventKind::ConnectRequest => self.take_cm_request(ev),
                // Nothing else concerns a listening id but its device going away, which the
                // hub's queues report themselves.
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(e) => {
                    self.stats.handshakes_failed += 1;
                    self.events.push_back(RawHubEvent::HandshakeFailed {
                        peer: None,
                        error: e.into(),
                    });
                    return;
                }
            }
        }
    }

    /// Checks one request's hello, makes its queue pair on the hub's queues and accepts it;
    /// a request that fails a check (or finds the hub full) is rejected with the reason.
    fn take_cm_request(&mut self, mut request: CmEvent) {
        let Some(mut id) = request.request.take() else {
            return;
        };
        let peer_addr = id.peer_addr();
        let name = peer_addr.map_or_else(|| "?".into(), |a| a.to_string());
        // A hub proves no key over rdma_cm (`listen_cm` refused one): a keyed client is
        // refused as keyless.
        let checked =
            check_request(&self.hello(None), &self.config.conn, &request).map(|(_, peer)| peer);
        let refused = match checked {
            Err(reason) => Some((reason, Error::BadHandshake(reason))),
            Ok(_) => check_device(&self.endpoint, &id, &name)
                .err()
                .map(|e| (Reject::Resources, e)),
        };
        if let Some((reason, error)) = refused {
            let _ = id.reject(&encode_reject(reason));
            trace::handshake_failed(peer_addr, None, &error);
            self.stats.handshakes_failed += 1;
            self.events
                .push_back(RawHubEvent::HandshakeFailed { peer: None, error });
            return;
        }
        let peer = checked.expect("checked above");
        self.evict_oldest_pending();
        let slot = match self.new_slot(true) {
            Ok(slot) => slot,
            Err(e) => {
                let _ = id.reject(&encode_reject(Reject::Resources));
                trace::client_refused(&e);
                self.stats.refused += 1;
                return;
            }
        };
        let made = CmEventChannel::new()
            .map_err(Error::from)
            .and_then(|channel| {
                // Its own channel before the accept, so that its ESTABLISHED (and everything
                // after) lands there, not among the listener's requests.
                id.migrate(&channel)?;
                Ok(channel)
            });
        let channel = match made {
            Ok(c) => c,
            Err(e) => {
                let _ = id.reject(&encode_reject(Reject::Resources));
                self.abandon(slot);
                self.stats.handshakes_failed += 1;
                self.events.push_back(RawHubEvent::HandshakeFailed {
                    peer: None,
                    error: e,
                });
                return;
            }
        };
        let pending = CmPending {
            id,
            channel,
            side: None,
            hs: CmHandshake::accepted(self.clock.now(), self.config.conn.handshake_timeout),
            peer_addr,
            notified: false,
        };
        trace::handshake_started(peer_addr, Some(self.slot(slot).id(slot)));
        if self.start_cm_handshake(slot, pending).is_err() {
            self.stats.handshakes_failed += 1;
            return;
        }
        let params = read_params(&self.endpoint, &self.config.conn, &request.params);
        if let Err(e) = self.accept_cm(slot, peer, &params) {
            if let Resources::CmHandshake(p) = &mut self.slot_mut(slot).resources {
                let _ = p.id.reject(&encode_reject(Reject::Resources));
            }
            self.handshake_failed(slot, e);
        }
    }

    /// The queue pair of an accepted request, in RTS with the CM's attributes, and the accept
    /// with our hello.
    fn accept_cm(&mut self, slot: usize, peer: Hello, params: &ConnParams) -> Result<()> {
        let mut side = self.create_side(slot)?;
        side.peer = Some(peer);
        let tuning = tuning(&self.endpoint, &self.config.conn, Some(*params));
        let ours = encode_hello(&self.hello(None));
        let books = self.books_for(&peer);
        let Resources::CmHandshake(p) = &mut self.slot_mut(slot).resources else {
            unreachable!("a CM handshake under way");
        };
        let start = Instant::now();
        let ready = p.id.ready_qp(&mut side.qp, &tuning);
        let took = start.elapsed();
        let res = ready.and_then(|()| p.id.accept(&side.qp, params, &ours));
        p.side = Some(side);
        self.stats.connect_times.transitions += took;
        res?;
        // The peer may send once it has our answer.
        self.slot_mut(slot).core.learn_peer(books);
        Ok(())
    }

    fn start_cm_handshake(&mut self, slot: usize, pending: CmPending) -> Result<()> {
        self.watch_handshake(slot, pending.channel.as_fd())?;
        self.slot_mut(slot).resources = Resources::CmHandshake(Box::new(pending));
        self.handshake_started(slot);
        Ok(())
    }

    /// Moves the CM handshake of `slot` on with the events its channel holds.
    pub(super) fn advance_cm_handshake(&mut self, slot: usize) {
        let Resources::CmHandshake(mut pending) =
            std::mem::replace(&mut self.slot_mut(slot).resources, Resources::Retired)
        else {
            return;
        };
        loop {
            let ev = match pending.channel.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) => {
                    self.slot_mut(slot).resources = Resources::CmHandshake(pending);
                    self.handshake_failed(slot, e.into());
                    return;
                }
            };
            match self.cm_step(slot, &mut pending, &ev) {
                Ok(false) => {}
                Ok(true) => {
                    let CmPending {
                        id,
                        channel,
                        side,
                        peer_addr,
                        hs,
                        ..
                    } = *pending;
                    let side = side.expect("a connected handshake has its queue pair");
                    let peer = side.peer.expect("a connected handshake knows its peer");
                    // Later events (a disconnect) are the connection's news.
                    self.finish_handshake(
                        slot,
                        side,
                        Control::Cm(CmLink::new(channel, id)),
                        peer,
                        peer_addr,
                        hs.started(),
                    );
                    self.announce(slot, false);
                    self.after_linked(slot);
                    self.stream_ready(slot);
                    return;
                }
                Err(e) => {
                    self.slot_mut(slot).resources = Resources::CmHandshake(pending);
                    self.handshake_failed(slot, e);
                    return;
                }
            }
        }
        self.slot_mut(slot).resources = Resources::CmHandshake(pending);
    }

    /// One event of a CM handshake; whether the connection is established.
    fn cm_step(&mut self, slot: usize, p: &mut CmPending, ev: &CmEvent) -> Result<bool> {
        match p.hs.on_event(ev.kind, ev.status) {
            CmNext::ResolveRoute => {
                p.id.resolve_route(p.hs.left(self.clock.now()))?;
            }
            CmNext::Connect => {
                check_device(&self.endpoint, &p.id, &p.peer_name())?;
                let side = self.create_side(slot)?;
                let ours = encode_hello(&self.hello(None));
                let params = conn_params(&self.endpoint, &self.config.conn);
                let res = p.id.connect(&side.qp, &params, &ours);
                p.side = Some(side);
                res?;
            }
            CmNext::Answered => {
                // A server hello we cannot take: dropping the id refuses the connection.
                let (_, peer) = check_answer(&self.hello(None), &self.config.conn, ev)
                    .map_err(Error::BadHandshake)?;
                let books = self.books_for(&peer);
                let params = read_params(&self.endpoint, &self.config.conn, &ev.params);
                let tuning = tuning(&self.endpoint, &self.config.conn, Some(params));
                let side = p.side.as_mut().expect("connecting with a queue pair");
                side.peer = Some(peer);
                let start = Instant::now();
                let ready = p.id.ready_qp(&mut side.qp, &tuning);
                self.stats.connect_times.transitions += start.elapsed();
                ready?;
                self.slot_mut(slot).core.learn_peer(books);
                p.id.establish()?;
                return Ok(true);
            }
            CmNext::Established => return Ok(true),
            CmNext::Failed(at) => return Err(cm_failure(ev, &p.peer_name(), at.name())),
        }
        Ok(false)
    }
}
