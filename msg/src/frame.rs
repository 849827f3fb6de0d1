//! The frame: a 20-byte header and a bincode body, one per RC message.
//!
//! ```text
//! 0      2        3      4      8      12      14         16     20
//! | magic | version | flags | tag  | seq  | frag  | taken    | len  | body (len bytes)
//! ```
//! Big-endian. `seq` numbers messages per connection; a message larger than one buffer is cut
//! into fragments `frag = 0, 1, ...`, the first flagged [`FIRST`], the last [`LAST`]. The first
//! fragment's body starts with the whole message's body length, [`TOTAL_LEN`] bytes (see
//! [`announced_total`]): a receiver knows at once what the message will hold, and the
//! fragments must add up to exactly that. Since RC delivers whole messages in order, a bad
//! frame never desynchronises the next one: it can always be dropped alone.
//!
//! A packed frame ([`PACK`], with [`FIRST`] and [`LAST`], tag 0) carries several whole small
//! messages in one receive buffer: `frag` says how many, `seq` is the first one's number (the
//! others follow it), and the body is that many entries of a [`PACK_ENTRY`]-byte head (the
//! message's tag and body length, big-endian) and the body (see [`unpack`]).
//!
//! `taken` is the delivery record riding every frame: how many of the *peer's* messages the
//! writer's application has taken, modulo 2^16 (see [`stamp_taken`]). A sender keeps fewer
//! than 2^15 messages unconfirmed, so the low 16 bits name the count without doubt.

/// Frame magic, "RM".
pub const MAGIC: u16 = 0x524d;
/// Frame format version. 2: a first fragment announces its message's length
/// ([`announced_total`]). 3: a request's body carries what was left of its caller's deadline
/// (see [`crate::call`]), so that a peer of another version refuses every frame
/// ([`FrameError::BadVersion`]) rather than misreading requests. 4: packed frames ([`PACK`]).
pub const VERSION: u8 = 4;
/// Header length.
pub const HEADER_LEN: usize = 20;
/// Bytes at the start of a first fragment's body (a frame with [`FIRST`] and without
/// [`LAST`]) that announce the message's body length, big-endian, before its first part.
pub const TOTAL_LEN: usize = 4;
/// Flag: first fragment of a message.
pub const FIRST: u8 = 0x01;
/// Flag: last fragment of a message.
pub const LAST: u8 = 0x02;
/// Flag: a rendezvous descriptor (with [`FIRST`] and [`LAST`]): the body says where the
/// message waits in the sender's memory for us to read it (see the `rendezvous` module).
pub const RNDV: u8 = 0x04;
/// Flag: a rendezvous acknowledgement (with [`FIRST`] and [`LAST`], tag 0): the body lists
/// the sequence numbers of messages the receiver is done reading.
pub const DONE: u8 = 0x08;
/// Flag: a request for the delivery record (with [`FIRST`] and [`LAST`], tag 0, no body):
/// "once your application has taken my messages up to `seq` (exclusive), send a frame, solicited,
/// to say so". A sender short of room in its window of unconfirmed messages asks so.
pub const ASK: u8 = 0x10;
/// Flag: several whole messages in one frame (with [`FIRST`] and [`LAST`], tag 0, `frag` the
/// number of messages, at least one): see [`unpack`].
pub const PACK: u8 = 0x20;
/// Flag: the first frame on a connection that resumes a session (with [`FIRST`] and
/// [`LAST`], tag 0, no body, `seq` the sender's count of our messages its application has
/// taken, in full 32 bits): we send again from there. Read only by the resume
/// ([`resume_count`]); anywhere else it is a reserved flag.
pub const RESUME: u8 = 0x40;
/// Bytes ahead of each message in a packed frame: its tag and its body length, big-endian.
pub const PACK_ENTRY: usize = 8;

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// [`FIRST`] and/or [`LAST`].
    pub flags: u8,
    /// Message type tag.
    pub tag: u32,
    /// Message sequence number.
    pub seq: u32,
    /// Fragment index within the message.
    pub frag: u16,
    /// Body bytes in this frame.
    pub len: u32,
}

/// A frame that cannot be taken apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than a header.
    #[error("frame of {0} bytes is shorter than a header")]
    TooShort(usize),
    /// Not an rdmsg frame.
    #[error("bad magic {0:#06x}")]
    BadMagic(u16),
    /// Another frame version.
    #[error("frame version {0} is not supported")]
    BadVersion(u8),
    /// Unknown flag bits or a set reserved field.
    #[error("reserved bits set")]
    Reserved,
    /// The header's length disagrees with the bytes received.
    #[error("header says {declared} body bytes, frame has {actual}")]
    Length {
        /// From the header.
        declared: u32,
        /// Received.
        actual: usize,
    },
    /// A fragment out of order, or of another message while one is being reassembled.
    #[error("fragment {frag} of message {seq} out of order")]
    OutOfOrder {
        /// Its message.
        seq: u32,
        /// Its index.
        frag: u16,
    },
    /// A reassembled message would exceed the configured bound
    /// ([`crate::SessionConfig::max_message`]).
    #[error(
        "message in fragments exceeds SessionConfig::max_message ({0} bytes) on this side: \
         raise max_message on both sides"
    )]
    TooLarge(usize),
    /// A first fragment too short to announce its message's length ([`TOTAL_LEN`] bytes).
    #[error("first fragment of message {seq} does not announce the message's length")]
    NoTotal {
        /// Its message.
        seq: u32,
    },
    /// A message's fragments do not add up to the length its first fragment announced (more,
    /// or fewer by its last fragment).
    #[error(
        "fragments of message {seq} bring {received} body bytes, its first fragment announced \
         {announced}"
    )]
    Announced {
        /// Its message.
        seq: u32,
        /// The length the first fragment announced.
        announced: u32,
        /// The body bytes its fragments brought (up to the one that disagreed).
        received: usize,
    },
    /// A rendezvous descriptor or acknowledgement that cannot be taken apart.
    #[error("bad rendezvous frame: {0}")]
    Rendezvous(&'static str),
    /// A packed frame whose entries do not add up to its body and its count.
    #[error("packed frame of messages {seq}.. does not hold the {count} messages it announces")]
    Packed {
        /// Its first message's number.
        seq: u32,
        /// The messages it announces.
        count: u16,
    },
    /// A packed frame where one message was expected ([`crate::codec::Decoder::push`]):
    /// [`crate::codec::Decoder::take`] hands out its messages.
    #[error("packed frame of {0} messages where one message was expected")]
    NotSingle(u16),
}

impl Header {
    /// Writes the header into the first [`HEADER_LEN`] bytes of `out`.
    pub fn write(&self, out: &mut [u8]) {
        out[0..2].copy_from_slice(&MAGIC.to_be_bytes());
        out[2] = VERSION;
        out[3] = self.flags;
        out[4..8].copy_from_slice(&self.tag.to_be_bytes());
        out[8..12].copy_from_slice(&self.seq.to_be_bytes());
        out[12..14].copy_from_slice(&self.frag.to_be_bytes());
        out[14..16].copy_from_slice(&[0, 0]);
        out[16..20].copy_from_slice(&self.len.to_be_bytes());
    }
}

/// A whole frame: this header (its `len` set from `body`) followed by `body`.
pub fn build(flags: u8, tag: u32, seq: u32, frag: u16, body: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; HEADER_LEN + body.len()];
    Header {
        flags,
        tag,
        seq,
        frag,
        len: body.len() as u32,
    }
    .write(&mut f);
    f[HEADER_LEN..].copy_from_slice(body);
    f
}

/// Writes the delivery record into a frame about to go: `taken` messages of the peer's taken
/// by our application (modulo 2^16). A frame too short for a header is left alone.
pub fn stamp_taken(frame: &mut [u8], taken: u32) {
    if let Some(field) = frame.get_mut(14..16) {
        field.copy_from_slice(&(taken as u16).to_be_bytes());
    }
}

/// The delivery record a frame carries (see [`stamp_taken`]), if it is long enough to have one.
pub fn taken_of(frame: &[u8]) -> Option<u16> {
    frame.get(14..16).map(|b| u16::from_be_bytes([b[0], b[1]]))
}

/// The body length a first fragment announces ([`TOTAL_LEN`] bytes at the start of its
/// body), if the frame is one (flags [`FIRST`] without [`LAST`]) and long enough; `None` for
/// any other frame.
pub fn announced_total(flags: u8, body: &[u8]) -> Option<u32> {
    if flags & (FIRST | LAST) != FIRST {
        return None;
    }
    let b = body.get(..TOTAL_LEN)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// A resume frame telling our count `taken` ([`RESUME`]).
pub fn resume_frame(taken: u32) -> Vec<u8> {
    build(FIRST | LAST | RESUME, 0, taken, 0, &[])
}

/// The count a resume frame carries, if `frame` is one ([`RESUME`]).
pub fn resume_count(frame: &[u8]) -> Option<u32> {
    let resume = [FIRST | LAST | RESUME, 0, 0, 0, 0];
    let h = frame.get(..HEADER_LEN)?;
    let fields = [h[3], h[4] | h[5] | h[6] | h[7], h[16], h[17] | h[18], h[19]];
    (frame.len() == HEADER_LEN
        && u16::from_be_bytes([h[0], h[1]]) == MAGIC
        && h[2] == VERSION
        && fields == resume)
        .then(|| u32::from_be_bytes([h[8], h[9], h[10], h[11]]))
}

/// Splits a received frame into header and body, checking everything the header claims.
pub fn parse(frame: &[u8]) -> Result<(Header, &[u8]), FrameError> {
    if frame.len() < HEADER_LEN {
        return Err(FrameError::TooShort(frame.len()));
    }
    let magic = u16::from_be_bytes([frame[0], frame[1]]);
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if frame[2] != VERSION {
        return Err(FrameError::BadVersion(frame[2]));
    }
    let flags = frame[3];
    if flags & !(FIRST | LAST | RNDV | DONE | ASK | PACK) != 0 {
        return Err(FrameError::Reserved);
    }
    if flags & (RNDV | DONE | ASK | PACK) != 0 && !matches!(flags, 0x07 | 0x0b | 0x13 | 0x23) {
        // A descriptor, an acknowledgement, a request for the record or a packed frame is one
        // whole frame, and only one of them.
        return Err(FrameError::Reserved);
    }
    let u32_at =
        |i: usize| u32::from_be_bytes([frame[i], frame[i + 1], frame[i + 2], frame[i + 3]]);
    let header = Header {
        flags,
        tag: u32_at(4),
        seq: u32_at(8),
        frag: u16::from_be_bytes([frame[12], frame[13]]),
        len: u32_at(16),
    };
    let body = &frame[HEADER_LEN..];
    if flags & ASK != 0 && (header.tag != 0 || header.len != 0) {
        return Err(FrameError::Reserved);
    }
    if flags & PACK != 0 && (header.tag != 0 || header.frag == 0) {
        return Err(FrameError::Reserved);
    }
    if header.len as usize != body.len() {
        return Err(FrameError::Length {
            declared: header.len,
            actual: body.len(),
        });
    }
    Ok((header, body))
}

/// The entries of a packed frame's `body` ([`PACK`]) whose header announced `count` messages
/// from `seq` on: each message's number, tag and the range of its body in `body`, checked
/// whole before any is handed out, so that a frame that does not add up is one error
/// ([`FrameError::Packed`]) and never half delivered.
pub fn unpack(
    seq: u32,
    count: u16,
    body: &[u8],
) -> Result<impl Iterator<Item = (u32, u32, std::ops::Range<usize>)> + '_, FrameError> {
    check_packed(seq, count, body)?;
    let mut at = 0;
    Ok((0..count).map(move |i| {
        let h = &body[at..at + PACK_ENTRY];
        let tag = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let range = at + PACK_ENTRY..at + PACK_ENTRY + len;
        at = range.end;
        (seq.wrapping_add(u32::from(i)), tag, range)
    }))
}

/// Whether a packed frame's `body` holds exactly the `count` entries its header announced
/// (see [`unpack`]).
pub fn check_packed(seq: u32, count: u16, body: &[u8]) -> Result<(), FrameError> {
    let bad = FrameError::Packed { seq, count };
    let mut at: usize = 0;
    for _ in 0..count {
        let head = body.get(at..at + PACK_ENTRY).ok_or(bad)?;
        let len = u32::from_be_bytes([head[4], head[5], head[6], head[7]]) as usize;
        at = len
            .checked_add(PACK_ENTRY)
            .and_then(|entry| at.checked_add(entry))
            .filter(|&end| end <= body.len())
            .ok_or(bad)?;
    }
    match at == body.len() {
        true => Ok(()),
        false => Err(bad),
    }
}

/// Writes one packed entry's head (see [`PACK_ENTRY`]) into the first bytes of `out`.
pub fn write_entry(out: &mut [u8], tag: u32, len: u32) {
    out[0..4].copy_from_slice(&tag.to_be_bytes());
    out[4..8].copy_from_slice(&len.to_be_bytes());
}

/// Joins fragments back into messages. Single-frame messages never go through it.
///
/// A message's first fragment announces its body length ([`announced_total`]): one beyond the
/// bound is refused at once ([`FrameError::TooLarge`]), before anything of it is buffered, and
/// the fragments must bring exactly that many bytes ([`FrameError::Announced`]).
#[derive(Debug)]
pub struct Reassembler {
    partial: Option<Partial>,
    max_size: usize,
}

#[derive(Debug)]
struct Partial {
    tag: u32,
    seq: u32,
    next: u16,
    total: u32,
    body: Vec<u8>,
}

impl Reassembler {
    /// Reassembles messages of at most `max_size` bytes.
    pub fn new(max_size: usize) -> Self {
        Self {
            partial: None,
            max_size,
        }
    }

    /// The bound on a reassembled message.
    pub fn max_size(&self) -> usize {
        self.max_size
    }

    /// Whether a message is half reassembled.
    pub fn in_progress(&self) -> bool {
        self.partial.is_some()
    }

    /// Bytes held for the message being reassembled.
    pub fn buffered(&self) -> usize {
        self.partial.as_ref().map_or(0, |p| p.body.len())
    }

    /// The message being reassembled: its tag, sequence number and the body bytes received.
    pub fn partial(&self) -> Option<(u32, u32, usize)> {
        self.partial.as_ref().map(|p| (p.tag, p.seq, p.body.len()))
    }

    /// Drops the message being reassembled; what [`Reassembler::partial`] said of it.
    pub fn abandon(&mut self) -> Option<(u32, u32, usize)> {
        let p = self.partial.take()?;
        Some((p.tag, p.seq, p.body.len()))
    }

    /// Takes a fragment (a frame without both [`FIRST`] and [`LAST`]). Returns the tag and
    /// body once the last fragment is in. On error the partial message is dropped.
    pub fn push(&mut self, h: &Header, body: &[u8]) -> Result<Option<(u32, Vec<u8>)>, FrameError> {
        let out_of_order = FrameError::OutOfOrder {
            seq: h.seq,
            frag: h.frag,
        };
        let mut body = body;
        if h.flags & FIRST != 0 {
            let restarted = self.partial.take().is_some();
            if h.frag != 0 {
                return Err(out_of_order);
            }
            let total = announced_total(h.flags, body).ok_or(FrameError::NoTotal { seq: h.seq })?;
            if total as usize > self.max_size {
                return Err(FrameError::TooLarge(self.max_size));
            }
            body = &body[TOTAL_LEN..];
            self.partial = Some(Partial {
                tag: h.tag,
                seq: h.seq,
                next: 0,
                total,
                body: Vec::new(),
            });
            if restarted {
                // The previous message lost its tail; report it, keep the new one.
                self.extend(h, body)?;
                return Err(out_of_order);
            }
        }
        let Some(p) = &self.partial else {
            return Err(out_of_order);
        };
        if p.tag != h.tag || p.seq != h.seq || p.next != h.frag {
            self.partial = None;
            return Err(out_of_order);
        }
        self.extend(h, body)?;
        if h.flags & LAST != 0 {
            let p = self.partial.take().expect("checked above");
            if p.body.len() != p.total as usize {
                return Err(FrameError::Announced {
                    seq: p.seq,
                    announced: p.total,
                    received: p.body.len(),
                });
            }
            return Ok(Some((p.tag, p.body)));
        }
        Ok(None)
    }

    fn extend(&mut self, h: &Header, body: &[u8]) -> Result<(), FrameError> {
        let p = self.partial.as_mut().expect("caller checked");
        let received = p.body.len() + body.len();
        if received > p.total as usize {
            let e = FrameError::Announced {
                seq: p.seq,
                announced: p.total,
                received,
            };
            self.partial = None;
            return Err(e);
        }
        p.body.extend_from_slice(body);
        p.next = h.frag.wrapping_add(1);
        Ok(())
    }
}
