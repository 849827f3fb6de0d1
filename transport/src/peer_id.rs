//! Who a hub's connection is: [`PeerId`] (a leaf, so that what logs a peer needs no hub).

use std::fmt;

/// A connection of a [`RawHub`](crate::RawHub): small, copyable, never reused for another connection (a slot's
/// generation changes when it is).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId {
    pub(crate) slot: u32,
    pub(crate) generation: u32,
}

impl PeerId {
    /// The slot of this connection in the hub: below the number of slots the hub ever used, so
    /// usable as an index into a `Vec` of per-peer state (a later connection may reuse it).
    pub fn index(self) -> usize {
        self.slot as usize
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({}.{})", self.slot, self.generation)
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {}.{}", self.slot, self.generation)
    }
}
