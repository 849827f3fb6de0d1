//! Unit tests of the core's rules one input at a time (the simulator runs them together).

use std::time::{Duration, Instant};

use rdmsg_verbs::{WcOpcode, WcStatus};

use super::*;

/// The peer's close message.
const CLOSE_MSG: Imm = Imm {
    credits: 0,
    echo: 0,
    flags: Imm::CLOSE,
};

const CLOSE: Duration = Duration::from_secs(2);

fn core(credits: Credits, signal_every: u32) -> Core {
    Core::new(credits, signal_every, CLOSE)
}

fn recv(imm: Imm) -> Completion {
    Completion {
        recv: true,
        status: WcStatus::Success,
        opcode: WcOpcode::Recv,
        vendor_err: 0,
        imm: Some(imm.encode()),
        wr_id: 0,
    }
}

fn send_ok() -> Completion {
    Completion {
        recv: false,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        vendor_err: 0,
        imm: None,
        wr_id: 0,
    }
}

const ROOM: Room = Room {
    sq: 8,
    buffers: 8,
    cq: usize::MAX,
    unsignaled: usize::MAX,
};

fn actions(c: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| c.poll_command()).collect()
}

#[test]
fn the_first_failure_is_kept_and_asks_once_for_the_queue_pair_to_fail() {
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 4);
    c.handle_failure(Failure::PeerVanished);
    c.handle_failure(Failure::QpError);
    assert_eq!(c.failure(), Some(Failure::PeerVanished));
    assert_eq!(actions(&mut c), [Command::FailQueuePair]);
    assert!(!c.may_send(ROOM));
    assert!(c.data(true, ROOM).is_none());
    assert_eq!(c.check_send(), Err(Failure::PeerVanished));
}

#[test]
fn signalling_follows_the_count_and_what_runs_low() {
    let mut c = core(Credits::new(8, 3, 8, 3, 8), 3);
    let got: Vec<bool> = (0..6)
        .map(|_| c.data(false, ROOM).unwrap().signaled)
        .collect();
    assert_eq!(got, [false, false, true, false, false, true]);
    // The last send slot, the last buffer: signaled whatever the count.
    assert!(c.data(false, Room { sq: 1, ..ROOM }).unwrap().signaled);
    assert!(c.data(false, Room { buffers: 0, ..ROOM }).unwrap().signaled);
    c.posted(7, true);
    assert_eq!(c.send_arm(), ArmMode::Next);
    c.handle_send(&send_ok(), 7);
    assert_eq!(c.send_arm(), ArmMode::SolicitedOnly);
}

#[test]
fn a_close_timeout_of_any_length_is_a_deadline() {
    // `Duration::MAX` used to overflow the deadline and panic.
    let now = Instant::now();
    let mut c = Core::new(Credits::new(8, 3, 8, 3, 8), 16, Duration::MAX);
    c.handshake_done();
    c.handle_stream(StreamNews::Goodbye, now);
    let far = now + Duration::from_secs(365 * 24 * 60 * 60);
    assert!(c.timers.next().is_some_and(|at| at > far));
    let mut c = Core::new(Credits::new(8, 3, 8, 3, 8), 16, Duration::MAX);
    c.handshake_done();
    assert!(c.start_close(c.close_deadline(now), now).is_some());
    assert!(c.timers.next().is_some_and(|at| at > far));
}

#[test]
fn a_shared_send_cq_bounds_the_sends_left_unsignaled() {
    // A queue pair's part of a shared send CQ: at most one unsignaled in a row, or none.
    let mut c = core(Credits::new(8, 3, 8, 3, 8), 3);
    let shared = Room {
        unsignaled: 1,
        ..ROOM
    };
    let got: Vec<bool> = (0..4)
        .map(|_| c.data(false, shared).unwrap().signaled)
        .collect();
    assert_eq!(got, [false, true, false, true]);
    let none = Room {
        unsignaled: 0,
        ..ROOM
    };
    assert!(c.data(false, none).unwrap().signaled);
    assert!(c.data(false, none).unwrap().signaled);
    // Half a CQ of 1,024 for 16 queue pairs, none left for 1,024 of them.
    assert_eq!(unsignaled_share(1024, 16), 32);
    assert_eq!(unsignaled_share(1024, 1024), 0);
    assert_eq!(unsignaled_share(1024, 0), 512);
}

#[test]
fn queue_pairs_joining_one_by_one_leave_at_most_half_the_cq_unsignaled() {
    // Each newcomer sends unsignaled as long as it may, then falls silent for good, keeping
    // what it left behind: by parts alone (what each got when it came) that sums to about
    // 2,250 of 1,024 entries; the hub-wide bound keeps it to half.
    let (cq, signal_every) = (1024, 16);
    let mut total = 0;
    for n in 1..=1024 {
        let mut own = 0;
        while own + 1 < signal_every && own < unsignaled_room(cq, n, own, total) {
            own += 1;
            total += 1;
        }
        assert!(total <= cq / 2, "{total} unsignaled with {n} queue pairs");
    }
    assert_eq!(
        unsignaled_room(cq, 1, 3, cq / 2),
        3,
        "none more once half is held"
    );
}

#[test]
fn the_last_credit_is_solicited_and_counted() {
    let mut c = core(Credits::new(4, 3, 2, 3, 2), 16);
    assert!(!c.data(false, ROOM).unwrap().solicited);
    let last = c.data(false, ROOM).unwrap();
    assert!(last.solicited && last.imm.is_exhausted());
    assert!(!c.may_send(ROOM));
    assert!(c.data(true, ROOM).is_none());
    let s = c.stats();
    assert_eq!((s.sent, s.sent_solicited, s.forced_solicited), (2, 1, 1));
    let r = c.handle_recv(
        &recv(Imm {
            credits: 2,
            echo: 0,
            flags: 0,
        }),
        || None,
        Instant::now,
    );
    assert_eq!(r.action, RecvAction::Deliver);
    assert!(r.spent_credit);
    assert_eq!(c.credits().available(), 2);
}

#[test]
fn a_grant_needs_room_and_spends_no_credit() {
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 4);
    // The peer spends its last credits: we owe them back once re-posted.
    for _ in 0..4 {
        c.handle_recv(&recv(Imm::default_data()), || None, Instant::now);
    }
    c.reposted(4);
    assert!(c.grant(Room { sq: 0, ..ROOM }).is_none(), "no send slot");
    let g = c.grant(ROOM).expect("due");
    assert!(g.imm.is_grant() && g.imm.credits == 4);
    assert!(g.solicited, "the peer may be blocked");
    assert_eq!(c.credits().available(), 4);
}

#[test]
fn a_close_is_solicited_signaled_and_ends_in_a_goodbye() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    let post = c.start_close(c.close_deadline(t0), t0).expect("a credit");
    assert!(post.solicited && post.signaled && post.imm.flags & Imm::CLOSE != 0);
    assert_eq!(c.check_send(), Err(Failure::Closed));
    assert!(c.data(false, ROOM).is_none(), "nothing after the close");
    assert_eq!(c.next_timeout(), Some(t0 + CLOSE));
    c.posted(9, true);
    c.handle_send(&send_ok(), 9);
    assert_eq!(
        actions(&mut c),
        [Command::SayGoodbye, Command::FailQueuePair]
    );
    assert_eq!(c.failure(), Some(Failure::Closed));
    assert!(!c.close_timed_out());
}

/// One close, one clock: the close message's deadline is the one the close began with
/// (`close_timeout` after the layers above started it), not `close_timeout` after the message
/// went, however long they waited first (for the peer's reads, for a credit); a deadline that
/// passed before the message went still lets an acknowledgement polled first win.
#[test]
fn a_close_keeps_the_deadline_it_began_with() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    let deadline = c.close_deadline(t0);
    assert_eq!(deadline, t0 + CLOSE);
    // The layers above spent 1.5 s of it; the message goes now, with 0.5 s left.
    c.start_close(deadline, deadline - Duration::from_millis(500))
        .expect("a credit");
    c.posted(9, true);
    assert_eq!(
        c.next_timeout(),
        Some(deadline),
        "not 1.5 s + close_timeout"
    );
    c.handle_timeout(deadline - Duration::from_millis(1));
    assert_eq!(c.failure(), None);
    c.handle_timeout(deadline);
    assert_eq!(c.failure(), Some(Failure::CloseTimedOut));
    assert!(c.close_timed_out());
    assert_eq!(
        c.close_result(CLOSE)
            .and_then(|r| r.err())
            .map(|e| e.to_string()),
        Some(Error::timeout("closing", crate::error::WAIT_CLOSE_ACK, CLOSE).to_string()),
        "the timeout reported is the close's, not what was left of it"
    );

    // Nothing left when the message went: it still gets the time an acknowledgement takes
    // (CLOSE_ACK_GRACE), and its acknowledgement then is the close delivered.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    let now = t0 + Duration::from_millis(10);
    c.start_close(t0, now).expect("a credit");
    c.posted(9, true);
    assert_eq!(c.next_timeout(), Some(now + CLOSE_ACK_GRACE));
    c.handle_timeout(now + CLOSE_ACK_GRACE - Duration::from_millis(1));
    assert_eq!(c.failure(), None);
    c.handle_send(&send_ok(), 9);
    assert_eq!(c.failure(), Some(Failure::Closed));
    // Without one, it times out at that grace's end.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.start_close(t0, now).expect("a credit");
    c.posted(9, true);
    c.handle_timeout(now + CLOSE_ACK_GRACE);
    assert_eq!(c.failure(), Some(Failure::CloseTimedOut));
}

#[test]
fn a_close_is_delivered_by_its_own_completion_whatever_was_posted_after_it() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.posted(9, true);
    // A grant posted after the close message, unsignaled: still outstanding when the
    // close's completion comes.
    c.posted(10, false);
    c.handle_send(&send_ok(), 9);
    assert_eq!(c.failure(), Some(Failure::Closed));
    assert!(!c.close_timed_out());
}

#[test]
fn a_flushed_close_message_is_not_a_close_delivered() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.posted(9, true);
    let flushed = Completion {
        status: WcStatus::WrFlushErr,
        ..send_ok()
    };
    c.handle_send(&flushed, 9);
    assert_eq!(
        c.failure(),
        None,
        "no goodbye for a close that never arrived"
    );
    assert!(actions(&mut c).is_empty());
    c.handle_timeout(t0 + CLOSE);
    assert!(c.close_timed_out());
}

#[test]
fn a_close_ends_delivered_timed_out_or_failed() {
    let t0 = Instant::now();
    let linked = || core(Credits::new(4, 3, 4, 3, 4), 16);
    let mut c = linked();
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.posted(9, true);
    assert!(c.close_result(CLOSE).is_none(), "under way");
    assert_eq!(c.time_to_next(t0), Some(CLOSE));
    c.handle_send(&send_ok(), 9);
    assert!(matches!(c.close_result(CLOSE), Some(Ok(()))));

    let mut c = linked();
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.handle_timeout(t0 + CLOSE);
    assert!(
        matches!(c.close_result(CLOSE), Some(Err(Error::Timeout(t))) if t.after == CLOSE && t.op == "closing")
    );

    let mut c = linked();
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.handle_failure(Failure::PeerVanished);
    assert!(matches!(
        c.close_result(CLOSE),
        Some(Err(Error::Connection(Failure::PeerVanished)))
    ));
}

#[test]
fn a_refused_send_wants_any_completion_until_one_goes() {
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    assert!(!c.wants_any_completion());
    c.send_waits(true);
    assert!(c.wants_any_completion());
    c.send_waits(false);
    assert!(!c.wants_any_completion());
    c.send_waits(true);
    c.handle_failure(Failure::QpError);
    assert!(!c.wants_any_completion(), "nothing to wait for once failed");
}

#[test]
fn a_credit_stall_counts_once_however_many_sends_it_refused() {
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    while c.data(false, ROOM).is_some() {}
    assert_eq!(c.credits().available(), 0);
    assert!(c.send_waited(), "the stall begins");
    // A bounded send refused, retried by an event loop, refused again.
    assert!(!c.send_waits(true));
    assert!(!c.send_waited(), "the same stall");
    assert!(!c.send_waits(true));
    assert!(c.send_waits(false), "a send goes: the stall ends");
    assert!(!c.send_waits(false), "once");
    assert!(c.send_waited(), "a new stall");
    let s = c.stats();
    assert_eq!((s.credit_stalls, s.credit_waits), (2, 3));
}

#[test]
fn a_close_past_its_deadline_is_closed_and_says_it_timed_out() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.handle_timeout(t0 + CLOSE / 2);
    assert_eq!(c.failure(), None);
    c.handle_timeout(t0 + CLOSE);
    // Not `Closed`: a hub's `Disconnected` says the close was not taken in time.
    assert_eq!(c.failure(), Some(Failure::CloseTimedOut));
    assert!(c.close_timed_out());
    assert_eq!(actions(&mut c), [Command::FailQueuePair]);
}

#[test]
fn a_goodbye_gives_the_close_message_until_the_close_timeout() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_stream(StreamNews::Goodbye, t0);
    assert_eq!(actions(&mut c), [Command::UnwatchStream]);
    assert_eq!(c.next_timeout(), Some(t0 + CLOSE));
    // The close message arrives in time.
    assert_eq!(
        c.handle_recv(&recv(CLOSE_MSG), || None, Instant::now)
            .action,
        RecvAction::Recycle
    );
    assert_eq!(c.failure(), Some(Failure::PeerClosed));
    assert_eq!(c.next_timeout(), None, "the vanish deadline is gone");
}

#[test]
fn a_close_message_before_the_goodbye_keeps_the_queue_pair_until_the_goodbye() {
    // rxe completes a receive before it acknowledges it: a queue pair moved to the error
    // state at once could lose the acknowledgement, and the closing peer would retry its
    // close message until its close timed out.
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_recv(&recv(CLOSE_MSG), || None, || t0);
    assert_eq!(
        c.failure(),
        Some(Failure::PeerClosed),
        "the user hears at once"
    );
    assert!(actions(&mut c).is_empty(), "the queue pair stays up");
    assert_eq!(
        c.next_timeout(),
        Some(t0 + CLOSE),
        "at most the close timeout"
    );
    c.handle_stream(StreamNews::Goodbye, t0);
    assert_eq!(
        actions(&mut c),
        [Command::UnwatchStream, Command::FailQueuePair]
    );
    assert_eq!(c.next_timeout(), None);

    // No goodbye: failed at the close timeout.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_recv(&recv(CLOSE_MSG), || None, || t0);
    c.handle_timeout(t0 + CLOSE);
    assert_eq!(actions(&mut c), [Command::FailQueuePair]);
    assert_eq!(c.failure(), Some(Failure::PeerClosed));
}

#[test]
fn both_closing_at_once_each_says_goodbye_when_its_close_completes() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.start_close(c.close_deadline(t0), t0).unwrap();
    c.posted(7, true);
    // The peer's close arrives first: we linger for its goodbye...
    c.handle_recv(&recv(CLOSE_MSG), || None, || t0);
    assert_eq!(c.failure(), Some(Failure::PeerClosed));
    assert!(c.lingering());
    // ...and our own close completing still says ours, which it lingers for.
    c.handle_send(&send_ok(), 7);
    assert_eq!(actions(&mut c), [Command::SayGoodbye]);
    // A real failure meanwhile ends the linger at once.
    c.handle_failure(Failure::QpError);
    assert!(!c.lingering());
    assert_eq!(actions(&mut c), [Command::FailQueuePair]);
}

#[test]
fn an_ended_stream_gives_the_close_message_50_ms_then_the_peer_vanished() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_stream(StreamNews::Ended, t0);
    assert_eq!(c.next_timeout(), Some(t0 + Duration::from_millis(50)));
    assert!(c.may_send(ROOM), "a leaving peer's credits are still good");
    c.handle_timeout(t0 + Duration::from_millis(50));
    assert_eq!(c.failure(), Some(Failure::PeerVanished));
}

#[test]
fn while_closing_an_ended_stream_gives_our_close_50_ms_then_the_peer_vanished() {
    let t0 = Instant::now();
    let grace = Duration::from_millis(50);
    let closing = |at: Instant| {
        let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
        c.start_close(c.close_deadline(at), at).unwrap();
        c.posted(9, true);
        c
    };
    // A peer that took our close and dropped its side at once: the completion comes within
    // the grace, and the close is a close.
    let mut c = closing(t0);
    c.handle_stream(StreamNews::Ended, t0);
    assert_eq!(actions(&mut c), [Command::UnwatchStream]);
    assert_eq!(c.failure(), None);
    assert_eq!(c.next_timeout(), Some(t0 + grace));
    c.handle_send(&send_ok(), 9);
    assert!(matches!(c.close_result(CLOSE), Some(Ok(()))));
    assert_eq!(c.next_timeout(), None);

    // A peer that died while we waited: nothing acknowledges our close (rxe retries it for
    // ever), and the close ends at the grace as the peer vanished, not at the close timeout.
    let mut c = closing(t0);
    let ended = t0 + Duration::from_millis(300);
    c.handle_stream(StreamNews::Ended, ended);
    c.handle_timeout(ended + grace - Duration::from_millis(1));
    assert!(c.close_result(CLOSE).is_none(), "still in the grace");
    c.handle_timeout(ended + grace);
    assert!(matches!(
        c.close_result(CLOSE),
        Some(Err(Error::Connection(Failure::PeerVanished)))
    ));
    assert!(!c.close_timed_out());
    assert_eq!(
        actions(&mut c),
        [Command::UnwatchStream, Command::FailQueuePair]
    );

    // A peer that died before the close began (its stream's end already seen): the close
    // keeps the deadline the end set.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_stream(StreamNews::Ended, t0);
    let at = t0 + Duration::from_millis(10);
    let post = c.start_close(c.close_deadline(at), at);
    assert!(post.is_some(), "a leaving peer's credits are still good");
    assert_eq!(c.next_timeout(), Some(t0 + grace));
    c.handle_timeout(t0 + grace);
    assert_eq!(c.failure(), Some(Failure::PeerVanished));

    // A goodbye (the peer closing too, its close message on its way): the close deadline
    // still decides.
    let mut c = closing(t0);
    c.handle_stream(StreamNews::Goodbye, t0 + Duration::from_millis(10));
    assert_eq!(c.next_timeout(), Some(t0 + CLOSE));
    c.handle_timeout(t0 + CLOSE);
    assert_eq!(c.failure(), Some(Failure::CloseTimedOut));
}

#[test]
fn junk_on_the_stream_fails_at_once() {
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_stream(StreamNews::Garbage(7), Instant::now());
    assert_eq!(
        actions(&mut c),
        [Command::UnwatchStream, Command::FailQueuePair]
    );
    assert_eq!(c.failure(), Some(Failure::BootstrapGarbage { byte: 7 }));
}

#[test]
fn the_drain_ends_when_nothing_is_posted_or_at_its_deadline() {
    let t0 = Instant::now();
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_failure(Failure::QpError);
    c.flushing_since(t0);
    c.handle_flushed(3, Instant::now());
    assert!(!c.is_drained());
    c.handle_timeout(t0 + FLUSH_WAIT);
    assert!(c.is_drained());

    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_failure(Failure::QpError);
    c.flushing_since(t0);
    c.handle_flushed(0, Instant::now());
    assert!(c.is_drained());
    assert_eq!(c.next_timeout(), None);
}

#[test]
fn a_handshaking_core_sends_nothing_until_linked_and_takes_the_real_books_once() {
    let placeholder = Credits::shared(64, 3, 0, 3, 0, 4);
    let mut c = Core::handshaking(placeholder, 16, CLOSE);
    assert!(!c.is_linked());
    assert!(c.data(false, ROOM).is_none());
    c.learn_peer(Credits::shared(64, 3, 8, 3, 8, 4));
    c.learn_peer(Credits::shared(64, 3, 1, 3, 1, 4));
    assert_eq!(c.credits().available(), 8, "the first books stay");
    assert!(c.data(false, ROOM).is_none(), "not linked yet");
    c.handshake_done();
    assert!(c.data(false, ROOM).is_none(), "its grant slots sleep");
    c.credits_mut().want_slots();
    c.credits_mut().on_reposted(3);
    assert!(c.data(false, ROOM).is_some());
}

#[test]
fn a_read_longer_than_the_send_queue_is_refused_typed() {
    let c = core(Credits::new(4, 3, 4, 3, 4), 16);
    assert!(c.read_fits(4, 4).is_ok());
    let e = c.read_fits(5, 4).unwrap_err();
    assert!(matches!(
        e,
        Error::ReadTooLarge {
            segments: 5,
            send_slots: 4
        }
    ));
    assert!(e.to_string().contains("raise send_depth"), "{e}");
}

#[test]
fn a_streaming_sender_polls_every_few_sends_and_when_anything_runs_low() {
    let mut c = core(Credits::new(64, 3, 64, 3, 64), 16);
    let polls: Vec<bool> = (0..SEND_PROGRESS_EVERY)
        .map(|_| c.poll_before_send(ROOM))
        .collect();
    assert_eq!(polls.iter().filter(|&&p| p).count(), 1);
    assert!(polls[SEND_PROGRESS_EVERY as usize - 1]);
    assert!(c.poll_before_send(Room { sq: 1, ..ROOM }));
}

impl Imm {
    fn default_data() -> Self {
        Imm {
            credits: 0,
            echo: 0,
            flags: 0,
        }
    }
}

#[test]
fn a_queue_pair_on_a_shared_receive_queue_waits_briefly_for_its_last_wqe() {
    let t0 = Instant::now();
    let failed = || {
        let mut c = core(Credits::new(4, 3, 4, 3, 4), 16).on_shared_receive_queue();
        c.handle_failure(Failure::QpError);
        c.flushing_since(t0);
        c
    };
    // The event comes: drained as soon as its requests are back.
    let mut c = failed();
    c.handle_flushed(0, t0);
    assert!(!c.is_drained(), "waits for the device's word");
    c.last_wqe_reached();
    c.handle_flushed(0, t0);
    assert!(c.is_drained());
    // It never comes (rxe): drained once LAST_WQE_WAIT has passed.
    let mut c = failed();
    c.handle_flushed(0, t0);
    assert_eq!(c.next_timeout(), Some(t0 + LAST_WQE_WAIT));
    c.handle_timeout(t0 + LAST_WQE_WAIT);
    assert!(c.is_drained());
    // A queue pair with receives of its own does not wait.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.handle_failure(Failure::QpError);
    c.handle_flushed(0, t0);
    assert!(c.is_drained());
}

#[test]
fn a_queue_half_unsignaled_always_has_room_for_one_operation() {
    use crate::core::{max_in_one_go, unsignaled_in_queue};
    for depth in 1..=256 {
        // With no signaled send outstanding, the unsignaled ones hold at most this many slots,
        // and what is left fits the largest operation allowed.
        assert!(
            unsignaled_in_queue(depth) + max_in_one_go(depth) <= depth.max(1),
            "{depth}"
        );
    }
}

#[test]
fn a_silent_peer_is_probed_once_per_interval_and_never_twice_at_once() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.probe_every(s, t0);
    assert_eq!(c.next_timeout(), Some(t0 + s));
    // Traffic in the first interval: no probe, the next interval begins.
    c.begin_batch([send_ok()]);
    c.handle_send(&send_ok(), 1);
    c.handle_timeout(t0 + s);
    assert_eq!(actions(&mut c), []);
    assert_eq!(c.next_timeout(), Some(t0 + 2 * s));
    // A silent interval: one probe, signaled (the send queue is armed for it).
    c.handle_timeout(t0 + 2 * s);
    assert_eq!(actions(&mut c), [Command::Probe]);
    c.probe_posted(5);
    assert_eq!(c.send_arm(), ArmMode::Next);
    // Answered within the interval: the peer lives, and the interval after its answer is
    // quiet again.
    let answer = Completion {
        wr_id: 5,
        ..send_ok()
    };
    c.begin_batch([answer]);
    c.handle_send(&answer, 5);
    assert_eq!(c.failure(), None);
    assert_eq!(c.send_arm(), ArmMode::SolicitedOnly);
    c.handle_timeout(t0 + 3 * s);
    assert_eq!(actions(&mut c), []);
    c.handle_timeout(t0 + 4 * s);
    assert_eq!(actions(&mut c), [Command::Probe]);
    c.probe_posted(6);
    c.handle_send(
        &Completion {
            wr_id: 6,
            ..send_ok()
        },
        6,
    );
    c.handle_timeout(t0 + 5 * s);
    assert_eq!(actions(&mut c), []);
    // A receive is a sign of life too.
    c.handle_recv(&recv(Imm::default_data()), || None, || t0);
    c.handle_timeout(t0 + 6 * s);
    assert_eq!(actions(&mut c), []);
    // Closing, nothing is probed and the interval is not renewed.
    c.start_close(c.close_deadline(t0 + 6 * s), t0 + 6 * s)
        .unwrap();
    c.handle_timeout(t0 + 7 * s);
    assert_eq!(actions(&mut c), []);
}

#[test]
fn a_probe_still_unanswered_an_interval_later_is_the_peer_vanished() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.probe_every(s, t0);
    c.handle_timeout(t0 + s);
    assert_eq!(actions(&mut c), [Command::Probe]);
    c.probe_posted(3);
    c.handle_timeout(t0 + 2 * s);
    assert_eq!(c.failure(), Some(Failure::PeerVanished));
    assert_eq!(actions(&mut c), [Command::FailQueuePair]);

    // No room for the probe and nothing signaled out: nothing to judge by, it is asked again.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.probe_every(s, t0);
    c.handle_timeout(t0 + s);
    assert_eq!(actions(&mut c), [Command::Probe]);
    c.handle_timeout(t0 + 2 * s);
    assert_eq!(actions(&mut c), [Command::Probe]);
    assert_eq!(c.failure(), None);
    // A probe behind a read under way (a long one, say) gets six intervals.
    c.posted_read(3);
    c.probe_posted(4);
    for i in 3..7 {
        c.handle_timeout(t0 + i * s);
        assert_eq!(c.failure(), None, "interval {i}");
    }
    c.handle_timeout(t0 + 7 * s);
    assert_eq!(c.failure(), Some(Failure::PeerVanished));
    // No room for the probe behind a full send queue whose last (signaled) send goes
    // unanswered: two intervals, as for a probe.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.probe_every(s, t0);
    c.posted(11, true);
    c.handle_timeout(t0 + s);
    assert_eq!(actions(&mut c), [Command::Probe]);
    assert_eq!(c.failure(), None);
    c.handle_timeout(t0 + 2 * s);
    assert_eq!(c.failure(), Some(Failure::PeerVanished));
}

#[test]
fn an_unanswered_probe_is_the_peer_vanished_and_any_other_send_error_says_itself() {
    let retry = |wr_id| Completion {
        status: WcStatus::RetryExcErr,
        wr_id,
        ..send_ok()
    };
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.probe_every(Duration::from_secs(1), Instant::now());
    c.probe_posted(9);
    c.begin_batch([retry(9)]);
    c.handle_send(&retry(9), 9);
    assert_eq!(c.failure(), Some(Failure::PeerVanished));
    assert_eq!(actions(&mut c), [Command::FailQueuePair]);

    // A send of ours that exhausted its retries, ahead of the probe: that is what failed.
    let mut c = core(Credits::new(4, 3, 4, 3, 4), 16);
    c.probe_posted(9);
    c.begin_batch([retry(8), retry(9)]);
    assert!(matches!(
        c.failure(),
        Some(Failure::Completion {
            status: WcStatus::RetryExcErr,
            ..
        })
    ));
}
