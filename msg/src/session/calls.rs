//! A session's calls and the answers it gives: started, waited for with the peer's other
//! messages held meanwhile, answered at once or through the outbox (`peer/outbox.rs`).

use super::*;

impl Session {
    /// Calls the peer: sends `request` and waits for its answer, all within `timeout`
    /// ([`crate::Error::CallTimedOut`] past it; an answer that comes later is dropped and
    /// counted in [`CallStats::late`]). The answer is decoded with
    /// [`Envelope::decode_shared`]: its [`crate::Bulk`] fields share the received bytes.
    /// Messages that arrive meanwhile wait for [`Session::recv`], in order. The server side
    /// answers with the request's [`Responder`] ([`Envelope::responder`]).
    pub fn call<R>(&mut self, request: &R, timeout: Duration) -> Result<R::Response>
    where
        R: Request,
        R::Response: serde::de::DeserializeOwned,
    {
        let call = self.start_call(request, timeout)?;
        self.wait(call)
    }

    /// Starts a call (see [`Session::call`]) without waiting for its answer: many can be in
    /// flight, each waited for with [`Session::wait`] (or looked at with [`Call::is_done`]
    /// after a receive). Waits at most `timeout` for the credit to send the request, and the
    /// call's deadline is `timeout` from now; dropping the [`Call`] cancels it.
    pub fn start_call<R: Request>(
        &mut self,
        request: &R,
        timeout: Duration,
    ) -> Result<Call<R::Response>> {
        self.start_call_as(request, R::SOLICITED, timeout)
    }

    /// [`Session::start_call`] for a batch: every request but the last unsolicited, so the
    /// whole batch wakes the server once. One deadline, `timeout` from now, for all of them.
    pub fn start_calls<'a, R: Request + 'a>(
        &mut self,
        requests: impl IntoIterator<Item = &'a R>,
        timeout: Duration,
    ) -> Result<Vec<Call<R::Response>>> {
        let deadline = call::deadline(timeout);
        let mut requests = requests.into_iter().peekable();
        let mut calls = Vec::new();
        while let Some(r) = requests.next() {
            let last = requests.peek().is_none();
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            calls.push(self.start_call_until(r, last, timeout, left, deadline)?);
        }
        Ok(calls)
    }

    /// [`Session::start_call`], solicited or not as given.
    pub fn start_call_as<R: Request>(
        &mut self,
        request: &R,
        solicited: bool,
        timeout: Duration,
    ) -> Result<Call<R::Response>> {
        let deadline = call::deadline(timeout);
        self.start_call_until(request, solicited, timeout, timeout, deadline)
    }

    fn start_call_until<R: Request>(
        &mut self,
        request: &R,
        solicited: bool,
        timeout: Duration,
        left: Duration,
        deadline: Option<Instant>,
    ) -> Result<Call<R::Response>> {
        let id = call::lock(&self.calls).start::<R>(None);
        let out = CallOut {
            id,
            deadline,
            m: request,
        };
        let before = peer::Numbering::before(&self.machine.send);
        self.went_as = None;
        let sent = self.sending(Some(left), true, Some(false), |s| {
            peer::in_time(
                s.machine
                    .send_within(&mut s.conn, &out, solicited, Some(left)),
            )
        });
        let went = self
            .went_as
            .take()
            .or_else(|| before.went(&self.machine.send, &sent));
        call::started::<R>(&self.calls, id, sent, went, timeout, deadline)
    }

    /// [`Session::start_call`] only if the request can go without waiting: `Ok(None)`,
    /// nothing sent, if the peer has no credit or no send slot is free. For event loops and
    /// async runtimes.
    pub fn try_start_call<R: Request>(
        &mut self,
        request: &R,
        solicited: bool,
        timeout: Duration,
    ) -> Result<Option<Call<R::Response>>> {
        let deadline = call::deadline(timeout);
        let id = call::lock(&self.calls).start::<R>(None);
        let out = CallOut {
            id,
            deadline,
            m: request,
        };
        let before = peer::Numbering::before(&self.machine.send);
        self.went_as = None;
        let sent = self.try_send_as(&out, solicited);
        let went = self
            .went_as
            .take()
            .or_else(|| before.went(&self.machine.send, &sent));
        match went {
            Some(seq) => {
                call::started::<R>(&self.calls, id, Ok(true), Some(seq), timeout, deadline)
                    .map(Some)
            }
            None => {
                call::lock(&self.calls).forget(id);
                sent.map(|_| None)
            }
        }
    }

    call::call_waits! {
        /// Waits for `call`'s answer until its deadline, taking in what arrives meanwhile:
        /// messages (and the errors that come in their place) wait for [`Session::recv`], in
        /// order, out of their receive buffers so that they hold none of the peer's credits.
        /// Handing them out of the session counts them taken in the delivery record. The
        /// deadline is judged on what has arrived: an answer already in the connection when the
        /// caller comes to wait, past the deadline (its thread busy elsewhere), is the answer.
        ///
        /// What is kept so is bounded ([`SessionConfig::max_held_bytes`]): at the bound the wait
        /// takes nothing more in, the peer's messages stay in their receive buffers with its
        /// credits, and a peer that keeps sending stops. An answer behind them is then not seen:
        /// the call ends at its deadline, unless the connection fails first.
        wait;
        /// Waits for the first of `calls` to end (its answer, its failure or its deadline),
        /// taking in what arrives meanwhile as [`Session::wait`] does: removes it from `calls`
        /// and returns where it was and what it came to; `None` once `calls` is empty.
        wait_any;
        /// The call's answer if it is in, without waiting or receiving (`None`: not yet; it
        /// stays under way). In an event loop, [`Session::poll_calls`] takes answers in.
        try_wait;
        /// The answer of a call whose waiter gave up (an async timeout): its answer if it came
        /// meanwhile, else [`crate::Error::CallTimedOut`] (and the call is counted timed out).
        expire;
    }

    /// Bytes of the messages calls' waits took in and keep for the next receive (their
    /// bodies and a few dozen bytes each): at most [`SessionConfig::max_held_bytes`] and one
    /// message.
    pub fn held_bytes(&self) -> usize {
        self.held.bytes(())
    }

    /// Takes in, without waiting, everything that has arrived: answers go to their calls,
    /// messages wait for [`Session::recv`] (or [`Session::try_recv`]), as a call's wait keeps
    /// them (within [`SessionConfig::max_held_bytes`]: at the bound it takes nothing in).
    /// Whether it took in any message. For event loops and async runtimes that wait for
    /// calls.
    pub fn poll_calls(&mut self) -> Result<bool> {
        let before = self.held.len();
        loop {
            let got = self.try_recv_inner();
            self.took();
            match got {
                Ok(Some(env)) => self.hold(Ok(env)),
                Ok(None) => break,
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => self.hold(Err(e)),
            }
        }
        Ok(self.held.len() != before)
    }

    /// Answers a request received on this session at once, on this thread: `value` is sent
    /// as [`Session::send`] sends (waiting for a credit if need be). From another thread, use
    /// [`Responder::respond`]. [`crate::Error::ForeignResponder`] for the responder of a
    /// request another session or hub received (nothing is sent).
    pub fn reply<T: Message>(&mut self, responder: Responder<T>, value: &T) -> Result<()> {
        let Some(origin) = responder.into_origin() else {
            return Ok(());
        };
        if !Arc::ptr_eq(&origin.replies, &self.replies) {
            // Dropped: it answers "no answer" through its own session.
            return Err(crate::Error::ForeignResponder);
        }
        let (id, _) = origin.disarm();
        let out = call::ReplyOut {
            id,
            status: 0,
            value: Some(value),
        };
        self.sending(None, (), None, |s| {
            s.machine.send_as(&mut s.conn, &out, true)
        })
    }

    /// Whether answers given by [`Responder`]s wait to be sent (they go with the next call
    /// that drives the session: a receive, a [`Session::step`], ...).
    pub fn answers_waiting(&self) -> bool {
        self.replies.waiting() || !self.machine.outbox.is_empty()
    }

    /// Runs `hook` whenever a [`Responder`] of this session answers (on the answering
    /// thread, after the session's descriptor was made readable): for drivers, such as async
    /// runtimes, that drive the session only while someone waits on it and must make sure
    /// the answer goes even when nobody does.
    pub fn on_answer(&mut self, hook: impl Fn() + Send + Sync + 'static) {
        self.replies.set_hook(Arc::new(hook));
    }

    /// Counts of calls made and served.
    pub fn call_stats(&self) -> CallStats {
        CallStats {
            expired: self.replies.expired(),
            ..call::lock(&self.calls).stats()
        }
    }

    /// A received message, as the application sees it: a request unwrapped (with where its
    /// answer goes), an answer handed to its call (`None`).
    pub(super) fn route(&mut self, env: Envelope) -> Result<Option<Envelope>> {
        if env.tag() == call::CALL_TAG && !self.replies.has_waker() {
            // The first request: answers from other threads must wake us from now on.
            if let Ok(w) = self.conn.waker() {
                self.replies.set_waker(w);
            }
        }
        match call::route(
            env,
            None,
            &self.calls,
            &self.replies,
            self.machine.recv.decoder(),
        )? {
            call::Routed::Deliver(env) => Ok(Some(env)),
            call::Routed::Consumed => {
                self.answer_watch.answer_came();
                Ok(None)
            }
        }
    }

    /// Sends the answers given on other threads that can go now, in order, keeping the rest
    /// in the outbox (within [`SessionConfig::max_outbox_bytes`]: an answer that does not
    /// fit becomes "no answer", a few bytes let past the bound, so that its caller learns
    /// at once; one that cannot be encoded or sent is dropped and counted, and its caller
    /// waits for its deadline). Never waits: a peer that takes nothing costs the bound and
    /// no receive's time.
    pub(super) fn send_replies(&mut self) -> Result<()> {
        self.queue_replies();
        self.machine.learn_note(&self.conn);
        let sent = self
            .machine
            .outbox
            .send_ready(&mut self.machine.send, &mut self.conn);
        self.settle_replies(sent)
    }

    /// Moves the answers given on other threads into the outbox.
    pub(super) fn queue_replies(&mut self) {
        for r in self.replies.take() {
            let no_answer = || Box::new(call::no_answer(r.id)) as _;
            if !self.machine.outbox.push_answer(r.msg, no_answer).0 {
                call::lock(&self.calls).answer_dropped();
            }
        }
    }

    /// Counts what a send of the outbox dropped; a failed connection drops the rest.
    pub(super) fn settle_replies(&mut self, sent: Result<u64>) -> Result<()> {
        match sent {
            Ok(dropped) => {
                let mut calls = call::lock(&self.calls);
                for _ in 0..dropped {
                    calls.answer_dropped();
                }
                Ok(())
            }
            // A session that suspends keeps its answers for the new connection; the loss
            // comes from the next receive.
            Err(_) if self.resume.is_some() && (self.suspended || self.suspends()) => Ok(()),
            Err(e) => {
                let lost = self.machine.outbox.clear();
                self.drop_replies(lost);
                Err(e)
            }
        }
    }

    /// The connection failed: answers waiting to go never will (`lost` of them dropped from
    /// the outbox, and those not queued yet).
    pub(super) fn drop_replies(&mut self, lost: usize) {
        let lost = lost + self.replies.take().len();
        if lost > 0 {
            let mut calls = call::lock(&self.calls);
            for _ in 0..lost {
                calls.answer_dropped();
            }
        }
    }
}

impl call::CallHost for Session {
    fn take_in(&mut self) {
        let _ = self.poll_calls();
    }

    fn wait_in(&mut self, left: Option<Duration>) -> Result<()> {
        self.answer_watch.begin();
        let got = self.recv_inner(left);
        self.answer_watch.end();
        self.took();
        match got {
            Ok(Some(env)) => self.hold(Ok(env)),
            Ok(None) => {}
            Err(e) if e.is_fatal() => return Err(e),
            // Its place in the order, for `recv`.
            Err(e) => self.hold(Err(e)),
        }
        Ok(())
    }
}
