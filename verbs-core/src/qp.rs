//! Reliable-connected queue pairs: creation, state transitions, posting.
//!
//! Posting rules live in the types: posting a [`Buffer`] moves it into the queue pair, which hands
//! it back only for a polled completion that covers it ([`QueuePair::take_recv`],
//! [`QueuePair::complete_send`], [`QueuePair::reclaim`]). A buffer the device may still access
//! is thus never reachable.
//!
//! Completions are not trusted blindly: [`WorkCompletion`] is `Clone` and `Default`, so safe
//! code can replay one, pass a receive completion where a send one belongs, or make one up.
//! Every work request id is therefore drawn from one process-wide counter and never reused, so
//! an id names exactly one request ever posted in this process; a queue pair hands a buffer
//! back only for the id of a request it still holds, once.

use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::cq::{CompletionQueue, CqInner, WorkCompletion};
use crate::device::{Gid, Mtu};
use crate::error::{check_ret, non_null, Error, Result};
use crate::ffi;
use crate::mr::Buffer;
use crate::pd::{PdInner, ProtectionDomain};
use crate::srq::{SharedReceiveQueue, SrqInner};

/// Queue sizes requested at creation (the device may grant more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send work requests outstanding at once.
    pub max_send_wr: u32,
    /// Receive work requests outstanding at once.
    pub max_recv_wr: u32,
    /// Bytes that may be sent inline (copied at post time, no registered buffer needed).
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_inline_data: 64,
        }
    }
}

/// Queue pair states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Freshly created or reset.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every outstanding work request completes with a flush error.
    Error,
    /// Unknown value.
    Unknown,
}

impl QpState {
    fn to_raw(self) -> ffi::ibv_qp_state::Type {
        use ffi::ibv_qp_state::*;
        match self {
            Self::Reset => IBV_QPS_RESET,
            Self::Init => IBV_QPS_INIT,
            Self::Rtr => IBV_QPS_RTR,
            Self::Rts => IBV_QPS_RTS,
            Self::Sqd => IBV_QPS_SQD,
            Self::Sqe => IBV_QPS_SQE,
            Self::Error => IBV_QPS_ERR,
            Self::Unknown => IBV_QPS_UNKNOWN,
        }
    }

    fn from_raw(v: ffi::ibv_qp_state::Type) -> Self {
        use ffi::ibv_qp_state::*;
        match v {
            IBV_QPS_RESET => Self::Reset,
            IBV_QPS_INIT => Self::Init,
            IBV_QPS_RTR => Self::Rtr,
            IBV_QPS_RTS => Self::Rts,
            IBV_QPS_SQD => Self::Sqd,
            IBV_QPS_SQE => Self::Sqe,
            IBV_QPS_ERR => Self::Error,
            _ => Self::Unknown,
        }
    }
}

/// Where the remote queue pair lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAddress {
    /// Remote LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Remote GID; required on RoCE, where it carries the IP address.
    pub gid: Option<Gid>,
    /// Index of the local GID to send from (see `Context::pick_roce_v2_ipv4_gid`).
    pub sgid_index: u8,
    /// Service level.
    pub sl: u8,
    /// Local port.
    pub port: u8,
}

/// Attributes for INIT → RTR, with explicit defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
    /// Remote queue pair number.
    pub dest_qp_num: u32,
    /// First packet sequence number expected from the peer (its send PSN).
    pub rq_psn: u32,
    /// Path MTU; at most the active MTU of both ports.
    pub path_mtu: Mtu,
    /// Outstanding RDMA reads/atomics the peer may direct at us. Default 1.
    pub max_dest_rd_atomic: u8,
    /// How long a peer that hit receiver-not-ready waits before retrying, as the IB-encoded
    /// 5-bit value. Default 12 (0.64 ms). **0 is not "no wait": it means 655.36 ms.**
    pub min_rnr_timer: u8,
    /// Remote address.
    pub remote: RemoteAddress,
}

impl RtrAttr {
    /// RTR attributes with the defaults documented on each field.
    pub fn new(dest_qp_num: u32, rq_psn: u32, path_mtu: Mtu, remote: RemoteAddress) -> Self {
        Self {
            dest_qp_num,
            rq_psn,
            path_mtu,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            remote,
        }
    }
}

/// Attributes for RTR → RTS, with explicit defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    /// Our first send packet sequence number (the peer's `rq_psn`).
    pub sq_psn: u32,
    /// Local ACK timeout, 4.096 µs × 2^timeout. Default 14 (≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before a `RetryExcErr` completion. Default 7; with timeout 14 a dead
    /// peer is detected in about half a second.
    pub retry_cnt: u8,
    /// Retries after receiver-not-ready NAKs; 7 means forever. Default 7: rdmsg's credits keep
    /// RNR from happening at all.
    pub rnr_retry: u8,
    /// Outstanding RDMA reads/atomics we may issue. Default 1.
    pub max_rd_atomic: u8,
}

impl RtsAttr {
    /// RTS attributes with the defaults documented on each field.
    pub fn new(sq_psn: u32) -> Self {
        Self {
            sq_psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }
}

/// What a send work request carries.
#[derive(Debug)]
pub enum SendPayload<'a> {
    /// The first `len` bytes of a registered buffer; the queue pair keeps the buffer until a
    /// completion covering this request is polled.
    Buffer {
        /// The buffer.
        buf: Buffer,
        /// Bytes to send.
        len: usize,
    },
    /// Bytes copied into the work request at post time (`IBV_SEND_INLINE`); at most
    /// `max_inline_data` of them.
    Inline(&'a [u8]),
    /// A zero-length send (useful with immediate data alone).
    Empty,
}

/// One send work request.
#[derive(Debug)]
pub struct SendRequest<'a> {
    /// The data.
    pub payload: SendPayload<'a>,
    /// Generate a completion for this request. Unsignaled requests are retired by the next
    /// signaled completion after them; signal at least every `max_send_wr`-th request.
    pub signaled: bool,
    /// Set `IBV_SEND_SOLICITED`: a receiver armed solicited-only is woken by this message.
    pub solicited: bool,
    /// Immediate data delivered with the receive completion.
    pub imm: Option<u32>,
}

impl<'a> SendRequest<'a> {
    /// A signaled, unsolicited send of the first `len` bytes of `buf`.
    pub fn buffer(buf: Buffer, len: usize) -> Self {
        Self::with(SendPayload::Buffer { buf, len })
    }

    /// A signaled, unsolicited inline send of `data`.
    pub fn inline(data: &'a [u8]) -> Self {
        Self::with(SendPayload::Inline(data))
    }

    /// A signaled, unsolicited empty send.
    pub fn empty() -> Self {
        Self::with(SendPayload::Empty)
    }

    fn with(payload: SendPayload<'a>) -> Self {
        Self {
            payload,
            signaled: true,
            solicited: false,
            imm: None,
        }
    }

    /// Sets whether the receiver should be woken.
    pub fn solicited(mut self, yes: bool) -> Self {
        self.solicited = yes;
        self
    }

    /// Sets whether this request produces a completion.
    pub fn signaled(mut self, yes: bool) -> Self {
        self.signaled = yes;
        self
    }

    /// Attaches immediate data.
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }
}

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
/// carries) and are never reused: at a billion posts a second, 2^63 of them last 292 years.
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
        let i = match self.queue.front() {
            Some(&(first, _)) if first == id => 0,
            _ => self.queue.binary_search_by_key(&id, |&(k, _)| k).ok()?,
        };
        let buf = self.queue[i].1.take()?;
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

    /// Every buffer still held, in posting order.
    pub(crate) fn drain_all(&mut self) -> Vec<B> {
        self.held = 0;
        self.queue.drain(..).filter_map(|(_, b)| b).collect()
    }
}

/// What [`QueuePair::reclaim`] found for a completion.
#[derive(Debug)]
pub enum Reclaimed {
    /// The completion is a receive of this queue pair: its buffer.
    Recv(Buffer),
    /// The completion is a send of this queue pair: the buffers of it and of every request
    /// posted before it on the send queue (empty for inline or empty sends).
    Send(Vec<Buffer>),
    /// The completion names no request this queue pair still holds (already handed back, of
    /// another queue pair, posted outside this crate, or made up): nothing is handed back.
    Unknown,
}

/// The requests a queue pair posted and has not handed back, with their buffers. Generic over
/// the buffer type so that the bookkeeping is tested without a device.
#[derive(Debug)]
struct Posted<B> {
    /// Receive requests in posting order.
    recv: InOrder<B>,
    /// Send requests in posting order, so with increasing wr_ids: (wr_id, buffer, whether it
    /// is an RDMA read). Completions on one send queue arrive in order, so a completion for
    /// one of them retires it and every entry before it.
    send: VecDeque<(u64, Option<B>, bool)>,
}

impl<B> Posted<B> {
    fn with_capacity(send: usize, recv: usize) -> Self {
        Self {
            recv: InOrder::with_capacity(recv),
            send: VecDeque::with_capacity(send),
        }
    }

    fn take_recv(&mut self, id: u64) -> Option<B> {
        self.recv.take(id)
    }

    /// Retires the send request `id` and every one before it into `out`; false (and nothing
    /// retired) if `id` is not a send request still held.
    fn complete_send(&mut self, id: u64, out: &mut Vec<B>) -> bool {
        let Ok(i) = self.send.binary_search_by_key(&id, |&(k, _, _)| k) else {
            return false;
        };
        out.extend(self.send.drain(..=i).filter_map(|(_, b, _)| b));
        true
    }

    /// [`Posted::complete_send`], the buffers of reads going to `reads` with their wr_ids.
    fn complete_split(&mut self, id: u64, sends: &mut Vec<B>, reads: &mut Vec<(u64, B)>) -> bool {
        let Ok(i) = self.send.binary_search_by_key(&id, |&(k, _, _)| k) else {
            return false;
        };
        for (k, b, read) in self.send.drain(..=i) {
            match (b, read) {
                (Some(b), true) => reads.push((k, b)),
                (Some(b), false) => sends.push(b),
                (None, _) => {}
            }
        }
        true
    }
}

/// A reliable-connected queue pair. Holds its PD and both CQs alive (destroying an attached CQ
/// would fail with `EBUSY`).
///
/// Posted buffers stay in the queue pair until a polled completion naming their request is
/// handed to [`QueuePair::take_recv`], [`QueuePair::complete_send`] or
/// [`QueuePair::reclaim`]; each request is handed back at most once, whatever completion (a
/// replayed, cloned, `Default` or other queue pair's one) those are given.
pub struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    qp_num: u32,
    state: QpState,
    caps: QpCaps,
    port: u8,
    posted: Posted<Buffer>,
    _pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    /// The shared receive queue this QP receives through, if any (then it posts no receives).
    srq: Option<Arc<SrqInner>>,
    /// Destroyed by [`QueuePair::destroy`]: nothing left for Drop.
    destroyed: bool,
}

// SAFETY: posting and modifying take `&mut self`; the raw QP may be used from any one thread at
// a time (libibverbs QPs are thread-safe).
unsafe impl Send for QueuePair {}
// SAFETY: `&self` methods only read immutable fields.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &format_args!("{:#x}", self.qp_num))
            .field("state", &self.state)
            .field("caps", &self.caps)
            .field("posted_recv", &self.posted.recv.len())
            .field("posted_send", &self.posted.send.len())
            .field("srq", &self.srq.as_ref().map(|s| s.as_ptr()))
            .finish()
    }
}

impl QueuePair {
    /// Creates an RC queue pair (`ibv_create_qp`) with one scatter/gather entry per request.
    pub fn new_rc(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<Self> {
        Self::create(pd, send_cq, recv_cq, None, caps)
    }

    /// Creates an RC queue pair (`ibv_create_qp`) that receives through `srq`: its receive
    /// completions (on `recv_cq`) name requests of the SRQ, whose buffers
    /// [`SharedReceiveQueue::take_recv`] hands back. The queue pair posts no receives of its
    /// own ([`QueuePair::post_recv`] fails with [`Error::InvalidArgument`]), and its
    /// [`QueuePair::take_recv`] and [`QueuePair::reclaim`] never hand out SRQ buffers.
    /// `caps.max_recv_wr` is ignored (the SRQ's size applies). Keeps the SRQ alive.
    pub fn new_rc_with_srq(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: &SharedReceiveQueue,
        caps: QpCaps,
    ) -> Result<Self> {
        let caps = QpCaps {
            max_recv_wr: 0,
            ..caps
        };
        Self::create(pd, send_cq, recv_cq, Some(srq), caps)
    }

    fn create(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Self> {
        // SAFETY: ibv_qp_init_attr is plain old data; all-zero is valid (no SRQ, no context).
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_raw();
        init.recv_cq = recv_cq.as_raw();
        if let Some(srq) = srq {
            init.srq = srq.as_raw();
        }
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap = ffi::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: 1,
            max_recv_sge: if srq.is_some() { 0 } else { 1 },
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: PD, CQs and SRQ are alive and kept so by the Arcs stored below; `init` is
        // valid.
        let qp = non_null(unsafe { ffi::ibv_create_qp(pd.as_raw(), &mut init) })
            .map_err(|source| Error::CreateQp { caps, source })?;
        // SAFETY: just created; qp_num is immutable.
        let qp_num = unsafe { (*qp.as_ptr()).qp_num };
        Ok(Self {
            qp,
            qp_num,
            state: QpState::Reset,
            // ibv_create_qp writes the granted sizes back into init.cap.
            caps: QpCaps {
                max_send_wr: init.cap.max_send_wr,
                max_recv_wr: if srq.is_some() {
                    0
                } else {
                    init.cap.max_recv_wr
                },
                max_inline_data: init.cap.max_inline_data,
            },
            port: 1,
            posted: Posted::with_capacity(
                init.cap.max_send_wr as usize,
                if srq.is_some() {
                    0
                } else {
                    init.cap.max_recv_wr as usize
                },
            ),
            _pd: pd.inner.clone(),
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
            srq: srq.map(|s| s.inner().clone()),
            destroyed: false,
        })
    }

    /// Queue pair number, as the peer needs it.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The granted queue sizes.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The state after the last successful transition made through this handle. The device may
    /// have moved the QP to `Error` since; [`QueuePair::query_state`] asks it.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// True if `cq` is this QP's send CQ.
    pub fn uses_send_cq(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.send_cq, &cq.inner)
    }

    /// True if `cq` is this QP's receive CQ.
    pub fn uses_recv_cq(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.recv_cq, &cq.inner)
    }

    /// True if this QP receives through `srq`.
    pub fn uses_srq(&self, srq: &SharedReceiveQueue) -> bool {
        self.srq
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(s, srq.inner()))
    }

    /// The raw QP. Valid while this handle lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.qp.as_ptr()
    }

    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: u32, to: QpState) -> Result<()> {
        attr.qp_state = to.to_raw();
        let mask = mask | ffi::ibv_qp_attr_mask::IBV_QP_STATE.0;
        // SAFETY: the QP is alive; `attr` is valid and `mask` names only the fields set.
        let ret = unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, mask as libc::c_int) };
        check_ret(ret).map_err(|source| Error::ModifyQp {
            qp_num: self.qp_num,
            from: self.state,
            to,
            source,
        })?;
        self.state = to;
        Ok(())
    }

    fn zeroed_attr() -> ffi::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain old data; all-zero is valid.
        unsafe { std::mem::zeroed() }
    }

    /// RESET → INIT on `port`, with no remote access rights (send/receive needs none).
    pub fn to_init(&mut self, port: u8) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = Self::zeroed_attr();
        attr.pkey_index = 0;
        attr.port_num = port;
        // Peers may read what this process exposed (rendezvous): only regions registered with
        // remote read themselves (`ProtectionDomain::expose`, or `Access::remote_read`) can be
        // read, each under its own key. Remote write and atomics stay off.
        attr.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        self.port = port;
        self.modify(
            &mut attr,
            m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0,
            QpState::Init,
        )
    }

    /// INIT → RTR.
    pub fn to_rtr(&mut self, rtr: &RtrAttr) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        if rtr.min_rnr_timer > 31 {
            return Err(Error::InvalidArgument(format!(
                "min_rnr_timer {} is not a 5-bit value",
                rtr.min_rnr_timer
            )));
        }
        let mut attr = Self::zeroed_attr();
        attr.path_mtu = rtr.path_mtu.to_raw();
        attr.dest_qp_num = rtr.dest_qp_num;
        attr.rq_psn = rtr.rq_psn & 0xff_ffff;
        attr.max_dest_rd_atomic = rtr.max_dest_rd_atomic;
        attr.min_rnr_timer = rtr.min_rnr_timer;
        attr.ah_attr.dlid = rtr.remote.lid;
        attr.ah_attr.sl = rtr.remote.sl;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = rtr.remote.port;
        if let Some(gid) = rtr.remote.gid {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: gid.0 };
            attr.ah_attr.grh.sgid_index = rtr.remote.sgid_index;
            attr.ah_attr.grh.hop_limit = 1;
        }
        self.modify(
            &mut attr,
            m::IBV_QP_AV.0
                | m::IBV_QP_PATH_MTU.0
                | m::IBV_QP_DEST_QPN.0
                | m::IBV_QP_RQ_PSN.0
                | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | m::IBV_QP_MIN_RNR_TIMER.0,
            QpState::Rtr,
        )
    }

    /// RTR → RTS.
    pub fn to_rts(&mut self, rts: &RtsAttr) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = Self::zeroed_attr();
        attr.sq_psn = rts.sq_psn & 0xff_ffff;
        attr.timeout = rts.timeout;
        attr.retry_cnt = rts.retry_cnt;
        attr.rnr_retry = rts.rnr_retry;
        attr.max_rd_atomic = rts.max_rd_atomic;
        self.modify(
            &mut attr,
            m::IBV_QP_SQ_PSN.0
                | m::IBV_QP_TIMEOUT.0
                | m::IBV_QP_RETRY_CNT.0
                | m::IBV_QP_RNR_RETRY.0
                | m::IBV_QP_MAX_QP_RD_ATOMIC.0,
            QpState::Rts,
        )
    }

    /// Any state → ERROR: every outstanding work request completes with `WrFlushErr`, which
    /// is how buffers are reclaimed from a connection being torn down.
    pub fn to_error(&mut self) -> Result<()> {
        let mut attr = Self::zeroed_attr();
        self.modify(&mut attr, 0, QpState::Error)
    }

    /// Asks the device for the current state (`ibv_query_qp`).
    pub fn query_state(&self) -> Result<QpState> {
        let mut attr = Self::zeroed_attr();
        // SAFETY: ibv_qp_init_attr is plain old data; all-zero is valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is alive; both out-pointers are valid.
        let ret = unsafe {
            ffi::ibv_query_qp(
                self.qp.as_ptr(),
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as libc::c_int,
                &mut init,
            )
        };
        check_ret(ret).map_err(|source| Error::QueryQp {
            qp_num: self.qp_num,
            source,
        })?;
        Ok(QpState::from_raw(attr.qp_state))
    }

    /// Posts receive buffers as one linked list of work requests (`ibv_post_recv`), with fresh
    /// wr_ids. The queue pair owns them until [`QueuePair::take_recv`] (or
    /// [`QueuePair::reclaim`]) hands each back with its completion.
    ///
    /// On failure, the buffers of the failing request and those after it are handed back in
    /// the [`PostError`]; if the provider does not say which request failed, none are (they may
    /// have been posted) and they stay with the queue pair. A queue pair created with a
    /// [`SharedReceiveQueue`] posts nothing: [`Error::InvalidArgument`], every buffer handed
    /// back.
    pub fn post_recv(&mut self, bufs: impl IntoIterator<Item = Buffer>) -> Result<(), PostError> {
        if self.srq.is_some() {
            return Err(PostError {
                error: Error::InvalidArgument(format!(
                    "QP {:#x} receives through a shared receive queue: post to the SRQ",
                    self.qp_num
                )),
                unposted: bufs.into_iter().collect(),
                posted: 0,
            });
        }
        let qp = self.qp.as_ptr();
        let qp_num = self.qp_num;
        post_recv_list(
            &mut self.posted.recv,
            bufs.into_iter().collect(),
            |wrs, bad| {
                // SAFETY: the QP is alive; `wrs` is the valid NULL-terminated list
                // `post_recv_list` built, whose SGEs point into buffers it moved into
                // `posted.recv` (their memory is owned by the region, so moving the handles does
                // not move the bytes), which outlives the requests.
                unsafe { ffi::ibv_post_recv(qp, wrs, bad) }
            },
            |source| Error::PostRecv { qp_num, source },
        )
    }

    /// Hands back the buffer of a receive completion of this QP (successful or flushed): the
    /// buffer of the receive request `wc` names, if this QP still holds it. Each buffer comes
    /// back once: `None` for a completion already handed back, a send completion, another
    /// QP's completion, or one not polled from a CQ (such as `WorkCompletion::default()`).
    pub fn take_recv(&mut self, wc: &WorkCompletion) -> Option<Buffer> {
        if wc.qp_num() != self.qp_num {
            return None;
        }
        self.posted.take_recv(wc.wr_id())
    }

    /// Receive requests posted and not yet handed back.
    pub fn recv_outstanding(&self) -> usize {
        self.posted.recv.len()
    }

    /// Hands back what a polled completion of this QP covers, whichever queue it belongs to:
    /// for a CQ shared by the send and receive queues, where a flushed completion's opcode is
    /// undefined and cannot tell the direction. Equivalent to [`QueuePair::take_recv`] for a
    /// receive and [`QueuePair::complete_send`] for a send; [`Reclaimed::Unknown`] for anything
    /// else (nothing is handed back twice).
    pub fn reclaim(&mut self, wc: &WorkCompletion) -> Reclaimed {
        if wc.qp_num() != self.qp_num {
            return Reclaimed::Unknown;
        }
        if let Some(buf) = self.posted.take_recv(wc.wr_id()) {
            return Reclaimed::Recv(buf);
        }
        let mut out = Vec::new();
        if self.posted.complete_send(wc.wr_id(), &mut out) {
            Reclaimed::Send(out)
        } else {
            Reclaimed::Unknown
        }
    }

    /// Posts send requests as one linked list (`ibv_post_send`). Returns the wr_id of the first
    /// (0 if `reqs` is empty); the others follow consecutively. Inline payloads longer than the
    /// granted `max_inline_data` are rejected before anything is posted.
    ///
    /// On failure, the buffers of the failing request and those after it are handed back in
    /// the [`PostError`]; if the provider does not say which request failed, none are (they may
    /// have been posted) and they stay with the queue pair until their completions, like those
    /// of the requests posted.
    pub fn post_send(&mut self, reqs: Vec<SendRequest<'_>>) -> Result<u64, PostError> {
        if reqs.is_empty() {
            return Ok(0);
        }
        if let Some(err) = self.check_send(&reqs) {
            let unposted = reqs.into_iter().filter_map(take_buffer).collect();
            return Err(PostError {
                error: err,
                unposted,
                posted: 0,
            });
        }
        let first_id = draw_wr_ids(reqs.len());
        let mut sges: Vec<ffi::ibv_sge> = reqs.iter().map(sge_of).collect();
        let mut wrs: Vec<ffi::ibv_send_wr> = reqs
            .iter()
            .zip(sges.iter_mut())
            .enumerate()
            .map(|(i, (r, sge))| send_wr(r, first_id + i as u64, sge))
            .collect();
        link(&mut wrs, |wr, next| wr.next = next);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wrs` is a valid NULL-terminated list. Buffer SGEs point into
        // buffers that are moved into `posted.send` below (their memory is owned by the region,
        // so moving the handle does not move the bytes); inline SGEs point into borrowed slices
        // that outlive this call, after which the device no longer reads them.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        let posted = match check_ret(ret) {
            Ok(()) => wrs.len(),
            Err(_) => failed_index(&wrs, bad),
        };
        let mut reqs = reqs.into_iter();
        for i in 0..posted {
            let buf = reqs.next().and_then(take_buffer);
            self.posted
                .send
                .push_back((first_id + i as u64, buf, false));
        }
        if let Err(source) = check_ret(ret) {
            return Err(PostError {
                error: Error::PostSend {
                    qp_num: self.qp_num,
                    source,
                },
                unposted: reqs.filter_map(take_buffer).collect(),
                posted,
            });
        }
        Ok(first_id)
    }

    /// Posts one send request, without the allocations of [`QueuePair::post_send`] (the
    /// common case of a connection's data path). Returns its wr_id. On failure its buffer is
    /// handed back, unless the provider does not point at the request as the failing one
    /// (then it may have been posted, and stays with the queue pair as in
    /// [`QueuePair::post_send`]).
    pub fn post_send_one(&mut self, req: SendRequest<'_>) -> Result<u64, PostError> {
        if let Some(err) = self.check_send(std::slice::from_ref(&req)) {
            return Err(PostError {
                error: err,
                unposted: take_buffer(req).into_iter().collect(),
                posted: 0,
            });
        }
        let id = draw_wr_ids(1);
        let mut sge = sge_of(&req);
        let mut wr = send_wr(&req, id, &mut sge);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` is a single request (next is NULL) whose SGE lives on
        // this stack frame for the call. A buffer SGE points into a registered region that the
        // buffer handle, moved into `posted.send` below, keeps alive; an inline SGE points into a
        // borrowed slice that outlives the call, after which the device no longer reads it.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if let Err(source) = check_ret(ret) {
            let error = Error::PostSend {
                qp_num: self.qp_num,
                source,
            };
            if failed_index(std::slice::from_ref(&wr), bad) == 0 {
                return Err(PostError {
                    error,
                    unposted: take_buffer(req).into_iter().collect(),
                    posted: 0,
                });
            }
            // The provider did not name the request: it may have been posted (fail closed).
            self.posted.send.push_back((id, take_buffer(req), false));
            return Err(PostError {
                error,
                unposted: Vec::new(),
                posted: 1,
            });
        }
        // No allocation while fewer than the granted `max_send_wr` sends are held.
        self.posted.send.push_back((id, take_buffer(req), false));
        Ok(id)
    }

    fn check_send(&self, reqs: &[SendRequest<'_>]) -> Option<Error> {
        for r in reqs {
            match &r.payload {
                SendPayload::Inline(d) if d.len() > self.caps.max_inline_data as usize => {
                    return Some(Error::InvalidArgument(format!(
                        "inline send of {} bytes exceeds max_inline_data {}",
                        d.len(),
                        self.caps.max_inline_data
                    )))
                }
                SendPayload::Buffer { buf, len } if *len > buf.len() => {
                    return Some(Error::InvalidArgument(format!(
                        "send of {len} bytes from a buffer of {}",
                        buf.len()
                    )))
                }
                _ => {}
            }
        }
        None
    }

    /// Retires the send requests a polled send completion of this QP covers and hands back
    /// their buffers: the request `wc` names, if this QP still holds it, and every request
    /// posted before it (unsignaled ones complete silently; a completion means every earlier
    /// request on the send queue is done). Anything else (a receive completion, one already
    /// handed back, another QP's, `WorkCompletion::default()`) retires nothing.
    pub fn complete_send(&mut self, wc: &WorkCompletion) -> Vec<Buffer> {
        let mut out = Vec::new();
        if wc.qp_num() == self.qp_num {
            self.posted.complete_send(wc.wr_id(), &mut out);
        }
        out
    }

    /// Send requests posted and not yet retired by a completion: the send queue slots in use.
    pub fn send_outstanding(&self) -> usize {
        self.posted.send.len()
    }

    /// [`QueuePair::complete_send`], telling sends from RDMA reads: the buffers of sends go to
    /// `sends`, those of reads ([`QueuePair::post_read`]) to `reads` with the wr_id they were
    /// posted under. Whether `wc` named a request this queue pair held.
    pub fn complete_send_split(
        &mut self,
        wc: &WorkCompletion,
        sends: &mut Vec<Buffer>,
        reads: &mut Vec<(u64, Buffer)>,
    ) -> bool {
        wc.qp_num() == self.qp_num && self.posted.complete_split(wc.wr_id(), sends, reads)
    }

    /// Posts RDMA reads (`IBV_WR_RDMA_READ`) of the peer's memory into `buf`, one work request
    /// per segment, in one list; only the last is signaled, and the buffer is held under its
    /// wr_id (returned) until a completion covering it hands it back
    /// ([`QueuePair::complete_send_split`]). `buf` must be registered with local write; each
    /// segment must lie inside it. What the peer's memory holds, or whether the key is good,
    /// is for the device to check: a bad one completes in error (and the queue pair fails).
    ///
    /// On failure part-way, reads posted before the failing one may still write into `buf`:
    /// it then stays held (under the last posted wr_id) and is not handed back.
    pub fn post_read(&mut self, buf: Buffer, segments: &[ReadSegment]) -> Result<u64, PostError> {
        let refuse = |error: String, buf: Buffer| PostError {
            error: Error::InvalidArgument(error),
            unposted: vec![buf],
            posted: 0,
        };
        if segments.is_empty() {
            return Err(refuse("a read needs at least one segment".into(), buf));
        }
        if !buf.access().local_write {
            return Err(refuse(
                "a read's buffer must be registered with local write".into(),
                buf,
            ));
        }
        if segments.len() > self.caps.max_send_wr as usize {
            return Err(refuse(
                format!(
                    "{} read segments exceed the send queue's {} requests",
                    segments.len(),
                    self.caps.max_send_wr
                ),
                buf,
            ));
        }
        if let Some(s) = segments
            .iter()
            .find(|s| s.len == 0 || s.local_offset.saturating_add(s.len as usize) > buf.len())
        {
            return Err(refuse(
                format!(
                    "read segment of {} bytes at {} in a buffer of {}",
                    s.len,
                    s.local_offset,
                    buf.len()
                ),
                buf,
            ));
        }
        let n = segments.len();
        let first_id = draw_wr_ids(n);
        let mut sges: Vec<ffi::ibv_sge> = segments
            .iter()
            .map(|s| buf.sge_at(s.local_offset, s.len as usize))
            .collect();
        let mut wrs: Vec<ffi::ibv_send_wr> = segments
            .iter()
            .zip(sges.iter_mut())
            .enumerate()
            .map(|(i, (seg, sge))| {
                // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
                let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.wr_id = first_id + i as u64;
                wr.sg_list = sge;
                wr.num_sge = 1;
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
                if i + 1 == n {
                    wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                wr.wr.rdma = ffi::rdma_t {
                    remote_addr: seg.remote_addr,
                    rkey: seg.rkey,
                };
                wr
            })
            .collect();
        link(&mut wrs, |wr, next| wr.next = next);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wrs` is a valid NULL-terminated list whose SGEs lie inside
        // `buf` (checked above), a registered region the buffer handle keeps alive; the handle
        // is moved into `posted.send` below, so no safe code reaches those bytes until a
        // completion covering the reads hands it back. The device only writes there.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        let posted = match check_ret(ret) {
            Ok(()) => n,
            Err(_) => failed_index(&wrs, bad),
        };
        let mut buf = Some(buf);
        for i in 0..posted {
            let held = if i + 1 == posted { buf.take() } else { None };
            self.posted
                .send
                .push_back((first_id + i as u64, held, true));
        }
        if let Err(source) = check_ret(ret) {
            return Err(PostError {
                error: Error::PostSend {
                    qp_num: self.qp_num,
                    source,
                },
                unposted: buf.into_iter().collect(),
                posted,
            });
        }
        Ok(first_id + n as u64 - 1)
    }
}

/// One piece of an RDMA read ([`QueuePair::post_read`]): `len` bytes of the peer's memory at
/// `remote_addr`, under its remote key `rkey`, into `local_offset..local_offset + len` of the
/// local buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadSegment {
    /// Where in the local buffer.
    pub local_offset: usize,
    /// How many bytes (at least 1).
    pub len: u32,
    /// The peer's virtual address.
    pub remote_addr: u64,
    /// The peer's remote key.
    pub rkey: u32,
}

impl QueuePair {
    /// Destroys the queue pair now (`ibv_destroy_qp`) and hands back every buffer it still
    /// held but those of RDMA reads (dropped): sends that will never complete (unsignaled ones that succeeded with nothing
    /// signaled after them) and receives never consumed. Once the queue pair is destroyed the
    /// device can no longer touch them. Completions of it still queued in a CQ name requests
    /// no longer held, so they hand back nothing. If `ibv_destroy_qp` fails, the buffers are
    /// leaked (the device may still own them), as on drop.
    pub fn destroy(mut self) -> Result<Vec<Buffer>> {
        // SAFETY: the QP is alive; `destroyed` below keeps Drop from destroying it again.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        self.destroyed = true;
        if let Err(source) = check_ret(ret) {
            self.leak_posted();
            return Err(Error::DestroyQp {
                qp_num: self.qp_num,
                source,
            });
        }
        let mut bufs = self.posted.recv.drain_all();
        // The buffers of reads are dropped (the device is done with them): they are not send
        // buffers, and a caller pooling those would take them for some.
        bufs.extend(
            self.posted
                .send
                .drain(..)
                .filter_map(|(_, b, read)| b.filter(|_| !read)),
        );
        Ok(bufs)
    }

    /// After a failed `ibv_destroy_qp`: the device may still own the posted buffers; leak them
    /// rather than free memory it could write to, and keep the SRQ (the QP may still consume
    /// its requests).
    fn leak_posted(&mut self) {
        std::mem::forget(std::mem::replace(
            &mut self.posted.recv,
            InOrder::with_capacity(0),
        ));
        std::mem::forget(std::mem::take(&mut self.posted.send));
        std::mem::forget(self.srq.take());
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        if self.destroyed {
            return;
        }
        // SAFETY: the QP is alive and destroyed exactly once. Its CQs and PD are still held.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            self.leak_posted();
        }
    }
}

/// Posts `bufs` as one linked list of receive requests with fresh wr_ids through `post` (which
/// calls `ibv_post_recv` or `ibv_post_srq_recv` with the list and the `bad_wr` out-pointer),
/// holding each buffer in `held` first. On failure, the buffers of the failing request and those
/// after it are handed back with `error` of the OS error; if the provider names no request as
/// the failing one, all stay held (fail closed).
pub(crate) fn post_recv_list(
    held: &mut InOrder<Buffer>,
    bufs: Vec<Buffer>,
    post: impl FnOnce(*mut ffi::ibv_recv_wr, &mut *mut ffi::ibv_recv_wr) -> libc::c_int,
    error: impl FnOnce(std::io::Error) -> Error,
) -> Result<(), PostError> {
    if bufs.is_empty() {
        return Ok(());
    }
    let first_id = draw_wr_ids(bufs.len());
    let mut sges: Vec<ffi::ibv_sge> = bufs.iter().map(|b| b.sge(b.len())).collect();
    let mut wrs: Vec<ffi::ibv_recv_wr> = sges
        .iter_mut()
        .enumerate()
        .map(|(i, sge)| ffi::ibv_recv_wr {
            wr_id: first_id + i as u64,
            next: std::ptr::null_mut(),
            sg_list: sge,
            num_sge: 1,
        })
        .collect();
    let n = bufs.len();
    for (i, b) in bufs.into_iter().enumerate() {
        held.push(first_id + i as u64, b);
    }
    link(&mut wrs, |wr, next| wr.next = next);
    let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
    let ret = post(wrs.as_mut_ptr(), &mut bad);
    if let Err(source) = check_ret(ret) {
        let posted = failed_index(&wrs, bad);
        let unposted = (posted..n)
            .filter_map(|i| held.take(first_id + i as u64))
            .collect();
        return Err(PostError {
            error: error(source),
            unposted,
            posted,
        });
    }
    Ok(())
}

/// The scatter/gather entry of a request's payload.
fn sge_of(r: &SendRequest<'_>) -> ffi::ibv_sge {
    match &r.payload {
        SendPayload::Buffer { buf, len } => buf.sge(*len),
        SendPayload::Inline(data) => ffi::ibv_sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        },
        SendPayload::Empty => ffi::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        },
    }
}

/// The work request for `r` with id `id`, its list pointing at `sge`, unlinked.
fn send_wr(r: &SendRequest<'_>, id: u64, sge: &mut ffi::ibv_sge) -> ffi::ibv_send_wr {
    use ffi::ibv_send_flags as f;
    let mut flags = 0;
    if r.signaled {
        flags |= f::IBV_SEND_SIGNALED.0;
    }
    if r.solicited {
        flags |= f::IBV_SEND_SOLICITED.0;
    }
    if matches!(r.payload, SendPayload::Inline(_)) {
        flags |= f::IBV_SEND_INLINE.0;
    }
    let empty = matches!(r.payload, SendPayload::Empty);
    // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
    let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = id;
    wr.sg_list = if empty { std::ptr::null_mut() } else { sge };
    wr.num_sge = i32::from(!empty);
    wr.send_flags = flags;
    match r.imm {
        Some(imm) => {
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        None => wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND,
    }
    wr
}

fn take_buffer(r: SendRequest<'_>) -> Option<Buffer> {
    match r.payload {
        SendPayload::Buffer { buf, .. } => Some(buf),
        _ => None,
    }
}

/// Links a vector of work requests into a NULL-terminated list. Works through the raw pointer
/// only (`Vec::as_mut_ptr` creates no reference), so the links stay valid for the post call.
fn link<T>(wrs: &mut Vec<T>, set_next: impl Fn(&mut T, *mut T)) {
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
}

/// Index of the request `bad` points at (the first not posted), which is how many were posted.
/// If `bad` points at none of them (NULL, outside the list or into the middle of a request: a
/// provider breaking the libibverbs contract), `wrs.len()`: all of them count as posted, so
/// that no buffer the device may access is handed back (fail closed).
fn failed_index<T>(wrs: &[T], bad: *mut T) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Node {
        next: *mut Node,
    }

    #[test]
    fn link_builds_a_null_terminated_list() {
        let mut v: Vec<Node> = (0..3)
            .map(|_| Node {
                next: std::ptr::null_mut(),
            })
            .collect();
        link(&mut v, |n, next| n.next = next);
        let base = v.as_ptr();
        assert_eq!(v[0].next as *const Node, base.wrapping_add(1));
        assert_eq!(v[1].next as *const Node, base.wrapping_add(2));
        assert!(v[2].next.is_null());
    }

    #[test]
    fn failed_index_locates_the_bad_request() {
        let mut v = vec![0u64; 4];
        let base = v.as_mut_ptr();
        assert_eq!(failed_index(&v, base.wrapping_add(2)), 2);
        assert_eq!(failed_index(&v, base), 0);
        assert_eq!(failed_index(&v, base.wrapping_add(3)), 3);
        // Pointers at no request fail closed: every request counts as posted, so that no buffer
        // the device may access is handed back.
        assert_eq!(failed_index(&v, std::ptr::null_mut()), 4);
        assert_eq!(failed_index(&v, base.wrapping_add(4)), 4);
        assert_eq!(failed_index(&v, base.wrapping_sub(1)), 4);
        assert_eq!(
            failed_index(&v, base.cast::<u8>().wrapping_add(3).cast()),
            4
        );
        assert_eq!(failed_index(&v, usize::MAX as *mut u64), 4);
        assert_eq!(failed_index(&v[..0], base), 0);
    }

    #[test]
    fn wr_ids_are_never_zero_and_never_drawn_twice() {
        let a = draw_wr_ids(3);
        let b = draw_wr_ids(1);
        let c = draw_wr_ids(2);
        assert!(a >= 1);
        assert!(b >= a + 3 && c > b, "{a} {b} {c}");
        // From other threads too.
        let mut ids: Vec<u64> = (0..4)
            .map(|_| std::thread::spawn(|| (0..1000).map(|_| draw_wr_ids(1)).collect::<Vec<_>>()))
            .flat_map(|t| t.join().unwrap())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 4000);
    }

    fn posted(recv: &[u64], send: &[(u64, Option<&'static str>)]) -> Posted<&'static str> {
        let mut p = Posted::with_capacity(4, 4);
        for &id in recv {
            p.recv.push(id, "recv");
        }
        p.send.extend(send.iter().map(|&(id, b)| (id, b, false)));
        p
    }

    #[test]
    fn a_completion_tells_read_buffers_from_send_buffers() {
        let mut p = posted(&[], &[(1, Some("send")), (2, None)]);
        p.send.push_back((3, None, true));
        p.send.push_back((4, Some("read"), true));
        p.send.push_back((5, Some("later"), false));
        let (mut sends, mut reads) = (Vec::new(), Vec::new());
        assert!(!p.complete_split(9, &mut sends, &mut reads), "not held");
        assert!(p.complete_split(4, &mut sends, &mut reads));
        assert_eq!((sends, reads), (vec!["send"], vec![(4, "read")]));
        assert_eq!(p.send.len(), 1, "the later send stays");
    }

    #[test]
    fn a_receive_buffer_comes_back_once() {
        let mut p = posted(&[5, 6], &[]);
        assert_eq!(p.take_recv(5), Some("recv"));
        assert_eq!(p.take_recv(5), None, "a replayed completion gets nothing");
        assert_eq!(p.take_recv(0), None, "a default completion gets nothing");
        assert_eq!(p.recv.len(), 1);
    }

    #[test]
    fn a_send_completion_retires_only_an_exact_posted_send_and_those_before_it() {
        let mut p = posted(
            &[],
            &[(3, Some("a")), (7, None), (9, Some("b")), (12, Some("c"))],
        );
        let mut out = Vec::new();
        for absent in [0, 1, 8, 10, 13, u64::MAX] {
            assert!(!p.complete_send(absent, &mut out), "{absent}");
        }
        assert_eq!((out.len(), p.send.len()), (0, 4), "nothing retired");
        assert!(p.complete_send(7, &mut out));
        assert_eq!(out, ["a"], "7 and the request before it");
        assert!(!p.complete_send(3, &mut out), "already retired");
        assert!(!p.complete_send(7, &mut out), "a replay retires nothing");
        assert!(p.complete_send(12, &mut out));
        assert_eq!(out, ["a", "b", "c"]);
        assert!(p.send.is_empty());
    }

    #[test]
    fn receive_ids_never_retire_sends_and_send_ids_never_yield_receives() {
        // Ids are drawn from one counter, so a receive id lies between send ids.
        let mut p = posted(
            &[4, 8],
            &[(2, Some("s2")), (6, Some("s6")), (10, Some("s10"))],
        );
        let mut out = Vec::new();
        assert!(!p.complete_send(4, &mut out));
        assert!(!p.complete_send(8, &mut out));
        assert_eq!(p.send.len(), 3);
        assert_eq!(p.take_recv(6), None);
        assert_eq!(p.take_recv(2), None);
        assert_eq!(p.recv.len(), 2);
    }

    #[test]
    fn receives_come_back_in_any_order_from_many_sequential_and_scattered_ids() {
        let mut p: Posted<u64> = Posted::with_capacity(0, 0);
        let ids: Vec<u64> = (1..5000u64)
            .chain((13..64).map(|i| 1u64 << i))
            .chain([u64::MAX - 1, u64::MAX])
            .collect();
        for &id in &ids {
            p.recv.push(id, id);
        }
        // In order (the usual case), then out of order, then the rest in reverse.
        for &id in &ids[..100] {
            assert_eq!(p.take_recv(id), Some(id));
        }
        for &id in ids[100..].iter().step_by(3) {
            assert_eq!(p.take_recv(id), Some(id));
            assert_eq!(p.take_recv(id), None, "once");
        }
        for &id in ids[100..].iter().rev() {
            let _ = p.take_recv(id);
        }
        assert_eq!(p.recv.len(), 0);
        assert!(
            p.recv.queue.is_empty(),
            "handed-back entries do not pile up"
        );
    }

    #[test]
    fn shared_receives_come_back_once_in_any_order_whatever_else_was_drawn_between() {
        // An SRQ's requests are consumed by several QPs, so their completions arrive in any
        // order; other queues draw ids in between.
        let mut srq: InOrder<u64> = InOrder::with_capacity(0);
        let mut ids = Vec::new();
        for _ in 0..6 {
            let id = draw_wr_ids(1);
            srq.push(id, id);
            ids.push(id);
            let _other_queue = draw_wr_ids(2);
        }
        for &i in &[3, 0, 5, 1, 4, 2] {
            assert_eq!(srq.take(ids[i]), Some(ids[i]));
            assert_eq!(srq.take(ids[i]), None, "once");
            assert_eq!(srq.take(ids[i] + 1), None, "another queue's id");
        }
        assert_eq!(srq.take(0), None, "a default completion");
        assert_eq!(srq.len(), 0);
        assert!(srq.queue.is_empty());
    }

    #[test]
    fn a_post_error_prints_the_verb_why_and_what_was_posted() {
        let os = std::io::Error::from_raw_os_error(libc::ENOMEM);
        let e = PostError {
            error: Error::PostSend {
                qp_num: 0x11,
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            },
            unposted: Vec::new(),
            posted: 2,
        };
        let first =
            "ibv_post_send on QP 0x11 failed (ENOMEM); 2 work requests posted before it, 0 buffers handed back";
        assert_eq!(e.to_string(), first);
        // The chain as anyhow's `{:#}` prints it names the OS error once.
        let source = std::error::Error::source(&e).unwrap();
        assert_eq!(source.to_string(), os.to_string());
        assert!(source.source().is_none());
    }

    #[test]
    fn attribute_defaults_are_the_documented_ones() {
        let remote = RemoteAddress {
            lid: 0,
            gid: None,
            sgid_index: 0,
            sl: 0,
            port: 1,
        };
        let rtr = RtrAttr::new(7, 1, Mtu::Mtu1024, remote);
        assert_eq!((rtr.min_rnr_timer, rtr.max_dest_rd_atomic), (12, 1));
        let rts = RtsAttr::new(1);
        assert_eq!((rts.timeout, rts.retry_cnt, rts.rnr_retry), (14, 7, 7));
        let req = SendRequest::empty().solicited(true).signaled(false).imm(3);
        assert!(req.solicited && !req.signaled && req.imm == Some(3));
    }
}
