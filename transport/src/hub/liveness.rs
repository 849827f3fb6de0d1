//! Liveness, one peer host at a time.
//!
//! A hub's connections to one host share that host's device, and what a liveness probe asks
//! (does the peer's device still answer?) has one answer for all of them. So the hub watches
//! hosts, not connections. Once every probe interval ([`crate::core::probe_interval`] of
//! `Config::keepalive`) `RawHub::watch_liveness` polls its queues and looks at every open
//! connection:
//! - **Each connection** is judged by what of its own is out: a probe, or a signaled send, that
//!   a live peer's device answers. One still unanswered an interval after the one it went in
//!   (six while an RDMA read of ours is under way) ends that connection as vanished
//!   (`Core::silence_tick`), whether its host is heard from or not.
//! - **Each host** none of whose connections was heard from in the interval (a receive, a send
//!   acknowledged, a probe answered) and none of which has anything out gets one probe, on one
//!   connection. A host heard from gets none, however many connections it has, but for one
//!   probe per interval to the connection that went longest without being heard from (after
//!   [`ROTATE_AFTER`] intervals): so a connection that died on a live host (its peer rebooted
//!   and came back, say) is found too, in time.
//! - **A silent host** one of whose connections went unanswered is suspect: [`SAMPLE`] more of
//!   its connections are probed; when they too go unanswered, every connection to it ends as
//!   vanished at once. A host that answers any of them is alive. So a dead host's connections
//!   end within about four thirds of the keepalive, with at most `1 + SAMPLE` probes in its
//!   send CQ entries, not one per connection.
//!
//! Why not TCP keepalive on every bootstrap stream, as a single connection has: its probes
//! cost a packet each way per connection and interval, whether the host is heard from or not.
//! Ten thousand idle connections from one host made twenty thousand sockets probe every two
//! seconds, which a small (or emulated) machine drops, and a dropped keepalive answer ended
//! live connections as vanished (issue 41).
//!
//! The host's state machine ([`HostWatch`]) is pure: the hub tallies each host's connections
//! ([`Tally`]) and does what the verdict says.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdmsg_verbs::deadline_after;

use super::slots::{HostKey, Resources};
use super::RawHub;
use crate::error::{Failure, Result};

/// A connection as the liveness watch names it: slot and generation, so that a slot reused
/// by a later connection is not mistaken for the one probed.
pub(super) type Member = (usize, u32);

/// More connections of a suspect host probed before all of it is judged gone.
pub(super) const SAMPLE: usize = 2;

/// Intervals a connection of a host heard from may go unheard before it is probed on its
/// own (one such probe per host and interval).
pub(super) const ROTATE_AFTER: u32 = 3;

/// Connections kept as probe candidates per host and interval.
const CANDIDATES: usize = 4;

/// What one host's open connections showed over the last interval.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally {
    /// Any of them heard from its peer.
    pub(super) heard: bool,
    /// Connections with a request of ours out (a probe or a signaled send), still within
    /// their allowance: they will be judged by it.
    pub(super) pending: usize,
    /// Connections whose request went unanswered for its whole allowance (the hub ends them
    /// as vanished).
    pub(super) vanished: usize,
    /// Connections with nothing out that may carry a probe, those with no read under way
    /// first (a probe behind a read waits for all its bytes): a few (the first `count`).
    pub(super) candidates: [Member; CANDIDATES],
    pub(super) count: usize,
    /// The connection with nothing out that went longest unheard, and for how many intervals.
    pub(super) quietest: Option<(Member, u32)>,
}

impl Tally {
    fn candidate(&mut self, member: Member, reading: bool) {
        if self.count == CANDIDATES {
            return;
        }
        if reading {
            self.candidates[self.count] = member;
        } else {
            self.candidates.copy_within(..self.count, 1);
            self.candidates[0] = member;
        }
        self.count += 1;
    }

    /// The probe candidates, best first.
    pub(super) fn candidates(&self) -> &[Member] {
        &self.candidates[..self.count]
    }
}

/// What the hub must do for one host after an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing more: heard from, or judged by what is already out.
    Nothing,
    /// Probe this many of the candidates (the first that have room).
    Probe(usize),
    /// Heard from: probe the connection that went longest unheard.
    Rotate(Member),
    /// Every connection to the host ends as vanished.
    AllGone,
}

/// The liveness state of one peer host.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct HostWatch {
    /// Its connections that went unanswered since it was last heard from.
    vanished: usize,
}

impl HostWatch {
    /// An interval ended with `tally`: what to do.
    pub(super) fn tick(&mut self, tally: &Tally) -> Verdict {
        if tally.heard {
            *self = HostWatch::default();
            return match tally.quietest {
                Some((member, quiet)) if quiet >= ROTATE_AFTER => Verdict::Rotate(member),
                _ => Verdict::Nothing,
            };
        }
        self.vanished += tally.vanished;
        if self.vanished == 0 {
            // Silent: what is out will say; with nothing out, one probe asks.
            return if tally.pending > 0 {
                Verdict::Nothing
            } else {
                Verdict::Probe(1)
            };
        }
        if self.vanished > SAMPLE {
            return Verdict::AllGone;
        }
        // Suspect: sample more of its connections (those already out count).
        match (1 + SAMPLE - self.vanished).saturating_sub(tally.pending) {
            0 => Verdict::Nothing,
            n => Verdict::Probe(n),
        }
    }
}

/// The hub's watch over its peer hosts.
#[derive(Debug, Default)]
pub(super) struct Liveness {
    /// The probe interval (`None`: `Config::keepalive` is off).
    every: Option<Duration>,
    /// When the current interval ends, while any connection is open.
    next: Option<Instant>,
    hosts: HashMap<HostKey, HostWatch>,
    /// Scratch of each interval's look, kept (with its room) from one to the next: a watch
    /// that allocates as it looks would show as allocations per message (`cost-check`).
    tallies: HashMap<HostKey, Tally>,
    vanished: Vec<usize>,
    probes: Vec<(Tally, usize)>,
    all_gone: Vec<HostKey>,
}

/// Hosts (and connections to judge) the watch has room for before it first looks.
const ROOM: usize = 8;

impl Liveness {
    pub(super) fn new(every: Option<Duration>) -> Self {
        Self {
            every,
            next: None,
            hosts: HashMap::with_capacity(ROOM),
            tallies: HashMap::with_capacity(ROOM),
            vanished: Vec::with_capacity(ROOM),
            probes: Vec::with_capacity(ROOM),
            all_gone: Vec::with_capacity(ROOM),
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
    /// At the end of each probe interval: polls the queues (an answer already here is not
    /// mistaken for silence), then tallies each peer host's open connections and does what
    /// its [`HostWatch`] says. Visits every connection once per interval (seconds), whatever
    /// the traffic; nothing on the path of a message.
    pub(super) fn watch_liveness(&mut self, now: Instant) -> Result<()> {
        let (Some(every), Some(next)) = (self.liveness.every, self.liveness.next) else {
            return Ok(());
        };
        if now < next {
            return Ok(());
        }
        self.poll_now()?;
        let mut tallies = std::mem::take(&mut self.liveness.tallies);
        let mut vanished = std::mem::take(&mut self.liveness.vanished);
        let mut probes = std::mem::take(&mut self.liveness.probes);
        let mut all_gone = std::mem::take(&mut self.liveness.all_gone);
        tallies.clear();
        for (slot, s) in self.table.slots.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let Resources::Linked(link) = &s.resources else {
                continue;
            };
            if !s.core.is_open() {
                continue;
            }
            let member = (slot, s.generation);
            let tally = tallies.entry(link.host).or_default();
            let heard = s.core.take_heard();
            let (silence, quiet) = s.core.silence_tick(heard);
            tally.heard |= heard;
            if silence >= s.core.silence_limit() {
                tally.vanished += 1;
                vanished.push(slot);
            } else if s.core.awaits_answer() {
                tally.pending += 1;
            } else {
                tally.candidate(member, s.core.reading());
                if tally.quietest.map_or(true, |(_, q)| quiet > q) {
                    tally.quietest = Some((member, quiet));
                }
            }
        }
        let hosts = &mut self.liveness.hosts;
        hosts.retain(|key, _| tallies.contains_key(key));
        for (key, tally) in &tallies {
            match hosts.entry(*key).or_default().tick(tally) {
                Verdict::Nothing => {}
                Verdict::Probe(n) => probes.push((*tally, n)),
                Verdict::Rotate(member) => {
                    let mut one = Tally::default();
                    one.candidate(member, false);
                    probes.push((one, 1));
                }
                Verdict::AllGone => all_gone.push(*key),
            }
        }
        if !all_gone.is_empty() {
            for (slot, s) in self.table.slots.iter().enumerate() {
                if let Some(Resources::Linked(link)) = s.as_ref().map(|s| &s.resources) {
                    if all_gone.contains(&link.host) && !vanished.contains(&slot) {
                        vanished.push(slot);
                    }
                }
            }
        }
        for &slot in &vanished {
            if self.table.slots[slot]
                .as_ref()
                .is_some_and(|s| s.core.is_open())
            {
                self.stats.vanished_by_probe += 1;
                self.fail(slot, Failure::PeerVanished);
            }
        }
        for (tally, mut n) in probes.drain(..) {
            for &(slot, generation) in tally.candidates() {
                if n == 0 {
                    break;
                }
                let same = self.table.slots[slot]
                    .as_ref()
                    .is_some_and(|s| s.generation == generation && s.core.is_open());
                if same && self.probe(slot) {
                    n -= 1;
                }
                if self.table.slots[slot].is_some() {
                    self.do_commands(slot);
                }
            }
        }
        // Ticks go on while a connection is open (`opened` starts them again).
        self.liveness.next = (!tallies.is_empty()).then(|| deadline_after(now, every));
        vanished.clear();
        all_gone.clear();
        self.liveness.tallies = tallies;
        self.liveness.vanished = vanished;
        self.liveness.probes = probes;
        self.liveness.all_gone = all_gone;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Member = (1, 0);
    const B: Member = (2, 0);

    fn tally(heard: bool, pending: usize, vanished: usize) -> Tally {
        let mut t = Tally {
            heard,
            pending,
            vanished,
            ..Tally::default()
        };
        t.candidate(A, false);
        t.candidate(B, true);
        t
    }

    #[test]
    fn a_host_heard_from_is_not_probed_but_its_longest_unheard_connection_in_turn() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&tally(true, 0, 0)), Verdict::Nothing);
        let mut t = tally(true, 0, 0);
        t.quietest = Some((B, ROTATE_AFTER - 1));
        assert_eq!(w.tick(&t), Verdict::Nothing);
        t.quietest = Some((B, ROTATE_AFTER));
        assert_eq!(w.tick(&t), Verdict::Rotate(B));
    }

    #[test]
    fn a_silent_host_gets_one_probe_unless_something_of_ours_is_out() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&tally(false, 0, 0)), Verdict::Probe(1));
        // The probe is out: it will say.
        assert_eq!(w.tick(&tally(false, 1, 0)), Verdict::Nothing);
        // Answered.
        assert_eq!(w.tick(&tally(true, 0, 0)), Verdict::Nothing);
        // A send of ours out to a silent host says as much as a probe.
        assert_eq!(w.tick(&tally(false, 3, 0)), Verdict::Nothing);
    }

    #[test]
    fn a_silent_host_whose_connection_went_unanswered_is_sampled_then_judged_whole() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&tally(false, 0, 0)), Verdict::Probe(1));
        // The probe's connection went unanswered: sample more.
        assert_eq!(w.tick(&tally(false, 0, 1)), Verdict::Probe(SAMPLE));
        // Those went unanswered too: every connection is gone.
        assert_eq!(w.tick(&tally(false, 0, SAMPLE)), Verdict::AllGone);
    }

    #[test]
    fn samples_already_out_count_and_an_answer_clears_the_suspicion() {
        let mut w = HostWatch::default();
        assert_eq!(w.tick(&tally(false, 1, 1)), Verdict::Probe(SAMPLE - 1));
        assert_eq!(w.tick(&tally(false, SAMPLE, 0)), Verdict::Nothing);
        // One answered: alive; the count starts over.
        assert_eq!(w.tick(&tally(true, 0, 1)), Verdict::Nothing);
        assert_eq!(w.tick(&tally(false, 0, 0)), Verdict::Probe(1));
    }

    #[test]
    fn candidates_without_a_read_under_way_come_first() {
        let mut t = Tally::default();
        t.candidate(A, true);
        t.candidate(B, false);
        assert_eq!(t.candidates(), &[B, A]);
        for i in 0..10 {
            t.candidate((10 + i, 0), false);
        }
        assert_eq!(t.candidates().len(), CANDIDATES);
    }
}
