//! Credit-based flow control, as pure bookkeeping (no verbs), so that it can be checked
//! deterministically.
//!
//! # The protocol
//!
//! Each side posts `recv_depth` receive buffers for data plus `grant_slots` more for credit
//! grants, all before its queue pair reaches RTR, and announces both in the handshake. A
//! *credit* is the right to send one data message: one posted receive buffer at the peer.
//!
//! Every message carries 32 bits of immediate data ([`Imm`]): credits returned, a count of the
//! grants received so far (the *echo*), and two flags. Credits ride on data messages when there
//! are any; when none flow back, the receiver sends an explicit *grant*, a message with no
//! payload. A grant does not spend a credit: it lands in one of the peer's grant slots, which the
//! peer re-posts at once and confirms through its echo. A side keeps at most `grant_slots`
//! grants unconfirmed. So:
//!
//! - a sender never sends without a credit, and a grant always finds a slot (a shared
//!   receive side backs its slots whenever the peer may grant, see below): no
//!   receiver-not-ready NAK can happen;
//! - grants never cost data credits, so two idle peers never bounce grants back and forth.
//!
//! When a data message spends the sender's last credit it says so ([`Imm::EXHAUSTED`]) and is
//! solicited whatever the caller asked: otherwise a receiver asleep solicited-only would never
//! look at it, never grant, and both would wait forever. The receiver then grants as soon as it
//! has anything to give, and that grant is *solicited*: a sender blocked on credits must be
//! woken by it even if it sleeps solicited-only (the hang UCX hit). Grants are also solicited
//! when the receiver sees the sender at zero credits.
//!
//! # Why a blocked sender always gets its grant
//!
//! Ordinary grants stop while `grant_slots - 1` are unconfirmed; the last slot is kept for a
//! grant whose echo is news. A sender out of credits holding `grant_slots - 1` unechoed grants
//! sends an echo-only grant (solicited, no credits) into that slot, since no data message of
//! its will carry the echo now. So a peer owing credits to a blocked sender always regains a
//! slot and grants them, solicited. At least 3 grant slots are required.
//!
//! One case is the driver's to cover: grants sent *before* the peer saw us exhausted are not
//! solicited, and they may hold every ordinary grant slot while they sit unpolled in our
//! completion queue; the peer then owes us more but may not grant it. So a sender out of
//! credits must wait for *any* completion, not only a solicited one (the connection and the
//! hub arm both queues for the next completion while a send waits). The simulator found this
//! crossing (`sim`: random schedules of two peers, and of many peers on a hub, driving the real
//! connection core); its predecessors found the echo-only case, and the crossing of two peers
//! that each held all the other's slots.

//! # Grants answer data
//!
//! A side sends an explicit grant only to return credits of data it received (credits owed
//! beyond those, which a shared pool may lend, ride along, or wait for the peer's next
//! message), or to echo. So a peer that was sent nothing cannot grant, and a shared receive
//! side backs its grant slots only while the peer may: see [`Credits::shared`] and
//! [`Credits::park_slots`]. A peer out of credits has sent data, so its grant always may go.

/// The 32 bits of immediate data of every rdmsg message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imm {
    /// Data credits returned to the receiver of this message.
    pub credits: u16,
    /// Grants the sender has received and re-posted the slot of, modulo 256.
    pub echo: u8,
    /// Flag bits ([`Imm::GRANT`], [`Imm::EXHAUSTED`]).
    pub flags: u8,
}

impl Imm {
    /// The message is a credit grant without payload.
    pub const GRANT: u8 = 0x80;
    /// The sender spent its last credit on this message.
    pub const EXHAUSTED: u8 = 0x40;
    /// The sender is closing: nothing follows this (payload-less) message.
    pub const CLOSE: u8 = 0x20;

    /// Packs into the immediate-data word.
    pub fn encode(self) -> u32 {
        (u32::from(self.flags) << 24) | (u32::from(self.echo) << 16) | u32::from(self.credits)
    }

    /// Unpacks; `None` if reserved flag bits are set.
    pub fn decode(word: u32) -> Option<Self> {
        let flags = (word >> 24) as u8;
        if flags & !(Self::GRANT | Self::EXHAUSTED | Self::CLOSE) != 0 {
            return None;
        }
        Some(Self {
            credits: word as u16,
            echo: (word >> 16) as u8,
            flags,
        })
    }

    /// Whether this is a grant.
    pub fn is_grant(self) -> bool {
        self.flags & Self::GRANT != 0
    }

    /// Whether the sender is out of credits.
    pub fn is_exhausted(self) -> bool {
        self.flags & Self::EXHAUSTED != 0
    }
}

/// A peer broke the credit protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A data message arrived although the peer had no credit (we would have hit RNR).
    #[error("data message beyond the credits granted")]
    Overrun,
    /// A grant arrived although the peer had no free grant slot.
    #[error("grant beyond the grant slots")]
    GrantOverrun,
    /// The echo confirms grants never sent.
    #[error("echo confirms grants never sent")]
    BadEcho,
    /// More credits returned than ever lent.
    #[error("more credits returned than lent")]
    TooManyCredits,
    /// Reserved immediate-data bits set.
    #[error("reserved immediate-data bits set")]
    BadImm,
}

/// Both directions of one connection's credit bookkeeping.
#[derive(Debug, Clone)]
pub struct Credits {
    // Sending side.
    /// Data messages we may still send.
    credits: u32,
    /// Most credits we can ever hold: the peer's data receive depth.
    peer_depth: u32,
    /// Grants we sent, modulo 256.
    grants_sent: u8,
    /// Grants of ours the peer confirmed, modulo 256.
    peer_echo: u8,
    /// The peer's grant slots.
    peer_grant_slots: u8,

    // Receiving side.
    /// Credits the peer holds, as far as we know (at least what it really holds).
    peer_credits: u32,
    /// Buffers re-posted and not yet announced to the peer.
    owed: u32,
    /// Grants received whose slot is not yet re-posted.
    slots_missing: u32,
    /// Grants received and re-posted, modulo 256: our echo.
    grants_seen: u8,
    /// The echo we last sent.
    echo_sent: u8,
    /// The peer spent its last credit and may be blocked.
    peer_exhausted: bool,
    /// Our data receive depth.
    depth: u32,
    /// Our grant slots.
    grant_slots: u8,
    /// Explicit grants are sent once this many credits are owed.
    grant_threshold: u32,

    // Grant slots of a shared receive side, backed only while the peer may grant.
    /// Our grant slots are backed only while the peer may send a grant ([`Credits::shared`]).
    lazy_slots: bool,
    /// Grant slots with no buffer behind them (lazy only): the peer cannot grant now.
    dormant_slots: u32,
    /// The driver wants the dormant slots backed (we are about to send).
    wake_wanted: bool,
    /// Data messages we sent whose credits the peer has not returned (saturating: credits
    /// returned beyond them were new ones).
    sent_unreturned: u32,
    /// Data messages we received whose credits we have not returned (likewise).
    received_unreturned: u32,
    /// The peer announced fewer initial credits than its depth: a shared receive side that
    /// lends credits beyond those of our data, so `sent_unreturned` is not exact and its
    /// slots, once woken, never sleep again.
    peer_lends: bool,
}

/// What the connection should do after taking in completions and re-posting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantDecision {
    /// The immediate data of the grant to send.
    pub imm: Imm,
    /// Whether the grant must be solicited (the peer may be blocked on it).
    pub solicited: bool,
}

impl Credits {
    /// Bookkeeping for a connection where we receive into `depth` data buffers plus
    /// `grant_slots` grant slots, and the peer into `peer_depth` plus `peer_grant_slots`.
    /// We start with `initial_credits` (the peer's announcement); the peer with `depth`.
    pub fn new(
        depth: u32,
        grant_slots: u8,
        peer_depth: u32,
        peer_grant_slots: u8,
        initial_credits: u32,
    ) -> Self {
        Self {
            lazy_slots: false,
            dormant_slots: 0,
            ..Self::shared(
                depth,
                grant_slots,
                peer_depth,
                peer_grant_slots,
                initial_credits,
                depth,
            )
        }
    }

    /// Bookkeeping for a connection whose receive buffers come from a pool shared with other
    /// connections (a shared receive queue, see [`crate::share`]): the peer starts with
    /// `peer_initial` credits (our announced initial credits, backed by buffers set aside for
    /// it) and may never hold more than `max_credits` (our announced receive depth), however
    /// many the pool lends it later. Explicit grants are due after a quarter of
    /// `peer_initial` until [`Credits::set_grant_threshold`] says otherwise.
    ///
    /// Its grant slots start *dormant*, with no buffer behind them: a peer grants only to
    /// return credits for data we sent it, or to echo our grants (see the module docs), so
    /// until we send it anything it cannot grant, and an idle peer costs only its credits.
    /// Before sending, the driver has them backed ([`Credits::want_slots`], then buffers
    /// re-posted: [`Credits::on_reposted`]); once the peer returned everything and cannot
    /// echo, they may sleep again ([`Credits::park_slots`]).
    pub fn shared(
        max_credits: u32,
        grant_slots: u8,
        peer_depth: u32,
        peer_grant_slots: u8,
        initial_credits: u32,
        peer_initial: u32,
    ) -> Self {
        Self {
            credits: initial_credits,
            peer_depth,
            grants_sent: 0,
            peer_echo: 0,
            peer_grant_slots,
            peer_credits: peer_initial,
            owed: 0,
            slots_missing: 0,
            grants_seen: 0,
            echo_sent: 0,
            peer_exhausted: false,
            depth: max_credits,
            grant_slots,
            grant_threshold: (peer_initial / 4).max(1),
            lazy_slots: true,
            dormant_slots: u32::from(grant_slots),
            wake_wanted: false,
            sent_unreturned: 0,
            received_unreturned: 0,
            peer_lends: initial_credits < peer_depth,
        }
    }

    /// These books with the grant slots of `before` (backed, dormant or wanted): the books of
    /// a connection whose peer just became known replace placeholders whose slots the
    /// driver may have woken already.
    pub fn with_slots_of(mut self, before: &Credits) -> Self {
        if self.lazy_slots && before.lazy_slots {
            self.dormant_slots = before.dormant_slots.min(u32::from(self.grant_slots));
            self.wake_wanted = before.wake_wanted;
        }
        self
    }

    /// Whether every grant slot is backed: we may send data.
    pub fn slots_ready(&self) -> bool {
        self.dormant_slots == 0
    }

    /// Whether a grant needs the grant slots backed first: it would leave the peer holding
    /// enough of our grants unechoed to echo them with a grant of its own. (A grant returns
    /// credits of data received, and gives the peer nothing to return.)
    pub fn grant_needs_slots(&self) -> bool {
        !self.slots_ready() && self.unconfirmed_grants() + 1 >= self.echo_threshold()
    }

    /// Our grants the peer must hold unechoed before it may echo them with a grant.
    fn echo_threshold(&self) -> u8 {
        self.peer_grant_slots.saturating_sub(1).max(1)
    }

    /// Asks for the dormant grant slots to be backed (the next buffers re-posted restore
    /// them, after missing ones); returns how many are dormant.
    pub fn want_slots(&mut self) -> u32 {
        if self.dormant_slots > 0 {
            self.wake_wanted = true;
        }
        self.dormant_slots
    }

    /// Dormant grant slots wanted backed ([`Credits::want_slots`]).
    pub fn slots_wanted(&self) -> u32 {
        if self.wake_wanted {
            self.dormant_slots
        } else {
            0
        }
    }

    /// Lets the grant slots of a lazy side sleep if the peer cannot grant any more: it
    /// returned the credits of everything we sent, holds too few of our grants unechoed to
    /// echo them, and no grant of its waits to be re-posted. Never toward a peer that lends
    /// (a hub: it returns credits beyond those of our data, so which of ours are still
    /// unreturned is not known). Returns the buffers this frees (0 if nothing changed).
    pub fn park_slots(&mut self) -> u32 {
        let echo_possible = self.unconfirmed_grants() >= self.echo_threshold();
        if !self.lazy_slots
            || self.peer_lends
            || self.dormant_slots > 0
            || self.slots_missing > 0
            || self.sent_unreturned > 0
            || echo_possible
        {
            return 0;
        }
        self.dormant_slots = u32::from(self.grant_slots);
        self.wake_wanted = false;
        self.dormant_slots
    }

    /// Makes explicit grants due once `n` credits (at least 1) are owed. A connection whose
    /// peer may hold only a small share of a pool must return credits after a quarter of that
    /// share, not of its announced depth, or its peer would block before a grant is due.
    pub fn set_grant_threshold(&mut self, n: u32) {
        self.grant_threshold = n.max(1);
    }

    /// Owed credits from which an explicit grant is due.
    pub fn grant_threshold(&self) -> u32 {
        self.grant_threshold
    }

    /// Takes back up to `n` owed credits (buffers re-posted but not yet announced to the peer),
    /// so that they can back another connection's credits; returns how many. The peer never
    /// heard of them, so nothing it may do changes.
    pub fn withdraw_owed(&mut self, n: u32) -> u32 {
        let n = n.min(self.owed);
        self.owed -= n;
        n
    }

    /// Data messages we may send now.
    pub fn available(&self) -> u32 {
        self.credits
    }

    /// Most credits we can ever hold: the peer's data receive depth.
    pub fn peer_depth(&self) -> u32 {
        self.peer_depth
    }

    /// Credits the peer holds as far as we know.
    pub fn peer_credits(&self) -> u32 {
        self.peer_credits
    }

    /// Credits re-posted but not yet returned.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// Our grants the peer has not confirmed yet.
    pub fn unconfirmed_grants(&self) -> u8 {
        self.grants_sent.wrapping_sub(self.peer_echo)
    }

    /// Receive buffers that must be posted for the peer to use what it may: its credits, the
    /// owed ones about to be returned, and the grant slots.
    pub fn must_be_posted(&self) -> u32 {
        self.peer_credits + self.owed + u32::from(self.grant_slots)
            - self.slots_missing
            - self.dormant_slots
    }

    /// Grants received whose slot is not re-posted yet.
    pub fn slots_missing(&self) -> u32 {
        self.slots_missing
    }

    /// The peer may be waiting for credits.
    pub fn peer_may_be_blocked(&self) -> bool {
        self.peer_exhausted || self.peer_credits == 0
    }

    /// Takes in the immediate data of a received message. Returns whether it was a grant (its
    /// buffer goes straight back to the pool and must be re-posted).
    pub fn on_receive(&mut self, imm: Imm) -> Result<bool, Violation> {
        let newly_confirmed = imm.echo.wrapping_sub(self.peer_echo);
        if newly_confirmed > self.unconfirmed_grants() {
            return Err(Violation::BadEcho);
        }
        if self.credits + u32::from(imm.credits) > self.peer_depth {
            return Err(Violation::TooManyCredits);
        }
        if imm.is_grant() {
            // Dormant slots have no buffer: a grant while they sleep broke the rule that a
            // side grants only for data received or to echo.
            if self.slots_missing + self.dormant_slots >= u32::from(self.grant_slots) {
                return Err(Violation::GrantOverrun);
            }
            self.slots_missing += 1;
        } else {
            if self.peer_credits == 0 {
                return Err(Violation::Overrun);
            }
            self.peer_credits -= 1;
            self.peer_exhausted = imm.is_exhausted();
            self.received_unreturned += 1;
        }
        self.peer_echo = imm.echo;
        self.credits += u32::from(imm.credits);
        self.sent_unreturned = self.sent_unreturned.saturating_sub(u32::from(imm.credits));
        Ok(imm.is_grant())
    }

    /// Records `n` receive buffers re-posted: grant slots are restored first (and echoed), the
    /// rest become owed credits.
    pub fn on_reposted(&mut self, n: u32) {
        let slots = n.min(self.slots_missing);
        self.slots_missing -= slots;
        self.grants_seen = self.grants_seen.wrapping_add(slots as u8);
        // Dormant slots wanted back come next (nothing to echo: no grant used them).
        let woken = (n - slots).min(self.slots_wanted());
        self.dormant_slots -= woken;
        if self.dormant_slots == 0 {
            self.wake_wanted = false;
        }
        self.owed += n - slots - woken;
    }

    /// Immediate data for a data message we are about to send, spending one credit and
    /// returning every owed credit; `flags` are added ([`Imm::CLOSE`]). `None` if we have no
    /// credit. The second value says whether the message must be solicited: it spends our last
    /// credit (the receiver must wake to grant more), or it returns credits to a peer that may
    /// be blocked.
    #[inline]
    pub fn take_for_data(&mut self, flags: u8) -> Option<(Imm, bool)> {
        if self.credits == 0 || !self.slots_ready() {
            return None;
        }
        self.credits -= 1;
        self.sent_unreturned += 1;
        let mut flags = flags & Imm::CLOSE;
        // Spending the last credit: we may block next, and the receiver must be awake to
        // grant, so this message wakes it even if it sleeps solicited-only.
        let exhausted = self.credits == 0;
        if exhausted {
            flags |= Imm::EXHAUSTED;
        }
        let must_solicit = exhausted || (self.owed > 0 && self.peer_may_be_blocked());
        let credits = self.return_owed();
        self.echo_sent = self.grants_seen;
        Some((
            Imm {
                credits,
                echo: self.grants_seen,
                flags,
            },
            must_solicit,
        ))
    }

    fn return_owed(&mut self) -> u16 {
        let n = self.owed.min(u32::from(u16::MAX)) as u16;
        self.owed -= u32::from(n);
        self.received_unreturned = self.received_unreturned.saturating_sub(u32::from(n));
        self.peer_credits += u32::from(n);
        if n > 0 {
            self.peer_exhausted = false;
        }
        n
    }

    /// Whether an explicit grant is due, and if so its immediate data (the credits are counted
    /// as returned when this returns `Some`: send it).
    ///
    /// Ordinary grants keep one of the peer's grant slots free. That last slot takes only a
    /// grant whose echo is news to the peer, such as the one a sender out of credits sends,
    /// with no credits, when it holds enough unechoed grants to stop the peer from granting.
    /// Without it, two peers could each hold the other's grant slots unconfirmed and never
    /// grant again.
    pub fn take_grant(&mut self) -> Option<GrantDecision> {
        let (urgent, echo_due) = self.grant_due()?;
        let credits = self.return_owed();
        self.grants_sent = self.grants_sent.wrapping_add(1);
        self.echo_sent = self.grants_seen;
        Some(GrantDecision {
            imm: Imm {
                credits,
                echo: self.grants_seen,
                flags: Imm::GRANT,
            },
            // The peer may be blocked on the credits, or on this echo before it can grant.
            solicited: urgent || echo_due,
        })
    }

    /// Whether [`Credits::take_grant`] would grant now (slots aside): `Some((urgent,
    /// echo_due))` if so.
    ///
    /// A side grants only to return credits of data it received (owed credits beyond those,
    /// which a shared pool lends, ride along or wait for the peer's next message), or to
    /// echo: so a peer that was sent nothing cannot grant, which lets a shared receive side
    /// leave its grant slots unbacked ([`Credits::park_slots`]).
    pub fn grant_due(&self) -> Option<(bool, bool)> {
        // Out of credits, we send no data to carry our echo; if the peer may be at its limit
        // of ordinary grants because of it, tell it. (At least `grant_slots - 1` unechoed, not
        // 1: so that two blocked peers do not echo each other's echoes for ever.)
        let news = self.grants_seen.wrapping_sub(self.echo_sent);
        let echo_due = self.credits == 0
            && self.slots_missing == 0
            && news >= self.grant_slots.saturating_sub(1);
        let echo_due = echo_due && news > 0;
        let urgent = self.owed > 0 && self.peer_may_be_blocked();
        if !(urgent || self.owed >= self.grant_threshold || echo_due) {
            return None;
        }
        if self.received_unreturned == 0 && !echo_due {
            return None;
        }
        let limit = if news > 0 {
            self.peer_grant_slots
        } else {
            self.peer_grant_slots.saturating_sub(1)
        };
        if self.unconfirmed_grants() >= limit {
            return None;
        }
        Some((urgent, echo_due))
    }

    /// Our data receive depth (with a shared receive side, the most credits the peer may hold).
    pub fn depth(&self) -> u32 {
        self.depth
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imm_round_trips_and_rejects_reserved_bits() {
        let imm = Imm {
            credits: 513,
            echo: 200,
            flags: Imm::GRANT | Imm::EXHAUSTED,
        };
        assert_eq!(Imm::decode(imm.encode()), Some(imm));
        assert_eq!(Imm::decode(0x0100_0000), None);
    }

    #[test]
    fn sender_stops_at_zero_and_flags_exhaustion() {
        let mut c = Credits::new(4, 2, 2, 2, 2);
        let (first, _) = c.take_for_data(0).unwrap();
        assert!(!first.is_exhausted());
        let (last, _) = c.take_for_data(0).unwrap();
        assert!(last.is_exhausted());
        assert!(c.take_for_data(0).is_none());
    }

    #[test]
    fn grants_wait_for_the_threshold_unless_the_peer_is_blocked() {
        let mut c = Credits::new(8, 2, 8, 2, 8);
        c.on_receive(Imm::decode(0).unwrap()).unwrap();
        c.on_reposted(1);
        assert_eq!(
            c.take_grant(),
            None,
            "1 owed, threshold 2, peer not blocked"
        );
        c.on_receive(Imm {
            credits: 0,
            echo: 0,
            flags: Imm::EXHAUSTED,
        })
        .unwrap();
        c.on_reposted(1);
        let g = c.take_grant().unwrap();
        assert!(g.solicited, "the peer said it is out of credits");
        assert_eq!(g.imm.credits, 2);
        assert_eq!(c.unconfirmed_grants(), 1);
    }

    #[test]
    fn a_shared_side_backs_its_grant_slots_only_while_the_peer_may_grant() {
        let mut c = Credits::shared(64, 3, 8, 3, 8, 4);
        // Sent nothing: the peer cannot grant, the slots sleep.
        assert_eq!(c.must_be_posted(), 4);
        assert!(!c.slots_ready());
        assert!(
            c.take_for_data(0).is_none(),
            "no send before the slots are backed"
        );
        let grant = Imm {
            credits: 1,
            echo: 0,
            flags: Imm::GRANT,
        };
        assert_eq!(
            c.clone().on_receive(Imm {
                credits: 0,
                ..grant
            }),
            Err(Violation::GrantOverrun),
            "a grant while they sleep breaks the rule"
        );
        assert_eq!(c.want_slots(), 3);
        c.on_reposted(5);
        assert!(c.slots_ready());
        assert_eq!((c.owed(), c.must_be_posted()), (2, 4 + 2 + 3));
        assert_eq!(c.park_slots(), 3, "still nothing sent");
        c.want_slots();
        c.on_reposted(3);
        c.take_for_data(0).unwrap();
        assert_eq!(c.park_slots(), 0, "the peer owes us a credit");
        c.on_receive(grant).unwrap();
        assert_eq!(c.park_slots(), 0, "its grant's slot is not re-posted yet");
        c.on_reposted(1);
        assert_eq!(c.park_slots(), 3, "everything back");
        assert_eq!(c.must_be_posted(), 4 + 2);
    }

    #[test]
    fn a_side_grants_only_for_data_received_or_to_echo() {
        let mut c = Credits::shared(64, 3, 8, 3, 8, 4);
        // Buffers lent beyond the minimum, with no data received: owed, not granted.
        c.on_reposted(8);
        assert_eq!(c.grant_due(), None);
        c.on_receive(Imm::decode(0).unwrap()).unwrap();
        let g = c.take_grant().unwrap();
        assert_eq!(g.imm.credits, 8, "a grant for data returns everything owed");
        c.on_reposted(1);
        assert_eq!(
            c.grant_due(),
            None,
            "and nothing more until more data comes"
        );
    }

    #[test]
    fn a_shared_receive_side_starts_its_peer_at_the_minimum() {
        let mut c = Credits::shared(64, 3, 8, 3, 8, 4);
        c.want_slots();
        c.on_reposted(3);
        assert_eq!(c.peer_credits(), 4);
        assert_eq!(c.must_be_posted(), 4 + 3);
        assert_eq!(c.grant_threshold(), 1, "a quarter of the initial credits");
        c.set_grant_threshold(0);
        assert_eq!(c.grant_threshold(), 1, "at least one");
        c.on_reposted(5);
        c.set_grant_threshold(8);
        assert_eq!(c.withdraw_owed(2), 2);
        assert_eq!(c.withdraw_owed(9), 3, "only what is owed");
        assert_eq!(c.must_be_posted(), 4 + 3);
        // Up to 64 may be lent, whatever the initial 4 (returned with a grant for data).
        c.on_reposted(60);
        c.on_receive(Imm::decode(0).unwrap()).unwrap();
        c.on_reposted(1);
        assert_eq!(c.take_grant().unwrap().imm.credits, 61);
        assert_eq!(c.peer_credits(), 64);
        assert_eq!(Credits::new(8, 3, 8, 3, 8).grant_threshold(), 2);
        assert!(
            Credits::new(8, 3, 8, 3, 8).slots_ready(),
            "a connection's are posted"
        );
    }

    #[test]
    fn violations_are_caught() {
        let mut c = Credits::new(1, 1, 4, 1, 4);
        c.on_receive(Imm::decode(0).unwrap()).unwrap();
        assert_eq!(
            c.on_receive(Imm::decode(0).unwrap()),
            Err(Violation::Overrun)
        );
        let grant = Imm {
            credits: 0,
            echo: 0,
            flags: Imm::GRANT,
        };
        c.on_receive(grant).unwrap();
        assert_eq!(c.on_receive(grant), Err(Violation::GrantOverrun));
        let echo = Imm {
            credits: 0,
            echo: 1,
            flags: 0,
        };
        assert_eq!(c.on_receive(echo), Err(Violation::BadEcho));
        let flood = Imm {
            credits: 9,
            echo: 0,
            flags: Imm::GRANT,
        };
        assert_eq!(c.on_receive(flood), Err(Violation::TooManyCredits));
    }
}
