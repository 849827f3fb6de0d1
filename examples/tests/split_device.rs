//! Sessions from several threads and from an event loop, on rxe0: split halves under concurrent
//! load (a million messages each way, from two sending threads per side), the flush rules while
//! the other half waits, a sender blocked on credits beside a receiver that goes on, and two
//! sessions driven by one thread through their descriptors. Ignored on hosts; `cargo xtask
//! test` runs them in the VM.

use std::os::fd::AsFd;
use std::thread;
use std::time::{Duration, Instant};

use rdmsg::msg::{RecvHalf, SendHalf, Session, SessionConfig};
use rdmsg::transport::{Config, ReadyWatch};
use rdmsg_examples::{loopback_pair, Request, Response};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Tick {
    thread: u32,
    seq: u64,
    #[serde(with = "serde_bytes")]
    pad: Vec<u8>,
}
rdmsg::msg::message!(Tick, tag = "rdmsg.test.Tick", solicited = false);

fn sessions(config: SessionConfig) -> (Session, Session) {
    sessions_with(config.clone(), config)
}

fn sessions_with(a_config: SessionConfig, b_config: SessionConfig) -> (Session, Session) {
    let (a, b) = loopback_pair(&Config::default(), &Config::default()).expect("device");
    (
        Session::with_config(a, a_config),
        Session::with_config(b, b_config),
    )
}

fn pad(thread: u32, seq: u64) -> Vec<u8> {
    // Mostly small; every 1000th message needs several frames.
    let len = if seq % 1000 == 999 {
        9000
    } else {
        (seq % 64) as usize
    };
    (0..len)
        .map(|i| (seq as usize ^ i ^ thread as usize) as u8)
        .collect()
}

/// A server already asleep in a receive (solicited-only): it answers one request and reports
/// when the request reached it.
fn answering_server(mut server: Session) -> thread::JoinHandle<(Instant, Session)> {
    thread::spawn(move || {
        let req: Request = server
            .recv_timeout(Some(Duration::from_secs(5)))
            .unwrap()
            .expect("the request woke the server within 5 s")
            .decode()
            .unwrap();
        let at = Instant::now();
        server
            .send(&Response {
                id: req.id,
                sum: req.operands.iter().sum(),
            })
            .unwrap();
        (at, server)
    })
}

/// `senders` threads each send `each` ticks through clones of `tx`.
fn send_ticks(tx: &SendHalf, senders: u32, each: u64) -> Vec<thread::JoinHandle<()>> {
    (0..senders)
        .map(|t| {
            let tx = tx.clone();
            thread::spawn(move || {
                for seq in 0..each {
                    let m = Tick {
                        thread: t,
                        seq,
                        pad: pad(t, seq),
                    };
                    tx.send(&m).expect("send");
                }
                tx.flush().expect("flush");
            })
        })
        .collect()
}

/// Receives `senders * each` ticks, checking that each thread's arrive once, in order, intact.
fn recv_ticks(mut rx: RecvHalf, senders: u32, each: u64) -> thread::JoinHandle<RecvHalf> {
    thread::spawn(move || {
        let mut next = vec![0u64; senders as usize];
        for _ in 0..senders as u64 * each {
            let m: Tick = rx
                .recv_timeout(Some(Duration::from_secs(20)))
                .expect("receive")
                .expect("a tick within 20 s")
                .decode()
                .expect("decode");
            let t = m.thread as usize;
            assert_eq!(m.seq, next[t], "thread {t}: lost, duplicated or reordered");
            assert_eq!(m.pad, pad(m.thread, m.seq), "corrupted");
            next[t] += 1;
        }
        rx
    })
}

/// The soak: both sessions split, two sending threads and a receiving thread on each side,
/// `RDMSG_SPLIT_MESSAGES` (default a million) messages each way.
#[test]
#[ignore = "device"]
fn split_halves_carry_a_million_messages_each_way_from_several_threads() {
    let n: u64 = std::env::var("RDMSG_SPLIT_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let config = SessionConfig {
        max_unsolicited_delay: Some(Duration::from_millis(2)),
        ..SessionConfig::default()
    };
    let (a, b) = sessions(config);
    let (a_tx, a_rx) = a.split().unwrap();
    let (b_tx, b_rx) = b.split().unwrap();
    let started = Instant::now();
    let a_in = recv_ticks(a_rx, 2, n / 2);
    let b_in = recv_ticks(b_rx, 2, n / 2);
    let mut senders = send_ticks(&a_tx, 2, n / 2);
    senders.extend(send_ticks(&b_tx, 2, n / 2));
    for s in senders {
        s.join().expect("a sender");
    }
    let a_rx = a_in.join().expect("a's receiver");
    let b_rx = b_in.join().expect("b's receiver");
    let secs = started.elapsed().as_secs_f64();
    let (sa, sb) = (a_rx.stats(), b_rx.stats());
    println!(
        "split soak: {} messages each way in {secs:.1} s ({:.0} msgs/s each way); a: {sa:?}; b: {sb:?}",
        n / 2 * 2,
        (n / 2 * 2) as f64 / secs
    );
    assert_eq!((sa.sent, sa.received), (n / 2 * 2, n / 2 * 2));
    assert_eq!((sb.sent, sb.received), (n / 2 * 2, n / 2 * 2));
    assert_eq!(sa.dropped_frames + sb.dropped_frames, 0);
    // Whole again, and still working.
    let mut a = a_rx.reunite(a_tx).expect("no other sending half");
    let mut b = b_rx.reunite(b_tx).expect("no other sending half");
    a.send(&Response { id: 7, sum: 7 }).unwrap();
    let r: Response = b
        .recv_timeout(Some(Duration::from_secs(5)))
        .unwrap()
        .unwrap()
        .decode()
        .unwrap();
    assert_eq!(r.id, 7);
}

/// One thread waits to receive; another then sends a request unsolicited. The peer sleeps
/// solicited-only: without the rule that a message sent while a receiver waits goes
/// solicited, neither would ever look.
#[test]
#[ignore = "device"]
fn a_request_sent_while_the_other_half_waits_wakes_the_peer() {
    let (server, client) = sessions(SessionConfig::default());
    let server = answering_server(server);
    let (tx, mut rx) = client.split().unwrap();
    let waiting = thread::spawn(move || {
        let r: Response = rx
            .recv_timeout(Some(Duration::from_secs(10)))
            .unwrap()
            .expect("the answer within 10 s")
            .decode()
            .unwrap();
        (r, rx)
    });
    thread::sleep(Duration::from_millis(200)); // the receiving half and the server are asleep
    let t = Instant::now();
    tx.send_as(
        &Request {
            id: 1,
            operands: vec![4, 5],
        },
        false,
    )
    .unwrap();
    let (at, _server) = server.join().unwrap();
    let noticed = at - t;
    let (resp, rx) = waiting.join().unwrap();
    assert_eq!(resp, Response { id: 1, sum: 9 });
    let st = rx.stats();
    assert_eq!(
        st.sent_solicited, 1,
        "sent solicited: the other half waited; {st:?}"
    );
    assert!(noticed < Duration::from_secs(1), "{noticed:?}");
}

/// With `max_unsolicited_delay`, the request stays unsolicited and the waiting half flushes
/// it once the delay runs out, although the sending thread has gone quiet.
#[test]
#[ignore = "device"]
fn the_waiting_half_flushes_within_max_unsolicited_delay() {
    let delay = Duration::from_millis(200);
    let config = SessionConfig {
        max_unsolicited_delay: Some(delay),
        ..SessionConfig::default()
    };
    let (server, client) = sessions_with(SessionConfig::default(), config);
    let server = answering_server(server);
    let (tx, mut rx) = client.split().unwrap();
    let waiting = thread::spawn(move || {
        let got = rx.recv_timeout(Some(Duration::from_secs(10))).unwrap();
        (got.is_some(), rx)
    });
    thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    tx.send_as(
        &Request {
            id: 2,
            operands: vec![1],
        },
        false,
    )
    .unwrap();
    let (at, _server) = server.join().unwrap();
    let noticed = at - t;
    assert!(
        noticed >= delay - Duration::from_millis(20) && noticed < delay * 5,
        "noticed after {noticed:?}, bound {delay:?}"
    );
    let (got, rx) = waiting.join().unwrap();
    assert!(got);
    let st = rx.stats();
    assert_eq!((st.sent_solicited, st.wait_flushes), (0, 1), "{st:?}");
}

/// A sender blocked on credits (the peer is not reading) keeps nobody from receiving: the
/// receiving half goes on taking what the peer sends, and the sender finishes once the peer
/// reads.
#[test]
#[ignore = "device"]
fn a_sender_blocked_on_credits_does_not_stop_the_receiving_half() {
    let (mut peer, me) = sessions(SessionConfig::default());
    let (tx, mut rx) = me.split().unwrap();
    let n = 2000u64;
    let sending = thread::spawn(move || {
        for seq in 0..n {
            tx.send(&Tick {
                thread: 0,
                seq,
                pad: vec![],
            })
            .unwrap();
        }
        tx.flush().unwrap();
        tx
    });
    thread::sleep(Duration::from_millis(300)); // the sender has spent every credit
                                               // Fewer than the peer's credits: nobody reads them until the loop below.
    for seq in 0..20u64 {
        peer.send_as(
            &Tick {
                thread: 1,
                seq,
                pad: vec![],
            },
            seq == 19,
        )
        .unwrap();
    }
    for seq in 0..20u64 {
        let m: Tick = rx
            .recv_timeout(Some(Duration::from_secs(5)))
            .unwrap()
            .expect("received while the sender is blocked")
            .decode()
            .unwrap();
        assert_eq!((m.thread, m.seq), (1, seq));
    }
    assert!(
        !sending.is_finished(),
        "the peer has not read: the sender is blocked"
    );
    for seq in 0..n {
        let m: Tick = peer
            .recv_timeout(Some(Duration::from_secs(10)))
            .unwrap()
            .expect("everything arrives once read")
            .decode()
            .unwrap();
        assert_eq!(m.seq, seq);
    }
    let tx = sending.join().unwrap();
    rx.reunite(tx).expect("whole again");
}

/// One thread drives two connected sessions through their descriptors: `try_send`, `step`,
/// `try_recv`, and a wait on an epoll set holding both. A ping-pong of 2,000 round trips,
/// then a burst with a fragmented message.
#[test]
#[ignore = "device"]
fn an_event_loop_drives_two_sessions_through_their_descriptors() {
    let (mut a, mut b) = sessions(SessionConfig::default());
    let watch = ReadyWatch::new().unwrap();
    watch.add(a.as_fd(), 0).unwrap();
    watch.add(b.as_fd(), 1).unwrap();
    let rounds = 2000u64;
    let mut sent = 0u64;
    let mut answered = 0u64;
    let mut waits = 0u64;
    let mut turns = 0u64;
    let big = Tick {
        thread: 9,
        seq: 0,
        pad: vec![7; 20_000],
    };
    let mut big_seen = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(answered == rounds && big_seen) {
        turns += 1;
        assert!(Instant::now() < deadline, "{answered} of {rounds} in 60 s");
        if sent == answered && sent < rounds {
            assert!(a
                .try_send_as(
                    &Tick {
                        thread: 0,
                        seq: sent,
                        pad: vec![]
                    },
                    true
                )
                .unwrap());
            sent += 1;
        }
        if answered == rounds && sent == rounds {
            assert!(a.try_send_as(&big, true).unwrap());
            sent += 1;
        }
        while let Some(env) = b.try_recv().unwrap() {
            let m: Tick = env.decode().unwrap();
            if m.thread == 9 {
                assert_eq!(m, big);
                big_seen = true;
                continue;
            }
            // The answer goes unsolicited: b's step flushes it before the loop waits.
            assert!(b.try_send_as(&m, false).unwrap());
        }
        let answered_before = answered;
        while let Some(env) = a.try_recv().unwrap() {
            let m: Tick = env.decode().unwrap();
            assert_eq!(m.seq, answered);
            answered += 1;
        }
        let busy = a.step().unwrap() | b.step().unwrap();
        // An answer came: the next request goes before the loop waits.
        let more = (answered != answered_before && sent < rounds + 1) || big_seen;
        if busy || more || a.connection().has_ready() || b.connection().has_ready() {
            continue;
        }
        let limit = [a.next_timeout(), b.next_timeout()]
            .into_iter()
            .flatten()
            .min();
        let t = Instant::now();
        let ready = watch.wait(limit).unwrap();
        assert!(
            ready != 0 || t.elapsed() < Duration::from_millis(900),
            "a wait ran into its health-check timeout: a wake-up was missed ({answered} answered, \
             {sent} sent, big seen {big_seen}, a queued {}, a {:?} {:?}, b {:?} {:?})",
            a.has_queued_frames(),
            a.stats(),
            a.connection().stats(),
            b.stats(),
            b.connection().stats()
        );
        waits += 1;
    }
    println!(
        "event loop: {rounds} round trips, {turns} turns, {waits} waits; a {:?}; b {:?}",
        a.stats(),
        b.stats()
    );
    // Each turn did something or slept: no spinning on an idle descriptor. (Whether the
    // loop had to wait at all depends on how the device keeps up with it.)
    assert!(turns < 6 * rounds, "{turns} turns, {waits} waits");
    assert!(b.stats().wait_flushes > 0);

    // A message handed to another thread, dropped there while the loop waits: its buffer
    // must go back to the peer as a credit, so the drop makes the descriptor readable.
    assert!(a
        .try_send_as(
            &Tick {
                thread: 7,
                seq: 0,
                pad: vec![]
            },
            true
        )
        .unwrap());
    let only_b = ReadyWatch::new().unwrap();
    only_b.add(b.as_fd(), 0).unwrap();
    let env = loop {
        a.step().unwrap();
        if let Some(env) = b.try_recv().unwrap() {
            break env;
        }
        if !b.step().unwrap() {
            only_b.wait(Some(Duration::from_secs(5))).unwrap();
        }
    };
    while b.step().unwrap() {}
    let dropper = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        drop(env);
    });
    let t = Instant::now();
    let ready = only_b.wait(Some(Duration::from_secs(5))).unwrap();
    let woken = t.elapsed();
    dropper.join().unwrap();
    assert!(
        ready != 0 && woken >= Duration::from_millis(150) && woken < Duration::from_secs(2),
        "woken after {woken:?} (ready {ready:#b}) by a handle dropped after 200 ms"
    );
    assert!(b.step().unwrap(), "the step takes the returned buffer");
}

#[test]
fn halves_are_send_and_the_sending_half_is_sync() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<SendHalf>();
    sync::<SendHalf>();
    send::<RecvHalf>();
    send::<Session>();
}
