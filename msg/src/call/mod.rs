//! Calls: a typed request answered by a typed response, over the same connection as plain
//! messages, each with one deadline for the whole exchange.
//!
//! On the wire a request is a message of its own tag ([`CALL_TAG`]) whose body is the call's
//! number, the request type's tag, what was left of the caller's deadline when it went, and
//! the request; an answer is a message of tag
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
//! the server once.
//!
//! A deadline travels with its request: the server's [`Responder`] says when the caller gives
//! up ([`Responder::deadline`], [`Responder::time_left`]): what was left when the request
//! went, after any wait for a credit, counted from when this side hands it to the application
//! (its time in transit and in this side's queues is not taken off, so the server's view is
//! never earlier than the caller's). A server that calls another peer on its behalf gives that call
//! [`Responder::time_left`]; one that finds a request [`Responder::expired`] can drop it
//! unanswered: nothing is sent (the caller would drop it as late) and it is counted in
//! [`CallStats::expired`].

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rdmsg_transport::{PeerId, Waker};
use serde::ser::{SerializeTuple, Serializer};
use serde::Serialize;

use crate::codec::{Decoder, Envelope};
use crate::peer::Encode;
pub(crate) use crate::peer::{encoded_len, Outgoing, Owned};
use crate::{Error, Message, Result};

mod table;
mod wire;

pub(crate) use table::*;
pub(crate) use wire::*;

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
    /// The owner's waker: replaced when a session resumes on a new connection.
    waker: Mutex<Option<Waker>>,
    /// Whether `waker` is set (read without the lock for every request routed).
    has_waker: AtomicBool,
    /// Called after an answer is queued (see [`crate::Session::on_answer`]).
    hook: Mutex<Option<AnswerHook>>,
    /// Requests whose responder was dropped after their caller's deadline
    /// ([`CallStats::expired`]).
    expired: AtomicU64,
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
            has_waker: AtomicBool::new(waker.is_some()),
            waker: Mutex::new(waker),
            hook: Mutex::new(None),
            expired: AtomicU64::new(0),
        })
    }

    /// Whether answers given on other threads wake the owner (set once, when the first
    /// request arrives: a session that serves no calls keeps no descriptor for it).
    pub(crate) fn has_waker(&self) -> bool {
        self.has_waker.load(Ordering::Acquire)
    }

    /// The owner's waker, from now on (a session that resumed on a new connection gives its
    /// new one).
    pub(crate) fn set_waker(&self, waker: Waker) {
        *self.waker.lock().unwrap_or_else(PoisonError::into_inner) = Some(waker);
        self.has_waker.store(true, Ordering::Release);
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
        if let Some(w) = &*self.waker.lock().unwrap_or_else(PoisonError::into_inner) {
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

    /// Requests whose responder was dropped unanswered after their caller's deadline.
    pub(crate) fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
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
    /// The caller's deadline as seen here ([`deadline_of`]), if it has one.
    pub(crate) deadline: Option<Instant>,
    answered: bool,
}

impl Origin {
    pub(crate) fn new(
        id: u64,
        peer: Option<PeerId>,
        replies: Arc<Replies>,
        deadline: Option<Instant>,
    ) -> Self {
        Self {
            id,
            peer,
            replies,
            deadline,
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

    /// Whether the caller's deadline has passed.
    fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Taken to be answered by the thread that drives the connection: no "no answer" on drop.
    pub(crate) fn disarm(mut self) -> (u64, Option<PeerId>) {
        self.answered = true;
        (self.id, self.peer)
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        if self.expired() {
            // Its caller has given up: "no answer" would only be dropped there as late.
            self.replies.expired.fetch_add(1, Ordering::Relaxed);
        } else {
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

    /// The caller's deadline as this side sees it: when this side handed the request to the
    /// application (a receive, an event), plus what was left of the caller's deadline when the
    /// request went. Neither its time in transit nor its wait in this side's queues is taken
    /// off, so this is never earlier than the caller's own, and later by that much. `None` if
    /// the caller set none.
    pub fn deadline(&self) -> Option<Instant> {
        self.origin.as_ref().and_then(|o| o.deadline)
    }

    /// How long is left until [`Responder::deadline`] (zero once it passed; `None`: no
    /// deadline). A server that calls another peer on this request's behalf gives that call
    /// what is left, so that the deadline travels on.
    pub fn time_left(&self) -> Option<Duration> {
        self.deadline()
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Whether the caller has given up waiting ([`Responder::deadline`] passed). Dropping the
    /// responder of such a request sends nothing (its caller would drop "no answer" as late)
    /// and counts it in [`CallStats::expired`].
    pub fn expired(&self) -> bool {
        self.origin.as_ref().is_some_and(Origin::expired)
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
    /// The deadline of the call this request came with, as seen here (see
    /// [`Responder::deadline`]), if it is a request that has one.
    pub(crate) fn call_deadline(&self) -> Option<Instant> {
        self.origin_ref()?.downcast_ref::<Origin>()?.deadline
    }

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
    /// Requests received here whose [`Responder`] was dropped unanswered after the caller's
    /// deadline ([`Responder::expired`]): nothing was sent. Counted for the session or hub as a
    /// whole (a hub's [`crate::Hub::peer_call_stats`] leaves it 0).
    pub expired: u64,
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
    /// Whether dropping it cancels the call (not once a hub watches it in its place).
    armed: bool,
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
            armed: true,
            _answer: PhantomData,
        }
    }

    /// The same call, its answer's type forgotten: what a hub keeps for a watched call
    /// ([`crate::Hub::watch`]). This handle no longer cancels it.
    pub(crate) fn erase(mut self) -> Call<()> {
        self.armed = false;
        Call::new(
            self.id,
            self.calls.clone(),
            self.request,
            self.timeout,
            self.deadline,
        )
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

    /// Whether it was started by the session or hub whose calls are `calls`.
    pub(crate) fn started_by(&self, calls: &Calls) -> bool {
        Arc::ptr_eq(&self.calls, calls)
    }

    /// Whether its answer (or its failure) is in, without waiting.
    pub fn is_done(&self) -> bool {
        lock(&self.calls).is_done(self.id)
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
        if self.armed {
            lock(&self.calls).give_up(self.id, false);
        }
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

/// A front end's four methods for the calls it started (`wait`, `wait_any`, `try_wait`,
/// `expire`), written once for a session and a hub: each does its work in this module, over
/// the front end's [`CallHost`]. The docs, one block before each name, are the front end's.
macro_rules! call_waits {
    (
        $(#[$wait:meta])* wait;
        $(#[$wait_any:meta])* wait_any;
        $(#[$try_wait:meta])* try_wait;
        $(#[$expire:meta])* expire;
    ) => {
        $(#[$wait])*
        pub fn wait<T>(&mut self, call: $crate::Call<T>) -> $crate::Result<T>
        where
            T: $crate::Message + serde::de::DeserializeOwned,
        {
            $crate::call::wait(self, call)
        }

        $(#[$wait_any])*
        pub fn wait_any<T>(
            &mut self,
            calls: &mut Vec<$crate::Call<T>>,
        ) -> Option<(usize, $crate::Result<T>)>
        where
            T: $crate::Message + serde::de::DeserializeOwned,
        {
            $crate::call::wait_any(self, calls)
        }

        $(#[$try_wait])*
        pub fn try_wait<T>(&mut self, call: &$crate::Call<T>) -> Option<$crate::Result<T>>
        where
            T: $crate::Message + serde::de::DeserializeOwned,
        {
            call.take_outcome().map($crate::call::finish)
        }

        $(#[$expire])*
        pub fn expire<T>(&mut self, call: $crate::Call<T>) -> $crate::Result<T>
        where
            T: $crate::Message + serde::de::DeserializeOwned,
        {
            call.expire_or_take().and_then($crate::call::finish)
        }
    };
}
pub(crate) use call_waits;

/// Whether a call's wait is receiving, and whether an answer came since it began: an answer
/// ends the receive, so that the wait looks whether it is its own.
#[derive(Debug, Default)]
pub(crate) struct AnswerWatch {
    waiting: bool,
    answered: bool,
}

impl AnswerWatch {
    /// A call's wait starts receiving.
    pub(crate) fn begin(&mut self) {
        self.waiting = true;
        self.answered = false;
    }

    /// The call's wait stopped receiving.
    pub(crate) fn end(&mut self) {
        self.waiting = false;
    }

    /// An answer was routed to its call.
    pub(crate) fn answer_came(&mut self) {
        self.answered = true;
    }

    /// Whether a call's wait should stop receiving and look: an answer came since it began
    /// or last looked (which this forgets).
    pub(crate) fn take(&mut self) -> bool {
        self.waiting && std::mem::take(&mut self.answered)
    }

    /// [`AnswerWatch::take`] without forgetting.
    pub(crate) fn came(&self) -> bool {
        self.waiting && self.answered
    }
}

/// A front end whose calls wait: a session, or a hub.
pub(crate) trait CallHost {
    /// Takes in, without waiting, what has arrived: answers go to their calls, the rest is
    /// kept for the application's next receive.
    fn take_in(&mut self);
    /// Waits at most `left` for what arrives, taken in as [`CallHost::take_in`] does. An
    /// error returned ends the wait of the calls that have no outcome yet (a failed
    /// connection, the hub's own failure); others are kept in their place for the receive.
    fn wait_in(&mut self, left: Option<Duration>) -> Result<()>;
}

/// Waits for `call`'s answer until its deadline (see [`crate::Session::wait`]).
pub(crate) fn wait<T, H>(host: &mut H, call: Call<T>) -> Result<T>
where
    T: Message + serde::de::DeserializeOwned,
    H: CallHost + ?Sized,
{
    let mut calls = vec![call];
    let (_, outcome) = wait_any(host, &mut calls).expect("one call to wait for");
    outcome
}

/// Waits for the first of `calls` to end (see [`crate::Session::wait_any`]).
pub(crate) fn wait_any<T, H>(host: &mut H, calls: &mut Vec<Call<T>>) -> Option<(usize, Result<T>)>
where
    T: Message + serde::de::DeserializeOwned,
    H: CallHost + ?Sized,
{
    loop {
        // Past a deadline, what has arrived is taken in first.
        let left = match first_ended(calls, || host.take_in()) {
            Next::Ended(i, outcome) => return Some((i, outcome)),
            Next::NoneLeft => return None,
            Next::Wait(left) => left,
        };
        if let Err(e) = host.wait_in(left) {
            // The calls failed with it: their outcomes are in (else the failure is the
            // first call's).
            if !calls.iter().any(|c| c.is_done()) {
                drop(calls.remove(0));
                return Some((0, Err(e)));
            }
        }
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
            let ((id, inner, budget), used) =
                crate::codec::decode_prefix::<(u64, u32, u64)>(env.body())
                    .ok_or(Error::BadCall {
                    reason:
                        "a request whose header (call number, type's tag, budget) does not decode",
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
            // The clock, once per request that has a deadline.
            let deadline = deadline_of(budget, Instant::now);
            let origin = Box::new(Origin::new(id, peer, replies.clone(), deadline));
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
mod tests;
