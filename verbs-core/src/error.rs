//! One error type for every failing verb, and the single funnel from C return codes to it.

use std::io;

use crate::{QpCaps, QpState};

/// Result alias for verbs-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failed verb, with the context needed to tell which call failed and why.
///
/// Each message names the call, its context and, in short form, the error number (for example
/// `ibv_post_send on QP 0x11 failed (ENOMEM)`); the OS error itself (`errno`, or the error
/// number a verb returned directly) is the `#[source]`, so printing the chain (anyhow's `{:#}`)
/// adds its full text once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `ibv_get_device_list` failed (typically `ENOSYS`: the kernel has no RDMA support
    /// loaded, `ib_uverbs`). The message says how to set up Soft-RoCE ([`SETUP_HINT`]).
    #[error("ibv_get_device_list failed ({}){}", Errno(.0), ListHint(.0))]
    ListDevices(#[source] io::Error),
    /// No device of that name is present.
    #[error("no RDMA device named {name:?} {}", Present(.present))]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The names that are present.
        present: Vec<String>,
    },
    /// The system has no RDMA device at all. The message says how to set up Soft-RoCE
    /// ([`SETUP_HINT`]).
    #[error("no RDMA device present; {SETUP_HINT}")]
    NoDevice,
    /// `ibv_open_device` failed.
    #[error("ibv_open_device on {device} failed ({}){}", Errno(.source), FdHint(.source))]
    OpenDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device on {device} failed ({})", Errno(.source))]
    QueryDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_port` failed.
    #[error("ibv_query_port on {device} port {port} failed ({})", Errno(.source))]
    QueryPort {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_gid` failed.
    #[error("ibv_query_gid on {device} port {port} index {index} failed ({})", Errno(.source))]
    QueryGid {
        /// Device name.
        device: String,
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
    #[error("ibv_alloc_pd failed ({})", Errno(.0))]
    AllocPd(#[source] io::Error),
    /// `ibv_reg_mr` failed (or the memory to register could not be allocated: `ENOMEM`).
    #[error("ibv_reg_mr of {len} bytes failed ({}){}", Errno(.source), MemlockHint(.source))]
    RegisterMemory {
        /// Requested length.
        len: usize,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_alloc_mw` failed (or the device has no memory windows of type 2: `EOPNOTSUPP`).
    #[error("ibv_alloc_mw failed ({})", Errno(.source))]
    AllocMw {
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel failed ({}){}", Errno(.0), FdHint(.0))]
    CreateCompChannel(#[source] io::Error),
    /// Switching a file descriptor between blocking and non-blocking failed.
    #[error("fcntl setting O_NONBLOCK={nonblocking} on fd {fd} failed ({})", Errno(.source))]
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
    #[error("ibv_create_cq of {cqe} entries failed ({})", Errno(.source))]
    CreateCq {
        /// Requested number of entries.
        cqe: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_req_notify_cq` failed.
    #[error("ibv_req_notify_cq (solicited_only={solicited_only}) failed ({})", Errno(.source))]
    ReqNotifyCq {
        /// The arming mode.
        solicited_only: bool,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_get_cq_event` failed (other than `EAGAIN` on a non-blocking channel).
    #[error("ibv_get_cq_event failed ({})", Errno(.0))]
    GetCqEvent(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed ({})", Errno(.0))]
    PollCq(#[source] io::Error),
    /// `ibv_create_qp` failed.
    #[error(
        "ibv_create_qp (max_send_wr {}, max_recv_wr {}, max_inline_data {}) failed ({})",
        .caps.max_send_wr, .caps.max_recv_wr, .caps.max_inline_data, Errno(.source)
    )]
    CreateQp {
        /// The queue sizes requested.
        caps: QpCaps,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_modify_qp` failed.
    #[error("ibv_modify_qp on QP {qp_num:#x} from {from:?} to {to:?} failed ({})", Errno(.source))]
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
    /// `ibv_destroy_qp` failed (the queue pair's posted buffers are leaked: the device may
    /// still own them).
    #[error("ibv_destroy_qp on QP {qp_num:#x} failed ({})", Errno(.source))]
    DestroyQp {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    #[error("ibv_query_qp on QP {qp_num:#x} failed ({})", Errno(.source))]
    QueryQp {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_send` failed.
    #[error("ibv_post_send on QP {qp_num:#x} failed ({})", Errno(.source))]
    PostSend {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` failed.
    #[error("ibv_post_recv on QP {qp_num:#x} failed ({})", Errno(.source))]
    PostRecv {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_srq` failed.
    #[error("ibv_create_srq (max_wr {max_wr}) failed ({})", Errno(.source))]
    CreateSrq {
        /// Requested number of work requests.
        max_wr: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_srq_recv` failed.
    #[error("ibv_post_srq_recv of {requests} requests (max_wr {max_wr}) failed ({})", Errno(.source))]
    PostSrqRecv {
        /// Requests in the failed post.
        requests: usize,
        /// The SRQ's granted size.
        max_wr: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_modify_srq` setting the SRQ limit failed.
    #[error("ibv_modify_srq (srq_limit {limit}) failed ({})", Errno(.source))]
    ModifySrq {
        /// Requested limit.
        limit: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_get_async_event` failed (other than `EAGAIN` in non-blocking mode).
    #[error("ibv_get_async_event failed ({})", Errno(.0))]
    GetAsyncEvent(#[source] io::Error),
    /// A call waiting for verbs descriptors (`poll`, `epoll_create1`, `epoll_ctl`,
    /// `epoll_wait`) failed.
    #[error("{call}{} failed ({}){}", OnFd(.fd), Errno(.source), FdHint(.source))]
    WaitFd {
        /// The call that failed.
        call: &'static str,
        /// The descriptor concerned (-1: none yet).
        fd: i32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// An argument was rejected before any verb was called.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// What to do on a host without a usable RDMA device, as the errors that find none say it:
/// create a Soft-RoCE device over an Ethernet interface, or run the program in rdmsg's test VM.
pub const SETUP_HINT: &str = "to use Soft-RoCE over an Ethernet interface, run as root \
    `modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <iface>`, or, in a clone of rdmsg, \
    `cargo xtask vm -- <program>` runs the program in a VM that has rxe0";

/// What follows a failed device listing: for the error numbers that mean "no RDMA support
/// here" (`ENOSYS`: no `ib_uverbs`; `ENOENT`, `ENODEV`), how to get a device.
struct ListHint<'a>(&'a io::Error);

impl std::fmt::Display for ListHint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.raw_os_error() {
            Some(libc::ENOSYS | libc::ENOENT | libc::ENODEV) => {
                write!(f, ": this host has no RDMA support loaded; {SETUP_HINT}")
            }
            _ => Ok(()),
        }
    }
}

/// What follows a call that needed a descriptor and hit the process's limit (`EMFILE`): each
/// connection holds a few (its completion channel, wake-up pipe, bootstrap stream), a hub's
/// connections share all but their streams.
struct FdHint<'a>(&'a io::Error);

impl std::fmt::Display for FdHint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.raw_os_error() == Some(libc::EMFILE) {
            f.write_str(
                ": the process has too many open files; raise its limit (`ulimit -n`), or \
                 serve many peers from one Hub, whose connections share one completion channel",
            )?;
        }
        Ok(())
    }
}

/// What follows a failed registration that the locked-memory limit may explain (`ENOMEM`,
/// `EPERM`): registered memory is pinned, and counts against `RLIMIT_MEMLOCK` for a process
/// without `CAP_IPC_LOCK`.
struct MemlockHint<'a>(&'a io::Error);

impl std::fmt::Display for MemlockHint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if matches!(self.0.raw_os_error(), Some(libc::ENOMEM | libc::EPERM)) {
            f.write_str(
                ": registered memory counts against the locked-memory limit; check it \
                 (`ulimit -l`) and raise it, or register less",
            )?;
        }
        Ok(())
    }
}

/// After a device name that was not found: which ones are there (and how to pick one), or,
/// with none, how to get one.
struct Present<'a>(&'a [String]);

impl std::fmt::Display for Present<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            write!(f, "(no RDMA device is present); {SETUP_HINT}")
        } else {
            write!(
                f,
                "(present: {:?}); name one of them (`$RDMSG_DEVICE` for `open_default`)",
                self.0
            )
        }
    }
}

/// The short form of an OS error, for messages: the errno's symbolic name (`ENOMEM`), or
/// `errno N` for one not in the table; an error that carries no error number is described by
/// its kind. The full text is the error's own `Display`, reached as the `source()`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Errno<'a>(pub(crate) &'a io::Error);

impl std::fmt::Display for Errno<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.raw_os_error() {
            Some(n) => match errno_name(n) {
                Some(name) => f.write_str(name),
                None => write!(f, "errno {n}"),
            },
            None if self.0.kind() == io::ErrorKind::Other => f.write_str("no errno"),
            None => write!(f, "{}", self.0.kind()),
        }
    }
}

/// `" on fd N"`, or nothing for a call that failed before it had a descriptor (-1).
struct OnFd<'a>(&'a i32);

impl std::fmt::Display for OnFd<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self.0 >= 0 {
            write!(f, " on fd {}", self.0)
        } else {
            Ok(())
        }
    }
}

/// The symbolic name of the Linux error numbers verbs and the calls around them return.
pub(crate) fn errno_name(n: i32) -> Option<&'static str> {
    Some(match n {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::ESRCH => "ESRCH",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOSPC => "ENOSPC",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::EPROTO => "EPROTO",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::ENETDOWN => "ENETDOWN",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNRESET => "ECONNRESET",
        libc::ENOBUFS => "ENOBUFS",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::ECANCELED => "ECANCELED",
        _ => return None,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The message chain as anyhow's `{:#}` prints it: each error, then its sources, joined by
    /// `": "`.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut next = e.source();
        while let Some(s) = next {
            out.push_str(": ");
            out.push_str(&s.to_string());
            next = s.source();
        }
        out
    }

    fn os(n: i32) -> io::Error {
        io::Error::from_raw_os_error(n)
    }

    #[test]
    fn messages_name_the_verb_its_context_and_the_errno() {
        let cases: Vec<(Error, &str)> = vec![
            (
                Error::PostSend {
                    qp_num: 0x11,
                    source: os(libc::ENOMEM),
                },
                "ibv_post_send on QP 0x11 failed (ENOMEM)",
            ),
            (
                Error::ModifyQp {
                    qp_num: 0x2a,
                    from: QpState::Init,
                    to: QpState::Rtr,
                    source: os(libc::EINVAL),
                },
                "ibv_modify_qp on QP 0x2a from Init to Rtr failed (EINVAL)",
            ),
            (
                Error::QueryPort {
                    device: "rxe0".into(),
                    port: 1,
                    source: os(libc::ENODEV),
                },
                "ibv_query_port on rxe0 port 1 failed (ENODEV)",
            ),
            (
                Error::CreateQp {
                    caps: QpCaps::default(),
                    source: os(libc::ENOMEM),
                },
                "ibv_create_qp (max_send_wr 64, max_recv_wr 64, max_inline_data 64) failed (ENOMEM)",
            ),
            (
                Error::ReqNotifyCq {
                    solicited_only: true,
                    source: os(libc::EOPNOTSUPP),
                },
                "ibv_req_notify_cq (solicited_only=true) failed (EOPNOTSUPP)",
            ),
            (
                Error::WaitFd {
                    call: "epoll_ctl",
                    fd: 7,
                    source: os(libc::EBADF),
                },
                "epoll_ctl on fd 7 failed (EBADF)",
            ),
            (
                Error::WaitFd {
                    call: "epoll_create1",
                    fd: -1,
                    source: os(libc::EMFILE),
                },
                "epoll_create1 failed (EMFILE): the process has too many open files; raise its \
                 limit (`ulimit -n`), or serve many peers from one Hub, whose connections share \
                 one completion channel",
            ),
            (
                Error::CreateSrq {
                    max_wr: 256,
                    source: os(libc::ENOMEM),
                },
                "ibv_create_srq (max_wr 256) failed (ENOMEM)",
            ),
            (
                Error::PostSrqRecv {
                    requests: 8,
                    max_wr: 64,
                    source: os(libc::ENOMEM),
                },
                "ibv_post_srq_recv of 8 requests (max_wr 64) failed (ENOMEM)",
            ),
            (
                Error::ModifySrq {
                    limit: 100,
                    source: os(libc::EINVAL),
                },
                "ibv_modify_srq (srq_limit 100) failed (EINVAL)",
            ),
            (Error::PollCq(os(200)), "ibv_poll_cq failed (errno 200)"),
            (
                Error::GetCqEvent(last_os_error_of(0)),
                "ibv_get_cq_event failed (no errno)",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }

    #[test]
    fn no_device_says_how_to_get_one() {
        let setup = "to use Soft-RoCE over an Ethernet interface, run as root \
                     `modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <iface>`, or, in a \
                     clone of rdmsg, `cargo xtask vm -- <program>` runs the program in a VM \
                     that has rxe0";
        assert_eq!(SETUP_HINT, setup);
        let cases: Vec<(Error, String)> = vec![
            (
                Error::ListDevices(os(libc::ENOSYS)),
                format!(
                    "ibv_get_device_list failed (ENOSYS): this host has no RDMA support \
                     loaded; {setup}"
                ),
            ),
            (
                Error::ListDevices(os(libc::ENOMEM)),
                "ibv_get_device_list failed (ENOMEM)".into(),
            ),
            (Error::NoDevice, format!("no RDMA device present; {setup}")),
            (
                Error::DeviceNotFound {
                    name: "rxe0".into(),
                    present: vec![],
                },
                format!("no RDMA device named \"rxe0\" (no RDMA device is present); {setup}"),
            ),
            (
                Error::DeviceNotFound {
                    name: "rxe1".into(),
                    present: vec!["rxe0".into()],
                },
                "no RDMA device named \"rxe1\" (present: [\"rxe0\"]); name one of them \
                 (`$RDMSG_DEVICE` for `open_default`)"
                    .into(),
            ),
            (
                Error::CreateCompChannel(os(libc::EMFILE)),
                "ibv_create_comp_channel failed (EMFILE): the process has too many open \
                 files; raise its limit (`ulimit -n`), or serve many peers from one Hub, whose \
                 connections share one completion channel"
                    .into(),
            ),
            (
                Error::RegisterMemory {
                    len: 1 << 20,
                    source: os(libc::ENOMEM),
                },
                "ibv_reg_mr of 1048576 bytes failed (ENOMEM): registered memory counts against \
                 the locked-memory limit; check it (`ulimit -l`) and raise it, or register less"
                    .into(),
            ),
            (
                Error::CreateCompChannel(os(libc::ENOMEM)),
                "ibv_create_comp_channel failed (ENOMEM)".into(),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }

    /// What `last_os_error` makes of an errno value.
    fn last_os_error_of(n: i32) -> io::Error {
        if n == 0 {
            io::Error::other("verb failed without setting errno")
        } else {
            os(n)
        }
    }

    #[test]
    fn the_chain_adds_the_full_os_text_once() {
        let e = Error::PostRecv {
            qp_num: 0x11,
            source: os(libc::ENOMEM),
        };
        assert_eq!(
            chain(&e),
            format!(
                "ibv_post_recv on QP 0x11 failed (ENOMEM): {}",
                os(libc::ENOMEM)
            )
        );
        assert!(chain(&e).ends_with("(os error 12)"), "{}", chain(&e));
        let e = Error::GetCqEvent(last_os_error_of(0));
        assert_eq!(
            chain(&e),
            "ibv_get_cq_event failed (no errno): verb failed without setting errno"
        );
    }

    #[test]
    fn errno_names_cover_the_common_numbers() {
        for (n, name) in [
            (libc::EINVAL, "EINVAL"),
            (libc::ENOMEM, "ENOMEM"),
            (libc::EAGAIN, "EAGAIN"),
            (libc::EBUSY, "EBUSY"),
            (libc::EPERM, "EPERM"),
            (libc::EACCES, "EACCES"),
            (libc::ENODEV, "ENODEV"),
            (libc::ENOENT, "ENOENT"),
            (libc::EFAULT, "EFAULT"),
            (libc::EIO, "EIO"),
            (libc::ENOSYS, "ENOSYS"),
            (libc::EOPNOTSUPP, "EOPNOTSUPP"),
            (libc::ETIMEDOUT, "ETIMEDOUT"),
            (libc::ECONNRESET, "ECONNRESET"),
            (libc::ENXIO, "ENXIO"),
            (libc::ESRCH, "ESRCH"),
            (libc::EEXIST, "EEXIST"),
            (libc::ENOSPC, "ENOSPC"),
            (libc::EMFILE, "EMFILE"),
            (libc::ENFILE, "ENFILE"),
            (libc::EBADF, "EBADF"),
            (libc::EINTR, "EINTR"),
        ] {
            assert_eq!(Errno(&os(n)).to_string(), name);
        }
        assert_eq!(Errno(&os(4095)).to_string(), "errno 4095");
        let oom = io::Error::from(io::ErrorKind::OutOfMemory);
        assert_eq!(Errno(&oom).to_string(), "out of memory");
    }
}
