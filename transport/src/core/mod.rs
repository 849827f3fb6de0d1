//! The protocol of one RC queue pair, without I/O: credits and grants, the receive rules, which
//! failure wins, signalling, how the queues are armed, graceful close, a peer that leaves, the
//! drain after a failure, and their deadlines. No verbs, no socket, no clock: a
//! [`Connection`](crate::Connection) (one queue pair on its own queues), a
//! [`RawHub`](crate::RawHub) (a slab of cores on shared queues) and the host simulator (`sim`,
//! tests only) drive the same [`Core`], so that every rule has one home.
//!
//! # A driver's manual
//!
//! The methods come in four kinds, as in quinn-proto's `Connection`:
//!
//! - **getters** (`credits`, `stats`, `failure`, `may_send`, `send_arm`, `refill_due`,
//!   `next_timeout`, …) read the state;
//! - **`handle_*` inputs** tell it what happened: a polled batch (`begin_batch`, then
//!   `handle_recv` / `handle_send` for each completion in polling order), what the bootstrap
//!   stream brought (`handle_stream`), a failure found elsewhere (`handle_failure`: a verb
//!   that failed, an asynchronous event), the passing of time (`handle_timeout`), and how many
//!   requests are still posted after a failure (`handle_flushed`);
//! - **commands** from the application: `data` (a message to post), `start_close`, `grant`,
//!   `read_fits`, and the bookkeeping of what the driver then posted (`posted`, `reposted`);
//! - **`poll_command`**, the one output besides the commands' answers: what the driver must do
//!   on its side of the wire.
//!
//! After *every* input or command, call `poll_command` until it returns `None` and do each
//! [`Command`] in order; each comes at most once per connection, but for [`Command::Probe`]. Before waiting, wait at most
//! until `next_timeout`, and call `handle_timeout` with the time once it has passed. `now`
//! never goes backwards. A driver posts a data message only when `may_send` says so, and then
//! as `data` says (its immediate data, whether solicited, whether signaled); it re-posts
//! receive buffers when `refill_due` says so (own receive queue; a shared one follows
//! [`Share`](crate::share::Share)) and tells `reposted`; it sends `grant` whenever one is due.
//!
//! # Phases
//!
//! A core is *handshaking* (a hub's queue pair whose handshake runs: nothing may be sent),
//! *linked*, *closing* (our close message is posted: closed once a successful completion
//! covers it, whatever grants were posted after it; failed at the close deadline, or at the
//! vanish deadline once the peer's stream ended), *leaving* (the peer's stream said goodbye
//! or ended: its close message is waited for until the vanish deadline), or *failed* (the
//! first failure is kept; the queue pair is being flushed until it is drained or the drain
//! deadline passes).

mod inbound;
mod liveness;
mod outbound;
mod room;
mod stats;
mod timers;

use std::time::{Duration, Instant};

use rdmsg_notify::ArmMode;
use rdmsg_verbs::{deadline_after, WcStatus};

pub(crate) use inbound::{Completion, RecvAction};
#[cfg(test)]
use room::unsignaled_share;
pub(crate) use room::{max_in_one_go, unsignaled_in_queue, unsignaled_room, Room};
pub use stats::ConnStats;

use crate::credits::{Credits, Imm};
use crate::error::{Error, Failure};
use inbound::Inbound;
use timers::{Timer, TimerTable};

/// Longest wait for a failed queue pair's posted requests to be flushed back.
pub(crate) const FLUSH_WAIT: Duration = Duration::from_millis(500);

/// Longest a failed queue pair on a shared receive queue waits, once its own requests are
/// flushed, for the device to say that no receive of the queue is in its hands any more
/// (`IBV_EVENT_QP_LAST_WQE_REACHED`, which the verbs specification asks for before the queue
/// pair is destroyed). Some providers never send it (rxe among them): then this bounds the
/// wait, and so the delay of the connection's end.
pub(crate) const LAST_WQE_WAIT: Duration = Duration::from_millis(50);

/// The least time a close message gets for its acknowledgement, however much of the close's
/// deadline the waits before it spent: the grace a peer's bare end of stream gets too, so a
/// close ends within `close_timeout` and this.
pub(crate) const CLOSE_ACK_GRACE: Duration = Duration::from_millis(50);

/// Silent probe intervals after which a peer is gone while an RDMA read of ours is under way:
/// a long one completes (and what follows it) only once all its bytes have come. Twice the
/// keepalive limit; otherwise a probe is given one interval.
pub(crate) const SILENT_INTERVALS_BEHIND: u8 = 6;

/// A sender polls its queues at least every this many sends.
pub(crate) const SEND_PROGRESS_EVERY: u32 = 16;

/// How often a connection without keepalive looks whether its peer, silent, is still there,
/// for a peer host that may stay silent `limit` ([`Config::keepalive`](crate::Config::keepalive)):
/// a probe goes at the end of the first silent interval (one to two intervals after the last
/// sign of life), and a second silent interval means the peer is gone: within `limit` of its
/// end.
pub(crate) fn probe_interval(limit: Duration) -> Duration {
    (limit / 3).max(Duration::from_millis(100))
}

/// The sooner of two optional bounds, durations or deadlines (`None`: no bound).
pub(crate) fn earliest<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What may still come on the bootstrap stream once the handshake is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamNews {
    /// Nothing to read now.
    Nothing,
    /// Junk (this byte): the connection fails at once.
    Garbage(u8),
    /// The peer closed gracefully: its close message is delivered or on its way.
    Goodbye,
    /// The stream ended without a goodbye: the peer's process is gone, or its side failed.
    Ended,
}

impl StreamNews {
    /// How long to wait for the peer's close message before calling it vanished: up to
    /// `close_timeout` after a goodbye, 50 ms after a bare end of stream (one may still be in
    /// flight).
    fn grace(self, close_timeout: Duration) -> Duration {
        if self == Self::Goodbye {
            close_timeout
        } else {
            Duration::from_millis(50)
        }
    }
}

/// How a close that has ended ended, from the failure that ended it: `Ok` when the close
/// message was delivered, [`Error::Timeout`] (of `timeout`, the close timeout) when it was not
/// in time, the failure when something else ended the connection first.
pub(crate) fn close_outcome(failure: Failure, timeout: Duration) -> Result<(), Error> {
    match failure {
        Failure::CloseTimedOut => Err(Error::timeout(
            "closing",
            crate::error::WAIT_CLOSE_ACK,
            timeout,
        )),
        Failure::Closed => Ok(()),
        f => Err(f.into()),
    }
}

/// What the driver must do on its side, in the order given (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// Our close message was delivered: write the goodbye on the bootstrap stream (a
    /// [`Command::FailQueuePair`] with [`Failure::Closed`] follows).
    SayGoodbye,
    /// Stop watching the bootstrap stream: it said goodbye, ended, or sent junk, and stays
    /// readable for ever.
    UnwatchStream,
    /// The first failure: shut the bootstrap stream (so that the peer fails at once too) and
    /// move the queue pair to the error state, so that every posted request is flushed back;
    /// then [`Core::flushing_since`] with the time.
    FailQueuePair,
    /// Nothing came from the peer for a probe interval ([`Core::probe_every`]): post a
    /// liveness probe if there is room for it, then [`Core::probe_posted`] with its wr_id.
    /// Without room, the signaled send in flight tells as much, or the next interval asks
    /// again.
    Probe,
}

/// A message to post: its immediate data and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Post {
    /// Immediate data (credits returned, echo, flags).
    pub imm: Imm,
    /// Posted solicited.
    pub solicited: bool,
    /// Posted signaled.
    pub signaled: bool,
}

/// What to do with a receive completion's buffer, and whether it spent a credit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Receipt {
    /// Deliver, count as a grant, or recycle.
    pub action: RecvAction,
    /// It used one of the receive buffers the peer's credits stand for (a data message or a
    /// close; not a grant, nor anything past a broken point).
    pub spent_credit: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Handshaking,
    Linked,
    Closing {
        /// The close message's request, once posted: its completion (or a later one, which
        /// covers it) is the close delivered, whatever grants were posted after it.
        close_wr: Option<u64>,
    },
    Leaving,
    Failed {
        /// The close deadline passed before our close message completed.
        close_timed_out: bool,
        /// The posted requests are flushed back, or the drain deadline passed.
        drained: bool,
    },
}

/// The protocol state of one RC queue pair (see the module docs for how to drive it).
#[derive(Debug)]
pub(crate) struct Core {
    credits: Credits,
    /// The real books replaced the placeholder a hub starts a handshake with.
    books_known: bool,
    inbound: Inbound,
    state: State,
    failure: Option<Failure>,
    timers: TimerTable,
    actions: ActionQueue,
    stats: ConnStats,
    signal_every: u32,
    unsignaled: u32,
    /// wr_id of the last signaled send, until a completion retires it.
    last_signaled: Option<u64>,
    close_timeout: Duration,
    /// Sends since the sender last polled its queues.
    sends_since_poll: u32,
    /// A send found no credit or send slot and none has gone since: the driver waits for any
    /// completion (see [`Core::wants_any_completion`]).
    send_blocked: bool,
    /// A send found no credit and none has gone since: a credit stall is under way
    /// ([`ConnStats::credit_stalls`]).
    stalled: bool,
    /// The upper layer's word our grants carry ([`Core::set_note`]).
    note: u32,
    /// The word the peer's latest grant carried.
    peer_note: Option<u32>,
    /// The queue pair takes its receives from a shared receive queue (a hub's).
    on_srq: bool,
    /// The device said the last receive of the shared queue left the queue pair.
    last_wqe: bool,
    /// The peer's bootstrap stream said goodbye or ended.
    goodbye_seen: bool,
    /// Our close message's request, once posted (kept when the peer's close makes us
    /// linger: our goodbye still follows its completion).
    our_close_wr: Option<u64>,
    /// How often a silent peer is probed, where nothing else would notice its host's end.
    probe_every: Option<Duration>,
    /// The liveness probe posted and not yet completed.
    probe_wr: Option<u64>,
    /// The peer showed signs of life (a receive, a send it acknowledged) since the last
    /// probe interval began.
    heard: bool,
    /// Probe intervals in a row without a sign of life.
    silent_intervals: u8,
    /// Probe intervals since the peer was last heard from (a hub's liveness watch).
    quiet_intervals: u32,
    /// The last RDMA read posted, until a completion covers it: a probe behind it waits for
    /// all its bytes.
    last_read: Option<u64>,
}

/// Actions waiting for the driver, in order; each at most once.
#[derive(Debug, Default)]
struct ActionQueue {
    queue: [Option<Command>; 4],
    len: u8,
}

impl ActionQueue {
    fn push(&mut self, a: Command) {
        if self.queue[..usize::from(self.len)].contains(&Some(a)) {
            return;
        }
        self.queue[usize::from(self.len)] = Some(a);
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Command> {
        if self.len == 0 {
            return None;
        }
        let a = self.queue[0].take();
        self.queue.rotate_left(1);
        self.len -= 1;
        a
    }
}

impl Core {
    /// A linked connection with these books.
    pub(crate) fn new(credits: Credits, signal_every: u32, close_timeout: Duration) -> Self {
        Self {
            credits,
            books_known: true,
            inbound: Inbound::default(),
            state: State::Linked,
            failure: None,
            timers: TimerTable::default(),
            actions: ActionQueue::default(),
            stats: ConnStats::default(),
            signal_every: signal_every.max(1),
            unsignaled: 0,
            last_signaled: None,
            close_timeout,
            sends_since_poll: 0,
            send_blocked: false,
            stalled: false,
            note: 0,
            peer_note: None,
            on_srq: false,
            last_wqe: false,
            goodbye_seen: false,
            our_close_wr: None,
            probe_every: None,
            probe_wr: None,
            heard: false,
            quiet_intervals: 0,
            silent_intervals: 0,
            last_read: None,
        }
    }

    /// The queue pair takes its receives from a shared receive queue: once failed, it is
    /// drained only when the device says the last of them left it (or [`LAST_WQE_WAIT`]).
    pub(crate) fn on_shared_receive_queue(mut self) -> Self {
        self.on_srq = true;
        self
    }

    /// The word every grant of ours carries from now on, for the layer above (rdmsg's typed
    /// layer: how many of the peer's messages its application took): news that rides the
    /// grants a receiver sends anyway, costing no message of its own.
    pub(crate) fn set_note(&mut self, note: u32) {
        self.note = note;
    }

    /// What our grants carry.
    pub(crate) fn note(&self) -> u32 {
        self.note
    }

    /// A grant of the peer's carried `note`.
    pub(crate) fn note_received(&mut self, note: u32) {
        self.peer_note = Some(note);
    }

    /// The word the peer's latest grant carried.
    pub(crate) fn peer_note(&self) -> Option<u32> {
        self.peer_note
    }

    /// A connection whose handshake runs, with placeholder books until the peer is known
    /// ([`Core::learn_peer`]).
    pub(crate) fn handshaking(
        placeholder: Credits,
        signal_every: u32,
        close_timeout: Duration,
    ) -> Self {
        let mut c = Self::new(placeholder, signal_every, close_timeout);
        c.books_known = false;
        c.state = State::Handshaking;
        c
    }

    // ----- getters -----

    pub(crate) fn credits(&self) -> &Credits {
        &self.credits
    }

    pub(crate) fn credits_mut(&mut self) -> &mut Credits {
        &mut self.credits
    }

    pub(crate) fn stats(&self) -> ConnStats {
        self.stats
    }

    /// The first failure, if any.
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.failure
    }

    /// Whether the handshake is done (the connection may carry messages).
    pub(crate) fn is_linked(&self) -> bool {
        self.state != State::Handshaking
    }

    /// Whether the close deadline passed before our close message completed (what
    /// [`Failure::CloseTimedOut`] says; the tests check the two agree).
    #[cfg(test)]
    pub(crate) fn close_timed_out(&self) -> bool {
        matches!(
            self.state,
            State::Failed {
                close_timed_out: true,
                ..
            }
        )
    }

    /// Whether the connection failed and its queue pair's requests are flushed back (or the
    /// drain deadline passed): a hub may destroy it.
    pub(crate) fn is_drained(&self) -> bool {
        matches!(self.state, State::Failed { drained: true, .. })
    }

    /// Whether the peer's close message has arrived.
    pub(crate) fn peer_closed(&self) -> bool {
        self.inbound.peer_closed()
    }

    /// Whether the application may send: the failure if not, and [`Failure::Closed`] once
    /// our close is under way.
    pub(crate) fn check_send(&self) -> Result<(), Failure> {
        match (self.failure, self.state) {
            (Some(f), _) => Err(f),
            (None, State::Closing { .. }) => Err(Failure::Closed),
            _ => Ok(()),
        }
    }

    /// Whether a data message can be posted now: linked, not failed nor closing, a credit,
    /// and room on the driver's side.
    pub(crate) fn may_send(&self, room: Room) -> bool {
        matches!(self.state, State::Linked | State::Leaving)
            && self.failure.is_none()
            && self.credits.available() > 0
            && self.credits.slots_ready()
            && room.sq > 0
            && room.buffers > 0
            && room.cq > 0
    }

    /// Whether a streaming sender should poll its queues before this send: every
    /// [`SEND_PROGRESS_EVERY`] sends, and at once when credits or room run low (the peer may
    /// be waiting for credits we hold).
    pub(crate) fn poll_before_send(&mut self, room: Room) -> bool {
        self.sends_since_poll += 1;
        let plenty = self.credits.available() > self.credits.peer_depth() / 4
            && room.buffers > 1
            && room.sq > 1
            && room.cq > 1;
        if !plenty || self.sends_since_poll >= SEND_PROGRESS_EVERY {
            self.sends_since_poll = 0;
            true
        } else {
            false
        }
    }

    /// Whether the driver must wake for any completion, not only a solicited one: a send found
    /// no credit or send slot ([`Core::send_waits`]) and none has gone since. Grants sent
    /// before the peer saw us exhausted are not solicited, and they may hold every ordinary
    /// grant slot of ours while they sit unpolled.
    pub(crate) fn wants_any_completion(&self) -> bool {
        self.send_blocked && self.failure.is_none()
    }

    /// How the send queue is armed: for any completion while a signaled send is outstanding,
    /// so that its completion, or the error a failed send turns it into, wakes a sleeper (rxe
    /// never marks send-side errors solicited, although the specification has every error
    /// completion fire a solicited-only arm), and a full send queue (whose last send is always
    /// signaled) does not hold back a due grant. Solicited-only otherwise, so that a sleep
    /// with only unsignaled sends behind it skips the pre-sleep drain of the channel; an error
    /// among those is caught by the health check or the peer's end of the bootstrap stream.
    pub(crate) fn send_arm(&self) -> ArmMode {
        if self.last_signaled.is_some() {
            ArmMode::Next
        } else {
            ArmMode::SolicitedOnly
        }
    }

    /// Whether `free` buffers should be re-posted now (own receive queue): once an eighth of
    /// the depth is free, or at once if a grant slot is missing, or the peer runs low or may be
    /// blocked.
    pub(crate) fn refill_due(&self, free: usize) -> bool {
        let c = &self.credits;
        let batch = (c.depth() as usize / 8).max(1);
        free > 0
            && self.failure.is_none()
            && (free >= batch
                || c.slots_missing() > 0
                || c.peer_credits() <= c.depth() / 4
                || c.peer_may_be_blocked())
    }

    /// The earliest deadline: wait at most until then, then [`Core::handle_timeout`].
    pub(crate) fn next_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// Whether a deadline other than the liveness probe's is set: a busy driver hands the time
    /// to the core after every poll while one is, and for the probe's alone only when it
    /// looks at liveness anyway (the probe's interval is seconds long; reading the clock on
    /// every poll for it would not be).
    pub(crate) fn has_urgent_timer(&self) -> bool {
        self.timers.any_but(Timer::Probe)
    }

    /// How long from `now` until [`Core::next_timeout`] (zero once it has passed).
    pub(crate) fn time_to_next(&self, now: Instant) -> Option<Duration> {
        self.next_timeout()
            .map(|at| at.saturating_duration_since(now))
    }

    /// How a graceful close ended, once it has: `Ok` when the close message was delivered,
    /// [`Error::Timeout`] (of `timeout`, the close timeout) when it was not in time, the
    /// failure when something else ended the connection first. `None` while it is under way.
    pub(crate) fn close_result(&self, timeout: Duration) -> Option<Result<(), Error>> {
        Some(close_outcome(self.failure?, timeout))
    }

    /// The next thing the driver must do.
    pub(crate) fn poll_command(&mut self) -> Option<Command> {
        self.actions.pop()
    }

    // ----- inputs -----

    /// The peer's hello is known: its real books replace the placeholder (once).
    pub(crate) fn learn_peer(&mut self, books: Credits) {
        if !std::mem::replace(&mut self.books_known, true) {
            // Grant slots backed (or wanted) for a send queued during the handshake stay so.
            let books = books.with_slots_of(&self.credits);
            debug_assert_eq!(books.must_be_posted(), self.credits.must_be_posted());
            self.credits = books;
        }
    }

    /// The handshake is done.
    pub(crate) fn handshake_done(&mut self) {
        if self.state == State::Handshaking {
            self.state = State::Linked;
        }
    }

    /// Before a polled batch is handled: records the failure its first real error stands for,
    /// so that flushes in the batch are explained by it.
    pub(crate) fn begin_batch(&mut self, batch: impl IntoIterator<Item = Completion>) {
        if let Some(f) = Inbound::first_error(self.failure, batch, self.probe_wr) {
            self.handle_failure(f);
        }
    }

    /// A receive completion whose buffer came back. `explain_flush` is asked what explains a
    /// flush nothing else does (an asynchronous event).
    pub(crate) fn handle_recv(
        &mut self,
        c: &Completion,
        explain_flush: impl FnOnce() -> Option<Failure>,
        now: impl FnOnce() -> Instant,
    ) -> Receipt {
        let before = self.credits.must_be_posted();
        let (action, failure) =
            self.inbound
                .on_recv(c, &mut self.credits, self.failure, explain_flush);
        match action {
            RecvAction::Deliver => self.stats.received += 1,
            RecvAction::Grant => self.stats.grants_received += 1,
            RecvAction::Recycle => {}
        }
        let spent_credit = action != RecvAction::Grant && self.credits.must_be_posted() < before;
        self.heard |= c.status == WcStatus::Success;
        match failure {
            // Moving our queue pair to the error state now could lose the acknowledgement of
            // the close message (rxe completes a receive before it acknowledges it), and the
            // peer would retry it until its close timed out: wait for its goodbye.
            Some(Failure::PeerClosed) if !self.goodbye_seen => self.linger(now()),
            Some(f) => self.handle_failure(f),
            None => {}
        }
        Receipt {
            action,
            spent_credit,
        }
    }

    /// A send completion of request `wr_id`. Retires the signaled send it covers; our close
    /// is delivered once a successful completion covers the close message.
    pub(crate) fn handle_send(&mut self, c: &Completion, wr_id: u64) {
        // Completions come in posting order and wr_ids grow: this one retires every signaled
        // send up to it.
        if self.last_signaled.is_some_and(|id| wr_id >= id) {
            self.last_signaled = None;
        }
        if self.probe_wr.is_some_and(|id| wr_id >= id) {
            self.probe_wr = None;
        }
        if self.last_read.is_some_and(|id| wr_id >= id) {
            self.last_read = None;
        }
        self.heard |= c.status == WcStatus::Success;
        let close_delivered = c.status == WcStatus::Success
            && matches!(self.state, State::Closing { close_wr: Some(id) } if wr_id >= id);
        if let Some(f) = Inbound::on_send(c) {
            self.handle_failure(f);
        } else if close_delivered {
            // The close message is delivered: goodbye, and closed.
            self.timers.stop(Timer::Close);
            self.actions.push(Command::SayGoodbye);
            self.handle_failure(Failure::Closed);
        } else if c.status == WcStatus::Success
            && self.lingering()
            && self.our_close_wr.take().is_some_and(|id| wr_id >= id)
        {
            // Both closed at once: the peer lingers for our goodbye as we do for its.
            self.actions.push(Command::SayGoodbye);
        }
    }

    /// What the bootstrap stream brought at `now`.
    pub(crate) fn handle_stream(&mut self, news: StreamNews, now: Instant) {
        match news {
            StreamNews::Nothing => {}
            StreamNews::Garbage(byte) => {
                self.actions.push(Command::UnwatchStream);
                self.handle_failure(Failure::BootstrapGarbage { byte });
            }
            StreamNews::Goodbye | StreamNews::Ended => {
                self.actions.push(Command::UnwatchStream);
                self.goodbye_seen = true;
                if self.timers.get(Timer::Linger).is_some() {
                    // The peer's close completed: our acknowledgement reached it.
                    self.timers.stop(Timer::Linger);
                    self.actions.push(Command::FailQueuePair);
                }
                // The peer's close message gets the grace to arrive. Closing ourselves, ours
                // gets it to complete: a peer that took it and then dropped its side
                // acknowledged it before its stream ended (an acknowledgement lost all the
                // same ends the close as vanished, not timed out); one that died never will
                // (rxe retries for ever), and the close ends as the peer vanished rather than
                // at `close_timeout`.
                let closing = matches!(self.state, State::Closing { .. });
                let linked = matches!(self.state, State::Linked | State::Handshaking);
                if (linked || closing) && !self.peer_closed() {
                    if linked {
                        self.state = State::Leaving;
                    }
                    self.timers.set(
                        Timer::Vanish,
                        deadline_after(now, news.grace(self.close_timeout)),
                    );
                }
            }
        }
    }

    /// A failure found by the driver (a verb that failed, an asynchronous event, a dead
    /// peer). The first one is kept: every later call reports it.
    pub(crate) fn handle_failure(&mut self, f: Failure) {
        if self.failure.is_some() {
            // A real failure while lingering ends the wait for the goodbye.
            if self.lingering() {
                self.timers.stop(Timer::Linger);
                self.actions.push(Command::FailQueuePair);
            }
            return;
        }
        self.failure = Some(f);
        self.state = State::Failed {
            close_timed_out: false,
            drained: false,
        };
        self.timers.stop(Timer::Close);
        self.timers.stop(Timer::Vanish);
        self.actions.push(Command::FailQueuePair);
    }

    /// The peer's close message came before its goodbye: the queue pair stays up (not failed
    /// yet, nothing to drain) until the goodbye or the deadline.
    pub(crate) fn lingering(&self) -> bool {
        self.timers.get(Timer::Linger).is_some()
    }

    /// The peer closed, and its goodbye is not here yet: failed with [`Failure::PeerClosed`]
    /// (everything it sent is delivered), but the queue pair stays up until the goodbye, at
    /// most `close_timeout` from `now`.
    fn linger(&mut self, now: Instant) {
        if self.failure.is_some() {
            return;
        }
        self.failure = Some(Failure::PeerClosed);
        self.state = State::Failed {
            close_timed_out: false,
            drained: false,
        };
        self.timers.stop(Timer::Close);
        self.timers.stop(Timer::Vanish);
        self.timers
            .set(Timer::Linger, deadline_after(now, self.close_timeout));
    }

    /// The driver moved the queue pair to the error state at `now`: its requests are flushed
    /// back from now on, waited for at most [`FLUSH_WAIT`].
    pub(crate) fn flushing_since(&mut self, now: Instant) {
        if matches!(self.state, State::Failed { drained: false, .. })
            && self.timers.get(Timer::Drain).is_none()
        {
            self.timers.set(Timer::Drain, now + FLUSH_WAIT);
        }
    }

    /// After a failure, at `now`: `outstanding` requests of the queue pair are still posted
    /// (those the driver waits for). Drained once none is, and on a shared receive queue once
    /// the device said its last receive left the queue pair, or [`LAST_WQE_WAIT`] passed.
    pub(crate) fn handle_flushed(&mut self, outstanding: usize, now: Instant) {
        if outstanding > 0 {
            return;
        }
        if self.on_srq && !self.last_wqe {
            let at = now + LAST_WQE_WAIT;
            if self.timers.get(Timer::Drain).map_or(true, |d| d > at) {
                self.timers.set(Timer::Drain, at);
            }
            return;
        }
        self.drained();
    }

    /// The time is `now`: fires what is due.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        for t in self.timers.expired(now) {
            match (t, self.state) {
                (Timer::Close, State::Closing { .. }) => {
                    self.handle_failure(Failure::CloseTimedOut);
                    self.state = State::Failed {
                        close_timed_out: true,
                        drained: false,
                    };
                }
                // Our close under way or not: a peer gone is gone (a close started while the
                // peer was leaving keeps its deadline).
                (Timer::Vanish, State::Leaving | State::Closing { .. }) => {
                    self.handle_failure(Failure::PeerVanished)
                }
                (Timer::Linger, _) => self.actions.push(Command::FailQueuePair),
                (Timer::Probe, State::Linked) => {
                    if std::mem::take(&mut self.heard) {
                        self.silent_intervals = 0;
                    } else if self.probe_wr.is_none() && self.last_signaled.is_none() {
                        // Nothing out that a live peer would answer (the driver had no room
                        // for the probe): ask again, and judge by that one.
                        self.silent_intervals = 1;
                        self.actions.push(Command::Probe);
                    } else {
                        self.silent_intervals = self.silent_intervals.saturating_add(1);
                        // A read under way may move many bytes before what follows it
                        // completes: it gets more time. Sends are a buffer each.
                        let limit = if self.last_read.is_some() {
                            SILENT_INTERVALS_BEHIND
                        } else {
                            2
                        };
                        if self.silent_intervals >= limit {
                            // What was out went unanswered through whole intervals, however
                            // the queue pair retries (rxe takes `retry_cnt` 7 as for ever).
                            self.handle_failure(Failure::PeerVanished);
                            continue;
                        }
                        if self.probe_wr.is_none() {
                            self.actions.push(Command::Probe);
                        }
                    }
                    if let Some(every) = self.probe_every {
                        self.timers.set(Timer::Probe, deadline_after(now, every));
                    }
                }
                (Timer::Drain, _) => self.drained(),
                _ => {}
            }
        }
    }

    /// The driver can no longer poll for the flushes: it stops waiting for them.
    pub(crate) fn stop_draining(&mut self) {
        self.drained();
    }

    fn drained(&mut self) {
        if let State::Failed { drained, .. } = &mut self.state {
            *drained = true;
            self.timers.stop(Timer::Drain);
        }
    }
}

#[cfg(test)]
mod tests;
