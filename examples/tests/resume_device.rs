//! Sessions that survive a lost connection, on rxe0: the bootstrap stream is cut under a
//! session while typed messages and calls flow (both sides see the peer vanish, as when a
//! network loses the stream; rxe0 loops traffic between QPs of one device back inside the
//! driver, so a link is cut between two VMs instead, in `cargo xtask test`'s flap step);
//! both sides suspend, the connecting side dials again, the listener hands the new
//! connection over, and every message is handed over once, in order, every call answered. A
//! peer whose process restarted cannot resume, and says so. Ignored on hosts; `cargo xtask
//! test` runs them in the VM.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use rdmsg::transport::Listener;
use rdmsg::{message, request, Config, Endpoint, Error, Session, Unresumable};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Note(u32);
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Add {
    a: u32,
    b: u32,
}
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Sum(u32);
message!(Note, solicited = false);
message!(Sum);
request!(Add => Sum);

fn endpoint() -> Endpoint {
    Endpoint::open_default().expect("rxe0")
}

fn config() -> Config {
    Config {
        resume_window: Some(Duration::from_secs(60)),
        handshake_timeout: Duration::from_secs(2),
        ..Config::default()
    }
}

/// A listener that keeps accepting (so that resumes are handed over) until `stop`; the
/// first connection goes to `first`.
fn accept_loop(
    listener: Arc<Listener>,
    config: Config,
    stop: Arc<AtomicBool>,
) -> (mpsc::Receiver<Session>, thread::JoinHandle<u32>) {
    let (tx, rx) = mpsc::channel();
    let t = thread::spawn(move || {
        let mut fresh = 0;
        while !stop.load(Ordering::Acquire) {
            if let Ok(Some(conn)) =
                listener.accept_timeout(&config, Some(Duration::from_millis(50)))
            {
                fresh += 1;
                let _ = tx.send(Session::new(conn));
            }
        }
        fresh
    });
    (rx, t)
}

#[test]
#[ignore = "device"]
fn a_session_resumes_after_its_stream_is_cut_with_nothing_lost_or_repeated() {
    const MESSAGES: u32 = 3000;
    let ep = endpoint();
    let listener = Arc::new(ep.listen("127.0.0.1:0").unwrap());
    let addr: SocketAddr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (sessions, acceptor) = accept_loop(listener.clone(), config(), stop.clone());

    // The server: takes every note, in order, and answers every call.
    let server = thread::spawn(move || {
        let mut s = sessions.recv().unwrap();
        s.register::<Note>().unwrap().register::<Add>().unwrap();
        let (mut next, mut calls) = (0u32, 0u32);
        // The client's last call comes after its last note.
        while next < MESSAGES || calls < MESSAGES / 100 {
            let mut env = s.recv().expect("the session resumes");
            if env.is::<Add>() {
                let add: Add = env.decode().unwrap();
                let r = env.responder::<Add>().unwrap();
                s.reply(r, &Sum(add.a + add.b)).unwrap();
                calls += 1;
                continue;
            }
            let Note(n) = env.decode::<Note>().unwrap();
            assert_eq!(n, next, "each note once, in order");
            next += 1;
        }
        (calls, s.stats())
    });

    let mut client = Session::new(ep.connect(addr, &config()).unwrap());
    let mut cut_at = None;
    let mut answered = 0;
    let mut resumes_before = 0;
    let started = Instant::now();
    for n in 0..MESSAGES {
        client.send(&Note(n)).unwrap();
        if n % 100 == 99 {
            client.flush().unwrap();
            let sum = client
                .call(&Add { a: n, b: 1 }, Duration::from_secs(60))
                .expect("the call survives the cut");
            assert_eq!(sum, Sum(n + 1));
            answered += 1;
        }
        if n % 1000 == 333 {
            // Cut under messages in flight, in both directions (answers to calls): three times.
            // The queue pairs still work, so the loss shows when the stream is next looked at:
            // the client receives (nothing comes) until it has resumed.
            cut_at.get_or_insert_with(Instant::now);
            resumes_before = client.stats().resumes;
            client.connection().sever_bootstrap();
        }
        if n % 1000 == 383 {
            // Fifty more went over the cut connection; now receive (nothing comes) until
            // the session has resumed.
            let t = Instant::now();
            while client.stats().resumes == resumes_before {
                assert!(t.elapsed() < Duration::from_secs(30), "no resume");
                let _ = client
                    .recv_timeout(Some(Duration::from_millis(20)))
                    .unwrap();
            }
        }
    }
    client.flush().unwrap();
    let (calls, server_stats) = server.join().unwrap();
    let stats = client.stats();
    stop.store(true, Ordering::Release);
    let fresh = acceptor.join().unwrap();
    println!(
        "stats resume: {MESSAGES} notes, {answered} calls in {:?}; cut {:?} after the start; \
         client resumes {} (again {}, suspended {:?}); server resumes {} (again {}, suspended {:?})",
        started.elapsed(),
        cut_at.map(|c| c - started),
        stats.resumes,
        stats.resumed_messages,
        stats.time_suspended,
        server_stats.resumes,
        server_stats.resumed_messages,
        server_stats.time_suspended,
    );
    assert_eq!(calls, answered);
    assert_eq!(fresh, 1, "the resume went to the session, not to accept");
    // A resume per cut at least (a new connection that fails at once, as one cut while the
    // previous resume's frames cross can make it, is resumed from again): every note once and
    // in order says nothing was lost or repeated.
    assert!(
        (3..=6).contains(&stats.resumes) && (3..=6).contains(&server_stats.resumes),
        "{stats:?} {server_stats:?}"
    );
    assert!(!client.is_suspended());
}

#[test]
#[ignore = "device"]
fn a_peer_that_restarted_refuses_the_resume_with_a_typed_error() {
    let ep = endpoint();
    let listener = Arc::new(ep.listen("127.0.0.1:0").unwrap());
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (sessions, acceptor) = accept_loop(listener.clone(), config(), stop.clone());
    let mut client = Session::new(ep.connect(addr, &config()).unwrap());
    let mut server = sessions.recv().unwrap();
    client.send(&Note(1)).unwrap();
    assert_eq!(server.recv().unwrap().decode::<Note>().unwrap(), Note(1));
    // The server "restarts": its session and listener are gone, a new one listens on the
    // same address, knowing nothing of the old session.
    stop.store(true, Ordering::Release);
    acceptor.join().unwrap();
    drop(server);
    drop(sessions);
    drop(listener);
    let reborn = Arc::new(ep.listen(addr).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (_sessions, acceptor) = accept_loop(reborn, config(), stop.clone());
    let t = Instant::now();
    let err = client
        .recv_timeout(Some(Duration::from_secs(30)))
        .unwrap_err();
    println!("stats resume refused after {:?}: {err}", t.elapsed());
    assert!(
        matches!(err, Error::CannotResume(Unresumable::UnknownSession)),
        "{err:?}"
    );
    assert!(err.is_fatal());
    assert!(!client.is_suspended());
    // The record is as it stood: the note was taken.
    assert_eq!(client.delivery().sent, 1);
    stop.store(true, Ordering::Release);
    assert_eq!(acceptor.join().unwrap(), 0, "no fresh session came");
}

/// A hub's config whose sessions resume.
fn hub_config() -> rdmsg::HubConfig {
    let mut c = rdmsg::HubConfig::default();
    c.conn.resume_window = Some(Duration::from_secs(60));
    c.conn.handshake_timeout = Duration::from_secs(2);
    c
}

/// A resumable server hub and a client hub connected to it, one thread driving both until
/// the client is connected: (server, client, the server as the client's peer, its address).
fn connected_hubs(ep: &Endpoint) -> (rdmsg::Hub, rdmsg::Hub, rdmsg::PeerId, SocketAddr) {
    use rdmsg::{Hub, HubEvent};
    let mut server = Hub::new(ep, hub_config()).unwrap();
    let addr = server.listen("127.0.0.1:0").unwrap();
    let mut client = Hub::new(ep, hub_config()).unwrap();
    let peer = client.connect(addr).unwrap();
    loop {
        let _ = server.try_recv().unwrap();
        match client.recv_timeout(Some(Duration::from_millis(5))).unwrap() {
            Some(HubEvent::Connected { .. }) => break,
            None => {}
            Some(ev) => panic!("{ev:?}"),
        }
    }
    (server, client, peer, addr)
}

#[test]
#[ignore = "device"]
fn a_hub_peer_resumes_after_its_stream_is_cut_with_nothing_lost_or_repeated() {
    use rdmsg::{Hub, HubEvent};
    const MESSAGES: u32 = 3000;
    let ep = endpoint();
    let mut server = Hub::new(&ep, hub_config()).unwrap();
    server
        .register::<Note>()
        .unwrap()
        .register::<Add>()
        .unwrap();
    let addr = server.listen("127.0.0.1:0").unwrap();

    // The server hub: takes every note, in order, and answers every call; no peer of it
    // ever disconnects.
    let server = thread::spawn(move || {
        let (mut next, mut calls, mut connected) = (0u32, 0u32, 0u32);
        let mut peer = None;
        while next < MESSAGES || calls < MESSAGES / 100 {
            match server.recv().expect("the hub works") {
                HubEvent::Connected { peer: p, .. } => {
                    connected += 1;
                    peer = Some(p);
                }
                HubEvent::Message { peer: p, mut msg } => {
                    assert_eq!(Some(p), peer, "one peer, under one id");
                    if msg.is::<Add>() {
                        let add: Add = msg.decode().unwrap();
                        let r = msg.responder::<Add>().unwrap();
                        let _ = server.reply(r, Sum(add.a + add.b)).unwrap();
                        calls += 1;
                        continue;
                    }
                    let Note(n) = msg.decode::<Note>().unwrap();
                    assert_eq!(n, next, "each note once, in order");
                    next += 1;
                }
                ev => panic!("the session resumes: {ev:?}"),
            }
        }
        // The last answer goes before the hub does.
        let t = Instant::now();
        while server.outboxes_waiting() && t.elapsed() < Duration::from_secs(10) {
            let _ = server
                .recv_timeout(Some(Duration::from_millis(10)))
                .unwrap();
        }
        let peer = peer.unwrap();
        (
            connected,
            calls,
            server.stats(),
            server.transport().stats(),
            peer,
        )
    });

    let mut client = Hub::new(&ep, hub_config()).unwrap();
    client.register::<Sum>().unwrap();
    let peer = client.connect(addr).unwrap();
    let started = Instant::now();
    let mut answered = 0;
    for n in 0..MESSAGES {
        client
            .send(peer, &Note(n))
            .expect("sends wait for the resume");
        if n % 100 == 99 {
            let sum = client
                .call(peer, &Add { a: n, b: 1 }, Duration::from_secs(60))
                .expect("the call survives the cut");
            assert_eq!(sum, Sum(n + 1));
            answered += 1;
        }
        if n % 1000 == 333 {
            // Cut under messages in flight, three times: both sides see the peer vanish.
            client.transport().sever_bootstrap(peer);
        }
    }
    // Whatever was not confirmed goes once the last resume is done.
    let t = Instant::now();
    while client.delivery(peer).is_some_and(|d| d.unconfirmed() > 0)
        && t.elapsed() < Duration::from_secs(30)
    {
        if let Some(ev) = client
            .recv_timeout(Some(Duration::from_millis(20)))
            .unwrap()
        {
            panic!("nothing comes but answers: {ev:?}");
        }
    }
    let (connected, calls, server_stats, server_raw, server_peer) = server.join().unwrap();
    let (stats, raw) = (client.stats(), client.transport().stats());
    println!(
        "stats hub resume: {MESSAGES} notes, {answered} calls in {:?}; client suspended {} \
         resumed {} (again {}, suspended {:?}); server suspended {} resumed {} (again {}, \
         suspended {:?})",
        started.elapsed(),
        raw.suspended,
        raw.resumes,
        stats.resumed_messages,
        stats.time_suspended,
        server_raw.suspended,
        server_raw.resumes,
        server_stats.resumed_messages,
        server_stats.time_suspended,
    );
    assert_eq!(
        server_peer.index(),
        0,
        "the first connection's id throughout"
    );
    assert_eq!(connected, 1, "a resume is no new connection");
    assert_eq!(calls, answered);
    assert_eq!((raw.resumes, server_raw.resumes), (3, 3), "{raw:?}");
    assert_eq!((stats.resumes, server_stats.resumes), (3, 3));
    assert!(!client.is_suspended(peer));
}

#[test]
#[ignore = "device"]
fn a_hub_peer_that_restarted_refuses_the_resume_and_the_session_ends_typed() {
    use rdmsg::{Failure, Hub, HubEvent};
    let ep = endpoint();
    let (mut server, mut client, peer, addr) = connected_hubs(&ep);
    server.register::<Note>().unwrap();
    client.send(peer, &Note(1)).unwrap();
    loop {
        match server.recv().unwrap() {
            HubEvent::Connected { .. } => {}
            HubEvent::Message { msg, .. } => {
                assert_eq!(msg.decode::<Note>().unwrap(), Note(1));
                break;
            }
            ev => panic!("{ev:?}"),
        }
    }
    // The server "restarts": a new hub on the same address knows nothing of the session.
    drop(server);
    let mut reborn = Hub::new(&ep, hub_config()).unwrap();
    reborn.listen(addr).unwrap();
    let t = Instant::now();
    let (failure, connected) = loop {
        assert!(t.elapsed() < Duration::from_secs(30), "no end");
        let _ = reborn.try_recv().unwrap();
        let Some(ev) = client
            .recv_timeout(Some(Duration::from_millis(20)))
            .unwrap()
        else {
            continue;
        };
        match ev {
            HubEvent::Disconnected { peer: p, failure } => {
                assert_eq!(p, peer);
                break (failure, reborn.peers().count());
            }
            // The note's copy: the record had not come back when the server went.
            HubEvent::Unconfirmed {
                peer: p, messages, ..
            } => {
                assert_eq!((p, messages.len()), (peer, 1));
            }
            ev => panic!("only the end comes: {ev:?}"),
        }
    };
    println!(
        "stats hub resume refused after {:?}: {failure}",
        t.elapsed()
    );
    assert_eq!(failure, Failure::ResumeRefused);
    assert_eq!(connected, 0, "no fresh session on the reborn hub");
    assert!(!client.is_suspended(peer));
    assert_eq!(client.transport().stats().suspended, 1);
}

#[test]
#[ignore = "device"]
fn closing_a_suspended_hub_peer_ends_its_session() {
    use rdmsg::{Failure, HubEvent};
    let ep = endpoint();
    let (server, mut client, peer, _) = connected_hubs(&ep);
    // The server goes and nothing listens there: the client's session is suspended, its
    // dialing refused at the TCP level (not by a peer that knows nothing of it).
    drop(server);
    let t = Instant::now();
    while !client.is_suspended(peer) {
        assert!(t.elapsed() < Duration::from_secs(30), "never suspended");
        assert!(client
            .recv_timeout(Some(Duration::from_millis(20)))
            .unwrap()
            .is_none());
    }
    assert!(client.peers().next().is_none(), "not among the live peers");
    assert!(!client.try_send(peer, &Note(1)).unwrap(), "a send waits");
    let t = Instant::now();
    client
        .close(peer)
        .expect("closing a suspended peer ends it at once");
    let failure = loop {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the close never ended it"
        );
        match client
            .recv_timeout(Some(Duration::from_millis(20)))
            .unwrap()
        {
            Some(HubEvent::Disconnected { peer: p, failure }) => {
                assert_eq!(p, peer);
                break failure;
            }
            Some(HubEvent::Unconfirmed { .. }) | None => {}
            Some(ev) => panic!("{ev:?}"),
        }
    };
    println!("stats hub suspended peer closed after {:?}", t.elapsed());
    assert_eq!(failure, Failure::Closed);
    assert!(!client.is_suspended(peer));
}
