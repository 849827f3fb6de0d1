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
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use rdmsg::notify::{ArmMode, Policy, Waiter};
use rdmsg::transport::{Endpoint, GidChoice, PathParams, QpAddress, RecvPool};
use rdmsg::verbs::{
    Access, CompletionChannel, CompletionQueue, Context, Mtu, QpCaps, QueuePair, SendRequest,
    WorkCompletion,
};

struct Options {
    port: u16,
    device: Option<String>,
    ib_port: u8,
    size: usize,
    mtu: Mtu,
    rx_depth: u32,
    iters: u64,
    sl: u8,
    events: bool,
    gid_index: Option<u8>,
    server: Option<String>,
}

const USAGE: &str = "usage: rc_pingpong [-p port] [-d device] [-i ib_port] [-s size] [-m mtu] \
[-r rx_depth] [-n iters] [-l sl] [-e] [-g gid_index] [server]";

fn parse_args() -> Result<Options> {
    let mut o = Options {
        port: 18515,
        device: None,
        ib_port: 1,
        size: 4096,
        mtu: Mtu::Mtu1024,
        rx_depth: 500,
        iters: 1000,
        sl: 0,
        events: false,
        gid_index: None,
        server: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<String> {
            args.next()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "-p" | "--port" => o.port = value("-p")?.parse().context("-p")?,
            "-d" | "--ib-dev" => o.device = Some(value("-d")?),
            "-i" | "--ib-port" => o.ib_port = value("-i")?.parse().context("-i")?,
            "-s" | "--size" => o.size = value("-s")?.parse().context("-s")?,
            "-m" | "--mtu" => {
                let bytes: usize = value("-m")?.parse().context("-m")?;
                o.mtu = Mtu::from_bytes(bytes).with_context(|| format!("bad MTU {bytes}"))?;
            }
            "-r" | "--rx-depth" => o.rx_depth = value("-r")?.parse().context("-r")?,
            "-n" | "--iters" => o.iters = value("-n")?.parse().context("-n")?,
            "-l" | "--sl" => o.sl = value("-l")?.parse().context("-l")?,
            "-e" | "--events" => o.events = true,
            "-g" | "--gid-idx" => o.gid_index = Some(value("-g")?.parse().context("-g")?),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            s if s.starts_with('-') => bail!("unknown option {s}\n{USAGE}"),
            s => o.server = Some(s.to_owned()),
        }
    }
    if o.size == 0 || o.rx_depth < 2 || o.iters == 0 {
        bail!("-s and -n must be positive and -r at least 2\n{USAGE}");
    }
    Ok(o)
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

fn main() -> Result<()> {
    let o = parse_args()?;
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
    let remote = exchange(&o, &local, |remote| {
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
    let post_send = |qp: &mut QueuePair, buf: &mut Option<rdmsg::verbs::Buffer>| -> Result<()> {
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
