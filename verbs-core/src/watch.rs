//! A set of descriptors registered once and waited on many times (epoll). A sleeping
//! connection watches four descriptors; `poll(2)` would register and unregister each of them
//! on every sleep, which under emulation costs as much as a tenth of a round trip.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Most descriptors one wait reports.
const MAX_EVENTS: usize = 8;

/// Descriptors watched for readability, each with a token (0..64) reported when it is
/// readable or hung up. Level-triggered: a descriptor stays reported while readable.
///
/// The caller keeps every added descriptor open until it is removed or the watch is dropped.
#[derive(Debug)]
pub struct ReadyWatch {
    epoll: OwnedFd,
}

impl ReadyWatch {
    /// An empty watch.
    pub fn new() -> Result<Self> {
        // SAFETY: epoll_create1 has no memory arguments; a non-negative return is a new
        // descriptor that we own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(wait_err(
                "epoll_create1",
                -1,
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by nobody else.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { epoll })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, flags: libc::c_int) -> Result<()> {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | flags) as u32,
            u64: token,
        };
        // SAFETY: the epoll descriptor is ours and open; `ev` is a valid epoll_event for the
        // duration of the call (the kernel copies it).
        let ret = unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) };
        if ret < 0 {
            return Err(wait_err("epoll_ctl", fd, std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Watches `fd` for readability, reporting it as `token` (below 64).
    pub fn add(&self, fd: BorrowedFd<'_>, token: u8) -> Result<()> {
        self.add_with(fd, token, 0)
    }

    /// Watches `fd` like [`ReadyWatch::add`], but when several watches share `fd` and sleep on
    /// it, a new event wakes one of them rather than all (`EPOLLEXCLUSIVE`). For a descriptor
    /// such as a device's async-event fd that many connections watch and any one of them can
    /// serve for all: whoever wakes must read it and hand on what is not its own.
    pub fn add_exclusive(&self, fd: BorrowedFd<'_>, token: u8) -> Result<()> {
        self.add_with(fd, token, libc::EPOLLEXCLUSIVE)
    }

    fn add_with(&self, fd: BorrowedFd<'_>, token: u8, flags: libc::c_int) -> Result<()> {
        if token >= 64 {
            return Err(Error::InvalidArgument(format!(
                "watch token {token} is not below 64"
            )));
        }
        self.ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), u64::from(token), flags)
    }

    /// Watches `fd` for readability, reporting it as `key` through [`ReadyWatch::wait_keys`]
    /// (any 64-bit key: for watches of many descriptors, such as one per connection).
    pub fn add_keyed(&self, fd: BorrowedFd<'_>, key: u64) -> Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), key, 0)
    }

    /// Like [`ReadyWatch::add_keyed`], waking one of several watches sharing `fd`
    /// (`EPOLLEXCLUSIVE`, see [`ReadyWatch::add_exclusive`]).
    pub fn add_keyed_exclusive(&self, fd: BorrowedFd<'_>, key: u64) -> Result<()> {
        self.ctl(
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            key,
            libc::EPOLLEXCLUSIVE,
        )
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: BorrowedFd<'_>) -> Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0)
    }

    /// Waits until a watched descriptor is readable or `timeout` passes (`None`: forever).
    /// Returns the set of ready tokens as a bit mask (bit `t` for token `t`); 0 on timeout.
    /// Interrupted waits are resumed with the remaining time.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<u64> {
        self.wait_mask(crate::WaitTimeout::new(timeout))
    }

    /// Like [`ReadyWatch::wait`], until `deadline` (`None`: forever) counted from `now`, the
    /// caller's time: the wait reads no clock (only one a signal interrupted does, to resume).
    pub fn wait_until(&self, deadline: Option<Instant>, now: Instant) -> Result<u64> {
        self.wait_mask(crate::WaitTimeout::until(deadline, now))
    }

    fn wait_mask(&self, wait: crate::WaitTimeout) -> Result<u64> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; MAX_EVENTS];
        let n = self.wait_raw(wait, &mut events)?;
        Ok(events[..n]
            .iter()
            .fold(0u64, |mask, ev| mask | (1u64 << (ev.u64 & 63))))
    }

    /// Waits like [`ReadyWatch::wait`] and appends the keys of up to 16 ready descriptors to
    /// `ready` (a descriptor added with a token reports the token as its key); returns how
    /// many. A zero `timeout` only looks. Level-triggered: a descriptor left readable is
    /// reported again by the next call.
    pub fn wait_keys(&self, timeout: Option<Duration>, ready: &mut Vec<u64>) -> Result<usize> {
        self.keys(crate::WaitTimeout::new(timeout), ready)
    }

    /// Like [`ReadyWatch::wait_keys`], until `deadline` (`None`: forever) counted from `now`,
    /// the caller's time: the wait reads no clock (only one a signal interrupted does).
    pub fn wait_keys_until(
        &self,
        deadline: Option<Instant>,
        now: Instant,
        ready: &mut Vec<u64>,
    ) -> Result<usize> {
        self.keys(crate::WaitTimeout::until(deadline, now), ready)
    }

    fn keys(&self, wait: crate::WaitTimeout, ready: &mut Vec<u64>) -> Result<usize> {
        // Small: most waits find one or two descriptors ready, and those left over are
        // reported by the next call (level-triggered).
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        let n = self.wait_raw(wait, &mut events)?;
        ready.extend(events[..n].iter().map(|ev| ev.u64));
        Ok(n)
    }

    fn wait_raw(
        &self,
        mut wait: crate::WaitTimeout,
        events: &mut [libc::epoll_event],
    ) -> Result<usize> {
        loop {
            let ms = wait.next_ms();
            // SAFETY: `events` is a valid array of `events.len()` epoll_events the kernel may
            // fill; the epoll descriptor is ours and open.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    ms,
                )
            };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(wait_err("epoll_wait", self.epoll.as_raw_fd(), err));
            }
            return Ok(n as usize);
        }
    }
}

/// The epoll descriptor itself: readable whenever one of the watched descriptors is, so that
/// an outer event loop (mio, tokio, another epoll) can wait on the whole set.
impl std::os::fd::AsFd for ReadyWatch {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

fn wait_err(call: &'static str, fd: RawFd, source: std::io::Error) -> Error {
    Error::WaitFd { call, fd, source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn reports_readable_descriptors_by_token() {
        let (mut a_tx, a_rx) = UnixStream::pair().unwrap();
        let (mut b_tx, b_rx) = UnixStream::pair().unwrap();
        let w = ReadyWatch::new().unwrap();
        w.add(a_rx.as_fd(), 0).unwrap();
        w.add(b_rx.as_fd(), 3).unwrap();
        assert_eq!(w.wait(Some(Duration::from_millis(1))).unwrap(), 0);
        b_tx.write_all(b"x").unwrap();
        assert_eq!(w.wait(None).unwrap(), 1 << 3);
        a_tx.write_all(b"y").unwrap();
        assert_eq!(w.wait(None).unwrap(), 1 | 1 << 3, "level-triggered");
        w.remove(b_rx.as_fd()).unwrap();
        assert_eq!(w.wait(None).unwrap(), 1);
        assert!(w.add(a_rx.as_fd(), 64).is_err());
        assert!(w.add(a_rx.as_fd(), 1).is_err(), "already watched");
    }

    #[test]
    fn waits_until_a_deadline_count_from_the_callers_time() {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let w = ReadyWatch::new().unwrap();
        w.add(rx.as_fd(), 2).unwrap();
        let now = Instant::now();
        let deadline = now + Duration::from_millis(20);
        assert_eq!(w.wait_until(Some(deadline), now).unwrap(), 0);
        assert!(Instant::now() >= deadline, "a wait never ends early");
        let mut ready = Vec::new();
        // A deadline already passed only looks.
        let now = Instant::now();
        assert_eq!(w.wait_keys_until(Some(now), now, &mut ready).unwrap(), 0);
        tx.write_all(b"x").unwrap();
        assert_eq!(w.wait_until(None, Instant::now()).unwrap(), 1 << 2);
        assert_eq!(
            w.wait_keys_until(None, Instant::now(), &mut ready).unwrap(),
            1
        );
        assert_eq!(ready, [2]);
    }

    #[test]
    fn keyed_watches_report_their_keys() {
        let (mut a_tx, a_rx) = UnixStream::pair().unwrap();
        let (mut b_tx, b_rx) = UnixStream::pair().unwrap();
        let w = ReadyWatch::new().unwrap();
        w.add_keyed(a_rx.as_fd(), 1 << 40 | 7).unwrap();
        w.add_keyed(b_rx.as_fd(), 3).unwrap();
        let mut ready = Vec::new();
        let zero = Some(Duration::ZERO);
        assert_eq!(w.wait_keys(zero, &mut ready).unwrap(), 0);
        a_tx.write_all(b"x").unwrap();
        b_tx.write_all(b"y").unwrap();
        assert_eq!(w.wait_keys(None, &mut ready).unwrap(), 2);
        ready.sort_unstable();
        assert_eq!(ready, [3, 1 << 40 | 7]);
    }

    #[test]
    fn an_exclusive_watch_reports_like_any_other() {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let (one, two) = (ReadyWatch::new().unwrap(), ReadyWatch::new().unwrap());
        one.add_exclusive(rx.as_fd(), 2).unwrap();
        two.add_exclusive(rx.as_fd(), 5).unwrap();
        assert_eq!(one.wait(Some(Duration::from_millis(1))).unwrap(), 0);
        tx.write_all(b"x").unwrap();
        // Not sleeping when the byte came: each finds it readable when it looks.
        assert_eq!(one.wait(Some(Duration::from_millis(100))).unwrap(), 1 << 2);
        assert_eq!(two.wait(Some(Duration::from_millis(100))).unwrap(), 1 << 5);
    }
}
