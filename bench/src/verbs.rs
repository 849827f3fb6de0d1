//! The floors under rdmsg, written directly on `verbs-core`: a one-way stream shaped like
//! `ib_send_bw` (a window of 128 sends, a completion every 64, 512 receives reposted in
//! batches, both sides busy polling, no framing, no credits, no copies), and the cheapest
//! possible sleeping receiver.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdmsg::transport::{Endpoint, PathParams};
use rdmsg::verbs::{
    Access, Buffer, CompletionChannel, CompletionQueue, QpCaps, QueuePair, SendRequest,
    WorkCompletion,
};

const TX_DEPTH: usize = 128;
const SIGNAL_EVERY: u64 = 64;
const RX_DEPTH: usize = 512;
const REPOST_BATCH: usize = 32;

struct Side {
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    qp: QueuePair,
}

fn side(ep: &Endpoint, channel: Option<&CompletionChannel>) -> Result<Side> {
    let ctx = ep.context();
    let send_cq = CompletionQueue::new(ctx, TX_DEPTH as u32 + 1, None)?;
    let recv_cq = CompletionQueue::new(ctx, RX_DEPTH as u32 + 1, channel)?;
    let caps = QpCaps {
        max_send_wr: TX_DEPTH as u32,
        max_recv_wr: RX_DEPTH as u32,
        max_inline_data: 64,
    };
    let mut qp = QueuePair::new_rc(ep.pd(), &send_cq, &recv_cq, caps)?;
    qp.to_init(ep.port())?;
    Ok(Side {
        send_cq,
        recv_cq,
        qp,
    })
}

/// Streams `count` messages of `size` bytes from one queue pair to another on the same
/// device; returns million messages per second at the receiver.
pub fn throughput(size: usize, count: u64) -> Result<f64> {
    let ep = Endpoint::open_default()?;
    let (mut tx, rx) = connected_pair(&ep, size, None)?;
    let ready = Arc::new(Barrier::new(2));
    let receiver = {
        let ready = Arc::clone(&ready);
        thread::spawn(move || receive(rx, count, &ready))
    };
    ready.wait();
    let started = Instant::now();
    let sent = send(&ep, &mut tx, size, count);
    let done = crate::join(receiver);
    sent?;
    let done = done?;
    Ok(count as f64 / done.duration_since(started).as_secs_f64() / 1e6)
}

/// Two connected sides on one device; the receiving one has `RX_DEPTH` receives of `size`
/// bytes posted and its receive CQ on `channel`.
fn connected_pair(
    ep: &Endpoint,
    size: usize,
    channel: Option<&CompletionChannel>,
) -> Result<(Side, Side)> {
    let mut tx = side(ep, None)?;
    let mut rx = side(ep, channel)?;
    let region = ep.pd().register(RX_DEPTH * size, Access::LOCAL_WRITE)?;
    rx.qp.post_recv(region.chunks(size)?).map_err(|e| e.error)?;
    let (tx_psn, rx_psn) = (
        rdmsg::transport::random_psn(tx.qp.qp_num()),
        rdmsg::transport::random_psn(rx.qp.qp_num()),
    );
    let (tx_addr, rx_addr) = (ep.address_of(&tx.qp, tx_psn), ep.address_of(&rx.qp, rx_psn));
    let path = PathParams::default();
    ep.connect_qp(&mut rx.qp, rx_psn, &tx_addr, &path)?;
    ep.connect_qp(&mut tx.qp, tx_psn, &rx_addr, &path)?;
    Ok((tx, rx))
}

/// The floor under any sleeping receiver: `batches` batches of `batch` 64-byte messages, the
/// last of each solicited, `gap` apart, received by a thread that does only what the verbs
/// require (block in `ibv_get_cq_event`, ack, re-arm solicited-only, poll, re-post). Returns its
/// CPU µs per message.
pub fn wake_floor(batch: usize, batches: usize, gap: Duration) -> Result<f64> {
    const SIZE: usize = 64;
    let ep = Endpoint::open_default()?;
    let channel = CompletionChannel::new(ep.context())?;
    let (mut tx, rx) = connected_pair(&ep, SIZE, Some(&channel))?;
    let count = (batch * batches) as u64;
    rx.recv_cq.req_notify(true)?;
    let receiver = thread::spawn(move || -> Result<f64> {
        let mut r = rx;
        let cpu = rdmsg::verbs::thread_cpu_time();
        let mut wcs = WorkCompletion::buffer(32);
        let mut spare: Vec<Buffer> = Vec::new();
        let mut received = 0u64;
        while received < count {
            channel
                .get_event()?
                .context("a blocking channel returned no event")?;
            r.recv_cq.ack_events(1);
            r.recv_cq.req_notify(true)?;
            loop {
                let got = take_received(&mut r, &mut wcs, &mut spare)?;
                received += got as u64;
                if got < wcs.len() {
                    break;
                }
            }
            r.qp.post_recv(spare.drain(..)).map_err(|e| e.error)?;
        }
        let cpu = rdmsg::verbs::thread_cpu_time() - cpu;
        Ok(cpu.as_secs_f64() * 1e6 / count as f64)
    });
    let payload = [7u8; SIZE];
    let mut wcs = WorkCompletion::buffer(16);
    for _ in 0..batches {
        let reqs = (0..batch).map(|i| {
            SendRequest::inline(&payload)
                .solicited(i + 1 == batch)
                .signaled(i + 1 == batch)
        });
        tx.qp.post_send(reqs).map_err(|e| e.error)?;
        while tx.qp.send_outstanding() > 0 {
            let got = tx.send_cq.poll(&mut wcs)?;
            for wc in &wcs[..got] {
                if !wc.is_success() {
                    bail!("send completion failed: {:?}", wc.status());
                }
                tx.qp.complete_send(wc);
            }
        }
        thread::sleep(gap);
    }
    crate::join(receiver)
}

fn send(ep: &Endpoint, s: &mut Side, size: usize, count: u64) -> Result<()> {
    let inline = size <= s.qp.caps().max_inline_data as usize;
    let payload = vec![0xa5u8; size];
    let mut free: Vec<Buffer> = if inline {
        Vec::new()
    } else {
        let mut bufs = ep
            .pd()
            .register(TX_DEPTH * size, Access::LOCAL_WRITE)?
            .chunks(size)?;
        for b in &mut bufs {
            b.as_mut_slice().copy_from_slice(&payload);
        }
        bufs
    };
    let mut wcs = WorkCompletion::buffer(16);
    let mut posted = 0u64;
    while posted < count || s.qp.send_outstanding() > 0 {
        let room = TX_DEPTH - s.qp.send_outstanding();
        let n = (room as u64).min(count - posted) as usize;
        if n > 0 {
            let mut reqs = Vec::with_capacity(n);
            for i in 0..n as u64 {
                let id = posted + i;
                let req = if inline {
                    SendRequest::inline(&payload)
                } else {
                    SendRequest::buffer(free.pop().context("send buffers exhausted")?, size)
                };
                reqs.push(req.signaled((id + 1) % SIGNAL_EVERY == 0 || id + 1 == count));
            }
            s.qp.post_send(reqs).map_err(|e| e.error)?;
            posted += n as u64;
        }
        let got = s.send_cq.poll(&mut wcs)?;
        for wc in &wcs[..got] {
            if !wc.is_success() {
                bail!("send completion failed: {:?}", wc.status());
            }
            free.extend(s.qp.complete_send(wc));
        }
    }
    Ok(())
}

fn receive(mut r: Side, count: u64, ready: &Barrier) -> Result<Instant> {
    ready.wait();
    let mut wcs = WorkCompletion::buffer(32);
    let mut spare: Vec<Buffer> = Vec::with_capacity(RX_DEPTH);
    let mut received = 0u64;
    while received < count {
        received += take_received(&mut r, &mut wcs, &mut spare)? as u64;
        if spare.len() >= REPOST_BATCH {
            r.qp.post_recv(spare.drain(..)).map_err(|e| e.error)?;
        }
    }
    Ok(Instant::now())
}

/// Polls the receive CQ once; the buffers of successful receives go to `spare`. Returns how
/// many completions there were.
fn take_received(
    r: &mut Side,
    wcs: &mut [WorkCompletion],
    spare: &mut Vec<Buffer>,
) -> Result<usize> {
    let got = r.recv_cq.poll(wcs)?;
    for wc in &wcs[..got] {
        if !wc.is_success() {
            bail!("receive completion failed: {:?}", wc.status());
        }
        spare.push(r.qp.take_recv(wc).context("unknown receive completion")?);
    }
    Ok(got)
}
