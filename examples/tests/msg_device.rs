//! The message layer on rxe0: round trips of every example type, wake-ups per batch, the
//! unsolicited-run policy, and malformed frames injected over the wire. Ignored on hosts;
//! `cargo xtask test` runs them in the VM.

use std::thread;
use std::time::Duration;

use rdmsg::msg::frame::{self, FrameError, FIRST, LAST};
use rdmsg::msg::{Error, Message, Session};
use rdmsg::transport::Config;
use rdmsg_examples::{loopback_pair, Alarm, Command, Reading, Request, Response};

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

fn sessions() -> (Session, Session) {
    let (rx, tx) = loopback_pair(&Config::default(), &Config::default()).expect("device");
    (Session::new(rx), Session::new(tx))
}

fn recv_one<M: Message + rdmsg::msg::serde::de::DeserializeOwned>(s: &mut Session) -> M {
    s.recv_timeout(WAIT)
        .unwrap()
        .expect("a message within 10 s")
        .decode()
        .unwrap()
}

#[test]
#[ignore = "device"]
fn every_example_type_round_trips() {
    let (mut rx, mut tx) = sessions();
    let reading = Reading {
        sensor: 7,
        seq: 42,
        value: -1.25,
    };
    let alarm = Alarm {
        sensor: 7,
        reason: "hot".into(),
    };
    let request = Request {
        id: 9,
        operands: vec![1, -2, 3],
    };
    let response = Response { id: 9, sum: 2 };
    let calibrate = Command::Calibrate {
        sensor: 1,
        offset: 0.5,
    };
    let firmware = Command::Firmware((0..50_000u32).map(|i| i as u8).collect());
    tx.send(&reading).unwrap();
    tx.send(&alarm).unwrap();
    tx.send(&request).unwrap();
    tx.send(&response).unwrap();
    tx.send(&calibrate).unwrap();
    tx.send(&firmware).unwrap();
    assert_eq!(recv_one::<Reading>(&mut rx), reading);
    assert_eq!(recv_one::<Alarm>(&mut rx), alarm);
    assert_eq!(recv_one::<Request>(&mut rx), request);
    assert_eq!(recv_one::<Response>(&mut rx), response);
    assert_eq!(recv_one::<Command>(&mut rx), calibrate);
    assert_eq!(recv_one::<Command>(&mut rx), firmware);
    let st = tx.stats();
    // The 50 KB firmware went by rendezvous (at least 16 KiB encoded): one descriptor frame.
    assert_eq!((st.sent, st.rendezvous_sent, st.fragmented), (6, 1, 0));
    assert_eq!(st.frames_sent, 6, "{st:?}");
}

/// Batches of 16 readings, all unsolicited but the last: one wake-up per batch.
#[test]
#[ignore = "device"]
fn a_batch_costs_one_wake_up() {
    const BATCHES: u64 = 20;
    const K: u64 = 16;
    let (mut rx, mut tx) = sessions();
    let producer = thread::spawn(move || {
        for b in 0..BATCHES {
            let batch: Vec<Reading> = (0..K)
                .map(|i| Reading {
                    sensor: 0,
                    seq: b * K + i,
                    value: 0.0,
                })
                .collect();
            tx.send_batch(&batch).unwrap();
            thread::sleep(Duration::from_millis(20));
        }
        tx
    });
    for seq in 0..BATCHES * K {
        assert_eq!(recv_one::<Reading>(&mut rx).seq, seq);
    }
    let tx = producer.join().unwrap();
    let w = rx.connection().wait_stats();
    println!(
        "stats batches: {BATCHES} batches of {K}: wakeups={} per_wakeup={:.1} sent_solicited={}",
        w.wakeups,
        w.completions_per_wakeup(),
        tx.stats().sent_solicited
    );
    assert_eq!(tx.stats().sent_solicited, BATCHES);
    assert!(w.wakeups <= BATCHES + 1, "{} wake-ups", w.wakeups);
    assert!(
        w.wakeups >= BATCHES / 2,
        "{} wake-ups: did it sleep?",
        w.wakeups
    );
}

/// A million small messages streamed by `send_batch`, packed many to a frame: every one arrives
/// once and in order, and the receiver spends a receive buffer (and the sender a credit) per
/// frame, under one per 16 messages.
#[test]
#[ignore = "device"]
fn a_million_small_messages_stream_packed() {
    const N: u64 = 1_000_000;
    const BATCH: u64 = 256;
    let (mut rx, mut tx) = sessions();
    let producer = thread::spawn(move || {
        let mut batch = Vec::with_capacity(BATCH as usize);
        for first in (0..N).step_by(BATCH as usize) {
            batch.clear();
            batch.extend((first..N.min(first + BATCH)).map(|seq| Reading {
                sensor: 3,
                seq,
                value: seq as f64,
            }));
            assert_eq!(tx.send_batch(&batch).unwrap(), batch.len());
        }
        tx
    });
    for seq in 0..N {
        let r: Reading = recv_one(&mut rx);
        assert_eq!((r.seq, r.value), (seq, seq as f64), "in order, each once");
    }
    let tx = producer.join().unwrap();
    let (sent, got) = (tx.stats(), rx.stats());
    println!(
        "stats packed stream: {N} messages in {} frames ({:.4} receive buffers per message), \
         {} solicited",
        got.frames_received,
        got.frames_received as f64 / N as f64,
        sent.sent_solicited
    );
    assert_eq!((sent.sent, sent.packed, got.received), (N, N, N));
    assert!(got.frames_received * 16 <= N, "{got:?}");
    assert!(rx.try_recv().unwrap().is_none(), "nothing more");
}

/// Unsolicited telemetry without batch ends, trickling in while the receiver sleeps: the
/// policy solicits every 17th message (a quarter of the peer's 64 credits, plus one) and
/// `flush` wakes the receiver for the tail, so nothing waits unread.
#[test]
#[ignore = "device"]
fn the_policy_and_flush_bound_what_waits_unread() {
    const N: u64 = 60;
    let (mut rx, mut tx) = sessions();
    let producer = thread::spawn(move || {
        for seq in 0..N {
            tx.send(&Reading {
                sensor: 1,
                seq,
                value: 0.0,
            })
            .unwrap();
            thread::sleep(Duration::from_millis(2));
        }
        tx.flush().unwrap();
        tx
    });
    for seq in 0..N {
        assert_eq!(recv_one::<Reading>(&mut rx).seq, seq);
    }
    let tx = producer.join().unwrap();
    let st = tx.stats();
    let wakeups = rx.connection().wait_stats().wakeups;
    println!(
        "stats policy: {N} unsolicited readings, 2 ms apart: policy_solicited={} receiver wakeups={wakeups}",
        st.policy_solicited
    );
    assert_eq!(st.policy_solicited, N / 17);
    assert!((2..=5).contains(&wakeups), "{wakeups} wake-ups");
}

/// Malformed frames sent over the wire: each gives its typed error at the receiver, is
/// dropped and counted, and the session carries on.
#[test]
#[ignore = "device"]
fn bad_frames_over_the_wire_are_typed_counted_and_survived() {
    let (mut rx, mut tx) = sessions();
    rx.register::<Reading>().expect("distinct tags");
    rx.register::<Alarm>().expect("distinct tags");
    let good = frame::build(FIRST | LAST, Alarm::TAG, 0, 0, &[1, 2, b'o', b'k']);
    let mut wrong_magic = good.clone();
    wrong_magic[0] = b'X';
    let mut wrong_version = good.clone();
    wrong_version[2] = 77;
    let mut short_length = good.clone();
    short_length[19] += 1;
    let bad: Vec<(Vec<u8>, &str)> = vec![
        (vec![0xde, 0xad], "too short"),
        (wrong_magic, "magic"),
        (wrong_version, "version"),
        (short_length, "length"),
        (
            frame::build(FIRST | LAST, rdmsg::msg::tag("nobody"), 0, 0, &[]),
            "unknown tag",
        ),
        (
            frame::build(0, Reading::TAG, 5, 3, &[1]),
            "fragment out of order",
        ),
        (
            frame::build(FIRST | LAST, Reading::TAG, 6, 0, &[1, 2]),
            "truncated bincode",
        ),
    ];
    let conn = tx.connection_mut();
    for (f, _) in &bad {
        conn.send(f, false).unwrap();
    }
    conn.send(&good, true).unwrap();
    let mut seen = Vec::new();
    let alarm = loop {
        match rx.recv_timeout(WAIT) {
            Ok(Some(env)) if env.is::<Alarm>() => break env.decode::<Alarm>().unwrap(),
            Ok(Some(env)) => seen.push(env.decode::<Reading>().unwrap_err()),
            Ok(None) => panic!("nothing within 10 s"),
            Err(e) => {
                assert!(!e.is_fatal(), "{e:?}");
                seen.push(e);
            }
        }
    };
    assert_eq!(alarm.sensor, 1);
    assert_eq!(alarm.reason, "ok");
    println!("stats bad frames: {seen:?}");
    assert_eq!(seen.len(), bad.len(), "{seen:?}");
    let frame_error = |e: &Error| match e {
        Error::BadFrame(f) => Some(*f),
        _ => None,
    };
    let frames: Vec<Option<FrameError>> = seen.iter().map(frame_error).collect();
    assert!(
        matches!(frames[0], Some(FrameError::TooShort(2))),
        "{frames:?}"
    );
    assert!(
        matches!(frames[1], Some(FrameError::BadMagic(_))),
        "{frames:?}"
    );
    assert!(
        matches!(frames[2], Some(FrameError::BadVersion(77))),
        "{frames:?}"
    );
    assert!(
        matches!(frames[3], Some(FrameError::Length { .. })),
        "{frames:?}"
    );
    assert!(matches!(seen[4], Error::UnknownTag { .. }), "{:?}", seen[4]);
    assert!(
        matches!(frames[5], Some(FrameError::OutOfOrder { .. })),
        "{frames:?}"
    );
    assert!(matches!(seen[6], Error::Decode { .. }), "{:?}", seen[6]);
    assert_eq!(
        rx.stats().dropped_frames,
        6,
        "the body error is the caller's to count"
    );
}

/// A lasting verbs error (a completion queue that can no longer be polled) ends `incoming()`
/// and `Dispatcher::run` at once instead of retrying at full speed.
#[test]
#[ignore = "device"]
fn a_lasting_verbs_error_ends_the_receive_loops() {
    let (mut rx, mut tx) = sessions();
    tx.send(&Alarm {
        sensor: 1,
        reason: "before".into(),
    })
    .unwrap();
    let first = rx.recv_timeout(WAIT).unwrap().expect("delivered");
    assert_eq!(first.decode::<Alarm>().unwrap().reason, "before");
    rx.connection_mut()
        .inject_fault(rdmsg::transport::Fault::Poll);
    let started = std::time::Instant::now();
    assert_eq!(rx.incoming().count(), 0, "incoming() ends");
    let mut dispatcher = rdmsg::msg::Dispatcher::new();
    let err = dispatcher.run(&mut rx);
    println!("stats lasting verbs error: {err} / {err:#?}");
    assert!(err.is_fatal(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// A request sent unsolicited, then a wait for its answer: the peer sleeps solicited-only,
/// so it would never look, and both would wait for ever. The receive flushes first.
#[test]
#[ignore = "device"]
fn a_request_sent_unsolicited_is_flushed_before_its_sender_waits() {
    let (mut server, mut client) = sessions();
    let answering = thread::spawn(move || {
        let req: Request = server
            .recv_timeout(Some(Duration::from_secs(5)))
            .unwrap()
            .expect("the request woke the server within 5 s")
            .decode()
            .unwrap();
        let sum = req.operands.iter().sum();
        server.send(&Response { id: req.id, sum }).unwrap();
        server
    });
    thread::sleep(Duration::from_millis(100)); // the server is asleep
    let request = Request {
        id: 1,
        operands: vec![2, 3],
    };
    client.send_as(&request, false).unwrap();
    let resp: Response = recv_one(&mut client);
    assert_eq!(resp, Response { id: 1, sum: 5 });
    // Kept open to the end: its drop would end the connection under the last wait.
    let _server = answering.join().unwrap();
    let st = client.stats();
    assert_eq!((st.sent_solicited, st.wait_flushes), (0, 1), "{st:?}");
    // Nothing pending: the next wait sends nothing.
    assert!(client
        .recv_timeout(Some(Duration::from_millis(50)))
        .unwrap()
        .is_none());
    assert_eq!(client.stats().wait_flushes, 1);
}

/// `send_timeout` against a peer that does not read: `false` once its credits are spent,
/// without waiting; everything sent arrives once the peer reads.
#[test]
#[ignore = "device"]
fn send_timeout_gives_up_when_the_peer_does_not_read() {
    let (mut rx, mut tx) = sessions();
    let t = std::time::Instant::now();
    let mut sent = 0u64;
    let reading = |seq| Reading {
        sensor: 3,
        seq,
        value: 1.0,
    };
    while tx
        .send_timeout(&reading(sent), false, Duration::ZERO)
        .unwrap()
    {
        sent += 1;
        assert!(sent < 100_000, "credits never ran out");
    }
    assert!(
        sent > 0 && t.elapsed() < Duration::from_secs(2),
        "{sent} in {:?}",
        t.elapsed()
    );
    let t = std::time::Instant::now();
    assert!(!tx
        .send_timeout(&reading(sent), false, Duration::from_millis(300))
        .unwrap());
    assert!(t.elapsed() >= Duration::from_millis(290));
    for seq in 0..sent {
        assert_eq!(recv_one::<Reading>(&mut rx).seq, seq);
    }
}

/// Timeouts of any length, `Duration::MAX` included, are waits, not panics (adding one to the
/// clock used to overflow): in the handshake, a receive, and a graceful close.
#[test]
#[ignore = "device"]
fn timeouts_of_any_length_are_waits() {
    let forever = Config {
        handshake_timeout: Duration::MAX,
        close_timeout: Duration::MAX,
        ..Config::default()
    };
    let (rx, tx) = loopback_pair(&forever, &forever).expect("device");
    let (mut rx, mut tx) = (Session::new(rx), Session::new(tx));
    let reading = Reading {
        sensor: 1,
        seq: 2,
        value: 3.0,
    };
    tx.send(&reading).unwrap();
    let got: Reading = rx
        .recv_timeout(Some(Duration::MAX))
        .unwrap()
        .expect("a message")
        .decode()
        .unwrap();
    assert_eq!(got, reading);
    tx.close().unwrap();
    let end = rx.recv_timeout(Some(Duration::MAX)).unwrap_err();
    assert!(end.is_peer_closed(), "{end}");
}

/// `Session::close` towards a peer dropped without closing (as when its process dies): rxe
/// never acknowledges the close message (it retries for ever), so the close fails as the
/// peer vanished as soon as its stream's end is seen, not after `close_timeout`: whether a
/// receive saw the end first, nothing looked yet, or the peer goes while the close waits for
/// it to read a message it was lent by rendezvous.
#[test]
#[ignore = "device"]
fn closing_a_session_whose_peer_vanished_fails_at_once_as_vanished() {
    use rdmsg::msg::Error;
    use rdmsg::transport::Failure;
    use std::time::Instant;
    const PROMPT: Duration = Duration::from_millis(500);
    let check = |what: &str, r: Result<(), Error>, took: Duration| {
        println!("stats session close towards a vanished peer, {what}: {took:?}");
        assert!(
            matches!(
                r,
                Err(Error::Transport(rdmsg::transport::Error::Connection(
                    Failure::PeerVanished
                )))
            ),
            "{what}: {r:?}"
        );
        assert!(took < PROMPT, "{what}: {took:?}");
    };

    // A receive saw the end first.
    let (mut a, b) = sessions();
    drop(b);
    let err = a.recv_timeout(WAIT).unwrap_err();
    assert!(!err.is_peer_closed(), "{err}");
    let t = Instant::now();
    check("seen by a receive", a.close(), t.elapsed());

    // Nothing looked since the peer went.
    let (a, b) = sessions();
    drop(b);
    thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    check("not looked at yet", a.close(), t.elapsed());

    // Lent a message by rendezvous it never reads, the close waits for it; then it goes.
    let (mut a, b) = sessions();
    a.send(&Command::Firmware(vec![7; 1 << 20])).unwrap();
    assert_eq!(a.stats().rendezvous_sent, 1);
    let dropper = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        drop(b);
        t
    });
    let r = a.close();
    let closed = Instant::now();
    let dropped = dropper.join().unwrap();
    assert!(closed >= dropped, "the close waited for the peer: {r:?}");
    check(
        "gone while the close waits for its read",
        r,
        closed - dropped,
    );
}

/// One close, one clock: `Session::close` towards a peer that is there but neither reads nor
/// grants (its application never receives, so its credits are never returned) ends within
/// `close_timeout`, whatever it waits for: here the peer's read of a message lent by
/// rendezvous, then a credit for the close message. Each stage used to get a
/// `close_timeout` of its own (twice it here, three times at most).
#[test]
#[ignore = "device"]
fn a_close_ends_within_one_close_timeout_whatever_it_waits_for() {
    use std::time::Instant;
    const CLOSE: Duration = Duration::from_secs(1);
    let config = Config {
        close_timeout: CLOSE,
        ..Config::default()
    };
    let (rx, tx) = loopback_pair(&Config::default(), &config).expect("device");
    let (rx, mut tx) = (Session::new(rx), Session::new(tx));
    // Lent by rendezvous: the close waits for the peer's read, which never comes.
    tx.send(&Command::Firmware(vec![7; 1 << 20])).unwrap();
    assert_eq!(tx.stats().rendezvous_sent, 1);
    // Every credit spent: the close message then waits for a grant, which never comes.
    let mut sent = 0u64;
    while tx
        .send_timeout(
            &Reading {
                sensor: 1,
                seq: sent,
                value: 0.0,
            },
            false,
            Duration::ZERO,
        )
        .unwrap()
    {
        sent += 1;
        assert!(sent < 100_000, "credits never ran out");
    }
    let t = Instant::now();
    let r = tx.close();
    let took = t.elapsed();
    println!(
        "stats close waiting for a read and a credit, close_timeout {CLOSE:?}: {took:?}: {r:?}"
    );
    assert!(r.is_err(), "the peer read nothing, granted nothing");
    assert!(
        took < CLOSE + Duration::from_millis(600),
        "{took:?}: beyond one close_timeout"
    );
    drop(rx);
}
