//! Fan-in: `N` connections from one client process into one server process, the server being
//! one [`Hub`] thread or a [`Listener`](rdmsg::transport::Listener) with a thread per
//! [`Connection`], measured on the server side.
//!
//! The client is this program again (`rdmsg-bench fanin-client`), one client hub on one
//! thread. It opens the `N` connections, says so, waits for `GO`, sends the same number of
//! 64-byte messages on every connection in batches of 8 whose last is solicited, interleaved
//! message by message across the connections (message `j` of every connection's batch before
//! message `j + 1` of any) and paced to a fixed total rate, so that every connection offers
//! the same load in any stretch of time; it reports what it sent, waits for `CLOSE`, closes
//! every connection gracefully and exits. Standard input and output carry that conversation,
//! one line each way per step.
//!
//! The server is a process of its own too (`rdmsg-bench fanin-server`, started by
//! [`measure`] and printing one `RESULT {json}` line), so that what it counts is its own and
//! nothing an earlier measurement left in the runner's heap. It takes a snapshot of itself
//! (descriptors, `/proc/self/status`, the device's RNR counters) before it creates anything,
//! again once all `N` are connected and idle, measures its process CPU time and wake-ups over
//! the messages, and timestamps every message for the fairness windows. Everything read from
//! `/proc` and every figure computed from the readings is a pure function below, unit-tested.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdmsg::transport::{
    Config, Connection, Endpoint, Failure, GroupConfig, HubConfig, HubGroup, Member, PeerId,
    RawHub as Hub, RawHubEvent as HubEvent,
};
use serde::{Deserialize, Serialize};

/// Who serves the connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// One [`Hub`], on the measuring thread: one completion channel, one shared receive queue.
    Hub,
    /// A listener accepting on the measuring thread, one thread per connection blocked in
    /// [`Connection::recv`].
    Threads,
    /// A [`HubGroup`] of this many member hubs, each on a thread of its own.
    Group(usize),
}

impl Server {
    /// Group sizes the bench knows by name.
    pub const GROUPS: [usize; 4] = [1, 2, 4, 8];

    /// Name in samples and tables.
    pub fn name(self) -> &'static str {
        match self {
            Server::Hub => "hub",
            Server::Threads => "threads",
            Server::Group(1) => "group1",
            Server::Group(2) => "group2",
            Server::Group(4) => "group4",
            Server::Group(8) => "group8",
            Server::Group(_) => "group",
        }
    }

    /// The server a name stands for.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "hub" => Some(Server::Hub),
            "threads" => Some(Server::Threads),
            _ => Self::GROUPS
                .into_iter()
                .map(Server::Group)
                .find(|g| g.name() == name),
        }
    }
}

/// Each hub's configuration for `conns` connections: the default, with room for them all.
pub fn hub_config(conns: usize) -> HubConfig {
    let config = HubConfig::default();
    HubConfig {
        max_connections: config.max_connections.max(conns as u32),
        ..config
    }
}

/// The fairness window for `load`: a second, or as long as it takes to offer each peer 8
/// messages (with thousands of peers, a second holds less than one message of each).
pub fn fair_window(load: &Load) -> f64 {
    (8.0 * load.conns as f64 / load.rate).max(1.0)
}

/// What the client offers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Connections.
    pub conns: usize,
    /// Messages per connection (a multiple of `batch`).
    pub per_conn: usize,
    /// Messages per batch; the last of each is solicited.
    pub batch: usize,
    /// Payload bytes.
    pub size: usize,
    /// Messages per second, all connections together.
    pub rate: f64,
}

impl Load {
    /// `total` messages or so spread over `conns` connections: whole batches, at least two per
    /// connection.
    pub fn new(conns: usize, total: usize, batch: usize, size: usize, rate: f64) -> Self {
        Self {
            conns,
            per_conn: per_conn_messages(total, conns, batch),
            batch,
            size,
            rate,
        }
    }

    /// Messages in all.
    pub fn messages(&self) -> usize {
        self.conns * self.per_conn
    }

    /// Solicited messages the client asks for (the transport may solicit more).
    pub fn solicited(&self) -> usize {
        self.conns * self.per_conn.div_ceil(self.batch)
    }

    /// As flags of `fanin-server` and `fanin-client`.
    pub fn to_args(&self) -> Vec<String> {
        [
            ("--conns", self.conns.to_string()),
            ("--per-conn", self.per_conn.to_string()),
            ("--batch", self.batch.to_string()),
            ("--size", self.size.to_string()),
            ("--rate", self.rate.to_string()),
        ]
        .into_iter()
        .flat_map(|(f, v)| [f.to_owned(), v])
        .collect()
    }

    /// Reads what [`Load::to_args`] wrote; returns the other flags with their values.
    pub fn from_args(args: &[String]) -> Result<(Self, Vec<(String, String)>)> {
        let mut load = Load {
            conns: 0,
            per_conn: 0,
            batch: 0,
            size: 0,
            rate: 0.0,
        };
        let mut rest = Vec::new();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().with_context(|| format!("{flag} needs a value"))?;
            let number = || -> Result<usize> { value.parse().with_context(|| flag.clone()) };
            match flag.as_str() {
                "--conns" => load.conns = number()?,
                "--per-conn" => load.per_conn = number()?,
                "--batch" => load.batch = number()?,
                "--size" => load.size = number()?,
                "--rate" => load.rate = value.parse().context("--rate")?,
                _ => rest.push((flag.clone(), value.clone())),
            }
        }
        if load.conns == 0 || load.per_conn == 0 || load.batch == 0 || load.size < 8 {
            bail!("a fan-in needs --conns, --per-conn, --batch and --size (8 bytes at least)");
        }
        if !(load.rate > 0.0 && load.rate.is_finite()) {
            bail!("a fan-in needs a positive --rate");
        }
        Ok((load, rest))
    }
}

/// Messages per connection for about `total` in all: whole batches, at least two.
pub fn per_conn_messages(total: usize, conns: usize, batch: usize) -> usize {
    let batch = batch.max(1);
    (total / conns.max(1)).div_ceil(batch).max(2) * batch
}

/// The order the client sends in: `(connection, solicited)`, message `j` of a batch on every
/// connection before message `j + 1` on any; the last message of each batch is solicited.
pub fn send_order(load: &Load) -> impl Iterator<Item = (usize, bool)> {
    let Load {
        conns,
        per_conn,
        batch,
        ..
    } = *load;
    (0..per_conn).flat_map(move |seq| {
        let solicited = seq % batch == batch - 1 || seq + 1 == per_conn;
        (0..conns).map(move |c| (c, solicited))
    })
}

// ----- what /proc says -----

/// The lines of `/proc/self/status` we use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcStatus {
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// `VmPin`, KiB: pages pinned, which is where memory registered with the device shows
    /// (`ib_umem_get` counts it in `pinned_vm`).
    pub pinned_kib: u64,
    /// `Threads`.
    pub threads: u64,
}

impl ProcStatus {
    /// Parses the text of `/proc/<pid>/status`; missing lines read as 0.
    pub fn parse(text: &str) -> Self {
        let mut s = Self::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let number = || {
                value
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            match key {
                "VmRSS" => s.rss_kib = number(),
                "VmPin" => s.pinned_kib = number(),
                "Threads" => s.threads = number(),
                _ => {}
            }
        }
        s
    }

    /// This process, now.
    pub fn read() -> Result<Self> {
        let text =
            std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
        Ok(Self::parse(&text))
    }
}

/// Clock ticks per second of `/proc/<pid>/stat` (`USER_HZ`, 100 on every Linux architecture
/// rdmsg builds for).
pub const USER_HZ: f64 = 100.0;

/// User and system CPU time, in clock ticks, of every thread the process has had (fields 14
/// and 15 of `/proc/<pid>/stat`, counted after the command name, which may hold anything).
pub fn stat_cpu_split(text: &str) -> Option<(u64, u64)> {
    let after_name = &text[text.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    // Field 3 (state) is the first after the name: utime is field 14, stime 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime, stime))
}

/// CPU time of this process so far, seconds, user and system.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct CpuTime {
    user: f64,
    system: f64,
}

impl CpuTime {
    fn process() -> Result<Self> {
        let path = "/proc/self/stat";
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let (user, system) =
            stat_cpu_split(&text).with_context(|| format!("no CPU times in {path}"))?;
        Ok(Self {
            user: user as f64 / USER_HZ,
            system: system as f64 / USER_HZ,
        })
    }

    fn total(self) -> f64 {
        self.user + self.system
    }

    fn since(self, before: Self) -> Self {
        Self {
            user: self.user - before.user,
            system: self.system - before.system,
        }
    }
}

/// Open descriptors of this process (the directory's own one cancels out in differences).
fn fd_count() -> Result<usize> {
    Ok(std::fs::read_dir("/proc/self/fd")
        .context("reading /proc/self/fd")?
        .count())
}

/// Receiver-not-ready NAKs counted by port 1 of `device`, both directions
/// (`rcvd_rnr_err + send_rnr_err`); `None` if the device does not expose them.
fn rnr_count(device: &str) -> Option<u64> {
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(format!(
            "/sys/class/infiniband/{device}/ports/1/hw_counters/{name}"
        ))
        .ok()?
        .trim()
        .parse()
        .ok()
    };
    Some(read("rcvd_rnr_err")? + read("send_rnr_err")?)
}

/// One look at the server process.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    fds: usize,
    status: ProcStatus,
}

impl Snapshot {
    fn take() -> Result<Self> {
        Ok(Self {
            fds: fd_count()?,
            status: ProcStatus::read()?,
        })
    }
}

/// `(after - before) / n`, for per-connection costs (negative if something was given back).
pub fn per_conn(before: u64, after: u64, n: usize) -> f64 {
    (after as f64 - before as f64) / n.max(1) as f64
}

/// `part` over `whole`, 0 when `whole` is (a phase too short for the clock's ticks).
pub fn share(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}

// ----- fairness -----

/// How evenly the peers were served: per-peer counts of messages received in consecutive
/// windows from the first message on (whole windows only), and the window where the most
/// and the least served peers were furthest apart.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fairness {
    /// Whole windows looked at.
    pub windows: usize,
    /// In the worst window: the most served peer's count.
    pub max: u64,
    /// In the worst window: the least served peer's count.
    pub min: u64,
    /// Mean count per peer per window, over all windows (below a handful, counting alone
    /// makes peers look unequal).
    pub mean: f64,
}

impl Fairness {
    /// Most / least served in the worst window (infinite if a peer got nothing in it).
    pub fn ratio(&self) -> f64 {
        self.max as f64 / self.min as f64
    }
}

/// Fairness of the arrival times `times[peer]` (seconds from any common origin) over windows
/// of `window` seconds; `None` without peers or without one whole window between the first
/// and the last message.
pub fn fairness(times: &[Vec<f64>], window: f64) -> Option<Fairness> {
    let first = times.iter().flatten().copied().min_by(f64::total_cmp)?;
    let last = times.iter().flatten().copied().max_by(f64::total_cmp)?;
    let windows = ((last - first) / window).floor() as usize;
    if windows == 0 || !window.is_finite() || window <= 0.0 {
        return None;
    }
    let mut counts = vec![vec![0u64; windows]; times.len()];
    for (peer, ts) in times.iter().enumerate() {
        for &t in ts {
            let w = ((t - first) / window).floor() as usize;
            if w < windows {
                counts[peer][w] += 1;
            }
        }
    }
    let mut worst: Option<(u64, u64)> = None;
    let mut total = 0;
    for w in 0..windows {
        let column = counts.iter().map(|c| c[w]);
        let max = column.clone().max().unwrap_or(0);
        let min = column.clone().min().unwrap_or(0);
        total += column.sum::<u64>();
        // Worse: a larger max/min, compared without dividing (min may be 0).
        let worse = match worst {
            None => true,
            Some((wmax, wmin)) => {
                u128::from(max) * u128::from(wmin) > u128::from(wmax) * u128::from(min)
            }
        };
        if worse {
            worst = Some((max, min));
        }
    }
    let (max, min) = worst?;
    Some(Fairness {
        windows,
        max,
        min,
        mean: total as f64 / (windows * times.len()) as f64,
    })
}

// ----- the conversation with the client -----

/// What the client reports once it has sent everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientReport {
    /// Data messages sent.
    pub sent: u64,
    /// Of those, solicited: asked for by the client, or forced by the transport.
    pub sent_solicited: u64,
    /// Solicited by the transport although the client did not ask (the last credit).
    pub forced_solicited: u64,
    /// Times a send waited for a credit.
    pub credit_waits: u64,
    /// From the first send to the last, seconds.
    pub send_secs: f64,
    /// Furthest behind the pacing schedule the client fell, seconds.
    pub max_lag_secs: f64,
}

const CONNECTED: &str = "CONNECTED";
const SENT: &str = "SENT ";
const CLOSED: &str = "CLOSED";
const GO: &str = "GO";
const CLOSE: &str = "CLOSE";

/// Longest the connections may take to come up.
fn connect_limit(conns: usize) -> Duration {
    Duration::from_secs(60) + Duration::from_millis(250) * conns as u32
}

/// Longest the messages may take beyond their schedule.
fn phase_limit(load: &Load) -> Duration {
    Duration::from_secs_f64(load.messages() as f64 / load.rate * 4.0) + Duration::from_secs(60)
}

/// Open descriptors a server or client needs for `conns` connections.
fn fds_needed(conns: usize, server: Server) -> u64 {
    let per = match server {
        Server::Hub | Server::Group(_) => 1,
        Server::Threads => 8,
    };
    (conns * per) as u64 + 256
}

/// Raises the descriptor limit to `want`: the soft limit up to the hard one, and, if the hard
/// one is lower, both through `prlimit(1)` (which needs the privilege to raise it, as root
/// has in the test VM). Returns the soft limit in force.
pub(crate) fn ensure_fd_limit(want: u64) -> Result<u64> {
    let got = rdmsg::verbs::raise_fd_limit(want).context("raising RLIMIT_NOFILE")?;
    if got >= want {
        return Ok(got);
    }
    let status = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={want}:{want}"))
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        return Ok(got);
    }
    rdmsg::verbs::raise_fd_limit(want).context("raising RLIMIT_NOFILE")
}

/// The client process, killed if dropped before it finished.
struct ClientProc {
    child: Child,
    stdin: ChildStdin,
    stdout: Option<BufReader<ChildStdout>>,
    done: bool,
}

impl ClientProc {
    fn spawn(addr: SocketAddr, load: &Load) -> Result<Self> {
        let exe = std::env::current_exe().context("finding this program")?;
        let mut child = Command::new(exe)
            .arg("fanin-client")
            .args(["--connect", &addr.to_string()])
            .args(load.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the fan-in client")?;
        let stdin = child.stdin.take().context("client stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("client stdout")?);
        Ok(Self {
            child,
            stdin,
            stdout: Some(stdout),
            done: false,
        })
    }

    fn tell(&mut self, line: &str) -> Result<()> {
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .with_context(|| format!("telling the client {line}"))
    }

    /// Takes the client's output back from the watcher of its `CONNECTED` line, with the
    /// watcher's verdict.
    fn rejoin(
        &mut self,
        watch: thread::JoinHandle<(BufReader<ChildStdout>, Result<()>)>,
    ) -> Result<()> {
        let (stdout, res) = watch.join().expect("the watcher does not panic");
        self.stdout = Some(stdout);
        res
    }

    /// After `CLOSE`: the client says it closed everything, and exits by itself.
    fn closed(mut self) -> Result<()> {
        let closed = self.line()?;
        if closed != CLOSED {
            bail!("the fan-in client said {closed:?} instead of {CLOSED}");
        }
        self.wait(Duration::from_secs(30))
    }

    /// The client's next line (blocking: only where it has it, or is about to).
    fn line(&mut self) -> Result<String> {
        read_line(self.stdout.as_mut().context("client output taken")?)
    }

    /// How the client stands, given up to `limit` to exit by itself (after a failure on our
    /// side that its own failure may explain: its messages go to standard error first).
    fn state_within(&mut self, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.done = true;
                    return format!("the client exited ({status})");
                }
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                Ok(None) => return format!("the client still ran after {limit:?}"),
                Err(e) => return format!("the client's state is unknown ({e})"),
            }
        }
    }

    /// Waits for the client to finish by itself.
    fn wait(mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.done = true;
                if !status.success() {
                    bail!("the fan-in client failed ({status})");
                }
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("the fan-in client did not exit in {limit:?}");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ClientProc {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn read_line(r: &mut impl BufRead) -> Result<String> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("the fan-in client ended (see its messages above)");
    }
    Ok(line.trim_end().to_owned())
}

/// Waits, on a thread of its own, for the client's `CONNECTED` line. If the client ends or
/// says something else instead, `poke` is called (to wake a server blocked in `accept`).
/// Joined before anything is counted, so it is never among the server's threads.
fn await_connected(
    mut stdout: BufReader<ChildStdout>,
    poke: impl FnOnce() + Send + 'static,
) -> thread::JoinHandle<(BufReader<ChildStdout>, Result<()>)> {
    thread::spawn(move || {
        let res = read_line(&mut stdout).and_then(|l| {
            if l.starts_with(CONNECTED) {
                Ok(())
            } else {
                bail!("the fan-in client said {l:?} instead of {CONNECTED}")
            }
        });
        if res.is_err() {
            poke();
        }
        (stdout, res)
    })
}

fn parse_sent(line: &str) -> Result<ClientReport> {
    let json = line
        .strip_prefix(SENT)
        .with_context(|| format!("the fan-in client said {line:?} instead of {SENT}"))?;
    serde_json::from_str(json).context("the fan-in client's report")
}

// ----- the server -----

/// Everything one fan-in measurement found.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Seconds from the first connection attempt to all `N` established.
    pub connect_secs: f64,
    /// Server process CPU (user + system, all threads) per message, µs.
    pub cpu_us_per_msg: f64,
    /// System time's share of that CPU (0 to 1): the kernel's part, rxe's packet processing
    /// included where it ran in the server's context.
    pub system_share: f64,
    /// Server wake-ups (completion channel) per message.
    pub wakeups_per_msg: f64,
    /// Server wake-ups per solicited message the client sent.
    pub wakeups_per_solicited: f64,
    /// Times a server sleep ended for something other than the completion channel (returned
    /// buffers, bootstrap streams, async events), per message.
    pub other_wakeups_per_msg: f64,
    /// Share of the phase the hub spent asleep (0 to 1; `None` for the threads, whose
    /// sleeps before `GO` cannot be told apart).
    pub asleep: Option<f64>,
    /// Explicit credit grants the server sent, per message (credits go back only that way,
    /// as the server sends no data).
    pub grants_per_msg: f64,
    /// Times the client waited for a credit, per message.
    pub credit_waits_per_msg: f64,
    /// Furthest the client fell behind its pacing schedule, seconds.
    pub client_lag_secs: f64,
    /// Solicited messages the client sent (asked for plus forced).
    pub solicited: u64,
    /// Of those, forced by the transport.
    pub forced_solicited: u64,
    /// Descriptors per connection, all connected and idle, over the server's state before it
    /// created anything.
    pub fds_per_conn: f64,
    /// Registered memory per connection as the server's books say, KiB (hub: its receive and
    /// send buffers in all, divided by N; threads: each connection's receive pool and send
    /// buffers).
    pub registered_kib_per_conn: f64,
    /// `VmPin` per connection, KiB.
    pub pinned_kib_per_conn: f64,
    /// `VmRSS` per connection, KiB.
    pub rss_kib_per_conn: f64,
    /// Threads of the server process, all connected.
    pub threads: u64,
    /// RNR NAKs counted by the device during the measurement (`None`: no counters).
    pub rnr: Option<u64>,
    /// Per-peer service in windows of [`Measured::fair_window_secs`].
    pub fairness: Option<Fairness>,
    /// The fairness window, seconds (see [`fair_window`]).
    #[serde(default)]
    pub fair_window_secs: f64,
    /// Receive groups of the server's hubs, all connected (0: not a hub).
    #[serde(default)]
    pub recv_groups: u32,
    /// Messages per second received, first to last.
    pub rate: f64,
    /// Messages in all.
    pub messages: usize,
    /// Messages per second the client offered.
    pub offered_rate: f64,
}

/// The arrival times of every peer, in seconds from `origin`.
fn seconds_since(origin: Instant, times: &[Vec<Instant>]) -> Vec<Vec<f64>> {
    times
        .iter()
        .map(|ts| {
            ts.iter()
                .map(|t| t.duration_since(origin).as_secs_f64())
                .collect()
        })
        .collect()
}

/// What a waiter's statistics say about its sleeps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sleeps {
    /// Woken by the completion channel.
    wakeups: u64,
    /// Woken by something else.
    external: u64,
    asleep: Duration,
}

impl Sleeps {
    fn of(s: &rdmsg::notify::Stats) -> Self {
        Self {
            wakeups: s.wakeups,
            external: s.external_wakeups,
            asleep: s.time_asleep,
        }
    }

    /// What happened since `before`.
    fn since(self, before: Self) -> Self {
        Self {
            wakeups: self.wakeups - before.wakeups,
            external: self.external - before.external,
            asleep: self.asleep.saturating_sub(before.asleep),
        }
    }

    fn plus(self, other: Self) -> Self {
        Self {
            wakeups: self.wakeups + other.wakeups,
            external: self.external + other.external,
            asleep: self.asleep + other.asleep,
        }
    }
}

/// The readings of one measurement, turned into [`Measured`].
struct Readings {
    load: Load,
    connect_secs: f64,
    before: Snapshot,
    idle: Snapshot,
    registered_bytes: u64,
    /// The server process's CPU over the phase.
    cpu: CpuTime,
    /// Sleeps of the serving threads over the phase (the threads': from their start), summed.
    waits: Sleeps,
    /// `waits` starts at `GO` (the hub's does).
    waits_from_go: bool,
    phase_secs: f64,
    grants: u64,
    client: ClientReport,
    rnr: Option<u64>,
    times: Vec<Vec<f64>>,
    recv_groups: u32,
}

impl Readings {
    fn measured(self) -> Measured {
        let n = self.load.conns;
        let msgs = self.load.messages() as f64;
        let (first, last) = self
            .times
            .iter()
            .flatten()
            .fold((f64::INFINITY, 0.0f64), |(a, b), &t| (a.min(t), b.max(t)));
        Measured {
            connect_secs: self.connect_secs,
            cpu_us_per_msg: self.cpu.total() * 1e6 / msgs,
            system_share: share(self.cpu.system, self.cpu.total()),
            wakeups_per_msg: self.waits.wakeups as f64 / msgs,
            wakeups_per_solicited: self.waits.wakeups as f64
                / self.client.sent_solicited.max(1) as f64,
            other_wakeups_per_msg: self.waits.external as f64 / msgs,
            asleep: self
                .waits_from_go
                .then(|| self.waits.asleep.as_secs_f64() / self.phase_secs),
            grants_per_msg: self.grants as f64 / msgs,
            credit_waits_per_msg: self.client.credit_waits as f64 / msgs,
            client_lag_secs: self.client.max_lag_secs,
            solicited: self.client.sent_solicited,
            forced_solicited: self.client.forced_solicited,
            fds_per_conn: per_conn(self.before.fds as u64, self.idle.fds as u64, n),
            registered_kib_per_conn: self.registered_bytes as f64 / 1024.0 / n as f64,
            pinned_kib_per_conn: per_conn(
                self.before.status.pinned_kib,
                self.idle.status.pinned_kib,
                n,
            ),
            rss_kib_per_conn: per_conn(self.before.status.rss_kib, self.idle.status.rss_kib, n),
            threads: self.idle.status.threads,
            rnr: self.rnr,
            fairness: fairness(&self.times, fair_window(&self.load)),
            fair_window_secs: fair_window(&self.load),
            rate: if last > first {
                msgs / (last - first)
            } else {
                0.0
            },
            messages: self.load.messages(),
            offered_rate: self.load.rate,
            recv_groups: self.recv_groups,
        }
    }
}

/// What the server process prints last: its measurement, or why it failed.
const RESULT: &str = "RESULT ";
const ERROR: &str = "ERROR ";

/// Runs one fan-in measurement: `server` serving `load` from a client process, in a server
/// process of its own (`rdmsg-bench fanin-server`), so that its descriptors, threads, memory
/// and CPU time are its own and nothing an earlier measurement left behind.
pub fn measure(server: Server, load: &Load) -> Result<Measured> {
    let exe = std::env::current_exe().context("finding this program")?;
    let mut child = Command::new(exe)
        .arg("fanin-server")
        .args(["--server", server.name()])
        .args(load.to_args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the fan-in server")?;
    let stdout = BufReader::new(child.stdout.take().context("server stdout")?);
    // Its last line, read aside so that a server that hangs can be killed.
    let (tx, rx) = mpsc::channel();
    let reader = thread::spawn(move || {
        let last = stdout
            .lines()
            .map_while(Result::ok)
            .filter(|l| l.starts_with(RESULT) || l.starts_with(ERROR))
            .last();
        let _ = tx.send(last);
    });
    let limit = connect_limit(load.conns) * 2 + phase_limit(load);
    let last = match rx.recv_timeout(limit) {
        Ok(last) => last,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the fan-in server did not finish in {limit:?} (killed)");
        }
    };
    let status = child.wait().context("waiting for the fan-in server")?;
    let _ = reader.join();
    match last {
        Some(l) if l.starts_with(RESULT) => {
            serde_json::from_str(&l[RESULT.len()..]).context("the fan-in server's result")
        }
        Some(l) => bail!("{}", &l[ERROR.len()..]),
        None => bail!("the fan-in server ended ({status}) without a result"),
    }
}

/// `rdmsg-bench fanin-server --server hub|threads --conns N ...`: serves one fan-in and prints
/// `RESULT {json}` (or `ERROR message`).
pub fn server_main(args: &[String]) -> Result<()> {
    let (load, rest) = Load::from_args(args)?;
    let mut server = None;
    for (flag, value) in rest {
        match (flag.as_str(), Server::parse(&value)) {
            ("--server", Some(s)) => server = Some(s),
            _ => bail!("fanin-server: unknown flag {flag} {value}"),
        }
    }
    let server = server.context("fanin-server needs --server hub|threads|groupN")?;
    let mut out = std::io::stdout().lock();
    match serve(server, &load) {
        Ok(m) => writeln!(out, "{RESULT}{}", serde_json::to_string(&m)?)?,
        Err(e) => {
            // One line: the runner keeps it as the failure's note.
            let text = format!("{e:#}").replace('\n', " ");
            writeln!(out, "{ERROR}{text}")?;
            out.flush()?;
            return Err(e);
        }
    }
    out.flush()?;
    Ok(())
}

/// Serves one fan-in in this process.
fn serve(server: Server, load: &Load) -> Result<Measured> {
    let want = fds_needed(load.conns, server);
    let limit = ensure_fd_limit(want)?;
    if limit < want {
        bail!(
            "{} connections need about {want} descriptors; the limit is {limit} \
             (raise it with ulimit -n)",
            load.conns
        );
    }
    let ep = Endpoint::open_default()?;
    let device = ep.context().name().to_owned();
    let rnr_before = rnr_count(&device);
    let before = Snapshot::take()?;
    let mut r = match server {
        Server::Hub => serve_hub(&ep, load, before)?,
        Server::Threads => serve_threads(&ep, load, before)?,
        Server::Group(hubs) => serve_group(&ep, load, before, hubs)?,
    };
    r.rnr = rnr_before.zip(rnr_count(&device)).map(|(b, a)| a - b);
    Ok(r.measured())
}

/// A sample's worth of progress on stderr, every few seconds at most.
struct Progress {
    what: &'static str,
    last: Instant,
}

impl Progress {
    fn new(what: &'static str) -> Self {
        Self {
            what,
            last: Instant::now(),
        }
    }

    fn tick(&mut self, done: usize, of: usize) {
        if self.last.elapsed() >= Duration::from_secs(10) {
            self.last = Instant::now();
            eprintln!("  fanin: {} {done} of {of}", self.what);
        }
    }
}

fn serve_hub(ep: &Endpoint, load: &Load, before: Snapshot) -> Result<Readings> {
    let n = load.conns;
    let mut hub = Hub::new(ep, hub_config(n))?;
    let addr = hub.listen("127.0.0.1:0")?;
    let started = Instant::now();
    let mut client = ClientProc::spawn(addr, load)?;
    let mut watch = Some(await_connected(
        client.stdout.take().context("client output")?,
        || {},
    ));
    // Slot index of each peer -> its arrival times.
    let mut times: Vec<Vec<Instant>> = Vec::new();
    let mut peers: Vec<PeerId> = Vec::with_capacity(n);
    let deadline = started + connect_limit(n);
    let mut progress = Progress::new("hub connections");
    while peers.len() < n {
        // The client may be done before the hub has read every client's last bytes.
        if watch.as_ref().is_some_and(|w| w.is_finished()) {
            client
                .rejoin(watch.take().expect("checked"))
                .with_context(|| format!("with {} of {n} connected", peers.len()))?;
        }
        if Instant::now() >= deadline {
            bail!(
                "{} of {n} connections in {:?}",
                peers.len(),
                connect_limit(n)
            );
        }
        progress.tick(peers.len(), n);
        match hub.next_event(Some(Duration::from_millis(100)))? {
            Some(HubEvent::Connected { peer, .. }) => {
                if times.len() <= peer.index() {
                    times.resize_with(peer.index() + 1, Vec::new);
                }
                peers.push(peer);
            }
            Some(HubEvent::HandshakeFailed { error, .. }) => {
                bail!(
                    "a handshake failed after {} connections: {error}",
                    peers.len()
                )
            }
            Some(HubEvent::Disconnected { peer, failure, .. }) => {
                bail!("{peer} disconnected while connecting: {failure}")
            }
            Some(HubEvent::Message { .. }) => bail!("a message before GO"),
            Some(HubEvent::Read { .. }) => bail!("a read the bench never posted"),
            Some(ev @ (HubEvent::Suspended { .. } | HubEvent::Resumed { .. })) => {
                bail!("no session of the bench resumes: {ev:?}")
            }
            None => {}
        }
    }
    if let Some(w) = watch {
        client.rejoin(w)?;
    }
    let connect_secs = started.elapsed().as_secs_f64();
    // Idle: let the last handshakes' stragglers (the clients' final bytes) arrive.
    if let Some(ev) = hub.next_event(Some(Duration::from_millis(300)))? {
        bail!("unexpected while idle: {ev:?}");
    }
    let idle = Snapshot::take()?;
    let idle_stats = hub.stats();
    let registered_bytes = idle_stats.registered_bytes;

    let total = load.messages();
    let received_before = hub.stats().received;
    let sleeps_before = Sleeps::of(&hub.wait_stats());
    let grants_before = grants_sent(&hub, &peers);
    let cpu_before = CpuTime::process()?;
    let origin = Instant::now();
    client.tell(GO)?;
    let deadline = origin + phase_limit(load);
    let mut got = 0;
    let mut progress = Progress::new("hub messages");
    while got < total {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("{got} of {total} messages in {:?}", phase_limit(load));
        }
        match hub.next_event(Some(left))? {
            Some(HubEvent::Message { peer, msg }) => {
                times[peer.index()].push(Instant::now());
                if msg.len() != load.size {
                    bail!("{peer} sent {} bytes, not {}", msg.len(), load.size);
                }
                got += 1;
                progress.tick(got, total);
            }
            Some(other) => bail!("unexpected during the messages: {other:?}"),
            None => {}
        }
    }
    let cpu = CpuTime::process()?.since(cpu_before);
    let phase_secs = origin.elapsed().as_secs_f64();
    let waits = Sleeps::of(&hub.wait_stats()).since(sleeps_before);
    let grants = grants_sent(&hub, &peers) - grants_before;
    let received = hub.stats().received - received_before;
    if received != total as u64 {
        bail!("the hub counted {received} messages, {total} delivered");
    }
    let report = parse_sent(&client.line()?)?;
    client.tell(CLOSE)?;
    let mut gone = 0;
    let deadline = Instant::now() + connect_limit(n);
    while gone < n {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("{gone} of {n} connections closed in {:?}", connect_limit(n));
        }
        match hub.next_event(Some(left))? {
            Some(HubEvent::Disconnected {
                failure: Failure::PeerClosed,
                ..
            }) => gone += 1,
            Some(HubEvent::Disconnected { peer, failure, .. }) => {
                let client = client.state_within(Duration::from_secs(5));
                bail!(
                    "{peer} ended with {failure} instead of a graceful close, after {gone} \
                     closed; {client}"
                )
            }
            Some(other) => bail!("unexpected while closing: {other:?}"),
            None => {}
        }
    }
    client.closed()?;
    // Only the slots that were connections.
    let times: Vec<Vec<Instant>> = peers
        .iter()
        .map(|p| std::mem::take(&mut times[p.index()]))
        .collect();
    Ok(Readings {
        load: *load,
        connect_secs,
        before,
        idle,
        registered_bytes,
        cpu,
        waits,
        waits_from_go: true,
        phase_secs,
        grants,
        client: report,
        rnr: None,
        times: seconds_since(origin, &times),
        recv_groups: idle_stats.recv_groups,
    })
}

/// Explicit credit grants the hub has sent to `peers`.
fn grants_sent(hub: &Hub, peers: &[PeerId]) -> u64 {
    peers
        .iter()
        .filter_map(|&p| hub.conn_stats(p))
        .map(|s| s.grants_sent)
        .sum()
}

/// Settings of each thread-per-connection server connection: the hub's per-connection
/// settings (2 KiB buffers, 16 send slots), with as many receive buffers as a hub lets one
/// busy connection hold (its `max_credits`), so both offer a peer the same window.
pub fn thread_config() -> Config {
    let hub = HubConfig::default();
    Config {
        recv_depth: hub.max_credits,
        ..hub.conn
    }
}

/// What a connection's thread found.
#[derive(Debug, Default)]
struct ThreadDone {
    times: Vec<Instant>,
    waits: Sleeps,
    grants: u64,
}

/// The shared books of the connection threads: each one's result, how many are still
/// receiving, and the channel on which the last one (or the first failure) tells the
/// measuring thread.
struct Books {
    done: Mutex<Vec<Option<ThreadDone>>>,
    receiving: AtomicUsize,
    tell: Mutex<mpsc::Sender<Result<(), String>>>,
}

impl Books {
    fn finished(&self, i: usize, result: Result<ThreadDone>) {
        let told = match result {
            Ok(d) => {
                self.done.lock().unwrap_or_else(PoisonError::into_inner)[i] = Some(d);
                if self.receiving.fetch_sub(1, Ordering::AcqRel) != 1 {
                    return;
                }
                Ok(())
            }
            Err(e) => Err(format!("connection {i}: {e:#}")),
        };
        let _ = self
            .tell
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(told);
    }
}

/// A connection's thread: `per_conn` messages, then the peer's graceful close.
fn connection_thread(
    mut conn: Connection,
    i: usize,
    per_conn: usize,
    size: usize,
    books: &Books,
) -> Result<()> {
    let received = (|| -> Result<ThreadDone> {
        let sleeps = Sleeps::of(&conn.wait_stats());
        let grants = conn.stats().grants_sent;
        let mut times = Vec::with_capacity(per_conn);
        for _ in 0..per_conn {
            let msg = conn.recv()?;
            times.push(Instant::now());
            if msg.len() != size {
                bail!("{} bytes, not {size}", msg.len());
            }
        }
        Ok(ThreadDone {
            times,
            waits: Sleeps::of(&conn.wait_stats()).since(sleeps),
            grants: conn.stats().grants_sent - grants,
        })
    })();
    let failed = received.is_err();
    books.finished(i, received);
    if failed {
        return Ok(());
    }
    match conn.recv() {
        Err(rdmsg::transport::Error::Connection(Failure::PeerClosed)) => Ok(()),
        Err(e) => Err(e).context("waiting for the client to close"),
        Ok(_) => bail!("a message after the last"),
    }
}

fn serve_threads(ep: &Endpoint, load: &Load, before: Snapshot) -> Result<Readings> {
    let n = load.conns;
    let config = thread_config();
    let listener = ep.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let started = Instant::now();
    let mut client = ClientProc::spawn(addr, load)?;
    // A client that gives up leaves `accept` waiting: wake it with a bad hello.
    let watch = await_connected(client.stdout.take().context("client output")?, move || {
        if let Ok(mut s) = TcpStream::connect(addr) {
            let _ = s.write_all(&[0xff; 64]);
        }
    });
    let (tell, told) = mpsc::channel();
    let books = Arc::new(Books {
        done: Mutex::new((0..n).map(|_| None).collect()),
        receiving: AtomicUsize::new(n),
        tell: Mutex::new(tell),
    });
    let mut threads = Vec::with_capacity(n);
    let mut registered_bytes = 0u64;
    let mut progress = Progress::new("connections accepted");
    for i in 0..n {
        progress.tick(i, n);
        let conn = match listener.accept(&config) {
            Ok(c) => c,
            Err(e) => {
                if watch.is_finished() {
                    let (_, res) = watch.join().expect("the watcher does not panic");
                    res.with_context(|| format!("after {i} of {n} connections"))?;
                }
                return Err(e).with_context(|| format!("accepting connection {} of {n}", i + 1));
            }
        };
        registered_bytes += conn.pool_stats().total as u64 * u64::from(config.buf_size)
            + u64::from(config.send_depth) * u64::from(conn.peer().buf_size);
        let books = Arc::clone(&books);
        let (per, size) = (load.per_conn, load.size);
        let t = thread::Builder::new()
            .name(format!("fanin-{i}"))
            .spawn(move || connection_thread(conn, i, per, size, &books))
            .with_context(|| format!("starting thread {} of {n}", i + 1))?;
        threads.push(t);
    }
    client.rejoin(watch)?;
    let connect_secs = started.elapsed().as_secs_f64();
    thread::sleep(Duration::from_millis(300));
    let idle = Snapshot::take()?;

    let cpu_before = CpuTime::process()?;
    let origin = Instant::now();
    client.tell(GO)?;
    match told.recv_timeout(phase_limit(load)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("{e}"),
        Err(_) => bail!(
            "{} of {n} connections still receiving after {:?}",
            books.receiving.load(Ordering::Acquire),
            phase_limit(load)
        ),
    }
    let cpu = CpuTime::process()?.since(cpu_before);
    let phase_secs = origin.elapsed().as_secs_f64();
    let report = parse_sent(&client.line()?)?;
    client.tell(CLOSE)?;
    for (i, t) in threads.into_iter().enumerate() {
        t.join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            .with_context(|| format!("connection {i}"))?;
    }
    client.closed()?;
    let done: Vec<ThreadDone> =
        std::mem::take(&mut *books.done.lock().unwrap_or_else(PoisonError::into_inner))
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect();
    let waits = done
        .iter()
        .fold(Sleeps::default(), |sum, d| sum.plus(d.waits));
    let grants = done.iter().map(|d| d.grants).sum();
    let times: Vec<Vec<Instant>> = done.into_iter().map(|d| d.times).collect();
    Ok(Readings {
        load: *load,
        connect_secs,
        before,
        idle,
        registered_bytes,
        cpu,
        waits,
        waits_from_go: false,
        phase_secs,
        grants,
        client: report,
        rnr: None,
        times: seconds_since(origin, &times),
        recv_groups: 0,
    })
}

/// What the members of a group hand the measuring thread.
struct GroupBooks {
    connected: AtomicUsize,
    received: AtomicUsize,
    closed: AtomicUsize,
    members: Vec<Mutex<MemberBooks>>,
    failure: Mutex<Option<String>>,
}

/// One member's readings.
#[derive(Default)]
struct MemberBooks {
    /// Arrival times by the peer's slot in the member's hub.
    times: Vec<Vec<Instant>>,
    /// The slots of the member's peers (a peer served nothing still counts).
    peers: Vec<usize>,
    /// The member's wait statistics at its first and at its latest message.
    first_waits: Option<Sleeps>,
    waits: Option<Sleeps>,
}

impl GroupBooks {
    fn fail(&self, what: String) {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(what);
    }

    fn check(&self) -> Result<()> {
        match &*self.failure.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(f) => bail!("{f}"),
            None => Ok(()),
        }
    }

    /// Waits until `count()` reaches `n`, or `limit` passes, or a member failed.
    fn wait_for(
        &self,
        what: &str,
        n: usize,
        limit: Duration,
        count: impl Fn() -> usize,
    ) -> Result<()> {
        let deadline = Instant::now() + limit;
        let mut progress = Progress::new("group");
        loop {
            self.check()?;
            let done = count();
            if done >= n {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("{done} of {n} {what} in {limit:?}");
            }
            progress.tick(done, n);
            thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A [`HubGroup`] of `hubs` members serving the fan-in; the measuring thread only watches
/// (it wakes every 5 ms to look at the counts, which the CPU figure includes).
fn serve_group(ep: &Endpoint, load: &Load, before: Snapshot, hubs: usize) -> Result<Readings> {
    let n = load.conns;
    let size = load.size;
    let books = Arc::new(GroupBooks {
        connected: AtomicUsize::new(0),
        received: AtomicUsize::new(0),
        closed: AtomicUsize::new(0),
        members: (0..hubs).map(|_| Mutex::default()).collect(),
        failure: Mutex::new(None),
    });
    let config = GroupConfig {
        hubs,
        hub: hub_config(n),
        ..GroupConfig::default()
    };
    let group = HubGroup::start(ep, "127.0.0.1:0", config, |index| {
        let books = Arc::clone(&books);
        move |member: &mut Member<'_>, event: HubEvent| match event {
            HubEvent::Connected { peer, .. } => {
                let mut m = books.members[index]
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if m.times.len() <= peer.index() {
                    m.times.resize_with(peer.index() + 1, Vec::new);
                }
                m.peers.push(peer.index());
                drop(m);
                books.connected.fetch_add(1, Ordering::AcqRel);
            }
            HubEvent::Message { peer, msg } => {
                if msg.len() != size {
                    books.fail(format!("{peer} sent {} bytes, not {size}", msg.len()));
                }
                let waits = Sleeps::of(&member.hub.wait_stats());
                let mut m = books.members[index]
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if m.times.len() <= peer.index() {
                    m.times.resize_with(peer.index() + 1, Vec::new);
                }
                m.times[peer.index()].push(Instant::now());
                m.first_waits.get_or_insert(waits);
                m.waits = Some(waits);
                drop(m);
                books.received.fetch_add(1, Ordering::AcqRel);
            }
            HubEvent::Disconnected {
                failure: Failure::PeerClosed,
                ..
            } => {
                books.closed.fetch_add(1, Ordering::AcqRel);
            }
            other => books.fail(format!("member {index}: unexpected {other:?}")),
        }
    })?;
    let addr = group.local_addr();
    let started = Instant::now();
    let mut client = ClientProc::spawn(addr, load)?;
    let watch = await_connected(client.stdout.take().context("client output")?, || {});
    books.wait_for("connections", n, connect_limit(n), || {
        books.connected.load(Ordering::Acquire)
    })?;
    client.rejoin(watch)?;
    let connect_secs = started.elapsed().as_secs_f64();
    thread::sleep(Duration::from_millis(300));
    let idle = Snapshot::take()?;

    let total = load.messages();
    let cpu_before = CpuTime::process()?;
    let origin = Instant::now();
    client.tell(GO)?;
    books.wait_for("messages", total, phase_limit(load), || {
        books.received.load(Ordering::Acquire)
    })?;
    let cpu = CpuTime::process()?.since(cpu_before);
    let phase_secs = origin.elapsed().as_secs_f64();
    let report = parse_sent(&client.line()?)?;
    client.tell(CLOSE)?;
    books.wait_for("connections closed", n, connect_limit(n), || {
        books.closed.load(Ordering::Acquire)
    })?;
    client.closed()?;
    let stats = group
        .stop()
        .into_iter()
        .collect::<rdmsg::transport::Result<Vec<_>>>()?;
    let mut waits = Sleeps::default();
    let mut times = Vec::with_capacity(n);
    for m in &books.members {
        let mut m = m.lock().unwrap_or_else(PoisonError::into_inner);
        if let (Some(first), Some(last)) = (m.first_waits, m.waits) {
            // The wake-up of a member's first message is before its first reading.
            let mut w = last.since(first);
            w.wakeups += 1;
            waits = waits.plus(w);
        }
        times.extend(
            std::mem::take(&mut m.times)
                .into_iter()
                .filter(|t| !t.is_empty()),
        );
    }
    Ok(Readings {
        load: *load,
        connect_secs,
        before,
        idle,
        // After the messages: a member's pool keeps what it grew to.
        registered_bytes: stats.iter().map(|s| s.registered_bytes).sum(),
        cpu,
        waits,
        waits_from_go: false,
        phase_secs,
        grants: 0,
        client: report,
        rnr: None,
        times: seconds_since(origin, &times),
        recv_groups: stats.iter().map(|s| s.recv_groups).sum(),
    })
}

// ----- the client -----

/// Pacing slack: the client sleeps only when this far ahead of its schedule.
const PACE_SLACK: Duration = Duration::from_millis(1);

/// `rdmsg-bench fanin-client --connect ADDR --conns N --per-conn K --batch B --size S
/// --rate R`: the client process of a fan-in (see the module documentation), started by the
/// server process.
pub fn client_main(args: &[String]) -> Result<()> {
    let (load, rest) = Load::from_args(args)?;
    let mut addr = None;
    for (flag, value) in rest {
        match flag.as_str() {
            "--connect" => addr = Some(value.parse::<SocketAddr>().context("--connect")?),
            other => bail!("fanin-client: unknown flag {other}"),
        }
    }
    let addr = addr.context("fanin-client needs --connect ADDR")?;
    ensure_fd_limit(fds_needed(load.conns, Server::Hub))?;
    let ep = Endpoint::open_default()?;
    let mut hub = Hub::new(&ep, hub_config(load.conns))?;
    let ids = (0..load.conns)
        .map(|_| hub.connect(addr))
        .collect::<rdmsg::transport::Result<Vec<PeerId>>>()
        .context("connecting")?;
    let deadline = Instant::now() + connect_limit(load.conns);
    let mut up = 0;
    while up < load.conns {
        let left = deadline.saturating_duration_since(Instant::now());
        match hub.next_event(Some(left))? {
            Some(HubEvent::Connected { .. }) => up += 1,
            Some(other) => bail!("fanin-client: while connecting ({up} up): {other:?}"),
            None => bail!("fanin-client: {up} of {} connected in time", load.conns),
        }
    }
    let mut out = std::io::stdout().lock();
    let mut input = std::io::stdin().lock();
    writeln!(out, "{CONNECTED}")?;
    out.flush()?;
    let cmd = read_line(&mut input)?;
    if cmd != GO {
        bail!("fanin-client: {cmd:?} instead of {GO}");
    }
    let mut payload = vec![0u8; load.size];
    let mut seqs = vec![0u32; load.conns];
    let mut max_lag = Duration::ZERO;
    let started = Instant::now();
    for (i, (c, solicited)) in send_order(&load).enumerate() {
        let due = Duration::from_secs_f64(i as f64 / load.rate);
        let now = started.elapsed();
        if due > now + PACE_SLACK {
            thread::sleep(due - now);
        } else {
            max_lag = max_lag.max(now.saturating_sub(due));
        }
        payload[..4].copy_from_slice(&(c as u32).to_le_bytes());
        payload[4..8].copy_from_slice(&seqs[c].to_le_bytes());
        seqs[c] += 1;
        hub.send(ids[c], &payload, solicited)
            .with_context(|| format!("sending to connection {c}"))?;
    }
    let send_secs = started.elapsed().as_secs_f64();
    let mut report = ClientReport {
        send_secs,
        max_lag_secs: max_lag.as_secs_f64(),
        ..ClientReport::default()
    };
    for &id in &ids {
        let s = hub.conn_stats(id).context("a connection's statistics")?;
        report.sent += s.sent;
        report.sent_solicited += s.sent_solicited;
        report.forced_solicited += s.forced_solicited;
        report.credit_waits += s.credit_waits;
    }
    writeln!(out, "{SENT}{}", serde_json::to_string(&report)?)?;
    out.flush()?;
    let cmd = read_line(&mut input)?;
    if cmd != CLOSE {
        bail!("fanin-client: {cmd:?} instead of {CLOSE}");
    }
    for (i, &id) in ids.iter().enumerate() {
        hub.close(id)
            .with_context(|| format!("closing connection {i} of {}", ids.len()))?;
    }
    // Each close reports its connection gone.
    let mut gone = 0;
    while gone < ids.len() {
        match hub.next_event(Some(Duration::from_secs(10)))? {
            Some(HubEvent::Disconnected { .. }) => gone += 1,
            Some(_) => {}
            None => bail!("fanin-client: {gone} of {} closes reported", ids.len()),
        }
    }
    writeln!(out, "{CLOSED}")?;
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_are_read_by_name() {
        let text = "Name:\trdmsg-bench\nThreads:\t1025\nVmPin:\t  172032 kB\n\
                    VmRSS:\t  301234 kB\nVmRSSx: 7 kB\nbroken line\n";
        assert_eq!(
            ProcStatus::parse(text),
            ProcStatus {
                rss_kib: 301_234,
                pinned_kib: 172_032,
                threads: 1025,
            }
        );
        assert_eq!(ProcStatus::parse(""), ProcStatus::default());
    }

    #[test]
    fn cpu_ticks_are_counted_after_the_name() {
        // A command name with spaces and parentheses, as a process may choose.
        let stat = "4242 (a b) c)) S 1 4242 4242 0 -1 4194560 2000 0 0 0 \
                    731 269 0 0 20 0 3 0 1000 10000 500";
        assert_eq!(stat_cpu_split(stat), Some((731, 269)));
        assert_eq!(stat_cpu_split("4242 (x) S 1 2"), None);
        assert_eq!(stat_cpu_split("no name"), None);
        // This very process.
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(stat_cpu_split(&own).is_some());
    }

    #[test]
    fn a_share_of_nothing_is_zero() {
        assert_eq!(share(1.0, 4.0), 0.25);
        assert_eq!(share(0.0, 0.0), 0.0);
    }

    #[test]
    fn per_connection_costs_are_differences_over_n() {
        assert_eq!(per_conn(100, 1124, 1024), 1.0);
        assert_eq!(per_conn(10, 5, 5), -1.0);
        assert_eq!(per_conn(0, 3, 0), 3.0);
    }

    #[test]
    fn every_connection_gets_whole_batches_in_interleaved_order() {
        assert_eq!(per_conn_messages(32768, 1, 8), 32768);
        assert_eq!(per_conn_messages(32768, 1024, 8), 32);
        assert_eq!(per_conn_messages(1000, 3, 8), 336);
        assert_eq!(per_conn_messages(16, 1024, 8), 16, "two batches at least");
        let load = Load::new(3, 48, 8, 64, 1000.0);
        assert_eq!(
            (load.per_conn, load.messages(), load.solicited()),
            (16, 48, 6)
        );
        let order: Vec<(usize, bool)> = send_order(&load).collect();
        assert_eq!(order.len(), 48);
        assert_eq!(
            &order[..4],
            &[(0, false), (1, false), (2, false), (0, false)]
        );
        // Message 8 of every connection (the last of the first batch) is solicited, in a row.
        assert_eq!(&order[21..24], &[(0, true), (1, true), (2, true)]);
        assert_eq!(order.iter().filter(|o| o.1).count(), 6);
        for c in 0..3 {
            assert_eq!(order.iter().filter(|o| o.0 == c).count(), 16);
        }
        // In any stretch, no connection is more than one message ahead of another.
        for end in 0..order.len() {
            let counts: Vec<usize> = (0..3)
                .map(|c| order[..end].iter().filter(|o| o.0 == c).count())
                .collect();
            assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn fairness_finds_the_worst_whole_window() {
        // Two peers over 3.5 s: even in the first second, 3 vs 1 in the second, 2 vs 2 in the
        // third; the half second after that is not a whole window.
        let a = vec![0.0, 0.5, 1.1, 1.2, 1.3, 2.1, 2.2, 3.4];
        let b = vec![0.1, 0.6, 1.5, 2.5, 2.6, 3.5];
        let f = fairness(&[a, b], 1.0).unwrap();
        assert_eq!((f.windows, f.max, f.min), (3, 3, 1));
        assert_eq!(f.ratio(), 3.0);
        assert!((f.mean - 12.0 / 6.0).abs() < 1e-9, "{f:?}");
        // A peer served nothing in a window: infinitely unfair, and still the worst.
        let f = fairness(&[vec![0.0, 1.5, 2.5], vec![0.2, 2.7]], 1.0).unwrap();
        assert_eq!((f.max, f.min), (1, 0));
        assert!(f.ratio().is_infinite());
        // Shorter than a window, or nobody: nothing to say.
        assert_eq!(fairness(&[vec![0.0, 0.9]], 1.0), None);
        assert_eq!(fairness(&[], 1.0), None);
        assert_eq!(fairness(&[vec![], vec![]], 1.0), None);
    }

    #[test]
    fn a_load_survives_its_flags() {
        let load = Load::new(1024, 32_768, 8, 64, 8192.0);
        let mut args = load.to_args();
        args.extend(["--server".to_owned(), "hub".to_owned()]);
        let (back, rest) = Load::from_args(&args).unwrap();
        assert_eq!(back, load);
        assert_eq!(rest, vec![("--server".to_owned(), "hub".to_owned())]);
        assert!(Load::from_args(&["--conns".to_owned(), "4".to_owned()]).is_err());
        assert!(Load::from_args(&["--conns".to_owned()]).is_err());
    }

    #[test]
    fn the_client_report_survives_its_line() {
        let r = ClientReport {
            sent: 10,
            sent_solicited: 3,
            forced_solicited: 1,
            credit_waits: 2,
            send_secs: 1.5,
            max_lag_secs: 0.25,
        };
        let line = format!("{SENT}{}", serde_json::to_string(&r).unwrap());
        assert_eq!(parse_sent(&line).unwrap(), r);
        assert!(parse_sent("CLOSED").is_err());
    }

    #[test]
    fn the_thread_server_matches_the_hub_per_connection() {
        let c = thread_config();
        let h = HubConfig::default();
        assert_eq!(
            (c.buf_size, c.send_depth, c.recv_depth),
            (h.conn.buf_size, h.conn.send_depth, h.max_credits)
        );
    }
}
