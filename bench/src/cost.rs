//! The deterministic cost section: user-space instructions, system calls and heap allocations
//! per round trip of each layer, counted by valgrind's callgrind inside the VM, against
//! rdma-core's `ibv_rc_pingpong -e` in the same run.
//!
//! Every subject is a ping-pong of a small message between two processes on the device's
//! loopback, both sides asleep on completion events. One side runs under callgrind, twice: for
//! `n` round trips and for `3n`. The difference of the two profiles, divided by `2n`, is the
//! cost of a round trip in steady state: process start, connection set-up, warm-up and teardown
//! cancel out. Instruction counts do not depend on time, but in event mode they do depend on
//! how completions happen to batch (one wake-up for a send and a receive completion, or two),
//! which moves them by some percent from run to run; allocation counts do not move.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdmsg::msg::{Hub, HubEvent, Session, SessionConfig, RESUME_KEEP};
use rdmsg::tokio::AsyncSession;
use rdmsg::transport::{Config, Connection, Endpoint, Failure, HubConfig};
use serde::{Deserialize, Serialize};

use crate::callgrind::{self, PerUnit};
use crate::perftest::Perftest;

/// The small message of the typed subjects: 14 bytes of fields.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    /// Sequence number.
    pub seq: u64,
    /// A reading.
    pub value: f32,
    /// Who sent it.
    pub sensor: u16,
}
rdmsg::msg::message!(Tick, tag = "rdmsg.bench.Tick");

/// How long the unmeasured side of an rdmsg subject holds each message, so that the measured
/// side is asleep on its completion channel when it comes. Without it a count depends on how
/// often the message happened to be there already when the callgrind-slowed side first looked:
/// `AsyncSession` gave 5,200 to 8,100 instructions per round trip in four runs (with nearly no
/// completion wake-ups), and failed its ceiling on a slower machine; held 3 ms (or 10 ms), it
/// gave 10,800 to 11,000, one wake-up per round trip. A receiver that sleeps is also the case
/// this library is for. (rdmsg-tokio's offload pool keeps its last worker: before, a run
/// longer than the 10 s a worker idles (at 10 ms, or a slow run at 3 ms: CI saw 0.047
/// allocations per round trip once) started a new thread for the close, and its allocations
/// counted against the round trips.)
pub const REPLY_DELAY: Duration = Duration::from_millis(3);

/// Payload bytes of the untyped subjects (`ibv_rc_pingpong -s 8`).
const RAW_SIZE: usize = 8;

/// A layer whose round trip is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject {
    /// rdma-core's `ibv_rc_pingpong -e`, the anchor (client measured).
    IbvRcPingpong,
    /// rdmsg's `rc_pingpong -e` example: verbs-core and notify alone (client measured).
    RcPingpong,
    /// Raw bytes through a transport `Connection` (client measured).
    Connection,
    /// A typed [`Tick`] through a `Session` (client measured).
    Session,
    /// The same keeping copies of what the peer has not taken
    /// (`SessionConfig::keep_unconfirmed`, as a resumable session does).
    SessionKeeping,
    /// The same, both sides resumable (`Config::resume_window`): resume support must add
    /// nothing per message to the copies while nothing fails.
    SessionResumable,
    /// A hub with one peer, echoing [`Tick`]s to a `Session` (the hub measured).
    Hub,
    /// A tokio `AsyncSession` on a current-thread runtime against a blocking echo (client
    /// measured).
    Tokio,
}

impl Subject {
    /// Every subject, the anchor first.
    pub const ALL: [Subject; 8] = [
        Subject::IbvRcPingpong,
        Subject::RcPingpong,
        Subject::Connection,
        Subject::Session,
        Subject::SessionKeeping,
        Subject::SessionResumable,
        Subject::Hub,
        Subject::Tokio,
    ];

    /// The subject's name in samples and the report.
    pub fn name(self) -> &'static str {
        match self {
            Subject::IbvRcPingpong => "ibv_rc_pingpong -e",
            Subject::RcPingpong => "rc_pingpong -e",
            Subject::Connection => "Connection",
            Subject::Session => "Session",
            Subject::SessionKeeping => "Session (copies)",
            Subject::SessionResumable => "Session (resume)",
            Subject::Hub => "Hub",
            Subject::Tokio => "AsyncSession",
        }
    }

    /// The goal for its instructions per round trip, as a ratio to `ibv_rc_pingpong -e`.
    pub fn goal(self) -> Option<f64> {
        match self {
            Subject::IbvRcPingpong => None,
            Subject::RcPingpong => Some(1.05),
            Subject::Connection => Some(1.25),
            Subject::Session | Subject::SessionKeeping | Subject::SessionResumable => Some(1.5),
            Subject::Hub | Subject::Tokio => Some(1.6),
        }
    }

    /// The subject named `name` (its [`Subject::name`] or its `cost-peer` name).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|s| s.name() == name || s.peer_name() == name)
    }

    fn peer_name(self) -> &'static str {
        match self {
            Subject::IbvRcPingpong => "ibv_rc_pingpong",
            Subject::RcPingpong => "rc_pingpong",
            Subject::Connection => "connection",
            Subject::Session => "session",
            Subject::SessionKeeping => "session-copies",
            Subject::SessionResumable => "session-resume",
            Subject::Hub => "hub",
            Subject::Tokio => "tokio",
        }
    }

    /// Whether the measured side sleeps on every round trip: its peer (rdmsg's `cost-peer`,
    /// or `rc_pingpong --hold-us`) holds each message for [`REPLY_DELAY`]. `ibv_rc_pingpong`
    /// cannot be told to, and needs no telling: in event mode it calls the blocking
    /// `ibv_get_cq_event` for every completion, sleeping or not.
    fn sleeps_every_round_trip(self) -> bool {
        self != Subject::IbvRcPingpong
    }

    /// Whether the server side is the one measured.
    fn measures_server(self) -> bool {
        self == Subject::Hub
    }
}

/// One subject's cost per round trip.
#[derive(Debug, Clone, PartialEq)]
pub struct Cost {
    /// The subject.
    pub subject: Subject,
    /// Instructions, syscalls, allocations and top functions per round trip.
    pub per_rt: PerUnit,
    /// Wake-ups per round trip of the measured side, where it reports them.
    pub wakeups: Option<f64>,
}

/// Measures `subject`: profiles of `n` and `3n` round trips, their difference per round trip.
pub fn measure(subject: Subject, n: u64, perf: &Perftest, scratch: &Path) -> Result<Cost> {
    let (small, w1) = profile(subject, n, perf, scratch)?;
    let (large, w3) = profile(subject, 3 * n, perf, scratch)?;
    if small.allocations == 0 {
        // Every process allocates while it starts: none counted means the profile does not
        // show the allocator under the names looked for, and "no allocation" would be vacuous.
        bail!(
            "{}: the profile shows no call to the allocator at all",
            subject.name()
        );
    }
    let per_rt = callgrind::per_unit(&small, &large, 2 * n, 12);
    let wakeups = w1
        .zip(w3)
        .map(|(a, b)| (b as f64 - a as f64) / (2 * n) as f64);
    Ok(Cost {
        subject,
        per_rt,
        wakeups,
    })
}

/// Runs `n` round trips of `subject` with its measured side under callgrind; returns the
/// profile and the measured side's wake-ups if it printed them.
fn profile(
    subject: Subject,
    n: u64,
    perf: &Perftest,
    scratch: &Path,
) -> Result<(callgrind::Profile, Option<u64>)> {
    let port = crate::perftest::next_port();
    let out = scratch.join(format!("callgrind.{}.{n}.{port}", subject.peer_name()));
    let (program, args) = match subject {
        Subject::IbvRcPingpong | Subject::RcPingpong => {
            let program = if subject == Subject::RcPingpong {
                crate::sibling_program("rc_pingpong")?
            } else {
                "ibv_rc_pingpong".into()
            };
            let args: Vec<String> = [
                "-d",
                &perf.device,
                "-g",
                &perf.gid_index.to_string(),
                "-p",
                &port.to_string(),
                "-n",
                &n.to_string(),
                "-s",
                &RAW_SIZE.to_string(),
                "-e",
            ]
            .map(String::from)
            .to_vec();
            (program, args)
        }
        _ => {
            let program = std::env::current_exe()?.to_string_lossy().into_owned();
            let args = [
                "cost-peer",
                subject.peer_name(),
                "--port",
                &port.to_string(),
                "--iters",
                &n.to_string(),
            ]
            .map(String::from)
            .to_vec();
            (program, args)
        }
    };
    let valgrind = |mut cmd: Vec<String>| -> Vec<String> {
        let mut v: Vec<String> = [
            "valgrind",
            "--tool=callgrind",
            "--collect-systime=yes",
            "--error-exitcode=0",
        ]
        .map(String::from)
        .to_vec();
        v.push(format!("--callgrind-out-file={}", out.display()));
        v.append(&mut cmd);
        v
    };
    let mut server: Vec<String> = std::iter::once(program.clone())
        .chain(args.iter().cloned())
        .collect();
    let mut client = server.clone();
    client.push("127.0.0.1".into());
    if subject == Subject::RcPingpong {
        // The unmeasured side holds each message (see `REPLY_DELAY`).
        server.extend(["--hold-us".into(), REPLY_DELAY.as_micros().to_string()]);
    }
    if subject.measures_server() {
        server = valgrind(server);
    } else {
        client = valgrind(client);
    }
    let outputs = crate::perftest::run_commands(&server, &client, Duration::from_secs(300))?;
    let measured = if subject.measures_server() {
        &outputs.server
    } else {
        &outputs.client
    };
    let text = std::fs::read_to_string(&out)
        .with_context(|| format!("reading the profile {}", out.display()))?;
    if std::env::var_os("RDMSG_KEEP_PROFILES").is_none() {
        let _ = std::fs::remove_file(&out);
    }
    let profile = callgrind::parse(&text).with_context(|| format!("parsing {}", out.display()))?;
    Ok((profile, wakeups_in(measured)))
}

/// The wake-ups a side printed: `wakeups N` (cost-peer) or `N wake-ups, ...` (rc_pingpong).
fn wakeups_in(output: &str) -> Option<u64> {
    output.lines().find_map(|l| {
        if let Some(n) = l.strip_prefix("wakeups ") {
            return n.trim().parse().ok();
        }
        let (n, rest) = l.trim().split_once(' ')?;
        rest.starts_with("wake-ups").then(|| n.parse().ok())?
    })
}

/// `rdmsg-bench cost-peer SUBJECT --port P --iters N [HOST]`: one side of a subject's
/// ping-pong; the server without `HOST`. The measured side prints `wakeups N` at the end.
pub fn peer_main(args: &[String]) -> Result<()> {
    let mut it = args.iter();
    let subject = it
        .next()
        .and_then(|s| Subject::parse(s))
        .context("cost-peer needs a subject: connection, session, hub or tokio")?;
    let (mut port, mut iters, mut host) = (None, None, None);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--port" => port = Some(it.next().context("--port")?.parse::<u16>()?),
            "--iters" => iters = Some(it.next().context("--iters")?.parse::<u64>()?),
            h => host = Some(h.to_owned()),
        }
    }
    let port = port.context("--port")?;
    let iters = iters.context("--iters")?;
    let endpoint = Endpoint::open_default()?;
    let config = match subject {
        Subject::SessionResumable => Config {
            resume_window: Some(Duration::from_secs(60)),
            ..Config::default()
        },
        _ => Config::default(),
    };
    match host {
        None => serve(subject, &endpoint, &config, port),
        Some(host) => {
            let addr = format!("{host}:{port}");
            match subject {
                Subject::Hub => client_session(
                    Session::new(connect(&endpoint, &config, &addr)?),
                    iters,
                    false,
                ),
                Subject::Session | Subject::SessionKeeping | Subject::SessionResumable => {
                    let conn = connect(&endpoint, &config, &addr)?;
                    let s = match subject {
                        Subject::SessionKeeping => Session::with_config(
                            conn,
                            SessionConfig {
                                keep_unconfirmed: Some(RESUME_KEEP),
                                ..SessionConfig::default()
                            },
                        ),
                        _ => Session::new(conn),
                    };
                    if subject == Subject::SessionResumable && !s.is_resumable() {
                        bail!("the session is not resumable");
                    }
                    client_session(s, iters, true)
                }
                Subject::Connection => client_connection(&endpoint, &config, &addr, iters),
                Subject::Tokio => client_tokio(&endpoint, &addr, iters),
                _ => bail!("{} is not a cost-peer subject", subject.name()),
            }
        }
    }
}

/// Connects, retrying while the server is not listening yet (under valgrind it takes seconds
/// to start).
fn connect(endpoint: &Endpoint, config: &Config, addr: &str) -> Result<Connection> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match endpoint.connect(addr, config) {
            Ok(conn) => return Ok(conn),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e).with_context(|| format!("connecting to {addr}")),
        }
    }
}

fn serve(subject: Subject, endpoint: &Endpoint, config: &Config, port: u16) -> Result<()> {
    let addr = format!("0.0.0.0:{port}");
    match subject {
        Subject::Hub => {
            let mut hub = Hub::new(endpoint, HubConfig::default())?;
            hub.listen(addr.as_str())?;
            loop {
                match hub.recv()? {
                    HubEvent::Message { peer, msg } => {
                        let t: Tick = msg.decode()?;
                        drop(msg);
                        hub.send(peer, &t)?;
                    }
                    HubEvent::Disconnected { .. } => break,
                    HubEvent::Connected { .. } => {}
                    other => bail!("the hub got {other:?}"),
                }
            }
            println!("wakeups {}", hub.transport().wait_stats().wakeups);
            Ok(())
        }
        Subject::Connection => {
            let listener = endpoint.listen(addr.as_str())?;
            let mut conn = listener.accept(config)?;
            loop {
                match conn.recv() {
                    Ok(m) => {
                        thread::sleep(REPLY_DELAY);
                        conn.send(&m, true)?
                    }
                    Err(rdmsg::transport::Error::Connection(Failure::PeerClosed)) => break,
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        }
        Subject::Session | Subject::SessionKeeping | Subject::SessionResumable | Subject::Tokio => {
            let listener = endpoint.listen(addr.as_str())?;
            let mut s = Session::new(listener.accept(config)?);
            loop {
                match s.recv() {
                    Ok(env) => {
                        let t: Tick = env.decode()?;
                        drop(env);
                        thread::sleep(REPLY_DELAY);
                        s.send(&t)?;
                    }
                    Err(e) if e.is_peer_closed() => break,
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        }
        _ => bail!("{} is not a cost-peer subject", subject.name()),
    }
}

fn tick(seq: u64) -> Tick {
    Tick {
        seq,
        value: 21.5,
        sensor: 7,
    }
}

/// `print`: the client is the measured side (else the hub is, and the client holds each ping for
/// [`REPLY_DELAY`]).
fn client_session(mut s: Session, iters: u64, print: bool) -> Result<()> {
    for seq in 0..iters {
        if !print {
            thread::sleep(REPLY_DELAY);
        }
        s.send(&tick(seq))?;
        let back: Tick = s.recv()?.decode()?;
        if back.seq != seq {
            bail!("sent {seq}, got {} back", back.seq);
        }
    }
    if print {
        println!("wakeups {}", s.connection().wait_stats().wakeups);
    }
    s.close()?;
    Ok(())
}

fn client_connection(endpoint: &Endpoint, config: &Config, addr: &str, iters: u64) -> Result<()> {
    let mut conn = connect(endpoint, config, addr)?;
    let ping = [0x5au8; RAW_SIZE];
    for _ in 0..iters {
        conn.send(&ping, true)?;
        let back = conn.recv()?;
        if back.len() != RAW_SIZE {
            bail!("sent {RAW_SIZE} bytes, got {} back", back.len());
        }
    }
    println!("wakeups {}", conn.wait_stats().wakeups);
    conn.close()?;
    Ok(())
}

fn client_tokio(endpoint: &Endpoint, addr: &str, iters: u64) -> Result<()> {
    // Connecting and closing run on the runtime's blocking pool. Its worker, idle during the
    // round trips, would exit after tokio's default 10 s: a longer run under callgrind (900
    // round trips take about that on a slow machine) then starts a new thread for the close,
    // and its allocations count against the round trips. Kept for the whole run, only the
    // round trips differ between the two runs.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_keep_alive(Duration::from_secs(3600))
        .build()?;
    rt.block_on(async {
        let session = {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                match AsyncSession::connect(
                    endpoint,
                    addr.to_owned(),
                    Config::default(),
                    rdmsg::msg::SessionConfig::default(),
                )
                .await
                {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    Err(e) => return Err(e).with_context(|| format!("connecting to {addr}")),
                }
            }
        };
        for seq in 0..iters {
            session.send(&tick(seq)).await?;
            let back: Tick = session.recv().await?.decode()?;
            if back.seq != seq {
                bail!("sent {seq}, got {} back", back.seq);
            }
        }
        println!("wakeups {}", session.wakeups());
        session.close().await?;
        Ok(())
    })
}

/// Instructions per round trip above which `cost-check` fails, per layer. rdmsg's layers are
/// counted asleep on every message (see [`REPLY_DELAY`]), where three runs agree within 0.2 %:
/// each ceiling is that count, measured on Linux 6.1 at the commit that set it, plus 15 %
/// (rc_pingpong 3,350; Connection 4,812; Session 6,897; Hub 10,310; AsyncSession 10,845). Work
/// added to every round trip crosses a ceiling; timing alone does not. (Before the hold, a
/// count moved by up to 50 % with how often the measured side happened to sleep, and a check
/// on a slower machine failed with nothing changed.)
pub fn ceiling(subject: Subject) -> Option<f64> {
    match subject {
        Subject::IbvRcPingpong => None,
        Subject::RcPingpong => Some(3850.0),
        Subject::Connection => Some(5550.0),
        Subject::Session | Subject::SessionKeeping | Subject::SessionResumable => Some(7950.0),
        Subject::Hub => Some(11850.0),
        Subject::Tokio => Some(12500.0),
    }
}

/// Most instructions per round trip a resumable `Session` may add to a plain one while
/// nothing fails: the runs of one layer agree within a few instructions, so this is noise,
/// not work per message.
pub const RESUME_EXTRA: f64 = 12.0;

/// Heap allocations per round trip at or above which `cost-check` fails: none is the goal; a
/// container that doubles now and then over the run stays below it.
pub const MAX_ALLOCATIONS: f64 = 0.01;

/// Runs of each layer `cost-check` takes the smallest count of: two, since runs agree within
/// 0.2 % and a third cost CI about four minutes of callgrind under emulation.
pub const CHECK_RUNS: usize = 2;

/// `rdmsg-bench cost-check [--iters N] [--runs K]`: measures every rdmsg layer `K` times
/// (`N` and `3N` round trips, 300 and 2 by default) and fails if one allocates per message in
/// any run or the smallest of its instruction counts is above its [`ceiling`]. For `cargo
/// xtask test`.
pub fn check_main(args: &[String], perf: &Perftest) -> Result<bool> {
    let mut iters = 300;
    let mut runs = CHECK_RUNS;
    let mut only: Option<Subject> = None;
    let mut verbose = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--iters" => iters = it.next().context("--iters needs a value")?.parse()?,
            "--runs" => runs = it.next().context("--runs needs a value")?.parse()?,
            "--verbose" => verbose = true,
            "--only" => {
                let name = it.next().context("--only needs a layer")?;
                only = Some(
                    Subject::parse(name)
                        .with_context(|| format!("cost-check: no layer named {name:?}"))?,
                );
            }
            other => bail!("cost-check: unknown argument {other}"),
        }
    }
    if runs == 0 || iters == 0 {
        bail!("cost-check: --iters and --runs must be positive");
    }
    if !have_valgrind() {
        bail!("valgrind is not installed: the cost check counts with callgrind");
    }
    let mut ok = true;
    // The smallest count of each layer measured, for the comparison of resume support.
    let mut bests = Vec::new();
    for subject in Subject::ALL {
        if subject == Subject::IbvRcPingpong || only.is_some_and(|o| o != subject) {
            continue;
        }
        let mut costs = Vec::with_capacity(runs);
        for _ in 0..runs {
            costs.push(measure(subject, iters, perf, &scratch_dir())?);
        }
        if verbose {
            for c in &costs {
                println!(
                    "cost: {} run: {:.0} instructions, {:.2} syscalls, {:.2} clock reads",
                    subject.name(),
                    c.per_rt.instructions,
                    c.per_rt.syscalls,
                    c.per_rt.clock_reads
                );
                for (f, v) in &c.per_rt.top {
                    println!("cost:     {v:>8.1} {f}");
                }
            }
        }
        let counts: Vec<String> = costs
            .iter()
            .map(|c| format!("{:.0}", c.per_rt.instructions))
            .collect();
        let best = costs
            .iter()
            .min_by(|a, b| a.per_rt.instructions.total_cmp(&b.per_rt.instructions))
            .expect("at least one run");
        let allocations = costs
            .iter()
            .map(|c| c.per_rt.allocations)
            .fold(0.0, f64::max);
        let limit = ceiling(subject).unwrap_or(f64::INFINITY);
        // A count taken while the subject did not sleep on every reply is not the count the
        // ceiling was set for (see `REPLY_DELAY`): say so rather than judge it.
        let unslept = costs
            .iter()
            .filter_map(|c| c.wakeups)
            .filter(|&w| subject.sleeps_every_round_trip() && w < 0.9)
            .count();
        if unslept > 0 {
            println!(
                "cost: {}: {unslept} of {runs} runs woke less than once per round trip although each reply comes {} ms late: the reply delay is too short for this machine",
                subject.name(),
                REPLY_DELAY.as_millis()
            );
            ok = false;
        }
        bests.push((subject, best.per_rt.instructions));
        let instr_ok = best.per_rt.instructions <= limit;
        let alloc_ok = allocations < MAX_ALLOCATIONS;
        ok &= instr_ok && alloc_ok;
        let wakeups: Vec<String> = costs
            .iter()
            .filter_map(|c| c.wakeups.map(|w| format!("{w:.2}")))
            .collect();
        let wakeups = if wakeups.is_empty() {
            String::new()
        } else {
            format!("; wake-ups {}", wakeups.join(", "))
        };
        println!(
            "cost: {:<16} {:>6.0} instructions per round trip (smallest of {}{wakeups}; ceiling {limit:.0}) {}, {:.3} allocations {}",
            subject.name(),
            best.per_rt.instructions,
            counts.join(", "),
            if instr_ok { "ok" } else { "TOO MANY" },
            allocations,
            if alloc_ok { "ok" } else { "ALLOCATES PER MESSAGE" },
        );
        if !instr_ok || !alloc_ok {
            for (f, v) in best.per_rt.top.iter().take(8) {
                println!("cost:     {v:>8.1} {f}");
            }
        }
    }
    let best = |s: Subject| bests.iter().find(|(b, _)| *b == s).map(|(_, c)| *c);
    if let (Some(plain), Some(keeping), Some(resumable)) = (
        best(Subject::Session),
        best(Subject::SessionKeeping),
        best(Subject::SessionResumable),
    ) {
        let extra = resumable - keeping;
        let fine = extra <= RESUME_EXTRA;
        println!(
            "cost: resume support adds {extra:+.0} instructions per round trip to a Session keeping copies (at most {RESUME_EXTRA:.0}) {}; the copies themselves {:+.0}",
            if fine { "ok" } else { "FAILED" },
            keeping - plain
        );
        ok &= fine;
    }
    Ok(ok)
}

/// Where profiles go: `$RDMSG_SCRATCH` in the VM, else the temporary directory.
pub fn scratch_dir() -> PathBuf {
    std::env::var_os("RDMSG_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// Whether valgrind can be run.
pub fn have_valgrind() -> bool {
    Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
