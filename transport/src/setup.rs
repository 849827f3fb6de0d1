//! The verbs resources of one connection in the making, and what this side announces.

use std::io;

use rdmsg_verbs::{Access, Buffer, CompletionChannel, CompletionQueue, QpCaps, QueuePair};

use crate::addr::QpAddress;
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::handshake::{Hello, NONCE_LEN, VERSION};
use crate::pool::RecvPool;

/// The verbs resources of one connection in the making.
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) channel: CompletionChannel,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) qp: QueuePair,
    pub(crate) pool: RecvPool,
    /// Registered only once the handshake is complete (see [`Setup::register_send_buffers`]).
    pub(crate) send_bufs: Vec<Buffer>,
    /// How many send buffers the handshake settled on.
    send_buffers: u32,
    pub(crate) psn: u32,
}

impl Setup {
    /// Creates the completion channel, both CQs and the queue pair, moves it to INIT and posts
    /// every receive buffer (before RTR: the credits the peer starts with are real).
    pub(crate) fn new(endpoint: &Endpoint, config: &Config) -> Result<Self> {
        Self::with_access(endpoint, config, true)
    }

    /// [`Setup::new`] with a queue pair that grants no remote access (not even remote read)
    /// until [`QueuePair::allow_remote_read`]: for a client that has yet to prove the key.
    pub(crate) fn closed(endpoint: &Endpoint, config: &Config) -> Result<Self> {
        Self::with_access(endpoint, config, false)
    }

    fn with_access(endpoint: &Endpoint, config: &Config, remote_read: bool) -> Result<Self> {
        let ctx = endpoint.context();
        let pd = endpoint.pd();
        let recv_total = config.recv_depth + u32::from(config.grant_slots);
        let channel = CompletionChannel::new(ctx)?;
        let send_cq = CompletionQueue::new(ctx, config.send_depth, Some(&channel))?;
        let recv_cq = CompletionQueue::new(
            ctx,
            config.recv_cq_entries().unwrap_or(recv_total),
            Some(&channel),
        )?;
        let caps = QpCaps {
            max_send_wr: config.send_depth,
            max_recv_wr: recv_total,
            max_inline_data: config.max_inline,
        };
        let mut qp = QueuePair::new_rc(pd, &send_cq, &recv_cq, caps)?;
        if remote_read {
            qp.to_init(endpoint.port())?;
        } else {
            qp.to_init_closed(endpoint.port())?;
        }
        let mut pool = RecvPool::new(pd, recv_total as usize, config.buf_size as usize)?;
        if let Err(e) = qp.post_recv(pool.take_free()) {
            for b in e.unposted {
                pool.put_back(b);
            }
            return Err(e.error.into());
        }
        let psn = random_psn(qp.qp_num());
        Ok(Self {
            channel,
            send_cq,
            recv_cq,
            qp,
            pool,
            send_bufs: Vec::new(),
            send_buffers: 0,
            psn,
        })
    }

    /// Notes how many send buffers the handshake settled on (the CM path, which connects the
    /// queue pair itself rather than through [`LocalSide::connect`]).
    pub(crate) fn set_send_buffers(&mut self, n: u32) {
        self.send_buffers = n;
    }

    /// Registers the send buffers, sized by the peer's receive buffers. Only once the handshake
    /// is complete: a client that stops before its "ready" (authenticated or not) must not
    /// hold `send_depth` × its buffer size of pinned memory per pending handshake.
    pub(crate) fn register_send_buffers(
        &mut self,
        endpoint: &Endpoint,
        peer: &Hello,
    ) -> Result<()> {
        let size = peer.buf_size as usize;
        self.send_bufs = endpoint
            .pd()
            .register(self.send_buffers as usize * size, Access::LOCAL_WRITE)?
            .chunks(size)?;
        Ok(())
    }
}

/// The local half of a connection in the making: its queue pair, created (by the server) only
/// once the client's hello passed, then connected towards the peer.
pub(crate) trait LocalSide: Sized {
    /// Moves the queue pair to RTR and RTS towards `peer`, noting how many send buffers the
    /// handshake settled on; returns the queue pair's address.
    fn connect(
        &mut self,
        endpoint: &Endpoint,
        config: &Config,
        peer: &Hello,
        send_buffers: u32,
    ) -> Result<QpAddress>;
}

impl LocalSide for Setup {
    fn connect(
        &mut self,
        endpoint: &Endpoint,
        config: &Config,
        peer: &Hello,
        send_buffers: u32,
    ) -> Result<QpAddress> {
        self.send_buffers = send_buffers;
        endpoint.connect_qp_to(&mut self.qp, self.psn, peer, &config.path)?;
        Ok(endpoint.address_of(&self.qp, self.psn))
    }
}

/// What this side announces; `addr` is `None` on the server until its queue pair exists.
pub(crate) fn our_hello(endpoint: &Endpoint, config: &Config, addr: Option<QpAddress>) -> Hello {
    #[cfg(feature = "test-hooks")]
    let (lie, lie_buf) = (
        config.hooks.overstate_credits,
        config.hooks.overstate_buf_size,
    );
    #[cfg(not(feature = "test-hooks"))]
    let (lie, lie_buf) = (0, 0);
    Hello {
        version: VERSION,
        addr: addr.unwrap_or(QpAddress {
            lid: 0,
            qpn: 0,
            psn: 0,
            gid: rdmsg_verbs::Gid([0; 16]),
        }),
        mtu: endpoint.path_mtu(&config.path).bytes() as u32,
        buf_size: config.buf_size + lie_buf,
        recv_depth: config.recv_depth + lie,
        grant_slots: config.grant_slots,
        initial_credits: config.recv_depth + lie,
        reads: endpoint.reads_served(),
        max_read: config.announced_max_read(),
    }
}

/// Fresh random bytes for a handshake nonce, from the operating system.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| Error::Bootstrap {
        stage: "drawing a random nonce",
        source: e.raw_os_error().map_or_else(
            || io::Error::other(e.to_string()),
            io::Error::from_raw_os_error,
        ),
    })?;
    Ok(n)
}

/// A pseudo-random 24-bit starting PSN for the queue pair `qp_num`, different per connection
/// (a reused PSN could let stale packets of an earlier connection be accepted).
pub fn random_psn(qp_num: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(qp_num);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() as u32) & 0xff_ffff
}
