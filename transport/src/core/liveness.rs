//! The core's watch of the peer's liveness: probes when a whole interval passed unheard, and
//! the silent intervals a hub's liveness watch counts.

use std::time::{Duration, Instant};

use super::*;

impl Core {
    /// Probes the peer for liveness from `now` on: whenever a whole interval of `every` passes
    /// without a sign of life from it (a receive, or a send it acknowledged), [`Command::Probe`],
    /// so that a live peer's device gives one. A second such interval in a row with the probe
    /// unanswered (the sixth, while an RDMA read of ours is under way), or a probe failed by the
    /// queue pair's retries, fails the connection with [`Failure::PeerVanished`]. For
    /// connections without a bootstrap stream whose keepalive would tell (rdma_cm's).
    pub(crate) fn probe_every(&mut self, every: Duration, now: Instant) {
        self.probe_every = Some(every);
        self.timers.set(Timer::Probe, deadline_after(now, every));
    }

    /// Probes (if on) only from `from` on: the first interval starts then, not earlier.
    pub(crate) fn probes_from(&mut self, from: Instant) {
        if let Some(every) = self.probe_every {
            self.timers.set(Timer::Probe, deadline_after(from, every));
        }
    }

    /// Whether the peer showed a sign of life (a receive, a send it acknowledged) since this
    /// was last asked, for a driver that judges liveness itself: a hub watches each peer
    /// host once, not each connection (see `hub::liveness`). Asking clears it.
    #[inline]
    pub(crate) fn take_heard(&mut self) -> bool {
        std::mem::take(&mut self.heard)
    }

    /// Whether the connection is open for liveness to be watched: linked, neither closing
    /// nor failed (a close and a failure have their own deadlines).
    #[inline]
    pub(crate) fn is_open(&self) -> bool {
        self.state == State::Linked
    }

    /// Whether a request of ours a live peer's device answers is out: a probe, or a signaled
    /// send (whose completion also retires the unsignaled ones before it).
    #[inline]
    pub(crate) fn awaits_answer(&self) -> bool {
        self.probe_wr.is_some() || self.last_signaled.is_some()
    }

    /// For a driver that judges liveness itself, once per probe interval with what
    /// [`Core::take_heard`] said: intervals in a row that a request of ours stayed unanswered
    /// (0 once the peer is heard from, or nothing is out), and intervals since the peer was
    /// last heard from. A probe counts from the interval it was posted in.
    pub(crate) fn silence_tick(&mut self, heard: bool) -> (u8, u32) {
        if heard {
            self.silent_intervals = 0;
            self.quiet_intervals = 0;
        } else {
            self.quiet_intervals = self.quiet_intervals.saturating_add(1);
            self.silent_intervals = if self.awaits_answer() {
                self.silent_intervals.saturating_add(1)
            } else {
                0
            };
        }
        (self.silent_intervals, self.quiet_intervals)
    }

    /// Intervals a request of ours may stay unanswered before the peer is gone: one probe
    /// interval after the one it went in, six while an RDMA read of ours is under way.
    pub(crate) fn silence_limit(&self) -> u8 {
        if self.last_read.is_some() {
            SILENT_INTERVALS_BEHIND
        } else {
            2
        }
    }

    /// Whether an RDMA read of ours is under way: a probe behind it completes only once all
    /// its bytes have come, so it gets [`SILENT_INTERVALS_BEHIND`] intervals, not one.
    #[inline]
    pub(crate) fn reading(&self) -> bool {
        self.last_read.is_some()
    }

    /// The liveness probe [`Command::Probe`] asked for was posted as `wr_id` (signaled).
    #[inline]
    pub(crate) fn probe_posted(&mut self, wr_id: u64) {
        self.stats.probes += 1;
        self.probe_wr = Some(wr_id);
        // Its interval counts: unanswered at the end of the next, the peer is gone.
        self.silent_intervals = self.silent_intervals.max(1);
        self.last_signaled = Some(wr_id);
        // Signaled: its completion retires the unsignaled sends before it.
        self.unsignaled = 0;
    }

    /// `IBV_EVENT_QP_LAST_WQE_REACHED` came for the queue pair.
    pub(crate) fn last_wqe_reached(&mut self) {
        self.last_wqe = true;
    }
}
