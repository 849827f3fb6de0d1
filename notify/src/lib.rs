//! Completion-notification policy for rdmsg: receivers that sleep instead of spinning.
//!
//! A [`Waiter`] serves one completion channel and the completion queues reporting to it
//! (normally a connection's receive queue, armed [`ArmMode::SolicitedOnly`], and its send queue,
//! armed [`ArmMode::Next`] so that send errors still wake it: Soft-RoCE does not mark send-side
//! error completions solicited).
//!
//! # Quick start
//!
//! ```no_run
//! use rdmsg_notify::{ArmMode, Policy, Waiter};
//! use rdmsg_verbs::{CompletionChannel, CompletionQueue, Context};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = Context::open("rxe0")?;
//! let channel = CompletionChannel::new(&ctx)?;
//! let recv_cq = CompletionQueue::new(&ctx, 256, Some(&channel))?;
//! // ... create the queue pair with recv_cq, post receives, connect ...
//! let mut waiter = Waiter::new_verbs(channel, Policy::Sleep)?;
//! let recv = waiter.add(recv_cq, ArmMode::SolicitedOnly);
//! loop {
//!     waiter.wait(None, &mut |cq, wc| {
//!         assert_eq!(cq, recv);
//!         println!("{:?}", wc.status()); // hand the buffer back with qp.take_recv(wc)
//!     })?;
//! }
//! # }
//! ```
//!
//! # Arm, drain, wait, re-arm
//!
//! Arming (`ibv_req_notify_cq`) is one-shot and only concerns completions that arrive *after* it:
//! whatever was already queued never produces an event. Like readiness in mio's `Poll`, an event
//! therefore means "look", not "exactly this arrived", and the queue has to be drained every
//! time. The waiter's loop, in this order:
//!
//! 1. **wait** on the channel's fd;
//! 2. **drain the channel**: read events until `EAGAIN` (several may be pending, one per queue);
//! 3. **ack** them in batches (`ibv_ack_cq_events` takes a mutex; every event must be acked
//!    before its queue is destroyed, or the destroy hangs);
//! 4. **re-arm** every queue whose arm an event consumed;
//! 5. **poll until empty**, delivering everything in order.
//!
//! Re-arming *before* the final poll is what makes it race-free: a completion that lands
//! after the poll finds the queue armed and produces an event; one that landed before the arm
//! is found by the poll. Polling first and arming afterwards strands a completion that lands in
//! between, and the receiver sleeps forever (brpc, perftest and UCX all shipped that bug).
//!
//! Syscalls are what a wake-up costs, so [`Waiter::wait`] makes as few as the rule allows:
//! - it first polls what is already queued (no syscall); only if that finds nothing does it
//!   arm and poll (steps 4 and 5), then sleep. A busy receiver makes no syscall per message;
//! - on waking it reads the one event that woke it, re-arms that queue and polls;
//! - sleeping is level-triggered (the channel's fd in `poll`/`epoll`), so an event left unread
//!   ends the next sleep at once: no completion can be stranded by not draining. The drain to
//!   `EAGAIN` (step 2) only spares that wasted wake-up, so it is done before sleeping when a
//!   queue is armed for any completion, where stale events are common; with every queue armed
//!   solicited-only a stale event needs a solicited message landing between re-arm and poll,
//!   too rare to pay a syscall per sleep for.
//!
//! Consequences worth knowing:
//! - **Stale events** are normal: a completion that lands between the re-arm and the poll of
//!   step 5 is delivered by that poll and still leaves an event behind. With a queue armed for
//!   any completion the next wait reads it before sleeping, so it costs no wake-up; on
//!   solicited-only queues it may cost one (counted as spurious). A wake-up that finds nothing to poll (for example
//!   an event for a queue this waiter does not serve) is counted in
//!   [`Stats::spurious_wakeups`] and is harmless.
//! - With solicited-only arming, unsolicited messages sit in the queue until a solicited one (or
//!   an error) arrives; they are then delivered first, in order.
//! - After [`Waiter::step`] returns, sleeping is safe. Event loops register the channel's fd and
//!   call `step` whenever it is readable (and once before the first sleep).
//!
//! # Policies
//!
//! [`Policy::Sleep`] arms and sleeps at once; [`Policy::Poll`] never arms; [`Policy::Hybrid`]
//! spins for a bounded time or number of empty polls before arming and sleeping;
//! [`Policy::Adaptive`] spins only while recent waits were short (about twice as long as they
//! were), probing now and then otherwise, so that one setting serves high and low message
//! rates.
//!
//! # Testing
//!
//! The logic runs against the [`CompletionSource`] and [`EventChannel`] traits, implemented by
//! verbs-core's types and by the deterministic [`model`], which obeys the verbs semantics and
//! flags any sleep that would strand a completion.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod error;
pub mod model;
mod source;
mod stats;
mod waiter;

pub use error::{Error, Result};
pub use source::{ArmMode, CompletionSource, EventChannel, EventTarget, Readiness};
pub use stats::Stats;
pub use waiter::{CqKey, Policy, Waiter, PROBE_EVERY, RECENT_GAPS};

impl Waiter<rdmsg_verbs::CompletionQueue, rdmsg_verbs::CompletionChannel> {
    /// A waiter over a verbs completion channel, switched to non-blocking mode (draining reads
    /// events until `EAGAIN`).
    pub fn new_verbs(channel: rdmsg_verbs::CompletionChannel, policy: Policy) -> Result<Self> {
        channel.set_nonblocking(true)?;
        Ok(Self::new(channel, policy))
    }
}
