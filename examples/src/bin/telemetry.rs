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

use std::process::ExitCode;
use std::thread;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};
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

/// A solicited-only receiver fed by a telemetry producer on one device: readings go out
/// unsolicited in batches whose last message wakes the receiver, alarms wake it at once.
/// `--arm all --rounds 7` compares it, round after round, against a receiver woken by every
/// completion and one that busy-polls, and prints each receiver's median and spread.
#[derive(Debug, Parser)]
#[command(name = "telemetry", args_override_self = true)]
struct Options {
    /// The receivers to run
    #[arg(long, value_enum, default_value_t = Arm::Solicited)]
    arm: Arm,
    /// Rounds, each running every receiver once
    #[arg(long, value_name = "R", default_value_t = 1,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    rounds: usize,
    /// Readings per run
    #[arg(long, value_name = "N", default_value_t = 4000)]
    messages: u64,
    /// Readings per batch (the last one solicited)
    #[arg(long, value_name = "K", default_value_t = 20,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    batch: usize,
    /// An alarm after every A readings
    #[arg(long, value_name = "A", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..))]
    alarm_every: u64,
    /// Microseconds between batches
    #[arg(long = "gap-us", value_name = "G", default_value = "2000", value_parser = micros)]
    gap: Duration,
}

/// `--arm`: which receivers.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Arm {
    /// Asleep until a solicited message
    Solicited,
    /// Asleep until any completion
    Next,
    /// Busy-polling
    Poll,
    /// Solicited and next
    Both,
    /// Solicited, next and poll
    All,
}

impl Arm {
    fn modes(self) -> Vec<Mode> {
        match self {
            Arm::Solicited => vec![Mode::Solicited],
            Arm::Next => vec![Mode::Next],
            Arm::Poll => vec![Mode::Poll],
            Arm::Both => vec![Mode::Solicited, Mode::Next],
            Arm::All => vec![Mode::Solicited, Mode::Next, Mode::Poll],
        }
    }
}

/// `--gap-us`: microseconds.
fn micros(us: &str) -> Result<Duration, std::num::ParseIntError> {
    Ok(Duration::from_micros(us.parse()?))
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

fn main() -> ExitCode {
    let o = Options::parse();
    rdmsg_examples::run(|| compare(&o))
}

fn compare(o: &Options) -> Result<()> {
    let arms = o.arm.modes();
    println!(
        "telemetry: {} readings in batches of {} (last one solicited), an alarm every {}, {:?} between batches; {} round(s), the receivers interleaved",
        o.messages, o.batch, o.alarm_every, o.gap, o.rounds
    );
    // Round after round, every receiver once: drift of the machine hits them alike.
    let mut rows: Vec<Vec<Row>> = arms.iter().map(|_| Vec::new()).collect();
    for round in 0..o.rounds {
        for (i, &mode) in arms.iter().enumerate() {
            let r = run(o, mode)?;
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
    for (mode, runs) in arms.iter().zip(&rows) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("telemetry").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn command_lines() {
        let o = parse(&[]);
        assert_eq!(o.arm.modes(), [Mode::Solicited]);
        assert_eq!(
            (o.rounds, o.messages, o.batch, o.alarm_every),
            (1, 4000, 20, 1000)
        );
        assert_eq!(o.gap, Duration::from_micros(2000));
        // As `cargo xtask demo` runs it.
        let o = parse(&["--arm", "all", "--rounds", "7", "--messages", "4000"]);
        assert_eq!(o.arm.modes(), [Mode::Solicited, Mode::Next, Mode::Poll]);
        assert_eq!((o.rounds, o.messages), (7, 4000));
        for (arm, modes) in [
            ("solicited", &[Mode::Solicited][..]),
            ("next", &[Mode::Next]),
            ("poll", &[Mode::Poll]),
            ("both", &[Mode::Solicited, Mode::Next]),
        ] {
            assert_eq!(parse(&["--arm", arm]).arm.modes(), modes);
        }
        let o = parse(&["--batch", "5", "--alarm-every", "3", "--gap-us", "10"]);
        assert_eq!(
            (o.batch, o.alarm_every, o.gap),
            (5, 3, Duration::from_micros(10))
        );
    }

    #[test]
    fn refused() {
        for args in [
            &["--arm", "sometimes"][..],
            &["--rounds", "0"],
            &["--batch", "0"],
            &["--alarm-every", "0"],
            &["--gap-us", "-1"],
            &["--bogus"],
        ] {
            let args = std::iter::once("telemetry").chain(args.iter().copied());
            assert!(Options::try_parse_from(args).is_err());
        }
    }
}
