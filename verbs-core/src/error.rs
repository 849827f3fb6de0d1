//! One error type for every failing verb, and the single funnel from C return codes to it.

use std::io;

use crate::{QpCaps, QpState};

/// Result alias for verbs-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error told in full: its message, then under `Caused by:` each cause whose text the
/// lines before do not already hold (a verb's message names its errno in short; the OS's own
/// words follow once). What `Debug` of rdmsg's error enums prints: `fn main() -> Result<(),
/// rdmsg::Error>` ends with `Debug`, and a variant's structure (`Verbs(ListDevices(Os { code:
/// 38, .. }))`) would hide the message's advice (here, how to set up Soft-RoCE).
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut said = self.0.to_string();
        let mut cause = self.0.source();
        // An error with nothing to say of its own is told by its first cause that has.
        while said.is_empty() {
            let Some(c) = cause else {
                return f.write_str("(an error with no message)");
            };
            said = c.to_string();
            cause = c.source();
        }
        f.write_str(&said)?;
        let mut heading = false;
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !said.contains(&text) {
                if !heading {
                    f.write_str("\n\nCaused by:")?;
                    heading = true;
                }
                write!(f, "\n    {text}")?;
                // Apart, so that a later cause is not found across two texts' seam.
                said.push('\n');
                said.push_str(&text);
            }
            cause = c.source();
        }
        Ok(())
    }
}

/// Implements `Debug` for an error type as its [`Report`]: what rdmsg's error enums do, so
/// that `fn main() -> Result<(), E>` (which Rust ends with `Debug`) tells what failed and what
/// to do, as `Display` does. Match on the variants to inspect one.
#[macro_export]
macro_rules! debug_as_report {
    ($ty:ty) => {
        impl ::std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                ::std::fmt::Display::fmt(&$crate::Report(self), f)
            }
        }
    };
}

impl std::fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// A failed verb, with the context needed to tell which call failed and why.
///
/// Each message names the call, its context and, in short form, the error number (for example
/// `ibv_post_send on QP 0x11 failed (ENOMEM)`), or for a limit on open descriptors what it
/// means and what to do ([`FdLimit`]: `failed: too many open files (EMFILE): ...`); the OS
/// error itself (`errno`, or the error number a verb returned directly) is the `#[source]`, so
/// printing the chain (anyhow's `{:#}`) adds its full text once.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `ibv_get_device_list` failed (typically `ENOSYS`: the kernel has no RDMA support
    /// loaded, `ib_uverbs`). The message says how to set up Soft-RoCE ([`SETUP_HINT`]).
    #[error("ibv_get_device_list failed{}{}", Failed(.0), ListHint(.0))]
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
    #[error("ibv_open_device on {device} failed{}", Failed(.source))]
    OpenDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device on {device} failed{}", Failed(.source))]
    QueryDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_port` failed.
    #[error("ibv_query_port on {device} port {port} failed{}", Failed(.source))]
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
    #[error("ibv_query_gid on {device} port {port} index {index} failed{}", Failed(.source))]
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
    #[error("ibv_alloc_pd failed{}", Failed(.0))]
    AllocPd(#[source] io::Error),
    /// `ibv_reg_mr` failed (or the memory to register could not be allocated: `ENOMEM`).
    #[error("ibv_reg_mr of {len} bytes failed{}{}", Failed(.source), MemlockHint(.source))]
    RegisterMemory {
        /// Requested length.
        len: usize,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_alloc_mw` failed (or the device has no memory windows of type 2: `EOPNOTSUPP`).
    #[error("ibv_alloc_mw failed{}", Failed(.source))]
    AllocMw {
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel failed{}", Failed(.0))]
    CreateCompChannel(#[source] io::Error),
    /// Switching a file descriptor between blocking and non-blocking failed.
    #[error("fcntl setting O_NONBLOCK={nonblocking} on fd {fd} failed{}", Failed(.source))]
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
    #[error("ibv_create_cq of {cqe} entries failed{}", Failed(.source))]
    CreateCq {
        /// Requested number of entries.
        cqe: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_req_notify_cq` failed.
    #[error("ibv_req_notify_cq (solicited_only={solicited_only}) failed{}", Failed(.source))]
    ReqNotifyCq {
        /// The arming mode.
        solicited_only: bool,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_get_cq_event` failed (other than `EAGAIN` on a non-blocking channel).
    #[error("ibv_get_cq_event failed{}", Failed(.0))]
    GetCqEvent(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed{}", Failed(.0))]
    PollCq(#[source] io::Error),
    /// `ibv_create_qp` failed.
    #[error(
        "ibv_create_qp (max_send_wr {}, max_recv_wr {}, max_inline_data {}) failed{}",
        .caps.max_send_wr, .caps.max_recv_wr, .caps.max_inline_data, Failed(.source)
    )]
    CreateQp {
        /// The queue sizes requested.
        caps: QpCaps,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_modify_qp` failed.
    #[error("ibv_modify_qp on QP {qp_num:#x} from {from:?} to {to:?} failed{}", Failed(.source))]
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
    #[error("ibv_destroy_qp on QP {qp_num:#x} failed{}", Failed(.source))]
    DestroyQp {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    #[error("ibv_query_qp on QP {qp_num:#x} failed{}", Failed(.source))]
    QueryQp {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_send` failed.
    #[error("ibv_post_send on QP {qp_num:#x} failed{}", Failed(.source))]
    PostSend {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` failed.
    #[error("ibv_post_recv on QP {qp_num:#x} failed{}", Failed(.source))]
    PostRecv {
        /// Queue pair number.
        qp_num: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_srq` failed.
    #[error("ibv_create_srq (max_wr {max_wr}) failed{}", Failed(.source))]
    CreateSrq {
        /// Requested number of work requests.
        max_wr: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_srq_recv` failed.
    #[error("ibv_post_srq_recv of {requests} requests (max_wr {max_wr}) failed{}", Failed(.source))]
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
    #[error("ibv_modify_srq (srq_limit {limit}) failed{}", Failed(.source))]
    ModifySrq {
        /// Requested limit.
        limit: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `ibv_get_async_event` failed (other than `EAGAIN` in non-blocking mode).
    #[error("ibv_get_async_event failed{}", Failed(.0))]
    GetAsyncEvent(#[source] io::Error),
    /// A call waiting for verbs descriptors (`poll`, `epoll_create1`, `epoll_ctl`,
    /// `epoll_wait`) failed.
    #[error("{call}{} failed{}", OnFd(.fd), Failed(.source))]
    WaitFd {
        /// The call that failed.
        call: &'static str,
        /// The descriptor concerned (-1: none yet).
        fd: i32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A call of the RDMA connection manager (librdmacm) failed. Without `/dev/infiniband/
    /// rdma_cm` (the `rdma_ucm` module not loaded) creating the event channel fails with
    /// `ENOENT`/`ENODEV`, and the message says which modules the CM needs.
    #[error("{call} failed{}{}", Failed(.source), CmHint(.source))]
    Cm {
        /// The librdmacm call (`rdma_resolve_addr`, `rdma_connect`...).
        call: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// An argument was rejected before any verb was called.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

// `Debug` is the report (see `Report`): advice, not variants.
crate::debug_as_report!(Error);

/// What follows a failed connection-manager call whose error number means "no CM here".
struct CmHint<'a>(&'a io::Error);

impl std::fmt::Display for CmHint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.raw_os_error() {
            Some(libc::ENOENT | libc::ENODEV | libc::ENOSYS) => f.write_str(
                ": the RDMA connection manager needs /dev/infiniband/rdma_cm (modprobe rdma_ucm, \
                 which loads rdma_cm, ib_cm and iw_cm)",
            ),
            _ => Ok(()),
        }
    }
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

/// What a call that hit a limit on open descriptors means, and what to do: `EMFILE` (this
/// process's limit, `ulimit -n`) or `ENFILE` (the system's). A session holds about nine
/// descriptors, so the usual soft limit of 1024 stops a process near a hundred sessions with
/// errors that would otherwise name only the call; a hub holds one per peer beyond its own few.
/// Every layer's error that carries an OS error shows this in place of the bare error: this
/// crate's, and the transport's (through `rdmsg_transport::Brief`).
///
/// ```text
/// too many open files (EMFILE): this process reached its descriptor limit (`ulimit -n`,
/// currently 1024): raise it, or serve many peers from one `Hub` (one descriptor per peer; a
/// session holds about 9) instead of a session each
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    errno: i32,
}

impl FdLimit {
    /// The explanation of `e`, if it is `EMFILE` or `ENFILE`.
    pub fn of(e: &io::Error) -> Option<Self> {
        matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)).then(|| Self {
            errno: e.raw_os_error().unwrap_or_default(),
        })
    }
}

/// What to do instead of raising a limit further, the same for both limits.
const USE_A_HUB: &str =
    "serve many peers from one `Hub` (one descriptor per peer; a session holds about 9) instead \
     of a session each";

impl std::fmt::Display for FdLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.errno == libc::ENFILE {
            return write!(
                f,
                "too many open files in the system (ENFILE): the system reached its limit on \
                 open files (`sysctl fs.file-max`): raise it or close files elsewhere, and \
                 {USE_A_HUB}"
            );
        }
        f.write_str(
            "too many open files (EMFILE): this process reached its descriptor limit \
             (`ulimit -n`",
        )?;
        // Read when shown: the limit the process has now, which it may have raised since.
        if let Some(n) = crate::fd_limit() {
            write!(f, ", currently {n}")?;
        }
        write!(f, "): raise it, or {USE_A_HUB}")
    }
}

/// What follows "failed" in a verb's message: ` (ENOMEM)`, the errno in short form, or for a
/// descriptor limit `: ` and what it means ([`FdLimit`]).
struct Failed<'a>(&'a io::Error);

impl std::fmt::Display for Failed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match FdLimit::of(self.0) {
            Some(limit) => write!(f, ": {limit}"),
            None => write!(f, " ({})", Errno(self.0)),
        }
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

    /// An error of a given message and cause, for [`Report`]'s cases.
    #[derive(Debug)]
    struct Said(&'static str, Option<Box<Said>>);

    impl std::fmt::Display for Said {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Said {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    fn said(texts: &[&'static str]) -> Said {
        texts
            .iter()
            .rev()
            .fold(None, |cause, t| Some(Said(t, cause.map(Box::new))))
            .expect("one text at least")
    }

    #[test]
    fn a_report_says_each_cause_once_and_never_nothing() {
        let report = |e: &Said| Report(e).to_string();
        assert_eq!(report(&said(&["outer"])), "outer");
        assert_eq!(
            report(&said(&["outer: inner", "inner", "os"])),
            "outer: inner\n\nCaused by:\n    os"
        );
        // A cause is looked for in each text said, not across the seam of two.
        assert_eq!(
            report(&said(&["ab", "cd", "bc"])),
            "ab\n\nCaused by:\n    cd\n    bc"
        );
        // An error without a message is told by its first cause that has one.
        assert_eq!(
            report(&said(&["", "", "inner", "os"])),
            "inner\n\nCaused by:\n    os"
        );
        assert_eq!(report(&said(&[""])), "(an error with no message)");
        assert_eq!(
            format!("{:?}", Report(&said(&["x", "y"]))),
            "x\n\nCaused by:\n    y"
        );
    }

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

    /// What the descriptor limits read as, with the process's soft limit as it is now.
    fn fd_limit_texts() -> (String, String) {
        let now = crate::fd_limit().map_or(String::new(), |n| format!(", currently {n}"));
        (
            format!(
                "too many open files (EMFILE): this process reached its descriptor limit \
                 (`ulimit -n`{now}): raise it, or serve many peers from one `Hub` (one \
                 descriptor per peer; a session holds about 9) instead of a session each"
            ),
            "too many open files in the system (ENFILE): the system reached its limit on open \
             files (`sysctl fs.file-max`): raise it or close files elsewhere, and serve many \
             peers from one `Hub` (one descriptor per peer; a session holds about 9) instead of \
             a session each"
                .to_owned(),
        )
    }

    #[test]
    fn a_descriptor_limit_says_which_and_what_to_do() {
        let (emfile, enfile) = fd_limit_texts();
        assert!(
            emfile.contains(", currently "),
            "getrlimit reads on Linux: {emfile}"
        );
        let cases: Vec<(Error, String)> = vec![
            (
                Error::CreateCompChannel(os(libc::EMFILE)),
                format!("ibv_create_comp_channel failed: {emfile}"),
            ),
            (
                Error::CreateCompChannel(os(24)),
                format!("ibv_create_comp_channel failed: {emfile}"),
            ),
            (
                Error::WaitFd {
                    call: "epoll_create1",
                    fd: -1,
                    source: os(libc::EMFILE),
                },
                format!("epoll_create1 failed: {emfile}"),
            ),
            (
                Error::OpenDevice {
                    device: "rxe0".into(),
                    source: os(libc::ENFILE),
                },
                format!("ibv_open_device on rxe0 failed: {enfile}"),
            ),
            (
                Error::CreateCq {
                    cqe: 64,
                    source: os(libc::EMFILE),
                },
                format!("ibv_create_cq of 64 entries failed: {emfile}"),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
            // The full OS text stays the source, for chains.
            assert!(
                chain(&e).ends_with(&os(e_errno(&e)).to_string()),
                "{}",
                chain(&e)
            );
        }
        assert_eq!(FdLimit::of(&os(libc::ENOMEM)), None);
        assert_eq!(FdLimit::of(&io::Error::other("no errno")), None);
        assert_eq!(FdLimit::of(&os(libc::EMFILE)).unwrap().to_string(), emfile);
        assert_eq!(FdLimit::of(&os(libc::ENFILE)).unwrap().to_string(), enfile);
    }

    /// The errno of an error's source.
    fn e_errno(e: &Error) -> i32 {
        std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<io::Error>())
            .and_then(io::Error::raw_os_error)
            .expect("an OS error as the source")
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
