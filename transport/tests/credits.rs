//! The credit protocol, simulated between two peers over in-order links with arbitrary
//! interleavings of sends, deliveries, consumer releases and refills: no message ever finds
//! its receive queue empty (no RNR), the peers never fall silent while one of them is out of
//! credits, and an idle pair goes quiet instead of bouncing grants.

use std::collections::VecDeque;

use proptest::prelude::*;
use transport::credits::{Credits, Imm};

const DEPTH: u32 = 8;
const SLOTS: u8 = 3;

#[derive(Debug)]
struct Side {
    credits: Credits,
    posted: u32,
    free: u32,
    held: u32,
    /// The peer said it is exhausted; the next credits we send must be solicited.
    owe_solicited: bool,
    inbox: VecDeque<(Imm, bool)>,
}

impl Side {
    fn new() -> Self {
        Self {
            credits: Credits::new(DEPTH, SLOTS, DEPTH, SLOTS, DEPTH),
            posted: DEPTH + u32::from(SLOTS),
            free: 0,
            held: 0,
            owe_solicited: false,
            inbox: VecDeque::new(),
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

/// Re-posts everything free and sends a grant if one is due. Returns whether a grant went out.
fn maintain(side: &mut Side, peer: &mut Side) -> bool {
    side.posted += side.free;
    side.credits.on_reposted(side.free);
    side.free = 0;
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
    let (mut a, mut b) = (Side::new(), Side::new());
    for &(op, arg) in ops {
        let (x, y) = if arg % 2 == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        match op % 4 {
            0 => {
                send_data(x, y);
            }
            1 => {
                deliver(x);
            }
            2 => release(x, u32::from(arg % 5)),
            _ => {
                maintain(x, y);
            }
        }
    }
    // Let the consumers catch up and the links settle: everything must become quiet, with
    // both sides able to send, within a bounded number of rounds.
    release(&mut a, u32::MAX);
    release(&mut b, u32::MAX);
    let mut quiet_rounds = 0;
    for _ in 0..100 {
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]
    #[test]
    fn arbitrary_interleavings(ops in prop::collection::vec((0u8..4, any::<u8>()), 0..400)) {
        run(&ops);
    }
}
