//! Posted-request bookkeeping shared by queue pairs and shared receive queues: process-wide
//! work request ids, requests held in posting order, posting a list of receives, and what a
//! failed post hands back.

use smallvec::SmallVec;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{check_ret, Error, Result};
use crate::ffi;
use crate::mr::Buffer;

/// A post that failed part-way. Requests before the failing one were posted; the buffers of the
/// failing one and those after it are handed back.
///
/// The failing request is the one the provider's `bad_wr` points at. If it points at none of
/// the requests (NULL or garbage: a provider breaking the libibverbs contract), it cannot be
/// known which ones the device may access, so the post fails closed: every request counts as
/// posted (`posted` is their number, `unposted` holds only buffers refused before anything
/// was posted), and their buffers stay with the queue pair until a completion or its
/// destruction hands them back. The error is returned all the same.
///
/// Displays as its [`PostError::error`] plus what was posted and handed back; `source()` is that
/// error's source (the OS error), so a printed chain names each cause once.
#[derive(Debug)]
pub struct PostError {
    /// Why.
    pub error: Error,
    /// Buffers of the requests that were certainly not posted.
    pub unposted: Vec<Buffer>,
    /// How many requests were (or, the failing one unknown, may have been) posted before the
    /// failure.
    pub posted: usize,
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; {} work requests posted before it, {} buffers handed back",
            self.error,
            self.posted,
            self.unposted.len()
        )
    }
}

impl std::error::Error for PostError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Self {
        e.error
    }
}

/// The next work request id of this process. Ids start at 1 (0 is what a `Default` completion
/// carries) and are never reused: at a billion a second (receive lists draw 8 at a time), 2^63
/// of them last 36 years and more.
static NEXT_WR_ID: AtomicU64 = AtomicU64::new(1);

/// Draws `n` consecutive work request ids no other request of this process ever had; returns
/// the first.
pub(crate) fn draw_wr_ids(n: usize) -> u64 {
    assert!((n as u64) < 1 << 32, "{n} work requests in one post");
    // Relaxed: only uniqueness matters, and fetch_add on one atomic is totally ordered.
    let first = NEXT_WR_ID.fetch_add(n as u64, Ordering::Relaxed);
    // Unreachable in practice; if ever reached, refuse to post rather than reuse an id. The
    // counter is far from wrapping (another 2^63 ids), so every later call stops here too.
    assert!(first < 1 << 63, "work request ids exhausted");
    first
}

/// Requests in posting order, so with increasing wr_ids, each with its buffer until handed
/// back. A queue's completions come in posting order, so the one handed back is nearly always
/// the oldest: finding it is a look at the front (a binary search otherwise), and no hashing.
#[derive(Debug)]
pub(crate) struct InOrder<B> {
    /// (wr_id, buffer); `None` once handed back, dropped when it reaches the front.
    queue: VecDeque<(u64, Option<B>)>,
    held: usize,
}

impl<B> InOrder<B> {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self {
            queue: VecDeque::with_capacity(n),
            held: 0,
        }
    }

    /// Holds `buf` for request `id`, which is above every id held (ids are drawn in order).
    pub(crate) fn push(&mut self, id: u64, buf: B) {
        debug_assert!(self.queue.back().map_or(true, |&(last, _)| last < id));
        self.queue.push_back((id, Some(buf)));
        self.held += 1;
    }

    /// The buffer of request `id`, once.
    pub(crate) fn take(&mut self, id: u64) -> Option<B> {
        // The oldest, nearly always: its entry goes at once, no search.
        let buf = if self.queue.front().is_some_and(|&(first, _)| first == id) {
            self.queue.pop_front()?.1?
        } else {
            let i = self.queue.binary_search_by_key(&id, |&(k, _)| k).ok()?;
            self.queue[i].1.take()?
        };
        self.held -= 1;
        while self.queue.front().is_some_and(|(_, b)| b.is_none()) {
            self.queue.pop_front();
        }
        while self.queue.back().is_some_and(|(_, b)| b.is_none()) {
            self.queue.pop_back();
        }
        Some(buf)
    }

    pub(crate) fn len(&self) -> usize {
        self.held
    }

    /// Whether no entry, not even a handed-back one, is left in the queue.
    #[cfg(test)]
    pub(crate) fn is_clear(&self) -> bool {
        self.queue.is_empty()
    }

    /// Every buffer still held, in posting order.
    pub(crate) fn drain_all(&mut self) -> Vec<B> {
        self.held = 0;
        self.queue.drain(..).filter_map(|(_, b)| b).collect()
    }
}

/// Posts `bufs` as linked lists of receive requests with fresh wr_ids through `post` (which
/// calls `ibv_post_recv` or `ibv_post_srq_recv` with a list and the `bad_wr` out-pointer), up
/// to [`INLINE_WRS`] requests per call, built on the stack: re-posting buffers, which a data
/// path does all the time, allocates nothing. Each buffer is held in `held` before its list is
/// posted. On failure, the buffers of the failing request and all after it are handed back with
/// `error` of the OS error; if the provider names no request as the failing one, those of that
/// list stay held (fail closed) and the rest are handed back.
pub(crate) fn post_recv_list(
    held: &mut InOrder<Buffer>,
    bufs: impl IntoIterator<Item = Buffer>,
    mut post: impl FnMut(*mut ffi::ibv_recv_wr, &mut *mut ffi::ibv_recv_wr) -> libc::c_int,
    error: impl FnOnce(std::io::Error) -> Error,
) -> Result<(), PostError> {
    let mut bufs = bufs.into_iter();
    let mut posted_before = 0;
    loop {
        // Ids for a whole list: unused ones are simply never seen (ids only need to be unique
        // and increasing).
        let first_id = draw_wr_ids(INLINE_WRS);
        let mut sges: SmallVec<[ffi::ibv_sge; INLINE_WRS]> = SmallVec::new();
        for (i, b) in bufs.by_ref().take(INLINE_WRS).enumerate() {
            sges.push(b.sge(b.len()));
            held.push(first_id + i as u64, b);
        }
        let n = sges.len();
        if n == 0 {
            return Ok(());
        }
        let mut wrs: SmallVec<[ffi::ibv_recv_wr; INLINE_WRS]> = SmallVec::new();
        for (i, sge) in sges.iter_mut().enumerate() {
            wrs.push(ffi::ibv_recv_wr {
                wr_id: first_id + i as u64,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: 1,
            });
        }
        let head = link(&mut wrs, |wr, next| wr.next = next);
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        let ret = post(head, &mut bad);
        if let Err(source) = check_ret(ret) {
            let posted = failed_index(&wrs, bad);
            let unposted = (posted..n)
                .filter_map(|i| held.take(first_id + i as u64))
                .chain(bufs)
                .collect();
            return Err(PostError {
                error: error(source),
                unposted,
                posted: posted_before + posted,
            });
        }
        posted_before += n;
        if n < INLINE_WRS {
            return Ok(());
        }
    }
}

/// Work requests of one post built without a heap allocation; longer lists spill to the heap.
pub(crate) const INLINE_WRS: usize = 8;

/// Links work requests into a NULL-terminated list and returns the pointer to its head, the
/// one to post. Works through that raw pointer only, so the links stay valid for the post call
/// as long as the requests do not move and `wrs` is not borrowed again before it.
pub(crate) fn link<T>(wrs: &mut [T], set_next: impl Fn(&mut T, *mut T)) -> *mut T {
    let base = wrs.as_mut_ptr();
    let n = wrs.len();
    for i in 0..n {
        let next = if i + 1 < n {
            base.wrapping_add(i + 1)
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: `i < n`, so `base.add(i)` is an initialised element of the vector, and no
        // other reference to it exists during this call.
        set_next(unsafe { &mut *base.add(i) }, next);
    }
    base
}

/// Index of the request `bad` points at (the first not posted), which is how many were posted.
/// If `bad` points at none of them (NULL, outside the list or into the middle of a request: a
/// provider breaking the libibverbs contract), `wrs.len()`: all of them count as posted, so
/// that no buffer the device may access is handed back (fail closed).
pub(crate) fn failed_index<T>(wrs: &[T], bad: *mut T) -> usize {
    let base = wrs.as_ptr() as usize;
    let addr = bad as usize;
    let size = std::mem::size_of::<T>();
    if size > 0
        && addr >= base
        && addr - base < std::mem::size_of_val(wrs)
        && (addr - base) % size == 0
    {
        (addr - base) / size
    } else {
        wrs.len()
    }
}
