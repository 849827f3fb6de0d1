//! Large messages on a real device (`$RDMSG_DEVICE`): every size across the thresholds
//! (inline, one buffer, fragments, rendezvous) with its content checked, rendezvous both ways
//! at once, the bound on rendezvous memory, a hub, a forged descriptor, and a peer that dies
//! while its message is being read. Ignored on hosts; `cargo xtask test` runs it in the VM.

use std::time::{Duration, Instant};

use rdmsg::msg::frame::{self, FIRST, LAST, RNDV};
use rdmsg::msg::rendezvous::{Descriptor, Segment};
use rdmsg::msg::{Message, Session};
use rdmsg::transport::Config;
use rdmsg::{Bulk, Error, SessionConfig};
use rdmsg_examples::loopback_pair;
use serde::{Deserialize, Serialize};

/// A message with a payload that goes by reference when it goes by rendezvous.
#[derive(Debug, Serialize, Deserialize)]
struct Blob {
    id: u32,
    data: Bulk,
    tail: String,
}
rdmsg::message!(Blob, tag = "large.blob");

/// The same message as a view: the payload read in place, from the receive buffer.
#[derive(Debug, Serialize, Deserialize)]
struct BlobView<'a> {
    id: u32,
    #[serde(borrow, with = "serde_bytes")]
    data: &'a [u8],
    tail: &'a str,
}
impl Message for BlobView<'_> {
    const TAG: u32 = Blob::TAG;
}

/// A message whose payload is an ordinary vector: encoded (copied) once, then read.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Plain {
    id: u32,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
}
rdmsg::message!(Plain, tag = "large.plain");

fn pattern(id: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(id) as u8)
        .collect()
}

fn pair(server: SessionConfig, client: SessionConfig) -> (Session, Session) {
    pair_reading(u32::MAX, server, client)
}

/// [`pair`], each side reading messages of at most `max_read` bytes (and registering at most
/// that much for them).
fn pair_reading(max_read: u32, server: SessionConfig, client: SessionConfig) -> (Session, Session) {
    let conn = Config {
        max_read_bytes: max_read.min(Config::default().max_read_bytes),
        ..Config::default()
    };
    let (a, b) = loopback_pair(&conn, &conn).expect("device");
    (
        Session::with_config(a, server),
        Session::with_config(b, client),
    )
}

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

fn recv(s: &mut Session) -> rdmsg::Envelope {
    s.recv_timeout(WAIT)
        .expect("received")
        .expect("within the wait")
}

/// Sizes around every threshold: inline (64), one receive buffer (4096), the rendezvous
/// threshold (16 KiB), and on up to 16 MiB.
const SIZES: &[usize] = &[
    0,
    1,
    40,
    64,
    100,
    4000,
    4070,
    4096,
    5000,
    16_000,
    16_384,
    16_400,
    65_536,
    262_144,
    1 << 20,
    (1 << 20) + 1,
    4 << 20,
    // The largest message by default is 16 MiB, encoding included.
    (16 << 20) - 64,
];

#[test]
#[ignore = "needs an RDMA device"]
fn every_size_across_the_thresholds_arrives_intact_both_ways() {
    let (mut a, mut b) = pair(SessionConfig::default(), SessionConfig::default());
    let sender = std::thread::spawn(move || {
        for (i, &len) in SIZES.iter().enumerate() {
            let id = i as u32;
            b.send(&Blob {
                id,
                data: Bulk::from(pattern(id, len)),
                tail: format!("end {id}"),
            })
            .expect("sent");
            b.send(&Plain {
                id,
                data: pattern(id + 1000, len),
            })
            .expect("sent");
        }
        // Answered in the other direction, by rendezvous too.
        let back = recv(&mut b);
        let p: Plain = back.decode().expect("decodes");
        assert_eq!(p.data, pattern(77, 3 << 20));
        b
    });
    for (i, &len) in SIZES.iter().enumerate() {
        let id = i as u32;
        let env = recv(&mut a);
        let view: BlobView<'_> = env.decode_borrowed().expect("the view decodes in place");
        assert_eq!((view.id, view.tail), (id, format!("end {id}").as_str()));
        assert!(
            view.data == pattern(id, len).as_slice(),
            "blob {len} bytes intact"
        );
        let owned: Blob = env.decode().expect("decodes");
        assert_eq!(owned.data.len(), len);
        let env = recv(&mut a);
        let p: Plain = env.decode().expect("decodes");
        assert_eq!(p.id, id);
        assert!(
            p.data == pattern(id + 1000, len),
            "plain {len} bytes intact"
        );
    }
    a.send(&Plain {
        id: 9,
        data: pattern(77, 3 << 20),
    })
    .expect("sent back");
    let mut b = sender.join().expect("the sender does not panic");
    let (sa, sb) = (a.stats(), b.stats());
    // Those of at least 16 KiB went by rendezvous: the last 8 sizes, twice each, and back.
    let large = SIZES.iter().filter(|&&n| n >= 16_384).count() as u64;
    assert_eq!(sb.rendezvous_sent, 2 * large, "{sb:?}");
    assert_eq!(sa.rendezvous_received, 2 * large, "{sa:?}");
    assert_eq!((sa.rendezvous_sent, sb.rendezvous_received), (1, 1));
    assert_eq!(sa.dropped_frames + sb.dropped_frames, 0);
    println!("rendezvous: {sb:?}");
    // Closing waits for the peer to be done reading; everything was.
    b.flush().expect("flushed");
    drop(b);
}

#[test]
#[ignore = "needs an RDMA device"]
fn small_and_large_messages_interleaved_keep_their_order() {
    let (mut a, mut b) = pair(SessionConfig::default(), SessionConfig::default());
    let sender = std::thread::spawn(move || {
        for id in 0..60u32 {
            let len = match id % 3 {
                0 => 10,
                1 => 200_000,
                _ => 9_000,
            };
            b.send_as(
                &Plain {
                    id,
                    data: pattern(id, len),
                },
                id % 5 == 0,
            )
            .expect("sent");
        }
        b.flush().expect("flushed");
        b
    });
    for id in 0..60u32 {
        let p: Plain = recv(&mut a).decode().expect("decodes");
        assert_eq!(p.id, id, "in order");
        assert!(p.data == pattern(id, p.data.len()));
    }
    let b = sender.join().expect("no panic");
    assert_eq!(b.stats().rendezvous_sent, 20);
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_slow_reader_makes_the_sender_wait_within_the_bound() {
    let bounded = SessionConfig {
        max_rendezvous_bytes: 1 << 20,
        ..SessionConfig::default()
    };
    let (mut a, mut b) = pair_reading(1 << 20, bounded.clone(), bounded);
    const N: u32 = 30;
    const LEN: usize = 300_000;
    let sender = std::thread::spawn(move || {
        for id in 0..N {
            b.send(&Plain {
                id,
                data: pattern(id, LEN),
            })
            .expect("sent");
        }
        b.flush().expect("flushed");
        b
    });
    // A slow reader that holds its last two messages: what it registers stays within the
    // bound, and the sender waits for room.
    let mut held = Vec::new();
    for id in 0..N {
        std::thread::sleep(Duration::from_millis(20));
        let env = recv(&mut a);
        let p: Plain = env.decode().expect("decodes");
        assert_eq!(p.id, id);
        assert!(p.data == pattern(id, LEN));
        held.push(env);
        if held.len() > 2 {
            held.remove(0);
        }
        assert!(a.stats().rendezvous_registered <= 1 << 20);
    }
    let b = sender.join().expect("no panic");
    let sb = b.stats();
    println!(
        "sender: {sb:?}
receiver: {:?}",
        a.stats()
    );
    assert_eq!(sb.rendezvous_sent, N as u64);
    assert!(sb.rendezvous_waits > 0, "the bound made the sender wait");
}

#[test]
#[ignore = "needs an RDMA device"]
fn large_messages_both_ways_at_once_through_split_halves() {
    let bounded = SessionConfig {
        max_rendezvous_bytes: 1 << 20,
        ..SessionConfig::default()
    };
    let (a, b) = pair_reading(1 << 20, bounded.clone(), bounded);
    const N: u32 = 30;
    const LEN: usize = 300_000;
    let side = |s: Session| {
        std::thread::spawn(move || {
            let (tx, mut rx) = s.split().expect("split");
            let sending = std::thread::spawn(move || {
                for id in 0..N {
                    tx.send(&Plain {
                        id,
                        data: pattern(id, LEN),
                    })
                    .expect("sent");
                }
                tx
            });
            for id in 0..N {
                let env = rx.recv_timeout(WAIT).expect("received").expect("in time");
                let p: Plain = env.decode().expect("decodes");
                assert_eq!(p.id, id);
                assert!(p.data == pattern(id, LEN));
            }
            let tx = sending.join().expect("no panic");
            // Both halves stay until both sides are done: the peer may still be reading.
            (tx.stats(), tx, rx)
        })
    };
    let (ta, tb) = (side(a), side(b));
    let (a, b) = (ta.join().expect("no panic"), tb.join().expect("no panic"));
    let (sa, sb) = (a.0, b.0);
    println!("a: {sa:?}\nb: {sb:?}");
    assert_eq!(
        (sa.rendezvous_sent, sb.rendezvous_sent),
        (N as u64, N as u64)
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn fragmentation_stays_available() {
    let fragments = SessionConfig {
        rendezvous_threshold: None,
        ..SessionConfig::default()
    };
    let (mut a, mut b) = pair(SessionConfig::default(), fragments);
    let sender = std::thread::spawn(move || {
        b.send(&Plain {
            id: 1,
            data: pattern(1, 1 << 20),
        })
        .expect("sent");
        b
    });
    let p: Plain = recv(&mut a).decode().expect("decodes");
    assert!(p.data == pattern(1, 1 << 20));
    let b = sender.join().expect("no panic");
    assert_eq!(b.stats().rendezvous_sent, 0);
    assert_eq!(b.stats().fragmented, 1);
}

/// A descriptor naming memory that is not there: its read fails with a remote access error.
fn forged_descriptor() -> Descriptor {
    Descriptor {
        total: 100_000,
        segments: vec![Segment::Remote {
            len: 100_000,
            addr: 0xdead_0000,
            rkey: 0x1234,
        }],
    }
}

/// Sends `frame` raw on `conn`, solicited.
fn send_raw(s: &mut Session, f: &[u8]) {
    s.connection_mut().send(f, true).expect("raw frame sent");
}

#[test]
#[ignore = "needs an RDMA device"]
fn forged_descriptors_cost_their_message_or_fail_the_connection_alone() {
    let (mut a, mut b) = pair(SessionConfig::default(), SessionConfig::default());
    let mut buf = vec![0u8; 4096];
    // Too large for the receiver's bound: refused, acknowledged, the next message arrives.
    let huge = Descriptor {
        total: u32::MAX,
        segments: vec![Segment::Remote {
            len: u32::MAX,
            addr: 0x1000,
            rkey: 7,
        }],
    };
    let n = huge.write_frame(Plain::TAG, 0, &mut buf).expect("fits");
    send_raw(&mut b, &buf[..n]);
    match a.recv_timeout(WAIT) {
        Err(Error::TooLarge { .. }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // A body that does not add up: a bad frame.
    let mut bad = frame::build(
        FIRST | LAST | RNDV,
        Plain::TAG,
        1,
        0,
        &[0, 0, 0, 9, 0, 1, 0, 0],
    );
    send_raw(&mut b, &bad);
    assert!(matches!(a.recv_timeout(WAIT), Err(Error::BadFrame(_))));
    bad.truncate(10);
    b.send(&Plain {
        id: 5,
        data: vec![1, 2, 3],
    })
    .expect("sent");
    let p: Plain = recv(&mut a).decode().expect("the next message is fine");
    assert_eq!(p.id, 5);
    // A descriptor naming memory that is not there: the read fails with a remote access
    // error, and the connection fails (both sides), with a typed error and no hang.
    let n = forged_descriptor()
        .write_frame(Plain::TAG, 2, &mut buf)
        .expect("fits");
    send_raw(&mut b, &buf[..n]);
    let started = Instant::now();
    let first = a.recv_timeout(WAIT);
    assert!(
        matches!(
            first,
            Err(Error::ReadFailed { .. }) | Err(Error::Transport(_))
        ),
        "{first:?}"
    );
    let mut last = first;
    while !matches!(&last, Err(e) if e.is_fatal()) {
        last = a.recv_timeout(WAIT);
        assert!(started.elapsed() < Duration::from_secs(20), "no hang");
    }
    println!(
        "forged read: {first_err} after {:?}",
        started.elapsed(),
        first_err = last.as_ref().unwrap_err()
    );
    // The forger's side fails too (its queue pair saw the access error, or the peer went).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match b.recv_timeout(Some(Duration::from_millis(200))) {
            Err(e) if e.is_fatal() => break,
            _ => assert!(Instant::now() < deadline, "the forger's side fails too"),
        }
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_peer_that_dies_mid_read_fails_the_reader_with_a_typed_error() {
    let (mut a, mut b) = pair(SessionConfig::default(), SessionConfig::default());
    b.send(&Blob {
        id: 1,
        data: Bulk::from(pattern(1, 8 << 20)),
        tail: String::new(),
    })
    .expect("sent");
    // The sender goes away at once: its queue pair and registrations with it.
    drop(b);
    let started = Instant::now();
    let mut errors = Vec::new();
    loop {
        match a.recv_timeout(WAIT) {
            Ok(Some(env)) => {
                // The read may have finished before the end: then it is whole.
                let v: BlobView<'_> = env.decode_borrowed().expect("decodes");
                assert!(v.data == pattern(1, 8 << 20).as_slice());
            }
            Ok(None) => panic!("no hang"),
            Err(e) => {
                let fatal = e.is_fatal();
                errors.push(e.to_string());
                if fatal {
                    break;
                }
            }
        }
    }
    println!("after {:?}: {errors:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// A typed hub listening on loopback, and `n` client threads, each running `client` with its
/// number and a session connected to the hub.
fn hub_with_clients<T: Send + 'static>(
    n: u32,
    client: impl Fn(u32, Session) -> T + Clone + Send + 'static,
) -> (rdmsg::Hub, Vec<std::thread::JoinHandle<T>>) {
    hub_with_config(n, rdmsg::HubConfig::default(), client)
}

fn hub_with_config<T: Send + 'static>(
    n: u32,
    config: rdmsg::HubConfig,
    client: impl Fn(u32, Session) -> T + Clone + Send + 'static,
) -> (rdmsg::Hub, Vec<std::thread::JoinHandle<T>>) {
    let ep = rdmsg::Endpoint::open_default().expect("device");
    let mut hub = rdmsg::Hub::with_config(&ep, config, SessionConfig::default()).expect("hub");
    let addr = hub.listen("127.0.0.1:0").expect("listening");
    let clients = (0..n)
        .map(|c| {
            let (ep, client) = (ep.clone(), client.clone());
            std::thread::spawn(move || {
                let conn = ep.connect(addr, &Config::default()).expect("connected");
                client(c, Session::new(conn))
            })
        })
        .collect();
    (hub, clients)
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_hub_reads_large_messages_from_its_peers_and_sends_them_large_answers() {
    use rdmsg::HubEvent;
    const CLIENTS: u32 = 3;
    const EACH: u32 = 6;
    let (mut hub, clients) = hub_with_clients(CLIENTS, |c, mut s| {
        for i in 0..EACH {
            let id = c * 100 + i;
            s.send(&Blob {
                id,
                data: Bulk::from(pattern(id, 100_000 + 50_000 * i as usize)),
                tail: String::new(),
            })
            .expect("sent");
            let answer: Plain = recv(&mut s).decode().expect("an answer");
            assert_eq!(answer.id, id);
            assert!(answer.data == pattern(id + 1, 200_000), "answer intact");
        }
        let stats = s.stats();
        s.close().expect("closed");
        stats
    });
    let mut answered = 0;
    let mut gone = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while gone < CLIENTS {
        assert!(Instant::now() < deadline, "the hub got everything in time");
        let Some(ev) = hub
            .recv_timeout(Some(Duration::from_secs(1)))
            .expect("hub works")
        else {
            continue;
        };
        match ev {
            HubEvent::Message { peer, msg } => {
                let v: BlobView<'_> = msg.decode_borrowed().expect("decodes");
                let len = 100_000 + 50_000 * (v.id % 100) as usize;
                assert!(v.data == pattern(v.id, len).as_slice(), "request intact");
                let id = v.id;
                drop(msg);
                hub.send(
                    peer,
                    &Plain {
                        id,
                        data: pattern(id + 1, 200_000),
                    },
                )
                .expect("answered");
                answered += 1;
            }
            HubEvent::Disconnected { .. } => gone += 1,
            HubEvent::Connected { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    for c in clients {
        let stats = c.join().expect("no panic");
        assert_eq!((stats.rendezvous_sent, stats.rendezvous_received), (6, 6));
    }
    assert_eq!(answered, CLIENTS * EACH);
    let hs = hub.stats();
    println!("hub: {hs:?}");
    assert_eq!(hs.rendezvous_received, u64::from(CLIENTS * EACH));
    assert_eq!(hs.rendezvous_sent, u64::from(CLIENTS * EACH));
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_hub_closing_a_peer_lets_it_finish_reading_first() {
    use rdmsg::{Failure, HubEvent};
    const LEN: usize = 4 << 20;
    let (mut hub, clients) = hub_with_clients(2, |c, mut s| {
        s.send(&Plain {
            id: c,
            data: vec![],
        })
        .expect("hello sent");
        let p: Plain = recv(&mut s).decode().expect("the large message");
        assert!(p.data == pattern(c, LEN), "read whole before the close");
        match s.recv_timeout(WAIT) {
            Err(Error::Transport(rdmsg::transport::Error::Connection(Failure::PeerClosed))) => {}
            other => panic!("a graceful close, not {other:?}"),
        }
    });
    let mut gone = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while gone < 2 {
        assert!(Instant::now() < deadline, "both closed in time");
        let Some(ev) = hub
            .recv_timeout(Some(Duration::from_secs(1)))
            .expect("hub works")
        else {
            continue;
        };
        match ev {
            HubEvent::Message { peer, msg } => {
                let c = msg.decode::<Plain>().expect("hello").id;
                drop(msg);
                hub.send(
                    peer,
                    &Plain {
                        id: c,
                        data: pattern(c, LEN),
                    },
                )
                .expect("sent");
                // At once, while the peer reads: the close waits for its acknowledgement.
                if c == 0 {
                    hub.start_close(peer).expect("closing");
                } else {
                    hub.close(peer).expect("closed");
                }
            }
            HubEvent::Disconnected { failure, .. } => {
                assert_eq!(failure, Failure::Closed);
                gone += 1;
            }
            HubEvent::Connected { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    for c in clients {
        c.join().expect("the client saw everything, then the close");
    }
}

/// A close that runs out of `close_timeout` before the peer read what it was lent says so
/// (`Error::Unread`, with the count) instead of `Ok`, and the peer, which had not read it,
/// does not get it as if it were sent: its read fails.
#[test]
#[ignore = "needs an RDMA device"]
fn a_close_the_peer_did_not_finish_reading_says_how_many_it_did_not_read() {
    let short = Config {
        close_timeout: Duration::from_millis(300),
        ..Config::default()
    };
    let (a, b) = loopback_pair(&Config::default(), &short).expect("device");
    let (mut rx, mut tx) = (Session::new(a), Session::new(b));
    tx.send(&Plain {
        id: 1,
        data: pattern(1, 1 << 20),
    })
    .expect("sent");
    // The receiver is busy: it reads nothing for longer than the sender's close_timeout.
    match tx.close() {
        Err(Error::Unread { messages: 1 }) => {}
        other => panic!("Unread {{ messages: 1 }}, not {other:?}"),
    }
    match rx.recv_timeout(WAIT) {
        Ok(Some(m)) => panic!("a message whose memory is gone: {:?}", m.tag()),
        Ok(None) => panic!("nothing at all within the wait"),
        Err(e) => assert!(!e.is_peer_closed(), "not a clean close: {e}"),
    }
}

/// The same with the hub's `start_close`: `HubEvent::Unread` names the peer and the count,
/// then its `Disconnected` follows.
#[test]
#[ignore = "needs an RDMA device"]
fn a_hub_close_the_peer_did_not_finish_reading_says_how_many_it_did_not_read() {
    use rdmsg::{Failure, HubEvent};
    let config = rdmsg::HubConfig {
        conn: Config {
            close_timeout: Duration::from_millis(300),
            ..rdmsg::HubConfig::default().conn
        },
        ..rdmsg::HubConfig::default()
    };
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = std::sync::Arc::new(std::sync::Mutex::new(released));
    let (mut hub, clients) = hub_with_config(1, config, move |_, mut s| {
        s.send(&Plain {
            id: 0,
            data: vec![],
        })
        .expect("hello sent");
        // Busy until the hub's close has run out of time.
        let _ = released.lock().unwrap().recv();
        s.recv_timeout(WAIT).map(|m| m.map(|m| m.tag()))
    });
    let mut unread = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "closed in time");
        let Some(ev) = hub
            .recv_timeout(Some(Duration::from_secs(1)))
            .expect("hub works")
        else {
            continue;
        };
        match ev {
            HubEvent::Message { peer, msg } => {
                drop(msg);
                hub.send(
                    peer,
                    &Plain {
                        id: 0,
                        data: pattern(0, 1 << 20),
                    },
                )
                .expect("sent");
                hub.start_close(peer).expect("closing");
            }
            HubEvent::Unread { messages, .. } => unread = Some(messages),
            HubEvent::Disconnected { failure, .. } => {
                assert_eq!(failure, Failure::Closed);
                break;
            }
            HubEvent::Connected { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(unread, Some(1), "Unread before Disconnected");
    release.send(()).unwrap();
    for c in clients {
        let got = c.join().expect("no panic");
        assert!(got.is_err(), "the client's read failed: {got:?}");
    }
}

/// A connection that fails under a read delivers, in order: `ReadFailed` for that message,
/// then the message that arrived after it, then the failure (a forged descriptor makes the
/// read fail with a remote access error, which fails the connection while the read's own
/// acknowledgement waits to be sent).
#[test]
#[ignore = "needs an RDMA device"]
fn a_failed_read_comes_in_its_place_and_what_followed_it_is_delivered() {
    let (mut a, mut b) = pair(SessionConfig::default(), SessionConfig::default());
    let mut buf = vec![0u8; 4096];
    let n = forged_descriptor()
        .write_frame(Plain::TAG, 100, &mut buf)
        .expect("fits");
    send_raw(&mut b, &buf[..n]);
    b.send(&Plain {
        id: 9,
        data: vec![9],
    })
    .expect("sent");
    // Both land before the receiver looks.
    std::thread::sleep(Duration::from_millis(300));
    match a.recv_timeout(WAIT) {
        Err(Error::ReadFailed { seq: 100, .. }) => {}
        other => panic!("ReadFailed first, not {other:?}"),
    }
    let p: Plain = recv(&mut a).decode().expect("the message after it");
    assert_eq!(p.id, 9);
    let end = a.recv_timeout(WAIT).expect_err("then the failure");
    assert!(end.is_fatal(), "{end}");
}

/// Copies kept for the delivery record, bounded well above these tests' messages.
fn keeping() -> SessionConfig {
    SessionConfig {
        keep_unconfirmed: Some(64 << 20),
        ..SessionConfig::default()
    }
}

/// Messages of three sizes, one per way a message goes: whole, in fragments, by rendezvous.
fn varied(id: u32) -> Plain {
    Plain {
        id,
        data: pattern(id, [10, 5_000, 100_000][id as usize % 3]),
    }
}

/// The message a peer sends to say, in its header, how many it took.
fn answer() -> Plain {
    Plain {
        id: 999,
        data: Vec::new(),
    }
}

/// The fatal error that ends `s`, once what arrived before it was taken (none expected).
fn end_of(s: &mut Session) -> Error {
    match s.recv_timeout(WAIT) {
        Err(e) => e,
        Ok(other) => panic!("the end, not {other:?}"),
    }
}

/// The delivery record after a failure: the peer took five of twelve messages, said so in its
/// next frame, and vanished. The sender's record says so, and hands back exactly the seven
/// others, in order, intact, whichever way each went.
#[test]
#[ignore = "needs an RDMA device"]
fn the_record_hands_back_exactly_what_a_vanished_peer_did_not_take() {
    const SENT: u32 = 12;
    const TAKEN: u32 = 5;
    let (mut server, mut client) = pair(SessionConfig::default(), keeping());
    for id in 0..SENT {
        client.send(&varied(id)).expect("sent");
    }
    for id in 0..TAKEN {
        assert_eq!(recv(&mut server).decode::<Plain>().unwrap(), varied(id));
    }
    assert!(
        client.take_unconfirmed().is_none(),
        "nothing is handed back while the peer may still take it"
    );
    server
        .send(&answer())
        .expect("the answer carries the count");
    drop(server);
    assert_eq!(recv(&mut client).decode::<Plain>().unwrap().id, 999);
    let end = end_of(&mut client);
    assert!(end.is_fatal(), "{end}");
    assert_eq!(
        client.delivery(),
        rdmsg::Delivery {
            sent: SENT.into(),
            taken: TAKEN.into()
        }
    );
    let back = client.take_unconfirmed().expect("the connection ended");
    let ids: Vec<u32> = back.iter().map(|e| e.seq()).collect();
    assert_eq!(ids, (TAKEN..SENT).collect::<Vec<_>>(), "the rest, in order");
    for env in &back {
        assert_eq!(env.decode::<Plain>().unwrap(), varied(env.seq()));
    }
}

/// A close with the record waits for the peer's application to take everything (here a slow
/// one); with too little time, it names what was taken and hands back the rest.
#[test]
#[ignore = "needs an RDMA device"]
fn a_close_with_the_record_waits_for_the_peer_to_take_everything_or_hands_back_the_rest() {
    const SENT: u32 = 30;
    let (mut server, mut client) = pair(SessionConfig::default(), SessionConfig::default());
    let reader = std::thread::spawn(move || {
        for id in 0..SENT {
            if id % 10 == 0 {
                std::thread::sleep(Duration::from_millis(100));
            }
            assert_eq!(recv(&mut server).decode::<Plain>().unwrap(), varied(id));
        }
        assert!(end_of(&mut server).is_peer_closed());
    });
    for id in 0..SENT {
        client.send(&varied(id)).expect("sent");
    }
    let closed = client.close_with_record();
    closed.result.expect("closed");
    assert_eq!(
        closed.delivery.taken,
        SENT.into(),
        "all taken before the close"
    );
    assert!(closed.unconfirmed.is_empty());
    reader.join().unwrap();

    // A peer that took three, said so, and then did not read within the close timeout.
    let short = Config {
        close_timeout: Duration::from_millis(500),
        ..Config::default()
    };
    let (a, b) = loopback_pair(&Config::default(), &short).expect("device");
    let (mut server, mut client) = (Session::new(a), Session::with_config(b, keeping()));
    for id in 0..SENT {
        client.send(&varied(id)).expect("sent");
    }
    for id in 0..3 {
        assert_eq!(recv(&mut server).decode::<Plain>().unwrap(), varied(id));
    }
    server.send(&answer()).unwrap();
    let closed = client.close_with_record();
    assert_eq!(closed.delivery.sent, SENT.into());
    assert_eq!(closed.delivery.taken, 3, "what the peer said it took");
    let ids: Vec<u32> = closed.unconfirmed.iter().map(|e| e.seq()).collect();
    assert_eq!(ids, (3..SENT).collect::<Vec<_>>());
    drop(server);
}

/// A one-way stream: the receiver never sends a message, yet the sender's record follows it,
/// carried by the credit grants the receiver sends anyway.
#[test]
#[ignore = "needs an RDMA device"]
fn the_record_of_a_one_way_stream_rides_the_credit_grants() {
    const SENT: u64 = 3_000;
    let (mut server, mut client) = pair(SessionConfig::default(), SessionConfig::default());
    let reader = std::thread::spawn(move || {
        for id in 0..SENT {
            assert_eq!(recv(&mut server).seq(), id as u32);
        }
        server
    });
    let small = Plain {
        id: 0,
        data: vec![7; 16],
    };
    for _ in 0..SENT {
        client.send_as(&small, false).expect("sent");
    }
    client.flush().unwrap();
    let server = reader.join().unwrap();
    let depth = u64::from(client.connection().peer().recv_depth);
    let t = Instant::now();
    while client.delivery().taken + depth < SENT && t.elapsed() < Duration::from_secs(10) {
        client.try_recv().expect("nothing fails");
        std::thread::sleep(Duration::from_millis(5));
    }
    let d = client.delivery();
    assert!(
        d.taken + depth >= SENT && d.taken <= SENT,
        "{d:?}: within the receiver's depth ({depth}) of the end"
    );
    assert_eq!(client.stats().received, 0, "no message came back");
    drop(server);
}

/// The typed hub hands back what a peer that vanished did not take, as an event before its
/// `Disconnected`.
#[test]
#[ignore = "needs an RDMA device"]
fn a_hub_hands_back_what_a_vanished_peer_did_not_take() {
    use rdmsg::HubEvent;
    const SENT: u32 = 10;
    const TAKEN: u32 = 4;
    let ep = rdmsg::Endpoint::open_default().expect("device");
    let mut hub =
        rdmsg::Hub::with_config(&ep, rdmsg::HubConfig::default(), keeping()).expect("hub");
    let addr = hub.listen("127.0.0.1:0").expect("listening");
    let (all_sent, sent) = std::sync::mpsc::channel();
    let client = std::thread::spawn(move || {
        let mut s = Session::new(ep.connect(addr, &Config::default()).expect("connected"));
        for id in 0..TAKEN {
            assert_eq!(recv(&mut s).decode::<Plain>().unwrap(), varied(id));
        }
        s.send(&answer()).unwrap();
        // Vanishes once everything was sent: dropped without a close.
        sent.recv().unwrap();
    });
    let mut back = None;
    loop {
        match hub
            .recv_timeout(WAIT)
            .expect("the hub goes on")
            .expect("an event")
        {
            HubEvent::Connected { peer, .. } => {
                for id in 0..SENT {
                    hub.send(peer, &varied(id)).expect("sent");
                }
                all_sent.send(()).unwrap();
            }
            HubEvent::Message { peer, msg } => {
                assert_eq!(msg.decode::<Plain>().unwrap().id, 999);
                assert_eq!(hub.delivery(peer).unwrap().taken, TAKEN.into());
            }
            HubEvent::Writable { .. } | HubEvent::CallEnded { .. } => {}
            HubEvent::Unconfirmed {
                delivery, messages, ..
            } => {
                assert_eq!(delivery.taken, TAKEN.into());
                back = Some(messages);
            }
            HubEvent::Disconnected { failure, .. } => {
                assert_ne!(failure, rdmsg::Failure::Closed, "{failure}");
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    client.join().unwrap();
    let back = back.expect("handed back before Disconnected");
    let ids: Vec<u32> = back.iter().map(|e| e.seq()).collect();
    assert_eq!(ids, (TAKEN..SENT).collect::<Vec<_>>());
    for env in &back {
        assert_eq!(env.decode::<Plain>().unwrap(), varied(env.seq()));
    }
}

/// What a receiver reads is negotiated: one that reads at most 100,000 bytes gets a larger
/// message in fragments (it used to refuse the descriptor, after the sender was told the
/// message went), and smaller large ones by rendezvous.
#[test]
#[ignore = "needs an RDMA device"]
fn a_message_larger_than_the_peer_reads_goes_in_fragments() {
    let (a, b) = loopback_pair(
        &Config {
            max_read_bytes: 100_000,
            ..Config::default()
        },
        &Config::default(),
    )
    .expect("device");
    let (mut small_reader, mut sender) = (Session::new(a), Session::new(b));
    assert_eq!(sender.connection().peer().max_read, 100_000);
    let (big, fits) = (varied_of(1, 500_000), varied_of(2, 50_000));
    let reader = std::thread::spawn(move || {
        assert_eq!(recv(&mut small_reader).decode::<Plain>().unwrap(), big);
        assert_eq!(recv(&mut small_reader).decode::<Plain>().unwrap(), fits);
        small_reader
    });
    sender.send(&varied_of(1, 500_000)).expect("sent");
    sender.send(&varied_of(2, 50_000)).expect("sent");
    let small_reader = reader.join().unwrap();
    let s = sender.stats();
    assert_eq!((s.fragmented, s.rendezvous_sent), (1, 1), "{s:?}");
    assert_eq!(small_reader.stats().dropped_frames, 0);
    assert!(small_reader.stats().rendezvous_registered <= 100_000);
}

fn varied_of(id: u32, len: usize) -> Plain {
    Plain {
        id,
        data: pattern(id, len),
    }
}

/// The close carries the count: a peer that took six of ten messages and closed without
/// sending anything tells the sender exactly which four it did not take.
#[test]
#[ignore = "needs an RDMA device"]
fn the_peers_close_says_what_it_took() {
    let (mut server, mut client) = pair(SessionConfig::default(), keeping());
    for id in 0..10 {
        client.send(&varied(id)).expect("sent");
    }
    for id in 0..6 {
        assert_eq!(recv(&mut server).decode::<Plain>().unwrap(), varied(id));
    }
    server.close().expect("closed");
    let end = end_of(&mut client);
    assert!(end.is_peer_closed(), "{end}");
    assert_eq!(client.delivery().taken, 6, "{:?}", client.delivery());
    let back = client.take_unconfirmed().expect("the connection ended");
    let ids: Vec<u32> = back.iter().map(|e| e.seq()).collect();
    assert_eq!(ids, [6, 7, 8, 9]);
}
