//! rdmsg on tokio against blocking rdmsg, in the same run: the ping-pong (one-way median µs)
//! and the low-rate receiver (CPU and wake-ups per message). Each side of the async runs has a
//! current-thread runtime on a thread of its own, as each blocking side has a thread: the
//! difference is the futures, the runtime's reactor and the shared-handle bookkeeping.

use std::thread;
use std::time::Duration;

use anyhow::{bail, Result};
use rdmsg::msg::Session;
use rdmsg::tokio::AsyncSession;
use rdmsg::transport::Config;

use crate::join;
use crate::rdmsg::{Payload, PayloadView, Wakeups};

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// The async ping-pong: `iters` measured round trips (after the warm-up) of `size`-byte typed
/// messages, both sides awaiting solicited-only; median one-way µs.
pub fn latency(size: usize, iters: usize) -> Result<f64> {
    let config = crate::rdmsg::ping_pong_config(size, true);
    let (server, client) = rdmsg::transport::loopback_pair(&config, &config)?;
    let total = crate::rdmsg::WARMUP + iters;
    let echo = thread::spawn(move || -> Result<()> {
        runtime()?.block_on(async {
            let s = AsyncSession::new(Session::new(server))?;
            for _ in 0..total {
                let env = s.recv().await?;
                let ping: PayloadView = env.decode_borrowed()?;
                s.send(&ping).await?;
            }
            match s.recv().await {
                Err(rdmsg::tokio::Error::Msg(e)) if e.is_peer_closed() => Ok(()),
                other => bail!("expected the peer's close, got {other:?}"),
            }
        })
    });
    let median = runtime()?.block_on(async {
        let c = AsyncSession::new(Session::new(client))?;
        let ping = Payload {
            bytes: vec![0x5a; size],
        };
        let mut one_way = Vec::with_capacity(iters);
        for i in 0..total {
            let started = std::time::Instant::now();
            c.send(&ping).await?;
            let env = c.recv().await?;
            let back = env.decode_borrowed::<PayloadView>()?.bytes.len();
            let rtt = started.elapsed();
            if back != size {
                bail!("echo of {size} bytes came back with {back}");
            }
            if i >= crate::rdmsg::WARMUP {
                one_way.push(rtt.as_secs_f64() * 1e6 / 2.0);
            }
        }
        c.close().await?;
        Ok(crate::sample::median(&one_way))
    })?;
    join(echo)?;
    Ok(median)
}

/// The async receiver at a low rate: `count` 64-byte messages in batches of `batch` (the last
/// solicited), `gap` apart, from a blocking sender; CPU of the receiver's thread (runtime and
/// reactor included) and descriptor wake-ups per message.
pub fn receiver(batch: usize, count: usize, gap: Duration) -> Result<Wakeups> {
    let rx_config = Config {
        recv_depth: (4 * batch as u32).max(64),
        ..Config::default()
    };
    let (rx, tx) = rdmsg::transport::loopback_pair(&rx_config, &Config::default())?;
    let receiving = thread::spawn(move || -> Result<Wakeups> {
        runtime()?.block_on(async {
            let r = AsyncSession::new(Session::new(rx))?;
            let cpu = rdmsg::verbs::thread_cpu_time();
            for i in 0..count {
                let env = r.recv().await?;
                let m: PayloadView = env.decode_borrowed()?;
                if m.bytes.len() != 64 {
                    bail!("message {i}: {} bytes, sent 64", m.bytes.len());
                }
            }
            let cpu = rdmsg::verbs::thread_cpu_time() - cpu;
            let wakeups = r.wakeups();
            match r.recv().await {
                Err(rdmsg::tokio::Error::Msg(e)) if e.is_peer_closed() => {}
                other => bail!("expected the peer's close, got {other:?}"),
            }
            Ok(Wakeups {
                per_message: wakeups as f64 / count as f64,
                cpu_us_per_message: cpu.as_secs_f64() * 1e6 / count as f64,
            })
        })
    });
    let mut t = Session::new(tx);
    let m = Payload { bytes: vec![7; 64] };
    crate::rdmsg::send_in_batches(&mut t, &m, count, batch, gap)?;
    t.close()?;
    join(receiving)
}
