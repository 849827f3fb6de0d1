//! A [`CmListener`] against clients written with verbs-core's `CmId` directly, which stop or
//! misbehave where `Endpoint::connect_cm` never would: a client that fails half-way is that
//! client's failure, not the listener's. Ignored on hosts; `cargo xtask test` runs them in
//! the VM.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

// Only its endpoint: the forged TCP hellos are bootstrap.rs's.
#[allow(dead_code)]
mod common;

use common::endpoint;
use rdmsg_transport::handshake::cm::{encode_request, CM_NONCE_LEN};
use rdmsg_transport::handshake::{Hello, VERSION};
use rdmsg_transport::{CmListener, Config, Connection, Endpoint, PathParams, Psk, QpAddress};
use rdmsg_verbs::{
    CmEvent, CmEventChannel, CmEventKind, CmId, CompletionQueue, ConnParams, Gid, ProtectionDomain,
    QpCaps, QueuePair,
};

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

fn cm_addr() -> SocketAddr {
    SocketAddr::new(rdmsg_testkit::device_ipv4().into(), 0)
}

/// A client driven by hand, up to the server's accept: its queue pair is in INIT.
struct RawClient {
    channel: CmEventChannel,
    id: CmId,
    qp: QueuePair,
    /// Kept for the queue pair.
    _cq: CompletionQueue,
    _pd: ProtectionDomain,
}

impl RawClient {
    /// The next event of the client's id, which must be `want`.
    fn next(&self, want: CmEventKind) -> CmEvent {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(ev) = self.channel.next_event().unwrap() {
                assert_eq!(ev.kind, want, "{ev:?}");
                return ev;
            }
            assert!(Instant::now() < until, "no {want:?}");
            thread::sleep(Duration::from_millis(2));
        }
    }

    /// Connects to `addr` with a valid hello (keyed with `key`) and waits for the accept.
    fn accepted(ep: &Endpoint, addr: SocketAddr, key: Option<&Psk>) -> Self {
        let channel = CmEventChannel::new().unwrap();
        let id = CmId::new(&channel).unwrap();
        let pd = ProtectionDomain::new(ep.context()).unwrap();
        let cq = CompletionQueue::new(ep.context(), 16, None).unwrap();
        let qp = QueuePair::new_rc(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let mut c = Self {
            channel,
            id,
            qp,
            _cq: cq,
            _pd: pd,
        };
        c.id.resolve_addr(None, addr, Duration::from_secs(5))
            .unwrap();
        c.next(CmEventKind::AddrResolved);
        c.id.resolve_route(Duration::from_secs(5)).unwrap();
        c.next(CmEventKind::RouteResolved);
        c.id.init_qp(&mut c.qp).unwrap();
        let hello = Hello {
            version: VERSION,
            addr: QpAddress {
                lid: 0,
                qpn: 0,
                psn: 0,
                gid: Gid([0; 16]),
            },
            mtu: ep.path_mtu(&PathParams::default()).bytes() as u32,
            buf_size: 4096,
            recv_depth: 64,
            initial_credits: 64,
            grant_slots: 4,
            reads: 1,
            max_read: 0,
        };
        let request = encode_request(&hello, key, &[3; CM_NONCE_LEN]);
        let params = ConnParams {
            responder_resources: 1,
            initiator_depth: 1,
            ..ConnParams::default()
        };
        c.id.connect(&c.qp, &params, &request).unwrap();
        c.next(CmEventKind::ConnectResponse);
        c
    }
}

/// What a listener's `accept` returned, and how many clients had failed their handshake by
/// then.
struct Accepted {
    got: rdmsg_transport::Result<Connection>,
    failed: u64,
}

/// Accepts on a thread, sending each result as it comes; stops at an error.
fn accepting(listener: CmListener, config: Config) -> mpsc::Receiver<Accepted> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || loop {
        let got = listener.accept(&config);
        let stop = got.is_err();
        let accepted = Accepted {
            got,
            failed: listener.failed_handshakes(),
        };
        if tx.send(accepted).is_err() || stop {
            return;
        }
    });
    rx
}

/// Issue 40, item 9: one rule for every listener. A client that is accepted and then goes
/// away before its side is done (its id destroyed: the CM rejects on its behalf) failed its
/// own handshake: `accept` skips it and goes on to the good client after it.
#[test]
#[ignore = "device"]
fn a_client_gone_before_established_is_skipped_and_counted() {
    let ep = endpoint();
    let listener = ep.listen_cm(cm_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = accepting(listener, Config::default());
    let gone = RawClient::accepted(&ep, addr, None);
    drop(gone);
    thread::sleep(Duration::from_millis(100));
    let mut client = ep.connect_cm(addr, &Config::default()).expect("connected");
    let first = accepted
        .recv_timeout(Duration::from_secs(10))
        .expect("an accept");
    let mut server = first
        .got
        .expect("the good client, not the gone one's error");
    assert_eq!(first.failed, 1, "the gone client is counted");
    client.send(b"good", true).unwrap();
    assert_eq!(&*server.recv_timeout(WAIT).unwrap().unwrap(), b"good");
}
