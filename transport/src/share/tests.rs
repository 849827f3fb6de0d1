//! Unit tests of the share: admission, lending, quotas, release, and its audit.

use super::*;
use crate::credits::Imm;

const CFG: ShareConfig = ShareConfig {
    min_credits: 2,
    max_credits: 16,
    grant_slots: 3,
};

const GRANT: Imm = Imm {
    credits: 0,
    echo: 0,
    flags: Imm::GRANT,
};

/// Books of a hub connection whose peer receives into 8 buffers and 3 grant slots.
fn books() -> Option<Credits> {
    Some(Credits::shared(
        CFG.max_credits,
        CFG.grant_slots,
        8,
        3,
        8,
        CFG.min_credits,
    ))
}

/// A pool of `n` connections with `extra` buffers spare, each about to send (its grant slots
/// backed, as a hub backs them before a connection sends).
fn pool(n: usize, extra: u32) -> (Share, Vec<Option<Credits>>) {
    let mut share = Share::new(CFG).unwrap();
    let mut conns = vec![None; n];
    share.on_posted(
        n as u32 * (CFG.admission_cost() + CFG.slot_cost()) + extra,
        &mut conns,
        &mut Vec::new(),
    );
    for slot in 0..n {
        share.admit(slot).unwrap();
        conns[slot] = books();
        assert!(share.wake_slots(slot, &mut conns, &mut Vec::new()));
    }
    (share, conns)
}

/// The peer of `slot` sends a data message, which the hub takes in.
fn receive_data(share: &mut Share, conns: &mut [Option<Credits>], slot: usize, last: bool) {
    receive_echoing(share, conns, slot, last, 0);
}

/// The same, the message confirming `echo` grants.
fn receive_echoing(
    share: &mut Share,
    conns: &mut [Option<Credits>],
    slot: usize,
    last: bool,
    echo: u8,
) {
    let c = conns[slot].as_mut().unwrap();
    let flags = if last { Imm::EXHAUSTED } else { 0 };
    let imm = Imm {
        credits: 0,
        echo,
        flags,
    };
    assert!(!c.on_receive(imm).unwrap());
    share.on_consumed(slot, c, Consumed::Data, &mut Vec::new());
}

fn owed(conns: &[Option<Credits>], slot: usize) -> u32 {
    conns[slot].as_ref().unwrap().owed()
}

#[test]
fn bad_configs_are_refused() {
    let cfg = |min_credits, max_credits, grant_slots| ShareConfig {
        min_credits,
        max_credits,
        grant_slots,
    };
    assert_eq!(Share::new(cfg(0, 4, 3)).err(), Some(ConfigError::NoMinimum));
    assert_eq!(
        Share::new(cfg(4, 2, 3)).err(),
        Some(ConfigError::MaxBelowMin { min: 4, max: 2 })
    );
    assert_eq!(
        Share::new(cfg(1, 2, 2)).err(),
        Some(ConfigError::TooFewGrantSlots(2))
    );
}

#[test]
fn admission_needs_room_and_a_free_slot() {
    let mut share = Share::new(CFG).unwrap();
    let mut conns: Vec<Option<Credits>> = vec![None, None];
    assert_eq!(
        share.admit(0),
        Err(AdmitError::NoRoom { spare: 0, cost: 2 })
    );
    share.on_posted(7, &mut conns, &mut Vec::new());
    share.admit(0).unwrap();
    conns[0] = books();
    assert_eq!(share.admit(0), Err(AdmitError::SlotInUse(0)));
    // Its grant slots sleep until it sends.
    assert_eq!(share.spare(), 5);
    assert_eq!(share.backing(0), Some(2));
    share.audit(&conns).unwrap();
    assert!(share.wake_slots(0, &mut conns, &mut Vec::new()));
    assert_eq!((share.spare(), share.backing(0)), (2, Some(5)));
    share.audit(&conns).unwrap();
    // Nothing sent: the peer cannot grant, they may sleep again.
    share.park_slots(0, &mut conns, &mut Vec::new());
    assert_eq!((share.spare(), share.backing(0)), (5, Some(2)));
    share.audit(&conns).unwrap();
}

#[test]
fn grant_slots_first_then_the_starving_then_quotas() {
    let (mut share, mut conns) = pool(3, 0);
    // 1 spends its minimum; 2 receives a grant.
    receive_data(&mut share, &mut conns, 1, false);
    receive_data(&mut share, &mut conns, 1, true);
    let c2 = conns[2].as_mut().unwrap();
    assert!(c2.on_receive(GRANT).unwrap());
    share.on_consumed(2, c2, Consumed::Grant, &mut Vec::new());
    assert!(share.urgent());
    share.audit(&conns).unwrap();
    let mut touched = Vec::new();
    share.on_posted(1, &mut conns, &mut touched);
    assert_eq!(conns[2].as_ref().unwrap().slots_missing(), 0, "slot first");
    assert_eq!(owed(&conns, 1), 0);
    share.on_posted(2, &mut conns, &mut touched);
    assert_eq!(owed(&conns, 1), 2, "then the starving");
    assert!(!share.urgent());
    share.on_posted(1, &mut conns, &mut touched);
    assert_eq!(share.spare(), 1, "nobody below quota: spare");
    assert_eq!(touched, [2, 1], "once per call, in the order served");
    share.audit(&conns).unwrap();
}

#[test]
fn fewest_credits_first_and_equals_take_turns() {
    let (mut share, mut conns) = pool(3, 12);
    // All three grow to quota 4 from spare; no grants are sent, so what they got is owed.
    for slot in 0..3 {
        receive_data(&mut share, &mut conns, slot, false);
        receive_data(&mut share, &mut conns, slot, true);
        assert_eq!(share.quota(slot), Some(4));
    }
    assert_eq!(share.spare(), 0);
    // Each peer now holds none and is owed 4; the hub grants: peers hold 4.
    for c in conns.iter_mut().flatten() {
        assert_eq!(c.take_grant().unwrap().imm.credits, 4);
    }
    // 0 drops to 1 credit, 1 and 2 to 3.
    for _ in 0..3 {
        receive_data(&mut share, &mut conns, 0, false);
    }
    receive_data(&mut share, &mut conns, 1, false);
    receive_data(&mut share, &mut conns, 2, false);
    share.on_posted(3, &mut conns, &mut Vec::new());
    assert_eq!(
        owed(&conns, 0),
        2,
        "0 was lowest, then level with the others"
    );
    assert_eq!(owed(&conns, 1) + owed(&conns, 2), 1);
    share.on_posted(1, &mut conns, &mut Vec::new());
    assert_eq!((owed(&conns, 1), owed(&conns, 2)), (1, 1), "turns");
    share.audit(&conns).unwrap();
}

#[test]
fn a_peer_that_runs_out_grows_while_spare_lasts_and_an_idle_one_shrinks() {
    let (mut share, mut conns) = pool(2, 30);
    let mut quotas = Vec::new();
    for grants in 0..3 {
        let n = conns[0].as_ref().unwrap().peer_credits();
        for i in 0..n {
            receive_echoing(&mut share, &mut conns, 0, i + 1 == n, grants);
        }
        quotas.push(share.quota(0).unwrap());
        let g = conns[0].as_mut().unwrap().take_grant().unwrap();
        assert!(g.solicited, "the peer is out of credits");
    }
    assert_eq!(quotas, [4, 8, 16], "doubled, refilled at once");
    assert_eq!(share.spare(), 2);
    assert_eq!(conns[0].as_ref().unwrap().grant_threshold(), 4);
    share.tick(&mut conns, &mut Vec::new());
    assert_eq!(share.quota(0), Some(16), "busy: kept");
    assert_eq!(share.quota(1), Some(2));
    share.tick(&mut conns, &mut Vec::new());
    assert_eq!(share.quota(0), Some(8));
    share.tick(&mut conns, &mut Vec::new());
    share.tick(&mut conns, &mut Vec::new());
    assert_eq!(share.quota(0), Some(2));
    assert_eq!(conns[0].as_ref().unwrap().grant_threshold(), 1);
    // The peer still holds its 16 credits; as it spends them, only the last two are
    // refilled, from the two spare, and running out grows its quota into that headroom.
    assert_eq!(share.spare(), 2);
    for i in 0..16 {
        receive_echoing(&mut share, &mut conns, 0, i == 15, 3);
    }
    assert_eq!(owed(&conns, 0), 2);
    assert_eq!(share.quota(0), Some(4));
    assert!(share.urgent(), "its peer is blocked and below its quota");
    share.on_posted(16, &mut conns, &mut Vec::new());
    assert_eq!(owed(&conns, 0), 4);
    assert_eq!(share.spare(), 14);
    share.audit(&conns).unwrap();
}

#[test]
fn owed_credits_beyond_a_shrunk_quota_go_back_to_spare() {
    let (mut share, mut conns) = pool(1, 10);
    receive_data(&mut share, &mut conns, 0, false);
    receive_data(&mut share, &mut conns, 0, true);
    // Quota 4; the peer holds none and is owed 4, then goes idle.
    assert_eq!(owed(&conns, 0), 4);
    assert_eq!(share.spare(), 6);
    share.tick(&mut conns, &mut Vec::new());
    assert_eq!(owed(&conns, 0), 4, "it received data since the last tick");
    let mut touched = Vec::new();
    share.tick(&mut conns, &mut touched);
    assert_eq!(touched, [0], "its threshold changed");
    assert_eq!(share.quota(0), Some(2));
    assert_eq!(owed(&conns, 0), 2);
    assert_eq!(share.spare(), 8);
    share.audit(&conns).unwrap();
}

#[test]
fn unaccounted_receives_are_charged_and_released_connections_feed_the_waiting() {
    let (mut share, mut conns) = pool(2, 0);
    // 0 breaks the protocol: it overruns its 2 credits and then some.
    for _ in 0..2 {
        receive_data(&mut share, &mut conns, 0, false);
    }
    let c0 = conns[0].as_mut().unwrap();
    for _ in 0..4 {
        share.on_consumed(0, c0, Consumed::Unaccounted, &mut Vec::new());
    }
    // 3 grant slots covered 3 of them; the fourth ate a buffer backing 1's credits.
    assert_eq!(share.backing(0), Some(0));
    assert_eq!(share.deficit(), 1);
    share.audit(&conns).unwrap();
    receive_data(&mut share, &mut conns, 1, false);
    // 6 buffers come back: one makes up the deficit, 0 gets none, 1 is refilled.
    share.on_posted(6, &mut conns, &mut Vec::new());
    assert_eq!(share.deficit(), 0);
    assert_eq!(owed(&conns, 0), 0);
    assert_eq!(owed(&conns, 1), 1);
    assert_eq!(share.spare(), 4);
    conns[0] = None;
    share.release(0, &mut conns, &mut Vec::new());
    assert_eq!(share.spare(), 4);
    share.audit(&conns).unwrap();
    share.on_stray();
    assert_eq!(share.spare(), 3, "a stray receive is charged to the pool");
    share.audit(&conns).unwrap();
    // 1 spends everything while nothing is spare; a departing connection refills it.
    let (mut share, mut conns) = pool(2, 0);
    receive_data(&mut share, &mut conns, 1, false);
    receive_data(&mut share, &mut conns, 1, true);
    assert!(share.urgent());
    conns[0] = None;
    let mut touched = Vec::new();
    share.release(0, &mut conns, &mut touched);
    assert_eq!(owed(&conns, 1), 2);
    assert_eq!(share.spare(), 3);
    assert_eq!(touched, [1]);
    share.audit(&conns).unwrap();
}

#[test]
fn buffers_posted_for_a_newcomer_go_to_it_first_and_retired_connections_get_none() {
    let (mut share, mut conns) = pool(2, 0);
    conns.push(None);
    for _ in 0..2 {
        receive_data(&mut share, &mut conns, 0, false);
    }
    assert_eq!(
        share.admit(2),
        Err(AdmitError::NoRoom { spare: 0, cost: 2 })
    );
    share
        .admit_posted(2, 3, &mut conns, &mut Vec::new())
        .unwrap();
    conns[2] = books();
    assert_eq!(owed(&conns, 0), 1, "the waiting get what the newcomer left");
    share.retire(0);
    assert!(!share.urgent());
    share.on_posted(1, &mut conns, &mut Vec::new());
    assert_eq!((owed(&conns, 0), share.spare()), (1, 1));
    // A closing peer's last message (its credit granted before the hub retired it).
    assert_eq!(
        conns[0].as_mut().unwrap().take_grant().unwrap().imm.credits,
        1
    );
    receive_data(&mut share, &mut conns, 0, true);
    assert_eq!(share.quota(0), Some(2), "retired: no growth");
    assert_eq!((owed(&conns, 0), share.spare()), (0, 1), "nor refills");
    share.audit(&conns).unwrap();
    let mut touched = Vec::new();
    share.release(0, &mut conns, &mut touched);
    assert_eq!(share.spare(), 1 + 3, "its grant slots come back");
    assert!(touched.is_empty());
}

#[test]
fn a_held_back_connection_gets_no_credits_and_gives_back_what_it_was_owed() {
    let (mut share, mut conns) = pool(2, 10);
    // 0 spends its minimum and grows to quota 4: owed 4, 6 spare.
    receive_data(&mut share, &mut conns, 0, false);
    receive_data(&mut share, &mut conns, 0, true);
    assert_eq!((owed(&conns, 0), share.spare()), (4, 6));
    let mut touched = Vec::new();
    share.hold(0, true, &mut conns, &mut touched);
    assert!(share.is_held(0));
    assert_eq!(owed(&conns, 0), 0, "never announced: back to the pool");
    assert_eq!(share.spare(), 10);
    assert_eq!(touched, [0]);
    share.audit(&conns).unwrap();
    // Let go, it is refilled to its quota; its peer is granted them.
    share.hold(0, false, &mut conns, &mut Vec::new());
    let g = conns[0].as_mut().unwrap().take_grant().unwrap();
    assert_eq!(g.imm.credits, 4);
    // Held again, its peer spends them: nothing comes back, not even its minimum, its quota
    // does not grow, and the others are served as ever.
    share.hold(0, true, &mut conns, &mut Vec::new());
    for i in 0..4 {
        receive_echoing(&mut share, &mut conns, 0, i == 3, 1);
    }
    share.on_posted(4, &mut conns, &mut Vec::new());
    assert_eq!(owed(&conns, 0), 0, "held: no credit");
    assert_eq!(share.quota(0), Some(4));
    assert_eq!(share.take_demand(), 0, "no growth asked for it");
    assert!(!share.urgent());
    receive_data(&mut share, &mut conns, 1, false);
    receive_data(&mut share, &mut conns, 1, true);
    assert_eq!(owed(&conns, 1), 4, "the other peer is served");
    share.audit(&conns).unwrap();
    // A grant from the held peer still finds its slot restored.
    let c0 = conns[0].as_mut().unwrap();
    assert!(c0
        .on_receive(Imm {
            credits: 0,
            echo: 1,
            flags: Imm::GRANT
        })
        .unwrap());
    share.on_consumed(0, c0, Consumed::Grant, &mut Vec::new());
    share.on_posted(1, &mut conns, &mut Vec::new());
    assert_eq!(conns[0].as_ref().unwrap().slots_missing(), 0);
    assert_eq!(owed(&conns, 0), 0);
    // Let go: starving, it is served first.
    let mut touched = Vec::new();
    share.hold(0, false, &mut conns, &mut touched);
    assert!(!share.is_held(0));
    assert_eq!(touched, [0]);
    assert!(owed(&conns, 0) >= CFG.min_credits);
    share.audit(&conns).unwrap();
}
