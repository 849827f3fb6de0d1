//! Devices, opened contexts, port and GID queries.

use std::ffi::CStr;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{check_ret, last_os_error, non_null, Error, Result};
use crate::ffi;

/// A device as listed by `ibv_get_device_list`, before it is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `rxe0` or `mlx5_0`.
    pub name: String,
    /// Node GUID in host byte order.
    pub guid: u64,
}

/// Lists the RDMA devices present. An empty list is not an error here.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    with_device_list(|list| {
        Ok(list
            .iter()
            .map(|&dev| DeviceInfo {
                name: device_name(dev),
                // SAFETY: `dev` comes from a live device list.
                guid: u64::from_be(unsafe { ffi::ibv_get_device_guid(dev) }),
            })
            .collect())
    })
}

/// Runs `f` over the device list, freeing the list afterwards whatever `f` returns.
fn with_device_list<T>(f: impl FnOnce(&[*mut ffi::ibv_device]) -> Result<T>) -> Result<T> {
    let mut count: libc::c_int = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut count) };
    if list.is_null() {
        return Err(Error::ListDevices(last_os_error()));
    }
    let len = usize::try_from(count).unwrap_or(0);
    // SAFETY: libibverbs returns `count` valid entries followed by NULL; the slice does not
    // outlive `list`, which is freed only after `f` returns.
    let slice = unsafe { std::slice::from_raw_parts(list, len) };
    let result = f(slice);
    // SAFETY: `list` came from ibv_get_device_list and is freed once; opened contexts stay valid.
    unsafe { ffi::ibv_free_device_list(list) };
    result
}

fn device_name(dev: *mut ffi::ibv_device) -> String {
    // SAFETY: `dev` is a live device; the name is a NUL-terminated string inside it.
    let name = unsafe { ffi::ibv_get_device_name(dev) };
    if name.is_null() {
        return String::new();
    }
    // SAFETY: checked non-NULL above; the string lives as long as the device list.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

pub(crate) struct ContextInner {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: an ibv_context is thread-safe per the libibverbs documentation; the pointer is owned
// by this struct and freed once, in Drop.
unsafe impl Send for ContextInner {}
// SAFETY: see Send; shared use only calls thread-safe verbs.
unsafe impl Sync for ContextInner {}

impl ContextInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child (PD, CQ, channel...) holds an Arc of this context, so none is
        // alive any more; the context is closed exactly once.
        unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// An opened device (`ibv_context`). Cheap to clone; closed when the last clone and the last
/// child resource are dropped.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Self> {
        with_device_list(|list| {
            let dev = list
                .iter()
                .copied()
                .find(|&d| device_name(d) == name)
                .ok_or_else(|| Error::DeviceNotFound {
                    name: name.to_owned(),
                    present: list.iter().map(|&d| device_name(d)).collect(),
                })?;
            Self::open_raw(dev, name)
        })
    }

    /// The environment variable naming the device that [`Context::open_default`] opens.
    pub const DEVICE_ENV: &'static str = "RDMSG_DEVICE";

    /// Opens the device named by `$RDMSG_DEVICE`, or the first device when it is unset.
    pub fn open_default() -> Result<Self> {
        match std::env::var(Self::DEVICE_ENV) {
            Ok(name) if !name.is_empty() => Self::open(&name),
            _ => Self::open_first(),
        }
    }

    /// Opens the first device listed.
    pub fn open_first() -> Result<Self> {
        with_device_list(|list| {
            let &dev = list.first().ok_or(Error::NoDevice)?;
            Self::open_raw(dev, &device_name(dev))
        })
    }

    fn open_raw(dev: *mut ffi::ibv_device, name: &str) -> Result<Self> {
        // SAFETY: `dev` belongs to a live device list; the context outlives the list.
        let ctx =
            non_null(unsafe { ffi::ibv_open_device(dev) }).map_err(|source| Error::OpenDevice {
                device: name.to_owned(),
                source,
            })?;
        Ok(Self {
            inner: Arc::new(ContextInner {
                ctx,
                name: name.to_owned(),
            }),
        })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The raw `ibv_context`. Valid as long as this `Context` or any resource created from it
    /// is alive.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.as_ptr()
    }

    /// Device capabilities (`ibv_query_device`).
    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        check_ret(unsafe { ffi::ibv_query_device(self.as_raw(), &mut attr) }).map_err(
            |source| Error::QueryDevice {
                device: self.inner.name.clone(),
                source,
            },
        )?;
        let nonneg = |v: libc::c_int| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttr {
            max_qp_wr: nonneg(attr.max_qp_wr),
            max_sge: nonneg(attr.max_sge),
            max_cqe: nonneg(attr.max_cqe),
            max_mr_size: attr.max_mr_size,
            max_qp: nonneg(attr.max_qp),
            max_cq: nonneg(attr.max_cq),
            max_srq_wr: nonneg(attr.max_srq_wr),
            max_qp_rd_atom: nonneg(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: nonneg(attr.max_qp_init_rd_atom),
            phys_port_cnt: attr.phys_port_cnt,
            mw_type2: attr.device_cap_flags
                & ffi::ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0
                != 0,
            max_mw: nonneg(attr.max_mw),
        })
    }

    /// Port attributes (`ibv_query_port`).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: ibv_port_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer of the right size.
        check_ret(unsafe { ffi::___ibv_query_port(self.as_raw(), port, &mut attr) }).map_err(
            |source| Error::QueryPort {
                device: self.inner.name.clone(),
                port,
                source,
            },
        )?;
        Ok(PortAttr {
            state: PortState::from_raw(attr.state),
            max_mtu: Mtu::from_raw(attr.max_mtu),
            active_mtu: Mtu::from_raw(attr.active_mtu),
            lid: attr.lid,
            gid_table_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            link_layer: match u32::from(attr.link_layer) {
                // IBV_LINK_LAYER_* from verbs.h, an anonymous enum bindgen does not emit.
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                other => LinkLayer::Other(other),
            },
        })
    }

    /// The GID at `index` of `port`.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let c_index = libc::c_int::try_from(index)
            .map_err(|_| Error::InvalidArgument(format!("GID index {index} out of range")))?;
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: the context is open and `gid` is a valid out-pointer.
        check_ret(unsafe { ffi::ibv_query_gid(self.as_raw(), port, c_index, &mut gid) }).map_err(
            |source| Error::QueryGid {
                device: self.inner.name.clone(),
                port,
                index,
                source,
            },
        )?;
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(Gid(unsafe { gid.raw }))
    }

    /// The GID type of a table entry as the kernel reports it in sysfs, e.g. `"RoCE v2"` or
    /// `"IB/RoCE v1"`; `None` where sysfs does not say (InfiniBand ports, old kernels).
    pub fn gid_type(&self, port: u8, index: u32) -> Option<String> {
        let path = format!(
            "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}",
            self.inner.name
        );
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
    }

    /// Picks the GID a RoCE connection should use: the first RoCE v2 entry holding an
    /// IPv4-mapped address (the `-g` index `ibv_rc_pingpong` users look up by hand).
    /// Falls back to any IPv4-mapped entry where sysfs has no GID types.
    pub fn pick_roce_v2_ipv4_gid(&self, port: u8) -> Result<(u32, Gid)> {
        let attr = self.query_port(port)?;
        let mut fallback = None;
        for index in 0..attr.gid_table_len {
            let Ok(gid) = self.query_gid(port, index) else {
                continue;
            };
            if gid.to_ipv4().is_none() {
                continue;
            }
            match self.gid_type(port, index).as_deref() {
                Some("RoCE v2") => return Ok((index, gid)),
                None => {
                    fallback.get_or_insert((index, gid));
                }
                Some(_) => {}
            }
        }
        fallback.ok_or(Error::NoRoceV2Gid { port })
    }

    /// Reads the next asynchronous event (port changes, QP fatal, CQ overrun...). Blocks unless
    /// [`Context::set_async_nonblocking`] was called, in which case `Ok(None)` means none is
    /// pending. The event is acknowledged before it is returned, so destroying the resource it
    /// names never waits for it.
    pub fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
        let mut raw = std::mem::MaybeUninit::<ffi::ibv_async_event>::uninit();
        // SAFETY: the context is open; `raw` is a valid out-pointer.
        let ret = unsafe { ffi::ibv_get_async_event(self.as_raw(), raw.as_mut_ptr()) };
        if ret != 0 {
            let err = last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::GetAsyncEvent(err));
        }
        // SAFETY: ibv_get_async_event returned 0, so it filled `raw`.
        let mut raw = unsafe { raw.assume_init() };
        let event = AsyncEvent::from_raw(&raw);
        // SAFETY: `raw` was returned by ibv_get_async_event and is acked exactly once.
        unsafe { ffi::ibv_ack_async_event(&mut raw) };
        Ok(Some(event))
    }

    /// Makes [`Context::get_async_event`] non-blocking (for use with poll/epoll on
    /// [`Context::async_fd`]).
    pub fn set_async_nonblocking(&self, nonblocking: bool) -> Result<()> {
        crate::set_nonblocking(self.async_fd().as_raw_fd(), nonblocking)
    }

    /// The file descriptor that becomes readable when an asynchronous event is pending.
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the context is open, so `async_fd` is a valid open descriptor for as long as
        // the borrow of `self` lasts.
        unsafe { BorrowedFd::borrow_raw((*self.as_raw()).async_fd) }
    }
}

impl AsRawFd for Context {
    /// The asynchronous event descriptor.
    fn as_raw_fd(&self) -> RawFd {
        self.async_fd().as_raw_fd()
    }
}

impl AsFd for Context {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.async_fd()
    }
}

/// The device limits that matter for sizing queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Maximum work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per work request.
    pub max_sge: u32,
    /// Maximum entries per completion queue.
    pub max_cqe: u32,
    /// Largest registrable region.
    pub max_mr_size: u64,
    /// Maximum queue pairs.
    pub max_qp: u32,
    /// Maximum completion queues.
    pub max_cq: u32,
    /// Maximum work requests per shared receive queue.
    pub max_srq_wr: u32,
    /// Most RDMA reads a queue pair serves for its peer at once (responder resources).
    pub max_qp_rd_atom: u32,
    /// Most RDMA reads a queue pair may have in flight as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Memory windows of type 2 (bound to one queue pair through a work request,
    /// `IBV_DEVICE_MEM_WINDOW_TYPE_2B`), and how many the device holds.
    pub mw_type2: bool,
    /// Maximum memory windows.
    pub max_mw: u32,
}

/// Port attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU currently in effect; use it as a connection's path MTU.
    pub active_mtu: Mtu,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Entries in the GID table.
    pub gid_table_len: u32,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// Native InfiniBand: addressed by LID.
    InfiniBand,
    /// RoCE: addressed by GID.
    Ethernet,
    /// Unknown value.
    Other(u32),
}

/// Logical port state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Link down.
    Down,
    /// Link up, not yet configured.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Any other value.
    Other(u32),
}

impl PortState {
    fn from_raw(v: ffi::ibv_port_state::Type) -> Self {
        use ffi::ibv_port_state::*;
        match v {
            IBV_PORT_DOWN => Self::Down,
            IBV_PORT_INIT => Self::Init,
            IBV_PORT_ARMED => Self::Armed,
            IBV_PORT_ACTIVE => Self::Active,
            other => Self::Other(other),
        }
    }
}

/// Path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    pub(crate) fn from_raw(v: ffi::ibv_mtu::Type) -> Self {
        use ffi::ibv_mtu::*;
        match v {
            IBV_MTU_256 => Self::Mtu256,
            IBV_MTU_512 => Self::Mtu512,
            IBV_MTU_2048 => Self::Mtu2048,
            IBV_MTU_4096 => Self::Mtu4096,
            _ => Self::Mtu1024,
        }
    }

    pub(crate) fn to_raw(self) -> ffi::ibv_mtu::Type {
        use ffi::ibv_mtu::*;
        match self {
            Self::Mtu256 => IBV_MTU_256,
            Self::Mtu512 => IBV_MTU_512,
            Self::Mtu1024 => IBV_MTU_1024,
            Self::Mtu2048 => IBV_MTU_2048,
            Self::Mtu4096 => IBV_MTU_4096,
        }
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> usize {
        match self {
            Self::Mtu256 => 256,
            Self::Mtu512 => 512,
            Self::Mtu1024 => 1024,
            Self::Mtu2048 => 2048,
            Self::Mtu4096 => 4096,
        }
    }

    /// The MTU for a byte count as `ibv_rc_pingpong -m` takes it.
    pub fn from_bytes(bytes: usize) -> Option<Self> {
        Some(match bytes {
            256 => Self::Mtu256,
            512 => Self::Mtu512,
            1024 => Self::Mtu1024,
            2048 => Self::Mtu2048,
            4096 => Self::Mtu4096,
            _ => return None,
        })
    }
}

/// A 128-bit global identifier; on RoCE it encodes an IP address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// True for the all-zero GID (an unused table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Ipv6Addr::from(self.0).fmt(f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// An asynchronous event (`ibv_get_async_event`), already acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// What it happened to.
    pub element: AsyncElement,
}

/// The resource an asynchronous event concerns. Raw pointers are given as addresses for
/// comparison with `as_raw()` of a live handle only; they are never dereferenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncElement {
    /// A completion queue (address of its `ibv_cq`).
    Cq(usize),
    /// A queue pair, by number.
    Qp(u32),
    /// A shared receive queue (address of its `ibv_srq`).
    Srq(usize),
    /// A port, by number.
    Port(u8),
    /// The device as a whole.
    Device,
}

/// Kinds of asynchronous events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEventKind {
    /// A completion queue overran: completions were lost; the CQ is unusable.
    CqErr,
    /// A queue pair hit an error it cannot report through a completion.
    QpFatal,
    /// Invalid request on a queue pair (transport error).
    QpReqErr,
    /// Access violation on a queue pair.
    QpAccessErr,
    /// First packet arrived on a queue pair in RTR.
    CommEst,
    /// The send queue drained.
    SqDrained,
    /// The last WQE of a QP attached to an SRQ was consumed.
    QpLastWqeReached,
    /// An SRQ fell below its limit.
    SrqLimitReached,
    /// SRQ error.
    SrqErr,
    /// Port became active.
    PortActive,
    /// Port left the active state.
    PortErr,
    /// LID changed.
    LidChange,
    /// P_Key table changed.
    PkeyChange,
    /// GID table changed.
    GidChange,
    /// Fatal device error.
    DeviceFatal,
    /// Any other event.
    Other(u32),
}

impl AsyncEvent {
    fn from_raw(raw: &ffi::ibv_async_event) -> Self {
        use ffi::ibv_event_type::*;
        let kind = match raw.event_type {
            IBV_EVENT_CQ_ERR => AsyncEventKind::CqErr,
            IBV_EVENT_QP_FATAL => AsyncEventKind::QpFatal,
            IBV_EVENT_QP_REQ_ERR => AsyncEventKind::QpReqErr,
            IBV_EVENT_QP_ACCESS_ERR => AsyncEventKind::QpAccessErr,
            IBV_EVENT_COMM_EST => AsyncEventKind::CommEst,
            IBV_EVENT_SQ_DRAINED => AsyncEventKind::SqDrained,
            IBV_EVENT_QP_LAST_WQE_REACHED => AsyncEventKind::QpLastWqeReached,
            IBV_EVENT_SRQ_LIMIT_REACHED => AsyncEventKind::SrqLimitReached,
            IBV_EVENT_SRQ_ERR => AsyncEventKind::SrqErr,
            IBV_EVENT_PORT_ACTIVE => AsyncEventKind::PortActive,
            IBV_EVENT_PORT_ERR => AsyncEventKind::PortErr,
            IBV_EVENT_LID_CHANGE => AsyncEventKind::LidChange,
            IBV_EVENT_PKEY_CHANGE => AsyncEventKind::PkeyChange,
            IBV_EVENT_GID_CHANGE => AsyncEventKind::GidChange,
            IBV_EVENT_DEVICE_FATAL => AsyncEventKind::DeviceFatal,
            other => AsyncEventKind::Other(other as u32),
        };
        // SAFETY: the union member read is the one the event type says is set; the QP is alive
        // until the event is acked, which happens after this function returns.
        let element = unsafe {
            match raw.event_type {
                IBV_EVENT_CQ_ERR => AsyncElement::Cq(raw.element.cq as usize),
                IBV_EVENT_QP_FATAL
                | IBV_EVENT_QP_REQ_ERR
                | IBV_EVENT_QP_ACCESS_ERR
                | IBV_EVENT_COMM_EST
                | IBV_EVENT_SQ_DRAINED
                | IBV_EVENT_PATH_MIG
                | IBV_EVENT_PATH_MIG_ERR
                | IBV_EVENT_QP_LAST_WQE_REACHED => AsyncElement::Qp((*raw.element.qp).qp_num),
                IBV_EVENT_SRQ_ERR | IBV_EVENT_SRQ_LIMIT_REACHED => {
                    AsyncElement::Srq(raw.element.srq as usize)
                }
                IBV_EVENT_PORT_ACTIVE
                | IBV_EVENT_PORT_ERR
                | IBV_EVENT_LID_CHANGE
                | IBV_EVENT_PKEY_CHANGE
                | IBV_EVENT_GID_CHANGE
                | IBV_EVENT_SM_CHANGE
                | IBV_EVENT_CLIENT_REREGISTER => {
                    AsyncElement::Port(u8::try_from(raw.element.port_num).unwrap_or(0))
                }
                _ => AsyncElement::Device,
            }
        };
        Self { kind, element }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_shows_and_extracts_ipv4() {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, 77, 0, 1]);
        let gid = Gid(raw);
        assert_eq!(gid.to_ipv4(), Some(Ipv4Addr::new(10, 77, 0, 1)));
        assert_eq!(gid.to_string(), "::ffff:10.77.0.1");
        assert!(!gid.is_zero());
        assert!(Gid::default().is_zero());
        let link_local = Gid("fe80::1".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(link_local.to_ipv4(), None);
    }

    #[test]
    fn mtu_round_trips() {
        for bytes in [256, 512, 1024, 2048, 4096] {
            let mtu = Mtu::from_bytes(bytes).unwrap();
            assert_eq!(mtu.bytes(), bytes);
            assert_eq!(Mtu::from_raw(mtu.to_raw()), mtu);
        }
        assert_eq!(Mtu::from_bytes(1500), None);
    }
}
