//! Connections made by the RDMA connection manager (rdma_cm) instead of the TCP bootstrap:
//! [`Endpoint::connect_cm`] and [`CmListener`].
//!
//! The handshake is the TCP one reshaped for private data ([`crate::handshake::cm`]): the
//! client's hello rides in the connection request, the server's in the accept, a refusal's
//! reason in the reject; the queue pair's number, PSNs and path are the CM's. The server
//! creates nothing for a client before its hello passed every check, as over TCP. Afterwards
//! each connection keeps its id alone on an event channel of its own, watched beside its
//! completion channel ([`crate::control`]): a peer's disconnect is what the end of the
//! bootstrap stream is on TCP. With [`Config::psk`] the key is proved as
//! [`crate::handshake::cm`] describes: the server in its accept, the client in its first
//! message over the queue pair, which the listener takes before it hands the connection out.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::Instant;

use rdmsg_verbs::{
    deadline_after, CmEvent, CmEventChannel, CmEventKind, CmId, ConnParams, QpTuning, ReadyWatch,
    REJECT_INVALID_SERVICE,
};

use crate::config::Config;
use crate::connection::Connection;
use crate::control::{CmLink, Control};
use crate::endpoint::Endpoint;
use crate::error::{Error, Result, TimedOut};
use crate::failed::FailedHandshakes;
use crate::handshake::cm::{
    check_accept, check_key_flag, decode_hello, decode_reject, encode_accept, encode_reject,
    encode_request, Ends, ProofCheck, CM_NONCE_LEN,
};
use crate::handshake::{Hello, Reject};
use crate::handshake_set::{to_evict, Bound, Waiting};
use crate::setup::{our_hello, Setup};

mod listener;
pub(crate) mod machine;

use machine::{CmHandshake, CmNext};

pub use listener::CmListener;

/// What the handshake over rdma_cm waits for when it runs out of time.
pub(crate) const WAIT_CM: &str =
    "for the connection manager (address, route, or the peer's answer): \
                       Config::handshake_timeout bounds it";

/// The first address `addr` resolves to, IPv4 first (rxe and most RoCE set-ups route it).
pub(crate) fn socket_addr(addr: &(impl ToSocketAddrs + fmt::Debug)) -> Result<SocketAddr> {
    let fail = |source| Error::Connect {
        addr: format!("{addr:?}"),
        source,
    };
    let all: Vec<SocketAddr> = addr.to_socket_addrs().map_err(fail)?.collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| fail(io::Error::new(io::ErrorKind::NotFound, "no address")))
}

/// For the hub, which proves no key over rdma_cm.
pub(crate) fn refuse_psk(config: &Config) -> Result<()> {
    if config.psk.is_some() {
        return Err(Error::Unsupported {
            what: "a hub's pre-shared key over rdma_cm",
            instead: "listen or connect through the TCP bootstrap (RawHub::listen / connect) \
                      to use Config::psk, or use Endpoint::connect_cm and CmListener, which \
                      prove it",
        });
    }
    Ok(())
}

/// A fresh nonce for CM private data.
fn cm_nonce() -> Result<[u8; CM_NONCE_LEN]> {
    let full = crate::setup::nonce()?;
    let mut n = [0; CM_NONCE_LEN];
    n.copy_from_slice(&full[..CM_NONCE_LEN]);
    Ok(n)
}

/// What rdmsg sets itself on a CM queue pair: the transport's path parameters, as the TCP
/// bootstrap sets them.
pub(crate) fn tuning(endpoint: &Endpoint, config: &Config, reads: Option<ConnParams>) -> QpTuning {
    QpTuning {
        reads,
        min_rnr_timer: config.path.min_rnr_timer,
        path_mtu: Some(endpoint.path_mtu(&config.path)),
        timeout: Some(config.path.timeout),
        retry_cnt: Some(config.path.retry_cnt),
        rnr_retry: Some(config.path.rnr_retry),
    }
}

pub(crate) fn conn_params(endpoint: &Endpoint, config: &Config) -> ConnParams {
    ConnParams {
        responder_resources: endpoint.reads_served(),
        initiator_depth: endpoint.reads_served(),
        retry_count: config.path.retry_cnt.min(7),
        rnr_retry_count: config.path.rnr_retry.min(7),
    }
}

/// The IP address of a CM id's end, for the key's transcript (unspecified where the CM
/// reports none).
fn ip_of(addr: Option<SocketAddr>) -> IpAddr {
    addr.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip())
}

/// The device the CM bound `id` to must be the endpoint's: the queue pair is created there.
pub(crate) fn check_device(endpoint: &Endpoint, id: &CmId, addr: &str) -> Result<()> {
    let ours = endpoint.context().name();
    match id.device_name() {
        Some(name) if name == ours && id.port_num() == endpoint.port() => Ok(()),
        resolved => Err(Error::CmDevice {
            addr: addr.to_owned(),
            resolved: resolved.unwrap_or_else(|| "no device".into()),
            port: id.port_num(),
            ours: ours.to_owned(),
            our_port: endpoint.port(),
        }),
    }
}

/// Checks the peer's hello against ours and our limits; the send buffers to register.
fn check_peer(ours: &Hello, config: &Config, peer: &Hello) -> Result<u32, Reject> {
    ours.check_peer(peer)?;
    config.limits().check(peer)
}

/// The checks of a connection request, for a listener or a hub whose hello is `ours`: the
/// client's hello (decoded first, so that a foreign client reads as one), a key flag that
/// agrees with ours and, keyed, the nonce; the read resources our reads and liveness probes
/// need; then ours against its hello, and our limits. The send buffers to register, and the
/// client's hello.
pub(crate) fn check_request(
    ours: &Hello,
    config: &Config,
    request: &CmEvent,
) -> Result<(u32, Hello), Reject> {
    let keyed = config.psk.is_some();
    let data = &request.private_data;
    let peer = decode_hello(data, request.peer_qp_num)?;
    check_key_flag(data, keyed)?;
    if keyed && data.len() < crate::handshake::cm::CM_KEYED_REQUEST_LEN {
        return Err(Reject::BadValue("nonce"));
    }
    check_reads(&request.params)?;
    Ok((check_peer(ours, config, &peer)?, peer))
}

/// The checks of a server's answer (its accept) by a client whose hello is `ours`: the
/// server's hello, a key flag that agrees with ours, ours against its hello, and our limits.
/// The send buffers to register, and the server's hello.
pub(crate) fn check_answer(
    ours: &Hello,
    config: &Config,
    answer: &CmEvent,
) -> Result<(u32, Hello), Reject> {
    let peer = decode_hello(&answer.private_data, answer.peer_qp_num)?;
    check_key_flag(&answer.private_data, config.psk.is_some())?;
    check_reads(&answer.params)?;
    Ok((check_peer(ours, config, &peer)?, peer))
}

/// The peer must serve at least one read of ours, on either side: our liveness probes are
/// reads, and one the peer does not serve would block the send queue behind it and read as
/// the peer vanished.
fn check_reads(peer: &ConnParams) -> Result<(), Reject> {
    if peer.initiator_depth == 0 {
        return Err(Reject::BadValue("read resources"));
    }
    Ok(())
}

/// The reads each way over a CM connection, on either side, from the peer's parameters (a
/// request's or an accept's, as the CM reports them: from our side): we issue no more reads
/// than the peer serves and serve what we announced, each within this device's limits
/// whatever the peer says.
pub(crate) fn read_params(endpoint: &Endpoint, config: &Config, peer: &ConnParams) -> ConnParams {
    reads_within(conn_params(endpoint, config), peer)
}

/// `ours`, issuing no more reads than `peer` serves.
fn reads_within(ours: ConnParams, peer: &ConnParams) -> ConnParams {
    ConnParams {
        initiator_depth: ours.initiator_depth.min(peer.initiator_depth),
        ..ours
    }
}

/// Waits for the next event of the only id on `channel`, until `deadline`.
fn next_event(channel: &CmEventChannel, watch: &ReadyWatch, deadline: Instant) -> Result<CmEvent> {
    let started = Instant::now();
    loop {
        if let Some(ev) = channel.next_event()? {
            return Ok(ev);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(TimedOut {
                op: "connecting over rdma_cm",
                waiting_for: WAIT_CM,
                after: started.elapsed(),
            }));
        }
        watch.wait(Some(left))?;
    }
}

/// A CM event that ends a connection in the making, as the error it stands for.
pub(crate) fn cm_failure(ev: &CmEvent, addr: &str, stage: &'static str) -> Error {
    match ev.kind {
        CmEventKind::Rejected => match decode_reject(&ev.private_data) {
            Some(reason) => Error::Rejected(reason),
            None if ev.status == REJECT_INVALID_SERVICE => Error::Connect {
                addr: addr.to_owned(),
                source: io::ErrorKind::ConnectionRefused.into(),
            },
            None => Error::Cm {
                addr: addr.to_owned(),
                stage,
                detail: format!(
                    "rejected without an rdmsg reason (IB CM reason {})",
                    ev.status
                ),
            },
        },
        CmEventKind::Unreachable
        | CmEventKind::ConnectError
        | CmEventKind::AddrError
        | CmEventKind::RouteError
            if ev.status < 0 =>
        {
            Error::Connect {
                addr: addr.to_owned(),
                source: io::Error::from_raw_os_error(-ev.status),
            }
        }
        kind => Error::Cm {
            addr: addr.to_owned(),
            stage,
            detail: format!("{kind:?} (status {})", ev.status),
        },
    }
}

/// Connecting and listening through the connection manager.
impl Endpoint {
    /// Connects to a [`CmListener`] at `addr` (an IP address and port) through the RDMA
    /// connection manager: the address and route are resolved to this endpoint's device,
    /// and no TCP connection is made. Within [`Config::handshake_timeout`] in all.
    pub fn connect_cm(
        &self,
        addr: impl ToSocketAddrs + fmt::Debug,
        config: &Config,
    ) -> Result<Connection> {
        config.check()?;
        let dst = socket_addr(&addr)?;
        let name = dst.to_string();
        let started = Instant::now();
        let mut hs = CmHandshake::client(started, config.handshake_timeout);
        let channel = CmEventChannel::new()?;
        let watch = ReadyWatch::new()?;
        watch.add(channel.as_fd(), 0)?;
        let mut id = CmId::new(&channel)?;
        id.resolve_addr(None, dst, hs.left(started))?;
        let ours = our_hello(self, config, None);
        let request = encode_request(&ours, config.psk.as_ref(), &cm_nonce()?);
        let mut made = None;
        // The machine says what each event calls for; the verbs are done here.
        let (answer, mut setup) = loop {
            let ev = next_event(&channel, &watch, hs.deadline())?;
            match hs.on_event(ev.kind, ev.status) {
                CmNext::ResolveRoute => id.resolve_route(hs.left(Instant::now()))?,
                CmNext::Connect => {
                    check_device(self, &id, &name)?;
                    let setup = Setup::new(self, config)?;
                    id.connect(&setup.qp, &conn_params(self, config), &request)?;
                    made = Some(setup);
                }
                CmNext::Answered => break (ev, made.expect("connected with a queue pair")),
                CmNext::Established => unreachable!("a client's handshake is answered"),
                CmNext::Failed(at) => return Err(cm_failure(&ev, &name, at.name())),
            }
        };
        // A server hello (or proof) we cannot take: dropping the id refuses the connection.
        let (send_buffers, peer) =
            check_answer(&ours, config, &answer).map_err(Error::BadHandshake)?;
        let proof = config
            .psk
            .as_ref()
            .map(|k| {
                check_accept(
                    k,
                    &request,
                    &answer.private_data,
                    &Ends {
                        client_qpn: setup.qp.qp_num(),
                        server_qpn: answer.peer_qp_num,
                        client_ip: ip_of(id.local_addr()),
                        server_ip: dst.ip(),
                    },
                )
            })
            .transpose()
            .map_err(Error::BadHandshake)?;
        setup.set_send_buffers(send_buffers);
        setup.register_send_buffers(self, &peer)?;
        let params = read_params(self, config, &answer.params);
        id.ready_qp(&mut setup.qp, &tuning(self, config, Some(params)))?;
        id.establish()?;
        let mut conn = Connection::establish(
            self,
            setup,
            Control::Cm(CmLink::new(channel, id)),
            config,
            peer,
        )?;
        if let Some(proof) = proof {
            // Our proof of the key goes first: the listener takes it before anything else.
            conn.send(&proof, true)?;
            // Until the listener has taken it, its queue pair grants no remote access, and a
            // liveness probe (a zero-length read) would fail the connection: the first goes
            // once a listener with our handshake_timeout has taken the proof or dropped us.
            conn.probes_from(deadline_after(Instant::now(), config.handshake_timeout));
        }
        Ok(conn)
    }

    /// Listens for connection requests through the RDMA connection manager on `addr` (an IP
    /// address of this endpoint's device, or a wildcard, and a port; port 0 picks one).
    pub fn listen_cm(&self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<CmListener> {
        let bind = socket_addr(&addr).map_err(|e| match e {
            Error::Connect { addr, source } => Error::Listen { addr, source },
            e => e,
        })?;
        let channel = CmEventChannel::new()?;
        let mut id = CmId::new(&channel)?;
        let listen = |id: &mut CmId| -> rdmsg_verbs::Result<()> {
            id.bind(bind)?;
            id.listen(128)
        };
        listen(&mut id).map_err(|e| match e {
            rdmsg_verbs::Error::Cm { source, .. } => Error::Listen {
                addr: format!("{addr:?}"),
                source,
            },
            e => e.into(),
        })?;
        CmListener::new(self.clone(), channel, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(serves: u8, asks: u8) -> ConnParams {
        // As the CM reports a peer's: from our side.
        ConnParams {
            initiator_depth: serves,
            responder_resources: asks,
            ..ConnParams::default()
        }
    }

    #[test]
    fn a_peer_that_serves_no_read_is_refused_on_either_side() {
        // A request's and an answer's parameters are checked by the same rule: a peer that
        // serves no read would leave our first liveness probe blocking the send queue.
        assert_eq!(
            check_reads(&params(0, 16)),
            Err(Reject::BadValue("read resources"))
        );
        // One that asks for none of ours is fine: it issues no reads.
        assert_eq!(check_reads(&params(1, 0)), Ok(()));
    }

    #[test]
    fn reads_follow_the_peer_only_within_our_own_limits() {
        let ours = params(16, 16);
        // A server that says it serves 255 reads does not raise ours beyond our device's.
        let capped = reads_within(ours, &params(255, 255));
        assert_eq!(
            (capped.initiator_depth, capped.responder_resources),
            (16, 16)
        );
        // One that serves 2 gets at most 2 of ours in flight; we still serve what we said.
        let fewer = reads_within(ours, &params(2, 64));
        assert_eq!((fewer.initiator_depth, fewer.responder_resources), (2, 16));
    }
}
