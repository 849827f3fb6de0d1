//! The async handles as tokio users expect them, on rxe0: sends cancelled at random with
//! exactly-once delivery, `Stream` and `Sink`, close from any handle, close after the peer
//! vanished, an accept loop that survives failed handshakes, teardown off the runtime's
//! threads, handles made outside a runtime, and the `current_thread` runtime. Ignored on
//! hosts; `cargo xtask test` runs them in the VM.

use std::collections::HashMap;
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use rdmsg::msg::{HubEvent, Session, SessionConfig};
use rdmsg::tokio::{AsyncHub, AsyncListener, AsyncSession, Error};
use rdmsg::transport::{loopback_pair, Config, Endpoint, HubConfig};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Numbered {
    sender: u32,
    seq: u64,
    #[serde(with = "serde_bytes")]
    pad: Vec<u8>,
}
rdmsg::msg::message!(Numbered, tag = "rdmsg.test.Numbered", solicited = false);

const LONG: Duration = Duration::from_secs(30);

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A connected pair of sessions (made on a blocking thread: it waits for the handshake).
async fn sessions(a: SessionConfig, b: SessionConfig) -> (Session, Session) {
    tokio::task::spawn_blocking(move || {
        let (x, y) = loopback_pair(&Config::default(), &Config::default()).expect("device");
        (Session::with_config(x, a), Session::with_config(y, b))
    })
    .await
    .unwrap()
}

async fn pair() -> (AsyncSession, AsyncSession) {
    let (x, y) = sessions(SessionConfig::default(), SessionConfig::default()).await;
    (AsyncSession::new(x).unwrap(), AsyncSession::new(y).unwrap())
}

/// The payload of `sender`'s message `seq`: its size varies from 16 B to 256 KiB (one in 16
/// large enough for rendezvous or fragments), its bytes say whose it is.
fn numbered(sender: u32, seq: u64) -> Numbered {
    let len = match seq % 16 {
        0 => 256 << 10,
        5 => 40 << 10,
        9 => 3000,
        _ => 16 + (seq % 7) as usize * 50,
    };
    let fill = (sender as u64 * 31 + seq) as u8;
    Numbered {
        sender,
        seq,
        pad: vec![fill; len],
    }
}

/// Four tasks send numbered messages over clones of one session, each send raced against a
/// random timer (sometimes `send`, sometimes `reserve` then `SendPermit::send`), and resend
/// what timed out; the receiver, its own `recv`s raced against timers too, gets every message
/// exactly once, in each sender's order, whole.
#[test]
#[ignore = "device"]
fn randomly_cancelled_sends_deliver_exactly_once() {
    multi_thread().block_on(async {
        let (me, peer) = pair().await;
        let (senders, per_sender) = (4u32, 600u64);
        let cancelled = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for sender in 0..senders {
            let (me, cancelled) = (me.clone(), cancelled.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(u64::from(sender) + 7);
                let mut seq = 0;
                while seq < per_sender {
                    let m = numbered(sender, seq);
                    let limit = Duration::from_micros(rng.u64(0..3000));
                    let done = if rng.bool() {
                        tokio::time::timeout(limit, me.send(&m)).await
                    } else {
                        match tokio::time::timeout(limit, me.reserve()).await {
                            Ok(permit) => Ok(permit.and_then(|p| p.send(&m))),
                            Err(e) => Err(e),
                        }
                    };
                    match done {
                        Ok(sent) => {
                            sent.unwrap();
                            seq += 1;
                        }
                        // Nothing was sent: the same message goes again.
                        Err(_) => {
                            cancelled.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        let total = u64::from(senders) * per_sender;
        let receiving = tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(99);
            let mut next: HashMap<u32, u64> = HashMap::new();
            let (mut got, mut recv_cancelled) = (0u64, 0u64);
            let deadline = Instant::now() + Duration::from_secs(240);
            while got < total {
                assert!(Instant::now() < deadline, "stalled at {got} of {total}");
                let limit = Duration::from_micros(rng.u64(0..400));
                let Ok(env) = tokio::time::timeout(limit, peer.recv()).await else {
                    recv_cancelled += 1;
                    continue;
                };
                let m: Numbered = env.unwrap().decode().unwrap();
                let want = next.entry(m.sender).or_insert(0);
                assert_eq!(m.seq, *want, "sender {}: lost, duplicated or out of order", m.sender);
                assert_eq!(m, numbered(m.sender, m.seq), "corrupt");
                *want += 1;
                got += 1;
            }
            (peer, recv_cancelled)
        });
        for t in tasks {
            t.await.unwrap();
        }
        // The close sends what is still committed first, within its timeout.
        me.close().await.unwrap();
        let (peer, recv_cancelled) = tokio::time::timeout(Duration::from_secs(300), receiving)
            .await
            .expect("every message")
            .unwrap();
        let cancelled = cancelled.load(Ordering::Relaxed);
        println!(
            "exactly once: {total} messages, {cancelled} sends and {recv_cancelled} receives cancelled"
        );
        assert!(cancelled > 20, "the timers cancelled too few sends ({cancelled})");
        assert_eq!(me.delivery().sent, total, "every completed send, and no other");
        // Nothing more is there: no duplicate after the last.
        let end = tokio::time::timeout(LONG, peer.recv()).await.unwrap();
        assert!(end.as_ref().is_err_and(Error::is_peer_closed), "{end:?}");
    });
}

/// `split` halves: a `Sink` fed with `send_all` on one side, a `Stream` on the other that
/// ends at the peer's graceful close; a hub's events as a `Stream`, and a `PeerSink`.
#[test]
#[ignore = "device"]
fn streams_and_sinks_carry_sessions_and_hubs() {
    multi_thread().block_on(async {
        let (a, b) = pair().await;
        let (mut sink, _) = a.split();
        let stream = b.stream();
        let n = 300u64;
        let feeding = tokio::spawn(async move {
            let mut items = futures::stream::iter((0..n).map(|seq| Ok(numbered(0, seq))));
            sink.send_all(&mut items).await.unwrap();
            sink.close().await.unwrap();
            a.close().await.unwrap();
        });
        let got: Vec<Numbered> = tokio::time::timeout(
            LONG,
            stream
                .map(|env| env.unwrap().decode::<Numbered>().unwrap())
                .collect(),
        )
        .await
        .expect("the stream ends at the close");
        feeding.await.unwrap();
        assert_eq!(got.len() as u64, n);
        for (seq, m) in got.iter().enumerate() {
            assert_eq!(*m, numbered(0, seq as u64));
        }

        // A hub: its events as a stream, and a sink to one peer.
        let ep = Endpoint::open_default().expect("device");
        let hub = AsyncHub::new(rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let addr = hub.with_hub(|h| h.listen("127.0.0.1:0")).unwrap();
        // The hub moves the handshake on while a task waits on its events.
        let connecting = {
            let ep = ep.clone();
            tokio::spawn(async move {
                AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default()).await
            })
        };
        let mut events = hub.events();
        let peer = loop {
            match tokio::time::timeout(LONG, events.next()).await.unwrap() {
                Some(Ok(HubEvent::Connected { peer, .. })) => break peer,
                Some(Ok(_)) => {}
                other => panic!("{other:?}"),
            }
        };
        let client = connecting.await.unwrap().unwrap();
        let mut to_client = hub.sink_to(peer);
        for seq in 0..50 {
            to_client.feed(numbered(1, seq)).await.unwrap();
        }
        to_client.flush().await.unwrap();
        let mut from_hub = client.stream();
        for seq in 0..50 {
            let env = tokio::time::timeout(LONG, from_hub.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(env.decode::<Numbered>().unwrap(), numbered(1, seq));
        }
        // The other way, while a task waits on the hub's events (a hub moves on only then:
        // a 256 KiB message to it needs its credits and its read).
        let sending = {
            let client = client.clone();
            tokio::spawn(async move { client.sink().send(numbered(2, 0)).await })
        };
        loop {
            match tokio::time::timeout(LONG, events.next()).await.unwrap() {
                Some(Ok(HubEvent::Message { msg, .. })) => {
                    assert_eq!(msg.decode::<Numbered>().unwrap(), numbered(2, 0));
                    break;
                }
                Some(Ok(_)) => {}
                other => panic!("{other:?}"),
            }
        }
        sending.await.unwrap().unwrap();
        client.close().await.unwrap();
    });
}

/// Any clone closes the session for all: a task waiting in `recv` on another clone wakes
/// with `Closed`, as does every later call; the counters and the delivery record stay
/// readable; a second close is `Closed`.
#[test]
#[ignore = "device"]
fn any_handle_closes_the_session_for_all() {
    multi_thread().block_on(async {
        let (me, peer) = pair().await;
        let waiting = {
            let me = me.clone();
            tokio::spawn(async move { me.recv().await })
        };
        let writer = me.clone();
        writer.send(&numbered(0, 1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Instant::now();
        me.close().await.unwrap();
        println!("closed in {:?}", t.elapsed());
        let woke = tokio::time::timeout(LONG, waiting).await.unwrap().unwrap();
        assert!(matches!(woke, Err(Error::Closed)), "{woke:?}");
        assert!(matches!(
            writer.send(&numbered(0, 2)).await,
            Err(Error::Closed)
        ));
        assert!(matches!(writer.reserve().await, Err(Error::Closed)));
        assert!(matches!(me.close().await, Err(Error::Closed)));
        assert!(Error::Closed.is_fatal() && !Error::Closed.is_peer_closed());
        assert_eq!(writer.stats().sent, 1);
        assert_eq!(writer.delivery().sent, 1);
        // The peer got the message, then the close.
        let m: Numbered = peer.recv().await.unwrap().decode().unwrap();
        assert_eq!(m, numbered(0, 1));
        let end = tokio::time::timeout(LONG, peer.recv()).await.unwrap();
        assert!(end.as_ref().is_err_and(Error::is_peer_closed), "{end:?}");
        assert!(
            !end.unwrap_err().to_string().contains("failed"),
            "a graceful close reads as one"
        );
    });
}

/// A peer that dropped its session without closing: `close` returns in well under a second
/// with the peer's failure, not after `close_timeout`; whether or not a `recv` saw it first.
#[test]
#[ignore = "device"]
fn close_after_the_peer_vanished_returns_at_once() {
    multi_thread().block_on(async {
        for looked_first in [true, false] {
            let (me, peer) = pair().await;
            me.send(&numbered(0, 0)).await.unwrap();
            drop(peer);
            if looked_first {
                let err = tokio::time::timeout(LONG, me.recv()).await.unwrap();
                assert!(err.is_err(), "{err:?}");
            } else {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let t = Instant::now();
            let closed = me.close().await;
            let took = t.elapsed();
            println!("close after the peer vanished (looked first: {looked_first}): {took:?}, {closed:?}");
            let err = closed.expect_err("the peer is gone");
            assert!(err.is_fatal() && !err.is_peer_closed(), "{err}");
            assert!(took < Duration::from_millis(500), "close took {took:?}");
        }
    });
}

/// A client that fails its handshake (garbage, then an early hang-up) does not stop the
/// README's accept loop: the next good client is served. `incoming()` yields the failure
/// as an item and goes on.
#[test]
#[ignore = "device"]
fn the_accept_loop_survives_failed_handshakes() {
    multi_thread().block_on(async {
        let ep = Endpoint::open_default().expect("device");
        let listener = AsyncListener::bind(
            &ep,
            "127.0.0.1:0",
            Config::default(),
            SessionConfig::default(),
        )
        .unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = {
            let listener = listener.clone();
            tokio::spawn(async move {
                let mut served = 0;
                while let Ok(client) = listener.accept().await {
                    let m: Numbered = client.recv().await.unwrap().decode().unwrap();
                    client.send(&m).await.unwrap();
                    // Waits until the client has read the echo (lent by rendezvous).
                    client.close().await.unwrap();
                    served += 1;
                    if served == 2 {
                        break;
                    }
                }
                served
            })
        };
        let bad_clients = || {
            let mut garbage = std::net::TcpStream::connect(addr).unwrap();
            garbage.write_all(&[0xde; 200]).unwrap();
            drop(garbage);
            drop(std::net::TcpStream::connect(addr).unwrap());
        };
        for round in 0..2u64 {
            bad_clients();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let good =
                AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default())
                    .await
                    .unwrap_or_else(|e| panic!("round {round}: a good client after bad ones: {e}"));
            good.send(&numbered(3, round)).await.unwrap();
            let echo: Numbered = tokio::time::timeout(LONG, good.recv())
                .await
                .unwrap()
                .unwrap()
                .decode()
                .unwrap();
            assert_eq!(echo, numbered(3, round));
            // The server closes first.
            let end = tokio::time::timeout(LONG, good.recv()).await.unwrap();
            assert!(end.as_ref().is_err_and(Error::is_peer_closed), "{end:?}");
        }
        assert_eq!(serving.await.unwrap(), 2);
        assert!(
            listener.failed_handshakes() >= 2,
            "{}",
            listener.failed_handshakes()
        );

        // The stream of every outcome: the failure is an item, then the good client.
        let mut incoming = listener.incoming();
        let before = listener.failed_handshakes();
        bad_clients();
        let good = {
            let ep = ep.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default()).await
            })
        };
        let mut failures = 0;
        loop {
            match tokio::time::timeout(LONG, incoming.next()).await.unwrap() {
                Some(Ok(_client)) => break,
                Some(Err(e)) => {
                    assert!(matches!(e, Error::Handshake(_)) && !e.is_fatal(), "{e}");
                    failures += 1;
                }
                None => panic!("the stream ended"),
            }
        }
        assert!(failures >= 1 && listener.failed_handshakes() > before);
        good.await.unwrap().unwrap().close().await.ok();
    });
}

/// Runs `f`, giving its wall-clock time.
fn cost<R>(f: impl FnOnce() -> R) -> (R, Cost) {
    let wall = Instant::now();
    let r = f();
    let wall = wall.elapsed();
    (r, Cost { wall })
}

#[derive(Debug, Clone, Copy, Default)]
struct Cost {
    wall: Duration,
}

/// Wraps a future, keeping what each of its polls cost.
struct Timed<F> {
    inner: Pin<Box<F>>,
    polls: Arc<std::sync::Mutex<Vec<Cost>>>,
}

fn timed<F: Future>(f: F) -> Timed<F> {
    Timed {
        inner: Box::pin(f),
        polls: Arc::default(),
    }
}

impl<F: Future> Future for Timed<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let (out, took) = cost(|| self.inner.as_mut().poll(cx));
        self.polls.lock().unwrap().push(took);
        out
    }
}

/// Sessions connected, accepted, used, closed and dropped on a runtime: no kind of call on
/// its thread (a poll of `connect`, `accept` or `close`, dropping the last handle or a
/// listener) takes a millisecond; the verbs work runs
/// on rdmsg's own threads, where a session's teardown takes 1.4 to 16 ms. Each kind is
/// judged by its median over 10 rounds (every poll counted): the guest's two CPUs are two host threads of an
/// emulator on a two-core host, so any one call's time can include milliseconds in which the
/// host ran something else (the thread's own CPU time too, as the guest counts it). The longest
/// of each kind is printed, with tokio's own calls for scale.
#[test]
#[ignore = "device"]
fn teardown_never_blocks_a_runtime_thread() {
    current_thread().block_on(async {
        let ep = Endpoint::open_default().expect("device");
        let mut all: Vec<(&str, Cost)> = Vec::new();
        for i in 0..10 {
            let listener = AsyncListener::bind(
                &ep,
                "127.0.0.1:0",
                Config::default(),
                SessionConfig::default(),
            )
            .unwrap();
            let addr = listener.local_addr().unwrap();
            let connect = timed(AsyncSession::connect(
                &ep,
                addr,
                Config::default(),
                SessionConfig::default(),
            ));
            let accept = timed(listener.accept());
            let (connect_polls, accept_polls) = (connect.polls.clone(), accept.polls.clone());
            let (a, b) = tokio::join!(connect, accept);
            let (a, b) = (a.unwrap(), b.unwrap());
            let polls = |of, all: &mut Vec<(&str, Cost)>, p: &Arc<std::sync::Mutex<Vec<Cost>>>| {
                all.extend(p.lock().unwrap().iter().map(|c| (of, *c)));
            };
            polls("a poll of connect", &mut all, &connect_polls);
            polls("a poll of accept", &mut all, &accept_polls);
            a.send(&numbered(0, i)).await.unwrap();
            let _: Numbered = b.recv().await.unwrap().decode().unwrap();
            if i % 2 == 0 {
                let close = timed(a.close());
                let close_polls = close.polls.clone();
                close.await.unwrap();
                polls("a poll of close", &mut all, &close_polls);
                all.push(("drop after close", cost(|| drop(a)).1));
            } else {
                all.push(("drop", cost(|| drop(a)).1));
            }
            all.push(("drop", cost(|| drop(b)).1));
            all.push(("drop listener", cost(|| drop(listener)).1));
            // What tokio's own objects cost here, for scale.
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let there = tcp.local_addr().unwrap();
            let (stream, _) = tokio::join!(tokio::net::TcpStream::connect(there), tcp.accept());
            all.push(("(tokio) drop a TcpStream", cost(|| drop(stream)).1));
            let (spawned, took) = cost(|| tokio::task::spawn_blocking(|| ()));
            all.push(("(tokio) spawn_blocking", took));
            spawned.await.unwrap();
        }
        let mut kinds: Vec<&str> = all.iter().map(|(k, _)| *k).collect();
        kinds.dedup();
        kinds.sort();
        kinds.dedup();
        let mut slow = Vec::new();
        for kind in kinds {
            let mut walls: Vec<Duration> = all
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, c)| c.wall)
                .collect();
            walls.sort();
            let median = walls[walls.len() / 2];
            let ninetieth = walls[walls.len() * 9 / 10];
            let longest = walls[walls.len() - 1];
            println!(
                "{kind}: median {median:?}, 90th percentile {ninetieth:?}, longest {longest:?} of {}",
                walls.len()
            );
            if median >= Duration::from_millis(1) {
                slow.push((kind, median));
            }
        }
        assert!(slow.is_empty(), "on the runtime thread: {slow:?}");
    });
}

/// Outside a runtime, every constructor returns `NoRuntime`, not a panic.
#[test]
#[ignore = "device"]
fn handles_made_outside_a_runtime_are_an_error() {
    let (x, _y) = loopback_pair(&Config::default(), &Config::default()).expect("device");
    let err = AsyncSession::new(Session::new(x)).unwrap_err();
    assert!(matches!(err, Error::NoRuntime { .. }), "{err}");
    assert!(err.to_string().contains("tokio runtime"), "{err}");
    let ep = Endpoint::open_default().expect("device");
    let err = AsyncListener::bind(
        &ep,
        "127.0.0.1:0",
        Config::default(),
        SessionConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::NoRuntime { .. }), "{err}");
    let hub = rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap();
    assert!(matches!(AsyncHub::new(hub), Err(Error::NoRuntime { .. })));
}

/// The `current_thread` runtime: sends, receives, a call and a close, with one thread.
#[test]
#[ignore = "device"]
fn the_current_thread_runtime_works() {
    current_thread().block_on(async {
        let (a, b) = pair().await;
        let echo = {
            let b = b.clone();
            tokio::spawn(async move {
                for _ in 0..100 {
                    let m: Numbered = b.recv().await.unwrap().decode().unwrap();
                    b.send_as(&m, true).await.unwrap();
                }
            })
        };
        for seq in 0..100 {
            a.send_as(&numbered(4, seq), true).await.unwrap();
            let m: Numbered = tokio::time::timeout(LONG, a.recv())
                .await
                .unwrap()
                .unwrap()
                .decode()
                .unwrap();
            assert_eq!(m, numbered(4, seq));
        }
        echo.await.unwrap();
        a.close().await.unwrap();
        let end = tokio::time::timeout(LONG, b.recv()).await.unwrap();
        assert!(end.as_ref().is_err_and(Error::is_peer_closed), "{end:?}");
    });
}
