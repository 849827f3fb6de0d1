//! Sessions connected through the RDMA connection manager (`Endpoint::connect_cm`,
//! `CmListener`) instead of the TCP bootstrap: typed messages both ways (a large one by RDMA
//! read), a graceful close, a hello refused with its reason, nothing listening, and how fast
//! a killed peer is noticed, over rdma_cm and over TCP in the same run. Ignored on hosts;
//! `cargo xtask test` runs them in the VM.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rdmsg::msg::{Hub, HubEvent, Message, Session};
use rdmsg::transport::handshake::Reject;
use rdmsg::transport::{Config, Endpoint, Error as TError};
use rdmsg::HubConfig;
use rdmsg_examples::{Command as Cmd, Request};

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

fn cm_addr() -> SocketAddr {
    SocketAddr::new(rdmsg_testkit::device_ipv4().into(), 0)
}

fn recv_one<M: Message + rdmsg::msg::serde::de::DeserializeOwned>(s: &mut Session) -> M {
    s.recv_timeout(WAIT)
        .unwrap()
        .expect("a message within 10 s")
        .decode()
        .unwrap()
}

/// A session pair over rdma_cm: (accepted, connected).
fn cm_pair(server: Config, client: Config) -> (Session, Session) {
    let ep = Endpoint::open_default().expect("device");
    let listener = ep.listen_cm(cm_addr()).expect("listen_cm");
    let addr = listener.local_addr().expect("a bound address");
    assert_ne!(addr.port(), 0, "{addr}");
    let accepted = thread::spawn(move || listener.accept(&server).map(Session::new));
    let connected = Session::new(ep.connect_cm(addr, &client).expect("connect_cm"));
    (accepted.join().unwrap().expect("accept"), connected)
}

/// A message larger than a receive buffer (300 KB).
fn firmware() -> Cmd {
    Cmd::Firmware((0..300_000u32).map(|i| (i * 7) as u8).collect())
}

#[test]
#[ignore = "device"]
fn sessions_connected_through_the_connection_manager_carry_messages_both_ways() {
    let (mut a, mut b) = cm_pair(Config::default(), Config::default());
    // Solicited messages: each one wakes its receiver, asleep in the same thread's next
    // receive (an unsolicited one would wait for the sender's next wait, which in one thread
    // is never).
    for id in 0..500u64 {
        let r = Request {
            id,
            operands: vec![id as i64, -1],
        };
        b.send(&r).unwrap();
        assert_eq!(recv_one::<Request>(&mut a), r);
        a.send(&r).unwrap();
        assert_eq!(recv_one::<Request>(&mut b), r);
    }
    // Larger than a receive buffer: fragments or a rendezvous read, both over the CM's QP.
    let firmware = firmware();
    b.send(&firmware).unwrap();
    assert_eq!(recv_one::<Cmd>(&mut a), firmware);
    a.send(&firmware).unwrap();
    assert_eq!(recv_one::<Cmd>(&mut b), firmware);
    b.close().expect("a graceful close");
    let end = a.recv_timeout(WAIT).expect_err("the peer closed");
    assert!(end.is_peer_closed(), "{end}");
}

#[test]
#[ignore = "device"]
fn a_hello_beyond_the_servers_limits_is_refused_with_the_reason() {
    let ep = Endpoint::open_default().expect("device");
    let listener = ep.listen_cm(cm_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let strict = Config {
        max_peer_buf_size: 8192,
        ..Config::default()
    };
    let server = thread::spawn(move || {
        // The refused client is skipped; the next one is served.
        let conn = listener.accept(&strict).expect("the good client");
        let mut s = Session::new(conn);
        let r: Request = recv_one(&mut s);
        assert_eq!(r.id, 7);
    });
    let greedy = Config {
        buf_size: 65536,
        ..Config::default()
    };
    match ep.connect_cm(addr, &greedy) {
        Err(TError::Rejected(Reject::Limits(_))) => {}
        other => panic!("expected a refusal for the limits, got {other:?}"),
    }
    let mut good = Session::new(ep.connect_cm(addr, &Config::default()).unwrap());
    good.send(&Request {
        id: 7,
        operands: vec![],
    })
    .unwrap();
    server.join().unwrap();
}

#[test]
#[ignore = "device"]
fn nothing_listening_over_the_connection_manager_reads_as_connection_refused() {
    let ep = Endpoint::open_default().expect("device");
    let addr = SocketAddr::new(rdmsg_testkit::device_ipv4().into(), 1);
    let e = ep
        .connect_cm(addr, &Config::default())
        .expect_err("nothing listens on port 1");
    let text = e.to_string();
    assert!(
        matches!(&e, TError::Connect { source, .. } if source.kind() == std::io::ErrorKind::ConnectionRefused),
        "{text}"
    );
    assert!(text.contains("nothing listens there"), "{text}");
}

fn keyed(key: u8) -> Config {
    Config {
        psk: Some(rdmsg::transport::Psk::new([key; 32])),
        ..Config::default()
    }
}

/// A pre-shared key over rdma_cm: the server proves it in its accept, the client in its first
/// message over the queue pair, which the listener takes before it hands the connection out.
/// A wrong key is refused by the client (`BadKey`: the server's proof fails), a key on one side
/// only by the server with the reason (`KeyMissing`), and the listener goes on with the next
/// client.
#[test]
#[ignore = "device"]
fn a_pre_shared_key_is_proved_both_ways_over_the_connection_manager() {
    let ep = Endpoint::open_default().expect("device");
    let listener = ep.listen_cm(cm_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        // The wrong-key client and the keyless one are refused and skipped.
        let mut s = Session::new(listener.accept(&keyed(7)).unwrap());
        let r: Request = recv_one(&mut s);
        assert_eq!(r.id, 1, "the proof is not delivered as a message");
        s.send(&r).unwrap();
        // Larger than a receive buffer: read by the client through our queue pair, which
        // grants remote read only since the client's proof came in.
        s.send(&firmware()).unwrap();
        let _ = s.recv_timeout(WAIT);
        // A keyless listener refuses a keyed client.
        drop(listener.accept_timeout(&Config::default(), Some(Duration::from_secs(5))));
    });
    match ep.connect_cm(addr, &keyed(8)) {
        Err(TError::BadHandshake(Reject::BadKey)) => {}
        other => panic!("a wrong key: {other:?}"),
    }
    match ep.connect_cm(addr, &Config::default()) {
        Err(TError::Rejected(Reject::KeyMissing)) => {}
        other => panic!("no key where one is due: {other:?}"),
    }
    let mut good = Session::new(ep.connect_cm(addr, &keyed(7)).unwrap());
    let r = Request {
        id: 1,
        operands: vec![],
    };
    good.send(&r).unwrap();
    assert_eq!(recv_one::<Request>(&mut good), r);
    assert_eq!(recv_one::<Cmd>(&mut good), firmware());
    good.close().unwrap();
    match ep.connect_cm(addr, &keyed(7)) {
        Err(TError::Rejected(Reject::KeyMissing)) => {}
        other => panic!("a key the server has not: {other:?}"),
    }
    server.join().unwrap();
}

/// With `RDMSG_CM_CHILD=cm|tcp ADDR` in its environment, this test is the peer of
/// `a_killed_peer_is_noticed_over_cm_as_over_tcp`: it connects, says hello, and waits to be
/// killed. Without it, it does nothing.
#[test]
#[ignore = "device"]
fn killed_peer_child() {
    let Ok(how) = std::env::var("RDMSG_CM_CHILD") else {
        return;
    };
    let (way, addr) = how.split_once(' ').unwrap();
    let ep = Endpoint::open_default().unwrap();
    let conn = match way {
        "cm" => ep.connect_cm(addr, &Config::default()),
        _ => ep.connect(addr, &Config::default()),
    }
    .unwrap();
    let mut s = Session::new(conn);
    s.send(&Request {
        id: 1,
        operands: vec![],
    })
    .unwrap();
    thread::sleep(Duration::from_secs(60));
}

fn child(way: &str, addr: SocketAddr) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "killed_peer_child", "--nocapture"])
        .env("RDMSG_CM_CHILD", format!("{way} {addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// How long after a SIGKILL of the peer's process a receive here fails, with `accept` making
/// the connection the child makes.
fn notice_after_kill(
    way: &str,
    listen: impl FnOnce() -> (SocketAddr, thread::JoinHandle<Session>),
) -> Duration {
    let (addr, accepted) = listen();
    let mut peer = child(way, addr);
    let mut s = accepted.join().unwrap();
    let _: Request = recv_one(&mut s);
    let killed = Instant::now();
    peer.kill().unwrap();
    peer.wait().unwrap();
    let e = s
        .recv_timeout(Some(Duration::from_secs(30)))
        .expect_err("the peer is gone");
    let took = killed.elapsed();
    assert!(e.is_fatal() && !e.is_peer_closed(), "{way}: {e}");
    took
}

#[test]
#[ignore = "device"]
fn a_killed_peer_is_noticed_over_cm_as_over_tcp() {
    let ep = Endpoint::open_default().expect("device");
    let cm = notice_after_kill("cm", || {
        let listener = ep.listen_cm(cm_addr()).unwrap();
        let addr = listener.local_addr().unwrap();
        (
            addr,
            thread::spawn(move || Session::new(listener.accept(&Config::default()).unwrap())),
        )
    });
    let tcp = notice_after_kill("tcp", || {
        let listener = ep.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        (
            addr,
            thread::spawn(move || Session::new(listener.accept(&Config::default()).unwrap())),
        )
    });
    println!("stats killed peer noticed: rdma_cm {cm:?}, tcp {tcp:?}");
    assert!(cm < Duration::from_secs(5), "rdma_cm: {cm:?}");
    assert!(tcp < Duration::from_secs(5), "tcp: {tcp:?}");
}

/// Connect time, rdma_cm against the TCP bootstrap, in the same run: the median of 10
/// connections each (printed; the figures belong to the closing note, not to a bound).
#[test]
#[ignore = "device"]
fn connect_times_over_cm_and_over_tcp() {
    let ep = Endpoint::open_default().expect("device");
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let cm_listener = ep.listen_cm(cm_addr()).unwrap();
    let cm_at = cm_listener.local_addr().unwrap();
    let tcp_listener = ep.listen("127.0.0.1:0").unwrap();
    let tcp_at = tcp_listener.local_addr().unwrap();
    let rounds = 10;
    let server = thread::spawn(move || {
        for _ in 0..rounds {
            drop(cm_listener.accept(&Config::default()).unwrap());
            drop(tcp_listener.accept(&Config::default()).unwrap());
        }
    });
    let (mut cm, mut tcp) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let c = ep.connect_cm(cm_at, &Config::default()).unwrap();
        cm.push(t.elapsed());
        drop(c);
        let t = Instant::now();
        let c = ep.connect(tcp_at, &Config::default()).unwrap();
        tcp.push(t.elapsed());
        drop(c);
    }
    server.join().unwrap();
    println!(
        "stats connect time (median of {rounds}): rdma_cm {:?}, tcp {:?}",
        median(cm),
        median(tcp)
    );
}

/// A client that sends a valid request and then never completes the connection (no
/// `rdma_establish`) holds its own slot until its handshake timeout, not the listener: a good
/// client connecting meanwhile is served at once.
#[test]
#[ignore = "device"]
fn a_half_connected_client_does_not_stall_the_listener() {
    half_connected_client_beside_a_good_one(false);
}

/// With a key: a client that completes the connection but never proves the key (its first
/// message never comes) is not handed out, and with room for one waiting handshake the good
/// client's arrival evicts it.
#[test]
#[ignore = "device"]
fn a_client_that_never_proves_the_key_is_never_handed_out() {
    half_connected_client_beside_a_good_one(true);
}

/// A client that stops half-way (keyless: no RTU; keyed: connected, but no proof), and a good
/// one connecting meanwhile, which must be served at once.
fn half_connected_client_beside_a_good_one(keyed: bool) {
    use rdmsg::transport::handshake::cm::{encode_request, CM_NONCE_LEN};
    use rdmsg::transport::handshake::{Hello, VERSION};
    use rdmsg::transport::{PathParams, QpAddress};
    use rdmsg::verbs::{
        CmEventChannel, CmEventKind, CmId, CompletionQueue, ConnParams, Gid, ProtectionDomain,
        QpCaps, QpTuning, QueuePair,
    };

    let ep = Endpoint::open_default().expect("device");
    let listener = ep.listen_cm(cm_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let key = keyed.then(|| rdmsg::transport::Psk::new([9u8; 32]));
    let server_key = key.clone();
    let server = thread::spawn(move || {
        let config = Config {
            handshake_timeout: Duration::from_secs(20),
            // Keyed: room for one waiting handshake, so the good client evicts the silent one.
            max_pending_handshakes: if server_key.is_some() { 1 } else { 32 },
            psk: server_key,
            ..Config::default()
        };
        let t = Instant::now();
        let conn = listener.accept(&config).expect("the good client");
        (t.elapsed(), Session::new(conn))
    });

    // The half-connected client: a valid hello, then silence.
    let ch = CmEventChannel::new().unwrap();
    let mut id = CmId::new(&ch).unwrap();
    let next = |want: CmEventKind| {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(ev) = ch.next_event().unwrap() {
                assert_eq!(ev.kind, want, "{ev:?}");
                return ev;
            }
            assert!(Instant::now() < until, "no {want:?}");
            thread::sleep(Duration::from_millis(5));
        }
    };
    id.resolve_addr(None, addr, Duration::from_secs(5)).unwrap();
    next(CmEventKind::AddrResolved);
    id.resolve_route(Duration::from_secs(5)).unwrap();
    next(CmEventKind::RouteResolved);
    let pd = ProtectionDomain::new(ep.context()).unwrap();
    let cq = CompletionQueue::new(ep.context(), 16, None).unwrap();
    let mut qp = QueuePair::new_rc(&pd, &cq, &cq, QpCaps::default()).unwrap();
    id.init_qp(&mut qp).unwrap();
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
    let request = encode_request(&hello, key.as_ref(), &[3; CM_NONCE_LEN]);
    let params = ConnParams {
        responder_resources: 1,
        initiator_depth: 1,
        ..ConnParams::default()
    };
    id.connect(&qp, &params, &request).unwrap();
    next(CmEventKind::ConnectResponse);
    if keyed {
        // Connected, and silent: no proof.
        id.ready_qp(&mut qp, &QpTuning::default()).unwrap();
        id.establish().unwrap();
    }
    // ... and (keyless) no rdma_establish.

    let t = Instant::now();
    let good_config = Config {
        psk: key,
        ..Config::default()
    };
    let mut good = Session::new(ep.connect_cm(addr, &good_config).expect("served"));
    let connect = t.elapsed();
    good.send(&Request {
        id: 3,
        operands: vec![],
    })
    .unwrap();
    let (waited, mut s) = server.join().unwrap();
    let r: Request = recv_one(&mut s);
    assert_eq!(
        r.id, 3,
        "the good client's first message, not the silent one's"
    );
    println!(
        "stats good client beside a half-connected one (keyed {keyed}): connect {connect:?}, accept returned after {waited:?}"
    );
    assert!(connect < Duration::from_secs(5), "{connect:?}");
    drop(id);
}

/// A peer host that dies says nothing: no DREQ, no end of a stream. Its queue pair here stops
/// answering (moved to the error state behind its connection's back, which is then left
/// alone), and the liveness probes of the other side notice within about `keepalive`; a
/// peer that is merely idle (not driven at all) answers them from its device.
#[test]
#[ignore = "device"]
fn a_silent_peer_host_is_noticed_by_probes_and_an_idle_one_is_not() {
    let keepalive = Duration::from_secs(3);
    let config = Config {
        keepalive: Some(keepalive),
        ..Config::default()
    };
    let (mut a, mut b) = cm_pair(config.clone(), config);
    let r = Request {
        id: 1,
        operands: vec![],
    };
    b.send(&r).unwrap();
    assert_eq!(recv_one::<Request>(&mut a), r);
    // Idle for two keepalive limits, the peer not even driven: probed, and alive.
    let idle = a
        .recv_timeout(Some(2 * keepalive))
        .expect("an idle peer is not a dead one");
    assert!(idle.is_none());
    let probes = a.connection().stats().probes;
    assert!(probes >= 1, "probes {probes}");
    b.send(&r).unwrap();
    assert_eq!(recv_one::<Request>(&mut a), r);
    // Now the peer's side stops answering, as a dead host's would.
    let stopped = Instant::now();
    b.connection_mut().break_queue_pair().unwrap();
    let e = match a.recv_timeout(Some(Duration::from_secs(30))) {
        Err(e) => e,
        Ok(got) => panic!(
            "the peer is gone, yet after 30 s: {got:?}; {:?}",
            a.connection().stats()
        ),
    };
    let took = stopped.elapsed();
    println!(
        "stats silent peer host noticed after {took:?} (keepalive {keepalive:?}, {} probes)",
        a.connection().stats().probes
    );
    assert!(
        matches!(
            e,
            rdmsg::msg::Error::Transport(TError::Connection(
                rdmsg::transport::Failure::PeerVanished
            ))
        ),
        "{e}"
    );
    assert!(took < keepalive + Duration::from_secs(2), "{took:?}");
    drop(b);
}

/// The next event of `hub`, within 10 s.
fn hub_event(hub: &mut Hub) -> HubEvent {
    hub.recv_timeout(WAIT)
        .unwrap()
        .expect("a hub event within 10 s")
}

/// A hub listening through rdma_cm and TCP at once serves a session connected over each, and
/// another hub connected over rdma_cm: messages both ways, then graceful closes.
#[test]
#[ignore = "device"]
fn a_hub_serves_peers_connected_through_the_connection_manager_beside_tcp() {
    let ep = Endpoint::open_default().expect("device");
    let mut hub = Hub::new(&ep, HubConfig::default()).unwrap();
    let cm_at = hub.listen_cm(cm_addr()).unwrap();
    let tcp_at = hub.listen("127.0.0.1:0").unwrap();
    assert_ne!(cm_at.port(), 0);
    let clients = thread::spawn(move || {
        let ep = Endpoint::open_default().unwrap();
        let mut sessions = vec![
            Session::new(ep.connect_cm(cm_at, &Config::default()).unwrap()),
            Session::new(ep.connect(tcp_at, &Config::default()).unwrap()),
        ];
        // A hub on the client side too, connecting through the CM itself.
        let mut other = Hub::new(&ep, HubConfig::default()).unwrap();
        let to = other.connect_cm(cm_at).unwrap();
        assert!(
            matches!(hub_event(&mut other), HubEvent::Connected { peer, accepted: false } if peer == to)
        );
        for (i, s) in sessions.iter_mut().enumerate() {
            let r = Request {
                id: i as u64,
                operands: vec![],
            };
            s.send(&r).unwrap();
            assert_eq!(recv_one::<Request>(s), r, "echoed");
        }
        let r = Request {
            id: 7,
            operands: vec![7],
        };
        other.send(to, &r).unwrap();
        match hub_event(&mut other) {
            HubEvent::Message { peer, msg } if peer == to => {
                assert_eq!(msg.decode::<Request>().unwrap(), r)
            }
            ev => panic!("{ev:?}"),
        }
        other.close(to).unwrap();
        for s in sessions {
            s.close().unwrap();
        }
    });
    let (mut connected, mut echoed, mut closed) = (0, 0, 0);
    while closed < 3 {
        match hub_event(&mut hub) {
            HubEvent::Connected { accepted, .. } => {
                assert!(accepted);
                connected += 1;
            }
            HubEvent::Message { peer, msg } => {
                let r: Request = msg.decode().unwrap();
                hub.send(peer, &r).unwrap();
                echoed += 1;
            }
            HubEvent::Disconnected { failure, .. } => {
                assert_eq!(failure, rdmsg::transport::Failure::PeerClosed);
                closed += 1;
            }
            ev => panic!("{ev:?}"),
        }
    }
    clients.join().unwrap();
    assert_eq!((connected, echoed), (3, 3));
    println!("stats hub over rdma_cm: {:?}", hub.transport().stats());
}

/// A hub refuses a CM client's hello beyond its limits with the reason, and a peer host that
/// stops answering (the queue pairs of its connections failed behind their backs, as a dead
/// host's) is reported by the hub's probes: each of its connections ends as vanished within
/// about four thirds of the keepalive (the host silent for an interval, its probe unanswered
/// for one, each other connection's own probe for one more). A hub watches hosts, not
/// connections (see `Config::keepalive`): in this one-machine test every peer is on the one
/// host, so all of its connections are stopped.
#[test]
#[ignore = "device"]
fn a_hub_refuses_a_bad_cm_hello_and_notices_a_silent_cm_peer_host() {
    let ep = Endpoint::open_default().expect("device");
    let keepalive = Duration::from_secs(3);
    let mut config = HubConfig::default();
    config.conn.max_peer_buf_size = 8192;
    config.conn.keepalive = Some(keepalive);
    let mut hub = Hub::new(&ep, config).unwrap();
    let at = hub.listen_cm(cm_addr()).unwrap();
    // Clients connect from a thread: the hub answers only while it is driven.
    let client = Config {
        keepalive: Some(keepalive),
        ..Config::default()
    };
    let clients = thread::spawn(move || {
        let ep = Endpoint::open_default().unwrap();
        let refused = ep.connect_cm(
            at,
            &Config {
                buf_size: 65536,
                ..Config::default()
            },
        );
        assert!(
            matches!(refused, Err(TError::Rejected(Reject::Limits(_)))),
            "{refused:?}"
        );
        let quiet = Session::new(ep.connect_cm(at, &client).unwrap());
        let silent = Session::new(ep.connect_cm(at, &client).unwrap());
        (quiet, silent)
    });
    let (mut peers, mut failed) = (Vec::new(), 0);
    while peers.len() < 2 {
        match hub_event(&mut hub) {
            HubEvent::Connected { peer, .. } => peers.push(peer),
            HubEvent::HandshakeFailed { peer: None, .. } => failed += 1,
            ev => panic!("{ev:?}"),
        }
    }
    assert_eq!(failed, 1, "the refused hello");
    let (mut quiet, mut silent) = clients.join().unwrap();
    // Idle for two keepalive limits, the peers not even driven: alive (their device answers).
    assert!(hub
        .recv_timeout(Some(2 * keepalive))
        .expect("an idle host is not a dead one")
        .is_none());
    let stopped = Instant::now();
    quiet.connection_mut().break_queue_pair().unwrap();
    silent.connection_mut().break_queue_pair().unwrap();
    let mut gone = Vec::new();
    while gone.len() < 2 {
        match hub.recv_timeout(Some(Duration::from_secs(30))).unwrap() {
            Some(HubEvent::Disconnected { peer, failure }) => {
                assert_eq!(failure, rdmsg::transport::Failure::PeerVanished);
                assert!(peers.contains(&peer));
                gone.push(stopped.elapsed());
            }
            other => panic!("the silent host was not noticed in 30 s: {other:?}"),
        }
    }
    println!(
        "stats hub noticed a silent rdma_cm peer host after {gone:?} (keepalive {keepalive:?})"
    );
    let took = gone.iter().max().copied().unwrap();
    assert!(
        took < keepalive * 4 / 3 + Duration::from_secs(2),
        "{took:?}"
    );
    drop((quiet, silent));
}

/// On tokio: an `AsyncListener` through rdma_cm serves an `AsyncSession::connect_cm` client
/// with a pre-shared key and an `AsyncHub` connecting through the CM.
#[test]
#[ignore = "device"]
fn async_sessions_and_hubs_connect_through_the_connection_manager() {
    use rdmsg::msg::SessionConfig;
    use rdmsg::tokio::{AsyncHub, AsyncListener, AsyncSession};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ep = Endpoint::open_default().expect("device");
        let listener =
            AsyncListener::bind_cm(&ep, cm_addr(), keyed(5), SessionConfig::default()).unwrap();
        let at = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let s = listener.accept().await.unwrap();
            let r: Request = s.recv().await.unwrap().decode().unwrap();
            s.send(&r).await.unwrap();
            let end = s.recv().await.expect_err("the client closes");
            assert!(end.is_peer_closed(), "{end}");
        });
        let client = AsyncSession::connect_cm(&ep, at, keyed(5), SessionConfig::default())
            .await
            .unwrap();
        let r = Request {
            id: 3,
            operands: vec![1, 2],
        };
        client.send(&r).await.unwrap();
        let back: Request = client.recv().await.unwrap().decode().unwrap();
        assert_eq!(back, r);
        client.close().await.unwrap();
        server.await.unwrap();
        // A hub proves no key over rdma_cm: it connects to a keyless listener.
        let plain =
            AsyncListener::bind_cm(&ep, cm_addr(), Config::default(), SessionConfig::default())
                .unwrap();
        let plain_at = plain.local_addr().unwrap();
        let served = tokio::spawn(async move {
            let s = plain.accept().await.unwrap();
            let r: Request = s.recv().await.unwrap().decode().unwrap();
            s.send(&r).await.unwrap();
            let _ = s.recv().await;
        });
        let hub = AsyncHub::new(Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let peer = hub.connect_cm(plain_at).await.unwrap();
        hub.send(peer, &r).await.unwrap();
        loop {
            match hub.recv().await.unwrap() {
                HubEvent::Message { msg, .. } => {
                    assert_eq!(msg.decode::<Request>().unwrap(), r);
                    break;
                }
                HubEvent::Connected { .. } => {}
                ev => panic!("{ev:?}"),
            }
        }
        hub.close(peer).unwrap();
        let ev = hub.recv().await.unwrap();
        assert!(matches!(ev, HubEvent::Disconnected { .. }), "{ev:?}");
        served.await.unwrap();
    });
}
