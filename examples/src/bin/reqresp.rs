//! Requests from many clients, answered by one server thread: the server's [`Hub`] feeds a
//! [`Dispatcher`] that routes each [`Request`] with the peer it came from, and the hub's
//! event callback replies to that peer. Both message types are solicited, so each side sleeps
//! between turns.
//!
//! With no role, the server listens on 127.0.0.1 and starts a second process (this binary,
//! role `clients`: one thread, one hub, one connection per client); each client keeps one
//! request outstanding and checks every response (its id, the sum it asked for). Ends with one
//! line:
//!
//! ```text
//! reqresp: clients=64 requests=3200 responses=3200 errors=0 wakeups=... rtt_p50_us=... ...
//! ```
//!
//! `requests` is what the server received, `responses` what the clients received and found
//! right, `errors` everything else (bad frames, undecodable or wrong responses, failed
//! peers, responses missing), `wakeups` the server hub's wake-ups. Non-zero exit code on any
//! error.
//!
//! ```text
//! reqresp [--clients N] [--requests R]
//! reqresp server --listen ADDR [--clients N]       (without --clients: serves for ever)
//! reqresp clients --connect ADDR [--count N] [--requests R]
//! ```

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::ControlFlow;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use rdmsg::{Dispatcher, Endpoint, Failure, Hub, HubConfig, HubEvent, PeerId};
use rdmsg_examples::peers::{count_dir, field, PeerProcess};
use rdmsg_examples::{Request, Response};

/// Longest a client waits for anything to happen.
const IDLE: Duration = Duration::from_secs(60);

enum Role {
    Both {
        clients: u32,
        requests: u64,
    },
    Server {
        listen: String,
        clients: Option<u32>,
    },
    Clients {
        connect: String,
        count: u32,
        requests: u64,
    },
}

fn parse() -> Result<Role> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let role = match args.first().map(String::as_str) {
        Some("server" | "clients") => args.remove(0),
        _ => String::new(),
    };
    let (mut clients, mut requests) = (None, 50u64);
    let (mut listen, mut connect) = (None, None);
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--clients" | "--count" => clients = Some(v()?.parse::<u32>()?),
            "--requests" => requests = v()?.parse()?,
            "--listen" => listen = Some(v()?),
            "--connect" => connect = Some(v()?),
            other => bail!("unknown argument {other} (see the doc at the top of reqresp.rs)"),
        }
    }
    ensure!(clients != Some(0), "--clients must be positive");
    Ok(match role.as_str() {
        "server" => Role::Server {
            listen: listen.context("server needs --listen ADDR")?,
            clients,
        },
        "clients" => Role::Clients {
            connect: connect.context("clients needs --connect ADDR")?,
            count: clients.unwrap_or(64),
            requests,
        },
        _ => Role::Both {
            clients: clients.unwrap_or(64),
            requests,
        },
    })
}

fn main() -> Result<()> {
    match parse()? {
        Role::Both { clients, requests } => both(clients, requests),
        Role::Server { listen, clients } => {
            let served = serve(&listen, clients, None)?;
            served.finish(None)
        }
        Role::Clients {
            connect,
            count,
            requests,
        } => run_clients(&connect, count, requests),
    }
}

/// The server here, the clients in a child process.
fn both(clients: u32, requests: u64) -> Result<()> {
    let exe = std::env::current_exe().context("locating this program")?;
    let mut command = Command::new(exe);
    command
        .args(["clients", "--count", &clients.to_string()])
        .args(["--requests", &requests.to_string()])
        .stdout(Stdio::piped());
    let mut process = PeerProcess::new(command, "clients");
    let served = serve("127.0.0.1:0", Some(clients), Some(&mut process));
    let Some(reaped) = process.reap("server") else {
        return served.map(|_| ());
    };
    let line = reaped.and_then(|(status, line)| {
        ensure!(status.success(), "the clients process failed: {status}");
        line.context("the clients process printed no report")
    });
    match (served, line) {
        (Ok(s), Ok(line)) => s.finish(Some(&line)),
        (Err(e), _) => Err(e),
        (Ok(s), Err(e)) => {
            let _ = s.finish(None);
            Err(e)
        }
    }
}

// ----- the server -----

#[derive(Debug, Default)]
struct Served {
    clients: u32,
    requests: u64,
    responses_sent: u64,
    errors: u64,
    wakeups: u64,
    threads: usize,
    fds: usize,
    elapsed: Duration,
}

impl Served {
    fn finish(self, clients_line: Option<&str>) -> Result<()> {
        let get = |key: &str| clients_line.and_then(|l| field(l, key));
        // Without the clients' report, what the server sent stands for what they received.
        let responses = get("responses").unwrap_or(self.responses_sent);
        let mut errors = self.errors + get("errors").unwrap_or(0);
        if let Some(asked) = get("requests") {
            errors += asked.saturating_sub(responses);
        }
        let show = |key: &str| get(key).map_or("n/a".into(), |v| v.to_string());
        println!(
            "reqresp: clients={} requests={} responses={responses} errors={errors} wakeups={} \
             requests_per_wakeup={:.1} server_threads={} fds={} client_wakeups={} rtt_p50_us={} \
             rtt_p99_us={} elapsed_ms={}",
            self.clients,
            self.requests,
            self.wakeups,
            self.requests as f64 / self.wakeups.max(1) as f64,
            self.threads,
            self.fds,
            show("wakeups"),
            show("rtt_p50_us"),
            show("rtt_p99_us"),
            self.elapsed.as_millis()
        );
        ensure!(errors == 0, "{errors} errors");
        Ok(())
    }
}

/// Serves on this thread until `clients` clients have come and gone (for ever if `None`).
/// `process`, if given, is started once the hub listens.
fn serve(listen: &str, clients: Option<u32>, process: Option<&mut PeerProcess>) -> Result<Served> {
    let t0 = Instant::now();
    let ep = Endpoint::open_default().context("opening $RDMSG_DEVICE")?;
    let config = HubConfig {
        max_connections: clients.unwrap_or(1024),
        ..HubConfig::default()
    };
    let mut hub = Hub::new(&ep, config).context("creating the server's hub")?;
    hub.register::<Request>()?;
    let addr = hub.listen(listen)?;
    // The hub's loop below waits for ever: until the first client shows up, watch the
    // process that runs them, which may fail before connecting anything.
    let mut first = None;
    match process {
        Some(p) => {
            p.start(&addr.to_string())?;
            let since = Instant::now();
            while first.is_none() {
                first = hub.recv_timeout(Some(Duration::from_secs(1)))?;
                if first.is_none() && (p.ended() || since.elapsed() > IDLE) {
                    bail!("no client connected (the clients process ended, or {IDLE:?} passed)");
                }
            }
        }
        None => println!("listening {addr}"),
    }
    // Each request is routed with its peer into this channel, and answered by the event
    // callback right after (the callback has the hub, the route does not).
    let mut d = Dispatcher::new();
    let requests = d.channel_from::<Request>(64)?;
    let mut s = Served::default();
    let (mut gone, mut live) = (0u32, 0u32);
    let mut on_event = |hub: &mut Hub, ev: HubEvent| {
        for (peer, req) in requests.try_iter() {
            s.requests += 1;
            let sum = req.operands.iter().sum();
            match hub.send(peer, &Response { id: req.id, sum }) {
                Ok(()) => s.responses_sent += 1,
                Err(e) => {
                    s.errors += 1;
                    eprintln!("server: answering {peer}: {e}");
                }
            }
        }
        match ev {
            HubEvent::Connected { .. } => {
                s.clients += 1;
                live += 1;
                if Some(s.clients) == clients {
                    s.threads = count_dir("/proc/self/task");
                    s.fds = count_dir("/proc/self/fd").saturating_sub(1);
                }
            }
            HubEvent::Disconnected { peer, failure } => {
                gone += 1;
                live -= 1;
                if failure != Failure::PeerClosed {
                    s.errors += 1;
                    eprintln!("server: {peer} ended: {failure}");
                    // The clients died: nobody else is coming.
                    if live == 0 && hub.transport().stats().handshakes == 0 {
                        return ControlFlow::Break(());
                    }
                }
            }
            HubEvent::HandshakeFailed { error, .. } => {
                gone += 1;
                s.errors += 1;
                eprintln!("server: a client's handshake failed: {error}");
            }
            HubEvent::BadFrame { peer, error } => {
                s.errors += 1;
                eprintln!("server: {peer}: {error}");
            }
            HubEvent::Unread { peer, messages } => {
                s.errors += 1;
                eprintln!("server: {peer} closed with {messages} unread");
            }
            HubEvent::Unconfirmed { peer, delivery, .. } => {
                s.errors += 1;
                let n = delivery.unconfirmed();
                eprintln!("server: {peer} ended with {n} message(s) not taken");
            }
            HubEvent::Message { .. } => {}
        }
        if Some(gone) == clients {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let mut done = false;
    if let Some(ev) = first {
        // What `run_hub_with` does with an event (a first event is a connection, though).
        if let HubEvent::Message { peer, msg } = &ev {
            let _ = d.dispatch_from(*peer, msg);
        }
        done = on_event(&mut hub, ev).is_break();
    }
    if !done {
        d.run_hub_with(&mut hub, &mut on_event)
            .context("the server's hub failed")?;
    }
    let ds = d.stats();
    s.errors += ds.unknown + ds.undecodable + ds.orphaned + ds.no_peer;
    s.wakeups = hub.transport().wait_stats().wakeups;
    s.elapsed = t0.elapsed();
    Ok(s)
}

// ----- the clients -----

/// The `k`-th request of client `client`: its id names both.
fn request(client: u32, k: u64) -> Request {
    let id = (u64::from(client) << 32) | k;
    let operands = (0..(k % 8) as i64)
        .map(|j| i64::from(client) * 1000 + j - k as i64)
        .collect();
    Request { id, operands }
}

/// One client's progress.
#[derive(Debug)]
struct Client {
    index: u32,
    /// Requests answered.
    answered: u64,
    /// The request outstanding: its id, expected sum, when it was sent.
    outstanding: Option<(u64, i64, Instant)>,
}

/// Closes `peer`; a failure is reported and remembered in `unclosed`, not fatal (everything
/// was answered), unless the peer is left open.
fn close(hub: &mut Hub, peer: PeerId, unclosed: &mut HashSet<PeerId>) -> Result<()> {
    let t = Instant::now();
    if let Err(e) = hub.close(peer) {
        eprintln!(
            "clients: closing {peer} failed after {:?}: {e}",
            t.elapsed()
        );
        ensure!(
            hub.transport().failure(peer).is_some(),
            "{peer} is still open"
        );
        unclosed.insert(peer);
    }
    Ok(())
}

/// `count` clients on one hub, each sending `requests` requests one at a time.
fn run_clients(connect: &str, count: u32, requests: u64) -> Result<()> {
    let t0 = Instant::now();
    let ep = Endpoint::open_default().context("opening $RDMSG_DEVICE")?;
    let config = HubConfig {
        max_connections: count,
        ..HubConfig::default()
    };
    let mut hub = Hub::new(&ep, config).context("creating the clients' hub")?;
    hub.register::<Response>()?;
    let mut clients: HashMap<PeerId, Client> = HashMap::new();
    // Events that came while connecting (the hub is driven meanwhile, so that the first
    // handshakes do not wait for the last connections to start).
    let mut early = VecDeque::new();
    for index in 0..count {
        let peer = hub.connect(connect)?;
        let c = Client {
            index,
            answered: 0,
            outstanding: None,
        };
        clients.insert(peer, c);
        while let Some(ev) = hub.try_recv()? {
            early.push_back(ev);
        }
    }
    let mut rtts: Vec<Duration> = Vec::with_capacity((u64::from(count) * requests) as usize);
    let (mut errors, mut responses, mut finished, mut closed) = (0u64, 0u64, 0u32, 0u32);
    let send_next = |hub: &mut Hub, peer: PeerId, c: &mut Client| -> Result<()> {
        let r = request(c.index, c.answered);
        let sum = r.operands.iter().sum();
        hub.send(peer, &r)?;
        c.outstanding = Some((r.id, sum, Instant::now()));
        Ok(())
    };
    // Clients whose close failed (after all their responses came: reported, not fatal).
    let mut unclosed = HashSet::new();
    while closed < count {
        let ev = match early.pop_front() {
            Some(ev) => ev,
            None => hub
                .recv_timeout(Some(IDLE))?
                .with_context(|| format!("nothing for {IDLE:?}: {finished} of {count} finished"))?,
        };
        match ev {
            HubEvent::Connected { peer, .. } => {
                let c = clients
                    .get_mut(&peer)
                    .context("an unknown peer connected")?;
                if requests == 0 {
                    finished += 1;
                    close(&mut hub, peer, &mut unclosed)?;
                } else {
                    send_next(&mut hub, peer, c)?;
                }
            }
            HubEvent::Message { peer, msg } => {
                let c = clients.get_mut(&peer).context("a message from nowhere")?;
                let resp: Response = match msg.decode() {
                    Ok(r) => r,
                    Err(e) => {
                        errors += 1;
                        eprintln!("clients: {peer}: {e}");
                        continue;
                    }
                };
                let Some((id, sum, at)) = c.outstanding.take() else {
                    errors += 1;
                    eprintln!("clients: {peer}: a response nobody asked for: {resp:?}");
                    continue;
                };
                if resp.id == id && resp.sum == sum {
                    responses += 1;
                } else {
                    errors += 1;
                    eprintln!("clients: {peer}: {resp:?} answers request {id:#x} (sum {sum})");
                }
                rtts.push(at.elapsed());
                c.answered += 1;
                if c.answered < requests {
                    send_next(&mut hub, peer, c)?;
                } else {
                    finished += 1;
                    close(&mut hub, peer, &mut unclosed)?;
                }
            }
            HubEvent::Disconnected {
                failure: Failure::Closed,
                ..
            } => closed += 1,
            // Its close failed (counted below): it ends anyway.
            HubEvent::Disconnected { peer, .. } if unclosed.contains(&peer) => closed += 1,
            HubEvent::Disconnected { peer, failure } => bail!("{peer} failed: {failure}"),
            HubEvent::BadFrame { peer, error } => {
                errors += 1;
                eprintln!("clients: {peer}: {error}");
            }
            HubEvent::Unread { peer, messages } => {
                errors += 1;
                eprintln!("clients: {peer} closed with {messages} unread");
            }
            HubEvent::Unconfirmed { peer, delivery, .. } => {
                errors += 1;
                let n = delivery.unconfirmed();
                eprintln!("clients: {peer} ended with {n} message(s) not taken");
            }
            HubEvent::HandshakeFailed { error, .. } => bail!("a handshake failed: {error}"),
        }
    }
    errors += unclosed.len() as u64;
    rtts.sort_unstable();
    let pct = |p: usize| {
        rtts.get(rtts.len().saturating_sub(1) * p / 100)
            .map_or(0, |d| d.as_micros())
    };
    println!(
        "clients: clients={count} requests={} responses={responses} errors={errors} wakeups={} \
         rtt_p50_us={} rtt_p99_us={} elapsed_ms={}",
        u64::from(count) * requests,
        hub.transport().wait_stats().wakeups,
        pct(50),
        pct(99),
        t0.elapsed().as_millis()
    );
    Ok(())
}
