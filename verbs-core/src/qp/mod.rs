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
mod attr;
mod books;
mod request;

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

pub use attr::{QpCaps, QpState, RemoteAddress, RtrAttr, RtsAttr};
use books::Posted;
pub use books::Reclaimed;
use request::{send_wr, sge_of, take_buffer};
pub use request::{ReadSegment, SendPayload, SendRequest};

use crate::cq::{CompletionQueue, CqInner, WorkCompletion};
use crate::error::{check_ret, non_null, Error, Result};
use crate::ffi;
use crate::mr::Buffer;
use crate::pd::{PdInner, ProtectionDomain};
pub use crate::posted::PostError;
use crate::posted::{draw_wr_ids, failed_index, link, post_recv_list, InOrder, INLINE_WRS};
use crate::srq::{SharedReceiveQueue, SrqInner};
use smallvec::SmallVec;

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
    /// Memory windows bound through this queue pair ([`QueuePair::bind`]): those still
    /// allocated are deallocated before it is destroyed.
    windows: Vec<std::sync::Weak<crate::mr::Window>>,
    /// The windows of binds still pending, under their wr_ids in posting order: held until a
    /// completion retires the bind (or the queue pair goes), whatever becomes of their
    /// exposures meanwhile.
    binding: std::collections::VecDeque<(u64, Arc<crate::mr::Window>)>,
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
            windows: Vec::new(),
            binding: std::collections::VecDeque::new(),
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

    /// Whether the queue pair receives through a shared receive queue.
    pub(crate) fn has_srq(&self) -> bool {
        self.srq.is_some()
    }

    /// A state change with the attributes the connection manager computed for it
    /// ([`crate::CmId::init_qp`], [`crate::CmId::ready_qp`]).
    pub(crate) fn modify_from_cm(
        &mut self,
        attr: &mut ffi::ibv_qp_attr,
        mask: u32,
        to: QpState,
    ) -> Result<()> {
        let port = attr.port_num;
        self.modify(attr, mask, to)?;
        if to == QpState::Init {
            self.port = port;
        }
        Ok(())
    }

    fn zeroed_attr() -> ffi::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain old data; all-zero is valid.
        unsafe { std::mem::zeroed() }
    }

    /// RESET → INIT on `port`, with remote read as the only remote access right (send and
    /// receive need none; the peer's RDMA reads of what this process exposed need it).
    pub fn to_init(&mut self, port: u8) -> Result<()> {
        // Peers may read what this process exposed (rendezvous): only regions registered with
        // remote read themselves (`ProtectionDomain::expose`, or `Access::remote_read`) can be
        // read, each under its own key. Remote write and atomics stay off.
        self.init_with(port, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0)
    }

    /// RESET → INIT on `port` with no remote access right at all: for a queue pair whose peer
    /// has not proved who it is yet. A region exposed in the protection domain is readable
    /// under its key through any queue pair of the domain that allows remote read, so a
    /// stranger's must not; [`QueuePair::allow_remote_read`] grants it once the peer is known.
    pub fn to_init_closed(&mut self, port: u8) -> Result<()> {
        self.init_with(port, 0)
    }

    /// Grants remote read (of regions registered for it, each under its own key) to a queue
    /// pair in RTS, RTS → RTS: for one made with [`QueuePair::to_init_closed`] whose peer has
    /// proved who it is.
    pub fn allow_remote_read(&mut self) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        if self.state != QpState::Rts {
            return Err(Error::InvalidArgument(format!(
                "remote read is granted in RTS, not {:?}",
                self.state
            )));
        }
        let mut attr = Self::zeroed_attr();
        attr.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        self.modify(&mut attr, m::IBV_QP_ACCESS_FLAGS.0, QpState::Rts)
    }

    fn init_with(&mut self, port: u8, access: u32) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = Self::zeroed_attr();
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = access;
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

    /// Posts receive buffers as linked lists of up to 8 work requests (`ibv_post_recv`), built
    /// on the stack (no allocation), with fresh wr_ids. The queue pair owns them until
    /// [`QueuePair::take_recv`] (or [`QueuePair::reclaim`]) hands each back with its
    /// completion.
    ///
    /// On failure, the buffers of the failing request and those after it are handed back in
    /// the [`PostError`]; if the provider does not say which request failed, those of the
    /// failing list stay with the queue pair (they may have been posted) and only those of
    /// later lists are handed back. A queue pair created with a
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
            bufs,
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
            self.release_binds();
            Reclaimed::Send(out)
        } else {
            Reclaimed::Unknown
        }
    }

    /// Lets go of the windows whose binds are retired: every request posted before the oldest
    /// one still held (ids grow with posting order).
    fn release_binds(&mut self) {
        let oldest = self.posted.send.front().map(|&(id, _, _)| id);
        while self
            .binding
            .front()
            .is_some_and(|&(id, _)| oldest.map_or(true, |o| id < o))
        {
            self.binding.pop_front();
        }
    }

    /// Posts send requests as one linked list (`ibv_post_send`). Returns the wr_id of the first
    /// (0 if `reqs` is empty); the others follow consecutively. Inline payloads longer than the
    /// granted `max_inline_data` are rejected before anything is posted. Up to 8 requests (an
    /// array of them, say) are posted without a heap allocation.
    ///
    /// On failure, the buffers of the failing request and those after it are handed back in
    /// the [`PostError`]; if the provider does not say which request failed, none are (they may
    /// have been posted) and they stay with the queue pair until their completions, like those
    /// of the requests posted.
    pub fn post_send<'a>(
        &mut self,
        reqs: impl IntoIterator<Item = SendRequest<'a>>,
    ) -> Result<u64, PostError> {
        let reqs: SmallVec<[SendRequest<'a>; INLINE_WRS]> = reqs.into_iter().collect();
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
        let mut sges: SmallVec<[ffi::ibv_sge; INLINE_WRS]> = reqs.iter().map(sge_of).collect();
        let mut wrs: SmallVec<[ffi::ibv_send_wr; INLINE_WRS]> = reqs
            .iter()
            .zip(sges.iter_mut())
            .enumerate()
            .map(|(i, (r, sge))| send_wr(r, first_id + i as u64, sge))
            .collect();
        let head = link(&mut wrs, |wr, next| wr.next = next);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `head` is a valid NULL-terminated list. Buffer SGEs point into
        // buffers that are moved into `posted.send` below (their memory is owned by the region,
        // so moving the handle does not move the bytes); inline SGEs point into borrowed slices
        // that outlive this call, after which the device no longer reads them.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), head, &mut bad) };
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

    /// Binds the memory window of `exposed` (made by [`ProtectionDomain::window_over`] in
    /// this queue pair's protection domain) over its bytes, for remote reads through this queue
    /// pair alone, with a signaled `IBV_WR_BIND_MW` request (the queue pair must be in RTS).
    /// The window's key ([`Exposed::rkey`]) is then valid on this queue pair only: a peer on
    /// another queue pair of the same protection domain that uses it gets a remote access
    /// error. Requests posted after the bind execute after it, so a descriptor sent next names
    /// a key already valid. The bind takes a send queue slot until its completion; returns its
    /// wr_id. `exposed` may be dropped at any time: the queue pair holds the window, and with
    /// it the memory, until a completion retires the bind or the queue pair goes
    /// (deallocating a window under a pending bind would fail the queue pair).
    ///
    /// [`Exposed::rkey`]: crate::Exposed::rkey
    pub fn bind(&mut self, exposed: &mut crate::Exposed) -> Result<u64> {
        let Some((window, mw)) = exposed.window() else {
            return Err(Error::InvalidArgument(
                "an exposure without a memory window cannot be bound".into(),
            ));
        };
        let window_arc = Arc::clone(window);
        let window = Arc::downgrade(window);
        if !Arc::ptr_eq(exposed.pd(), &self._pd) {
            return Err(Error::InvalidArgument(
                "the window belongs to another protection domain".into(),
            ));
        }
        // SAFETY: the window is alive (owned by `exposed`); its key is read before the bind
        // below changes it.
        let rkey = unsafe { ffi::ibv_inc_rkey((*mw.as_ptr()).rkey) };
        let id = draw_wr_ids(1);
        // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = id;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
            mw: mw.as_ptr(),
            rkey,
            bind_info: ffi::ibv_mw_bind_info {
                mr: exposed.raw_mr(),
                addr: exposed.addr(),
                length: exposed.len() as u64,
                mw_access_flags: ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            },
        };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` is a single request (next is NULL) without a list; the
        // window and the region it names are owned by `exposed`, which the caller keeps until
        // the request completes (its Drop deallocates the window before the region).
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if let Err(source) = check_ret(ret) {
            if bad.is_null() {
                // The provider did not name the request: it may have been posted (fail
                // closed: it counts as outstanding, and its window is held).
                self.posted.send.push_back((id, None, false));
                self.binding.push_back((id, window_arc));
            }
            return Err(Error::PostSend {
                qp_num: self.qp_num,
                source,
            });
        }
        self.posted.send.push_back((id, None, false));
        self.binding.push_back((id, window_arc));
        exposed.rkey = rkey;
        // Forget the windows already gone, now and then (at each power of two from 64: the
        // list stays within about twice the windows alive, at amortized constant cost).
        if self.windows.len() >= 64 && self.windows.len().is_power_of_two() {
            self.windows.retain(|w| w.strong_count() > 0);
        }
        self.windows.push(window);
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
        self.complete_send_into(wc, &mut out);
        out
    }

    /// [`QueuePair::complete_send`] into `out`, which a data path keeps from one completion
    /// to the next (no allocation once it has room). Whether `wc` named a request this queue
    /// pair held.
    pub fn complete_send_into(&mut self, wc: &WorkCompletion, out: &mut Vec<Buffer>) -> bool {
        let retired = wc.qp_num() == self.qp_num && self.posted.complete_send(wc.wr_id(), out);
        if retired && !self.binding.is_empty() {
            self.release_binds();
        }
        retired
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
        let retired =
            wc.qp_num() == self.qp_num && self.posted.complete_split(wc.wr_id(), sends, reads);
        if retired && !self.binding.is_empty() {
            self.release_binds();
        }
        retired
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
        let mut sges: SmallVec<[ffi::ibv_sge; INLINE_WRS]> = segments
            .iter()
            .map(|s| buf.sge_at(s.local_offset, s.len as usize))
            .collect();
        let mut wrs: SmallVec<[ffi::ibv_send_wr; INLINE_WRS]> = segments
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
        let head = link(&mut wrs, |wr, next| wr.next = next);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `head` is a valid NULL-terminated list whose SGEs lie inside
        // `buf` (checked above), a registered region the buffer handle keeps alive; the handle
        // is moved into `posted.send` below, so no safe code reaches those bytes until a
        // completion covering the reads hands it back. The device only writes there.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), head, &mut bad) };
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

    /// Posts a liveness probe: a signaled zero-length RDMA read (no local or remote memory, so
    /// no key: a zero-length read names none, C9-88 of the InfiniBand specification). The
    /// peer's device answers it without its process or a receive buffer; a peer whose host is
    /// gone leaves it unanswered, and it completes with `RetryExcErr` once the queue pair's
    /// `timeout` and `retry_cnt` are spent. The queue pair must allow remote reads (every
    /// queue pair made here does) and be in RTS. Takes a send queue slot until its completion
    /// (retired by [`QueuePair::complete_send_split`] like any request); returns its wr_id.
    pub fn post_probe(&mut self) -> Result<u64> {
        self.post_zero_length_read()
    }

    /// Posts a drain marker on a queue pair moved to the error state: a signaled zero-length
    /// request that the device flushes back after every request posted before it (the
    /// kernel's `ib_drain_sq` does the same). Its completion retires them all
    /// ([`QueuePair::complete_send_split`]), unsignaled sends that had already completed
    /// included: those leave no completion of their own, so without a later one they would
    /// count as outstanding for ever. Takes a send queue slot until its completion; returns
    /// its wr_id. A provider that refuses a post in the error state says so here: then only
    /// a deadline ends the wait for the rest.
    pub fn post_drain_marker(&mut self) -> Result<u64> {
        self.post_zero_length_read()
    }

    /// A signaled zero-length RDMA read (see [`QueuePair::post_probe`]).
    fn post_zero_length_read(&mut self) -> Result<u64> {
        let id = draw_wr_ids(1);
        // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = id;
        wr.num_sge = 0;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` is a single request (next is NULL) without scatter
        // entries: the device writes nothing locally and reads zero bytes remotely.
        let ret = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if let Err(source) = check_ret(ret) {
            if !bad.is_null() {
                return Err(Error::PostSend {
                    qp_num: self.qp_num,
                    source,
                });
            }
            // The provider did not name the request: it may have been posted.
            self.posted.send.push_back((id, None, true));
            return Err(Error::PostSend {
                qp_num: self.qp_num,
                source,
            });
        }
        self.posted.send.push_back((id, None, true));
        Ok(id)
    }
}

impl QueuePair {
    /// Destroys the queue pair now (`ibv_destroy_qp`) and hands back every buffer it still
    /// held but those of RDMA reads (dropped): sends that will never complete (unsignaled ones that succeeded with nothing
    /// signaled after them) and receives never consumed. Once the queue pair is destroyed the
    /// device can no longer touch them. Completions of it still queued in a CQ name requests
    /// no longer held, so they hand back nothing. If `ibv_destroy_qp` fails, the buffers are
    /// leaked (the device may still own them), as on drop.
    pub fn destroy(mut self) -> Result<Vec<Buffer>> {
        self.revoke_windows();
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

    /// Deallocates the memory windows still bound through this queue pair, before it goes:
    /// their keys read nothing from now on (the exposures keep their memory until dropped).
    fn revoke_windows(&mut self) {
        for w in self.windows.drain(..) {
            if let Some(w) = w.upgrade() {
                w.revoke();
            }
        }
        // No bind is pending once the queue pair is gone: the windows (and the regions of
        // exposures dropped meanwhile) go with their last holder.
        self.binding.clear();
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
        self.revoke_windows();
        // SAFETY: the QP is alive and destroyed exactly once. Its CQs and PD are still held.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            self.leak_posted();
        }
    }
}

#[cfg(test)]
mod tests;
