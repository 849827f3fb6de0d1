//! What a [`crate::Session`] keeps for its connection and a [`crate::Hub`] keeps for each of
//! its peers: the sending side (sequence, solicitation policy, encoding and fragmenting) and
//! the receiving side (decoder), written once over a [`PeerIo`] so that both drive the same code.
//! `link` is where frames go, `send` the sending side, `receive` the receiving side, `table`
//! a hub's per-peer state.

mod budget;
mod close;
mod config;
mod lend;
mod link;
mod outbox;
mod receive;
mod record;
mod send;
mod table;
#[cfg(test)]
mod tests;

pub(crate) use budget::ReassemblyBudget;
pub(crate) use close::Closing;
pub use config::{
    SessionConfig, SessionStats, DEFAULT_REASSEMBLY_TIMEOUT, DEFAULT_RENDEZVOUS_THRESHOLD,
};
pub(crate) use link::*;
pub use outbox::OutboxStats;
pub(crate) use outbox::{encoded_len, Outbox, Outgoing, Owned};
pub(crate) use receive::*;
pub use record::Delivery;
pub(crate) use record::*;
pub(crate) use send::*;
pub(crate) use table::*;

/// Hands acknowledgements and delivery records between the two sides of one peer: the
/// peer's to our sender, ours to be sent. Whether any frame of ours was queued.
pub(crate) fn exchange_acks(
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
pub(crate) fn took(sender: &mut SendSide, receiver: &mut RecvSide) -> bool {
    sender.tell_taken(receiver.taken());
    let answer = receiver.take_answer_due();
    if answer {
        sender.queue_answer();
    }
    answer
}

/// The counters of both sides.
pub(crate) fn stats(sender: &SendSide, receiver: &RecvSide) -> SessionStats {
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
