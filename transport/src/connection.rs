//! A credit-flow-controlled RC connection.

use std::collections::VecDeque;
use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmsg_notify::{ArmMode, CqKey, EventChannel, EventTarget, Policy, Readiness, Waiter};
use rdmsg_verbs::{
    Buffer, CompletionChannel, CompletionQueue, Exposed, QueuePair, ReadSegment, ReadyWatch,
    SendRequest, WorkCompletion,
};

use crate::bootstrap::{AfterHandshake, Setup};
use crate::credits::{Credits, Imm};
use crate::endpoint::{Endpoint, PathParams};
use crate::events::{self, Mailbox};
use crate::handshake::{self, Hello, GOODBYE};
use crate::inbound::{Completion, RecvAction};
use crate::pool::{PoolStats, Received, RecvPool};
use crate::protocol::{Outgoing, Protocol};
use crate::read::{self, Arrival, ReadDone, ReadPost};
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
    /// Longest a whole handshake may take, whatever the peer does byte by byte (a
    /// [`Listener`](crate::Listener) runs many at once, each with its own deadline). Default
    /// 5 s.
    pub handshake_timeout: Duration,
    /// Largest receive buffer a peer may announce. Our send buffers are that big, so this is
    /// what a peer can make us register per send buffer; a bigger announcement is rejected
    /// ([`Reject::Limits`](crate::handshake::Reject::Limits)) before anything is allocated.
    /// Default 1 MiB.
    pub max_peer_buf_size: u32,
    /// Deepest receive queue a peer may announce (its initial credits are at most that).
    /// Default 65535 (the most credits one message can return).
    pub max_peer_recv_depth: u32,
    /// Most memory registered for send buffers (`send_depth` buffers of the peer's buffer
    /// size): beyond it, fewer send buffers are registered (at least one; a peer whose one
    /// buffer does not fit is rejected). Default 64 MiB.
    pub max_send_memory: u64,
    /// Most handshakes a [`Listener`](crate::Listener) runs at once (1..=63); a new client
    /// beyond that evicts the oldest pending one. Default 32.
    pub max_pending_handshakes: u32,
    /// A pre-shared key both sides must prove they know (HMAC-SHA256 challenge-response over
    /// the handshake, see the `handshake` module); the server allocates nothing for a client
    /// that has not. Both sides must have the same key, or none. Default `None`.
    pub psk: Option<handshake::Psk>,
    /// Longest wait in [`Connection::close`] for the close message to be delivered. Default 2 s.
    pub close_timeout: Duration,
    /// How long a peer *host* may stay silent before it is declared gone
    /// ([`Failure::PeerVanished`]), through TCP keepalive on the bootstrap stream (a peer
    /// process that dies is noticed at once by its stream's end; a host that dies or drops off
    /// the network sends nothing). `None`: never. Default 5 s; whole seconds, at least 3 s.
    /// The first half of it is idle, the second probes once a second (3 to 30 probes), and
    /// the peer is declared gone only when every probe went unanswered: on a lossy link,
    /// where probes are lost too, a longer limit makes false alarms much rarer (at 5 % loss
    /// each way, 3 probes all fail about once in a thousand rounds, 5 about once in 10^5).
    pub keepalive: Option<Duration>,
    /// Longest a sleeping connection goes without polling its queues for an error nothing
    /// woke it for. The verbs specification has an error completion fire even a solicited-only
    /// arm, but providers bend it: Linux 6.12's rxe does not wake a solicited-only receiver for
    /// receives flushed by a queue pair error, and rxe never marks send-side errors solicited.
    /// The send queue is armed for any completion while a signaled send is outstanding;
    /// this bound covers the rest. Costs one timer wake-up per interval while idle (not counted as a
    /// wake-up in [`rdmsg_notify::Stats`]). `None`: never. Default 1 s.
    pub health_check: Option<Duration>,
    /// Fault injection for tests (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub hooks: TestHooks,
}

/// Faults a test can inject into a connection's setup (feature `test-hooks`); never used
/// otherwise.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct TestHooks {
    /// Entries of the receive CQ instead of what the receive queue needs: provokes a CQ
    /// overrun.
    pub recv_cq_entries: Option<u32>,
    /// Credits announced to the peer beyond the receive buffers really posted: a lying peer,
    /// whose partner's excess sends meet receiver-not-ready.
    pub overstate_credits: u32,
    /// Bytes announced beyond the real size of each receive buffer: the partner's larger
    /// messages complete here with a local length error, a real error completion.
    pub overstate_buf_size: u32,
    /// Credits this side believes it has beyond what the peer granted: a lying sender, whose
    /// excess messages break the peer's credit books.
    pub extra_credits: u32,
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
            max_peer_buf_size: 1 << 20,
            max_peer_recv_depth: 65_535,
            max_send_memory: 64 << 20,
            max_pending_handshakes: 32,
            psk: None,
            close_timeout: Duration::from_secs(2),
            keepalive: Some(Duration::from_secs(5)),
            health_check: Some(Duration::from_secs(1)),
            #[cfg(feature = "test-hooks")]
            hooks: TestHooks::default(),
        }
    }
}

impl Config {
    #[cfg(feature = "test-hooks")]
    pub(crate) fn recv_cq_entries(&self) -> Option<u32> {
        self.hooks.recv_cq_entries
    }

    #[cfg(not(feature = "test-hooks"))]
    pub(crate) fn recv_cq_entries(&self) -> Option<u32> {
        None
    }

    /// What a peer's hello may ask of us.
    pub(crate) fn limits(&self) -> handshake::Limits {
        handshake::Limits {
            max_buf_size: self.max_peer_buf_size,
            max_recv_depth: self.max_peer_recv_depth,
            max_send_memory: self.max_send_memory,
            send_depth: self.send_depth,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
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
        if self.path.rnr_retry > 6 {
            return bad("path.rnr_retry must be at most 6 (7 retries forever: a peer that lies about its buffers would hang us)");
        }
        if self.health_check.is_some_and(|h| h.is_zero()) {
            return bad("health_check must be longer than zero (None turns it off)");
        }
        if self.keepalive.is_some_and(|k| k < Duration::from_secs(3)) {
            return bad("keepalive must be at least 3 s (TCP keepalive counts whole seconds)");
        }
        if self.handshake_timeout.is_zero() {
            return bad("handshake_timeout must be longer than zero");
        }
        if !(handshake::MIN_BUF_SIZE..=handshake::MAX_BUF_SIZE).contains(&self.max_peer_buf_size) {
            return bad("max_peer_buf_size must be between 64 bytes and 1 GiB");
        }
        if self.max_peer_recv_depth == 0 {
            return bad("max_peer_recv_depth must be at least 1");
        }
        if self.max_send_memory < u64::from(handshake::MIN_BUF_SIZE) {
            return bad("max_send_memory must hold at least one 64-byte buffer");
        }
        if self.max_pending_handshakes == 0
            || self.max_pending_handshakes > crate::bootstrap::MAX_PENDING
        {
            return bad("max_pending_handshakes must be between 1 and 63");
        }
        if self
            .psk
            .as_ref()
            .is_some_and(|k| k.len() < handshake::Psk::MIN_LEN)
        {
            return bad("psk must be at least 16 bytes");
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
    endpoint: Endpoint,
}

/// Token of the completion channel in the watch; the others only interrupt a sleep.
const CHANNEL_TOKEN: u8 = 0;
/// Token of the device's async-event descriptor.
const ASYNC_TOKEN: u8 = 2;

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
        // Every connection of the device watches its async-event descriptor; one new event
        // wakes one sleeper, which routes it to its owner (see the `events` module).
        watch.add_exclusive(endpoint.context().async_fd(), ASYNC_TOKEN)?;
        watch.add(bootstrap.as_fd(), 3)?;
        Ok(Self {
            channel,
            watch,
            _wake: wake,
            bootstrap,
            watch_bootstrap: true,
            endpoint,
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
    fn next_event(&mut self, cqs: &[CompletionQueue]) -> rdmsg_notify::Result<Option<EventTarget>> {
        self.channel.next_event(cqs)
    }

    fn wait_readable(&mut self, timeout: Option<Duration>) -> rdmsg_notify::Result<Readiness> {
        let ready = self.watch.wait(timeout)?;
        if ready & (1 << ASYNC_TOKEN) != 0 {
            // Exclusive: of the connections asleep on the device's async events, this one was
            // woken, and it may be the only one. Route them now, whatever else woke us: each
            // event lands in its owner's mailbox and wakes it (us too, through our wake-up
            // socket, if one is ours). A failure to read is found again by the owner's own
            // liveness check.
            let _ = self.endpoint.route_async_events();
        }
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
    /// Credits, receive rules, failure, signalling, statistics (pure, shared with the hub).
    proto: Protocol,
    ready: VecDeque<Received>,
    /// Our RDMA reads that finished, for [`Connection::try_recv_any`].
    reads_done: VecDeque<ReadDone>,
    /// Scratch for the read buffers a completion retires.
    read_scratch: Vec<(u64, Buffer)>,
    completions: Vec<(CqKey, WorkCompletion)>,
    config: Config,
    peer: Hello,
    sq_depth: usize,
    max_inline: usize,
    /// The flushes that follow a failure have been waited for.
    flushed: bool,
    /// Asynchronous events the endpoint routed to this connection.
    mailbox: Arc<Mailbox>,
    /// Test hook: a verb that fails from now on.
    #[cfg(feature = "test-hooks")]
    fault: Option<Fault>,
    inline_scratch: Vec<u8>,
    bootstrap_checked: Instant,
    /// Calls of `progress` and waits that delivered completions, for rate-limiting the
    /// liveness checks without reading the clock every time.
    busy_steps: u32,
    /// Sends since the sender last polled its queues.
    sends_since_progress: u32,
    /// Our close message is posted: the end of the bootstrap stream is the peer having taken
    /// it (it shuts its stream at once), not the peer vanishing.
    closing: bool,
    /// The last bounded send found no credit or send slot: until one goes, [`Connection::step`]
    /// arms both queues for any completion, so that an event loop hears of the grant.
    send_blocked: bool,
    /// Completions handled so far: lets threads sharing the connection tell whether one of
    /// them moved it on (see [`Connection::handled`]).
    handled: u64,
    /// The last [`Connection::step`] marked the pool asleep (for an external wait): the next
    /// call takes the mark back, so that handles dropped while we are awake do not write to
    /// the wake-up socket.
    stepped_asleep: bool,
    /// The last step found nothing to do, so its caller waited (or will) before the next.
    step_quiet: bool,
}

impl AsFd for Connection {
    /// The connection's epoll set (completion channel, wake-up socket, asynchronous events,
    /// bootstrap stream): readable whenever [`Connection::step`] has something to do.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.waiter.channel().watch.as_fd()
    }
}

/// Makes a connection's descriptor readable from any thread: see [`Connection::waker`].
#[derive(Debug)]
pub struct Waker(std::os::unix::net::UnixStream);

impl Waker {
    pub(crate) fn new(socket: std::os::unix::net::UnixStream) -> Self {
        Self(socket)
    }

    /// Writes one byte to the connection's wake-up socket (non-blocking: a full socket
    /// already wakes it).
    pub fn wake(&self) {
        let _ = (&self.0).write(&[1]);
    }
}

/// Longest busy-poll before a polling connection looks at its bootstrap stream again.
const POLL_SLICE: Duration = Duration::from_millis(10);

/// A sender polls its queues at least every this many sends (see `wait_to_send`).
const SEND_PROGRESS_EVERY: u32 = 16;

/// Shortest interval between liveness checks of a busy connection.
const LIVENESS_EVERY: Duration = Duration::from_millis(1);

/// Longest wait for the flush completions after a failure.
const FLUSH_WAIT: Duration = Duration::from_millis(500);

/// Keepalive probing that gives up on a silent peer after about `limit`: see
/// [`keepalive_schedule`].
pub(crate) fn keepalive_probes(limit: Duration) -> socket2::TcpKeepalive {
    let (idle, interval, probes) = keepalive_schedule(limit);
    socket2::TcpKeepalive::new()
        .with_time(idle)
        .with_interval(interval)
        .with_retries(probes)
}

/// (idle time before the first probe, interval, probes) for a keepalive that gives up after
/// about `limit`: half of it idle, the other half probing once a second (at least 3 probes, at
/// most 30, spread out beyond that). A lossy link drops probes and their answers too: at 5 %
/// loss each way one probe in ten goes unanswered, so a peer is declared gone only after
/// every probe of a row failed, and the more a row holds, the rarer a false alarm.
pub(crate) fn keepalive_schedule(limit: Duration) -> (Duration, Duration, u32) {
    let secs = limit.as_secs().max(3);
    let idle = secs / 2;
    let probing = secs - idle;
    let probes = probing.clamp(3, 30);
    let interval = (probing / probes).max(1);
    (
        Duration::from_secs(idle),
        Duration::from_secs(interval),
        probes as u32,
    )
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
    /// Builds the connection once its handshake is done (see the `bootstrap` and `handshake`
    /// modules): `setup`'s queue pair is in RTS towards `peer`, its receives posted and its
    /// send buffers registered; `stream` is the bootstrap stream, non-blocking.
    pub(crate) fn establish(
        endpoint: &Endpoint,
        setup: Setup,
        stream: TcpStream,
        config: &Config,
        peer: Hello,
    ) -> Result<Self> {
        let Setup {
            channel,
            send_cq,
            recv_cq,
            qp,
            pool,
            send_bufs,
            ..
        } = setup;
        stream
            .set_nonblocking(true)
            .map_err(io_err("making the stream non-blocking"))?;
        if let Some(limit) = config.keepalive {
            socket2::SockRef::from(&stream)
                .set_tcp_keepalive(&keepalive_probes(limit))
                .map_err(io_err("enabling TCP keepalive"))?;
        }
        let wake = pool.wake_handle().map_err(Error::WakePipe)?;
        channel.set_nonblocking(true)?;
        let mut waiter = Waiter::new(
            ConnChannel::new(channel, wake, stream, endpoint.clone())?,
            config.policy,
        );
        let recv_key = waiter.add(recv_cq, config.recv_arm);
        let send_key = waiter.add(send_cq, ArmMode::SolicitedOnly);
        let max_inline = qp.caps().max_inline_data.min(config.max_inline) as usize;
        let mailbox = Mailbox::new(Some(pool.waker().map_err(Error::WakePipe)?));
        endpoint.register_async(
            qp.qp_num(),
            vec![
                waiter.cq(recv_key)?.as_raw() as usize,
                waiter.cq(send_key)?.as_raw() as usize,
            ],
            &mailbox,
        );
        Ok(Self {
            endpoint: endpoint.clone(),
            proto: Protocol::new(
                Credits::new(
                    config.recv_depth,
                    config.grant_slots,
                    peer.recv_depth + extra_credits(config),
                    peer.grant_slots,
                    peer.initial_credits + extra_credits(config),
                ),
                config.signal_every,
            ),
            sq_depth: qp.caps().max_send_wr.min(config.send_depth) as usize,
            qp,
            waiter,
            recv_key,
            send_key,
            pool,
            send_bufs,
            ready: VecDeque::new(),
            reads_done: VecDeque::new(),
            read_scratch: Vec::new(),
            completions: Vec::new(),
            config: config.clone(),
            peer,
            max_inline,
            flushed: false,
            mailbox,
            #[cfg(feature = "test-hooks")]
            fault: None,
            inline_scratch: vec![0; max_inline],
            bootstrap_checked: Instant::now(),
            busy_steps: 0,
            sends_since_progress: 0,
            closing: false,
            send_blocked: false,
            handled: 0,
            stepped_asleep: false,
            step_quiet: false,
        })
    }

    /// How the connection was set up.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The largest message the peer accepts.
    pub fn max_message(&self) -> usize {
        self.peer.buf_size as usize
    }

    /// Statistics of this connection.
    pub fn stats(&self) -> ConnStats {
        self.proto.stats()
    }

    /// Wake-up statistics of this connection's waits.
    pub fn wait_stats(&self) -> rdmsg_notify::Stats {
        self.waiter.stats()
    }

    /// Counts of the receive pool's buffers.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats(self.qp.recv_outstanding())
    }

    /// Data messages we may send right now without waiting.
    pub fn credits(&self) -> u32 {
        self.proto.credits().available()
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
        self.proto.failure()
    }

    /// Sends `data`, solicited (waking a receiver armed solicited-only) or not. Blocks while
    /// there is no credit or no send slot.
    pub fn send(&mut self, data: &[u8], solicited: bool) -> Result<()> {
        self.send_timeout(data, solicited, None).map(|_| ())
    }

    /// Sends `data`, waiting at most `timeout` (`None`: as long as it takes) for a credit
    /// and a send slot; `Ok(false)` if none came in time (nothing sent).
    pub fn send_timeout(
        &mut self,
        data: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        if data.len() > self.max_message() {
            return Err(Error::TooLarge {
                len: data.len(),
                max: self.max_message(),
            });
        }
        match self.send_with(solicited, timeout, |buf| {
            buf[..data.len()].copy_from_slice(data);
            Some(data.len())
        }) {
            Err(Error::Timeout(_)) => Ok(false),
            other => other,
        }
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
        self.check_can_send()?;
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
        let out = self
            .proto
            .data(solicited, 0)
            .expect("wait_to_send ensured a credit");
        if len <= self.max_inline {
            // Inline: the bytes are copied at post time, so the buffer is free again at once.
            self.proto.stats_mut().sent_inline += 1;
            let mut scratch = std::mem::take(&mut self.inline_scratch);
            scratch[..len].copy_from_slice(&buf.as_slice()[..len]);
            self.send_bufs.push(buf);
            let res = self.post(SendRequest::inline(&scratch[..len]), out);
            self.inline_scratch = scratch;
            res?;
        } else {
            self.post(SendRequest::buffer(buf, len), out)?;
        }
        Ok(true)
    }

    fn post(&mut self, req: SendRequest<'_>, out: Outgoing) -> Result<()> {
        let signaled = self.proto.signal_next(
            self.qp.send_outstanding() + 1 >= self.sq_depth || self.send_bufs.is_empty(),
        );
        let req = req
            .imm(out.imm.encode())
            .solicited(out.solicited)
            .signaled(signaled);
        #[cfg(feature = "test-hooks")]
        if self.fault == Some(Fault::Post) {
            if let rdmsg_verbs::SendPayload::Buffer { buf, .. } = req.payload {
                self.send_bufs.push(buf);
            }
            let e = injected_fault(Fault::Post, self.qp.qp_num());
            return Err(self.local_failure("posting a send (ibv_post_send)", e));
        }
        match self.qp.post_send_one(req) {
            Ok(id) => {
                self.proto.posted(id, signaled);
                Ok(())
            }
            Err(e) => {
                self.send_bufs.extend(e.unposted);
                // A credit (or a grant's slot) was taken for this message: carrying on would
                // leave the two sides' books apart for good.
                Err(self.local_failure("posting a send (ibv_post_send)", e.error.into()))
            }
        }
    }

    fn can_send(&self) -> bool {
        self.proto.credits().available() > 0
            && self.qp.send_outstanding() < self.sq_depth
            && !self.send_bufs.is_empty()
    }

    fn wait_to_send(&mut self, timeout: Option<Duration>) -> Result<()> {
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        // A streaming sender need not poll before every message: credits, send completions and
        // failures are looked at every few sends, and at once when anything runs low or
        // buffers came back to be re-posted (the peer may be waiting for their credits).
        self.sends_since_progress += 1;
        let plenty = self.proto.credits().available() > self.peer.recv_depth / 4
            && self.send_bufs.len() > 1
            && self.qp.send_outstanding() + 1 < self.sq_depth;
        if !plenty || self.sends_since_progress >= SEND_PROGRESS_EVERY || self.pool.has_returns() {
            self.sends_since_progress = 0;
            self.progress()?;
            // Polling may have found a failure: nothing is posted after it.
            self.check_can_send()?;
        }
        if self.can_send() {
            self.send_blocked = false;
            return Ok(());
        }
        let no_credit = self.proto.credits().available() == 0;
        if no_credit {
            self.proto.stats_mut().credit_waits += 1;
        } else {
            self.proto.stats_mut().send_slot_waits += 1;
        }
        // While blocked, any grant (not only a solicited one) and any send completion must
        // wake us: arm both queues for the next completion.
        self.waiter.set_mode(self.recv_key, ArmMode::Next)?;
        self.waiter.set_mode(self.send_key, ArmMode::Next)?;
        let res = loop {
            if let Err(e) = self.check_can_send() {
                break Err(e);
            }
            if self.can_send() {
                break Ok(());
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                self.send_blocked = true;
                break Err(Error::Timeout(timeout.unwrap_or_default()));
            }
            if let Err(e) = self.wait_once(left) {
                break Err(e);
            }
        };
        if res.is_ok() {
            self.send_blocked = false;
        }
        self.waiter.set_mode(self.recv_key, self.config.recv_arm)?;
        self.waiter.set_mode(self.send_key, self.send_arm())?;
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
        self.wait_for(timeout, Self::try_recv)
    }

    /// Takes what `take` finds, waiting at most `timeout` (`None`: forever) until it finds
    /// something: the wait of [`Connection::recv_timeout`] and
    /// [`Connection::recv_any_timeout`].
    fn wait_for<T>(
        &mut self,
        timeout: Option<Duration>,
        mut take: impl FnMut(&mut Self) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            if let Some(got) = take(self)? {
                return Ok(Some(got));
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

    /// The non-blocking step, for event loops and async runtimes that wait on the connection's
    /// descriptor ([`AsFd`]) instead of in [`Connection::recv`]: re-posts returned buffers and
    /// sends a due grant, reads the completion channel, re-arms both queues (for any
    /// completion while a bounded send found no credit or send slot, else as configured),
    /// polls them, looks at the bootstrap stream and the device's asynchronous events, and
    /// marks the connection asleep, so that a [`Received`] dropped from now on makes the
    /// descriptor readable (its credit must go back to the peer).
    ///
    /// Take what it queued ([`Connection::try_recv`]) before waiting. Once that finds
    /// nothing, waiting until the descriptor is readable, or [`Connection::next_timeout`] has
    /// passed, misses nothing: every completion after the arm raises an event. Returns
    /// whether it handled anything (completions or returned buffers): if so, step again
    /// before waiting (what it queued for receiving is [`Connection::has_ready`]).
    pub fn step(&mut self) -> Result<bool> {
        // Whether the caller waited since our last step: only then is there a wake-up to
        // explain.
        let after_wait = std::mem::take(&mut self.step_quiet);
        self.wake_from_step();
        let returned = self.pool.collect_returns() > 0;
        self.maintain()?;
        let before = self.handled;
        let events = self.waiter.stats().events;
        if self.proto.failure().is_none() {
            let (recv_mode, send_mode) = if self.send_blocked {
                (ArmMode::Next, ArmMode::Next)
            } else {
                (self.config.recv_arm, self.send_arm())
            };
            for (key, mode) in [(self.recv_key, recv_mode), (self.send_key, send_mode)] {
                if self.waiter.mode(key)? != mode {
                    self.waiter.set_mode(key, mode)?;
                }
            }
            let mut got = std::mem::take(&mut self.completions);
            // A send queue armed solicited-only fires only for an error completion, which
            // this step polls and fails on: its event need not be looked for.
            let send_key = self.send_key;
            let may_fire = |key: CqKey, mode: ArmMode| key != send_key || mode == ArmMode::Next;
            let polled = self
                .waiter
                .step_where(&may_fire, &mut |key, wc| got.push((key, wc.clone())));
            self.completions = got;
            self.handle_completions();
            if let Err(e) = polled {
                return Err(self.local_failure("stepping the completion queues", e.into()));
            }
        }
        // A completion event explains the wake-up (and a step that follows another without a
        // wait has none to explain): the other descriptors (wake-up socket, bootstrap stream,
        // asynchronous events) are then looked at only now and then, as a busy connection
        // does, and at the latest by the health check's step. Otherwise something else made
        // the descriptor readable: look at all of them.
        let explained = !after_wait || self.waiter.stats().events != events;
        let liveness = !explained || self.liveness_due();
        if liveness {
            // Settling reads (and routes) the device's asynchronous events too.
            self.pool.awake(true);
        }
        self.settle(liveness)?;
        let busy = returned || self.handled != before;
        // After this, a dropped handle writes to the wake-up socket, which is in the set.
        let quiet = self.pool.going_to_sleep();
        self.stepped_asleep = quiet;
        self.step_quiet = quiet && !busy;
        Ok(busy || !quiet)
    }

    /// Awake again after a [`Connection::step`]'s external wait: takes the pool's sleeping
    /// mark back (drains the wake-up socket only if a dropped handle wrote to it).
    fn wake_from_step(&mut self) {
        if std::mem::take(&mut self.stepped_asleep) {
            self.pool.awake(false);
        }
    }

    /// Tells the connection that nobody waits on its descriptor any more (the last waiter woke
    /// up): a [`Received`] dropped from now on need not write to the wake-up socket. Until
    /// this (or the next [`Connection::step`]), each sleep costs the first such drop a write.
    /// Call it only when no other thread or task still waits on the descriptor: one that does
    /// would not be woken for the buffers dropped meanwhile.
    pub fn resume(&mut self) {
        self.wake_from_step();
    }

    /// Longest an event loop may wait on the descriptor before calling
    /// [`Connection::step`]: the health check, which finds errors a provider did not signal.
    pub fn next_timeout(&self) -> Option<Duration> {
        self.config.health_check
    }

    /// Completions handled since the connection was made. Threads sharing a connection
    /// compare it before and after a call to learn whether the call moved the connection on
    /// (messages queued, credits or send slots back), which a thread asleep on the descriptor
    /// may be waiting for.
    pub fn handled(&self) -> u64 {
        self.handled
    }

    /// Whether the last bounded send found no credit or send slot (and none has gone since):
    /// [`Connection::step`] then arms for any completion.
    pub fn send_blocked(&self) -> bool {
        self.send_blocked
    }

    /// Whether received messages (or finished reads, for [`Connection::try_recv_any`]) are
    /// queued.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty() || !self.reads_done.is_empty()
    }

    /// Exposes `bytes` to RDMA reads by the peer, under a key of their own, until the
    /// returned [`Exposed`] is dropped (see [`Endpoint::expose`]).
    pub fn expose(&self, bytes: rdmsg_verbs::Bytes) -> Result<Exposed> {
        self.endpoint.expose(bytes)
    }

    /// Registers `len` bytes that reads may land in (see [`Endpoint::register`]).
    pub fn register(&self, len: usize) -> Result<Buffer> {
        self.endpoint.register(len)
    }

    /// Posts RDMA reads of the peer's memory into `into` (see
    /// [`rdmsg_verbs::QueuePair::post_read`]): no credit is spent, but each segment takes a
    /// send queue slot until the read completes. [`ReadPost::Busy`] (the buffer back) if the
    /// slots are not free now. The read's end comes out of [`Connection::try_recv_any`] as
    /// [`Arrival::Read`]. A bad key or address is the peer's doing: the read completes in
    /// error and the connection fails ([`Failure::Completion`]); the peer's side sees a remote
    /// access error.
    pub fn post_read(&mut self, into: Buffer, segments: &[ReadSegment]) -> Result<ReadPost> {
        self.check_can_send()?;
        let need = segments.len();
        if need > self.sq_depth {
            return Err(Error::Config(format!(
                "a read of {need} segments needs more than the {} send queue slots",
                self.sq_depth
            )));
        }
        if self.qp.send_outstanding() + need > self.sq_depth {
            self.progress()?;
            self.check_can_send()?;
            if self.qp.send_outstanding() + need > self.sq_depth {
                return Ok(ReadPost::Busy(into));
            }
        }
        match self.qp.post_read(into, segments) {
            Ok(id) => {
                self.proto.posted(id, true);
                Ok(ReadPost::Posted(id))
            }
            Err(e)
                if e.posted == 0 && matches!(e.error, rdmsg_verbs::Error::InvalidArgument(_)) =>
            {
                Err(e.error.into())
            }
            Err(e) => Err(self.local_failure("posting a read (ibv_post_send)", e.error.into())),
        }
    }

    /// [`Connection::try_recv`], also handing out this connection's finished RDMA reads
    /// ([`Connection::post_read`]).
    pub fn try_recv_any(&mut self) -> Result<Option<Arrival>> {
        if self.ready.is_empty() && self.reads_done.is_empty() {
            let progressed = self.progress();
            if self.ready.is_empty() && self.reads_done.is_empty() {
                progressed?;
                self.check_failed()?;
                return Ok(None);
            }
        }
        if let Some(read) = self.reads_done.pop_front() {
            return Ok(Some(Arrival::Read(read)));
        }
        Ok(self.try_recv()?.map(Arrival::Message))
    }

    /// [`Connection::recv_timeout`], also handing out finished reads (see
    /// [`Connection::try_recv_any`]).
    pub fn recv_any_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<Arrival>> {
        self.wait_for(timeout, Self::try_recv_any)
    }

    /// A handle that makes the connection's descriptor readable (and ends its blocking
    /// waits), from any thread: for threads sharing the connection, one of which sleeps on
    /// it while another changed what it waits for.
    pub fn waker(&self) -> Result<Waker> {
        Ok(Waker(self.pool.waker().map_err(Error::WakePipe)?))
    }

    /// An iterator of received messages that ends when the connection fails or closes.
    pub fn incoming(&mut self) -> impl Iterator<Item = Received> + '_ {
        std::iter::from_fn(move || self.recv().ok())
    }

    /// Closes gracefully: sends a close message after everything sent so far and waits (up to
    /// `close_timeout`) until it is delivered, then writes [`GOODBYE`] on the bootstrap stream
    /// and shuts it down. The peer receives everything, then [`Failure::PeerClosed`].
    pub fn close(mut self) -> Result<()> {
        self.check_can_send()?;
        let timeout = self.config.close_timeout;
        self.wait_to_send(Some(timeout))?;
        let out = self
            .proto
            .data(true, Imm::CLOSE)
            .expect("wait_to_send ensured a credit");
        self.proto.force_signal();
        self.closing = true;
        self.post(SendRequest::empty(), out)?;
        let deadline = Instant::now() + timeout;
        self.waiter.set_mode(self.send_key, ArmMode::Next)?;
        while self.qp.send_outstanding() > 0 {
            self.check_can_send()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            self.wait_once(Some(left))?;
        }
        let _ = self.proto.record_failure(Failure::Closed);
        // The close message is delivered: say goodbye on the bootstrap stream, so that the
        // peer reading its end waits for that message rather than calling us vanished.
        let bootstrap = &self.waiter.channel().bootstrap;
        let _ = (&*bootstrap).write_all(&[GOODBYE]);
        let _ = bootstrap.shutdown(std::net::Shutdown::Both);
        Ok(())
    }

    /// The failure, once every message that arrived before it has been delivered.
    fn check_failed(&self) -> Result<()> {
        match self.proto.failure() {
            Some(f) if self.ready.is_empty() => Err(f.into()),
            _ => Ok(()),
        }
    }

    /// The failure, at once: nothing is sent after it.
    fn check_can_send(&self) -> Result<()> {
        match self.proto.failure() {
            Some(f) => Err(f.into()),
            None => Ok(()),
        }
    }

    /// Sleeps (per the policy) until something happens, then processes it.
    /// Messages already queued do not stop the wait: a receiver takes them before calling
    /// this, and a sender blocked on credits must sleep (or poll) for its grant whatever it
    /// holds undelivered.
    fn wait_once(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.maintain()?;
        if self.proto.failure().is_some() {
            return Ok(());
        }
        if !self.pool.going_to_sleep() {
            return self.progress();
        }
        // A polling wait watches no descriptor: bound it so that liveness is checked. A
        // sleeping one wakes at least every `health_check` to poll for errors the provider
        // did not signal.
        let slice = match self.config.policy {
            Policy::Poll => Some(POLL_SLICE),
            _ => self.config.health_check,
        };
        let timeout = match (timeout, slice) {
            (Some(t), Some(s)) => Some(t.min(s)),
            (t, s) => t.or(s),
        };
        let mut got = std::mem::take(&mut self.completions);
        let res = self.wait_for_completions(timeout, &mut got);
        self.pool.awake(!matches!(res, Ok(n) if n > 0));
        self.completions = got;
        self.handle_completions();
        let delivered = match res {
            Ok(n) => n,
            Err(e) => return Err(self.local_failure("waiting for completions", e)),
        };
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

    /// The waiter's wait, or the injected fault of a test.
    fn wait_for_completions(
        &mut self,
        timeout: Option<Duration>,
        got: &mut Vec<(CqKey, WorkCompletion)>,
    ) -> Result<usize> {
        #[cfg(feature = "test-hooks")]
        if self.fault == Some(Fault::Poll) {
            return Err(injected_fault(Fault::Poll, self.qp.qp_num()));
        }
        Ok(self
            .waiter
            .wait(timeout, &mut |key, wc| got.push((key, wc.clone())))?)
    }

    /// After completions were handled: waits for the flushes of a failure, optionally looks
    /// for a vanished peer and asynchronous events, then re-posts and grants.
    fn settle(&mut self, liveness: bool) -> Result<()> {
        if self.proto.failure().is_some() {
            self.drain_flushes();
        }
        if liveness {
            self.check_bootstrap();
            self.check_async_events()?;
        }
        self.maintain()
    }

    /// Turns the error of a verb the connection drives into the sticky failure it stands for
    /// (a queue that cannot be polled, armed or posted to now will not work later either), and
    /// hands the error back for this call to report.
    fn local_failure(&mut self, op: &'static str, e: Error) -> Error {
        if let Some(known) = self.proto.failure() {
            // Reported once; from then on the connection's failure says it.
            return known.into();
        }
        let errno = errno_of(&e);
        self.fail(Failure::Local { op, errno });
        e
    }

    /// Records a failure and waits (bounded) for the flushes it causes.
    fn fail(&mut self, f: Failure) {
        self.record_failure(f);
        self.drain_flushes();
    }

    /// Records the first failure, tells the peer (the end of the bootstrap stream) and moves
    /// the queue pair to the error state so that every posted buffer is flushed back. Polls
    /// nothing: completions being handled right now keep their order.
    fn record_failure(&mut self, f: Failure) {
        if self.proto.record_failure(f) {
            self.tell_peer_and_flush();
        }
    }

    /// After the first failure: shuts the bootstrap stream and moves the queue pair to the
    /// error state.
    fn tell_peer_and_flush(&mut self) {
        // Tell the peer at once: the end of our bootstrap stream fails its side too, rather than
        // leaving it waiting on a queue pair that no longer answers.
        let _ = self
            .waiter
            .channel()
            .bootstrap
            .shutdown(std::net::Shutdown::Both);
        self.stop_watching_bootstrap();
        let _ = self.qp.to_error();
    }

    /// Waits (once, bounded) for the flushes of every posted receive, so that every receive
    /// buffer comes back to its pool; successful receives found among them are delivered.
    /// (Sends are not waited for: unsignaled sends that had already succeeded never complete
    /// again; their buffers go with the queue pair.)
    fn drain_flushes(&mut self) {
        if std::mem::replace(&mut self.flushed, true) {
            return;
        }
        let until = Instant::now() + FLUSH_WAIT;
        while self.qp.recv_outstanding() > 0 && Instant::now() < until {
            match self.poll_and_handle() {
                Ok(0) => std::thread::sleep(Duration::from_millis(1)),
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }

    /// Polls both queues until empty and handles what they held; returns how many.
    fn poll_and_handle(&mut self) -> Result<usize> {
        let mut got = std::mem::take(&mut self.completions);
        let polled = self.poll_completions(&mut got);
        self.completions = got;
        self.handle_completions();
        polled.map_err(|e| self.local_failure("polling the completion queues", e))
    }

    /// The waiter's poll, or the injected fault of a test.
    fn poll_completions(&mut self, got: &mut Vec<(CqKey, WorkCompletion)>) -> Result<usize> {
        #[cfg(feature = "test-hooks")]
        if self.fault == Some(Fault::Poll) {
            return Err(injected_fault(Fault::Poll, self.qp.qp_num()));
        }
        Ok(self
            .waiter
            .poll_all(&mut |key, wc| got.push((key, wc.clone())))?)
    }

    /// Handles polled completions in the order polled (see the `inbound` module): whatever
    /// arrived before a failure is delivered before the failure is reported.
    fn handle_completions(&mut self) {
        let mut got = std::mem::take(&mut self.completions);
        self.handled += got.len() as u64;
        let recv_key = self.recv_key;
        // Recording polls nothing, so the batch is still handled in order below.
        if self.proto.begin_batch(
            got.iter()
                .map(|(key, wc)| Completion::of(*key == recv_key, wc)),
        ) {
            self.tell_peer_and_flush();
        }
        for (key, wc) in got.drain(..) {
            let c = Completion::of(key == recv_key, &wc);
            if c.recv {
                self.on_recv(&c, &wc);
            } else {
                let mut reads = std::mem::take(&mut self.read_scratch);
                self.qp
                    .complete_send_split(&wc, &mut self.send_bufs, &mut reads);
                self.reads_done.extend(read::finished(&wc, reads.drain(..)));
                self.read_scratch = reads;
                if self.proto.on_send(&c, wc.wr_id()) {
                    self.tell_peer_and_flush();
                }
            }
        }
        self.completions = got;
    }

    fn on_recv(&mut self, c: &Completion, wc: &WorkCompletion) {
        let Some(buf) = self.qp.take_recv(wc) else {
            return;
        };
        let (endpoint, mailbox) = (&self.endpoint, &self.mailbox);
        // A flush nothing explains yet: an asynchronous event (a CQ overrun, a fatal QP error)
        // may be waiting to.
        let (action, first_failure) = self
            .proto
            .on_recv(c, || async_failure_of(endpoint, mailbox).ok().flatten());
        match action {
            RecvAction::Deliver => {
                let len = wc.byte_len() as usize;
                self.ready.push_back(self.pool.lend(buf, len));
            }
            RecvAction::Grant | RecvAction::Recycle => self.pool.put_back(buf),
        }
        if first_failure {
            self.tell_peer_and_flush();
        }
    }

    /// Re-posts free buffers and sends a credit grant when one is due.
    fn maintain(&mut self) -> Result<()> {
        self.pool.collect_returns();
        if self.proto.failure().is_some() {
            return Ok(());
        }
        if self.proto.refill_due(self.pool.free_count()) {
            let bufs = self.pool.take_free();
            let n = bufs.len();
            if let Err(e) = self.qp.post_recv(bufs) {
                for b in e.unposted {
                    self.pool.put_back(b);
                }
                self.proto.reposted(e.posted as u32);
                return Err(
                    self.local_failure("re-posting receives (ibv_post_recv)", e.error.into())
                );
            }
            self.proto.reposted(n as u32);
        }
        if self.qp.send_outstanding() < self.sq_depth {
            if let Some(grant) = self.proto.grant() {
                self.post(SendRequest::empty(), grant)?;
            }
        }
        let mode = self.send_arm();
        if self.waiter.mode(self.send_key)? != mode {
            self.waiter.set_mode(self.send_key, mode)?;
        }
        Ok(())
    }

    /// How the send queue is armed: for any completion while a signaled send is outstanding,
    /// so that its completion, or the error a failed send turns it into, wakes a sleeper (rxe
    /// never marks send-side errors solicited, although the specification has every error
    /// completion fire a solicited-only arm), and a full send queue (whose last send is always
    /// signaled) does not hold back a due grant. Solicited-only otherwise, so that a sleep
    /// with only unsignaled sends behind it skips the pre-sleep drain of the channel; an error
    /// among those is caught by `health_check` or the peer's end of the bootstrap stream.
    fn send_arm(&self) -> ArmMode {
        self.proto.send_arm()
    }

    /// Test hook: moves the queue pair to the error state behind the connection's back, as a
    /// device fault would.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn break_queue_pair(&mut self) -> Result<()> {
        Ok(self.qp.to_error()?)
    }

    /// Test hook: makes a verb fail from now on, as on a queue that can no longer be used.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn inject_fault(&mut self, fault: Fault) {
        self.fault = Some(fault);
    }

    /// Test hook: the raw queue pair, for a test that moves it to the error state from another
    /// thread while the connection sleeps. Valid while the connection lives.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn raw_queue_pair(&self) -> *mut rdmsg_verbs::ffi::ibv_qp {
        self.qp.as_raw()
    }

    /// Looks at the bootstrap stream, where after the handshake only a [`GOODBYE`] may come:
    /// the peer closed gracefully and its close message is delivered or on its way, so wait
    /// for it up to `close_timeout`. End-of-file without it means the peer's process is gone
    /// (a close message may still be in flight: wait 50 ms). Anything else is junk and fails
    /// the connection at once ([`Failure::BootstrapGarbage`]), which also stops watching the
    /// stream: junk costs one wake-up, not one per read.
    fn check_bootstrap(&mut self) {
        self.bootstrap_checked = Instant::now();
        let ch = self.waiter.channel();
        if !ch.watch_bootstrap {
            return;
        }
        let news = AfterHandshake::read(&ch.bootstrap);
        match news {
            AfterHandshake::Nothing => return,
            AfterHandshake::Garbage(byte) => {
                self.fail(Failure::BootstrapGarbage { byte });
                return;
            }
            AfterHandshake::Goodbye | AfterHandshake::Ended => {}
        }
        self.stop_watching_bootstrap();
        if self.closing {
            // Our close is delivered or on its way: `close` waits for its completion.
            return;
        }
        let grace = news.grace(self.config.close_timeout);
        let until = Instant::now() + grace;
        while !self.proto.peer_closed() && Instant::now() < until {
            let _ = self.poll_and_handle();
            if !self.proto.peer_closed() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.fail(Failure::PeerVanished);
    }

    fn stop_watching_bootstrap(&mut self) {
        self.waiter.channel_mut().stop_watching_bootstrap();
    }

    /// Fails the connection if an asynchronous event says it is broken.
    fn check_async_events(&mut self) -> Result<()> {
        if let Some(f) = self.async_failure() {
            self.fail(f);
        }
        Ok(())
    }

    /// Reads the device's pending asynchronous events (routing each to the connection it
    /// concerns) and returns the failure the first fatal one of ours stands for: a fatal,
    /// request or access error of our queue pair, an overrun of one of our CQs, a fatal
    /// device error, or an error of our port.
    fn async_failure(&mut self) -> Option<Failure> {
        match async_failure_of(&self.endpoint, &self.mailbox) {
            Ok(f) => f,
            Err(e) => {
                // The descriptor can no longer be read: nothing would tell us of device faults.
                self.local_failure("reading asynchronous events", e);
                None
            }
        }
    }
}

/// Test hook: credits a lying sender believes it has beyond the peer's grant.
fn extra_credits(config: &Config) -> u32 {
    #[cfg(feature = "test-hooks")]
    return config.hooks.extra_credits;
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = config;
        0
    }
}

/// Routes the device's pending asynchronous events and returns the failure the first fatal
/// one in `mailbox` stands for: a fatal, request or access error of the queue pair, an
/// overrun of a CQ, a fatal device error, or an error of the port.
fn async_failure_of(endpoint: &Endpoint, mailbox: &Mailbox) -> Result<Option<Failure>> {
    endpoint.route_async_events()?;
    Ok(mailbox
        .take()
        .into_iter()
        .find_map(|ev| events::is_fatal(ev.kind).then_some(Failure::AsyncEvent(ev.kind))))
}

/// The error number behind an error, if any of its sources is an OS error.
pub(crate) fn errno_of(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io.raw_os_error();
        }
        cur = err.source();
    }
    None
}

/// Verbs a test can make fail (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Polling and waiting fail, as on a completion queue or channel that can no longer be
    /// used.
    Poll,
    /// Posting a send fails (after its credit was taken).
    Post,
}

/// What an injected fault reports: the error of a queue that can no longer be used (EIO, as
/// a provider reports for a queue it can no longer reach).
#[cfg(feature = "test-hooks")]
fn injected_fault(fault: Fault, qp_num: u32) -> Error {
    let source = std::io::Error::from_raw_os_error(5);
    Error::Verbs(match fault {
        Fault::Poll => rdmsg_verbs::Error::PollCq(source),
        Fault::Post => rdmsg_verbs::Error::PostSend { qp_num, source },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalive_gives_up_after_about_its_limit_with_more_probes_for_longer_limits() {
        let total = |(idle, interval, probes): (Duration, Duration, u32)| {
            (idle + interval * probes).as_secs()
        };
        for (limit, probes) in [(3, 3), (5, 3), (10, 5), (20, 10), (60, 30), (7200, 30)] {
            let s = keepalive_schedule(Duration::from_secs(limit));
            assert_eq!(s.2, probes, "{limit} s");
            assert!(s.1 >= Duration::from_secs(1), "{limit} s");
            let t = total(s);
            assert!(
                t >= limit && t <= limit + 1,
                "{limit} s gives up after {t} s"
            );
        }
    }

    #[test]
    fn retrying_receiver_not_ready_for_ever_is_refused() {
        assert_eq!(Config::default().path.rnr_retry, 6, "finite by default");
        let mut c = Config::default();
        c.path.rnr_retry = 7;
        assert!(matches!(c.check(), Err(Error::Config(m)) if m.contains("rnr_retry")));
        c.path.rnr_retry = 6;
        assert!(c.check().is_ok());
    }

    #[test]
    fn the_health_check_is_bounded_and_can_be_turned_off() {
        assert_eq!(Config::default().health_check, Some(Duration::from_secs(1)));
        let mut c = Config {
            health_check: Some(Duration::ZERO),
            ..Config::default()
        };
        assert!(c.check().is_err());
        c.health_check = None;
        assert!(c.check().is_ok());
    }

    #[test]
    fn errno_is_found_anywhere_in_the_chain() {
        let e = Error::Verbs(rdmsg_verbs::Error::PollCq(
            std::io::Error::from_raw_os_error(5),
        ));
        assert_eq!(errno_of(&e), Some(5));
        assert_eq!(errno_of(&Error::Config("x".into())), None);
        let f = Failure::Local {
            op: "polling the completion queues",
            errno: Some(5),
        };
        assert_eq!(
            f.to_string(),
            "polling the completion queues failed (Input/output error (os error 5))"
        );
    }
}
