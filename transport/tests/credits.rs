//! The credit protocol, simulated between two peers over in-order links with arbitrary
//! interleavings of sends, deliveries, consumer releases and refills: no message ever finds
//! its receive queue empty (no RNR), posted buffers always equal the bookkeeping, the peers
//! never fall silent while one of them is out of credits, and an idle pair goes quiet instead
//! of bouncing grants. Both with eager re-posting and with the connection's batched rule
//! ([`Repost::Batched`]), for equal and for unequal receive depths and grant slots.

use std::collections::VecDeque;

use proptest::prelude::*;
use rdmsg_transport::credits::{Credits, Imm};

const DEPTH: u32 = 8;
const SLOTS: u8 = 3;

/// When free receive buffers go back to the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Repost {
    /// Every free buffer at once.
    Eager,
    /// As `Connection::maintain` does: once an eighth of the depth is free, or at once if a
    /// grant slot is missing, the peer is down to a quarter of our depth in credits, or may be
    /// blocked.
    Batched,
}

/// One side's receive depth and grant slots.
#[derive(Debug, Clone, Copy)]
struct Shape {
    depth: u32,
    slots: u8,
}

const SYMMETRIC: Shape = Shape {
    depth: DEPTH,
    slots: SLOTS,
};

#[derive(Debug)]
struct Side {
    credits: Credits,
    posted: u32,
    free: u32,
    held: u32,
    /// The peer said it is exhausted; the next credits we send must be solicited.
    owe_solicited: bool,
    inbox: VecDeque<(Imm, bool)>,
    repost: Repost,
}

impl Side {
    fn new() -> Self {
        Self::shaped(SYMMETRIC, SYMMETRIC, Repost::Eager)
    }

    /// A side receiving as `ours` says, whose peer receives as `peer` says.
    fn shaped(ours: Shape, peer: Shape, repost: Repost) -> Self {
        Self {
            credits: Credits::new(ours.depth, ours.slots, peer.depth, peer.slots, peer.depth),
            posted: ours.depth + u32::from(ours.slots),
            free: 0,
            held: 0,
            owe_solicited: false,
            inbox: VecDeque::new(),
            repost,
        }
    }

    /// Whether `maintain` re-posts the free buffers now.
    fn reposts_now(&self) -> bool {
        let c = &self.credits;
        self.free > 0
            && match self.repost {
                Repost::Eager => true,
                Repost::Batched => {
                    self.free >= (c.depth() / 8).max(1)
                        || c.slots_missing() > 0
                        || c.peer_credits() <= c.depth() / 4
                        || c.peer_may_be_blocked()
                }
            }
    }

    fn check(&self) {
        assert_eq!(
            self.posted,
            self.credits.must_be_posted(),
            "posted buffers match the bookkeeping"
        );
    }
}

/// Sends a data message from `from` to `to` if it has a credit.
fn send_data(from: &mut Side, to: &mut Side) -> bool {
    let Some((imm, must)) = from.credits.take_for_data(0) else {
        return false;
    };
    if imm.credits > 0 && from.owe_solicited {
        assert!(must, "credits to an exhausted peer must be solicited");
        from.owe_solicited = false;
    }
    assert_eq!(
        imm.is_exhausted(),
        from.credits.available() == 0,
        "the last credit is flagged"
    );
    if imm.is_exhausted() {
        assert!(
            must,
            "the message spending the last credit wakes the receiver"
        );
    }
    to.inbox.push_back((imm, must));
    true
}

fn deliver(to: &mut Side) -> bool {
    let Some((imm, _solicited)) = to.inbox.pop_front() else {
        return false;
    };
    assert!(
        to.posted > 0,
        "receiver not ready: a message found no buffer"
    );
    to.posted -= 1;
    let grant = to.credits.on_receive(imm).expect("protocol followed");
    if grant {
        to.free += 1;
    } else {
        to.held += 1;
        // A later message without the flag means the peer got credits again meanwhile.
        to.owe_solicited = imm.is_exhausted();
    }
    to.check();
    true
}

fn release(side: &mut Side, n: u32) {
    let n = n.min(side.held);
    side.held -= n;
    side.free += n;
}

/// Re-posts the free buffers if the side's rule says so, and sends a grant if one is due.
/// Returns whether a grant went out.
fn maintain(side: &mut Side, peer: &mut Side) -> bool {
    if side.reposts_now() {
        side.posted += side.free;
        side.credits.on_reposted(side.free);
        side.free = 0;
    }
    side.check();
    match side.credits.take_grant() {
        Some(g) => {
            if g.imm.credits > 0 && side.owe_solicited {
                assert!(
                    g.solicited,
                    "a grant to an exhausted peer must be solicited"
                );
                side.owe_solicited = false;
            }
            peer.inbox.push_back((g.imm, g.solicited));
            true
        }
        None => false,
    }
}

fn run(ops: &[(u8, u8)]) {
    run_shaped(SYMMETRIC, SYMMETRIC, Repost::Eager, ops);
}

/// Runs `ops` between `a` (receiving as `sa` says) and `b` (as `sb` says), then lets them
/// settle and checks that they fall quiet with credits on both sides.
fn run_shaped(sa: Shape, sb: Shape, repost: Repost, ops: &[(u8, u8)]) {
    let mut a = Side::shaped(sa, sb, repost);
    let mut b = Side::shaped(sb, sa, repost);
    for &(op, arg) in ops {
        let (x, y) = if arg % 2 == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        match op % 5 {
            0 => {
                send_data(x, y);
            }
            1 => {
                deliver(x);
            }
            2 => release(x, u32::from(arg % 5)),
            3 => {
                maintain(x, y);
            }
            _ => release(x, u32::MAX),
        }
    }
    // Let the consumers catch up and the links settle: everything must become quiet, with
    // both sides able to send, within a bounded number of rounds.
    release(&mut a, u32::MAX);
    release(&mut b, u32::MAX);
    let mut quiet_rounds = 0;
    for _ in 0..400 {
        let mut busy = deliver(&mut a) | deliver(&mut b);
        busy |= maintain(&mut a, &mut b) | maintain(&mut b, &mut a);
        while deliver(&mut a) | deliver(&mut b) {
            busy = true;
        }
        release(&mut a, u32::MAX);
        release(&mut b, u32::MAX);
        if busy {
            quiet_rounds = 0;
        } else {
            quiet_rounds += 1;
            if quiet_rounds == 3 {
                break;
            }
        }
    }
    assert_eq!(
        quiet_rounds, 3,
        "the peers kept exchanging grants while idle"
    );
    assert!(a.credits.available() > 0, "a is stuck without credits");
    assert!(b.credits.available() > 0, "b is stuck without credits");
}

#[test]
fn one_way_stream_with_a_slow_consumer() {
    // a sends as fast as it can; b's consumer releases one buffer every third step.
    let (mut a, mut b) = (Side::new(), Side::new());
    let mut sent = 0;
    for step in 0..10_000 {
        if send_data(&mut a, &mut b) {
            sent += 1;
        }
        deliver(&mut b);
        if step % 3 == 0 {
            release(&mut b, 1);
        }
        maintain(&mut b, &mut a);
        deliver(&mut a);
        maintain(&mut a, &mut b);
    }
    assert!(sent > 3000, "only {sent} sent");
}

fn shape() -> impl Strategy<Value = Shape> {
    (1u32..=64, 3u8..=8).prop_map(|(depth, slots)| Shape { depth, slots })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]
    #[test]
    fn arbitrary_interleavings(ops in prop::collection::vec((0u8..4, any::<u8>()), 0..400)) {
        run(&ops);
    }

    /// Unequal depths and grant slots, each side re-posting in batches as the connection does.
    #[test]
    fn asymmetric_batched_interleavings(
        sa in shape(),
        sb in shape(),
        ops in prop::collection::vec((0u8..5, any::<u8>()), 0..800),
    ) {
        run_shaped(sa, sb, Repost::Batched, &ops);
    }
}

#[test]
fn one_way_streams_between_unequal_sides_with_batched_reposts() {
    let shapes = [(1, 3), (2, 3), (5, 4), (8, 3), (17, 8), (64, 3), (64, 8)];
    for &(da, sa) in &shapes {
        for &(db, sb) in &shapes {
            let (sa, sb) = (
                Shape {
                    depth: da,
                    slots: sa,
                },
                Shape {
                    depth: db,
                    slots: sb,
                },
            );
            // a streams to b, whose consumer releases one buffer every third step.
            let mut a = Side::shaped(sa, sb, Repost::Batched);
            let mut b = Side::shaped(sb, sa, Repost::Batched);
            let mut sent = 0;
            for step in 0..3_000 {
                if send_data(&mut a, &mut b) {
                    sent += 1;
                }
                deliver(&mut b);
                if step % 3 == 0 {
                    release(&mut b, 1);
                }
                maintain(&mut b, &mut a);
                deliver(&mut a);
                maintain(&mut a, &mut b);
            }
            assert!(sent > 900, "{sa:?} -> {sb:?}: only {sent} sent");
        }
    }
}
