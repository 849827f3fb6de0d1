//! A hub's rdma_cm handshakes as its slots hold them: the listener's id, and each pending
//! handshake's id, channel, stage and deadline (driven by `cm`).

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use rdmsg_verbs::{CmEventChannel, CmId};

use super::side::HubSide;
use crate::cm::machine::{CmHandshake, Stage};
use crate::cm::WAIT_CM;
use crate::error::{Error, TimedOut};

/// The hub's rdma_cm listener: its id, alone on its channel.
#[derive(Debug)]
pub(super) struct CmListening {
    /// Listening as long as it lives.
    pub(super) _id: CmId,
    pub(super) channel: CmEventChannel,
}

/// An rdma_cm handshake of a hub's slot.
pub(super) struct CmPending {
    pub(super) id: CmId,
    pub(super) channel: CmEventChannel,
    /// The queue pair on the hub's queues, once made.
    pub(super) side: Option<HubSide>,
    /// Its stage and deadline.
    pub(super) hs: CmHandshake,
    pub(super) peer_addr: Option<SocketAddr>,
    /// The CM was told of the client's first message (`rdma_notify`).
    pub(super) notified: bool,
}

impl fmt::Debug for CmPending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmPending")
            .field("stage", &self.hs.stage())
            .field("peer_addr", &self.peer_addr)
            .finish_non_exhaustive()
    }
}

impl CmPending {
    /// A receive completed for this accepted request's queue pair before its `ESTABLISHED`:
    /// the client's side is connected whatever became of its RTU (lost or late, the CM would
    /// resend its REP only after seconds). Tells the CM, once, which then establishes the
    /// connection (`ESTABLISHED` follows on the id's channel); where it cannot, the RTU still
    /// does. The message itself waits in the slot like any before `Connected`.
    pub(super) fn peer_sent(&mut self) {
        if self.hs.stage() == Stage::Established && !self.notified {
            self.notified = true;
            let _ = self.id.notify_established();
        }
    }

    pub(super) fn peer_name(&self) -> String {
        self.peer_addr
            .map_or_else(|| "the peer".to_owned(), |a| a.to_string())
    }

    /// The error of a handshake past its deadline (`after` is the handshake timeout).
    pub(super) fn timed_out(&self, after: Duration) -> Error {
        Error::Timeout(TimedOut {
            op: "connecting over rdma_cm",
            waiting_for: WAIT_CM,
            after,
        })
    }

    /// The error of a handshake evicted to make room: `max` were pending.
    pub(super) fn evicted(&self, max: u32) -> Error {
        Error::Cm {
            addr: self.peer_name(),
            stage: self.hs.stage().name(),
            detail: format!("evicted: {max} handshakes pending"),
        }
    }
}
