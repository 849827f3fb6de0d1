//! A device port ready to make connections: context, protection domain, addressing.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use rdmsg_verbs::{
    Context, Gid, LinkLayer, Mtu, PortAttr, ProtectionDomain, QueuePair, RemoteAddress, RtrAttr,
    RtsAttr,
};

use crate::addr::QpAddress;
use crate::device_events::{self, Mailbox, Router};
use crate::{Error, Result};

/// Which local GID to send from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GidChoice {
    /// RoCE: the RoCE v2 GID holding an IPv4 address; InfiniBand: none (route by LID).
    #[default]
    Auto,
    /// This GID table index.
    Index(u8),
}

/// Transport parameters of a queue pair's path, with explicit defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathParams {
    /// Path MTU; `None`: the port's active MTU.
    pub mtu: Option<Mtu>,
    /// Local ACK timeout, 4.096 µs × 2^timeout. Default 14 (≈ 67 ms).
    pub timeout: u8,
    /// Retries before `RetryExcErr`. Default 7: a dead peer is noticed by a sender within about
    /// half a second.
    pub retry_cnt: u8,
    /// Retries after receiver-not-ready NAKs, each after the peer's `min_rnr_timer`; 7 would
    /// be "forever". Default 6: credits keep RNR from happening at all, so an RNR NAK means a
    /// peer that lies about its buffers (or a credit bug), and it must surface as
    /// `RnrRetryExcErr` (a few milliseconds with the default timer) rather than as a silent
    /// hang.
    pub rnr_retry: u8,
    /// Delay a peer waits after our RNR NAK, IB-encoded. Default 12 (0.64 ms); **0 is 655 ms**.
    pub min_rnr_timer: u8,
    /// Service level.
    pub sl: u8,
}

impl Default for PathParams {
    fn default() -> Self {
        Self {
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            min_rnr_timer: 12,
            sl: 0,
        }
    }
}

struct Inner {
    ctx: Context,
    pd: ProtectionDomain,
    port: u8,
    port_attr: PortAttr,
    gid_index: Option<u8>,
    gid: Gid,
    /// Where asynchronous events read from the context go (see the `device_events` module); shared
    /// by every endpoint on the context.
    router: Arc<Mutex<Router>>,
    /// RDMA reads in flight per queue pair, as initiator and as responder.
    rd_atomic: u8,
    /// The device binds memory windows of type 2: exposures are keyed per queue pair.
    windows: bool,
}

/// Most RDMA reads a queue pair keeps in flight (or serves) at once.
const MAX_READS_IN_FLIGHT: u32 = 16;

/// One port of an opened device, shared by the connections made through it. Cheap to clone.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("device", &self.inner.ctx.name())
            .field("port", &self.inner.port)
            .field("gid_index", &self.inner.gid_index)
            .field("gid", &self.inner.gid)
            .finish()
    }
}

impl Endpoint {
    /// Opens `port` of `ctx`, picking the GID as `gid` says.
    pub fn open(ctx: Context, port: u8, gid: GidChoice) -> Result<Self> {
        let pd = ProtectionDomain::new(&ctx)?;
        let port_attr = ctx.query_port(port)?;
        let (gid_index, gid) = match gid {
            GidChoice::Index(i) => (Some(i), ctx.query_gid(port, u32::from(i))?),
            GidChoice::Auto if port_attr.link_layer == LinkLayer::Ethernet => {
                let (i, gid) = ctx.pick_roce_v2_ipv4_gid(port)?;
                let i = u8::try_from(i)
                    .map_err(|_| Error::Config(format!("GID index {i} above 255")))?;
                (Some(i), gid)
            }
            GidChoice::Auto => (None, Gid([0; 16])),
        };
        ctx.set_async_nonblocking(true)?;
        let dev = ctx.query_device()?;
        // Reads in flight per queue pair, both ways (a rendezvous receiver reads the sender's
        // memory): enough to keep a link busy, within what the device allows.
        let rd_atomic = dev
            .max_qp_rd_atom
            .min(dev.max_qp_init_rd_atom)
            .clamp(1, MAX_READS_IN_FLIGHT) as u8;
        let router = device_events::router_for(&ctx);
        Ok(Self {
            inner: Arc::new(Inner {
                ctx,
                pd,
                port,
                port_attr,
                gid_index,
                gid,
                router,
                rd_atomic,
                windows: dev.mw_type2 && dev.max_mw > 0,
            }),
        })
    }

    /// Port 1 of the device named by `$RDMSG_DEVICE` (or the first device), GID picked
    /// automatically.
    pub fn open_default() -> Result<Self> {
        Self::open(Context::open_default()?, 1, GidChoice::Auto)
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Exposes `bytes` to RDMA reads under a key of their own (see
    /// [`rdmsg_verbs::Exposed`]), valid on every queue pair of this endpoint: prefer
    /// [`Connection::expose_to_peer`](crate::Connection::expose_to_peer), whose keys only the
    /// connection's peer can use.
    pub fn expose(&self, bytes: rdmsg_verbs::Bytes) -> Result<rdmsg_verbs::Exposed> {
        Ok(self.inner.pd.expose(bytes)?)
    }

    /// Whether the device binds memory windows of type 2, so that an exposure's key is valid
    /// on one queue pair alone (rxe does; without them keys are valid endpoint-wide).
    pub fn binds_windows(&self) -> bool {
        self.inner.windows
    }

    /// The pieces of exposures for one connection's peer: windows over `pieces`, to be bound
    /// on its queue pair (or, without memory windows, plain exposures). Every registration
    /// comes first, so that a refused one leaves nothing posted.
    pub(crate) fn windows_over(
        &self,
        pieces: Vec<rdmsg_verbs::Bytes>,
    ) -> Result<Vec<rdmsg_verbs::Exposed>> {
        pieces
            .into_iter()
            .map(|b| match self.inner.windows {
                true => Ok(self.inner.pd.window_over(b)?),
                false => self.expose(b),
            })
            .collect()
    }

    /// Registers `len` zeroed bytes with local write (see
    /// [`rdmsg_verbs::ProtectionDomain::register`]): where RDMA reads may land.
    pub fn register(&self, len: usize) -> Result<rdmsg_verbs::Buffer> {
        Ok(self
            .inner
            .pd
            .register(len, rdmsg_verbs::Access::LOCAL_WRITE)?)
    }

    /// The protection domain every connection of this endpoint uses.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The port number.
    pub fn port(&self) -> u8 {
        self.inner.port
    }

    /// The port's attributes when the endpoint was opened.
    pub fn port_attr(&self) -> &PortAttr {
        &self.inner.port_attr
    }

    /// The GID index used (`None`: no GRH, InfiniBand by LID).
    pub fn gid_index(&self) -> Option<u8> {
        self.inner.gid_index
    }

    /// The local GID (all zero without a GRH).
    pub fn gid(&self) -> Gid {
        self.inner.gid
    }

    /// The path MTU `params` asks for, bounded by the port's active MTU.
    pub fn path_mtu(&self, params: &PathParams) -> Mtu {
        let active = self.inner.port_attr.active_mtu;
        match params.mtu {
            Some(m) if m.bytes() <= active.bytes() => m,
            _ => active,
        }
    }

    /// What a peer needs to connect to `qp`, which will send starting at `psn`.
    pub fn address_of(&self, qp: &QueuePair, psn: u32) -> QpAddress {
        QpAddress {
            lid: self.inner.port_attr.lid,
            qpn: qp.qp_num(),
            psn: psn & 0xff_ffff,
            gid: self.inner.gid,
        }
    }

    /// RDMA reads our queue pairs serve at once (their responder resources), announced.
    pub(crate) fn reads_served(&self) -> u8 {
        self.inner.rd_atomic
    }

    /// [`Endpoint::connect_qp`] towards the peer of `hello`, keeping no more reads in flight
    /// towards it than it serves.
    pub(crate) fn connect_qp_to(
        &self,
        qp: &mut QueuePair,
        local_psn: u32,
        hello: &crate::handshake::Hello,
        params: &PathParams,
    ) -> Result<()> {
        let reads = self.inner.rd_atomic.min(hello.reads);
        self.connect_qp_reading(qp, local_psn, &hello.addr, params, reads)
    }

    /// Moves `qp` (in INIT) to RTR and RTS towards `remote`. A GRH is used when the remote
    /// GID is set, as `ibv_rc_pingpong` does.
    pub fn connect_qp(
        &self,
        qp: &mut QueuePair,
        local_psn: u32,
        remote: &QpAddress,
        params: &PathParams,
    ) -> Result<()> {
        self.connect_qp_reading(qp, local_psn, remote, params, self.inner.rd_atomic)
    }

    fn connect_qp_reading(
        &self,
        qp: &mut QueuePair,
        local_psn: u32,
        remote: &QpAddress,
        params: &PathParams,
        reads: u8,
    ) -> Result<()> {
        let use_grh = !remote.gid.is_zero();
        let sgid_index = match (use_grh, self.inner.gid_index) {
            (true, Some(i)) => i,
            (true, None) => {
                return Err(Error::Config(
                    "the peer routes by GID but no local GID index is set".into(),
                ))
            }
            (false, _) => 0,
        };
        let address = RemoteAddress {
            lid: remote.lid,
            gid: use_grh.then_some(remote.gid),
            sgid_index,
            sl: params.sl,
            port: self.inner.port,
        };
        let mut rtr = RtrAttr::new(remote.qpn, remote.psn, self.path_mtu(params), address);
        rtr.min_rnr_timer = params.min_rnr_timer;
        rtr.max_dest_rd_atomic = self.inner.rd_atomic;
        qp.to_rtr(&rtr)?;
        let mut rts = RtsAttr::new(local_psn & 0xff_ffff);
        rts.timeout = params.timeout;
        rts.retry_cnt = params.retry_cnt;
        rts.rnr_retry = params.rnr_retry;
        rts.max_rd_atomic = reads;
        qp.to_rts(&rts)?;
        Ok(())
    }

    /// Routes asynchronous events to `mailbox` from now on: those naming `qp_num` or one of
    /// the completion queues at addresses `cqs`, and device-wide failures.
    pub(crate) fn register_async(
        &self,
        qp_num: Option<u32>,
        cqs: Vec<usize>,
        mailbox: &Arc<Mailbox>,
    ) {
        self.router()
            .register(qp_num, cqs, self.inner.port, mailbox);
    }

    /// The queue pair `qp_num` routed to `mailbox` is destroyed: its number may name another
    /// one next.
    pub(crate) fn unregister_async(&self, qp_num: u32, mailbox: &Arc<Mailbox>) {
        self.router().unregister_qp(qp_num, mailbox);
    }

    /// Reads every pending asynchronous event of the device and routes it to the mailbox of
    /// the connection it concerns (device-wide failures to all), waking each recipient. The
    /// router is the context's, shared with every other endpoint on it.
    pub(crate) fn route_async_events(&self) -> Result<()> {
        let mut router = self.router();
        while let Some(ev) = self.inner.ctx.get_async_event()? {
            router.route(ev);
        }
        Ok(())
    }

    fn router(&self) -> std::sync::MutexGuard<'_, Router> {
        self.inner
            .router
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
