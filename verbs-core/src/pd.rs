//! Protection domains.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::{Context, ContextInner};
use crate::error::{non_null, Error, Result};
use crate::ffi;

pub(crate) struct PdInner {
    pd: NonNull<ffi::ibv_pd>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: a PD is only handed to thread-safe verbs (reg_mr, create_qp, dealloc_pd once in Drop).
unsafe impl Send for PdInner {}
// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl PdInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of this PD, so none remains; freed exactly once.
        unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

/// A protection domain: memory regions and queue pairs of one PD may be used together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("pd", &self.inner.pd)
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx` (`ibv_alloc_pd`).
    pub fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is open (held alive by the Arc stored below).
        let pd = non_null(unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) }).map_err(Error::AllocPd)?;
        Ok(Self {
            inner: Arc::new(PdInner {
                pd,
                ctx: ctx.inner.clone(),
            }),
        })
    }

    /// The context this PD belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: self.inner.ctx.clone(),
        }
    }

    /// The raw `ibv_pd`. Valid while this PD or any MR or QP created from it is alive.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.as_ptr()
    }
}
