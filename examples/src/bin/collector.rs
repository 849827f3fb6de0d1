//! Many sensors, one collector thread. Each sensor sends telemetry in batches (only the last
//! sample of a batch is solicited, so a batch costs the collector at most one wake-up) and an
//! occasional alarm (solicited); one [`Hub`] on one thread serves every sensor.
//!
//! With no role, the collector listens on 127.0.0.1, starts a second process that runs the
//! sensors (this binary again, role `sensors`: one thread, one hub, one connection per
//! sensor), checks every message it gets (sensor, per-sensor sequence, content) and ends with
//! one line:
//!
//! ```text
//! collector: connections=1024 server_threads=1 fds=1037 registered_kib=10752 messages=34816 lost=0 wakeups=...
//! ```
//!
//! By default 1024 sensors each send 4 batches of 8 samples, an alarm after every 4th batch
//! (counting from a different batch for each sensor), and a final `Done` saying how many
//! messages they sent: 34 messages a sensor, 34816 in all.
//!
//! `connections`, `server_threads` (entries of `/proc/self/task`), `fds` (of `/proc/self/fd`)
//! and `registered_kib` (the hub's receive and send buffers) are measured in the collector
//! while every sensor is connected (the collector then tells each to start); `messages` is
//! what it received, `lost` what the sensors that finished say they sent minus what arrived
//! from them, `wakeups` the hub's wake-ups. A sensor connection that fails (its handshake, or
//! the connection ending without a graceful close before its `Done`) is reported and
//! counted, and the other sensors go on: `finished` sensors, `failed` connections and, last on
//! the line, `failures` (each reason with its count, `none` if none). The exit code is
//! non-zero on any loss, disorder, failed connection or error.
//!
//! Other keys: `samples`, `alarms`, `batches` (the sensors' count), `fds_per_conn`,
//! `registered_kib_per_conn`, `recv_buffers` and `spare_buffers` (the hub's receive pool, and
//! what of it backs no connection, while all are connected), `forced_solicited` (messages the
//! sensors' transport solicited because they spent the collector's last credit: each may cost
//! a wake-up the batching was meant to save), `msgs_per_wakeup`, `spurious_wakeups`, `rnr`
//! (receiver-not-ready NAKs the device counted during the run: always 0), `errors`,
//! `connect_ms` (until every sensor was connected), `elapsed_ms`, `traffic_ms` (from `Start` to
//! the last sensor's end), `cpu_us_per_msg` (the collector's CPU time over the traffic, per
//! message), `wakeups_per_msg`, `probes` (liveness probes the collector's hub sent: one per
//! silent sensor host and third of `keepalive`, not one per connection), and where connect
//! time went, per connection: `connect_cpu_us_per_conn` (the collector's CPU time until every
//! sensor was connected), `hs_wall_us` (a handshake's start to its connection, waits
//! included), and the hub's own work in it: `admission_us` (receive buffers set aside, and
//! registered in batches as the pool grows), `qp_create_us` (queue pair created and in INIT),
//! `rtr_rts_us` (moved to RTR and RTS), `hello_us` (hellos read, checked and written). The
//! sensors' line has the same for their hub.
//!
//! ```text
//! collector [--sensors N] [--batches B] [--batch K] [--alarm-every A] [HUB]
//! collector serve --listen ADDR --sensors N [HUB]
//! collector sensors --connect ADDR [--count N] [--first S] [--batches B] [--batch K] [--alarm-every A]
//! ```
//!
//! `HUB` is `--min-credits C` and `--shared-credits S`, for the collector's [`HubConfig`]
//! (defaults 8, a default batch, so that a sensor's batch goes without waiting for credits,
//! and `HubConfig::default()`'s; `--help` shows them). With the hub's own default of one
//! credit, an idle sensor holds 2 KiB rather than 16, but each sample of a batch waits for
//! the credit of the one before. `--count` and
//! `--sensors` are one option, in every role. `--help` (or `-h`) describes each role's
//! options (`collector serve --help`, ...).
//!
//! A hub keeps one descriptor per connection (its bootstrap TCP stream), so 1024 sensors do
//! not fit the usual soft limit of 1024 descriptors: each process raises its soft limit
//! (`rdmsg::verbs::raise_fd_limit`) when its hard limit allows.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use clap::builder::RangedU64ValueParser;
use clap::{Args, Parser, Subcommand};
use rdmsg::transport::ConnectTimes;
use rdmsg::{message, Endpoint, Failure, Hub, HubConfig, HubEvent, PeerId};
use rdmsg_examples::peers::{count_dir, field, process_cpu_ms, PeerProcess};
use serde::{Deserialize, Serialize};
use socket2::{Domain, Protocol, Socket, Type};

/// A reading: telemetry, sent in batches whose last sample alone wakes the collector.
#[derive(Debug, Serialize, Deserialize)]
struct Sample {
    sensor: u32,
    /// Per sensor, counting samples and alarms.
    seq: u64,
    value: f64,
}
message!(
    Sample,
    tag = "rdmsg.example.collector.Sample",
    solicited = false
);

/// An alarm: wakes the collector at once.
#[derive(Debug, Serialize, Deserialize)]
struct Alarm {
    sensor: u32,
    seq: u64,
    reason: String,
}
message!(Alarm, tag = "rdmsg.example.collector.Alarm");

/// A sensor's last message: how many samples and alarms it sent.
#[derive(Debug, Serialize, Deserialize)]
struct Done {
    sensor: u32,
    sent: u64,
}
message!(Done, tag = "rdmsg.example.collector.Done");

/// From the collector once every sensor is connected: go.
#[derive(Debug, Serialize, Deserialize)]
struct Start {
    sensors: u32,
}
message!(Start, tag = "rdmsg.example.collector.Start");

/// The value sensor `sensor` reads as its `seq`-th message (exact in an `f64`).
fn value_of(sensor: u32, seq: u64) -> f64 {
    f64::from(sensor) * 1e6 + seq as f64 * 0.5
}

fn reason_of(sensor: u32, seq: u64) -> String {
    format!("sensor {sensor}: reading {seq} over threshold")
}

/// Whether sensor `sensor` raises an alarm after its batch `batch`.
fn alarm_due(sensor: u32, batch: u64, every: u64) -> bool {
    (u64::from(sensor) + batch) % every == 0
}

/// Longest the collector waits for anything to happen (a handshake costs a few ms, under
/// emulation tens).
const IDLE: Duration = Duration::from_secs(120);

/// Many sensors, one collector thread: one hub serves every sensor and checks every message
/// it gets; the collector ends with one `collector: key=value ...` line, and a non-zero exit
/// code on any loss, disorder or error.
///
/// With no role, the collector listens on 127.0.0.1 and runs the sensors in a second process
/// (this program again, role `sensors`). By default 1024 sensors each send 4 batches of 8
/// samples (the last of a batch solicited), an alarm after every 4th batch and a final `Done`.
#[derive(Debug, Parser)]
#[command(
    name = "collector",
    args_override_self = true,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// How many sensors (one connection each)
    #[arg(long, visible_alias = "count", value_name = "N", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    sensors: u32,
    #[command(flatten)]
    work: Workload,
    #[command(flatten)]
    hub: HubArgs,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// The collector alone: prints `listening ADDR`, serves the sensors that connect there
    /// and ends with its line once they have all gone.
    Serve {
        /// Where to listen (port 0: any free port)
        #[arg(long, value_name = "ADDR")]
        listen: String,
        /// How many sensors to wait for
        #[arg(long, visible_alias = "count", value_name = "N", default_value_t = 1024,
              value_parser = clap::value_parser!(u32).range(1..))]
        sensors: u32,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Sensors FIRST..FIRST+N, one connection each, on one thread's hub, sending to the
    /// collector at ADDR once it says start; ends with one `sensors: key=value ...` line.
    Sensors {
        /// The collector's address
        #[arg(long, value_name = "ADDR")]
        connect: String,
        /// How many sensors
        #[arg(long, visible_alias = "sensors", value_name = "N", default_value_t = 1024,
              value_parser = clap::value_parser!(u32).range(1..))]
        count: u32,
        /// The first sensor's number
        #[arg(long, value_name = "S", default_value_t = 0)]
        first: u32,
        #[command(flatten)]
        work: Workload,
    },
}

/// What each sensor sends.
#[derive(Debug, Clone, Args)]
struct Workload {
    /// Batches of samples each sensor sends
    #[arg(long, value_name = "B", default_value_t = 4)]
    batches: u64,
    /// Samples per batch (the last one solicited)
    #[arg(long, value_name = "K", default_value_t = 8,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    batch: usize,
    /// An alarm after every A-th batch (counting from a different batch for each sensor)
    #[arg(long, value_name = "A", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..))]
    alarm_every: u64,
}

impl Workload {
    fn args(&self) -> Vec<String> {
        vec![
            "--batches".into(),
            self.batches.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--alarm-every".into(),
            self.alarm_every.to_string(),
        ]
    }
}

/// Credits a sensor keeps however idle: a default batch, which then never waits.
const MIN_CREDITS: u32 = 8;

/// The collector's hub: `HubConfig::default()` but for these (and `max_connections`, the
/// number of sensors).
#[derive(Debug, Clone, Args)]
struct HubArgs {
    /// Credits every connection keeps however idle (HubConfig::min_credits): a default batch
    #[arg(long, value_name = "C", default_value_t = MIN_CREDITS)]
    min_credits: u32,
    /// Receive buffers kept spare beyond every connection's minimum (HubConfig::shared_credits)
    #[arg(long, value_name = "S", default_value_t = HubConfig::default().shared_credits)]
    shared_credits: u32,
}

impl HubArgs {
    fn config(&self, sensors: u32) -> HubConfig {
        HubConfig {
            min_credits: self.min_credits,
            shared_credits: self.shared_credits,
            max_connections: sensors,
            ..HubConfig::default()
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rdmsg_examples::run(|| match cli.role {
        None => both(cli.sensors, &cli.work, cli.hub.config(cli.sensors)),
        Some(Role::Serve {
            listen,
            sensors,
            hub,
        }) => {
            let report = collect(&listen, sensors, hub.config(sensors), None)?;
            report.finish(None)
        }
        Some(Role::Sensors {
            connect,
            count,
            first,
            work,
        }) => run_sensors(&connect, count, first, &work),
    })
}

// ----- the collector -----

/// The collector and, in a child process, the sensors.
fn both(sensors: u32, work: &Workload, hub: HubConfig) -> Result<()> {
    let exe = std::env::current_exe().context("locating this program")?;
    let mut command = Command::new(exe);
    command
        .args(["sensors", "--count", &sensors.to_string()])
        .args(work.args())
        .stdout(Stdio::piped());
    let mut process = PeerProcess::new(command, "sensors");
    let report = collect("127.0.0.1:0", sensors, hub, Some(&mut process));
    let Some(reaped) = process.reap("collector") else {
        return report.map(|_| ()); // failed before starting it
    };
    let report = report?;
    let (status, line) = match reaped {
        Ok(r) => r,
        Err(e) => {
            let _ = report.finish(None);
            return Err(e);
        }
    };
    if let Some(line) = &line {
        eprintln!("collector: the sensors process reported: {line}");
    }
    // The line first, whatever the sensors process says: it has the collector's view.
    let checked = report.finish(line.as_deref());
    ensure!(status.success(), "the sensors process failed: {status}");
    ensure!(line.is_some(), "the sensors process printed no report");
    checked
}

/// What one sensor delivered, as the collector sees it.
#[derive(Debug, Default)]
struct Track {
    peer: Option<PeerId>,
    next_seq: u64,
    done: Option<u64>,
    /// Messages that arrived from it (its `Done` included).
    received: u64,
}

/// Connections that failed, counted by why (the failure's text).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Failures(BTreeMap<String, u64>);

impl Failures {
    fn add(&mut self, why: impl ToString) {
        *self.0.entry(why.to_string()).or_default() += 1;
    }

    fn count(&self) -> u64 {
        self.0.values().sum()
    }

    /// `"WHY xN; ..."`, or `none`: how many failed and why, for a report line.
    fn describe(&self) -> String {
        if self.0.is_empty() {
            return "none".into();
        }
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(why, n)| format!("{why} x{n}"))
            .collect();
        format!("\"{}\"", parts.join("; "))
    }
}

/// Measured while every sensor is connected.
#[derive(Debug, Default)]
struct Snapshot {
    connections: usize,
    threads: usize,
    fds: usize,
    registered_kib: u64,
    recv_buffers: usize,
    spare_buffers: u32,
}

#[derive(Debug, Default)]
struct Report {
    sensors: u32,
    snapshot: Snapshot,
    messages: u64,
    samples: u64,
    alarms: u64,
    done: u64,
    /// Σ over sensors of what their `Done` said they sent (+1 for the `Done`).
    done_sent: u64,
    /// Messages that arrived from the sensors whose `Done` arrived.
    from_finished: u64,
    /// Sensor connections that failed before their `Done` arrived (a handshake, or a
    /// connection that ended without a graceful close), by why.
    failed: Failures,
    wakeups: u64,
    spurious: u64,
    connect_ms: u128,
    elapsed_ms: u128,
    /// From `Start` to the last sensor's end.
    traffic_ms: u128,
    /// The collector's CPU time over the traffic (user and system, 10 ms ticks).
    traffic_cpu_ms: Option<u64>,
    /// Liveness probes the collector's hub sent (one per silent sensor host and interval).
    probes: u64,
    /// The collector's CPU time until every sensor was connected.
    connect_cpu_ms: Option<u64>,
    /// Where the collector's hub spent its connect time, when every sensor was connected.
    connect_times: Option<ConnectTimes>,
    rnr: Option<u64>,
    errors: u64,
}

impl Report {
    /// Prints the line (with what the sensors process reported, if it ran here); an error if
    /// anything was lost, out of order or wrong.
    fn finish(self, sensors_line: Option<&str>) -> Result<()> {
        let (line, verdict) = self.summary(sensors_line)?;
        println!("{line}");
        verdict
    }

    /// The report line, and whether the run passed (an error: the sensors' line is not one).
    /// Losses are counted over the sensors that finished (their `Done` arrived): what a failed
    /// connection had sent may or may not have arrived, and is counted as failed, not lost.
    fn summary(&self, sensors_line: Option<&str>) -> Result<(String, Result<()>)> {
        let sent = match sensors_line {
            Some(line) => {
                let v = field(line, "sent").context("the sensors' report has no sent=")?;
                if v != self.done_sent {
                    eprintln!(
                        "collector: the sensors report {v} messages sent, their Done messages {}",
                        self.done_sent
                    );
                }
                v
            }
            None => self.done_sent,
        };
        let lost = sent as i64 - self.from_finished as i64;
        // Batches, and the messages the transport solicited because they spent the last
        // credit, are the sensors' to count (the collector sees samples, not batch ends).
        let theirs = |key: &str| {
            sensors_line
                .and_then(|l| field(l, key))
                .map_or("n/a".into(), |n| n.to_string())
        };
        let (batches, forced) = (theirs("batches"), theirs("forced_solicited"));
        let s = &self.snapshot;
        let conns = s.connections.max(1) as f64;
        let mut errors = self.errors;
        let failed = self.failed.count();
        if u64::from(self.sensors) != self.done + failed {
            eprintln!(
                "collector: {} of {} sensors finished, {failed} failed",
                self.done, self.sensors
            );
            errors += 1;
        }
        let line = format!(
            "collector: connections={} server_threads={} fds={} registered_kib={} messages={} lost={lost} wakeups={} \
             samples={} alarms={} batches={batches} fds_per_conn={:.2} registered_kib_per_conn={:.1} recv_buffers={} \
             spare_buffers={} forced_solicited={forced} msgs_per_wakeup={:.1} spurious_wakeups={} rnr={} errors={errors} connect_ms={} elapsed_ms={} \
             traffic_ms={} cpu_us_per_msg={} wakeups_per_msg={:.3} probes={} connect_cpu_us_per_conn={} {} finished={} failed={failed} \
             failures={}",
            s.connections,
            s.threads,
            s.fds,
            s.registered_kib,
            self.messages,
            self.wakeups,
            self.samples,
            self.alarms,
            s.fds as f64 / conns,
            s.registered_kib as f64 / conns,
            s.recv_buffers,
            s.spare_buffers,
            self.messages as f64 / self.wakeups.max(1) as f64,
            self.spurious,
            self.rnr.map_or("n/a".into(), |n| n.to_string()),
            self.connect_ms,
            self.elapsed_ms,
            self.traffic_ms,
            self.traffic_cpu_ms.map_or("n/a".into(), |ms| format!(
                "{:.1}",
                ms as f64 * 1000.0 / self.messages.max(1) as f64
            )),
            self.wakeups as f64 / self.messages.max(1) as f64,
            self.probes,
            us_per_conn(self.connect_cpu_ms, conns),
            connect_breakdown(self.connect_times.as_ref()),
            self.done,
            self.failed.describe(),
        );
        let verdict = (|| {
            ensure!(lost == 0, "{lost} messages lost");
            ensure!(
                failed == 0,
                "{failed} sensor connections failed: {}",
                self.failed.describe()
            );
            ensure!(errors == 0, "{errors} errors");
            ensure!(
                s.connections == self.sensors as usize,
                "only {} of {} sensors were connected at once",
                s.connections,
                self.sensors
            );
            Ok(())
        })();
        Ok((line, verdict))
    }
}

/// Runs the collector's hub on this thread until every sensor has gone. `process`, if given,
/// is started once the hub listens, and watched: if it ends early, the collector does not wait
/// for sensors that will never come.
fn collect(
    listen: &str,
    sensors: u32,
    config: HubConfig,
    mut process: Option<&mut PeerProcess>,
) -> Result<Report> {
    ensure_fds(u64::from(sensors) + 64)?;
    let t0 = Instant::now();
    let rnr_before = rnr_counters();
    let ep = Endpoint::open_default().context("opening $RDMSG_DEVICE")?;
    let mut hub = Hub::new(&ep, config).context("creating the collector's hub")?;
    hub.register::<Sample>()?
        .register::<Alarm>()?
        .register::<Done>()?;
    let addr = hub.listen(listen)?;
    match process.as_deref_mut() {
        Some(p) => p.start(&addr.to_string())?,
        None => println!("listening {addr}"),
    }
    let mut c = Collector {
        sensors,
        tracks: (0..sensors).map(|_| Track::default()).collect(),
        by_peer: HashMap::new(),
        report: Report {
            sensors,
            ..Report::default()
        },
        shown: 0,
        shown_failed: 0,
    };
    // Connections made, and handshakes that failed (no connection): once they add up to
    // every sensor, the ones that are up start.
    let (mut connected, mut ended, mut refused) = (0u32, 0u32, 0u32);
    let mut started_at = None;
    let mut cpu_at_start = None;
    let mut last_event = Instant::now();
    while ended < sensors {
        let Some(ev) = hub.recv_timeout(Some(Duration::from_secs(1)))? else {
            let live = hub.transport().stats();
            let orphaned = live.connections + live.handshakes == 0
                && process.as_deref_mut().is_some_and(PeerProcess::ended);
            if orphaned || last_event.elapsed() > IDLE {
                c.error(format_args!(
                    "gave up waiting ({}): {connected} connected, {ended} gone of {sensors}",
                    if orphaned {
                        "the sensors process has ended"
                    } else {
                        "nothing happened for 2 minutes"
                    }
                ));
                break;
            }
            continue;
        };
        last_event = Instant::now();
        match ev {
            HubEvent::Connected { .. } => {
                connected += 1;
                if connected + refused == sensors && started_at.is_none() {
                    c.report.connect_ms = t0.elapsed().as_millis();
                    c.report.connect_cpu_ms = process_cpu_ms();
                    c.report.connect_times = Some(hub.transport().stats().connect_times);
                    c.report.snapshot = snapshot(&hub);
                    eprintln!(
                        "collector: {sensors} sensors connected after {} ms",
                        c.report.connect_ms
                    );
                    let peers: Vec<PeerId> = hub.peers().collect();
                    for p in peers {
                        if let Err(e) = hub.send(p, &Start { sensors }) {
                            // A connection that failed meanwhile is reported by its
                            // `Disconnected`, and counted there.
                            let gone = hub.transport().conn_stats(p).is_none()
                                || hub.transport().failure(p).is_some();
                            if !gone {
                                c.error(format_args!("sending Start to {p}: {e}"));
                            }
                        }
                    }
                    started_at = Some(Instant::now());
                    cpu_at_start = process_cpu_ms();
                }
            }
            HubEvent::Message { peer, msg } => c.message(peer, &msg),
            HubEvent::BadFrame { peer, error } => c.error(format_args!("{peer}: {error}")),
            HubEvent::Unread { peer, messages } => {
                c.error(format_args!("{peer} closed with {messages} unread"))
            }
            HubEvent::Writable { .. } => {}  // nothing is posted here
            HubEvent::CallEnded { .. } => {} // no call is watched here
            HubEvent::Unconfirmed { peer, delivery, .. } => c.error(format_args!(
                "{peer} ended with {} message(s) not taken",
                delivery.unconfirmed()
            )),
            HubEvent::Disconnected { peer, failure } => {
                ended += 1;
                if failure != Failure::PeerClosed {
                    c.ended(peer, failure, t0.elapsed());
                }
            }
            HubEvent::HandshakeFailed { error, .. } => {
                ended += 1;
                refused += 1;
                c.failed(format_args!("a sensor's handshake failed: {error}"));
                c.report.failed.add(format_args!("handshake: {error}"));
            }
        }
    }
    c.report.from_finished = c
        .tracks
        .iter()
        .filter(|t| t.done.is_some())
        .map(|t| t.received)
        .sum();
    let wait = hub.transport().wait_stats();
    let r = &mut c.report;
    r.wakeups = wait.wakeups;
    r.spurious = wait.spurious_wakeups;
    r.elapsed_ms = t0.elapsed().as_millis();
    r.probes = hub.transport().stats().liveness_probes;
    if let Some(t) = started_at {
        r.traffic_ms = t.elapsed().as_millis();
        r.traffic_cpu_ms = cpu_at_start.and_then(|b| Some(process_cpu_ms()?.saturating_sub(b)));
        eprintln!("collector: traffic took {} ms", r.traffic_ms);
    }
    r.rnr = rnr_before.and_then(|b| Some(rnr_counters()? - b));
    Ok(c.report)
}

/// Where a hub's connect time went, per connection, in µs, as `key=value` pairs: `hs_wall_us`
/// (a handshake's start to its connection: waiting included), then the hub's own work in it:
/// `admission_us` (receive buffers set aside; registered in batches as the pool grows),
/// `qp_create_us` (queue pair created and in INIT), `rtr_rts_us` (moved to RTR and RTS),
/// `hello_us` (the rest: reading, checking and writing hellos).
/// `n/a` each if not every sensor connected.
fn connect_breakdown(t: Option<&ConnectTimes>) -> String {
    let Some(t) = t else {
        return "hs_wall_us=n/a admission_us=n/a qp_create_us=n/a rtr_rts_us=n/a hello_us=n/a"
            .into();
    };
    let per = |d: Duration| d.as_secs_f64() * 1e6 / t.established.max(1) as f64;
    format!(
        "hs_wall_us={:.0} admission_us={:.1} qp_create_us={:.1} rtr_rts_us={:.1} hello_us={:.1}",
        per(t.wall),
        per(t.admission),
        per(t.queue_pairs),
        per(t.transitions),
        per(t.hellos),
    )
}

/// A CPU time in ms (`None`: unknown) spread over `conns` connections, in µs, or `n/a`.
fn us_per_conn(ms: Option<u64>, conns: f64) -> String {
    ms.map_or("n/a".into(), |ms| {
        format!("{:.0}", ms as f64 * 1000.0 / conns)
    })
}

fn snapshot(hub: &Hub) -> Snapshot {
    let stats = hub.transport().stats();
    Snapshot {
        connections: stats.connections,
        threads: count_dir("/proc/self/task"),
        // Not counting the descriptor that reads the directory.
        fds: count_dir("/proc/self/fd").saturating_sub(1),
        registered_kib: stats.registered_bytes / 1024,
        recv_buffers: stats.recv_buffers,
        spare_buffers: stats.spare_buffers,
    }
}

struct Collector {
    sensors: u32,
    tracks: Vec<Track>,
    by_peer: HashMap<PeerId, u32>,
    report: Report,
    /// Errors printed so far (the rest are only counted).
    shown: u64,
    /// Failed connections printed so far (the rest are only counted).
    shown_failed: u64,
}

impl Collector {
    fn error(&mut self, what: std::fmt::Arguments<'_>) {
        self.report.errors += 1;
        if self.shown < 20 {
            self.shown += 1;
            eprintln!("collector: error: {what}");
        }
    }

    /// A failed sensor connection, shown (as errors are, the first 20) but counted apart.
    fn failed(&mut self, what: std::fmt::Arguments<'_>) {
        if self.shown_failed < 20 {
            self.shown_failed += 1;
            eprintln!("collector: failed: {what}");
        }
    }

    /// `peer`'s connection ended with `failure` rather than its sensor's graceful close: a
    /// failed sensor if its `Done` had not come, else an error (its close went wrong).
    fn ended(&mut self, peer: PeerId, failure: Failure, at: Duration) {
        let sensor = self.by_peer.get(&peer).copied();
        let finished = sensor.is_some_and(|s| self.tracks[s as usize].done.is_some());
        let who = sensor.map_or(String::new(), |s| format!(" (sensor {s})"));
        if finished {
            self.error(format_args!("{peer}{who} ended: {failure}"));
        } else {
            self.failed(format_args!(
                "{peer}{who} ended after {} ms: {failure}",
                at.as_millis()
            ));
            self.report.failed.add(failure);
        }
    }

    fn message(&mut self, peer: PeerId, msg: &rdmsg::Envelope) {
        self.report.messages += 1;
        if let Some(&s) = self.by_peer.get(&peer) {
            self.tracks[s as usize].received += 1;
        }
        if let Err(e) = self.check(peer, msg) {
            self.error(format_args!("{peer}: {e:#}"));
        }
    }

    /// Checks one message: its sensor is this peer's (each sensor on one connection only),
    /// its sequence the next of that sensor, its content what that sensor sends there.
    fn check(&mut self, peer: PeerId, msg: &rdmsg::Envelope) -> Result<()> {
        let (sensor, seq) = if msg.is::<Sample>() {
            let s: Sample = msg.decode()?;
            ensure!(
                s.value == value_of(s.sensor, s.seq),
                "sample {} of sensor {} reads {}",
                s.seq,
                s.sensor,
                s.value
            );
            self.report.samples += 1;
            (s.sensor, Some(s.seq))
        } else if msg.is::<Alarm>() {
            let a: Alarm = msg.decode()?;
            ensure!(
                a.reason == reason_of(a.sensor, a.seq),
                "alarm {} of sensor {} says {:?}",
                a.seq,
                a.sensor,
                a.reason
            );
            self.report.alarms += 1;
            (a.sensor, Some(a.seq))
        } else {
            let d: Done = msg.decode()?;
            let t = self.claim(peer, d.sensor)?;
            ensure!(t.done.is_none(), "sensor {} finished twice", d.sensor);
            ensure!(
                d.sent == t.next_seq,
                "sensor {} sent {} messages, {} arrived",
                d.sensor,
                d.sent,
                t.next_seq
            );
            t.done = Some(d.sent);
            self.report.done += 1;
            self.report.done_sent += d.sent + 1;
            (d.sensor, None)
        };
        let t = self.claim(peer, sensor)?;
        if let Some(seq) = seq {
            ensure!(t.done.is_none(), "sensor {sensor} sent after its Done");
            ensure!(
                seq == t.next_seq,
                "sensor {sensor}: message {seq} arrived where {} was due",
                t.next_seq
            );
            t.next_seq += 1;
        }
        Ok(())
    }

    /// The track of `sensor`, which must be `peer`'s only sensor and nobody else's.
    fn claim(&mut self, peer: PeerId, sensor: u32) -> Result<&mut Track> {
        ensure!(
            sensor < self.sensors,
            "sensor {sensor} (only {} expected)",
            self.sensors
        );
        match self.by_peer.get(&peer) {
            Some(&s) => ensure!(s == sensor, "sensor {sensor} on the connection of {s}"),
            None => {
                let owner = self.tracks[sensor as usize].peer;
                ensure!(owner.is_none(), "sensor {sensor} on two connections");
                self.by_peer.insert(peer, sensor);
                self.tracks[sensor as usize].peer = Some(peer);
                // Its first message, counted before the peer was known.
                self.tracks[sensor as usize].received += 1;
            }
        }
        Ok(&mut self.tracks[sensor as usize])
    }
}

// ----- the sensors -----

/// Sensors per source address when the collector is on this host.
const SENSORS_PER_SOURCE: u32 = 8_000;

/// The bootstrap stream of sensor `i` towards the collector at `to`. When `to` is an IPv4
/// loopback address, sensors come from several loopback addresses (sensor `i` from
/// 127.0.0.1 + `i / SENSORS_PER_SOURCE`), as they would from several hosts, so that an
/// address carries at most [`SENSORS_PER_SOURCE`]. Linux picks a connection's local port
/// among its source address's ephemeral ports (28,232 by default), first among the half of
/// one parity; once those are in use, each further connect searches through them, in system
/// time. From one address, 20,000 sensors connected in 7x the time of 10,000.
fn sensor_stream(to: SocketAddr, i: u32, timeout: Duration) -> Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))
        .context("making a sensor's socket")?;
    if let SocketAddr::V4(v4) = to {
        if v4.ip().is_loopback() {
            let host = u32::from(Ipv4Addr::LOCALHOST) + i / SENSORS_PER_SOURCE;
            let from = SocketAddr::from((Ipv4Addr::from(host), 0));
            socket
                .bind(&from.into())
                .with_context(|| format!("binding sensor {i}'s socket to {from}"))?;
        }
    }
    socket
        .connect_timeout(&to.into(), timeout)
        .with_context(|| format!("connecting sensor {i} to {to}"))?;
    Ok(socket.into())
}

/// Sensors `first..first + count`, one connection each, all driven by this thread's hub.
fn run_sensors(connect: &str, count: u32, first: u32, work: &Workload) -> Result<()> {
    ensure_fds(u64::from(count) + 64)?;
    let t0 = Instant::now();
    let ep = Endpoint::open_default().context("opening $RDMSG_DEVICE")?;
    let config = HubConfig {
        max_connections: count,
        ..HubConfig::default()
    };
    let to = connect
        .to_socket_addrs()
        .with_context(|| format!("resolving {connect}"))?
        .next()
        .with_context(|| format!("{connect} names no address"))?;
    let timeout = config.conn.handshake_timeout;
    // As `Hub::connect` paces its own handshakes.
    let most_pending = (config.conn.max_pending_handshakes as usize / 4).max(1);
    let mut hub = Hub::new(&ep, config).context("creating the sensors' hub")?;
    hub.register::<Start>()?;
    let mut peers = Vec::with_capacity(count as usize);
    let mut state = SensorsState::default();
    for i in 0..count {
        while hub.transport().pending_connects() >= most_pending {
            if let Some(ev) = hub.recv_timeout(Some(Duration::from_millis(100)))? {
                state.event(ev)?;
            }
        }
        let stream = sensor_stream(to, first.saturating_add(i), timeout)?;
        peers.push(hub.connect_stream(stream)?);
        // Moves the handshakes under way on while the others start.
        while let Some(ev) = hub.try_recv()? {
            state.event(ev)?;
        }
    }
    // Each sensor starts, or its connection fails (it will not start: the others go on).
    while state.settled < count as usize {
        let ev = hub
            .recv_timeout(Some(IDLE))?
            .with_context(|| format!("waiting for connections and starts: {state}"))?;
        state.event(ev)?;
    }
    let connect_ms = t0.elapsed().as_millis();
    let connect_cpu_ms = process_cpu_ms();
    let connect_times = hub.transport().stats().connect_times;
    let (mut samples, mut alarms) = (0u64, 0u64);
    let mut seqs = vec![0u64; count as usize];
    let mut batch = Vec::with_capacity(work.batch);
    // A send to a connection that failed: the sensor stops (its failure is counted), the
    // others go on; any other error ends the run.
    let stopped = |hub: &Hub, peer: PeerId, e: anyhow::Error, state: &mut SensorsState| {
        let gone =
            hub.transport().conn_stats(peer).is_none() || hub.transport().failure(peer).is_some();
        if !gone {
            return Err(e);
        }
        let why = hub
            .transport()
            .failure(peer)
            .map_or_else(|| format!("{e:#}"), |f| f.to_string());
        state.fail(peer, why);
        Ok(())
    };
    for b in 0..work.batches {
        for (i, &peer) in peers.iter().enumerate() {
            if state.failed.contains_key(&peer) {
                continue;
            }
            let sensor = first + i as u32;
            let seq = &mut seqs[i];
            batch.clear();
            batch.extend((0..work.batch as u64).map(|j| Sample {
                sensor,
                seq: *seq + j,
                value: value_of(sensor, *seq + j),
            }));
            if let Err(e) = hub
                .send_batch(peer, &batch)
                .with_context(|| format!("sensor {sensor}: batch {b}"))
            {
                stopped(&hub, peer, e, &mut state)?;
                continue;
            }
            *seq += work.batch as u64;
            samples += work.batch as u64;
            if alarm_due(sensor, b, work.alarm_every) {
                let reason = reason_of(sensor, *seq);
                let alarm = Alarm {
                    sensor,
                    seq: *seq,
                    reason,
                };
                if let Err(e) = hub
                    .send(peer, &alarm)
                    .with_context(|| format!("sensor {sensor}: alarm"))
                {
                    stopped(&hub, peer, e, &mut state)?;
                    continue;
                }
                *seq += 1;
                alarms += 1;
            }
        }
        // Nothing but a failure can have come meanwhile.
        while let Some(ev) = hub.try_recv()? {
            state.event(ev)?;
        }
    }
    // What the sensors that finished sent (their `Done` included): what the collector must
    // have received from them.
    let mut sent = 0u64;
    for (i, &peer) in peers.iter().enumerate() {
        if state.failed.contains_key(&peer) {
            continue;
        }
        let sensor = first + i as u32;
        let done = Done {
            sensor,
            sent: seqs[i],
        };
        match hub
            .send(peer, &done)
            .with_context(|| format!("sensor {sensor}: done"))
        {
            Ok(()) => sent += seqs[i] + 1,
            Err(e) => stopped(&hub, peer, e, &mut state)?,
        }
    }
    // Failures that came meanwhile.
    while let Some(ev) = hub.try_recv()? {
        state.event(ev)?;
    }
    // What the credits cost: sends that waited for one, and messages the transport solicited
    // because they spent a peer's last credit (each a wake-up of the collector).
    let (mut credit_waits, mut forced) = (0u64, 0u64);
    for &peer in &peers {
        if let Some(s) = hub.transport().conn_stats(peer) {
            credit_waits += s.credit_waits;
            forced += s.forced_solicited;
        }
    }
    // Each close waits for its close message to be delivered. One that fails is reported
    // (and fails the process at the end), the others still close: everything was sent.
    let closing = Instant::now();
    state.closing = true;
    let mut slowest = Duration::ZERO;
    let mut close_errors = 0u32;
    let failed_before_close = state.failed.len() as u32;
    for (i, &peer) in peers.iter().enumerate() {
        if state.failed.contains_key(&peer) {
            continue;
        }
        let t = Instant::now();
        if let Err(e) = hub.close(peer) {
            close_errors += 1;
            let sensor = first + i as u32;
            eprintln!(
                "sensors: closing sensor {sensor} ({peer}) failed after {:?}: {e}",
                t.elapsed()
            );
            if hub.transport().failure(peer).is_none() {
                state.closed += 1; // still up (a timeout): no Disconnected will come
            }
        }
        slowest = slowest.max(t.elapsed());
    }
    let close_ms = closing.elapsed().as_millis();
    while state.closed + failed_before_close < count {
        let ev = hub
            .recv_timeout(Some(IDLE))?
            .with_context(|| format!("waiting for the closes: {state}"))?;
        state.event(ev)?;
    }
    let wait = hub.transport().wait_stats();
    let failures = state.failures();
    println!(
        "sensors: connections={count} sent={sent} samples={samples} alarms={alarms} batches={} \
         solicited={} forced_solicited={forced} credit_waits={credit_waits} wakeups={} threads={} \
         connect_ms={connect_ms} connect_cpu_us_per_conn={} {} close_ms={close_ms} slowest_close_us={} \
         close_errors={close_errors} elapsed_ms={} failed={} failures={}",
        work.batches * u64::from(count),
        hub.stats().sent_solicited,
        wait.wakeups,
        count_dir("/proc/self/task"),
        us_per_conn(connect_cpu_ms, f64::from(count.max(1))),
        connect_breakdown(Some(&connect_times)),
        slowest.as_micros(),
        t0.elapsed().as_millis(),
        failures.count(),
        failures.describe(),
    );
    ensure!(
        failures.count() == 0,
        "{} sensor connections failed: {}",
        failures.count(),
        failures.describe()
    );
    ensure!(close_errors == 0, "{close_errors} closes failed");
    Ok(())
}

#[derive(Debug, Default)]
struct SensorsState {
    connected: u32,
    /// Sensors told to start.
    started: HashSet<PeerId>,
    closed: u32,
    /// Closing every connection: each ends (a close that failed was reported already).
    closing: bool,
    /// Connections that failed before their close, and why (the first word on them; a later
    /// `Disconnected` says it better).
    failed: HashMap<PeerId, String>,
    /// Failures shown so far (the rest are only counted).
    shown: u32,
    /// Sensors that started, or never will (their connection failed first).
    settled: usize,
}

impl std::fmt::Display for SensorsState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} connected, {} started, {} failed, {} closed",
            self.connected,
            self.started.len(),
            self.failed.len(),
            self.closed
        )
    }
}

impl SensorsState {
    /// `peer`'s connection failed (`why`): that sensor stops, the others go on.
    fn fail(&mut self, peer: PeerId, why: String) {
        if self.shown < 20 {
            self.shown += 1;
            eprintln!("sensors: {peer} failed: {why}");
        }
        if self.failed.insert(peer, why).is_none() && !self.started.contains(&peer) {
            self.settled += 1;
        }
    }

    fn failures(&self) -> Failures {
        let mut f = Failures::default();
        for why in self.failed.values() {
            f.add(why);
        }
        f
    }

    fn event(&mut self, ev: HubEvent) -> Result<()> {
        match ev {
            HubEvent::Connected { .. } => self.connected += 1,
            HubEvent::Message { peer, msg } => {
                msg.decode::<Start>()
                    .with_context(|| format!("{peer}: not a Start"))?;
                if self.started.insert(peer) && !self.failed.contains_key(&peer) {
                    self.settled += 1;
                }
            }
            HubEvent::Disconnected { peer, failure } => {
                if let Some(why) = self.failed.get_mut(&peer) {
                    // A send to it said so first (`no connection`): its failure says why.
                    *why = failure.to_string();
                } else if failure == Failure::Closed || self.closing {
                    // Closed (a close that failed was reported already).
                    self.closed += 1;
                } else {
                    self.fail(peer, failure.to_string());
                }
            }
            HubEvent::BadFrame { peer, error } => bail!("{peer}: {error}"),
            HubEvent::Unread { peer, messages } => bail!("{peer} closed with {messages} unread"),
            HubEvent::Writable { .. } => {}  // nothing is posted here
            HubEvent::CallEnded { .. } => {} // no call is watched here
            HubEvent::Unconfirmed { peer, delivery, .. } => bail!(
                "{peer} ended with {} message(s) not taken",
                delivery.unconfirmed()
            ),
            HubEvent::HandshakeFailed {
                peer: Some(peer),
                error,
            } => self.fail(peer, format!("handshake: {error}")),
            HubEvent::HandshakeFailed { error, .. } => bail!("a handshake failed: {error}"),
        }
        Ok(())
    }
}

// ----- the process around them -----

/// Makes room for `need` descriptors (a hub holds one per connection): raises the soft limit
/// if it is lower and the hard limit allows.
fn ensure_fds(need: u64) -> Result<()> {
    let soft = rdmsg::verbs::raise_fd_limit(need).context("raising the descriptor limit")?;
    ensure!(
        soft >= need,
        "{need} file descriptors needed, the hard limit allows {soft}: raise it (ulimit -Hn) or use fewer sensors"
    );
    Ok(())
}

/// Receiver-not-ready NAKs counted by the device's port 1 (both directions), if it says.
fn rnr_counters() -> Option<u64> {
    let dev = std::env::var("RDMSG_DEVICE").ok()?;
    let read = |name: &str| -> Option<u64> {
        let path = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}");
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    };
    Some(read("rcvd_rnr_err")? + read("send_rnr_err")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("collector").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// The `sensors` role's options, or a panic naming the role parsed.
    fn sensors_of(c: Cli) -> (String, u32, u32, Workload) {
        match c.role {
            Some(Role::Sensors {
                connect,
                count,
                first,
                work,
            }) => (connect, count, first, work),
            other => panic!("{other:?}"),
        }
    }

    fn check_work(w: &Workload, (batches, batch, alarm_every): (u64, usize, u64)) {
        assert_eq!(
            (w.batches, w.batch, w.alarm_every),
            (batches, batch, alarm_every)
        );
    }

    #[test]
    fn no_role_defaults_and_flags() {
        let c = parse(&[]);
        assert!(c.role.is_none());
        assert_eq!(c.sensors, 1024);
        check_work(&c.work, (4, 8, 4));
        let d = HubConfig::default();
        let hub = c.hub.config(c.sensors);
        assert_eq!(
            (hub.min_credits, hub.shared_credits, hub.max_connections),
            (MIN_CREDITS, d.shared_credits, 1024)
        );
        assert_eq!(parse(&["--sensors", "256"]).sensors, 256);
        assert_eq!(parse(&["--sensors", "10000"]).sensors, 10000);
        let c = parse(&[
            "--count",
            "3",
            "--batches",
            "5",
            "--batch",
            "6",
            "--alarm-every",
            "7",
            "--min-credits",
            "2",
            "--shared-credits",
            "9",
            "--sensors",
            "4",
        ]);
        assert_eq!(c.sensors, 4, "the last of --count and --sensors wins");
        check_work(&c.work, (5, 6, 7));
        let hub = c.hub.config(c.sensors);
        assert_eq!(
            (hub.min_credits, hub.shared_credits, hub.max_connections),
            (2, 9, 4)
        );
    }

    #[test]
    fn serve_role() {
        let c = parse(&["serve", "--listen", "127.0.0.1:0", "--sensors", "64"]);
        let Some(Role::Serve {
            listen,
            sensors,
            hub,
        }) = c.role
        else {
            panic!("{:?}", c.role)
        };
        assert_eq!((listen.as_str(), sensors), ("127.0.0.1:0", 64));
        assert_eq!(hub.min_credits, MIN_CREDITS);
        let c = parse(&[
            "serve",
            "--count",
            "5",
            "--listen",
            "a:1",
            "--min-credits",
            "3",
        ]);
        let Some(Role::Serve { sensors, hub, .. }) = c.role else {
            panic!("{:?}", c.role)
        };
        assert_eq!((sensors, hub.min_credits), (5, 3));
    }

    #[test]
    fn sensors_role() {
        // As the device test starts them.
        let c = parse(&[
            "sensors",
            "--connect",
            "a:1",
            "--count",
            "32",
            "--first",
            "32",
        ]);
        let (connect, count, first, work) = sensors_of(c);
        assert_eq!((connect.as_str(), count, first), ("a:1", 32, 32));
        check_work(&work, (4, 8, 4));
        // As `both` starts them (`PeerProcess::start` adds `--connect ADDR`).
        let work = Workload {
            batches: 2,
            batch: 3,
            alarm_every: 5,
        };
        let mut args = vec!["sensors".to_owned(), "--count".into(), "10000".into()];
        args.extend(work.args());
        args.extend(["--connect".into(), "127.0.0.1:4000".into()]);
        let c = parse(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let (connect, count, first, work) = sensors_of(c);
        assert_eq!(
            (connect.as_str(), count, first),
            ("127.0.0.1:4000", 10000, 0)
        );
        check_work(&work, (2, 3, 5));
    }

    /// A run where 2 of 4 sensors finished and 2 connections failed midway, what they had
    /// sent partly arrived, and the sensors process failed without a report line.
    fn two_of_four_failed() -> Report {
        let mut failed = Failures::default();
        failed.add(Failure::PeerVanished);
        failed.add(Failure::PeerVanished);
        Report {
            sensors: 4,
            snapshot: Snapshot {
                connections: 4,
                ..Snapshot::default()
            },
            messages: 2 * 35 + 9 + 17,
            done: 2,
            done_sent: 2 * 35,
            from_finished: 2 * 35,
            failed,
            ..Report::default()
        }
    }

    #[test]
    fn failed_sensors_are_counted_apart_and_nothing_is_lost_negatively() {
        let (line, verdict) = two_of_four_failed().summary(None).unwrap();
        let num = |key: &str| field(&line, key).unwrap_or_else(|| panic!("{key} in {line}"));
        assert!(line.contains(" lost=0 "), "{line}");
        assert_eq!(
            num("messages"),
            2 * 35 + 26,
            "everything that arrived is counted"
        );
        assert_eq!((num("finished"), num("failed")), (2, 2), "{line}");
        assert!(
            line.ends_with(&format!("failures=\"{} x2\"", Failure::PeerVanished)),
            "{line}"
        );
        assert_eq!(
            num("errors"),
            0,
            "a failed sensor is not also an error: {line}"
        );
        let e = verdict.unwrap_err().to_string();
        assert!(e.starts_with("2 sensor connections failed: "), "{e}");
    }

    #[test]
    fn losses_are_those_of_the_sensors_that_finished() {
        let mut r = two_of_four_failed();
        // The sensors say their two finished sensors sent one more than arrived.
        let (line, verdict) = r.summary(Some("sensors: sent=71 failed=2")).unwrap();
        assert!(line.contains(" lost=1 "), "{line}");
        assert!(verdict.unwrap_err().to_string().contains("1 messages lost"));
        // Nothing failed and everything arrived: a pass.
        r.failed = Failures::default();
        r.done = 4;
        r.done_sent = 4 * 35;
        r.from_finished = 4 * 35;
        r.messages = 4 * 35;
        let (line, verdict) = r.summary(Some("sensors: sent=140")).unwrap();
        assert!(
            line.contains(" lost=0 ") && line.ends_with("failed=0 failures=none"),
            "{line}"
        );
        verdict.unwrap();
        // A sensor neither finished nor failed: an error.
        r.done = 3;
        let (_, verdict) = r.summary(None).unwrap();
        assert!(verdict.is_err());
    }

    #[test]
    fn refused() {
        for args in [
            &["--bogus"][..],
            &["--sensors", "0"],
            &["--batch", "0"],
            &["--alarm-every", "0"],
            &["--sensors"],
            &["serve"],
            &["sensors", "--count", "3"],
            &["--sensors", "3", "serve", "--listen", "a:1"],
        ] {
            let args = std::iter::once("collector").chain(args.iter().copied());
            assert!(Cli::try_parse_from(args).is_err());
        }
    }
}
