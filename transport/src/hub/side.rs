//! A hub connection's local side while its handshake runs (TCP or rdma_cm).

use rdmsg_verbs::QueuePair;

use crate::addr::QpAddress;
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::error::Result;
use crate::handshake::Hello;
use crate::setup::LocalSide;

/// A hub connection's local side while its handshake runs: the queue pair (on the hub's
/// queues) and, once the peer's hello is known, the peer.
#[derive(Debug)]
pub(super) struct HubSide {
    pub(super) qp: QueuePair,
    pub(super) psn: u32,
    pub(super) peer: Option<Hello>,
    /// Time spent moving the queue pair to RTR and RTS, not yet in the hub's stats.
    pub(super) transitions: std::time::Duration,
}

impl LocalSide for HubSide {
    fn connect(
        &mut self,
        endpoint: &Endpoint,
        config: &Config,
        peer: &Hello,
        _send_buffers: u32,
    ) -> Result<QpAddress> {
        let start = std::time::Instant::now();
        let connected = endpoint.connect_qp_to(&mut self.qp, self.psn, peer, &config.path);
        self.transitions += start.elapsed();
        connected?;
        self.peer = Some(*peer);
        Ok(endpoint.address_of(&self.qp, self.psn))
    }
}
