//! Scenarios and properties of the real protocol core, run through the simulator: credits,
//! the shared pool, close, vanish, failure ordering, reads, and random schedules of many
//! peers.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::credits::Violation;

const CLOSE: Duration = Duration::from_secs(2);

fn pair(a: Shape, b: Shape) -> (Net, usize, usize) {
    let mut net = Net::new(CLOSE);
    let (x, y) = net.pair(a, b);
    (net, x, y)
}

fn seqs(n: u64) -> Vec<u64> {
    (0..n).collect()
}

/// Everything each side sent arrived, once and in order, with no receiver-not-ready, and
/// every receive buffer is back in its pool.
fn all_through(net: &Net, a: usize, b: usize) {
    assert_eq!(net.rnr, 0, "receiver not ready");
    for (from, to) in [(a, b), (b, a)] {
        let sent = net.conns[from].app.sent;
        assert_eq!(
            net.conns[from].app.backlog, 0,
            "{from} still has messages to send"
        );
        assert_eq!(net.conns[to].app.received, seqs(sent), "{from} -> {to}");
    }
}

#[test]
fn a_stream_gets_through_in_order_without_receiver_not_ready() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 1000;
    net.conns[b].app.hold = 2;
    net.drive(100_000);
    all_through(&net, a, b);
}

#[test]
fn unequal_sides_stream_both_ways_at_once() {
    let shapes = [(1, 3, 2), (2, 3, 8), (5, 4, 3), (17, 8, 16), (64, 3, 64)];
    for &(da, sa, qa) in &shapes {
        for &(db, sb, qb) in &shapes {
            let a_shape = Shape {
                depth: da,
                slots: sa,
                send_depth: qa,
                signal_every: 4,
            };
            let b_shape = Shape {
                depth: db,
                slots: sb,
                send_depth: qb,
                signal_every: 3,
            };
            let (mut net, a, b) = pair(a_shape, b_shape);
            net.conns[a].app.backlog = 300;
            net.conns[b].app.backlog = 200;
            // Each application holds fewer than all its buffers (holding them all would stop
            // every credit: an application's deadlock, not the protocol's).
            net.conns[a].app.hold = 1.min(da - 1);
            net.conns[b].app.hold = 3.min(db - 1);
            net.drive(100_000);
            all_through(&net, a, b);
        }
    }
}

#[test]
fn an_idle_pair_falls_quiet_without_bouncing_grants() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 50;
    net.conns[a].app.solicit_every = 5;
    net.conns[b].app.hold = 0;
    net.drive(10_000);
    let grants = net.conns[a].core.stats().grants_sent + net.conns[b].core.stats().grants_sent;
    // Quiet now: a second drive moves nothing.
    net.drive(3);
    let again = net.conns[a].core.stats().grants_sent + net.conns[b].core.stats().grants_sent;
    assert_eq!(grants, again);
    all_through(&net, a, b);
}

#[test]
fn a_peer_that_stops_granting_blocks_its_sender_without_breaking_it() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 100;
    // b's application holds everything it gets: no buffer, so no credit, goes back.
    net.drive(10_000);
    assert!(net.stuck(a), "a waits for credits");
    assert_eq!(net.conns[a].core.credits().available(), 0);
    assert_eq!(net.conns[b].app.received.len(), 8);
    assert!(net.conns[a].core.failure().is_none() && net.conns[b].core.failure().is_none());
    assert!(
        net.conns[a].core.stats().forced_solicited > 0,
        "the last credit woke b"
    );
    // b's application lets go: everything follows, woken by solicited grants alone.
    net.conns[b].app.hold = 0;
    net.turn(b);
    net.drive(10_000);
    all_through(&net, a, b);
}

#[test]
fn a_graceful_close_delivers_everything_then_the_close() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 20;
    net.conns[b].app.hold = 0;
    net.drive(10_000);
    assert!(net.close(a));
    net.drive(10_000);
    assert_eq!(net.conns[b].app.received, seqs(20));
    assert_eq!(net.conns[b].core.failure(), Some(Failure::PeerClosed));
    assert_eq!(net.conns[a].core.failure(), Some(Failure::Closed));
    assert!(!net.conns[a].core.close_timed_out());
    assert_eq!(
        net.conns[a].core.check_send(),
        Err(Failure::Closed),
        "nothing is sent after the close"
    );
}

#[test]
fn a_close_that_is_not_taken_in_time_times_out() {
    let (mut net, a, _b) = pair(Shape::default(), Shape::default());
    assert!(net.close(a));
    assert_eq!(net.conns[a].core.check_send(), Err(Failure::Closed));
    // Nothing is delivered; the close deadline passes.
    net.advance(CLOSE + Duration::from_millis(1));
    net.turn(a);
    assert_eq!(net.conns[a].core.failure(), Some(Failure::CloseTimedOut));
    assert!(net.conns[a].core.close_timed_out());
}

#[test]
fn a_dead_peer_is_noticed_as_vanished_after_what_it_sent() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[b].app.backlog = 5;
    net.conns[a].app.hold = 0;
    net.drive(10_000);
    let start = net.now;
    net.kill(b);
    net.drive(10_000);
    assert_eq!(net.conns[a].app.received, seqs(5));
    assert_eq!(net.conns[a].core.failure(), Some(Failure::PeerVanished));
    assert!(net.now.duration_since(start) >= Duration::from_millis(50));
    assert!(net.conns[a].core.is_drained());
}

/// A close of a peer whose process died (rxe retries the close message for ever): it ends as
/// the peer vanished, 50 ms after its stream's end (the grace a close message in flight
/// gets), whether the end was seen before the close, came in while the close was being
/// started, or came while it waited; never at `close_timeout`.
#[test]
fn a_close_to_a_peer_that_died_ends_as_vanished_not_at_the_close_timeout() {
    let grace = Duration::from_millis(50);
    let ended = |net: &Net, a: usize| {
        let c = &net.conns[a].core;
        assert_eq!(c.failure(), Some(Failure::PeerVanished));
        assert!(!c.close_timed_out());
        assert!(matches!(
            c.close_result(CLOSE),
            Some(Err(crate::Error::Connection(Failure::PeerVanished)))
        ));
        assert!(c.is_drained());
    };
    let pair = || {
        let (mut net, a, b) = pair(Shape::default(), Shape::default());
        net.retry_for_ever();
        net.conns[a].app.backlog = 5;
        net.conns[b].app.hold = 0;
        net.drive(10_000);
        (net, a, b)
    };

    // Seen before: the close is refused with the failure at once.
    let (mut net, a, b) = pair();
    net.kill(b);
    net.drive(10_000);
    assert!(!net.close(a));
    assert_eq!(net.conns[a].core.check_send(), Err(Failure::PeerVanished));

    // The end not looked at yet when the close starts.
    let (mut net, a, b) = pair();
    net.kill(b);
    let start = net.now;
    assert!(net.close(a));
    net.drive(10_000);
    ended(&net, a);
    assert_eq!(net.now.duration_since(start), grace);

    // Seen by a turn, the close started within the grace: it keeps the deadline.
    let (mut net, a, b) = pair();
    net.kill(b);
    let start = net.now;
    net.turn(a);
    net.advance(grace / 2);
    assert!(net.close(a));
    net.drive(10_000);
    ended(&net, a);
    assert_eq!(net.now.duration_since(start), grace);

    // The peer dies while the close waits.
    let (mut net, a, b) = pair();
    assert!(net.close(a));
    net.turn(a);
    net.advance(Duration::from_millis(300));
    net.kill(b);
    let died = net.now;
    net.drive(10_000);
    ended(&net, a);
    assert_eq!(net.now.duration_since(died), grace);
    assert_eq!(
        net.conns[b].app.received,
        seqs(5),
        "what went before it arrived"
    );
}

/// The hub closing a peer whose process died, before the close or while it waits: its
/// `Disconnected` says vanished, 50 ms after the peer's stream ended, not `close_timeout`
/// later.
#[test]
fn a_hub_closing_a_peer_that_died_reports_it_vanished_at_once() {
    for died_first in [true, false] {
        let (mut net, ids) = hub(2, SHARE, 4);
        net.retry_for_ever();
        let (slot, dead) = ids[0];
        net.hub().table.slots[slot].as_mut().unwrap().app.backlog = 3;
        net.conns[dead].app.hold = 0;
        net.drive(10_000);
        if died_first {
            net.kill(dead);
            assert!(
                net.close_hub_slot(slot),
                "a leaving peer's credits are still good"
            );
        } else {
            assert!(net.close_hub_slot(slot));
            net.hub_turn();
            net.advance(Duration::from_millis(300));
            net.kill(dead);
        }
        let died = net.now;
        net.drive(10_000);
        assert_eq!(net.hub().ended, vec![(slot, Failure::PeerVanished)]);
        let took = net.now.duration_since(died);
        assert!(took < CLOSE / 4, "{took:?}");
        assert_eq!(net.conns[dead].app.received, seqs(3));
    }
}

#[test]
fn a_goodbye_waits_for_the_close_message_it_announces() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[b].app.backlog = 3;
    net.conns[a].app.hold = 0;
    net.drive(10_000);
    // The goodbye overtakes the close message (another path: the TCP stream).
    assert!(net.close(b));
    net.tell_stream(Some(End::Conn(a)), StreamNews::Goodbye);
    net.turn(a);
    assert_eq!(
        net.conns[a].core.failure(),
        None,
        "waiting for the close message"
    );
    net.advance(CLOSE / 2);
    net.drive(10_000);
    assert_eq!(net.conns[a].core.failure(), Some(Failure::PeerClosed));
    assert_eq!(net.conns[a].app.received, seqs(3));
}

#[test]
fn a_goodbye_without_the_close_message_is_a_vanished_peer() {
    let (mut net, a, _b) = pair(Shape::default(), Shape::default());
    net.tell_stream(Some(End::Conn(a)), StreamNews::Goodbye);
    net.turn(a);
    net.advance(CLOSE);
    net.turn(a);
    assert_eq!(net.conns[a].core.failure(), Some(Failure::PeerVanished));
}

#[test]
fn junk_on_the_stream_fails_the_connection_once() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.tell_stream(Some(End::Conn(a)), StreamNews::Garbage(0x42));
    net.drive(10_000);
    assert_eq!(
        net.conns[a].core.failure(),
        Some(Failure::BootstrapGarbage { byte: 0x42 })
    );
    // The end of a's stream fails b as vanished.
    assert_eq!(net.conns[b].core.failure(), Some(Failure::PeerVanished));
}

#[test]
fn the_real_error_explains_the_flushes_and_what_arrived_comes_first() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[b].app.backlog = 3;
    // b's messages reach a's completion queue; a does not look yet.
    net.turn(b);
    while net.deliver(End::Conn(b)) {}
    // b's host goes silent; a sends into the void: its retries run out.
    net.crash(b);
    net.conns[a].app.backlog = 1;
    net.conns[a].app.hold = u32::MAX;
    net.drive(10_000);
    assert_eq!(
        net.conns[a].app.received,
        seqs(3),
        "what arrived is delivered"
    );
    match net.conns[a].core.failure() {
        Some(Failure::Completion { status, .. }) => assert_eq!(status, WcStatus::RetryExcErr),
        other => panic!("the retry error wins, not {other:?}"),
    }
    assert!(net.conns[a].core.is_drained());
}

#[test]
fn a_cq_overrun_fails_the_connection_with_its_event() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 4;
    net.drive(10_000);
    let overrun = Failure::AsyncEvent(rdmsg_verbs::AsyncEventKind::CqErr);
    net.async_failure(End::Conn(b), overrun);
    net.drive(10_000);
    assert_eq!(
        net.conns[b].core.failure(),
        Some(overrun),
        "the flushes are explained"
    );
    assert_eq!(net.conns[a].core.failure(), Some(Failure::PeerVanished));
    assert_eq!(net.conns[b].app.received, seqs(4));
}

#[test]
fn an_unread_cq_overrun_event_explains_the_flushes_it_caused() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 4;
    net.drive(10_000);
    // The queue pair breaks; its flushes come before anything else says why.
    net.overrun(b);
    net.drive(10_000);
    assert_eq!(
        net.conns[b].core.failure(),
        Some(Failure::AsyncEvent(rdmsg_verbs::AsyncEventKind::CqErr)),
        "the event explains the flushes, not QpError"
    );
    assert_eq!(net.conns[b].app.received, seqs(4));
    assert!(net.conns[b].core.is_drained(), "every flush polled");
}

#[test]
fn a_close_completes_while_the_peer_still_sends_and_grants_follow_it() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.conns[a].app.backlog = 10;
    net.conns[a].app.hold = 0;
    net.conns[b].app.hold = 0;
    net.drive(10_000);
    // The peer keeps sending while our close is under way: we keep granting after the close
    // message, and those grants are not signaled.
    net.conns[b].app.backlog = 200;
    assert!(net.close(a));
    net.drive(100_000);
    assert_eq!(net.conns[a].core.failure(), Some(Failure::Closed));
    assert!(
        !net.conns[a].core.close_timed_out(),
        "the close was delivered"
    );
    assert_eq!(net.conns[b].app.received, seqs(10));
    assert_eq!(net.conns[b].core.failure(), Some(Failure::PeerClosed));
}

#[test]
fn a_credit_overrun_breaks_the_receiving_side_alone_first() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    // a believes it has more credits than b granted: a lying sender.
    let lie = Credits::new(8, 3, 8 + 4, 3, 8 + 4);
    net.conns[a].core = Core::new(lie, 4, CLOSE);
    net.conns[a].app.backlog = 12;
    net.drive(10_000);
    assert_eq!(
        net.conns[b].core.failure(),
        Some(Failure::Protocol(Violation::Overrun))
    );
    assert_eq!(
        net.conns[b].app.received,
        seqs(8),
        "what it was owed is delivered"
    );
}

#[test]
fn a_read_takes_send_slots_and_ends_with_its_completion() {
    let shape = Shape {
        send_depth: 4,
        ..Shape::default()
    };
    let (mut net, a, _b) = pair(shape, shape);
    assert!(matches!(
        net.post_read(a, 5),
        Err(crate::Error::ReadTooLarge {
            segments: 5,
            send_slots: 4
        })
    ));
    assert_eq!(net.post_read(a, 3), Ok(true));
    assert_eq!(
        net.conns[a].core.send_arm(),
        ArmMode::Next,
        "its end wakes us"
    );
    assert_eq!(net.post_read(a, 2), Ok(false), "no room until it ends");
    net.drive(10_000);
    assert_eq!(net.conns[a].room().sq, 4);
    assert_eq!(net.conns[a].core.send_arm(), ArmMode::SolicitedOnly);
    assert_eq!(net.send_failures(a), 0);
}

#[test]
fn a_read_in_flight_when_the_peer_dies_fails_with_the_retry_error() {
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    net.crash(b);
    assert_eq!(net.post_read(a, 2), Ok(true));
    net.drive(10_000);
    assert!(matches!(
        net.conns[a].core.failure(),
        Some(Failure::Completion {
            status: WcStatus::RetryExcErr,
            ..
        })
    ));
    assert!(net.send_failures(a) >= 1);
}

#[test]
fn probes_keep_a_quiet_pair_alive_and_find_a_host_gone_silent() {
    const EVERY: Duration = Duration::from_secs(1);
    let (mut net, a, b) = pair(Shape::default(), Shape::default());
    // rxe with `retry_cnt` 7: nothing a silent host was sent ever fails on its own.
    net.retry_for_ever();
    let now = net.now;
    for i in [a, b] {
        net.conns[i].core.probe_every(EVERY, now);
    }
    net.conns[a].app.backlog = 10;
    net.conns[b].app.hold = 2;
    // Ten quiet intervals: each side probes its peer, every probe is answered.
    net.drive_until(Some(now + 10 * EVERY), 100_000);
    all_through(&net, a, b);
    assert!(net.probes >= 10, "quiet sides probe: {}", net.probes);
    assert_eq!(net.conns[a].core.failure(), None);
    assert_eq!(net.conns[b].core.failure(), None);
    // b's host goes silent: its stream says nothing, a's probe is never answered (nor failed).
    net.crash(b);
    let crashed = net.now;
    net.drive_until(Some(crashed + 10 * EVERY), 100_000);
    assert_eq!(net.conns[a].core.failure(), Some(Failure::PeerVanished));
    assert!(
        net.now <= crashed + 4 * EVERY,
        "found within a few intervals: {:?}",
        net.now - crashed
    );
}

impl PartialEq for crate::Error {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

// ----- the hub -----

fn hub(peers: usize, cfg: ShareConfig, shared: u32) -> (Net, Vec<(usize, usize)>) {
    let mut net = Net::new(CLOSE);
    net.with_hub(cfg, shared);
    let ids = (0..peers).map(|_| net.join_hub(Shape::default())).collect();
    (net, ids)
}

const SHARE: ShareConfig = ShareConfig {
    min_credits: 2,
    max_credits: 16,
    grant_slots: 3,
};

#[test]
fn hub_peers_share_the_pool_without_receiver_not_ready() {
    let (mut net, ids) = hub(6, SHARE, 8);
    for (k, &(slot, c)) in ids.iter().enumerate() {
        net.conns[c].app.backlog = 50 * (k as u64 + 1);
        net.conns[c].app.hold = 0;
        net.hub().table.slots[slot].as_mut().unwrap().app.hold = 1;
        net.hub().table.slots[slot].as_mut().unwrap().app.backlog = 20;
    }
    net.drive(200_000);
    assert_eq!(net.rnr, 0);
    for (k, &(slot, c)) in ids.iter().enumerate() {
        let got = &net.hub().table.slots[slot].as_ref().unwrap().app.received;
        assert_eq!(*got, seqs(50 * (k as u64 + 1)), "peer {k} to the hub");
        assert_eq!(net.conns[c].app.received, seqs(20), "the hub to peer {k}");
    }
}

#[test]
fn a_hub_peer_that_dies_fails_alone_after_what_it_sent() {
    let (mut net, ids) = hub(3, SHARE, 4);
    for &(slot, c) in &ids {
        net.conns[c].app.backlog = 10;
        net.hub().table.slots[slot].as_mut().unwrap().app.hold = 0;
    }
    net.drive(100_000);
    let (dead_slot, dead) = ids[1];
    net.kill(dead);
    for &(_, c) in &ids {
        net.conns[c].app.backlog += 10;
    }
    net.drive(100_000);
    assert_eq!(net.hub().ended, vec![(dead_slot, Failure::PeerVanished)]);
    for &(slot, _) in ids.iter().filter(|&&(s, _)| s != dead_slot) {
        let got = &net.hub().table.slots[slot].as_ref().unwrap().app.received;
        assert_eq!(*got, seqs(20));
    }
    assert_eq!(net.rnr, 0);
}

#[test]
fn a_stalled_hub_peer_holds_back_only_itself() {
    let (mut net, ids) = hub(3, SHARE, 4);
    for &(slot, c) in &ids {
        net.hub().table.slots[slot].as_mut().unwrap().app.backlog = 40;
        net.conns[c].app.hold = 0;
    }
    // The first peer's application never lets go of what it receives.
    let (stalled_slot, stalled) = ids[0];
    net.conns[stalled].app.hold = u32::MAX;
    net.drive(100_000);
    assert_eq!(net.conns[stalled].app.received.len(), 8);
    assert!(
        net.hub().table.slots[stalled_slot]
            .as_ref()
            .unwrap()
            .app
            .backlog
            > 0
    );
    for &(_, c) in &ids[1..] {
        assert_eq!(net.conns[c].app.received, seqs(40));
    }
}

#[test]
fn a_hub_closes_a_peer_gracefully() {
    let (mut net, ids) = hub(2, SHARE, 4);
    let (slot, c) = ids[0];
    net.hub().table.slots[slot].as_mut().unwrap().app.backlog = 7;
    net.conns[c].app.hold = 0;
    net.drive(10_000);
    assert!(net.close_hub_slot(slot));
    net.drive(10_000);
    assert_eq!(net.conns[c].app.received, seqs(7));
    assert_eq!(net.conns[c].core.failure(), Some(Failure::PeerClosed));
    assert_eq!(net.hub().ended, vec![(slot, Failure::Closed)]);
}

/// Eight peers offering equal load to a hub whose application is the bottleneck: over every
/// window of rounds the best and worst served are within 1.5x. Then half of them go idle and
/// the application keeps up: the idle ones' quotas shrink back to the minimum, the busy ones'
/// grow.
#[test]
fn equal_load_is_served_fairly_and_quotas_follow_the_traffic() {
    const PEERS: usize = 8;
    const WINDOW: usize = 25;
    let cfg = ShareConfig {
        min_credits: 2,
        max_credits: 32,
        grant_slots: 3,
    };
    let (mut net, ids) = hub(PEERS, cfg, 64);
    for &(slot, c) in &ids {
        net.hub().table.slots[slot].as_mut().unwrap().app.hold = u32::MAX;
        net.conns[c].app.hold = 0;
    }
    // One round: the first `busy` peers keep 8 messages to send and send what their credits
    // allow (in turns, so that nobody is always first), the application handles `consumed`
    // messages, buffers and grants go back; a simulated 100 ms passes.
    let round = |net: &mut Net, r: usize, busy: usize, consumed: u32| {
        for k in 0..PEERS {
            let (_, c) = ids[(r + k) % PEERS];
            if (r + k) % PEERS < busy && net.conns[c].app.backlog < 8 {
                net.conns[c].app.backlog = 8;
            }
            net.turn(c);
        }
        net.deliver_all();
        net.hub_consume(consumed);
        net.hub_turn();
        net.deliver_all();
        net.turns(false);
        net.deliver_all();
        net.advance(Duration::from_millis(100));
    };
    let received = |net: &mut Net| -> Vec<usize> {
        ids.iter()
            .map(|&(s, _)| {
                net.hub().table.slots[s]
                    .as_ref()
                    .unwrap()
                    .app
                    .received
                    .len()
            })
            .collect()
    };
    let quotas = |net: &mut Net| -> Vec<u32> {
        ids.iter()
            .map(|&(s, _)| net.hub().share.quota(s).unwrap())
            .collect()
    };
    // Warm-up: quotas grow from the spare buffers.
    for r in 0..50 {
        round(&mut net, r, PEERS, 12);
    }
    let mut before = received(&mut net);
    for r in 50..1050 {
        round(&mut net, r, PEERS, 12);
        if (r + 1) % WINDOW == 0 {
            let now = received(&mut net);
            let served: Vec<usize> = now.iter().zip(&before).map(|(n, b)| n - b).collect();
            let (most, least) = (served.iter().max().unwrap(), served.iter().min().unwrap());
            assert!(
                *most * 2 <= *least * 3,
                "rounds {}..={r}: served {served:?}",
                r + 1 - WINDOW
            );
            before = now;
        }
    }
    let was = quotas(&mut net);
    for r in 1050..1200 {
        round(&mut net, r, PEERS / 2, u32::MAX);
    }
    let now = quotas(&mut net);
    for (k, &q) in now.iter().enumerate().skip(PEERS / 2) {
        assert_eq!(q, cfg.min_credits, "idle {k}: {was:?} -> {now:?}");
    }
    let busy = |q: &[u32]| q[..PEERS / 2].iter().sum::<u32>();
    assert!(busy(&now) > busy(&was), "{was:?} -> {now:?}");
    assert!(
        now[..PEERS / 2].iter().all(|&q| q > cfg.min_credits),
        "{now:?}"
    );
    assert_eq!(net.rnr, 0);
}

// ----- random schedules -----

/// Runs `ops` between two peers shaped `sa` and `sb`, then lets them finish: nothing lost,
/// duplicated or reordered, no receiver-not-ready, no deadlock (drive fails a run that never
/// goes idle, and a sender left with messages is a deadlock), every buffer back.
fn run_pair(sa: Shape, sb: Shape, ops: &[(u8, u8)]) {
    let (mut net, a, b) = pair(sa, sb);
    for &(op, x) in ops {
        let (me, other) = if x % 2 == 0 { (a, b) } else { (b, a) };
        let me_end = End::Conn(me);
        match op % 6 {
            0 => {
                net.conns[me].app.backlog += u64::from(x % 5) + 1;
                net.conns[me].app.solicit_every = u64::from(x % 4);
            }
            1 | 2 => {
                net.deliver(me_end);
            }
            3 => {
                // A turn, asleep or not (a health check, a spurious wake-up).
                net.turn(me);
            }
            4 => net.conns[me].app.hold = u32::from(x / 2 % 8),
            _ => {
                net.advance(Duration::from_millis(1));
                net.turn(other);
            }
        }
    }
    net.conns[a].app.hold = 0;
    net.conns[b].app.hold = 0;
    net.turns(true);
    net.drive(100_000);
    all_through(&net, a, b);
    for i in [a, b] {
        assert_eq!(net.conns[i].app.held, 0);
        assert!(
            net.conns[i].core.credits().available() > 0,
            "{i} left without credits"
        );
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    (1u32..=32, 3u8..=6, 1u32..=16, 1u32..=8).prop_map(|(depth, slots, send_depth, every)| Shape {
        depth,
        slots,
        send_depth,
        signal_every: every,
    })
}

/// Runs `ops` on a hub with `weights.len()` peers (peers join and die mid-run), then lets
/// everything finish: what every live peer sent got through in order both ways, no
/// receiver-not-ready, the share's books balance at every step, every buffer is back.
fn run_hub(cfg: ShareConfig, shared: u32, peers: usize, ops: &[(u8, u8)]) {
    let (mut net, mut ids) = hub(peers, cfg, shared);
    let mut dead = Vec::new();
    for &(op, x) in ops {
        let live: Vec<(usize, usize)> = ids.iter().copied().filter(|p| !dead.contains(p)).collect();
        let Some(&(slot, c)) = live.get(usize::from(x) % live.len().max(1)) else {
            continue;
        };
        match op % 9 {
            0 => net.conns[c].app.backlog += u64::from(x % 4) + 1,
            1 => {
                if let Some(s) = net.hub().table.slots[slot].as_mut() {
                    s.app.backlog += u64::from(x % 3);
                }
            }
            // Deliveries in any order across the wires: completions of different queue
            // pairs interleave as the schedule says.
            2 | 3 => {
                net.deliver(End::Conn(c));
            }
            4 => {
                net.deliver(End::Hub(slot));
            }
            5 => {
                if x % 2 == 0 {
                    net.turn(c);
                } else {
                    net.hub_turn();
                }
            }
            6 => {
                net.conns[c].app.hold = u32::from(x % 5);
                if let Some(s) = net.hub().table.slots[slot].as_mut() {
                    s.app.hold = u32::from(x / 16 % 5);
                }
            }
            7 => net.advance(Duration::from_millis(u64::from(x) * 4)),
            _ => match x % 8 {
                0 if live.len() > 1 => {
                    net.kill(c);
                    dead.push((slot, c));
                }
                1 => ids.push(net.join_hub(Shape::default())),
                _ => {
                    net.hub_turn();
                }
            },
        }
    }
    for &(slot, c) in &ids {
        net.conns[c].app.hold = 0;
        if let Some(s) = net.hub().table.slots[slot].as_mut() {
            s.app.hold = 0;
        }
    }
    net.turns(true);
    net.drive(200_000);
    assert_eq!(net.rnr, 0, "receiver not ready");
    let dead_slots: Vec<usize> = dead.iter().map(|&(s, _)| s).collect();
    let mut ended: Vec<usize> = net.hub().ended.iter().map(|&(s, _)| s).collect();
    ended.sort_unstable();
    let mut expected = dead_slots.clone();
    expected.sort_unstable();
    assert_eq!(ended, expected, "exactly the dead peers ended");
    for &(slot, c) in ids.iter().filter(|p| !dead.contains(p)) {
        let peer_sent = net.conns[c].app.sent;
        let s = net.hub().table.slots[slot]
            .as_ref()
            .expect("a live peer's slot");
        assert_eq!(s.app.received, seqs(peer_sent), "to the hub");
        assert_eq!(s.app.backlog, 0, "the hub sent everything");
        let hub_sent = s.app.sent;
        assert_eq!(net.conns[c].app.received, seqs(hub_sent), "from the hub");
        assert_eq!(net.conns[c].app.backlog, 0, "the peer sent everything");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_schedules_between_two_peers(
        sa in shape(),
        sb in shape(),
        ops in prop::collection::vec((0u8..6, any::<u8>()), 0..600),
    ) {
        run_pair(sa, sb, &ops);
    }

    #[test]
    fn random_schedules_of_many_peers_on_a_hub(
        min in 1u32..=4,
        more in 0u32..=24,
        slots in 3u8..=5,
        shared in 0u32..=24,
        peers in 1usize..=8,
        ops in prop::collection::vec((0u8..9, any::<u8>()), 0..800),
    ) {
        let cfg = ShareConfig { min_credits: min, max_credits: min + more, grant_slots: slots };
        run_hub(cfg, shared, peers, &ops);
    }
}

// ----- what the drivers report (feature `tracing`) -----

#[cfg(feature = "tracing")]
#[test]
fn closes_and_failures_are_reported_once_each_at_their_levels() {
    use rdmsg_testkit::events::recording;
    use tracing::Level;

    let ((), events) = recording(|| {
        // A graceful close: started and done on one side, the peer's close on the other.
        let (mut net, a, b) = pair(Shape::default(), Shape::default());
        net.conns[a].app.backlog = 20;
        net.conns[b].app.hold = 0;
        net.drive(10_000);
        assert!(net.close(a));
        net.drive(10_000);
        // A sender beyond its credits: the receiver's receive queue would have run dry.
        let (mut net, a, b) = pair(Shape::default(), Shape::default());
        net.conns[a].core = Core::new(Credits::new(8, 3, 8 + 4, 3, 8 + 4), 4, CLOSE);
        net.conns[a].app.backlog = 12;
        net.drive(10_000);
        assert!(net.conns[b].core.failure().is_some());
    });
    let of = |message: &str| -> Vec<_> { events.iter().filter(|e| e.message == message).collect() };
    let one = |message: &str, level: Level, conn: &str| {
        let found = of(message);
        assert_eq!(found.len(), 1, "{message}: {events:#?}");
        assert_eq!(found[0].level, level, "{message}");
        assert_eq!(found[0].field("conn"), Some(conn), "{message}");
        found[0].clone()
    };
    one("close started", Level::INFO, "qp 0x0");
    one("closed", Level::INFO, "qp 0x0");
    one("peer closed", Level::INFO, "qp 0x1");
    // Both sides of the lie: the receiver sees data beyond its credits, the liar's message
    // meets a receiver not ready until its retries run out.
    let mut rnr: Vec<_> = of("receiver not ready")
        .into_iter()
        .map(|e| (e.level, e.field("conn"), e.field("failure")))
        .collect();
    rnr.sort();
    assert_eq!(
        rnr,
        [
            (
                Level::WARN,
                Some("qp 0x0"),
                Some("a work request completed with RnrRetryExcErr (vendor error 0x0)")
            ),
            (
                Level::WARN,
                Some("qp 0x1"),
                Some("protocol violation: data message beyond the credits granted")
            ),
        ]
    );
    assert!(of("connection failed").is_empty(), "{events:#?}");
}
