//! rdmsg on tokio, on rxe0, on the multi-thread runtime: an async listener serving many async
//! clients (typed request/response), cancellation of `recv` and `send` futures, the
//! solicitation rule while a task awaits, and an async hub. Ignored on hosts; `cargo xtask
//! test` runs them in the VM.

use std::time::{Duration, Instant};

use rdmsg::msg::{HubEvent, Posted, Session, SessionConfig};
use rdmsg::tokio::{AsyncHub, AsyncListener, AsyncSession};
use rdmsg::transport::{Config, Endpoint, HubConfig};
use rdmsg_examples::{loopback_pair, Request, Response};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Tick {
    seq: u64,
    #[serde(with = "serde_bytes")]
    pad: Vec<u8>,
}
rdmsg::msg::message!(Tick, tag = "rdmsg.test.AsyncTick", solicited = false);

const LONG: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn pair(a: SessionConfig, b: SessionConfig) -> (AsyncSession, AsyncSession) {
    let (x, y) = loopback_pair(&Config::default(), &Config::default()).expect("device");
    (
        AsyncSession::new(Session::with_config(x, a)).unwrap(),
        AsyncSession::new(Session::with_config(y, b)).unwrap(),
    )
}

async fn recv<M: rdmsg::msg::Message + serde::de::DeserializeOwned>(s: &AsyncSession) -> M {
    tokio::time::timeout(LONG, s.recv())
        .await
        .expect("a message within 20 s")
        .expect("receive")
        .decode()
        .expect("decode")
}

/// An async listener and eight async clients, each with 200 requests in flight one at a time;
/// the server answers every client from its own task.
#[test]
#[ignore = "device"]
fn an_async_server_answers_many_async_clients() {
    runtime().block_on(async {
        let ep = Endpoint::open_default().expect("device");
        let listener = AsyncListener::bind(
            &ep,
            "127.0.0.1:0",
            Config::default(),
            SessionConfig::default(),
        )
        .unwrap();
        let addr = listener.local_addr().unwrap();
        let clients = 8u32;
        let rounds = 200u32;
        let server = tokio::spawn(async move {
            let mut tasks = Vec::new();
            for _ in 0..clients {
                let s = listener.accept().await.expect("accept");
                tasks.push(tokio::spawn(async move {
                    for _ in 0..rounds {
                        let req: Request = recv(&s).await;
                        let sum = req.operands.iter().sum();
                        s.send(&Response { id: req.id, sum }).await.unwrap();
                    }
                    s
                }));
            }
            let mut sessions = Vec::new();
            for t in tasks {
                sessions.push(t.await.unwrap());
            }
            sessions
        });
        let started = Instant::now();
        let mut tasks = Vec::new();
        for c in 0..clients {
            let ep = ep.clone();
            tasks.push(tokio::spawn(async move {
                let s =
                    AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default())
                        .await
                        .expect("connect");
                for i in 0..rounds {
                    let id = u64::from(c) << 32 | u64::from(i);
                    // Unsolicited: the await below flushes it (the server sleeps solicited-only).
                    s.send_as(
                        &Request {
                            id,
                            operands: vec![i64::from(i), 1],
                        },
                        false,
                    )
                    .await
                    .unwrap();
                    let r: Response = recv(&s).await;
                    assert_eq!((r.id, r.sum), (id, i64::from(i) + 1));
                }
                s
            }));
        }
        for t in tasks {
            let s = t.await.expect("client");
            assert_eq!(s.stats().received, u64::from(rounds));
        }
        let served = server.await.unwrap();
        assert_eq!(served.len(), clients as usize);
        println!(
            "async server: {clients} clients x {rounds} round trips in {:.2} s",
            started.elapsed().as_secs_f64()
        );
    });
}

/// `recv` futures dropped again and again (a short timeout, a `select!` that another branch
/// wins) lose no message: all 3,000 arrive, in order.
#[test]
#[ignore = "device"]
fn dropped_recv_futures_lose_no_message() {
    runtime().block_on(async {
        let (rx, tx) = pair(SessionConfig::default(), SessionConfig::default());
        let n = 3000u64;
        let sender = tokio::spawn(async move {
            for seq in 0..n {
                tx.send_as(&Tick { seq, pad: vec![] }, seq % 7 == 0)
                    .await
                    .unwrap();
                if seq % 100 == 0 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            tx.flush().await.unwrap();
            tx
        });
        let mut next = 0u64;
        let mut dropped = 0u64;
        let mut tick = tokio::time::interval(Duration::from_micros(300));
        let deadline = Instant::now() + Duration::from_secs(60);
        while next < n {
            assert!(Instant::now() < deadline, "{next} of {n} in 60 s");
            tokio::select! {
                got = rx.recv() => {
                    let m: Tick = got.unwrap().decode().unwrap();
                    assert_eq!(m.seq, next, "lost, duplicated or reordered");
                    next += 1;
                }
                _ = tick.tick() => dropped += 1,
            }
        }
        let _tx = sender.await.unwrap();
        println!("{n} received across {dropped} dropped recv futures");
        assert!(dropped > 10, "the futures were dropped: {dropped}");
    });
}

/// A `send` future dropped while it waits for credits sent nothing; one that completed
/// committed its message, which arrives whole even if it needed many frames. The peer
/// receives exactly what the completed sends said.
#[test]
#[ignore = "device"]
fn a_dropped_send_either_sent_or_did_not() {
    runtime().block_on(async {
        let (peer, me) = pair(SessionConfig::default(), SessionConfig::default());
        // The peer does not read: credits run out, and a send waits.
        let mut sent = 0u64;
        loop {
            let m = Tick {
                seq: sent,
                pad: vec![],
            };
            match tokio::time::timeout(Duration::from_millis(200), me.send(&m)).await {
                Ok(done) => {
                    done.unwrap();
                    sent += 1;
                }
                Err(_) => break, // dropped while waiting for a credit
            }
            assert!(sent < 100_000, "credits never ran out");
        }
        assert!(sent > 0);
        // Now the peer reads: exactly the completed sends arrive, then the next one sent.
        for seq in 0..sent {
            let m: Tick = recv(&peer).await;
            assert_eq!(m.seq, seq);
        }
        me.send_as(
            &Tick {
                seq: sent,
                pad: vec![],
            },
            true,
        )
        .await
        .unwrap();
        let m: Tick = recv(&peer).await;
        assert_eq!(m.seq, sent, "the dropped send left nothing behind");
        // A message of many frames whose send is dropped once committed arrives whole.
        let big = Tick {
            seq: sent + 1,
            pad: (0..200_000u32).map(|i| i as u8).collect(),
        };
        let committed =
            tokio::time::timeout(Duration::from_millis(1), me.send_as(&big, true)).await;
        let after = Tick {
            seq: sent + 2,
            pad: vec![1],
        };
        me.send_as(&after, true).await.unwrap();
        let m: Tick = recv(&peer).await;
        let next = if committed.is_err() {
            // Dropped before it was committed: it was not sent at all.
            m
        } else {
            assert_eq!(m, big, "committed, so sent whole, before what followed");
            recv(&peer).await
        };
        assert_eq!(next, after);
    });
}

/// A task awaits `recv` while another sends a request unsolicited: the peer, asleep
/// solicited-only, still sees it (the send goes solicited), and answers.
#[test]
#[ignore = "device"]
fn a_request_sent_while_a_task_awaits_wakes_the_peer() {
    runtime().block_on(async {
        let (server, client) = pair(SessionConfig::default(), SessionConfig::default());
        let answering = tokio::spawn(async move {
            let req: Request = recv(&server).await;
            let at = Instant::now();
            server
                .send(&Response {
                    id: req.id,
                    sum: req.operands.iter().sum(),
                })
                .await
                .unwrap();
            (at, server)
        });
        let waiting = {
            let client = client.clone();
            tokio::spawn(async move { recv::<Response>(&client).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        client
            .send_as(
                &Request {
                    id: 5,
                    operands: vec![2, 2],
                },
                false,
            )
            .await
            .unwrap();
        let (at, _server) = answering.await.unwrap();
        let r = waiting.await.unwrap();
        assert_eq!(r, Response { id: 5, sum: 4 });
        assert!(
            at - t < Duration::from_secs(1),
            "noticed after {:?}",
            at - t
        );
        assert_eq!(client.stats().sent_solicited, 1);
    });
}

/// An async hub serves blocking clients and async hub peers: connect, messages both ways,
/// disconnection.
#[test]
#[ignore = "device"]
fn an_async_hub_serves_many_peers() {
    runtime().block_on(async {
        let ep = Endpoint::open_default().expect("device");
        let hub = AsyncHub::new(rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let addr = hub.with_hub(|h| h.listen("127.0.0.1:0")).unwrap();
        let clients = 6u64;
        let rounds = 100u64;
        let mut threads = Vec::new();
        for c in 0..clients {
            let ep = ep.clone();
            threads.push(std::thread::spawn(move || {
                let mut s = Session::new(ep.connect(addr, &Config::default()).unwrap());
                for i in 0..rounds {
                    s.send(&Request {
                        id: c * 1000 + i,
                        operands: vec![1, 2, 3],
                    })
                    .unwrap();
                    let r: Response = s
                        .recv_timeout(Some(LONG))
                        .unwrap()
                        .expect("an answer")
                        .decode()
                        .unwrap();
                    assert_eq!((r.id, r.sum), (c * 1000 + i, 6));
                }
                s.close().unwrap();
            }));
        }
        // The hub's own task answers everyone until the blocking clients are gone.
        let serving = tokio::spawn(async move {
            let (mut answered, mut gone) = (0u64, 0u64);
            while gone < clients {
                let ev = tokio::time::timeout(LONG, hub.recv())
                    .await
                    .expect("an event");
                match ev.unwrap() {
                    HubEvent::Message { peer, msg } => {
                        let req: Request = msg.decode().unwrap();
                        let sum = req.operands.iter().sum();
                        hub.send(peer, &Response { id: req.id, sum }).await.unwrap();
                        answered += 1;
                    }
                    HubEvent::Disconnected { .. } => gone += 1,
                    _ => {}
                }
            }
            answered
        });
        // And one async hub peer, connected from a second async hub.
        let other =
            AsyncHub::new(rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let to_server = other.connect(addr).await.unwrap();
        other
            .send(
                to_server,
                &Request {
                    id: 99,
                    operands: vec![40, 2],
                },
            )
            .await
            .unwrap();
        let other_got = loop {
            let ev = tokio::time::timeout(LONG, other.recv())
                .await
                .expect("an answer");
            if let HubEvent::Message { msg, .. } = ev.unwrap() {
                break Some(msg.decode::<Response>().unwrap());
            }
        };
        let answered = serving.await.unwrap();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(answered, clients * rounds + 1);
        assert_eq!(other_got, Some(Response { id: 99, sum: 42 }));
    });
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Double(u64);
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Doubled(u64);
rdmsg::msg::request!(Double => Doubled, tag = "rdmsg.test.AsyncDouble");
rdmsg::msg::message!(Doubled, tag = "rdmsg.test.AsyncDoubled");

/// Answers `Double` calls on `server` until it closes; how many it answered.
fn serve_doubles(server: AsyncSession) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut served = 0;
        while let Ok(mut env) = server.recv().await {
            let Double(x) = env.decode().unwrap();
            env.responder::<Double>().unwrap().respond(Doubled(2 * x));
            served += 1;
        }
        served
    })
}

/// Calls `Double(0..n)` through `service` with tower's `call_all`, checking every answer.
async fn call_doubles<S>(service: S, n: u64)
where
    S: tower::Service<Double, Response = Doubled>,
    S::Error: Into<tower::BoxError> + std::fmt::Debug,
{
    use futures::StreamExt;
    use tower::ServiceExt;
    let answers: Vec<_> = service
        .call_all(futures::stream::iter((0..n).map(Double)))
        .collect()
        .await;
    assert_eq!(answers.len() as u64, n);
    for (i, a) in answers.into_iter().enumerate() {
        assert_eq!(a.unwrap(), Doubled(2 * i as u64));
    }
}

/// Calls on tokio: 64 concurrent calls from tasks of one session answered by a serving task
/// (half through `Responder::respond` from spawned tasks), calls cancelled by a timeout whose
/// answers come late, and an async hub that calls a session and answers its calls through
/// the outbox.
#[test]
#[ignore = "device"]
fn async_calls_answer_concurrent_tasks_and_count_cancelled_ones_late() {
    runtime().block_on(async {
        let (client, server) = pair(SessionConfig::default(), SessionConfig::default());
        let serving = tokio::spawn(async move {
            let mut served = 0u64;
            loop {
                let mut env = match server.recv().await {
                    Ok(env) => env,
                    Err(_) => return served,
                };
                let Double(x) = env.decode().unwrap();
                let responder = env.responder::<Double>().unwrap();
                served += 1;
                tokio::spawn(async move {
                    if x >= 1000 {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    responder.respond(Doubled(2 * x));
                });
            }
        });
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let c = client.clone();
                tokio::spawn(async move { c.call(&Double(i), LONG).await.unwrap() })
            })
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), Doubled(2 * i as u64));
        }
        // Cancelled by its own deadline, and by a timeout around the future.
        let err = client
            .call(&Double(1000), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        let cancelled =
            tokio::time::timeout(Duration::from_millis(50), client.call(&Double(1001), LONG));
        assert!(cancelled.await.is_err());
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(client.call(&Double(5), LONG).await.unwrap(), Doubled(10));
        let stats = client.with_session(|s| s.call_stats()).unwrap();
        assert_eq!(
            (stats.late, stats.timed_out, stats.in_flight),
            (2, 1, 0),
            "{stats:?}"
        );
        client.close().await.unwrap();
        assert_eq!(serving.await.unwrap(), 67);

        // An async hub: calls a session, and answers the session's calls by `reply`.
        let ep = Endpoint::open_default().unwrap();
        let hub = AsyncHub::new(rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let addr = hub.with_hub(|h| h.listen("127.0.0.1:0")).unwrap();
        let ep2 = ep.clone();
        // The handshake runs inside the hub: it must be driven (here, by `recv`) meanwhile.
        let connecting = tokio::spawn(async move {
            AsyncSession::connect(&ep2, addr, Config::default(), SessionConfig::default()).await
        });
        let peer = loop {
            if let HubEvent::Connected { peer, .. } = hub.recv().await.unwrap() {
                break peer;
            }
        };
        let session = connecting.await.unwrap().unwrap();
        let s2 = session.clone();
        let answering = tokio::spawn(async move {
            for _ in 0..10 {
                let mut env = s2.recv().await.unwrap();
                let Double(x) = env.decode().unwrap();
                env.responder::<Double>().unwrap().respond(Doubled(2 * x));
            }
        });
        for i in 0..10 {
            let got = hub.call(peer, &Double(i), LONG).await;
            let (hs, ss) = (
                hub.with_hub(|h| (h.call_stats(), h.peer_stats(peer), h.outbox(peer))),
                session.with_session(|s| (s.call_stats(), s.stats(), s.connection().credits())),
            );
            assert_eq!(
                got.unwrap_or_else(|e| panic!("call {i}: {e}\nhub {hs:?}\nsession {ss:?}")),
                Doubled(2 * i)
            );
        }
        answering.await.unwrap();
        let h2 = hub.clone();
        let hub_side = tokio::spawn(async move {
            for _ in 0..10 {
                match h2.recv().await.unwrap() {
                    HubEvent::Message { mut msg, .. } => {
                        let Double(x) = msg.decode().unwrap();
                        let r = msg.responder::<Double>().unwrap();
                        assert!(matches!(
                            h2.reply(r, Doubled(3 * x)).unwrap(),
                            Posted::Sent | Posted::Queued
                        ));
                    }
                    ev => panic!("{ev:?}"),
                }
            }
        });
        for i in 0..10 {
            assert_eq!(
                session.call(&Double(i), LONG).await.unwrap(),
                Doubled(3 * i)
            );
        }
        hub_side.await.unwrap();
        session.close().await.unwrap();
    });
}

/// Calls as tower services: a session's behind tower's concurrency limit and timeout, and
/// two peers of an async hub behind tower's power-of-two-choices balancer (a fixed list:
/// peers as services); every answer right, both peers used.
#[test]
#[ignore = "device"]
fn calls_serve_as_tower_services_limited_and_balanced() {
    use tower::ServiceBuilder;
    runtime().block_on(async {
        let (client, server) = pair(SessionConfig::default(), SessionConfig::default());
        let serving = serve_doubles(server);
        let limited = ServiceBuilder::new()
            .concurrency_limit(4)
            .timeout(LONG)
            .service(client.service::<Double>(LONG));
        call_doubles(limited, 32).await;
        client.close().await.unwrap();
        assert_eq!(serving.await.unwrap(), 32);

        let ep = Endpoint::open_default().unwrap();
        let hub = AsyncHub::new(rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let addr = hub.with_hub(|h| h.listen("127.0.0.1:0")).unwrap();
        let mut servers = Vec::new();
        for _ in 0..2 {
            let ep = ep.clone();
            servers.push(tokio::spawn(async move {
                AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default()).await
            }));
        }
        let mut peers = Vec::new();
        while peers.len() < 2 {
            if let HubEvent::Connected { peer, .. } = hub.recv().await.unwrap() {
                peers.push(peer);
            }
        }
        let mut sessions = Vec::new();
        let mut serving = Vec::new();
        for s in servers {
            let session = s.await.unwrap().unwrap();
            serving.push(serve_doubles(session.clone()));
            sessions.push(session);
        }
        let services: Vec<_> = peers
            .iter()
            .map(|&p| hub.service::<Double>(p, LONG))
            .collect();
        assert_eq!(services[1].peer(), Some(peers[1]));
        let balanced =
            tower::balance::p2c::Balance::new(tower::load::PendingRequestsDiscover::new(
                tower::discover::ServiceList::new(services),
                tower::load::CompleteOnResponse::default(),
            ));
        call_doubles(balanced, 64).await;
        for s in &sessions {
            s.close().await.unwrap();
        }
        let mut served = Vec::new();
        for s in serving {
            served.push(s.await.unwrap());
        }
        println!("stats tower balance: served {served:?}");
        assert_eq!(served.iter().sum::<u64>(), 64, "{served:?}");
        assert!(
            served.iter().all(|&n| n > 0),
            "both peers take calls: {served:?}"
        );
    });
}

/// A hub's peers as a discoverable set (`AsyncHub::discover`): tower's balancer spreads calls
/// over the servers that connected, and stops choosing one once its connection closes,
/// without the application reading the hub's events.
#[test]
#[ignore = "device"]
fn a_hubs_peers_are_a_discoverable_set_for_tower_balance() {
    use futures::StreamExt;
    runtime().block_on(async {
        let ep = Endpoint::open_default().unwrap();
        let hub = AsyncHub::new(rdmsg::msg::Hub::new(&ep, HubConfig::default()).unwrap()).unwrap();
        let addr = hub.with_hub(|h| h.listen("127.0.0.1:0")).unwrap();
        // Nobody chosen: nothing discovered.
        let mut none = hub.discover_where::<Double>(LONG, |_, _| false);
        let mut all = hub.discover::<Double>(LONG);
        // Each server appears once its handshake is done (polling the set drives the hub, which
        // accepts), as the hub's own service to it.
        let mut sessions = Vec::new();
        let mut serving = Vec::new();
        let mut inserted = Vec::new();
        for _ in 0..2 {
            let connecting =
                AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default());
            let (session, change) = tokio::join!(connecting, all.next());
            let session = session.unwrap();
            match change.unwrap().unwrap() {
                tower::discover::Change::Insert(peer, service) => {
                    assert_eq!(service.peer(), Some(peer));
                    inserted.push(peer);
                }
                tower::discover::Change::Remove(peer) => panic!("{peer} removed"),
            }
            serving.push(serve_doubles(session.clone()));
            sessions.push(session);
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(200), none.next())
                .await
                .is_err()
        );
        let mut balanced =
            tower::balance::p2c::Balance::new(tower::load::PendingRequestsDiscover::new(
                hub.discover::<Double>(LONG),
                tower::load::CompleteOnResponse::default(),
            ));
        call_doubles(&mut balanced, 64).await;
        // The first server goes: the set drops it, and every later call goes to the second.
        let leaving = sessions.remove(0);
        let (closed, change) = tokio::join!(leaving.close(), all.next());
        closed.unwrap();
        match change.unwrap().unwrap() {
            tower::discover::Change::Remove(peer) => assert_eq!(peer, inserted[0]),
            tower::discover::Change::Insert(peer, _) => panic!("{peer} inserted"),
        }
        let first = serving.remove(0).await.unwrap();
        call_doubles(&mut balanced, 64).await;
        let leaving = sessions.remove(0);
        let (closed, change) = tokio::join!(leaving.close(), all.next());
        closed.unwrap();
        assert!(matches!(
            change.unwrap().unwrap(),
            tower::discover::Change::Remove(peer) if peer == inserted[1]
        ));
        let second = serving.remove(0).await.unwrap();
        println!("stats tower discover: served {first} then closed, {second}");
        assert!(
            first > 0 && first < 64,
            "both take calls: {first}, {second}"
        );
        assert_eq!(first + second, 128);
    });
}

/// `AsyncSession::close` towards a peer dropped without closing (as when its process dies)
/// fails as the peer vanished at once, not after `close_timeout`, as the blocking close does.
#[test]
#[ignore = "device"]
fn an_async_close_towards_a_vanished_peer_fails_at_once_as_vanished() {
    runtime().block_on(async {
        let (a, b) = pair(SessionConfig::default(), SessionConfig::default());
        drop(b);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t = Instant::now();
        let r = a.close().await;
        let took = t.elapsed();
        println!("stats async close towards a vanished peer: {took:?}");
        assert!(
            matches!(
                r,
                Err(rdmsg::tokio::Error::Msg(rdmsg::msg::Error::Transport(
                    rdmsg::transport::Error::Connection(rdmsg::transport::Failure::PeerVanished)
                )))
            ),
            "{r:?}"
        );
        assert!(took < Duration::from_millis(500), "{took:?}");
    });
}

/// An async call whose peer streams instead of answering, on a session that only makes calls
/// (nothing receives): the call keeps at most `max_held_bytes` of what arrives, the rest stay
/// in their receive buffers with the peer's credits, so the peer's sends stop; the call times
/// out; then everything arrives, once, in order (issue 40).
#[test]
#[ignore = "device"]
fn an_async_call_keeps_what_a_streaming_peer_sends_within_its_bound() {
    const HELD: usize = 256 << 10;
    let tick = |seq| Tick {
        seq,
        pad: vec![7; 4000],
    };
    runtime().block_on(async {
        let config = SessionConfig {
            max_held_bytes: HELD,
            ..SessionConfig::default()
        };
        let (client, server) = pair(config, SessionConfig::default());
        let streaming = tokio::spawn(async move {
            let mut env = server.recv().await.unwrap();
            let responder = env.responder::<Double>().unwrap();
            let mut seq = 0;
            // A send dropped by its timeout sent nothing.
            let stopped = loop {
                let m = tick(seq);
                let sending = server.send(&m);
                match tokio::time::timeout(Duration::from_secs(2), sending).await {
                    Ok(sent) => sent.unwrap(),
                    Err(_) => break true,
                }
                seq += 1;
                if seq == 50_000 {
                    break false;
                }
            };
            (server, responder, seq, stopped)
        });
        let t = Instant::now();
        let err = client
            .call(&Double(1), Duration::from_secs(6))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
        let (server, responder, sent, stopped) = streaming.await.unwrap();
        let held = client.with_session(|s| s.held_bytes()).unwrap();
        println!("held {held} bytes; the peer sent {sent} messages before it stopped");
        assert!(
            stopped,
            "the peer was never stopped: it sent {sent} messages"
        );
        assert!(held <= HELD + (8 << 10), "held {held} bytes");
        drop(responder);
        let rest = tokio::spawn(async move {
            for seq in sent..sent + 1000 {
                server.send(&tick(seq)).await.unwrap();
            }
            server.close().await.unwrap();
            sent + 1000
        });
        let mut next = 0;
        loop {
            match client.recv().await {
                Ok(env) => {
                    let got: Tick = env.decode().unwrap();
                    assert_eq!(got.seq, next, "in order, nothing lost");
                    next += 1;
                }
                Err(e) if e.is_peer_closed() => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(next, rest.await.unwrap(), "every message arrived");
    });
}
