//! When the transport must solicit although the caller did not ask, so that a receiver asleep
//! solicited-only never leaves a backlog unread for long. After brpc's rules:
//!
//! - more than `max_run` unsolicited messages in a row (default: a quarter of the peer's
//!   credit window): the next one is solicited;
//! - more than `max_bytes` unsolicited bytes in a row (default 64 KiB): likewise;
//! - an explicit [`crate::Session::flush`] solicits a payload-less frame if anything went
//!   unsolicited since the last solicited one ("the send queue drained");
//! - credit grants a blocked peer waits on, and the message spending the last credit, are
//!   solicited by the transport itself.
//!
//! - with a `max_delay` (see [`crate::SessionConfig::max_unsolicited_delay`]): the first
//!   message sent once that long has passed since the oldest unsolicited one is solicited, and
//!   [`SolicitPolicy::deadline`] tells a session when to flush if nothing is sent by then.
//!
//! Fragments before the last of a message are never solicited by these rules: the receiver can
//! do nothing with half a message.

use std::time::{Duration, Instant};

/// Whether a message goes solicited when several threads or tasks share one session or hub:
/// when its sender asks (`requested`), and when another thread or task is asleep on it
/// (`others_waiting`) unless unsolicited sends may wait within a bound (`delays`, see
/// [`crate::SessionConfig::max_unsolicited_delay`]: the session's own flush deadline then
/// wakes the sleeper). A sleeper solicited-only would otherwise not see the message until
/// something solicited came. The one rule; [`crate::Session::solicit_for`] and
/// [`crate::Hub::solicit_for`] apply it.
pub fn solicit_for(requested: bool, others_waiting: bool, delays: bool) -> bool {
    requested || (others_waiting && !delays)
}

/// Tracks unsolicited traffic since the last solicited frame.
#[derive(Debug, Clone)]
pub struct SolicitPolicy {
    max_run: u32,
    max_bytes: usize,
    max_delay: Option<Duration>,
    run: u32,
    bytes: usize,
    /// When the oldest frame of the current unsolicited run went (kept only with a
    /// `max_delay`, so that the default reads no clock).
    since: Option<Instant>,
}

impl SolicitPolicy {
    /// Rules with these bounds (at least 1 each).
    pub fn new(max_run: u32, max_bytes: usize) -> Self {
        Self {
            max_run: max_run.max(1),
            max_bytes: max_bytes.max(1),
            max_delay: None,
            run: 0,
            bytes: 0,
            since: None,
        }
    }

    /// The same rules, plus a bound on how long an unsolicited frame may wait for a
    /// solicited one behind it.
    pub fn with_max_delay(mut self, max_delay: Option<Duration>) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// The bound on how long an unsolicited frame may wait, if any.
    pub fn max_delay(&self) -> Option<Duration> {
        self.max_delay
    }

    /// Whether the last (or only) frame of a message must be solicited, given what the
    /// caller asked for.
    pub fn decide(&self, requested: bool) -> bool {
        let late = || self.deadline().is_some_and(|d| Instant::now() >= d);
        requested || self.run >= self.max_run || self.bytes >= self.max_bytes || late()
    }

    /// Records a frame as sent.
    pub fn record(&mut self, solicited: bool, bytes: usize) {
        self.record_at(solicited, bytes, Instant::now);
    }

    /// [`SolicitPolicy::record`] with the clock given (read only when needed).
    pub fn record_at(&mut self, solicited: bool, bytes: usize, now: impl FnOnce() -> Instant) {
        if solicited {
            self.run = 0;
            self.bytes = 0;
            self.since = None;
        } else {
            if self.run == 0 && self.max_delay.is_some() {
                self.since = Some(now());
            }
            self.run += 1;
            self.bytes += bytes;
        }
    }

    /// With a `max_delay`, when what went unsolicited must be flushed at the latest.
    pub fn deadline(&self) -> Option<Instant> {
        self.since?.checked_add(self.max_delay?)
    }

    /// Whether anything went unsolicited since the last solicited frame.
    pub fn pending(&self) -> bool {
        self.run > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_solicited_when_asked_or_when_another_sleeps_without_a_delay_bound() {
        assert!(solicit_for(true, false, false));
        assert!(solicit_for(true, true, true), "asked: always");
        assert!(
            solicit_for(false, true, false),
            "another sleeps: it must wake"
        );
        assert!(
            !solicit_for(false, true, true),
            "the delay bound's flush wakes it instead"
        );
        assert!(!solicit_for(false, false, false));
    }

    #[test]
    fn forces_after_a_run_or_a_byte_count() {
        let mut p = SolicitPolicy::new(3, 1000);
        for _ in 0..3 {
            assert!(!p.decide(false));
            p.record(false, 10);
        }
        assert!(p.decide(false), "fourth in a row");
        p.record(true, 10);
        assert!(!p.pending());
        p.record(false, 1000);
        assert!(p.decide(false), "byte bound reached");
        assert!(p.decide(true));
    }

    #[test]
    fn a_delay_bound_dates_the_oldest_unsolicited_frame_only() {
        let t0 = Instant::now();
        let mut p = SolicitPolicy::new(100, 1 << 20);
        p.record_at(false, 10, || t0);
        assert_eq!(p.deadline(), None, "no bound, no deadline, no clock");
        let mut p = SolicitPolicy::new(100, 1 << 20).with_max_delay(Some(Duration::from_secs(60)));
        p.record_at(false, 10, || t0);
        p.record_at(false, 10, || t0 + Duration::from_secs(5));
        assert_eq!(
            p.deadline(),
            Some(t0 + Duration::from_secs(60)),
            "the oldest counts"
        );
        assert!(!p.decide(false), "not late yet");
        p.record_at(true, 0, || unreachable!("a solicited frame reads no clock"));
        assert_eq!(p.deadline(), None);
        let mut p = SolicitPolicy::new(100, 1 << 20).with_max_delay(Some(Duration::ZERO));
        p.record_at(false, 10, Instant::now);
        assert!(
            p.decide(false),
            "past the bound: the next message is solicited"
        );
    }
}
