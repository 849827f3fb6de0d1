//! Per-peer state of a hub, addressed by keys whose slots later keys may reuse.

use rdmsg_transport::PeerId;

/// A key naming a slot that later keys may reuse ([`PeerId`]).
pub(crate) trait SlotKey: Copy + Eq {
    fn index(self) -> usize;
}

impl SlotKey for PeerId {
    fn index(self) -> usize {
        PeerId::index(self)
    }
}

/// Per-peer state in a `Vec` indexed by slot, each entry keeping the key it was made for, so
/// that a stale key (its slot reused by a later connection) finds nothing.
#[derive(Debug)]
pub(crate) struct PeerTable<K, V> {
    pub(super) slots: Vec<Option<(K, V)>>,
}

impl<K, V> Default for PeerTable<K, V> {
    fn default() -> Self {
        Self { slots: Vec::new() }
    }
}

impl<K: SlotKey, V> PeerTable<K, V> {
    pub(crate) fn get(&self, key: K) -> Option<&V> {
        match self.slots.get(key.index()) {
            Some(Some((k, v))) if *k == key => Some(v),
            _ => None,
        }
    }

    pub(crate) fn get_mut(&mut self, key: K) -> Option<&mut V> {
        match self.slots.get_mut(key.index()) {
            Some(Some((k, v))) if *k == key => Some(v),
            _ => None,
        }
    }

    /// Puts `value` in `key`'s slot; returns what was there, under whatever key (a stale entry
    /// whose removal was missed).
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<(K, V)> {
        let i = key.index();
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i].replace((key, value))
    }

    /// Removes `key`'s entry; a stale key removes nothing.
    pub(crate) fn remove(&mut self, key: K) -> Option<V> {
        let slot = self.slots.get_mut(key.index())?;
        if !matches!(slot, Some((k, _)) if *k == key) {
            return None;
        }
        slot.take().map(|(_, v)| v)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.slots.iter().flatten().map(|(_, v)| v)
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> + '_ {
        self.slots.iter_mut().flatten().map(|(_, v)| v)
    }
}
