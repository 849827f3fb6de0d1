//! Queue pair attributes: sizes, states, and what the RTR and RTS transitions set.

use crate::device::{Gid, Mtu};
use crate::ffi;

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
    pub(super) fn to_raw(self) -> ffi::ibv_qp_state::Type {
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

    pub(super) fn from_raw(v: ffi::ibv_qp_state::Type) -> Self {
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
