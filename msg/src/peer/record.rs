//! The delivery record of one peer's sending side: how many of our messages its application
//! has taken, learnt from the count every frame of the peer's carries
//! ([`crate::frame::stamp_taken`]), and copies of the rest when asked to keep them.

use std::collections::VecDeque;

use crate::codec::Envelope;
use crate::error::Unresumable;

/// Most messages a sender leaves unconfirmed: beyond it a send waits for the peer's record.
/// Below 2^15, so that the 16 bits a frame carries name the peer's count without doubt.
pub(crate) const MAX_UNCONFIRMED: u64 = 1 << 14;

/// What the peer's application has taken of the messages sent to it: messages are numbered
/// from 0 in the order they were sent, and `0..taken` were taken (as messages, or as the
/// error that stood in their place at the peer: a read that failed, a frame it dropped).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delivery {
    /// Messages sent (the number the next one will get).
    pub sent: u64,
    /// Messages the peer's application has taken: those numbered below this.
    pub taken: u64,
}

impl Delivery {
    /// Messages sent that the peer's application has not been seen to take.
    pub fn unconfirmed(&self) -> u64 {
        self.sent - self.taken
    }

    /// This record once the peer's count `taken` (modulo 2^16, as its frames and grants carry
    /// it) is known. A count that would be behind ours (written before one we already saw) or
    /// beyond what was sent (a lying peer) changes nothing.
    pub(crate) fn learned(self, taken: u16) -> Self {
        self.ahead_by(u64::from(taken.wrapping_sub(self.taken as u16)))
    }

    /// This record once the peer's count is known in full 32 bits (as its grants and close
    /// carry it): a count behind ours (an old grant's, read again) is never taken for one
    /// 2^16 ahead.
    pub(crate) fn learned_in_full(self, taken: u32) -> Self {
        self.ahead_by(u64::from(taken.wrapping_sub(self.taken as u32)))
    }

    fn ahead_by(self, ahead: u64) -> Self {
        if ahead > self.unconfirmed() {
            return self;
        }
        Self {
            taken: self.taken + ahead,
            ..self
        }
    }
}

/// The books behind [`Delivery`], and the copies kept.
#[derive(Debug)]
pub(crate) struct Record {
    delivery: Delivery,
    /// The `sent` our last request for the record asked about, until the peer's count reaches
    /// it.
    asked: Option<u64>,
    kept: Option<Kept>,
    max_message: usize,
}

/// Copies of the messages not confirmed yet, oldest first, their bytes bounded: one arena of
/// bytes and an index, so that keeping a copy allocates nothing once the arena has grown to
/// what is unconfirmed at most.
#[derive(Debug)]
struct Kept {
    /// Each copy's number, tag and length, oldest first; their bytes follow each other in
    /// `arena` from `start` on.
    copies: VecDeque<(u64, u32, u32)>,
    arena: Vec<u8>,
    start: usize,
    max_bytes: usize,
}

impl Kept {
    /// Bytes kept.
    fn bytes(&self) -> usize {
        self.arena.len() - self.start
    }

    fn push(&mut self, seq: u64, tag: u32, body: &[u8]) {
        if self.copies.is_empty() {
            self.arena.clear();
            self.start = 0;
        }
        self.arena.extend_from_slice(body);
        self.copies.push_back((seq, tag, body.len() as u32));
    }

    /// Drops the copies numbered below `taken`.
    fn drop_below(&mut self, taken: u64) {
        while let Some(&(seq, _, len)) = self.copies.front() {
            if seq >= taken {
                break;
            }
            self.copies.pop_front();
            self.start += len as usize;
        }
        if self.copies.is_empty() {
            self.arena.clear();
            self.start = 0;
            // A large message's copy does not keep its memory for the session's life.
            if self.arena.capacity() > self.max_bytes.min(1 << 20) * 2 {
                self.arena = Vec::new();
            }
        } else if self.start >= 1 << 16 && self.start * 2 >= self.arena.len() {
            // Mostly taken: the rest moves to the front (its bytes at most the half freed).
            self.arena.drain(..self.start);
            self.start = 0;
        }
    }

    /// Every copy, oldest first, as (number, tag, body); the arena is emptied.
    fn take_all(&mut self) -> Vec<(u64, u32, Vec<u8>)> {
        let mut at = self.start;
        let all = self
            .copies
            .drain(..)
            .map(|(seq, tag, len)| {
                let body = self.arena[at..at + len as usize].to_vec();
                at += len as usize;
                (seq, tag, body)
            })
            .collect();
        self.arena.clear();
        self.start = 0;
        all
    }
}

impl Record {
    /// A record keeping copies of up to `keep` bytes of unconfirmed messages (`None`: no
    /// copies); `max_message` bounds what a returned copy decodes to.
    pub(crate) fn new(keep: Option<usize>, max_message: usize) -> Self {
        Self {
            delivery: Delivery::default(),
            asked: None,
            kept: keep.map(|max_bytes| Kept {
                copies: VecDeque::new(),
                arena: Vec::new(),
                start: 0,
                max_bytes,
            }),
            max_message,
        }
    }

    pub(crate) fn delivery(&self) -> Delivery {
        self.delivery
    }

    /// Whether copies of sent messages are kept (the caller then hands one to
    /// [`Record::sent`]).
    pub(crate) fn keeps(&self) -> bool {
        self.kept.is_some()
    }

    /// A message went: message `delivery.sent`, of type `tag`, its encoded body `copy`.
    pub(crate) fn sent(&mut self, tag: u32, copy: Option<&[u8]>) {
        if let (Some(k), Some(body)) = (&mut self.kept, copy) {
            k.push(self.delivery.sent, tag, body);
        }
        self.delivery.sent += 1;
    }

    /// The peer's count, as a frame of its carried it (see [`Delivery::learned`]).
    pub(crate) fn learn(&mut self, taken: u16) {
        self.move_to(self.delivery.learned(taken));
    }

    /// The peer's count in full, as a grant or its close carried it.
    pub(crate) fn learn_in_full(&mut self, taken: u32) {
        self.move_to(self.delivery.learned_in_full(taken));
    }

    fn move_to(&mut self, learned: Delivery) {
        let before = self.delivery.taken;
        self.delivery = learned;
        let d = &self.delivery;
        if d.taken == before {
            return;
        }
        if let Some(k) = &mut self.kept {
            k.drop_below(d.taken);
        }
        if self.asked.is_some_and(|a| d.taken >= a) {
            self.asked = None;
        }
    }

    /// Whether another message may go: fewer than [`MAX_UNCONFIRMED`] unconfirmed, and the
    /// copies within their bound (one message may pass it, so that any message can go).
    pub(crate) fn has_room(&self) -> bool {
        self.delivery.unconfirmed() < MAX_UNCONFIRMED
            && self
                .kept
                .as_ref()
                .map_or(true, |k| k.copies.is_empty() || k.bytes() < k.max_bytes)
    }

    /// How many more messages may go in one frame ([`crate::frame::PACK`]): the window's
    /// room, none while [`Record::has_room`] says no (a frame may pass the copies' bound as
    /// one message may).
    pub(crate) fn room(&self) -> u64 {
        match self.has_room() {
            true => MAX_UNCONFIRMED - self.delivery.unconfirmed(),
            false => 0,
        }
    }

    /// The number to ask the peer about ([`crate::frame::ASK`]), once half the room is used
    /// and no request is outstanding: the peer answers once its application took everything
    /// sent so far, long before a sender streaming at full speed runs out of room.
    pub(crate) fn ask_due(&mut self) -> Option<u32> {
        let half_used = self.delivery.unconfirmed() >= MAX_UNCONFIRMED / 2
            || self
                .kept
                .as_ref()
                .is_some_and(|k| k.bytes() >= k.max_bytes / 2);
        (half_used && self.asked.is_none()).then(|| self.ask_now())
    }

    /// Asks about everything sent so far (a close waiting for the record), unless that is
    /// asked already or nothing is unconfirmed.
    pub(crate) fn ask_all(&mut self) -> Option<u32> {
        let d = self.delivery;
        (d.unconfirmed() > 0 && self.asked != Some(d.sent)).then(|| self.ask_now())
    }

    fn ask_now(&mut self) -> u32 {
        self.asked = Some(self.delivery.sent);
        self.delivery.sent as u32
    }

    /// Rewinds to the peer's count `taken` of our messages (in full 32 bits, as its resume
    /// carries it) after the connection was lost: the copies of the messages it has not
    /// taken come out, oldest first, as (tag, body), and the next number is `taken` again,
    /// so that sending them anew gives each the number it had. The count must lie between
    /// what the peer told us before and what we sent: one behind means a peer whose numbers
    /// are gone (it restarted), one beyond a peer that is confused or lying. Without copies
    /// nothing can go again.
    pub(crate) fn rewind(&mut self, taken: u32) -> Result<Vec<(u32, Vec<u8>)>, Unresumable> {
        let d = self.delivery;
        let ahead = u64::from(taken.wrapping_sub(d.taken as u32));
        if ahead > d.unconfirmed() {
            let behind = (d.taken as u32).wrapping_sub(taken);
            return Err(match behind < 1 << 31 {
                true => Unresumable::PeerRestarted {
                    known: d.taken,
                    peer: taken,
                },
                false => Unresumable::BeyondSent {
                    sent: d.sent,
                    peer: taken,
                },
            });
        }
        if self.kept.is_none() {
            return Err(Unresumable::NoCopies);
        }
        self.move_to(Delivery {
            taken: d.taken + ahead,
            ..d
        });
        let k = self.kept.as_mut().expect("checked");
        if k.copies.len() as u64 != self.delivery.unconfirmed() {
            // Some were handed back already (`take_unconfirmed`): they cannot go again.
            return Err(Unresumable::NoCopies);
        }
        let copies = k
            .take_all()
            .into_iter()
            .map(|(_, tag, body)| (tag, body))
            .collect();
        self.delivery.sent = self.delivery.taken;
        self.asked = None;
        Ok(copies)
    }

    /// The copies of the messages not confirmed, in order (none if none are kept), given up by
    /// the record.
    pub(crate) fn take_unconfirmed(&mut self) -> Vec<Envelope> {
        let Some(k) = &mut self.kept else {
            return Vec::new();
        };
        let max = self.max_message;
        k.take_all()
            .into_iter()
            .map(|(seq, tag, body)| Envelope::returned(tag, seq as u32, body, max))
            .collect()
    }
}

/// What a failed connection's delivery record says of the calls that went over it.
#[derive(Debug, Default)]
pub(crate) struct LostCalls {
    /// How many of our messages the peer's application took (modulo 2^32).
    pub(crate) taken: u32,
    /// The calls whose requests were still in the outbox.
    pub(crate) unsent: Vec<u64>,
    /// Nothing went to the peer (its handshake failed).
    pub(crate) nothing_went: bool,
}

impl LostCalls {
    /// What became of call `id`'s request, which went as message `seq` (`None`: not known to
    /// have gone).
    pub(crate) fn fate(&self, id: u64, seq: Option<u32>) -> crate::RequestFate {
        use crate::RequestFate::*;
        if self.nothing_went || self.unsent.contains(&id) {
            return NotSent;
        }
        match seq {
            Some(seq) if (self.taken.wrapping_sub(seq.wrapping_add(1)) as i32) >= 0 => Taken,
            _ => Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_follows_the_peer_through_wrapping_and_ignores_stale_or_false_counts() {
        let mut r = Record::new(Some(1 << 20), 1 << 20);
        for i in 0..70_500u64 {
            r.sent(7, Some(&[i as u8; 3]));
            if i % 1000 == 999 {
                r.learn((i + 1) as u16);
            }
        }
        assert_eq!(r.delivery().taken, 70_000);
        let before = r.delivery();
        r.learn(5); // stale: written long before
        r.learn((before.taken + 1) as u16 ^ 0x8000); // beyond what was sent
        assert_eq!(r.delivery(), before);
        let back = r.take_unconfirmed();
        assert_eq!(back.len(), 500);
        assert_eq!(back[0].seq(), 70_000);
        assert_eq!(back[0].tag(), 7);
        assert_eq!(back[0].body(), &[70_000u64 as u8; 3]);
    }

    #[test]
    fn an_old_grant_note_read_again_confirms_nothing() {
        // Traffic both ways: frames move the count on while the last grant's note stays.
        let mut r = Record::new(None, 64);
        let stale = 5u32;
        for _ in 0..65_536 {
            r.sent(1, None);
            let next = r.delivery().taken + 1;
            r.learn(next as u16);
        }
        for _ in 0..10_000 {
            r.sent(1, None);
        }
        let before = r.delivery();
        // Its low 16 bits would pass for 5 messages ahead of 65,536; all 32 do not.
        assert!(
            before.learned(stale as u16) != before,
            "the flaw of 16 bits"
        );
        r.learn_in_full(stale);
        assert_eq!(r.delivery(), before);
        r.learn_in_full(before.taken as u32 + 7);
        assert_eq!(r.delivery().taken, before.taken + 7);
    }

    #[test]
    fn copies_share_one_arena_that_a_large_one_does_not_keep_grown() {
        let mut r = Record::new(Some(16 << 20), 16 << 20);
        for i in 0..100u8 {
            r.sent(1, Some(&[i; 10]));
        }
        r.learn(60);
        let k = r.kept.as_ref().unwrap();
        assert_eq!((k.copies.len(), k.bytes()), (40, 400));
        r.sent(2, Some(&vec![9; 3 << 20]));
        r.learn(101);
        let k = r.kept.as_ref().unwrap();
        assert_eq!(k.bytes(), 0);
        assert_eq!(
            k.arena.capacity(),
            0,
            "the large copy's memory went with it"
        );
        // What is left comes back whole and in order after a rewind.
        r.sent(3, Some(b"abc"));
        r.sent(4, Some(b"de"));
        let back = r.rewind(101).unwrap();
        assert_eq!(back, [(3, b"abc".to_vec()), (4, b"de".to_vec())]);
        assert_eq!(
            r.delivery(),
            Delivery {
                sent: 101,
                taken: 101
            }
        );
    }

    #[test]
    fn room_runs_out_at_the_window_or_the_copies_bound_and_asks_at_half() {
        let mut r = Record::new(None, 64);
        let mut asked = None;
        for _ in 0..MAX_UNCONFIRMED {
            assert!(r.has_room());
            r.sent(1, None);
            if let Some(a) = r.ask_due() {
                assert!(asked.is_none(), "one request at a time");
                asked = Some(a);
            }
        }
        assert_eq!(asked, Some((MAX_UNCONFIRMED / 2) as u32));
        assert!(!r.has_room());
        r.learn((MAX_UNCONFIRMED / 2) as u16);
        assert!(r.has_room());
        assert!(r.ask_due().is_some(), "still half used: asks again");

        let mut k = Record::new(Some(100), 64);
        k.sent(1, Some(&[0; 60]));
        assert!(k.has_room());
        assert_eq!(k.ask_due(), Some(1));
        k.sent(1, Some(&[0; 60]));
        assert!(!k.has_room(), "copies past their bound");
        assert_eq!(k.ask_all(), Some(2));
        assert_eq!(k.ask_all(), None, "asked already");
        k.learn(2);
        assert!(k.has_room());
        assert!(k.take_unconfirmed().is_empty());
    }
}
