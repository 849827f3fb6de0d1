//! rdmsg's side of each benchmark: typed messages through `rdmsg::msg::Session`s over two connections
//! on the device's loopback, one thread per side (perftest runs one process per side).

use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdmsg::msg::Session;
use rdmsg::notify::{ArmMode, Policy};
use rdmsg::transport::Config;
use serde::{Deserialize, Serialize};

use crate::join;

/// A message of `size` payload bytes (serialized as one byte string, as bulk data should be).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Payload {
    /// The bytes.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}
rdmsg::msg::message!(Payload, tag = "rdmsg.bench.Payload");

/// [`Payload`] read in place from the receive buffer, as a receiver that only looks at the
/// bytes would (perftest does not touch them at all).
#[derive(Debug, Serialize, Deserialize)]
pub struct PayloadView<'a> {
    /// The bytes, borrowed.
    #[serde(borrow, with = "serde_bytes")]
    pub bytes: &'a [u8],
}
rdmsg::msg::message!(PayloadView<'_>, tag = "rdmsg.bench.Payload");

/// Round trips before the measured ones (connection warm-up, page faults).
pub(crate) const WARMUP: usize = 50;

/// Receive buffer size for payloads of `size` bytes: room for frame header and length prefix.
fn buf_size(size: usize) -> u32 {
    (size + 64).next_power_of_two().max(4096) as u32
}

/// Both peers of a ping-pong: buffers for `size`-byte payloads; sleeping solicited-only
/// (`events`) or busy polling.
pub(crate) fn ping_pong_config(size: usize, events: bool) -> Config {
    Config {
        buf_size: buf_size(size),
        policy: if events { Policy::Sleep } else { Policy::Poll },
        recv_arm: ArmMode::SolicitedOnly,
        ..Config::default()
    }
}

/// Times `WARMUP + iters` calls of `round_trip`, which returns the size of the echo that came
/// back (it must be `size`); returns the median one-way latency in µs (half the round trip, as
/// `ib_send_lat` reports), warm-up left out.
fn median_one_way(
    size: usize,
    iters: usize,
    mut round_trip: impl FnMut() -> Result<usize>,
) -> Result<f64> {
    let mut one_way = Vec::with_capacity(iters);
    for i in 0..WARMUP + iters {
        let started = Instant::now();
        let back = round_trip()?;
        let rtt = started.elapsed();
        if back != size {
            bail!("echo of {size} bytes came back with {back}");
        }
        if i >= WARMUP {
            one_way.push(rtt.as_secs_f64() * 1e6 / 2.0);
        }
    }
    Ok(crate::sample::median(&one_way))
}

/// Ping-pong of `iters` round trips of typed messages between two sessions; returns the median
/// one-way latency in µs. `events`: both sides sleep solicited-only; otherwise both busy poll.
pub fn latency(size: usize, iters: usize, events: bool) -> Result<f64> {
    let config = ping_pong_config(size, events);
    let (server, client) = rdmsg::transport::loopback_pair(&config, &config)?;
    let total = WARMUP + iters;
    let echo = thread::spawn(move || -> Result<()> {
        let mut s = Session::new(server);
        for _ in 0..total {
            let env = s.recv()?;
            let ping: PayloadView = env.decode_borrowed()?;
            s.send(&ping)?;
        }
        expect_close(&mut s)
    });
    let mut c = Session::new(client);
    let ping = Payload {
        bytes: vec![0x5a; size],
    };
    let median = median_one_way(size, iters, || {
        c.send(&ping)?;
        let env = c.recv()?;
        let pong: PayloadView = env.decode_borrowed()?;
        Ok(pong.bytes.len())
    })?;
    c.close()?;
    join(echo)?;
    Ok(median)
}

/// [`latency`] one layer down: raw bytes through `rdmsg::transport::Connection`s (credits, pools,
/// waiter), without frames or serialization. Both sides solicit every message.
pub fn latency_transport(size: usize, iters: usize, events: bool) -> Result<f64> {
    let config = ping_pong_config(size, events);
    let (mut server, mut client) = rdmsg::transport::loopback_pair(&config, &config)?;
    let total = WARMUP + iters;
    let echo = thread::spawn(move || -> Result<()> {
        for _ in 0..total {
            let ping = server.recv()?;
            server.send(&ping, true)?;
        }
        match server.recv() {
            Err(rdmsg::transport::Error::Connection(rdmsg::transport::Failure::PeerClosed)) => {
                Ok(())
            }
            Err(e) => Err(e).context("waiting for the peer to close"),
            Ok(_) => bail!("unexpected message after the last"),
        }
    });
    let ping = vec![0x5a; size];
    let median = median_one_way(size, iters, || {
        client.send(&ping, true)?;
        Ok(client.recv()?.len())
    })?;
    client.close()?;
    join(echo)?;
    Ok(median)
}

/// Receives `count` [`Payload`]s of `size` bytes, reading each in place.
fn receive_payloads(r: &mut Session, count: usize, size: usize) -> Result<()> {
    for i in 0..count {
        let env = r.recv()?;
        let m: PayloadView = env.decode_borrowed()?;
        if m.bytes.len() != size {
            bail!("message {i}: {} bytes, sent {size}", m.bytes.len());
        }
    }
    Ok(())
}

/// Sends `count` copies of `m` in `send_batch`es of `batch` (the last of each solicited),
/// pausing `gap` after each batch.
pub(crate) fn send_in_batches(
    t: &mut Session,
    m: &Payload,
    count: usize,
    batch: usize,
    gap: Duration,
) -> Result<()> {
    let mut sent = 0;
    while sent < count {
        let n = batch.min(count - sent);
        t.send_batch(std::iter::repeat(m).take(n))?;
        sent += n;
        if !gap.is_zero() {
            thread::sleep(gap);
        }
    }
    Ok(())
}

/// After the last expected message: the peer's graceful close, and nothing else.
pub(crate) fn expect_close(s: &mut Session) -> Result<()> {
    match s.recv() {
        Err(e) if e.is_peer_closed() => Ok(()),
        Err(e) => Err(e).context("waiting for the peer to close"),
        Ok(env) => bail!(
            "unexpected message with tag {:#x} after the last",
            env.tag()
        ),
    }
}

/// Throughput settings.
#[derive(Debug, Clone, Copy)]
pub struct Stream {
    /// Payload bytes per message.
    pub size: usize,
    /// Messages in all.
    pub count: usize,
    /// Messages per batch (the last of each solicited).
    pub batch: usize,
    /// Batches go by `send_batch`, packed several messages to a frame; else one `send` per
    /// message (one frame, one receive buffer and one credit each).
    pub packed: bool,
    /// Receive buffers (credits) of the receiver.
    pub recv_depth: u32,
}

/// What a stream measured.
#[derive(Debug, Clone, Copy)]
pub struct Streamed {
    /// Million messages per second, from the first send to the last message decoded by the
    /// receiver.
    pub mpps: f64,
    /// The receiver's frames per message: receive buffers (and credits) spent per message.
    pub buffers_per_message: f64,
}

/// One-way stream of `count` messages.
pub fn throughput(s: Stream) -> Result<Streamed> {
    let config = Config {
        buf_size: buf_size(s.size),
        recv_depth: s.recv_depth,
        send_depth: s.recv_depth.max(64),
        ..Config::default()
    };
    let (rx, tx) = rdmsg::transport::loopback_pair(&config, &config)?;
    let count = s.count;
    let receiver = thread::spawn(move || -> Result<(Instant, f64)> {
        let mut r = Session::new(rx);
        receive_payloads(&mut r, count, s.size)?;
        let done = Instant::now();
        let stats = r.stats();
        expect_close(&mut r)?;
        Ok((
            done,
            stats.frames_received as f64 / stats.received.max(1) as f64,
        ))
    });
    let mut t = Session::new(tx);
    let m = Payload {
        bytes: vec![0xa5; s.size],
    };
    let started = Instant::now();
    if s.packed {
        send_in_batches(&mut t, &m, count, s.batch, Duration::ZERO)?;
    } else {
        for i in 0..count {
            t.send_as(&m, (i + 1) % s.batch == 0 || i + 1 == count)?;
        }
    }
    t.close()?;
    let (done, buffers_per_message) = join(receiver)?;
    Ok(Streamed {
        mpps: count as f64 / done.duration_since(started).as_secs_f64() / 1e6,
        buffers_per_message,
    })
}

/// How the receiver waits, in the wake-up benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvMode {
    /// Busy polling, never sleeping.
    Poll,
    /// Sleeping, armed for the next completion.
    Next,
    /// Spinning a little, then sleeping solicited-only.
    Hybrid,
    /// Sleeping solicited-only.
    Solicited,
    /// Spinning while recent arrivals came close together, else sleeping solicited-only
    /// (`Policy::Adaptive`, 50 µs limit).
    Adaptive,
}

impl RecvMode {
    /// All modes, in report order.
    pub const ALL: [RecvMode; 4] = [
        RecvMode::Poll,
        RecvMode::Next,
        RecvMode::Hybrid,
        RecvMode::Solicited,
    ];

    /// Name in samples and tables.
    pub fn name(self) -> &'static str {
        match self {
            RecvMode::Poll => "busy-poll",
            RecvMode::Next => "next",
            RecvMode::Hybrid => "hybrid",
            RecvMode::Solicited => "solicited-only",
            RecvMode::Adaptive => "adaptive",
        }
    }

    fn apply(self, c: &mut Config) {
        (c.policy, c.recv_arm) = match self {
            RecvMode::Poll => (Policy::Poll, ArmMode::SolicitedOnly),
            RecvMode::Next => (Policy::Sleep, ArmMode::Next),
            RecvMode::Hybrid => (
                Policy::Hybrid {
                    spin: Duration::from_micros(50),
                    max_empty_polls: 1000,
                },
                ArmMode::SolicitedOnly,
            ),
            RecvMode::Solicited => (Policy::Sleep, ArmMode::SolicitedOnly),
            RecvMode::Adaptive => (Policy::ADAPTIVE, ArmMode::SolicitedOnly),
        };
    }
}

/// The modes of the rate sweep: the two ends, the fixed spin, and the adaptive one.
pub const SWEEP_MODES: [RecvMode; 4] = [
    RecvMode::Poll,
    RecvMode::Solicited,
    RecvMode::Hybrid,
    RecvMode::Adaptive,
];

/// What the receiver paid per message at an offered rate.
#[derive(Debug, Clone, Copy)]
pub struct AtRate {
    /// One-way latency, from the send call to the decoded message, µs (median).
    pub latency_us: f64,
    /// Receiver thread CPU time per message, µs.
    pub cpu_us_per_message: f64,
    /// Messages per second the sender managed.
    pub rate: f64,
}

/// Messages of the sweep at `rate` per second (`None`: as fast as the sender can), each
/// solicited and stamped with its send time; measures the receiving thread waiting as `mode`
/// says.
pub fn at_rate(mode: RecvMode, rate: Option<f64>, count: usize) -> Result<AtRate> {
    let mut rx_config = Config::default();
    mode.apply(&mut rx_config);
    let (rx, tx) = rdmsg::transport::loopback_pair(&rx_config, &Config::default())?;
    let base = Instant::now();
    let receiver = thread::spawn(move || -> Result<(f64, f64)> {
        let mut r = Session::new(rx);
        let mut lat = Vec::with_capacity(count);
        let cpu = rdmsg::verbs::thread_cpu_time();
        for _ in 0..count {
            let env = r.recv()?;
            let m: PayloadView = env.decode_borrowed()?;
            let stamp = u64::from_le_bytes(m.bytes[..8].try_into()?);
            let now = base.elapsed().as_nanos() as u64;
            lat.push(now.saturating_sub(stamp) as f64 / 1e3);
        }
        let cpu = rdmsg::verbs::thread_cpu_time() - cpu;
        let st = r.connection().wait_stats();
        eprintln!(
            "  {}: {} waits spun, {} caught a message, {} wake-ups",
            mode.name(),
            st.spins,
            st.spins_caught,
            st.wakeups
        );
        expect_close(&mut r)?;
        Ok((
            crate::sample::median(&lat),
            cpu.as_secs_f64() * 1e6 / count as f64,
        ))
    });
    let mut t = Session::new(tx);
    let mut m = Payload { bytes: vec![0; 8] };
    let started = Instant::now();
    for i in 0..count {
        if let Some(rate) = rate {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            pace_until(due);
        }
        m.bytes
            .copy_from_slice(&(base.elapsed().as_nanos() as u64).to_le_bytes());
        t.send(&m)?;
    }
    let secs = started.elapsed().as_secs_f64();
    t.close()?;
    let (latency_us, cpu_us_per_message) = join(receiver)?;
    Ok(AtRate {
        latency_us,
        cpu_us_per_message,
        rate: count as f64 / secs,
    })
}

/// Waits until `due`: sleeping while it is far, spinning the last stretch (a sleep under
/// emulation overshoots by a hundred µs or more).
fn pace_until(due: Instant) {
    loop {
        let now = Instant::now();
        if now >= due {
            return;
        }
        let left = due - now;
        if left > Duration::from_micros(300) {
            thread::sleep(left - Duration::from_micros(200));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// What the receiver paid per message.
#[derive(Debug, Clone, Copy)]
pub struct Wakeups {
    /// Wake-ups from the completion channel per message (0 for busy polling).
    pub per_message: f64,
    /// Receiver thread CPU time per message, µs.
    pub cpu_us_per_message: f64,
}

/// `count` messages of 64 bytes at a low rate: batches of `batch` (the last solicited) with
/// `gap` between batches. Measures the receiving thread.
pub fn wakeups(mode: RecvMode, batch: usize, count: usize, gap: Duration) -> Result<Wakeups> {
    let mut rx_config = Config {
        // Deep enough that the sender's policy never solicits inside a batch (it does after a
        // quarter of the receiver's depth).
        recv_depth: (4 * batch as u32).max(64),
        ..Config::default()
    };
    mode.apply(&mut rx_config);
    let (rx, tx) = rdmsg::transport::loopback_pair(&rx_config, &Config::default())?;
    let receiver = thread::spawn(move || -> Result<Wakeups> {
        let mut r = Session::new(rx);
        let cpu = rdmsg::verbs::thread_cpu_time();
        receive_payloads(&mut r, count, 64)?;
        let cpu = rdmsg::verbs::thread_cpu_time() - cpu;
        let stats = r.connection().wait_stats();
        expect_close(&mut r)?;
        Ok(Wakeups {
            per_message: stats.wakeups as f64 / count as f64,
            cpu_us_per_message: cpu.as_secs_f64() * 1e6 / count as f64,
        })
    });
    let mut t = Session::new(tx);
    let m = Payload { bytes: vec![7; 64] };
    send_in_batches(&mut t, &m, count, batch, gap)?;
    t.close()?;
    join(receiver)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_hold_the_largest_frame() {
        assert_eq!(buf_size(8), 4096);
        assert_eq!(buf_size(4096), 8192);
        assert_eq!(buf_size(65536), 131072);
    }
}
