//! The shared receive pool (admission, growth on demand, re-posting), credit grants, and
//! posting sends on a connection's queue pair within the hub's send buffers and send CQ.

use std::time::Duration;

use super::slots::Resources;
use super::{PeerId, RawHub};
use crate::core::{Post, Room, SEND_PROGRESS_EVERY};
use crate::drive;
use crate::error::{errno_of, Error, Failure, Result};
use crate::send::{self, Payload};
use crate::share::AdmitError;

impl RawHub {
    /// Sets aside a new connection's minimum share in a receive group with room for it
    /// (making one if none has), growing the pool so that `shared_credits` buffers stay spare
    /// there for busy peers beyond everyone's minimum (as far as the group's size allows).
    /// Returns the group.
    pub(super) fn admit(&mut self, slot: usize) -> Result<usize> {
        let group = self.group_for_new()?;
        let g = &mut self.groups[group];
        let cost = g.share.admission_cost();
        let room = g.room();
        let short = (cost + self.config.shared_credits).saturating_sub(g.share.spare());
        let admitted_now = (short == 0 || room == 0) && g.share.admit(slot).is_ok();
        if !admitted_now {
            // Free buffers first, then new ones: a batch (a 64th of the room left), at least
            // what is short.
            let want = short.max(room / 64).min(room);
            let full = |spare| Error::ReceiveQueueFull {
                spare,
                needed: cost,
                capacity: room,
            };
            if want + g.share.spare() < cost {
                return Err(full(g.share.spare()));
            }
            self.pool.collect_returns();
            let missing = (want as usize).saturating_sub(self.pool.free_count());
            self.pool.grow(self.endpoint.pd(), missing)?;
            let posted = self.post_free(group, want as usize)?;
            let g = &mut self.groups[group];
            match g
                .share
                .admit_posted(slot, posted, &mut self.table.slots, &mut self.touched)
            {
                Ok(()) => {}
                Err(AdmitError::NoRoom { spare, .. }) => return Err(full(spare)),
                Err(e) => return Err(Error::Admit(e)),
            }
        }
        self.groups[group].conns += 1;
        let s = self.slot_mut(slot);
        s.admitted = true;
        s.group = Some(group);
        self.admitted += 1;
        Ok(group)
    }

    /// Posts up to `n` free buffers to `group`'s SRQ (not yet handed out: the caller tells its
    /// share); returns how many went. A failed post is the hub's failure.
    fn post_free(&mut self, group: usize, n: usize) -> Result<u32> {
        let g = &mut self.groups[group];
        let bufs = self.pool.take_free_up_to(n.min(g.room() as usize));
        let n = bufs.len();
        if n == 0 {
            return Ok(0);
        }
        if let Err(e) = g.srq.post_recv(bufs) {
            for b in e.unposted {
                self.pool.put_back(b);
            }
            let posted = e.posted as u32;
            g.share
                .on_posted(posted, &mut self.table.slots, &mut self.touched);
            return Err(self.hub_failure(e.error.into()));
        }
        self.stats.srq_posts += 1;
        Ok(n as u32)
    }

    /// Gives a connection's share of the buffers back (its queue pair can consume nothing
    /// more, and everything it did consume has been polled).
    pub(super) fn unadmit(&mut self, slot: usize) {
        let s = self.table.slots[slot].as_mut().expect("a live slot");
        if std::mem::take(&mut s.admitted) {
            self.admitted -= 1;
            let g = &mut self.groups[s.group.expect("an admitted connection has a group")];
            g.conns -= 1;
            g.share
                .release(slot, &mut self.table.slots, &mut self.touched);
        }
    }

    /// Busy peers ran out of credits with nothing spare: registers more buffers (in chunks of
    /// at least 64), up to `max_shared_credits` beyond everyone's minimum; `repost` posts them.
    pub(super) fn grow_for_demand(&mut self) -> Result<()> {
        let (mut quotas, mut slots) = (0u64, 0u64);
        for g in &mut self.groups {
            slots += u64::from(g.share.take_slot_demand());
            quotas += u64::from(g.share.take_demand());
        }
        if quotas + slots == 0 {
            return Ok(());
        }
        // Quotas grow up to `max_shared_credits` beyond everyone's minimum; grant slots that
        // a sender waits for are added as far as the SRQs have room (a group's SRQ is sized
        // for every connection's grant slots, though lending may have taken that room).
        let admitted = self.admitted as u64;
        let minimums = admitted * u64::from(self.config.min_credits);
        let rooms: u64 = self.groups.iter().map(|g| u64::from(g.room())).sum();
        let total = self.pool.stats(0).total as u64;
        let limit = minimums + u64::from(self.config.max_shared_credits);
        let for_quotas = if quotas > 0 {
            quotas.max(64).min(limit.saturating_sub(total))
        } else {
            0
        };
        // Slots in batches too (a registration costs more than the buffers): what they do not
        // take is spare for the next.
        let for_slots = if slots > 0 { slots.max(64) } else { 0 };
        let grow = (for_quotas + for_slots).min(rooms);
        if grow == 0 {
            return Ok(());
        }
        #[cfg(feature = "test-hooks")]
        let refused = self.config.conn.hooks.refuse_pool_growth;
        #[cfg(not(feature = "test-hooks"))]
        let refused = false;
        let grown = if refused {
            Err(crate::Error::Config(
                "registration refused (test hook)".into(),
            ))
        } else {
            self.pool.grow(self.endpoint.pd(), grow as usize)
        };
        match grown {
            Ok(()) => self.stats.pool_growths += 1,
            // No more memory to register (RLIMIT_MEMLOCK, say): the pool stays as it is, and
            // busy peers go on with the credits they have. Not the hub's failure: it asks
            // again when demand comes back.
            Err(_) => self.stats.pool_growth_failures += 1,
        }
        Ok(())
    }

    /// Posts every free receive buffer and lets the shares hand them out. With several
    /// receive groups, the groups whose connections wait for buffers get them (those with a
    /// starving connection or a missing grant slot first), in equal parts; when none waits,
    /// the group with the fewest spare does. What no group has room for stays free.
    pub(super) fn repost(&mut self) -> Result<()> {
        self.pool.collect_returns();
        let free = self.pool.free_count();
        if free == 0 {
            return Ok(());
        }
        if self.groups.len() == 1 {
            return self.post_to(0, free);
        }
        let mut needy: Vec<usize> = (0..self.groups.len())
            .filter(|&g| self.groups[g].share.urgent())
            .collect();
        if needy.is_empty() {
            needy.extend((0..self.groups.len()).filter(|&g| self.groups[g].share.waiting() > 0));
        }
        if needy.is_empty() {
            let fewest = (0..self.groups.len())
                .filter(|&g| self.groups[g].room() > 0)
                .min_by_key(|&g| self.groups[g].share.spare());
            needy.extend(fewest);
        }
        let part = free.div_ceil(needy.len().max(1));
        for g in needy {
            self.post_to(g, part)?;
        }
        Ok(())
    }

    /// Posts up to `n` free buffers to `group` and lets its share hand them out.
    fn post_to(&mut self, group: usize, n: usize) -> Result<()> {
        let posted = self.post_free(group, n)?;
        if posted > 0 {
            self.groups[group]
                .share
                .on_posted(posted, &mut self.table.slots, &mut self.touched);
        }
        Ok(())
    }

    /// Sends the grants due on connections touched this round; one without room for its
    /// grant now stays touched (a send completion will bring the hub back).
    pub(super) fn grants(&mut self) {
        if self.send_cq_room() == 0 {
            // Nothing can go before a send completion, which comes back here.
            return;
        }
        let mut touched = std::mem::take(&mut self.touched);
        let mut keep = Vec::new();
        for slot in touched.drain(..) {
            let Some(s) = self.table.slots[slot].as_mut() else {
                continue;
            };
            s.touched = false;
            if s.core.failure().is_some() || s.established().is_none() {
                continue;
            }
            let room = self.room(slot);
            if room.sq == 0 || room.cq == 0 {
                keep.push(slot);
                continue;
            }
            let books = self.slot(slot).core.credits();
            if books.grant_needs_slots() && books.grant_due().is_some() && !self.wake_slots(slot) {
                // The grant would let the peer echo with a grant of its own: its slots first
                // (they come with the next buffers posted).
                keep.push(slot);
                continue;
            }
            // A failed post failed the connection.
            let _ = drive::grant(&mut self.queues(slot), room);
        }
        for slot in keep {
            self.touch(slot);
        }
        if self.touched.is_empty() {
            self.touched = touched;
        }
    }

    /// Backs the dormant grant slots of `slot` before it sends (see [`Share::wake_slots`]);
    /// whether they are backed now.
    ///
    /// [`Share::wake_slots`]: crate::share::Share::wake_slots
    pub(super) fn wake_slots(&mut self, slot: usize) -> bool {
        let s = self.slot(slot);
        if s.core.credits().slots_ready() {
            return true;
        }
        let Some(group) = s.group.filter(|_| s.admitted) else {
            return false;
        };
        if self.groups[group]
            .share
            .wake_slots(slot, &mut self.table.slots, &mut self.touched)
        {
            return true;
        }
        // Nothing spare: register more now (nothing else may come to wake the hub); posted,
        // they back the slots before anything else.
        if self.grow_for_demand().is_err() || self.repost().is_err() {
            return false;
        }
        self.slot(slot).core.credits().slots_ready()
    }

    /// What is free for a send on `slot` now (nothing before it is linked).
    #[inline]
    pub(super) fn room(&self, slot: usize) -> Room {
        let s = self.slot(slot);
        let link = s.established();
        self.budget.room(
            link.map(|l| l.sq_depth),
            link.map_or(0, |l| l.qp.send_outstanding()),
            s.core.unsignaled_behind(),
            self.send.free.len(),
            self.table.used(),
        )
    }

    /// Entries of the send CQ no outstanding send may still fill.
    fn send_cq_room(&self) -> usize {
        self.budget.cq_free()
    }

    pub(super) fn post(&mut self, slot: usize, payload: Payload, post: Post) -> Result<()> {
        let s = self.table.slots[slot].as_mut().expect("a live slot");
        let Resources::Linked(link) = &mut s.resources else {
            unreachable!("posting needs a link")
        };
        let before = link.qp.send_outstanding();
        let posted = send::post(&mut link.qp, &mut self.send, &mut s.core, payload, post);
        self.budget.follow(before, link.qp.send_outstanding());
        self.follow_unsignaled(slot);
        posted.map_err(|e| self.local_failure(slot, "posting a send (ibv_post_send)", e.into()))?;
        Ok(())
    }

    /// The hub-wide count of sends left unsignaled follows `slot`'s, after a post.
    pub(super) fn follow_unsignaled(&mut self, slot: usize) {
        let s = self.table.slots[slot].as_mut().expect("a live slot");
        let behind = s.core.unsignaled_behind();
        self.budget.follow_unsignaled(s.unsignaled, behind);
        s.unsignaled = behind;
    }

    /// Fails `slot` for the error of a verb it drove, and hands the error back.
    pub(super) fn local_failure(&mut self, slot: usize, op: &'static str, e: Error) -> Error {
        let errno = errno_of(&e);
        self.fail(slot, Failure::Local { op, errno });
        e
    }

    fn can_send(&self, slot: usize) -> bool {
        let s = self.slot(slot);
        s.announced && s.core.may_send(self.room(slot))
    }

    pub(super) fn wait_to_send(
        &mut self,
        slot: usize,
        peer: PeerId,
        timeout: Option<Duration>,
    ) -> Result<()> {
        // The hub looks at everything every `SEND_PROGRESS_EVERY` sends (the cadence a
        // connection polls at, counted over all its peers), and at once when this one cannot
        // go: a step costs the whole hub a look at its descriptors, so not whenever one peer
        // runs low, as a connection's `Core::poll_before_send` does. Buffers that came back
        // are re-posted and their grants sent (a peer may be waiting for those credits), which
        // needs no step.
        self.sends_since_step += 1;
        self.wake_slots(slot);
        if self.sends_since_step >= SEND_PROGRESS_EVERY || !self.can_send(slot) {
            self.sends_since_step = 0;
            self.step()?;
            self.live_slot(peer)?;
            self.wake_slots(slot);
        } else if self.pool.has_returns() {
            self.repost()?;
            self.grants();
        }
        if self.can_send(slot) {
            self.sends_again(slot, peer);
            return Ok(());
        }
        // A timeout too long to add to the clock is no deadline at all.
        // A new turn: the wait's deadline, and whatever the waits below look at, from now.
        self.clock.new_turn();
        let deadline = timeout.and_then(|t| self.clock.now().checked_add(t));
        let s = self.slot_mut(slot);
        if s.core.send_waited() {
            let qpn = s.qpn.unwrap_or(0);
            s.stall.began(qpn, Some(peer));
        }
        loop {
            self.live_slot(peer)?;
            // A receive may have let them sleep again meanwhile.
            self.wake_slots(slot);
            if self.can_send(slot) {
                self.sends_again(slot, peer);
                return Ok(());
            }
            let left = deadline.map(|d| d.saturating_duration_since(self.clock.now()));
            if left == Some(Duration::ZERO) {
                // Until a send to it goes, the hub wakes for any completion (see `Hub::arm`).
                self.slot_mut(slot).core.send_waits(true);
                if !self.blocked.contains(&slot) {
                    self.blocked.push(slot);
                }
                return Err(Error::timeout(
                    "sending",
                    crate::error::WAIT_SEND,
                    timeout.unwrap_or_default(),
                ));
            }
            self.wait_for_progress(left, true)?;
        }
    }

    /// A send to `slot` goes now: a credit stall of its ends.
    fn sends_again(&mut self, slot: usize, peer: PeerId) {
        let s = self.slot_mut(slot);
        if s.core.send_waits(false) {
            let qpn = s.qpn.unwrap_or(0);
            s.stall.ended(qpn, Some(peer));
        }
    }
}
