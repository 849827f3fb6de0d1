//! Where a [`SendSide`]'s frames go and what a wait takes in: a connection, one peer of a
//! transport hub, or a connection absorbing arrivals into a [`RecvSide`].

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use rdmsg_transport::{Buffer, Connection, Exposed, PeerId, ReadPost, ReadSegment};

use crate::codec::FrameBytes;
use crate::Result;

use super::*;

/// Where a [`SendSide`]'s frames go: a connection, or one peer of a transport hub.
pub(crate) trait PeerIo {
    /// Sends what `fill` writes into a registered send buffer (`None`: nothing sent,
    /// `Ok(false)`), waiting at most `timeout` (`None`: as long as it takes) for a credit
    /// and a send slot ([`rdmsg_transport::Error::Timeout`]).
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool>;

    /// The largest frame the peer accepts.
    fn max_message(&self) -> rdmsg_transport::Result<usize>;

    /// Credits we hold for sending to the peer (0 for a peer gone).
    fn credits(&self) -> u32;

    /// The count of our messages the peer's application took that its latest grant carried
    /// (see [`rdmsg_transport::Connection::set_note`]), if one came.
    fn peer_note(&self) -> Option<u32>;

    /// The count of the peer's messages our application took, for every grant to carry from
    /// now on.
    fn set_note(&mut self, taken: u32);

    /// Exposes `pieces` to the peer's RDMA reads, each under a key of its own that only this
    /// peer can use, waiting at most `timeout` (as a send does) for room to bind them and
    /// send the descriptor that names them right after.
    fn expose_all(
        &mut self,
        pieces: Vec<Bytes>,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<Vec<Exposed>>;

    /// The most pieces [`PeerIo::expose_all`] takes at once.
    fn max_exposures(&self) -> usize;

    /// Registers `len` bytes that reads may land in.
    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer>;

    /// Posts RDMA reads of the peer's memory into `into`.
    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost>;

    /// Whether the connection failed (for good: nothing more goes over it).
    fn failed(&self) -> bool;

    /// Waits at most `timeout` for anything to arrive and hands it to the receiving side
    /// (which reads what the peer lends us meanwhile, so that two peers each waiting for the
    /// other's acknowledgement both go on): how a send short of rendezvous room waits.
    /// `None` if this link cannot wait so (a send then finds no room and does not wait).
    fn absorb(&mut self, _timeout: Option<Duration>) -> Result<Option<Absorbed>> {
        Ok(None)
    }

    /// Sends one frame, waiting at most `timeout` as [`PeerIo::send_with`] does; `Ok(false)`
    /// if nothing came in time (nothing sent).
    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool>;
}

impl PeerIo for Connection {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        Connection::send_with(self, solicited, timeout, fill)
    }

    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        Connection::send_timeout(self, frame, solicited, timeout)
    }

    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        Ok(Connection::max_message(self))
    }

    fn credits(&self) -> u32 {
        Connection::credits(self)
    }

    fn peer_note(&self) -> Option<u32> {
        Connection::peer_note(self)
    }

    fn set_note(&mut self, taken: u32) {
        Connection::set_note(self, taken);
    }

    fn failed(&self) -> bool {
        self.failure().is_some()
    }

    fn expose_all(
        &mut self,
        pieces: Vec<Bytes>,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<Vec<Exposed>> {
        Connection::expose_to_peer(self, pieces, timeout)
    }

    fn max_exposures(&self) -> usize {
        Connection::max_exposures(self)
    }

    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        Connection::register(self, len)
    }

    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        Connection::post_read(self, into, segments)
    }
}

/// What [`PeerIo::absorb`] took in: acknowledgements and delivery records each way.
#[derive(Debug, Default)]
pub(crate) struct Absorbed {
    /// The peer is done reading these messages of ours.
    pub(crate) acked: Vec<u32>,
    /// We are done reading these messages of the peer's: to be told.
    pub(crate) acks: Vec<u32>,
    /// The peer's count of our messages taken, from its latest frame.
    pub(crate) peer_taken: Option<u16>,
    /// The peer's count of our messages taken, as its latest credit grant carried it.
    pub(crate) note: Option<u32>,
    /// Our count of its messages taken, and whether a request of its is to be answered.
    pub(crate) taken: u32,
    pub(crate) answer: bool,
}

impl Absorbed {
    pub(super) fn from(receiver: &mut RecvSide) -> Self {
        Self {
            acked: receiver.take_acked(),
            acks: receiver.take_acks(),
            peer_taken: receiver.take_peer_taken(),
            note: None,
            taken: receiver.taken(),
            answer: receiver.take_answer_due(),
        }
    }
}

/// A peer's I/O that, lent the peer's receiving side, takes in what arrives while a send
/// waits for room ([`PeerIo::absorb`]): a session's connection, or a hub's peer (with the
/// hub's stash for the other peers' events). [`crate::peer::PeerMachine`] lends its own
/// receiving side so, for the sends and the close that may wait.
pub(crate) trait LendsRecv: PeerIo {
    /// The I/O with the receiving side lent to it.
    type Absorbing<'a>: PeerIo
    where
        Self: 'a;

    fn absorbing<'a>(&'a mut self, recv: &'a mut RecvSide) -> Self::Absorbing<'a>;
}

impl LendsRecv for Connection {
    type Absorbing<'a> = SessionPeerIo<'a>;

    fn absorbing<'a>(&'a mut self, recv: &'a mut RecvSide) -> SessionPeerIo<'a> {
        SessionPeerIo {
            conn: self,
            receiver: recv,
        }
    }
}

impl<'h> LendsRecv for HubPeerIo<'h> {
    type Absorbing<'a>
        = HubPeerIo<'a>
    where
        Self: 'a;

    fn absorbing<'a>(&'a mut self, recv: &'a mut RecvSide) -> HubPeerIo<'a> {
        HubPeerIo {
            hub: &mut *self.hub,
            peer: self.peer,
            stash: self.stash.as_deref_mut(),
            receiver: Some(recv),
        }
    }
}

/// A session's connection with its receiving side, for a send that may wait for room
/// ([`PeerIo::absorb`]).
#[derive(Debug)]
pub(crate) struct SessionPeerIo<'a> {
    pub(crate) conn: &'a mut Connection,
    pub(crate) receiver: &'a mut RecvSide,
}

/// Everything but [`PeerIo::absorb`] is the connection's own [`PeerIo`].
impl PeerIo for SessionPeerIo<'_> {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        PeerIo::send_with(self.conn, solicited, timeout, fill)
    }

    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        PeerIo::send(self.conn, frame, solicited, timeout)
    }

    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        PeerIo::max_message(self.conn)
    }

    fn credits(&self) -> u32 {
        self.conn.credits()
    }

    fn peer_note(&self) -> Option<u32> {
        self.conn.peer_note()
    }

    fn set_note(&mut self, taken: u32) {
        self.conn.set_note(taken);
    }

    fn failed(&self) -> bool {
        PeerIo::failed(self.conn)
    }

    fn expose_all(
        &mut self,
        pieces: Vec<Bytes>,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<Vec<Exposed>> {
        PeerIo::expose_all(self.conn, pieces, timeout)
    }

    fn max_exposures(&self) -> usize {
        PeerIo::max_exposures(self.conn)
    }

    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        PeerIo::register(self.conn, len)
    }

    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        PeerIo::post_read(self.conn, into, segments)
    }

    fn absorb(&mut self, timeout: Option<Duration>) -> Result<Option<Absorbed>> {
        match self.conn.recv_any_timeout(timeout)? {
            // A suspended session reads nothing more of the old connection.
            Some(_) if self.receiver.paused => {}
            Some(a) => self.receiver.accept(a),
            None => {}
        }
        self.receiver.advance(self.conn)?;
        Ok(Some(Absorbed {
            note: PeerIo::peer_note(self),
            ..Absorbed::from(self.receiver)
        }))
    }
}

/// What a send bounded by a timeout came to: `Ok(false)` if it timed out (nothing sent).
pub(crate) fn in_time(sent: Result<()>) -> Result<bool> {
    went(sent.map(|()| true))
}

/// A non-blocking send's outcome with a timeout read as "not sent": `Ok(false)`.
pub(crate) fn went(sent: Result<bool>) -> Result<bool> {
    match sent {
        Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => Ok(false),
        other => other,
    }
}

/// Whether a hub's `peer` is gone: failed, or its slot released (its `Disconnected` handed
/// out).
pub(crate) fn hub_peer_gone(hub: &rdmsg_transport::RawHub, peer: PeerId) -> bool {
    hub.failure(peer).is_some() || hub.credits(peer).is_err()
}

/// One peer of a transport hub, as a [`PeerIo`].
#[derive(Debug)]
pub(crate) struct HubPeerIo<'a> {
    pub(crate) hub: &'a mut rdmsg_transport::RawHub,
    pub(crate) peer: PeerId,
    /// Where a waiting send keeps the events of other peers it takes (see
    /// [`PeerIo::absorb`]), and this peer's receiving side; `None`: it does not wait for
    /// rendezvous room.
    pub(crate) stash: Option<&'a mut VecDeque<rdmsg_transport::RawHubEvent>>,
    pub(crate) receiver: Option<&'a mut RecvSide>,
}

impl PeerIo for HubPeerIo<'_> {
    fn send_with(
        &mut self,
        solicited: bool,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> rdmsg_transport::Result<bool> {
        self.hub.send_with(self.peer, solicited, timeout, fill)
    }

    fn send(
        &mut self,
        frame: &[u8],
        solicited: bool,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<bool> {
        self.hub.send_timeout(self.peer, frame, solicited, timeout)
    }

    fn max_message(&self) -> rdmsg_transport::Result<usize> {
        self.hub.max_message(self.peer)
    }

    fn credits(&self) -> u32 {
        self.hub.credits(self.peer).unwrap_or(0)
    }

    fn peer_note(&self) -> Option<u32> {
        self.hub.peer_note(self.peer)
    }

    fn set_note(&mut self, taken: u32) {
        // A peer gone: its Disconnected tells.
        let _ = self.hub.set_note(self.peer, taken);
    }

    fn failed(&self) -> bool {
        hub_peer_gone(self.hub, self.peer)
    }

    fn expose_all(
        &mut self,
        pieces: Vec<Bytes>,
        timeout: Option<Duration>,
    ) -> rdmsg_transport::Result<Vec<Exposed>> {
        self.hub.expose_to_peer(self.peer, pieces, timeout)
    }

    fn max_exposures(&self) -> usize {
        self.hub.max_exposures(self.peer).unwrap_or(1)
    }

    fn register(&self, len: usize) -> rdmsg_transport::Result<Buffer> {
        self.hub.register(len)
    }

    fn post_read(
        &mut self,
        into: Buffer,
        segments: &[ReadSegment],
    ) -> rdmsg_transport::Result<ReadPost> {
        self.hub.post_read(self.peer, into, segments)
    }

    fn absorb(&mut self, timeout: Option<Duration>) -> Result<Option<Absorbed>> {
        let (Some(stash), Some(receiver)) = (self.stash.take(), self.receiver.take()) else {
            return Ok(None);
        };
        let taken = self.hub.next_event(timeout);
        let out = match taken {
            Err(e) => Err(e.into()),
            Ok(ev) => {
                let gone = match ev {
                    Some(rdmsg_transport::RawHubEvent::Message { peer, msg })
                        if peer == self.peer =>
                    {
                        receiver.woken(self.hub.wakeups());
                        receiver.arrive(FrameBytes::Received(msg));
                        None
                    }
                    Some(rdmsg_transport::RawHubEvent::Read { peer, read })
                        if peer == self.peer =>
                    {
                        receiver.read_done(read);
                        None
                    }
                    Some(other) => {
                        // Others' events wait for the hub's next call; this peer's end ends
                        // the wait.
                        let gone = match &other {
                            rdmsg_transport::RawHubEvent::Disconnected {
                                peer, failure, ..
                            }
                            | rdmsg_transport::RawHubEvent::Suspended { peer, failure, .. }
                                if *peer == self.peer =>
                            {
                                Some(*failure)
                            }
                            _ => None,
                        };
                        stash.push_back(other);
                        gone
                    }
                    None => None,
                };
                match gone {
                    Some(f) => Err(rdmsg_transport::Error::from(f).into()),
                    None => receiver.advance(self).map(|()| {
                        Some(Absorbed {
                            note: PeerIo::peer_note(self),
                            ..Absorbed::from(receiver)
                        })
                    }),
                }
            }
        };
        self.stash = Some(stash);
        self.receiver = Some(receiver);
        out
    }
}
