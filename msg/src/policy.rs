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
//! Fragments before the last of a message are never solicited by these rules: the receiver can
//! do nothing with half a message.

/// Tracks unsolicited traffic since the last solicited frame.
#[derive(Debug, Clone)]
pub struct SolicitPolicy {
    max_run: u32,
    max_bytes: usize,
    run: u32,
    bytes: usize,
}

impl SolicitPolicy {
    /// Rules with these bounds (at least 1 each).
    pub fn new(max_run: u32, max_bytes: usize) -> Self {
        Self {
            max_run: max_run.max(1),
            max_bytes: max_bytes.max(1),
            run: 0,
            bytes: 0,
        }
    }

    /// Whether the last (or only) frame of a message must be solicited, given what the
    /// caller asked for.
    pub fn decide(&self, requested: bool) -> bool {
        requested || self.run >= self.max_run || self.bytes >= self.max_bytes
    }

    /// Records a frame as sent.
    pub fn record(&mut self, solicited: bool, bytes: usize) {
        if solicited {
            self.run = 0;
            self.bytes = 0;
        } else {
            self.run += 1;
            self.bytes += bytes;
        }
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
}
