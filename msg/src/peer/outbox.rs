//! One peer's outbox: messages handed over without waiting (a hub's [`crate::Hub::post`],
//! answers given on other threads for a session or a hub) that go, in order, as the peer's
//! credits come. One bound ([`crate::SessionConfig::max_outbox_bytes`]) and one behaviour when
//! full, for every front end: a message that does not fit is refused, never dropped in
//! silence (a post gets it back with [`crate::Posted::Full`], an answer becomes "no answer"),
//! and the front end is told when half the bound is free again.

use std::collections::VecDeque;
use std::fmt;

use serde::Serialize;

use crate::{Message, Result};

use super::{Encode, PeerIo, SendSide};

/// A message owned by an outbox, sent later by the thread that drives the peer.
pub(crate) trait Outgoing: Send + fmt::Debug {
    /// The message to encode, with its solicitation.
    fn encoding(&self) -> (&dyn Encode, bool);
    /// Its encoded length (what it holds, roughly).
    fn size(&self) -> usize;
    /// The call it is the request of, if it is one: the call learns its number when it goes.
    fn call_id(&self) -> Option<u64> {
        None
    }
}

/// Encoded length of `m` (bincode's standard configuration, as frames use), without encoding
/// it anywhere.
pub(crate) fn encoded_len<M: Serialize>(m: &M) -> usize {
    let mut size = bincode::enc::write::SizeWriter::default();
    match bincode::serde::encode_into_writer(m, &mut size, bincode::config::standard()) {
        Ok(()) => size.bytes_written,
        Err(_) => 0,
    }
}

/// A message of the application's, owned by an outbox.
pub(crate) struct Owned<M> {
    pub(crate) m: M,
    pub(crate) solicited: bool,
}

impl<M> fmt::Debug for Owned<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(std::any::type_name::<M>())
    }
}

impl<M: Message + Send> Outgoing for Owned<M> {
    fn encoding(&self) -> (&dyn Encode, bool) {
        (&self.m, self.solicited)
    }
    fn size(&self) -> usize {
        encoded_len(&self.m)
    }
}

/// A call's request, owned by an outbox ([`crate::Hub::try_start_call`]).
pub(crate) struct CallRequest<M> {
    pub(crate) owned: Owned<M>,
    pub(crate) id: u64,
}

impl<M> fmt::Debug for CallRequest<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "call {} ({:?})", self.id, self.owned)
    }
}

impl<M: Message + Send> Outgoing for CallRequest<M> {
    fn encoding(&self) -> (&dyn Encode, bool) {
        self.owned.encoding()
    }
    fn size(&self) -> usize {
        self.owned.size()
    }
    fn call_id(&self) -> Option<u64> {
        Some(self.id)
    }
}

/// A peer's outbox ([`crate::Hub::post`], answers waiting to go).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxStats {
    /// Messages waiting now.
    pub messages: usize,
    /// Their encoded bytes.
    pub bytes: usize,
    /// The most bytes it has held.
    pub peak_bytes: usize,
    /// Messages queued in all (sent at once: not counted).
    pub queued: u64,
    /// Posts refused for want of room.
    pub refused: u64,
    /// Messages dropped: answers refused for want of room, what could not be encoded or
    /// sent for a reason of its own, and what was still waiting when the peer failed or a
    /// close ran out of time.
    pub dropped: u64,
}

impl OutboxStats {
    pub(crate) fn add(&mut self, o: &OutboxStats) {
        self.messages += o.messages;
        self.bytes += o.bytes;
        self.peak_bytes = self.peak_bytes.max(o.peak_bytes);
        self.queued += o.queued;
        self.refused += o.refused;
        self.dropped += o.dropped;
    }
}

/// One message waiting.
#[derive(Debug)]
struct Entry {
    msg: Box<dyn Outgoing>,
    /// Its encoded length.
    size: usize,
    /// Counted dropped already (a "no answer" in a refused answer's place): not again.
    counted: bool,
}

/// Messages waiting for one peer's credits, in order, within one bound.
#[derive(Debug)]
pub(crate) struct Outbox {
    queue: VecDeque<Entry>,
    max_bytes: usize,
    stats: OutboxStats,
    /// Something was refused: the front end is told once half the bound is free.
    refused: bool,
    /// Calls whose requests went, with their numbers, for the front end's call table
    /// ([`Outbox::take_calls_sent`]).
    calls_sent: Vec<(u64, u32)>,
    /// Calls whose requests were dropped from here unsent (a close that ran out of time).
    calls_cleared: Vec<u64>,
}

impl Outbox {
    pub(crate) fn new(max_bytes: usize) -> Self {
        Self {
            queue: VecDeque::new(),
            max_bytes,
            stats: OutboxStats::default(),
            refused: false,
            calls_sent: Vec::new(),
            calls_cleared: Vec::new(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(crate) fn stats(&self) -> OutboxStats {
        self.stats
    }

    /// Whether `size` more bytes fit (one message always fits an empty outbox).
    pub(crate) fn has_room(&self, size: usize) -> bool {
        self.queue.is_empty() || self.stats.bytes + size <= self.max_bytes
    }

    /// Queues `msg` (room checked by the caller); whether the outbox was empty before.
    pub(crate) fn push(&mut self, msg: Box<dyn Outgoing>, size: usize) -> bool {
        self.push_entry(msg, size, false)
    }

    /// An answer found no room: it is counted dropped, and `no_answer` ("no answer" to its
    /// call, a few bytes) goes past the bound in its place, so that the caller learns at
    /// once; whether the outbox was empty before.
    pub(crate) fn refuse_answer(&mut self, no_answer: Box<dyn Outgoing>) -> bool {
        self.stats.dropped += 1;
        let size = no_answer.size();
        self.push_entry(no_answer, size, true)
    }

    /// Queues an answer given on another thread: as it is if it fits, else "no answer" in its
    /// place ([`Outbox::refuse_answer`], `no_answer` makes it). Whether it went in as it is,
    /// and whether the outbox was empty before.
    pub(crate) fn push_answer(
        &mut self,
        answer: Box<dyn Outgoing>,
        no_answer: impl FnOnce() -> Box<dyn Outgoing>,
    ) -> (bool, bool) {
        let size = answer.size();
        if self.has_room(size) {
            (true, self.push(answer, size))
        } else {
            (false, self.refuse_answer(no_answer()))
        }
    }

    fn push_entry(&mut self, msg: Box<dyn Outgoing>, size: usize, counted: bool) -> bool {
        let was_empty = self.queue.is_empty();
        self.queue.push_back(Entry { msg, size, counted });
        let s = &mut self.stats;
        s.messages += 1;
        s.bytes += size;
        s.peak_bytes = s.peak_bytes.max(s.bytes);
        s.queued += 1;
        was_empty
    }

    /// A message was refused for want of room.
    pub(crate) fn refuse(&mut self) {
        self.stats.refused += 1;
        self.refused = true;
    }

    /// Whether the front end should now say there is room: something was refused and half
    /// the bound is free (said once per refusal).
    pub(crate) fn take_writable(&mut self) -> bool {
        let writable = self.refused && self.stats.bytes <= self.max_bytes / 2;
        self.refused &= !writable;
        writable
    }

    /// Sends, in order, what can go now without waiting: how many it dropped. A message
    /// failing for a reason of its own (too large, not encodable, memory that cannot be
    /// registered) is dropped and counted; a failed connection stops it, the message kept,
    /// and its error is returned.
    /// Messages that waited together go packed, several to a frame, as far as they fit
    /// ([`SendSide::try_send_packed`]).
    pub(crate) fn send_ready(&mut self, send: &mut SendSide, io: &mut impl PeerIo) -> Result<u64> {
        while self.queue.len() >= 2 {
            let packed = match send.try_send_packed(io, self.queue.iter().map(|e| e.msg.encoding()))
            {
                Ok(packed) => packed,
                Err(e) if io.failed() => return Err(e),
                // A committed message's own error: the messages here go one by one.
                Err(_) => 0,
            };
            if packed == 0 {
                break;
            }
            // The frame was the last to go: its messages' numbers end just before the next.
            let first = send.next_seq().wrapping_sub(packed as u32);
            for (i, entry) in self.queue.drain(..packed).enumerate() {
                if let Some(id) = entry.msg.call_id() {
                    self.calls_sent.push((id, first.wrapping_add(i as u32)));
                }
                self.stats.messages -= 1;
                self.stats.bytes -= entry.size;
            }
        }
        self.send_in_order(send, io, true, |send, io, e, solicited| {
            send.try_send_as(io, e, solicited)
        })
    }

    /// Before a close: commits everything, in order, without waiting (what cannot go now is
    /// encoded and queued behind, as [`SendSide::commit_as`] does), so that the close's
    /// drain sends it within its deadline and counts what found no room
    /// ([`crate::Error::Unsent`]); how many it dropped, as [`Outbox::send_ready`].
    pub(crate) fn commit_all(&mut self, send: &mut SendSide, io: &mut impl PeerIo) -> Result<u64> {
        // Whether a committed message went, and under which number, is not known here: calls
        // committed so say nothing of their numbers (their fate is then not known).
        self.send_in_order(send, io, false, |send, io, e, solicited| {
            send.commit_as(io, e, solicited).map(|()| true)
        })
    }

    /// Sends (`one`) each message in order; with `numbered`, `one` sends nothing before the
    /// message, so a message that went is the last to have gone: a call learns its number.
    fn send_in_order<I: PeerIo>(
        &mut self,
        send: &mut SendSide,
        io: &mut I,
        numbered: bool,
        mut one: impl FnMut(&mut SendSide, &mut I, &dyn Encode, bool) -> Result<bool>,
    ) -> Result<u64> {
        let mut dropped = 0;
        let mut failed = None;
        while let Some(entry) = self.queue.front() {
            if numbered {
                // Committed messages go first, so that what moves the numbers below is this
                // message alone.
                match send.send_committed(io) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) if io.failed() => {
                        failed = Some(e);
                        break;
                    }
                    // A committed message failed alone (dropped and counted): the next.
                    Err(_) => continue,
                }
            }
            let (e, solicited) = entry.msg.encoding();
            let before = send.next_seq();
            let sent = one(send, io, e, solicited);
            let went = send.next_seq() != before;
            if let Some(id) = entry.msg.call_id().filter(|_| went && numbered) {
                self.calls_sent.push((id, send.next_seq().wrapping_sub(1)));
            }
            match sent {
                Ok(true) => {}
                Ok(false) => break,
                // It went, then the connection failed (or something after it did): it is
                // sent, its fate the record's.
                Err(e) if went => {
                    if io.failed() {
                        failed = Some(e);
                        self.stats.messages -= 1;
                        self.stats.bytes -= entry.size;
                        self.queue.pop_front();
                        break;
                    }
                }
                Err(e) if io.failed() => {
                    failed = Some(e);
                    break;
                }
                // Not counted twice: a "no answer" in a refused answer's place was counted
                // when it was queued.
                Err(_) => dropped += u64::from(!entry.counted),
            }
            self.stats.messages -= 1;
            self.stats.bytes -= entry.size;
            self.queue.pop_front();
        }
        self.stats.dropped += dropped;
        match failed {
            Some(e) => Err(e),
            None => Ok(dropped),
        }
    }

    /// The calls whose requests went since last asked, with their numbers.
    pub(crate) fn take_calls_sent(&mut self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.calls_sent.drain(..)
    }

    /// The calls whose requests wait here, or were dropped from here, unsent.
    pub(crate) fn calls_waiting(&self) -> Vec<u64> {
        let waiting = self.queue.iter().filter_map(|e| e.msg.call_id());
        self.calls_cleared.iter().copied().chain(waiting).collect()
    }

    /// Drops everything waiting (the peer failed, or a close ran out of time): how many. The
    /// calls among them stay listed unsent ([`Outbox::calls_waiting`]).
    pub(crate) fn clear(&mut self) -> usize {
        let cleared = self.queue.iter().filter_map(|e| e.msg.call_id());
        self.calls_cleared.extend(cleared);
        let n = self.queue.drain(..).filter(|e| !e.counted).count();
        self.stats.messages = 0;
        self.stats.bytes = 0;
        self.stats.dropped += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Note {
        n: u32,
    }
    crate::message!(Note);

    fn note(n: u32) -> (Box<dyn Outgoing>, usize) {
        let m = Owned {
            m: Note { n },
            solicited: false,
        };
        let size = m.size();
        (Box::new(m), size)
    }

    #[test]
    fn one_bound_one_message_always_fits_and_room_is_said_at_half() {
        let (m, size) = note(1);
        let mut outbox = Outbox::new(2 * size);
        // Even a message larger than the bound fits an empty outbox.
        assert!(Outbox::new(0).has_room(size));
        assert!(outbox.push(m, size), "was empty");
        let (m, _) = note(2);
        assert!(outbox.has_room(size));
        assert!(!outbox.push(m, size));
        assert!(!outbox.has_room(size), "full at the bound");
        outbox.refuse();
        assert!(!outbox.take_writable(), "no room yet");
        assert_eq!(outbox.clear(), 2);
        assert!(outbox.take_writable(), "half free: said once");
        assert!(!outbox.take_writable());
        let s = outbox.stats();
        assert_eq!(
            (s.messages, s.bytes, s.queued, s.refused, s.dropped),
            (0, 0, 2, 1, 2)
        );
        assert_eq!(s.peak_bytes, 2 * size);
    }
}
