//! One peer's protocol state, the same for a [`crate::Session`]'s connection and each peer of
//! a [`crate::Hub`]: the sending side, the receiving side and the outbox, with the sequences
//! that join them (the taken count handed to the transport, acknowledgements exchanged, the
//! frames they queue sent). The front ends hold one each and only translate their API onto
//! it; the sequences here take the peer's I/O ([`PeerIo`]) as an argument, so that a session
//! and a hub drive them alike.

use super::{Outbox, PeerIo, RecvSide, SendSide, SessionStats};

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
        dropped_frames: receiver.dropped_frames,
        rendezvous_received: receiver.rendezvous_received,
        bytes_received: receiver.bytes_received,
        wakeups: receiver.wakeups,
        rendezvous_registered: receiver.pool.registered() as u64,
        ..sender.stats
    }
}
