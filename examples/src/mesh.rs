//! The bookkeeping of the `mesh` example (the cluster workload), kept pure so that it is
//! tested on any machine: what one host sends another, in which order and with which content,
//! and the check of what arrives (loss, duplication, order, content, answers).
//!
//! Every direction between two hosts is one stream: a sequence number per message, counted
//! from 0, over samples (in batches of 8 whose last alone is solicited), queries and alerts;
//! then a `Done` saying how many came before it. Answers to queries travel outside the
//! sequence (a host answers whenever a query arrives, also after its own `Done`) and are
//! checked against the queries still open.

use std::collections::{BTreeSet, HashMap};

/// What the message numbered `seq` of a stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A sample; `last_of_batch` ones are sent solicited, the others not.
    Sample {
        /// The last of its batch of [`BATCH`].
        last_of_batch: bool,
    },
    /// A query: the receiver must answer it.
    Query,
    /// An alert: solicited on its own.
    Alert,
}

/// Samples per batch.
pub const BATCH: u64 = 8;
/// One cycle of a stream: four batches, a query, an alert.
const CYCLE: u64 = 4 * BATCH + 2;

/// The kind of message number `seq` of every stream.
pub fn kind(seq: u64) -> Kind {
    match seq % CYCLE {
        r if r < 4 * BATCH => Kind::Sample {
            last_of_batch: r % BATCH == BATCH - 1,
        },
        r if r == 4 * BATCH => Kind::Query,
        _ => Kind::Alert,
    }
}

/// A mix of the stream and sequence number, from which content is derived (SplitMix64).
fn mix(from: u16, to: u16, seq: u64) -> u64 {
    let mut z = seq
        .wrapping_add(u64::from(from) << 48)
        .wrapping_add(u64::from(to) << 32)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Body of sample `seq` from host `from` to host `to`: 16 to 1000 bytes, none alike.
pub fn body(from: u16, to: u16, seq: u64) -> Vec<u8> {
    let m = mix(from, to, seq);
    let len = 16 + (m % 985) as usize;
    (0..len)
        .map(|i| (m >> ((i % 8) * 8)) as u8 ^ (i as u8).wrapping_mul(31))
        .collect()
}

/// Operands of the query `seq` from `from` to `to`.
pub fn operands(from: u16, to: u16, seq: u64) -> Vec<u64> {
    let m = mix(from, to, seq);
    (0..1 + m % 8)
        .map(|i| m.rotate_left(i as u32 * 7))
        .collect()
}

/// Level of the alert `seq`.
pub fn alert_level(seq: u64) -> u8 {
    (seq % 5) as u8
}

/// What a query's answer must say.
pub fn answer(operands: &[u64]) -> u64 {
    operands.iter().fold(0u64, |a, b| a.wrapping_add(*b))
}

/// How far ahead of what is expected a sequence number may jump before it counts as corrupt
/// rather than as a gap of missing messages (bounds the memory of the gap's record).
pub const MAX_GAP: u64 = 1 << 16;

/// How one arrival was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The next one, intact.
    InOrder,
    /// New, but not the next one (ahead of a gap, or filling one).
    Reordered,
    /// Seen before.
    Duplicated,
    /// Its content or number is wrong (not counted as received).
    Corrupt,
}

/// The check of one incoming stream.
#[derive(Debug, Default, Clone)]
pub struct Inbound {
    /// The number expected next (everything below has arrived, or is in `missing`).
    next: u64,
    /// Numbers below `next` that have not arrived.
    missing: BTreeSet<u64>,
    /// Distinct intact messages received.
    pub received: u64,
    /// Arrivals of a number seen before.
    pub duplicated: u64,
    /// Arrivals out of order.
    pub reordered: u64,
    /// Arrivals with wrong content or an impossible number.
    pub corrupt: u64,
    /// What the sender's `Done` said it sent (arrivals after it are corrupt).
    pub done: Option<u64>,
}

impl Inbound {
    /// Counts message `seq`, whose content checked out or not.
    pub fn arrive(&mut self, seq: u64, intact: bool) -> Arrival {
        let beyond_done = self.done.is_some_and(|d| seq >= d);
        let arrival = if !intact || beyond_done || seq > self.next.saturating_add(MAX_GAP) {
            Arrival::Corrupt
        } else if seq == self.next {
            self.next += 1;
            Arrival::InOrder
        } else if seq > self.next {
            self.missing.extend(self.next..seq);
            self.next = seq + 1;
            Arrival::Reordered
        } else if self.missing.remove(&seq) {
            Arrival::Reordered
        } else {
            Arrival::Duplicated
        };
        match arrival {
            Arrival::InOrder => self.received += 1,
            Arrival::Reordered => {
                self.received += 1;
                self.reordered += 1;
            }
            Arrival::Duplicated => self.duplicated += 1,
            Arrival::Corrupt => self.corrupt += 1,
        }
        arrival
    }

    /// The sender's `Done`: it sent `sent` messages before it. A second `Done`, or one that
    /// says fewer than already arrived, is corrupt.
    pub fn finish(&mut self, sent: u64) {
        if self.done.is_some() || sent < self.next {
            self.corrupt += 1;
        } else {
            self.done = Some(sent);
        }
    }

    /// Messages the `Done` counted that never arrived (`None` before the `Done`).
    pub fn lost(&self) -> Option<u64> {
        self.done.map(|d| d - self.received)
    }
}

/// The queries sent on one stream and their answers.
#[derive(Debug, Default, Clone)]
pub struct Queries {
    open: HashMap<u64, u64>,
    /// Answered correctly.
    pub answered: u64,
    /// Answers to a query not open (answered before, or never asked).
    pub duplicated: u64,
    /// Answers with the wrong result.
    pub wrong: u64,
}

impl Queries {
    /// Query `id` was sent, expecting `expected`.
    pub fn asked(&mut self, id: u64, expected: u64) {
        self.open.insert(id, expected);
    }

    /// An answer to `id` arrived, saying `result`.
    pub fn answer(&mut self, id: u64, result: u64) {
        match self.open.remove(&id) {
            Some(expected) if expected == result => self.answered += 1,
            Some(_) => self.wrong += 1,
            None => self.duplicated += 1,
        }
    }

    /// Queries not answered yet.
    pub fn open(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cycle_is_four_batches_a_query_and_an_alert() {
        let kinds: Vec<Kind> = (0..CYCLE).map(kind).collect();
        let solicited = kinds
            .iter()
            .filter(|k| {
                matches!(
                    k,
                    Kind::Sample {
                        last_of_batch: true
                    }
                )
            })
            .count();
        assert_eq!(solicited, 4);
        assert_eq!(kinds[32], Kind::Query);
        assert_eq!(kinds[33], Kind::Alert);
        assert_eq!(
            kind(CYCLE),
            Kind::Sample {
                last_of_batch: false
            }
        );
    }

    #[test]
    fn bodies_differ_by_stream_and_number() {
        assert_eq!(body(1, 2, 7), body(1, 2, 7));
        assert_ne!(body(1, 2, 7), body(2, 1, 7));
        assert_ne!(body(1, 2, 7), body(1, 2, 8));
        assert!((0..1000).all(|s| (16..=1000).contains(&body(3, 4, s).len())));
    }

    #[test]
    fn in_order_arrivals_lose_nothing() {
        let mut s = Inbound::default();
        for seq in 0..100 {
            assert_eq!(s.arrive(seq, true), Arrival::InOrder);
        }
        s.finish(100);
        assert_eq!(s.lost(), Some(0));
        assert_eq!((s.duplicated, s.reordered, s.corrupt), (0, 0, 0));
    }

    #[test]
    fn gaps_duplicates_and_late_arrivals_are_told_apart() {
        let mut s = Inbound::default();
        s.arrive(0, true);
        assert_eq!(s.arrive(3, true), Arrival::Reordered); // 1 and 2 missing
        assert_eq!(s.arrive(1, true), Arrival::Reordered); // fills the gap
        assert_eq!(s.arrive(1, true), Arrival::Duplicated);
        assert_eq!(s.arrive(3, true), Arrival::Duplicated);
        assert_eq!(s.arrive(4, false), Arrival::Corrupt);
        s.finish(5);
        assert_eq!(s.lost(), Some(2)); // 2 and 4
        assert_eq!(s.arrive(5, true), Arrival::Corrupt); // after Done
        assert_eq!(
            (s.received, s.duplicated, s.reordered, s.corrupt),
            (3, 2, 2, 2)
        );
    }

    #[test]
    fn a_forged_number_far_ahead_is_corrupt_and_costs_no_memory() {
        let mut s = Inbound::default();
        assert_eq!(s.arrive(u64::MAX, true), Arrival::Corrupt);
        assert_eq!(s.arrive(MAX_GAP + 1, true), Arrival::Corrupt);
        assert!(s.missing.is_empty());
        assert_eq!(s.arrive(0, true), Arrival::InOrder);
    }

    #[test]
    fn a_done_that_contradicts_the_stream_is_corrupt() {
        let mut s = Inbound::default();
        (0..10).for_each(|q| {
            s.arrive(q, true);
        });
        s.finish(5);
        assert_eq!((s.done, s.corrupt), (None, 1));
        s.finish(10);
        s.finish(10);
        assert_eq!((s.done, s.corrupt), (Some(10), 2));
    }

    #[test]
    fn answers_are_checked_once_each() {
        let mut q = Queries::default();
        let ops = operands(1, 2, 32);
        q.asked(32, answer(&ops));
        q.asked(66, 5);
        q.answer(32, answer(&ops));
        q.answer(32, answer(&ops));
        q.answer(66, 6);
        q.answer(99, 0);
        assert_eq!((q.answered, q.duplicated, q.wrong, q.open()), (1, 2, 1, 0));
    }
}
