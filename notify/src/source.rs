//! What the waiter needs from a completion queue and a completion channel, implemented for
//! verbs-core's types and for the deterministic [`crate::model`].

use std::os::fd::AsFd;
use std::time::Instant;

use rdmsg_verbs::{CompletionChannel, CompletionQueue, WorkCompletion};

use crate::Result;

/// How a completion queue is armed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArmMode {
    /// The next completion of any kind produces an event.
    Next,
    /// Only a receive completion of a message sent with `IBV_SEND_SOLICITED`, or any
    /// unsuccessful completion, produces an event.
    SolicitedOnly,
}

/// A completion queue as the waiter drives it.
pub trait CompletionSource {
    /// One polled completion.
    type Completion: Default;
    /// Polls up to `out.len()` completions into `out`; returns how many.
    fn poll(&mut self, out: &mut [Self::Completion]) -> Result<usize>;
    /// Arms the queue for one event.
    fn arm(&self, mode: ArmMode) -> Result<()>;
    /// Acknowledges `n` events read for this queue.
    fn ack(&self, n: u32);
}

/// Which of the waiter's queues an event is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventTarget {
    /// The queue at this index of the slice given to [`EventChannel::next_event`].
    Cq(usize),
    /// A queue this waiter does not serve (it stays counted on that queue).
    Foreign,
}

/// Why [`EventChannel::wait_readable`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The completion channel is readable: an event may be pending.
    Events,
    /// Something else the channel also watches is ready (a wake-up pipe, a socket): the waiter
    /// returns to its caller, which decides what that means.
    Other,
    /// The timeout passed.
    TimedOut,
}

/// A completion channel as the waiter drives it.
pub trait EventChannel<Q: CompletionSource> {
    /// Reads the next pending event without blocking; `Ok(None)` when the channel is drained.
    fn next_event(&mut self, cqs: &[Q]) -> Result<Option<EventTarget>>;
    /// Blocks until an event may be pending, something else the implementation watches is
    /// ready, or `deadline` passes (`None`: never). `now` is the caller's time, read before it
    /// began to wait: the sleep is `deadline - now` long and reads no clock of its own (only a
    /// wait a signal interrupted does, to resume with what is left).
    fn wait_readable(&mut self, deadline: Option<Instant>, now: Instant) -> Result<Readiness>;
}

impl CompletionSource for CompletionQueue {
    type Completion = WorkCompletion;

    fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        Ok(CompletionQueue::poll(self, out)?)
    }

    fn arm(&self, mode: ArmMode) -> Result<()> {
        Ok(self.req_notify(mode == ArmMode::SolicitedOnly)?)
    }

    fn ack(&self, n: u32) {
        self.ack_events(n);
    }
}

impl EventChannel<CompletionQueue> for CompletionChannel {
    fn next_event(&mut self, cqs: &[CompletionQueue]) -> Result<Option<EventTarget>> {
        Ok(self.get_event()?.map(|ev| {
            cqs.iter()
                .position(|cq| ev.is_for(cq))
                .map_or(EventTarget::Foreign, EventTarget::Cq)
        }))
    }

    fn wait_readable(&mut self, deadline: Option<Instant>, now: Instant) -> Result<Readiness> {
        Ok(
            if rdmsg_verbs::wait_readable_until(self.as_fd(), deadline, now)? {
                Readiness::Events
            } else {
                Readiness::TimedOut
            },
        )
    }
}
