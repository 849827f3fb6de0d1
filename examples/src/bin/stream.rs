//! Streams numbered messages over one rdmsg connection, as a peer for tests and a small
//! throughput demo.
//!
//! ```text
//! stream recv 0.0.0.0:18600             # prints a line per 10 000 messages
//! stream send server:18600 100000 64    # count, message size; every 64th solicited
//! ```
//! Exits 0 after a graceful close, 1 with the typed error otherwise (2 for a command line it
//! does not take; `--help` tells).

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::builder::RangedU64ValueParser;
use clap::{Parser, Subcommand};
use rdmsg::transport::{Config, Endpoint, Error, Failure};

/// Streams numbered messages over one rdmsg connection, as a peer for tests and a small
/// throughput demo. Exits 0 after a graceful close, 1 with the typed error otherwise.
#[derive(Debug, Parser)]
#[command(name = "stream")]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Listens at ADDR, receives from one peer until it closes, checking the numbering;
    /// prints a line per 10 000 messages
    Recv {
        /// Where to listen (port 0: any free port)
        addr: String,
    },
    /// Connects to ADDR and sends COUNT messages of SIZE bytes (every 64th solicited), then
    /// closes
    Send {
        /// The receiver's address
        addr: String,
        /// How many messages
        count: u64,
        /// Bytes per message (at least 8: the number)
        #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(8..))]
        size: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rdmsg_examples::run(|| stream(cli.role))
}

fn stream(role: Role) -> Result<()> {
    let ep = Endpoint::open_default().context("opening the RDMA device")?;
    let config = Config::default();
    match role {
        Role::Recv { addr } => {
            let listener = ep.listen(addr.as_str())?;
            println!("listening on {}", listener.local_addr()?);
            let mut conn = listener.accept(&config)?;
            println!("connected");
            let start = Instant::now();
            let mut n: u64 = 0;
            loop {
                match conn.recv() {
                    Ok(m) => {
                        let seq = u64::from_le_bytes(m[..8].try_into()?);
                        if seq != n {
                            bail!("expected message {n}, got {seq}");
                        }
                        n += 1;
                        if n % 10_000 == 0 {
                            println!("received {n}");
                        }
                    }
                    Err(Error::Connection(Failure::PeerClosed)) => break,
                    Err(e) => return Err(e).context(format!("after {n} messages")),
                }
            }
            let secs = start.elapsed().as_secs_f64();
            println!("received {n} messages in {secs:.2} s, closed by the peer");
        }
        Role::Send { addr, count, size } => {
            let mut conn = ep.connect(addr.as_str(), &config)?;
            println!("connected");
            let mut payload = vec![0u8; size];
            for seq in 0..count {
                payload[..8].copy_from_slice(&seq.to_le_bytes());
                conn.send(&payload, seq % 64 == 63)
                    .with_context(|| format!("sending message {seq}"))?;
                if (seq + 1) % 10_000 == 0 {
                    println!("sent {}", seq + 1);
                }
            }
            conn.close()?;
            println!("sent {count} messages, closed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Role, clap::Error> {
        Cli::try_parse_from(std::iter::once("stream").chain(args.iter().copied())).map(|c| c.role)
    }

    #[test]
    fn command_lines() {
        // As the device tests run it.
        let Ok(Role::Send { addr, count, size }) = parse(&["send", "a:1", "100000000", "64"])
        else {
            panic!("send")
        };
        assert_eq!((addr.as_str(), count, size), ("a:1", 100_000_000, 64));
        let Ok(Role::Recv { addr }) = parse(&["recv", "127.0.0.1:18600"]) else {
            panic!("recv")
        };
        assert_eq!(addr, "127.0.0.1:18600");
        for args in [
            &[][..],
            &["recv"],
            &["recv", "a:1", "b:2"],
            &["send", "a:1", "10"],
            &["send", "a:1", "10", "7"],
            &["send", "a:1", "ten", "64"],
        ] {
            assert!(parse(args).is_err(), "{args:?}");
        }
    }
}
