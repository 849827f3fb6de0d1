//! Helpers shared by the device tests of every rdmsg crate.
//!
//! Device tests open `$RDMSG_DEVICE` (rxe0 in the test VM) and panic when there is none: a device
//! test never passes by skipping.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

#[cfg(feature = "tracing")]
pub mod events;

use std::time::{Duration, Instant};

use rdmsg_verbs::{
    connect_loopback, Access, Buffer, CompletionChannel, CompletionQueue, Context,
    ProtectionDomain, QpCaps, QueuePair, SendRequest, WorkCompletion,
};

/// The port tests use.
pub const PORT: u8 = 1;
/// Size of each test buffer.
pub const BUF: usize = 4096;

/// Opens the test device, or panics saying how to provide one.
pub fn open_device() -> Context {
    Context::open_default().unwrap_or_else(|e| {
        panic!(
            "device test needs an RDMA device (set ${}): {e}",
            Context::DEVICE_ENV
        )
    })
}

/// The sending side of a [`Pair`]: a queue pair with its own CQs (no channel) and free buffers.
/// `Send`, so a test can drive it from another thread while the receiver sleeps.
#[allow(missing_docs)]
#[derive(Debug)]
pub struct RawSender {
    pub qp: QueuePair,
    pub send_cq: CompletionQueue,
    pub recv_cq: CompletionQueue,
    /// Free send buffers.
    pub bufs: Vec<Buffer>,
}

impl RawSender {
    /// Sends `data`, copied into a registered buffer.
    pub fn send(&mut self, data: &[u8], solicited: bool, imm: Option<u32>) {
        let mut buf = self.bufs.pop().expect("free send buffer");
        buf.as_mut_slice()[..data.len()].copy_from_slice(data);
        let mut req = SendRequest::buffer(buf, data.len()).solicited(solicited);
        req.imm = imm;
        self.qp.post_send(vec![req]).unwrap();
    }

    /// Waits for `n` send completions, returning their buffers to the free list. Once a send
    /// completed, the receiver has the message.
    pub fn reap(&mut self, n: usize) -> Vec<WorkCompletion> {
        let wcs = poll_n(&mut self.send_cq, n);
        for wc in &wcs {
            self.bufs.extend(self.qp.complete_send(wc));
        }
        wcs
    }
}

/// Two connected RC queue pairs on one device: `sender` sends to `b`. Both of `b`'s CQs report
/// to `channel`.
#[allow(missing_docs)]
#[derive(Debug)]
pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub channel: CompletionChannel,
    pub sender: RawSender,
    pub b_send_cq: CompletionQueue,
    pub b_recv_cq: CompletionQueue,
    pub b: QueuePair,
}

impl Pair {
    /// Connects a pair with `recv_depth` receive buffers posted on `b` before it can receive.
    pub fn new(recv_depth: usize) -> Self {
        let ctx = open_device();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let channel = CompletionChannel::new(&ctx).unwrap();
        let a_send_cq = CompletionQueue::new(&ctx, 128, None).unwrap();
        let a_recv_cq = CompletionQueue::new(&ctx, 128, None).unwrap();
        let b_send_cq = CompletionQueue::new(&ctx, 128, Some(&channel)).unwrap();
        let b_recv_cq = CompletionQueue::new(&ctx, 128, Some(&channel)).unwrap();
        let caps = QpCaps {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_inline_data: 64,
        };
        let mut a = QueuePair::new_rc(&pd, &a_send_cq, &a_recv_cq, caps).unwrap();
        let mut b = QueuePair::new_rc(&pd, &b_send_cq, &b_recv_cq, caps).unwrap();
        b.to_init(PORT).unwrap();
        let recv = pd
            .register(recv_depth * BUF, Access::LOCAL_WRITE)
            .unwrap()
            .chunks(BUF)
            .unwrap();
        b.post_recv(recv).unwrap();
        connect_loopback(&ctx, PORT, &mut a, &mut b).unwrap();
        let bufs = pd
            .register(32 * BUF, Access::LOCAL_WRITE)
            .unwrap()
            .chunks(BUF)
            .unwrap();
        Self {
            ctx,
            pd,
            channel,
            sender: RawSender {
                qp: a,
                send_cq: a_send_cq,
                recv_cq: a_recv_cq,
                bufs,
            },
            b_send_cq,
            b_recv_cq,
            b,
        }
    }

    /// Sends from the sender side (see [`RawSender::send`]).
    pub fn send(&mut self, data: &[u8], solicited: bool, imm: Option<u32>) {
        self.sender.send(data, solicited, imm);
    }

    /// Reaps send completions on the sender side (see [`RawSender::reap`]).
    pub fn reap_sends(&mut self, n: usize) -> Vec<WorkCompletion> {
        self.sender.reap(n)
    }
}

/// Polls until `n` completions arrived; panics after 10 s.
pub fn poll_n(cq: &mut CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut wcs = WorkCompletion::buffer(16);
    while out.len() < n {
        let got = cq.poll(&mut wcs[..(n - out.len()).min(16)]).unwrap();
        out.extend(wcs[..got].iter().cloned());
        assert!(
            Instant::now() < deadline,
            "only {} of {n} completions within 10 s",
            out.len()
        );
        if got == 0 {
            std::thread::yield_now();
        }
    }
    out
}

/// The IPv4 address of port 1 of the test device (`$RDMSG_DEVICE`): the first IPv4-mapped GID
/// in its table, where RoCE carries its interface's addresses. The address rdma_cm tests
/// connect to; panics if there is none.
pub fn device_ipv4() -> std::net::Ipv4Addr {
    let device = std::env::var(Context::DEVICE_ENV).expect("device tests need $RDMSG_DEVICE");
    let dir = format!("/sys/class/infiniband/{device}/ports/1/gids");
    let mut gids: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().path())
        .collect();
    gids.sort();
    gids.iter()
        .find_map(|path| {
            let gid = std::fs::read_to_string(path).ok()?;
            let hex: String = gid.trim().chars().filter(|c| *c != ':').collect();
            let v4 = hex.strip_prefix("00000000000000000000ffff")?;
            u32::from_str_radix(v4, 16)
                .ok()
                .map(std::net::Ipv4Addr::from)
        })
        .unwrap_or_else(|| panic!("no IPv4 GID on {device}"))
}

/// How many times the calling thread gave up its CPU of its own accord (blocked: a sleep, a
/// wait, a lock), from `/proc/thread-self/status`: a call that never sleeps adds none.
/// Panics if it cannot be read.
pub fn thread_voluntary_switches() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .unwrap_or_else(|e| panic!("cannot read /proc/thread-self/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no voluntary_ctxt_switches in /proc/thread-self/status"))
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Receiver-not-ready NAKs a device port has counted: `(rcvd_rnr_err, send_rnr_err)`, from
/// the port's `hw_counters` in sysfs (Soft-RoCE and most hardware provide them). Panics if
/// they cannot be read: a test that relies on them must not pass without them.
pub fn rnr_counters(device: &str, port: u8) -> (u64, u64) {
    let read = |name: &str| -> u64 {
        let path = format!("/sys/class/infiniband/{device}/ports/{port}/hw_counters/{name}");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    (read("rcvd_rnr_err"), read("send_rnr_err"))
}

/// An error and its sources as anyhow's `{:#}` prints them, joined by `": "`: what a user who
/// prints the chain sees.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}
