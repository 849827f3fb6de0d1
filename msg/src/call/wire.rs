//! Calls on the wire: a request wrapped with its call's number, an answer with its status.

use super::*;
use crate::frame::{HEADER_LEN, PACK_ENTRY};

/// An answer's status.
pub(crate) const ANSWERED: u8 = 0;
/// The server dropped the request's responder without answering.
pub(crate) const NO_ANSWER: u8 = 1;
/// The server does not take requests of that type (it registered types, not this one).
pub(crate) const NOT_SERVED: u8 = 2;

/// What a request says of its caller's deadline: how long was left when it was sent, in
/// microseconds rounded up, so that the server's view is never earlier than the caller's
/// ([`NO_DEADLINE`]: none).
pub(crate) fn budget_of(left: Option<Duration>) -> u64 {
    left.map_or(NO_DEADLINE, |l| {
        u64::try_from(l.as_nanos().div_ceil(1000))
            .map_or(NO_DEADLINE - 1, |us| us.min(NO_DEADLINE - 1))
    })
}

/// A request's budget for a caller without a deadline.
pub(crate) const NO_DEADLINE: u64 = u64::MAX;

/// The deadline a request's `budget` gives, counted from `arrived` (read only for a budget
/// that is a deadline): never earlier than the caller's own, since the time in transit is not
/// taken off.
pub(crate) fn deadline_of(budget: u64, arrived: impl FnOnce() -> Instant) -> Option<Instant> {
    if budget == NO_DEADLINE {
        return None;
    }
    arrived().checked_add(Duration::from_micros(budget))
}

/// A request as it goes: `(id, tag, budget, request)`, the budget what is left of the
/// caller's `deadline` when it is encoded, that is when it goes, after any wait for a credit
/// ([`budget_of`]; the clock is read then, for a call that has a deadline).
pub(crate) struct CallOut<'a, M> {
    pub(crate) id: u64,
    pub(crate) deadline: Option<Instant>,
    pub(crate) m: &'a M,
}

impl<M: Message> Serialize for CallOut<'_, M> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let left = self
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()));
        let mut t = s.serialize_tuple(4)?;
        t.serialize_element(&self.id)?;
        t.serialize_element(&M::TAG)?;
        t.serialize_element(&budget_of(left))?;
        t.serialize_element(self.m)?;
        t.end()
    }
}

impl<M: Message> Message for CallOut<'_, M> {
    const TAG: u32 = CALL_TAG;
    const SOLICITED: bool = M::SOLICITED;
}

/// A request owned by an outbox, as it goes (as [`CallOut`]: its budget taken when it goes).
pub(crate) struct CallOwned<M> {
    pub(crate) id: u64,
    pub(crate) deadline: Option<Instant>,
    pub(crate) request: M,
}

impl<M: Message> Serialize for CallOwned<M> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        CallOut {
            id: self.id,
            deadline: self.deadline,
            m: &self.request,
        }
        .serialize(s)
    }
}

impl<M: Message> Message for CallOwned<M> {
    const TAG: u32 = CALL_TAG;
    const SOLICITED: bool = M::SOLICITED;
}

/// A request or an answer whose body goes as it came, undecoded ([`crate::Hub::forward`],
/// [`crate::Hub::reply_with`]): its call head (`(id, tag, budget)` or `(id, status)`),
/// encoded, then the body's bytes, which are what the value's encoding was.
pub(crate) struct Forwarded<B> {
    pub(crate) tag: u32,
    pub(crate) head: Vec<u8>,
    pub(crate) body: B,
}

/// The body of a [`Forwarded`] message: borrowed or owned bytes are copied into its encoding;
/// shared ones ([`bytes::Bytes`], an envelope's body once detached) go by reference when the
/// message goes by rendezvous, exposed where they are.
pub(crate) trait Body: AsRef<[u8]> {
    /// The body by reference, if it can be.
    fn shared(&self) -> Option<bytes::Bytes> {
        None
    }
}

impl Body for &[u8] {}

impl Body for Vec<u8> {}

impl Body for bytes::Bytes {
    fn shared(&self) -> Option<bytes::Bytes> {
        Some(self.clone())
    }
}

impl<B: AsRef<[u8]>> Forwarded<B> {
    /// Its encoded length: head and body.
    pub(crate) fn size_of(&self) -> usize {
        self.len()
    }

    fn len(&self) -> usize {
        self.head.len() + self.body.as_ref().len()
    }

    fn write(&self, out: &mut [u8]) {
        let (head, body) = out.split_at_mut(self.head.len());
        head.copy_from_slice(&self.head);
        body.copy_from_slice(self.body.as_ref());
    }
}

impl<B: Body> Encode for Forwarded<B> {
    fn tag(&self) -> u32 {
        self.tag
    }
    fn encode_single(&self, seq: u32, out: &mut [u8]) -> Result<Option<usize>> {
        let len = HEADER_LEN + self.len();
        if out.len() < len {
            return Ok(None);
        }
        let header = crate::frame::Header {
            flags: crate::frame::FIRST | crate::frame::LAST,
            tag: self.tag,
            seq,
            frag: 0,
            len: self.len() as u32,
        };
        header.write(&mut out[..HEADER_LEN]);
        self.write(&mut out[HEADER_LEN..len]);
        Ok(Some(len))
    }
    fn encode_pieces(&self) -> Result<Vec<crate::bulk::Piece>> {
        if let Some(body) = self.body.shared() {
            return Ok(vec![
                crate::bulk::Piece::Encoded(self.head.clone()),
                crate::bulk::Piece::Bulk(body),
            ]);
        }
        let mut all = vec![0; self.len()];
        self.write(&mut all);
        Ok(vec![crate::bulk::Piece::Encoded(all)])
    }
    fn encode_entry(&self, out: &mut [u8]) -> Result<Option<usize>> {
        let len = PACK_ENTRY + self.len();
        if out.len() < len {
            return Ok(None);
        }
        crate::frame::write_entry(out, self.tag, self.len() as u32);
        self.write(&mut out[PACK_ENTRY..len]);
        Ok(Some(len))
    }
}

impl fmt::Debug for Forwarded<Vec<u8>> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "forwarded answer ({} bytes)", self.len())
    }
}

impl Outgoing for Forwarded<Vec<u8>> {
    fn encoding(&self) -> (&dyn Encode, bool) {
        // Answers are solicited: their callers wait for them.
        (self, true)
    }
    fn size(&self) -> usize {
        self.len()
    }
}

/// A request received, to go on to another peer as it came: the head of the call that carries
/// it (`(id, tag, budget)`, the budget what is left of `deadline` now) and its body.
pub(crate) fn forwarded_request<B>(
    id: u64,
    tag: u32,
    deadline: Option<Instant>,
    body: B,
) -> Result<Forwarded<B>> {
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    Ok(Forwarded {
        tag: CALL_TAG,
        head: crate::codec::encode_head(&(id, tag, budget_of(left)))?,
        body,
    })
}

/// An answer received, to go on as the answer to call `id` as it came.
pub(crate) fn forwarded_answer<B>(id: u64, body: B) -> Result<Forwarded<B>> {
    Ok(Forwarded {
        tag: REPLY_TAG,
        head: crate::codec::encode_head(&(id, ANSWERED))?,
        body,
    })
}

/// An answer as it goes: `(id, status[, response])`.
pub(crate) struct ReplyOut<'a, T> {
    pub(crate) id: u64,
    pub(crate) status: u8,
    pub(crate) value: Option<&'a T>,
}

impl<T: Serialize> Serialize for ReplyOut<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(2 + usize::from(self.value.is_some()))?;
        t.serialize_element(&self.id)?;
        t.serialize_element(&self.status)?;
        if let Some(v) = self.value {
            t.serialize_element(v)?;
        }
        t.end()
    }
}

impl<T: Serialize> Message for ReplyOut<'_, T> {
    const TAG: u32 = REPLY_TAG;
}

impl<T> fmt::Debug for OwnedReply<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "answer to call {} ({})", self.id, self.status)
    }
}

/// An answer owned by a queue.
pub(crate) struct OwnedReply<T> {
    pub(crate) id: u64,
    pub(crate) status: u8,
    pub(crate) value: Option<T>,
}

impl<T: Serialize> OwnedReply<T> {
    fn out(&self) -> ReplyOut<'_, T> {
        ReplyOut {
            id: self.id,
            status: self.status,
            value: self.value.as_ref(),
        }
    }
}

impl<T: Serialize> Encode for OwnedReply<T> {
    fn tag(&self) -> u32 {
        REPLY_TAG
    }
    fn encode_single(&self, seq: u32, out: &mut [u8]) -> Result<Option<usize>> {
        self.out().encode_single(seq, out)
    }
    fn encode_pieces(&self) -> Result<Vec<crate::bulk::Piece>> {
        self.out().encode_pieces()
    }
    fn encode_entry(&self, out: &mut [u8]) -> Result<Option<usize>> {
        self.out().encode_entry(out)
    }
}

impl<T: Serialize + Send> Outgoing for OwnedReply<T> {
    fn encoding(&self) -> (&dyn Encode, bool) {
        // Answers are solicited: their callers wait for them.
        (self, true)
    }
    fn size(&self) -> usize {
        encoded_len(&self.out())
    }
}

/// "No answer" to call `id`.
pub(crate) fn no_answer(id: u64) -> OwnedReply<()> {
    OwnedReply {
        id,
        status: NO_ANSWER,
        value: None,
    }
}
