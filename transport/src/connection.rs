//! A credit-flow-controlled RC connection.

use std::collections::VecDeque;
use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use notify::{ArmMode, CqKey, EventChannel, EventTarget, Policy, Readiness, Waiter};
use verbs_core::{
    AsyncElement, Buffer, CompletionChannel, CompletionQueue, QpCaps, QueuePair, ReadyWatch,
    SendRequest, WcStatus, WorkCompletion,
};

use crate::credits::{Credits, Imm};
use crate::endpoint::{Endpoint, PathParams};
use crate::handshake::{self, Hello, Reject, ACCEPT, HELLO_LEN, READY};
use crate::pool::{PoolStats, Received, RecvPool};
use crate::{Error, Failure, Result};

/// How a connection is set up. Both sides announce their receive side in the handshake; the
/// send side adapts to the peer.
#[derive(Debug, Clone)]
pub struct Config {
    /// Size of each receive buffer: the largest message the peer may send us. Default 4096.
    pub buf_size: u32,
    /// Receive buffers for data messages: the credits the peer starts with. Default 64.
    pub recv_depth: u32,
    /// Extra receive buffers reserved for credit grants (3..=64). Default 3.
    pub grant_slots: u8,
    /// Send queue depth and number of send buffers. Default 64.
    pub send_depth: u32,
    /// Request a send completion every this many sends (at least 1). Default 16.
    pub signal_every: u32,
    /// Payloads up to this size are sent inline, without a send buffer (bounded by what the
    /// device grants). Default 64.
    pub max_inline: u32,
    /// How the receive queue is armed while waiting for messages. Default
    /// [`ArmMode::SolicitedOnly`]: only solicited messages (and errors) wake a receiver.
    pub recv_arm: ArmMode,
    /// How waits wait. Default [`Policy::Sleep`].
    pub policy: Policy,
    /// Path parameters of the queue pair.
    pub path: PathParams,
    /// Longest wait for each step of the handshake. Default 5 s.
    pub handshake_timeout: Duration,
    /// Longest wait in [`Connection::close`] for the close message to be delivered. Default 2 s.
    pub close_timeout: Duration,
    /// How long a peer *host* may stay silent before it is declared gone
    /// ([`Failure::PeerVanished`]), through TCP keepalive on the bootstrap stream (a peer
    /// process that dies is noticed at once by its stream's end; a host that dies or drops off
    /// the network sends nothing). `None`: never. Default 5 s; whole seconds, at least 3 s.
    pub keepalive: Option<Duration>,
    /// Test hook: entries of the receive CQ instead of what the receive queue needs, to provoke
    /// a CQ overrun. Never set it otherwise.
    #[doc(hidden)]
    pub recv_cq_entries: Option<u32>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            buf_size: 4096,
            recv_depth: 64,
            grant_slots: 3,
            send_depth: 64,
            signal_every: 16,
            max_inline: 64,
            recv_arm: ArmMode::SolicitedOnly,
            policy: Policy::Sleep,
            path: PathParams::default(),
            handshake_timeout: Duration::from_secs(5),
            close_timeout: Duration::from_secs(2),
            keepalive: Some(Duration::from_secs(5)),
            recv_cq_entries: None,
        }
    }
}

impl Config {
    fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Config(what.to_owned()));
        if !(handshake::MIN_BUF_SIZE..=handshake::MAX_BUF_SIZE).contains(&self.buf_size) {
            return bad("buf_size must be between 64 bytes and 1 GiB");
        }
        if self.recv_depth == 0 || self.recv_depth > 0xff_ffff {
            return bad("recv_depth must be between 1 and 2^24 - 1");
        }
        if self.grant_slots < 3 || self.grant_slots > handshake::MAX_GRANT_SLOTS {
            return bad("grant_slots must be between 3 and 64");
        }
        if self.send_depth == 0 || self.signal_every == 0 {
            return bad("send_depth and signal_every must be at least 1");
        }
        if self.keepalive.is_some_and(|k| k < Duration::from_secs(3)) {
            return bad("keepalive must be at least 3 s (TCP keepalive counts whole seconds)");
        }
        Ok(())
    }
}

/// What a connection did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Data messages sent.
    pub sent: u64,
    /// Data messages sent solicited.
    pub sent_solicited: u64,
    /// Of those, messages the transport solicited although the caller did not ask (they
    /// returned credits to a peer that may be blocked).
    pub forced_solicited: u64,
    /// Data messages sent inline.
    pub sent_inline: u64,
    /// Data messages received.
    pub received: u64,
    /// Explicit credit grants sent.
    pub grants_sent: u64,
    /// Credit grants received.
    pub grants_received: u64,
    /// Times a send waited for a credit.
    pub credit_waits: u64,
    /// Times a send waited for a send buffer or send queue slot.
    pub send_slot_waits: u64,
    /// `ibv_post_recv` calls made to refill the receive queue.
    pub refills: u64,
}

/// The completion channel of a connection plus what else should interrupt its sleep: buffers
/// coming back to the receive pool, the bootstrap stream (end-of-file: the peer process is
/// gone), and the device's asynchronous events. All four are registered once in an epoll set.
#[derive(Debug)]
struct ConnChannel {
    channel: CompletionChannel,
    watch: ReadyWatch,
    /// Registered in `watch`: kept open here.
    _wake: std::os::unix::net::UnixStream,
    bootstrap: TcpStream,
    /// Stop watching the bootstrap stream once it has ended (it stays readable forever).
    watch_bootstrap: bool,
    /// Owns the context whose async-event descriptor is registered in `watch`.
    _endpoint: Endpoint,
}

/// Token of the completion channel in the watch; the others only interrupt a sleep.
const CHANNEL_TOKEN: u8 = 0;

impl ConnChannel {
    fn new(
        channel: CompletionChannel,
        wake: std::os::unix::net::UnixStream,
        bootstrap: TcpStream,
        endpoint: Endpoint,
    ) -> Result<Self> {
        let watch = ReadyWatch::new()?;
        watch.add(channel.as_fd(), CHANNEL_TOKEN)?;
        watch.add(wake.as_fd(), 1)?;
        watch.add(endpoint.context().async_fd(), 2)?;
        watch.add(bootstrap.as_fd(), 3)?;
        Ok(Self {
            channel,
            watch,
            _wake: wake,
            bootstrap,
            watch_bootstrap: true,
            _endpoint: endpoint,
        })
    }

    fn stop_watching_bootstrap(&mut self) {
        if std::mem::take(&mut self.watch_bootstrap) {
            // The stream stays readable at end-of-file; watching it would spin.
            let _ = self.watch.remove(self.bootstrap.as_fd());
        }
    }
}

impl EventChannel<CompletionQueue> for ConnChannel {
    fn next_event(&mut self, cqs: &[CompletionQueue]) -> notify::Result<Option<EventTarget>> {
        self.channel.next_event(cqs)
    }

    fn wait_readable(&mut self, timeout: Option<Duration>) -> notify::Result<Readiness> {
        let ready = self.watch.wait(timeout)?;
        Ok(if ready == 0 {
            Readiness::TimedOut
        } else if ready & (1 << CHANNEL_TOKEN) != 0 {
            Readiness::Events
        } else {
            Readiness::Other
        })
    }
}

/// One reliable-connected queue pair with credit flow control, a self-refilling receive pool
/// and a pool of send buffers.
///
/// Sending never provokes a receiver-not-ready NAK: a data message is posted only with a
/// credit, i.e. a receive buffer the peer has posted. Receiving hands out [`Received`] handles
/// that return their buffer when dropped; the buffer is re-posted, and its credit returned,
/// the next time the connection is driven (any `send*`/`recv*` call).
#[derive(Debug)]
pub struct Connection {
    endpoint: Endpoint,
    qp: QueuePair,
    waiter: Waiter<CompletionQueue, ConnChannel>,
    recv_key: CqKey,
    send_key: CqKey,
    pool: RecvPool,
    send_bufs: Vec<Buffer>,
    credits: Credits,
    ready: VecDeque<Received>,
    completions: Vec<(CqKey, WorkCompletion)>,
    config: Config,
    peer: Hello,
    sq_depth: usize,
    max_inline: usize,
    unsignaled: u32,
    /// The peer's close message has arrived: nothing follows it.
    peer_closed: bool,
    failure: Option<Failure>,
    stats: ConnStats,
    inline_scratch: Vec<u8>,
    bootstrap_checked: Instant,
    /// Calls of `progress` and waits that delivered completions, for rate-limiting the
    /// liveness checks without reading the clock every time.
    busy_steps: u32,
    /// Sends since the sender last polled its queues.
    sends_since_progress: u32,
}

/// Longest busy-poll before a polling connection looks at its bootstrap stream again.
const POLL_SLICE: Duration = Duration::from_millis(10);

/// A sender polls its queues at least every this many sends (see `wait_to_send`).
const SEND_PROGRESS_EVERY: u32 = 16;

/// Shortest interval between liveness checks of a busy connection.
const LIVENESS_EVERY: Duration = Duration::from_millis(1);

/// Longest wait for the flush completions after a failure.
const FLUSH_WAIT: Duration = Duration::from_millis(500);

/// Keepalive probing that gives up on a silent peer after about `limit`: the first probe after
/// half of it, then three more spread over the other half.
fn keepalive_probes(limit: Duration) -> socket2::TcpKeepalive {
    let secs = limit.as_secs().max(3);
    socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(secs / 2))
        .with_interval(Duration::from_secs((secs - secs / 2).div_ceil(3).max(1)))
        .with_retries(3)
}

fn io_err(stage: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Bootstrap { stage, source }
}

/// A pseudo-random 24-bit starting PSN for the queue pair `qp_num`, different per connection
/// (a reused PSN could let stale packets of an earlier connection be accepted).
pub fn random_psn(qp_num: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(qp_num);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() as u32) & 0xff_ffff
}

impl Connection {
    /// Sets up the queue pair over an established bootstrap stream: see the `handshake` module
    /// for the exchange.
    pub(crate) fn establish(
        endpoint: &Endpoint,
        mut stream: TcpStream,
        config: &Config,
    ) -> Result<Self> {
        config.check()?;
        let ctx = endpoint.context();
        let pd = endpoint.pd();
        let recv_total = config.recv_depth + u32::from(config.grant_slots);
        let channel = CompletionChannel::new(ctx)?;
        let send_cq = CompletionQueue::new(ctx, config.send_depth, Some(&channel))?;
        let recv_cq = CompletionQueue::new(
            ctx,
            config.recv_cq_entries.unwrap_or(recv_total),
            Some(&channel),
        )?;
        let caps = QpCaps {
            max_send_wr: config.send_depth,
            max_recv_wr: recv_total,
            max_inline_data: config.max_inline,
        };
        let mut qp = QueuePair::new_rc(pd, &send_cq, &recv_cq, caps)?;
        qp.to_init(endpoint.port())?;
        let mut pool = RecvPool::new(pd, recv_total as usize, config.buf_size as usize)?;
        // Every receive is posted before the peer can send: its initial credits are real.
        if let Err(e) = qp.post_recv(pool.take_free()) {
            for b in e.unposted {
                pool.put_back(b);
            }
            return Err(e.error.into());
        }

        let psn = random_psn(qp.qp_num());
        let ours = Hello {
            version: handshake::VERSION,
            addr: endpoint.address_of(&qp, psn),
            mtu: endpoint.path_mtu(&config.path).bytes() as u32,
            buf_size: config.buf_size,
            recv_depth: config.recv_depth,
            grant_slots: config.grant_slots,
            initial_credits: config.recv_depth,
        };
        stream
            .set_read_timeout(Some(config.handshake_timeout))
            .map_err(io_err("setting the handshake timeout"))?;
        stream
            .set_write_timeout(Some(config.handshake_timeout))
            .map_err(io_err("setting the handshake timeout"))?;
        stream
            .set_nodelay(true)
            .map_err(io_err("setting TCP_NODELAY"))?;
        handshake::write_all(&mut stream, &ours.encode()).map_err(io_err("sending the hello"))?;
        let mut raw = [0u8; HELLO_LEN];
        handshake::read_exact(&mut stream, &mut raw).map_err(io_err("reading the peer's hello"))?;
        let verdict = Hello::decode(&raw).and_then(|peer| ours.check_peer(&peer).map(|()| peer));
        let code = match verdict {
            Ok(_) => ACCEPT,
            Err(r) => r.code(),
        };
        // Tell the peer either way; if it is already gone, our own verdict is the news.
        let told = handshake::write_all(&mut stream, &[code]);
        let peer = verdict.map_err(Error::BadHandshake)?;
        told.map_err(io_err("sending the verdict"))?;
        let mut theirs = [0u8; 1];
        handshake::read_exact(&mut stream, &mut theirs)
            .map_err(io_err("reading the peer's verdict"))?;
        if let Some(reject) = Reject::from_code(theirs[0]) {
            return Err(Error::Rejected(reject));
        }

        endpoint.connect_qp(&mut qp, psn, &peer.addr, &config.path)?;
        handshake::write_all(&mut stream, &[READY]).map_err(io_err("sending ready"))?;
        handshake::read_exact(&mut stream, &mut theirs).map_err(io_err("waiting for ready"))?;
        if theirs[0] != READY {
            return Err(Error::BadHandshake(Reject::Unknown(theirs[0])));
        }
        stream
            .set_nonblocking(true)
            .map_err(io_err("making the stream non-blocking"))?;
        if let Some(limit) = config.keepalive {
            socket2::SockRef::from(&stream)
                .set_tcp_keepalive(&keepalive_probes(limit))
                .map_err(io_err("enabling TCP keepalive"))?;
        }

        let send_bufs = pd
            .register(
                config.send_depth as usize * peer.buf_size as usize,
                verbs_core::Access::LOCAL_WRITE,
            )?
            .chunks(peer.buf_size as usize)?;
        let wake = pool.wake_handle().map_err(Error::WakePipe)?;
        channel.set_nonblocking(true)?;
        let mut waiter = Waiter::new(
            ConnChannel::new(channel, wake, stream, endpoint.clone())?,
            config.policy,
        );
        let recv_key = waiter.add(recv_cq, config.recv_arm);
        let send_key = waiter.add(send_cq, ArmMode::SolicitedOnly);
        let max_inline = qp.caps().max_inline_data.min(config.max_inline) as usize;
        Ok(Self {
            endpoint: endpoint.clone(),
            credits: Credits::new(
                config.recv_depth,
                config.grant_slots,
                peer.recv_depth,
                peer.grant_slots,
                peer.initial_credits,
            ),
            sq_depth: qp.caps().max_send_wr.min(config.send_depth) as usize,
            qp,
            waiter,
            recv_key,
            send_key,
            pool,
            send_bufs,
            ready: VecDeque::new(),
            completions: Vec::new(),
            config: config.clone(),
            peer,
            max_inline,
            unsignaled: 0,
            peer_closed: false,
            failure: None,
            stats: ConnStats::default(),
            inline_scratch: vec![0; max_inline],
            bootstrap_checked: Instant::now(),
            busy_steps: 0,
            sends_since_progress: 0,
        })
    }

    /// The largest message the peer accepts.
    pub fn max_message(&self) -> usize {
        self.peer.buf_size as usize
    }

    /// Statistics of this connection.
    pub fn stats(&self) -> ConnStats {
        self.stats
    }

    /// Wake-up statistics of this connection's waits.
    pub fn wait_stats(&self) -> notify::Stats {
        self.waiter.stats()
    }

    /// Counts of the receive pool's buffers.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats(self.qp.recv_outstanding())
    }

    /// Data messages we may send right now without waiting.
    pub fn credits(&self) -> u32 {
        self.credits.available()
    }

    /// The queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// The peer's handshake.
    pub fn peer(&self) -> &Hello {
        &self.peer
    }

    /// Why the connection failed, if it did.
    pub fn failure(&self) -> Option<Failure> {
        self.failure
    }

    /// Sends `data`, solicited (waking a receiver armed solicited-only) or not. Blocks while
    /// there is no credit or no send slot.
    pub fn send(&mut self, data: &[u8], solicited: bool) -> Result<()> {
        if data.len() > self.max_message() {
            return Err(Error::TooLarge {
                len: data.len(),
                max: self.max_message(),
            });
        }
        self.send_with(solicited, None, |buf| {
            buf[..data.len()].copy_from_slice(data);
            Some(data.len())
        })?;
        Ok(())
    }

    /// Sends a message that `fill` writes straight into a registered send buffer of
    /// [`Connection::max_message`] bytes, returning its length. If `fill` returns `None`,
    /// nothing is sent, no credit is spent, and this returns `Ok(false)`. Messages up to
    /// `max_inline` bytes are sent inline and their buffer is reused at once. Waits at most
    /// `timeout` (`None`: forever) for a credit and a send buffer.
    pub fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<bool> {
        self.check_failed()?;
        self.wait_to_send(timeout)?;
        let mut buf = self.send_bufs.pop().expect("wait_to_send ensured a buffer");
        let max = self.max_message();
        let len = match fill(&mut buf.as_mut_slice()[..max]) {
            Some(len) if len <= max => len,
            other => {
                self.send_bufs.push(buf);
                return match other {
                    None => Ok(false),
                    Some(len) => Err(Error::TooLarge { len, max }),
                };
            }
        };
        let (imm, must_solicit) = self
            .credits
            .take_for_data(0)
            .expect("wait_to_send ensured a credit");
        self.stats.sent += 1;
        self.stats.forced_solicited += u64::from(must_solicit && !solicited);
        let solicited = solicited || must_solicit;
        self.stats.sent_solicited += u64::from(solicited);
        if len <= self.max_inline {
            // Inline: the bytes are copied at post time, so the buffer is free again at once.
            self.stats.sent_inline += 1;
            let mut scratch = std::mem::take(&mut self.inline_scratch);
            scratch[..len].copy_from_slice(&buf.as_slice()[..len]);
            self.send_bufs.push(buf);
            let res = self.post(SendRequest::inline(&scratch[..len]), imm, solicited);
            self.inline_scratch = scratch;
            res?;
        } else {
            self.post(SendRequest::buffer(buf, len), imm, solicited)?;
        }
        Ok(true)
    }

    fn post(&mut self, req: SendRequest<'_>, imm: Imm, solicited: bool) -> Result<()> {
        let signaled = self.unsignaled + 1 >= self.config.signal_every
            || self.qp.send_outstanding() + 1 >= self.sq_depth
            || self.send_bufs.is_empty();
        self.unsignaled = if signaled { 0 } else { self.unsignaled + 1 };
        let req = req
            .imm(imm.encode())
            .solicited(solicited)
            .signaled(signaled);
        if let Err(e) = self.qp.post_send_one(req) {
            self.send_bufs.extend(e.unposted);
            return Err(e.error.into());
        }
        Ok(())
    }

    fn can_send(&self) -> bool {
        self.credits.available() > 0
            && self.qp.send_outstanding() < self.sq_depth
            && !self.send_bufs.is_empty()
    }

    fn wait_to_send(&mut self, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // A streaming sender need not poll before every message: credits, send completions and
        // failures are looked at every few sends, and at once when anything runs low or
        // buffers came back to be re-posted (the peer may be waiting for their credits).
        self.sends_since_progress += 1;
        let plenty = self.credits.available() > self.peer.recv_depth / 4
            && self.send_bufs.len() > 1
            && self.qp.send_outstanding() + 1 < self.sq_depth;
        if !plenty || self.sends_since_progress >= SEND_PROGRESS_EVERY || self.pool.has_returns() {
            self.sends_since_progress = 0;
            self.progress()?;
        }
        if self.can_send() {
            return Ok(());
        }
        let no_credit = self.credits.available() == 0;
        if no_credit {
            self.stats.credit_waits += 1;
        } else {
            self.stats.send_slot_waits += 1;
        }
        // While blocked, any grant (not only a solicited one) and any send completion must
        // wake us: arm both queues for the next completion.
        self.waiter.set_mode(self.recv_key, ArmMode::Next)?;
        self.waiter.set_mode(self.send_key, ArmMode::Next)?;
        let res = loop {
            if let Err(e) = self.check_failed() {
                break Err(e);
            }
            if self.can_send() {
                break Ok(());
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                break Err(Error::Timeout(timeout.unwrap_or_default()));
            }
            if let Err(e) = self.wait_once(left) {
                break Err(e);
            }
        };
        self.waiter.set_mode(self.recv_key, self.config.recv_arm)?;
        self.waiter
            .set_mode(self.send_key, ArmMode::SolicitedOnly)?;
        res
    }

    /// Receives the next message, waiting as long as it takes.
    pub fn recv(&mut self) -> Result<Received> {
        loop {
            if let Some(m) = self.recv_timeout(None)? {
                return Ok(m);
            }
        }
    }

    /// Receives the next message, waiting at most `timeout` (`None`: forever); `Ok(None)` if
    /// none came. Messages that arrived before a failure are delivered before the failure is
    /// reported.
    pub fn recv_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<Received>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(m) = self.try_recv()? {
                return Ok(Some(m));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            self.wait_once(left)?;
        }
    }

    /// Returns a message that has already arrived, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Received>> {
        if self.ready.is_empty() {
            let progressed = self.progress();
            if self.ready.is_empty() {
                progressed?;
                self.check_failed()?;
                return Ok(None);
            }
        }
        let m = self.ready.pop_front();
        if self.ready.is_empty() {
            // Return the buffer of the previous message promptly.
            let _ = self.maintain();
        }
        Ok(m)
    }

    /// An iterator of received messages that ends when the connection fails or closes.
    pub fn incoming(&mut self) -> impl Iterator<Item = Received> + '_ {
        std::iter::from_fn(move || self.recv().ok())
    }

    /// Closes gracefully: sends a close message after everything sent so far and waits (up to
    /// `close_timeout`) until it is delivered. The peer receives everything, then
    /// [`Failure::PeerClosed`].
    pub fn close(mut self) -> Result<()> {
        self.check_failed()?;
        let timeout = self.config.close_timeout;
        self.wait_to_send(Some(timeout))?;
        let (imm, _) = self
            .credits
            .take_for_data(Imm::CLOSE)
            .expect("wait_to_send ensured a credit");
        self.unsignaled = self.config.signal_every;
        self.post(SendRequest::empty(), imm, true)?;
        let deadline = Instant::now() + timeout;
        self.waiter.set_mode(self.send_key, ArmMode::Next)?;
        while self.qp.send_outstanding() > 0 {
            self.check_failed()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            self.wait_once(Some(left))?;
        }
        self.failure = Some(Failure::Closed);
        Ok(())
    }

    fn check_failed(&self) -> Result<()> {
        match self.failure {
            Some(f) if self.ready.is_empty() => Err(f.into()),
            _ => Ok(()),
        }
    }

    /// Sleeps (per the policy) until something happens, then processes it.
    fn wait_once(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.maintain()?;
        if self.failure.is_some() || !self.ready.is_empty() {
            return Ok(());
        }
        if !self.pool.going_to_sleep() {
            return self.progress();
        }
        // A polling wait watches no descriptor: bound it so that liveness is checked.
        let timeout = match self.config.policy {
            Policy::Poll => Some(timeout.map_or(POLL_SLICE, |t| t.min(POLL_SLICE))),
            _ => timeout,
        };
        let mut got = std::mem::take(&mut self.completions);
        let res = self
            .waiter
            .wait(timeout, &mut |key, wc| got.push((key, wc.clone())));
        self.pool.awake(!matches!(res, Ok(n) if n > 0));
        self.completions = got;
        let delivered = res?;
        self.handle_completions();
        // Nothing delivered: a timeout, or one of the other descriptors (bootstrap stream,
        // async events) is readable. Look at them now; otherwise now and then.
        let liveness = delivered == 0 || self.liveness_due();
        self.settle(liveness)
    }

    /// Polls both queues without sleeping and does the bookkeeping.
    fn progress(&mut self) -> Result<()> {
        self.poll_and_handle()?;
        let liveness = self.liveness_due();
        self.settle(liveness)
    }

    /// Whether a busy connection should look at its bootstrap stream and async events: a read
    /// syscall or two per message would be costly, so at most every millisecond, and the
    /// clock itself only every 16th step.
    fn liveness_due(&mut self) -> bool {
        self.busy_steps = self.busy_steps.wrapping_add(1);
        self.busy_steps % 16 == 0 && self.bootstrap_checked.elapsed() >= LIVENESS_EVERY
    }

    /// After completions were handled: optionally looks for a vanished peer and asynchronous
    /// events, then re-posts and grants.
    fn settle(&mut self, liveness: bool) -> Result<()> {
        if liveness {
            self.check_bootstrap();
            self.check_async_events()?;
        }
        self.maintain()
    }

    fn fail(&mut self, f: Failure) {
        if self.failure.is_some() {
            return;
        }
        self.failure = Some(f);
        // Tell the peer at once: the end of our bootstrap stream fails its side too, rather than
        // leaving it waiting on a queue pair that no longer answers.
        let _ = self
            .waiter
            .channel()
            .bootstrap
            .shutdown(std::net::Shutdown::Both);
        self.stop_watching_bootstrap();
        // Flush whatever is outstanding so that every receive buffer comes back to its pool.
        // The flushes are generated promptly; wait a bounded time for them. (Sends are not
        // waited for: unsignaled sends that had already succeeded never complete again; their
        // buffers go with the queue pair.)
        let _ = self.qp.to_error();
        let until = Instant::now() + FLUSH_WAIT;
        while self.qp.recv_outstanding() > 0 && Instant::now() < until {
            if !matches!(self.poll_and_handle(), Ok(n) if n > 0) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let _ = self.poll_and_handle();
    }

    /// Polls both queues until empty and handles what they held; returns how many.
    fn poll_and_handle(&mut self) -> Result<usize> {
        let mut got = std::mem::take(&mut self.completions);
        let polled = self
            .waiter
            .poll_all(&mut |key, wc| got.push((key, wc.clone())));
        self.completions = got;
        self.handle_completions();
        Ok(polled?)
    }

    fn handle_completions(&mut self) {
        let mut got = std::mem::take(&mut self.completions);
        // The first real error explains the flushes that follow it (a send that exhausted its
        // retries moves the queue pair to error, which flushes the receives, and the receive
        // queue is polled first): record it before any flush is looked at.
        if self.failure.is_none() {
            if let Some((_, wc)) = got
                .iter()
                .find(|(_, wc)| !wc.is_success() && wc.status() != WcStatus::WrFlushErr)
            {
                let f = Failure::of_completion(wc);
                self.fail(f);
            }
        }
        for (key, wc) in got.drain(..) {
            if key == self.recv_key {
                self.on_recv(&wc);
            } else {
                self.send_bufs.extend(self.qp.complete_send(&wc));
                if !wc.is_success() && wc.status() != WcStatus::WrFlushErr {
                    self.fail(Failure::of_completion(&wc));
                }
            }
        }
        self.completions = got;
    }

    fn on_recv(&mut self, wc: &WorkCompletion) {
        let Some(buf) = self.qp.take_recv(wc) else {
            return;
        };
        if !wc.is_success() {
            self.pool.put_back(buf);
            if wc.status() == WcStatus::WrFlushErr && self.failure.is_none() {
                // Our queue pair is in error and nothing said why yet: an asynchronous event
                // (a CQ overrun, a fatal QP error) may be waiting to.
                let _ = self.check_async_events();
            }
            let f = if wc.status() == WcStatus::WrFlushErr {
                Failure::QpError
            } else {
                Failure::of_completion(wc)
            };
            self.fail(f);
            return;
        }
        if self.failure.is_some() || self.peer_closed {
            self.pool.put_back(buf);
            return;
        }
        let Some(word) = wc.imm_data() else {
            self.pool.put_back(buf);
            self.fail(Failure::MissingImm);
            return;
        };
        let Some(imm) = Imm::decode(word) else {
            self.pool.put_back(buf);
            self.fail(Failure::Protocol(crate::credits::Violation::BadImm));
            return;
        };
        match self.credits.on_receive(imm) {
            Err(v) => {
                self.pool.put_back(buf);
                self.fail(Failure::Protocol(v));
            }
            Ok(true) => {
                self.stats.grants_received += 1;
                self.pool.put_back(buf);
            }
            Ok(false) if imm.flags & Imm::CLOSE != 0 => {
                self.pool.put_back(buf);
                // Its slot was a data credit: the buffer is re-posted but never returned.
                self.peer_closed = true;
                self.fail(Failure::PeerClosed);
            }
            Ok(false) => {
                self.stats.received += 1;
                let len = wc.byte_len() as usize;
                self.ready.push_back(self.pool.lend(buf, len));
            }
        }
    }

    /// Re-posts free buffers and sends a credit grant when one is due.
    fn maintain(&mut self) -> Result<()> {
        self.pool.collect_returns();
        if self.failure.is_some() {
            return Ok(());
        }
        let free = self.pool.free_count();
        let batch = (self.credits.depth() as usize / 8).max(1);
        let low = self.credits.depth() / 4;
        if free > 0
            && (free >= batch
                || self.credits.slots_missing() > 0
                || self.credits.peer_credits() <= low
                || self.credits.peer_may_be_blocked())
        {
            let bufs = self.pool.take_free();
            let n = bufs.len();
            if let Err(e) = self.qp.post_recv(bufs) {
                for b in e.unposted {
                    self.pool.put_back(b);
                }
                self.credits.on_reposted(e.posted as u32);
                return Err(e.error.into());
            }
            self.stats.refills += 1;
            self.credits.on_reposted(n as u32);
        }
        if self.qp.send_outstanding() < self.sq_depth {
            if let Some(grant) = self.credits.take_grant() {
                self.stats.grants_sent += 1;
                self.post(SendRequest::empty(), grant.imm, grant.solicited)?;
            }
        }
        // A full send queue holds back grants: hear of its completions.
        let mode = if self.qp.send_outstanding() >= self.sq_depth {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        };
        if self.waiter.mode(self.send_key)? != mode {
            self.waiter.set_mode(self.send_key, mode)?;
        }
        Ok(())
    }

    /// Test hook: moves the queue pair to the error state behind the connection's back, as a
    /// device fault would. Never call it otherwise.
    #[doc(hidden)]
    pub fn break_queue_pair(&mut self) -> Result<()> {
        Ok(self.qp.to_error()?)
    }

    /// Notices the end of the peer's bootstrap stream.
    fn check_bootstrap(&mut self) {
        self.bootstrap_checked = Instant::now();
        let ch = self.waiter.channel();
        if !ch.watch_bootstrap {
            return;
        }
        let mut byte = [0u8; 16];
        let eof = match (&ch.bootstrap).read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        };
        if eof {
            self.stop_watching_bootstrap();
            // A close message may still be on its way through the RC path; give it a moment.
            let until = Instant::now() + Duration::from_millis(50);
            while !self.peer_closed && Instant::now() < until {
                let _ = self.poll_and_handle();
                if !self.peer_closed {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            self.fail(Failure::PeerVanished);
        }
    }

    fn stop_watching_bootstrap(&mut self) {
        self.waiter.channel_mut().stop_watching_bootstrap();
    }

    fn check_async_events(&mut self) -> Result<()> {
        let qp_num = self.qp.qp_num();
        let cqs = [
            self.waiter.cq(self.recv_key)?.as_raw() as usize,
            self.waiter.cq(self.send_key)?.as_raw() as usize,
        ];
        let events = self.endpoint.take_async_events(|el| match *el {
            AsyncElement::Qp(n) => n == qp_num,
            AsyncElement::Cq(addr) => cqs.contains(&addr),
            _ => false,
        })?;
        for ev in events {
            use verbs_core::AsyncEventKind as K;
            if matches!(
                ev.kind,
                K::QpFatal | K::QpReqErr | K::QpAccessErr | K::CqErr
            ) {
                self.fail(Failure::AsyncEvent(ev.kind));
            }
        }
        Ok(())
    }
}
