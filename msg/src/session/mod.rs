//! A message session over one transport connection.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmsg_transport::Connection;

use crate::call::{self, Call, CallOut, CallStats, Calls, Replies, Request, Responder};
use crate::codec::{Decoder, Envelope};
use crate::drive::earliest;
use crate::error::unread_error;
use crate::held::Held;
use crate::peer::{self, Closing, Delivery, Outbox, PeerMachine, RecvSide, SendSide};
use crate::rendezvous::ReadPool;
use crate::{Message, Result, SessionConfig, SessionStats};

/// Bytes of copies a resumable session keeps of the messages its peer has not taken, unless
/// [`SessionConfig::keep_unconfirmed`] says otherwise: a send beyond it waits for the peer's
/// record, as one beyond the window of unconfirmed messages does.
pub const RESUME_KEEP: usize = 16 << 20;

/// How often an event loop steps a suspended session (its new connection also wakes it).
const SUSPENDED_POLL_MS: u64 = 50;

/// Typed messages over a [`Connection`]. The sender decides per message whether it wakes the
/// receiver; the receiver sleeps solicited-only (the connection's default) and drains
/// everything that arrived before the waking message, in order.
#[derive(Debug)]
pub struct Session {
    conn: Connection,
    /// The peer's protocol state: sending side, receiving side, outbox (answers taken from
    /// `replies` that could not go yet, within [`SessionConfig::max_outbox_bytes`]).
    machine: PeerMachine,
    /// Our calls waiting for answers.
    calls: Calls,
    /// Answers to the peer's requests given on other threads (or by dropped responders).
    replies: Arc<Replies>,
    /// Messages that arrived while a call waited for its answer: handed out first. At
    /// [`SessionConfig::max_held_bytes`], nothing more is taken in (see [`Session::hold`]).
    held: Held<(), Result<Envelope>>,
    /// A call's wait is receiving, and whether an answer came: it ends the receive.
    answer_watch: call::AnswerWatch,
    /// How the session resumes after its connection is lost, if both sides set
    /// [`rdmsg_transport::Config::resume_window`] (see `resume.rs`).
    resume: Option<resume::Resuming>,
    /// Suspended: nothing more is read from the old connection (what the peer had not seen
    /// taken comes again on the new one).
    suspended: bool,
    /// The number a send that went before a loss went under (see `sending`): a call's
    /// request learns it there, since the numbers moved with the resume.
    went_as: Option<u32>,
}

mod calls;
mod close;
mod resume;
mod send;

pub use close::Closed;

impl Session {
    /// A session with default bounds.
    pub fn new(conn: Connection) -> Self {
        Self::with_config(conn, SessionConfig::default())
    }

    /// A session with these bounds.
    pub fn with_config(mut conn: Connection, config: SessionConfig) -> Self {
        // A resumable session keeps copies of what the peer has not taken: they go again.
        let resume = conn.take_resume();
        let config = match (&resume, config.keep_unconfirmed) {
            (Some(_), None) => SessionConfig {
                keep_unconfirmed: Some(RESUME_KEEP),
                ..config
            },
            _ => config,
        };
        if let Some(r) = &resume {
            // A new connection the listener hands over ends this one.
            r.watch(&conn);
        }
        // What we read is bounded by what we announced in the handshake (the peer fragments
        // larger messages).
        let pool = ReadPool::new(conn.config().announced_max_read() as usize);
        if let Ok(waker) = conn.waker() {
            // A read buffer given back on another thread while a descriptor waits for room
            // wakes whoever waits on the connection.
            pool.set_waker(waker);
        }
        Self {
            calls: Calls::default(),
            // An answer given on another thread wakes whoever waits on the connection (its
            // waker made when the first request arrives).
            replies: Replies::new(None),
            held: Held::new(config.max_held_bytes),
            answer_watch: call::AnswerWatch::default(),
            resume: resume.map(resume::Resuming::new),
            suspended: false,
            went_as: None,
            machine: PeerMachine::new(
                SendSide::new(&config, conn.peer().recv_depth)
                    .with_peer_max_read(conn.peer().max_read),
                RecvSide::new(Decoder::new(config.max_message), pool),
                Outbox::new(config.max_outbox_bytes),
            ),
            conn,
        }
    }

    /// Accept only registered types from now on; others are dropped with
    /// [`crate::Error::UnknownTag`] (a fragmented one at its first fragment, before anything
    /// of it is buffered). [`crate::Error::DuplicateTag`] if `M`'s tag is registered already.
    pub fn register<M: Message>(&mut self) -> Result<&mut Self> {
        self.machine.recv.register::<M>()?;
        Ok(self)
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The connection underneath, to send raw bytes or tune it.
    pub fn connection_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// Statistics.
    pub fn stats(&self) -> SessionStats {
        SessionStats {
            credit_waits: self.conn.stats().credit_stalls,
            wakeups: self.conn.wakeups(),
            time_suspended: self.time_suspended(),
            ..self.machine.stats()
        }
    }

    /// The delivery record: how many messages were sent, and how many of them the peer's
    /// application has taken (messages are numbered from 0 in the order they were sent; those
    /// below [`Delivery::taken`] were taken). The peer's count rides every frame it sends,
    /// and a sender with many messages unconfirmed asks for it, so it is never far behind.
    pub fn delivery(&self) -> Delivery {
        self.machine.send.delivery(self.conn.peer_note())
    }

    /// Once the connection has ended (a fatal error from a receive or a send), the messages
    /// the peer's application was not seen to take, in order, as the envelopes they went as
    /// ([`Envelope::seq`] their number, modulo 2^32; decode them as received ones): copies
    /// kept with [`SessionConfig::keep_unconfirmed`] (none without it). `None` while the
    /// connection is up: those may still be taken. After a failure, the peer's application
    /// may have taken some of them after its last word reached us (its count rides its
    /// frames; RDMA says nothing of what an application did).
    pub fn take_unconfirmed(&mut self) -> Option<Vec<Envelope>> {
        self.conn.failure()?;
        if self.suspended || (self.is_resumable() && self.suspends()) {
            // They go again once the session resumes.
            return None;
        }
        self.machine.learn_note(&self.conn);
        Some(self.machine.send.take_unconfirmed())
    }

    /// Receives the next message, waiting as long as it takes. A bad frame gives its error
    /// (not fatal: call again); a failed connection gives a fatal one.
    ///
    /// Before it waits, anything this session sent unsolicited since its last solicited
    /// frame is flushed ([`Session::flush`]; counted in [`SessionStats::wait_flushes`]): a
    /// peer asleep solicited-only would not see it, and may be waiting for exactly that,
    /// a request sent unsolicited whose answer this receive waits for.
    pub fn recv(&mut self) -> Result<Envelope> {
        crate::drive::wait_until_some(|| self.recv_timeout(None))
    }

    /// Receives the next message, waiting at most `timeout`; `Ok(None)` if none came.
    ///
    /// Flushes first, as [`Session::recv`] does, if it would wait (with
    /// [`SessionConfig::max_unsolicited_delay`], when that runs out).
    pub fn recv_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<Envelope>> {
        if let Some(r) = self.take_held() {
            return r.map(Some);
        }
        let got = self.recv_inner(timeout);
        self.took();
        got
    }

    /// After a message was handed to the application: our frames carry the new count, and a
    /// request of the peer's it reaches is answered (sent if it can go now; else with the
    /// next call that sends: a failure comes from the next receive).
    fn took(&mut self) {
        self.machine.took(&mut self.conn);
    }

    fn recv_inner(&mut self, timeout: Option<Duration>) -> Result<Option<Envelope>> {
        // A timeout too long to add to the clock is no deadline at all.
        // The first turn's time is the one read for the deadline; a later turn's, the
        // connection's when its wait woke (`waited_from`: the time its wait was given).
        let mut first = None;
        let deadline = timeout.and_then(|t| {
            let now = Instant::now();
            first = Some(now);
            now.checked_add(t)
        });
        let mut waited_from = None;
        loop {
            // An answer came: a call's wait looks whether it is its own.
            if self.answer_watch.take() {
                return Ok(None);
            }
            // The clock, read once per turn of this loop (each wait ends one), and only if a
            // deadline needs it.
            let (mut now, mut passed, left) =
                self.clock(deadline, first.take(), waited_from.take());
            if self.machine.send.queued_frames() > 0 || self.machine.send.flush_due(now) {
                // Only if this would wait: what has arrived is taken first.
                if let Some(env) = self.try_recv_inner()? {
                    return Ok(Some(env));
                }
                // The sends wait at most what is left, taking in what arrives.
                match self.machine.flush_before_wait(&mut self.conn, left, now) {
                    Err(e) => {
                        if !self.before_failure(e, resume::Until::At(deadline))? {
                            // Suspended past the deadline: nothing came.
                            return Ok(None);
                        }
                        continue;
                    }
                    Ok(f) if !f.drained => {
                        if passed {
                            return Ok(None);
                        }
                        continue;
                    }
                    Ok(_) => {}
                }
                // Those sends may have waited, and left a flush deadline of their own.
                (now, passed, _) = self.clock(deadline, None, None);
            }
            if passed {
                return Ok(None);
            }
            if let Some(r) = self.next_received() {
                match self.route(r?)? {
                    Some(env) => return Ok(Some(env)),
                    None => continue,
                }
            }
            if self.replies.waiting() || !self.machine.outbox.is_empty() {
                self.send_replies()?;
            }
            if self.answer_watch.came() {
                continue;
            }
            let advanced = self.machine.recv.advance(&mut self.conn);
            if advanced.is_ok() && self.has_received() {
                // Frames parked until now were taken in (behind a head whose read could start,
                // or a bound that lifted): handed out before any wait. Their receive buffers
                // may hold all the peer's credits, so nothing else may ever come to end one.
                continue;
            }
            // Answers given meanwhile, or a credit for those waiting, end the wait.
            let (replies, unsent) = (&self.replies, !self.machine.outbox.is_empty());
            let interrupted = |c: &Connection| replies.waiting() || (unsent && c.credits() > 0);
            let arrival = advanced.and_then(|()| {
                Ok(match now {
                    Some(now) => {
                        waited_from = Some(now);
                        // One deadline, the nearer of the caller's and a flush's, counted from
                        // this turn's time: the connection derives none of its own.
                        let limit = earliest(deadline, self.machine.send.flush_deadline());
                        self.conn
                            .recv_any_interruptible_until(limit, now, interrupted)?
                    }
                    None => self.conn.recv_any_interruptible(None, interrupted)?,
                })
            });
            // Nothing came: the next turn reads the clock and judges the deadline.
            self.take_arrival(arrival, resume::Until::At(deadline))?;
        }
    }

    /// The time of a receive's turn, if `deadline` or a flush deadline needs it (`known`, or
    /// the connection's if a wait given `waited_from` moved its turn on, else the clock's);
    /// whether `deadline` has passed; how long is left until it.
    fn clock(
        &self,
        deadline: Option<Instant>,
        known: Option<Instant>,
        waited_from: Option<Instant>,
    ) -> (Option<Instant>, bool, Option<Duration>) {
        let needed = deadline.is_some() || self.machine.send.flush_deadline().is_some();
        let now = needed.then(|| match (known, waited_from) {
            (Some(now), _) => now,
            // A connection that returned without polling or sleeping is still at our time:
            // the clock, so that time moves on.
            (None, Some(from)) => Some(self.conn.turn_now())
                .filter(|&t| t > from)
                .unwrap_or_else(Instant::now),
            (None, None) => Instant::now(),
        });
        let passed = matches!((deadline, now), (Some(d), Some(n)) if n >= d);
        let left = deadline
            .zip(now)
            .map(|(d, n)| d.saturating_duration_since(n));
        (now, passed, left)
    }

    /// Takes in what a receive from the connection brought: whether anything came (a
    /// failure counts: what is still deliverable comes before it).
    // Inlined: on the receive path of every message, and an arrival is moved, not copied.
    #[inline(always)]
    fn take_arrival(
        &mut self,
        arrival: Result<Option<rdmsg_transport::Arrival>>,
        until: resume::Until,
    ) -> Result<bool> {
        match arrival {
            Ok(Some(a)) if !self.suspended => {
                self.machine.recv.accept(a);
                self.exchange_acks()?;
                Ok(true)
            }
            // The old connection, still read after the session suspended: it comes again.
            Ok(Some(_)) => self.resume_until(until),
            Ok(None) => Ok(false),
            Err(e) => self.before_failure(e, until),
        }
    }

    /// A call failed with `e`. If the connection failed, messages whose reads can no longer
    /// complete fail in their place, and what is then deliverable comes before `e` (`Ok`:
    /// look again). A failed connection stays failed: `e` comes once nothing is left. A
    /// resumable session suspends instead and waits for its new connection until
    /// `deadline` (`Ok(true)`: resumed, look again; `Ok(false)`: not yet).
    fn before_failure(&mut self, e: crate::Error, until: resume::Until) -> Result<bool> {
        if self.resume.is_some() && (self.suspended || self.suspends()) {
            return self.resume_until(until);
        }
        if let Some(f) = self.conn.failure() {
            // Calls under way end with it (their answers can no longer come), and answers
            // waiting to go are dropped.
            let (dropped, lost) = self.machine.connection_failed(self.conn.peer_note());
            call::lock(&self.calls)
                .fail_peer(None, &lost, || rdmsg_transport::Error::Connection(f).into());
            self.drop_replies(dropped);
            // (Unless a call's wait keeps all it may: then the calls have their outcome.)
            if self.machine.recv.has_ready() && !self.held.is_full(()) {
                return Ok(true);
            }
        }
        Err(e)
    }

    /// Returns a message that has already arrived, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Envelope>> {
        if let Some(r) = self.take_held() {
            return r.map(Some);
        }
        let got = self.try_recv_inner();
        self.took();
        got
    }

    fn try_recv_inner(&mut self) -> Result<Option<Envelope>> {
        if self.replies.waiting() || !self.machine.outbox.is_empty() {
            self.send_replies()?;
        }
        loop {
            if let Some(r) = self.next_received() {
                match self.route(r?)? {
                    Some(env) => return Ok(Some(env)),
                    None => continue,
                }
            }
            let advanced = self.machine.recv.advance(&mut self.conn);
            if advanced.is_ok() && self.has_received() {
                // Parked frames taken in just now.
                continue;
            }
            let arrival = advanced.and_then(|()| Ok(self.conn.try_recv_any()?));
            if !self.take_arrival(arrival, resume::Until::Now)? {
                return Ok(None);
            }
        }
    }

    /// Hands acknowledgements over (the peer's to the sender, ours out) and sends ours if
    /// they can go now. Not on a failed connection: its failure comes from the next receive,
    /// after what arrived before it.
    fn exchange_acks(&mut self) -> Result<()> {
        match self.machine.exchange_acks(&mut self.conn) {
            Err(e) if self.conn.failure().is_none() => Err(e),
            _ => Ok(()),
        }
    }

    /// An iterator over received messages; it skips non-fatal errors (bad frames, unknown
    /// tags) and ends for good at the first fatal one ([`crate::Error::is_fatal`]: the peer
    /// closing, a failed connection, a verb or wait that failed), never retrying an error that
    /// would recur. Use [`Session::recv`] to see the error that ended it.
    pub fn incoming(&mut self) -> impl Iterator<Item = Envelope> + '_ {
        crate::drive::messages(move || self.recv())
    }

    /// The non-blocking step for an event loop that waits on the session's descriptor
    /// ([`AsFd`]): sends committed frames that can go, flushes what went unsolicited if a
    /// wait would otherwise hide it from the peer (see
    /// [`SessionConfig::max_unsolicited_delay`]), then steps the connection
    /// ([`Connection::step`]). Take messages with [`Session::try_recv`] until it finds none,
    /// then wait until the descriptor is readable or [`Session::next_timeout`] passes.
    /// Returns whether it handled anything (if so, look again before waiting).
    ///
    /// A resumable session (see [`Session::is_resumable`]) takes a new connection up here too:
    /// its descriptor then changes (re-register it when [`SessionStats::resumes`] moves), and
    /// the step waits for the peer's resume frame, within the handshake's timeout.
    pub fn step(&mut self) -> Result<bool> {
        match self.step_inner() {
            // A resumable session that lost its connection takes a new one if there is one
            // (never waiting).
            Err(_)
                if self.resume.is_some()
                    && (self.suspended || self.suspends() || self.successor_waiting()) =>
            {
                self.resume_until(resume::Until::Now)
            }
            r => r,
        }
    }

    fn step_inner(&mut self) -> Result<bool> {
        // Take in what the last step polled: a peer's acknowledgement frees rendezvous room
        // for a sender that waits on the descriptor without receiving, and a descriptor
        // starts its read. Messages wait in order for `try_recv`.
        let mut took = false;
        while self.conn.has_ready() {
            match self.conn.try_recv_any()? {
                Some(_) if self.suspended => return self.resume_until(resume::Until::Now),
                Some(a) => {
                    self.machine.recv.accept(a);
                    took = true;
                }
                None => break,
            }
        }
        self.exchange_acks()?;
        if self.machine.recv.has_waiting() {
            self.machine.recv.advance(&mut self.conn)?;
        }
        let answered = (self.replies.waiting() || !self.machine.outbox.is_empty()) && {
            let before = self.machine.outbox.stats().messages;
            self.send_replies()?;
            self.machine.outbox.stats().messages != before || self.machine.outbox.is_empty()
        };
        let flushed = self
            .machine
            .flush_before_wait(&mut self.conn, Some(Duration::ZERO), None)?;
        let sent = answered || flushed.sent;
        // What was taken in may have freed room for a send: look again before waiting.
        // (Messages ready stay ready: callers look with `has_ready`/`try_recv`.)
        Ok(self.conn.step()? || sent || took)
    }

    /// See [`Connection::nobody_waits`]: after a wait on the descriptor, when nobody else waits on it.
    pub fn nobody_waits(&mut self) {
        self.conn.nobody_waits();
    }

    /// Longest an event loop may wait on the descriptor before calling [`Session::step`]:
    /// the connection's health check, or sooner when an unsolicited message's
    /// [`SessionConfig::max_unsolicited_delay`] runs out.
    pub fn next_timeout(&self) -> Option<Duration> {
        // A flush already due but stuck (no send slot) is retried a millisecond on, not in a
        // spin. The clock is read only for a flush waiting.
        let flush = self.machine.send.flush_deadline().map(|d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        let resume = self
            .is_suspended()
            .then_some(Duration::from_millis(SUSPENDED_POLL_MS));
        earliest(earliest(self.conn.next_timeout(), flush), resume)
    }

    /// Whether a message (or a frame to take) is there for [`Session::try_recv`] without
    /// waiting.
    pub fn has_ready(&self) -> bool {
        !self.held.is_empty() || self.machine.recv.has_ready() || self.conn.has_ready()
    }

    /// Keeps what a call's wait took in for `recv`, holding no receive buffer. At
    /// [`SessionConfig::max_held_bytes`], the receiver parks the peer's frames unread (their
    /// buffers hold its credits: it stops sending) and receives hand over nothing more to be
    /// kept ([`Session::next_received`]) until `recv` takes some of what is kept.
    fn hold(&mut self, got: Result<Envelope>) {
        let got = got.map(|mut env| {
            env.release_credit();
            env
        });
        let body = got.as_ref().map_or(0, |env| env.body().len());
        if self.held.push(Some(()), got, body) {
            self.machine.recv.hold_back(true);
        }
    }

    /// The oldest message a call's wait kept; below the bound again, the peer's frames are
    /// taken in from the next receive on.
    fn take_held(&mut self) -> Option<Result<Envelope>> {
        let (got, _, freed) = self.held.pop()?;
        if freed {
            self.machine.recv.hold_back(false);
        }
        Some(got)
    }

    /// Whether [`Session::next_received`] has a message to hand out.
    fn has_received(&self) -> bool {
        self.machine.recv.has_ready() && !self.held.is_full(())
    }

    /// The next message the receiver has in order, unless what calls' waits keep is at its
    /// bound: then nothing (a receive hands out what is kept first, so only a call's wait
    /// gets here then, and it takes nothing more in).
    fn next_received(&mut self) -> Option<Result<Envelope>> {
        if self.held.is_full(()) {
            return None;
        }
        self.machine.recv.pop()
    }
}

impl AsFd for Session {
    /// The connection's descriptor (see [`Session::step`]).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.conn.as_fd()
    }
}
