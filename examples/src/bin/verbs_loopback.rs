//! Sends a few messages between two queue pairs of one device and shows a solicited-only
//! receiver sleeping through the unsolicited ones and waking on the solicited one.
//!
//! Run it inside the Soft-RoCE VM: `cargo xtask demo`.

#![forbid(unsafe_code)]

use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use rdmsg::verbs::{
    connect_loopback, wait_readable, Access, CompletionChannel, CompletionQueue, Context,
    ProtectionDomain, QpCaps, QueuePair, SendRequest, WorkCompletion,
};

const PORT: u8 = 1;
const BUF: usize = 256;

/// Sends a few messages between two queue pairs of one device and shows a solicited-only
/// receiver sleeping through the unsolicited ones and waking on the solicited one. Takes no
/// arguments.
#[derive(Debug, Parser)]
#[command(name = "verbs_loopback")]
struct Cli {}

fn main() -> ExitCode {
    Cli::parse();
    rdmsg_examples::run(loopback)
}

fn loopback() -> Result<()> {
    let ctx = Context::open_default().context("opening the RDMA device")?;
    let port = ctx.query_port(PORT)?;
    let (gid_index, gid) = ctx.pick_roce_v2_ipv4_gid(PORT)?;
    println!(
        "device {}: port {PORT} {:?}, active MTU {} bytes, RoCE v2 GID[{gid_index}] = {gid}",
        ctx.name(),
        port.state,
        port.active_mtu.bytes()
    );

    let pd = ProtectionDomain::new(&ctx)?;
    let channel = CompletionChannel::new(&ctx)?;
    let send_cq = CompletionQueue::new(&ctx, 32, None)?;
    let mut recv_cq = CompletionQueue::new(&ctx, 32, Some(&channel))?;
    let unused_cq = CompletionQueue::new(&ctx, 1, None)?;
    let mut sender = QueuePair::new_rc(&pd, &send_cq, &unused_cq, QpCaps::default())?;
    let mut receiver = QueuePair::new_rc(&pd, &unused_cq, &recv_cq, QpCaps::default())?;
    receiver.to_init(PORT)?;
    receiver.post_recv(pd.register(16 * BUF, Access::LOCAL_WRITE)?.chunks(BUF)?)?;
    connect_loopback(&ctx, PORT, &mut sender, &mut receiver)?;
    println!(
        "connected QP {:#x} -> QP {:#x}",
        sender.qp_num(),
        receiver.qp_num()
    );

    recv_cq.req_notify(true)?;
    println!("receiver armed solicited-only; sending 4 unsolicited messages");
    let texts = [
        "reading 1",
        "reading 2",
        "reading 3",
        "reading 4",
        "ALARM: wake up",
    ];
    let mut send_bufs = pd
        .register(texts.len() * BUF, Access::LOCAL_WRITE)?
        .chunks(BUF)?;
    for (i, text) in texts.iter().enumerate() {
        let last = i + 1 == texts.len();
        if last {
            let woke = wait_readable(channel.as_fd(), Some(Duration::from_millis(200)))?;
            println!("  receiver woke during unsolicited traffic: {woke}");
            if woke {
                bail!("a solicited-only receiver woke for unsolicited messages");
            }
            println!("sending 1 solicited message");
        }
        let mut buf = send_bufs.pop().context("send buffer")?;
        buf.as_mut_slice()[..text.len()].copy_from_slice(text.as_bytes());
        sender.post_send(vec![SendRequest::buffer(buf, text.len()).solicited(last)])?;
    }

    let started = Instant::now();
    if !wait_readable(channel.as_fd(), Some(Duration::from_secs(5)))? {
        bail!("no completion event within 5 s of the solicited send");
    }
    let event = channel.get_event()?.context("event expected")?;
    recv_cq.ack_events(1);
    println!(
        "receiver woke after {:?} (event for the receive CQ: {})",
        started.elapsed(),
        event.is_for(&recv_cq)
    );

    let mut wcs = WorkCompletion::buffer(16);
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while got < texts.len() && Instant::now() < deadline {
        let n = recv_cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            let buf = receiver
                .take_recv(wc)
                .context("completion for a buffer we posted")?;
            let text = String::from_utf8_lossy(&buf.as_slice()[..wc.byte_len() as usize]);
            println!("  drained #{got}: {text:?} ({:?})", wc.status());
            got += 1;
        }
    }
    if got != texts.len() {
        bail!("drained {got} of {} messages", texts.len());
    }
    println!(
        "one wake-up, {got} messages: solicited-only works on {}",
        ctx.name()
    );
    Ok(())
}
