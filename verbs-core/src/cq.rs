//! Completion channels, completion queues and work completions.
//!
//! Event accounting: libibverbs makes `ibv_destroy_cq` wait until every event read from the
//! channel for that CQ has been acknowledged. Each CQ therefore counts the events read for it and
//! the events acked, and acks the difference when it is dropped, so dropping never hangs.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::device::{Context, ContextInner};
use crate::error::{check_ret, last_os_error, non_null, Error, Result};
use crate::ffi;

pub(crate) struct ChannelInner {
    ch: NonNull<ffi::ibv_comp_channel>,
    /// CQs attached to this channel, by the address of their `ibv_cq`, to turn an event's raw
    /// CQ pointer back into a counted handle.
    cqs: Mutex<Vec<(usize, Weak<CqInner>)>>,
    _ctx: Arc<ContextInner>,
}

// SAFETY: ibv_get_cq_event may be called from any thread; the registry is behind a mutex.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: each CQ attached holds an Arc of this channel, so none remains; destroyed once.
        unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) };
    }
}

/// A completion channel (`ibv_comp_channel`): the file descriptor armed CQs report events to.
///
/// One channel may serve several CQs, and the CQs attached to it keep it alive. It has one
/// owner, which reads its events: a channel is deliberately not `Clone`, because two waiters
/// reading one channel steal each other's events (an event is one-shot) and one of them sleeps
/// for ever with completions queued. Code that needs to look at it borrows it.
///
/// ```compile_fail,E0277
/// fn clone<T: Clone>(t: &T) -> T {
///     t.clone()
/// }
/// fn two_waiters(channel: &rdmsg_verbs::CompletionChannel) {
///     let _stolen = clone(channel); // error: `CompletionChannel` is not `Clone`
/// }
/// ```
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

impl CompletionChannel {
    /// Creates a channel on `ctx` (`ibv_create_comp_channel`).
    pub fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is open and kept alive by the Arc stored below.
        let ch = non_null(unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) })
            .map_err(Error::CreateCompChannel)?;
        Ok(Self {
            inner: Arc::new(ChannelInner {
                ch,
                cqs: Mutex::new(Vec::new()),
                _ctx: ctx.inner.clone(),
            }),
        })
    }

    /// Makes [`CompletionChannel::get_event`] return `Ok(None)` instead of blocking.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        crate::set_nonblocking(self.as_raw_fd(), nonblocking)
    }

    /// Reads one completion event (`ibv_get_cq_event`).
    ///
    /// Blocks in blocking mode; in non-blocking mode `Ok(None)` means the channel is drained.
    /// The event is counted against its CQ; acknowledge it (in batches) with
    /// [`CompletionQueue::ack_events`], or let the CQ's drop do it.
    pub fn get_event(&self) -> Result<Option<CqEvent>> {
        loop {
            let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
            let mut cq_context: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: the channel is alive; both out-pointers are valid.
            let ret =
                unsafe { ffi::ibv_get_cq_event(self.inner.ch.as_ptr(), &mut cq, &mut cq_context) };
            if ret != 0 {
                let err = last_os_error();
                if err.kind() == std::io::ErrorKind::WouldBlock {
                    return Ok(None);
                }
                return Err(Error::GetCqEvent(err));
            }
            let found = self.lookup(cq as usize);
            match found {
                Some(inner) => {
                    inner.events_got.fetch_add(1, Ordering::AcqRel);
                    return Ok(Some(CqEvent { cq: inner }));
                }
                None => {
                    // The CQ is being dropped (its handle is gone but ibv_destroy_cq waits for
                    // this very event) or was created outside this crate: ack it here so that
                    // nobody waits for it. Not a completion anyone can poll.
                    // SAFETY: an event was read for `cq`, so libibverbs keeps the ibv_cq alive
                    // until it is acked; it is acked exactly once, here.
                    unsafe { ffi::ibv_ack_cq_events(cq, 1) };
                }
            }
        }
    }

    fn lookup(&self, addr: usize) -> Option<Arc<CqInner>> {
        let mut cqs = self.inner.cqs.lock().unwrap_or_else(|p| p.into_inner());
        cqs.retain(|(_, weak)| weak.strong_count() > 0);
        cqs.iter()
            .find(|(a, _)| *a == addr)
            .and_then(|(_, weak)| weak.upgrade())
    }

    /// The raw channel. Valid while this channel or any CQ attached to it is alive.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.ch.as_ptr()
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is alive; `fd` never changes after creation.
        unsafe { (*self.inner.ch.as_ptr()).fd }
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open while the channel (borrowed by the result) is alive.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

/// A completion event read from a channel: the CQ it names was armed and has since received a
/// completion that matched the arming. Holds the CQ's bookkeeping alive.
pub struct CqEvent {
    cq: Arc<CqInner>,
}

impl fmt::Debug for CqEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqEvent").field("cq", &self.cq.cq).finish()
    }
}

impl CqEvent {
    /// True if this event is for `cq`.
    pub fn is_for(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.cq, &cq.inner)
    }

    /// The raw CQ the event is for.
    pub fn cq_raw(&self) -> *mut ffi::ibv_cq {
        self.cq.cq.as_ptr()
    }
}

pub(crate) struct CqInner {
    cq: NonNull<ffi::ibv_cq>,
    events_got: AtomicU64,
    events_acked: AtomicU64,
    channel: Option<Arc<ChannelInner>>,
    _ctx: Arc<ContextInner>,
}

// SAFETY: req_notify, ack and destroy are thread-safe verbs; polling, which is not, needs
// `&mut CompletionQueue`.
unsafe impl Send for CqInner {}
// SAFETY: see Send.
unsafe impl Sync for CqInner {}

impl CqInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    /// Acks up to `max` of the events read and not yet acked; the counter is advanced with a
    /// compare-exchange so that concurrent callers never ack more than were read.
    fn ack(&self, max: u64) -> u64 {
        let mut acked = self.events_acked.load(Ordering::Acquire);
        let n = loop {
            let got = self.events_got.load(Ordering::Acquire);
            let n = got
                .saturating_sub(acked)
                .min(max)
                .min(u64::from(libc::c_uint::MAX));
            if n == 0 {
                return 0;
            }
            match self.events_acked.compare_exchange(
                acked,
                acked + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break n,
                Err(current) => acked = current,
            }
        };
        // SAFETY: the CQ is alive and `n` events read for it were claimed for acking above.
        unsafe { ffi::ibv_ack_cq_events(self.cq.as_ptr(), n as libc::c_uint) };
        n
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Some(ch) = &self.channel {
            let addr = self.cq.as_ptr() as usize;
            let mut cqs = ch.cqs.lock().unwrap_or_else(|p| p.into_inner());
            cqs.retain(|(a, _)| *a != addr);
        }
        self.ack(u64::MAX);
        // SAFETY: no QP uses this CQ (each holds an Arc), every event read for it is acked
        // (above, or by get_event once the registry entry is gone); destroyed exactly once.
        unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// A completion queue.
///
/// Polling needs `&mut self` because `ibv_poll_cq` on one CQ from two threads is not safe;
/// arming and acking take `&self`.
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    capacity: u32,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cq", &self.inner.cq)
            .field("capacity", &self.capacity)
            .field("unacked_events", &self.unacked_events())
            .finish()
    }
}

impl CompletionQueue {
    /// Creates a CQ of at least `cqe` entries, reporting to `channel` when armed.
    ///
    /// Size it for every completion that can be outstanding at once: an overrun loses
    /// completions and raises `IBV_EVENT_CQ_ERR`.
    pub fn new(ctx: &Context, cqe: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        let c_cqe = libc::c_int::try_from(cqe)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("CQ size {cqe}")))?;
        let ch_ptr = channel.map_or(std::ptr::null_mut(), |c| c.as_raw());
        // SAFETY: the context and channel are alive and kept so by the Arcs stored below.
        let cq = non_null(unsafe {
            ffi::ibv_create_cq(ctx.as_raw(), c_cqe, std::ptr::null_mut(), ch_ptr, 0)
        })
        .map_err(|source| Error::CreateCq { cqe, source })?;
        // SAFETY: the CQ was just created; `cqe` holds the actual size.
        let capacity = u32::try_from(unsafe { (*cq.as_ptr()).cqe }).unwrap_or(cqe);
        let inner = Arc::new(CqInner {
            cq,
            events_got: AtomicU64::new(0),
            events_acked: AtomicU64::new(0),
            channel: channel.map(|c| c.inner.clone()),
            _ctx: ctx.inner.clone(),
        });
        if let Some(ch) = channel {
            ch.inner
                .cqs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((cq.as_ptr() as usize, Arc::downgrade(&inner)));
        }
        Ok(Self { inner, capacity })
    }

    /// Actual number of entries (the device may round up).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Polls up to `wcs.len()` completions into `wcs`; returns how many were written.
    pub fn poll(&mut self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        let n = i32::try_from(wcs.len()).unwrap_or(i32::MAX);
        // SAFETY: `WorkCompletion` is repr(transparent) over ibv_wc, so the slice is a valid
        // array of `n` ibv_wc; the CQ is alive and `&mut self` excludes concurrent polling.
        let ret = unsafe { ffi::ibv_poll_cq(self.inner.as_ptr(), n, wcs.as_mut_ptr().cast()) };
        usize::try_from(ret).map_err(|_| {
            Error::PollCq(if ret < -1 {
                std::io::Error::from_raw_os_error(-ret)
            } else {
                last_os_error()
            })
        })
    }

    /// Arms the CQ (`ibv_req_notify_cq`): the next completion (or, with `solicited_only`, the
    /// next solicited receive completion or any error completion) produces one event on the
    /// channel. One-shot; completions already queued do not trigger it.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is alive.
        let ret = unsafe { ffi::ibv_req_notify_cq(self.inner.as_ptr(), i32::from(solicited_only)) };
        check_ret(ret).map_err(|source| Error::ReqNotifyCq {
            solicited_only,
            source,
        })
    }

    /// Acknowledges up to `n` events read for this CQ (`ibv_ack_cq_events`, which takes a mutex:
    /// batch it). Returns how many were acked; never more than were read.
    pub fn ack_events(&self, n: u32) -> u32 {
        u32::try_from(self.inner.ack(u64::from(n))).unwrap_or(u32::MAX)
    }

    /// Events read for this CQ and not yet acknowledged.
    pub fn unacked_events(&self) -> u64 {
        let got = self.inner.events_got.load(Ordering::Acquire);
        got.saturating_sub(self.inner.events_acked.load(Ordering::Acquire))
    }

    /// Events read for this CQ since it was created.
    pub fn events_got(&self) -> u64 {
        self.inner.events_got.load(Ordering::Acquire)
    }

    /// The raw CQ. Valid while this handle, a QP using it, or an undelivered event for it lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.as_ptr()
    }
}

/// A work completion, layout-compatible with `ibv_wc` so that polling writes straight into a
/// caller's slice.
#[repr(transparent)]
pub struct WorkCompletion(ffi::ibv_wc);

impl Default for WorkCompletion {
    fn default() -> Self {
        // SAFETY: ibv_wc consists of integers and a union of integers: all-zero is valid.
        Self(unsafe { std::mem::zeroed() })
    }
}

impl Clone for WorkCompletion {
    fn clone(&self) -> Self {
        // SAFETY: ibv_wc is plain old data; a bitwise copy is a valid value.
        Self(unsafe { std::ptr::read(&self.0) })
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm", &self.imm_data())
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

impl WorkCompletion {
    /// A vector of `n` empty completions to poll into.
    pub fn buffer(n: usize) -> Vec<Self> {
        (0..n).map(|_| Self::default()).collect()
    }

    /// The work request id given when posting. Requests posted through [`crate::QueuePair`]
    /// get ids unique in the process (never 0, never reused), which is how a completion is
    /// matched to exactly one posted buffer.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Outcome.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.0.status)
    }

    /// True if the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.0.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// Operation. Not valid for error completions, whose opcode the device may leave undefined.
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode::from_raw(self.0.opcode)
    }

    /// Bytes received (receive completions).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// Immediate data in host order, if the sender attached any.
    pub fn imm_data(&self) -> Option<u32> {
        if self.0.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
            // SAFETY: the WITH_IMM flag says the union holds imm_data.
            Some(u32::from_be(unsafe {
                self.0.imm_data_invalidated_rkey_union.imm_data
            }))
        } else {
            None
        }
    }

    /// Number of the local queue pair the work request belonged to.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// Vendor error code for failed completions.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
}

/// Completion status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcStatus {
    /// Success.
    Success,
    /// Local length error (e.g. a message larger than the receive buffer).
    LocLenErr,
    /// Local QP operation error.
    LocQpOpErr,
    /// Local protection error (e.g. a bad lkey).
    LocProtErr,
    /// Flushed because the QP entered the error state.
    WrFlushErr,
    /// Local access error.
    LocAccessErr,
    /// Remote invalid request.
    RemInvReqErr,
    /// Remote access error.
    RemAccessErr,
    /// Remote operation error.
    RemOpErr,
    /// Transport retries exhausted (the peer is gone).
    RetryExcErr,
    /// Receiver-not-ready retries exhausted.
    RnrRetryExcErr,
    /// Bad response.
    BadRespErr,
    /// Fatal error.
    FatalErr,
    /// General error.
    GeneralErr,
    /// Any other status.
    Other(u32),
}

impl WcStatus {
    fn from_raw(v: ffi::ibv_wc_status::Type) -> Self {
        use ffi::ibv_wc_status::*;
        match v {
            IBV_WC_SUCCESS => Self::Success,
            IBV_WC_LOC_LEN_ERR => Self::LocLenErr,
            IBV_WC_LOC_QP_OP_ERR => Self::LocQpOpErr,
            IBV_WC_LOC_PROT_ERR => Self::LocProtErr,
            IBV_WC_WR_FLUSH_ERR => Self::WrFlushErr,
            IBV_WC_LOC_ACCESS_ERR => Self::LocAccessErr,
            IBV_WC_REM_INV_REQ_ERR => Self::RemInvReqErr,
            IBV_WC_REM_ACCESS_ERR => Self::RemAccessErr,
            IBV_WC_REM_OP_ERR => Self::RemOpErr,
            IBV_WC_RETRY_EXC_ERR => Self::RetryExcErr,
            IBV_WC_RNR_RETRY_EXC_ERR => Self::RnrRetryExcErr,
            IBV_WC_BAD_RESP_ERR => Self::BadRespErr,
            IBV_WC_FATAL_ERR => Self::FatalErr,
            IBV_WC_GENERAL_ERR => Self::GeneralErr,
            other => Self::Other(other),
        }
    }
}

/// Completion opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A send completed.
    Send,
    /// An RDMA write completed.
    RdmaWrite,
    /// An RDMA read completed.
    RdmaRead,
    /// A receive completed.
    Recv,
    /// A receive of an RDMA write with immediate completed.
    RecvRdmaWithImm,
    /// Any other opcode.
    Other(u32),
}

impl WcOpcode {
    fn from_raw(v: ffi::ibv_wc_opcode::Type) -> Self {
        use ffi::ibv_wc_opcode::*;
        match v {
            IBV_WC_SEND => Self::Send,
            IBV_WC_RDMA_WRITE => Self::RdmaWrite,
            IBV_WC_RDMA_READ => Self::RdmaRead,
            IBV_WC_RECV => Self::Recv,
            IBV_WC_RECV_RDMA_WITH_IMM => Self::RecvRdmaWithImm,
            other => Self::Other(other),
        }
    }

    /// True for receive-side opcodes.
    pub fn is_recv(self) -> bool {
        matches!(self, Self::Recv | Self::RecvRdmaWithImm)
    }
}
