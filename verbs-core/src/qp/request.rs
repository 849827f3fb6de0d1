//! Work requests: what a send carries, one piece of an RDMA read, and how both become the
//! `ibv_send_wr` and scatter/gather entries the provider reads.

use crate::ffi;
use crate::mr::Buffer;

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

/// One piece of an RDMA read ([`QueuePair::post_read`](super::QueuePair::post_read)): `len` bytes of the peer's memory at
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

/// The scatter/gather entry of a request's payload.
pub(super) fn sge_of(r: &SendRequest<'_>) -> ffi::ibv_sge {
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
pub(super) fn send_wr(r: &SendRequest<'_>, id: u64, sge: &mut ffi::ibv_sge) -> ffi::ibv_send_wr {
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

pub(super) fn take_buffer(r: SendRequest<'_>) -> Option<Buffer> {
    match r.payload {
        SendPayload::Buffer { buf, .. } => Some(buf),
        _ => None,
    }
}
