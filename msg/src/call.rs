//! Calls: a typed request answered by a typed response, over the same connection as plain
//! messages, each with one deadline for the whole exchange.
//!
//! On the wire a request is a message of its own tag ([`CALL_TAG`]) whose body is the call's
//! number, the request type's tag and the request; an answer is a message of tag
//! [`REPLY_TAG`] whose body is the call's number, a status and the response. The receiving
//! side unwraps both before the application sees anything: a request arrives as an
//! [`Envelope`] of the request's own type that also carries a [`Responder`]
//! ([`Envelope::responder`]), so telling types apart (`env.is::<T>()`) and decoding
//! (shared or borrowed included) work as for any message (a [`crate::Dispatcher`] handler
//! sees the decoded request only: answer calls before dispatching); an answer goes to the
//! call waiting for it, and one nobody waits for any more (it came after its deadline, or its
//! call was dropped) is counted in [`CallStats::late`] and dropped.
//!
//! A request type names its response type ([`Request`], declared with [`crate::request!`]).
//! Answers are always solicited, so an answer always wakes the caller; requests are unless
//! the request type says otherwise, and `start_calls` sends a batch of requests that wakes
//! the server once. A deadline is the caller's alone: the server does not learn of it.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use rdmsg_transport::{PeerId, Waker};
use serde::ser::{SerializeTuple, Serializer};
use serde::Serialize;

use crate::codec::{Decoder, Envelope};
use crate::peer::Encode;
pub(crate) use crate::peer::{encoded_len, Outgoing, Owned};
use crate::{Error, Message, Result};

/// A message that asks for an answer of type [`Request::Response`]. Declare both with
/// [`crate::request!`].
pub trait Request: Message {
    /// The type of the answer.
    type Response: Message;
}

/// Declares a request type: implements [`Message`] (as [`crate::message!`] does, with the
/// same tag rules) and [`Request`] with its response type.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// #[derive(Serialize, Deserialize)]
/// struct Get { key: String }
/// #[derive(Serialize, Deserialize)]
/// struct Value(Option<Vec<u8>>);
/// rdmsg_msg::message!(Value);
/// rdmsg_msg::request!(Get => Value);                     // tag of "Get"
/// # #[derive(Serialize, Deserialize)] struct Put;
/// rdmsg_msg::request!(Put => Value, tag = "kv.put");     // wire name pinned
/// ```
#[macro_export]
macro_rules! request {
    ($name:ident => $resp:ty) => {
        $crate::message!($name);
        impl $crate::Request for $name {
            type Response = $resp;
        }
    };
    ($ty:ty => $resp:ty, tag = $t:expr) => {
        $crate::message!($ty, tag = $t);
        impl $crate::Request for $ty {
            type Response = $resp;
        }
    };
    ($ty:ty => $resp:ty, tag = $t:expr, solicited = $s:expr) => {
        $crate::message!($ty, tag = $t, solicited = $s);
        impl $crate::Request for $ty {
            type Response = $resp;
        }
    };
}

pub use crate::message::{CALL_TAG, REPLY_TAG};

/// An answer's status.
const ANSWERED: u8 = 0;
/// The server dropped the request's responder without answering.
const NO_ANSWER: u8 = 1;
/// The server does not take requests of that type (it registered types, not this one).
const NOT_SERVED: u8 = 2;

/// A request as it goes: `(id, tag, request)`.
pub(crate) struct CallOut<'a, M> {
    pub(crate) id: u64,
    pub(crate) m: &'a M,
}

impl<M: Message> Serialize for CallOut<'_, M> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(3)?;
        t.serialize_element(&self.id)?;
        t.serialize_element(&M::TAG)?;
        t.serialize_element(self.m)?;
        t.end()
    }
}

impl<M: Message> Message for CallOut<'_, M> {
    const TAG: u32 = CALL_TAG;
    const SOLICITED: bool = M::SOLICITED;
}

/// A request owned by an outbox, as it goes (as [`CallOut`]).
pub(crate) struct CallOwned<M> {
    pub(crate) id: u64,
    pub(crate) request: M,
}

impl<M: Message> Serialize for CallOwned<M> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        CallOut {
            id: self.id,
            m: &self.request,
        }
        .serialize(s)
    }
}

impl<M: Message> Message for CallOwned<M> {
    const TAG: u32 = CALL_TAG;
    const SOLICITED: bool = M::SOLICITED;
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

impl<T: Serialize + Send> Outgoing for OwnedReply<T> {
    fn with_encode(&self, send: &mut dyn FnMut(&dyn Encode, bool) -> Result<bool>) -> Result<bool> {
        // Answers are solicited: their callers wait for them.
        send(&self.out(), true)
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

/// An answer waiting for the thread that drives the connection.
pub(crate) struct QueuedReply {
    /// To whom (a hub's peer; `None` for a session).
    pub(crate) peer: Option<PeerId>,
    /// The call it answers.
    pub(crate) id: u64,
    pub(crate) msg: Box<dyn Outgoing>,
}

impl fmt::Debug for QueuedReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QueuedReply({:?})", self.peer)
    }
}

/// Answers given on other threads (or by dropped responders), for the session or hub that
/// received the requests to send, and the waker that tells it.
#[derive(Default)]
pub(crate) struct Replies {
    queue: Mutex<Vec<QueuedReply>>,
    any: AtomicBool,
    waker: OnceLock<Waker>,
    /// Called after an answer is queued (see [`crate::Session::on_answer`]).
    hook: Mutex<Option<AnswerHook>>,
}

/// What a driver runs when an answer is given (see [`crate::Session::on_answer`]).
pub(crate) type AnswerHook = Arc<dyn Fn() + Send + Sync>;

impl fmt::Debug for Replies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replies")
            .field("any", &self.any)
            .field("waker", &self.waker)
            .finish_non_exhaustive()
    }
}

impl Replies {
    /// Answers for a session or hub woken by `waker` (if it has one).
    pub(crate) fn new(waker: Option<Waker>) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
            waker: waker.map_or_else(OnceLock::new, OnceLock::from),
            hook: Mutex::new(None),
        })
    }

    /// Whether answers given on other threads wake the owner (set once, when the first
    /// request arrives: a session that serves no calls keeps no descriptor for it).
    pub(crate) fn has_waker(&self) -> bool {
        self.waker.get().is_some()
    }

    /// The owner's waker, from now on.
    pub(crate) fn set_waker(&self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    /// Runs `hook` after each answer queued from now on.
    pub(crate) fn set_hook(&self, hook: AnswerHook) {
        *self.hook.lock().unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }

    fn push(&self, reply: QueuedReply) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(reply);
        self.any.store(true, Ordering::SeqCst);
        if let Some(w) = self.waker.get() {
            w.wake();
        }
        let hook = self
            .hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    /// Whether answers wait (one atomic load: cheap enough for every call).
    pub(crate) fn waiting(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// The answers waiting, in the order given.
    pub(crate) fn take(&self) -> Vec<QueuedReply> {
        if !self.waiting() {
            return Vec::new();
        }
        self.any.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Where a received request came from, and where its answer goes. Dropped unanswered, it
/// answers "no answer".
#[derive(Debug)]
pub(crate) struct Origin {
    pub(crate) id: u64,
    pub(crate) peer: Option<PeerId>,
    pub(crate) replies: Arc<Replies>,
    answered: bool,
}

impl Origin {
    pub(crate) fn new(id: u64, peer: Option<PeerId>, replies: Arc<Replies>) -> Self {
        Self {
            id,
            peer,
            replies,
            answered: false,
        }
    }

    fn answer(mut self, msg: Box<dyn Outgoing>) {
        self.answered = true;
        self.replies.push(QueuedReply {
            peer: self.peer,
            id: self.id,
            msg,
        });
    }

    /// Taken to be answered by the thread that drives the connection: no "no answer" on drop.
    pub(crate) fn disarm(mut self) -> (u64, Option<PeerId>) {
        self.answered = true;
        (self.id, self.peer)
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        if !self.answered {
            self.replies.push(QueuedReply {
                peer: self.peer,
                id: self.id,
                msg: Box::new(no_answer(self.id)),
            });
        }
    }
}

/// The answer to one received request, at most once, from any thread. Dropped without an
/// answer, it answers "no answer" ([`Error::NoAnswer`] for the caller) so that the caller
/// need not wait for its deadline.
///
/// [`Responder::respond`] hands the answer to the thread that drives the session (or hub),
/// waking it: from another thread, that is how to answer. On that thread,
/// [`crate::Session::reply`] (or [`crate::Hub::reply`]) sends it at once, without a queue.
pub struct Responder<T> {
    origin: Option<Origin>,
    request: &'static str,
    _answer: PhantomData<fn(T)>,
}

impl<T> fmt::Debug for Responder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Responder")
            .field("request", &self.request)
            .field("call", &self.origin.as_ref().map(|o| o.id))
            .field("peer", &self.origin.as_ref().and_then(|o| o.peer))
            .finish()
    }
}

impl<T: Message> Responder<T> {
    pub(crate) fn new(origin: Origin, request: &'static str) -> Self {
        Self {
            origin: Some(origin),
            request,
            _answer: PhantomData,
        }
    }

    /// The hub peer that asked (`None` in a session).
    pub fn peer(&self) -> Option<PeerId> {
        self.origin.as_ref().and_then(|o| o.peer)
    }

    /// The caller's number for this call.
    pub fn call_id(&self) -> u64 {
        self.origin.as_ref().map_or(0, |o| o.id)
    }

    /// Answers with `value`: queued for the session's (or hub's) thread, which is woken to
    /// send it; a hub sends it through the peer's outbox (see [`crate::Hub::post`]). An
    /// answer to a connection that has gone is dropped.
    pub fn respond(mut self, value: T)
    where
        T: Send + 'static,
    {
        if let Some(origin) = self.origin.take() {
            let id = origin.id;
            origin.answer(Box::new(OwnedReply {
                id,
                status: ANSWERED,
                value: Some(value),
            }));
        }
    }

    /// Taken apart to be answered at once by the owning thread.
    pub(crate) fn into_origin(mut self) -> Option<Origin> {
        self.origin.take()
    }
}

impl<T> Drop for Responder<T> {
    fn drop(&mut self) {
        // `origin`'s own drop answers "no answer" if nobody answered.
        let _ = self.origin.take();
    }
}

impl Envelope {
    /// Takes the answer's handle of a request of type `R` ([`Request`]): answer it with
    /// [`Responder::respond`] from any thread, or with [`crate::Session::reply`] /
    /// [`crate::Hub::reply`] on the connection's own. [`Error::WrongType`] if the message is
    /// not an `R`, [`Error::NotARequest`] if it is not a request (a plain message, or its
    /// responder already taken). An envelope dropped with its responder still inside answers
    /// "no answer" ([`Error::NoAnswer`] for the caller).
    pub fn responder<R: Request>(&mut self) -> Result<Responder<R::Response>> {
        if !self.is::<R>() {
            return Err(crate::codec::wrong_type::<R>(self.tag(), self.type_name()));
        }
        match self.take_origin().map(|o| o.downcast::<Origin>()) {
            Some(Ok(o)) => Ok(Responder::new(*o, std::any::type_name::<R>())),
            _ => Err(Error::NotARequest {
                request: std::any::type_name::<R>(),
            }),
        }
    }
}

/// Counts of a session's (or hub's) calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallStats {
    /// Calls started.
    pub started: u64,
    /// Calls answered in time.
    pub answered: u64,
    /// Calls that ran out of their deadline.
    pub timed_out: u64,
    /// Answers that came for a call nobody waits for any more (after its deadline, or once
    /// its [`Call`] was dropped): dropped.
    pub late: u64,
    /// Calls now waiting for their answer.
    pub in_flight: u64,
    /// Requests received by this side (answered, refused, or waiting for their answer).
    pub served: u64,
    /// Answers this side gave that could not be sent: past the bound on answers waiting to
    /// go ([`crate::SessionConfig::max_outbox_bytes`]) while the peer took nothing (its
    /// caller was told "no answer"), not encodable, or the connection gone.
    pub answers_dropped: u64,
}

/// What a call came to, once its answer is in.
#[derive(Debug)]
pub(crate) enum Outcome {
    Answer(Envelope),
    Failed(Error),
}

#[derive(Debug)]
struct Pending {
    peer: Option<PeerId>,
    /// The response type's tag and name.
    expect: (u32, &'static str),
    request: &'static str,
    outcome: Option<Outcome>,
}

/// The calls of one session or hub waiting for answers.
#[derive(Debug, Default)]
pub(crate) struct CallTable {
    next: u64,
    pending: HashMap<u64, Pending>,
    stats: CallStats,
    /// A hub's counts per peer (its calls to the peer, and the peer's requests served).
    by_peer: HashMap<PeerId, CallStats>,
}

/// A call table shared with the [`Call`] handles (whose drop cancels).
pub(crate) type Calls = Arc<Mutex<CallTable>>;

/// The call `id` of `R` whose request went (`Ok(true)`), did not go within `timeout`
/// (`Ok(false)`: [`crate::Error::CallTimedOut`]), or failed: a session's and a hub's start.
pub(crate) fn started<R: Request>(
    calls: &Calls,
    id: u64,
    sent: Result<bool>,
    timeout: Duration,
    deadline: Option<Instant>,
) -> Result<Call<R::Response>> {
    let request = std::any::type_name::<R>();
    match sent {
        Ok(true) => Ok(Call::new(id, calls.clone(), request, timeout, deadline)),
        Ok(false) => {
            lock(calls).give_up(id, true);
            Err(crate::Error::CallTimedOut {
                request,
                after: timeout,
            })
        }
        Err(e) => {
            lock(calls).forget(id);
            Err(e)
        }
    }
}

pub(crate) fn lock(calls: &Calls) -> MutexGuard<'_, CallTable> {
    calls.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CallTable {
    /// Counts `f` in all and for `peer` (for a peer gone, in all only).
    fn count(&mut self, peer: Option<PeerId>, f: impl Fn(&mut CallStats)) {
        f(&mut self.stats);
        if let Some(s) = peer.and_then(|p| self.by_peer.get_mut(&p)) {
            f(s);
        }
    }

    /// The counts of a peer that is starting a call or has sent a request.
    fn counted(&mut self, peer: Option<PeerId>) {
        if let Some(p) = peer {
            self.by_peer.entry(p).or_default();
        }
    }

    /// A new call's number.
    pub(crate) fn start<R: Request>(&mut self, peer: Option<PeerId>) -> u64 {
        self.next = self.next.wrapping_add(1);
        let id = self.next;
        self.pending.insert(
            id,
            Pending {
                peer,
                expect: (R::Response::TAG, std::any::type_name::<R::Response>()),
                request: std::any::type_name::<R>(),
                outcome: None,
            },
        );
        self.counted(peer);
        self.count(peer, |s| {
            s.started += 1;
            s.in_flight += 1;
        });
        id
    }

    /// Call `id` is over: no longer in flight.
    fn remove(&mut self, id: u64) -> Option<Pending> {
        let p = self.pending.remove(&id)?;
        self.count(p.peer, |s| s.in_flight = s.in_flight.saturating_sub(1));
        Some(p)
    }

    /// A call whose request did not go.
    pub(crate) fn forget(&mut self, id: u64) {
        if let Some(p) = self.remove(id) {
            self.count(p.peer, |s| s.started -= 1);
        }
    }

    pub(crate) fn stats(&self) -> CallStats {
        self.stats
    }

    /// The counts of calls to and from `peer`, while it is connected.
    pub(crate) fn peer_stats(&self, peer: PeerId) -> CallStats {
        self.by_peer.get(&peer).copied().unwrap_or_default()
    }

    /// `peer` is gone: its counts are dropped (they stay in the totals).
    pub(crate) fn forget_peer(&mut self, peer: PeerId) {
        self.by_peer.remove(&peer);
    }

    pub(crate) fn answer_dropped(&mut self) {
        self.stats.answers_dropped += 1;
    }

    pub(crate) fn served(&mut self, peer: Option<PeerId>) {
        self.counted(peer);
        self.count(peer, |s| s.served += 1);
    }

    /// An answer arrived from `peer` (its body past the call number and status).
    pub(crate) fn answer(&mut self, peer: Option<PeerId>, id: u64, status: u8, mut env: Envelope) {
        let Some(p) = self
            .pending
            .get_mut(&id)
            .filter(|p| p.peer == peer && p.outcome.is_none())
        else {
            self.count(peer, |s| s.late += 1);
            return;
        };
        let request = p.request;
        p.outcome = Some(match status {
            ANSWERED => {
                env.retag(p.expect.0, p.expect.1);
                // It may wait for its caller a while: not in a receive buffer, whose credit
                // the peer needs.
                env.release_credit();
                Outcome::Answer(env)
            }
            NOT_SERVED => Outcome::Failed(Error::NotServed { request }),
            _ => Outcome::Failed(Error::NoAnswer { request }),
        });
    }

    /// The connection to `peer` (every peer: `None` in a session) failed: its calls fail.
    pub(crate) fn fail_peer(&mut self, peer: Option<PeerId>, error: impl Fn() -> Error) {
        for p in self.pending.values_mut() {
            if p.outcome.is_none() && (peer.is_none() || p.peer == peer) {
                p.outcome = Some(Outcome::Failed(error()));
            }
        }
    }

    /// The outcome of call `id`, if it is in (the call is then over).
    pub(crate) fn take(&mut self, id: u64) -> Option<Outcome> {
        let out = self.pending.get_mut(&id)?.outcome.take()?;
        let p = self.remove(id)?;
        if matches!(out, Outcome::Answer(_)) {
            self.count(p.peer, |s| s.answered += 1);
        }
        Some(out)
    }

    /// Call `id` ran out of time (or its handle went): an answer that comes now is late.
    pub(crate) fn give_up(&mut self, id: u64, timed_out: bool) {
        if let Some(p) = self.remove(id) {
            if p.outcome.is_none() && timed_out {
                self.count(p.peer, |s| s.timed_out += 1);
            }
        }
    }
}

/// A call under way: the handle to its answer. Dropping it cancels the call (its answer,
/// should it come, is dropped and counted late).
#[must_use = "dropping a call cancels it"]
pub struct Call<T> {
    id: u64,
    deadline: Option<Instant>,
    calls: Calls,
    request: &'static str,
    timeout: Duration,
    _answer: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Call<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Call")
            .field("id", &self.id)
            .field("request", &self.request)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl<T> Call<T> {
    pub(crate) fn new(
        id: u64,
        calls: Calls,
        request: &'static str,
        timeout: Duration,
        deadline: Option<Instant>,
    ) -> Self {
        Self {
            id,
            deadline,
            calls,
            request,
            timeout,
            _answer: PhantomData,
        }
    }

    /// The call's number (as its [`Responder::call_id`] on the other side).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// When it runs out of time.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Gives up on the call as timed out, unless its answer is in (then that). For a wait
    /// bounded by its caller (an async timeout around it).
    pub(crate) fn expire_or_take(self) -> Result<Outcome> {
        match self.take_outcome() {
            Some(out) => Ok(out),
            None => Err(self.timed_out()),
        }
    }

    /// Gives up on the call as timed out (as a blocking wait does at its deadline): counted
    /// in [`CallStats::timed_out`], an answer that comes later is dropped as late; returns
    /// the [`Error::CallTimedOut`] to report. For callers that bound the wait themselves (an
    /// async timeout around it).
    pub fn expire(self) -> Error {
        self.timed_out()
    }

    /// Whether its answer (or its failure) is in, without waiting.
    pub fn is_done(&self) -> bool {
        lock(&self.calls)
            .pending
            .get(&self.id)
            .is_some_and(|p| p.outcome.is_some())
    }

    /// The answer if it is in: `Some(Ok(envelope))`, retagged as the response type, or the
    /// call's failure. `None`: not yet (the deadline is not checked here).
    pub(crate) fn take_outcome(&self) -> Option<Outcome> {
        lock(&self.calls).take(self.id)
    }

    /// The timeout error of this call.
    pub(crate) fn timed_out(&self) -> Error {
        lock(&self.calls).give_up(self.id, true);
        Error::CallTimedOut {
            request: self.request,
            after: self.timeout,
        }
    }

    /// Whether the deadline has passed.
    pub(crate) fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }

    /// How long is left until the deadline.
    pub(crate) fn left(&self, now: Instant) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(now))
    }
}

impl<T> Drop for Call<T> {
    fn drop(&mut self) {
        lock(&self.calls).give_up(self.id, false);
    }
}

/// The answer of a call: decoded ([`Envelope::decode_shared`]: its [`crate::Bulk`] fields
/// share the received bytes), or the call's failure.
pub(crate) fn finish<T>(outcome: Outcome) -> Result<T>
where
    T: Message + serde::de::DeserializeOwned,
{
    match outcome {
        Outcome::Answer(mut env) => env.decode_shared(),
        Outcome::Failed(e) => Err(e),
    }
}

/// Where waiting for the first of some calls stands ([`first_ended`]).
pub(crate) enum Next<T> {
    /// The call at this index ended (removed from the list), with what it came to.
    Ended(usize, Result<T>),
    /// No call is left to wait for.
    NoneLeft,
    /// None has ended: wait at most this long (the nearest deadline).
    Wait(Option<Duration>),
}

/// The first of `calls` whose outcome is in, or else whose deadline has passed (counted
/// timed out), removed from `calls`; else how long until the nearest deadline. What a
/// session's and a hub's `wait_any` do between receives.
///
/// A deadline is judged on what has arrived, not on when the caller came back to look: once
/// one has passed, `take_in` first takes in, without waiting, what is already there (answers
/// go to their calls), and a call whose answer was among it ends with its answer. A caller
/// whose thread was busy past a deadline (while its answers sat in the connection) would
/// otherwise report calls timed out whose answers had come, and count them late.
pub(crate) fn first_ended<T>(calls: &mut Vec<Call<T>>, take_in: impl FnOnce()) -> Next<T>
where
    T: Message + serde::de::DeserializeOwned,
{
    if let Some(ended) = answered(calls) {
        return ended;
    }
    let now = Instant::now();
    if calls.iter().any(|c| c.expired(now)) {
        take_in();
        if let Some(ended) = answered(calls) {
            return ended;
        }
        if let Some(i) = calls.iter().position(|c| c.expired(now)) {
            return Next::Ended(i, Err(calls.remove(i).timed_out()));
        }
    }
    if calls.is_empty() {
        return Next::NoneLeft;
    }
    Next::Wait(calls.iter().filter_map(|c| c.left(now)).min())
}

/// The first of `calls` whose outcome is in, removed from `calls`.
fn answered<T>(calls: &mut Vec<Call<T>>) -> Option<Next<T>>
where
    T: Message + serde::de::DeserializeOwned,
{
    let (i, outcome) = calls
        .iter()
        .enumerate()
        .find_map(|(i, c)| c.take_outcome().map(|o| (i, o)))?;
    drop(calls.remove(i));
    Some(Next::Ended(i, finish(outcome)))
}

/// What a received message is, for the layer that routes calls.
pub(crate) enum Routed {
    /// A message for the application (a request among them, with its origin attached).
    Deliver(Envelope),
    /// An answer, or a request refused: nothing for the application.
    Consumed,
}

/// Routes one received message: unwraps a request (attaching where its answer goes, or
/// refusing it if `decoder` does not take its type), hands an answer to its call.
pub(crate) fn route(
    mut env: Envelope,
    peer: Option<PeerId>,
    calls: &Calls,
    replies: &Arc<Replies>,
    decoder: &Decoder,
) -> Result<Routed> {
    match env.tag() {
        CALL_TAG => {
            let ((id, inner), used) =
                crate::codec::decode_prefix::<(u64, u32)>(env.body()).ok_or(Error::BadCall {
                    reason: "a request whose header (call number, type's tag) does not decode",
                })?;
            if matches!(inner, CALL_TAG | REPLY_TAG | crate::codec::NUDGE_TAG) {
                return Err(Error::BadCall {
                    reason: "a request whose type's tag is one of the library's own",
                });
            }
            lock(calls).served(peer);
            if !decoder.accepts(inner) {
                replies.push(QueuedReply {
                    peer,
                    id,
                    msg: Box::new(OwnedReply::<()> {
                        id,
                        status: NOT_SERVED,
                        value: None,
                    }),
                });
                return Ok(Routed::Consumed);
            }
            let ty = decoder.type_of(inner);
            let origin = Box::new(Origin::new(id, peer, replies.clone()));
            env.unwrap_request(used, (inner, ty), origin);
            Ok(Routed::Deliver(env))
        }
        REPLY_TAG => {
            let ((id, status), used) =
                crate::codec::decode_prefix::<(u64, u8)>(env.body()).ok_or(Error::BadCall {
                    reason: "an answer whose header (call number, status) does not decode",
                })?;
            if status > NOT_SERVED {
                return Err(Error::BadCall {
                    reason: "an answer with an unknown status",
                });
            }
            env.skip(used);
            lock(calls).answer(peer, id, status, env);
            Ok(Routed::Consumed)
        }
        _ => Ok(Routed::Deliver(env)),
    }
}

/// A deadline `timeout` from now (none if it does not fit the clock).
pub(crate) fn deadline(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::codec::{self, FrameBytes};
    use crate::Bulk;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct Get {
        key: String,
    }
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct Value {
        data: Bulk,
    }
    #[derive(Debug, Serialize, Deserialize)]
    struct Other;
    crate::message!(Value);
    crate::message!(Other);
    crate::request!(Get => Value);

    /// `m` as the decoder hands it out, from one frame.
    fn received<M: Message>(m: &M, decoder: &mut Decoder) -> Result<Envelope> {
        let mut frame = vec![0; 1 << 20];
        let n = codec::encode_single(m, 0, &mut frame)?.expect("fits");
        frame.truncate(n);
        Ok(decoder
            .push(FrameBytes::Owned(frame))?
            .expect("one whole frame"))
    }

    fn deliver(
        env: Envelope,
        calls: &Calls,
        replies: &Arc<Replies>,
        d: &Decoder,
    ) -> Option<Envelope> {
        match route(env, None, calls, replies, d).unwrap() {
            Routed::Deliver(e) => Some(e),
            Routed::Consumed => None,
        }
    }

    #[test]
    fn a_request_arrives_as_its_own_type_and_its_answer_reaches_its_call() {
        let (client, server) = (Calls::default(), Calls::default());
        let replies = Replies::new(None);
        let mut decoder = Decoder::new(1 << 20);
        decoder.register::<Get>().unwrap();
        let id = lock(&client).start::<Get>(None);
        let call: Call<Value> = Call::new(id, client.clone(), "Get", Duration::from_secs(1), None);
        let get = Get { key: "k".into() };
        let env = received(&CallOut { id, m: &get }, &mut decoder).unwrap();
        let mut env = deliver(env, &server, &replies, &decoder).expect("for the application");
        assert!(env.is::<Get>() && env.is_request());
        assert_eq!(env.decode::<Get>().unwrap(), get);
        let responder = env.responder::<Get>().unwrap();
        assert!(matches!(
            env.responder::<Get>(),
            Err(Error::NotARequest { .. })
        ));
        assert_eq!(responder.call_id(), id);
        // The answer as it goes: large enough to be shared, not copied.
        let data = Bulk::new(vec![7u8; 8192]);
        let out = ReplyOut {
            id,
            status: ANSWERED,
            value: Some(&Value { data: data.clone() }),
        };
        let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
        assert!(deliver(answer, &client, &replies, &decoder).is_none());
        assert!(call.is_done());
        let Some(Outcome::Answer(mut env)) = call.take_outcome() else {
            panic!("answered")
        };
        let got: Value = env.decode_shared().unwrap();
        assert_eq!(got.data, data);
        let body = env.body().as_ptr_range();
        assert!(
            body.contains(&got.data.as_ptr()),
            "the payload shares the received bytes"
        );
        assert_eq!(lock(&client).stats().answered, 1);
        // A second answer to the same call is late.
        let again = received(&out, &mut Decoder::new(1 << 20)).unwrap();
        assert!(deliver(again, &client, &replies, &decoder).is_none());
        assert_eq!(lock(&client).stats().late, 1);
        drop(responder);
        let queued = replies.take();
        assert_eq!(
            queued.len(),
            1,
            "a responder dropped unanswered answers 'no answer'"
        );
    }

    #[test]
    fn a_request_of_a_type_not_served_is_refused_at_once() {
        let (calls, replies) = (Calls::default(), Replies::new(None));
        let mut decoder = Decoder::new(1 << 20);
        decoder.register::<Other>().unwrap();
        let get = Get { key: "k".into() };
        let env = received(&CallOut { id: 5, m: &get }, &mut decoder).unwrap();
        assert!(deliver(env, &calls, &replies, &decoder).is_none());
        assert_eq!(replies.take().len(), 1, "answered NOT_SERVED");
        // ... which the caller sees as NotServed.
        let client = Calls::default();
        let id = lock(&client).start::<Get>(None);
        let call: Call<Value> = Call::new(id, client.clone(), "Get", Duration::from_secs(1), None);
        let out = ReplyOut::<()> {
            id,
            status: NOT_SERVED,
            value: None,
        };
        let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
        assert!(deliver(answer, &client, &replies, &decoder).is_none());
        let err = finish::<Value>(call.take_outcome().unwrap()).unwrap_err();
        assert!(matches!(err, Error::NotServed { .. }), "{err}");
    }

    #[test]
    fn forged_call_frames_are_bad_frames() {
        let (calls, replies) = (Calls::default(), Replies::new(None));
        let decoder = Decoder::new(1 << 20);
        let bad = |m: &dyn Fn(&mut Decoder) -> Envelope| {
            let env = m(&mut Decoder::new(1 << 20));
            let r = route(env, None, &calls, &replies, &decoder);
            matches!(r, Err(Error::BadCall { .. }))
        };
        // A request posing as one of the library's own tags.
        let inner = CallOut {
            id: 1,
            m: &ReplyOut::<()> {
                id: 1,
                status: 0,
                value: None,
            },
        };
        assert!(bad(&|d| received(&inner, d).unwrap()));
        // An answer of an unknown status.
        let status = ReplyOut::<()> {
            id: 1,
            status: 9,
            value: None,
        };
        assert!(bad(&|d| received(&status, d).unwrap()));
        // Headers that do not decode.
        #[derive(Serialize)]
        struct Junk(u8);
        impl Message for Junk {
            const TAG: u32 = CALL_TAG;
        }
        assert!(bad(&|d| received(&Junk(0xff), d).unwrap()));
        assert_eq!(
            lock(&calls).stats(),
            CallStats::default(),
            "nothing counted"
        );
    }

    #[test]
    fn a_call_whose_answer_is_here_when_its_deadline_is_judged_ends_with_it() {
        // The caller's thread came back past the deadline (busy elsewhere) while the answer
        // sat in the connection: taking it in comes before judging the deadline.
        let (client, replies, decoder) =
            (Calls::default(), Replies::new(None), Decoder::new(1 << 20));
        let id = lock(&client).start::<Get>(None);
        let past = Instant::now();
        let mut calls = vec![Call::<Value>::new(
            id,
            client.clone(),
            "Get",
            Duration::ZERO,
            Some(past),
        )];
        let data = Bulk::new(vec![3u8; 16]);
        let out = ReplyOut {
            id,
            status: ANSWERED,
            value: Some(&Value { data: data.clone() }),
        };
        let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
        let mut took_in = 0;
        let ended = first_ended(&mut calls, || {
            took_in += 1;
            assert!(deliver(answer, &client, &replies, &decoder).is_none());
        });
        let Next::Ended(0, Ok(got)) = ended else {
            panic!("the answer that was here, not a timeout")
        };
        assert_eq!((got.data, took_in), (data, 1));
        let stats = lock(&client).stats();
        assert_eq!((stats.answered, stats.timed_out, stats.late), (1, 0, 0));
        // Nothing there: the deadline is the outcome.
        let id = lock(&client).start::<Get>(None);
        let mut calls = vec![Call::<Value>::new(
            id,
            client.clone(),
            "Get",
            Duration::ZERO,
            Some(past),
        )];
        let ended = first_ended(&mut calls, || {});
        assert!(matches!(
            ended,
            Next::Ended(0, Err(Error::CallTimedOut { .. }))
        ));
        // Before any deadline, nothing is taken in here (the wait receives).
        let id = lock(&client).start::<Get>(None);
        let mut calls = vec![Call::<Value>::new(
            id,
            client.clone(),
            "Get",
            Duration::from_secs(60),
            deadline(Duration::from_secs(60)),
        )];
        let ended = first_ended(&mut calls, || panic!("no deadline passed"));
        assert!(matches!(ended, Next::Wait(Some(_))));
    }

    #[test]
    fn a_cancelled_or_expired_call_counts_its_answer_late() {
        let (client, replies, decoder) =
            (Calls::default(), Replies::new(None), Decoder::new(1 << 20));
        let id = lock(&client).start::<Get>(None);
        let call: Call<Value> = Call::new(id, client.clone(), "Get", Duration::ZERO, None);
        let err = call.expire();
        assert!(matches!(err, Error::CallTimedOut { .. }));
        let id2 = lock(&client).start::<Get>(None);
        drop(Call::<Value>::new(
            id2,
            client.clone(),
            "Get",
            Duration::ZERO,
            None,
        ));
        for id in [id, id2] {
            let out = ReplyOut {
                id,
                status: ANSWERED,
                value: Some(&Value {
                    data: Bulk::default(),
                }),
            };
            let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
            assert!(deliver(answer, &client, &replies, &decoder).is_none());
        }
        let stats = lock(&client).stats();
        assert_eq!((stats.late, stats.timed_out, stats.in_flight), (2, 1, 0));
    }
}
