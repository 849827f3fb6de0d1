//! Receive groups: a hub's connections spread over as many shared receive queues as they
//! need, each with a completion queue of its own on the hub's one completion channel.
//!
//! A group's SRQ never holds more requests than its CQ has entries, so no peer, whatever it
//! sends, can overrun a CQ: every receive completion consumed one request of its group's
//! SRQ. A device's largest CQ thus bounds a group, not the hub. Each group keeps its own
//! [`Share`] (which connection each of its posted buffers backs); the receive buffers
//! themselves are one pool, re-posted to whichever group needs them.

use rdmsg_notify::CqKey;
use rdmsg_verbs::{CompletionQueue, SharedReceiveQueue};

use super::RawHub;
use crate::error::{Error, Result};
use crate::share::{Share, ShareConfig};

/// One shared receive queue, its completion queue and its books.
#[derive(Debug)]
pub(super) struct RecvGroup {
    /// Its CQ in the hub's waiter.
    pub(super) key: CqKey,
    pub(super) srq: SharedReceiveQueue,
    pub(super) share: Share,
    /// Most requests posted at once: the CQ's entries (the SRQ may have been granted more).
    pub(super) entries: u32,
    /// Connections admitted.
    pub(super) conns: u32,
}

impl RecvGroup {
    /// Requests that may still be posted.
    pub(super) fn room(&self) -> u32 {
        self.entries
            .saturating_sub(self.srq.recv_outstanding().min(u32::MAX as usize) as u32)
    }
}

impl RawHub {
    /// Makes a group (its CQ armed like the others from the next step on).
    pub(super) fn new_group(&mut self) -> Result<usize> {
        let entries = self.group_size.entries;
        let ctx = self.endpoint.context();
        let cq = CompletionQueue::new(ctx, entries, Some(self.waiter.channel().completion()))?;
        let srq = SharedReceiveQueue::new(self.endpoint.pd(), entries)?;
        let share = Share::new(ShareConfig {
            min_credits: self.config.min_credits,
            max_credits: self.config.max_credits,
            grant_slots: self.config.conn.grant_slots,
        })
        .map_err(Error::ShareConfig)?;
        let addr = cq.as_raw() as usize;
        let key = self.waiter.add(cq, self.config.conn.recv_arm);
        self.endpoint
            .register_async(None, vec![addr], &self.mailbox);
        if self.key_group.len() <= key.0 {
            self.key_group.resize(key.0 + 1, None);
        }
        self.key_group[key.0] = Some(self.groups.len());
        self.groups.push(RecvGroup {
            key,
            srq,
            share,
            entries,
            conns: 0,
        });
        Ok(self.groups.len() - 1)
    }

    /// The group a new connection joins: the first with room for one more, or a new one.
    pub(super) fn group_for_new(&mut self) -> Result<usize> {
        let most = self.group_size.conns;
        match self.groups.iter().position(|g| g.conns < most) {
            Some(g) => Ok(g),
            None => self.new_group(),
        }
    }

    /// The group whose CQ is behind `key` (`None`: the send CQ).
    pub(super) fn group_of_key(&self, key: CqKey) -> Option<usize> {
        self.key_group.get(key.0).copied().flatten()
    }
}
