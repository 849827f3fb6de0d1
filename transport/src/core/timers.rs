//! The deadlines of one queue pair's protocol, each with a name: the earliest is what a driver
//! waits for at most ([`TimerTable::next`]); [`TimerTable::expired`] takes those due.

use std::time::Instant;

/// A deadline of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timer {
    /// Our close message must complete by then, or the close failed.
    Close,
    /// The peer said goodbye (or its stream ended): its close message must arrive by then (or,
    /// while we close, ours complete), or it vanished.
    Vanish,
    /// After a failure: the queue pair's posted requests must be flushed back by then, or the
    /// driver stops waiting for them.
    Drain,
    /// The peer's close message arrived before its goodbye: our queue pair stays up until the
    /// goodbye (its close completed, so our acknowledgement reached it) or until then.
    Linger,
    /// The end of a liveness probe interval ([`super::Core::probe_every`]).
    Probe,
}

impl Timer {
    const ALL: [Timer; 5] = [
        Timer::Close,
        Timer::Vanish,
        Timer::Drain,
        Timer::Linger,
        Timer::Probe,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// At most one deadline per [`Timer`].
#[derive(Debug, Clone, Default)]
pub(crate) struct TimerTable {
    at: [Option<Instant>; 5],
}

impl TimerTable {
    pub(crate) fn set(&mut self, timer: Timer, at: Instant) {
        self.at[timer.index()] = Some(at);
    }

    pub(crate) fn stop(&mut self, timer: Timer) {
        self.at[timer.index()] = None;
    }

    pub(crate) fn get(&self, timer: Timer) -> Option<Instant> {
        self.at[timer.index()]
    }

    /// The earliest deadline set.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.at.iter().flatten().min().copied()
    }

    /// Whether a deadline but `but`'s is set.
    pub(crate) fn any_but(&self, but: Timer) -> bool {
        Timer::ALL
            .into_iter()
            .any(|t| t != but && self.get(t).is_some())
    }

    /// Takes the timers due at `now`, earliest first.
    pub(crate) fn expired(&mut self, now: Instant) -> impl Iterator<Item = Timer> {
        let mut due: Vec<(Instant, Timer)> = Timer::ALL
            .into_iter()
            .filter_map(|t| self.get(t).filter(|&at| at <= now).map(|at| (at, t)))
            .collect();
        due.sort_by_key(|&(at, _)| at);
        for &(_, t) in &due {
            self.stop(t);
        }
        due.into_iter().map(|(_, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_earliest_is_next_and_expired_ones_are_taken_once() {
        let t0 = Instant::now();
        let mut t = TimerTable::default();
        assert_eq!(t.next(), None);
        t.set(Timer::Drain, t0 + Duration::from_millis(30));
        t.set(Timer::Close, t0 + Duration::from_millis(10));
        assert_eq!(t.next(), Some(t0 + Duration::from_millis(10)));
        let due: Vec<_> = t.expired(t0 + Duration::from_millis(40)).collect();
        assert_eq!(due, [Timer::Close, Timer::Drain]);
        assert_eq!(t.expired(t0 + Duration::from_secs(1)).count(), 0);
        assert_eq!(t.next(), None);
    }
}
