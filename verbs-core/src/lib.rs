//! Safe RAII handles over libibverbs, the bottom layer of rdmsg.
//!
//! This is the only crate of the workspace that contains `unsafe` code or touches C. Every
//! handle keeps its parents alive (a queue pair holds its protection domain and both completion
//! queues, a completion queue its context and channel), so no destruction order is wrong.
//!
//! # Quick start
//!
//! ```no_run
//! use rdmsg_verbs::{Access, CompletionChannel, CompletionQueue, Context, ProtectionDomain,
//!                  QpCaps, QueuePair};
//!
//! # fn main() -> rdmsg_verbs::Result<()> {
//! let ctx = Context::open("rxe0")?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let channel = CompletionChannel::new(&ctx)?;
//! let send_cq = CompletionQueue::new(&ctx, 64, None)?;
//! let recv_cq = CompletionQueue::new(&ctx, 64, Some(&channel))?;
//! let mut qp = QueuePair::new_rc(&pd, &send_cq, &recv_cq, QpCaps::default())?;
//! let buffers = pd.register(64 * 4096, Access::LOCAL_WRITE)?.chunks(4096)?;
//! qp.to_init(1)?;
//! qp.post_recv(buffers)?;
//! // exchange qp_num, PSN and GID with the peer, then qp.to_rtr(..) and qp.to_rts(..)
//! # Ok(()) }
//! ```
//!
//! # Posting rules
//!
//! Registered memory is reached only through [`Buffer`]s, which never overlap. Posting moves a
//! buffer into the [`QueuePair`]; it comes back only with the polled completion that covers it
//! ([`QueuePair::take_recv`] for a receive, [`QueuePair::complete_send`] for a send and the
//! unsignaled sends before it, [`QueuePair::reclaim`] for either when one CQ serves both
//! queues and a flushed completion's opcode cannot tell them apart). So the CPU never touches
//! memory the device may be using, and nothing posted can be freed early. This does not
//! compile:
//!
//! ```compile_fail
//! # fn misuse(qp: &mut rdmsg_verbs::QueuePair, mut buf: rdmsg_verbs::Buffer) {
//! qp.post_recv([buf]).unwrap();
//! buf.as_mut_slice()[0] = 1; // error: `buf` was moved into the queue pair
//! # }
//! ```
//!
//! Whatever completion those calls are given, they hand out only buffers the device is done
//! with. [`WorkCompletion`] is `Clone` and `Default`, so a completion can be replayed, passed to
//! the wrong queue pair or direction, or made up; but every work request id is drawn from one
//! process-wide counter and never reused, so an id names exactly one request ever posted, and
//! a queue pair hands a buffer back only for the id of a request it still holds: once, in the
//! direction it was posted, and only to the queue pair that posted it. Anything else yields
//! nothing ([`Reclaimed::Unknown`]).
//!
//! # Shared receive queues
//!
//! A [`SharedReceiveQueue`] holds receive buffers for many queue pairs (created with
//! [`QueuePair::new_rc_with_srq`], which keep it alive and post no receives of their own). The
//! same rule applies: posting moves a buffer into the SRQ, and [`SharedReceiveQueue::take_recv`]
//! hands it back once, for the exact id of a request the SRQ still holds, whichever queue pair
//! the completion names; a queue pair's own `take_recv` and `reclaim` never hand out SRQ
//! buffers. Buffers still posted when the handle is dropped stay unreachable until the last
//! queue pair using the SRQ is gone and the SRQ is destroyed. [`SharedReceiveQueue::arm_limit`]
//! asks for one [`AsyncEventKind::SrqLimitReached`] event (read with
//! [`Context::get_async_event`]) when the SRQ runs low, so that it can be refilled in time.
//!
//! # Completion events
//!
//! [`CompletionQueue::req_notify`] arms a CQ once; [`CompletionChannel::get_event`] reads the
//! event it produces. Each event must be acknowledged before the CQ is destroyed; the CQ counts
//! them and acks whatever is left when it is dropped. The policy built on top (when to arm, how
//! to drain) lives in the `notify` crate.
//!
//! # Thread safety
//!
//! Handles are `Send` and `Sync` where libibverbs allows it. Polling a CQ and posting to a QP
//! take `&mut self`: wrap them in a mutex to share them.
//!
//! # Reaching verbs not wrapped here
//!
//! The raw bindings are re-exported as [`ffi`]; every handle has an `as_raw()` documenting how
//! long the pointer stays valid.
#![deny(missing_docs)]

mod cm;
mod cq;
mod device;
mod error;
mod loopback;
mod mr;
mod pd;
mod posted;
mod qp;
mod srq;
mod watch;

/// The raw rdma-sys bindings, for verbs this crate does not wrap.
pub use rdma_sys as ffi;

pub use bytes::Bytes;
pub use cm::{
    CmEvent, CmEventChannel, CmEventKind, CmId, CmIdKey, ConnParams, QpTuning,
    ACCEPT_PRIVATE_DATA_MAX, CONNECT_PRIVATE_DATA_MAX, REJECT_CONSUMER, REJECT_INVALID_SERVICE,
    REJECT_PRIVATE_DATA_MAX,
};
pub use cq::{CompletionChannel, CompletionQueue, CqEvent, WcOpcode, WcStatus, WorkCompletion};
pub use device::{
    devices, AsyncElement, AsyncEvent, AsyncEventKind, Context, DeviceAttr, DeviceInfo, Gid,
    LinkLayer, Mtu, PortAttr, PortState,
};
pub use error::{Error, FdLimit, Report, Result, SETUP_HINT};
pub use loopback::connect_loopback;
pub use mr::{Access, Buffer, Exposed};
pub use pd::ProtectionDomain;
pub use qp::{
    PostError, QpCaps, QpState, QueuePair, ReadSegment, Reclaimed, RemoteAddress, RtrAttr, RtsAttr,
    SendPayload, SendRequest,
};
pub use srq::SharedReceiveQueue;
pub use watch::ReadyWatch;

/// Sets or clears `O_NONBLOCK` on a descriptor owned by a verbs object.
pub(crate) fn set_nonblocking(fd: std::os::fd::RawFd, nonblocking: bool) -> Result<()> {
    let fail = |source| Error::SetNonBlocking {
        fd,
        nonblocking,
        source,
    };
    // SAFETY: F_GETFL on a descriptor has no memory-safety preconditions.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(fail(error::last_os_error()));
    }
    let new = if nonblocking {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: F_SETFL with an int argument has no memory-safety preconditions.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, new) } < 0 {
        return Err(fail(error::last_os_error()));
    }
    Ok(())
}

/// Waits until `fd` is readable or `timeout` passes (`None`: forever). Returns whether it is
/// readable. Interrupted waits are resumed with the remaining time.
pub fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: Option<std::time::Duration>,
) -> Result<bool> {
    Ok(poll_readable(&mut [pollin(fd)], WaitTimeout::new(timeout))?.is_some())
}

/// Like [`wait_readable`], until `deadline` (`None`: forever) counted from `now`, the caller's
/// time: the wait reads no clock (only a wait a signal interrupted does, to resume).
pub fn wait_readable_until(
    fd: std::os::fd::BorrowedFd<'_>,
    deadline: Option<std::time::Instant>,
    now: std::time::Instant,
) -> Result<bool> {
    Ok(poll_readable(&mut [pollin(fd)], WaitTimeout::until(deadline, now))?.is_some())
}

/// Waits until one of `fds` is readable (or hung up) or `timeout` passes (`None`: forever).
/// Returns the index of the first readable descriptor, `None` on timeout. Interrupted waits are
/// resumed with the remaining time.
pub fn wait_any_readable(
    fds: &[std::os::fd::BorrowedFd<'_>],
    timeout: Option<std::time::Duration>,
) -> Result<Option<usize>> {
    // A few descriptors, on the stack: a sleep allocates nothing.
    let mut pfds: smallvec::SmallVec<[libc::pollfd; 8]> =
        fds.iter().map(|&fd| pollin(fd)).collect();
    poll_readable(&mut pfds, WaitTimeout::new(timeout))
}

/// A `pollfd` waiting for `fd` to be readable.
fn pollin(fd: std::os::fd::BorrowedFd<'_>) -> libc::pollfd {
    use std::os::fd::AsRawFd;
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// `poll(2)` on `pfds` (descriptors the caller's borrows keep open), resumed after a signal:
/// the index of the first readable one, `None` on timeout.
fn poll_readable(pfds: &mut [libc::pollfd], mut wait: WaitTimeout) -> Result<Option<usize>> {
    loop {
        let ms = wait.next_ms();
        // SAFETY: `pfds` is a valid array of `pfds.len()` pollfds, kept open by the caller.
        let ret = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if ret < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::WaitFd {
                call: "poll",
                fd: pfds.first().map_or(-1, |p| p.fd),
                source: err,
            });
        }
        return Ok(pfds.iter().position(|p| p.revents != 0));
    }
}

/// The longest wait rdmsg counts in time: a timeout beyond it (`Duration::MAX` included) waits
/// this long, which is for ever in practice, where adding it to an [`Instant`](std::time::Instant)
/// would panic.
pub const FOREVER: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `start + timeout`, the timeout capped at [`FOREVER`]: the deadline of a wait of any length.
pub fn deadline_after(
    start: std::time::Instant,
    timeout: std::time::Duration,
) -> std::time::Instant {
    start + timeout.min(FOREVER)
}

/// The millisecond timeout `poll`/`epoll_wait` take for the time left until `deadline` (-1:
/// none), rounded up so that a sub-millisecond remainder still waits.
pub(crate) fn poll_timeout_ms(deadline: Option<std::time::Instant>) -> libc::c_int {
    match deadline {
        None => -1,
        Some(d) => timeout_ms(d.saturating_duration_since(std::time::Instant::now())),
    }
}

/// The millisecond timeouts of a `poll` or `epoll_wait` that is resumed after a signal: the
/// first wait takes the timeout as it is, a resumed one what is left of it (a look stays a look,
/// a wait for ever stays one). Only a bounded wait reads the clock, once, for the deadline a
/// resumed wait counts from.
pub(crate) struct WaitTimeout {
    timeout: Option<std::time::Duration>,
    deadline: Option<std::time::Instant>,
    first: bool,
}

impl WaitTimeout {
    pub(crate) fn new(timeout: Option<std::time::Duration>) -> Self {
        Self {
            timeout,
            deadline: timeout
                .filter(|t| !t.is_zero())
                .map(|t| deadline_after(std::time::Instant::now(), t)),
            first: true,
        }
    }

    /// A wait until `deadline` (`None`: forever), `now` being the caller's time: the first
    /// call's timeout is counted from it, so that no clock is read unless a signal interrupts.
    pub(crate) fn until(deadline: Option<std::time::Instant>, now: std::time::Instant) -> Self {
        Self {
            timeout: deadline.map(|d| d.saturating_duration_since(now)),
            deadline,
            first: true,
        }
    }

    /// The timeout of the next call (-1: none).
    pub(crate) fn next_ms(&mut self) -> libc::c_int {
        match self.timeout {
            Some(t) if std::mem::take(&mut self.first) || t.is_zero() => timeout_ms(t),
            _ => poll_timeout_ms(self.deadline),
        }
    }
}

/// `left` in whole milliseconds for `poll`/`epoll_wait`, rounded up (a wait never ends early).
pub(crate) fn timeout_ms(left: std::time::Duration) -> libc::c_int {
    libc::c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
}

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`), for measuring what a
/// receiver costs. Here because this is the crate allowed to call C.
pub fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to; the clock id is a constant Linux supports.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if ret != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// User-space CPU time of the calling thread (`getrusage(RUSAGE_THREAD)`'s `ru_utime`),
/// zero if it cannot be read: what a thread spends outside the kernel, so outside Soft-RoCE,
/// which does a device's work (copies included) in the kernel, often in the posting thread.
pub fn thread_user_time() -> std::time::Duration {
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid rusage to write to; RUSAGE_THREAD is a constant Linux supports.
    let ret = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    if ret != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(
        usage.ru_utime.tv_sec as u64,
        usage.ru_utime.tv_usec as u32 * 1000,
    )
}

/// Raises the soft limit on open descriptors (`RLIMIT_NOFILE`) to `want`, or to the hard
/// limit if that is lower; never lowers it. Returns the soft limit now in force. Every
/// connection holds one descriptor (its bootstrap TCP stream), and the usual soft limit is
/// 1024: a process serving a thousand peers needs more. Here because this is the crate
/// allowed to call C.
pub fn raise_fd_limit(want: u64) -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit to write to.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let target = want.min(lim.rlim_max);
    if target <= lim.rlim_cur {
        return Ok(lim.rlim_cur);
    }
    lim.rlim_cur = target;
    // SAFETY: `lim` is a valid rlimit, its soft value within its hard one.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(target)
}

/// The soft limit on open descriptors (`RLIMIT_NOFILE`, what `ulimit -n` shows) in force now:
/// `None` when unlimited or unreadable. Read by the errors that hit it ([`FdLimit`]), so that
/// they say how far the process got.
pub fn fd_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit to write to.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// The soft limit on memory a process may pin (`RLIMIT_MEMLOCK`), which bounds what it can
/// register: `None` when unlimited, unknown, or not enforced (the kernel lets a process with
/// `CAP_IPC_LOCK` pin past it). Unprivileged processes often have 8 MiB or less, where a
/// registration beyond it fails with `ENOMEM`.
pub fn locked_memory_limit() -> Option<u64> {
    if may_lock_any_memory() {
        return None;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit to write to.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return None;
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// Whether this process has `CAP_IPC_LOCK` in its effective set (`CapEff` in
/// `/proc/self/status`), which exempts its registrations from `RLIMIT_MEMLOCK`.
fn may_lock_any_memory() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_deadline_of_any_length_is_an_instant() {
        let now = Instant::now();
        assert_eq!(
            deadline_after(now, Duration::from_secs(2)),
            now + Duration::from_secs(2)
        );
        assert_eq!(deadline_after(now, Duration::MAX), now + FOREVER);
        assert!(poll_timeout_ms(Some(deadline_after(now, Duration::MAX))) == libc::c_int::MAX);
    }

    #[test]
    fn a_resumed_wait_waits_what_is_left_and_a_look_stays_a_look() {
        let mut look = WaitTimeout::new(Some(Duration::ZERO));
        assert_eq!((look.next_ms(), look.next_ms()), (0, 0));
        let mut forever = WaitTimeout::new(None);
        assert_eq!((forever.next_ms(), forever.next_ms()), (-1, -1));
        let mut bounded = WaitTimeout::new(Some(Duration::from_millis(1500)));
        assert_eq!(bounded.next_ms(), 1500);
        assert!((1..=1500).contains(&bounded.next_ms()));
    }

    #[test]
    fn a_wait_until_counts_from_the_callers_time_and_resumes_from_the_clock() {
        let now = std::time::Instant::now();
        // The first wait is the deadline less the caller's time, whatever the clock says.
        let mut until = WaitTimeout::until(Some(now + Duration::from_millis(1500)), now);
        assert_eq!(until.next_ms(), 1500);
        assert!(
            (1..=1500).contains(&until.next_ms()),
            "resumed: what is left"
        );
        let mut past = WaitTimeout::until(Some(now), now + Duration::from_secs(1));
        assert_eq!(
            (past.next_ms(), past.next_ms()),
            (0, 0),
            "a deadline passed looks"
        );
        let mut forever = WaitTimeout::until(None, now);
        assert_eq!((forever.next_ms(), forever.next_ms()), (-1, -1));
    }

    #[test]
    fn wait_readable_until_sees_a_readable_descriptor_and_times_out_at_the_deadline() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
        let now = std::time::Instant::now();
        let deadline = now + Duration::from_millis(30);
        assert!(!wait_readable_until(rx.as_fd(), Some(deadline), now).unwrap());
        assert!(
            std::time::Instant::now() >= deadline,
            "a wait never ends early"
        );
        tx.write_all(b"x").unwrap();
        let now = std::time::Instant::now();
        assert!(wait_readable_until(rx.as_fd(), None, now).unwrap());
    }
}
