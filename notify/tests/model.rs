//! The model obeys every clause of the verbs notification semantics, and the waiter, driven
//! against it, never strands a completion.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use rdmsg_notify::model::{Model, ModelArrival, ModelChannel, ModelCompletion, ModelCq};
use rdmsg_notify::{
    ArmMode, CompletionSource, EventChannel, EventTarget, Policy, Readiness, Waiter,
};

fn events(model: &Model, cqs: &[ModelCq]) -> Vec<EventTarget> {
    let mut ch = model.channel();
    std::iter::from_fn(|| ch.next_event(cqs).unwrap()).collect()
}

// ---- the model, clause by clause ----

#[test]
fn arming_is_one_shot() {
    let m = Model::new();
    let cq = m.add_cq(16);
    cq.arm(ArmMode::Next).unwrap();
    m.arrive(ModelArrival::recv(0, false));
    m.arrive(ModelArrival::recv(0, false));
    assert_eq!(events(&m, &[cq]), [EventTarget::Cq(0)]);
}

#[test]
fn completions_queued_before_arming_do_not_notify() {
    let m = Model::new();
    let cq = m.add_cq(16);
    m.arrive(ModelArrival::recv(0, true));
    cq.arm(ArmMode::Next).unwrap();
    assert!(events(&m, &[cq]).is_empty());
}

#[test]
fn several_arms_before_an_event_yield_one_event() {
    let m = Model::new();
    let cq = m.add_cq(16);
    for _ in 0..3 {
        cq.arm(ArmMode::SolicitedOnly).unwrap();
    }
    m.arrive(ModelArrival::recv(0, true));
    m.arrive(ModelArrival::recv(0, true));
    assert_eq!(events(&m, &[cq]).len(), 1);
}

#[test]
fn next_wins_over_solicited_only_in_either_order() {
    for order in [
        [ArmMode::SolicitedOnly, ArmMode::Next],
        [ArmMode::Next, ArmMode::SolicitedOnly],
    ] {
        let m = Model::new();
        let cq = m.add_cq(16);
        for mode in order {
            cq.arm(mode).unwrap();
        }
        m.arrive(ModelArrival::recv(0, false));
        assert_eq!(events(&m, &[cq]).len(), 1, "{order:?}");
    }
}

#[test]
fn solicited_only_fires_for_solicited_receives_and_any_error() {
    let solicited_send = ModelArrival {
        cq: 0,
        recv: false,
        solicited: true,
        success: true,
    };
    let cases = [
        (ModelArrival::recv(0, false), false),
        (ModelArrival::send(0), false),
        (solicited_send, false),
        (ModelArrival::recv(0, true), true),
        (ModelArrival::error(0, true), true),
        (ModelArrival::error(0, false), true),
    ];
    for (arrival, fires) in cases {
        let m = Model::new();
        let cq = m.add_cq(16);
        cq.arm(ArmMode::SolicitedOnly).unwrap();
        m.arrive(arrival);
        assert_eq!(events(&m, &[cq]).len(), usize::from(fires), "{arrival:?}");
    }
}

#[test]
fn destroying_with_unacked_events_is_reported() {
    for ack in [true, false] {
        let m = Model::new();
        let cq = m.add_cq(16);
        cq.arm(ArmMode::Next).unwrap();
        m.arrive(ModelArrival::recv(0, false));
        let cqs = [cq];
        assert_eq!(events(&m, &cqs).len(), 1);
        let [cq] = cqs;
        assert_eq!(cq.unacked(), 1);
        if ack {
            cq.ack(5);
            assert_eq!(cq.unacked(), 0, "acks never exceed events read");
        }
        assert_eq!(cq.destroy().is_ok(), ack);
    }
}

#[test]
fn an_undersized_queue_overruns() {
    let m = Model::new();
    let _cq = m.add_cq(2);
    for _ in 0..3 {
        m.arrive(ModelArrival::recv(0, false));
    }
    assert!(m.overrun(0));
}

// ---- the waiter against the model ----

type ModelWaiter = Waiter<ModelCq, ModelChannel>;

fn waiter(m: &Model, modes: &[ArmMode], policy: Policy) -> ModelWaiter {
    let mut w = Waiter::new(m.channel(), policy);
    for &mode in modes {
        w.add(m.add_cq(1024), mode);
    }
    w
}

fn wait_now(w: &mut ModelWaiter, out: &mut Vec<ModelCompletion>) -> usize {
    w.wait(Some(Duration::ZERO), &mut |_, c| out.push(*c))
        .unwrap()
}

/// A fresh waiter's wait on solicited-only queues is: one poll (of what is already queued), one
/// arm, one poll, then the sleep. Arrivals scheduled for the fourth operation land while it
/// sleeps.
const DURING_FIRST_SLEEP: u64 = 4;

/// With a queue armed for any completion, the channel is drained (one event read) before the
/// arm: the sleep is the fifth operation.
const DURING_FIRST_SLEEP_NEXT: u64 = 5;

#[test]
fn solicited_only_receiver_sleeps_through_unsolicited_messages() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], Policy::Sleep);
    for _ in 0..10 {
        m.schedule(m.now() + DURING_FIRST_SLEEP, ModelArrival::recv(0, false));
    }
    let mut got = Vec::new();
    assert_eq!(
        wait_now(&mut w, &mut got),
        0,
        "not woken: the wait timed out"
    );
    assert_eq!(m.queued(0), 10, "they landed and wait in the queue");
    assert_eq!(w.stats().wakeups, 0);
    assert!(m.violations().is_empty(), "{:?}", m.violations());
    // The next wait collects them without sleeping.
    assert_eq!(wait_now(&mut w, &mut got), 10);
}

#[test]
fn a_sleep_reads_the_clock_when_it_ends_and_a_wait_that_polled_reads_none() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], Policy::Sleep);
    let mut got = Vec::new();
    m.arrive(ModelArrival::recv(0, false));
    let now = Instant::now();
    assert_eq!(
        w.wait_until(Some(now), now, &mut |_, c| got.push(*c))
            .unwrap(),
        1
    );
    assert_eq!(w.woke_at(), None, "found by the first poll: no sleep");
    m.schedule(m.now() + DURING_FIRST_SLEEP, ModelArrival::recv(0, true));
    assert_eq!(
        w.wait_until(Some(now), now, &mut |_, c| got.push(*c))
            .unwrap(),
        1
    );
    assert!(w.woke_at().is_some_and(|t| t >= now), "slept, then read it");
    assert_eq!(w.stats().wakeups, 1);
    // A later wait that finds its completion by polling did not sleep: no time of its own.
    m.arrive(ModelArrival::recv(0, false));
    assert_eq!(w.wait(None, &mut |_, c| got.push(*c)).unwrap(), 1);
    assert_eq!(w.woke_at(), None, "not the earlier wait's");
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

#[test]
fn solicited_message_wakes_and_everything_before_it_is_drained_in_order() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], Policy::Sleep);
    for i in 0..11 {
        m.schedule(m.now() + DURING_FIRST_SLEEP, ModelArrival::recv(0, i == 10));
    }
    let mut got = Vec::new();
    assert_eq!(
        wait_now(&mut w, &mut got),
        11,
        "woken, then drained everything"
    );
    let seqs: Vec<u64> = got.iter().map(|c| c.seq).collect();
    assert_eq!(seqs, (0..11).collect::<Vec<_>>());
    let s = w.stats();
    assert_eq!((s.wakeups, s.spurious_wakeups, s.events), (1, 0, 1));
    assert_eq!(s.completions_per_wakeup(), 11.0);
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

#[test]
fn a_wait_of_any_length_is_a_wait() {
    // `Duration::MAX` used to overflow the deadline and panic.
    for policy in [
        Policy::Sleep,
        Policy::Poll,
        Policy::Hybrid {
            spin: Duration::MAX,
            max_empty_polls: 4,
        },
        Policy::ADAPTIVE,
        Policy::Adaptive {
            max_spin: Duration::MAX,
        },
    ] {
        let m = Model::new();
        let mut w = waiter(&m, &[ArmMode::SolicitedOnly], policy);
        m.arrive(ModelArrival::recv(0, true));
        let mut got = Vec::new();
        let n = w
            .wait(Some(Duration::MAX), &mut |_, c| got.push(*c))
            .unwrap();
        assert_eq!((n, got.len()), (1, 1), "{policy:?}");
    }
}

#[test]
fn next_mode_send_queue_wakes_on_a_send_error_the_receive_queue_ignores() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly, ArmMode::Next], Policy::Sleep);
    let mut got = Vec::new();
    assert_eq!(wait_now(&mut w, &mut got), 0);
    m.arrive(ModelArrival::send(1));
    assert_eq!(
        wait_now(&mut w, &mut got),
        1,
        "next-mode queue wakes on the first"
    );
    m.arrive(ModelArrival::error(1, false));
    assert_eq!(wait_now(&mut w, &mut got), 1);
    assert!(!got[1].success);
}

#[test]
fn raising_a_queue_to_next_mode_rearms_it() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], Policy::Sleep);
    let mut got = Vec::new();
    assert_eq!(
        wait_now(&mut w, &mut got),
        0,
        "armed solicited-only, asleep"
    );
    w.set_mode(rdmsg_notify::CqKey(0), ArmMode::Next).unwrap();
    assert_eq!(w.mode(rdmsg_notify::CqKey(0)).unwrap(), ArmMode::Next);
    m.schedule(
        m.now() + DURING_FIRST_SLEEP_NEXT,
        ModelArrival::recv(0, false),
    );
    assert_eq!(
        wait_now(&mut w, &mut got),
        1,
        "the unsolicited receive wakes the re-armed queue"
    );
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

/// A completion landing at every possible instant inside the waiter's loop, in particular
/// between its poll and its arm, is delivered by a later wait.
#[test]
fn no_instant_in_the_loop_strands_a_completion() {
    for offset in 1..12 {
        let m = Model::new();
        let mut w = waiter(&m, &[ArmMode::SolicitedOnly, ArmMode::Next], Policy::Sleep);
        let mut got = Vec::new();
        m.schedule(m.now() + offset, ModelArrival::recv(0, true));
        m.schedule(m.now() + offset, ModelArrival::send(1));
        for _ in 0..4 {
            wait_now(&mut w, &mut got);
        }
        assert_eq!(got.len(), 2, "offset {offset}");
        assert!(
            m.violations().is_empty(),
            "offset {offset}: {:?}",
            m.violations()
        );
    }
}

/// The model catches the classic bug: polling, then arming, then sleeping.
#[test]
fn the_model_catches_poll_then_arm() {
    let m = Model::new();
    let mut cq = m.add_cq(16);
    let mut ch = m.channel();
    let mut scratch = [ModelCompletion::default(); 4];
    assert_eq!(cq.poll(&mut scratch).unwrap(), 0);
    m.arrive(ModelArrival::recv(0, true));
    cq.arm(ArmMode::SolicitedOnly).unwrap();
    assert_eq!(
        ch.wait_readable(None, std::time::Instant::now()).unwrap(),
        Readiness::TimedOut
    );
    assert_eq!(m.violations().len(), 1, "{:?}", m.violations());
}

#[test]
fn acks_are_batched_and_flushed() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::Next], Policy::Sleep);
    w.set_ack_batch(4);
    let mut got = Vec::new();
    for _ in 0..10 {
        wait_now(&mut w, &mut got);
        m.arrive(ModelArrival::recv(0, false));
        wait_now(&mut w, &mut got);
    }
    // The last completion was collected by the wait's first poll, before its event was read:
    // the next wait reads it before it sleeps.
    assert_eq!(w.stats().events, 9);
    wait_now(&mut w, &mut got);
    let s = w.stats();
    assert_eq!(s.events, 10);
    assert_eq!((s.events_acked, s.ack_calls), (8, 2));
    let (_, cqs) = w.into_parts();
    for cq in cqs {
        cq.destroy().expect("into_parts acks the rest");
    }
}

#[test]
fn a_stale_event_is_absorbed_before_sleeping() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::Next], Policy::Sleep);
    let mut got = Vec::new();
    wait_now(&mut w, &mut got); // armed
                                // Lands after the arm (an event is pending) and is drained by a poll before the next wait.
    m.arrive(ModelArrival::recv(0, false));
    w.poll_all(&mut |_, c| got.push(*c)).unwrap();
    assert_eq!(wait_now(&mut w, &mut got), 0);
    let s = w.stats();
    // The event is read, acked later, and the queue re-armed, all without a sleep.
    assert_eq!((s.events, s.wakeups, s.spurious_wakeups), (1, 0, 0));
    assert_eq!(m.arms(), 2);
    assert_eq!(got.len(), 1);
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

#[test]
fn poll_policy_never_arms_and_hybrid_arms_after_spinning() {
    let m = Model::new();
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], Policy::Poll);
    let mut got = Vec::new();
    m.arrive(ModelArrival::recv(0, false));
    assert_eq!(
        wait_now(&mut w, &mut got),
        1,
        "polling sees unsolicited messages"
    );
    assert_eq!(m.arms(), 0);

    let m = Model::new();
    let hybrid = Policy::Hybrid {
        spin: Duration::from_secs(1),
        max_empty_polls: 5,
    };
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], hybrid);
    // No deadline: the spin ends after max_empty_polls, then the waiter arms and sleeps.
    assert_eq!(w.wait(None, &mut |_, c| got.push(*c)).unwrap(), 0);
    assert_eq!(m.arms(), 1, "armed once the spin ran out");
    assert!(w.stats().empty_polls >= 5);
}

#[test]
fn the_adaptive_policy_spins_only_while_recent_waits_are_short() {
    let m = Model::new();
    let max_spin = Duration::from_millis(4);
    let mut w = waiter(&m, &[ArmMode::SolicitedOnly], Policy::Adaptive { max_spin });
    let mut got = Vec::new();
    assert_eq!(
        w.adaptive_spin(),
        Duration::ZERO,
        "no history: sleep at once"
    );
    // Completions already queued when waited for: waits of no length.
    for seq in 0..rdmsg_notify::RECENT_GAPS as u64 {
        m.arrive(ModelArrival::recv(0, true));
        assert_eq!(w.wait(None, &mut |_, c| got.push(*c)).unwrap(), 1, "#{seq}");
    }
    let spin = w.adaptive_spin();
    assert_eq!(spin, max_spin / 4, "short waits: the shortest spin");
    // A spin the caller's deadline cuts short says nothing.
    assert_eq!(
        w.wait(Some(Duration::from_micros(100)), &mut |_, c| got.push(*c))
            .unwrap(),
        0
    );
    assert_eq!(
        w.adaptive_spin(),
        max_spin / 4,
        "a cut-short spin is not counted"
    );
    // Two spins that ran their course and found nothing turn spinning off; one does not.
    let long = Some(Duration::from_millis(200));
    assert_eq!(w.wait(long, &mut |_, c| got.push(*c)).unwrap(), 0);
    assert_eq!(
        w.adaptive_spin(),
        max_spin / 4,
        "one outlier does not decide"
    );
    assert_eq!(w.wait(long, &mut |_, c| got.push(*c)).unwrap(), 0);
    assert_eq!(
        w.adaptive_spin(),
        Duration::ZERO,
        "two fruitless spins turn spinning off"
    );
    // With spinning off, waits sleep at once, but every PROBE_EVERY-th one spins to look.
    let mut spins = 0;
    for _ in 0..2 * rdmsg_notify::PROBE_EVERY {
        let polls = w.stats().empty_polls;
        assert_eq!(
            w.wait(Some(Duration::ZERO), &mut |_, c| got.push(*c))
                .unwrap(),
            0
        );
        if w.stats().empty_polls > polls + 3 {
            spins += 1;
        }
    }
    assert_eq!(spins, 2, "one probe in {} waits", rdmsg_notify::PROBE_EVERY);
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

// ---- the property ----

#[derive(Debug, Clone)]
enum Op {
    /// A completion lands `delay` operations from now (possibly in the middle of a wait).
    Arrive { delay: u64, arrival: ModelArrival },
    /// The waiter waits (without blocking: the model reports when it would).
    Wait,
}

fn op(n_cqs: usize) -> impl Strategy<Value = Op> {
    let arrive = (
        0..8u64,
        0..n_cqs,
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.9),
    )
        .prop_map(|(delay, cq, recv, solicited, success)| Op::Arrive {
            delay,
            arrival: ModelArrival {
                cq,
                recv,
                solicited,
                success,
            },
        });
    prop_oneof![3 => arrive, 2 => Just(Op::Wait)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Over arbitrary interleavings of arrivals, arms and polls: no wait sleeps while a
    /// completion that should wake it is pending, and once a waking completion arrives on every
    /// queue, everything is delivered exactly once, in arrival order per queue.
    #[test]
    fn no_completion_is_ever_stranded(
        solicited_recv in any::<bool>(),
        ops in prop::collection::vec(op(2), 1..60),
        batch in 1u32..5,
        adaptive in any::<bool>(),
    ) {
        let m = Model::new();
        let recv_mode = if solicited_recv { ArmMode::SolicitedOnly } else { ArmMode::Next };
        // The adaptive policy spins between quick arrivals, then sleeps as Sleep does: it must
        // strand nothing either.
        let policy = if adaptive { Policy::ADAPTIVE } else { Policy::Sleep };
        let mut w = waiter(&m, &[recv_mode, ArmMode::Next], policy);
        w.set_ack_batch(batch);
        let mut got: Vec<ModelCompletion> = Vec::new();
        let mut arrivals = 0u64;
        for op in ops {
            match op {
                Op::Arrive { delay, arrival } => {
                    arrivals += 1;
                    if delay == 0 {
                        m.arrive(arrival);
                    } else {
                        m.schedule(m.now() + delay, arrival);
                    }
                }
                Op::Wait => {
                    wait_now(&mut w, &mut got);
                }
            }
        }
        // Let every scheduled arrival land, then wake both queues for sure.
        while m.pending_schedule() > 0 {
            wait_now(&mut w, &mut got);
        }
        m.arrive(ModelArrival::recv(0, true));
        m.arrive(ModelArrival::error(1, false));
        arrivals += 2;
        for _ in 0..4 {
            wait_now(&mut w, &mut got);
        }
        prop_assert!(m.violations().is_empty(), "{:?}", m.violations());
        prop_assert_eq!(got.len() as u64, arrivals, "every completion delivered once");
        for cq in 0..2 {
            prop_assert_eq!(m.queued(cq), 0);
            let seqs: Vec<u64> = got.iter().filter(|c| c.cq == cq).map(|c| c.seq).collect();
            prop_assert!(seqs.windows(2).all(|p| p[0] < p[1]), "in order: {:?}", seqs);
        }
        let (_, cqs) = w.into_parts();
        for cq in cqs {
            prop_assert!(cq.destroy().is_ok());
        }
    }
}
