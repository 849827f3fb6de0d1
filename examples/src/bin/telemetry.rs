//! A solicited-only receiver fed by a telemetry producer: readings go out unsolicited in
//! batches whose last message wakes the receiver, alarms wake it at once. Run with
//! `--arm all --rounds 7` (what `cargo xtask demo` does) to compare it, round after round,
//! against a receiver woken by every completion and one that busy-polls; the table gives each
//! receiver's median over the rounds and the spread, so that one noisy run does not decide.
//!
//! ```text
//! telemetry [--arm solicited|next|poll|both|all] [--rounds R] [--messages N] [--batch K]
//!           [--alarm-every A] [--gap-us G]
//! ```

#![forbid(unsafe_code)]

use std::thread;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use rdmsg::msg::Session;
use rdmsg::notify::{ArmMode, Policy};
use rdmsg::transport::Config;
use rdmsg_examples::{loopback_pair, Alarm, Reading};

/// How the receiver waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Asleep until a solicited message (or an error).
    Solicited,
    /// Asleep until any completion.
    Next,
    /// Never asleep: polling all the time.
    Poll,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Solicited => "solicited-only",
            Mode::Next => "next completion",
            Mode::Poll => "busy-poll",
        }
    }
}

struct Options {
    arms: Vec<Mode>,
    rounds: usize,
    messages: u64,
    batch: usize,
    alarm_every: u64,
    gap: Duration,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        arms: vec![Mode::Solicited],
        rounds: 1,
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
                    "solicited" => vec![Mode::Solicited],
                    "next" => vec![Mode::Next],
                    "poll" => vec![Mode::Poll],
                    "both" => vec![Mode::Solicited, Mode::Next],
                    "all" => vec![Mode::Solicited, Mode::Next, Mode::Poll],
                    other => bail!("--arm solicited|next|poll|both|all, not {other}"),
                }
            }
            "--rounds" => o.rounds = v()?.parse()?,
            "-h" | "--help" => {
                println!(
                    "usage: telemetry [--arm solicited|next|poll|both|all] [--rounds R] \
                     [--messages N] [--batch K] [--alarm-every A] [--gap-us G]"
                );
                std::process::exit(0);
            }
            "--messages" => o.messages = v()?.parse()?,
            "--batch" => o.batch = v()?.parse()?,
            "--alarm-every" => o.alarm_every = v()?.parse()?,
            "--gap-us" => o.gap = Duration::from_micros(v()?.parse()?),
            other => bail!("unknown argument {other}"),
        }
    }
    if o.batch == 0 || o.alarm_every == 0 || o.rounds == 0 {
        bail!("--batch, --alarm-every and --rounds must be positive");
    }
    Ok(o)
}

struct Row {
    messages: u64,
    alarms: u64,
    wakeups: u64,
    per_wakeup: f64,
    cpu_per_message: Duration,
}

fn run(o: &Options, mode: Mode) -> Result<Row> {
    let server = Config {
        recv_arm: if mode == Mode::Next {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        },
        policy: if mode == Mode::Poll {
            Policy::Poll
        } else {
            Policy::Sleep
        },
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
        "telemetry: {} readings in batches of {} (last one solicited), an alarm every {}, {:?} between batches; {} round(s), the receivers interleaved",
        o.messages, o.batch, o.alarm_every, o.gap, o.rounds
    );
    // Round after round, every receiver once: drift of the machine hits them alike.
    let mut rows: Vec<Vec<Row>> = o.arms.iter().map(|_| Vec::new()).collect();
    for round in 0..o.rounds {
        for (i, &mode) in o.arms.iter().enumerate() {
            let r = run(&o, mode)?;
            eprintln!(
                "[round {}/{}] {}: {:.1} µs CPU/message, {} wake-ups",
                round + 1,
                o.rounds,
                mode.name(),
                r.cpu_per_message.as_secs_f64() * 1e6,
                r.wakeups
            );
            rows[i].push(r);
        }
    }
    println!();
    println!(
        "| receiver | messages | alarms | wake-ups | completions/wake-up | receiver CPU/message (median) | spread (min–max) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut medians = Vec::new();
    for (mode, runs) in o.arms.iter().zip(&rows) {
        let mut cpu: Vec<f64> = runs
            .iter()
            .map(|r| r.cpu_per_message.as_secs_f64() * 1e6)
            .collect();
        cpu.sort_by(f64::total_cmp);
        let med = cpu[cpu.len() / 2];
        medians.push((*mode, med));
        let mid = &runs[runs.len() / 2];
        let mut wakeups: Vec<u64> = runs.iter().map(|r| r.wakeups).collect();
        wakeups.sort_unstable();
        let mut per_wakeup: Vec<f64> = runs.iter().map(|r| r.per_wakeup).collect();
        per_wakeup.sort_by(f64::total_cmp);
        println!(
            "| {} | {} | {} | {} | {:.1} | {med:.1} µs | {:.1}–{:.1} µs |",
            mode.name(),
            mid.messages,
            mid.alarms,
            wakeups[wakeups.len() / 2],
            per_wakeup[per_wakeup.len() / 2],
            cpu[0],
            cpu[cpu.len() - 1],
        );
    }
    if let Some(&(_, solicited)) = medians.iter().find(|(m, _)| *m == Mode::Solicited) {
        for &(mode, other) in medians.iter().filter(|(m, _)| *m != Mode::Solicited) {
            println!(
                "solicited-only used {:.1}× less receiver CPU per message than {} (medians of {} rounds)",
                other / solicited,
                mode.name(),
                o.rounds
            );
        }
    }
    Ok(())
}
