//! Shared receive queues: one pool of receive buffers consumed by many queue pairs.
//!
//! The ownership rule is the queue pair's: posting moves a [`Buffer`] into the
//! [`SharedReceiveQueue`], which hands it back only for a polled completion naming that exact
//! request ([`SharedReceiveQueue::take_recv`]), once. Completions of an SRQ name whichever queue
//! pair consumed the request, so the queue pair number is not checked; the work request id,
//! drawn from the process-wide counter and never reused, is what identifies the request.

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::cq::WorkCompletion;
use crate::error::{check_ret, non_null, Error, Result};
use crate::ffi;
use crate::mr::Buffer;
use crate::pd::{PdInner, ProtectionDomain};
use crate::posted::{post_recv_list, InOrder, PostError};

/// The SRQ itself, shared by its handle and every queue pair created with it (destroying an SRQ
/// that queue pairs still use fails with `EBUSY`).
pub(crate) struct SrqInner {
    srq: NonNull<ffi::ibv_srq>,
    /// Buffers still posted when the [`SharedReceiveQueue`] handle was dropped: the device may
    /// write into them until the SRQ is destroyed, so they are kept (unreachable) until then.
    orphans: Mutex<Option<InOrder<Buffer>>>,
    _pd: Arc<PdInner>,
}

// SAFETY: the raw SRQ is only passed to libibverbs SRQ verbs, which are thread-safe
// (`ibv_post_srq_recv` through the handle's `&mut self`, `ibv_modify_srq`), and destroyed once,
// in Drop; the parked buffers are behind a mutex.
unsafe impl Send for SrqInner {}
// SAFETY: shared access reads only the immutable pointer and locks the mutex.
unsafe impl Sync for SrqInner {}

impl SrqInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_srq {
        self.srq.as_ptr()
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: the SRQ is alive and destroyed exactly once; every queue pair created with it
        // holds an Arc of this, so none is left. Its PD is still held.
        let ret = unsafe { ffi::ibv_destroy_srq(self.srq.as_ptr()) };
        if ret != 0 {
            // The device may still own the posted buffers: leak them rather than free memory
            // it could write to.
            let orphans = self.orphans.get_mut().unwrap_or_else(|e| e.into_inner());
            std::mem::forget(orphans.take());
        }
    }
}

/// A shared receive queue (`ibv_srq`): receive buffers posted once, consumed by whichever queue
/// pair created with [`QueuePair::new_rc_with_srq`](crate::QueuePair::new_rc_with_srq) receives
/// a message next. Those queue pairs post no receives of their own.
///
/// Keeps its PD alive; each of its queue pairs keeps the SRQ alive, so any drop order is valid.
/// Posted buffers stay with the SRQ until [`SharedReceiveQueue::take_recv`] hands each back for
/// a polled completion naming its request, once; if this handle is dropped first, they stay
/// unreachable until the SRQ is destroyed (and are leaked if `ibv_destroy_srq` fails).
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
    posted: InOrder<Buffer>,
    max_wr: u32,
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("srq", &self.inner.srq)
            .field("max_wr", &self.max_wr)
            .field("posted_recv", &self.posted.len())
            .finish()
    }
}

impl SharedReceiveQueue {
    /// Creates a shared receive queue of at least `max_wr` requests, one scatter/gather entry
    /// each, with no limit armed (`ibv_create_srq`).
    pub fn new(pd: &ProtectionDomain, max_wr: u32) -> Result<Self> {
        let mut init = ffi::ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is alive and kept so by the Arc stored below; `init` is valid.
        let srq = non_null(unsafe { ffi::ibv_create_srq(pd.as_raw(), &mut init) })
            .map_err(|source| Error::CreateSrq { max_wr, source })?;
        Ok(Self {
            inner: Arc::new(SrqInner {
                srq,
                orphans: Mutex::new(None),
                _pd: pd.inner.clone(),
            }),
            // ibv_create_srq writes the granted size back into init.attr.
            posted: InOrder::with_capacity(init.attr.max_wr as usize),
            max_wr: init.attr.max_wr,
        })
    }

    pub(crate) fn inner(&self) -> &Arc<SrqInner> {
        &self.inner
    }

    /// The granted number of requests that may be outstanding at once.
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// Posts receive buffers as linked lists of up to 8 work requests (`ibv_post_srq_recv`),
    /// built on the stack (no allocation), with fresh wr_ids. The SRQ owns them until
    /// [`SharedReceiveQueue::take_recv`] hands each back with its completion, whichever queue
    /// pair consumed it.
    ///
    /// On failure, the buffers of the failing request and those after it are handed back in
    /// the [`PostError`]; if the provider does not say which request failed, those of the
    /// failing list stay with the SRQ (they may have been posted) and only those of later lists
    /// are handed back.
    pub fn post_recv(&mut self, bufs: impl IntoIterator<Item = Buffer>) -> Result<(), PostError> {
        let bufs = bufs.into_iter();
        let requests = bufs.size_hint().0;
        let (srq, max_wr) = (self.inner.as_ptr(), self.max_wr);
        post_recv_list(
            &mut self.posted,
            bufs,
            |wrs, bad| {
                // SAFETY: the SRQ is alive (held by `self.inner`); `wrs` is the valid
                // NULL-terminated list `post_recv_list` built, whose SGEs point into buffers it
                // moved into `self.posted`, which holds them until their completions.
                unsafe { ffi::ibv_post_srq_recv(srq, wrs, bad) }
            },
            |source| Error::PostSrqRecv {
                requests,
                max_wr,
                source,
            },
        )
    }

    /// Hands back the buffer of a receive completion of this SRQ (successful or flushed),
    /// whichever queue pair it names: the buffer of the request `wc` names, if this SRQ still
    /// holds it. Each buffer comes back once: `None` for a completion already handed back, a
    /// send completion, another queue's completion, or one not polled from a CQ (such as
    /// `WorkCompletion::default()`).
    pub fn take_recv(&mut self, wc: &WorkCompletion) -> Option<Buffer> {
        self.posted.take(wc.wr_id())
    }

    /// Receive requests posted and not yet handed back.
    pub fn recv_outstanding(&self) -> usize {
        self.posted.len()
    }

    /// Arms the SRQ limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): once fewer than `limit`
    /// receives remain posted on the device, the context reports one
    /// [`AsyncEventKind::SrqLimitReached`](crate::AsyncEventKind::SrqLimitReached) event for
    /// [`AsyncElement::Srq`](crate::AsyncElement::Srq)`(self.as_raw() as usize)` and the limit
    /// disarms (re-arm after re-posting). `limit` 0 disarms. Devices reject a limit above
    /// [`SharedReceiveQueue::max_wr`] (`EINVAL`).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        let mask = ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as libc::c_int;
        // SAFETY: the SRQ is alive; `attr` is valid and `mask` names only the field set.
        let ret = unsafe { ffi::ibv_modify_srq(self.inner.as_ptr(), &mut attr, mask) };
        check_ret(ret).map_err(|source| Error::ModifySrq { limit, source })
    }

    /// The raw SRQ. Valid while this handle or any queue pair created with it is alive.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.as_ptr()
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // Queue pairs may keep the SRQ (and so the device's access to these buffers) alive:
        // park the buffers with it; they are freed after `ibv_destroy_srq` succeeds.
        let posted = std::mem::replace(&mut self.posted, InOrder::with_capacity(0));
        let mut orphans = self.inner.orphans.lock().unwrap_or_else(|e| e.into_inner());
        *orphans = Some(posted);
    }
}
