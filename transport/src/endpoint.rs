//! A device port ready to make connections: context, protection domain, addressing.

use std::fmt;
use std::net::{TcpListener, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};

use verbs_core::{
    AsyncElement, AsyncEvent, Context, Gid, LinkLayer, Mtu, PortAttr, ProtectionDomain, QueuePair,
    RemoteAddress, RtrAttr, RtsAttr,
};

use crate::addr::QpAddress;
use crate::connection::{Config, Connection};
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
    /// Retries after receiver-not-ready NAKs; 7 is "forever". Default 7 (credits prevent RNR).
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
            rnr_retry: 7,
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
    /// Asynchronous events read from the context and not yet claimed by a connection.
    async_events: Mutex<Vec<AsyncEvent>>,
}

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

/// Most unclaimed asynchronous events kept.
const ASYNC_BACKLOG: usize = 256;

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
        Ok(Self {
            inner: Arc::new(Inner {
                ctx,
                pd,
                port,
                port_attr,
                gid_index,
                gid,
                async_events: Mutex::new(Vec::new()),
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

    /// Moves `qp` (in INIT) to RTR and RTS towards `remote`. A GRH is used when the remote
    /// GID is set, as `ibv_rc_pingpong` does.
    pub fn connect_qp(
        &self,
        qp: &mut QueuePair,
        local_psn: u32,
        remote: &QpAddress,
        params: &PathParams,
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
        qp.to_rtr(&rtr)?;
        let mut rts = RtsAttr::new(local_psn & 0xff_ffff);
        rts.timeout = params.timeout;
        rts.retry_cnt = params.retry_cnt;
        rts.rnr_retry = params.rnr_retry;
        qp.to_rts(&rts)?;
        Ok(())
    }

    /// Listens for bootstrap connections on `addr`.
    pub fn listen(&self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<Listener> {
        let tcp = TcpListener::bind(&addr).map_err(|source| Error::Listen {
            addr: format!("{addr:?}"),
            source,
        })?;
        Ok(Listener {
            endpoint: self.clone(),
            tcp,
        })
    }

    /// Connects to a [`Listener`] at `addr`.
    pub fn connect(
        &self,
        addr: impl ToSocketAddrs + fmt::Debug,
        config: &Config,
    ) -> Result<Connection> {
        let stream = std::net::TcpStream::connect(&addr).map_err(|source| Error::Connect {
            addr: format!("{addr:?}"),
            source,
        })?;
        Connection::establish(self, stream, config)
    }

    /// Reads pending asynchronous events into the backlog and takes out those `claims`
    /// accepts.
    pub(crate) fn take_async_events(
        &self,
        claims: impl Fn(&AsyncElement) -> bool,
    ) -> Result<Vec<AsyncEvent>> {
        let mut backlog = self
            .inner
            .async_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while let Some(ev) = self.inner.ctx.get_async_event()? {
            if backlog.len() == ASYNC_BACKLOG {
                backlog.remove(0);
            }
            backlog.push(ev);
        }
        let (mine, rest): (Vec<_>, Vec<_>) = backlog.drain(..).partition(|e| claims(&e.element));
        *backlog = rest;
        Ok(mine)
    }
}

/// Accepts bootstrap connections for an [`Endpoint`].
#[derive(Debug)]
pub struct Listener {
    endpoint: Endpoint,
    tcp: TcpListener,
}

impl Listener {
    /// The address listened on.
    pub fn local_addr(&self) -> Result<std::net::SocketAddr> {
        self.tcp.local_addr().map_err(|source| Error::Bootstrap {
            stage: "reading the listening address",
            source,
        })
    }

    /// Accepts one connection and runs the handshake. A peer that sends garbage, stalls, or
    /// does not match is rejected with an error for this call only; the listener stays usable.
    pub fn accept(&self, config: &Config) -> Result<Connection> {
        let (stream, _) = self.tcp.accept().map_err(|source| Error::Bootstrap {
            stage: "accepting",
            source,
        })?;
        Connection::establish(&self.endpoint, stream, config)
    }

    /// Accepts one raw TCP stream, for protocols of your own (such as `ibv_rc_pingpong`'s).
    pub fn accept_stream(&self) -> Result<std::net::TcpStream> {
        self.tcp
            .accept()
            .map(|(s, _)| s)
            .map_err(|source| Error::Bootstrap {
                stage: "accepting",
                source,
            })
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }
}

/// Connects two connections to each other through TCP on loopback, on the default device
/// ([`Endpoint::open_default`]): (accepting side, connecting side). For tests, examples and
/// benchmarks that run both peers in one process.
pub fn loopback_pair(server: &Config, client: &Config) -> Result<(Connection, Connection)> {
    let ep = Endpoint::open_default()?;
    let listener = ep.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let client_ep = ep.clone();
    let client = client.clone();
    let connector = std::thread::spawn(move || client_ep.connect(addr, &client));
    let accepted = listener.accept(server);
    let connected = connector
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    Ok((accepted?, connected?))
}
