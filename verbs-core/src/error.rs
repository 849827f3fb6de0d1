//! One error type for every failing verb, and the single funnel from C return codes to it.

use std::io;

use crate::QpState;

/// Result alias for verbs-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failed verb, with the context needed to tell which call failed and why.
///
/// The OS error (`errno`, or the error number a verb returned directly) is the `#[source]`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `ibv_get_device_list` failed (typically: `ib_uverbs` not loaded).
    #[error("listing RDMA devices")]
    ListDevices(#[source] io::Error),
    /// No device of that name is present.
    #[error("no RDMA device named {name:?} (present: {present:?})")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The names that are present.
        present: Vec<String>,
    },
    /// The system has no RDMA device at all.
    #[error("no RDMA device present")]
    NoDevice,
    /// `ibv_open_device` failed.
    #[error("opening device {device}")]
    OpenDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed.
    #[error("querying device {device}")]
    QueryDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_port` failed.
    #[error("querying port {port}")]
    QueryPort {
        /// Port number.
        port: u8,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_gid` failed.
    #[error("querying GID {index} of port {port}")]
    QueryGid {
        /// Port number.
        port: u8,
        /// GID table index.
        index: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The port has no RoCE v2 GID carrying an IPv4 address.
    #[error("port {port} has no RoCE v2 GID with an IPv4-mapped address (is an IPv4 address set on its netdev?)")]
    NoRoceV2Gid {
        /// Port number.
        port: u8,
    },
    /// `ibv_alloc_pd` failed.
    #[error("allocating a protection domain")]
    AllocPd(#[source] io::Error),
    /// `ibv_reg_mr` failed.
    #[error("registering {len} bytes of memory")]
    RegisterMemory {
        /// Requested length.
        len: usize,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_comp_channel` failed.
    #[error("creating a completion channel")]
    CreateCompChannel(#[source] io::Error),
    /// Switching a file descriptor between blocking and non-blocking failed.
    #[error("setting O_NONBLOCK={nonblocking} on fd {fd}")]
    SetNonBlocking {
        /// The file descriptor.
        fd: i32,
        /// Requested mode.
        nonblocking: bool,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_cq` failed.
    #[error("creating a completion queue of {cqe} entries")]
    CreateCq {
        /// Requested number of entries.
        cqe: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_req_notify_cq` failed.
    #[error("arming a completion queue (solicited_only={solicited_only})")]
    ReqNotifyCq {
        /// The arming mode.
        solicited_only: bool,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_get_cq_event` failed (other than `EAGAIN` on a non-blocking channel).
    #[error("reading a completion event")]
    GetCqEvent(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    #[error("polling a completion queue")]
    PollCq(#[source] io::Error),
    /// `ibv_create_qp` failed.
    #[error("creating a queue pair")]
    CreateQp(#[source] io::Error),
    /// `ibv_modify_qp` failed.
    #[error("moving queue pair {qp_num:#x} from {from:?} to {to:?}")]
    ModifyQp {
        /// Queue pair number.
        qp_num: u32,
        /// State before the call.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    #[error("querying queue pair {qp_num:#x}")]
    QueryQp {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_send` failed.
    #[error("posting to the send queue of queue pair {qp_num:#x}")]
    PostSend {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` failed.
    #[error("posting to the receive queue of queue pair {qp_num:#x}")]
    PostRecv {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_get_async_event` failed (other than `EAGAIN` in non-blocking mode).
    #[error("reading an asynchronous event")]
    GetAsyncEvent(#[source] io::Error),
    /// `poll(2)` on a verbs descriptor failed.
    #[error("waiting for fd {fd} to become readable")]
    WaitFd {
        /// The descriptor.
        fd: i32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// An argument was rejected before any verb was called.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Converts the return value of a verb that returns 0 or an error number (`ibv_modify_qp`,
/// `ibv_req_notify_cq`, `ibv_post_send`...). Some providers return -1 and set errno instead;
/// errno is then read exactly once.
pub(crate) fn check_ret(ret: libc::c_int) -> io::Result<()> {
    match ret {
        0 => Ok(()),
        r if r > 0 => Err(io::Error::from_raw_os_error(r)),
        _ => Err(last_os_error()),
    }
}

/// Reads errno once; a verb that failed without setting it is reported as such.
pub(crate) fn last_os_error() -> io::Error {
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(0) {
        io::Error::other("verb failed without setting errno")
    } else {
        err
    }
}

/// Converts a pointer returned by a constructor verb (NULL plus errno on failure).
pub(crate) fn non_null<T>(ptr: *mut T) -> io::Result<std::ptr::NonNull<T>> {
    std::ptr::NonNull::new(ptr).ok_or_else(last_os_error)
}
