//! A tokio server with many clients: typed request/response over `rdmsg::tokio`, one task per
//! client on the multi-thread runtime, nothing blocking a runtime thread.
//!
//! With no role, it listens on 127.0.0.1, runs `--clients` async clients in the same process
//! (each connecting, then sending `--requests` requests one at a time and checking every
//! answer), and ends with one line:
//!
//! ```text
//! tokio_server: clients=32 requests=200 answered=6400 errors=0 elapsed_ms=... rtt_us_median=... server_wakeups=...
//! ```
//!
//! `server_wakeups` is the sum over the server's sessions of the times their descriptor woke a
//! waiting task (every request is solicited: about one per request, none spent polling). The exit code is non-zero on any
//! wrong or missing answer.
//!
//! ```text
//! tokio_server [--clients N] [--requests R]
//! tokio_server serve --listen ADDR
//! tokio_server client --connect ADDR [--clients N] [--requests R]
//! ```
//!
//! `--listen` and `--connect` are one option, and the role may come anywhere on the line.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use clap::{Parser, ValueEnum};
use rdmsg::tokio::{AsyncListener, AsyncSession};
use rdmsg::{Config, Endpoint, SessionConfig};
use rdmsg_examples::{Request, Response};

/// A tokio server with many clients: typed request/response over `rdmsg::tokio`, one task per
/// client on the multi-thread runtime. With no role, it runs server and clients in this
/// process and ends with one `tokio_server: key=value ...` line (a non-zero exit code on any
/// wrong or missing answer).
#[derive(Debug, Parser)]
#[command(name = "tokio_server", args_override_self = true)]
struct Args {
    /// Server or clients alone (without it: both, here)
    #[arg(value_enum)]
    role: Option<Role>,
    /// Where the server listens, or the clients connect (the same option)
    #[arg(long = "listen", visible_alias = "connect", value_name = "ADDR")]
    addr: Option<SocketAddr>,
    /// Async clients, one task each
    #[arg(long, value_name = "N", default_value_t = 32)]
    clients: u32,
    /// Requests per client, one at a time
    #[arg(long, value_name = "R", default_value_t = 200)]
    requests: u32,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Role {
    /// The server alone, at --listen ADDR, serving for ever
    Serve,
    /// The clients alone, connecting to the server at --connect ADDR
    Client,
}

/// Answers one client until it goes; returns its session's wake-ups.
async fn serve_client(s: AsyncSession, answered: Arc<AtomicU64>) -> u64 {
    loop {
        let env = match s.recv().await {
            Ok(env) => env,
            Err(e) if e_is_fatal(&e) => break,
            Err(_) => continue, // a bad frame: the client goes on
        };
        let Ok(req) = env.decode::<Request>() else {
            continue;
        };
        let sum = req.operands.iter().sum();
        if s.send(&Response { id: req.id, sum }).await.is_err() {
            break;
        }
        answered.fetch_add(1, Ordering::Relaxed);
    }
    s.wakeups()
}

fn e_is_fatal(e: &rdmsg::tokio::Error) -> bool {
    match e {
        rdmsg::tokio::Error::Msg(m) => m.is_fatal(),
        _ => true,
    }
}

async fn server(listener: AsyncListener, clients: Option<u32>) -> Result<(u64, u64)> {
    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let mut n = 0;
    while clients.map_or(true, |c| n < c) {
        match listener.accept().await {
            Ok(s) => {
                tasks.push(tokio::spawn(serve_client(s, answered.clone())));
                n += 1;
            }
            Err(e) => eprintln!("tokio_server: a client failed its handshake: {e}"),
        }
    }
    let mut wakeups = 0;
    for t in tasks {
        wakeups += t.await?;
    }
    Ok((answered.load(Ordering::Relaxed), wakeups))
}

/// One client: `requests` round trips; returns their times.
async fn client(ep: Endpoint, addr: SocketAddr, id: u32, requests: u32) -> Result<Vec<Duration>> {
    let s = AsyncSession::connect(&ep, addr, Config::default(), SessionConfig::default()).await?;
    let mut rtts = Vec::with_capacity(requests as usize);
    for i in 0..requests {
        let req = Request {
            id: u64::from(id) << 32 | u64::from(i),
            operands: vec![i64::from(i), i64::from(id)],
        };
        let t = Instant::now();
        s.send(&req).await?;
        let resp: Response = s.recv().await?.decode()?;
        rtts.push(t.elapsed());
        ensure!(
            resp == Response {
                id: req.id,
                sum: i64::from(i) + i64::from(id)
            },
            "client {id}: wrong answer {resp:?} to {req:?}"
        );
    }
    s.close().await?;
    Ok(rtts)
}

async fn clients(ep: Endpoint, addr: SocketAddr, n: u32, requests: u32) -> Result<Vec<Duration>> {
    let tasks: Vec<_> = (0..n)
        .map(|id| tokio::spawn(client(ep.clone(), addr, id, requests)))
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

fn main() -> ExitCode {
    let a = Args::parse();
    rdmsg_examples::run(|| run_role(a))
}

fn run_role(a: Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ep = Endpoint::open_default()?;
        match a.role {
            Some(Role::Serve) => {
                let addr = a.addr.context("serve needs --listen ADDR")?;
                let l = AsyncListener::bind(&ep, addr, Config::default(), SessionConfig::default())?;
                println!("tokio_server: listening on {}", l.local_addr()?);
                server(l, None).await?;
                Ok(())
            }
            Some(Role::Client) => {
                let addr = a.addr.context("client needs --connect ADDR")?;
                let rtts = clients(ep, addr, a.clients, a.requests).await?;
                println!("tokio_server: client round_trips={}", rtts.len());
                Ok(())
            }
            None => {
                let started = Instant::now();
                let l = AsyncListener::bind(
                    &ep,
                    "127.0.0.1:0",
                    Config::default(),
                    SessionConfig::default(),
                )?;
                let addr = l.local_addr()?;
                let serving = tokio::spawn(server(l, Some(a.clients)));
                let mut rtts = clients(ep, addr, a.clients, a.requests).await?;
                let (answered, wakeups) = serving.await??;
                rtts.sort_unstable();
                let median = rtts.get(rtts.len() / 2).copied().unwrap_or_default();
                let expected = u64::from(a.clients) * u64::from(a.requests);
                println!(
                    "tokio_server: clients={} requests={} answered={answered} errors={} elapsed_ms={} rtt_us_median={} server_wakeups={wakeups}",
                    a.clients,
                    a.requests,
                    u64::from(answered != expected),
                    started.elapsed().as_millis(),
                    median.as_micros(),
                );
                ensure!(answered == expected, "{answered} of {expected} answered");
                Ok(())
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("tokio_server").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn command_lines() {
        let a = parse(&[]);
        assert!(a.role.is_none() && a.addr.is_none());
        assert_eq!((a.clients, a.requests), (32, 200));
        let a = parse(&["--clients", "24", "--requests", "100"]);
        assert_eq!((a.clients, a.requests), (24, 100));
        let a = parse(&["serve", "--listen", "127.0.0.1:0"]);
        assert!(matches!(a.role, Some(Role::Serve)));
        assert_eq!(a.addr, Some("127.0.0.1:0".parse().unwrap()));
        // The role anywhere, --listen and --connect one option.
        let a = parse(&["--connect", "10.0.0.1:5", "--clients", "3", "client"]);
        assert!(matches!(a.role, Some(Role::Client)));
        assert_eq!(
            (a.addr, a.clients),
            (Some("10.0.0.1:5".parse().unwrap()), 3)
        );
    }

    #[test]
    fn refused() {
        for args in [&["--listen", "nowhere"][..], &["listen"], &["--bogus"]] {
            let args = std::iter::once("tokio_server").chain(args.iter().copied());
            assert!(Args::try_parse_from(args).is_err());
        }
    }
}
