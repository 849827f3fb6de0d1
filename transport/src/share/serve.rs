//! The share's inner bookkeeping: who waits for buffers and in what order, serving them as
//! buffers come, growing the pool for demand, and the totals' invariants.

use super::*;

impl Share {
    pub(super) fn live(&self, slot: usize) -> Option<&Account> {
        self.slots.get(slot).filter(|s| s.live)
    }

    /// A buffer consumed that no connection's backing covered.
    pub(super) fn charge_pool(&mut self) {
        if self.spare > 0 {
            self.spare -= 1;
        } else {
            self.deficit += 1;
        }
    }

    /// Spare buffers first make up the deficit.
    pub(super) fn cover_deficit(&mut self) {
        let paid = self.spare.min(self.deficit);
        self.spare -= paid;
        self.deficit -= paid;
    }

    /// Pushes `slot` into `touched` unless this call did already.
    pub(super) fn touch(&mut self, slot: usize, touched: &mut Vec<usize>) {
        let s = &mut self.slots[slot];
        if !s.touched {
            s.touched = true;
            touched.push(slot);
        }
    }

    /// Ends a call: its touched slots may be pushed again by the next.
    pub(super) fn untouch(&mut self, pushed: &[usize]) {
        for &slot in pushed {
            self.slots[slot].touched = false;
        }
    }

    /// What the connection waits for, if anything, and how many credits its peer holds or is
    /// owed (those with fewer are served first).
    pub(super) fn need(&self, slot: usize, c: &Credits) -> Option<(Need, u32)> {
        let s = &self.slots[slot];
        if !s.live || s.retired {
            return None;
        }
        if c.slots_missing() > 0 || c.slots_wanted() > 0 {
            return Some((Need::GrantSlot, 0));
        }
        if s.held {
            return None;
        }
        let lent = lent(c);
        if lent >= s.quota {
            return None;
        }
        let need = if lent < self.cfg.min_credits || c.peer_may_be_blocked() {
            Need::Starving
        } else {
            Need::Quota
        };
        Some((need, lent))
    }

    /// Queues the connection anew as its books now say (after any change to them).
    pub(super) fn requeue(&mut self, slot: usize, c: &Credits) {
        self.dequeue(slot);
        let Some((need, lent)) = self.need(slot, c) else {
            return;
        };
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.queue.push(Reverse((need, lent, stamp, slot)));
        self.slots[slot].waiting = Some(Waiting { need, stamp });
        self.waiting += 1;
        if need < Need::Quota {
            self.urgent += 1;
        }
        if self.queue.len() > 2 * self.waiting + 64 {
            self.compact();
        }
    }

    /// Takes the connection out of the queue (its entry goes stale).
    pub(super) fn dequeue(&mut self, slot: usize) {
        if let Some(w) = self.slots[slot].waiting.take() {
            self.waiting -= 1;
            if w.need < Need::Quota {
                self.urgent -= 1;
            }
        }
    }

    /// Drops stale queue entries.
    pub(super) fn compact(&mut self) {
        let slots = &self.slots;
        self.queue.retain(|Reverse((_, _, stamp, slot))| {
            slots[*slot].waiting.map(|w| w.stamp) == Some(*stamp)
        });
    }

    /// Hands spare buffers to the connections waiting, most pressing first.
    pub(super) fn serve<H: CreditHolder>(
        &mut self,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) {
        while self.spare > 0 {
            let Some(Reverse((_, _, stamp, slot))) = self.queue.pop() else {
                break;
            };
            if self.slots[slot].waiting.map(|w| w.stamp) != Some(stamp) {
                continue;
            }
            let Some(holder) = conns.get_mut(slot).and_then(Option::as_mut) else {
                debug_assert!(false, "connection {slot} waits but has no books");
                self.dequeue(slot);
                continue;
            };
            self.give(slot, holder, touched);
        }
        self.headroom = self.spare;
        self.check_totals();
    }

    /// Gives the connection in `slot` what it waits for from spare (its grant slots first):
    /// spare means nobody else waits. It is pushed into `touched` at most once.
    pub(super) fn serve_slot<H: CreditHolder>(
        &mut self,
        slot: usize,
        holder: &mut H,
        touched: &mut Vec<usize>,
    ) {
        self.slots[slot].touched = true;
        while self.spare > 0 && self.slots[slot].waiting.is_some() {
            self.give(slot, holder, touched);
        }
        self.slots[slot].touched = false;
    }

    /// Gives a waiting connection its missing grant slots, or one credit, from spare, and
    /// queues it anew.
    pub(super) fn give<H: CreditHolder>(
        &mut self,
        slot: usize,
        holder: &mut H,
        touched: &mut Vec<usize>,
    ) {
        let c = holder.credits_mut();
        // `on_reposted` restores grant slots first (missing ones, then dormant ones wanted).
        let n = (c.slots_missing() + c.slots_wanted())
            .max(1)
            .min(self.spare);
        c.on_reposted(n);
        debug_assert!(lent(c) <= self.cfg.max_credits);
        self.slots[slot].backing += n;
        self.backed += n;
        self.spare -= n;
        self.touch(slot, touched);
        self.requeue(slot, holder.credits());
    }

    /// A peer ran out of credits: with headroom, it may hold more.
    pub(super) fn grow<H: CreditHolder>(&mut self, slot: usize, holder: &mut H) {
        let s = &mut self.slots[slot];
        if s.quota >= self.cfg.max_credits {
            return;
        }
        if self.headroom == 0 {
            // Busy, and nothing to grow into: the pool's owner may add buffers.
            let wanted = s.quota.min(self.cfg.max_credits - s.quota);
            self.demand = self.demand.saturating_add(wanted);
            return;
        }
        let quota = (s.quota.saturating_mul(2))
            .min(self.cfg.max_credits)
            .min(s.quota.saturating_add(self.headroom));
        self.headroom -= quota - s.quota;
        s.quota = quota;
        holder
            .credits_mut()
            .set_grant_threshold(threshold_for_quota(quota));
    }

    pub(super) fn check_totals(&self) {
        debug_assert_eq!(
            self.posted + self.deficit,
            self.spare + self.backed,
            "posted buffers are spare or back a connection"
        );
        debug_assert!(
            self.spare == 0 || self.waiting == 0,
            "nothing is spare while a connection waits"
        );
    }
}
