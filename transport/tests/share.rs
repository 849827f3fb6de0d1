//! The credit protocol over a shared receive queue, simulated: one hub whose receive buffers
//! [`Share`] lends to several peers, each an ordinary [`Credits::new`] side with its own
//! receive queue, over in-order links. Peers send at unequal rates, the hub sends some data
//! back (so peers grant into the hub's grant slots too), a consumer holds a few received
//! buffers, the hub re-posts in batches, and peers leave and join mid-run. At every step: no
//! message finds its queue empty (no RNR), and posted buffers are the spare plus what every
//! connection's books need. At the end, with no new sends: everything every peer wanted to
//! send got through, and the system falls quiet.

use std::collections::VecDeque;

use proptest::prelude::*;
use rdmsg_transport::credits::{Credits, Imm};
use rdmsg_transport::share::{AdmitError, CreditHolder, Receipt, Share, ShareConfig};

/// Most peers at once (slots are reused).
const MAX_PEERS: usize = 8;

/// The hub's pool and re-posting, and the peers' receive sides.
#[derive(Debug, Clone, Copy)]
struct Shape {
    min: u32,
    max: u32,
    hub_slots: u8,
    peer_depth: u32,
    peer_slots: u8,
    /// Buffers beyond what the first peers' admission needs.
    extra: u32,
    /// The hub re-posts once this many buffers are free (or at once if `Share::urgent`).
    batch: u32,
    /// The hub's consumer holds at most this many received buffers.
    hold: u32,
}

/// The hub's record of one peer.
#[derive(Debug)]
struct HubConn {
    credits: Credits,
    /// Data the hub still wants to send to the peer.
    backlog: u32,
    /// Data the hub wanted to send to the peer, in all.
    generated: u64,
    /// Data taken in from the peer.
    received: u64,
    /// The peer said it is exhausted: the next credits sent to it must be solicited.
    owe_solicited: bool,
}

impl CreditHolder for HubConn {
    fn credits(&self) -> &Credits {
        &self.credits
    }

    fn credits_mut(&mut self) -> &mut Credits {
        &mut self.credits
    }
}

/// A peer: its side of the connection, its own receive queue, and both links.
#[derive(Debug)]
struct Peer {
    credits: Credits,
    posted: u32,
    free: u32,
    held: u32,
    backlog: u32,
    generated: u64,
    received: u64,
    owe_solicited: bool,
    /// How often it acts, relative to the others.
    weight: u32,
    to_hub: VecDeque<Imm>,
    to_peer: VecDeque<Imm>,
}

impl Peer {
    /// Whether it re-posts its free buffers now (the connection's batched rule).
    fn reposts_now(&self) -> bool {
        let c = &self.credits;
        self.free > 0
            && (self.free >= (c.depth() / 8).max(1)
                || c.slots_missing() > 0
                || c.peer_credits() <= c.depth() / 4
                || c.peer_may_be_blocked())
    }
}

/// Checks the solicitation rules on a message carrying credits to the other side.
fn check_solicited(imm: Imm, solicited: bool, owe_solicited: &mut bool) {
    if imm.credits > 0 && *owe_solicited {
        assert!(solicited, "credits to an exhausted peer are solicited");
        *owe_solicited = false;
    }
    if imm.is_exhausted() {
        assert!(
            solicited,
            "the message spending the last credit is solicited"
        );
    }
}

#[derive(Debug)]
struct Hub {
    shape: Shape,
    share: Share,
    conns: Vec<Option<HubConn>>,
    peers: Vec<Option<Peer>>,
    /// Buffers posted to the SRQ.
    srq: u32,
    /// Buffers back from the consumer (or grants), not posted yet.
    free: u32,
    /// Buffers the consumer holds.
    held: u32,
    /// Buffers in all.
    total: u32,
    touched: Vec<usize>,
    /// Connections the hub sent data on since it last looked for grants.
    sent_on: Vec<usize>,
}

impl Hub {
    fn new(shape: Shape, weights: &[u32]) -> Self {
        let share = Share::new(ShareConfig {
            min_credits: shape.min,
            max_credits: shape.max,
            grant_slots: shape.hub_slots,
        })
        .unwrap();
        let total = weights.len() as u32 * share.admission_cost() + shape.extra;
        let mut hub = Self {
            shape,
            share,
            conns: (0..MAX_PEERS).map(|_| None).collect(),
            peers: (0..MAX_PEERS).map(|_| None).collect(),
            srq: total,
            free: 0,
            held: 0,
            total,
            touched: Vec::new(),
            sent_on: Vec::new(),
        };
        hub.share.on_posted(total, &mut hub.conns, &mut hub.touched);
        for &w in weights {
            assert!(hub.join(w, false));
        }
        hub.check();
        hub
    }

    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_PEERS).filter(|&s| self.peers[s].is_some())
    }

    /// The live peer `x` picks, each as likely as its weight.
    fn pick_weighted(&self, x: u8) -> Option<usize> {
        let total: u32 = self.peers.iter().flatten().map(|p| p.weight).sum();
        if total == 0 {
            return None;
        }
        let mut x = u32::from(x) * total / 256;
        for s in self.live() {
            let w = self.peers[s].as_ref().unwrap().weight;
            if x < w {
                return Some(s);
            }
            x -= w;
        }
        unreachable!()
    }

    /// The live peer `x` picks, all equally likely.
    fn pick(&self, x: u8) -> Option<usize> {
        let live: Vec<usize> = self.live().collect();
        (!live.is_empty()).then(|| live[usize::from(x) % live.len()])
    }

    /// A new peer connects. If the spare buffers do not cover it, the hub grows its pool by
    /// what is missing if `grow`, or refuses the client.
    fn join(&mut self, weight: u32, grow: bool) -> bool {
        let Some(slot) = (0..MAX_PEERS).find(|&s| self.peers[s].is_none()) else {
            return false;
        };
        match self.share.admit(slot) {
            Ok(()) => {}
            Err(AdmitError::NoRoom { spare, cost }) if grow => {
                // Posted for this connection, before any other takes them.
                let more = cost - spare;
                self.total += more;
                self.srq += more;
                self.share
                    .admit_posted(slot, more, &mut self.conns, &mut self.touched)
                    .expect("the pool grew by what was missing");
            }
            Err(_) => {
                self.check();
                return false;
            }
        }
        let sh = self.shape;
        self.conns[slot] = Some(HubConn {
            credits: Credits::shared(
                sh.max,
                sh.hub_slots,
                sh.peer_depth,
                sh.peer_slots,
                sh.peer_depth,
                sh.min,
            ),
            backlog: 0,
            generated: 0,
            received: 0,
            owe_solicited: false,
        });
        self.peers[slot] = Some(Peer {
            credits: Credits::new(sh.peer_depth, sh.peer_slots, sh.max, sh.hub_slots, sh.min),
            posted: sh.peer_depth + u32::from(sh.peer_slots),
            free: 0,
            held: 0,
            backlog: 0,
            generated: 0,
            received: 0,
            owe_solicited: false,
            weight,
            to_hub: VecDeque::new(),
            to_peer: VecDeque::new(),
        });
        true
    }

    /// The peer in `slot` goes. Gracefully, the hub retires it (no more buffers for it) and
    /// takes in what it sent; otherwise whatever is in flight is lost (never lands, so it
    /// consumes nothing).
    fn leave(&mut self, slot: usize, graceful: bool) {
        if graceful {
            self.share.retire(slot);
            while self.deliver_to_hub(slot) {}
        }
        // Released with its record still there, as a hub would before dropping it.
        self.share.release(slot, &mut self.conns, &mut self.touched);
        self.conns[slot] = None;
        self.peers[slot] = None;
        self.check();
    }

    /// The peer wants to send `n` more messages.
    fn generate(&mut self, slot: usize, n: u32) {
        let p = self.peers[slot].as_mut().unwrap();
        p.backlog += n;
        p.generated += u64::from(n);
    }

    /// The hub wants to send `n` more messages to the peer.
    fn generate_back(&mut self, slot: usize, n: u32) {
        let c = self.conns[slot].as_mut().unwrap();
        c.backlog += n;
        c.generated += u64::from(n);
    }

    /// The peer sends one message of its backlog, if it has a credit.
    fn peer_send(&mut self, slot: usize) -> bool {
        let Some(p) = self.peers[slot].as_mut() else {
            return false;
        };
        if p.backlog == 0 {
            return false;
        }
        let Some((imm, solicited)) = p.credits.take_for_data(0) else {
            return false;
        };
        assert_eq!(imm.is_exhausted(), p.credits.available() == 0);
        check_solicited(imm, solicited, &mut p.owe_solicited);
        p.backlog -= 1;
        p.to_hub.push_back(imm);
        true
    }

    /// The hub sends one message of its backlog to the peer, if it has a credit.
    fn hub_send(&mut self, slot: usize) -> bool {
        let Some(c) = self.conns[slot].as_mut() else {
            return false;
        };
        if c.backlog == 0 {
            return false;
        }
        let Some((imm, solicited)) = c.credits.take_for_data(0) else {
            return false;
        };
        check_solicited(imm, solicited, &mut c.owe_solicited);
        c.backlog -= 1;
        self.sent_on.push(slot);
        self.peers[slot].as_mut().unwrap().to_peer.push_back(imm);
        true
    }

    /// The next message from the peer lands in the SRQ and is taken in.
    fn deliver_to_hub(&mut self, slot: usize) -> bool {
        let Some(imm) = self.peers[slot].as_mut().and_then(|p| p.to_hub.pop_front()) else {
            return false;
        };
        assert!(self.srq > 0, "receiver not ready: the SRQ is empty");
        self.srq -= 1;
        let c = self.conns[slot].as_mut().unwrap();
        let grant = c
            .credits
            .on_receive(imm)
            .expect("the peer keeps the protocol");
        let receipt = if grant { Receipt::Grant } else { Receipt::Data };
        self.share.on_consumed(slot, c, receipt, &mut self.touched);
        if grant {
            self.free += 1;
        } else {
            c.received += 1;
            c.owe_solicited = imm.is_exhausted();
            self.held += 1;
            if self.held > self.shape.hold {
                self.hub_release(1);
            }
        }
        self.check();
        true
    }

    /// The next message from the hub lands in the peer's receive queue.
    fn deliver_to_peer(&mut self, slot: usize) -> bool {
        let Some(p) = self.peers[slot].as_mut() else {
            return false;
        };
        let Some(imm) = p.to_peer.pop_front() else {
            return false;
        };
        assert!(p.posted > 0, "receiver not ready at a peer");
        p.posted -= 1;
        if p.credits
            .on_receive(imm)
            .expect("the hub keeps the protocol")
        {
            p.free += 1;
        } else {
            p.received += 1;
            p.held += 1;
            p.owe_solicited = imm.is_exhausted();
        }
        assert_eq!(p.posted, p.credits.must_be_posted());
        true
    }

    fn hub_release(&mut self, n: u32) {
        let n = n.min(self.held);
        self.held -= n;
        self.free += n;
    }

    fn peer_release(&mut self, slot: usize, n: u32) {
        if let Some(p) = self.peers[slot].as_mut() {
            let n = n.min(p.held);
            p.held -= n;
            p.free += n;
        }
    }

    /// Re-posts free buffers if a batch is free or a connection is urgent, then sends the
    /// grants due where the share touched or the hub sent. Returns whether a grant went out.
    fn hub_maintain(&mut self) -> bool {
        if self.free > 0 && (self.free >= self.shape.batch || self.share.urgent()) {
            self.srq += self.free;
            self.share
                .on_posted(self.free, &mut self.conns, &mut self.touched);
            self.free = 0;
        }
        let mut look: Vec<usize> = self
            .touched
            .drain(..)
            .chain(self.sent_on.drain(..))
            .collect();
        look.sort_unstable();
        look.dedup();
        let mut granted = false;
        for slot in 0..MAX_PEERS {
            let Some(c) = self.conns[slot].as_mut() else {
                continue;
            };
            if look.binary_search(&slot).is_err() {
                assert_eq!(
                    c.credits.clone().take_grant(),
                    None,
                    "a grant due on slot {slot}, which nothing touched"
                );
                continue;
            }
            if let Some(g) = c.credits.take_grant() {
                check_solicited(g.imm, g.solicited, &mut c.owe_solicited);
                self.peers[slot].as_mut().unwrap().to_peer.push_back(g.imm);
                granted = true;
            }
        }
        self.check();
        granted
    }

    /// The peer re-posts by its rule and grants if due. Returns whether a grant went out.
    fn peer_maintain(&mut self, slot: usize) -> bool {
        let Some(p) = self.peers[slot].as_mut() else {
            return false;
        };
        if p.reposts_now() {
            p.posted += p.free;
            p.credits.on_reposted(p.free);
            p.free = 0;
        }
        assert_eq!(p.posted, p.credits.must_be_posted());
        match p.credits.take_grant() {
            Some(g) => {
                check_solicited(g.imm, g.solicited, &mut p.owe_solicited);
                p.to_hub.push_back(g.imm);
                true
            }
            None => false,
        }
    }

    fn tick(&mut self) {
        self.share.tick(&mut self.conns, &mut self.touched);
        self.check();
    }

    fn check(&self) {
        assert_eq!(
            self.share.posted(),
            self.srq,
            "the share's count of posted buffers"
        );
        assert_eq!(self.srq + self.free + self.held, self.total);
        assert_eq!(self.share.deficit(), 0);
        if let Err(e) = self.share.audit(&self.conns) {
            panic!("{e}");
        }
    }

    /// Stops new sends and lets everything settle: every backlog must drain and the system
    /// fall quiet (no grants bouncing) within a bounded number of rounds.
    fn drain(&mut self) {
        let mut quiet = 0;
        for round in 0..20_000 {
            let mut busy = false;
            for slot in 0..MAX_PEERS {
                while self.peer_send(slot) | self.hub_send(slot) {
                    busy = true;
                }
            }
            busy |= self.deliver_all();
            self.hub_release(u32::MAX);
            for slot in 0..MAX_PEERS {
                self.peer_release(slot, u32::MAX);
            }
            busy |= self.hub_maintain();
            for slot in 0..MAX_PEERS {
                busy |= self.peer_maintain(slot);
            }
            busy |= self.deliver_all();
            if round % 64 == 63 {
                self.tick();
            }
            let backlog = self.peers.iter().flatten().any(|p| p.backlog > 0)
                || self.conns.iter().flatten().any(|c| c.backlog > 0);
            if busy || backlog {
                quiet = 0;
            } else {
                quiet += 1;
                if quiet == 3 {
                    break;
                }
            }
        }
        assert_eq!(
            quiet, 3,
            "still busy after 20000 rounds: deadlock or ping-pong"
        );
        for slot in self.live().collect::<Vec<_>>() {
            let (p, c) = (
                self.peers[slot].as_ref().unwrap(),
                self.conns[slot].as_ref().unwrap(),
            );
            assert_eq!(
                c.received, p.generated,
                "peer {slot} got everything through"
            );
            assert_eq!(
                p.received, c.generated,
                "the hub got everything to peer {slot}"
            );
            assert!(
                p.credits.available() > 0,
                "peer {slot} left without credits"
            );
            assert!(
                c.credits.available() > 0,
                "hub left without credits for {slot}"
            );
        }
    }

    fn deliver_all(&mut self) -> bool {
        let mut any = false;
        loop {
            let mut moved = false;
            for slot in 0..MAX_PEERS {
                moved |= self.deliver_to_hub(slot) | self.deliver_to_peer(slot);
            }
            if !moved {
                return any;
            }
            any = true;
        }
    }
}

/// Runs `ops` on a hub with `weights.len()` peers, then drains.
fn run(shape: Shape, weights: &[u32], ops: &[(u8, u8)]) {
    let mut hub = Hub::new(shape, weights);
    for &(op, x) in ops {
        match op {
            // A peer acts, as often as its weight says: it wants to send more, and sends.
            0..=2 => {
                if let Some(s) = hub.pick_weighted(x) {
                    if op == 0 {
                        hub.generate(s, u32::from(x % 3) + 1);
                    }
                    hub.peer_send(s);
                }
            }
            3 | 4 => {
                if let Some(s) = hub.pick(x) {
                    hub.deliver_to_hub(s);
                }
            }
            5 => {
                if let Some(s) = hub.pick(x) {
                    hub.deliver_to_peer(s);
                }
            }
            6 => hub.hub_release(u32::from(x % 4)),
            7 => {
                hub.hub_maintain();
            }
            8 => {
                if let Some(s) = hub.pick(x) {
                    if x % 4 == 0 {
                        hub.peer_release(s, u32::from(x % 3));
                    } else {
                        hub.peer_maintain(s);
                    }
                }
            }
            9 => {
                if let Some(s) = hub.pick(x) {
                    if x % 2 == 0 {
                        hub.generate_back(s, 1);
                    }
                    hub.hub_send(s);
                }
            }
            10 => match x % 16 {
                0 => hub.tick(),
                1 => {
                    if let Some(s) = hub.pick(x / 16) {
                        hub.leave(s, x & 0x80 != 0);
                    }
                }
                2 => {
                    hub.join(u32::from(x / 16 % 8) + 1, x & 0x80 != 0);
                }
                _ => {
                    hub.hub_maintain();
                }
            },
            _ => unreachable!(),
        }
    }
    hub.drain();
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        1u32..=4,
        0u32..=28,
        3u8..=5,
        1u32..=16,
        3u8..=5,
        0u32..=24,
        1u32..=8,
        0u32..=6,
    )
        .prop_map(
            |(min, more, hub_slots, peer_depth, peer_slots, extra, batch, hold)| Shape {
                min,
                max: min + more,
                hub_slots,
                peer_depth,
                peer_slots,
                extra,
                batch,
                hold,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]
    #[test]
    fn peers_sharing_a_receive_queue(
        shape in shape(),
        weights in prop::collection::vec(1u32..=16, 2..=6),
        ops in prop::collection::vec((0u8..=10, any::<u8>()), 0..800),
    ) {
        run(shape, &weights, &ops);
    }
}

/// Eight peers offering equal load to a hub whose consumer is the bottleneck: over every
/// window of rounds the best and worst served are within 1.5x. Then half of them go idle and
/// the consumer keeps up: the idle ones' quotas shrink back to the minimum, the busy ones'
/// grow.
#[test]
fn equal_load_is_served_fairly_and_quotas_follow_the_traffic() {
    const PEERS: usize = 8;
    const WINDOW: usize = 25;
    let shape = Shape {
        min: 2,
        max: 32,
        hub_slots: 3,
        peer_depth: 8,
        peer_slots: 3,
        extra: 24,
        batch: 4,
        hold: u32::MAX,
    };
    let mut hub = Hub::new(shape, &[1; PEERS]);
    // One round: the first `busy` peers keep 8 messages to send, everyone sends what its
    // credits allow (in turns, so that nobody is always first), the consumer handles
    // `consumed` messages, buffers and grants go back.
    let round = |hub: &mut Hub, r: usize, busy: usize, consumed: u32| {
        for k in 0..PEERS {
            let slot = (r + k) % PEERS;
            let backlog = hub.peers[slot].as_ref().unwrap().backlog;
            if slot < busy && backlog < 8 {
                hub.generate(slot, 8 - backlog);
            }
            while hub.peer_send(slot) {}
        }
        hub.deliver_all();
        hub.hub_release(consumed);
        hub.hub_maintain();
        for slot in 0..PEERS {
            hub.peer_maintain(slot);
        }
        hub.deliver_all();
        if r % 10 == 9 {
            hub.tick();
        }
    };
    let received = |hub: &Hub| -> Vec<u64> {
        hub.conns
            .iter()
            .map(|c| c.as_ref().unwrap().received)
            .collect()
    };
    let quotas = |hub: &Hub| -> Vec<u32> {
        (0..PEERS)
            .map(|slot| hub.share.quota(slot).unwrap())
            .collect()
    };
    // Warm-up: quotas grow from the spare buffers.
    for r in 0..50 {
        round(&mut hub, r, PEERS, 12);
    }
    let mut before = received(&hub);
    for r in 50..1050 {
        round(&mut hub, r, PEERS, 12);
        if (r + 1) % WINDOW == 0 {
            let now = received(&hub);
            let served: Vec<u64> = now.iter().zip(&before).map(|(n, b)| n - b).collect();
            let (most, least) = (served.iter().max().unwrap(), served.iter().min().unwrap());
            assert!(
                *most * 2 <= *least * 3,
                "rounds {}..={r}: served {served:?}",
                r + 1 - WINDOW
            );
            before = now;
        }
    }
    let was = quotas(&hub);
    for r in 1050..1200 {
        round(&mut hub, r, PEERS / 2, u32::MAX);
    }
    let now = quotas(&hub);
    for slot in PEERS / 2..PEERS {
        assert_eq!(now[slot], shape.min, "idle {slot}: {was:?} -> {now:?}");
    }
    // The busy ones grew into what the idle ones no longer get back (what their peers still
    // hold stays theirs).
    let busy = |q: &[u32]| q[..PEERS / 2].iter().sum::<u32>();
    assert!(busy(&now) > busy(&was), "{was:?} -> {now:?}");
    assert!(now[..PEERS / 2].iter().all(|&q| q > shape.min), "{now:?}");
}
