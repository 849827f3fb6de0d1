//! Reliable-connected queue pairs: creation, state transitions, posting.
//!
//! Posting rules live in the types: posting a [`Buffer`] moves it into the queue pair, which hands
//! it back only for a polled completion that covers it ([`QueuePair::take_recv`],
//! [`QueuePair::complete_send`]). A buffer the device may still access is thus never reachable.

use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use slab::Slab;

use crate::cq::{CompletionQueue, CqInner, WorkCompletion};
use crate::device::{Gid, Mtu};
use crate::error::{check_ret, non_null, Error, Result};
use crate::ffi;
use crate::mr::Buffer;
use crate::pd::{PdInner, ProtectionDomain};

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
#[derive(Debug, thiserror::Error)]
#[error("work requests not posted ({} buffers handed back)", unposted.len())]
pub struct PostError {
    /// Why.
    #[source]
    pub error: Error,
    /// Buffers of the requests that were not posted.
    pub unposted: Vec<Buffer>,
    /// How many requests were posted before the failure.
    pub posted: usize,
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Self {
        e.error
    }
}

/// A reliable-connected queue pair. Holds its PD and both CQs alive (destroying an attached CQ
/// would fail with `EBUSY`).
pub struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    qp_num: u32,
    state: QpState,
    caps: QpCaps,
    port: u8,
    posted_recv: Slab<Buffer>,
    /// Send requests in posting order: (wr_id, buffer). Completions on one send queue arrive in
    /// order, so a completion for wr_id N retires every entry up to N.
    posted_send: VecDeque<(u64, Option<Buffer>)>,
    next_send_id: u64,
    _pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
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
            .field("posted_recv", &self.posted_recv.len())
            .field("posted_send", &self.posted_send.len())
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
        // SAFETY: ibv_qp_init_attr is plain old data; all-zero is valid (no SRQ, no context).
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_raw();
        init.recv_cq = recv_cq.as_raw();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap = ffi::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: PD and CQs are alive and kept so by the Arcs stored below; `init` is valid.
        let qp = non_null(unsafe { ffi::ibv_create_qp(pd.as_raw(), &mut init) })
            .map_err(Error::CreateQp)?;
        // SAFETY: just created; qp_num is immutable.
        let qp_num = unsafe { (*qp.as_ptr()).qp_num };
        Ok(Self {
            qp,
            qp_num,
            state: QpState::Reset,
            // ibv_create_qp writes the granted sizes back into init.cap.
            caps: QpCaps {
                max_send_wr: init.cap.max_send_wr,
                max_recv_wr: init.cap.max_recv_wr,
                max_inline_data: init.cap.max_inline_data,
            },
            port: 1,
            posted_recv: Slab::new(),
            posted_send: VecDeque::new(),
            next_send_id: 0,
            _pd: pd.inner.clone(),
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
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
        attr.qp_access_flags = 0;
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

    /// Posts receive buffers as one linked list of work requests (`ibv_post_recv`). The queue
    /// pair owns them until [`QueuePair::take_recv`] hands each back with its completion.
    pub fn post_recv(&mut self, bufs: impl IntoIterator<Item = Buffer>) -> Result<(), PostError> {
        let bufs: Vec<Buffer> = bufs.into_iter().collect();
        if bufs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ffi::ibv_sge> = bufs.iter().map(|b| b.sge(b.len())).collect();
        let keys: Vec<usize> = {
            let mut keys = Vec::with_capacity(bufs.len());
            for b in bufs {
                keys.push(self.posted_recv.insert(b));
            }
            keys
        };
        let mut wrs: Vec<ffi::ibv_recv_wr> = keys
            .iter()
            .zip(sges.iter_mut())
            .map(|(&key, sge)| ffi::ibv_recv_wr {
                wr_id: key as u64,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: 1,
            })
            .collect();
        link(&mut wrs, |wr, next| wr.next = next);
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wrs` is a valid NULL-terminated list whose SGEs point into
        // buffers now owned by `posted_recv`, which outlives the requests.
        let ret = unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if let Err(source) = check_ret(ret) {
            let posted = failed_index(&wrs, bad);
            let unposted = keys[posted..]
                .iter()
                .filter_map(|&k| self.posted_recv.try_remove(k))
                .collect();
            return Err(PostError {
                error: Error::PostRecv {
                    qp_num: self.qp_num,
                    source,
                },
                unposted,
                posted,
            });
        }
        Ok(())
    }

    /// Hands back the buffer of a receive completion of this QP (successful or flushed). `None`
    /// if the completion is not a receive of this QP.
    pub fn take_recv(&mut self, wc: &WorkCompletion) -> Option<Buffer> {
        if wc.qp_num() != self.qp_num {
            return None;
        }
        usize::try_from(wc.wr_id())
            .ok()
            .and_then(|k| self.posted_recv.try_remove(k))
    }

    /// Receive requests posted and not yet handed back.
    pub fn recv_outstanding(&self) -> usize {
        self.posted_recv.len()
    }

    /// Posts send requests as one linked list (`ibv_post_send`). Returns the wr_id of the first;
    /// the others follow consecutively. Inline payloads longer than the granted
    /// `max_inline_data` are rejected before anything is posted.
    pub fn post_send(&mut self, reqs: Vec<SendRequest<'_>>) -> Result<u64, PostError> {
        let first_id = self.next_send_id;
        if reqs.is_empty() {
            return Ok(first_id);
        }
        if let Some(err) = self.check_send(&reqs) {
            let unposted = reqs.into_iter().filter_map(take_buffer).collect();
            return Err(PostError {
                error: err,
                unposted,
                posted: 0,
            });
        }
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
        // buffers that are moved into `posted_send` below (their memory is owned by the region,
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
            self.posted_send.push_back((first_id + i as u64, buf));
        }
        self.next_send_id = first_id + posted as u64;
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
    /// common case of a connection's data path). Returns its wr_id.
    pub fn post_send_one(&mut self, req: SendRequest<'_>) -> Result<u64, PostError> {
        let id = self.next_send_id;
        if let Some(err) = self.check_send(std::slice::from_ref(&req)) {
            return Err(PostError {
                error: err,
                unposted: take_buffer(req).into_iter().collect(),
                posted: 0,
            });
        }
        let mut sge = sge_of(&req);
        let mut wr = send_wr(&req, id, &mut sge);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` is a single request (next is NULL) whose SGE lives on
        // this stack frame for the call. A buffer SGE points into a registered region that the
        // buffer handle, moved into `posted_send` below, keeps alive; an inline SGE points into a
        // borrowed slice that outlives the call, after which the device no longer reads it.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if let Err(source) = check_ret(ret) {
            return Err(PostError {
                error: Error::PostSend {
                    qp_num: self.qp_num,
                    source,
                },
                unposted: take_buffer(req).into_iter().collect(),
                posted: 0,
            });
        }
        self.posted_send.push_back((id, take_buffer(req)));
        self.next_send_id = id + 1;
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

    /// Retires the send requests a polled send completion of this QP covers (it and every
    /// unsignaled request before it) and hands back their buffers.
    pub fn complete_send(&mut self, wc: &WorkCompletion) -> Vec<Buffer> {
        let mut out = Vec::new();
        if wc.qp_num() != self.qp_num {
            return out;
        }
        while let Some(&(id, _)) = self.posted_send.front() {
            if id > wc.wr_id() {
                break;
            }
            if let Some((_, Some(buf))) = self.posted_send.pop_front() {
                out.push(buf);
            }
        }
        out
    }

    /// Send requests posted and not yet retired by a completion: the send queue slots in use.
    pub fn send_outstanding(&self) -> usize {
        self.posted_send.len()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP is alive and destroyed exactly once. Its CQs and PD are still held.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            // The device may still own the posted buffers: leak them rather than free memory
            // it could write to.
            std::mem::forget(std::mem::take(&mut self.posted_recv));
            std::mem::forget(std::mem::take(&mut self.posted_send));
        }
    }
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

/// Index of the request `bad` points at (the first not posted); all of them if unknown.
fn failed_index<T>(wrs: &[T], bad: *mut T) -> usize {
    let base = wrs.as_ptr() as usize;
    let addr = bad as usize;
    let size = std::mem::size_of::<T>();
    if addr >= base && addr < base + std::mem::size_of_val(wrs) {
        (addr - base) / size
    } else {
        0
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
        // Unknown pointers count as "nothing posted".
        assert_eq!(failed_index(&v, std::ptr::null_mut()), 0);
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
