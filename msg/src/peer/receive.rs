//! The receiving side of one peer: the decoder, messages kept in their order, rendezvous
//! reads waiting, posted and done, acknowledgements each way.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmsg_transport::{Arrival, Buffer, ReadDone, ReadPost, ReadSegment};

use crate::codec::{Decoded, Decoder, Envelope, FrameBytes};
use crate::frame::{self};
use crate::rendezvous::{Descriptor, ReadBuf, ReadPool, Segment};
use crate::trace::trace_event;
use crate::{Message, Result};

use super::*;

/// The receiving side of one connection: its decoder (reassembly, registered tags), the
/// rendezvous reads under way, and the receive counters of [`SessionStats`]. Messages come
/// out in their sequence order, a message being read holding back those after it.
#[derive(Debug)]
pub(crate) struct RecvSide {
    pub(super) decoder: Decoder,
    pub(super) received: u64,
    /// Frames that arrived: receive buffers the peer spent ([`SessionStats::frames_received`]).
    pub(super) frames_received: u64,
    pub(super) dropped_frames: u64,
    pub(super) rendezvous_received: u64,
    /// Bodies of the messages received, in bytes ([`SessionStats::bytes_received`]).
    pub(super) bytes_received: u64,
    /// A hub's wake-ups that brought frames of this peer ([`SessionStats::wakeups`]), and the
    /// hub's wake-up count when the last one came ([`RecvSide::woken`]).
    pub(super) wakeups: u64,
    pub(super) last_wakeup: u64,
    /// Messages (or the errors of dropped frames) in order; some still being read.
    pub(super) order: VecDeque<Place>,
    /// Descriptors whose reads are not posted yet (no buffer room, or no send slot).
    pub(super) waiting: VecDeque<WaitingRead>,
    /// Reads posted: read id → (seq, tag, length, the buffer's size).
    pub(super) reading: std::collections::HashMap<u64, (u32, u32, usize, usize)>,
    /// Our reads that finished: their senders are to be told.
    pub(super) acks: Vec<u32>,
    /// The peer's acknowledgements of our messages, for the sender.
    pub(super) acked: Vec<u32>,
    pub(super) pool: ReadPool,
    /// The peer's messages our application has taken, modulo 2^32: the count our frames
    /// carry back ([`frame::stamp_taken`]).
    pub(super) taken: u32,
    /// The peer asked to be told once `taken` reaches this ([`frame::ASK`]).
    pub(super) ask: Option<u32>,
    /// It has: a frame is to go, solicited, to say so.
    pub(super) answer_due: bool,
    /// The latest count of ours the peer's frames carried, for the sender.
    pub(super) peer_taken: Option<u16>,
    /// Frames that came while the head of the order waits for room to be read into, or
    /// while a new fragmented message found no reassembly budget: kept as they came, unread,
    /// holding their receive buffers and so the peer's credits (the peer stops when they run
    /// out), until the head moves. Memory held for a peer is bounded by what it was granted.
    pub(super) parked: VecDeque<FrameBytes>,
    /// A hub's budget for the messages its peers have in reassembly (none for a session).
    pub(super) budget: Option<ReassemblyBudget>,
    /// Our reservation of the budget, for the message being reassembled.
    pub(super) reserved: usize,
    /// Our place in the budget's line while a message waits for room.
    pub(super) ticket: Option<u64>,
    /// The message in reassembly as last seen by [`RecvSide::handle_timeout`] (tag, seq,
    /// bytes received) and when: its progress deadline runs from then.
    pub(super) watch: Option<((u32, u32, usize), Instant)>,
    /// Suspended for a resume ([`RecvSide::reset_for_resume`]): what the old connection
    /// still brings is dropped (it comes again on the new one), until the resume.
    pub(crate) paused: bool,
    /// The application holds as much of this peer's messages as it may
    /// ([`SessionConfig::max_held_bytes`](crate::SessionConfig::max_held_bytes)): frames of
    /// new messages are parked, as behind a head that waits, until it takes some.
    pub(super) held_back: bool,
}

/// A message's place in the order: its sequence number (when the frame said it) and the
/// message, or the error standing in its place; or a message still being read.
#[derive(Debug)]
pub(super) enum Place {
    Ready(Option<u32>, Result<Envelope>),
    Reading(u32),
}

#[derive(Debug)]
pub(super) struct WaitingRead {
    pub(super) seq: u32,
    pub(super) tag: u32,
    pub(super) descriptor: Descriptor,
}

/// Most messages a receiver reads at once (the queue pair keeps up to 16 reads in flight).
pub(super) const MAX_READS_POSTED: usize = 8;

/// Most descriptors a receiver keeps waiting for room: an honest sender's are bounded by its
/// own room; beyond this one is refused (and acknowledged).
pub(super) const MAX_WAITING_READS: usize = 1024;

impl RecvSide {
    pub(crate) fn new(decoder: Decoder, pool: ReadPool) -> Self {
        Self {
            decoder,
            received: 0,
            frames_received: 0,
            dropped_frames: 0,
            rendezvous_received: 0,
            bytes_received: 0,
            wakeups: 0,
            last_wakeup: u64::MAX,
            order: VecDeque::new(),
            waiting: VecDeque::new(),
            reading: std::collections::HashMap::new(),
            acks: Vec::new(),
            acked: Vec::new(),
            pool,
            taken: 0,
            ask: None,
            answer_due: false,
            peer_taken: None,
            parked: VecDeque::new(),
            budget: None,
            reserved: 0,
            ticket: None,
            watch: None,
            paused: false,
            held_back: false,
        }
    }

    /// What a read buffer given back on another thread wakes (the connection's waker: a
    /// resumed session's new one).
    pub(crate) fn set_pool_waker(&self, waker: rdmsg_transport::Waker) {
        self.pool.set_waker(waker);
    }

    /// This receiver with its fragmented messages counted against a hub's `budget`.
    pub(crate) fn with_budget(mut self, budget: ReassemblyBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    pub(crate) fn register<M: Message>(&mut self) -> Result<()> {
        self.decoder.register::<M>()
    }

    /// Whether frames of new messages are to be parked, holding their receive buffers and
    /// so the peer's credits (see [`RecvSide::parked`]): while the application holds as much
    /// of this peer's messages as it may. A message under way in fragments still finishes
    /// (one message more, bounded by `max_message`); acknowledgements are taken as ever.
    /// Turned off, the parked frames are taken in by the next [`RecvSide::advance`].
    pub(crate) fn hold_back(&mut self, on: bool) {
        self.held_back = on;
    }

    /// The decoder (its registered types).
    pub(crate) fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// A frame of this peer's is taken after the hub's `wakeup`-th wake-up
    /// ([`rdmsg_transport::RawHub::wakeups`]): counted once per wake-up.
    pub(crate) fn woken(&mut self, wakeup: u64) {
        if self.last_wakeup != wakeup {
            self.last_wakeup = wakeup;
            self.wakeups += 1;
        }
    }

    /// Time passed (`now` never goes backwards): a message in reassembly that got no fragment
    /// since the hub's budget's timeout ([`crate::HubLimits::reassembly_timeout`]) is dropped,
    /// [`crate::Error::ReassemblyTimedOut`] in its place, its reservation returned. Its
    /// deadline runs from the first call that saw it as it is now, so the owner calls this
    /// after taking frames in and at [`RecvSide::poll_timeout`]. Nothing for a receiver
    /// without a budget (a session's).
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        let Some(timeout) = self.budget.as_ref().map(ReassemblyBudget::timeout) else {
            return;
        };
        let Some(seen) = self.decoder.partial() else {
            self.watch = None;
            return;
        };
        if !self.parked.is_empty() {
            // Its next fragments may be among the frames we hold back ourselves: its clock
            // starts again once they are taken in.
            self.watch = None;
            return;
        }
        match self.watch {
            Some((before, since)) if before == seen => {
                if now.saturating_duration_since(since) >= timeout {
                    self.expire(timeout);
                }
            }
            _ => self.watch = Some((seen, now)),
        }
    }

    /// When [`RecvSide::handle_timeout`] should next be called: the progress deadline of the
    /// message in reassembly (it may have moved on since; a call then finds out).
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let timeout = self.budget.as_ref()?.timeout();
        let (_, since) = self.watch.filter(|_| self.decoder.in_progress())?;
        since.checked_add(timeout)
    }

    /// Whether a message is being reassembled (see [`RecvSide::handle_timeout`]).
    pub(crate) fn reassembling(&self) -> bool {
        self.decoder.in_progress()
    }

    /// Drops the message in reassembly, its sender stalled: its error takes its place.
    fn expire(&mut self, after: Duration) {
        self.watch = None;
        let Some((tag, seq, received)) = self.decoder.abandon_partial() else {
            return;
        };
        trace_event!(WARN, seq, tag, bytes = received, "reassembly timed out");
        self.drop_frame(
            Some(seq),
            crate::Error::ReassemblyTimedOut {
                tag,
                seq,
                received,
                after,
            },
        );
        self.release_budget();
    }

    /// Takes what a connection handed out.
    pub(crate) fn accept(&mut self, a: Arrival) {
        match a {
            Arrival::Message(m) => self.arrive(FrameBytes::Received(m)),
            Arrival::Read(r) => self.read_done(r),
        }
    }

    /// Takes a frame in ([`RecvSide::take_in`]) without taking the next message out. While the head of the order
    /// waits for read room, frames of messages are parked (see [`RecvSide::parked`]);
    /// acknowledgements and requests for the record are taken at once.
    pub(crate) fn arrive(&mut self, frame: FrameBytes) {
        self.frames_received += 1;
        let header = frame::parse(frame.bytes()).ok().map(|(h, _)| h);
        if header.is_some() {
            self.peer_taken = frame::taken_of(frame.bytes());
        }
        let control = header.is_some_and(|h| h.flags & (frame::DONE | frame::ASK) != 0);
        if !control && (!self.parked.is_empty() || self.must_park(frame.bytes())) {
            self.parked.push_back(frame);
            return;
        }
        self.take_in(frame, header);
    }

    /// Whether a frame must wait: the head of the order waits for room, the application
    /// holds all it may of this peer's messages (a message under way excepted), or it starts
    /// a fragmented message for which the hub's budget has no room, or whose turn has not
    /// come (see [`ReassemblyBudget`]). Otherwise a first fragment reserves what its message
    /// announces.
    fn must_park(&mut self, frame: &[u8]) -> bool {
        if self.head_waits() || (self.held_back && !self.decoder.in_progress()) {
            if let Some(b) = &self.budget {
                // Not ready to take a turn: others go first.
                b.leave(&mut self.ticket);
            }
            return true;
        }
        if self.budget.is_none() {
            return false;
        }
        let (h, need) = match frame::parse(frame) {
            Ok((h, body)) if h.flags & frame::RNDV == 0 => {
                (h, frame::announced_total(h.flags, body))
            }
            _ => return false,
        };
        let Some(need) = need.map(|n| n as usize) else {
            return false;
        };
        if need > self.decoder.max_message() {
            // Refused when taken in, nothing reserved.
            return false;
        }
        if self.reserved > 0 {
            // A new message before the last one ended: that one lost its tail (reported as
            // the decoder would), and the new one waits for room like any other.
            self.release_budget_now();
            if self.decoder.abandon_partial().is_some() {
                let e = frame::FrameError::OutOfOrder {
                    seq: h.seq,
                    frag: h.frag,
                };
                self.drop_frame(Some(h.seq), e.into());
            }
        }
        let Some(budget) = &self.budget else {
            return false;
        };
        if !budget.try_reserve(&mut self.ticket, need) {
            return true;
        }
        self.reserved = need;
        false
    }

    /// Whether the head of the order is a message whose read waits for buffer room or a send
    /// slot (not one being read: that ends soon, one way or the other).
    fn head_waits(&self) -> bool {
        match (self.order.front(), self.waiting.front()) {
            (Some(Place::Reading(head)), Some(w)) => w.seq == *head,
            _ => false,
        }
    }

    /// Takes in parked frames, in order, as far as nothing makes them wait again.
    fn unpark(&mut self) {
        while let Some(f) = self.parked.pop_front() {
            if self.must_park(f.bytes()) {
                self.parked.push_front(f);
                return;
            }
            let header = frame::parse(f.bytes()).ok().map(|(h, _)| h);
            self.take_in(f, header);
        }
    }

    /// Gives back the budget once no message is being reassembled.
    fn release_budget(&mut self) {
        if self.reserved > 0 && !self.decoder.in_progress() {
            self.release_budget_now();
        }
    }

    fn release_budget_now(&mut self) {
        if let Some(b) = &self.budget {
            b.release(self.reserved);
        }
        self.reserved = 0;
    }

    fn take_in(&mut self, frame: FrameBytes, header: Option<frame::Header>) {
        match self.decoder.take(frame) {
            Ok(Decoded::Message(env)) => {
                self.received += 1;
                self.bytes_received += env.body().len() as u64;
                self.order.push_back(Place::Ready(Some(env.seq()), Ok(env)));
            }
            Ok(Decoded::Packed(packed)) => {
                for (seq, env) in self.decoder.unpack(&packed) {
                    match env {
                        Ok(env) => {
                            self.received += 1;
                            self.bytes_received += env.body().len() as u64;
                            self.order.push_back(Place::Ready(Some(seq), Ok(env)));
                        }
                        Err(e) => {
                            self.dropped_frames += 1;
                            self.order.push_back(Place::Ready(Some(seq), Err(e)));
                        }
                    }
                }
            }
            Ok(Decoded::Nothing) => {}
            Ok(Decoded::Done(seqs)) => self.acked.extend(seqs),
            Ok(Decoded::Ask(through)) => {
                self.ask = Some(through);
                self.check_ask();
            }
            Ok(Decoded::Rendezvous {
                tag,
                seq,
                descriptor,
            }) => self.on_descriptor(tag, seq, descriptor),
            Err(e) => {
                // A descriptor refused is acknowledged all the same: its sender frees it.
                let descriptor_seq = header.filter(|h| h.flags & frame::RNDV != 0).map(|h| h.seq);
                self.acks.extend(descriptor_seq);
                self.drop_frame(message_seq(header), e);
            }
        }
        self.release_budget();
    }

    pub(super) fn drop_frame(&mut self, seq: Option<u32>, e: crate::Error) {
        self.dropped_frames += 1;
        self.order.push_back(Place::Ready(seq, Err(e)));
    }

    /// Our application took the peer's message `seq` (or the error in its place): the count
    /// our frames carry moves on, and a request of the peer's it reaches is to be answered.
    pub(crate) fn mark_taken(&mut self, seq: u32) {
        let next = seq.wrapping_add(1);
        if (next.wrapping_sub(self.taken) as i32) > 0 {
            self.taken = next;
        }
        self.check_ask();
    }

    fn check_ask(&mut self) {
        if let Some(through) = self.ask {
            if (through.wrapping_sub(self.taken) as i32) <= 0 {
                self.ask = None;
                self.answer_due = true;
            }
        }
    }

    /// The count of the peer's messages our application took (modulo 2^32).
    pub(crate) fn taken(&self) -> u32 {
        self.taken
    }

    /// Whether a request of the peer's is answered by now (once).
    pub(crate) fn take_answer_due(&mut self) -> bool {
        std::mem::take(&mut self.answer_due)
    }

    /// The latest count of our messages the peer took, as its last frame carried it.
    pub(crate) fn take_peer_taken(&mut self) -> Option<u16> {
        self.peer_taken.take()
    }

    pub(super) fn on_descriptor(&mut self, tag: u32, seq: u32, descriptor: Descriptor) {
        let len = descriptor.total as usize;
        let max = self.decoder.max_message();
        if len > max {
            trace_event!(WARN, seq, tag, bytes = len, max, "rendezvous read refused");
            self.acks.push(seq);
            return self.drop_frame(Some(seq), crate::Error::TooLarge { len, max });
        }
        if len > self.pool.max() {
            // Beyond what we announced we read (`Config::max_read_bytes`): the peer should
            // have sent it in fragments.
            self.acks.push(seq);
            let e = frame::FrameError::Rendezvous("larger than the reads this side announced");
            return self.drop_frame(Some(seq), e.into());
        }
        if self.waiting.len() >= MAX_WAITING_READS {
            trace_event!(
                WARN,
                seq,
                tag,
                bytes = len,
                waiting = self.waiting.len(),
                "rendezvous read refused"
            );
            self.acks.push(seq);
            let e = frame::FrameError::Rendezvous("too many messages waiting to be read");
            return self.drop_frame(Some(seq), e.into());
        }
        self.order.push_back(Place::Reading(seq));
        self.waiting.push_back(WaitingRead {
            seq,
            tag,
            descriptor,
        });
    }

    /// Posts the reads of waiting descriptors, as far as buffer room and send slots allow,
    /// and takes in the frames parked behind a head that no longer waits.
    pub(crate) fn advance(&mut self, link: &mut impl PeerIo) -> Result<()> {
        loop {
            self.post_reads(link)?;
            let parked = self.parked.len();
            self.unpark();
            if self.parked.len() == parked || !self.has_waiting() {
                return Ok(());
            }
        }
    }

    fn post_reads(&mut self, link: &mut impl PeerIo) -> Result<()> {
        while let Some(w) = self.waiting.front() {
            if self.reading.len() >= MAX_READS_POSTED {
                // Enough to keep the link busy; more would only register more buffers.
                return Ok(());
            }
            let len = w.descriptor.total as usize;
            let in_flight = self.reading.values().map(|r| r.3).sum();
            if !self.pool.within_share(in_flight, len) {
                // Beyond this peer's part of a pool other peers read into too: once one of its
                // reads ends.
                return Ok(());
            }
            let mut buf = match self.pool.acquire(len, |n| link.register(n)) {
                Ok(Some(buf)) => buf,
                Ok(None) => return Ok(()),
                Err(source) => {
                    // No memory to read it into (a registration refused, say by
                    // RLIMIT_MEMLOCK): this message is refused alone, and acknowledged so
                    // that its sender frees it; the connection and the next message go on.
                    let (seq, tag) = (w.seq, w.tag);
                    trace_event!(WARN, seq, tag, bytes = len, error = %source, "rendezvous read refused");
                    self.waiting.pop_front();
                    self.acks.push(seq);
                    self.fill(seq, Err(crate::Error::ReadRefused { tag, seq, source }));
                    continue;
                }
            };
            let mut segments = Vec::new();
            let mut at = 0;
            for seg in &w.descriptor.segments {
                match seg {
                    Segment::Inline(v) => {
                        buf.as_mut_slice()[at..at + v.len()].copy_from_slice(v);
                    }
                    Segment::Remote { len, addr, rkey } => segments.push(ReadSegment {
                        local_offset: at,
                        len: *len,
                        remote_addr: *addr,
                        rkey: *rkey,
                    }),
                }
                at += seg.len();
            }
            let (seq, tag) = (w.seq, w.tag);
            if segments.is_empty() {
                self.waiting.pop_front();
                self.acks.push(seq);
                self.complete(seq, tag, buf, len);
                continue;
            }
            let cap = buf.len();
            match link.post_read(buf, &segments) {
                Ok(ReadPost::Posted(id)) => {
                    trace_event!(
                        DEBUG,
                        seq,
                        tag,
                        bytes = len,
                        segments = segments.len(),
                        "rendezvous read started"
                    );
                    self.waiting.pop_front();
                    if self.reading.is_empty() {
                        self.pool.reading(true);
                    }
                    self.reading.insert(id, (seq, tag, len, cap));
                }
                Ok(ReadPost::Busy(buf)) => {
                    self.pool.release(buf);
                    return Ok(());
                }
                Err(e) => {
                    // The buffer went with the refused post: count it out of the pool.
                    self.pool.forget(cap);
                    if let rdmsg_transport::Error::ReadTooLarge { .. } = e {
                        trace_event!(WARN, seq, tag, bytes = len, error = %e, "rendezvous read refused");
                        // More pieces than our send queue takes at once: refused alone.
                        self.waiting.pop_front();
                        self.acks.push(seq);
                        self.fill(seq, Err(crate::Error::Transport(e)));
                        continue;
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// One of our reads finished: its message takes its place in the order, and its sender
    /// is to be told.
    pub(crate) fn read_done(&mut self, done: ReadDone) {
        let Some((seq, tag, len, _)) = self.reading.remove(&done.id) else {
            // Not one of ours, or one abandoned when the connection failed: not counted in
            // the pool (any more).
            return;
        };
        if self.reading.is_empty() {
            self.pool.reading(false);
        }
        self.acks.push(seq);
        if done.ok {
            trace_event!(DEBUG, seq, tag, bytes = len, "rendezvous read finished");
            self.complete(seq, tag, done.buffer, len);
        } else {
            trace_event!(WARN, seq, tag, bytes = len, "rendezvous read failed");
            self.pool.release(done.buffer);
            self.fill(seq, Err(crate::Error::ReadFailed { tag, seq }));
        }
        self.unpark();
    }

    pub(super) fn complete(&mut self, seq: u32, tag: u32, buf: Buffer, len: usize) {
        let env = self
            .decoder
            .read_message(tag, seq, ReadBuf::new(buf, len, self.pool.clone()));
        self.received += 1;
        self.rendezvous_received += 1;
        self.bytes_received += len as u64;
        self.fill(seq, Ok(env));
    }

    pub(super) fn fill(&mut self, seq: u32, what: Result<Envelope>) {
        if let Some(slot) = self
            .order
            .iter_mut()
            .find(|s| matches!(s, Place::Reading(n) if *n == seq))
        {
            *slot = Place::Ready(Some(seq), what);
        }
    }

    /// The connection failed: no read can complete any more (a failed queue pair flushes
    /// what was posted). Each message still waiting for its read or being read fails in its
    /// place ([`crate::Error::ReadFailed`]), so that everything before and after it in the
    /// order is delivered, before the connection's failure.
    pub(crate) fn abandon_reads(&mut self) {
        if !self.waiting.is_empty() || !self.reading.is_empty() {
            trace_event!(
                WARN,
                waiting = self.waiting.len(),
                reading = self.reading.len(),
                "rendezvous read failed"
            );
        }
        for w in std::mem::take(&mut self.waiting) {
            self.fill(
                w.seq,
                Err(crate::Error::ReadFailed {
                    tag: w.tag,
                    seq: w.seq,
                }),
            );
        }
        if !self.reading.is_empty() {
            self.pool.reading(false);
        }
        for (_, (seq, tag, _, cap)) in std::mem::take(&mut self.reading) {
            // Its buffer goes with the queue pair (a flushed completion may still bring it).
            self.pool.forget(cap);
            self.fill(seq, Err(crate::Error::ReadFailed { tag, seq }));
        }
        // What was parked arrived before the failure: it is delivered, budget or not (a
        // fragmented message cut short by the failure fails alone). The reservation goes
        // back first: other peers need it.
        if let Some(b) = self.budget.take() {
            b.release(std::mem::take(&mut self.reserved));
            b.leave(&mut self.ticket);
        }
        while let Some(f) = self.parked.pop_front() {
            let header = frame::parse(f.bytes()).ok().map(|(h, _)| h);
            self.take_in(f, header);
        }
    }

    /// The connection was lost and a new one is to take its place (a resume): everything of
    /// the peer's that our application has not taken is dropped, whole messages, messages in
    /// reassembly or waiting for their reads, and parked frames alike, since the peer sends
    /// again everything from our count on ([`RecvSide::taken`]), in order. Reads under way
    /// end with the old queue pair (their buffers go with it). Registered types, the read
    /// pool and the counts stay.
    pub(crate) fn reset_for_resume(&mut self) {
        if !self.reading.is_empty() {
            self.pool.reading(false);
        }
        for (_, (_, _, _, cap)) in std::mem::take(&mut self.reading) {
            self.pool.forget(cap);
        }
        self.waiting.clear();
        self.parked.clear();
        self.order.clear();
        self.decoder.reset();
        if let Some(b) = &self.budget {
            b.release(std::mem::take(&mut self.reserved));
            b.leave(&mut self.ticket);
        }
        self.watch = None;
        self.acks.clear();
        self.acked.clear();
        self.ask = None;
        self.answer_due = false;
        self.peer_taken = None;
        self.paused = true;
    }

    /// The next message (or dropped frame's error) in order, if it is there, handed to the
    /// application: counted as taken ([`RecvSide::mark_taken`]).
    pub(crate) fn pop(&mut self) -> Option<Result<Envelope>> {
        let (seq, r) = self.pop_numbered()?;
        if let Some(seq) = seq {
            self.mark_taken(seq);
        }
        Some(r)
    }

    /// [`RecvSide::pop`] without counting it taken, with the message's number if known: for a
    /// hub, which hands it to the application later.
    pub(crate) fn pop_numbered(&mut self) -> Option<(Option<u32>, Result<Envelope>)> {
        match self.order.front()? {
            Place::Ready(..) => match self.order.pop_front() {
                Some(Place::Ready(seq, r)) => Some((seq, r)),
                _ => None,
            },
            Place::Reading(_) => None,
        }
    }

    /// Whether [`RecvSide::pop`] has something.
    pub(crate) fn has_ready(&self) -> bool {
        matches!(self.order.front(), Some(Place::Ready(..)))
    }

    /// Whether descriptors wait for room or a send slot, or frames are parked (a step should
    /// try again).
    pub(crate) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty() || !self.parked.is_empty()
    }

    /// Sequence numbers of the peer's messages we are done reading.
    pub(crate) fn take_acks(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.acks)
    }

    /// The peer's acknowledgements of our messages.
    pub(crate) fn take_acked(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.acked)
    }

    /// Whether acknowledgements wait to be handed over (either way).
    pub(crate) fn has_acks(&self) -> bool {
        !self.acks.is_empty() || !self.acked.is_empty()
    }
}

/// The message a bad frame belonged to, if it names one (not a control frame); for a packed
/// frame, its last: the error stands in for all of them, and taking it counts them all taken.
fn message_seq(header: Option<frame::Header>) -> Option<u32> {
    header
        .filter(|h| h.flags & (frame::DONE | frame::ASK) == 0)
        .map(|h| match h.flags & frame::PACK {
            0 => h.seq,
            _ => h.seq.wrapping_add(u32::from(h.frag.max(1)) - 1),
        })
}

impl Drop for RecvSide {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.release(self.reserved);
            b.leave(&mut self.ticket);
        }
        // Reads still under way end with the connection, their buffers with it (a queue pair
        // destroyed drops them): they leave the pool's count.
        for &(_, _, _, cap) in self.reading.values() {
            self.pool.forget(cap);
        }
        if !self.reading.is_empty() {
            self.pool.reading(false);
        }
    }
}
