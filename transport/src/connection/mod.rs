//! A credit-flow-controlled RC connection: the driver of one [`Core`] on a queue pair with its
//! own completion queues, receive pool, send buffers and completion channel. It polls, posts,
//! waits and moves bytes; every protocol rule is the core's. `channel` is what its sleep
//! watches; `turn` is the private half of the driver: polling, waiting, the core's actions.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmsg_notify::{ArmMode, CqKey, Waiter};
use rdmsg_verbs::{Buffer, CompletionQueue, Exposed, QueuePair, ReadSegment, WorkCompletion};

use crate::clock::TurnClock;
use crate::config::{extra_credits, Config};
#[cfg(feature = "test-hooks")]
use crate::config::{injected_fault, Fault};
use crate::control::Control;
use crate::core::{earliest, ConnStats, Core, Post, Room};
use crate::credits::Credits;
use crate::device_events::Mailbox;
use crate::drive;
use crate::endpoint::Endpoint;
use crate::error::{Error, Failure, Result};
use crate::handshake::Hello;
use crate::pool::{PoolStats, Received, RecvPool, Waker};
use crate::read::{Arrival, ReadDone, ReadPost};
use crate::send::{self, Payload, SendBuffers};
use crate::setup::Setup;
use crate::stream::{bootstrap_err, keepalive_probes};
use crate::trace::{trace_span, Stall};

mod channel;
mod queues;
mod turn;

use channel::ConnChannel;

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
    send: SendBuffers,
    /// The protocol: credits, receive rules, failure, signalling, close, deadlines.
    core: Core,
    ready: VecDeque<Received>,
    /// Our RDMA reads that finished, for [`Connection::try_recv_any`].
    reads_done: VecDeque<ReadDone>,
    /// Scratch for the read buffers a completion retires.
    read_scratch: Vec<(u64, Buffer)>,
    completions: Vec<(CqKey, WorkCompletion)>,
    config: Config,
    peer: Hello,
    sq_depth: usize,
    /// Send queue slots set aside while an exposure waits to be bound (see
    /// [`Connection::expose_to_peer`]).
    sq_reserve: usize,
    /// Asynchronous events the endpoint routed to this connection.
    mailbox: Arc<Mailbox>,
    /// Test hook: a verb that fails from now on.
    #[cfg(feature = "test-hooks")]
    fault: Option<Fault>,
    bootstrap_checked: Instant,
    /// The time of this turn (see [`TurnClock`]).
    clock: TurnClock,
    /// Polls and waits that delivered completions, for rate-limiting the liveness checks
    /// without reading the clock every time.
    busy_steps: u32,
    /// Completions handled so far: lets threads sharing the connection tell whether one of
    /// them moved it on (see [`Connection::handled`]).
    handled: u64,
    /// `handled` when re-posting and granting last ran: a poll that finds nothing since needs
    /// only the look of `before_wait`.
    granted_at: u64,
    /// The last [`Connection::step`] marked the pool asleep (for an external wait): the next
    /// call takes the mark back, so that handles dropped while we are awake do not write to
    /// the wake-up socket.
    stepped_asleep: bool,
    /// The last step found nothing to do, so its caller waited (or will) before the next.
    step_quiet: bool,
    /// Steps after a wait that found the completion channel fired (see
    /// [`Connection::wakeups`]).
    step_wakeups: u64,
    /// The credit stall under way, for its events (nothing without the `tracing` feature).
    stall: Stall,
    /// How a session over this connection resumes on a new one, if it may
    /// ([`Config::resume_window`]).
    pub(crate) resume: Option<Box<crate::resume::Resume<Connection>>>,
}

impl AsFd for Connection {
    /// The connection's epoll set (completion channel, wake-up socket, asynchronous events,
    /// bootstrap stream): readable whenever [`Connection::step`] has something to do.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.waiter.channel().watch.as_fd()
    }
}

/// Longest busy-poll before a polling connection looks at its bootstrap stream again.
const POLL_SLICE: Duration = Duration::from_millis(10);

/// While a failed queue pair's requests are flushed back, the longest a blocking wait sleeps
/// and an event loop waits ([`Connection::next_timeout`]) before they are polled again: a
/// flush is an error completion, and some providers fire no solicited-only arm for it.
const DRAIN_POLL: Duration = Duration::from_millis(1);

/// Shortest interval between liveness checks of a busy connection.
const LIVENESS_EVERY: Duration = Duration::from_millis(1);

impl Connection {
    /// Builds the connection once its handshake is done (see the `bootstrap` and `handshake`
    /// modules): `setup`'s queue pair is in RTS towards `peer`, its receives posted and its
    /// send buffers registered; `stream` is the bootstrap stream, non-blocking.
    pub(crate) fn establish(
        endpoint: &Endpoint,
        setup: Setup,
        control: Control,
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
        if let Control::Tcp(stream) = &control {
            stream
                .set_nonblocking(true)
                .map_err(bootstrap_err("making the stream non-blocking"))?;
            if let Some(limit) = config.keepalive {
                socket2::SockRef::from(stream)
                    .set_tcp_keepalive(&keepalive_probes(limit))
                    .map_err(bootstrap_err("enabling TCP keepalive"))?;
            }
        }
        let probe = control.probe_interval(config.keepalive);
        let wake = pool.wake_handle().map_err(Error::WakePipe)?;
        channel.set_nonblocking(true)?;
        let mut waiter = Waiter::new(
            ConnChannel::new(channel, wake, control, endpoint.clone())?,
            config.policy,
        );
        let recv_key = waiter.add(recv_cq, config.recv_arm);
        let send_key = waiter.add(send_cq, ArmMode::SolicitedOnly);
        let max_inline = qp.caps().max_inline_data.min(config.max_inline) as usize;
        let mailbox = Mailbox::new(Some(pool.waker().map_err(Error::WakePipe)?));
        endpoint.register_async(
            Some(qp.qp_num()),
            vec![
                waiter.cq(recv_key)?.as_raw() as usize,
                waiter.cq(send_key)?.as_raw() as usize,
            ],
            &mailbox,
        );
        let books = Credits::new(
            config.recv_depth,
            config.grant_slots,
            peer.recv_depth + extra_credits(config),
            peer.grant_slots,
            peer.initial_credits + extra_credits(config),
        );
        let mut core = Core::new(books, config.signal_every, config.close_timeout);
        let now = Instant::now();
        if let Some(every) = probe {
            core.probe_every(every, now);
        }
        Ok(Self {
            endpoint: endpoint.clone(),
            core,
            sq_depth: qp.caps().max_send_wr.min(config.send_depth) as usize,
            sq_reserve: 0,
            qp,
            waiter,
            recv_key,
            send_key,
            pool,
            send: SendBuffers::new(send_bufs, max_inline),
            ready: VecDeque::new(),
            reads_done: VecDeque::new(),
            read_scratch: Vec::new(),
            completions: Vec::new(),
            config: config.clone(),
            peer,
            mailbox,
            #[cfg(feature = "test-hooks")]
            fault: None,
            bootstrap_checked: now,
            clock: TurnClock::default(),
            busy_steps: 0,
            handled: 0,
            granted_at: 0,
            stepped_asleep: false,
            step_quiet: false,
            step_wakeups: 0,
            stall: Stall::default(),
            resume: None,
        })
    }

    /// Registers `n` send buffers of the peer's receive-buffer size and makes them the
    /// connection's: a keyed CM listener registers them only once its client proved the key.
    pub(crate) fn add_send_buffers(&mut self, n: u32) -> Result<()> {
        let size = self.peer.buf_size as usize;
        let bufs = self
            .endpoint
            .pd()
            .register(n as usize * size, rdmsg_verbs::Access::LOCAL_WRITE)?
            .chunks(size)?;
        self.send.free.extend(bufs);
        Ok(())
    }

    /// Grants the peer remote read through the queue pair (RTS → RTS): a keyed CM listener
    /// made it without any remote access, for a client that had yet to prove the key.
    pub(crate) fn allow_remote_read(&mut self) -> Result<()> {
        self.qp.allow_remote_read()?;
        Ok(())
    }

    /// Liveness probes (over rdma_cm) only from `from` on: a keyed CM client's first, so that
    /// it never reaches a listener's queue pair before the listener took the client's proof
    /// and granted remote read (a probe is a read).
    pub(crate) fn probes_from(&mut self, from: Instant) {
        self.core.probes_from(from);
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
        self.core.stats()
    }

    /// Wake-up statistics of this connection's waits.
    pub fn wait_stats(&self) -> rdmsg_notify::Stats {
        self.waiter.stats()
    }

    /// Times the connection was woken by its completion channel: its own waits (a receive, a
    /// send waiting for a credit) that slept until an event came (`wait_stats().wakeups`),
    /// and [`Connection::step`]s after an external wait that found an event (an event loop's
    /// wake-ups).
    #[inline]
    pub fn wakeups(&self) -> u64 {
        self.waiter.stats().wakeups + self.step_wakeups
    }

    /// Counts of the receive pool's buffers.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats(self.qp.recv_outstanding())
    }

    /// Data messages we may send right now without waiting.
    pub fn credits(&self) -> u32 {
        self.core.credits().available()
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
        self.core.failure()
    }

    /// A word for the layer above that every credit grant of ours carries from now on (4
    /// bytes inline; nothing with `max_inline` below 4): news for the peer that costs no
    /// message of its own, since a receiver sends grants anyway. rdmsg's typed layer puts its
    /// delivery record there.
    pub fn set_note(&mut self, note: u32) {
        self.core.set_note(note);
    }

    /// The word the peer's latest grant carried ([`Connection::set_note`]), if one came.
    pub fn peer_note(&self) -> Option<u32> {
        self.core.peer_note()
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
        let fill = send::copy_of(data, self.max_message())?;
        send::in_time(self.send_with(solicited, timeout, fill))
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
        let Some(payload) = self.send.fill(self.max_message(), usize::MAX, fill)? else {
            return Ok(false);
        };
        let inline = matches!(payload, Payload::Inline(_));
        drive::send_data(self, solicited, inline, payload)?;
        Ok(true)
    }

    /// What is free for a send now.
    fn room(&self) -> Room {
        Room {
            sq: self
                .sq_depth
                .saturating_sub(self.qp.send_outstanding() + self.sq_reserve),
            buffers: self.send.free.len(),
            cq: usize::MAX,
            unsignaled: crate::core::unsignaled_in_queue(self.sq_depth),
        }
    }

    fn post(&mut self, payload: Payload, post: Post) -> Result<()> {
        #[cfg(feature = "test-hooks")]
        if self.fault == Some(Fault::Post) {
            if let Payload::Buffer(buf, _) = payload {
                self.send.free.push(buf);
            }
            let e = injected_fault(Fault::Post, self.qp.qp_num());
            return Err(self.local_failure("posting a send (ibv_post_send)", e));
        }
        send::post(&mut self.qp, &mut self.send, &mut self.core, payload, post)
            .map_err(|e| self.local_failure("posting a send (ibv_post_send)", e.into()))
    }

    fn can_send(&self) -> bool {
        self.core.may_send(self.room())
    }

    fn wait_to_send(&mut self, timeout: Option<Duration>) -> Result<()> {
        // A streaming sender need not poll before every message: credits, send completions and
        // failures are looked at every few sends, and at once when anything runs low. Buffers
        // that came back are re-posted (the peer may be waiting for their credits), which
        // needs no poll.
        if self.core.poll_before_send(self.room()) {
            self.poll_now()?;
            // Polling may have found a failure: nothing is posted after it.
            self.check_can_send()?;
        } else if self.pool.has_returns() {
            self.repost_and_grant()?;
        }
        if self.can_send() {
            if self.core.send_waits(false) {
                self.stall.ended(self.qp.qp_num(), None);
            }
            return Ok(());
        }
        if self.core.send_waited() {
            self.stall.began(self.qp.qp_num(), None);
        }
        // A timeout too long to add to the clock is no deadline at all.
        // A new turn: the wait's deadline, and whatever the waits below look at, from now.
        self.clock.new_turn();
        let deadline = timeout.and_then(|t| self.clock.now().checked_add(t));
        // While blocked, any grant (not only a solicited one) and any send completion must
        // wake us.
        self.arm(drive::arm_modes(
            true,
            self.config.recv_arm,
            self.core.send_arm(),
        ))?;
        let res = loop {
            if let Err(e) = self.check_can_send() {
                break Err(e);
            }
            if self.can_send() {
                break Ok(());
            }
            let left = deadline.map(|d| d.saturating_duration_since(self.clock.now()));
            if left == Some(Duration::ZERO) {
                self.core.send_waits(true);
                break Err(Error::timeout(
                    "sending",
                    crate::error::WAIT_SEND,
                    timeout.unwrap_or_default(),
                ));
            }
            if let Err(e) = self.wait_once(left) {
                break Err(e);
            }
        };
        if res.is_ok() && self.core.send_waits(false) {
            self.stall.ended(self.qp.qp_num(), None);
        }
        // A blocking caller that gave up retries through this wait, which arms anew: its
        // sleeps in between need no wake-up for every completion.
        self.arm(drive::arm_modes(
            false,
            self.config.recv_arm,
            self.core.send_arm(),
        ))?;
        res
    }

    /// Arms the receive and send CQs as `modes` say.
    fn arm(&mut self, (recv, send): (ArmMode, ArmMode)) -> Result<()> {
        self.waiter.set_mode(self.recv_key, recv)?;
        self.waiter.set_mode(self.send_key, send)?;
        Ok(())
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
        take: impl FnMut(&mut Self) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        // A timeout too long to add to the clock is no deadline at all.
        // A new turn: the wait's deadline, and whatever the waits below look at, from now.
        self.clock.new_turn();
        let deadline = timeout.and_then(|t| self.clock.now().checked_add(t));
        self.wait_loop(deadline, take)
    }

    /// Takes what `take` finds, waiting until `deadline` (`None`: forever); each wait begins
    /// at its turn's time and the next turn at the wait's end.
    fn wait_loop<T>(
        &mut self,
        deadline: Option<Instant>,
        mut take: impl FnMut(&mut Self) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        loop {
            if let Some(got) = take(self)? {
                return Ok(Some(got));
            }
            let left = deadline.map(|d| d.saturating_duration_since(self.clock.now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            self.wait_once(left)?;
        }
    }

    /// Returns a message that has already arrived, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Received>> {
        if self.ready.is_empty() {
            let polled = self.poll_now();
            if self.ready.is_empty() {
                polled?;
                self.check_failed()?;
                return Ok(None);
            }
        }
        let m = self.ready.pop_front();
        if self.ready.is_empty() && self.pool.has_returns() {
            // Return the buffers of earlier messages promptly (the poll above re-posted and
            // granted what it could; only buffers dropped since change that).
            let _ = self.repost_and_grant();
        }
        Ok(m)
    }

    /// The non-blocking step, for event loops and async runtimes that wait on the connection's
    /// descriptor ([`AsFd`]) instead of in [`Connection::recv`]: re-posts returned buffers and
    /// sends a due grant, reads the completion channel, re-arms both queues (for any
    /// completion while a bounded send found no credit or send slot, else as configured),
    /// polls them, looks at the bootstrap stream and the device's asynchronous events, fires
    /// the deadlines that passed, and marks the connection asleep, so that a [`Received`]
    /// dropped from now on makes the descriptor readable (its credit must go back to the
    /// peer).
    ///
    /// Take what it queued ([`Connection::try_recv`]) before waiting. Once that finds
    /// nothing, waiting until the descriptor is readable, or [`Connection::next_timeout`] has
    /// passed, misses nothing: every completion after the arm raises an event. Returns
    /// whether it handled anything (completions or returned buffers): if so, step again
    /// before waiting (what it queued for receiving is [`Connection::has_ready`]).
    ///
    /// It never sleeps, so that it may run on an async runtime's threads: after a failure,
    /// it takes the flushes of the queue pair that are back and returns; the descriptor and
    /// [`Connection::next_timeout`] (at most 1 ms meanwhile) bring the caller back for the
    /// rest, and [`Connection::try_recv`] reports the failure once they are all in (or the
    /// 500 ms the wait for them is given ran out).
    pub fn step(&mut self) -> Result<bool> {
        self.clock.new_turn();
        // Whether the caller waited since our last step: only then is there a wake-up to
        // explain.
        let after_wait = std::mem::take(&mut self.step_quiet);
        self.wake_from_step();
        let returned = self.pool.collect_returns() > 0;
        self.repost_and_grant()?;
        let before = self.handled;
        let events = self.waiter.stats().events;
        // While the flushes of a failure drain, the channel is read and the queues armed and
        // polled as before: a flush wakes the event loop, which steps again.
        let draining = self.draining();
        if self.core.failure().is_none() || draining {
            let (recv_mode, send_mode) = drive::arm_modes(
                drive::wakes_for_any(&self.core, false, draining),
                self.config.recv_arm,
                self.core.send_arm(),
            );
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
            match polled {
                Err(_) if draining => {
                    // Nothing can be polled any more: the flushes will not be seen.
                    self.core.stop_draining();
                }
                Err(e) => {
                    return Err(self.local_failure("stepping the completion queues", e.into()))
                }
                Ok(_) => {}
            }
        }
        // A completion event explains the wake-up (and a step that follows another without a
        // wait has none to explain): the other descriptors (wake-up socket, bootstrap stream,
        // asynchronous events) are then looked at only now and then, as a busy connection
        // does, and at the latest by the health check's step. Otherwise something else made
        // the descriptor readable: look at all of them.
        let fired = self.waiter.stats().events != events;
        self.step_wakeups += u64::from(after_wait && fired);
        let explained = !after_wait || fired;
        let liveness = !explained || self.liveness_due();
        if liveness {
            // The liveness check reads (and routes) the device's asynchronous events too.
            self.pool.awake(true);
        }
        self.after_poll(liveness)?;
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
    pub fn nobody_waits(&mut self) {
        self.wake_from_step();
    }

    /// Longest an event loop may wait on the descriptor before calling
    /// [`Connection::step`]: the health check, which finds errors a provider did not signal,
    /// or a deadline of the protocol (a close, a peer's close message after its goodbye).
    pub fn next_timeout(&self) -> Option<Duration> {
        // Asked between turns: however long ago the last one was, the answer is from now.
        self.clock.new_turn();
        earliest(self.config.health_check, self.time_to_next())
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
        self.core.wants_any_completion()
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

    /// Exposes `pieces` to RDMA reads by this connection's peer alone: each is registered and
    /// a memory window of type 2 bound over it on this connection's queue pair, so that its
    /// key ([`Exposed::rkey`]) reads nothing on any other connection, even one of the same
    /// endpoint (a hub's peers share one protection domain). Waits, as a send does (at most
    /// `timeout`), for a credit and for send slots for the binds and one more message (the
    /// descriptor that names them goes next without waiting). On a device without memory
    /// windows the keys are the regions' own ([`Endpoint::expose`]). Keep the exposures at
    /// least until a message sent after them completes.
    pub fn expose_to_peer(
        &mut self,
        pieces: Vec<rdmsg_verbs::Bytes>,
        timeout: Option<Duration>,
    ) -> Result<Vec<Exposed>> {
        drive::expose(self, pieces, timeout)
    }

    /// The most pieces [`Connection::expose_to_peer`] binds at once (its send queue, less
    /// the message that names them).
    pub fn max_exposures(&self) -> usize {
        crate::core::max_in_one_go(self.sq_depth)
            .saturating_sub(1)
            .max(1)
    }

    /// Registers `len` bytes that reads may land in (see [`Endpoint::register`]).
    pub fn register(&self, len: usize) -> Result<Buffer> {
        self.endpoint.register(len)
    }

    /// Posts RDMA reads of the peer's memory into `into` (see
    /// [`rdmsg_verbs::QueuePair::post_read`]): no credit is spent, but each segment takes a
    /// send queue slot until the read completes. [`ReadPost::Busy`] (the buffer back) if the
    /// slots are not free now; [`Error::ReadTooLarge`] if there never are that many. The
    /// read's end comes out of [`Connection::try_recv_any`] as [`Arrival::Read`]. A bad key
    /// or address is the peer's doing: the read completes in error and the connection fails
    /// ([`Failure::Completion`]); the peer's side sees a remote access error.
    pub fn post_read(&mut self, into: Buffer, segments: &[ReadSegment]) -> Result<ReadPost> {
        self.check_can_send()?;
        let need = segments.len();
        self.core.read_fits(need, self.sq_depth)?;
        if self.room().sq < need {
            self.poll_now()?;
            self.check_can_send()?;
            if self.room().sq < need {
                return Ok(ReadPost::Busy(into));
            }
        }
        match self.qp.post_read(into, segments) {
            Ok(id) => {
                self.core.posted_read(id);
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
            let polled = self.poll_now();
            if self.ready.is_empty() && self.reads_done.is_empty() {
                polled?;
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

    /// [`Connection::recv_any_timeout`] that also returns `Ok(None)` once `interrupted` holds
    /// (looked at before each wait and after each wake-up): for a thread that sleeps here
    /// while other threads hand it work, waking it with a [`Waker`].
    pub fn recv_any_interruptible(
        &mut self,
        timeout: Option<Duration>,
        interrupted: impl Fn(&Connection) -> bool,
    ) -> Result<Option<Arrival>> {
        let got = self.wait_for(timeout, |c| c.try_recv_unless(&interrupted))?;
        Ok(got.flatten())
    }

    /// [`Connection::recv_any_interruptible`] until `deadline` (`None`: forever), `now` being
    /// the caller's time, which begins the connection's turn: one deadline serves the layer
    /// above and the connection, and the connection derives none of its own. `now` must be a
    /// fresh reading (a wait counted from it is longer by its age). After a wait that slept,
    /// [`Connection::turn_now`] is the time it woke.
    pub fn recv_any_interruptible_until(
        &mut self,
        deadline: Option<Instant>,
        now: Instant,
        interrupted: impl Fn(&Connection) -> bool,
    ) -> Result<Option<Arrival>> {
        self.clock.new_turn_at(now);
        let got = self.wait_loop(deadline, |c| c.try_recv_unless(&interrupted))?;
        Ok(got.flatten())
    }

    /// The time of the connection's current turn: as read when its last wait woke (or its
    /// last call or poll began), read now only if nothing in the turn needed it yet.
    /// Meaningful right after a wait; between calls it may be as old as the last one.
    pub fn turn_now(&self) -> Instant {
        self.clock.now()
    }

    /// `Some(None)` if `interrupted` holds, else what [`Connection::try_recv_any`] finds.
    fn try_recv_unless(
        &mut self,
        interrupted: &impl Fn(&Connection) -> bool,
    ) -> Result<Option<Option<Arrival>>> {
        if interrupted(self) {
            return Ok(Some(None));
        }
        Ok(self.try_recv_any()?.map(Some))
    }

    /// How a session over this connection resumes on a new one after it is lost, if both
    /// sides set [`Config::resume_window`] (the first connection of a session only; a
    /// successor has none: its session keeps the first's). Taken once, by the typed layer.
    pub fn take_resume(&mut self) -> Option<crate::resume::Resume<Connection>> {
        self.resume.take().map(|r| *r)
    }

    /// A handle that makes the connection's descriptor readable (and ends its blocking
    /// waits), from any thread: for threads sharing the connection, one of which sleeps on
    /// it while another changed what it waits for.
    pub fn waker(&self) -> Result<Waker> {
        Ok(Waker::new(self.pool.waker().map_err(Error::WakePipe)?))
    }

    /// An iterator of received messages that ends when the connection fails or closes.
    pub fn incoming(&mut self) -> impl Iterator<Item = Received> + '_ {
        std::iter::from_fn(move || self.recv().ok())
    }

    /// Closes gracefully: sends a close message after everything sent so far and waits (up to
    /// `close_timeout`) until it is delivered, then writes [`GOODBYE`](crate::handshake::GOODBYE) on the bootstrap stream
    /// and shuts it down. The peer receives everything, then [`Failure::PeerClosed`]. A peer
    /// that went without closing (its bootstrap stream ended) never acknowledges the message:
    /// the close fails with [`Failure::PeerVanished`], at once if that is known, else 50 ms
    /// after the stream's end, as a receive would.
    pub fn close(self) -> Result<()> {
        let deadline = self.core.close_deadline(self.begin_turn());
        self.close_by(deadline)
    }

    /// [`Connection::close`] that ends by `deadline` rather than `close_timeout` from now:
    /// for a layer above whose close began earlier and waited for other things first (its
    /// peer's reads, its own queued messages), so that the whole close lasts one
    /// `close_timeout`. Waiting for a credit for the close message and then for its
    /// acknowledgement both spend what is left; a deadline already passed still sends the
    /// close if a credit is there, and takes its acknowledgement if the next poll finds it.
    /// Without a credit by then it fails with [`Error::Timeout`] (of `close_timeout`).
    pub fn close_by(mut self, deadline: Instant) -> Result<()> {
        let _span = trace_span!(INFO, "close", qp = self.qp.qp_num());
        self.check_can_send()?;
        let timeout = self.config.close_timeout;
        let left = deadline.saturating_duration_since(self.begin_turn());
        self.wait_to_send(Some(left)).map_err(|e| match e {
            Error::Timeout(_) => {
                Error::timeout("closing", crate::error::WAIT_CLOSE_CREDIT, timeout)
            }
            e => e,
        })?;
        let now = self.clock.now();
        let started = drive::start_close(&mut self, deadline, now)?;
        assert!(started, "wait_to_send ensured a credit");
        self.waiter.set_mode(self.send_key, ArmMode::Next)?;
        loop {
            if let Some(ended) = self.core.close_result(timeout) {
                return ended;
            }
            self.wait_once(self.time_to_next())?;
        }
    }
}
