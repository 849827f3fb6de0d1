//! Settings of a hub as a whole, beside each peer's [`SessionConfig`].

use super::*;

/// Bounds a hub keeps over all its peers at once ([`Hub::set_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HubLimits {
    /// Bound on what all its peers' messages in fragments may hold while they are
    /// reassembled. Each such message reserves the length its first fragment announces (at
    /// most `max_message`) until it is whole, so that messages under way always finish; a
    /// peer starting one beyond the bound waits, its frames held unread and so its credits,
    /// until there is room. Peers that wait are served in the order they came, and while
    /// anyone waits only the first in line may start a message: a peer that keeps sending
    /// cannot keep another out. One message may always be under way. A message that stops
    /// making progress gives its part back after `reassembly_timeout`. (A session
    /// reassembles one message at a time.) Default 256 MiB (16 messages of the default
    /// `max_message` at once, many more of smaller ones).
    pub max_reassembly_bytes: usize,
    /// How long a peer's message in fragments may go without a new fragment. Past it, the
    /// message is dropped ([`crate::Error::ReassemblyTimedOut`] in its place, a
    /// [`HubEvent::BadFrame`]; the peer's messages before and after it are delivered), its
    /// fragments that come later are dropped quietly, and its part of
    /// `max_reassembly_bytes` goes back to the others: a stopped or stalled peer cannot hold
    /// it for longer. The deadline runs from the hub's first look after a fragment came (it
    /// wakes for it: [`Hub::next_timeout`]), and not while the hub itself holds the peer's
    /// frames back. Default [`crate::DEFAULT_REASSEMBLY_TIMEOUT`] (10 s).
    pub reassembly_timeout: Duration,
}

impl Default for HubLimits {
    fn default() -> Self {
        Self {
            max_reassembly_bytes: 256 << 20,
            reassembly_timeout: crate::DEFAULT_REASSEMBLY_TIMEOUT,
        }
    }
}

impl HubLimits {
    /// What a [`SessionConfig`] set before these limits had a home of their own.
    #[allow(deprecated)]
    pub(super) fn from_session(config: &SessionConfig) -> Self {
        Self {
            max_reassembly_bytes: config.max_reassembly_bytes,
            reassembly_timeout: config.reassembly_timeout,
        }
    }
}

impl Hub {
    /// The hub's limits in force.
    pub fn limits(&self) -> HubLimits {
        self.limits
    }

    /// Sets the hub's limits, for every peer at once, connected or to come: a lower bound
    /// holds back only messages not started yet (those under way finish), and a new
    /// timeout applies from each message's last progress.
    pub fn set_limits(&mut self, limits: HubLimits) {
        self.limits = limits;
        self.budget
            .set_limits(limits.max_reassembly_bytes, limits.reassembly_timeout);
    }
}
