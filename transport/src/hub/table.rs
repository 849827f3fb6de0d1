//! The hub's connection table without I/O: which slot each connection holds, the generation
//! that tells it from every earlier and later holder of that slot, the bound on connections,
//! the slots free for the next, and which slot a queue pair number names. Host-tested below;
//! the hub keeps its `Slot`s (core and I/O resources) in it.

use std::collections::HashMap;

use super::PeerId;

/// What the table needs of an entry: the generation it was given.
pub(crate) trait Generational {
    fn generation(&self) -> u32;
}

/// Slots of connections, each `None` while free.
#[derive(Debug)]
pub(crate) struct SlotTable<S> {
    /// The entries, by slot: the hub's share of the buffers keeps its books over them.
    pub(crate) slots: Vec<Option<S>>,
    free: Vec<usize>,
    /// The next generation given (never 0, so that a default `PeerId` names nobody).
    next_generation: u32,
    by_qpn: HashMap<u32, usize>,
    max: usize,
    /// Slots kept from reuse while empty: the index of a resumable session's name.
    reserved: std::collections::HashSet<usize>,
    /// Names answered by another slot: a resumed session's id, by its connection's slot.
    aliases: HashMap<PeerId, usize>,
    /// Reserved slots that are empty.
    kept_empty: usize,
}

impl<S: Generational> SlotTable<S> {
    /// A table of at most `max` connections at once.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            next_generation: 1,
            by_qpn: HashMap::new(),
            max,
            reserved: std::collections::HashSet::new(),
            aliases: HashMap::new(),
            kept_empty: 0,
        }
    }

    /// Connections in the table (a slot kept empty for a session's name is none).
    pub(crate) fn used(&self) -> usize {
        self.slots.len() - self.free.len() - self.kept_empty
    }

    /// Puts the entry `make` builds for the generation it is given into a free slot (a freed
    /// one first); `None` when the table holds its most already.
    pub(crate) fn insert(&mut self, make: impl FnOnce(u32) -> S) -> Option<usize> {
        if self.used() >= self.max {
            return None;
        }
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        let entry = make(generation);
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[i] = Some(entry);
        Some(i)
    }

    /// The slot `peer` names, while it holds that connection (not a later one of the slot).
    #[inline]
    pub(crate) fn find(&self, peer: PeerId) -> Option<usize> {
        let i = peer.slot as usize;
        match self.slots.get(i) {
            Some(Some(s)) if s.generation() == peer.generation => Some(i),
            _ => self.find_alias(peer),
        }
    }

    #[cold]
    fn find_alias(&self, peer: PeerId) -> Option<usize> {
        if self.aliases.is_empty() {
            return None;
        }
        self.aliases.get(&peer).copied()
    }

    /// Frees slot `i`; its entry, if it held one. Its queue pair's number is the caller's to
    /// [`SlotTable::unmap_qp`] (once the queue pair is gone). A reserved slot is not reused
    /// until [`SlotTable::unreserve`]d.
    pub(crate) fn remove(&mut self, i: usize) -> Option<S> {
        let entry = self.slots.get_mut(i)?.take()?;
        if self.reserved.contains(&i) {
            self.kept_empty += 1;
        } else {
            self.free.push(i);
        }
        Some(entry)
    }

    /// Slot `i` is not reused, even once empty, until unreserved: its index names a session.
    pub(crate) fn reserve(&mut self, i: usize) {
        self.reserved.insert(i);
    }

    /// Slot `i` may be reused once empty.
    pub(crate) fn unreserve(&mut self, i: usize) {
        if self.reserved.remove(&i) && self.slots.get(i).is_some_and(Option::is_none) {
            self.kept_empty -= 1;
            self.free.push(i);
        }
    }

    /// `name` answers to slot `i` from now on.
    pub(crate) fn alias(&mut self, name: PeerId, i: usize) {
        self.aliases.insert(name, i);
    }

    /// `name` answers to no other slot.
    pub(crate) fn unalias(&mut self, name: PeerId) {
        self.aliases.remove(&name);
    }

    /// Completions of queue pair `qpn` are slot `i`'s.
    pub(crate) fn map_qp(&mut self, qpn: u32, i: usize) {
        self.by_qpn.insert(qpn, i);
    }

    /// Queue pair `qpn` is gone or going: its number may name another next, of this hub or
    /// not.
    pub(crate) fn unmap_qp(&mut self, qpn: u32) {
        self.by_qpn.remove(&qpn);
    }

    /// The slot whose queue pair is `qpn`.
    pub(crate) fn slot_of_qp(&self, qpn: u32) -> Option<usize> {
        self.by_qpn.get(&qpn).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Entry(u32);

    impl Generational for Entry {
        fn generation(&self) -> u32 {
            self.0
        }
    }

    fn id(slot: usize, generation: u32) -> PeerId {
        PeerId {
            slot: slot as u32,
            generation,
        }
    }

    #[test]
    fn a_freed_slot_is_reused_under_a_new_generation_and_the_old_id_names_nobody() {
        let mut t = SlotTable::new(2);
        let a = t.insert(Entry).expect("room");
        let b = t.insert(Entry).expect("room");
        assert_ne!(a, b);
        assert!(t.insert(Entry).is_none(), "two at most");
        let old = id(a, t.slots[a].as_ref().expect("held").0);
        assert_eq!(t.find(old), Some(a));
        assert!(t.remove(a).is_some());
        assert_eq!(t.find(old), None, "released");
        assert!(t.remove(a).is_none(), "freed once");
        let c = t.insert(Entry).expect("room again");
        assert_eq!(c, a, "the freed slot first");
        assert_eq!(
            t.find(old),
            None,
            "the slot's new holder is not the old id's"
        );
        assert_eq!(t.used(), 2);
        assert_eq!(t.find(id(7, 1)), None, "a slot never used");
    }

    #[test]
    fn generations_skip_zero_when_they_wrap() {
        let mut t = SlotTable::new(1);
        t.next_generation = u32::MAX;
        let i = t.insert(Entry).expect("room");
        assert_eq!(t.slots[i].as_ref().map(|e| e.0), Some(u32::MAX));
        t.remove(i);
        let i = t.insert(Entry).expect("room");
        assert_eq!(t.slots[i].as_ref().map(|e| e.0), Some(1));
        assert_eq!(t.find(id(i, 0)), None);
    }

    #[test]
    fn a_reserved_slot_is_not_reused_until_unreserved_and_its_name_may_answer_elsewhere() {
        let mut t = SlotTable::new(2);
        let a = t.insert(Entry).expect("room");
        let name = id(a, t.slots[a].as_ref().expect("held").0);
        t.reserve(a);
        t.remove(a);
        assert_eq!(t.used(), 0, "an empty reserved slot is no connection");
        let b = t.insert(Entry).expect("room");
        assert_ne!(a, b, "not reused while reserved");
        assert_eq!(t.find(name), None);
        t.alias(name, b);
        assert_eq!(t.find(name), Some(b), "the name answers to its new slot");
        t.unalias(name);
        assert_eq!(t.find(name), None);
        t.unreserve(a);
        assert_eq!(t.used(), 1);
        assert_eq!(t.insert(Entry), Some(a), "free again");
    }

    #[test]
    fn a_queue_pair_number_names_its_slot_until_unmapped() {
        let mut t = SlotTable::new(4);
        let a = t.insert(Entry).expect("room");
        t.map_qp(0x11, a);
        assert_eq!(t.slot_of_qp(0x11), Some(a));
        assert_eq!(t.slot_of_qp(0x12), None);
        t.unmap_qp(0x11);
        assert_eq!(
            t.slot_of_qp(0x11),
            None,
            "a number the device may give again"
        );
    }
}
