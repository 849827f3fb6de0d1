//! A ping-pong over a queue pair the RDMA connection manager connected (librdmacm), at the raw
//! layer (verbs-core and notify, as `rc_pingpong` is). By default it speaks the protocol of
//! rdma-core's `rdma_server` / `rdma_client` (port 7471, one exchange of 16 bytes: the client
//! sends, the server answers), so either side can be ours or theirs. With `--hello` the client
//! puts rdmsg's hello (the size and the number of exchanges) in the connection request's
//! private data; a server that disagrees rejects the request with its reason in the reject's
//! private data, and takes the next request.
//!
//! One thread waits on the completion channel and the CM's event channel together: a peer that
//! disconnects in the middle ends the run with an error at once, not at a timeout.
//!
//! ```text
//! cm_pingpong                      # server on 0.0.0.0:7471
//! cm_pingpong 10.77.0.1            # client
//! cm_pingpong --hello -n 1000 -s 64 --solicited 10.77.0.1
//! ```

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use clap::Parser;
use rdmsg::notify::{ArmMode, Policy, Waiter};
use rdmsg::verbs::{
    Access, Buffer, CmEvent, CmEventChannel, CmEventKind, CmId, CompletionChannel, CompletionQueue,
    ConnParams, Context, ProtectionDomain, QpCaps, QpTuning, QueuePair, ReadyWatch, SendRequest,
    WorkCompletion, REJECT_CONSUMER, REJECT_INVALID_SERVICE,
};

/// A ping-pong over a connection the RDMA connection manager set up. The server listens on
/// BIND:PORT; the client, given the server's address, connects to it. Speaks rdma-core's
/// rdma_server / rdma_client protocol by default.
#[derive(Debug, Parser)]
#[command(name = "cm_pingpong", args_override_self = true)]
struct Options {
    /// Listen on / connect to this port
    #[arg(short, long, default_value_t = 7471)]
    port: u16,
    /// The server's address to listen on
    #[arg(short, long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Size of the messages
    #[arg(short, long, default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    size: u32,
    /// Number of exchanges
    #[arg(short = 'n', long, default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Client: send rdmsg's hello in the request's private data (the server checks it)
    #[arg(long)]
    hello: bool,
    /// Arm the receive queue solicited-only (every send of ours is solicited; rdma-core's
    /// tools solicit none)
    #[arg(long)]
    solicited: bool,
    /// Seconds to wait for any one step (a connection event, the next completion)
    #[arg(short, long, default_value_t = 10)]
    timeout: u64,
    /// The server to connect to (without it: be the server)
    server: Option<String>,
}

/// The hello in a connection request's private data: magic, size, exchanges (20 of the 56
/// bytes a request carries; the CM pads the rest with zeros).
const HELLO_MAGIC: &[u8; 8] = b"rdmsgcm1";
const HELLO_LEN: usize = 20;
const _: () = assert!(HELLO_LEN <= rdmsg::verbs::CONNECT_PRIVATE_DATA_MAX);

fn hello(size: u32, iters: u64) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..8].copy_from_slice(HELLO_MAGIC);
    h[8..12].copy_from_slice(&size.to_le_bytes());
    h[12..20].copy_from_slice(&iters.to_le_bytes());
    h
}

/// A request's hello: `None` for a peer that sent none (rdma-core's tools), else its size and
/// exchanges.
fn parse_hello(data: &[u8]) -> Option<(u32, u64)> {
    if data.len() < HELLO_LEN || &data[..8] != HELLO_MAGIC {
        return None;
    }
    let size = u32::from_le_bytes(data[8..12].try_into().ok()?);
    let iters = u64::from_le_bytes(data[12..20].try_into().ok()?);
    Some((size, iters))
}

/// What a server says when it refuses a hello, or `None` when it agrees.
fn refusal(ours: (u32, u64), theirs: (u32, u64)) -> Option<String> {
    if ours == theirs {
        return None;
    }
    Some(format!(
        "the server runs {} exchanges of {} bytes, the client asked for {} of {}",
        ours.1, ours.0, theirs.1, theirs.0
    ))
}

/// Private data as text: up to the first zero byte (the CM pads it with zeros).
fn text(data: &[u8]) -> String {
    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    String::from_utf8_lossy(&data[..end]).into_owned()
}

const COMPLETIONS: u64 = 0;
const CM: u64 = 1;

/// The CM's event channel and a watch over it (and, once there is one, the completion
/// channel).
struct Events {
    channel: CmEventChannel,
    watch: ReadyWatch,
    timeout: Duration,
}

impl Events {
    fn new(timeout: Duration) -> Result<Self> {
        let channel = CmEventChannel::new().context("opening the connection manager")?;
        let watch = ReadyWatch::new()?;
        watch.add_keyed(channel.as_fd(), CM)?;
        Ok(Self {
            channel,
            watch,
            timeout,
        })
    }

    /// The next CM event, waiting at most the step timeout for it.
    fn next(&self, waiting_for: &str) -> Result<CmEvent> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(ev) = self.channel.next_event()? {
                return Ok(ev);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "timed out after {:?} waiting for {waiting_for}",
                    self.timeout
                );
            }
            let mut ready = Vec::new();
            self.watch.wait_keys(Some(left), &mut ready)?;
        }
    }

    /// Waits for `want` on `id`, failing with what happened instead. Events of other ids
    /// (another client's request, say) are dropped: a dropped request is refused.
    fn expect(&self, id: &CmId, want: CmEventKind) -> Result<CmEvent> {
        let ev = loop {
            let ev = self.next(&format!("{want:?}"))?;
            if ev.id == id.key() {
                break ev;
            }
        };
        if ev.kind == want && ev.status == 0 {
            return Ok(ev);
        }
        Err(failure(&ev))
    }
}

/// A CM event that ends the connection, as an error that says what it means.
fn failure(ev: &CmEvent) -> anyhow::Error {
    match ev.kind {
        CmEventKind::Rejected if ev.status == REJECT_CONSUMER => anyhow!(
            "the server rejected the connection: {}",
            if ev.private_data.iter().any(|&b| b != 0) {
                text(&ev.private_data)
            } else {
                "no reason given".into()
            }
        ),
        CmEventKind::Rejected if ev.status == REJECT_INVALID_SERVICE => {
            anyhow!("nothing listens there (rejected by the peer's connection manager)")
        }
        CmEventKind::Rejected => anyhow!("the connection was rejected (reason {})", ev.status),
        CmEventKind::Disconnected => anyhow!("the peer disconnected"),
        CmEventKind::DeviceRemoval => anyhow!("the RDMA device is being removed"),
        // librdmacm reports a missing device as -1 (its ERR(ENODEV) sets errno instead).
        _ if ev.status == -1 => anyhow!("{:?}: no RDMA device for that address", ev.kind),
        _ if ev.status < 0 => anyhow!(
            "{:?}: {}",
            ev.kind,
            std::io::Error::from_raw_os_error(-ev.status)
        ),
        _ => anyhow!(
            "unexpected connection event {:?} (status {})",
            ev.kind,
            ev.status
        ),
    }
}

/// Everything on the device side of one connection.
struct Link {
    waiter: Waiter<CompletionQueue, CompletionChannel>,
    qp: QueuePair,
    send_buf: Option<Buffer>,
    inline_max: usize,
    recv_key: rdmsg::notify::CqKey,
    /// Times a completion event ended a sleep.
    wakeups: u64,
}

impl Link {
    /// A queue pair on the device the CM resolved `id` to, moved to INIT, with receives
    /// posted (a peer may send as soon as it is connected).
    fn new(id: &CmId, o: &Options, events: &Events) -> Result<Self> {
        let device = id
            .device_name()
            .context("the connection manager bound no device")?;
        let ctx = Context::open(&device)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let channel = CompletionChannel::new(&ctx)?;
        let depth = 16u32;
        let send_cq = CompletionQueue::new(&ctx, depth, Some(&channel))?;
        let recv_cq = CompletionQueue::new(&ctx, depth, Some(&channel))?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_inline_data: 64,
        };
        let mut qp = QueuePair::new_rc(&pd, &send_cq, &recv_cq, caps)?;
        id.init_qp(&mut qp)?;
        let size = o.size as usize;
        let recvs = pd
            .register(size * depth as usize, Access::LOCAL_WRITE)?
            .chunks(size)?;
        qp.post_recv(recvs).map_err(|e| e.error)?;
        let send_buf = Some(pd.register(size, Access::LOCAL_WRITE)?);
        let inline_max = qp.caps().max_inline_data as usize;
        let mut waiter = Waiter::new_verbs(channel, Policy::Sleep)?;
        waiter.add(send_cq, ArmMode::Next);
        let mode = if o.solicited {
            ArmMode::SolicitedOnly
        } else {
            ArmMode::Next
        };
        let recv_key = waiter.add(recv_cq, mode);
        events
            .watch
            .add_keyed(waiter.channel().as_fd(), COMPLETIONS)?;
        println!(
            "  device {device} port {}, QP {:#x}",
            id.port_num(),
            qp.qp_num()
        );
        Ok(Self {
            waiter,
            qp,
            send_buf,
            inline_max,
            recv_key,
            wakeups: 0,
        })
    }

    fn send(&mut self, payload: &[u8]) -> Result<()> {
        let req = if payload.len() <= self.inline_max {
            SendRequest::inline(payload)
        } else {
            let mut buf = self.send_buf.take().context("send buffer in use")?;
            buf.as_mut_slice()[..payload.len()].copy_from_slice(payload);
            SendRequest::buffer(buf, payload.len())
        };
        self.qp
            .post_send_one(req.solicited(true).signaled(true))
            .map_err(|e| e.error)?;
        Ok(())
    }
}

/// The ping-pong itself: the client sends first and checks each echo when the server is
/// rdmsg's; the server answers each message with what it received.
struct Exchange {
    client: bool,
    check_echo: bool,
    iters: u64,
    size: usize,
    sent: u64,
    sends_done: u64,
    received: u64,
    payload: Vec<u8>,
}

impl Exchange {
    fn new(o: &Options, client: bool, check_echo: bool) -> Self {
        Self {
            client,
            check_echo,
            iters: o.iters,
            size: o.size as usize,
            sent: 0,
            sends_done: 0,
            received: 0,
            payload: Vec::new(),
        }
    }

    fn can_send(&self) -> bool {
        // One message in flight each way, and the previous send's completion back first
        // (its buffer is reused).
        let turn = if self.client {
            self.sent == self.received
        } else {
            self.sent < self.received
        };
        self.sent < self.iters && turn && self.sends_done == self.sent
    }

    fn done(&self) -> bool {
        self.received >= self.iters && self.sends_done >= self.iters
    }

    fn ping(&mut self) {
        self.payload.clear();
        self.payload.extend_from_slice(&self.sent.to_le_bytes());
        self.payload.resize(self.size, 0x5a);
        self.payload.truncate(self.size);
    }

    fn handle(&mut self, link: &mut Link, recv_cq: bool, wc: &WorkCompletion) -> Result<()> {
        if !wc.is_success() {
            bail!("completion failed: {:?}", wc.status());
        }
        if recv_cq {
            let buf = link
                .qp
                .take_recv(wc)
                .context("unknown receive completion")?;
            let data = &buf.as_slice()[..wc.byte_len() as usize];
            if self.client {
                if self.check_echo && data != self.payload.as_slice() {
                    bail!(
                        "exchange {}: the echo differs from what was sent",
                        self.received
                    );
                }
            } else {
                self.payload.clear();
                self.payload.extend_from_slice(data);
            }
            self.received += 1;
            link.qp.post_recv([buf]).map_err(|e| e.error)?;
        } else {
            let mut back = Vec::with_capacity(1);
            link.qp.complete_send_into(wc, &mut back);
            if let Some(b) = back.pop() {
                link.send_buf = Some(b);
            }
            self.sends_done += 1;
        }
        Ok(())
    }

    /// One step of the waiter (drain the channel, re-arm, poll), each completion handled;
    /// whether there was any. `completions` is scratch space kept across steps.
    fn step(
        &mut self,
        link: &mut Link,
        completions: &mut Vec<(bool, WorkCompletion)>,
    ) -> Result<bool> {
        let recv_key = link.recv_key;
        completions.clear();
        link.waiter
            .step(&mut |key, wc| completions.push((key == recv_key, wc.clone())))?;
        for (recv, wc) in completions.iter() {
            self.handle(link, *recv, wc)?;
        }
        Ok(!completions.is_empty())
    }

    /// Runs to the end, waking on completions and CM events alike.
    fn run(&mut self, link: &mut Link, id: &CmId, events: &Events) -> Result<()> {
        let recv_key = link.recv_key;
        let mut ready = Vec::new();
        let mut completions = Vec::new();
        loop {
            if self.can_send() {
                if self.client {
                    self.ping();
                }
                link.send(&self.payload)?;
                self.sent += 1;
            }
            // Step first (drain the channel, re-arm, poll), then sleep: nothing that arrived
            // before the arm is missed.
            let any = self.step(link, &mut completions)?;
            if self.done() {
                return Ok(());
            }
            if any || self.can_send() {
                continue;
            }
            ready.clear();
            events.watch.wait_keys(Some(events.timeout), &mut ready)?;
            if ready.is_empty() {
                bail!(
                    "timed out after {:?} after {} of {} exchanges{}",
                    events.timeout,
                    self.received,
                    self.iters,
                    if link.waiter.mode(recv_key).ok() == Some(ArmMode::SolicitedOnly) {
                        " (the receive queue is armed solicited-only: a peer that does not \
                         solicit its sends never wakes it)"
                    } else {
                        ""
                    }
                );
            }
            if ready.contains(&COMPLETIONS) {
                link.wakeups += 1;
            }
            if ready.contains(&CM) {
                while let Some(ev) = events.channel.next_event()? {
                    if ev.id != id.key() {
                        continue;
                    }
                    // The peer may have ended because our last message reached it: what
                    // is already in the queues counts first.
                    self.step(link, &mut completions)?;
                    if self.done() {
                        return Ok(());
                    }
                    return Err(failure(&ev)).with_context(|| {
                        format!("after {} of {} exchanges", self.received, self.iters)
                    });
                }
            }
        }
    }
}

fn main() -> ExitCode {
    let o = Options::parse();
    rdmsg_examples::run(|| match &o.server {
        Some(server) => client(&o, server),
        None => server(&o),
    })
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {host}"))?
        .find(|a| a.is_ipv4())
        .or_else(|| (host, port).to_socket_addrs().ok()?.next())
        .with_context(|| format!("{host} has no address"))
}

fn client(o: &Options, server: &str) -> Result<()> {
    let events = Events::new(Duration::from_secs(o.timeout))?;
    let dst = resolve(server, o.port)?;
    let mut id = CmId::new(&events.channel)?;
    let started = Instant::now();
    id.resolve_addr(None, dst, events.timeout)?;
    events
        .expect(&id, CmEventKind::AddrResolved)
        .with_context(|| format!("resolving {dst}"))?;
    id.resolve_route(events.timeout)?;
    events
        .expect(&id, CmEventKind::RouteResolved)
        .with_context(|| format!("resolving the route to {dst}"))?;
    let mut link = Link::new(&id, o, &events)?;
    let private = if o.hello {
        hello(o.size, o.iters).to_vec()
    } else {
        Vec::new()
    };
    id.connect(&link.qp, &ConnParams::default(), &private)?;
    let response = events
        .expect(&id, CmEventKind::ConnectResponse)
        .with_context(|| format!("connecting to {dst}"))?;
    id.ready_qp(&mut link.qp, &QpTuning::default())?;
    id.establish()?;
    let rdmsg_server = parse_hello(&response.private_data).is_some();
    println!(
        "  connected to {dst} (QP {:#x}) in {:.1} ms{}",
        response.peer_qp_num,
        started.elapsed().as_secs_f64() * 1e3,
        if rdmsg_server {
            ", an rdmsg server"
        } else {
            ""
        }
    );
    let mut ex = Exchange::new(o, true, rdmsg_server);
    let start = Instant::now();
    ex.run(&mut link, &id, &events)?;
    report(o, start, &link);
    id.disconnect()?;
    // The disconnect is confirmed by an event; a peer already gone is fine.
    let _ = events.next("the disconnect");
    Ok(())
}

fn server(o: &Options) -> Result<()> {
    let events = Events::new(Duration::from_secs(o.timeout))?;
    let mut listener = CmId::new(&events.channel)?;
    let addr = SocketAddr::new(o.bind, o.port);
    listener
        .bind(addr)
        .with_context(|| format!("binding {addr}"))?;
    listener.listen(8)?;
    println!("  listening on {addr}");
    let (mut id, theirs, request_params) = loop {
        let ev = events.next("a connection request")?;
        if ev.kind != CmEventKind::ConnectRequest {
            continue;
        }
        let Some(mut id) = ev.request else { continue };
        let theirs = parse_hello(&ev.private_data);
        if let Some(reason) = theirs.and_then(|t| refusal((o.size, o.iters), t)) {
            println!("  rejected a client: {reason}");
            id.reject(reason.as_bytes())?;
            continue;
        }
        break (id, theirs, ev.params);
    };
    let mut link = Link::new(&id, o, &events)?;
    // Our reads towards the client: no more than its request says it serves.
    let params = ConnParams {
        initiator_depth: ConnParams::default()
            .initiator_depth
            .min(request_params.initiator_depth),
        ..ConnParams::default()
    };
    let tuning = QpTuning {
        reads: Some(params),
        ..QpTuning::default()
    };
    id.ready_qp(&mut link.qp, &tuning)?;
    let answer = if theirs.is_some() {
        hello(o.size, o.iters).to_vec()
    } else {
        Vec::new()
    };
    id.accept(&link.qp, &params, &answer)?;
    events.expect(&id, CmEventKind::Established)?;
    println!(
        "  accepted {} ({})",
        id.peer_addr().map_or("?".into(), |a| a.to_string()),
        if theirs.is_some() {
            "an rdmsg client"
        } else {
            "no hello: a foreign client"
        }
    );
    let mut ex = Exchange::new(o, false, false);
    let start = Instant::now();
    ex.run(&mut link, &id, &events)?;
    report(o, start, &link);
    // The client disconnects once it has its last answer; wait for that, then end.
    match events.next("the client's disconnect") {
        Ok(ev) if ev.kind == CmEventKind::Disconnected => {}
        Ok(ev) => println!("  then: {:?}", ev.kind),
        Err(e) => println!("  then: {e:#}"),
    }
    let _ = id.disconnect();
    Ok(())
}

fn report(o: &Options, start: Instant, link: &Link) {
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} iters of {} bytes in {secs:.3} seconds = {:.2} usec/iter",
        o.iters,
        o.size,
        secs * 1e6 / o.iters as f64
    );
    let s = link.waiter.stats();
    println!("{} wake-ups, {} completions", link.wakeups, s.completions);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_round_trip_and_foreign_private_data_is_no_hello() {
        let h = hello(64, 1000);
        assert_eq!(parse_hello(&h), Some((64, 1000)));
        // The CM pads a request's private data to 56 bytes.
        let mut padded = h.to_vec();
        padded.resize(56, 0);
        assert_eq!(parse_hello(&padded), Some((64, 1000)));
        assert_eq!(parse_hello(&[0; 56]), None);
        assert_eq!(parse_hello(&h[..19]), None);
        assert_eq!(parse_hello(b""), None);
    }

    #[test]
    fn a_disagreeing_hello_is_refused_with_both_sides_named() {
        assert_eq!(refusal((16, 1), (16, 1)), None);
        let r = refusal((16, 1), (64, 5)).unwrap();
        assert_eq!(
            r,
            "the server runs 1 exchanges of 16 bytes, the client asked for 5 of 64"
        );
        assert!(r.len() <= rdmsg::verbs::REJECT_PRIVATE_DATA_MAX);
        let mut padded = r.clone().into_bytes();
        padded.resize(148, 0);
        assert_eq!(text(&padded), r);
    }

    #[test]
    fn rdma_core_defaults() {
        let o = Options::try_parse_from(["cm_pingpong"]).unwrap();
        assert_eq!((o.port, o.size, o.iters), (7471, 16, 1));
        assert!(!o.hello && !o.solicited && o.server.is_none());
        let o = Options::try_parse_from(["cm_pingpong", "-n", "5", "10.0.0.1", "--hello"]).unwrap();
        assert_eq!(
            (o.iters, o.server.as_deref(), o.hello),
            (5, Some("10.0.0.1"), true)
        );
        for bad in [&["-s", "0"][..], &["-n", "0"], &["-b", "host"]] {
            let args = std::iter::once("cm_pingpong").chain(bad.iter().copied());
            assert!(Options::try_parse_from(args).is_err(), "{bad:?}");
        }
    }
}
