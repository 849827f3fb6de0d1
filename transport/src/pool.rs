//! Receive buffers: one registered region sliced into fixed buffers, lent out as [`Received`]
//! handles that come back to the pool when dropped, from any thread.

use std::fmt;
use std::io::Write;
use std::ops::Deref;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rdmsg_verbs::{Access, Buffer, ProtectionDomain};

use crate::Result;

/// Where dropped handles put their buffers, and how they wake a connection asleep on them.
#[derive(Debug)]
pub(crate) struct Returns {
    bufs: Mutex<Vec<Buffer>>,
    /// How many `bufs` holds, readable without the lock (the owner looks on every step).
    count: AtomicUsize,
    /// Written (one byte) when a buffer comes back while the owner sleeps.
    waker: UnixStream,
    /// The owner is (about to be) asleep and wants to hear of returned buffers.
    sleeping: AtomicBool,
}

impl Returns {
    fn give_back(&self, buf: Buffer) {
        {
            let mut bufs = self.bufs.lock().unwrap_or_else(PoisonError::into_inner);
            bufs.push(buf);
            // Counted under the lock (so `take_all` never takes more than it counted) and
            // before looking at `sleeping`: an owner that sets `sleeping` and then reads the
            // count (both SeqCst) either sees this buffer or is seen asleep.
            self.count.fetch_add(1, Ordering::SeqCst);
        }
        // One byte per sleep: the first handle dropped while the owner sleeps takes the flag.
        if self.sleeping.swap(false, Ordering::SeqCst) {
            // Non-blocking: a full pipe already holds a wake-up, which is all we need.
            let _ = (&self.waker).write(&[1]);
        }
    }

    fn take_all(&self, into: &mut Vec<Buffer>) -> usize {
        if self.is_empty() {
            return 0;
        }
        let mut bufs = self.bufs.lock().unwrap_or_else(PoisonError::into_inner);
        let n = bufs.len();
        into.append(&mut bufs);
        self.count.fetch_sub(n, Ordering::SeqCst);
        n
    }

    fn is_empty(&self) -> bool {
        self.count.load(Ordering::SeqCst) == 0
    }
}

/// Counts of a pool's buffers. `free + posted + lent == total` at all times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Buffers in the pool.
    pub total: usize,
    /// Ready to be posted.
    pub free: usize,
    /// Posted to the queue pair.
    pub posted: usize,
    /// Held by [`Received`] handles (or dropped and not yet collected).
    pub lent: usize,
}

/// Fixed-size receive buffers carved from one registered region.
pub struct RecvPool {
    free: Vec<Buffer>,
    returns: Arc<Returns>,
    /// Read end of the waker pipe, for the owner's poll set.
    wake_rx: UnixStream,
    buf_size: usize,
    total: usize,
    lent: usize,
}

impl fmt::Debug for RecvPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvPool")
            .field("buf_size", &self.buf_size)
            .field("total", &self.total)
            .field("free", &self.free.len())
            .field("lent", &self.lent)
            .finish()
    }
}

impl RecvPool {
    /// Registers `count` buffers of `buf_size` bytes in one region.
    pub fn new(pd: &ProtectionDomain, count: usize, buf_size: usize) -> Result<Self> {
        let region = pd.register(count * buf_size, Access::LOCAL_WRITE)?;
        let free = region.chunks(buf_size)?;
        let (waker, wake_rx) = UnixStream::pair().map_err(crate::Error::WakePipe)?;
        waker
            .set_nonblocking(true)
            .map_err(crate::Error::WakePipe)?;
        wake_rx
            .set_nonblocking(true)
            .map_err(crate::Error::WakePipe)?;
        Ok(Self {
            total: free.len(),
            free,
            returns: Arc::new(Returns {
                bufs: Mutex::new(Vec::new()),
                count: AtomicUsize::new(0),
                waker,
                sleeping: AtomicBool::new(false),
            }),
            wake_rx,
            buf_size,
            lent: 0,
        })
    }

    /// Registers `count` more buffers of the pool's size, in a region of their own (a hub's
    /// shared pool grows with its connections; the regions stay until the pool is dropped).
    pub(crate) fn grow(&mut self, pd: &ProtectionDomain, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let region = pd.register(count * self.buf_size, Access::LOCAL_WRITE)?;
        let more = region.chunks(self.buf_size)?;
        self.total += more.len();
        self.free.extend(more);
        Ok(())
    }

    /// Size of each buffer.
    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    /// Moves buffers returned by dropped handles back to the free list; returns how many.
    pub fn collect_returns(&mut self) -> usize {
        let n = self.returns.take_all(&mut self.free);
        self.lent -= n;
        n
    }

    /// Whether dropped handles have returned buffers not yet collected (no lock taken).
    pub fn has_returns(&self) -> bool {
        !self.returns.is_empty()
    }

    /// Free buffers.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Takes every free buffer (to post them). The pool keeps its list's room: re-posting
    /// allocates nothing.
    pub fn take_free(&mut self) -> std::vec::Drain<'_, Buffer> {
        self.free.drain(..)
    }

    /// Takes at most `n` free buffers (to post them to one of several queues).
    pub fn take_free_up_to(&mut self, n: usize) -> std::vec::Drain<'_, Buffer> {
        let from = self.free.len().saturating_sub(n);
        self.free.drain(from..)
    }

    /// Puts a buffer that was never lent back on the free list (a grant, a flushed receive, a
    /// failed post).
    pub fn put_back(&mut self, buf: Buffer) {
        self.free.push(buf);
    }

    /// Lends a received buffer holding `len` bytes as a handle.
    pub fn lend(&mut self, buf: Buffer, len: usize) -> Received {
        self.lent += 1;
        Received {
            buf: Some(buf),
            len,
            returns: Arc::clone(&self.returns),
        }
    }

    /// Counts, given how many buffers are posted.
    pub fn stats(&self, posted: usize) -> PoolStats {
        PoolStats {
            total: self.total,
            free: self.free.len(),
            posted,
            lent: self.lent,
        }
    }

    /// Announces that the owner is about to sleep. Returns `false` if buffers came back in the
    /// meantime (do not sleep: collect them). Paired with [`RecvPool::awake`].
    pub(crate) fn going_to_sleep(&self) -> bool {
        self.returns.sleeping.store(true, Ordering::SeqCst);
        // A handle dropped before the store above did not write to the pipe: look for it.
        if !self.returns.is_empty() {
            self.returns.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The owner is awake again. Empties the waker pipe if a handle wrote to it (it took the
    /// sleeping flag), or if `woken_by_other` (the wait ended for something other than
    /// completions: a byte written just after an earlier drain must not keep waking us).
    /// Otherwise no syscall.
    pub(crate) fn awake(&self, woken_by_other: bool) {
        let still_flagged = self.returns.sleeping.swap(false, Ordering::SeqCst);
        if still_flagged && !woken_by_other {
            return;
        }
        let mut sink = [0u8; 64];
        while matches!(std::io::Read::read(&mut &self.wake_rx, &mut sink), Ok(n) if n > 0) {}
    }

    /// A second handle on the read end of the waker pipe, for the owner's poll set.
    pub(crate) fn wake_handle(&self) -> std::io::Result<UnixStream> {
        self.wake_rx.try_clone()
    }

    /// A second handle on the write end of the waker pipe, for others that must wake the
    /// owner (the endpoint's router of asynchronous events). A byte written by it ends the
    /// owner's sleep as [`rdmsg_notify::Readiness::Other`], which makes the owner look at its
    /// mailbox, and is drained like any other.
    pub(crate) fn waker(&self) -> std::io::Result<UnixStream> {
        self.returns.waker.try_clone()
    }
}

/// A received message: borrows its registered buffer (no copy) and gives it back to its
/// connection's pool when dropped, from whichever thread. Holding many handles holds back the
/// peer: each one is a receive buffer, and so a credit, the peer does not have.
pub struct Received {
    buf: Option<Buffer>,
    len: usize,
    returns: Arc<Returns>,
}

impl Received {
    /// The message bytes.
    pub fn bytes(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| &b.as_slice()[..self.len])
    }
}

impl Deref for Received {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl AsRef<[u8]> for Received {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl fmt::Debug for Received {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Received").field("len", &self.len).finish()
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.returns.give_back(buf);
        }
    }
}

/// Makes a connection's (or a hub's) descriptor readable from any thread: see
/// [`Connection::waker`](crate::Connection::waker).
#[derive(Debug)]
pub struct Waker(UnixStream);

impl Waker {
    pub(crate) fn new(socket: UnixStream) -> Self {
        Self(socket)
    }

    /// Writes one byte to the wake-up socket (non-blocking: a full socket already wakes it).
    pub fn wake(&self) {
        let _ = (&self.0).write(&[1]);
    }
}
