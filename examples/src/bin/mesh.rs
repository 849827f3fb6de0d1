//! One host of a mesh: every host exchanges typed messages with every other over one [`Hub`]
//! (one thread), and checks everything it gets for loss, duplication, order and content
//! (see [`rdmsg_examples::mesh`]). `cargo xtask cluster` runs one per VM, on a virtual switch,
//! with `tc netem` faults; the device tests run several on one VM's rxe0.
//!
//! ```text
//! mesh --id I --hosts ADDR1,ADDR2,... [--seconds D] [--netem "ARGS" --netdev DEV]
//!      [--die-after S] [--cut-after S --cut-ms M] [--may-lose J,...] [--ack-timeout T]
//!      [--keepalive S] [--cm] [--resume-window W] [--cuts N --cut-every E]
//! ```
//!
//! Host `I` (1-based) listens on its own entry's port and connects to every host before it in
//! the list; the others connect to it. Once connected to all, it sends to each, as fast as
//! their credits allow, for `D` seconds (default 20): samples in batches of 8 (the last
//! solicited), queries (each must be answered once, correctly) and alerts, numbered per
//! stream; then `Done` with the count. A host closes a connection it made once both `Done`s
//! crossed and every query is answered; the other side waits for that close.
//!
//! Faults it makes itself (it runs as root in its VM): `--netem` is applied to `DEV` with
//! `tc` before anything else; `--cut-after S --cut-ms M` drops every packet leaving `DEV` for
//! `M` ms, `S` seconds into sending (a link cut shorter than the retry budget: no connection
//! may fail); `--die-after S` prints `mesh: ready-to-die` `S` seconds into sending, for the
//! harness to kill the VM. Hosts listed in `--may-lose` may vanish (their streams are then not
//! counted); any other failure is an error. `--ack-timeout T` is the queue pairs' local ACK
//! timeout exponent (4.096 µs × 2^T; default 16, 268 ms: with 7 retries a budget of about
//! 2.1 s). `--keepalive S` is `Config::keepalive` (default 10 s), which bounds the hub's
//! liveness probes of each peer host (a hub's bootstrap streams have no TCP keepalive).
//! `--cm` connects through the RDMA connection manager instead of the TCP bootstrap (every
//! host listens on its own entry, which must be its RDMA device's address).
//! `--resume-window W` makes every session resumable (`Config::resume_window`, W seconds):
//! a cut longer than the keepalive then suspends sessions instead of failing them, and they
//! resume once the link is back, nothing lost or repeated. `--cuts N --cut-every E` cuts
//! the link N times, E seconds apart (a flap); the cutting host reports, after each cut,
//! how long after the link came back its last session resumed
//! (`mesh: resumed after_restore_ms=...`).
//!
//! Lines: `mesh: connected id=J ...` per peer, `mesh: peer-lost id=J failure="..."` when one
//! fails, `mesh: cut ...`, and at the end one report:
//!
//! ```text
//! mesh: id=1 hosts=4 peers=3 lost_peers=0 sent=... received=... bytes_received=... secs=...
//!       msgs_per_s=... bytes_per_s=... lost=0 duplicated=0 reordered=0 corrupt=0
//!       unanswered=0 wrong_answers=0 hw_<counter>=... ok=1
//! ```
//!
//! `hw_*` are the increases of rxe0's hardware counters (retransmissions among them) while it
//! ran. The exit code is non-zero on any loss, duplication, disorder, corruption, unanswered
//! query or unexpected failure.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use clap::Parser;
use rdmsg::{message, Endpoint, Envelope, Failure, Hub, HubConfig, HubEvent, PeerId};
use rdmsg_examples::mesh::{self, Inbound, Kind, Queries};
use serde::{Deserialize, Serialize};

/// First message on a connection, from the host that made it: who it is.
#[derive(Debug, Serialize, Deserialize)]
struct Join {
    from: u16,
    hosts: u16,
}
message!(Join, tag = "rdmsg.mesh.Join");

/// Telemetry: unsolicited but for the last of a batch.
#[derive(Debug, Serialize, Deserialize)]
struct Sample {
    seq: u64,
    body: Vec<u8>,
}
message!(Sample, tag = "rdmsg.mesh.Sample", solicited = false);

/// A query the receiver must answer.
#[derive(Debug, Serialize, Deserialize)]
struct Query {
    seq: u64,
    operands: Vec<u64>,
}
message!(Query, tag = "rdmsg.mesh.Query");

/// The answer to query `seq` (outside the sequence).
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    seq: u64,
    sum: u64,
}
message!(Answer, tag = "rdmsg.mesh.Answer");

/// An alert: solicited on its own.
#[derive(Debug, Serialize, Deserialize)]
struct Alert {
    seq: u64,
    level: u8,
}
message!(Alert, tag = "rdmsg.mesh.Alert");

/// The end of a stream: `sent` messages came before it.
#[derive(Debug, Serialize, Deserialize)]
struct Done {
    sent: u64,
}
message!(Done, tag = "rdmsg.mesh.Done");

/// One host of a mesh: exchanges typed, checked messages with every other host over one hub
/// (one thread) and ends with one `mesh: key=value ...` report line; the exit code is
/// non-zero on any loss, duplication, disorder, corruption, unanswered query or unexpected
/// failure.
///
/// Host I (1-based) listens on its own entry's port and connects to every host before it in
/// the list; the others connect to it.
#[derive(Debug, Parser)]
#[command(name = "mesh", args_override_self = true)]
struct Options {
    /// This host's number in --hosts (1-based)
    #[arg(long, value_name = "I")]
    id: u16,
    /// Every host's address, this one's included, comma-separated (at least two)
    // A qualified `Vec`: one value split here, not one value per occurrence.
    #[arg(long, value_name = "ADDR1,ADDR2,...", value_parser = addresses)]
    hosts: ::std::vec::Vec<String>,
    /// How long to send to every peer
    #[arg(long, value_name = "D", default_value_t = 20.0)]
    seconds: f64,
    /// `tc netem` arguments applied to DEV before anything else (empty: none)
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    netem: Option<String>,
    /// The network device of --netem and --cut-after
    #[arg(long, value_name = "DEV", default_value = "eth0")]
    netdev: String,
    /// Print `mesh: ready-to-die` S seconds into sending, for the harness to kill this host
    #[arg(long, value_name = "S")]
    die_after: Option<f64>,
    /// Drop every packet leaving DEV for --cut-ms, S seconds into sending
    #[arg(long, value_name = "S")]
    cut_after: Option<f64>,
    /// How long the cut of --cut-after lasts
    #[arg(long, value_name = "M", default_value_t = 1000)]
    cut_ms: u64,
    /// Hosts that may vanish (their streams are then not counted), comma-separated
    // A qualified `Vec`: one value split here, not one value per occurrence.
    #[arg(long, value_name = "J,...", value_parser = host_ids, default_value = "",
          hide_default_value = true)]
    may_lose: ::std::vec::Vec<u16>,
    /// The queue pairs' local ACK timeout exponent (4.096 µs × 2^T)
    #[arg(long, value_name = "T", default_value_t = 16)]
    ack_timeout: u8,
    /// Config::keepalive, the limit of the hub's liveness probes, in seconds
    #[arg(long, value_name = "S", default_value_t = 10)]
    keepalive: u64,
    /// Connect through the RDMA connection manager instead of the TCP bootstrap
    #[arg(long)]
    cm: bool,
    /// Config::resume_window in seconds: sessions survive a cut shorter than it
    #[arg(long, value_name = "W")]
    resume_window: Option<u64>,
    /// How many times --cut-after cuts the link
    #[arg(long, value_name = "N", default_value_t = 1)]
    cuts: u32,
    /// Seconds from one cut's start to the next one's
    #[arg(long, value_name = "E", default_value_t = 10.0)]
    cut_every: f64,
}

/// `--hosts`: addresses separated by commas.
fn addresses(list: &str) -> Result<Vec<String>, std::convert::Infallible> {
    Ok(list.split(',').map(str::to_owned).collect())
}

/// `--may-lose`: host numbers separated by commas (none if empty).
fn host_ids(list: &str) -> Result<Vec<u16>, std::num::ParseIntError> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect()
}

fn parse() -> Result<Options> {
    let mut o = Options::parse();
    o.netem = o.netem.filter(|s| !s.trim().is_empty());
    ensure!(o.hosts.len() >= 2, "--hosts needs at least two addresses");
    ensure!(
        (1..=o.hosts.len()).contains(&usize::from(o.id)),
        "--id must be between 1 and the number of hosts"
    );
    ensure!(o.seconds > 0.0, "--seconds must be positive");
    Ok(o)
}

/// Where a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not connected yet (we connect at `retry_at`, if it is ours to make).
    Waiting,
    /// Our connection's handshake is under way, or it was accepted and its `Join` is awaited.
    Handshake,
    Up,
    /// Both `Done`s crossed and every query answered; the close is made or awaited.
    Finished,
    /// Failed before it finished.
    Lost,
}

/// One peer host, as this host sees it.
#[derive(Debug)]
struct Peer {
    id: u16,
    addr: String,
    peer: Option<PeerId>,
    state: State,
    retry_at: Instant,
    connect_errors: u32,
    /// Next sequence number of our stream to it.
    next_seq: u64,
    done_sent: bool,
    inbound: Inbound,
    queries: Queries,
    /// Answers owed, sent as credits allow.
    answers: VecDeque<Answer>,
    bytes_received: u64,
    failure: Option<String>,
}

impl Peer {
    fn ours_to_connect(&self, me: u16) -> bool {
        self.id < me
    }

    /// Lost, or finished and its connection closed: nothing more will come of it.
    fn ended(&self) -> bool {
        self.state == State::Lost || (self.state == State::Finished && self.peer.is_none())
    }

    /// `msg` decoded; one that does not decode counts as corrupt.
    fn decode<M: rdmsg::Message + serde::de::DeserializeOwned>(
        &mut self,
        msg: &Envelope,
    ) -> Option<M> {
        let m = msg.decode().ok();
        self.inbound.corrupt += u64::from(m.is_none());
        m
    }

    fn finished(&self) -> bool {
        self.done_sent
            && self.inbound.done.is_some()
            && self.queries.open() == 0
            && self.answers.is_empty()
    }
}

/// Runs `tc qdisc replace dev DEV root netem ARGS`.
fn netem(dev: &str, args: &str) -> Result<()> {
    let status = Command::new("tc")
        .args(["qdisc", "replace", "dev", dev, "root", "netem"])
        .args(args.split_whitespace())
        .status()
        .context("running tc")?;
    ensure!(
        status.success(),
        "tc qdisc replace dev {dev} root netem {args}: {status}"
    );
    Ok(())
}

/// rxe0's hardware counters (retransmissions, duplicates, sequence errors...).
fn hw_counters() -> BTreeMap<String, u64> {
    let dir = "/sys/class/infiniband/rxe0/ports/1/hw_counters";
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let v = std::fs::read_to_string(e.path())
                .ok()?
                .trim()
                .parse()
                .ok()?;
            Some((e.file_name().to_string_lossy().into_owned(), v))
        })
        .collect()
}

struct Node {
    o: Options,
    hub: Hub,
    peers: Vec<Peer>,
    /// Accepted connections whose `Join` has not come yet.
    unjoined: Vec<PeerId>,
    started: Instant,
    sending_since: Option<Instant>,
    last_receive: Option<Instant>,
    sent: u64,
    received: u64,
    bad_frames: u64,
    /// Unexpected events (a second `Join`, a message from nobody), each an error.
    errors: Vec<String>,
    /// Per cut that suspended sessions: how long after the link came back the last one
    /// resumed.
    resume_times: Vec<Duration>,
}

fn main() -> ExitCode {
    rdmsg_examples::run(|| {
        let o = parse()?;
        run_host(o)
    })
}

fn run_host(o: Options) -> Result<()> {
    if let Some(args) = &o.netem {
        netem(&o.netdev, args)?;
        println!("mesh: netem dev={} {args}", o.netdev);
    }
    let ep = Endpoint::open_default()?;
    let mut config = HubConfig {
        max_connections: o.hosts.len() as u32,
        ..HubConfig::default()
    };
    config.conn.path.timeout = o.ack_timeout;
    config.conn.keepalive = Some(Duration::from_secs(o.keepalive));
    config.conn.resume_window = o.resume_window.map(Duration::from_secs);
    // Peers boot at different times, and a lossy link slows handshakes down.
    config.conn.handshake_timeout = Duration::from_secs(15);
    let mut hub = Hub::new(&ep, config)?;
    hub.register::<Join>()?
        .register::<Sample>()?
        .register::<Query>()?
        .register::<Answer>()?
        .register::<Alert>()?
        .register::<Done>()?;
    let own = &o.hosts[usize::from(o.id) - 1];
    let port = own
        .rsplit(':')
        .next()
        .context("a host address needs a port")?;
    if o.cm {
        hub.listen_cm(own.as_str())?;
    } else {
        hub.listen(format!("0.0.0.0:{port}"))?;
    }
    let now = Instant::now();
    let peers = o
        .hosts
        .iter()
        .enumerate()
        .map(|(i, addr)| (i as u16 + 1, addr))
        .filter(|(id, _)| *id != o.id)
        .map(|(id, addr)| Peer {
            id,
            addr: addr.clone(),
            peer: None,
            state: State::Waiting,
            retry_at: now,
            connect_errors: 0,
            next_seq: 0,
            done_sent: false,
            inbound: Inbound::default(),
            queries: Queries::default(),
            answers: VecDeque::new(),
            bytes_received: 0,
            failure: None,
        })
        .collect();
    let mut node = Node {
        o,
        hub,
        peers,
        unjoined: Vec::new(),
        started: now,
        sending_since: None,
        last_receive: None,
        sent: 0,
        received: 0,
        bad_frames: 0,
        errors: Vec::new(),
        resume_times: Vec::new(),
    };
    let ok = node.run()?;
    ensure!(
        ok,
        "mesh host {} saw loss, disorder or failure (see its report)",
        node.o.id
    );
    Ok(())
}

/// Longest wait for every peer to connect, and for the end of the exchange after sending.
const CONNECT_LIMIT: Duration = Duration::from_secs(240);
const FINISH_LIMIT: Duration = Duration::from_secs(120);

impl Node {
    fn run(&mut self) -> Result<bool> {
        let hw_before = hw_counters();
        let mut died = false;
        let mut cut: Option<Instant> = None;
        let mut cuts_done = 0;
        // The link came back at this time, with this many suspensions before the cut began:
        // waiting for every session to resume.
        let mut restored: Option<(Instant, u64)> = None;
        let mut suspended_before = 0;
        loop {
            let now = Instant::now();
            self.connect_due(now);
            let mut busy = false;
            while let Some(ev) = self.hub.try_recv()? {
                self.on_event(ev);
                busy = true;
            }
            if self.sending_since.is_none()
                && self
                    .peers
                    .iter()
                    .all(|p| p.state != State::Waiting && p.state != State::Handshake)
            {
                let since = Instant::now();
                self.sending_since = Some(since);
                println!(
                    "mesh: sending id={} peers={} connect_ms={}",
                    self.o.id,
                    self.peers.len(),
                    since.duration_since(self.started).as_millis()
                );
            }
            let Some(since) = self.sending_since else {
                if now.duration_since(self.started) > CONNECT_LIMIT {
                    let missing: Vec<u16> = self
                        .peers
                        .iter()
                        .filter(|p| p.state != State::Up)
                        .map(|p| p.id)
                        .collect();
                    bail!(
                        "host {}: peers {missing:?} not connected after {CONNECT_LIMIT:?}",
                        self.o.id
                    );
                }
                if !busy {
                    self.wait(Duration::from_millis(5))?;
                }
                continue;
            };
            let into = now.duration_since(since).as_secs_f64();
            if !died && self.o.die_after.is_some_and(|s| into >= s) {
                died = true;
                println!("mesh: ready-to-die id={}", self.o.id);
            }
            if let (None, true, Some(at)) = (cut, cuts_done < self.o.cuts, self.o.cut_after) {
                if into >= at + f64::from(cuts_done) * self.o.cut_every {
                    netem(&self.o.netdev, "loss 100%")?;
                    cut = Some(Instant::now());
                    suspended_before = self.hub.transport().stats().suspended;
                    println!("mesh: cut id={} ms={}", self.o.id, self.o.cut_ms);
                }
            }
            if let Some((at, before)) = restored {
                let stats = self.hub.transport().stats();
                let waiting = self
                    .peers
                    .iter()
                    .filter(|p| !self.o.may_lose.contains(&p.id))
                    .filter_map(|p| p.peer)
                    .any(|p| self.hub.is_suspended(p));
                if !waiting {
                    restored = None;
                    if stats.suspended > before {
                        let after = at.elapsed();
                        self.resume_times.push(after);
                        println!(
                            "mesh: resumed id={} after_restore_ms={} suspended={} resumes={}",
                            self.o.id,
                            after.as_millis(),
                            stats.suspended - before,
                            stats.resumes
                        );
                    }
                }
            }
            if let Some(at) = cut {
                if at.elapsed() >= Duration::from_millis(self.o.cut_ms) {
                    let restore = self.o.netem.clone().unwrap_or_else(|| "loss 0%".into());
                    netem(&self.o.netdev, &restore)?;
                    println!(
                        "mesh: restored id={} after_ms={}",
                        self.o.id,
                        at.elapsed().as_millis()
                    );
                    cut = None;
                    cuts_done += 1;
                    restored = Some((Instant::now(), suspended_before));
                }
            }
            let sending = into < self.o.seconds;
            busy |= self.send_round(sending);
            self.close_finished();
            if self.peers.iter().all(Peer::ended) {
                break;
            }
            if into > self.o.seconds + FINISH_LIMIT.as_secs_f64() {
                self.errors.push(format!(
                    "not finished {FINISH_LIMIT:?} after sending ended: {:?}",
                    self.peers
                        .iter()
                        .filter(|p| !p.ended())
                        .map(|p| (
                            p.id,
                            p.state,
                            p.inbound.done,
                            p.queries.open(),
                            p.answers.len()
                        ))
                        .collect::<Vec<_>>()
                ));
                break;
            }
            if !busy {
                self.wait(Duration::from_millis(2))?;
            }
        }
        Ok(self.report(&hw_before))
    }

    /// Starts the connections that are ours to make and due.
    fn connect_due(&mut self, now: Instant) {
        let me = self.o.id;
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            if !p.ours_to_connect(me) || p.state != State::Waiting || now < p.retry_at {
                continue;
            }
            let addr = p.addr.clone();
            let made = if self.o.cm {
                self.hub.connect_cm(addr.as_str())
            } else {
                self.hub.connect(addr.as_str())
            };
            match made {
                Ok(conn) => {
                    let p = &mut self.peers[i];
                    p.peer = Some(conn);
                    p.state = State::Handshake;
                }
                Err(e) => self.retry_later(i, &e.to_string()),
            }
        }
    }

    fn retry_later(&mut self, i: usize, why: &str) {
        let p = &mut self.peers[i];
        if p.connect_errors == 0 {
            println!(
                "mesh: connecting to {} ({}) failed, retrying: {why}",
                p.id, p.addr
            );
        }
        p.connect_errors += 1;
        p.state = State::Waiting;
        p.peer = None;
        p.retry_at = Instant::now() + Duration::from_millis(300);
    }

    /// Waits for the hub's next event, at most `limit`.
    fn wait(&mut self, limit: Duration) -> Result<()> {
        if let Some(ev) = self.hub.recv_timeout(Some(limit))? {
            self.on_event(ev);
        }
        Ok(())
    }

    fn on_event(&mut self, ev: HubEvent) {
        match ev {
            HubEvent::Connected { peer, accepted } => {
                if accepted {
                    self.unjoined.push(peer);
                } else if let Some(i) = self.index_of(peer) {
                    let (me, hosts) = (self.o.id, self.o.hosts.len() as u16);
                    let p = &mut self.peers[i];
                    p.state = State::Up;
                    println!(
                        "mesh: connected id={} after_ms={} attempts={}",
                        p.id,
                        self.started.elapsed().as_millis(),
                        p.connect_errors + 1
                    );
                    if let Err(e) = self.hub.send(peer, &Join { from: me, hosts }) {
                        self.errors
                            .push(format!("sending Join to {}: {e}", self.peers[i].id));
                    }
                }
            }
            HubEvent::HandshakeFailed { peer, error } => {
                match peer.and_then(|c| self.index_of(c)) {
                    Some(i) => self.retry_later(i, &error.to_string()),
                    None => println!("mesh: a client failed its handshake: {error}"),
                }
            }
            HubEvent::Message { peer, msg } => {
                self.received += 1;
                self.last_receive = Some(Instant::now());
                if msg.is::<Join>() {
                    self.on_join(peer, msg.decode::<Join>());
                    return;
                }
                let Some(i) = self.index_of(peer) else {
                    self.errors.push(format!(
                        "a message from a connection that has not joined: {peer:?}"
                    ));
                    return;
                };
                self.on_message(i, &msg);
            }
            HubEvent::BadFrame { peer, error } => {
                self.bad_frames += 1;
                self.errors
                    .push(format!("bad frame from {peer:?}: {error}"));
            }
            HubEvent::Unread { peer, messages } => {
                self.errors
                    .push(format!("{peer:?} closed with {messages} unread"));
            }
            HubEvent::Unconfirmed {
                peer,
                delivery,
                messages,
            } => {
                // A host that may vanish takes what it took with it (copies are kept only
                // for resumable sessions).
                let lost = self
                    .index_of(peer)
                    .is_some_and(|i| self.o.may_lose.contains(&self.peers[i].id));
                if !lost {
                    self.errors.push(format!(
                        "{peer:?} ended with {} message(s) not taken: {delivery:?}, first {:?}",
                        delivery.unconfirmed(),
                        messages.first().map(|m| (m.seq(), m.type_name()))
                    ));
                }
            }
            // Nothing is posted here: sends wait for credits.
            HubEvent::Writable { .. } | HubEvent::CallEnded { .. } => {}
            HubEvent::Disconnected { peer, failure } => {
                self.unjoined.retain(|c| *c != peer);
                let Some(i) = self.index_of(peer) else {
                    return;
                };
                let p = &mut self.peers[i];
                p.peer = None;
                let graceful = matches!(failure, Failure::PeerClosed | Failure::Closed);
                if graceful && p.finished() {
                    p.state = State::Finished;
                    return;
                }
                if p.state == State::Handshake {
                    // Not up yet: try again.
                    let why = failure.to_string();
                    self.retry_later(i, &why);
                    return;
                }
                p.state = State::Lost;
                p.failure = Some(failure.to_string());
                println!(
                    "mesh: peer-lost id={} after_ms={} failure=\"{failure}\"",
                    p.id,
                    self.started.elapsed().as_millis()
                );
            }
        }
    }

    /// The peer host on connection `conn` (one that joined, or that we are connecting).
    fn index_of(&self, conn: PeerId) -> Option<usize> {
        self.peers.iter().position(|p| p.peer == Some(conn))
    }

    /// A message on peer `i`'s stream (or an answer), checked.
    fn on_message(&mut self, i: usize, msg: &Envelope) {
        let (me, p) = (self.o.id, &mut self.peers[i]);
        let from = p.id;
        p.bytes_received += msg.body().len() as u64;
        if msg.is::<Sample>() {
            if let Some(s) = p.decode::<Sample>(msg) {
                let intact = matches!(mesh::kind(s.seq), Kind::Sample { .. })
                    && s.body == mesh::body(from, me, s.seq);
                p.inbound.arrive(s.seq, intact);
            }
        } else if msg.is::<Query>() {
            if let Some(q) = p.decode::<Query>(msg) {
                let intact = mesh::kind(q.seq) == Kind::Query
                    && q.operands == mesh::operands(from, me, q.seq);
                if p.inbound.arrive(q.seq, intact) != mesh::Arrival::Corrupt {
                    let sum = mesh::answer(&q.operands);
                    p.answers.push_back(Answer { seq: q.seq, sum });
                }
            }
        } else if msg.is::<Alert>() {
            if let Some(a) = p.decode::<Alert>(msg) {
                let intact =
                    mesh::kind(a.seq) == Kind::Alert && a.level == mesh::alert_level(a.seq);
                p.inbound.arrive(a.seq, intact);
            }
        } else if msg.is::<Answer>() {
            if let Some(a) = p.decode::<Answer>(msg) {
                p.queries.answer(a.seq, a.sum);
            }
        } else if msg.is::<Done>() {
            if let Some(d) = p.decode::<Done>(msg) {
                p.inbound.finish(d.sent);
            }
        } else {
            p.inbound.corrupt += 1;
        }
    }

    fn on_join(&mut self, conn: PeerId, join: rdmsg::msg::Result<Join>) {
        let Ok(join) = join else {
            self.errors
                .push(format!("an undecodable Join from {conn:?}"));
            return;
        };
        let Some(at) = self.unjoined.iter().position(|c| *c == conn) else {
            self.errors
                .push(format!("a Join from {conn:?}, not an accepted connection"));
            return;
        };
        self.unjoined.swap_remove(at);
        let Some(i) = self.peers.iter().position(|p| p.id == join.from) else {
            self.errors
                .push(format!("a Join from unknown host {}", join.from));
            return;
        };
        let p = &mut self.peers[i];
        if p.ours_to_connect(self.o.id)
            || p.peer.is_some()
            || join.hosts as usize != self.o.hosts.len()
        {
            self.errors.push(format!(
                "an unexpected Join from host {} ({} hosts)",
                join.from, join.hosts
            ));
            return;
        }
        p.peer = Some(conn);
        p.state = State::Up;
        println!(
            "mesh: connected id={} after_ms={} accepted=1",
            p.id,
            self.started.elapsed().as_millis()
        );
    }

    /// One round of sending: answers first, then (while `sending`) up to a batch of the
    /// stream to each peer that has credits; `Done` once sending is over. Never waits for a
    /// peer's credits (that would stop this host from draining its own receive queue).
    fn send_round(&mut self, sending: bool) -> bool {
        let me = self.o.id;
        let mut any = false;
        for i in 0..self.peers.len() {
            let Some(conn) = self.peers[i].peer else {
                continue;
            };
            if self.peers[i].state != State::Up {
                continue;
            }
            let mut budget = mesh::BATCH as usize;
            while budget > 0 {
                let p = &self.peers[i];
                let (seq, to) = (p.next_seq, p.id);
                // What goes next; taken off the books only once it went.
                let went = if let Some(a) = p.answers.front() {
                    let went = self.hub.send_timeout(conn, a, true, Duration::ZERO);
                    if let Ok(true) = went {
                        self.peers[i].answers.pop_front();
                    }
                    went
                } else if sending {
                    let went = match mesh::kind(seq) {
                        Kind::Sample { last_of_batch } => self.hub.send_timeout(
                            conn,
                            &Sample {
                                seq,
                                body: mesh::body(me, to, seq),
                            },
                            last_of_batch,
                            Duration::ZERO,
                        ),
                        Kind::Query => {
                            let operands = mesh::operands(me, to, seq);
                            let sum = mesh::answer(&operands);
                            let went = self.hub.send_timeout(
                                conn,
                                &Query { seq, operands },
                                true,
                                Duration::ZERO,
                            );
                            if let Ok(true) = went {
                                self.peers[i].queries.asked(seq, sum);
                            }
                            went
                        }
                        Kind::Alert => self.hub.send_timeout(
                            conn,
                            &Alert {
                                seq,
                                level: mesh::alert_level(seq),
                            },
                            true,
                            Duration::ZERO,
                        ),
                    };
                    if let Ok(true) = went {
                        self.peers[i].next_seq += 1;
                    }
                    went
                } else if !p.done_sent {
                    let went =
                        self.hub
                            .send_timeout(conn, &Done { sent: seq }, true, Duration::ZERO);
                    if let Ok(true) = went {
                        self.peers[i].done_sent = true;
                    }
                    went
                } else {
                    break;
                };
                match went {
                    Ok(true) => {
                        self.sent += 1;
                        any = true;
                        budget -= 1;
                    }
                    // No credit or send slot now; or the peer is failing (its Disconnected
                    // event follows).
                    Ok(false) | Err(_) => break,
                }
            }
        }
        any
    }

    /// Marks the peers that are finished, and closes the connections we made to them (the
    /// other side waits for that close).
    fn close_finished(&mut self) {
        let me = self.o.id;
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            if p.state != State::Up || !p.finished() {
                continue;
            }
            let conn = p.peer.expect("an Up peer has a connection");
            self.peers[i].state = State::Finished;
            if self.peers[i].ours_to_connect(me) {
                // Its Disconnected (Closed) clears the connection. The typed close: with
                // resumable sessions (which keep copies), it waits for the peer's record of
                // our last messages, so that none ends unconfirmed.
                if let Err(e) = self.hub.start_close(conn) {
                    self.errors
                        .push(format!("closing host {}: {e}", self.peers[i].id));
                }
            }
        }
    }

    /// Prints the report line; whether everything checked out.
    fn report(&self, hw_before: &BTreeMap<String, u64>) -> bool {
        let secs = match (self.sending_since, self.last_receive) {
            (Some(a), Some(b)) if b > a => b.duration_since(a).as_secs_f64(),
            _ => 0.0,
        };
        let (mut lost, mut missing_done) = (0, 0);
        let (mut dup, mut reord, mut corrupt, mut unanswered, mut wrong) = (0, 0, 0, 0, 0);
        let mut bytes = 0;
        let mut lost_peers = Vec::new();
        for p in &self.peers {
            bytes += p.bytes_received;
            dup += p.inbound.duplicated + p.queries.duplicated;
            reord += p.inbound.reordered;
            corrupt += p.inbound.corrupt;
            wrong += p.queries.wrong;
            if p.state == State::Lost {
                lost_peers.push(p.id);
            } else {
                lost += p.inbound.lost().unwrap_or(0);
                missing_done += u64::from(p.inbound.done.is_none());
                unanswered += p.queries.open() as u64;
            }
        }
        let unexpected: Vec<u16> = lost_peers
            .iter()
            .copied()
            .filter(|id| !self.o.may_lose.contains(id))
            .collect();
        let ok = lost == 0
            && missing_done == 0
            && dup == 0
            && reord == 0
            && corrupt == 0
            && unanswered == 0
            && wrong == 0
            && unexpected.is_empty()
            && self.errors.is_empty();
        let hw: String = hw_counters()
            .into_iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(hw_before.get(&k).copied().unwrap_or(0));
                (d > 0).then(|| format!(" hw_{k}={d}"))
            })
            .collect();
        for e in &self.errors {
            println!("mesh: error: {e}");
        }
        let rate = |n: f64| if secs > 0.0 { n / secs } else { 0.0 };
        let raw = self.hub.transport().stats();
        let stats = self.hub.stats();
        let worst_resume = self.resume_times.iter().max().copied().unwrap_or_default();
        println!(
            "mesh: id={} hosts={} peers={} lost_peers={} lost_ids={:?} sent={} received={} bytes_received={bytes} secs={secs:.2} msgs_per_s={:.0} bytes_per_s={:.0} lost={lost} missing_done={missing_done} duplicated={dup} reordered={reord} corrupt={corrupt} unanswered={unanswered} wrong_answers={wrong} bad_frames={} errors={} suspended={} resumes={} resumed_messages={} resume_ms={}{hw} ok={}",
            self.o.id,
            self.o.hosts.len(),
            self.peers.len(),
            lost_peers.len(),
            lost_peers,
            self.sent,
            self.received,
            rate(self.received as f64),
            rate(bytes as f64),
            self.bad_frames,
            self.errors.len(),
            raw.suspended,
            raw.resumes,
            stats.resumed_messages,
            worst_resume.as_millis(),
            u8::from(ok),
        );
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("mesh").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn command_lines() {
        let o = parse(&["--id", "1", "--hosts", "a:1,b:2"]);
        assert_eq!(
            (o.id, o.hosts.clone()),
            (1, vec!["a:1".to_owned(), "b:2".into()])
        );
        assert_eq!(
            (o.seconds, o.netem, o.netdev.as_str()),
            (20.0, None, "eth0")
        );
        assert_eq!((o.die_after, o.cut_after, o.cut_ms), (None, None, 1000));
        assert_eq!((o.may_lose, o.ack_timeout, o.keepalive), (vec![], 16, 10));
        assert!(!o.cm);
        // As `cargo xtask cluster` runs it (its --netem a single quoted argument).
        let o = parse(&[
            "--id",
            "2",
            "--hosts",
            "10.79.0.1:19000,10.79.0.2:19000,10.79.0.3:19000",
            "--seconds",
            "16",
            "--netdev",
            "eth0",
            "--netem",
            "loss 1% duplicate 1% delay 2ms reorder 10% 50%",
            "--cut-after",
            "9",
            "--cut-ms",
            "1000",
            "--may-lose",
            "3",
            "--cm",
        ]);
        assert_eq!((o.id, o.hosts.len(), o.seconds), (2, 3, 16.0));
        assert!(o.cm);
        assert_eq!(
            o.netem.as_deref(),
            Some("loss 1% duplicate 1% delay 2ms reorder 10% 50%")
        );
        assert_eq!(
            (o.cut_after, o.cut_ms, o.may_lose),
            (Some(9.0), 1000, vec![3])
        );
        // As the device tests run it.
        let o = parse(&[
            "--id",
            "4",
            "--hosts",
            "a:1,b:2,c:3,d:4",
            "--seconds",
            "4",
            "--die-after",
            "1.5",
        ]);
        assert_eq!((o.id, o.die_after), (4, Some(1.5)));
        let o = parse(&[
            "--id",
            "1",
            "--hosts",
            "a:1,b:2",
            "--may-lose",
            "2,,3,",
            "--ack-timeout",
            "14",
            "--keepalive",
            "5",
            "--may-lose",
            "",
        ]);
        assert_eq!((o.may_lose, o.ack_timeout, o.keepalive), (vec![], 14, 5));
    }

    #[test]
    fn refused() {
        for args in [
            &["--hosts", "a:1,b:2"][..],
            &["--id", "1"],
            &["--id", "1", "--hosts", "a:1,b:2", "--may-lose", "x"],
            &["--id", "1", "--hosts", "a:1,b:2", "--bogus"],
        ] {
            let args = std::iter::once("mesh").chain(args.iter().copied());
            assert!(Options::try_parse_from(args).is_err());
        }
    }
}
