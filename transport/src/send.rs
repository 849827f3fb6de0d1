//! The send buffers of a driver and how a message gets into one: shared by a
//! [`Connection`](crate::Connection) and a [`RawHub`](crate::RawHub), which differ only in whose
//! queue pair they post to.

use rdmsg_verbs::{Buffer, QueuePair, SendRequest};

use crate::core::{Core, Post};
use crate::error::{Error, Result};

/// What goes out: the bytes inline (copied into the driver's scratch), in a send buffer, or
/// nothing (a grant, a close).
#[derive(Debug)]
pub(crate) enum Payload {
    /// The first `len` bytes of the scratch, copied at post time.
    Inline(usize),
    /// The first `len` bytes of `buf`, which the queue pair holds until its completion.
    Buffer(Buffer, usize),
    /// No payload.
    Empty,
}

/// Registered send buffers, and the scratch inline messages are copied through.
#[derive(Debug)]
pub(crate) struct SendBuffers {
    pub(crate) free: Vec<Buffer>,
    scratch: Vec<u8>,
}

impl SendBuffers {
    pub(crate) fn new(free: Vec<Buffer>, max_inline: usize) -> Self {
        Self {
            free,
            scratch: vec![0; max_inline],
        }
    }

    /// Lets `fill` write a message of at most `max` bytes into a free buffer: `None` (the
    /// buffer back, nothing to send) if it returns `None`; a message up to `max_inline` bytes
    /// (at most the scratch's size) goes inline, its buffer back at once. The caller made sure
    /// a buffer is free.
    pub(crate) fn fill(
        &mut self,
        max: usize,
        max_inline: usize,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<Option<Payload>> {
        let mut buf = self.free.pop().expect("a send buffer is free");
        let len = match fill(&mut buf.as_mut_slice()[..max]) {
            Some(len) if len <= max => len,
            other => {
                self.free.push(buf);
                return match other {
                    None => Ok(None),
                    Some(len) => Err(Error::TooLarge { len, max }),
                };
            }
        };
        if len <= max_inline.min(self.scratch.len()) {
            self.scratch[..len].copy_from_slice(&buf.as_slice()[..len]);
            self.free.push(buf);
            return Ok(Some(Payload::Inline(len)));
        }
        Ok(Some(Payload::Buffer(buf, len)))
    }

    /// The payload of a grant: the upper layer's word ([`crate::core::Core::set_note`]),
    /// inline; nothing where inline sends are off (`max_inline` below 4 bytes).
    pub(crate) fn note(&mut self, note: u32) -> Payload {
        match self.scratch.get_mut(..NOTE_LEN) {
            Some(head) => {
                head.copy_from_slice(&note.to_be_bytes());
                Payload::Inline(NOTE_LEN)
            }
            None => Payload::Empty,
        }
    }

    /// The request for `payload` (inline bytes borrowed from the scratch).
    pub(crate) fn request(&self, payload: Payload) -> SendRequest<'_> {
        match payload {
            Payload::Inline(len) => SendRequest::inline(&self.scratch[..len]),
            Payload::Buffer(buf, len) => SendRequest::buffer(buf, len),
            Payload::Empty => SendRequest::empty(),
        }
    }
}

/// Bytes of a grant's note.
pub(crate) const NOTE_LEN: usize = 4;

/// The note a grant's receive buffer holds, if it carried one.
pub(crate) fn note_of(bytes: &[u8], byte_len: u32) -> Option<u32> {
    if byte_len as usize != NOTE_LEN {
        return None;
    }
    let b = bytes.get(..NOTE_LEN)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// Posts `payload` on `qp` as `post` says and tells `core`; on failure the buffers that were
/// not posted go back to `send` and the verbs error is returned (the driver fails the
/// connection: a credit, or a grant's slot, was taken for the message, and carrying on would
/// leave the two sides' books apart for good).
pub(crate) fn post(
    qp: &mut QueuePair,
    send: &mut SendBuffers,
    core: &mut Core,
    payload: Payload,
    post: Post,
) -> std::result::Result<(), rdmsg_verbs::Error> {
    let req = send
        .request(payload)
        .imm(post.imm.encode())
        .solicited(post.solicited)
        .signaled(post.signaled);
    match qp.post_send_one(req) {
        Ok(id) => {
            core.posted(id, post.signaled);
            Ok(())
        }
        Err(e) => {
            send.free.extend(e.unposted);
            Err(e.error)
        }
    }
}

/// The `fill` of a send that copies `data`, once `data` is known to fit `max` bytes.
pub(crate) fn copy_of(
    data: &[u8],
    max: usize,
) -> Result<impl FnOnce(&mut [u8]) -> Option<usize> + '_> {
    if data.len() > max {
        return Err(Error::TooLarge {
            len: data.len(),
            max,
        });
    }
    Ok(move |buf: &mut [u8]| {
        buf[..data.len()].copy_from_slice(data);
        Some(data.len())
    })
}

/// A bounded send's answer: one that timed out sent nothing (`Ok(false)`).
pub(crate) fn in_time(sent: Result<bool>) -> Result<bool> {
    match sent {
        Err(Error::Timeout(_)) => Ok(false),
        other => other,
    }
}
