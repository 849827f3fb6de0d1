//! One peer's protocol state, the same for a [`crate::Session`]'s connection and each peer of
//! a [`crate::Hub`]: the sending side, the receiving side and the outbox, with the sequences
//! that join them (the taken count handed to the transport, acknowledgements exchanged, the
//! frames they queue sent). The front ends hold one each and only translate their API onto
//! it; the sequences here take the peer's I/O ([`PeerIo`]) as an argument, so that a session
//! and a hub drive them alike.

use std::time::{Duration, Instant};

use super::close::Waited;
use super::{
    Closing, Encode, LendsRecv, LostCalls, Outbox, PeerIo, RecvSide, SendSide, SessionStats,
};
use crate::Message;

/// What [`PeerMachine::flush_before_wait`] left.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flushed {
    /// Every committed frame went.
    pub(crate) drained: bool,
    /// Some committed frames went.
    pub(crate) sent: bool,
    /// No flush was due, or it went.
    pub(crate) flushed: bool,
}

impl Flushed {
    /// Frames or a flush still wait for a send slot or a credit: look again soon.
    pub(crate) fn stuck(self) -> bool {
        !self.drained || !self.flushed
    }
}

/// One peer's sending side, receiving side and outbox.
#[derive(Debug)]
pub(crate) struct PeerMachine {
    /// Sequence numbers, solicitation, encoding, fragments, rendezvous, the delivery record.
    pub(crate) send: SendSide,
    /// Decoding, reassembly, rendezvous reads, the taken count, acknowledgements.
    pub(crate) recv: RecvSide,
    /// Messages waiting for the peer's credits (a hub's posts, answers given elsewhere).
    pub(crate) outbox: Outbox,
}

impl PeerMachine {
    pub(crate) fn new(send: SendSide, recv: RecvSide, outbox: Outbox) -> Self {
        Self { send, recv, outbox }
    }

    /// The counters of both sides.
    pub(crate) fn stats(&self) -> SessionStats {
        stats(&self.send, &self.recv)
    }

    /// Takes in the count of our messages the peer's application took that its latest grant
    /// carried (the transport's route of the delivery record).
    pub(crate) fn learn_note(&mut self, io: &impl PeerIo) {
        self.send.learn_note(io.peer_note());
    }

    /// After our application took messages of the peer's: the transport's grants and our
    /// frames carry the new count, and a request of the peer's that it reaches is answered,
    /// sent now if it can go (if not, with the next send; a failure comes from the next
    /// receive or event).
    pub(crate) fn took(&mut self, io: &mut impl PeerIo) {
        io.set_note(self.recv.taken());
        if took(&mut self.send, &mut self.recv) {
            let _ = self.send.send_committed(io);
        }
    }

    /// The connection to the peer failed: what waits in the outbox never goes (counted
    /// dropped; how many is returned), reads under way never complete (their messages fail in
    /// their place, and those behind them are deliverable), and the peer's last word
    /// (`last_note`: what its application took, as of its last grant or close) settles the
    /// delivery record, which then says what became of the calls that went
    /// ([`LostCalls`]).
    pub(crate) fn connection_failed(&mut self, last_note: Option<u32>) -> (usize, LostCalls) {
        self.send.learn_note(last_note);
        self.recv.abandon_reads();
        let lost = LostCalls {
            taken: self.send.delivery(None).taken as u32,
            unsent: self.outbox.calls_waiting(),
            nothing_went: false,
        };
        (self.outbox.clear(), lost)
    }

    /// The connection to the peer was lost and the session is kept for a new one (a resume):
    /// the peer's last word (`last_note`) settles the delivery record as far as it goes, and
    /// everything of the peer's our application has not taken is dropped, to come again.
    /// The outbox, the calls and the copies of our unconfirmed messages stay. Returns our
    /// count of the peer's messages taken, for the resume to carry.
    pub(crate) fn suspend(&mut self, last_note: Option<u32>) -> u32 {
        self.send.learn_note(last_note);
        self.recv.reset_for_resume();
        self.recv.taken()
    }

    /// On the new connection, given the peer's count `peer_taken` of our messages: those it
    /// has not taken go again first ([`SendSide::rewind`]), our frames carry our count.
    /// Returns how many go again; [`crate::Error::CannotResume`] if the count cannot be true
    /// or no copies were kept.
    pub(crate) fn resume(&mut self, peer_taken: u32) -> crate::Result<usize> {
        let again = self.send.rewind(peer_taken)?;
        self.send.tell_taken(self.recv.taken());
        self.recv.paused = false;
        Ok(again)
    }

    /// Runs `f` with the sending side and `io` lent the receiving side, so that a send that
    /// waits for room takes in what arrives meanwhile ([`PeerIo::absorb`]).
    // One lifetime for the loan, not any (`Absorbing<'_>` in `f` would ask `L: 'static`).
    pub(crate) fn lending<'s, L: LendsRecv + 's, T>(
        &'s mut self,
        io: &'s mut L,
        f: impl FnOnce(&mut SendSide, &mut L::Absorbing<'s>) -> T,
    ) -> T {
        f(&mut self.send, &mut io.absorbing(&mut self.recv))
    }

    /// Sends `m` ([`SendSide::send_as`]), waiting for room as long as it takes.
    pub(crate) fn send_as<M: Message>(
        &mut self,
        io: &mut impl LendsRecv,
        m: &M,
        solicited: bool,
    ) -> crate::Result<()> {
        self.lending(io, |send, link| send.send_as(link, m, solicited))
    }

    /// Sends `m` ([`SendSide::send_within`]), its first frame waiting at most `timeout`.
    pub(crate) fn send_within<E: Encode + ?Sized>(
        &mut self,
        io: &mut impl LendsRecv,
        m: &E,
        solicited: bool,
        timeout: Option<Duration>,
    ) -> crate::Result<()> {
        self.lending(io, |send, link| {
            send.send_within(link, m, solicited, timeout)
        })
    }

    /// Sends a batch, only its last message solicited ([`SendSide::send_batch`]).
    pub(crate) fn send_batch<'a, M: Message + 'a>(
        &mut self,
        io: &mut impl LendsRecv,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> crate::Result<usize> {
        self.lending(io, |send, link| send.send_batch(link, batch))
    }

    /// Flushes what went unsolicited ([`SendSide::flush`]).
    pub(crate) fn flush(&mut self, io: &mut impl LendsRecv) -> crate::Result<()> {
        self.lending(io, |send, link| send.flush(link))
    }

    /// Sends what was committed ([`SendSide::drain`]) within `timeout`; whether all went.
    pub(crate) fn drain(
        &mut self,
        io: &mut impl LendsRecv,
        timeout: Option<Duration>,
    ) -> crate::Result<bool> {
        self.lending(io, |send, link| send.drain(link, timeout))
    }

    /// The one flush before a wait for the peer (a session's receive or step, a hub's wait
    /// or step): committed frames go first, since the peer may wait for a message's rest;
    /// then, if the flush is due by `now` ([`SendSide::flush_due`]), what went unsolicited is
    /// flushed, since a peer asleep solicited-only would not look at it before our wait ends
    /// ([`SendSide::flush_before_wait`]). Each waits at most `timeout` for a send slot, taking
    /// in what arrives meanwhile.
    pub(crate) fn flush_before_wait(
        &mut self,
        io: &mut impl LendsRecv,
        timeout: Option<Duration>,
        now: Option<Instant>,
    ) -> crate::Result<Flushed> {
        let before = self.send.queued_frames();
        let drained = before == 0 || self.drain(io, timeout)?;
        let sent = self.send.queued_frames() != before;
        let flushed = drained
            && (!self.send.flush_due(now)
                || self.lending(io, |send, link| send.flush_before_wait(link, timeout))?);
        Ok(Flushed {
            drained,
            sent,
            flushed,
        })
    }

    /// Whether [`PeerMachine::flush_before_wait`] has anything to do: frames committed, or
    /// something went unsolicited since the last solicited frame.
    pub(crate) fn unflushed(&self) -> bool {
        self.send.pending() || self.send.queued_frames() > 0
    }

    /// The blocking close's steps before the transport's ([`Closing::wait`]): the outbox,
    /// committed frames and messages, the peer's reads and record, a last flush.
    pub(crate) fn close_wait(
        &mut self,
        closing: &Closing,
        io: &mut impl LendsRecv,
    ) -> crate::Result<Waited> {
        let Self { send, recv, outbox } = self;
        closing.wait(send, &mut io.absorbing(recv), outbox)
    }

    /// Hands acknowledgements and delivery records between the two sides (the peer's to our
    /// sending side, ours out) and sends the frames that queues if they can go now.
    pub(crate) fn exchange_acks(&mut self, io: &mut impl PeerIo) -> crate::Result<()> {
        self.learn_note(io);
        let frame_max = io.max_message().unwrap_or(0);
        if exchange_acks(&mut self.send, &mut self.recv, frame_max) {
            self.send.send_committed(io)?;
        }
        Ok(())
    }
}

/// Hands acknowledgements and delivery records between the two sides of one peer: the
/// peer's to our sender, ours to be sent. Whether any frame of ours was queued.
pub(super) fn exchange_acks(
    sender: &mut SendSide,
    receiver: &mut RecvSide,
    frame_max: usize,
) -> bool {
    let answered = took(sender, receiver);
    if let Some(t) = receiver.take_peer_taken() {
        sender.learn_taken(t);
    }
    if !receiver.has_acks() {
        return answered;
    }
    sender.acknowledged(&receiver.take_acked());
    let ours = receiver.take_acks();
    sender.queue_acks(&ours, frame_max);
    answered || !ours.is_empty()
}

/// After our application took messages of the peer's: the count our frames carry moves on,
/// and a request of the peer's that it reaches is answered (a frame queued: `true`).
pub(super) fn took(sender: &mut SendSide, receiver: &mut RecvSide) -> bool {
    sender.tell_taken(receiver.taken());
    let answer = receiver.take_answer_due();
    if answer {
        sender.queue_answer();
    }
    answer
}

/// The counters of both sides.
pub(super) fn stats(sender: &SendSide, receiver: &RecvSide) -> SessionStats {
    SessionStats {
        received: receiver.received,
        frames_received: receiver.frames_received,
        dropped_frames: receiver.dropped_frames,
        rendezvous_received: receiver.rendezvous_received,
        bytes_received: receiver.bytes_received,
        wakeups: receiver.wakeups,
        rendezvous_registered: receiver.pool.registered() as u64,
        ..sender.stats
    }
}
