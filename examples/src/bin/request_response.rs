//! A request/response pair: both message types wake their receiver, so each side sleeps
//! solicited-only between turns.
//!
//! ```text
//! request_response [ROUNDS]
//! ```

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::thread;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Parser;
use rdmsg::msg::Session;
use rdmsg::transport::Config;
use rdmsg_examples::{loopback_pair, Request, Response};

/// A request/response pair on one device: both message types wake their receiver, so each
/// side sleeps solicited-only between turns. Prints the round trips' median and p99.
#[derive(Debug, Parser)]
#[command(name = "request_response")]
struct Cli {
    /// How many requests
    #[arg(default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rdmsg_examples::run(|| exchange(cli.rounds))
}

fn exchange(rounds: u64) -> Result<()> {
    let (server, client) = loopback_pair(&Config::default(), &Config::default())?;
    let server = thread::spawn(move || -> Result<u64> {
        let mut s = Session::new(server);
        s.register::<Request>()?;
        let mut served = 0;
        loop {
            let req: Request = match s.recv() {
                Ok(env) => env.decode()?,
                Err(e) if e.is_fatal() => break, // the client closed
                Err(e) => return Err(e.into()),
            };
            s.send(&Response {
                id: req.id,
                sum: req.operands.iter().sum(),
            })?;
            served += 1;
        }
        Ok(served)
    });
    let mut c = Session::new(client);
    c.register::<Response>()?;
    let mut latencies = Vec::with_capacity(rounds as usize);
    for id in 0..rounds {
        let operands: Vec<i64> = (0..(id % 16) as i64).collect();
        let t = Instant::now();
        c.send(&Request {
            id,
            operands: operands.clone(),
        })?;
        let resp: Response = c.recv()?.decode()?;
        latencies.push(t.elapsed());
        if resp.id != id || resp.sum != operands.iter().sum::<i64>() {
            bail!("wrong response {resp:?} to request {id}");
        }
    }
    let wait = c.connection().wait_stats();
    c.close()?;
    let served = server.join().expect("server thread")?;
    latencies.sort();
    let pct = |p: usize| latencies[(latencies.len() - 1) * p / 100];
    println!(
        "{rounds} requests, {served} served; round trip median {:?}, p99 {:?}; client wake-ups {} ({:.2} per response)",
        pct(50),
        pct(99),
        wait.wakeups,
        wait.wakeups as f64 / rounds as f64
    );
    Ok(())
}
