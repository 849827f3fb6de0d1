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
//!
//! `--clients` and `--count` are one option, in every role. `--help` (or `-h`) describes each
//! role's options (`reqresp server --help`, ...).

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::ControlFlow;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use clap::{Parser, Subcommand};
use rdmsg::{Dispatcher, Endpoint, Failure, Hub, HubConfig, HubEvent, PeerId};
use rdmsg_examples::peers::{count_dir, field, PeerProcess};
use rdmsg_examples::{Request, Response};

/// Longest a client waits for anything to happen.
const IDLE: Duration = Duration::from_secs(60);

/// Requests from many clients, answered by one server thread (a hub feeding a dispatcher);
/// ends with one `reqresp: key=value ...` line, and a non-zero exit code on any error.
///
/// With no role, the server listens on 127.0.0.1 and runs the clients in a second process
/// (this program again, role `clients`); each client keeps one request outstanding and
/// checks every response.
#[derive(Debug, Parser)]
#[command(
    name = "reqresp",
    args_override_self = true,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// How many clients (one connection each)
    #[arg(long, visible_alias = "count", value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Requests per client
    #[arg(long, value_name = "R", default_value_t = 50)]
    requests: u64,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// The server alone: prints `listening ADDR` and answers the clients that connect there;
    /// with --clients N it ends with its line once N clients have come and gone, without it
    /// it serves for ever.
    Server {
        /// Where to listen (port 0: any free port)
        #[arg(long, value_name = "ADDR")]
        listen: String,
        /// How many clients to serve before ending
        #[arg(long, visible_alias = "count", value_name = "N",
              value_parser = clap::value_parser!(u32).range(1..))]
        clients: Option<u32>,
    },
    /// The clients, one connection each, on one thread's hub, asking the server at ADDR;
    /// ends with one `clients: key=value ...` line.
    Clients {
        /// The server's address
        #[arg(long, value_name = "ADDR")]
        connect: String,
        /// How many clients
        #[arg(long, visible_alias = "clients", value_name = "N", default_value_t = 64,
              value_parser = clap::value_parser!(u32).range(1..))]
        count: u32,
        /// Requests per client
        #[arg(long, value_name = "R", default_value_t = 50)]
        requests: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rdmsg_examples::run(|| match cli.role {
        None => both(cli.clients, cli.requests),
        Some(Role::Server { listen, clients }) => {
            let served = serve(&listen, clients, None)?;
            served.finish(None)
        }
        Some(Role::Clients {
            connect,
            count,
            requests,
        }) => run_clients(&connect, count, requests),
    })
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
            // Nothing is posted: answers wait for credits.
            HubEvent::Writable { .. } | HubEvent::Message { .. } | HubEvent::CallEnded { .. } => {}
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
            HubEvent::Writable { .. } | HubEvent::CallEnded { .. } => {}
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("reqresp").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn command_lines() {
        let c = parse(&[]);
        assert!(c.role.is_none());
        assert_eq!((c.clients, c.requests), (64, 50));
        let c = parse(&["--clients", "48", "--requests", "40"]);
        assert_eq!((c.clients, c.requests), (48, 40));
        assert_eq!(parse(&["--count", "7"]).clients, 7);

        let c = parse(&["server", "--listen", "127.0.0.1:0"]);
        let Some(Role::Server { listen, clients }) = c.role else {
            panic!("{:?}", c.role)
        };
        assert_eq!((listen.as_str(), clients), ("127.0.0.1:0", None));
        let c = parse(&["server", "--count", "3", "--listen", "a:1"]);
        assert!(matches!(
            c.role,
            Some(Role::Server {
                clients: Some(3),
                ..
            })
        ));

        // As `both` starts them (`PeerProcess::start` adds `--connect ADDR`).
        let c = parse(&[
            "clients",
            "--count",
            "48",
            "--requests",
            "40",
            "--connect",
            "a:1",
        ]);
        let Some(Role::Clients {
            connect,
            count,
            requests,
        }) = c.role
        else {
            panic!("{:?}", c.role)
        };
        assert_eq!((connect.as_str(), count, requests), ("a:1", 48, 40));
        let c = parse(&["clients", "--connect", "a:1", "--clients", "2"]);
        assert!(matches!(
            c.role,
            Some(Role::Clients {
                count: 2,
                requests: 50,
                ..
            })
        ));
    }

    #[test]
    fn refused() {
        for args in [
            &["--bogus"][..],
            &["--clients", "0"],
            &["server"],
            &["server", "--listen", "a:1", "--clients", "0"],
            &["clients"],
        ] {
            let args = std::iter::once("reqresp").chain(args.iter().copied());
            assert!(Cli::try_parse_from(args).is_err());
        }
    }
}
