//! Posting without waiting: each peer's outbox (`peer/outbox.rs`), answers given on other
//! threads, and the hub's sends of them as credits come.

use super::*;

impl Hub {
    /// Sends `m` to `peer` without ever waiting: at once if it can go (nothing queued before
    /// it, a credit and a send slot free), else queued in `peer`'s outbox behind what waits
    /// there, within [`SessionConfig::max_outbox_bytes`]; beyond that, handed back
    /// ([`Posted::Full`]), and [`HubEvent::Writable`] tells when there is room. Queued
    /// messages go in order as the peer's credits come, driven by the hub's later calls
    /// ([`Hub::recv`], [`Hub::try_recv`], [`Hub::step`]). So one slow or stalled peer costs
    /// its outbox's memory and nothing else: the thread serving every peer never waits for
    /// it. What is still queued when the peer disconnects is dropped (counted in
    /// [`OutboxStats::dropped`]).
    pub fn post<M: Message + Send + 'static>(&mut self, peer: PeerId, m: M) -> Result<Posted<M>> {
        self.post_as(peer, m, M::SOLICITED)
    }

    /// [`Hub::post`], solicited or not as given.
    pub fn post_as<M: Message + Send + 'static>(
        &mut self,
        peer: PeerId,
        m: M,
        solicited: bool,
    ) -> Result<Posted<M>> {
        self.post_owned(peer, m, solicited, None)
    }

    /// Posts call `id`'s request (see [`Hub::try_start_call`]): the call learns the number
    /// its request goes under, when it goes, for its failure to say what became of it.
    pub(super) fn post_call<M: Message + Send + 'static>(
        &mut self,
        peer: PeerId,
        m: M,
        id: u64,
    ) -> Result<Posted<M>> {
        self.post_owned(peer, m, M::SOLICITED, Some(id))
    }

    fn post_owned<M: Message + Send + 'static>(
        &mut self,
        peer: PeerId,
        m: M,
        solicited: bool,
        call: Option<u64>,
    ) -> Result<Posted<M>> {
        let Some(empty) = self.outbox_empty(peer) else {
            return Ok(Posted::PeerGone(m));
        };
        if empty {
            let mut went = None;
            let sent =
                peer::went(
                    self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
                        let before = peer::Numbering::before(s);
                        let sent = s.try_send_as(link, &m, solicited);
                        went = before.went(s, &sent);
                        sent
                    }),
                );
            if let (Some(id), Some(seq)) = (call, went) {
                call::lock(&self.calls).request_sent(id, seq);
            }
            match sent {
                Ok(true) => return Ok(Posted::Sent),
                Ok(false) => {}
                // It went (in part, at least) before the peer failed: sent, its fate is the
                // peer's record's (`Disconnected`, `Unconfirmed`), not handed back twice.
                Err(_) if went.is_some() => return Ok(Posted::Sent),
                // Its session resumes: the message waits in the outbox.
                Err(_) if self.is_suspended(peer) => {}
                // The send itself found the peer gone (or failed it): as when that was
                // known before, not an error (issue 45: a job queue's coordinator exited on it).
                Err(_) if self.outbox_empty(peer).is_none() => return Ok(Posted::PeerGone(m)),
                // This message alone (too large, not encodable).
                Err(e) => return Err(e),
            }
        }
        let size = call::encoded_len(&m);
        if !self.room(peer, size) {
            self.state(peer).machine.outbox.refuse();
            return Ok(Posted::Full(m));
        }
        let owned = Owned { m, solicited };
        match call {
            Some(id) => self.queue(peer, Box::new(peer::CallRequest { owned, id }), size),
            None => self.queue(peer, Box::new(owned), size),
        }
        Ok(Posted::Queued)
    }

    /// Whether `peer`'s outbox is empty; `None` for a peer gone (failed).
    pub(super) fn outbox_empty(&mut self, peer: PeerId) -> Option<bool> {
        if self.is_suspended(peer) {
            // Not gone: what is posted waits in its outbox for the resume.
            return Some(false);
        }
        if peer::hub_peer_gone(&self.transport, peer) {
            return None;
        }
        Some(
            self.peers
                .get(peer)
                .map_or(true, |s| s.machine.outbox.is_empty()),
        )
    }

    /// Whether `peer`'s outbox has room for `size` more bytes (one message always fits an
    /// empty one).
    pub(super) fn room(&mut self, peer: PeerId, size: usize) -> bool {
        self.state(peer).machine.outbox.has_room(size)
    }

    /// An answer to `peer`'s call `id` could not be queued (no room): "no answer" goes in its
    /// place, past the bound (a few bytes, one per request the peer sent), so that the caller
    /// does not wait for its deadline. Counted dropped.
    pub(super) fn refuse_answer(&mut self, peer: PeerId, id: u64) {
        call::lock(&self.calls).answer_dropped();
        if self
            .state(peer)
            .machine
            .outbox
            .refuse_answer(Box::new(call::no_answer(id)))
        {
            self.outboxed.push(peer);
        }
    }

    /// Queues `msg` in `peer`'s outbox (room checked by the caller).
    pub(super) fn queue(&mut self, peer: PeerId, msg: Box<dyn Outgoing>, size: usize) {
        if self.state(peer).machine.outbox.push(msg, size) {
            self.outboxed.push(peer);
        }
    }

    /// Sends what the outboxes hold as far as credits allow, in order per peer, never
    /// waiting; queues the answers given on other threads first. `now` is the time of the
    /// hub's turn, if it has one (the clock is read only for closes waiting).
    pub(super) fn drain_outboxes_at(&mut self, now: Option<Instant>) {
        if !self.untold.is_empty() {
            self.tell_counts();
        }
        self.queue_replies();
        self.send_outboxes();
        // Closes waiting for their outboxes go once those went.
        if !self.closing.is_empty() {
            self.finish_closes(now.unwrap_or_else(Instant::now));
        }
    }

    /// Moves the answers given on other threads into their peers' outboxes.
    pub(super) fn queue_replies(&mut self) {
        if self.replies.waiting() {
            for r in self.replies.take() {
                let Some(peer) = r.peer else { continue };
                if self.peers.get(peer).is_none()
                    || (self.transport.failure(peer).is_some() && !self.is_suspended(peer))
                {
                    // Gone: its calls failed on its side.
                    call::lock(&self.calls).answer_dropped();
                    continue;
                }
                let no_answer = || Box::new(call::no_answer(r.id)) as _;
                let (kept, first) = self
                    .state(peer)
                    .machine
                    .outbox
                    .push_answer(r.msg, no_answer);
                if !kept {
                    call::lock(&self.calls).answer_dropped();
                }
                if first {
                    self.outboxed.push(peer);
                }
            }
        }
    }

    /// Sends what the outboxes hold as far as credits allow, in order per peer.
    pub(super) fn send_outboxes(&mut self) {
        let mut i = 0;
        while i < self.outboxed.len() {
            let peer = self.outboxed[i];
            if self.is_suspended(peer) {
                // Its outbox goes once it resumes.
                i += 1;
                continue;
            }
            let (writable, listed, empty) = {
                let Some((state, mut link)) = self.split(peer) else {
                    self.outboxed.swap_remove(i);
                    continue;
                };
                state.machine.learn_note(&link);
                // A failing peer: its Disconnected tells (and drops the rest). A message
                // failing alone (too large, not encodable) is dropped and counted.
                let _ = state
                    .machine
                    .outbox
                    .send_ready(&mut state.machine.send, &mut link);
                let writable = state.machine.outbox.take_writable();
                (writable, state.join_list(), state.machine.outbox.is_empty())
            };
            if let Some(state) = self.peers.get_mut(peer) {
                // Calls whose requests went learn their numbers.
                let mut calls = None;
                for (id, seq) in state.machine.outbox.take_calls_sent() {
                    calls
                        .get_or_insert_with(|| call::lock(&self.calls))
                        .request_sent(id, seq);
                }
            }
            if writable {
                self.ready.push_back((HubEvent::Writable { peer }, None));
            }
            if listed {
                self.unflushed.push(peer);
            }
            if empty {
                self.outboxed.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Whether outboxes hold messages, or answers given by [`Responder`]s wait to be queued:
    /// they go as credits come, with the calls that drive the hub ([`Hub::recv`],
    /// [`Hub::step`], ...).
    pub fn outboxes_waiting(&self) -> bool {
        !self.outboxed.is_empty() || self.replies.waiting()
    }

    /// Runs `hook` whenever a [`Responder`] of this hub answers (see
    /// [`crate::Session::on_answer`]).
    pub fn on_answer(&mut self, hook: impl Fn() + Send + Sync + 'static) {
        self.replies.set_hook(Arc::new(hook));
    }

    /// Every outbox's counts in all, peers gone included (`messages` and `bytes`: what
    /// waits now).
    pub fn outbox_totals(&self) -> OutboxStats {
        let mut total = self.departed_outboxes;
        total.messages = 0;
        total.bytes = 0;
        for s in self.peers.values() {
            total.add(&s.machine.outbox.stats());
        }
        total
    }

    /// `peer`'s outbox ([`Hub::post`]); `None` for a peer unknown or gone.
    pub fn outbox(&self, peer: PeerId) -> Option<OutboxStats> {
        self.peers.get(peer).map(|s| s.machine.outbox.stats())
    }

    /// Answers a request received from a peer at once, on the hub's thread, as
    /// [`Hub::post`] sends: never waiting; queued in the peer's outbox if it cannot go now;
    /// if that is full, dropped (counted in [`OutboxStats::dropped`]; the caller is told
    /// "no answer" at once, [`Error::NoAnswer`]) and the value handed back. From another thread, use
    /// [`Responder::respond`].
    pub fn reply<T: Message + Send + 'static>(
        &mut self,
        responder: Responder<T>,
        value: T,
    ) -> Result<Posted<T>> {
        self.answer(responder, value)
    }

    /// Answers a request with `answer`, the answer of a call this hub made (see
    /// [`Hub::forward`]), as it came: its body goes on undecoded, as [`Hub::reply`] sends
    /// (never waiting; queued in the outbox, a copy; handed back if that is full).
    /// [`Error::WrongType`] if `answer` is not a `T`, the request's response type.
    pub fn reply_with<T: Message>(
        &mut self,
        responder: Responder<T>,
        answer: Envelope,
    ) -> Result<Posted<Envelope>> {
        if !answer.is::<T>() {
            return Err(crate::codec::wrong_type::<T>(
                answer.tag(),
                answer.type_name(),
            ));
        }
        self.answer(responder, answer)
    }

    /// Sends `value` as the answer to `responder`'s request ([`Hub::reply`], [`Hub::reply_with`]).
    fn answer<T: Message, A: Answer>(
        &mut self,
        responder: Responder<T>,
        value: A,
    ) -> Result<Posted<A>> {
        let Some(origin) = responder.into_origin() else {
            return Ok(Posted::Sent);
        };
        if !Arc::ptr_eq(&origin.replies, &self.replies) {
            // Dropped: it answers "no answer" through its own session or hub.
            return Err(crate::Error::ForeignResponder);
        }
        let (id, peer) = origin.disarm();
        let peer = peer.ok_or(crate::Error::ForeignResponder)?;
        let Some(empty) = self
            .outbox_empty(peer)
            .filter(|_| self.peers.get(peer).is_some())
        else {
            // Gone (its Disconnected says so): the answer cannot go.
            call::lock(&self.calls).answer_dropped();
            return Ok(Posted::PeerGone(value));
        };
        if empty {
            let sent = self.with_sender_waiting(peer, Some(Duration::ZERO), |s, link| {
                value.send_now(id, &mut |out| s.try_send_as(link, out, true))
            });
            match sent {
                Ok(true) => return Ok(Posted::Sent),
                Ok(false) | Err(crate::Error::Transport(rdmsg_transport::Error::Timeout(_))) => {}
                // Its session resumes: the answer waits in the outbox.
                Err(_) if self.is_suspended(peer) => {}
                Err(_) if self.outbox_empty(peer).is_none() => {
                    call::lock(&self.calls).answer_dropped();
                    return Ok(Posted::PeerGone(value));
                }
                // This answer alone (too large, not encodable): the caller hears "no answer".
                Err(e) => {
                    self.refuse_answer(peer, id);
                    return Err(e);
                }
            }
        }
        let size = value.size(id);
        if !self.room(peer, size) {
            self.refuse_answer(peer, id);
            return Ok(Posted::Full(value));
        }
        match value.owned(id) {
            Ok(reply) => self.queue(peer, reply, size),
            Err(e) => {
                // This answer alone: the caller hears "no answer".
                self.refuse_answer(peer, id);
                return Err(e);
            }
        }
        Ok(Posted::Queued)
    }
}

/// What [`Hub::reply`] and [`Hub::reply_with`] send: a value, or an answer as it came.
trait Answer: Sized {
    /// Sends it as the answer to call `id` through `send`, without keeping it.
    fn send_now(&self, id: u64, send: &mut dyn FnMut(&dyn Encode) -> Result<bool>) -> Result<bool>;
    /// Its encoded size, as the answer to call `id`.
    fn size(&self, id: u64) -> usize;
    /// It owned by an outbox, as the answer to call `id`.
    fn owned(self, id: u64) -> Result<Box<dyn Outgoing>>;
}

impl<T: Message + Send + 'static> Answer for T {
    fn send_now(&self, id: u64, send: &mut dyn FnMut(&dyn Encode) -> Result<bool>) -> Result<bool> {
        send(&call::ReplyOut {
            id,
            status: 0,
            value: Some(self),
        })
    }
    fn size(&self, id: u64) -> usize {
        call::encoded_len(&call::ReplyOut {
            id,
            status: 0,
            value: Some(self),
        })
    }
    fn owned(self, id: u64) -> Result<Box<dyn Outgoing>> {
        Ok(Box::new(OwnedReply {
            id,
            status: 0,
            value: Some(self),
        }))
    }
}

impl Answer for Envelope {
    fn send_now(&self, id: u64, send: &mut dyn FnMut(&dyn Encode) -> Result<bool>) -> Result<bool> {
        send(&call::forwarded_answer(id, self.body())?)
    }
    fn size(&self, id: u64) -> usize {
        call::forwarded_answer(id, self.body()).map_or(self.body().len(), |f| f.size_of())
    }
    fn owned(self, id: u64) -> Result<Box<dyn Outgoing>> {
        Ok(Box::new(call::forwarded_answer(id, self.body().to_vec())?))
    }
}
