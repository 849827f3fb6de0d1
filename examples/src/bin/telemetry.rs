//! A solicited-only receiver fed by a telemetry producer: readings go out unsolicited in
//! batches whose last message wakes the receiver, alarms wake it at once. Run with
//! `--arm both` (what `cargo xtask demo` does) to compare against a receiver woken by every
//! completion.
//!
//! ```text
//! telemetry [--arm solicited|next|both] [--messages N] [--batch K] [--alarm-every A] [--gap-us G]
//! ```

#![forbid(unsafe_code)]

use std::thread;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use rdmsg::msg::Session;
use rdmsg::notify::ArmMode;
use rdmsg::transport::Config;
use rdmsg_examples::{loopback_pair, Alarm, Reading};

struct Options {
    arms: Vec<ArmMode>,
    messages: u64,
    batch: usize,
    alarm_every: u64,
    gap: Duration,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        arms: vec![ArmMode::SolicitedOnly],
        messages: 4000,
        batch: 20,
        alarm_every: 1000,
        gap: Duration::from_micros(2000),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut v = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--arm" => {
                o.arms = match v()?.as_str() {
                    "solicited" => vec![ArmMode::SolicitedOnly],
                    "next" => vec![ArmMode::Next],
                    "both" => vec![ArmMode::SolicitedOnly, ArmMode::Next],
                    other => bail!("--arm solicited|next|both, not {other}"),
                }
            }
            "--messages" => o.messages = v()?.parse()?,
            "--batch" => o.batch = v()?.parse()?,
            "--alarm-every" => o.alarm_every = v()?.parse()?,
            "--gap-us" => o.gap = Duration::from_micros(v()?.parse()?),
            other => bail!("unknown argument {other}"),
        }
    }
    if o.batch == 0 || o.alarm_every == 0 {
        bail!("--batch and --alarm-every must be positive");
    }
    Ok(o)
}

struct Row {
    arm: ArmMode,
    messages: u64,
    alarms: u64,
    wakeups: u64,
    per_wakeup: f64,
    cpu_per_message: Duration,
}

fn run(o: &Options, arm: ArmMode) -> Result<Row> {
    let server = Config {
        recv_arm: arm,
        ..Config::default()
    };
    let (rx, tx) = loopback_pair(&server, &Config::default())?;
    let receiver = thread::spawn(
        move || -> Result<(u64, u64, rdmsg::notify::Stats, Duration)> {
            let mut s = Session::new(rx);
            s.register::<Reading>()?.register::<Alarm>()?;
            let cpu = rdmsg::verbs::thread_cpu_time();
            let (mut readings, mut alarms) = (0u64, 0u64);
            loop {
                match s.recv() {
                    Ok(env) if env.is::<Reading>() => {
                        let r: Reading = env.decode()?;
                        if r.seq != readings {
                            bail!("reading {} arrived as number {readings}", r.seq);
                        }
                        readings += 1;
                    }
                    Ok(env) => {
                        env.decode::<Alarm>()?;
                        alarms += 1;
                    }
                    Err(e) if e.is_peer_closed() => break,
                    Err(e) => return Err(e.into()),
                }
            }
            let cpu = rdmsg::verbs::thread_cpu_time() - cpu;
            Ok((readings, alarms, s.connection().wait_stats(), cpu))
        },
    );
    let mut tx = Session::new(tx);
    let mut seq = 0u64;
    while seq < o.messages {
        let n = (o.batch as u64).min(o.messages - seq);
        let batch: Vec<Reading> = (seq..seq + n)
            .map(|i| Reading {
                sensor: (i % 8) as u16,
                seq: i,
                value: i as f64 * 0.5,
            })
            .collect();
        tx.send_batch(&batch)?;
        seq += n;
        if seq % o.alarm_every < n {
            tx.send(&Alarm {
                sensor: 3,
                reason: format!("threshold crossed at reading {seq}"),
            })?;
        }
        thread::sleep(o.gap);
    }
    tx.close()?;
    let (readings, alarms, stats, cpu) = receiver.join().expect("receiver thread")?;
    if readings != o.messages {
        bail!("received {readings} of {} readings", o.messages);
    }
    let messages = readings + alarms;
    Ok(Row {
        arm,
        messages,
        alarms,
        wakeups: stats.wakeups,
        per_wakeup: stats.completions_per_wakeup(),
        cpu_per_message: cpu / messages.max(1) as u32,
    })
}

fn main() -> Result<()> {
    let o = parse()?;
    println!(
        "telemetry: {} readings in batches of {} (last one solicited), an alarm every {}, {:?} between batches",
        o.messages, o.batch, o.alarm_every, o.gap
    );
    let rows: Vec<Row> = o.arms.iter().map(|&a| run(&o, a)).collect::<Result<_>>()?;
    println!();
    println!(
        "| receiver arming | messages | alarms | wake-ups | completions/wake-up | receiver CPU/message |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        let arm = match r.arm {
            ArmMode::SolicitedOnly => "solicited-only",
            ArmMode::Next => "next completion",
        };
        println!(
            "| {arm} | {} | {} | {} | {:.1} | {:.1} µs |",
            r.messages,
            r.alarms,
            r.wakeups,
            r.per_wakeup,
            r.cpu_per_message.as_secs_f64() * 1e6
        );
    }
    Ok(())
}
