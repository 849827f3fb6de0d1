//! Hostile or buggy peers of the bootstrap, on a real device (rxe0 in the test VM): what a
//! peer announces does not decide what we pin, a silent, slow or garbage-sending client
//! delays nobody, a pre-shared key keeps strangers out, and junk after the handshake fails
//! the connection once. Ignored on hosts; a missing device fails them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common;

use common::{client_hello, endpoint, plausible_hello, stalled_before_ready};
use rdmsg_transport::handshake::{Reject, CLIENT_HELLO_LEN, GOODBYE, MAC_LEN};
use rdmsg_transport::{Config, Connection, Error, Failure, Listener, Psk};

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

/// Resident memory of this process, in KiB.
fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// A client that copies a plausible hello and asks for 16 MiB buffers would have made the
/// listener register `send_depth × 16 MiB` = 1 GiB. Now the hello is rejected with a typed
/// reason the client is told, and nothing is allocated for it.
#[test]
#[ignore = "device"]
fn a_forged_hello_asking_for_huge_buffers_is_rejected_without_pinning_memory() {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut forged = plausible_hello(&ep);
    forged.buf_size = 16 << 20;
    let before = vm_rss_kib();
    let client = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&client_hello(forged)).unwrap();
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        reply
    });
    let err = outcome(&listener, &Config::default()).unwrap_err();
    let after = vm_rss_kib();
    let reply = client.join().unwrap();
    println!(
        "stats forged 16 MiB hello: {err}; listener RSS {before} KiB -> {after} KiB ({:+} KiB)",
        after as i64 - before as i64
    );
    assert!(
        matches!(err, Error::BadHandshake(Reject::Limits("buffer size"))),
        "{err:?}"
    );
    assert_eq!(reply.get(10), Some(&b'L'), "the client is told: {reply:?}");
    assert!(
        after < before + 4 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
}

/// The next client's outcome (`accept` skips the failures these tests look at).
fn outcome(listener: &Listener, cfg: &Config) -> Result<Connection, Error> {
    listener
        .accept_outcome_timeout(cfg, None)
        .expect("no failure of the listener's own")
        .expect("an outcome: there is no deadline")
}

/// Connects a good client to `listener` from a thread and accepts until it is in: returns
/// the time from its start to the accepted connection (checked to work) and the errors other
/// clients caused meanwhile.
fn time_a_good_client(listener: &Listener, cfg: &Config) -> (Duration, Vec<Error>) {
    let addr = listener.local_addr().unwrap();
    let client_ep = listener.endpoint().clone();
    let started = Instant::now();
    let client = thread::spawn(move || client_ep.connect(addr, &Config::default()).unwrap());
    let mut errors = Vec::new();
    let mut server = loop {
        match outcome(listener, cfg) {
            Ok(c) => break c,
            Err(e) => errors.push(e),
        }
    };
    let took = started.elapsed();
    let mut client = client.join().unwrap();
    client.send(b"hello", true).unwrap();
    assert_eq!(&*server.recv_timeout(WAIT).unwrap().unwrap(), b"hello");
    server.send(b"hi", true).unwrap();
    assert_eq!(&*client.recv_timeout(WAIT).unwrap().unwrap(), b"hi");
    (took, errors)
}

/// Server-side handshakes run concurrently: a client that connects first and says nothing
/// (the old listener spent its whole 5 s timeout on it), one that sends garbage, and one that
/// trickles a valid hello byte by byte do not delay a good client.
#[test]
#[ignore = "device"]
fn silent_garbage_and_slow_clients_do_not_delay_a_good_one() {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = Config::default();
    assert_eq!(cfg.handshake_timeout, Duration::from_secs(5));

    let silent = TcpStream::connect(addr).unwrap();
    thread::sleep(Duration::from_millis(50));
    let (behind_silent, errors) = time_a_good_client(&listener, &cfg);
    println!("stats good client behind a silent one: connected in {behind_silent:?}");
    assert!(errors.is_empty(), "{errors:?}");
    assert!(behind_silent < Duration::from_secs(1), "{behind_silent:?}");

    // Garbage that never makes a header, and garbage that does (rejected at once).
    let mut trickle_garbage = TcpStream::connect(addr).unwrap();
    trickle_garbage.write_all(b"GET ").unwrap();
    let mut garbage = TcpStream::connect(addr).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    thread::sleep(Duration::from_millis(50));
    let (behind_garbage, errors) = time_a_good_client(&listener, &cfg);
    println!(
        "stats good client behind garbage: connected in {behind_garbage:?}; meanwhile {:?}",
        errors.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    assert!(
        behind_garbage < Duration::from_secs(1),
        "{behind_garbage:?}"
    );
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, Error::BadHandshake(Reject::BadMagic))),
        "{errors:?}"
    );

    // A valid hello, one byte every 20 ms (1.8 s in all).
    let hello = client_hello(plausible_hello(&ep));
    let slow = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        for b in hello {
            if s.write_all(&[b]).is_err() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        s
    });
    thread::sleep(Duration::from_millis(100));
    let (behind_slow, errors) = time_a_good_client(&listener, &cfg);
    println!("stats good client behind a slow one: connected in {behind_slow:?}");
    assert!(behind_slow < Duration::from_secs(1), "{behind_slow:?}");
    assert!(errors.is_empty(), "{errors:?}");

    // The stragglers are reported in turn once their deadlines pass (the slow client's hello
    // completed, but it never proves anything), and the listener still works after.
    let t = Instant::now();
    let mut stragglers = Vec::new();
    for _ in 0..3 {
        stragglers.push(outcome(&listener, &cfg).unwrap_err());
    }
    println!(
        "stats stragglers after {:?}: {:?}",
        t.elapsed(),
        stragglers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    );
    assert!(
        stragglers
            .iter()
            .all(|e| matches!(e, Error::Bootstrap { .. })),
        "{stragglers:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    drop((silent, trickle_garbage, garbage, slow.join().unwrap()));
    let (again, errors) = time_a_good_client(&listener, &cfg);
    assert!(again < Duration::from_secs(1) && errors.is_empty());
}

/// A listener full of silent clients evicts the oldest for a new one.
#[test]
#[ignore = "device"]
fn a_full_listener_evicts_its_oldest_pending_handshake() {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = Config {
        max_pending_handshakes: 4,
        ..Config::default()
    };
    let silent: Vec<_> = (0..6).map(|_| TcpStream::connect(addr).unwrap()).collect();
    thread::sleep(Duration::from_millis(50));
    let (took, errors) = time_a_good_client(&listener, &cfg);
    println!(
        "stats good client behind 6 silent ones, 4 slots: {took:?}; {:?}",
        errors.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert!(!errors.is_empty(), "evictions are reported");
    assert!(errors.iter().all(|e| e.to_string().contains("bootstrap")));
    drop(silent);
}

/// Issue 40, item 9: one rule for every listener. A client that sends garbage, and one
/// evicted to make room, failed their own handshakes: `accept` skips them (counted) and
/// returns the good client after them; only the listener's own failure would be its error.
#[test]
#[ignore = "device"]
fn a_clients_failure_is_not_the_listeners_error() {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = Config {
        max_pending_handshakes: 2,
        ..Config::default()
    };
    let mut garbage = TcpStream::connect(addr).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // Three clients, two places: the third evicts the oldest (the garbage).
    let silent: Vec<_> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    thread::sleep(Duration::from_millis(50));
    let none = listener
        .accept_timeout(&cfg, Some(Duration::from_millis(300)))
        .expect("no client's failure is the listener's error");
    assert!(none.is_none(), "nobody completed a handshake");
    assert_eq!(listener.failed_handshakes(), 1, "the evicted garbage");
    // The good client evicts the older silent one, and is accepted.
    let client_ep = ep.clone();
    let client = thread::spawn(move || client_ep.connect(addr, &Config::default()).unwrap());
    let mut server = listener
        .accept(&cfg)
        .expect("the good client, not another client's failure");
    let mut client = client.join().unwrap();
    client.send(b"good", true).unwrap();
    assert_eq!(&*server.recv_timeout(WAIT).unwrap().unwrap(), b"good");
    assert_eq!(
        listener.failed_handshakes(),
        2,
        "and the evicted silent one"
    );
    drop((garbage, silent));
}

fn with_key(psk: Option<Psk>) -> Config {
    Config {
        psk,
        ..Config::default()
    }
}

/// Connects a client with `client` to `listener` accepting with `server`; returns both
/// results.
fn try_pair(
    listener: &Listener,
    server: Config,
    client: Config,
) -> (Result<Connection, Error>, Result<Connection, Error>) {
    let addr = listener.local_addr().unwrap();
    let client_ep = listener.endpoint().clone();
    let c = thread::spawn(move || client_ep.connect(addr, &client));
    let s = outcome(listener, &server);
    (s, c.join().unwrap())
}

/// Both sides prove they know the key; a wrong key or a key on one side only is rejected,
/// typed, on both sides, and the listener goes on.
#[test]
#[ignore = "device"]
fn a_pre_shared_key_keeps_strangers_out() {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let key = Psk::new([0x5a; 32]);
    let (s, c) = try_pair(
        &listener,
        with_key(Some(key.clone())),
        with_key(Some(key.clone())),
    );
    let (mut s, mut c) = (s.unwrap(), c.unwrap());
    c.send(b"authenticated", true).unwrap();
    assert_eq!(&*s.recv_timeout(WAIT).unwrap().unwrap(), b"authenticated");

    let (s_err, c_err) = try_pair(
        &listener,
        with_key(Some(key.clone())),
        with_key(Some(Psk::new([0xa5; 32]))),
    );
    let (s_err, c_err) = (s_err.unwrap_err(), c_err.unwrap_err());
    println!("stats wrong key: server {s_err}; client {c_err}");
    assert!(
        matches!(s_err, Error::Rejected(Reject::BadKey)),
        "{s_err:?}"
    );
    assert!(
        matches!(c_err, Error::BadHandshake(Reject::BadKey)),
        "{c_err:?}"
    );

    for (server, client) in [(Some(key.clone()), None), (None, Some(key.clone()))] {
        let (s_err, c_err) = try_pair(&listener, with_key(server), with_key(client));
        let (s_err, c_err) = (s_err.unwrap_err(), c_err.unwrap_err());
        println!("stats key on one side: server {s_err}; client {c_err}");
        assert!(
            matches!(s_err, Error::BadHandshake(Reject::KeyMissing)),
            "{s_err:?}"
        );
        assert!(
            matches!(c_err, Error::Rejected(Reject::KeyMissing)),
            "{c_err:?}"
        );
    }
    let (s, c) = try_pair(&listener, with_key(Some(key.clone())), with_key(Some(key)));
    assert!(s.is_ok() && c.is_ok());
}

/// A TCP relay between one client and a server, recording what the client sends and able to
/// inject bytes towards the server.
struct Relay {
    addr: SocketAddr,
    upstream: Arc<Mutex<Option<TcpStream>>>,
    from_client: Arc<Mutex<Vec<u8>>>,
    threads: thread::JoinHandle<thread::JoinHandle<()>>,
}

impl Relay {
    fn start(server: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = Arc::new(Mutex::new(None));
        let from_client = Arc::new(Mutex::new(Vec::new()));
        let (up, rec) = (upstream.clone(), from_client.clone());
        let threads = thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let server = TcpStream::connect(server).unwrap();
            *up.lock().unwrap() = Some(server.try_clone().unwrap());
            let (mut c_read, mut s_write) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            let to_server = thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = c_read.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    rec.lock().unwrap().extend_from_slice(&buf[..n]);
                    if s_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_write.shutdown(std::net::Shutdown::Write);
            });
            let (mut s_read, mut c_write) = (server, client);
            thread::spawn(move || {
                let _ = std::io::copy(&mut s_read, &mut c_write);
                let _ = c_write.shutdown(std::net::Shutdown::Write);
            });
            to_server
        });
        Self {
            addr,
            upstream,
            from_client,
            threads,
        }
    }

    fn inject(&self, bytes: &[u8]) {
        let up = self.upstream.lock().unwrap();
        let mut stream: &TcpStream = up.as_ref().expect("relay connected");
        stream.write_all(bytes).unwrap();
    }

    /// Waits for the client's end of file; returns what the client sent.
    fn finish(self) -> Vec<u8> {
        self.threads.join().unwrap().join().unwrap();
        let rec = self.from_client.lock().unwrap();
        rec.clone()
    }
}

/// A pair whose client talks to the listener through `Relay`: (server side, client side).
fn relayed_pair() -> (Connection, Connection, Relay, Listener) {
    let ep = endpoint();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let relay = Relay::start(listener.local_addr().unwrap());
    let client_ep = ep.clone();
    let relay_addr = relay.addr;
    let c = thread::spawn(move || client_ep.connect(relay_addr, &Config::default()).unwrap());
    let s = listener.accept(&Config::default()).unwrap();
    (s, c.join().unwrap(), relay, listener)
}

/// 4 KiB of junk on the bootstrap stream after the handshake: the sleeping receiver fails
/// once, typed, in a few wake-ups (it used to read and ignore 16 bytes per wake-up).
#[test]
#[ignore = "device"]
fn junk_on_the_bootstrap_stream_fails_the_connection_once() {
    let (mut s, mut c, relay, _l) = relayed_pair();
    c.send(b"before", true).unwrap();
    assert_eq!(&*s.recv_timeout(WAIT).unwrap().unwrap(), b"before");
    let before = s.wait_stats();
    let injector = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        relay.inject(&[b'x'; 4096]);
        relay
    });
    let err = s
        .recv_timeout(Some(Duration::from_secs(3)))
        .expect_err("junk must fail the connection");
    let after = s.wait_stats();
    // Junk wakes the waiter through the bootstrap stream: an external wake-up.
    let wakeups =
        (after.wakeups + after.external_wakeups) - (before.wakeups + before.external_wakeups);
    println!("stats junk on the bootstrap stream: {err} after {wakeups} wake-up(s)");
    assert!(
        matches!(
            err,
            Error::Connection(Failure::BootstrapGarbage { byte: b'x' })
        ),
        "{err:?}"
    );
    // One wake-up for the junk; the flushes of the failed queue pair that the wait takes
    // before reporting it may come in more than one batch (6.12's rxe: 3 wake-ups in all, once).
    // Ignoring 16 bytes per wake-up, as it once did, took 256.
    assert!(wakeups <= 4, "{wakeups} wake-ups");
    let again = s.recv_timeout(WAIT).unwrap_err();
    assert!(
        matches!(again, Error::Connection(Failure::BootstrapGarbage { .. })),
        "sticky: {again:?}"
    );
    let later = s.wait_stats();
    assert_eq!(
        (later.wakeups, later.external_wakeups, later.time_asleep),
        (after.wakeups, after.external_wakeups, after.time_asleep),
        "no sleep, no wake-up after"
    );
    // The client learns it through the end of the stream.
    let peer = c.recv_timeout(WAIT).unwrap_err();
    assert!(
        matches!(peer, Error::Connection(Failure::PeerVanished)),
        "{peer:?}"
    );
    drop(c);
    injector.join().unwrap().finish();
}

/// A graceful close writes exactly one goodbye on the bootstrap stream after the handshake,
/// and the peer reports the close, not a vanished peer.
#[test]
#[ignore = "device"]
fn a_graceful_close_says_goodbye_on_the_bootstrap_stream() {
    let (mut s, mut c, relay, _l) = relayed_pair();
    c.send(b"last words", true).unwrap();
    c.close().unwrap();
    assert_eq!(&*s.recv_timeout(WAIT).unwrap().unwrap(), b"last words");
    let err = s.recv_timeout(WAIT).unwrap_err();
    assert!(
        matches!(err, Error::Connection(Failure::PeerClosed)),
        "{err:?}"
    );
    let sent = relay.finish();
    let handshake = CLIENT_HELLO_LEN + 1 + MAC_LEN + 1;
    assert_eq!(sent.len(), handshake + 1, "{sent:?}");
    assert_eq!(sent[handshake], GOODBYE);
}

/// Clients that pass the handshake up to the server's address and then never say "ready"
/// (no key configured, so anyone can get that far) pin nothing of their choosing: the server
/// has its queue pair and its own receive pool, but registers the send buffers, sized by the
/// client's announced buffer size, only once the client is ready. Four such clients asking for
/// 1 MiB buffers used to pin 4 × 64 MiB.
#[test]
#[ignore = "device"]
fn clients_that_stop_before_ready_pin_no_send_buffers() {
    let ep = endpoint();
    let listener = Arc::new(ep.listen("127.0.0.1:0").unwrap());
    let addr = listener.local_addr().unwrap();
    let mut hello = plausible_hello(&ep);
    hello.buf_size = 1 << 20;
    let before = vm_rss_kib();
    let server = {
        let listener = Arc::clone(&listener);
        thread::spawn(move || {
            (0..4)
                .map(|_| outcome(&listener, &Config::default()).map(drop))
                .collect::<Vec<_>>()
        })
    };
    let stalled: Vec<TcpStream> = (0..4u8)
        .map(|i| stalled_before_ready(addr, hello, i))
        .collect();
    thread::sleep(Duration::from_millis(500));
    let during = vm_rss_kib();
    drop(stalled);
    let results = server.join().unwrap();
    println!(
        "stats 4 clients stalled before ready, 1 MiB buffers announced: RSS {before} KiB -> {during} KiB ({:+} KiB); accept: {:?}",
        during as i64 - before as i64,
        results.iter().map(|r| r.as_ref().err().map(ToString::to_string)).collect::<Vec<_>>()
    );
    assert!(results.iter().all(Result::is_err), "none of them got in");
    assert!(
        during < before + 16 * 1024,
        "RSS grew from {before} KiB to {during} KiB"
    );
}
