//! Liveness, one peer host at a time.
//!
//! A hub's connections to one host share that host's device, and what a liveness probe asks
//! (does the peer's device still answer?) has one answer for all of them. So the hub watches
//! hosts, not connections: once every probe interval ([`crate::core::probe_interval`] of
//! `Config::keepalive`) it looks at each host's open connections; if any heard from its peer
//! (a receive, a send it acknowledged, a probe answered) the host is alive. Only a host that
//! was silent for a whole interval gets a probe, one, on one of its connections. A probe
//! still unanswered an interval later (more while an RDMA read of ours is under way) ends
//! that connection as vanished, and makes the host suspect: each of its other connections is
//! then probed on its own and judged at the next interval. A host that answers any of them is
//! alive again.
//!
//! Why not TCP keepalive on every bootstrap stream, as a single connection has: its probes
//! cost a packet each way per connection and interval, whether the host is heard from or not.
//! Ten thousand idle connections from one host made twenty thousand sockets probe every two
//! seconds, which a small (or emulated) machine drops, and a dropped keepalive answer ended
//! live connections as vanished (issue 41). Here an idle hub sends one probe per silent host
//! and interval, and none to a host it hears from.
//!
//! The state machine ([`HostWatch`]) is pure: the hub tallies each host's connections
//! ([`Tally`]) and does what the verdict says (`RawHub::watch_liveness`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdmsg_verbs::Gid;

use super::slots::Phase;
use super::RawHub;
use crate::core::SILENT_INTERVALS_BEHIND;
use crate::error::Failure;
use rdmsg_verbs::deadline_after;

/// Where a peer's device answers: its port's GID (on RoCE, its address) and LID.
pub(super) type HostKey = (Gid, u16);

/// A connection as the liveness watch names it: slot and generation, so that a slot reused
/// by a later connection is not mistaken for the one probed.
pub(super) type Member = (usize, u32);

/// What one host's open connections showed over the last interval.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally {
    /// Any of them heard from its peer.
    pub(super) heard: bool,
    /// The connection carrying the host's probe is still open with the probe out.
    pub(super) probe_out: bool,
    /// A connection that may carry a probe, and whether an RDMA read of ours is under way
    /// on it (one without is preferred: a probe behind a read waits for all its bytes).
    pub(super) candidate: Option<(Member, bool)>,
}

/// What the hub must do for one host after an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing: the host was heard from, its probe still has time, or no connection could
    /// carry one (asked again next interval).
    Nothing,
    /// Post a probe on this connection.
    Probe(Member),
    /// The probe on `prober` went unanswered for its whole allowance: that connection's peer
    /// vanished, and every other connection to the host is probed on its own now.
    Suspect { prober: Member },
    /// The host stayed silent for the interval after [`Verdict::Suspect`]: each of its
    /// connections whose own probe is still out vanished; one without (no room for it then)
    /// is probed now, and the host stays suspect if any was ([`HostWatch::stay_suspect`]).
    JudgeEach,
}

/// The liveness state of one peer host.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct HostWatch {
    /// The connection carrying our probe, and the intervals it may stay unanswered.
    probe: Option<(Member, u8)>,
    /// Intervals since the probe was posted, itself included.
    silent: u8,
    /// Each connection was probed on its own; they are judged at the next interval.
    suspect: bool,
}

impl HostWatch {
    /// An interval ended with `tally`: what to do.
    pub(super) fn tick(&mut self, tally: &Tally) -> Verdict {
        if tally.heard {
            *self = HostWatch::default();
            return Verdict::Nothing;
        }
        if std::mem::take(&mut self.suspect) {
            *self = HostWatch::default();
            return Verdict::JudgeEach;
        }
        if let Some((prober, limit)) = self.probe {
            if tally.probe_out {
                self.silent = self.silent.saturating_add(1);
                if self.silent >= limit {
                    *self = HostWatch {
                        suspect: true,
                        ..HostWatch::default()
                    };
                    return Verdict::Suspect { prober };
                }
                return Verdict::Nothing;
            }
            // The probe's connection ended (a probe failed by the queue pair's retries ends
            // it as vanished), or the post found no room: another carries the next one.
            self.probe = None;
        }
        match tally.candidate {
            Some((member, reading)) => {
                let limit = if reading { SILENT_INTERVALS_BEHIND } else { 2 };
                self.probe = Some((member, limit));
                self.silent = 1;
                Verdict::Probe(member)
            }
            None => Verdict::Nothing,
        }
    }

    /// The connection this host's probe went out on, if one is out.
    pub(super) fn prober(&self) -> Option<Member> {
        self.probe.map(|(m, _)| m)
    }

    /// After [`Verdict::JudgeEach`], some connections could only now be probed: they are
    /// judged at the next interval.
    pub(super) fn stay_suspect(&mut self) {
        self.suspect = true;
    }
}

/// The hub's watch over its peer hosts.
#[derive(Debug, Default)]
pub(super) struct Liveness {
    /// The probe interval (`None`: `Config::keepalive` is off).
    every: Option<Duration>,
    /// When the current interval ends, once a connection is open.
    next: Option<Instant>,
    hosts: HashMap<HostKey, HostWatch>,
}

impl Liveness {
    pub(super) fn new(every: Option<Duration>) -> Self {
        Self {
            every,
            ..Self::default()
        }
    }

    /// A connection opened at `now`: the watch runs from then on, if it did not already.
    pub(super) fn opened(&mut self, now: Instant) {
        if let (Some(every), None) = (self.every, self.next) {
            self.next = Some(deadline_after(now, every));
        }
    }

    /// When the hub must next look (see [`RawHub::watch_liveness`]).
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.next
    }
}

impl RawHub {
    /// At the end of each probe interval: tallies each peer host's open connections and
    /// does what its [`HostWatch`] says. Visits every connection once per interval (seconds),
    /// whatever traffic there was; nothing on the path of a message.
    pub(super) fn watch_liveness(&mut self, now: Instant) {
        let (Some(every), Some(next)) = (self.liveness.every, self.liveness.next) else {
            return;
        };
        if now < next {
            return;
        }
        let hosts = &mut self.liveness.hosts;
        let mut tallies: HashMap<HostKey, Tally> = HashMap::with_capacity(hosts.len());
        for (slot, s) in self.slots.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let Phase::Linked(link) = &s.phase else {
                continue;
            };
            if !s.core.is_open() {
                continue;
            }
            let key = (link.peer.addr.gid, link.peer.addr.lid);
            let member = (slot, s.generation);
            let tally = tallies.entry(key).or_default();
            tally.heard |= s.core.take_heard();
            let probe_out = s.core.probe_out();
            if probe_out && hosts.get(&key).and_then(HostWatch::prober) == Some(member) {
                tally.probe_out = true;
            }
            let reading = s.core.reading();
            if !probe_out && tally.candidate.map_or(true, |(_, r)| r && !reading) {
                tally.candidate = Some((member, reading));
            }
        }
        // Hosts with no open connection left are forgotten.
        hosts.retain(|key, _| tallies.contains_key(key));
        let mut probe = Vec::new();
        let mut each: Vec<(HostKey, Option<Member>)> = Vec::new();
        for (key, tally) in &tallies {
            match hosts.entry(*key).or_default().tick(tally) {
                Verdict::Nothing => {}
                Verdict::Probe((slot, _)) => probe.push(slot),
                Verdict::Suspect { prober } => each.push((*key, Some(prober))),
                Verdict::JudgeEach => each.push((*key, None)),
            }
        }
        for slot in probe {
            self.probe(slot);
        }
        if !each.is_empty() {
            self.judge_each(&each);
        }
        self.liveness.next = Some(deadline_after(now, every));
    }

    /// For the hosts in `each`: after [`Verdict::Suspect`] (with its prober), the prober's
    /// peer vanished and every other connection is probed now; after [`Verdict::JudgeEach`]
    /// (none), a connection whose own probe is still out vanished, one that has none is
    /// probed now and its host stays suspect.
    fn judge_each(&mut self, each: &[(HostKey, Option<Member>)]) {
        let mut vanished = Vec::new();
        let mut probe: Vec<(usize, HostKey)> = Vec::new();
        for (slot, s) in self.slots.iter().enumerate() {
            let Some(s) = s else { continue };
            let Phase::Linked(link) = &s.phase else {
                continue;
            };
            if !s.core.is_open() {
                continue;
            }
            let key = (link.peer.addr.gid, link.peer.addr.lid);
            let Some((_, prober)) = each.iter().find(|(k, _)| *k == key) else {
                continue;
            };
            match prober {
                Some(p) if *p == (slot, s.generation) => vanished.push(slot),
                Some(_) => probe.push((slot, key)),
                None if s.core.probe_out() => vanished.push(slot),
                None => probe.push((slot, key)),
            }
        }
        for slot in vanished {
            self.stats.vanished_by_probe += 1;
            self.fail(slot, Failure::PeerVanished);
        }
        for (slot, key) in probe {
            self.probe(slot);
            let posted = self.slots[slot]
                .as_ref()
                .is_some_and(|s| s.core.probe_out());
            if let (true, Some(w)) = (posted, self.liveness.hosts.get_mut(&key)) {
                w.stay_suspect();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Member = (1, 0);
    const B: Member = (2, 0);

    fn silent(candidate: Option<(Member, bool)>, probe_out: bool) -> Tally {
        Tally {
            heard: false,
            probe_out,
            candidate,
        }
    }

    #[test]
    fn a_host_heard_from_is_never_probed() {
        let mut w = HostWatch::default();
        for _ in 0..10 {
            let t = Tally {
                heard: true,
                probe_out: false,
                candidate: Some((A, false)),
            };
            assert_eq!(w.tick(&t), Verdict::Nothing);
        }
        assert_eq!(w.prober(), None);
    }

    #[test]
    fn a_silent_host_gets_one_probe_and_an_answer_ends_the_watch() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&silent(Some((A, false)), false)), Verdict::Probe(A));
        assert_eq!(w.prober(), Some(A));
        // Answered: the probe's completion is a sign of life.
        let t = Tally {
            heard: true,
            ..Tally::default()
        };
        assert_eq!(w.tick(&t), Verdict::Nothing);
        assert_eq!(w.prober(), None);
    }

    #[test]
    fn a_probe_unanswered_for_an_interval_makes_the_host_suspect_then_each_is_judged() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&silent(Some((A, false)), false)), Verdict::Probe(A));
        assert_eq!(
            w.tick(&silent(Some((B, false)), true)),
            Verdict::Suspect { prober: A }
        );
        assert_eq!(w.tick(&silent(Some((B, false)), false)), Verdict::JudgeEach);
        // Judged: the watch starts over (the survivors are probed again when silent).
        assert_eq!(w.tick(&silent(Some((B, false)), false)), Verdict::Probe(B));
    }

    #[test]
    fn a_suspect_host_that_answers_any_connection_is_alive() {
        let mut w = HostWatch::default();
        w.tick(&silent(Some((A, false)), false));
        w.tick(&silent(Some((B, false)), true));
        let t = Tally {
            heard: true,
            ..Tally::default()
        };
        assert_eq!(w.tick(&t), Verdict::Nothing);
        assert_eq!(w.tick(&silent(Some((B, false)), false)), Verdict::Probe(B));
    }

    #[test]
    fn a_probe_behind_a_read_gets_more_intervals() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&silent(Some((A, true)), false)), Verdict::Probe(A));
        for _ in 2..SILENT_INTERVALS_BEHIND {
            assert_eq!(w.tick(&silent(None, true)), Verdict::Nothing);
        }
        assert_eq!(w.tick(&silent(None, true)), Verdict::Suspect { prober: A });
    }

    #[test]
    fn a_probe_whose_connection_ended_is_sent_again_on_another() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&silent(Some((A, false)), false)), Verdict::Probe(A));
        // A's probe failed by its retries (A ended as vanished) or never got room.
        assert_eq!(w.tick(&silent(Some((B, false)), false)), Verdict::Probe(B));
        assert_eq!(w.prober(), Some(B));
    }

    #[test]
    fn a_host_without_a_connection_able_to_probe_waits() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&silent(None, false)), Verdict::Nothing);
        assert_eq!(w.tick(&silent(Some((A, false)), false)), Verdict::Probe(A));
    }
}
