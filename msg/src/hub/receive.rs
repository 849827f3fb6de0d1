//! A hub's receives: the transport's events taken in, peers' frames routed to their
//! receiving sides, messages handed out in order with the held ones first.

use super::*;

impl Hub {
    /// The next event, waiting as long as it takes. An `Err` is the hub's own failure, which
    /// every later call reports too.
    ///
    /// Before it waits, every peer sent something unsolicited since its last solicited frame
    /// is flushed, as [`crate::Session::recv`] does, without waiting for any one of them
    /// (counted in [`SessionStats::wait_flushes`]).
    pub fn recv(&mut self) -> Result<HubEvent> {
        crate::drive::wait_until_some(|| self.recv_timeout(None))
    }

    /// The next event, waiting at most `timeout` (`None`: as long as it takes); `Ok(None)` if
    /// nothing happened in time.
    pub fn recv_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<HubEvent>> {
        // The clock is read once per turn of the loop below (each wait ends one): by the first
        // turn that needs it, then by the hub when its wait ends (`turn`).
        let mut turn = None;
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| {
            let now = Instant::now();
            turn = Some(now);
            now.checked_add(t)
        });
        if let Some(ev) = self.take_held() {
            return Ok(Some(ev));
        }
        loop {
            if let Some(ev) = self.take_ready() {
                return Ok(Some(ev));
            }
            if self.answer_watch.take() {
                return Ok(None);
            }
            let now = turn.take().unwrap_or_else(Instant::now);
            self.advance_reads(now);
            self.drain_outboxes_at(Some(now));
            if let Some(ev) = self.take_ready() {
                return Ok(Some(ev));
            }
            let mut left = deadline.map(|d| d.saturating_duration_since(now));
            if !self.unflushed.is_empty() {
                if let Some(ev) = self.try_recv()? {
                    return Ok(Some(ev));
                }
                let (stuck, nearest) = self.flush_before_wait(now);
                // A send slot frees as soon as an earlier send completes: look again soon.
                let retry = if stuck {
                    Some(UNFLUSHED_RETRY)
                } else {
                    nearest.map(|d| d.saturating_duration_since(now))
                };
                if let Some(r) = retry {
                    left = Some(left.map_or(r, |l| l.min(r)));
                }
                // Closes that waited for those frames go now, not at their deadlines.
                if !self.closing.is_empty() {
                    self.finish_closes(now);
                    if let Some(ev) = self.take_ready() {
                        return Ok(Some(ev));
                    }
                }
            }
            // A close waiting for its peer ends at its deadline, event or not; so do a
            // message in reassembly whose sender stalled and a watched call.
            let watch = self.watch_deadline();
            for at in self
                .earliest_close()
                .into_iter()
                .chain(self.reassembly_at)
                .chain(watch)
            {
                let r = at.saturating_duration_since(now);
                left = Some(left.map_or(r, |l| l.min(r)));
            }
            // An outbox waiting for credits: its failed send armed the hub to wake for the
            // grant (or the send completion) that lets it go, which is no event: `wait`
            // returns after any wake-up.
            if self.answer_watch.take() {
                return Ok(None);
            }
            let raw = match self.transport.queued_event() {
                Some(raw) => Some(raw),
                // Watched calls past their deadlines end once what has arrived is taken in
                // (an answer among it is the call's end).
                None if !self.watch_deadlines.is_empty() && self.expire_watched(now) => continue,
                None if left == Some(Duration::ZERO) => None,
                None => {
                    self.transport.wait_from(now, left)?;
                    // The hub's time if its wait moved it on (it slept, or stepped); else
                    // the next turn reads the clock, so that time moves on.
                    turn = Some(self.transport.turn_now()).filter(|&t| t > now);
                    self.transport.queued_event()
                }
            };
            let Some(raw) = raw else {
                // Nothing came: out of time if the deadline had passed when this turn began
                // (a wait that ran out makes the next turn find that).
                if left == Some(Duration::ZERO) && deadline.is_some_and(|d| now >= d) {
                    return Ok(None);
                }
                continue;
            };
            self.take(raw);
        }
    }

    /// Takes in every transport event a wait for rendezvous room stashed, in order.
    pub(super) fn take_stashed(&mut self) {
        while let Some(raw) = self.stash.pop_front() {
            self.take(raw);
        }
    }

    /// The next typed event ready, taking in what a waiting send stashed first. A message
    /// (or the error in its place) handed out is taken: its peer's record moves on, and a
    /// request of the peer's it reaches is answered.
    pub(super) fn take_ready(&mut self) -> Option<HubEvent> {
        loop {
            while self.ready.is_empty() {
                let raw = self.stash.pop_front()?;
                self.take(raw);
            }
            let (ev, seq) = self.ready.pop_front()?;
            if let (Some(seq), Some(peer)) = (seq, ev.peer()) {
                self.took(peer, seq);
            }
            match ev {
                HubEvent::Message { peer, msg } => {
                    let routed =
                        call::route(msg, Some(peer), &self.calls, &self.replies, &self.registry);
                    match routed {
                        Ok(call::Routed::Deliver(msg)) => {
                            return Some(HubEvent::Message { peer, msg })
                        }
                        Ok(call::Routed::Consumed) => {
                            self.answer_watch.answer_came();
                            self.queue_ended_calls();
                        }
                        Err(error) => return Some(HubEvent::BadFrame { peer, error }),
                    }
                }
                HubEvent::Disconnected { peer, failure } => {
                    if let Some(ended) = self.fail_calls(peer, failure) {
                        // Its watched calls end before it does.
                        self.ready
                            .push_front((HubEvent::Disconnected { peer, failure }, None));
                        for ev in ended.into_iter().rev() {
                            self.ready.push_front(ev);
                        }
                        continue;
                    }
                    return Some(HubEvent::Disconnected { peer, failure });
                }
                ev => return Some(ev),
            }
        }
    }

    /// `peer`'s failure is handed out: its calls fail (what arrived before it went to them
    /// first). The events of the watched ones, if any.
    fn fail_calls(
        &mut self,
        peer: PeerId,
        failure: Failure,
    ) -> Option<Vec<(HubEvent, Option<u32>)>> {
        let i = self.failing.iter().position(|(p, _)| *p == peer)?;
        let (_, lost) = self.failing.swap_remove(i);
        let before = self.ready.len();
        self.end_peer_calls(peer, &lost, failure);
        (self.ready.len() > before).then(|| self.ready.drain(before..).collect())
    }

    /// `peer`'s connection failed with `failure`: each of its calls fails, saying by `lost`
    /// what became of its request, and the watched ones' events are queued.
    fn end_peer_calls(&mut self, peer: PeerId, lost: &call::LostCalls, failure: Failure) {
        {
            let mut calls = call::lock(&self.calls);
            calls.fail_peer(Some(peer), lost, || {
                rdmsg_transport::Error::Connection(failure).into()
            });
            calls.forget_peer(peer);
        }
        self.queue_ended_calls();
    }

    /// The application took `peer`'s message `seq`.
    pub(super) fn took(&mut self, peer: PeerId, seq: u32) {
        let Some((state, mut link)) = self.split(peer) else {
            return;
        };
        state.machine.recv.mark_taken(seq);
        if state.suspension.is_some() {
            // Counted when it was suspended; the resume tells the peer.
            return;
        }
        state.machine.took(&mut link);
        if state.join_list() {
            self.unflushed.push(peer);
        }
    }

    /// Posts the reads that wait for buffer room or a send slot, and takes in the frames
    /// parked for want of room, for every peer, once messages in reassembly whose senders
    /// stalled until `now` are dropped (which gives their room to the others).
    pub(super) fn advance_reads(&mut self, now: Instant) {
        self.watch_reassembly(now);
        for peer in std::mem::take(&mut self.reads_waiting) {
            self.collect(peer);
        }
    }

    /// Gives each peer's message in reassembly its look at the clock
    /// ([`RecvSide::handle_timeout`]): one that got no fragment for
    /// [`HubLimits::reassembly_timeout`] fails in its place
    /// ([`crate::Error::ReassemblyTimedOut`], a [`HubEvent::BadFrame`]) and its reservation
    /// returns. Keeps the nearest deadline for the waits ([`Hub::next_timeout`]).
    pub(super) fn watch_reassembly(&mut self, now: Instant) {
        let mut nearest: Option<Instant> = None;
        let mut i = 0;
        while i < self.reassembling.len() {
            let peer = self.reassembling[i];
            let Some(state) = self.peers.get_mut(peer) else {
                self.reassembling.swap_remove(i);
                continue;
            };
            state.machine.recv.handle_timeout(now);
            if !state.machine.recv.reassembling() {
                self.reassembling.swap_remove(i);
                queue_ready(peer, &mut state.machine.recv, &mut self.ready);
                continue;
            }
            if let Some(d) = state.machine.recv.poll_timeout() {
                nearest = Some(nearest.map_or(d, |n| n.min(d)));
            }
            i += 1;
        }
        self.reassembly_at = nearest;
        self.reassembly_unwatched = false;
    }

    /// After `peer`'s receiving side took something in: posts its waiting reads, hands
    /// acknowledgements over (ours go out as they can), and queues its messages that are
    /// ready, in order (unless calls' waits keep all they may of its messages: they wait in
    /// its receiver, the peer under [`RecvSide::hold_back`]).
    pub(super) fn collect(&mut self, peer: PeerId) {
        let Some((state, mut link)) = self.split(peer) else {
            return;
        };
        // A failing peer: its Disconnected event tells.
        let _ = state.machine.recv.advance(&mut link);
        let _ = state.machine.exchange_acks(&mut link);
        let list = state.join_list();
        let (waiting, reassembling) = (
            state.machine.recv.has_waiting(),
            state.machine.recv.reassembling(),
        );
        if waiting && !self.reads_waiting.contains(&peer) {
            self.reads_waiting.push(peer);
        }
        if reassembling && !self.reassembling.contains(&peer) {
            // Watched from the next look at the clock on (see `advance_reads`).
            self.reassembling.push(peer);
            self.reassembly_unwatched = true;
        }
        if let Some(state) = self.peers.get_mut(peer) {
            if !self.held.is_full(peer) {
                queue_ready(peer, &mut state.machine.recv, &mut self.ready);
            }
        }
        if list {
            self.unflushed.push(peer);
        }
    }

    /// An event that has already happened, without waiting (for event loops over
    /// [`AsFd`]: call it until `Ok(None)` whenever the hub's descriptor is readable, and at
    /// least every [`rdmsg_transport::RawHub::next_timeout`]).
    pub fn try_recv(&mut self) -> Result<Option<HubEvent>> {
        if let Some(ev) = self.take_held() {
            return Ok(Some(ev));
        }
        self.drain_outboxes_at(None);
        loop {
            if let Some(ev) = self.take_ready() {
                return Ok(Some(ev));
            }
            match self.transport.try_event()? {
                Some(raw) => self.take(raw),
                // Watched calls past their deadlines end once what has arrived is taken in.
                None if !self.watch_deadlines.is_empty() && self.expire_watched(Instant::now()) => {
                }
                None => return Ok(None),
            }
        }
    }

    /// The events, until the hub's own failure (which [`Hub::recv`] then reports).
    pub fn incoming(&mut self) -> impl Iterator<Item = HubEvent> + '_ {
        std::iter::from_fn(move || self.recv().ok()).fuse()
    }

    /// Turns a transport event into typed ones (queued in [`Hub::ready`]), keeping per-peer
    /// state: none for a frame that completed nothing (a fragment, a nudge, a descriptor
    /// whose read is under way).
    pub(super) fn take(&mut self, raw: rdmsg_transport::RawHubEvent) {
        use rdmsg_transport::RawHubEvent as Raw;
        let ev = match raw {
            Raw::Connected { peer, accepted } => {
                self.state(peer);
                HubEvent::Connected { peer, accepted }
            }
            Raw::Message { peer, msg } => {
                let wakeup = self.transport.wakeups();
                let state = self.state(peer);
                if state.suspension.is_some() {
                    return self.resume_frame_came(peer, msg);
                }
                let receiver = &mut state.machine.recv;
                receiver.woken(wakeup);
                receiver.arrive(FrameBytes::Received(msg));
                return self.collect(peer);
            }
            Raw::Read { peer, read } => {
                // A read of a peer already gone was counted out of the pool with it: its
                // buffer is dropped.
                if let Some(state) = self.peers.get_mut(peer) {
                    state.machine.recv.read_done(read);
                    self.collect(peer);
                }
                return;
            }
            Raw::Disconnected {
                peer,
                failure,
                last_note,
            } => {
                let mut gone = self.peers.remove(peer);
                // What the peer's record says of the calls to it, for each call's failure,
                // which comes when this event is handed out (`take_ready`): answers that
                // arrived before it are routed to their calls first.
                let lost = gone
                    .as_mut()
                    .map(|g| g.machine.connection_failed(last_note).1)
                    .unwrap_or_default();
                if let Some(g) = &mut gone {
                    let mut calls = call::lock(&self.calls);
                    for (id, seq) in g.machine.outbox.take_calls_sent() {
                        calls.request_sent(id, seq);
                    }
                }
                self.failing.push((peer, lost));
                if let Some(mut gone) = gone {
                    self.departed_outboxes.add(&gone.machine.outbox.stats());
                    // What arrived comes first, then the failure.
                    queue_ready(peer, &mut gone.machine.recv, &mut self.ready);
                    self.departed.add(&gone.stats());
                    let delivery = gone.machine.send.delivery(None);
                    if gone.machine.send.keeps_copies() && delivery.unconfirmed() > 0 {
                        let messages = gone.machine.send.take_unconfirmed();
                        let ev = HubEvent::Unconfirmed {
                            peer,
                            delivery,
                            messages,
                        };
                        self.ready.push_back((ev, None));
                    }
                }
                HubEvent::Disconnected { peer, failure }
            }
            Raw::Suspended {
                peer,
                failure: _,
                last_note,
            } => return self.suspend_peer(peer, last_note),
            Raw::Resumed { peer } => return self.peer_resumed(peer),
            Raw::HandshakeFailed { peer, error } => {
                if let Some(p) = peer {
                    // Its handshake failed: nothing went to it.
                    let lost = call::LostCalls {
                        nothing_went: true,
                        ..call::LostCalls::default()
                    };
                    self.end_peer_calls(p, &lost, Failure::Closed);
                }
                if let Some(gone) = peer.and_then(|p| self.peers.remove(p)) {
                    self.departed.add(&gone.stats());
                }
                HubEvent::HandshakeFailed {
                    peer,
                    error: error.into(),
                }
            }
        };
        self.ready.push_back((ev, None));
    }
}
