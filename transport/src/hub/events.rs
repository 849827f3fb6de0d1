//! What a hub tells its user: who a connection is ([`PeerId`]), what happened
//! ([`RawHubEvent`]), and what it did ([`HubStats`]).

pub use crate::peer_id::PeerId;

use crate::error::{Error, Failure};
use crate::pool::Received;
use crate::read::ReadDone;
use std::time::Duration;

/// What happened in a [`RawHub`](super::RawHub).
#[derive(Debug)]
pub enum RawHubEvent {
    /// A connection is established: accepted from the hub's listener (`accepted`), or one that
    /// [`RawHub::connect`](super::RawHub::connect) started.
    Connected {
        /// The connection.
        peer: PeerId,
        /// Accepted (else connected by us).
        accepted: bool,
    },
    /// A message from `peer`. Its buffer is the hub's until dropped: holding many holds back
    /// that peer (and, past the spare buffers, others).
    Message {
        /// Who sent it.
        peer: PeerId,
        /// The bytes, in their receive buffer.
        msg: Received,
    },
    /// The connection ended; everything it delivered came before this, and its id is dead.
    Disconnected {
        /// The connection.
        peer: PeerId,
        /// Why ([`Failure::PeerClosed`] after a graceful close by the peer,
        /// [`Failure::Closed`] after [`RawHub::close`](super::RawHub::close), or
        /// [`Failure::CloseTimedOut`] when the peer did not take our close in time).
        failure: Failure,
        /// The word the peer's last grant or its close carried
        /// ([`Connection::set_note`](crate::Connection::set_note)), if any: its last word,
        /// which rdmsg's typed hub reads its delivery record from.
        last_note: Option<u32>,
    },
    /// A resumable session's connection was lost for a reason a network can cause
    /// ([`Failure::may_resume`]); everything it delivered came before this. The session and
    /// its id live on: the connecting side dials again, the accepting side waits for the
    /// peer, until [`Config::resume_window`](crate::Config::resume_window) runs out
    /// ([`RawHubEvent::Disconnected`] with this failure) or a new connection takes it up
    /// ([`RawHubEvent::Resumed`]). Sending to it meanwhile fails (with its connection's
    /// failure until the connection is released, then with
    /// [`Error::UnknownPeer`](crate::Error::UnknownPeer)); [`RawHub::will_resume`](super::RawHub::will_resume) tells
    /// such a wait from an end. It is not among [`RawHub::peers`](super::RawHub::peers) while
    /// suspended; closing it ends it.
    Suspended {
        /// The session.
        peer: PeerId,
        /// Why its connection was lost.
        failure: Failure,
        /// As [`RawHubEvent::Disconnected`]'s.
        last_note: Option<u32>,
    },
    /// A suspended session goes on over a new connection, under the same id: what its peer
    /// had not taken is the layer above's to send again. Sends reach the new connection only
    /// once this event is taken.
    Resumed {
        /// The session.
        peer: PeerId,
    },
    /// An RDMA read this hub posted for `peer` ([`RawHub::post_read`](super::RawHub::post_read)) finished (or was flushed
    /// by the peer's failure: then it comes before its [`RawHubEvent::Disconnected`]).
    Read {
        /// Whose memory it read.
        peer: PeerId,
        /// The read.
        read: ReadDone,
    },
    /// A handshake failed: a client accepted from the listener ( `peer: None`), or one that
    /// [`RawHub::connect`](super::RawHub::connect) started. The hub and every other connection go on.
    HandshakeFailed {
        /// The connection [`RawHub::connect`](super::RawHub::connect) returned, if it was ours.
        peer: Option<PeerId>,
        /// Why.
        error: Error,
    },
}

/// What a hub did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Connections established now.
    pub connections: usize,
    /// Handshakes under way now.
    pub handshakes: usize,
    /// Connections accepted, ever.
    pub accepted: u64,
    /// Connections established by [`RawHub::connect`](super::RawHub::connect), ever.
    pub connected: u64,
    /// Handshakes that failed.
    pub handshakes_failed: u64,
    /// Clients turned away at once because `max_connections` were open.
    pub refused: u64,
    /// Connections that ended.
    pub disconnected: u64,
    /// Times a resumable session's connection was lost and the session suspended.
    pub suspended: u64,
    /// Times a suspended session went on over a new connection.
    pub resumes: u64,
    /// Data messages received, all connections.
    pub received: u64,
    /// Data messages sent, all connections.
    pub sent: u64,
    /// `ibv_post_srq_recv` calls.
    pub srq_posts: u64,
    /// Times the receive pool grew because busy peers ran out of credits.
    pub pool_growths: u64,
    /// Times it could not (a registration refused): the hub goes on with what it has.
    pub pool_growth_failures: u64,
    /// Receive buffers registered (the SRQ's pool).
    pub recv_buffers: usize,
    /// Bytes registered for receive and send buffers.
    pub registered_bytes: u64,
    /// Posted receive buffers backing no connection.
    pub spare_buffers: u32,
    /// Receive groups (a shared receive queue and its completion queue each, see
    /// [`HubConfig::max_connections`](super::HubConfig::max_connections)).
    pub recv_groups: u32,
    /// Sends (and reads) posted on every queue pair and not yet completed: at most the send
    /// CQ's entries.
    pub sends_outstanding: usize,
    /// Send buffers free now.
    pub send_buffers_free: usize,
    /// Messages the transport solicited although the sender did not ask (they spent a
    /// peer's last credit, or returned credits to a peer that may be blocked), all
    /// connections, past and present.
    pub forced_solicited: u64,
    /// Times a send waited for a credit, all connections, past and present.
    pub credit_waits: u64,
    /// Credit stalls ([`ConnStats::credit_stalls`](crate::ConnStats::credit_stalls)), all
    /// connections, past and present.
    pub credit_stalls: u64,
    /// Failed queue pairs the device said had let go of their last shared receive
    /// (`IBV_EVENT_QP_LAST_WQE_REACHED`) before they were destroyed; the others were
    /// destroyed after a short wait for it (rxe never sends it).
    pub last_wqe_events: u64,
    /// Queue pairs destroyed after their drain (the error state, their requests flushed
    /// back, their last shared receive let go or waited for): every queue pair a hub made,
    /// a failed handshake's included, ends so.
    pub queue_pairs_drained: u64,
    /// Liveness probes posted: per probe interval (a third of `Config::keepalive`), one per
    /// peer host silent with nothing out, whatever its number of connections; one per host
    /// heard from, to its connection longest unheard; two more to a silent host one of whose
    /// connections went unanswered.
    pub liveness_probes: u64,
    /// Connections the liveness watch ended as vanished: their own probe or signaled send
    /// went unanswered, or their host answered none of its sampled connections.
    pub vanished_by_probe: u64,
    /// Where the time of making connections went, summed over every handshake.
    pub connect_times: ConnectTimes,
}

/// Where a hub's time of making connections went, summed over its handshakes (accepted and
/// its own, finished or failed): divided by `established`, one connection's share (a little
/// more when handshakes failed, whose work counts too). The parts are the hub's own work;
/// `wall` is each connection's wait from its handshake's start, the peer's part, the
/// network's and the hub's other work included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectTimes {
    /// Handshakes that ended in a connection.
    pub established: u64,
    /// From each established connection's start (its stream taken by the hub, or its queue
    /// pair made for a connect; its CM request or address resolution begun) to its
    /// connection, summed.
    pub wall: Duration,
    /// Admission: a connection's share of receive buffers set aside, posted and, when the
    /// pool grows (in batches), registered; receive groups made when one fills.
    pub admission: Duration,
    /// Queue pairs created and moved to INIT.
    pub queue_pairs: Duration,
    /// Queue pairs moved to RTR and RTS.
    pub transitions: Duration,
    /// The rest of a TCP handshake's steps in the hub: reading, checking and writing hellos,
    /// and filing the new queue pair.
    pub hellos: Duration,
}
