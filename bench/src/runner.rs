//! The device benchmarks, planned as a list of measurements: each round measures rdmsg and its
//! anchor back to back for every point, so that drift of the emulated machine hits both alike.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::perftest::{self, Perftest};
use crate::rdmsg::{self, RecvMode, Stream};
use crate::sample::{Bench, Sample};
use crate::verbs;

/// How much to measure.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Rounds of every measurement.
    pub rounds: u32,
    /// Ping-pong sizes.
    pub lat_sizes: Vec<usize>,
    /// Sizes of the verbs-level ping-pong (rdmsg's `rc_pingpong` vs `ibv_rc_pingpong`).
    pub layer_sizes: Vec<usize>,
    /// Round trips per latency measurement.
    pub lat_iters: usize,
    /// Stream sizes, with the message count for each.
    pub bw: Vec<(usize, usize)>,
    /// Messages per `send_batch` in the stream.
    pub bw_batch: usize,
    /// Receive depth (credits) of the stream's receiver.
    pub bw_depth: u32,
    /// Batch sizes of the wake-up benchmark.
    pub wake_batches: Vec<usize>,
    /// Batches per wake-up measurement (messages: batches × batch size).
    pub wake_batch_count: usize,
    /// Pause between batches in the wake-up benchmark.
    pub wake_gap: Duration,
    /// Which benchmarks to run.
    pub benches: Vec<Bench>,
    /// Only the measurements whose description contains this.
    pub filter: Option<String>,
}

impl Plan {
    /// The full benchmark (a few minutes under emulation).
    pub fn full() -> Self {
        Self {
            rounds: 5,
            lat_sizes: vec![8, 64, 256, 1024, 4096],
            layer_sizes: vec![8, 4096],
            lat_iters: 1000,
            bw: vec![(64, 20_000), (512, 20_000), (4096, 5_000), (65536, 1_000)],
            bw_batch: 64,
            bw_depth: 256,
            wake_batches: vec![1, 8, 64],
            wake_batch_count: 200,
            // A low rate: emulation slows everything some 20 to 200 times, and one sleeping
            // round trip already takes about half a millisecond.
            wake_gap: Duration::from_millis(5),
            benches: vec![Bench::LatEvent, Bench::LatPoll, Bench::Bw, Bench::Wake],
            filter: None,
        }
    }

    /// A smoke run: every measurement once, small.
    pub fn quick() -> Self {
        Self {
            rounds: 1,
            lat_sizes: vec![8, 4096],
            layer_sizes: vec![8],
            lat_iters: 100,
            bw: vec![(64, 2_000), (65536, 200)],
            wake_batches: vec![1, 8],
            wake_batch_count: 40,
            ..Self::full()
        }
    }

    /// Every measurement, in the order it runs.
    pub fn tasks(&self) -> Vec<Task> {
        let mut tasks = Vec::new();
        for round in 0..self.rounds {
            for &bench in &self.benches {
                match bench {
                    Bench::LatEvent | Bench::LatPoll => {
                        for &size in &self.lat_sizes {
                            for who in [Who::Rdmsg, Who::Perftest] {
                                tasks.push(Task {
                                    round,
                                    what: What::Latency { bench, size, who },
                                });
                            }
                        }
                        for &size in &self.layer_sizes {
                            for who in [Who::Transport, Who::RcPingpong, Who::IbvRcPingpong] {
                                tasks.push(Task {
                                    round,
                                    what: What::Latency { bench, size, who },
                                });
                            }
                        }
                    }
                    Bench::Bw => {
                        for &(size, count) in &self.bw {
                            for who in [Who::Rdmsg, Who::Perftest, Who::Verbs] {
                                tasks.push(Task {
                                    round,
                                    what: What::Stream { size, count, who },
                                });
                            }
                        }
                    }
                    Bench::Wake => {
                        for &batch in &self.wake_batches {
                            for mode in RecvMode::ALL {
                                tasks.push(Task {
                                    round,
                                    what: What::Wake { mode, batch },
                                });
                            }
                            tasks.push(Task {
                                round,
                                what: What::WakeFloor { batch },
                            });
                        }
                    }
                    Bench::Codec => {}
                }
            }
        }
        if let Some(f) = &self.filter {
            tasks.retain(|t| t.describe().contains(f.as_str()));
        }
        tasks
    }
}

/// Who is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// rdmsg sessions.
    Rdmsg,
    /// perftest.
    Perftest,
    /// The raw verbs-core stream.
    Verbs,
    /// rdmsg's transport alone: raw bytes through `Connection`s, no msg layer.
    Transport,
    /// rdmsg's `rc_pingpong` example: notify's waiter on verbs-core, no transport or msg.
    RcPingpong,
    /// rdma-core's `ibv_rc_pingpong`.
    IbvRcPingpong,
}

impl Who {
    fn name(self, bench: Bench) -> &'static str {
        match self {
            Who::Rdmsg => "rdmsg",
            Who::Perftest if bench == Bench::LatEvent => "ib_send_lat -e",
            Who::Perftest if bench == Bench::Bw => "ib_send_bw",
            Who::Perftest => "ib_send_lat",
            Who::Verbs => "verbs-core",
            Who::Transport => "transport",
            Who::RcPingpong => "rc_pingpong",
            Who::IbvRcPingpong => "ibv_rc_pingpong",
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Copy)]
pub enum What {
    /// A ping-pong.
    Latency {
        /// `LatEvent` or `LatPoll`.
        bench: Bench,
        /// Payload bytes.
        size: usize,
        /// Who.
        who: Who,
    },
    /// A one-way stream.
    Stream {
        /// Payload bytes.
        size: usize,
        /// Messages.
        count: usize,
        /// Who.
        who: Who,
    },
    /// Receiver cost at a low rate.
    Wake {
        /// How the receiver waits.
        mode: RecvMode,
        /// Messages per batch.
        batch: usize,
    },
    /// The same for the minimal sleeping receiver on raw verbs-core.
    WakeFloor {
        /// Messages per batch.
        batch: usize,
    },
}

/// A measurement of a round.
#[derive(Debug, Clone, Copy)]
pub struct Task {
    /// Round number.
    pub round: u32,
    /// The measurement.
    pub what: What,
}

impl Task {
    /// A short description for progress lines.
    pub fn describe(&self) -> String {
        match self.what {
            What::Latency { bench, size, who } => format!(
                "latency {} {size} B, {}",
                if bench == Bench::LatEvent {
                    "event"
                } else {
                    "poll"
                },
                who.name(bench)
            ),
            What::Stream { size, count, who } => {
                format!("stream {count} × {size} B, {}", who.name(Bench::Bw))
            }
            What::Wake { mode, batch } => format!("receiver {} batch {batch}", mode.name()),
            What::WakeFloor { batch } => format!("receiver verbs-core floor batch {batch}"),
        }
    }

    /// Runs the measurement; returns its samples.
    pub fn run(&self, plan: &Plan, perf: &Perftest) -> Result<Vec<Sample>> {
        let sample =
            |bench, subject: &str, variant: &str, size, batch, metric: &str, value| Sample {
                bench,
                subject: subject.into(),
                variant: variant.into(),
                size: size as u64,
                batch,
                round: self.round,
                metric: metric.into(),
                value,
            };
        Ok(match self.what {
            What::Latency { bench, size, who } => {
                let events = bench == Bench::LatEvent;
                let (subject, us) = match who {
                    Who::Perftest => {
                        let mut args = vec![
                            "-s".to_string(),
                            size.to_string(),
                            "-n".into(),
                            plan.lat_iters.to_string(),
                        ];
                        if events {
                            args.push("-e".into());
                        }
                        let out = perf.run("ib_send_lat", &args)?;
                        ("ib_send_lat", perftest::parse_lat_typical(&out.client)?)
                    }
                    Who::RcPingpong | Who::IbvRcPingpong => {
                        let program = if who == Who::RcPingpong {
                            sibling_program("rc_pingpong")?
                        } else {
                            "ibv_rc_pingpong".into()
                        };
                        let rtt =
                            perf.pingpong(&program, &program, size, plan.lat_iters * 5, events)?;
                        (who.name(bench), rtt / 2.0)
                    }
                    Who::Transport => (
                        "transport",
                        rdmsg::latency_transport(size, plan.lat_iters, events)?,
                    ),
                    Who::Rdmsg | Who::Verbs => {
                        ("rdmsg", rdmsg::latency(size, plan.lat_iters, events)?)
                    }
                };
                vec![sample(bench, subject, "", size, 0, "us", us)]
            }
            What::Stream { size, count, who } => {
                let (subject, mpps) = match who {
                    Who::Rdmsg => (
                        "rdmsg",
                        rdmsg::throughput(Stream {
                            size,
                            count,
                            batch: plan.bw_batch,
                            recv_depth: plan.bw_depth,
                        })?,
                    ),
                    Who::Perftest => {
                        let args =
                            ["-s", &size.to_string(), "-n", &count.to_string()].map(String::from);
                        let out = perf.run("ib_send_bw", &args)?;
                        // The receiver's figure, as rdmsg's is measured at its receiver.
                        ("ib_send_bw", perftest::parse_bw_mpps(&out.server)?)
                    }
                    Who::Verbs => ("verbs-core", verbs::throughput(size, count as u64)?),
                    Who::Transport | Who::RcPingpong | Who::IbvRcPingpong => {
                        anyhow::bail!("{} is not a stream", who.name(Bench::Bw))
                    }
                };
                vec![sample(Bench::Bw, subject, "", size, 0, "mpps", mpps)]
            }
            What::Wake { mode, batch } => {
                let count = plan.wake_batch_count * batch;
                let w = rdmsg::wakeups(mode, batch, count, plan.wake_gap)?;
                let mut v = vec![sample(
                    Bench::Wake,
                    "rdmsg",
                    mode.name(),
                    64,
                    batch as u32,
                    "cpu_us_per_msg",
                    w.cpu_us_per_message,
                )];
                if mode != RecvMode::Poll {
                    v.push(sample(
                        Bench::Wake,
                        "rdmsg",
                        mode.name(),
                        64,
                        batch as u32,
                        "wakeups_per_msg",
                        w.per_message,
                    ));
                }
                v
            }
            What::WakeFloor { batch } => {
                let cpu = verbs::wake_floor(batch, plan.wake_batch_count, plan.wake_gap)?;
                vec![sample(
                    Bench::Wake,
                    "verbs-core",
                    "floor",
                    64,
                    batch as u32,
                    "cpu_us_per_msg",
                    cpu,
                )]
            }
        })
    }
}

/// A program built next to this one (the examples, in the same target directory).
fn sibling_program(name: &str) -> Result<String> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.exists() {
        anyhow::bail!(
            "{} not found: build it (cargo build --release -p rdmsg-examples)",
            path.display()
        );
    }
    Ok(path.to_string_lossy().into_owned())
}

/// Runs every task, printing samples as lines on `out` and progress on stderr. A failed task
/// is reported and skipped; returns how many failed.
pub fn run_all(plan: &Plan, perf: &Perftest, out: &mut impl Write) -> Result<usize> {
    let tasks = plan.tasks();
    let started = Instant::now();
    let mut failed = 0;
    for (i, task) in tasks.iter().enumerate() {
        let t = Instant::now();
        let what = format!(
            "[{}/{}] round {}/{}: {}",
            i + 1,
            tasks.len(),
            task.round + 1,
            plan.rounds,
            task.describe()
        );
        match task.run(plan, perf) {
            Ok(samples) => {
                let values: Vec<String> = samples
                    .iter()
                    .map(|s| format!("{} {}", crate::report::fmt_num(s.value), s.metric))
                    .collect();
                eprintln!(
                    "{what}: {} ({:.1} s; {:.0} s in all)",
                    values.join(", "),
                    t.elapsed().as_secs_f64(),
                    started.elapsed().as_secs_f64()
                );
                for s in samples {
                    writeln!(out, "{}", s.to_line())?;
                }
                out.flush()?;
            }
            Err(e) => {
                failed += 1;
                eprintln!("{what}: FAILED: {e:#}");
            }
        }
    }
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_interleave_rdmsg_and_its_anchor() {
        let plan = Plan::quick();
        let tasks = plan.tasks();
        // 2 latency modes × (2 sizes × 2 + 1 layer size × 3), 2 stream sizes × 3,
        // 2 batches × (4 modes + the floor).
        assert_eq!(tasks.len(), 14 + 6 + 10);
        assert!(matches!(
            (tasks[0].what, tasks[1].what),
            (
                What::Latency {
                    who: Who::Rdmsg,
                    size: 8,
                    ..
                },
                What::Latency {
                    who: Who::Perftest,
                    size: 8,
                    ..
                }
            )
        ));
        let full = Plan::full();
        assert_eq!(
            full.tasks().len(),
            5 * (2 * (5 * 2 + 2 * 3) + 4 * 3 + 3 * 5)
        );
        assert!(full.tasks().iter().all(|t| t.round < 5));
    }
}
