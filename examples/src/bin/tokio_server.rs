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

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use rdmsg::tokio::{AsyncListener, AsyncSession};
use rdmsg::{Config, Endpoint, SessionConfig};
use rdmsg_examples::{Request, Response};

#[derive(Debug)]
struct Args {
    role: Option<String>,
    addr: Option<SocketAddr>,
    clients: u32,
    requests: u32,
}

fn args() -> Result<Args> {
    let mut a = Args {
        role: None,
        addr: None,
        clients: 32,
        requests: 200,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "serve" | "client" => a.role = Some(arg.clone()),
            "--listen" | "--connect" => a.addr = Some(value()?.parse()?),
            "--clients" => a.clients = value()?.parse()?,
            "--requests" => a.requests = value()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
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

fn main() -> Result<()> {
    let a = args()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ep = Endpoint::open_default()?;
        match a.role.as_deref() {
            Some("serve") => {
                let addr = a.addr.context("serve needs --listen ADDR")?;
                let l = AsyncListener::bind(&ep, addr, Config::default(), SessionConfig::default())?;
                println!("tokio_server: listening on {}", l.local_addr()?);
                server(l, None).await?;
                Ok(())
            }
            Some("client") => {
                let addr = a.addr.context("client needs --connect ADDR")?;
                let rtts = clients(ep, addr, a.clients, a.requests).await?;
                println!("tokio_server: client round_trips={}", rtts.len());
                Ok(())
            }
            _ => {
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
