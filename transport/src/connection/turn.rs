//! The private half of the connection driver: polling and waiting, handing completions and
//! the bootstrap stream to the core, doing its actions, re-posting and granting.

use std::time::{Duration, Instant};

use rdmsg_notify::{CqKey, Policy};
use rdmsg_verbs::WorkCompletion;

use super::{Connection, DRAIN_POLL, LIVENESS_EVERY, POLL_SLICE};
#[cfg(feature = "test-hooks")]
use crate::config::{injected_fault, Fault};
use crate::control::Control;
use crate::core::{earliest, Completion};
use crate::device_events::{self, Mailbox};
use crate::drive;
use crate::endpoint::Endpoint;
use crate::error::{errno_of, Error, Failure, Result};
use crate::read;

impl Connection {
    /// A call from the application begins a turn: its time, read now.
    pub(super) fn begin_turn(&self) -> Instant {
        self.clock.new_turn();
        self.clock.now()
    }

    /// The failure, once every message that arrived before it has been delivered: those
    /// queued, and those still to be found among the flushes of the queue pair (so not
    /// while they drain).
    pub(super) fn check_failed(&self) -> Result<()> {
        match self.core.failure() {
            Some(f) if self.ready.is_empty() && !self.draining() => Err(f.into()),
            _ => Ok(()),
        }
    }

    /// Whether the connection failed and its queue pair's requests are being flushed back:
    /// until they are (or the drain deadline passes), a step takes those that came and
    /// returns, and a blocking call sleeps on the channel for the rest (see
    /// [`Connection::take_flushes`]). A lingering queue pair is not failed yet: nothing
    /// flushes.
    pub(super) fn draining(&self) -> bool {
        self.core.failure().is_some() && !self.core.lingering() && !self.core.is_drained()
    }

    /// The failure, at once: nothing is sent after it.
    pub(super) fn check_can_send(&self) -> Result<()> {
        Ok(self.core.check_send()?)
    }

    /// Sleeps (per the policy) until something happens, then processes it.
    /// Messages already queued do not stop the wait: a receiver takes them before calling
    /// this, and a sender blocked on credits must sleep (or poll) for its grant whatever it
    /// holds undelivered.
    pub(super) fn wait_once(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.before_wait()?;
        if self.core.failure().is_some() {
            if self.draining() {
                self.wait_for_flushes(timeout);
            }
            return Ok(());
        }
        if !self.pool.going_to_sleep() {
            return self.poll_now();
        }
        // A polling wait watches no descriptor: bound it so that liveness is checked. A
        // sleeping one wakes at least every `health_check` to poll for errors the provider
        // did not signal, and at the protocol's next deadline.
        let slice = match self.config.policy {
            Policy::Poll => Some(POLL_SLICE),
            _ => self.config.health_check,
        };
        let due = self.time_to_next();
        let timeout = earliest(earliest(timeout, slice), due);
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
        self.after_poll(liveness)
    }

    /// How long until the protocol's next deadline, if it has one (the clock is read only
    /// then); while the flushes of a failure drain, at most [`DRAIN_POLL`], so that they are
    /// polled for even where the provider signals no event for them.
    pub(super) fn time_to_next(&self) -> Option<Duration> {
        let due = self
            .core
            .next_timeout()
            .map(|at| at.saturating_duration_since(self.clock.now()));
        if self.draining() {
            earliest(due, Some(DRAIN_POLL))
        } else {
            due
        }
    }

    /// Polls both queues without sleeping and does the bookkeeping.
    pub(super) fn poll_now(&mut self) -> Result<()> {
        self.poll_and_handle()?;
        let liveness = self.liveness_due();
        self.after_poll(liveness)
    }

    /// Whether a busy connection should look at its bootstrap stream and async events: a read
    /// syscall or two per message would be costly, so at most every millisecond, and the
    /// clock itself only every 16th step.
    pub(super) fn liveness_due(&mut self) -> bool {
        self.busy_steps = self.busy_steps.wrapping_add(1);
        self.busy_steps % 16 == 0
            && self.clock.now().duration_since(self.bootstrap_checked) >= LIVENESS_EVERY
    }

    /// The waiter's wait, or the injected fault of a test.
    pub(super) fn wait_for_completions(
        &mut self,
        timeout: Option<Duration>,
        got: &mut Vec<(CqKey, WorkCompletion)>,
    ) -> Result<usize> {
        self.injected_poll_fault()?;
        // Counted from this turn's time if the turn has read it (the caller's `timeout` counts
        // from it too); else the waiter reads the clock only if it has to sleep.
        let mut push = |key, wc: &WorkCompletion| got.push((key, wc.clone()));
        let waited = match self.clock.read() {
            Some(now) => {
                let deadline = timeout.map(|t| rdmsg_verbs::deadline_after(now, t));
                self.waiter.wait_until(deadline, now, &mut push)
            }
            None => self.waiter.wait(timeout, &mut push),
        };
        self.clock.after_wait(self.waiter.woke_at());
        Ok(waited?)
    }

    /// After completions were handled: optionally looks for a vanished peer and asynchronous
    /// events, fires the deadlines that passed, waits for the flushes of a failure, then
    /// re-posts and grants.
    pub(super) fn after_poll(&mut self, liveness: bool) -> Result<()> {
        if liveness {
            self.check_bootstrap();
            self.check_async_events();
        }
        let timers =
            self.core.has_urgent_timer() || (liveness && self.core.next_timeout().is_some());
        if timers {
            let now = self.clock.now();
            drive::fire_timers(self, now);
        }
        // A lingering queue pair (the peer's close came before its goodbye) is not failed
        // yet: nothing flushes.
        if self.draining() {
            self.take_flushes();
        }
        // A poll that found nothing (no completion since the last re-post and grant, no
        // deadline, no look at the stream) changed nothing they depend on but what
        // `before_wait` looks at.
        if liveness || timers || self.handled != self.granted_at || self.core.failure().is_some() {
            self.repost_and_grant()
        } else {
            self.before_wait()
        }
    }

    /// Turns the error of a verb the connection drives into the sticky failure it stands for
    /// (a queue that cannot be polled, armed or posted to now will not work later either), and
    /// hands the error back for this call to report.
    pub(super) fn local_failure(&mut self, op: &'static str, e: Error) -> Error {
        if let Some(known) = self.core.failure() {
            // Reported once; from then on the connection's failure says it.
            return known.into();
        }
        let errno = errno_of(&e);
        self.fail(Failure::Local { op, errno });
        e
    }

    /// Records a failure and takes the flushes it caused that are already back (the rest
    /// drain as the connection is driven).
    pub(super) fn fail(&mut self, f: Failure) {
        drive::fail(self, f);
        self.take_flushes();
    }

    /// Takes the flushes of a failed queue pair that are back, without waiting: the drain
    /// is a state of the core with a deadline ([`crate::core::Core::flushing_since`]), not a
    /// wait, so that a [`Connection::step`] on an async runtime's thread never sleeps. It is
    /// over once every posted receive came back (so every receive buffer is in its pool;
    /// successful receives found among them are delivered, before the failure is reported)
    /// or the deadline passed. (Sends are not waited for: unsignaled sends that had already
    /// succeeded never complete again; their buffers go with the queue pair.)
    pub(super) fn take_flushes(&mut self) {
        loop {
            let now = self.clock.now();
            if drive::drained(self, now) {
                return;
            }
            match self.poll_and_handle() {
                Ok(0) => break,
                Ok(_) => {}
                Err(_) => {
                    self.core.stop_draining();
                    return;
                }
            }
        }
        let now = self.clock.now();
        drive::fire_timers(self, now);
    }

    /// For the blocking calls while the flushes drain: sleeps on the completion channel (the
    /// queues are armed for any completion) until a flush comes, `timeout`, the drain
    /// deadline or [`DRAIN_POLL`] passes, then takes what came.
    fn wait_for_flushes(&mut self, timeout: Option<Duration>) {
        let timeout = earliest(timeout, self.time_to_next());
        let mut got = std::mem::take(&mut self.completions);
        let waited = self.wait_for_completions(timeout, &mut got);
        self.completions = got;
        self.handle_completions();
        if waited.is_err() {
            // Nothing can be polled any more: the flushes will not be seen.
            self.core.stop_draining();
        }
        self.take_flushes();
    }

    /// Polls both queues until empty and handles what they held; returns how many.
    pub(super) fn poll_and_handle(&mut self) -> Result<usize> {
        let mut got = std::mem::take(&mut self.completions);
        let polled = self.poll_completions(&mut got);
        self.completions = got;
        self.handle_completions();
        polled.map_err(|e| self.local_failure("polling the completion queues", e))
    }

    /// The waiter's poll, or the injected fault of a test.
    pub(super) fn poll_completions(
        &mut self,
        got: &mut Vec<(CqKey, WorkCompletion)>,
    ) -> Result<usize> {
        self.injected_poll_fault()?;
        self.clock.new_turn();
        Ok(self
            .waiter
            .poll_all(&mut |key, wc| got.push((key, wc.clone())))?)
    }

    /// Receives a test says will never come back flushed ([`Fault::LostFlush`], feature
    /// `test-hooks`).
    pub(super) fn lost_flushes(&self) -> usize {
        #[cfg(feature = "test-hooks")]
        if self.fault == Some(Fault::LostFlush) {
            return 1;
        }
        0
    }

    /// The error of a test's injected poll fault, if one is set (feature `test-hooks`).
    fn injected_poll_fault(&self) -> Result<()> {
        #[cfg(feature = "test-hooks")]
        if self.fault == Some(Fault::Poll) {
            return Err(injected_fault(Fault::Poll, self.qp.qp_num()));
        }
        Ok(())
    }

    /// Hands polled completions to the core in the order polled: whatever arrived before a
    /// failure is delivered before the failure is reported.
    pub(super) fn handle_completions(&mut self) {
        let mut got = std::mem::take(&mut self.completions);
        if got.is_empty() {
            self.completions = got;
            return;
        }
        self.handled += got.len() as u64;
        let recv_key = self.recv_key;
        self.core.begin_batch(
            got.iter()
                .map(|(key, wc)| Completion::of(*key == recv_key, wc)),
        );
        for (key, wc) in got.drain(..) {
            let c = Completion::of(key == recv_key, &wc);
            if c.recv {
                self.on_recv(&c, &wc);
            } else {
                let mut reads = std::mem::take(&mut self.read_scratch);
                self.qp
                    .complete_send_split(&wc, &mut self.send.free, &mut reads);
                self.reads_done.extend(read::finished(&wc, reads.drain(..)));
                self.read_scratch = reads;
                self.core.handle_send(&c, wc.wr_id());
            }
        }
        self.completions = got;
        drive::run_commands(self);
    }

    pub(super) fn on_recv(&mut self, c: &Completion, wc: &WorkCompletion) {
        if let Some(buf) = self.qp.take_recv(wc) {
            drive::on_recv(self, c, buf, wc.byte_len());
        }
    }

    /// What must be done before sleeping: everything [`Connection::repost_and_grant`] does.
    /// It already ran after the last completions were handled, and only two things change its
    /// outcome without a completion: buffers the application dropped since (their credits may
    /// be what the peer waits for), and sends posted since (a signaled one must wake us, so
    /// the send queue's arming follows it). So the full call runs only if buffers came back.
    pub(super) fn before_wait(&mut self) -> Result<()> {
        if self.pool.has_returns() {
            return self.repost_and_grant();
        }
        if self.core.failure().is_none() {
            self.sync_send_arm()?;
        }
        Ok(())
    }

    /// Arms the send queue as the core says ([`Core::send_arm`](crate::core::Core::send_arm)).
    fn sync_send_arm(&mut self) -> Result<()> {
        let mode = self.core.send_arm();
        if self.waiter.mode(self.send_key)? != mode {
            self.waiter.set_mode(self.send_key, mode)?;
        }
        Ok(())
    }

    /// Re-posts free buffers and sends a credit grant when the core says so, and re-arms the
    /// send queue as it says.
    pub(super) fn repost_and_grant(&mut self) -> Result<()> {
        self.granted_at = self.handled;
        self.pool.collect_returns();
        if self.core.failure().is_some() {
            return Ok(());
        }
        if self.core.refill_due(self.pool.free_count()) {
            let bufs = self.pool.take_free();
            let n = bufs.len();
            if let Err(e) = self.qp.post_recv(bufs) {
                for b in e.unposted {
                    self.pool.put_back(b);
                }
                self.core.reposted(e.posted as u32);
                return Err(
                    self.local_failure("re-posting receives (ibv_post_recv)", e.error.into())
                );
            }
            self.core.reposted(n as u32);
        }
        let room = self.room();
        drive::grant(self, room)?;
        self.sync_send_arm()
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

    /// A second handle on the bootstrap TCP stream (none over rdma_cm), for a resume to cut.
    pub(crate) fn bootstrap_handle(&self) -> Option<std::net::TcpStream> {
        match &self.waiter.channel().bootstrap {
            Control::Tcp(stream) => stream.try_clone().ok(),
            Control::Cm(_) => None,
        }
    }

    /// Test hook: cuts the bootstrap stream (both ways), as a network that lost it would: each
    /// side then sees its peer vanish, while the queue pairs still work.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn sever_bootstrap(&self) {
        if let Control::Tcp(stream) = &self.waiter.channel().bootstrap {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Test hook: the raw queue pair, for a test that moves it to the error state from another
    /// thread while the connection sleeps. Valid while the connection lives.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn raw_queue_pair(&self) -> *mut rdmsg_verbs::ffi::ibv_qp {
        self.qp.as_raw()
    }

    /// Looks at the bootstrap stream, where after the handshake only a [`GOODBYE`](crate::handshake::GOODBYE) may come,
    /// and tells the core (see [`crate::core::StreamNews`]).
    pub(super) fn check_bootstrap(&mut self) {
        let now = self.clock.now();
        self.bootstrap_checked = now;
        let ch = self.waiter.channel_mut();
        if !ch.watch_bootstrap {
            return;
        }
        let news = ch.bootstrap.news();
        drive::on_stream(self, news, now);
    }

    /// Fails the connection if an asynchronous event says it is broken: a fatal, request or
    /// access error of our queue pair, an overrun of one of our CQs, a fatal device error, or
    /// an error of our port.
    pub(super) fn check_async_events(&mut self) {
        match async_failure_of(&self.endpoint, &self.mailbox) {
            Ok(Some(f)) => self.fail(f),
            Ok(None) => {}
            Err(e) => {
                // The descriptor can no longer be read: nothing would tell us of device faults.
                let _ = self.local_failure("reading asynchronous events", e);
            }
        }
    }
}

/// Routes the device's pending asynchronous events and returns the failure the first fatal
/// one in `mailbox` stands for: a fatal, request or access error of the queue pair, an
/// overrun of a CQ, a fatal device error, or an error of the port.
pub(super) fn async_failure_of(endpoint: &Endpoint, mailbox: &Mailbox) -> Result<Option<Failure>> {
    endpoint.route_async_events()?;
    Ok(mailbox
        .take()
        .into_iter()
        .find_map(|ev| device_events::is_fatal(ev.kind).then_some(Failure::AsyncEvent(ev.kind))))
}

impl crate::resume::Resume<Connection> {
    /// `conn` is the session's connection now: if a new one comes before this side saw it
    /// fail (the peer resumed first), its bootstrap stream is cut, so that it fails as a lost
    /// connection does and the session takes the new one.
    pub fn watch(&self, conn: &Connection) {
        self.watch_stream(conn.bootstrap_handle());
    }
}
