//! Connections on a real device (rxe0 in the test VM), bootstrapped over TCP on loopback.
//! Ignored on hosts; `cargo xtask test` runs them inside the VM. A missing device fails them.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use testkit::{fd_count, rnr_counters};
use transport::handshake::{Hello, Reject, HELLO_LEN};
use transport::{Config, Connection, Endpoint, Error, Failure, Listener};

fn endpoint() -> Endpoint {
    Endpoint::open_default().unwrap_or_else(|e| panic!("device test needs an RDMA device: {e}"))
}

/// A listener on an ephemeral loopback port and a connection to it, made with `server` and
/// `client` configs. Returns (server side, client side, listener).
fn pair_with(server: Config, client: Config) -> (Connection, Connection, Listener) {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client_ep = ep.clone();
    let c = thread::spawn(move || client_ep.connect(addr, &client).unwrap());
    let s = listener.accept(&server).unwrap();
    (s, c.join().unwrap(), listener)
}

fn pair() -> (Connection, Connection, Listener) {
    pair_with(Config::default(), Config::default())
}

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

#[test]
#[ignore = "device"]
fn connects_over_tcp_and_talks_both_ways() {
    let (mut s, mut c, _l) = pair();
    assert_eq!(s.peer().addr.qpn, c.qp_num());
    let big = vec![0xab; c.max_message()];
    c.send(b"hello", false).unwrap(); // inline
    c.send(&big, true).unwrap(); // from a send buffer, solicited
    let m1 = s.recv_timeout(WAIT).unwrap().unwrap();
    let m2 = s.recv_timeout(WAIT).unwrap().unwrap();
    assert_eq!(&*m1, b"hello");
    assert_eq!(&*m2, &big[..]);
    s.send(b"world", true).unwrap();
    assert_eq!(&*c.recv_timeout(WAIT).unwrap().unwrap(), b"world");
    let too_big = vec![0; c.max_message() + 1];
    assert!(matches!(
        c.send(&too_big, true),
        Err(Error::TooLarge { len, max }) if len == max + 1
    ));
    assert_eq!(c.stats().sent_inline, 1);
    assert!(s
        .recv_timeout(Some(Duration::from_millis(50)))
        .unwrap()
        .is_none());
    drop((m1, m2));
    let p = s.pool_stats();
    assert_eq!(p.free + p.posted + p.lent, p.total);
}

/// 100k messages through a consumer that holds up to 48 messages and pauses now and then:
/// the sender waits for credits many times, yet no RNR NAK happens, nothing is lost or
/// reordered, and every buffer is back at the end.
#[test]
#[ignore = "device"]
fn hundred_thousand_messages_through_a_slow_consumer_without_rnr() {
    let n: u64 = std::env::var("RDMSG_TEST_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let ep = endpoint();
    let device = ep.context().name().to_owned();
    let before = rnr_counters(&device, ep.port());
    let fds_before = fd_count();
    let (mut rx, mut tx, listener) = pair();
    let started = Instant::now();
    let sender = thread::spawn(move || {
        let mut payload = [0u8; 256];
        for seq in 0..n {
            let len = 8 + (seq as usize * 37) % 248;
            payload[..8].copy_from_slice(&seq.to_le_bytes());
            // Only every 64th message and the last wake the receiver.
            let solicited = seq % 64 == 63 || seq == n - 1;
            tx.send(&payload[..len], solicited).unwrap();
        }
        tx
    });
    let mut held = VecDeque::new();
    for seq in 0..n {
        let m = rx.recv_timeout(WAIT).unwrap().expect("message within 10 s");
        let got = u64::from_le_bytes(m[..8].try_into().unwrap());
        assert_eq!(got, seq, "lost, duplicated or reordered");
        assert_eq!(m.len(), 8 + (seq as usize * 37) % 248);
        held.push_back(m);
        if held.len() > 48 {
            // Release in bursts, like a consumer working through a batch.
            held.drain(..40);
        }
        if seq % 10_000 == 0 {
            println!("progress: {seq} after {:?}", started.elapsed());
            thread::sleep(Duration::from_millis(20));
        }
    }
    drop(held);
    let tx = sender.join().unwrap();
    let elapsed = started.elapsed();
    // Drive the receiver once more so that the returned buffers are collected and re-posted.
    assert!(rx
        .recv_timeout(Some(Duration::from_millis(10)))
        .unwrap()
        .is_none());
    let pool = rx.pool_stats();
    let after = rnr_counters(&device, ep.port());
    let (ts, rs, w) = (tx.stats(), rx.stats(), rx.wait_stats());
    println!(
        "stats 100k: {n} messages in {elapsed:?} ({:.0}/s); sender credit_waits={} slot_waits={} forced_solicited={} inline={}; receiver grants_sent={} refills={} wakeups={} per_wakeup={:.1}; pool {pool:?}; rnr before={before:?} after={after:?}",
        n as f64 / elapsed.as_secs_f64(),
        ts.credit_waits,
        ts.send_slot_waits,
        ts.forced_solicited,
        ts.sent_inline,
        rs.grants_sent,
        rs.refills,
        w.wakeups,
        w.completions_per_wakeup(),
    );
    assert_eq!(after, before, "receiver-not-ready NAKs happened");
    assert!(
        ts.credit_waits > 0,
        "the consumer was never slow enough to block the sender"
    );
    assert_eq!(pool.lent, 0);
    assert_eq!(pool.free + pool.posted, pool.total);
    drop((rx, tx, listener));
    assert_eq!(fd_count(), fds_before, "file descriptors leaked");
}

/// The negative control for the test above: the counters do move when a receiver is not ready.
#[test]
#[ignore = "device"]
fn rnr_counters_see_a_receiver_that_is_not_ready() {
    let mut p = testkit::Pair::new(1);
    let device = p.ctx.name().to_owned();
    let before = rnr_counters(&device, testkit::PORT);
    p.send(b"one", false, None);
    p.send(b"two", false, None); // finds no receive buffer: RNR NAK, retried later
    p.reap_sends(1);
    thread::sleep(Duration::from_millis(20));
    let recv =
        p.pd.register(testkit::BUF, verbs_core::Access::LOCAL_WRITE)
            .unwrap();
    p.b.post_recv([recv]).unwrap();
    p.reap_sends(1);
    let after = rnr_counters(&device, testkit::PORT);
    println!("stats rnr control: before={before:?} after={after:?}");
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "{before:?} -> {after:?}"
    );
}

#[test]
#[ignore = "device"]
fn bad_peers_are_rejected_without_disturbing_other_connections() {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = Config {
        handshake_timeout: Duration::from_millis(300),
        ..Config::default()
    };
    let client_ep = ep.clone();
    let good = thread::spawn(move || client_ep.connect(addr, &Config::default()).unwrap());
    let mut established = listener.accept(&cfg).unwrap();
    let mut good = good.join().unwrap();

    // Garbage: told why, and the accept fails with a typed error.
    let junk = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[b'x'; HELLO_LEN]).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let err = listener.accept(&cfg).unwrap_err();
    assert!(
        matches!(err, Error::BadHandshake(Reject::BadMagic)),
        "{err:?}"
    );
    let reply = junk.join().unwrap();
    assert_eq!(reply.last(), Some(&Reject::BadMagic.code()), "{reply:?}");

    // Another version.
    let v2 = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(&transport::handshake::MAGIC);
        hello[9] = 2;
        s.write_all(&hello).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let err = listener.accept(&cfg).unwrap_err();
    assert!(
        matches!(err, Error::BadHandshake(Reject::Version { peer: 2, .. })),
        "{err:?}"
    );
    v2.join().unwrap();

    // A peer that connects and says nothing: the handshake times out.
    let stalled = TcpStream::connect(addr).unwrap();
    let t = Instant::now();
    let err = listener.accept(&cfg).unwrap_err();
    assert!(matches!(err, Error::Bootstrap { .. }), "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(2));
    drop(stalled);

    // Our own hello rejected by a peer (path MTU mismatch), seen from the connector.
    let other_mtu = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut theirs = [0u8; HELLO_LEN];
        s.read_exact(&mut theirs).unwrap();
        let mut h = Hello::decode(&theirs).unwrap();
        h.mtu = if h.mtu == 4096 { 1024 } else { 4096 };
        s.write_all(&h.encode()).unwrap();
        let mut verdict = [0u8; 1];
        s.read_exact(&mut verdict).unwrap();
        verdict[0]
    });
    let err = listener.accept(&cfg).unwrap_err();
    assert!(matches!(err, Error::BadHandshake(Reject::Mtu)), "{err:?}");
    assert_eq!(other_mtu.join().unwrap(), Reject::Mtu.code());

    // The established connection never noticed.
    good.send(b"still here", true).unwrap();
    assert_eq!(
        &*established.recv_timeout(WAIT).unwrap().unwrap(),
        b"still here"
    );
    established.send(b"ack", true).unwrap();
    assert_eq!(&*good.recv_timeout(WAIT).unwrap().unwrap(), b"ack");
}

#[test]
#[ignore = "device"]
fn graceful_close_delivers_everything_then_reports_it() {
    let (mut rx, mut tx, _l) = pair();
    for i in 0..10u8 {
        tx.send(&[i], false).unwrap();
    }
    tx.close().unwrap();
    for i in 0..10u8 {
        let m = rx
            .recv_timeout(WAIT)
            .unwrap()
            .expect("delivered before the close");
        assert_eq!(&*m, &[i]);
    }
    let err = rx.recv_timeout(WAIT).unwrap_err();
    assert!(
        matches!(err, Error::Connection(Failure::PeerClosed)),
        "{err:?}"
    );
}

/// A peer dropped without closing (as when its process dies): a receiver asleep in `recv`,
/// solicited-only, learns it within a bounded time instead of sleeping forever.
#[test]
#[ignore = "device"]
fn a_vanished_peer_wakes_a_sleeping_receiver() {
    let (mut rx, tx, _l) = pair();
    let dropper = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        drop(tx);
        t
    });
    let err = rx.recv_timeout(WAIT).unwrap_err();
    let noticed = Instant::now();
    let dropped = dropper.join().unwrap();
    let latency = noticed - dropped;
    println!("stats vanished peer: noticed after {latency:?}");
    assert!(
        matches!(err, Error::Connection(Failure::PeerVanished)),
        "{err:?}"
    );
    assert!(latency < Duration::from_secs(2));
    let p = rx.pool_stats();
    assert_eq!(p.posted, 0, "the error flushed every receive back");
    assert_eq!(p.free, p.total);
}

/// A receiver whose consumer holds every buffer blocks the sender; when another thread drops
/// the handles, the receiver (asleep in `recv`) re-posts them and the grant wakes the sender.
#[test]
#[ignore = "device"]
fn buffers_dropped_on_another_thread_unblock_the_sender() {
    let small = Config {
        recv_depth: 4,
        ..Config::default()
    };
    let (mut rx, mut tx, _l) = pair_with(small.clone(), small);
    for i in 0..4u8 {
        tx.send(&[i], i == 3).unwrap();
    }
    let held: Vec<_> = (0..4)
        .map(|_| rx.recv_timeout(WAIT).unwrap().unwrap())
        .collect();
    let sender = thread::spawn(move || {
        let t = Instant::now();
        tx.send(b"fifth", true).unwrap();
        (t.elapsed(), tx)
    });
    let releaser = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        drop(held);
    });
    let m = rx.recv_timeout(WAIT).unwrap().expect("the fifth message");
    assert_eq!(&*m, b"fifth");
    releaser.join().unwrap();
    let (waited, tx) = sender.join().unwrap();
    assert!(
        waited >= Duration::from_millis(250),
        "sent without a credit? {waited:?}"
    );
    assert_eq!(tx.stats().credit_waits, 1);
    assert!(rx.wait_stats().external_wakeups >= 1);
}

/// A device fault behind the connection's back: the queue pair moved to the error state. That
/// side reports `QpError` with every receive buffer flushed home; the peer learns it from the
/// end of the bootstrap stream within 2 s, instead of waiting on a queue pair that no longer
/// answers.
#[test]
#[ignore = "device"]
fn a_queue_pair_forced_into_error_fails_both_sides_promptly() {
    let (mut a, mut b, _l) = pair();
    a.send(b"before", true).unwrap();
    assert_eq!(&*b.recv_timeout(WAIT).unwrap().unwrap(), b"before");
    let broke = Instant::now();
    a.break_queue_pair().unwrap();
    let a_err = a.recv_timeout(WAIT).unwrap_err();
    assert!(
        matches!(a_err, Error::Connection(Failure::QpError)),
        "{a_err:?}"
    );
    let b_err = b.recv_timeout(WAIT).unwrap_err();
    let noticed = broke.elapsed();
    println!("stats qp error: local {a_err}; peer {b_err} after {noticed:?}");
    assert!(
        matches!(b_err, Error::Connection(Failure::PeerVanished)),
        "{b_err:?}"
    );
    assert!(noticed < Duration::from_secs(2), "{noticed:?}");
    let p = a.pool_stats();
    assert_eq!((p.posted, p.lent, p.free), (0, 0, p.total), "{p:?}");
    assert!(a.send(b"after", true).is_err(), "failures are sticky");
}

/// A completion queue too small for its receive queue: the overrun surfaces as the CQ error
/// event, typed, on the receiving side, and the sender is told too; nobody hangs.
#[test]
#[ignore = "device"]
fn an_undersized_cq_overruns_into_a_cq_error_event() {
    let small = Config {
        recv_cq_entries: Some(4),
        ..Config::default()
    };
    let (mut rx, mut tx, _l) = pair_with(small, Config::default());
    let started = Instant::now();
    // The receiver is busy elsewhere; unsolicited messages pile up in its CQ.
    for i in 0..32u8 {
        if tx.send(&[i; 16], false).is_err() {
            break;
        }
    }
    thread::sleep(Duration::from_millis(300));
    let mut delivered = 0;
    let err = loop {
        match rx.recv_timeout(WAIT) {
            Ok(Some(_)) => delivered += 1,
            Ok(None) => panic!("no error within 10 s: the overrun went unnoticed"),
            Err(e) => break e,
        }
    };
    println!(
        "stats cq overrun: {delivered} delivered, then {err} after {:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            err,
            Error::Connection(Failure::AsyncEvent(verbs_core::AsyncEventKind::CqErr))
        ),
        "{err:?}"
    );
    let sender_err = loop {
        match tx.send(b"more", true) {
            Ok(()) => thread::sleep(Duration::from_millis(10)),
            Err(e) => break e,
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "sender never told"
        );
    };
    println!("stats cq overrun sender: {sender_err}");
    assert!(matches!(sender_err, Error::Connection(_)), "{sender_err:?}");
}
