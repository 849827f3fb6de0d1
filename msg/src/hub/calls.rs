//! A hub's calls: started to a peer, waited for with the hub's events kept meanwhile.

use super::*;

impl Hub {
    /// Calls `peer` (see [`crate::Session::call`]): sends `request` and waits for its
    /// answer, all within `timeout`, driving the hub meanwhile (events that come wait for
    /// [`Hub::recv`], in order).
    pub fn call<R>(&mut self, peer: PeerId, request: &R, timeout: Duration) -> Result<R::Response>
    where
        R: Request,
        R::Response: serde::de::DeserializeOwned,
    {
        let call = self.start_call(peer, request, timeout)?;
        self.wait(call)
    }

    /// Starts a call to `peer` without waiting for its answer (see
    /// [`crate::Session::start_call`]): waits at most `timeout` to send the request;
    /// `Duration::ZERO`-bounded sends are [`Hub::try_start_call`].
    pub fn start_call<R: Request>(
        &mut self,
        peer: PeerId,
        request: &R,
        timeout: Duration,
    ) -> Result<Call<R::Response>> {
        let deadline = call::deadline(timeout);
        let id = call::lock(&self.calls).start::<R>(Some(peer));
        let out = CallOut {
            id,
            deadline,
            m: request,
        };
        self.send_call::<R>(peer, id, &out, timeout, deadline)
    }

    /// Forwards `request`, a request of type `R` received from a peer, to `peer` as it came:
    /// its body is not decoded nor encoded again, only copied (straight into a send buffer
    /// when it fits), or, for an envelope [`Envelope::detach`]ed, lent by reference when it
    /// goes by rendezvous, under a call of this hub's, waited for as any call or
    /// [`Hub::watch`]ed. The call's deadline is the sooner of `timeout` from now and the
    /// original caller's ([`Responder::deadline`]), read from the envelope while it still
    /// holds its responder: forward first, then take the responder
    /// ([`Envelope::responder`]) to answer the original caller with this call's answer as it
    /// came ([`Hub::reply_with`]). [`Error::WrongType`] if `request` is not an `R`;
    /// [`Error::CallFailed`] with [`crate::RequestFate::NotSent`] if `peer` failed or is gone
    /// and nothing went.
    pub fn forward<R: Request>(
        &mut self,
        peer: PeerId,
        request: &Envelope,
        timeout: Duration,
    ) -> Result<Call<R::Response>> {
        if !request.is::<R>() {
            return Err(crate::codec::wrong_type::<R>(
                request.tag(),
                request.type_name(),
            ));
        }
        let deadline = crate::drive::earliest(call::deadline(timeout), request.call_deadline());
        let timeout = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
        let id = call::lock(&self.calls).start::<R>(Some(peer));
        let forget = |e| {
            call::lock(&self.calls).forget(id);
            e
        };
        // A detached body goes by reference (no copy when it goes by rendezvous).
        match request.shared_body() {
            Some(body) => {
                let out = call::forwarded_request(id, R::TAG, deadline, body).map_err(forget)?;
                self.send_call::<R>(peer, id, &out, timeout, deadline)
            }
            None => {
                let out = call::forwarded_request(id, R::TAG, deadline, request.body())
                    .map_err(forget)?;
                self.send_call::<R>(peer, id, &out, timeout, deadline)
            }
        }
    }

    /// Sends call `id`'s request `out` to `peer`, waiting at most `timeout` for room: the
    /// call, once it went.
    fn send_call<R: Request>(
        &mut self,
        peer: PeerId,
        id: u64,
        out: &(impl Encode + ?Sized),
        timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<Call<R::Response>> {
        let (mut went, mut nothing_went) = (None, true);
        let sent = self.with_sender_resuming(peer, Some(timeout), true, Some(false), |s, link| {
            let before = peer::Numbering::before(s);
            let sent = peer::in_time(s.send_within(link, out, R::SOLICITED, Some(timeout)));
            went = went.or(before.went(s, &sent));
            nothing_went &= before.nothing_went(s);
            sent
        });
        // A failure after something went (the request, or committed messages before it
        // whose sending the failure cut short) makes no claim about the request.
        let sent = sent.map_err(|e| match nothing_went {
            true => call::never_sent::<R>(peer, e),
            false => e,
        });
        call::started::<R>(&self.calls, id, sent, went, timeout, deadline)
    }

    /// Starts a call to `peer` without ever waiting (see [`Hub::post`]): the request goes at
    /// once or waits in `peer`'s outbox; `Ok(None)` if the outbox is full (nothing sent).
    /// The call's deadline is `timeout` from now, whatever the outbox.
    pub fn try_start_call<R: Request + Clone + Send + 'static>(
        &mut self,
        peer: PeerId,
        request: &R,
        timeout: Duration,
    ) -> Result<Option<Call<R::Response>>> {
        let deadline = call::deadline(timeout);
        let id = call::lock(&self.calls).start::<R>(Some(peer));
        let out = call::CallOwned {
            id,
            deadline,
            request: request.clone(),
        };
        let request = std::any::type_name::<R>();
        match self.post_call(peer, out, id) {
            Ok(Posted::Sent | Posted::Queued) => Ok(Some(Call::new(
                id,
                self.calls.clone(),
                request,
                timeout,
                deadline,
            ))),
            Ok(Posted::Full(_)) => {
                call::lock(&self.calls).forget(id);
                Ok(None)
            }
            Ok(Posted::PeerGone(_)) => {
                call::lock(&self.calls).forget(id);
                let gone = rdmsg_transport::Error::UnknownPeer(peer).into();
                Err(call::never_sent::<R>(peer, gone))
            }
            Err(e) => {
                call::lock(&self.calls).forget(id);
                Err(call::never_sent::<R>(peer, e))
            }
        }
    }

    /// Hands `call` to the hub: its end comes as a [`HubEvent::CallEnded`] among the hub's
    /// other events (its answer, its failure, or its deadline passing, each once), so that a
    /// thread serving its peers waits for the calls it made in the same [`Hub::recv`], without
    /// polling. Returns the call's number, which the event carries. The hub keeps the call
    /// until then; dropped with the hub, it is cancelled. A call whose peer's failure the hub
    /// has taken in already ends at once, its event then after the peer's `Disconnected` if
    /// that was handed out (or kept by a call's wait) before; a call whose outcome was taken
    /// already ([`Hub::try_wait`]) has ended and gives no event. [`Error::ForeignCall`] for a
    /// call of another session or hub.
    pub fn watch<T>(&mut self, call: Call<T>) -> Result<u64> {
        let id = call.id();
        let call = call.erase();
        if !call.started_by(&self.calls) {
            return Err(Error::ForeignCall);
        }
        let watched = call::lock(&self.calls).watch(id);
        if let Some(Some(peer)) = watched {
            if let Some(d) = call.deadline() {
                self.watch_deadlines.insert((d, id));
            }
            self.watched.insert(id, (peer, call));
            self.queue_ended_calls();
        }
        Ok(id)
    }

    /// The nearest deadline of a watched call.
    #[inline]
    pub(super) fn watch_deadline(&self) -> Option<Instant> {
        self.watch_deadlines.first().map(|&(d, _)| d)
    }

    /// Queues the events of watched calls whose outcome came in (an answer routed, a peer
    /// failed).
    pub(super) fn queue_ended_calls(&mut self) {
        let ended = {
            let mut table = call::lock(&self.calls);
            if !table.any_ended() {
                return;
            }
            table.take_ended()
        };
        for id in ended {
            self.end_watched(id, |call| {
                call.take_outcome().map(call::Outcome::into_result)
            });
        }
    }

    /// Ends the watched calls whose deadline has passed by `now` (an answer already in is
    /// their end all the same); whether it queued any event. Run once what has arrived is
    /// taken in: a deadline is judged on that, as [`Hub::wait`] judges it.
    pub(super) fn expire_watched(&mut self, now: Instant) -> bool {
        let mut queued = false;
        while let Some(&(d, id)) = self.watch_deadlines.first() {
            if d > now {
                break;
            }
            self.watch_deadlines.pop_first();
            queued |= self.end_watched(id, |call| {
                Some(match call.take_outcome() {
                    Some(outcome) => outcome.into_result(),
                    None => Err(call.timed_out()),
                })
            });
        }
        queued
    }

    /// Ends watched call `id` (if the hub still watches it) with what `result` makes of it
    /// (`None`: nothing to hand out): its [`HubEvent::CallEnded`] queued; whether it was.
    fn end_watched(
        &mut self,
        id: u64,
        result: impl FnOnce(&Call<()>) -> Option<Result<Envelope>>,
    ) -> bool {
        let Some((peer, call)) = self.watched.remove(&id) else {
            return false;
        };
        if let Some(d) = call.deadline() {
            self.watch_deadlines.remove(&(d, id));
        }
        let Some(result) = result(&call) else {
            return false;
        };
        self.ready.push_back((
            HubEvent::CallEnded {
                peer,
                call: id,
                result,
            },
            None,
        ));
        true
    }

    call::call_waits! {
        /// Waits for `call`'s answer until its deadline, driving the hub (events wait for
        /// [`Hub::recv`]). As in [`crate::Session::wait`], an answer already here when the
        /// deadline is judged is the answer.
        wait;
        /// Waits for the first of `calls` to end (see [`crate::Session::wait_any`]), driving the
        /// hub (events wait for [`Hub::recv`]). Each peer's events kept so are bounded by
        /// [`SessionConfig::max_held_bytes`]: a peer at its bound is taken nothing more from (its
        /// messages stay in their receive buffers with its credits, so it stops; a call to it
        /// ends at its deadline if its answer is behind them), while the others go on.
        wait_any;
        /// The call's answer if it is in, without waiting (`None`: not yet).
        try_wait;
        /// The answer of a call whose waiter gave up (see [`crate::Session::expire`]).
        expire;
    }

    /// Takes in, without waiting, everything that has happened: answers go to their calls,
    /// other events wait for [`Hub::recv`] (or [`Hub::try_recv`]), each peer's within
    /// [`SessionConfig::max_held_bytes`] (see [`Hub::wait_any`]). Whether it took in any
    /// event. For event loops and async runtimes that wait for calls.
    pub fn poll_calls(&mut self) -> Result<bool> {
        let before = self.held.len();
        self.holding = true;
        let out = loop {
            match self.try_recv() {
                Ok(Some(ev)) => self.keep(ev),
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.holding = false;
        out.map(|()| self.held.len() != before)
    }

    /// Keeps an event a call's wait took in for [`Hub::recv`], its message out of its
    /// receive buffer (whose credit the peer may need to send the answer). Once a peer's
    /// kept events reach [`SessionConfig::max_held_bytes`], its frames are parked unread
    /// (their buffers hold its credits: it stops sending) and nothing more of it is queued
    /// ([`Hub::collect`]), until [`Hub::recv`] takes some of what is kept; other peers go on.
    pub(super) fn keep(&mut self, ev: HubEvent) {
        let (who, body, ev) = match ev {
            HubEvent::Message { peer, mut msg } => {
                msg.release_credit();
                let body = msg.body().len();
                (Some(peer), body, HubEvent::Message { peer, msg })
            }
            HubEvent::BadFrame { peer, error } => {
                (Some(peer), 0, HubEvent::BadFrame { peer, error })
            }
            // Once per connection, or the hub's own doing.
            ev => (None, 0, ev),
        };
        if self.held.push(who, ev, body) {
            if let Some(peer) = who {
                if let Some(state) = self.peers.get_mut(peer) {
                    state.machine.recv.hold_back(true);
                }
                // The buffers its parked frames keep are lent out of the pool every peer
                // shares: returning its credits would let it draw the pool dry.
                self.transport.hold_back(peer, true);
            }
        }
    }

    /// The oldest event a call's wait kept (none while a call's wait receives: what it takes
    /// goes behind them). A peer below its bound again has its frames taken in.
    pub(super) fn take_held(&mut self) -> Option<HubEvent> {
        if self.holding {
            return None;
        }
        let (ev, who, freed) = self.held.pop()?;
        if let (true, Some(peer)) = (freed, who) {
            if let Some(state) = self.peers.get_mut(peer) {
                state.machine.recv.hold_back(false);
                if !self.reads_waiting.contains(&peer) {
                    self.reads_waiting.push(peer);
                }
            }
            self.transport.hold_back(peer, false);
        }
        Some(ev)
    }

    /// Bytes of `peer`'s messages that calls' waits took in and keep for the next receive
    /// (their bodies and a few dozen bytes each): at most
    /// [`SessionConfig::max_held_bytes`] and one message.
    pub fn held_bytes(&self, peer: PeerId) -> usize {
        self.held.bytes(peer)
    }

    /// Counts of calls made and served, over every peer, present and past.
    pub fn call_stats(&self) -> CallStats {
        CallStats {
            expired: self.replies.expired(),
            ..call::lock(&self.calls).stats()
        }
    }

    /// Counts of calls to `peer` and of its requests served here, while it is connected
    /// (in flight, late answers, ...); `None` for a peer unknown or gone.
    pub fn peer_call_stats(&self, peer: PeerId) -> Option<CallStats> {
        self.peers.get(peer)?;
        Some(call::lock(&self.calls).peer_stats(peer))
    }
}

impl call::CallHost for Hub {
    fn take_in(&mut self) {
        // The hub's own failure comes from the next receive.
        let _ = self.poll_calls();
    }

    fn wait_in(&mut self, left: Option<Duration>) -> Result<()> {
        self.holding = true;
        self.answer_watch.begin();
        let got = self.recv_timeout(left);
        self.answer_watch.end();
        self.holding = false;
        // An error is the hub's own failure.
        if let Some(ev) = got? {
            self.keep(ev);
        }
        Ok(())
    }
}
