//! One pool of receive buffers (a shared receive queue) shared among many connections, as pure
//! bookkeeping (no verbs), so that it can be checked deterministically.
//!
//! # The problem
//!
//! A hub serves many RC connections whose receives all come from one shared receive queue
//! (SRQ) of equally sized buffers. Each connection keeps its own [`Credits`]: a credit is still
//! the right to one posted buffer, and a grant still needs a posted buffer to land in, but any
//! posted buffer serves any connection. So receiver-not-ready is impossible as long as the SRQ
//! holds, summed over the connections, what each one's books say must be posted
//! ([`Credits::must_be_posted`]). [`Share`] decides which connection each posted buffer backs.
//!
//! # The rules
//!
//! Every posted buffer backs one connection or is *spare*: `posted == spare + Σ backing`, and a
//! connection's backing is exactly its [`Credits::must_be_posted`] (its peer's credits, the
//! credits owed to it, its grant slots not in use).
//!
//! - **Admission** sets aside `min_credits` spare buffers: the credits the new peer starts
//!   with ([`Credits::shared`]). Its grant slots start dormant (the peer cannot grant before
//!   we send it something): [`Share::wake_slots`] backs them before the connection sends,
//!   first of all, and [`Share::park_slots`] lets them sleep once the peer cannot grant.
//! - **A receive completion** takes one buffer from the connection it came from.
//! - **A posted buffer** goes, in this order, to a connection missing a grant slot; to a
//!   *starving* connection (the credits its peer holds or is owed are below `min_credits`, or
//!   its peer may be blocked); to a connection below its *quota*, the one whose peer holds or
//!   is owed the fewest credits first and round-robin among equals; else to spare. Spare is
//!   handed out the moment someone needs it, so spare buffers mean that nobody waits.
//! - **Quotas** start at `min_credits`. A peer that runs out of credits has its quota doubled
//!   (at most `max_credits`) into the *headroom*: the buffers left spare after the last
//!   re-post, less what other quotas grew into since. Quotas thus grow only into buffers
//!   nobody else needed, not into those that busy peers' consumed messages are about to give
//!   back (a peer that runs out mid-batch finds spare already spent on refills). What is spare
//!   is handed out at once; the rest comes with the next re-post, before any ordinary quota.
//!   A connection that received no data between two [`Share::tick`]s has its quota halved,
//!   never below `min_credits`, and owed credits beyond it (never announced to the peer) taken
//!   back. Credits a peer holds cannot be taken back: a shrunk quota only stops them from
//!   being refilled. A quota is thus about what the connection can really get, and so is the
//!   grant threshold derived from it.
//! - **Grants** are due after a quarter of the quota ([`threshold_for_quota`]): a peer allowed
//!   few credits must get them back long before a quarter of its announced depth is owed.
//! - **A held-back connection** ([`Share::hold`]) gets no credits at all, not even its minimum,
//!   and gives back those owed and not yet announced: its consumer keeps its messages unread
//!   in their buffers, which are lent out of the pool, so each credit returned would let the
//!   peer take one more buffer from everyone else (the pool would grow to its bound and others
//!   starve). Its peer stops once it spent what it holds. Grant slots are still restored (a
//!   grant frees its own buffer at once). Released, it is queued as any other.
//!
//! # Why nobody waits for ever
//!
//! - Every credit a peer holds and every grant slot it may use is backed by a posted buffer,
//!   and a message takes a buffer only from its own connection's backing: no receiver-not-ready.
//! - Within a connection, the argument of [`crate::credits`] holds as is: its grant slots are
//!   always posted or served first, and a grant frees its own buffer at once, so restoring
//!   grant slots costs the pool nothing.
//! - A connection falls below `min_credits` only by receiving data, whose buffers come back
//!   to the pool once the consumer lets go of them, and are posted at once while anyone
//!   starves ([`Share::urgent`]); starving connections are served before any quota, so what
//!   they all miss below the minimum never exceeds the buffers held or free. With
//!   `min_credits >= 1`, each peer then gets a credit back, solicited if it may be blocked.
//!   This assumes that the consumer eventually lets go: one that keeps every buffer while it
//!   waits for another message blocks every peer, not only the one that sent them.
//! - Within a priority, the connection whose peer has the fewest credits is served first and
//!   equals take turns, so busy peers cannot keep a starved one out.
//!
//! The simulator (`sim`) checks this over random schedules of many peers sending at different
//! rates, joining and dying, driving the real connection cores and the hub's rules.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::credits::Credits;

/// Access to the credit books of one connection (the hub's connection record implements it).
pub trait CreditHolder {
    /// The connection's books.
    fn credits(&self) -> &Credits;
    /// The connection's books, to change.
    fn credits_mut(&mut self) -> &mut Credits;
}

impl CreditHolder for Credits {
    fn credits(&self) -> &Credits {
        self
    }

    fn credits_mut(&mut self) -> &mut Credits {
        self
    }
}

/// How credits are shared; the same for every connection of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareConfig {
    /// Credits every peer starts with and is refilled to first (its announced initial credits).
    pub min_credits: u32,
    /// Most credits a peer may hold (its announced receive depth).
    pub max_credits: u32,
    /// Grant slots of every connection.
    pub grant_slots: u8,
}

impl ShareConfig {
    /// Posted buffers a new connection needs set aside: its initial credits (its grant slots
    /// start dormant, see [`Credits::shared`]).
    pub fn admission_cost(&self) -> u32 {
        self.min_credits
    }

    /// Posted buffers a connection holds at most beyond its credits: its grant slots.
    pub fn slot_cost(&self) -> u32 {
        u32::from(self.grant_slots)
    }
}

/// A [`ShareConfig`] the credit protocol cannot work with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Without a minimum, a peer could be left with no credit and no grant coming.
    #[error("min_credits must be at least 1")]
    NoMinimum,
    /// The most a peer may hold is less than what it starts with.
    #[error("max_credits ({max}) below min_credits ({min})")]
    MaxBelowMin {
        /// The configured minimum.
        min: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The grant-slot rule of [`crate::credits`] needs at least 3.
    #[error("{0} grant slots, at least 3 needed")]
    TooFewGrantSlots(u8),
}

/// Why [`Share::admit`] refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdmitError {
    /// Too few spare buffers: post more and admit with [`Share::admit_posted`], or refuse the
    /// client.
    #[error("{spare} spare receive buffers, {cost} needed")]
    NoRoom {
        /// Spare buffers now.
        spare: u32,
        /// Buffers a new connection needs.
        cost: u32,
    },
    /// The slot holds a connection not yet released.
    #[error("slot {0} is in use")]
    SlotInUse(usize),
}

/// What a receive completion polled from the shared queue was to its connection's books.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumed {
    /// A data message that [`Credits::on_receive`] took.
    Data,
    /// A grant that [`Credits::on_receive`] took (its buffer is free at once).
    Grant,
    /// Anything the books did not count: an error completion, a message breaking the protocol,
    /// a message after close. The connection gets no more buffers; what it consumed beyond its
    /// backing is charged to the pool, so that spare never overstates.
    Unaccounted,
}

/// A broken invariant found by [`Share::audit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Imbalance {
    /// The buffers posted are not the spare plus what backs connections (less the deficit).
    #[error("{posted} posted + {deficit} deficit != {spare} spare + {backed} backing connections")]
    Totals {
        /// Buffers posted.
        posted: u32,
        /// Buffers consumed that no books covered, not yet made up by posting.
        deficit: u32,
        /// Spare buffers.
        spare: u32,
        /// Buffers backing connections, summed over them.
        backed: u32,
    },
    /// A connection's backing differs from what its books say must be posted.
    #[error("connection {slot}: {backing} buffers back it, its books need {needed}")]
    Mismatch {
        /// The connection's slot.
        slot: usize,
        /// Buffers backing it.
        backing: u32,
        /// [`Credits::must_be_posted`].
        needed: u32,
    },
    /// An admitted connection has no books in the slice given.
    #[error("connection {0} is admitted but has no credit books")]
    Missing(usize),
    /// A peer holds or is owed more than `max_credits`.
    #[error("connection {slot}: its peer holds or is owed {lent} credits, over the maximum")]
    OverMax {
        /// The connection's slot.
        slot: usize,
        /// Credits its peer holds or is owed.
        lent: u32,
    },
    /// Buffers are spare while a connection waits for some.
    #[error("{spare} buffers spare while {waiting} connections wait")]
    SpareWhileWaiting {
        /// Spare buffers.
        spare: u32,
        /// Connections waiting.
        waiting: usize,
    },
}

/// The grant threshold for a connection whose quota is `quota`: a quarter of it, at least 1.
pub fn threshold_for_quota(quota: u32) -> u32 {
    (quota / 4).max(1)
}

/// Credits a connection's peer holds or is owed: the data buffers that back it.
fn lent(c: &Credits) -> u32 {
    c.peer_credits() + c.owed()
}

/// Why a connection waits for buffers, most pressing first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Need {
    /// A grant slot is not posted.
    GrantSlot,
    /// Below `min_credits`, or its peer may be blocked.
    Starving,
    /// Below its quota.
    Quota,
}

/// A connection's place in the queue.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    need: Need,
    /// The stamp of its one valid queue entry (others of the slot are stale).
    stamp: u64,
}

/// Queue entries, smallest first: need, then credits lent, then arrival (round-robin).
type Entry = Reverse<(Need, u32, u64, usize)>;

/// Per-slot state.
#[derive(Debug, Clone, Default)]
struct Account {
    live: bool,
    /// Gets no more buffers (closing, or its books no longer match).
    retired: bool,
    /// Held back ([`Share::hold`]): gets no credits, only its grant slots.
    held: bool,
    /// Posted buffers backing the connection.
    backing: u32,
    quota: u32,
    /// Received data since the last tick.
    busy: bool,
    waiting: Option<Waiting>,
    /// Pushed into the caller's `touched` during the current call.
    touched: bool,
}

/// Which connection each buffer posted to a shared receive queue backs (see the [module
/// docs](self)).
///
/// # Driving it
///
/// Connections are known by slot numbers (small integers, reused after [`Share::release`]);
/// methods that may hand buffers to any connection take the hub's records as a slice indexed by
/// slot (`None` for free slots).
///
/// 1. Post the initial fill and call [`Share::on_posted`].
/// 2. Before setting up a connection, [`Share::admit`] its slot; on [`AdmitError::NoRoom`],
///    post more buffers and [`Share::admit_posted`], or refuse the client. Its books are
///    [`Credits::shared`]`(max_credits, grant_slots, .., min_credits)`.
/// 3. For every receive completion polled from the SRQ, after [`Credits::on_receive`], call
///    [`Share::on_consumed`] with what it was ([`Share::on_stray`] if it names no admitted
///    connection).
/// 4. Re-post free buffers once a batch of them is free, or at once if [`Share::urgent`], and
///    call [`Share::on_posted`].
/// 5. Look for a due grant ([`Credits::take_grant`]) on every slot the calls pushed into
///    `touched` (they got buffers, received something or had their threshold changed; each is
///    pushed at most once per call, not once across calls; a slot may have been released
///    since) and on every connection you sent data on.
/// 6. About once a second, [`Share::tick`].
/// 7. A connection closing or failed may be [`Share::retire`]d (it gets no more buffers).
///    Once it can consume nothing more (its queue pair gone, its completions polled),
///    [`Share::release`] it.
///
/// Costs: a buffer handed out is O(log n) in the connections waiting; only `tick` and `audit`
/// visit every connection.
#[derive(Debug)]
pub struct Share {
    cfg: ShareConfig,
    slots: Vec<Account>,
    /// Connections waiting for buffers, with stale entries skipped when popped.
    queue: BinaryHeap<Entry>,
    next_stamp: u64,
    /// Connections waiting.
    waiting: usize,
    /// Connections waiting for a grant slot or starving.
    urgent: usize,
    posted: u32,
    spare: u32,
    /// Sum of the connections' backing.
    backed: u32,
    /// Buffers consumed beyond all backing and spare (a peer overrunning its credits), made up
    /// by the next buffers posted.
    deficit: u32,
    /// Spare after the last re-post, less what quotas grew by since.
    headroom: u32,
    /// Credits quotas would have grown by had there been headroom, since
    /// [`Share::take_demand`]: what a pool that may grow should add.
    demand: u32,
    /// Grant slots that could not be woken from spare, since [`Share::take_slot_demand`].
    slot_demand: u32,
}

impl Share {
    /// An empty pool; `cfg` must allow at least one credit and three grant slots.
    pub fn new(cfg: ShareConfig) -> Result<Self, ConfigError> {
        if cfg.min_credits == 0 {
            return Err(ConfigError::NoMinimum);
        }
        if cfg.max_credits < cfg.min_credits {
            return Err(ConfigError::MaxBelowMin {
                min: cfg.min_credits,
                max: cfg.max_credits,
            });
        }
        if cfg.grant_slots < 3 {
            return Err(ConfigError::TooFewGrantSlots(cfg.grant_slots));
        }
        Ok(Self {
            cfg,
            slots: Vec::new(),
            queue: BinaryHeap::new(),
            next_stamp: 0,
            waiting: 0,
            urgent: 0,
            posted: 0,
            spare: 0,
            backed: 0,
            deficit: 0,
            headroom: 0,
            demand: 0,
            slot_demand: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> ShareConfig {
        self.cfg
    }

    /// Posted buffers a new connection needs set aside.
    pub fn admission_cost(&self) -> u32 {
        self.cfg.admission_cost()
    }

    /// Buffers posted, as the books say.
    pub fn posted(&self) -> u32 {
        self.posted
    }

    /// Posted buffers backing no connection.
    pub fn spare(&self) -> u32 {
        self.spare
    }

    /// Buffers consumed beyond every connection's backing and the spare (only a peer breaking
    /// the protocol causes this); the next buffers posted make up for them.
    pub fn deficit(&self) -> u32 {
        self.deficit
    }

    /// The quota of the connection in `slot`, if one is admitted there.
    pub fn quota(&self, slot: usize) -> Option<u32> {
        self.live(slot).map(|s| s.quota)
    }

    /// Posted buffers backing the connection in `slot`.
    pub fn backing(&self, slot: usize) -> Option<u32> {
        self.live(slot).map(|s| s.backing)
    }

    /// The grant threshold its quota gives the connection in `slot` (kept set in its books).
    pub fn grant_threshold(&self, slot: usize) -> Option<u32> {
        self.quota(slot).map(threshold_for_quota)
    }

    /// Connections waiting for buffers.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether a connection misses a grant slot or starves: free buffers should be posted now,
    /// not once a batch is free.
    pub fn urgent(&self) -> bool {
        self.urgent > 0
    }

    /// Credits that quotas of peers running out would have grown by, had spare buffers been
    /// there, since the last call: a pool allowed to grow adds about that many buffers (they
    /// become headroom at the next [`Share::on_posted`]). Resets the count.
    pub fn take_demand(&mut self) -> u32 {
        std::mem::take(&mut self.demand)
    }

    /// Grant slots that connections about to send wanted backed and spare could not back,
    /// since the last call: a pool that may grow should add them (the next buffers posted
    /// back them before anything else), or a sender waits for buffers to come back.
    pub fn take_slot_demand(&mut self) -> u32 {
        std::mem::take(&mut self.slot_demand)
    }

    /// Admits a connection into `slot`, setting aside the buffers of its initial credits and
    /// grant slots.
    pub fn admit(&mut self, slot: usize) -> Result<(), AdmitError> {
        let cost = self.admission_cost();
        if self.slots.get(slot).is_some_and(|s| s.live) {
            return Err(AdmitError::SlotInUse(slot));
        }
        if self.spare < cost {
            return Err(AdmitError::NoRoom {
                spare: self.spare,
                cost,
            });
        }
        if slot >= self.slots.len() {
            self.slots.resize_with(slot + 1, Account::default);
        }
        self.slots[slot] = Account {
            live: true,
            backing: cost,
            quota: self.cfg.min_credits,
            ..Account::default()
        };
        self.spare -= cost;
        self.backed += cost;
        self.headroom = self.headroom.saturating_sub(cost);
        Ok(())
    }

    /// `n` buffers were just posted to make room for a new connection in `slot`: it is
    /// admitted first (if they and the spare cover its cost), then the rest is handed out as
    /// by [`Share::on_posted`]. Posting first and admitting after would let the connections
    /// waiting take them.
    pub fn admit_posted<H: CreditHolder>(
        &mut self,
        slot: usize,
        n: u32,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) -> Result<(), AdmitError> {
        self.posted += n;
        self.spare += n;
        self.cover_deficit();
        let admitted = self.admit(slot);
        let mark = touched.len();
        self.serve(conns, touched);
        self.untouch(&touched[mark..]);
        admitted
    }

    /// `n` more buffers were posted to the SRQ (initial fill, growth, re-posting). They go to
    /// the connections waiting, most pressing first (see the [module docs](self)); the rest
    /// are spare.
    pub fn on_posted<H: CreditHolder>(
        &mut self,
        n: u32,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) {
        let mark = touched.len();
        self.posted += n;
        self.spare += n;
        self.cover_deficit();
        self.serve(conns, touched);
        self.untouch(&touched[mark..]);
    }

    /// One posted buffer was consumed by a receive completion (successful or not) of the
    /// connection in `slot`, whose books are `holder`; `receipt` says what its books made of it.
    /// The slot is pushed into `touched`: a grant may be due there now.
    pub fn on_consumed<H: CreditHolder>(
        &mut self,
        slot: usize,
        holder: &mut H,
        receipt: Consumed,
        touched: &mut Vec<usize>,
    ) {
        debug_assert!(self.posted > 0, "a receive completed with nothing posted");
        self.posted = self.posted.saturating_sub(1);
        let Some(s) = self.slots.get_mut(slot).filter(|s| s.live) else {
            debug_assert!(false, "a receive for slot {slot}: use on_stray");
            self.charge_pool();
            return;
        };
        match receipt {
            Consumed::Data => s.busy = true,
            Consumed::Grant => {}
            Consumed::Unaccounted => s.retired = true,
        }
        let retired = s.retired;
        if s.backing > 0 {
            s.backing -= 1;
            self.backed -= 1;
        } else {
            self.charge_pool();
        }
        touched.push(slot);
        if retired {
            self.dequeue(slot);
            return;
        }
        debug_assert_eq!(
            self.slots[slot].backing,
            holder.credits().must_be_posted(),
            "slot {slot}: backing and books agree"
        );
        if receipt == Consumed::Data
            && !self.slots[slot].held
            && holder.credits().peer_may_be_blocked()
        {
            self.grow(slot, holder);
        }
        self.requeue(slot, holder.credits());
        self.serve_slot(slot, holder, touched);
        self.check_totals();
    }

    /// A receive completion (successful or not) that names no admitted connection, say of a
    /// queue pair already released: the buffer it consumed is charged to the pool.
    pub fn on_stray(&mut self) {
        debug_assert!(self.posted > 0, "a receive completed with nothing posted");
        self.posted = self.posted.saturating_sub(1);
        self.charge_pool();
        self.check_totals();
    }

    /// The connection in `slot` is about to send: its dormant grant slots (if any) must be
    /// backed first. They are, at once, from spare; otherwise the connection waits for the
    /// next buffers posted, before anyone else, and the pool's owner is asked for more
    /// ([`Share::take_demand`]). Returns whether they are backed now.
    pub fn wake_slots<H: CreditHolder>(
        &mut self,
        slot: usize,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) -> bool {
        let Some(holder) = conns.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        if holder.credits().slots_ready() {
            return true;
        }
        if !self.live(slot).is_some_and(|s| !s.retired) {
            return false;
        }
        let wanted = holder.credits_mut().want_slots();
        self.requeue(slot, holder.credits());
        let mark = touched.len();
        let spare = self.spare;
        self.serve_slot(slot, holder, touched);
        // Quotas grow only into what nobody took.
        self.headroom = self.headroom.saturating_sub(spare - self.spare);
        self.untouch(&touched[mark..]);
        let ready = holder.credits().slots_ready();
        if !ready {
            self.slot_demand = self.slot_demand.saturating_add(wanted);
        }
        self.check_totals();
        ready
    }

    /// Lets the grant slots of the connection in `slot` sleep if its peer cannot grant any
    /// more ([`Credits::park_slots`]); the buffers behind them are spare, and go to those
    /// waiting.
    pub fn park_slots<H: CreditHolder>(
        &mut self,
        slot: usize,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) {
        let Some(holder) = conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        let Some(s) = self.slots.get_mut(slot).filter(|s| s.live && !s.retired) else {
            return;
        };
        let n = holder.credits_mut().park_slots();
        if n == 0 {
            return;
        }
        s.backing -= n;
        self.backed -= n;
        self.spare += n;
        self.requeue(slot, holder.credits());
        self.cover_deficit();
        let mark = touched.len();
        self.serve(conns, touched);
        self.untouch(&touched[mark..]);
    }

    /// Holds the connection in `slot` back (`on`) or lets it go: while held it gets no
    /// credits, not even `min_credits`, and credits owed to it (never announced) go back to
    /// the pool at once; its quota does not grow. For a consumer that keeps the peer's
    /// messages unread in their buffers (which are lent, not posted), so that the peer stops
    /// once it spent what it holds instead of drawing the pool dry. Its grant slots are served
    /// as ever. Let go, it waits for buffers like any other (starving if it ran out). Slots
    /// given buffers (or whose owed credits changed) are pushed into `touched`.
    pub fn hold<H: CreditHolder>(
        &mut self,
        slot: usize,
        on: bool,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) {
        let Some(s) = self.slots.get_mut(slot).filter(|s| s.live && !s.retired) else {
            return;
        };
        if s.held == on {
            return;
        }
        s.held = on;
        let Some(holder) = conns.get_mut(slot).and_then(Option::as_mut) else {
            debug_assert!(false, "connection {slot} has no books");
            return;
        };
        let mark = touched.len();
        if on {
            let c = holder.credits_mut();
            let taken = c.withdraw_owed(c.owed());
            if taken > 0 {
                let s = &mut self.slots[slot];
                s.backing -= taken;
                self.backed -= taken;
                self.spare += taken;
                self.touch(slot, touched);
            }
        }
        self.requeue(slot, holder.credits());
        self.cover_deficit();
        self.serve(conns, touched);
        self.untouch(&touched[mark..]);
    }

    /// Whether the connection in `slot` is held back ([`Share::hold`]).
    pub fn is_held(&self, slot: usize) -> bool {
        self.live(slot).is_some_and(|s| s.held)
    }

    /// Stops handing buffers to the connection in `slot` (it is closing or failed); what backs
    /// it returns to the pool at [`Share::release`].
    pub fn retire(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot).filter(|s| s.live) {
            s.retired = true;
            self.dequeue(slot);
        }
    }

    /// Called about once a second: connections that received no data since the last tick have
    /// their quota halved (not below `min_credits`) and owed credits beyond it taken back.
    /// Slots whose threshold changed are pushed into `touched`.
    pub fn tick<H: CreditHolder>(&mut self, conns: &mut [Option<H>], touched: &mut Vec<usize>) {
        let mark = touched.len();
        let min = self.cfg.min_credits;
        for slot in 0..self.slots.len() {
            let s = &mut self.slots[slot];
            if !s.live || s.retired {
                continue;
            }
            let idle = !std::mem::replace(&mut s.busy, false);
            let Some(holder) = conns.get_mut(slot).and_then(Option::as_mut) else {
                debug_assert!(false, "connection {slot} has no books");
                continue;
            };
            let mut changed = false;
            if idle && s.quota > min {
                s.quota = (s.quota / 2).max(min);
                holder
                    .credits_mut()
                    .set_grant_threshold(threshold_for_quota(s.quota));
                changed = true;
            }
            // Owed credits were never announced: beyond the quota, they can back others.
            let c = holder.credits_mut();
            let keep = s.quota.saturating_sub(c.peer_credits());
            let taken = c.withdraw_owed(c.owed().saturating_sub(keep));
            if taken > 0 {
                s.backing -= taken;
                self.backed -= taken;
                self.spare += taken;
                changed = true;
            }
            if changed {
                self.touch(slot, touched);
                self.requeue(slot, holder.credits());
            }
        }
        self.cover_deficit();
        self.serve(conns, touched);
        self.untouch(&touched[mark..]);
        self.compact();
    }

    /// The connection in `slot` is gone and can consume nothing more (its record in `conns`
    /// may still be there): what backed it is spare, and goes to those waiting.
    pub fn release<H: CreditHolder>(
        &mut self,
        slot: usize,
        conns: &mut [Option<H>],
        touched: &mut Vec<usize>,
    ) {
        let Some(s) = self.slots.get_mut(slot).filter(|s| s.live) else {
            return;
        };
        let backing = std::mem::take(&mut s.backing);
        self.dequeue(slot);
        self.slots[slot] = Account::default();
        self.backed -= backing;
        self.spare += backing;
        self.cover_deficit();
        let mark = touched.len();
        self.serve(conns, touched);
        self.untouch(&touched[mark..]);
    }

    /// Checks the invariants against the connections' books (O(connections)): posted buffers
    /// are the spare plus each connection's [`Credits::must_be_posted`], no peer may hold more
    /// than `max_credits`, and nothing is spare while a connection waits.
    pub fn audit<H: CreditHolder>(&self, conns: &[Option<H>]) -> Result<(), Imbalance> {
        let mut backed = 0;
        for (slot, s) in self.slots.iter().enumerate().filter(|(_, s)| s.live) {
            backed += s.backing;
            let Some(holder) = conns.get(slot).and_then(Option::as_ref) else {
                return Err(Imbalance::Missing(slot));
            };
            let c = holder.credits();
            let needed = c.must_be_posted();
            // A connection that consumed unaccounted buffers has fewer than its books say.
            if needed != s.backing && !(s.retired && s.backing < needed) {
                return Err(Imbalance::Mismatch {
                    slot,
                    backing: s.backing,
                    needed,
                });
            }
            if lent(c) > self.cfg.max_credits {
                return Err(Imbalance::OverMax {
                    slot,
                    lent: lent(c),
                });
            }
        }
        if backed != self.backed || self.posted + self.deficit != self.spare + backed {
            return Err(Imbalance::Totals {
                posted: self.posted,
                deficit: self.deficit,
                spare: self.spare,
                backed,
            });
        }
        if self.spare > 0 && self.waiting > 0 {
            return Err(Imbalance::SpareWhileWaiting {
                spare: self.spare,
                waiting: self.waiting,
            });
        }
        Ok(())
    }
}

mod serve;
#[cfg(test)]
mod tests;
