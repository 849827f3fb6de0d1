//! Wake-up statistics.

use std::time::Duration;

/// What a [`crate::Waiter`] did, for tuning and for proving that receivers really sleep.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Times the waiter slept on the channel and woke because it became readable.
    pub wakeups: u64,
    /// Wake-ups after which polling found nothing (the completion had already been drained).
    pub spurious_wakeups: u64,
    /// Times the waiter returned early because something other than the completion channel
    /// became ready (see [`crate::Readiness::Other`]).
    pub external_wakeups: u64,
    /// Completions delivered in all.
    pub completions: u64,
    /// Completions delivered right after a wake-up.
    pub completions_after_wakeup: u64,
    /// Events read from the channel.
    pub events: u64,
    /// Events acknowledged (`ibv_ack_cq_events` counts, not calls).
    pub events_acked: u64,
    /// Calls to `ibv_ack_cq_events`.
    pub ack_calls: u64,
    /// Times a queue was armed.
    pub arms: u64,
    /// Polls that found nothing.
    pub empty_polls: u64,
    /// Time spent blocked on the channel: from the start of each sleep (the time the waiter
    /// was given for it, `Waiter::wait_until`'s `now`, which may include the caller's work in
    /// its turn before the wait) to its wake-up. Sleeps read the clock only when they end.
    pub time_asleep: Duration,
    /// Spins before sleeping ([`crate::Policy::Hybrid`], [`crate::Policy::Adaptive`]).
    pub spins: u64,
    /// Spins that caught a completion (and so spared a sleep).
    pub spins_caught: u64,
}

impl Stats {
    /// Completions per wake-up: how many messages each sleep paid for.
    pub fn completions_per_wakeup(&self) -> f64 {
        if self.wakeups == 0 {
            0.0
        } else {
            self.completions_after_wakeup as f64 / self.wakeups as f64
        }
    }
}
