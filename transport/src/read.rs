//! RDMA reads of a peer's memory, as a connection or a hub posts them and reports them done:
//! the transport half of a rendezvous (the peer exposes a message, we read it).

use rdmsg_verbs::{Buffer, WorkCompletion};

/// An RDMA read that completed, or was flushed by a failure (`ok: false`; its bytes are then
/// not to be trusted). The buffer is ours again: the device no longer writes into it.
#[derive(Debug)]
pub struct ReadDone {
    /// The id [`ReadPost::Posted`] gave.
    pub id: u64,
    /// The buffer the read landed in.
    pub buffer: Buffer,
    /// Whether the read succeeded.
    pub ok: bool,
}

/// What posting a read came to.
#[derive(Debug)]
pub enum ReadPost {
    /// Posted under this id, which its [`ReadDone`] will carry.
    Posted(u64),
    /// No send queue slot was free for it: the buffer, back; try again later.
    Busy(Buffer),
}

/// The reads a completion retired. Reads are signaled, so each one's own completion (or a
/// later one, when its last segment's completion is the one that covers it) tells whether it
/// succeeded; a flushed one carries the flush error.
pub(crate) fn finished<'a>(
    wc: &'a WorkCompletion,
    reads: impl IntoIterator<Item = (u64, Buffer)> + 'a,
) -> impl Iterator<Item = ReadDone> + 'a {
    reads.into_iter().map(move |(id, buffer)| ReadDone {
        id,
        buffer,
        ok: wc.is_success(),
    })
}

/// What [`crate::Connection::try_recv_any`] hands out: a message, or a read of ours that
/// finished.
#[derive(Debug)]
pub enum Arrival {
    /// A message from the peer.
    Message(crate::Received),
    /// One of our RDMA reads finished.
    Read(ReadDone),
}
