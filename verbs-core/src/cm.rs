//! The RDMA connection manager (librdmacm): address and route resolution by IP address,
//! connection requests carrying private data, rejects with a reason, and a peer's disconnect
//! as an event, all on a non-blocking event channel that can sit in the same wait as a
//! completion channel.
//!
//! rdmsg's queue pairs stay its own: they are created on the caller's [`Context`]
//! (`crate::Context`) like any other, and the CM is given only their number. Each state change
//! is made here with the attributes the CM computed for it (`rdma_init_qp_attr`), so the CM
//! never modifies a queue pair it does not own, and the queue pair's posting rules are
//! unchanged. The device the CM resolved an address to is named by [`CmId::device_name`]; the
//! queue pair must live on that device.
//!
//! Events are acknowledged as they are read, once what they carry has been copied out, so a
//! [`CmId`] can always be destroyed (librdmacm's `rdma_destroy_id` waits for every event of
//! its id to be acknowledged).

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::error::{check_ret, non_null};
use crate::ffi;
use crate::{Error, QpState, QueuePair, Result};

/// Private data a connection request carries on InfiniBand and RoCE (an RC `REQ` has 92
/// bytes, of which the CM keeps 36 for its own header). iWARP allows more; this is the least.
pub const CONNECT_PRIVATE_DATA_MAX: usize = 56;
/// Private data an accept (`REP`) carries.
pub const ACCEPT_PRIVATE_DATA_MAX: usize = 196;
/// Private data a reject (`REJ`) carries.
pub const REJECT_PRIVATE_DATA_MAX: usize = 148;

/// The IB CM's reject reason for a reject the peer's application chose (`rdma_reject`); the
/// other reasons come from the CM itself (8: nothing listens on that service).
pub const REJECT_CONSUMER: i32 = 28;
/// The IB CM's reject reason when nothing listens on the address and port.
pub const REJECT_INVALID_SERVICE: i32 = 8;

struct ChannelInner {
    raw: NonNull<ffi::rdma_event_channel>,
    /// Held from reading an event to acknowledging it, and by every call on an id of the
    /// channel: reading an event writes fields of its id (`route`, `verbs`, `port_num`) that
    /// the id's own methods read, which must not race.
    lock: Mutex<()>,
}

impl ChannelInner {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

// SAFETY: the channel is a descriptor and librdmacm's bookkeeping around it; everything that
// touches an id's fields or reads an event holds `lock`.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every id created on the channel holds this Arc, so none is left.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// A connection-manager event channel (`rdma_create_event_channel`), non-blocking: its
/// descriptor is readable when an event waits, and [`CmEventChannel::next_event`] never
/// blocks. Every [`CmId`] created on it keeps it alive.
#[derive(Clone)]
pub struct CmEventChannel {
    inner: Arc<ChannelInner>,
}

impl fmt::Debug for CmEventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEventChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

impl CmEventChannel {
    /// Opens an event channel. Fails with a hint naming the modules when the kernel has no
    /// connection manager for user space (`/dev/infiniband/rdma_cm`).
    pub fn new() -> Result<Self> {
        // SAFETY: no arguments; NULL plus errno on failure.
        let raw =
            non_null(unsafe { ffi::rdma_create_event_channel() }).map_err(|source| Error::Cm {
                call: "rdma_create_event_channel",
                source,
            })?;
        let channel = Self {
            inner: Arc::new(ChannelInner {
                raw,
                lock: Mutex::new(()),
            }),
        };
        crate::set_nonblocking(channel.as_raw_fd(), true)?;
        Ok(channel)
    }

    /// Reads the next event, if one waits (`None`: the channel is empty). The event is
    /// acknowledged before it is returned: what it carries is copied into the [`CmEvent`].
    pub fn next_event(&self) -> Result<Option<CmEvent>> {
        let _guard = self.inner.lock();
        let mut raw: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is alive; `raw` is a valid out-pointer.
        let ret = unsafe { ffi::rdma_get_cm_event(self.inner.raw.as_ptr(), &mut raw) };
        if let Err(source) = check_ret(ret) {
            if source.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::Cm {
                call: "rdma_get_cm_event",
                source,
            });
        }
        // SAFETY: on success librdmacm filled `raw` with an event it owns until acknowledged.
        let ev = unsafe { &*raw };
        let kind = CmEventKind::from_raw(ev.event);
        // For a connection request `id` is the new id and `listen_id` the listener's.
        let (id, request) = if kind == CmEventKind::ConnectRequest {
            let new = NonNull::new(ev.id).map(|raw| CmId {
                raw,
                channel: self.inner.clone(),
            });
            (CmIdKey(ev.listen_id as usize), new)
        } else {
            (CmIdKey(ev.id as usize), None)
        };
        let carries_conn = matches!(
            kind,
            CmEventKind::ConnectRequest
                | CmEventKind::ConnectResponse
                | CmEventKind::Established
                | CmEventKind::Rejected
        );
        let conn = if carries_conn {
            // SAFETY: these events of a connected (port space TCP) id fill `param.conn`; the
            // union's other member, `ud`, is for datagram ids, which this module never makes.
            // Its private data is valid until the event is acknowledged.
            unsafe { ev.param.conn }
        } else {
            // SAFETY: rdma_conn_param is plain old data; all-zero is valid.
            unsafe { std::mem::zeroed() }
        };
        let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
            Vec::new()
        } else {
            // SAFETY: librdmacm says `private_data_len` bytes are readable there.
            unsafe {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    conn.private_data_len as usize,
                )
            }
            .to_vec()
        };
        let event = CmEvent {
            kind,
            status: ev.status,
            id,
            request,
            private_data,
            params: ConnParams {
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
                retry_count: conn.retry_count,
                rnr_retry_count: conn.rnr_retry_count,
            },
            peer_qp_num: conn.qp_num,
        };
        // SAFETY: the event came from rdma_get_cm_event and is acknowledged once; nothing
        // borrowed from it outlives this line.
        let ret = unsafe { ffi::rdma_ack_cm_event(raw) };
        check_ret(ret).map_err(|source| Error::Cm {
            call: "rdma_ack_cm_event",
            source,
        })?;
        Ok(Some(event))
    }
}

impl AsRawFd for CmEventChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is alive while `self` is.
        unsafe { (*self.inner.raw.as_ptr()).fd }
    }
}

impl AsFd for CmEventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open while the channel (borrowed by the result) lives.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

/// Which [`CmId`] an event concerns: compare with [`CmId::key`]. For a connection request it
/// is the listener's key (the request's own id is [`CmEvent::request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmIdKey(usize);

/// What happened (`enum rdma_cm_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CmEventKind {
    /// The address resolved to a device and port: resolve the route next.
    AddrResolved,
    /// The address did not resolve ([`CmEvent::status`] is `-errno`).
    AddrError,
    /// The route resolved: create the queue pair and connect.
    RouteResolved,
    /// The route did not resolve.
    RouteError,
    /// A peer asks to connect ([`CmEvent::request`] is its id).
    ConnectRequest,
    /// The passive side accepted: move the queue pair to RTS and call [`CmId::establish`].
    ConnectResponse,
    /// The connection failed while being set up.
    ConnectError,
    /// The peer did not answer.
    Unreachable,
    /// The peer (or its CM) refused: [`CmEvent::status`] is the reject reason
    /// ([`REJECT_CONSUMER`], [`REJECT_INVALID_SERVICE`], ...).
    Rejected,
    /// The connection is up: on the passive side once the active side called
    /// [`CmId::establish`]. An active side whose queue pair is its own (as every queue pair
    /// here is) gets [`CmEventKind::ConnectResponse`] instead, and none of these.
    Established,
    /// The peer disconnected, or the connection was lost.
    Disconnected,
    /// The device is going away: every id on it must be destroyed.
    DeviceRemoval,
    /// A multicast join completed (never for the ids this module creates).
    MulticastJoin,
    /// A multicast join failed (never for the ids this module creates).
    MulticastError,
    /// The local address changed.
    AddrChange,
    /// The connection's time-wait ended: its queue pair number may be reused.
    TimewaitExit,
    /// An event this library does not know.
    Other(u32),
}

impl CmEventKind {
    fn from_raw(raw: ffi::rdma_cm_event_type::Type) -> Self {
        use ffi::rdma_cm_event_type::*;
        match raw {
            RDMA_CM_EVENT_ADDR_RESOLVED => Self::AddrResolved,
            RDMA_CM_EVENT_ADDR_ERROR => Self::AddrError,
            RDMA_CM_EVENT_ROUTE_RESOLVED => Self::RouteResolved,
            RDMA_CM_EVENT_ROUTE_ERROR => Self::RouteError,
            RDMA_CM_EVENT_CONNECT_REQUEST => Self::ConnectRequest,
            RDMA_CM_EVENT_CONNECT_RESPONSE => Self::ConnectResponse,
            RDMA_CM_EVENT_CONNECT_ERROR => Self::ConnectError,
            RDMA_CM_EVENT_UNREACHABLE => Self::Unreachable,
            RDMA_CM_EVENT_REJECTED => Self::Rejected,
            RDMA_CM_EVENT_ESTABLISHED => Self::Established,
            RDMA_CM_EVENT_DISCONNECTED => Self::Disconnected,
            RDMA_CM_EVENT_DEVICE_REMOVAL => Self::DeviceRemoval,
            RDMA_CM_EVENT_MULTICAST_JOIN => Self::MulticastJoin,
            RDMA_CM_EVENT_MULTICAST_ERROR => Self::MulticastError,
            RDMA_CM_EVENT_ADDR_CHANGE => Self::AddrChange,
            RDMA_CM_EVENT_TIMEWAIT_EXIT => Self::TimewaitExit,
            other => Self::Other(other),
        }
    }
}

/// The connection parameters of `rdma_conn_param` that rdmsg sets and reads (the queue pair
/// number and private data are given separately). librdmacm reads 255 in the first two as
/// "the device's maximum".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnParams {
    /// RDMA reads the peer may have outstanding towards us. Default 1 (rendezvous reads).
    pub responder_resources: u8,
    /// RDMA reads we may have outstanding towards the peer. Default 1.
    pub initiator_depth: u8,
    /// Transport retries (0-7). Default 7.
    pub retry_count: u8,
    /// Receiver-not-ready retries (0-7; 7 means for ever). Default 7.
    pub rnr_retry_count: u8,
}

impl Default for ConnParams {
    fn default() -> Self {
        Self {
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
        }
    }
}

/// What rdmsg sets itself when [`CmId::ready_qp`] moves a queue pair to RTR and RTS, in place
/// of the CM's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpTuning {
    /// The receiver-not-ready timer, IB-encoded. The CM's is 0, which the specification
    /// defines as 655 ms, not "no wait"; default 12 (0.64 ms, as [`crate::RtrAttr`] has).
    pub min_rnr_timer: u8,
    /// A path MTU below the one the CM found (never above it). Default: the CM's.
    pub path_mtu: Option<crate::Mtu>,
    /// The local ACK timeout, 4.096 µs × 2^timeout. Default: the CM's, from the path's
    /// packet lifetime.
    pub timeout: Option<u8>,
    /// Transport retries. Default: the CM's (the connect's `retry_count`).
    pub retry_cnt: Option<u8>,
    /// RNR retries (7: for ever). Default: the CM's (the connect's `rnr_retry_count`).
    pub rnr_retry: Option<u8>,
    /// The reads each way (`max_dest_rd_atomic` from `responder_resources`, `max_rd_atomic`
    /// from `initiator_depth`): on the passive side its accept parameters, as `rdma_accept`
    /// announces them (before the accept the CM would compute them from the request); on
    /// the active side, the accept's capped by what this side can do. `None`: the CM's,
    /// which on the active side follow the accept as it is, even beyond this device's
    /// limits.
    pub reads: Option<ConnParams>,
}

impl Default for QpTuning {
    fn default() -> Self {
        Self {
            min_rnr_timer: 12,
            path_mtu: None,
            timeout: None,
            retry_cnt: None,
            rnr_retry: None,
            reads: None,
        }
    }
}

/// One connection-manager event, copied out and already acknowledged.
#[derive(Debug)]
pub struct CmEvent {
    /// What happened.
    pub kind: CmEventKind,
    /// The event's status: 0, `-errno` for the error events, the reject reason for
    /// [`CmEventKind::Rejected`].
    pub status: i32,
    /// The id it concerns (the listener's, for a connection request).
    pub id: CmIdKey,
    /// A connection request's own id: accept or reject it (dropping it rejects).
    pub request: Option<CmId>,
    /// The private data the peer sent with its request, accept or reject. The CM pads it to
    /// the transport's size (a request's is always 56 bytes on IB and RoCE): a format that
    /// needs a length must carry it.
    pub private_data: Vec<u8>,
    /// The peer's connection parameters (a request's or an accept's), as the CM reports them:
    /// from this side, so `initiator_depth` is the reads the peer serves (its responder
    /// resources) and `responder_resources` the reads it may ask of us (its initiator depth).
    pub params: ConnParams,
    /// The peer's queue pair number (a request's or an accept's; 0 otherwise).
    pub peer_qp_num: u32,
}

/// A connection-manager id (`rdma_cm_id`, port space TCP): one connection, or a listener.
/// Destroyed on drop (which disconnects it); keeps its event channel alive.
pub struct CmId {
    raw: NonNull<ffi::rdma_cm_id>,
    channel: Arc<ChannelInner>,
}

// SAFETY: librdmacm ids may be used from any thread; every call here holds the channel's lock,
// which reading the id's events also holds. Not `Sync`: calls on one id take turns.
unsafe impl Send for CmId {}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .field("device", &self.device_name())
            .finish()
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive and owned; its events were acknowledged as they were read
        // (under the lock held here), so librdmacm's wait for them returns at once.
        unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
    }
}

fn cm_err(call: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Cm { call, source }
}

fn cm_timeout_ms(timeout: Duration) -> libc::c_int {
    timeout.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int
}

impl CmId {
    /// A new id on `channel` (reliable-connected, port space TCP).
    pub fn new(channel: &CmEventChannel) -> Result<Self> {
        let mut raw: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is alive; `raw` is a valid out-pointer; no context pointer.
        let ret = unsafe {
            ffi::rdma_create_id(
                channel.inner.raw.as_ptr(),
                &mut raw,
                std::ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        check_ret(ret).map_err(cm_err("rdma_create_id"))?;
        let raw = non_null(raw).map_err(cm_err("rdma_create_id"))?;
        Ok(Self {
            raw,
            channel: channel.inner.clone(),
        })
    }

    /// The key events about this id carry.
    pub fn key(&self) -> CmIdKey {
        CmIdKey(self.raw.as_ptr() as usize)
    }

    /// Binds to a local address (port 0: any free port), as a listener does before
    /// [`CmId::listen`].
    pub fn bind(&mut self, addr: SocketAddr) -> Result<()> {
        let _guard = self.channel.lock();
        let mut sa = SockAddr::from(addr);
        // SAFETY: the id is alive; `sa` is a valid socket address of its family.
        let ret = unsafe { ffi::rdma_bind_addr(self.raw.as_ptr(), sa.as_mut_ptr()) };
        check_ret(ret).map_err(cm_err("rdma_bind_addr"))
    }

    /// Listens for connection requests on the bound address; they arrive as
    /// [`CmEventKind::ConnectRequest`] events.
    pub fn listen(&mut self, backlog: i32) -> Result<()> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive.
        let ret = unsafe { ffi::rdma_listen(self.raw.as_ptr(), backlog) };
        check_ret(ret).map_err(cm_err("rdma_listen"))
    }

    /// Starts resolving `dst` (and `src`, if given) to a device, port and GID; ends with
    /// [`CmEventKind::AddrResolved`] or [`CmEventKind::AddrError`].
    pub fn resolve_addr(
        &mut self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let mut src = src.map(SockAddr::from);
        let mut dst = SockAddr::from(dst);
        let src_ptr = src
            .as_mut()
            .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
        let _guard = self.channel.lock();
        // SAFETY: the id is alive; both addresses are valid (or NULL) for the call.
        let ret = unsafe {
            ffi::rdma_resolve_addr(
                self.raw.as_ptr(),
                src_ptr,
                dst.as_mut_ptr(),
                cm_timeout_ms(timeout),
            )
        };
        check_ret(ret).map_err(cm_err("rdma_resolve_addr"))
    }

    /// Starts resolving the route to the resolved address; ends with
    /// [`CmEventKind::RouteResolved`] or [`CmEventKind::RouteError`].
    pub fn resolve_route(&mut self, timeout: Duration) -> Result<()> {
        let _guard = self.channel.lock();
        self.require_device("rdma_resolve_route", "after its address resolved")?;
        // SAFETY: the id is alive and bound to a device (librdmacm reads it unchecked).
        let ret = unsafe { ffi::rdma_resolve_route(self.raw.as_ptr(), cm_timeout_ms(timeout)) };
        check_ret(ret).map_err(cm_err("rdma_resolve_route"))
    }

    /// The name of the device the id is bound to (after address resolution, a bind to a
    /// device's address, or on a connection request); `None` before.
    pub fn device_name(&self) -> Option<String> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive; `verbs` is NULL or a context librdmacm keeps open.
        let verbs = unsafe { (*self.raw.as_ptr()).verbs };
        if verbs.is_null() {
            return None;
        }
        // SAFETY: a live context's device pointer and its name are valid C strings.
        let name = unsafe { ffi::ibv_get_device_name((*verbs).device) };
        if name.is_null() {
            return None;
        }
        // SAFETY: as above.
        Some(
            unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// The device port the id is bound to (0 before it is bound to a device).
    pub fn port_num(&self) -> u8 {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive.
        unsafe { (*self.raw.as_ptr()).port_num }
    }

    /// The local address (after a bind or resolution; `None` before).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive; the route's source address is a sockaddr_storage.
        let storage = unsafe { &(*self.raw.as_ptr()).route.addr.src_addr_union.src_storage };
        SockAddr::to_std(storage)
    }

    /// The peer's address (after resolution, or on a connection request).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive; the route's destination address is a sockaddr_storage.
        let storage = unsafe { &(*self.raw.as_ptr()).route.addr.dst_addr_union.dst_storage };
        SockAddr::to_std(storage)
    }

    fn qp_attr(&self, state: QpState) -> Result<(ffi::ibv_qp_attr, u32)> {
        let _guard = self.channel.lock();
        // SAFETY: ibv_qp_attr is plain old data; all-zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = match state {
            QpState::Init => ffi::ibv_qp_state::IBV_QPS_INIT,
            QpState::Rtr => ffi::ibv_qp_state::IBV_QPS_RTR,
            QpState::Rts => ffi::ibv_qp_state::IBV_QPS_RTS,
            other => {
                return Err(Error::InvalidArgument(format!(
                "the connection manager computes attributes for INIT, RTR and RTS, not {other:?}"
            )))
            }
        };
        let mut mask: libc::c_int = 0;
        // SAFETY: the id is alive; both out-pointers are valid.
        let ret = unsafe { ffi::rdma_init_qp_attr(self.raw.as_ptr(), &mut attr, &mut mask) };
        check_ret(ret).map_err(cm_err("rdma_init_qp_attr"))?;
        Ok((attr, mask as u32))
    }

    /// RESET → INIT with the port and partition the CM resolved. Remote access stays what
    /// rdmsg allows everywhere (remote read of exposed regions only), whatever the CM offers.
    pub fn init_qp(&self, qp: &mut QueuePair) -> Result<()> {
        let (mut attr, mask) = self.qp_attr(QpState::Init)?;
        attr.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        let mask = mask | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
        qp.modify_from_cm(&mut attr, mask, QpState::Init)
    }

    /// INIT → RTR → RTS with the path, PSNs and peer's queue pair number the CM negotiated:
    /// the passive side before [`CmId::accept`], the active side on
    /// [`CmEventKind::ConnectResponse`] (then [`CmId::establish`]). `tuning` replaces what
    /// rdmsg decides itself (see [`QpTuning`]).
    pub fn ready_qp(&self, qp: &mut QueuePair, tuning: &QpTuning) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let five_bits = |what: &str, v: u8, max: u8| {
            if v > max {
                Err(Error::InvalidArgument(format!("{what} {v} is above {max}")))
            } else {
                Ok(())
            }
        };
        five_bits("min_rnr_timer", tuning.min_rnr_timer, 31)?;
        if let Some(t) = tuning.timeout {
            five_bits("timeout", t, 31)?;
        }
        if let Some(r) = tuning.retry_cnt {
            five_bits("retry_cnt", r, 7)?;
        }
        if let Some(r) = tuning.rnr_retry {
            five_bits("rnr_retry", r, 7)?;
        }
        let (mut attr, mut mask) = self.qp_attr(QpState::Rtr)?;
        attr.min_rnr_timer = tuning.min_rnr_timer;
        mask |= m::IBV_QP_MIN_RNR_TIMER.0;
        if let Some(p) = &tuning.reads {
            attr.max_dest_rd_atomic = p.responder_resources;
            mask |= m::IBV_QP_MAX_DEST_RD_ATOMIC.0;
        }
        if let Some(mtu) = tuning.path_mtu {
            // Never above what the CM found the path carries.
            if mtu.to_raw() < attr.path_mtu {
                attr.path_mtu = mtu.to_raw();
            }
        }
        qp.modify_from_cm(&mut attr, mask, QpState::Rtr)?;
        let (mut attr, mut mask) = self.qp_attr(QpState::Rts)?;
        if let Some(p) = &tuning.reads {
            attr.max_rd_atomic = p.initiator_depth;
            mask |= m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        }
        if let Some(t) = tuning.timeout {
            attr.timeout = t;
            mask |= m::IBV_QP_TIMEOUT.0;
        }
        if let Some(r) = tuning.retry_cnt {
            attr.retry_cnt = r;
            mask |= m::IBV_QP_RETRY_CNT.0;
        }
        if let Some(r) = tuning.rnr_retry {
            attr.rnr_retry = r;
            mask |= m::IBV_QP_RNR_RETRY.0;
        }
        qp.modify_from_cm(&mut attr, mask, QpState::Rts)
    }

    /// Moves the id to another event channel (`rdma_migrate_id`): a connection accepted on a
    /// listener's channel gets one of its own. Its events so far were acknowledged as they
    /// were read, as librdmacm requires.
    pub fn migrate(&mut self, channel: &CmEventChannel) -> Result<()> {
        if Arc::ptr_eq(&self.channel, &channel.inner) {
            return Ok(());
        }
        {
            // Readers of either channel may touch the id until it has moved.
            let _old = self.channel.lock();
            let _new = channel.inner.lock();
            // SAFETY: the id and both channels are alive; every event of the id read so far
            // was acknowledged, under the old lock held here.
            let ret =
                unsafe { ffi::rdma_migrate_id(self.raw.as_ptr(), channel.inner.raw.as_ptr()) };
            check_ret(ret).map_err(cm_err("rdma_migrate_id"))?;
        }
        self.channel = channel.inner.clone();
        Ok(())
    }

    fn conn_param(
        qp: &QueuePair,
        params: &ConnParams,
        private_data: &[u8],
    ) -> ffi::rdma_conn_param {
        ffi::rdma_conn_param {
            private_data: if private_data.is_empty() {
                std::ptr::null()
            } else {
                private_data.as_ptr().cast()
            },
            private_data_len: private_data.len() as u8,
            responder_resources: params.responder_resources,
            initiator_depth: params.initiator_depth,
            flow_control: 1,
            retry_count: params.retry_count.min(7),
            rnr_retry_count: params.rnr_retry_count.min(7),
            srq: u8::from(qp.has_srq()),
            qp_num: qp.qp_num(),
        }
    }

    fn check_private(what: &str, data: &[u8], max: usize) -> Result<()> {
        if data.len() > max {
            return Err(Error::InvalidArgument(format!(
                "{what} private data is {} bytes; the connection manager carries at most {max}",
                data.len()
            )));
        }
        Ok(())
    }

    /// Fails unless the id is bound to a device: librdmacm reads the device of an id unchecked
    /// in `rdma_resolve_route`, `rdma_connect` and `rdma_accept`. Call with the lock held.
    fn require_device(&self, call: &str, when: &str) -> Result<()> {
        // SAFETY: the id is alive; the caller holds the channel's lock.
        if unsafe { (*self.raw.as_ptr()).verbs }.is_null() {
            return Err(Error::InvalidArgument(format!(
                "{call} on a connection-manager id bound to no device: call it {when}"
            )));
        }
        Ok(())
    }

    /// Asks the resolved peer to connect `qp` (in INIT), with up to
    /// [`CONNECT_PRIVATE_DATA_MAX`] bytes of private data. Ends with
    /// [`CmEventKind::ConnectResponse`], [`CmEventKind::Rejected`],
    /// [`CmEventKind::Unreachable`] or [`CmEventKind::ConnectError`].
    pub fn connect(
        &mut self,
        qp: &QueuePair,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        Self::check_private("a connect's", private_data, CONNECT_PRIVATE_DATA_MAX)?;
        let _guard = self.channel.lock();
        self.require_device("rdma_connect", "once its route resolved")?;
        let mut p = Self::conn_param(qp, params, private_data);
        // SAFETY: the id is alive; `p` and the private data it points to outlive the call
        // (librdmacm copies them).
        let ret = unsafe { ffi::rdma_connect(self.raw.as_ptr(), &mut p) };
        check_ret(ret).map_err(cm_err("rdma_connect"))
    }

    /// Accepts a connection request with `qp` (in RTS, see [`CmId::ready_qp`]) and up to
    /// [`ACCEPT_PRIVATE_DATA_MAX`] bytes of private data. Ends with
    /// [`CmEventKind::Established`] (or an error event).
    pub fn accept(
        &mut self,
        qp: &QueuePair,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        Self::check_private("an accept's", private_data, ACCEPT_PRIVATE_DATA_MAX)?;
        let _guard = self.channel.lock();
        self.require_device("rdma_accept", "on a connection request's id")?;
        let mut p = Self::conn_param(qp, params, private_data);
        // SAFETY: as in `connect`.
        let ret = unsafe { ffi::rdma_accept(self.raw.as_ptr(), &mut p) };
        check_ret(ret).map_err(cm_err("rdma_accept"))
    }

    /// Refuses a connection request, with up to [`REJECT_PRIVATE_DATA_MAX`] bytes saying why
    /// (the peer sees [`CmEventKind::Rejected`] with reason [`REJECT_CONSUMER`]).
    pub fn reject(&mut self, private_data: &[u8]) -> Result<()> {
        let _guard = self.channel.lock();
        Self::check_private("a reject's", private_data, REJECT_PRIVATE_DATA_MAX)?;
        let ptr = if private_data.is_empty() {
            std::ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        // SAFETY: the id is alive; the data outlives the call.
        let ret = unsafe { ffi::rdma_reject(self.raw.as_ptr(), ptr, private_data.len() as u8) };
        check_ret(ret).map_err(cm_err("rdma_reject"))
    }

    /// Tells the CM the active side's queue pair is in RTS (after
    /// [`CmEventKind::ConnectResponse`]); the passive side then sees
    /// [`CmEventKind::Established`].
    pub fn establish(&mut self) -> Result<()> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive.
        let ret = unsafe { ffi::rdma_establish(self.raw.as_ptr()) };
        check_ret(ret).map_err(cm_err("rdma_establish"))
    }

    /// Tells the CM that the connection is in use (`rdma_notify` with `IBV_EVENT_COMM_EST`):
    /// the passive side calls it when a receive completes on its queue pair after
    /// [`CmId::accept`] and before [`CmEventKind::Established`]. Data from the client proves
    /// the client's side is connected, so the CM establishes the connection (delivers
    /// `Established`) without the client's RTU, which may be lost or late: the CM would
    /// resend its REP only after its response timeout (seconds). Harmless once established.
    pub fn notify_established(&mut self) -> Result<()> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive and ours; rdma_notify only passes the event to the kernel's
        // CM for this id (the guard keeps readers of its channel out meanwhile, as for the
        // other calls on a connected id).
        let ret =
            unsafe { ffi::rdma_notify(self.raw.as_ptr(), ffi::ibv_event_type::IBV_EVENT_COMM_EST) };
        check_ret(ret).map_err(cm_err("rdma_notify"))
    }

    /// Disconnects; both sides then see [`CmEventKind::Disconnected`]. The queue pair is not
    /// touched: move it to ERROR to flush what is still posted.
    pub fn disconnect(&mut self) -> Result<()> {
        let _guard = self.channel.lock();
        // SAFETY: the id is alive.
        let ret = unsafe { ffi::rdma_disconnect(self.raw.as_ptr()) };
        check_ret(ret).map_err(cm_err("rdma_disconnect"))
    }
}

/// A socket address in the C layout librdmacm takes.
struct SockAddr(libc::sockaddr_storage);

impl SockAddr {
    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        (&mut self.0 as *mut libc::sockaddr_storage).cast()
    }

    fn to_std(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
        match storage.ss_family as libc::c_int {
            libc::AF_INET => {
                // SAFETY: the family says the storage holds a sockaddr_in, which it can.
                let sin = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says the storage holds a sockaddr_in6, which it can.
                let sin6 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

impl From<SocketAddr> for SockAddr {
    fn from(addr: SocketAddr) -> Self {
        // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in.
                let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = a.port().to_be();
                sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            }
            SocketAddr::V6(a) => {
                // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in6.
                let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = a.port().to_be();
                sin6.sin6_addr.s6_addr = a.ip().octets();
                sin6.sin6_flowinfo = a.flowinfo();
                sin6.sin6_scope_id = a.scope_id();
            }
        }
        Self(storage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_survive_the_c_layout() {
        for addr in [
            "10.77.0.1:7471",
            "0.0.0.0:0",
            "[::1]:18515",
            "[fe80::1%3]:1",
            "255.255.255.255:65535",
        ] {
            let addr: SocketAddr = addr.parse().unwrap();
            let c = SockAddr::from(addr);
            assert_eq!(SockAddr::to_std(&c.0), Some(addr), "{addr}");
        }
        // SAFETY: all-zero storage is valid; its family is AF_UNSPEC.
        let none: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        assert_eq!(SockAddr::to_std(&none), None);
    }

    #[test]
    fn event_kinds_map_from_librdmacm() {
        use ffi::rdma_cm_event_type::*;
        assert_eq!(
            CmEventKind::from_raw(RDMA_CM_EVENT_CONNECT_REQUEST),
            CmEventKind::ConnectRequest
        );
        assert_eq!(
            CmEventKind::from_raw(RDMA_CM_EVENT_DISCONNECTED),
            CmEventKind::Disconnected
        );
        assert_eq!(
            CmEventKind::from_raw(RDMA_CM_EVENT_TIMEWAIT_EXIT),
            CmEventKind::TimewaitExit
        );
        assert_eq!(CmEventKind::from_raw(99), CmEventKind::Other(99));
    }

    #[test]
    fn a_missing_connection_manager_names_the_modules() {
        let e = Error::Cm {
            call: "rdma_create_event_channel",
            source: io::Error::from_raw_os_error(libc::ENODEV),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("rdma_create_event_channel failed (ENODEV)"),
            "{text}"
        );
        assert!(text.contains("modprobe rdma_ucm"), "{text}");
        let e = Error::Cm {
            call: "rdma_connect",
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert_eq!(e.to_string(), "rdma_connect failed (EINVAL)");
    }
}
