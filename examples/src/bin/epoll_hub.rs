//! One thread, one plain epoll loop: a typed [`Hub`] serving RDMA clients beside an ordinary
//! TCP listener. Nothing here is rdmsg-specific about the loop: it waits on both descriptors
//! (the hub is `AsFd`), calls the hub's non-blocking `step`, takes its events with
//! `try_recv`, sends with `try_send`, and waits no longer than the hub's `next_timeout`.
//!
//! RDMA clients send `Request`s and get `Response`s. A TCP client gets one line with the hub's
//! figures, then the stream is closed (a status port, as services keep beside their data
//! path). With no role it runs `--clients` blocking session clients on threads, each sending
//! `--requests` requests, and asks the status port once they are done; then it prints:
//!
//! ```text
//! epoll_hub: clients=16 requests=500 answered=8000 status_requests=1 loop_waits=... turns=... other_events=... resent=... hub_wakeups=... deferred=... errors=0
//! ```
//!
//! `deferred` counts answers that found no credit at once and went out on a later turn of the
//! loop (the loop never blocks on one peer).
//!
//! ```text
//! epoll_hub [--clients N] [--requests R]
//! ```

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use rdmsg::transport::ReadyWatch;
use rdmsg::{Endpoint, Hub, HubConfig, HubEvent, PeerId, Session};
use rdmsg_examples::{Request, Response};

const HUB: u8 = 0;
const TCP: u8 = 1;

fn client(ep: Endpoint, addr: SocketAddr, id: u64, requests: u64) -> Result<()> {
    let mut s = Session::new(ep.connect(addr, &rdmsg::Config::default())?);
    for i in 0..requests {
        let req = Request {
            id: id << 32 | i,
            operands: vec![i as i64, 1],
        };
        s.send(&req)?;
        let r: Response = s
            .recv_timeout(Some(Duration::from_secs(20)))?
            .context("an answer within 20 s")?
            .decode()?;
        ensure!(
            r.id == req.id && r.sum == i as i64 + 1,
            "wrong answer {r:?}"
        );
    }
    s.close()?;
    Ok(())
}

/// One thread, one plain epoll loop: a typed hub serving RDMA clients beside a TCP status
/// port. Runs the clients on threads, asks the status port once they are done, and ends with
/// one `epoll_hub: key=value ...` line (a non-zero exit code if an answer is missing).
#[derive(Debug, Parser)]
#[command(name = "epoll_hub", args_override_self = true)]
struct Cli {
    /// Blocking session clients, one thread each
    #[arg(long, value_name = "N", default_value_t = 16)]
    clients: u64,
    /// Requests per client
    #[arg(long, value_name = "R", default_value_t = 500)]
    requests: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rdmsg_examples::run(|| serve(cli.clients, cli.requests))
}

fn serve(clients: u64, requests: u64) -> Result<()> {
    let ep = Endpoint::open_default()?;
    let mut hub = Hub::new(&ep, HubConfig::default())?;
    let addr = hub.listen("127.0.0.1:0")?;
    let status = TcpListener::bind("127.0.0.1:0")?;
    status.set_nonblocking(true)?;
    let status_addr = status.local_addr()?;

    let watch = ReadyWatch::new()?;
    watch.add(hub.as_fd(), HUB)?;
    watch.add(status.as_fd(), TCP)?;

    let workers: Vec<_> = (0..clients)
        .map(|id| {
            let ep = ep.clone();
            std::thread::spawn(move || client(ep, addr, id, requests))
        })
        .collect();
    // The status client: asks once every RDMA client is done.
    let asker = std::thread::spawn(move || -> Result<String> {
        for w in workers {
            w.join().expect("a client thread")?;
        }
        let mut line = String::new();
        TcpStream::connect(status_addr)?.read_to_string(&mut line)?;
        Ok(line)
    });

    let (mut answered, mut gone, mut status_requests, mut loop_waits, mut deferred) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    // Turns of the loop, and events besides requests and departures: a loop that never
    // waits must owe every turn to something it handled (a busy server), not spin.
    let (mut turns, mut other_events, mut resent) = (0u64, 0u64, 0u64);
    let mut unsent: VecDeque<(PeerId, Response)> = VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while !(gone == clients && status_requests == 1) {
        ensure!(Instant::now() < deadline, "not done within 300 s");
        turns += 1;
        hub.step()?;
        let mut busy = false;
        // Answers that found no credit before go first, in order.
        while let Some((peer, resp)) = unsent.front() {
            match hub.try_send(*peer, resp) {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) => {} // the peer is gone: its Disconnected event tells
            }
            unsent.pop_front();
            resent += 1;
            busy = true;
        }
        while let Some(ev) = hub.try_recv()? {
            busy = true;
            match ev {
                HubEvent::Message { peer, msg } => {
                    let req: Request = msg.decode()?;
                    let resp = Response {
                        id: req.id,
                        sum: req.operands.iter().sum(),
                    };
                    answered += 1;
                    if !unsent.is_empty() || !hub.try_send(peer, &resp).unwrap_or(true) {
                        deferred += 1;
                        unsent.push_back((peer, resp));
                    }
                }
                HubEvent::Disconnected { .. } => gone += 1,
                _ => other_events += 1,
            }
        }
        loop {
            match status.accept() {
                Ok((mut s, _)) => {
                    busy = true;
                    status_requests += 1;
                    let st = hub.stats();
                    let t = hub.transport().stats();
                    let _ = writeln!(
                        s,
                        "connections={} received={} sent={} recv_buffers={}",
                        t.connections, st.received, st.sent, t.recv_buffers
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        if busy {
            continue; // step again before sleeping: what we sent may need a flush
        }
        let limit = if unsent.is_empty() {
            hub.next_timeout()
        } else {
            Some(Duration::from_millis(1))
        };
        watch.wait(limit)?;
        loop_waits += 1;
    }
    let line = asker.join().expect("the status client")?;
    ensure!(line.starts_with("connections="), "status line {line:?}");
    let expected = clients * requests;
    println!(
        "epoll_hub: clients={clients} requests={requests} answered={answered} status_requests={status_requests} loop_waits={loop_waits} turns={turns} other_events={other_events} resent={resent} hub_wakeups={} deferred={deferred} errors={}",
        hub.transport().wait_stats().wakeups,
        u64::from(answered != expected)
    );
    ensure!(answered == expected, "{answered} of {expected} answered");
    Ok(())
}
