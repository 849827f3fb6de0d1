//! What a connection did, counted by its core.

/// What a connection did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Data messages sent.
    pub sent: u64,
    /// Data messages sent solicited.
    pub sent_solicited: u64,
    /// Of those, messages the transport solicited although the caller did not ask (they
    /// returned credits to a peer that may be blocked).
    pub forced_solicited: u64,
    /// Data messages sent inline.
    pub sent_inline: u64,
    /// Data messages received.
    pub received: u64,
    /// Explicit credit grants sent.
    pub grants_sent: u64,
    /// Credit grants received.
    pub grants_received: u64,
    /// Times a send waited for a credit (a refused bounded send retried counts each time).
    pub credit_waits: u64,
    /// Credit stalls: episodes from the first send that found no credit until a send went,
    /// however many sends were refused or waited meanwhile (an event loop retrying a
    /// non-blocking send counts once).
    pub credit_stalls: u64,
    /// Times a send waited for a send buffer or send queue slot.
    pub send_slot_waits: u64,
    /// `ibv_post_recv` calls made to refill the receive queue.
    pub refills: u64,
    /// Liveness probes posted to a silent peer (rdma_cm connections, [`Config::keepalive`]).
    ///
    /// [`Config::keepalive`]: crate::Config::keepalive
    pub probes: u64,
}
