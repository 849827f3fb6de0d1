//! How a hub is set up, checked against the device before anything is created.

use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};

/// How a [`RawHub`](super::RawHub) is set up.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Settings of each connection: `buf_size` is the size of the shared receive buffers (the
    /// largest message a peer may send us) and of the send buffers; `grant_slots`,
    /// `send_depth` (per queue pair), `signal_every`, `max_inline`, `path`, `keepalive`,
    /// `psk`, the handshake's limits and timeouts, `close_timeout` and `health_check` apply
    /// as for a single connection. `recv_depth` is not used: see `min_credits` and
    /// `max_credits`. Default: [`Config::default`](crate::Config::default) with 2 KiB buffers and 16 send slots per
    /// queue pair.
    pub conn: Config,
    /// Credits every connection keeps however idle it is (its initial credits; the last one
    /// is how a peer asks for more: spending it wakes the hub, which grants from the shared
    /// pool as the peer's traffic needs). An idle connection holds this many receive buffers
    /// (2 KiB each by default) and nothing more: its grant slots are backed only while the
    /// hub has sent it something it may still grant back for. Default 1.
    pub min_credits: u32,
    /// Most credits one connection may hold (announced as its receive depth). Default 64.
    pub max_credits: u32,
    /// Most connections at once (accepted, connected and in handshake). Connections are
    /// spread over receive groups (a shared receive queue and its completion queue, all on
    /// the hub's one completion channel), each as large as the device's `max_cqe` and
    /// `max_srq_wr` allow; groups are made as connections come. Default 1024.
    pub max_connections: u32,
    /// Receive buffers kept spare beyond every connection's minimum, in each receive group,
    /// lent to busy connections at once (the pool grows as connections are admitted to keep
    /// them). Default 256.
    pub shared_credits: u32,
    /// Most receive buffers beyond every connection's minimum: while busy peers run out of
    /// credits with nothing spare, the pool grows towards this, so that memory follows the
    /// traffic (an idle hub holds `shared_credits`). Registered buffers stay registered (a
    /// shared receive queue cannot give posted buffers back) until the hub is dropped; what
    /// idle peers no longer use serves others. At least `shared_credits`. Default 8192.
    pub max_shared_credits: u32,
    /// Send buffers shared by every connection (messages up to `max_inline` need none).
    /// Default 256.
    pub send_buffers: u32,
    /// Most connections in one receive group (`None`: as many as the device's queues hold).
    /// Smaller groups mean more completion queues, each polled on every wake-up; useful to
    /// test, or to keep each group's queues small. Default `None`.
    pub group_connections: Option<u32>,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            conn: Config {
                buf_size: 2048,
                send_depth: 16,
                ..Config::default()
            },
            min_credits: 1,
            max_credits: 64,
            max_connections: 1024,
            shared_credits: 256,
            max_shared_credits: 8192,
            send_buffers: 256,
            group_connections: None,
        }
    }
}

impl HubConfig {
    /// Buffers reserved per connection: its minimum credits and its grant slots.
    pub(super) fn per_connection(&self) -> u32 {
        self.min_credits + u32::from(self.conn.grant_slots)
    }

    /// How receive groups are sized on a device whose CQs hold at most `max_cqe` entries and
    /// whose SRQs at most `max_srq_wr` requests: the connections one group takes, and the
    /// entries of its SRQ and CQ (the same number, so that no peer, lying or not, can
    /// overrun the CQ: every receive completion consumed a request of that SRQ). A group has
    /// room for its connections at their minimum, the spare kept at admission and the growth
    /// on demand, both at once.
    pub(super) fn group_size(&self, max_cqe: u32, max_srq_wr: u32) -> Result<GroupSize> {
        let cap = u64::from(max_cqe.min(max_srq_wr));
        let extra = u64::from(self.max_shared_credits) + u64::from(self.shared_credits);
        let per = u64::from(self.per_connection());
        let conns = (cap.saturating_sub(extra) / per)
            .min(u64::from(self.max_connections))
            .min(u64::from(self.group_connections.unwrap_or(u32::MAX)));
        if conns == 0 {
            return Err(Error::Config(format!(
                "max_shared_credits + shared_credits + min_credits + grant_slots = {} receive \
                 buffers exceed what one receive group can hold (the device's max_cqe {max_cqe} \
                 and max_srq_wr {max_srq_wr}): lower max_shared_credits",
                extra + per
            )));
        }
        Ok(GroupSize {
            conns: conns as u32,
            entries: (conns * per + extra) as u32,
        })
    }

    pub(super) fn check(&self, endpoint: &Endpoint) -> Result<()> {
        self.conn.check()?;
        let bad = |what: String| Err(Error::Config(what));
        if self.min_credits == 0 || self.min_credits > self.max_credits {
            return bad("min_credits must be between 1 and max_credits".into());
        }
        if self.max_credits > u32::from(u16::MAX) {
            return bad("max_credits must be at most 65535".into());
        }
        if self.max_connections == 0 || self.max_connections > MAX_SLOTS {
            return bad(format!("max_connections must be between 1 and {MAX_SLOTS}"));
        }
        if self.max_shared_credits < self.shared_credits {
            return bad("max_shared_credits must be at least shared_credits".into());
        }
        if self.group_connections == Some(0) {
            return bad("group_connections must be at least 1".into());
        }
        if self.send_buffers == 0 {
            return bad("send_buffers must be at least 1".into());
        }
        let dev = endpoint.context().query_device()?;
        self.group_size(dev.max_cqe, dev.max_srq_wr)?;
        Ok(())
    }
}

/// The size of every receive group of a hub (see [`HubConfig::group_size`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GroupSize {
    /// Connections one group takes.
    pub(super) conns: u32,
    /// Requests of its SRQ and entries of its CQ.
    pub(super) entries: u32,
}

/// Most connection slots of a hub (keys of the epoll set keep the slot in 32 bits).
pub(super) const MAX_SLOTS: u32 = 1 << 20;
