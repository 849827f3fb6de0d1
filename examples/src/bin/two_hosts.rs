//! Two hosts, one connection: the client sends `--messages` readings in batches and an alarm,
//! the server checks them, answers, and then waits for whatever comes next. When the client's
//! host dies (no FIN, no RST, no DREQ: `cargo xtask vm2` kills its VM), the server must report
//! the peer as gone, typed, within the keepalive limit, not hang: through TCP keepalive on the
//! bootstrap stream, or with `--cm` (connected through rdma_cm, which has no keepalive) through
//! the connection's liveness probes.
//!
//! ```text
//! two_hosts server [--cm] [--listen ADDR] [--messages N]
//! two_hosts client [--cm] --connect ADDR [--messages N]
//! ```
//!
//! `--listen` and `--connect` are one option (default `0.0.0.0:18800`, in both roles; over
//! rdma_cm the server's must be the address of its RDMA device).

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use rdmsg::msg::Session;
use rdmsg::transport::{Config, Endpoint, Error, Failure};
use rdmsg_examples::{Alarm, Reading, Request, Response};

/// Two hosts, one connection: the client sends readings in batches and an alarm, the server
/// checks them, answers, and then waits for whatever comes next; when the client's host dies,
/// the server must report the peer as gone, typed, within the keepalive limit.
#[derive(Debug, Parser)]
#[command(name = "two_hosts", args_override_self = true)]
struct Options {
    /// Which side this host is
    #[arg(value_enum)]
    role: Role,
    /// Where the server listens, or the client connects (the same option)
    #[arg(
        long = "listen",
        visible_alias = "connect",
        value_name = "ADDR",
        default_value = "0.0.0.0:18800"
    )]
    addr: String,
    /// Readings the client sends (and the server expects)
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    messages: u64,
    /// Connect through the RDMA connection manager instead of the TCP bootstrap
    #[arg(long)]
    cm: bool,
}

impl Options {
    fn way(&self) -> &'static str {
        if self.cm {
            "rdma_cm"
        } else {
            "tcp"
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Accepts one connection, checks it, then waits for the peer to vanish
    Server,
    /// Connects (retrying for a minute), sends, then says READY-TO-DIE and sleeps
    Client,
}

fn main() -> ExitCode {
    let o = Options::parse();
    rdmsg_examples::run(|| run_role(&o))
}

fn run_role(o: &Options) -> Result<()> {
    let server = o.role == Role::Server;
    let ep = Endpoint::open_default()?;
    println!(
        "two_hosts: {} on {} ({} over {})",
        if server { "server" } else { "client" },
        ep.context().name(),
        o.addr,
        o.way()
    );
    if server {
        serve(o, &ep)
    } else {
        client(o, &ep)
    }
}

fn serve(o: &Options, ep: &Endpoint) -> Result<()> {
    let conn = if o.cm {
        ep.listen_cm(o.addr.as_str())?.accept(&Config::default())?
    } else {
        ep.listen(o.addr.as_str())?.accept(&Config::default())?
    };
    let mut s = Session::new(conn);
    let way = o.way();
    println!(
        "server: connected to {} over {way}",
        s.connection().peer().addr
    );
    let started = Instant::now();
    let mut readings = 0u64;
    loop {
        let env = s.recv()?;
        if env.is::<Reading>() {
            let r: Reading = env.decode()?;
            if r.seq != readings {
                bail!("reading {} arrived as number {readings}", r.seq);
            }
            readings += 1;
        } else if env.is::<Alarm>() {
            env.decode::<Alarm>()?;
        } else {
            let req: Request = env.decode()?;
            if readings != o.messages {
                bail!("asked after {readings} of {} readings", o.messages);
            }
            s.send(&Response {
                id: req.id,
                sum: readings as i64,
            })?;
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "server: {readings} readings over {way} in {secs:.2} s ({:.0}/s), {} wake-ups; waiting for the peer",
        readings as f64 / secs,
        s.connection().wait_stats().wakeups
    );
    let quiet = Instant::now();
    match s.recv() {
        Err(rdmsg::msg::Error::Transport(Error::Connection(f @ Failure::PeerVanished))) => {
            println!(
                "server: peer failure over {way}: {f} after {:.2} s of silence ({} probes)",
                quiet.elapsed().as_secs_f64(),
                s.connection().stats().probes
            );
            Ok(())
        }
        Err(e) => bail!("unexpected error: {e}"),
        Ok(env) => bail!("unexpected message with tag {:#x}", env.tag()),
    }
}

fn client(o: &Options, ep: &Endpoint) -> Result<()> {
    // The server's host may still be booting: retry for a while.
    let deadline = Instant::now() + Duration::from_secs(60);
    let conn = loop {
        let made = if o.cm {
            ep.connect_cm(o.addr.as_str(), &Config::default())
        } else {
            ep.connect(o.addr.as_str(), &Config::default())
        };
        match made {
            Ok(c) => break c,
            // Over rdma_cm, a host that is not up yet may leave the address, route or
            // request unanswered: the connect times out rather than being refused.
            Err(
                Error::Connect { .. }
                | Error::Bootstrap { .. }
                | Error::Cm { .. }
                | Error::Timeout(_),
            ) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let mut s = Session::new(conn);
    println!(
        "client: connected to {} over {}",
        s.connection().peer().addr,
        o.way()
    );
    let mut seq = 0;
    while seq < o.messages {
        let n = 50.min(o.messages - seq);
        let batch: Vec<Reading> = (seq..seq + n)
            .map(|i| Reading {
                sensor: (i % 4) as u16,
                seq: i,
                value: i as f64,
            })
            .collect();
        s.send_batch(&batch)?;
        seq += n;
    }
    s.send(&Alarm {
        sensor: 1,
        reason: "end of run".into(),
    })?;
    s.send(&Request {
        id: 1,
        operands: Vec::new(),
    })?;
    let resp: Response = s.recv()?.decode()?;
    println!("client: the server counted {} readings", resp.sum);
    // Now the host dies under the connection: xtask kills this VM when it sees the line.
    println!("client: READY-TO-DIE");
    std::thread::sleep(Duration::from_secs(3600));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("two_hosts").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn command_lines() {
        // As `cargo xtask test` runs both sides.
        let o = parse(&["server", "--listen", "0.0.0.0:18800", "--messages", "20000"]);
        assert_eq!(
            (o.role, o.addr.as_str(), o.messages),
            (Role::Server, "0.0.0.0:18800", 20000)
        );
        let o = parse(&[
            "client",
            "--connect",
            "10.78.0.1:18800",
            "--messages",
            "20000",
        ]);
        assert_eq!(
            (o.role, o.addr.as_str(), o.messages),
            (Role::Client, "10.78.0.1:18800", 20000)
        );
        let o = parse(&["client"]);
        assert_eq!((o.addr.as_str(), o.messages), ("0.0.0.0:18800", 10_000));
        assert_eq!(parse(&["server", "--connect", "a:1"]).addr, "a:1");
        let o = parse(&["server", "--cm", "--listen", "10.78.0.1:18801"]);
        assert!(o.cm && !parse(&["server"]).cm);
    }

    #[test]
    fn refused() {
        for args in [&[][..], &["both"], &["server", "--bogus"]] {
            let args = std::iter::once("two_hosts").chain(args.iter().copied());
            assert!(Options::try_parse_from(args).is_err());
        }
    }
}
