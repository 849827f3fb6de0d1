//! Registered memory, handed out as exclusive, non-overlapping buffers.
//!
//! Memory the device may be reading or writing must not be touched by the CPU. The safe API makes
//! that impossible to get wrong: a [`Buffer`] is the only way to reach registered bytes, buffers of
//! one region never overlap, and posting a buffer moves it into the queue pair, which gives it back
//! only once its completion has been polled.

use std::alloc::{self, Layout};
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{non_null, Error, Result};
use crate::ffi;
use crate::pd::{PdInner, ProtectionDomain};

/// Access rights of a registered region.
///
/// Remote write and atomic access are deliberately not offered: a peer could then change bytes
/// that safe code holds as `&[u8]`. rdmsg moves data with send/receive only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// The local device may write the memory (required for receive buffers).
    pub local_write: bool,
    /// Peers may RDMA-read the memory.
    pub remote_read: bool,
}

impl Access {
    /// Local write: what send and receive buffers need.
    pub const LOCAL_WRITE: Self = Self {
        local_write: true,
        remote_read: false,
    };

    fn to_raw(self) -> libc::c_int {
        let mut flags = 0;
        if self.local_write {
            flags |= ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        }
        if self.remote_read {
            flags |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        flags as libc::c_int
    }
}

/// Page-aligned memory from the global allocator, freed when dropped.
struct Allocation {
    base: NonNull<u8>,
    layout: Layout,
}

impl Allocation {
    /// `len` zeroed bytes aligned to a page (`len` > 0).
    fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty region".into(),
            ));
        }
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|e| Error::InvalidArgument(format!("region of {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size (refused above).
        let base = NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or_else(|| {
            Error::RegisterMemory {
                len,
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            }
        })?;
        Ok(Self { base, layout })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: `base` was allocated with `layout` in `zeroed` and is freed once, here.
        unsafe { alloc::dealloc(self.base.as_ptr(), self.layout) };
    }
}

/// Frees `memory` only if its deregistration succeeded (`ret == 0`): after a failed
/// `ibv_dereg_mr` the device may still reach it (a peer's remote read included), so it is
/// leaked instead. Returns whether it was freed.
fn free_if_deregistered<T>(ret: libc::c_int, memory: T) -> bool {
    if ret == 0 {
        drop(memory);
        true
    } else {
        std::mem::forget(memory);
        false
    }
}

pub(crate) struct MrInner {
    mr: NonNull<ffi::ibv_mr>,
    /// Freed in Drop, and only once deregistered.
    memory: ManuallyDrop<Allocation>,
    access: Access,
    _pd: Arc<PdInner>,
}

// SAFETY: the region's bytes are reachable only through exclusive `Buffer`s; the ibv_mr is only
// deregistered, once, in Drop.
unsafe impl Send for MrInner {}
// SAFETY: shared access only reads immutable fields (lkey, rkey, base address).
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: no Buffer of this region exists any more (each holds an Arc), so the device
        // has no outstanding work on it; deregister first, then free the memory.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        // SAFETY: taken once, here; never used again.
        let memory = unsafe { ManuallyDrop::take(&mut self.memory) };
        free_if_deregistered(ret, memory);
    }
}

impl MrInner {
    fn lkey(&self) -> u32 {
        // SAFETY: the ibv_mr is valid while self lives; lkey is immutable after registration.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as for lkey.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl ProtectionDomain {
    /// Allocates `len` zeroed, page-aligned bytes and registers them (`ibv_reg_mr`). The whole
    /// region comes back as one [`Buffer`]; split it with [`Buffer::split_off`] or
    /// [`Buffer::chunks`].
    pub fn register(&self, len: usize, access: Access) -> Result<Buffer> {
        // Refuses an empty region.
        let memory = Allocation::zeroed(len)?;
        // SAFETY: `base..base+len` is a live allocation owned by the MrInner built below, which
        // frees it only after deregistering it. (Dropped unregistered if this fails.)
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.as_raw(),
                memory.base.as_ptr().cast(),
                len,
                access.to_raw(),
            )
        };
        let mr = non_null(mr).map_err(|source| Error::RegisterMemory { len, source })?;
        Ok(Buffer {
            region: Arc::new(MrInner {
                mr,
                memory: ManuallyDrop::new(memory),
                access,
                _pd: self.inner.clone(),
            }),
            offset: 0,
            len,
        })
    }
}

/// An exclusive slice of a registered region.
///
/// Not `Clone`: at most one `Buffer` covers any byte, so `&mut self` access is sound. Keeps its
/// region (and through it the PD and device) alive.
pub struct Buffer {
    region: Arc<MrInner>,
    offset: usize,
    len: usize,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .finish()
    }
}

impl Buffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset of this buffer within its region; stable identity for pool bookkeeping.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Virtual address of the first byte, as placed in a scatter/gather entry.
    pub fn addr(&self) -> u64 {
        self.region.memory.base.as_ptr() as u64 + self.offset as u64
    }

    /// Local key of the region.
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }

    /// Remote key of the region (meaningful only with [`Access::remote_read`]).
    pub fn rkey(&self) -> u32 {
        self.region.rkey()
    }

    /// The access rights its region was registered with.
    pub fn access(&self) -> Access {
        self.region.access
    }

    /// True if both buffers are slices of the same registered region.
    pub fn same_region(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.region, &other.region)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `offset..offset+len` lies inside the live allocation; no other Buffer covers
        // these bytes and the device does not access them while a Buffer is outside a queue.
        unsafe {
            std::slice::from_raw_parts(self.region.memory.base.as_ptr().add(self.offset), self.len)
        }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for as_slice, and `&mut self` makes the access exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.region.memory.base.as_ptr().add(self.offset),
                self.len,
            )
        }
    }

    /// Splits off the bytes from `at` on into a second buffer. Fails if `at > len`.
    pub fn split_off(&mut self, at: usize) -> Result<Buffer> {
        if at > self.len {
            return Err(Error::InvalidArgument(format!(
                "split at {at} beyond buffer of {} bytes",
                self.len
            )));
        }
        let tail = Buffer {
            region: self.region.clone(),
            offset: self.offset + at,
            len: self.len - at,
        };
        self.len = at;
        Ok(tail)
    }

    /// Cuts the buffer into pieces of `size` bytes; a shorter remainder is dropped.
    pub fn chunks(mut self, size: usize) -> Result<Vec<Buffer>> {
        if size == 0 || size > self.len {
            return Err(Error::InvalidArgument(format!(
                "chunk size {size} for a buffer of {} bytes",
                self.len
            )));
        }
        let mut out = Vec::with_capacity(self.len / size);
        while self.len >= size {
            let rest = self.split_off(size)?;
            out.push(std::mem::replace(&mut self, rest));
        }
        Ok(out)
    }

    pub(crate) fn sge_at(&self, offset: usize, len: usize) -> ffi::ibv_sge {
        let offset = offset.min(self.len);
        ffi::ibv_sge {
            addr: self.addr() + offset as u64,
            length: u32::try_from(len.min(self.len - offset)).unwrap_or(u32::MAX),
            lkey: self.lkey(),
        }
    }

    pub(crate) fn sge(&self, len: usize) -> ffi::ibv_sge {
        self.sge_at(0, len)
    }
}

/// Bytes exposed to RDMA reads by peers, under a registration of their own.
///
/// The region covers exactly these bytes and only allows remote reads (no local or remote
/// write): its remote key ([`Exposed::rkey`]) reads nothing else, and is invalid once the
/// `Exposed` is dropped (the registration is undone first). The
/// bytes are an immutable [`Bytes`](crate::Bytes) held for the whole registration, so no
/// safe code can change what a peer may be reading, and they are not freed while a peer could
/// read them. One registration per exposure gives every exposed message its own key: a peer
/// that keeps an old key reads nothing once its message is done.
pub struct Exposed {
    mr: NonNull<ffi::ibv_mr>,
    /// A memory window of type 2 over the region, bound to one queue pair
    /// ([`QueuePair::bind`](crate::QueuePair::bind)): the key peers read with is the
    /// window's, valid on that queue pair alone. `None`: the region's own key.
    pub(crate) mw: Option<Arc<Window>>,
    /// The key a peer reads with.
    pub(crate) rkey: u32,
    /// Keeps the memory alive and unchanged: `Bytes` gives no mutable access.
    bytes: crate::Bytes,
    _pd: Arc<PdInner>,
}

// SAFETY: the ibv_mr and ibv_mw are only read (keys) through `&self` and released once, in
// Drop; the bytes are immutable and shared-ownership (`Bytes` is Send + Sync).
unsafe impl Send for Exposed {}
// SAFETY: as above: shared access reads immutable fields only.
unsafe impl Sync for Exposed {}

impl fmt::Debug for Exposed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposed")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("rkey", &self.rkey())
            .finish()
    }
}

/// A memory window, deallocated once: when its last holder lets go (the [`Exposed`] that
/// owns it, or the queue pair whose bind of it is still pending: see
/// [`QueuePair::bind`](crate::QueuePair::bind)), or before that by the queue pair it is bound
/// to when that is destroyed (a window bound to a queue pair holds it: destroying the queue
/// pair first would wait for the window, for seconds on rxe). Its key reads nothing once
/// deallocated. An exposure dropped while a bind of its window is pending hands its region
/// over to the window, which deregisters it after the window is gone.
pub(crate) struct Window {
    mw: std::sync::Mutex<Option<NonNull<ffi::ibv_mw>>>,
    /// The region the window is bound over, once the exposure that owned it was dropped.
    region: std::sync::Mutex<Option<Adopted>>,
}

/// A region handed over by its dropped exposure: the registration, its bytes and their
/// protection domain.
type Adopted = (NonNull<ffi::ibv_mr>, crate::Bytes, Arc<PdInner>);

// SAFETY: the window and the region are only used through their mutexes, and released once;
// the bytes are immutable and shared-ownership.
unsafe impl Send for Window {}
// SAFETY: as above.
unsafe impl Sync for Window {}

impl Drop for Window {
    fn drop(&mut self) {
        let region = self
            .region
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if !self.revoke() {
            // Its key may still read the bytes: neither the region nor the bytes go.
            std::mem::forget(region);
            return;
        }
        if let Some((mr, bytes, pd)) = region {
            // SAFETY: the region is registered until now (its exposure handed it over instead
            // of deregistering it) and deregistered once, here; its PD is held until after.
            let ret = unsafe { ffi::ibv_dereg_mr(mr.as_ptr()) };
            free_if_deregistered(ret, bytes);
            drop(pd);
        }
    }
}

impl Window {
    fn raw(&self) -> Option<NonNull<ffi::ibv_mw>> {
        *self.mw.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Deallocates the window now (its key is dead); whether it is gone (false: the
    /// deallocation failed, and its key may still read).
    pub(crate) fn revoke(&self) -> bool {
        let mut mw = self.mw.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = mw.take() {
            // SAFETY: the window is allocated until now and deallocated once, here.
            if unsafe { ffi::ibv_dealloc_mw(p.as_ptr()) } != 0 {
                *mw = Some(p);
                return false;
            }
        }
        true
    }
}

impl ProtectionDomain {
    /// Registers `bytes` for remote read only (`ibv_reg_mr` with `IBV_ACCESS_REMOTE_READ` and
    /// nothing else), under a key of their own. Empty bytes cannot be registered.
    pub fn expose(&self, bytes: crate::Bytes) -> Result<Exposed> {
        if bytes.is_empty() {
            return Err(Error::InvalidArgument("cannot expose empty bytes".into()));
        }
        let access = Access {
            local_write: false,
            remote_read: true,
        };
        // SAFETY: the bytes stay alive and unchanged (immutable, owned by the Exposed built
        // below) until the region is deregistered; the device is only allowed to read them.
        // The libibverbs prototype takes a mutable pointer, but without write access nothing
        // writes through it.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.as_raw(),
                bytes.as_ptr().cast_mut().cast(),
                bytes.len(),
                access.to_raw(),
            )
        };
        let mr = non_null(mr).map_err(|source| Error::RegisterMemory {
            len: bytes.len(),
            source,
        })?;
        // SAFETY: the region was just registered and is valid.
        let rkey = unsafe { (*mr.as_ptr()).rkey };
        Ok(Exposed {
            mr,
            mw: None,
            rkey,
            bytes,
            _pd: self.inner.clone(),
        })
    }

    /// The pieces of an exposure bound to one queue pair: `bytes` registered for memory
    /// windows only (`IBV_ACCESS_MW_BIND`: the region's own key reads nothing), and a type 2
    /// window of this PD, not bound yet (its key reads nothing either until
    /// [`QueuePair::bind`](crate::QueuePair::bind) binds it). `EOPNOTSUPP` without memory
    /// windows of type 2.
    pub fn window_over(&self, bytes: crate::Bytes) -> Result<Exposed> {
        if bytes.is_empty() {
            return Err(Error::InvalidArgument("cannot expose empty bytes".into()));
        }
        let access = ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0 as libc::c_int;
        // SAFETY: as in `expose`: the bytes stay alive and unchanged until the region is
        // deregistered, and no access lets anything write them.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.as_raw(),
                bytes.as_ptr().cast_mut().cast(),
                bytes.len(),
                access,
            )
        };
        let mr = non_null(mr).map_err(|source| Error::RegisterMemory {
            len: bytes.len(),
            source,
        })?;
        let mut exposed = Exposed {
            mr,
            mw: None,
            rkey: 0,
            bytes,
            _pd: self.inner.clone(),
        };
        // SAFETY: the PD is alive; the window is deallocated once, in Exposed's Drop.
        let mw = unsafe { ffi::ibv_alloc_mw(self.as_raw(), ffi::ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = match mw {
            Some(p) => non_null(p),
            None => Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
        };
        let mw = mw.map_err(|source| Error::AllocMw { source })?;
        exposed.mw = Some(Arc::new(Window {
            mw: std::sync::Mutex::new(Some(mw)),
            region: std::sync::Mutex::new(None),
        }));
        Ok(exposed)
    }
}

impl Exposed {
    /// Virtual address of the first byte: what a peer names in its read.
    pub fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Never true: empty bytes cannot be exposed.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The remote key a peer reads these bytes with, and nothing else (for an exposure bound
    /// to a queue pair, only through that queue pair).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Whether the key is a memory window's, valid on one queue pair alone.
    pub fn is_bound_to_one_queue_pair(&self) -> bool {
        self.mw.is_some()
    }

    pub(crate) fn raw_mr(&self) -> *mut ffi::ibv_mr {
        self.mr.as_ptr()
    }

    /// The window's handle and its raw pointer, if it still has one.
    pub(crate) fn window(&self) -> Option<(&Arc<Window>, NonNull<ffi::ibv_mw>)> {
        let w = self.mw.as_ref()?;
        Some((w, w.raw()?))
    }

    pub(crate) fn pd(&self) -> &Arc<PdInner> {
        &self._pd
    }

    /// The bytes (reading them while a peer reads them is fine: nobody writes).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Exposed {
    fn drop(&mut self) {
        if let Some(w) = self.mw.take() {
            // The window goes with its last holder, this exposure or the queue pair whose bind
            // of it is still pending (deallocating it under a pending bind would fail that
            // queue pair), and the region with it: bound or not, its key is dead once it goes.
            *w.region.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((self.mr, std::mem::take(&mut self.bytes), self._pd.clone()));
            return;
        }
        // SAFETY: the region is registered until now and deregistered once, here.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        free_if_deregistered(ret, std::mem::take(&mut self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    #[test]
    fn memory_is_freed_only_after_a_deregistration_that_succeeded() {
        let memory = Rc::new(());
        assert!(free_if_deregistered(0, memory.clone()));
        assert_eq!(Rc::strong_count(&memory), 1, "freed");
        assert!(!free_if_deregistered(libc::EBUSY, memory.clone()));
        assert_eq!(
            Rc::strong_count(&memory),
            2,
            "leaked: the device may reach it"
        );
    }

    #[test]
    fn an_allocation_is_page_aligned_and_zeroed() {
        assert!(matches!(
            Allocation::zeroed(0),
            Err(Error::InvalidArgument(_))
        ));
        let a = Allocation::zeroed(3 * 4096 + 5).unwrap();
        assert_eq!(a.base.as_ptr() as usize % 4096, 0);
        // SAFETY: the allocation holds that many bytes, and nothing else refers to them.
        let bytes = unsafe { std::slice::from_raw_parts(a.base.as_ptr(), 3 * 4096 + 5) };
        assert!(bytes.iter().all(|&b| b == 0));
    }
}
