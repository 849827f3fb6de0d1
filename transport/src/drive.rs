//! The driver of one queue pair's [`Core`], written once.
//!
//! A [`Connection`](crate::Connection), each connection of a [`RawHub`](crate::RawHub) and each
//! end of the simulator implement [`Queues`]: what lies under one core (its queue pair, the
//! send buffers and CQ entries it may use, its receive buffers, its bootstrap stream). The
//! sequences here are what every one of them does with the core's inputs and actions: a
//! polled completion, an action, a probe, a failure, a data message, a grant, a close, a
//! deadline, news from the stream, the drain after a failure, and how the queues are armed.
//! The simulator's host tests run these sequences, not copies of them.
//!
//! What stays with each driver is what only it has: where a completion comes from (its own
//! CQs, or the hub's shared ones, mapped to a slot), where a delivered message goes, and how
//! it sleeps.

use std::time::{Duration, Instant};

use rdmsg_notify::ArmMode;
use rdmsg_verbs::{Exposed, WcStatus};

use crate::core::{Command, Completion, Core, Post, Receipt, RecvAction, Room, StreamNews};
use crate::endpoint::Endpoint;
use crate::error::{errno_of, Failure, Result};
use crate::peer_id::PeerId;
use crate::trace;

/// What lies under one queue pair's core, as its driver sees it.
pub(crate) trait Queues {
    /// A receive buffer, as its completion handed it back.
    type Buf;
    /// What a send carries.
    type Payload;

    /// The protocol core.
    fn core(&mut self) -> &mut Core;

    /// The time, read only when the core needs it (the simulator's clock is its own).
    fn clock(&self) -> impl FnOnce() -> Instant + 'static;

    /// The queue pair's number and the peer's id, for tracing.
    fn names(&self) -> (u32, Option<PeerId>);

    /// What is free for a send now.
    fn room(&self) -> Room;

    /// Posts `payload` as `post` says and tells the core ([`Core::posted`]). An error is the
    /// verb's; the driver has failed the connection for it.
    fn post(&mut self, payload: Self::Payload, post: Post) -> Result<()>;

    /// The payload of a grant or a close: the core's note for the peer
    /// ([`Core::note`]).
    fn note(&mut self) -> Self::Payload;

    /// The note a grant (or the peer's close) carried in `buf`, if any.
    fn note_in(&self, buf: &Self::Buf, byte_len: u32) -> Option<u32>;

    /// A data message for the application.
    fn deliver(&mut self, buf: Self::Buf, byte_len: u32);

    /// The buffer of a grant, a close or a flush goes back to its pool.
    fn recycle(&mut self, buf: Self::Buf);

    /// What explains a flushed receive when nothing else does (an asynchronous event).
    fn explain_flush(&mut self) -> Option<Failure> {
        None
    }

    /// A receive the core judged: the books of a shared pool follow it.
    fn received(&mut self, _receipt: Receipt) {}

    /// Posts a liveness probe (a signaled zero-length read) and tells the core
    /// ([`Core::probe_posted`]) before anything that follows the core's count of sends left
    /// unsignaled (a probe is signaled: the count drops to 0).
    fn post_probe(&mut self) -> Result<()>;

    /// Binds memory window `window` on the queue pair (a signaled request) and tells the core
    /// ([`Core::posted`]). An error is the verb's; the driver has failed the connection for it.
    fn bind(&mut self, window: &mut Exposed) -> Result<()>;

    /// Writes the goodbye on the bootstrap stream.
    fn say_goodbye(&mut self);

    /// Stops watching the bootstrap stream (it stays readable for ever once it ended).
    fn unwatch_stream(&mut self);

    /// The next action of the core (a hub's connection whose handshake failed may be gone).
    fn next_command(&mut self) -> Option<Command> {
        self.core().poll_command()
    }

    /// A connection without a linked queue pair fails on its own terms (one whose handshake is
    /// under way, as a handshake): whether this one has none (nothing else of
    /// [`fail_queue_pair`] then applies).
    fn fail_unlinked(&mut self) -> bool {
        false
    }

    /// Shuts the bootstrap stream down: the peer's side fails at once rather than waiting on
    /// a queue pair that no longer answers.
    fn shut_down_stream(&mut self);

    /// Moves the queue pair to the error state: every posted request comes back flushed.
    fn to_error(&mut self);

    /// The flushes are under way: what the driver does besides (arm for every flush, post a
    /// drain marker, stop refilling a shared pool, wait for the drain deadline).
    fn flushing(&mut self);

    /// Requests the drain after a failure still waits for: the posted receives of a queue pair's
    /// own receive queue, or the sends of one on a shared receive queue (whose receives stay
    /// posted).
    fn flushes_outstanding(&self) -> usize;
}

/// Does what the core asks for, in order.
#[inline]
pub(crate) fn run_commands<Q: Queues>(q: &mut Q) {
    while let Some(action) = q.next_command() {
        match action {
            Command::SayGoodbye => q.say_goodbye(),
            Command::UnwatchStream => q.unwatch_stream(),
            Command::FailQueuePair => fail_queue_pair(q),
            Command::Probe => {
                probe(q);
            }
        }
    }
}

/// After the connection's first failure: the peer is told (the end of the bootstrap stream),
/// the queue pair moved to the error state so that its requests are flushed back, and the
/// core told when the flushes began.
pub(crate) fn fail_queue_pair<Q: Queues>(q: &mut Q) {
    q.unwatch_stream();
    if q.fail_unlinked() {
        return;
    }
    let (qp, peer) = q.names();
    let failure = q.core().failure();
    trace::ended(qp, peer, failure);
    q.shut_down_stream();
    q.to_error();
    let now = q.clock()();
    q.core().flushing_since(now);
    q.flushing();
}

/// Posts a liveness probe if the send queue and its CQ have room for it; whether it did.
/// Without room, the signaled send in flight tells whether the peer is there, or the next
/// interval asks again. A post that fails fails the connection (its actions are the caller's
/// to run).
pub(crate) fn probe<Q: Queues>(q: &mut Q) -> bool {
    let room = q.room();
    if room.sq == 0 || room.cq == 0 {
        return false;
    }
    match q.post_probe() {
        Ok(()) => true,
        Err(e) => {
            q.core().handle_failure(Failure::Local {
                op: "posting a liveness probe (ibv_post_send)",
                errno: errno_of(&e),
            });
            false
        }
    }
}

/// A failure found outside the queues (an asynchronous event, a verb that failed): recorded
/// (the first is kept) and acted on.
pub(crate) fn fail<Q: Queues>(q: &mut Q, f: Failure) {
    q.core().handle_failure(f);
    run_commands(q);
}

/// A polled receive completion whose buffer came back: the core judges it, and the buffer is
/// delivered or recycled (a grant's, or the peer's close's, note read first). The caller runs
/// the actions.
#[inline]
pub(crate) fn on_recv<Q: Queues>(q: &mut Q, c: &Completion, buf: Q::Buf, byte_len: u32) {
    // Only a flush nothing explains yet asks (an asynchronous event may be waiting to).
    let explained = if c.status == WcStatus::WrFlushErr && q.core().failure().is_none() {
        q.explain_flush()
    } else {
        None
    };
    let clock = q.clock();
    let receipt = q.core().handle_recv(c, || explained, clock);
    q.received(receipt);
    match receipt.action {
        RecvAction::Deliver => q.deliver(buf, byte_len),
        // A grant, or the peer's close (the one recycled message that spent a credit), may
        // carry the peer's note.
        RecvAction::Grant | RecvAction::Recycle => {
            let carries = receipt.action == RecvAction::Grant || receipt.spent_credit;
            if let Some(note) = carries.then(|| q.note_in(&buf, byte_len)).flatten() {
                q.core().note_received(note);
            }
            q.recycle(buf);
        }
    }
}

/// A data message goes out with a credit the caller made sure of ([`Core::may_send`]).
#[inline]
pub(crate) fn send_data<Q: Queues>(
    q: &mut Q,
    solicited: bool,
    inline: bool,
    payload: Q::Payload,
) -> Result<()> {
    if inline {
        q.core().sent_inline();
    }
    let room = q.room();
    let post = q
        .core()
        .data(solicited, room)
        .expect("the caller made sure of a credit and room");
    q.post(payload, post)
}

/// A driver whose queue pair binds memory windows for its peer to read through (a
/// `Connection` and a hub's connection; the simulator exposes no memory).
pub(crate) trait Exposes: Queues {
    /// The endpoint the queue pair is on.
    fn endpoint(&self) -> &Endpoint;

    /// The send queue's depth, once there is a queue pair.
    fn sq_depth(&self) -> Option<usize>;

    /// Waits, as a send does (at most `timeout`), for a credit and for send slots for
    /// `reserve` requests and one more message.
    fn wait_for_send_slots(&mut self, reserve: usize, timeout: Option<Duration>) -> Result<()>;
}

/// Registers `pieces` and, on a device that binds memory windows, binds a window over each
/// on the queue pair (each a signaled request), once there are send slots for them and for
/// the message that names them (which goes next without waiting).
pub(crate) fn expose<Q: Exposes>(
    q: &mut Q,
    pieces: Vec<rdmsg_verbs::Bytes>,
    timeout: Option<Duration>,
) -> Result<Vec<Exposed>> {
    let mut windows = q.endpoint().windows_over(pieces)?;
    if !q.endpoint().binds_windows() {
        return Ok(windows);
    }
    let n = windows.len();
    if let Some(depth) = q.sq_depth() {
        q.core().read_fits(n + 1, depth)?;
    }
    q.wait_for_send_slots(n, timeout)?;
    windows.iter_mut().try_for_each(|w| q.bind(w))?;
    Ok(windows)
}

/// Sends a grant, with the note, if the core says one is due and `room` (what is free now,
/// which a caller that looked already passes on) has space for it; whether it did.
#[inline]
pub(crate) fn grant<Q: Queues>(q: &mut Q, room: Room) -> Result<bool> {
    let Some(post) = q.core().grant(room) else {
        return Ok(false);
    };
    let note = q.note();
    q.post(note, post)?;
    Ok(true)
}

/// Starts a graceful close ending by `deadline`: the close message, carrying the note (the
/// peer's last word from us), after everything sent so far. `Ok(false)` without a credit for
/// it (nothing sent).
pub(crate) fn start_close<Q: Queues>(q: &mut Q, deadline: Instant, now: Instant) -> Result<bool> {
    let Some(post) = q.core().start_close(deadline, now) else {
        return Ok(false);
    };
    let note = q.note();
    q.post(note, post)?;
    let (qp, peer) = q.names();
    trace::close_started(qp, peer);
    Ok(true)
}

/// The core's deadlines that passed by `now` fire; whether any did.
pub(crate) fn fire_timers<Q: Queues>(q: &mut Q, now: Instant) -> bool {
    if !q.core().next_timeout().is_some_and(|at| at <= now) {
        return false;
    }
    q.core().handle_timeout(now);
    run_commands(q);
    true
}

/// What the bootstrap stream brought at `now`.
pub(crate) fn on_stream<Q: Queues>(q: &mut Q, news: StreamNews, now: Instant) {
    q.core().handle_stream(news, now);
    run_commands(q);
}

/// After a failure, while the flushes drain: the core learns how many requests are still to
/// come back; whether the drain is over (every one back, or its deadline passed).
#[inline]
pub(crate) fn drained<Q: Queues>(q: &mut Q, now: Instant) -> bool {
    let outstanding = q.flushes_outstanding();
    q.core().handle_flushed(outstanding, now);
    q.core().is_drained()
}

/// Whether a queue pair's CQs must wake its driver for any completion, not only a solicited
/// receive or an error: while a send waits for a credit or a send slot (`blocked`: any grant,
/// solicited or not, and any send completion must wake it), while the core wants any
/// completion after a refused bounded send, and while the flushes of a failure drain (every
/// flush must wake it: 6.12's rxe fires no solicited-only arm for flushed receives).
#[inline]
pub(crate) fn wakes_for_any(core: &Core, blocked: bool, draining: bool) -> bool {
    blocked || draining || core.wants_any_completion()
}

/// How the receive and send CQs are armed before a sleep: both for the next completion when
/// the driver must wake for any ([`wakes_for_any`]); else the receive CQ as configured and the
/// send CQ as the core says ([`Core::send_arm`]: for the next completion while a signaled send
/// is outstanding).
#[inline]
pub(crate) fn arm_modes(any: bool, recv_arm: ArmMode, send_arm: ArmMode) -> (ArmMode, ArmMode) {
    if any {
        (ArmMode::Next, ArmMode::Next)
    } else {
        (recv_arm, send_arm)
    }
}
