//! The time of one turn of a driver.
//!
//! A turn begins when the driver polls or wakes from a wait, or when the application calls
//! in: from then until the next one,
//! every step that needs the time (a deadline, the drain after a failure, the liveness
//! check, how long to sleep) takes it from here, and only the first reads the system clock.
//! A turn that needs no time reads none. This is quinn's `now` argument, made lazy: the core
//! and the driver's sequences ([`crate::drive`]) take `now` as an argument; the drivers hand
//! them this turn's. The rare steps a public call may reach before any turn of its own began
//! (a failed post's drain, a close's linger) read the clock themselves (`Queues::clock`).

use std::cell::Cell;
use std::time::Instant;

/// The time of the current turn, read at most once.
#[derive(Debug, Default)]
pub(crate) struct TurnClock(Cell<Option<Instant>>);

impl TurnClock {
    /// A new turn begins (the driver polled or woke): the next [`TurnClock::now`] reads the
    /// clock.
    #[inline]
    pub(crate) fn new_turn(&self) {
        self.0.set(None);
    }

    /// A new turn begins at `now`, a time the caller read (a wait's wake-up): the turn reads
    /// no clock.
    #[inline]
    pub(crate) fn new_turn_at(&self, now: Instant) {
        self.0.set(Some(now));
    }

    /// Awake after a wait: a new turn, at `woke`, the time the wait's sleep ended, if it slept
    /// (no clock read), else at the next reading.
    #[inline]
    pub(crate) fn after_wait(&self, woke: Option<Instant>) {
        self.0.set(woke);
    }

    /// This turn's time if a step of it has read the clock already.
    #[inline]
    pub(crate) fn read(&self) -> Option<Instant> {
        self.0.get()
    }

    /// This turn's time: the clock, read by the first step of the turn that asks.
    #[inline]
    pub(crate) fn now(&self) -> Instant {
        match self.0.get() {
            Some(now) => now,
            None => {
                let now = Instant::now();
                self.0.set(Some(now));
                now
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_reads_the_clock_once_and_a_new_turn_reads_it_again() {
        let clock = TurnClock::default();
        let first = clock.now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(clock.now(), first, "the same turn");
        clock.new_turn();
        assert!(clock.now() > first, "a new turn reads the clock");
    }

    #[test]
    fn a_turn_begun_at_a_given_time_reads_no_clock() {
        let clock = TurnClock::default();
        assert_eq!(clock.read(), None, "nothing read yet");
        let then = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        clock.new_turn_at(then);
        assert_eq!((clock.read(), clock.now()), (Some(then), then));
        clock.new_turn();
        assert_eq!(clock.read(), None, "a new turn has not read it");
    }
}
