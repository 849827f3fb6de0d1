//! The soak: a million typed messages of random sizes (some fragmented) and random solicitation
//! patterns through a slow, bursty consumer. Nothing lost, duplicated or reordered, no RNR NAK,
//! and the pools and descriptors back where they started.

use std::collections::VecDeque;
use std::thread;
use std::time::{Duration, Instant};

use rdmsg::msg::Session;
use rdmsg::transport::Config;
use rdmsg_examples::loopback_pair;
use rdmsg_testkit::{fd_count, rnr_counters};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Soak {
    seq: u64,
    #[serde(with = "serde_bytes")]
    pad: Vec<u8>,
}
rdmsg::msg::message!(Soak, tag = "rdmsg.test.Soak", solicited = false);

#[derive(Debug, Serialize, Deserialize)]
struct SoakView<'a> {
    seq: u64,
    #[serde(borrow, with = "serde_bytes")]
    pad: &'a [u8],
}
rdmsg::msg::message!(SoakView<'_>, tag = "rdmsg.test.Soak", solicited = false);

/// xorshift64*: reproducible randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The payload of message `seq`: its length and bytes follow from `seq`, so that the receiver
/// can check every byte without being told.
fn pad_len(seq: u64) -> usize {
    let mut r = Rng(seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    match r.below(1000) {
        // One in a thousand does not fit a 4 KiB buffer: fragments.
        0 => 4096 + r.below(6000) as usize,
        n if n < 50 => 1024 + r.below(3000) as usize,
        _ => r.below(256) as usize,
    }
}

fn pad_byte(seq: u64, i: usize) -> u8 {
    (seq as usize).wrapping_add(i * 31) as u8
}

#[test]
#[ignore = "device"]
fn a_million_messages_through_a_bursty_consumer() {
    let n: u64 = std::env::var("RDMSG_SOAK_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let device = std::env::var("RDMSG_DEVICE").expect("RDMSG_DEVICE names the device");
    let before = rnr_counters(&device, 1);
    let fds_before = fd_count();
    let (rx, tx) = loopback_pair(&Config::default(), &Config::default()).expect("device");
    let started = Instant::now();

    let sender = thread::spawn(move || {
        let mut s = Session::new(tx);
        let mut rng = Rng(0x5eed);
        let mut seq = 0;
        let mut pad = Vec::new();
        while seq < n {
            // Random patterns: a batch (last one solicited), a run of unsolicited messages
            // ended by a flush, or single messages solicited at random.
            let pattern = rng.below(3);
            let count = (1 + rng.below(100)).min(n - seq);
            for i in 0..count {
                pad.clear();
                pad.extend((0..pad_len(seq)).map(|j| pad_byte(seq, j)));
                let m = SoakView { seq, pad: &pad };
                let solicited = match pattern {
                    0 => i + 1 == count,
                    1 => false,
                    _ => rng.below(20) == 0,
                };
                s.send_as(&m, solicited).expect("send");
                seq += 1;
            }
            if pattern == 1 {
                s.flush().expect("flush");
            }
        }
        s.flush().expect("flush");
        s
    });

    let mut r = Session::new(rx);
    r.register::<Soak>().expect("one type");
    let mut rng = Rng(0xc0ffee);
    let mut held = VecDeque::new();
    let mut bytes = 0u64;
    for expected in 0..n {
        let env = r
            .recv_timeout(Some(Duration::from_secs(20)))
            .expect("receive")
            .expect("a message within 20 s");
        let m: SoakView = env.decode_borrowed().expect("decode");
        assert_eq!(m.seq, expected, "lost, duplicated or reordered");
        assert_eq!(m.pad.len(), pad_len(expected));
        assert!(
            m.pad
                .iter()
                .enumerate()
                .all(|(i, &b)| b == pad_byte(expected, i)),
            "message {expected} corrupted"
        );
        bytes += m.pad.len() as u64;
        held.push_back(env);
        // Slow and bursty: hold up to 40 messages, release them in bursts, pause now and then.
        if held.len() > 8 + rng.below(32) as usize {
            let k = held.len() - rng.below(4) as usize;
            held.drain(..k);
        }
        if rng.below(5000) == 0 {
            thread::sleep(Duration::from_millis(1 + rng.below(10)));
        }
        if expected % 100_000 == 0 {
            println!("progress: {expected} after {:?}", started.elapsed());
        }
    }
    drop(held);
    let s = sender.join().expect("sender thread");
    let elapsed = started.elapsed();
    // Drive the receiver once more so that the returned buffers are collected and re-posted.
    assert!(r
        .recv_timeout(Some(Duration::from_millis(20)))
        .expect("nothing more")
        .is_none());
    let pool = r.connection().pool_stats();
    let after = rnr_counters(&device, 1);
    let (ss, rs, w) = (
        s.stats(),
        r.connection().stats(),
        r.connection().wait_stats(),
    );
    println!(
        "stats soak: {n} messages ({bytes} payload bytes) in {elapsed:?} ({:.0}/s); sender solicited={} policy_solicited={} fragmented={} credit_waits={}; receiver wakeups={} per_wakeup={:.1} grants_sent={}; pool {pool:?}; rnr before={before:?} after={after:?}",
        n as f64 / elapsed.as_secs_f64(),
        ss.sent_solicited,
        ss.policy_solicited,
        ss.fragmented,
        s.connection().stats().credit_waits,
        w.wakeups,
        w.completions_per_wakeup(),
        rs.grants_sent,
    );
    assert_eq!(after, before, "receiver-not-ready NAKs happened");
    assert!(ss.fragmented > 0, "no fragmented message was exercised");
    assert_eq!(pool.lent, 0);
    assert_eq!(pool.free + pool.posted, pool.total);
    s.close().expect("close");
    drop(r);
    assert_eq!(fd_count(), fds_before, "file descriptors leaked");
}
