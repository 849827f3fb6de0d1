//! The hub's completion channel and epoll set, sleeping on them, and what follows a wake-up.

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rdmsg_notify::{ArmMode, EventChannel, EventTarget, Readiness};
use rdmsg_verbs::{deadline_after, CompletionChannel, CompletionQueue, ReadyWatch};

use super::RawHub;
use crate::core::earliest;
use crate::error::Result;
use crate::token::Token;

/// The hub's completion channel, with everything else that ends its sleep, in one epoll set.
#[derive(Debug)]
pub(super) struct HubChannel {
    channel: CompletionChannel,
    pub(super) watch: ReadyWatch,
    /// Keys other than the channel's reported by the last waits, not yet looked at.
    ready: Vec<u64>,
    /// Registered in `watch`: kept open here.
    _wake: UnixStream,
}

impl HubChannel {
    pub(super) fn new(channel: CompletionChannel, watch: ReadyWatch, wake: UnixStream) -> Self {
        Self {
            channel,
            watch,
            ready: Vec::new(),
            _wake: wake,
        }
    }
}

impl HubChannel {
    /// The completion channel every CQ of the hub reports to.
    pub(super) fn completion(&self) -> &CompletionChannel {
        &self.channel
    }
}

impl EventChannel<CompletionQueue> for HubChannel {
    fn next_event(&mut self, cqs: &[CompletionQueue]) -> rdmsg_notify::Result<Option<EventTarget>> {
        self.channel.next_event(cqs)
    }

    fn wait_readable(
        &mut self,
        deadline: Option<Instant>,
        now: Instant,
    ) -> rdmsg_notify::Result<Readiness> {
        let before = self.ready.len();
        if self.watch.wait_keys_until(deadline, now, &mut self.ready)? == 0 {
            return Ok(Readiness::TimedOut);
        }
        let channel_key = Token::Channel.key();
        let mut channel = false;
        let mut i = before;
        while i < self.ready.len() {
            if self.ready[i] == channel_key {
                channel = true;
                self.ready.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(if channel {
            Readiness::Events
        } else {
            Readiness::Other
        })
    }
}

impl RawHub {
    /// A call from the application begins a turn: its time, read now.
    pub(super) fn begin_turn(&self) -> Instant {
        self.clock.new_turn();
        self.clock.now()
    }

    /// Sleeps until something happens (at most `timeout` from this turn's time, and the
    /// nearest deadline), then handles it. A `blocked` sender must hear of any grant and any
    /// send completion.
    pub(super) fn wait_for_progress(
        &mut self,
        timeout: Option<Duration>,
        blocked: bool,
    ) -> Result<()> {
        if !self.pool.going_to_sleep() {
            // Buffers came back: no sleep, but a new turn all the same.
            self.clock.new_turn();
            self.after_wake(true)?;
            return Ok(());
        }
        self.arm(blocked)?;
        // Counted from this turn's time (the call that began it, or the last wake-up): the
        // sleep itself reads the clock only when it ends. A timer due meanwhile fires late by
        // the turn's work since it began (microseconds natively), never early.
        let now = self.clock.now();
        let after =
            earliest(timeout, self.config.conn.health_check).map(|t| deadline_after(now, t));
        let limit = earliest(self.nearest_deadline(), after);
        let mut got = std::mem::take(&mut self.completions);
        let res = self
            .waiter
            .wait_until(limit, now, &mut |key, wc| got.push((key, wc.clone())));
        self.clock.after_wait(self.waiter.woke_at());
        self.pool.awake(!matches!(res, Ok(n) if n > 0));
        self.completions = got;
        self.handle_completions();
        let n = match res {
            Ok(n) => n,
            Err(e) => return Err(self.hub_failure(e.into())),
        };
        self.after_wake(n == 0)
    }

    /// Sets how both queues are armed: for any completion while a send waits for a credit or
    /// a send slot (`blocked`), or a connection's core wants any completion after a refused
    /// bounded send; else as configured (the send queue as [`RawHub::send_arm`] says).
    pub(super) fn arm(&mut self, blocked: bool) -> Result<()> {
        let slots = &self.table.slots;
        self.blocked.retain(|&s| {
            slots[s]
                .as_ref()
                .is_some_and(|slot| slot.core.wants_any_completion())
        });
        let (recv, send) = if blocked || !self.blocked.is_empty() {
            (ArmMode::Next, ArmMode::Next)
        } else {
            (self.config.conn.recv_arm, self.send_arm())
        };
        let groups = self.groups.iter().map(|g| (g.key, recv));
        for (key, mode) in groups.chain([(self.send_key, send)]) {
            if self.waiter.mode(key)? != mode {
                self.waiter.set_mode(key, mode)?;
            }
        }
        Ok(())
    }

    /// The send CQ is armed for any completion while a send is outstanding on any queue pair
    /// (as a core arms for its signaled sends, see `Core::send_arm`): counted, not searched.
    fn send_arm(&self) -> ArmMode {
        if self.budget.outstanding() > 0 {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        }
    }

    /// Polls every queue without waiting (or arming) and handles what came.
    pub(super) fn poll_now(&mut self) -> Result<()> {
        self.clock.new_turn();
        let mut got = std::mem::take(&mut self.completions);
        let polled = self
            .waiter
            .poll_all(&mut |key, wc| got.push((key, wc.clone())));
        self.completions = got;
        self.handle_completions();
        match polled {
            Ok(_) => Ok(()),
            Err(e) => Err(self.hub_failure(e.into())),
        }
    }

    /// Everything but completions: the descriptors that were readable, deadlines, drained
    /// connections, returned buffers, grants.
    pub(super) fn after_wake(&mut self, look_everywhere: bool) -> Result<()> {
        let mut ready = std::mem::take(&mut self.waiter.channel_mut().ready);
        if look_everywhere {
            // A non-blocking step, or a wake-up for something else: look at what is ready now.
            let _ = self
                .waiter
                .channel()
                .watch
                .wait_keys(Some(Duration::ZERO), &mut ready);
        }
        ready.sort_unstable();
        ready.dedup();
        // Streams before the listener: a handshake whose next bytes are here is not evicted to
        // make room for a newcomer.
        let (mut listen, mut cm_listen) = (false, false);
        for key in ready.drain(..) {
            match Token::of_key(key) {
                Some(Token::Wake) => {
                    // A dropped handle, or an asynchronous event routed to our mailbox (the
                    // last-WQE events of closing queue pairs on 6.12, say): drain the socket,
                    // or an event loop waiting on the hub would find it readable for ever.
                    self.pool.awake(true);
                    self.async_events();
                }
                Some(Token::Async) => self.async_events(),
                Some(Token::Listen) => listen = true,
                Some(Token::CmListen) => cm_listen = true,
                Some(Token::Stream(slot)) => self.stream_ready(slot as usize),
                Some(Token::Channel) | None => {}
            }
        }
        if listen {
            self.accept_all();
        }
        if cm_listen {
            self.accept_cm_all();
        }
        self.waiter.channel_mut().ready = ready;
        // Streams dialed to resume sessions (a dialing thread woke us).
        self.take_dialed();
        let now = self.clock.now();
        self.fire_deadlines(now);
        self.watch_liveness(now)?;
        self.retire_drained()?;
        self.grow_for_demand()?;
        self.repost()?;
        self.grants();
        if now.duration_since(self.last_tick) >= Duration::from_secs(1) {
            self.last_tick = now;
            for g in &mut self.groups {
                g.share.tick(&mut self.table.slots, &mut self.touched);
            }
        }
        Ok(())
    }
}
