//! The device benchmarks, planned as a list of measurements: each round measures rdmsg and its
//! anchor back to back for every point, so that drift of the emulated machine hits both alike.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::asynch;
use crate::fanin::{self, Load, Server};
use crate::large::{self, Path};
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
    /// Ping-pong sizes of the async-vs-blocking comparison.
    pub async_sizes: Vec<usize>,
    /// Payload sizes of the large-message section.
    pub large_sizes: Vec<usize>,
    /// Bytes each large-message run moves, about (see [`large::messages`]).
    pub large_bytes: usize,
    /// The fan-in.
    pub fanin: FaninPlan,
    /// Offered rates of the waiting-policy sweep, messages per second (0: as fast as the
    /// sender can).
    pub sweep_rates: Vec<u32>,
    /// Most messages per sweep point (and at least 100; about a second's worth otherwise).
    pub sweep_max_messages: usize,
    /// Round trips of the cost section's shorter profile (the longer one has three times as
    /// many).
    pub cost_iters: u64,
    /// Rounds that include the cost section (the first ones).
    pub cost_rounds: u32,
    /// Connections timed per round and way of the connect section.
    pub connects: usize,
    /// The collector example's runs.
    pub collector: CollectorPlan,
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
            async_sizes: vec![8, 4096],
            // From the rendezvous threshold up; the goals are on 1 MiB and above.
            large_sizes: vec![16 << 10, 256 << 10, 1 << 20, 16 << 20],
            // Under emulation rxe moves some 50 to 300 MB/s: a round of the four subjects at
            // four sizes (about a GiB) takes a minute or so.
            large_bytes: 64 << 20,
            fanin: FaninPlan::full(),
            cost_iters: 1000,
            cost_rounds: 3,
            connects: 10,
            collector: CollectorPlan::full(),
            sweep_rates: vec![100, 1000, 4000, 16000, 0],
            sweep_max_messages: 4000,
            benches: vec![
                Bench::LatEvent,
                Bench::LatPoll,
                Bench::Bw,
                Bench::Wake,
                Bench::Async,
                Bench::Large,
                Bench::Fanin,
                Bench::Rates,
                Bench::Cost,
                Bench::Connect,
                Bench::Collector,
            ],
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
            large_sizes: vec![16 << 10, 1 << 20],
            large_bytes: 8 << 20,
            cost_iters: 300,
            connects: 5,
            collector: CollectorPlan {
                sensors: vec![256],
                low_credits: None,
                ..CollectorPlan::full()
            },
            sweep_rates: vec![1000, 0],
            sweep_max_messages: 1000,
            fanin: FaninPlan {
                conns: vec![1, 16, 64],
                messages: 16_384,
                groups: vec![1, 2],
                group_conns: 64,
                large_group: None,
                ..FaninPlan::full()
            },
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
                    Bench::Async => {
                        for &size in &self.async_sizes {
                            for asynchronous in [false, true] {
                                tasks.push(Task {
                                    round,
                                    what: What::AsyncLatency { size, asynchronous },
                                });
                            }
                        }
                        for &batch in &self.wake_batches {
                            for asynchronous in [false, true] {
                                tasks.push(Task {
                                    round,
                                    what: What::AsyncReceiver {
                                        batch,
                                        asynchronous,
                                    },
                                });
                            }
                        }
                    }
                    Bench::Large => {
                        for &size in &self.large_sizes {
                            let count = large::messages(size, self.large_bytes);
                            for who in LargeWho::ALL {
                                tasks.push(Task {
                                    round,
                                    what: What::Large { size, count, who },
                                });
                            }
                        }
                    }
                    Bench::Fanin if round < self.fanin.rounds => {
                        for (conns, server) in self.fanin.points() {
                            tasks.push(Task {
                                round,
                                what: What::Fanin { conns, server },
                            });
                        }
                        if let (0, Some((hubs, conns))) = (round, self.fanin.large_group) {
                            tasks.push(Task {
                                round,
                                what: What::Fanin {
                                    conns,
                                    server: Server::Group(hubs),
                                },
                            });
                        }
                    }
                    Bench::Rates => {
                        for &rate in &self.sweep_rates {
                            for mode in crate::rdmsg::SWEEP_MODES {
                                tasks.push(Task {
                                    round,
                                    what: What::Rate { mode, rate },
                                });
                            }
                        }
                    }
                    Bench::Cost if round < self.cost_rounds => {
                        for subject in crate::cost::Subject::ALL {
                            tasks.push(Task {
                                round,
                                what: What::Cost { subject },
                            });
                        }
                    }
                    Bench::Connect => {
                        for way in crate::connect::Way::ALL {
                            tasks.push(Task {
                                round,
                                what: What::Connect { way },
                            });
                        }
                    }
                    // Slow (minutes at 10,000 sensors under emulation): the first round only.
                    Bench::Collector if round == 0 => {
                        for (sensors, min_credits) in self.collector.points() {
                            tasks.push(Task {
                                round,
                                what: What::Collector {
                                    sensors,
                                    min_credits,
                                },
                            });
                        }
                    }
                    Bench::Fanin | Bench::Cost | Bench::Codec | Bench::Collector => {}
                }
            }
        }
        if let Some(f) = &self.filter {
            tasks.retain(|t| t.describe().contains(f.as_str()));
        }
        tasks
    }
}

/// The subject of an async-vs-blocking sample.
fn async_name(asynchronous: bool) -> &'static str {
    if asynchronous {
        "rdmsg-tokio"
    } else {
        "rdmsg"
    }
}

/// How much fan-in to measure: every point runs the hub and the thread-per-connection
/// server one after the other, each with its own client process.
#[derive(Debug, Clone)]
pub struct FaninPlan {
    /// Connection counts.
    pub conns: Vec<usize>,
    /// Messages per measurement, all connections together (whole batches per connection, at
    /// least two).
    pub messages: usize,
    /// Messages per second the client offers, all connections together: the same at every
    /// connection count, so that CPU per message compares like with like.
    pub rate: f64,
    /// Messages per batch (the last solicited).
    pub batch: usize,
    /// Payload bytes.
    pub size: usize,
    /// Rounds with a fan-in (the first ones; at most the plan's rounds).
    pub rounds: u32,
    /// The thread-per-connection server runs up to this many connections (a thread and eight
    /// descriptors each).
    pub threads_up_to: usize,
    /// Hub groups of these many members, at [`FaninPlan::group_conns`] connections, offered
    /// as much as the client can send (their `rate` is what they took).
    pub groups: Vec<usize>,
    /// Connections of the group points.
    pub group_conns: usize,
    /// One more group point, in the first round only: (member hubs, connections). The
    /// scale a single hub's point does not reach (issue 41: 20,000 peers across a group).
    pub large_group: Option<(usize, usize)>,
}

impl FaninPlan {
    /// 1 to 10,000 connections, 32768 messages at 8192/s: four seconds of messages up to
    /// 1024 (8 per connection and second there), two batches per connection beyond; groups
    /// of 1, 2 and 4 hubs at 1024 connections; three rounds, a few minutes each under
    /// emulation.
    pub fn full() -> Self {
        Self {
            conns: vec![1, 16, 256, 1024, 4096, 10_000],
            messages: 32_768,
            rate: 8192.0,
            batch: 8,
            size: 64,
            rounds: 3,
            threads_up_to: 1024,
            groups: vec![1, 2, 4],
            group_conns: 1024,
            large_group: Some((4, 20_000)),
        }
    }

    /// The load of one point.
    pub fn load(&self, conns: usize) -> Load {
        Load::new(conns, self.messages, self.batch, self.size, self.rate)
    }

    /// The load of `server` at `conns` connections: groups are offered as much as the client
    /// can send.
    pub fn load_for(&self, conns: usize, server: Server) -> Load {
        match server {
            Server::Group(_) => Load::new(conns, self.messages, self.batch, self.size, SATURATE),
            _ => self.load(conns),
        }
    }

    /// Every (connections, server) point, in the order they run.
    pub fn points(&self) -> Vec<(usize, Server)> {
        let mut v = Vec::new();
        for &conns in &self.conns {
            v.push((conns, Server::Hub));
            if conns <= self.threads_up_to {
                v.push((conns, Server::Threads));
            }
        }
        v.extend(
            self.groups
                .iter()
                .map(|&hubs| (self.group_conns, Server::Group(hubs))),
        );
        v
    }
}

/// How the collector example runs: at each sensor count with the example's default credits,
/// and at the largest also with fewer, to show what an idle sensor's credits cost against
/// how its batches wait.
#[derive(Debug, Clone)]
pub struct CollectorPlan {
    /// Sensor counts.
    pub sensors: Vec<usize>,
    /// Credits per sensor of every run (`--min-credits`; the example's default, a batch).
    pub min_credits: u32,
    /// Credits per sensor of one more run at the largest count, if any.
    pub low_credits: Option<u32>,
    /// Batches each sensor sends (`--batches`): the figures are about connecting and idling
    /// many sensors, and two batches are enough traffic for CPU and wake-ups per message.
    pub batches: u32,
    /// Longest one run may take before it is killed.
    pub timeout: Duration,
}

impl CollectorPlan {
    /// 1,000, 5,000 and 10,000 sensors at 8 credits each (the example's default), and 10,000
    /// at 1 (the hub's default).
    pub fn full() -> Self {
        Self {
            sensors: vec![1000, 5000, 10_000],
            min_credits: 8,
            low_credits: Some(1),
            batches: 2,
            timeout: Duration::from_secs(15 * 60),
        }
    }

    /// Every (sensors, min credits) run, in the order they run.
    pub fn points(&self) -> Vec<(usize, u32)> {
        let mut v: Vec<(usize, u32)> = self
            .sensors
            .iter()
            .map(|&n| (n, self.min_credits))
            .collect();
        if let (Some(low), Some(&largest)) = (self.low_credits, self.sensors.iter().max()) {
            if low != self.min_credits {
                v.push((largest, low));
            }
        }
        v
    }
}

/// The offered rate of a saturating fan-in: more than any client sends (it never waits).
pub const SATURATE: f64 = 1e9;

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

/// Who is measured in the large-message section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LargeWho {
    /// `ib_read_bw`: the bytes moved by RDMA read, as rendezvous moves them.
    IbReadBw,
    /// `ib_send_bw`: the bytes moved by send, as fragments are.
    IbSendBw,
    /// rdmsg, large messages sent by this path.
    Rdmsg(Path),
}

impl LargeWho {
    /// All, in the order each round measures them.
    pub const ALL: [LargeWho; 4] = [
        LargeWho::IbReadBw,
        LargeWho::IbSendBw,
        LargeWho::Rdmsg(Path::Rendezvous),
        LargeWho::Rdmsg(Path::Fragmentation),
    ];

    /// `(subject, variant)` of its samples.
    pub fn names(self) -> (&'static str, &'static str) {
        match self {
            LargeWho::IbReadBw => ("ib_read_bw", ""),
            LargeWho::IbSendBw => ("ib_send_bw", ""),
            LargeWho::Rdmsg(path) => ("rdmsg", path.name()),
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
    /// The ping-pong, blocking sessions or async ones (rdmsg-tokio).
    AsyncLatency {
        /// Payload bytes.
        size: usize,
        /// On tokio (else the blocking API).
        asynchronous: bool,
    },
    /// The low-rate solicited-only receiver, blocking or async.
    AsyncReceiver {
        /// Messages per batch.
        batch: usize,
        /// On tokio (else the blocking API).
        asynchronous: bool,
    },
    /// Many connections into one server.
    Fanin {
        /// Connections.
        conns: usize,
        /// Who serves them.
        server: Server,
    },
    /// A receiver waiting by one policy at an offered rate.
    Rate {
        /// How it waits.
        mode: RecvMode,
        /// Messages per second offered (0: as fast as the sender can).
        rate: u32,
    },
    /// Instructions, syscalls and allocations per round trip of one layer (callgrind).
    Cost {
        /// The layer.
        subject: crate::cost::Subject,
    },
    /// Connect time and killed-peer notice of one way of connecting.
    Connect {
        /// TCP bootstrap or rdma_cm.
        way: crate::connect::Way,
    },
    /// The collector example at a number of sensors.
    Collector {
        /// Sensors.
        sensors: usize,
        /// Credits each sensor keeps however idle.
        min_credits: u32,
    },
    /// A one-way stream of large messages.
    Large {
        /// Payload bytes.
        size: usize,
        /// Messages (perftest's iterations).
        count: usize,
        /// Who.
        who: LargeWho,
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
            What::AsyncLatency { size, asynchronous } => {
                format!("async latency {size} B, {}", async_name(asynchronous))
            }
            What::AsyncReceiver {
                batch,
                asynchronous,
            } => format!("async receiver batch {batch}, {}", async_name(asynchronous)),
            What::Fanin { conns, server } => {
                format!("fanin {conns} connections, {}", server.name())
            }
            What::Cost { subject } => format!("cost {}", subject.name()),
            What::Connect { way } => format!("connect {}", way.name()),
            What::Collector {
                sensors,
                min_credits,
            } => format!("collector {sensors} sensors, min credits {min_credits}"),
            What::Rate { mode, rate } => match rate {
                0 => format!("rate saturation, {}", mode.name()),
                r => format!("rate {r}/s, {}", mode.name()),
            },
            What::Large { size, count, who } => {
                let (subject, variant) = who.names();
                format!(
                    "large {count} × {}, {subject}{}{variant}",
                    crate::report::fmt_size(size as u64),
                    if variant.is_empty() { "" } else { " " }
                )
            }
        }
    }

    /// Samples that record this task's failure in the report (the fan-in's and the
    /// collector's: a server that cannot take its connections is a result), or none.
    pub fn failure_samples(&self, error: &anyhow::Error) -> Vec<Sample> {
        match self.what {
            What::Collector {
                sensors,
                min_credits,
            } => {
                // What the run measured before it failed, then the failure.
                let mut v = error
                    .downcast_ref::<crate::collector::Failed>()
                    .map(|f| f.samples.clone())
                    .unwrap_or_default();
                v.push(collector_sample(
                    self.round,
                    sensors,
                    min_credits,
                    "failed",
                    1.0,
                    format!("{error:#}"),
                ));
                v
            }
            What::Fanin { conns, server } => vec![fanin_sample(
                self.round,
                conns,
                server,
                "failed",
                1.0,
                format!("{error:#}"),
            )],
            _ => Vec::new(),
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
                conns: 0,
                note: String::new(),
                top: Vec::new(),
                rate: 0,
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
                            crate::sibling_program("rc_pingpong")?
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
                    Who::Rdmsg => {
                        // One message per send, then the same batches packed.
                        let mut samples = Vec::new();
                        for (variant, packed) in [("", false), ("packed", true)] {
                            let got = rdmsg::throughput(Stream {
                                size,
                                count,
                                batch: plan.bw_batch,
                                packed,
                                recv_depth: plan.bw_depth,
                            })?;
                            samples.push(sample(
                                Bench::Bw,
                                "rdmsg",
                                variant,
                                size,
                                0,
                                "mpps",
                                got.mpps,
                            ));
                            samples.push(sample(
                                Bench::Bw,
                                "rdmsg",
                                variant,
                                size,
                                0,
                                "buffers_per_msg",
                                got.buffers_per_message,
                            ));
                        }
                        return Ok(samples);
                    }
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
            What::AsyncLatency { size, asynchronous } => {
                let us = if asynchronous {
                    asynch::latency(size, plan.lat_iters)?
                } else {
                    rdmsg::latency(size, plan.lat_iters, true)?
                };
                vec![sample(
                    Bench::Async,
                    async_name(asynchronous),
                    "latency",
                    size,
                    0,
                    "us",
                    us,
                )]
            }
            What::AsyncReceiver {
                batch,
                asynchronous,
            } => {
                let count = plan.wake_batch_count * batch;
                let w = if asynchronous {
                    asynch::receiver(batch, count, plan.wake_gap)?
                } else {
                    rdmsg::wakeups(RecvMode::Solicited, batch, count, plan.wake_gap)?
                };
                let subject = async_name(asynchronous);
                vec![
                    sample(
                        Bench::Async,
                        subject,
                        "receiver",
                        64,
                        batch as u32,
                        "cpu_us_per_msg",
                        w.cpu_us_per_message,
                    ),
                    sample(
                        Bench::Async,
                        subject,
                        "receiver",
                        64,
                        batch as u32,
                        "wakeups_per_msg",
                        w.per_message,
                    ),
                ]
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
            What::Fanin { conns, server } => {
                let m = fanin::measure(server, &plan.fanin.load_for(conns, server))?;
                fanin_samples(self.round, conns, server, &m)
            }
            What::Large { size, count, who } => {
                let (subject, variant) = who.names();
                let large = |metric: &str, value| {
                    sample(Bench::Large, subject, variant, size, 0, metric, value)
                };
                match who {
                    LargeWho::IbReadBw | LargeWho::IbSendBw => {
                        let args =
                            ["-s", &size.to_string(), "-n", &count.to_string()].map(String::from);
                        let out = perf.run(subject, &args)?;
                        // The figure of the side the bytes land on, as rdmsg's is its
                        // receiver's: `ib_read_bw`'s reading client, `ib_send_bw`'s server.
                        let landed = if who == LargeWho::IbReadBw {
                            &out.client
                        } else {
                            &out.server
                        };
                        vec![large("mib_per_s", perftest::parse_bw_average_mib(landed)?)]
                    }
                    LargeWho::Rdmsg(path) => {
                        let m = large::stream(path, size, count)?;
                        vec![
                            large("mib_per_s", m.mib_per_s),
                            large("cpu_us_per_mib", m.cpu_us_per_mib),
                            large("cpu_all_us_per_mib", m.cpu_all_us_per_mib),
                        ]
                    }
                }
            }
            What::Rate { mode, rate } => {
                let count = if rate == 0 {
                    plan.sweep_max_messages
                } else {
                    (rate as usize).clamp(100, plan.sweep_max_messages)
                };
                let offered = (rate > 0).then_some(f64::from(rate));
                let r = rdmsg::at_rate(mode, offered, count)?;
                [
                    ("us", r.latency_us),
                    ("cpu_us_per_msg", r.cpu_us_per_message),
                    ("rate", r.rate),
                ]
                .into_iter()
                .map(|(metric, value)| Sample {
                    rate,
                    ..sample(Bench::Rates, "rdmsg", mode.name(), 64, 0, metric, value)
                })
                .collect()
            }
            What::Connect { way } => {
                let f = crate::connect::measure(way, plan.connects)?;
                vec![
                    sample(
                        Bench::Connect,
                        way.name(),
                        "",
                        0,
                        0,
                        "connect_ms",
                        f.connect_ms,
                    ),
                    sample(
                        Bench::Connect,
                        way.name(),
                        "",
                        0,
                        0,
                        "killed_notice_ms",
                        f.killed_notice_ms,
                    ),
                ]
            }
            What::Collector {
                sensors,
                min_credits,
            } => {
                let c = &plan.collector;
                let out = crate::collector::run(sensors, min_credits, c.batches, c.timeout)?;
                let samples: Vec<Sample> = out
                    .figures
                    .iter()
                    .flat_map(|f| f.metrics(sensors))
                    .map(|(metric, value)| {
                        collector_sample(
                            self.round,
                            sensors,
                            min_credits,
                            metric,
                            value,
                            String::new(),
                        )
                    })
                    .collect();
                if let Some(reason) = out.failure {
                    return Err(crate::collector::Failed { reason, samples }.into());
                }
                samples
            }
            What::Cost { subject } => {
                let c = crate::cost::measure(
                    subject,
                    plan.cost_iters,
                    perf,
                    &crate::cost::scratch_dir(),
                )?;
                let per_rt = c.per_rt;
                let mut v: Vec<Sample> = [
                    ("instructions", per_rt.instructions),
                    ("syscalls", per_rt.syscalls),
                    ("allocations", per_rt.allocations),
                    ("clock_reads", per_rt.clock_reads),
                ]
                .into_iter()
                .chain(c.wakeups.map(|w| ("wakeups", w)))
                .map(|(metric, value)| sample(Bench::Cost, subject.name(), "", 0, 0, metric, value))
                .collect();
                v[0].top = per_rt.top;
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

/// A fan-in sample.
fn fanin_sample(
    round: u32,
    conns: usize,
    server: Server,
    metric: &str,
    value: f64,
    note: String,
) -> Sample {
    Sample {
        bench: Bench::Fanin,
        subject: server.name().into(),
        variant: String::new(),
        size: 0,
        batch: 0,
        round,
        metric: metric.into(),
        value,
        conns: conns as u32,
        note,
        top: Vec::new(),
        rate: 0,
    }
}

/// A sample of the collector example: its sensors as `conns`, its credits as the variant.
fn collector_sample(
    round: u32,
    sensors: usize,
    min_credits: u32,
    metric: &str,
    value: f64,
    note: String,
) -> Sample {
    Sample {
        bench: Bench::Collector,
        subject: crate::collector::PROGRAM.into(),
        variant: format!("min_credits={min_credits}"),
        size: 0,
        batch: 0,
        round,
        metric: metric.into(),
        value,
        conns: u32::try_from(sensors).unwrap_or(u32::MAX),
        note,
        top: Vec::new(),
        rate: 0,
    }
}

/// The samples of one fan-in measurement (metric names as the report reads them).
fn fanin_samples(round: u32, conns: usize, server: Server, m: &fanin::Measured) -> Vec<Sample> {
    let mut figures = vec![
        ("cpu_us_per_msg", m.cpu_us_per_msg),
        ("system_share", m.system_share),
        ("wakeups_per_msg", m.wakeups_per_msg),
        ("wakeups_per_solicited", m.wakeups_per_solicited),
        ("other_wakeups_per_msg", m.other_wakeups_per_msg),
        ("grants_per_msg", m.grants_per_msg),
        ("credit_waits_per_msg", m.credit_waits_per_msg),
        ("client_lag_s", m.client_lag_secs),
        ("solicited", m.solicited as f64),
        ("forced_solicited", m.forced_solicited as f64),
        ("fds_per_conn", m.fds_per_conn),
        ("registered_kib_per_conn", m.registered_kib_per_conn),
        ("pinned_kib_per_conn", m.pinned_kib_per_conn),
        ("rss_kib_per_conn", m.rss_kib_per_conn),
        ("threads", m.threads as f64),
        ("rate", m.rate),
        ("connect_s", m.connect_secs),
        ("messages", m.messages as f64),
        ("offered_rate", m.offered_rate),
        ("fair_window_s", m.fair_window_secs),
    ];
    if m.recv_groups > 0 {
        figures.push(("recv_groups", f64::from(m.recv_groups)));
    }
    if let Some(asleep) = m.asleep {
        figures.push(("asleep", asleep));
    }
    if let Some(rnr) = m.rnr {
        figures.push(("rnr", rnr as f64));
    }
    if let Some(f) = m.fairness {
        figures.push(("fair_max", f.max as f64));
        figures.push(("fair_min", f.min as f64));
        figures.push(("fair_mean", f.mean));
        figures.push(("fair_windows", f.windows as f64));
    }
    figures
        .into_iter()
        .map(|(metric, value)| fanin_sample(round, conns, server, metric, value, String::new()))
        .collect()
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
                for s in task.failure_samples(&e) {
                    writeln!(out, "{}", s.to_line())?;
                }
                out.flush()?;
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
        // 2 batches × (4 modes + the floor), async: (2 sizes + 2 batches) × 2, large: 2 sizes
        // × 4 subjects, 3 fan-in points × 2 servers and 2 groups, 2 sweep rates × 4
        // receivers, 8 cost subjects, 2 ways of connecting, one collector run.
        assert_eq!(tasks.len(), 14 + 6 + 10 + 8 + 8 + 8 + 8 + 8 + 2 + 1);
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
            5 * (2 * (5 * 2 + 2 * 3) + 4 * 3 + 3 * 5 + (2 + 3) * 2 + 4 * 4 + 5 * 4 + 2)
                + 3 * (6 + 4 + 3)
                + 1
                + 3 * 8
                + 4
        );
        assert!(full.tasks().iter().all(|t| t.round < 5));
    }

    #[test]
    fn large_messages_run_perftest_and_both_paths_side_by_side_with_the_same_counts() {
        let plan = Plan {
            benches: vec![Bench::Large],
            rounds: 2,
            ..Plan::full()
        };
        let tasks = plan.tasks();
        assert_eq!(tasks.len(), 2 * 4 * 4);
        let points: Vec<(u32, usize, usize, LargeWho)> = tasks
            .iter()
            .map(|t| match t.what {
                What::Large { size, count, who } => (t.round, size, count, who),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            &points[..4],
            &[
                (0, 16 << 10, 2000, LargeWho::IbReadBw),
                (0, 16 << 10, 2000, LargeWho::IbSendBw),
                (0, 16 << 10, 2000, LargeWho::Rdmsg(Path::Rendezvous)),
                (0, 16 << 10, 2000, LargeWho::Rdmsg(Path::Fragmentation)),
            ]
        );
        let counts: Vec<(usize, usize)> = points[..16].iter().map(|p| (p.1, p.2)).collect();
        assert_eq!(
            counts.iter().step_by(4).copied().collect::<Vec<_>>(),
            [
                (16 << 10, 2000),
                (256 << 10, 256),
                (1 << 20, 64),
                (16 << 20, 8)
            ]
        );
        assert_eq!(points[16].0, 1, "the next round measures every size again");
        assert_eq!(tasks[0].describe(), "large 2000 × 16 KiB, ib_read_bw");
        assert_eq!(
            tasks[15].describe(),
            "large 8 × 16 MiB, rdmsg fragmentation"
        );
        let only_rendezvous = Plan {
            filter: Some("rdmsg rendezvous".into()),
            ..plan
        };
        assert_eq!(only_rendezvous.tasks().len(), 2 * 4);
    }

    #[test]
    fn the_fanin_runs_hub_and_threads_side_by_side_in_its_rounds() {
        let plan = Plan {
            benches: vec![Bench::Fanin],
            rounds: 3,
            fanin: FaninPlan {
                rounds: 2,
                ..FaninPlan::full()
            },
            ..Plan::full()
        };
        let tasks = plan.tasks();
        let points: Vec<(u32, usize, Server)> = tasks
            .iter()
            .map(|t| match t.what {
                What::Fanin { conns, server } => (t.round, conns, server),
                other => panic!("{other:?}"),
            })
            .collect();
        // Hub at six N, threads at four, three groups: per round; the large group once.
        assert_eq!(points.len(), 2 * (6 + 4 + 3) + 1, "fan-in rounds only");
        assert_eq!(points[13], (0, 20_000, Server::Group(4)));
        assert_eq!(
            &points[..4],
            &[
                (0, 1, Server::Hub),
                (0, 1, Server::Threads),
                (0, 16, Server::Hub),
                (0, 16, Server::Threads)
            ]
        );
        assert_eq!(tasks[7].describe(), "fanin 1024 connections, threads");
        assert_eq!(
            &points[8..13],
            &[
                (0, 4096, Server::Hub),
                (0, 10_000, Server::Hub),
                (0, 1024, Server::Group(1)),
                (0, 1024, Server::Group(2)),
                (0, 1024, Server::Group(4)),
            ]
        );
        let load = plan.fanin.load(1024);
        assert_eq!((load.per_conn, load.messages()), (32, 32_768));
        assert_eq!(plan.fanin.load(1).per_conn, 32_768);
        assert_eq!(plan.fanin.load(10_000).per_conn, 16, "two batches at least");
        assert_eq!(
            plan.fanin.load_for(1024, Server::Group(2)).rate,
            SATURATE,
            "groups take what the client can send"
        );
        for server in [Server::Hub, Server::Threads, Server::Group(4)] {
            assert_eq!(Server::parse(server.name()), Some(server));
        }
        let failed = tasks[7].failure_samples(&anyhow::anyhow!("out of threads"));
        assert_eq!(failed.len(), 1);
        assert_eq!(
            (
                failed[0].conns,
                failed[0].subject.as_str(),
                failed[0].metric.as_str()
            ),
            (1024, "threads", "failed")
        );
        assert_eq!(failed[0].note, "out of threads");
    }

    #[test]
    fn the_collector_runs_each_count_once_and_the_largest_also_with_one_credit() {
        let plan = Plan {
            benches: vec![Bench::Collector],
            rounds: 3,
            ..Plan::full()
        };
        let tasks = plan.tasks();
        let points: Vec<(u32, usize, u32)> = tasks
            .iter()
            .map(|t| match t.what {
                What::Collector {
                    sensors,
                    min_credits,
                } => (t.round, sensors, min_credits),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            points,
            [(0, 1000, 8), (0, 5000, 8), (0, 10_000, 8), (0, 10_000, 1)],
            "round 0 only"
        );
        assert_eq!(
            tasks[3].describe(),
            "collector 10000 sensors, min credits 1"
        );
        assert_eq!(Plan::quick().collector.points(), [(256, 8)]);
        let failed = tasks[3].failure_samples(
            &crate::collector::Failed {
                reason: "2 messages lost".into(),
                samples: vec![collector_sample(0, 10_000, 1, "lost", 2.0, String::new())],
            }
            .into(),
        );
        let got: Vec<(&str, &str, u32, f64, &str)> = failed
            .iter()
            .map(|s| {
                (
                    s.metric.as_str(),
                    s.variant.as_str(),
                    s.conns,
                    s.value,
                    s.note.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("lost", "min_credits=1", 10_000, 2.0, ""),
                ("failed", "min_credits=1", 10_000, 1.0, "2 messages lost")
            ],
            "the figures, then the failure"
        );
        let plain = tasks[0].failure_samples(&anyhow::anyhow!("collector not found"));
        assert_eq!(plain.len(), 1);
        assert_eq!(plain[0].note, "collector not found");
    }
}
