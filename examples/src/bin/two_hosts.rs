//! Two hosts, one connection: the client sends `--messages` readings in batches and an alarm,
//! the server checks them, answers, and then waits for whatever comes next. When the client's
//! host dies (no FIN, no RST: `cargo xtask vm2` kills its VM), the server must report the
//! peer as gone, typed, within the keepalive limit, not hang.
//!
//! ```text
//! two_hosts server [--listen ADDR] [--messages N]
//! two_hosts client --connect ADDR [--messages N]
//! ```

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use rdmsg::msg::Session;
use rdmsg::transport::{Config, Endpoint, Error, Failure};
use rdmsg_examples::{Alarm, Reading, Request, Response};

struct Options {
    server: bool,
    addr: String,
    messages: u64,
}

fn parse() -> Result<Options> {
    let mut args = std::env::args().skip(1);
    let server = match args.next().as_deref() {
        Some("server") => true,
        Some("client") => false,
        _ => bail!("usage: two_hosts server|client [--listen|--connect ADDR] [--messages N]"),
    };
    let mut o = Options {
        server,
        addr: "0.0.0.0:18800".into(),
        messages: 10_000,
    };
    while let Some(a) = args.next() {
        let mut v = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--listen" | "--connect" => o.addr = v()?,
            "--messages" => o.messages = v()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(o)
}

fn main() -> Result<()> {
    let o = parse()?;
    let ep = Endpoint::open_default()?;
    println!(
        "two_hosts: {} on {} ({})",
        if o.server { "server" } else { "client" },
        ep.context().name(),
        o.addr
    );
    if o.server {
        serve(&o, &ep)
    } else {
        client(&o, &ep)
    }
}

fn serve(o: &Options, ep: &Endpoint) -> Result<()> {
    let listener = ep.listen(o.addr.as_str())?;
    let mut s = Session::new(listener.accept(&Config::default())?);
    println!("server: connected to {}", s.connection().peer().addr);
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
        "server: {readings} readings in {secs:.2} s ({:.0}/s), {} wake-ups; waiting for the peer",
        readings as f64 / secs,
        s.connection().wait_stats().wakeups
    );
    let quiet = Instant::now();
    match s.recv() {
        Err(rdmsg::msg::Error::Transport(Error::Connection(f @ Failure::PeerVanished))) => {
            println!(
                "server: peer failure: {f} after {:.2} s of silence",
                quiet.elapsed().as_secs_f64()
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
        match ep.connect(o.addr.as_str(), &Config::default()) {
            Ok(c) => break c,
            Err(Error::Connect { .. } | Error::Bootstrap { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let mut s = Session::new(conn);
    println!("client: connected to {}", s.connection().peer().addr);
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
