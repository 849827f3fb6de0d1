//! A drop-in peer for rdma-core's `ibv_rc_pingpong`: same flags, same TCP exchange of
//! `LID:QPN:PSN:GID` records, same ping-pong of `-n` messages of `-s` bytes, so that either side
//! can be ours or theirs. Polls by default; `-e` sleeps on the completion channel.
//!
//! ```text
//! rc_pingpong -g 1            # server
//! rc_pingpong -g 1 localhost  # client
//! ```

#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use rdmsg::notify::{ArmMode, Policy, Waiter};
use rdmsg::transport::{Endpoint, GidChoice, PathParams, QpAddress, RecvPool};
use rdmsg::verbs::{
    Access, CompletionChannel, CompletionQueue, Context, Mtu, QpCaps, QueuePair, SendRequest,
    WorkCompletion,
};

/// A drop-in peer for rdma-core's `ibv_rc_pingpong`: the same flags, the same TCP exchange of
/// addresses, the same ping-pong of ITERS messages of SIZE bytes. The server listens on PORT;
/// the client, given the server's name, connects to it. Polls by default; -e sleeps on the
/// completion channel.
#[derive(Debug, Parser)]
#[command(name = "rc_pingpong", args_override_self = true)]
struct Options {
    /// Listen on / connect to this TCP port
    #[arg(short, long, default_value_t = 18515)]
    port: u16,
    /// Use this IB device (default: $RDMSG_DEVICE, else the first found)
    #[arg(short, long = "ib-dev", value_name = "DEV")]
    device: Option<String>,
    /// Use this port of the IB device
    #[arg(short, long, default_value_t = 1)]
    ib_port: u8,
    /// Size of the messages
    #[arg(short, long, default_value_t = 4096,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    size: usize,
    /// Path MTU in bytes (256, 512, 1024, 2048 or 4096)
    #[arg(short, long, value_name = "MTU", default_value = "1024", value_parser = mtu)]
    mtu: Mtu,
    /// Receives to post at a time (at least 2)
    #[arg(short, long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(2..))]
    rx_depth: u32,
    /// Number of exchanges
    #[arg(short = 'n', long, default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Service level
    #[arg(short = 'l', long, default_value_t = 0)]
    sl: u8,
    /// Sleep on completion events (else poll)
    #[arg(short, long)]
    events: bool,
    /// Hold each message this many microseconds before sending it, so that the peer is asleep
    /// when it comes (not an ibv_rc_pingpong flag: rdmsg-bench's cost check uses it)
    #[arg(long, value_name = "MICROSECONDS", default_value_t = 0)]
    hold_us: u64,
    /// Local port GID index (default: the RoCE v2 IPv4 one)
    #[arg(short, long = "gid-idx", value_name = "GID_INDEX")]
    gid_index: Option<u8>,
    /// The server to connect to (without it: be the server)
    server: Option<String>,
}

/// `-m`: an MTU in bytes.
fn mtu(bytes: &str) -> Result<Mtu> {
    let bytes: usize = bytes.parse()?;
    Mtu::from_bytes(bytes).with_context(|| format!("bad MTU {bytes}"))
}

/// Exchanges records as `ibv_rc_pingpong` does. The server connects its queue pair before it
/// answers, the client after; both return the peer's address.
fn exchange(
    o: &Options,
    local: &QpAddress,
    connect: impl FnOnce(&QpAddress) -> Result<()>,
) -> Result<QpAddress> {
    let mut record = [0u8; QpAddress::RECORD_LEN];
    match &o.server {
        Some(host) => {
            let mut s = TcpStream::connect((host.as_str(), o.port))
                .with_context(|| format!("couldn't connect to {host}:{}", o.port))?;
            s.write_all(&local.to_record())?;
            s.read_exact(&mut record)
                .context("couldn't read the remote address")?;
            s.write_all(b"done\0")?;
            let remote = QpAddress::from_record(&record)?;
            connect(&remote)?;
            Ok(remote)
        }
        None => {
            let listener = TcpListener::bind(("0.0.0.0", o.port))
                .with_context(|| format!("couldn't listen on port {}", o.port))?;
            let (mut s, _) = listener.accept()?;
            s.read_exact(&mut record)
                .context("couldn't read the remote address")?;
            let remote = QpAddress::from_record(&record)?;
            connect(&remote)?;
            s.write_all(&local.to_record())?;
            let mut done = [0u8; 5];
            s.read_exact(&mut done).context("couldn't read \"done\"")?;
            Ok(remote)
        }
    }
}

/// Receive buffers re-posted per `ibv_post_recv` call.
const REPOST_BATCH: usize = 8;

const SEND: u8 = 1;
const RECV: u8 = 2;

fn main() -> ExitCode {
    let o = Options::parse();
    rdmsg_examples::run(|| pingpong(&o))
}

fn pingpong(o: &Options) -> Result<()> {
    let ctx = match &o.device {
        Some(name) => Context::open(name),
        None => Context::open_default(),
    }
    .context("opening the RDMA device")?;
    let gid = o.gid_index.map_or(GidChoice::Auto, GidChoice::Index);
    let ep = Endpoint::open(ctx, o.ib_port, gid)?;
    let ctx = ep.context();

    let channel = CompletionChannel::new(ctx)?;
    // One CQ for both queues, as ibv_rc_pingpong has: it wakes on every completion anyway
    // (a solicited-only receiver keeps its send completions on a CQ of their own).
    let cq = CompletionQueue::new(ctx, o.rx_depth + 2, Some(&channel))?;
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: o.rx_depth,
        max_inline_data: 64,
    };
    let mut qp = QueuePair::new_rc(ep.pd(), &cq, &cq, caps)?;
    let inline = o.size <= qp.caps().max_inline_data as usize;
    qp.to_init(o.ib_port)?;
    let mut pool = RecvPool::new(ep.pd(), o.rx_depth as usize, o.size)?;
    qp.post_recv(pool.take_free()).map_err(|e| e.error)?;

    let psn = rdmsg::transport::random_psn(qp.qp_num());
    let local = ep.address_of(&qp, psn);
    println!("  local address:  {local}");
    let path = PathParams {
        mtu: Some(o.mtu),
        sl: o.sl,
        ..PathParams::default()
    };
    let remote = exchange(o, &local, |remote| {
        ep.connect_qp(&mut qp, psn, remote, &path)
            .context("couldn't connect the queue pair")
    })?;
    println!("  remote address: {remote}");

    let policy = if o.events {
        Policy::Sleep
    } else {
        Policy::Poll
    };
    let mut waiter = Waiter::new_verbs(channel, policy)?;
    // ibv_rc_pingpong does not solicit its sends: wake on every completion.
    waiter.add(cq, ArmMode::Next);

    let mut send_buf = Some(ep.pd().register(o.size, Access::LOCAL_WRITE)?);
    let payload = vec![0x5a; o.size];
    let hold = std::time::Duration::from_micros(o.hold_us);
    let post_send = |qp: &mut QueuePair, buf: &mut Option<rdmsg::verbs::Buffer>| -> Result<()> {
        if !hold.is_zero() {
            std::thread::sleep(hold);
        }
        let req = if inline {
            SendRequest::inline(&payload)
        } else {
            SendRequest::buffer(buf.take().context("send buffer in use")?, o.size)
        };
        qp.post_send_one(req.signaled(true)).map_err(|e| e.error)?;
        Ok(())
    };

    let mut pending = RECV;
    if o.server.is_some() {
        post_send(&mut qp, &mut send_buf)?;
        pending |= SEND;
    }
    let start = Instant::now();
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    let mut sent_bufs = Vec::with_capacity(1);
    // At most half the receives wait to be re-posted, however small the depth.
    let repost_batch = REPOST_BATCH.min(o.rx_depth as usize / 2).max(1);
    // Each completion is handled where it is polled; the first error ends the loop. Says
    // whether every message went both ways.
    let mut handle = |wc: &WorkCompletion| -> Result<bool> {
        if !wc.is_success() {
            // A failed completion's opcode is undefined: say which queue from the QP's books.
            bail!("completion failed: {:?}", wc.status());
        }
        if wc.opcode().is_recv() {
            let buf = qp.take_recv(wc).context("unknown receive completion")?;
            pool.put_back(buf);
            // Re-post in lists of 8, as ibv_rc_pingpong re-posts in batches: one call per 8
            // receives, and no allocation.
            if pool.free_count() >= repost_batch {
                qp.post_recv(pool.take_free()).map_err(|e| e.error)?;
            }
            rcnt += 1;
            pending &= !RECV;
        } else {
            qp.complete_send_into(wc, &mut sent_bufs);
            if let Some(b) = sent_bufs.pop() {
                send_buf = Some(b);
            }
            scnt += 1;
            pending &= !SEND;
        }
        if scnt < o.iters && pending == 0 {
            post_send(&mut qp, &mut send_buf)?;
            pending = RECV | SEND;
        }
        Ok(scnt >= o.iters && rcnt >= o.iters)
    };
    let mut outcome = Ok(false);
    while matches!(outcome, Ok(false)) {
        waiter.wait(None, &mut |_, wc| {
            if matches!(outcome, Ok(false)) {
                outcome = handle(wc);
            }
        })?;
    }
    outcome?;
    let secs = start.elapsed().as_secs_f64();
    let bytes = o.size as u64 * o.iters * 2;
    println!(
        "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as f64 * 8.0 / secs / 1e6
    );
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        o.iters,
        secs * 1e6 / o.iters as f64
    );
    if o.events {
        let s = waiter.stats();
        println!(
            "{} wake-ups, {:.2} completions per wake-up, {:?} asleep",
            s.wakeups,
            s.completions_per_wakeup(),
            s.time_asleep
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("rc_pingpong").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn ibv_rc_pingpong_flags() {
        let o = parse(&[]);
        assert_eq!(
            (o.port, o.device, o.ib_port, o.size),
            (18515, None, 1, 4096)
        );
        assert_eq!(
            (o.mtu, o.rx_depth, o.iters, o.sl),
            (Mtu::Mtu1024, 500, 1000, 0)
        );
        assert_eq!((o.events, o.gid_index, o.server), (false, None, None));
        // As the device tests and rdmsg-bench run it, server then client.
        let common = [
            "-d", "rxe0", "-g", "1", "-p", "18600", "-n", "200", "-s", "64", "-e",
        ];
        let o = parse(&common);
        assert_eq!(
            (o.device.as_deref(), o.gid_index, o.port),
            (Some("rxe0"), Some(1), 18600)
        );
        assert_eq!((o.iters, o.size, o.events, o.server), (200, 64, true, None));
        let o = parse(&[&common[..], &["127.0.0.1"]].concat());
        assert_eq!(o.server.as_deref(), Some("127.0.0.1"));
        // The README's, the server's name anywhere, and the long forms.
        assert_eq!(
            parse(&["-g", "1", "localhost"]).server.as_deref(),
            Some("localhost")
        );
        let o = parse(&["host", "-m", "4096", "-r", "2", "-l", "3", "-i", "2"]);
        assert_eq!(o.server.as_deref(), Some("host"));
        assert_eq!(
            (o.mtu, o.rx_depth, o.sl, o.ib_port),
            (Mtu::Mtu4096, 2, 3, 2)
        );
        let o = parse(&[
            "--port",
            "1",
            "--ib-dev",
            "x",
            "--ib-port",
            "1",
            "--size",
            "8",
            "--mtu",
            "256",
            "--rx-depth",
            "9",
            "--iters",
            "3",
            "--sl",
            "1",
            "--events",
            "--gid-idx",
            "2",
        ]);
        assert_eq!(
            (o.port, o.device.as_deref(), o.size, o.mtu),
            (1, Some("x"), 8, Mtu::Mtu256)
        );
        assert_eq!(
            (o.rx_depth, o.iters, o.events, o.gid_index),
            (9, 3, true, Some(2))
        );
    }

    #[test]
    fn refused() {
        for args in [
            &["-x"][..],
            &["-m", "1000"],
            &["-s", "0"],
            &["-n", "0"],
            &["-r", "1"],
            &["-g"],
        ] {
            let args = std::iter::once("rc_pingpong").chain(args.iter().copied());
            assert!(Options::try_parse_from(args).is_err());
        }
    }
}
