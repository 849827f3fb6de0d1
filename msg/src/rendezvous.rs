//! Large messages by RDMA read: the frames of the rendezvous protocol and its books, without
//! I/O (the `peer` module drives them over a connection or a hub's peer).
//!
//! The sender encodes a message once, [`Bulk`](crate::Bulk) payloads left where they are,
//! exposes each piece to remote reads under a key of its own, and sends a small solicited
//! descriptor (`RNDV` frame): the message's tag and sequence number in the header, its length
//! and where its pieces are in the body. Pieces small enough travel inside the descriptor.
//! The receiver takes a registered buffer of its own (bounded by its
//! [`max_rendezvous_bytes`](crate::SessionConfig::max_rendezvous_bytes), whatever the peer
//! asks), reads the pieces into it, delivers the message in its sequence order, and tells the
//! sender it is done (`DONE` frame, solicited: a sender short of room waits for it). Only then
//! does the sender end the exposure (the keys read nothing from then on) and free the bytes.
//!
//! ```text
//! descriptor body: total u32 | count u16 | 0u16 | count × piece
//! piece:           0u8 | len u32 | len bytes                (inline)
//!                  1u8 | len u32 | addr u64 | rkey u32      (remote)
//! done body:       seq u32 × n   (n >= 1)
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdmsg_transport::{Buffer, Exposed};

use crate::frame::{self, FrameError, DONE, FIRST, HEADER_LEN, LAST, RNDV};

/// Most pieces one descriptor may name.
pub const MAX_PIECES: usize = 16;
/// Fixed part of a descriptor body.
const FIXED: usize = 8;
/// An inline piece's own bytes besides its data.
pub(crate) const INLINE_HEAD: usize = 5;
/// A remote piece's bytes.
const REMOTE_LEN: usize = 17;

/// The frame of a descriptor naming `pieces` pieces, all of them remote: what the sender
/// must have room for before inlining any.
pub(crate) fn remote_frame_len(pieces: usize) -> usize {
    HEADER_LEN + FIXED + REMOTE_LEN * pieces
}

/// Where one piece of a message is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Carried in the descriptor.
    Inline(Vec<u8>),
    /// In the sender's memory, for us to read.
    Remote {
        /// Bytes.
        len: u32,
        /// The sender's address.
        addr: u64,
        /// Its remote key.
        rkey: u32,
    },
}

impl Segment {
    /// Bytes it holds.
    pub fn len(&self) -> usize {
        match self {
            Segment::Inline(v) => v.len(),
            Segment::Remote { len, .. } => *len as usize,
        }
    }

    /// Whether it holds nothing (never, in a descriptor that parsed).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn encoded_len(&self) -> usize {
        match self {
            Segment::Inline(v) => INLINE_HEAD + v.len(),
            Segment::Remote { .. } => REMOTE_LEN,
        }
    }
}

/// A rendezvous descriptor's body: how long the message is, and where its pieces are, in
/// order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// The message's encoded length: the sum of the pieces.
    pub total: u32,
    /// The pieces.
    pub segments: Vec<Segment>,
}

impl Descriptor {
    /// Length of the body.
    pub fn encoded_len(&self) -> usize {
        FIXED
            + self
                .segments
                .iter()
                .map(Segment::encoded_len)
                .sum::<usize>()
    }

    /// The whole frame: header (`RNDV`, `tag`, `seq`) and body, written into `out`; its
    /// length, or `None` if it does not fit.
    pub fn write_frame(&self, tag: u32, seq: u32, out: &mut [u8]) -> Option<usize> {
        let body_len = self.encoded_len();
        let len = HEADER_LEN + body_len;
        if out.len() < len {
            return None;
        }
        frame::Header {
            flags: FIRST | LAST | RNDV,
            tag,
            seq,
            frag: 0,
            len: body_len as u32,
        }
        .write(out);
        let mut w = &mut out[HEADER_LEN..len];
        put(&mut w, &self.total.to_be_bytes());
        put(&mut w, &(self.segments.len() as u16).to_be_bytes());
        put(&mut w, &[0, 0]);
        for s in &self.segments {
            match s {
                Segment::Inline(v) => {
                    put(&mut w, &[0]);
                    put(&mut w, &(v.len() as u32).to_be_bytes());
                    put(&mut w, v);
                }
                Segment::Remote { len, addr, rkey } => {
                    put(&mut w, &[1]);
                    put(&mut w, &len.to_be_bytes());
                    put(&mut w, &addr.to_be_bytes());
                    put(&mut w, &rkey.to_be_bytes());
                }
            }
        }
        Some(len)
    }

    /// Takes a descriptor body apart, checking everything it claims: 1 to [`MAX_PIECES`]
    /// pieces, none empty, adding up to `total` (at least 1 byte), nothing after them.
    /// Whether the memory it names is really there is for the sender's device to say.
    pub fn parse(body: &[u8]) -> Result<Self, FrameError> {
        let bad = FrameError::Rendezvous;
        let mut r = Reader(body);
        let total = u32::from_be_bytes(r.take::<4>().ok_or(bad("short descriptor"))?);
        let count = u16::from_be_bytes(r.take::<2>().ok_or(bad("short descriptor"))?) as usize;
        if r.take::<2>().ok_or(bad("short descriptor"))? != [0, 0] {
            return Err(bad("reserved bytes set"));
        }
        if count == 0 || count > MAX_PIECES {
            return Err(bad("piece count out of range"));
        }
        let mut segments = Vec::with_capacity(count);
        let mut sum: u64 = 0;
        for _ in 0..count {
            let kind = r.take::<1>().ok_or(bad("short piece"))?[0];
            let len = u32::from_be_bytes(r.take::<4>().ok_or(bad("short piece"))?);
            if len == 0 {
                return Err(bad("empty piece"));
            }
            sum += u64::from(len);
            segments.push(match kind {
                0 => Segment::Inline(
                    r.bytes(len as usize)
                        .ok_or(bad("short inline piece"))?
                        .to_vec(),
                ),
                1 => Segment::Remote {
                    len,
                    addr: u64::from_be_bytes(r.take::<8>().ok_or(bad("short piece"))?),
                    rkey: u32::from_be_bytes(r.take::<4>().ok_or(bad("short piece"))?),
                },
                _ => return Err(bad("unknown piece kind")),
            });
        }
        if !r.0.is_empty() {
            return Err(bad("trailing bytes"));
        }
        if sum != u64::from(total) || total == 0 {
            return Err(bad("pieces do not add up to the length"));
        }
        Ok(Self { total, segments })
    }
}

fn put(w: &mut &mut [u8], bytes: &[u8]) {
    let (head, rest) = std::mem::take(w).split_at_mut(bytes.len());
    head.copy_from_slice(bytes);
    *w = rest;
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let b = self.bytes(N)?;
        b.try_into().ok()
    }

    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

/// The frames acknowledging `seqs`, as many sequence numbers in each as fit in `frame_max`
/// bytes.
pub fn done_frames(seqs: &[u32], frame_max: usize) -> Vec<Vec<u8>> {
    let per = (frame_max.saturating_sub(HEADER_LEN) / 4).max(1);
    seqs.chunks(per)
        .map(|chunk| {
            let body: Vec<u8> = chunk.iter().flat_map(|s| s.to_be_bytes()).collect();
            frame::build(FIRST | LAST | DONE, 0, 0, 0, &body)
        })
        .collect()
}

/// The sequence numbers a `DONE` body acknowledges.
pub fn parse_done(body: &[u8]) -> Result<Vec<u32>, FrameError> {
    if body.is_empty() || body.len() % 4 != 0 {
        return Err(FrameError::Rendezvous("acknowledgement of a bad length"));
    }
    Ok(body
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The sender's books: the messages a peer may be reading, each with its exposures, and
/// their bytes, bounded.
#[derive(Debug)]
pub(crate) struct Lent {
    by_seq: HashMap<u32, (Vec<Exposed>, usize)>,
    bytes: usize,
    max: usize,
}

impl Lent {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            by_seq: HashMap::new(),
            bytes: 0,
            max,
        }
    }

    /// Whether a message of `total` bytes may be exposed now: within the bound, or alone
    /// (a message larger than the bound is not sent by rendezvous at all).
    pub(crate) fn has_room(&self, total: usize) -> bool {
        self.by_seq.is_empty() || self.bytes + total <= self.max
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    pub(crate) fn lend(&mut self, seq: u32, exposed: Vec<Exposed>, total: usize) {
        self.bytes += total;
        if let Some((_, old)) = self.by_seq.insert(seq, (exposed, total)) {
            // Only after 2^32 messages with one still unread: the old one is given up.
            self.bytes -= old;
        }
    }

    /// The peer is done with `seq`: its exposures end (dropped: deregistered). Whether it
    /// was lent (a peer acknowledging what it was never lent is ignored).
    pub(crate) fn done(&mut self, seq: u32) -> bool {
        match self.by_seq.remove(&seq) {
            Some((exposed, total)) => {
                self.bytes -= total;
                drop(exposed);
                true
            }
            None => false,
        }
    }

    /// Messages lent and not acknowledged.
    pub(crate) fn count(&self) -> usize {
        self.by_seq.len()
    }
}

/// Registered buffers that reads land in, kept for reuse, their total bounded: what a
/// session (or a hub, for all its peers) pins for rendezvous, whatever peers ask.
#[derive(Debug, Clone)]
pub(crate) struct ReadPool {
    inner: Arc<Mutex<PoolState>>,
}

#[derive(Debug)]
struct PoolState {
    free: Vec<Buffer>,
    /// Bytes registered: free, being read into, or held by the application.
    registered: usize,
    max: usize,
    /// A descriptor waits for room: a buffer coming back wakes the owner.
    waiting: bool,
    /// Receivers (a hub's peers) with reads under way: each may hold an equal part of the
    /// bound in reads under way (see [`ReadPool::within_share`]).
    readers: usize,
    waker: Option<rdmsg_transport::Waker>,
    /// Bytes of buffers whose payloads the application shares ([`ReadBuf::share`]).
    shared: usize,
}

impl PoolState {
    /// Room was made: a descriptor waiting for it is told, through the owner's wake-up.
    fn room_made(&mut self) {
        if std::mem::take(&mut self.waiting) {
            if let Some(w) = &self.waker {
                w.wake();
            }
        }
    }
}

/// Smallest buffer registered for reads (smaller messages share the size class).
const MIN_READ_BUFFER: usize = 64 << 10;

impl ReadPool {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(PoolState {
                free: Vec::new(),
                registered: 0,
                max,
                waiting: false,
                readers: 0,
                waker: None,
                shared: 0,
            })),
        }
    }

    /// What a buffer returned on another thread writes to, if a descriptor waits.
    pub(crate) fn set_waker(&self, waker: rdmsg_transport::Waker) {
        self.lock().waker = Some(waker);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn max(&self) -> usize {
        self.lock().max
    }

    /// A buffer of at least `len` bytes: a free one, or a new registration (`register`)
    /// within the bound, freeing unused ones to make room. `None` if the bound is reached by
    /// buffers in use: the caller tries again once one comes back.
    pub(crate) fn acquire(
        &self,
        len: usize,
        register: impl FnOnce(usize) -> rdmsg_transport::Result<Buffer>,
    ) -> rdmsg_transport::Result<Option<Buffer>> {
        let mut st = self.lock();
        let fit = st
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        if let Some(i) = fit {
            st.waiting = false;
            return Ok(Some(st.free.swap_remove(i)));
        }
        // Sizes in eighths of a power of two: at most 1/8 wasted, and messages of about the
        // same size reuse each other's buffers.
        let step = (len.checked_next_power_of_two().unwrap_or(len) / 8).max(1);
        let size = len
            .div_ceil(step)
            .saturating_mul(step)
            .max(MIN_READ_BUFFER)
            .min(st.max.max(len));
        // Make room by giving up free buffers that are too small.
        while st.registered + size > st.max {
            let Some(b) = st.free.pop() else { break };
            st.registered -= b.len();
        }
        if st.registered + size > st.max {
            st.waiting = true;
            return Ok(None);
        }
        st.registered += size;
        drop(st);
        match register(size) {
            Ok(b) => {
                self.lock().waiting = false;
                Ok(Some(b))
            }
            Err(e) => {
                self.lock().registered -= size;
                Err(e)
            }
        }
    }

    /// Whether a receiver whose reads under way hold `in_flight` bytes may start one more of
    /// `len` bytes: one with none under way always may; one with some, within an equal part
    /// of the bound among the receivers reading. So a few peers whose reads do not complete
    /// never hold the whole pool that every peer's large messages need.
    pub(crate) fn within_share(&self, in_flight: usize, len: usize) -> bool {
        let st = self.lock();
        in_flight == 0 || in_flight + len <= st.max / st.readers.max(1)
    }

    /// A receiver's reads under way went from none to some (`true`) or back.
    pub(crate) fn reading(&self, started: bool) {
        let mut st = self.lock();
        if started {
            st.readers += 1;
        } else {
            st.readers = st.readers.saturating_sub(1);
            st.room_made();
        }
    }

    /// A buffer back (from a delivered message dropped, or a read that was not used).
    pub(crate) fn release(&self, buf: Buffer) {
        let mut st = self.lock();
        st.free.push(buf);
        st.room_made();
    }

    /// A buffer of `size` bytes that will not come back (it went with a failed post, or its
    /// connection): no longer counted.
    pub(crate) fn forget(&self, size: usize) {
        let mut st = self.lock();
        st.registered = st.registered.saturating_sub(size);
        st.room_made();
    }

    /// Counts `n` bytes as registered and held (a test's stand-in for buffers the
    /// application keeps).
    #[cfg(test)]
    pub(crate) fn occupy(&self, n: usize) {
        self.lock().registered += n;
    }

    /// Bytes registered now.
    pub(crate) fn registered(&self) -> usize {
        self.lock().registered
    }
}

/// A message read by rendezvous: its bytes in a registered buffer, which goes back to its
/// pool when this is dropped.
#[derive(Debug)]
pub struct ReadBuf {
    buf: Option<Buffer>,
    len: usize,
    pool: ReadPool,
    /// Counted in the pool's shared bytes.
    shared: bool,
}

impl ReadBuf {
    pub(crate) fn new(buf: Buffer, len: usize, pool: ReadPool) -> Self {
        Self {
            buf: Some(buf),
            len,
            pool,
            shared: false,
        }
    }

    /// Whether its payloads may share it (see [`crate::Envelope::decode_shared`]): while
    /// shared buffers hold at most half the pool. Counted until it is dropped.
    pub(crate) fn share(&mut self) -> bool {
        if !self.shared {
            let size = self.buf.as_ref().map_or(0, |b| b.len());
            let mut st = self.pool.lock();
            if st.shared + size > st.max / 2 {
                return false;
            }
            st.shared += size;
            self.shared = true;
        }
        true
    }

    /// The message's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| &b.as_slice()[..self.len])
    }
}

impl AsRef<[u8]> for ReadBuf {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Drop for ReadBuf {
    fn drop(&mut self) {
        if self.shared {
            let size = self.buf.as_ref().map_or(0, |b| b.len());
            let mut st = self.pool.lock();
            st.shared = st.shared.saturating_sub(size);
        }
        if let Some(b) = self.buf.take() {
            self.pool.release(b);
        }
    }
}
