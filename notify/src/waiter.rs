//! The waiter: arm, sleep, drain, re-arm, poll, without stranding a completion.

use std::time::{Duration, Instant};

use crate::source::{ArmMode, CompletionSource, EventChannel, EventTarget, Readiness};
use crate::stats::Stats;
use crate::{Error, Result};

/// How [`Waiter::wait`] waits when nothing is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Arm and sleep on the channel at once. Lowest CPU, one wake-up latency per sleep.
    Sleep,
    /// Never arm; poll until something arrives or the timeout passes. Lowest latency, a whole
    /// core.
    Poll,
    /// Poll for up to `spin` or `max_empty_polls` empty polls, whichever ends first, then arm and
    /// sleep. rsockets spins about 10 µs.
    Hybrid {
        /// Longest spin before sleeping.
        spin: Duration,
        /// Most empty polls before sleeping.
        max_empty_polls: u32,
    },
    /// Spin when recent waits were short, else sleep at once, without tuning per rate: the
    /// spin lasts twice the longest but one of the last [`RECENT_GAPS`] waits that ended
    /// without a sleep (the time from a wait's start to its first completion), if that is at
    /// most `max_spin`; otherwise the waiter sleeps at once, as [`Policy::Sleep`] does, and only
    /// every [`PROBE_EVERY`]th wait spins `max_spin` to find out whether messages come close
    /// together again. At a high message rate the receiver catches each message spinning
    /// (busy-polling latency, and a spin shorter than a sleep and a wake-up costs less CPU than
    /// they do); at a low rate it spins once in [`PROBE_EVERY`] waits (solicited-only CPU,
    /// nearly). Two spins in four that find nothing turn spinning off until short waits come
    /// again.
    Adaptive {
        /// Longest spin, and the longest gap worth spinning for: about what a sleep and a
        /// wake-up cost (50 µs is a fair default; more under emulation).
        max_spin: Duration,
    },
}

impl Policy {
    /// [`Policy::Adaptive`] with a 50 µs limit.
    pub const ADAPTIVE: Policy = Policy::Adaptive {
        max_spin: Duration::from_micros(50),
    };
}

/// Waits [`Policy::Adaptive`] remembers.
pub const RECENT_GAPS: usize = 4;

/// While spinning is off, [`Policy::Adaptive`] spins on one wait in this many, to see whether
/// messages come close together again.
pub const PROBE_EVERY: u32 = 8;

/// How long recent waits lasted, for [`Policy::Adaptive`].
#[derive(Debug, Clone, Copy, Default)]
struct Gaps {
    /// The last [`RECENT_GAPS`] waits that ended without a sleep, in nanoseconds: 0 for a
    /// completion already queued, the spin's length for one caught spinning, `u64::MAX` for
    /// a spin that found nothing.
    recent: [u64; RECENT_GAPS],
    /// Where the next one goes in `recent`.
    next: usize,
    /// Waits seen so far, up to [`RECENT_GAPS`].
    seen: usize,
    /// Waits that slept at once since the last spin.
    quiet: u32,
}

impl Gaps {
    fn record(&mut self, wait: Duration) {
        self.recent[self.next] = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        self.next = (self.next + 1) % RECENT_GAPS;
        self.seen = (self.seen + 1).min(RECENT_GAPS);
    }

    /// How long to spin before sleeping: twice the longest recent wait but one (one outlier,
    /// a spin that a late message just missed, does not decide), at least a quarter of
    /// `max_spin` (completions that were always queued already say nothing of how long the next
    /// one takes), if that is at most `max_spin`; else nothing (sleep at once).
    fn spin_budget(&self, max_spin: Duration) -> Duration {
        if self.seen < RECENT_GAPS {
            return Duration::ZERO;
        }
        let mut sorted = self.recent;
        sorted.sort_unstable();
        let longest = sorted[RECENT_GAPS - 2];
        // A fruitless spin (the sentinel) turns spinning off whatever `max_spin` is.
        if longest == u64::MAX {
            return Duration::ZERO;
        }
        let longest = Duration::from_nanos(longest);
        if longest > max_spin {
            Duration::ZERO
        } else {
            (longest * 2).clamp(max_spin / 4, max_spin)
        }
    }

    /// The spin of this wait: the budget, or `max_spin` on every [`PROBE_EVERY`]th wait while
    /// the budget is nothing.
    fn spin_now(&mut self, max_spin: Duration) -> Duration {
        let budget = self.spin_budget(max_spin);
        if !budget.is_zero() {
            self.quiet = 0;
            return budget;
        }
        self.quiet += 1;
        if self.quiet >= PROBE_EVERY {
            self.quiet = 0;
            max_spin
        } else {
            Duration::ZERO
        }
    }
}

/// Where a wait's time comes from: a timeout from now ([`Waiter::wait`]), or the caller's
/// deadline and time ([`Waiter::wait_until`]).
#[derive(Clone, Copy)]
enum Start {
    Timeout(Option<Duration>),
    Until(Option<Instant>, Instant),
}

impl Start {
    /// The deadline alone: a timeout reads the clock only if it is bounded.
    #[inline(always)]
    fn deadline(self) -> Option<Instant> {
        match self {
            Start::Timeout(t) => t.map(|t| rdmsg_verbs::deadline_after(Instant::now(), t)),
            Start::Until(deadline, _) => deadline,
        }
    }

    /// The deadline and the time the wait starts at: the caller's, if it gave one.
    #[inline(always)]
    fn given(self) -> (Option<Instant>, Instant) {
        match self {
            Start::Timeout(t) => {
                let now = Instant::now();
                (t.map(|t| rdmsg_verbs::deadline_after(now, t)), now)
            }
            Start::Until(deadline, now) => (deadline, now),
        }
    }

    /// The deadline and the time read now: a spin is timed from its own start, not from the
    /// caller's time, which may be its turn's (the turn's work since is no spin).
    #[inline(always)]
    fn fresh(self) -> (Option<Instant>, Instant) {
        match self {
            Start::Timeout(_) => self.given(),
            Start::Until(deadline, _) => (deadline, Instant::now()),
        }
    }
}

/// Key of a queue added to a [`Waiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqKey(pub usize);

/// A spinning wait looks at the clock once per this many empty polls: reading the clock can
/// cost more than polling (a microsecond or more where the clock source is not the TSC).
const CLOCK_EVERY: u32 = 16;

/// Completions polled per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// Waits on one completion channel serving one or more completion queues.
///
/// See the crate documentation for the loop it runs and why in that order.
#[derive(Debug)]
pub struct Waiter<Q: CompletionSource, C: EventChannel<Q>> {
    channel: C,
    cqs: Vec<Q>,
    slots: Vec<Watched>,
    policy: Policy,
    ack_batch: u32,
    scratch: Vec<Q::Completion>,
    stats: Stats,
    gaps: Gaps,
    /// The clock as read when the last wait's last sleep ended (`None`: it did not sleep).
    woke: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Watched {
    mode: ArmMode,
    armed: bool,
    unacked: u32,
}

impl<Q: CompletionSource, C: EventChannel<Q>> Waiter<Q, C> {
    /// A waiter over `channel`, which must not block in `next_event` (verbs-core: call
    /// `set_nonblocking(true)` first; [`Waiter::new_verbs`] does).
    pub fn new(channel: C, policy: Policy) -> Self {
        Self {
            channel,
            cqs: Vec::new(),
            slots: Vec::new(),
            policy,
            ack_batch: 16,
            scratch: (0..POLL_BATCH).map(|_| Q::Completion::default()).collect(),
            stats: Stats::default(),
            gaps: Gaps::default(),
            woke: None,
        }
    }

    /// Adds a queue reporting to this waiter's channel, armed with `mode` whenever the waiter
    /// sleeps. A receive queue of a solicited-only receiver takes [`ArmMode::SolicitedOnly`];
    /// a send queue takes [`ArmMode::Next`] if its errors must wake the waiter (Soft-RoCE does
    /// not flag send-side error completions as solicited).
    pub fn add(&mut self, cq: Q, mode: ArmMode) -> CqKey {
        self.cqs.push(cq);
        self.slots.push(Watched {
            mode,
            armed: false,
            unacked: 0,
        });
        CqKey(self.cqs.len() - 1)
    }

    /// Changes how the queue behind `key` is armed from now on. Raising
    /// [`ArmMode::SolicitedOnly`] to [`ArmMode::Next`] re-arms at the next step ("next" wins over
    /// "solicited" on a queue armed both ways); lowering it takes effect after the current arm
    /// fires, which costs at most one extra wake-up.
    pub fn set_mode(&mut self, key: CqKey, mode: ArmMode) -> Result<()> {
        let Some(slot) = self.slots.get_mut(key.0) else {
            return Err(Error::UnknownCq(key.0));
        };
        if slot.mode == ArmMode::SolicitedOnly && mode == ArmMode::Next {
            slot.armed = false;
        }
        slot.mode = mode;
        Ok(())
    }

    /// The arming mode of the queue behind `key`.
    pub fn mode(&self, key: CqKey) -> Result<ArmMode> {
        // Matches, not `ok_or`: an error built eagerly is dropped on every call, and these
        // run per message.
        match self.slots.get(key.0) {
            Some(s) => Ok(s.mode),
            None => Err(Error::UnknownCq(key.0)),
        }
    }

    /// Mutable access to the queue behind `key`, for example to poll it directly.
    pub fn cq_mut(&mut self, key: CqKey) -> Result<&mut Q> {
        match self.cqs.get_mut(key.0) {
            Some(cq) => Ok(cq),
            None => Err(Error::UnknownCq(key.0)),
        }
    }

    /// The queue behind `key`.
    pub fn cq(&self, key: CqKey) -> Result<&Q> {
        match self.cqs.get(key.0) {
            Some(cq) => Ok(cq),
            None => Err(Error::UnknownCq(key.0)),
        }
    }

    /// Acknowledge events in batches of `n` (at least 1). `ibv_ack_cq_events` takes a mutex.
    pub fn set_ack_batch(&mut self, n: u32) {
        self.ack_batch = n.max(1);
    }

    /// Changes the waiting policy.
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
    }

    /// The statistics so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The channel.
    pub fn channel(&self) -> &C {
        &self.channel
    }

    /// The channel, mutably (to change what else it watches, say).
    pub fn channel_mut(&mut self) -> &mut C {
        &mut self.channel
    }

    /// Polls every queue until it is empty, calling `f` for each completion in order.
    pub fn poll_all(&mut self, f: &mut dyn FnMut(CqKey, &Q::Completion)) -> Result<usize> {
        let mut total = 0;
        for (i, cq) in self.cqs.iter_mut().enumerate() {
            loop {
                let n = cq.poll(&mut self.scratch)?;
                if n == 0 {
                    self.stats.empty_polls += 1;
                }
                for wc in &self.scratch[..n] {
                    f(CqKey(i), wc);
                }
                total += n;
                if n < self.scratch.len() {
                    break;
                }
            }
        }
        self.stats.completions += total as u64;
        Ok(total)
    }

    /// The non-blocking step, for event loops (epoll/mio on the channel's fd) and the core of
    /// [`Waiter::wait`]: read every pending event until the channel is drained, ack in batches,
    /// re-arm every queue that is not armed, then poll every queue until empty.
    ///
    /// After it returns, sleeping on the channel is safe: every queue is armed, and everything
    /// that arrived before the arm has been delivered.
    pub fn step(&mut self, f: &mut dyn FnMut(CqKey, &Q::Completion)) -> Result<usize> {
        self.drain_events()?;
        self.arm_unarmed()?;
        self.poll_all(f)
    }

    fn drain_events(&mut self) -> Result<()> {
        while self.read_one_event()? {}
        Ok(())
    }

    /// [`Waiter::step`] for a caller that knows which armed queues cannot have fired (a send
    /// queue armed solicited-only whose error completions the caller would have polled and
    /// failed on): events are read only while a queue that may have fired is still armed, so
    /// the step usually ends without the read that finds the channel empty. A caller that
    /// waits edge-triggered still misses nothing, as long as `may_fire` is right.
    pub fn step_where(
        &mut self,
        may_fire: &dyn Fn(CqKey, ArmMode) -> bool,
        f: &mut dyn FnMut(CqKey, &Q::Completion),
    ) -> Result<usize> {
        while self
            .slots
            .iter()
            .enumerate()
            .any(|(i, s)| s.armed && may_fire(CqKey(i), s.mode))
            && self.read_one_event()?
        {}
        self.arm_unarmed()?;
        self.poll_all(f)
    }

    /// Reads one pending event, if any, and books it; false when the channel is empty.
    fn read_one_event(&mut self) -> Result<bool> {
        let Some(target) = self.channel.next_event(&self.cqs)? else {
            return Ok(false);
        };
        self.stats.events += 1;
        if let EventTarget::Cq(i) = target {
            let slot = &mut self.slots[i];
            // The event consumed the arm.
            slot.armed = false;
            slot.unacked += 1;
            if slot.unacked >= self.ack_batch {
                ack_slot(&self.cqs[i], slot, &mut self.stats);
            }
        }
        Ok(true)
    }

    fn arm_unarmed(&mut self) -> Result<()> {
        for (cq, slot) in self.cqs.iter().zip(self.slots.iter_mut()) {
            if !slot.armed {
                cq.arm(slot.mode)?;
                slot.armed = true;
                self.stats.arms += 1;
            }
        }
        Ok(())
    }

    /// Acknowledges every event read so far.
    pub fn flush_acks(&mut self) {
        for (cq, slot) in self.cqs.iter().zip(self.slots.iter_mut()) {
            if slot.unacked > 0 {
                ack_slot(cq, slot, &mut self.stats);
            }
        }
    }

    /// Waits until at least one completion is delivered to `f` or `timeout` passes (`None`:
    /// forever), following the policy. Returns how many were delivered: 0 when the timeout
    /// passed or the channel reported [`Readiness::Other`].
    pub fn wait(
        &mut self,
        timeout: Option<Duration>,
        f: &mut dyn FnMut(CqKey, &Q::Completion),
    ) -> Result<usize> {
        self.wait_from(Start::Timeout(timeout), f)
    }

    /// Like [`Waiter::wait`], until `deadline` (`None`: forever), with `now` the caller's time
    /// (read at the start of its turn): a sleeping wait then reads the clock once, when it
    /// wakes ([`Waiter::woke_at`]), where [`Waiter::wait`] reads it before it sleeps too.
    pub fn wait_until(
        &mut self,
        deadline: Option<Instant>,
        now: Instant,
        f: &mut dyn FnMut(CqKey, &Q::Completion),
    ) -> Result<usize> {
        self.wait_from(Start::Until(deadline, now), f)
    }

    /// The clock as read when the last wait's sleep ended; `None` if that wait did not sleep.
    /// The time a caller's next turn begins at, without reading the clock again.
    pub fn woke_at(&self) -> Option<Instant> {
        self.woke
    }

    // Inlined into `wait` and `wait_until`, so that each knows its `Start` and keeps only its
    // own way of taking the time.
    #[inline(always)]
    fn wait_from(
        &mut self,
        start: Start,
        f: &mut dyn FnMut(CqKey, &Q::Completion),
    ) -> Result<usize> {
        // What is already queued needs no syscall, and no clock read: the time is taken only
        // once there is something to wait for, and only by a policy that needs it.
        self.woke = None;
        let n = self.poll_all(f)?;
        if n > 0 {
            if matches!(self.policy, Policy::Adaptive { .. }) {
                self.gaps.record(Duration::ZERO);
            }
            return Ok(n);
        }
        let expired = |d: Option<Instant>| d.is_some_and(|d| Instant::now() >= d);
        match self.policy {
            Policy::Poll => {
                let deadline = start.deadline();
                let mut empty = 0u32;
                loop {
                    empty = empty.wrapping_add(1);
                    if empty % CLOCK_EVERY == 0 && expired(deadline) {
                        return Ok(0);
                    }
                    std::hint::spin_loop();
                    let n = self.poll_all(f)?;
                    if n > 0 {
                        return Ok(n);
                    }
                }
            }
            Policy::Hybrid {
                spin,
                max_empty_polls,
            } => {
                let (deadline, started) = start.fresh();
                if let Some(n) = self.spin(spin, max_empty_polls, started, deadline, f)? {
                    return Ok(n);
                }
                self.sleep_until(deadline, Instant::now(), f)
            }
            Policy::Adaptive { max_spin } => {
                let spin = self.gaps.spin_now(max_spin);
                if spin.is_zero() {
                    let (deadline, now) = start.given();
                    return self.sleep_until(deadline, now, f);
                }
                let (deadline, started) = start.fresh();
                let caught = self.spin(spin, u32::MAX, started, deadline, f)?;
                let spun_until = Instant::now();
                let spun = spun_until.saturating_duration_since(started);
                match caught {
                    Some(_) => self.gaps.record(spun),
                    // Fruitless only if it had its whole budget: one the caller's deadline
                    // cut short says nothing of the next message.
                    None if spun >= spin => self.gaps.record(Duration::MAX),
                    None => {}
                }
                match caught {
                    Some(n) => Ok(n),
                    None => self.sleep_until(deadline, spun_until, f),
                }
            }
            Policy::Sleep => {
                let (deadline, now) = start.given();
                self.sleep_until(deadline, now, f)
            }
        }
    }

    /// The spin budget [`Policy::Adaptive`] would use now (zero: it would sleep at once).
    pub fn adaptive_spin(&self) -> Duration {
        match self.policy {
            Policy::Adaptive { max_spin } => self.gaps.spin_budget(max_spin),
            _ => Duration::ZERO,
        }
    }

    /// Polls for up to `spin` from `now` or `max_polls` polls (the first already done by the
    /// caller), whichever ends first, or until `deadline`; what it delivered, if anything.
    fn spin(
        &mut self,
        spin: Duration,
        max_polls: u32,
        now: Instant,
        deadline: Option<Instant>,
        f: &mut dyn FnMut(CqKey, &Q::Completion),
    ) -> Result<Option<usize>> {
        self.stats.spins += 1;
        let spin_until = rdmsg_verbs::deadline_after(now, spin);
        for i in 2..=max_polls.max(1) {
            if i % CLOCK_EVERY == 0 {
                let now = Instant::now();
                if now >= spin_until || deadline.is_some_and(|d| now >= d) {
                    break;
                }
            }
            std::hint::spin_loop();
            let n = self.poll_all(f)?;
            if n > 0 {
                self.stats.spins_caught += 1;
                return Ok(Some(n));
            }
        }
        Ok(None)
    }

    /// Sleeps until a completion is delivered or `deadline` passes, `now` being the time
    /// before the first sleep: the clock is read once per sleep, when it ends.
    fn sleep_until(
        &mut self,
        deadline: Option<Instant>,
        mut now: Instant,
        f: &mut dyn FnMut(CqKey, &Q::Completion),
    ) -> Result<usize> {
        loop {
            // Before every sleep: every queue armed, then everything queued before the arms
            // delivered. Sleeping is level-triggered, so an event still unread would end the
            // sleep at once: nothing can be stranded. Draining the channel first spares that
            // wasted wake-up when a stale event is likely, i.e. when a queue is armed for any
            // completion; a solicited-only queue leaves one only if a solicited message lands
            // between its re-arm and the poll, which is too rare to pay a syscall per sleep.
            let n = if self.slots.iter().all(|s| s.mode == ArmMode::SolicitedOnly) {
                self.arm_unarmed()?;
                self.poll_all(f)?
            } else {
                self.step(f)?
            };
            if n > 0 {
                return Ok(n);
            }
            let readiness = self.channel.wait_readable(deadline, now)?;
            let woke = Instant::now();
            self.stats.time_asleep += woke.saturating_duration_since(now);
            self.woke = Some(woke);
            now = woke;
            match readiness {
                Readiness::TimedOut => return Ok(0),
                Readiness::Other => {
                    self.stats.external_wakeups += 1;
                    return Ok(0);
                }
                Readiness::Events => {}
            }
            self.stats.wakeups += 1;
            // Read the event that woke us, re-arm its queue, poll. Any further events are read
            // by the step before the next sleep: draining to EAGAIN here as well would cost a
            // syscall per wake-up and change nothing.
            self.read_one_event()?;
            self.arm_unarmed()?;
            let n = self.poll_all(f)?;
            if n > 0 {
                self.stats.completions_after_wakeup += n as u64;
                return Ok(n);
            }
            self.stats.spurious_wakeups += 1;
            if deadline.is_some_and(|d| now >= d) {
                return Ok(0);
            }
        }
    }

    /// Acks every outstanding event and hands back the channel and the queues, in the order
    /// they were added. (Dropping the waiter instead is fine too: verbs-core's queues ack what
    /// is left when they are dropped.)
    pub fn into_parts(mut self) -> (C, Vec<Q>) {
        self.flush_acks();
        (self.channel, self.cqs)
    }
}

/// Acks every event a slot has counted, with one `ibv_ack_cq_events` call.
fn ack_slot<Q: CompletionSource>(cq: &Q, slot: &mut Watched, stats: &mut Stats) {
    cq.ack(slot.unacked);
    stats.events_acked += u64::from(slot.unacked);
    stats.ack_calls += 1;
    slot.unacked = 0;
}
