//! Streams numbered messages over one rdmsg connection, as a peer for tests and a small
//! throughput demo.
//!
//! ```text
//! stream recv 0.0.0.0:18600             # prints a line per 10 000 messages
//! stream send server:18600 100000 64    # count, message size; every 64th solicited
//! ```
//! Exits 0 after a graceful close, 1 with the typed error otherwise.

#![forbid(unsafe_code)]

use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use rdmsg::transport::{Config, Endpoint, Error, Failure};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ep = Endpoint::open_default().context("opening the RDMA device")?;
    let config = Config::default();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["recv", addr] => {
            let listener = ep.listen(addr)?;
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
        ["send", addr, count, size] => {
            let count: u64 = count.parse().context("count")?;
            let size: usize = size.parse().context("size")?;
            if size < 8 {
                bail!("size must be at least 8");
            }
            let mut conn = ep.connect(addr, &config)?;
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
        _ => bail!("usage: stream recv ADDR | stream send ADDR COUNT SIZE"),
    }
    Ok(())
}
