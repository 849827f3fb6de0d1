//! What a connection keeps of the way it was set up, for liveness and the goodbye: the TCP
//! bootstrap stream, or the connection manager's id on an event channel of its own.
//!
//! Both say the same three things to the core ([`StreamNews`]): nothing new, the peer is gone,
//! or junk. On TCP a graceful close writes [`GOODBYE`] and the end of the stream follows; on
//! rdma_cm the goodbye is `rdma_disconnect`, and the peer's side sees `DISCONNECTED`. The CM
//! cannot tell a graceful disconnect from the kernel's on behalf of a killed process (both are
//! a DREQ), so every disconnect reads as [`StreamNews::Ended`]: a graceful peer's close message
//! was delivered before it disconnected, and the core's grace for a message still in flight
//! finds it.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use rdmsg_verbs::{CmEventChannel, CmEventKind, CmId};

use crate::core::StreamNews;
use crate::handshake::GOODBYE;
use crate::stream::read_after_handshake;

/// A connection made by the connection manager: its id, alone on its event channel.
#[derive(Debug)]
pub(crate) struct CmLink {
    pub(crate) channel: CmEventChannel,
    pub(crate) id: CmId,
    /// `rdma_disconnect` was called (once is enough).
    disconnected: bool,
}

impl CmLink {
    pub(crate) fn new(channel: CmEventChannel, id: CmId) -> Self {
        Self {
            channel,
            id,
            disconnected: false,
        }
    }

    fn disconnect(&mut self) {
        if !std::mem::replace(&mut self.disconnected, true) {
            let _ = self.id.disconnect();
        }
    }

    /// What the events waiting on the channel say.
    fn news(&mut self) -> StreamNews {
        let mut news = StreamNews::Nothing;
        loop {
            match self.channel.next_event() {
                Ok(None) => return news,
                Ok(Some(ev)) => match ev.kind {
                    // An address change or the end of time-wait leaves a connected queue pair
                    // as it is.
                    CmEventKind::AddrChange | CmEventKind::TimewaitExit => {}
                    CmEventKind::Established => {}
                    // A disconnect, a device going away, or anything else on a connected id:
                    // the connection is over.
                    _ => news = StreamNews::Ended,
                },
                // The channel can no longer be read: nothing would tell us of the peer's end.
                Err(_) => return StreamNews::Ended,
            }
        }
    }
}

/// The TCP bootstrap stream, or the connection manager's id.
#[derive(Debug)]
pub(crate) enum Control {
    Tcp(TcpStream),
    Cm(CmLink),
}

impl Control {
    /// How often a single connection's silent peer is probed for a host that may stay
    /// silent `keepalive`: never over TCP, whose keepalive on the stream tells; over rdma_cm,
    /// which has none, every [`crate::core::probe_interval`]. (A hub probes per peer host
    /// instead, see `hub::liveness`.)
    pub(crate) fn probe_interval(&self, keepalive: Option<Duration>) -> Option<Duration> {
        match self {
            Control::Tcp(_) => None,
            Control::Cm(_) => keepalive.map(crate::core::probe_interval),
        }
    }

    /// What the peer's side says now (non-blocking).
    pub(crate) fn news(&mut self) -> StreamNews {
        match self {
            Control::Tcp(stream) => read_after_handshake(stream),
            Control::Cm(link) => link.news(),
        }
    }

    /// Our graceful goodbye, once our close message was delivered.
    pub(crate) fn say_goodbye(&mut self) {
        match self {
            Control::Tcp(stream) => {
                let _ = (&*stream).write_all(&[GOODBYE]);
            }
            Control::Cm(link) => link.disconnect(),
        }
    }

    /// Ends our side at once, so that the peer's fails rather than waiting on a queue pair
    /// that no longer answers.
    pub(crate) fn shut_down(&mut self) {
        match self {
            Control::Tcp(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Control::Cm(link) => link.disconnect(),
        }
    }
}

impl AsFd for Control {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Control::Tcp(stream) => stream.as_fd(),
            Control::Cm(link) => link.channel.as_fd(),
        }
    }
}
