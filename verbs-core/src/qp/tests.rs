//! Unit tests of the posting bookkeeping and the attribute defaults.

use super::*;
use crate::device::Mtu;

#[derive(Debug)]
struct Node {
    next: *mut Node,
}

#[test]
fn link_builds_a_null_terminated_list() {
    let mut v: Vec<Node> = (0..3)
        .map(|_| Node {
            next: std::ptr::null_mut(),
        })
        .collect();
    let head = link(&mut v, |n, next| n.next = next);
    let base = v.as_ptr();
    assert_eq!(head as *const Node, base, "the head is the first request");
    assert_eq!(v[0].next as *const Node, base.wrapping_add(1));
    assert_eq!(v[1].next as *const Node, base.wrapping_add(2));
    assert!(v[2].next.is_null());
}

#[test]
fn failed_index_locates_the_bad_request() {
    let mut v = vec![0u64; 4];
    let base = v.as_mut_ptr();
    assert_eq!(failed_index(&v, base.wrapping_add(2)), 2);
    assert_eq!(failed_index(&v, base), 0);
    assert_eq!(failed_index(&v, base.wrapping_add(3)), 3);
    // Pointers at no request fail closed: every request counts as posted, so that no buffer
    // the device may access is handed back.
    assert_eq!(failed_index(&v, std::ptr::null_mut()), 4);
    assert_eq!(failed_index(&v, base.wrapping_add(4)), 4);
    assert_eq!(failed_index(&v, base.wrapping_sub(1)), 4);
    assert_eq!(
        failed_index(&v, base.cast::<u8>().wrapping_add(3).cast()),
        4
    );
    assert_eq!(failed_index(&v, usize::MAX as *mut u64), 4);
    assert_eq!(failed_index(&v[..0], base), 0);
}

#[test]
fn wr_ids_are_never_zero_and_never_drawn_twice() {
    let a = draw_wr_ids(3);
    let b = draw_wr_ids(1);
    let c = draw_wr_ids(2);
    assert!(a >= 1);
    assert!(b >= a + 3 && c > b, "{a} {b} {c}");
    // From other threads too.
    let mut ids: Vec<u64> = (0..4)
        .map(|_| std::thread::spawn(|| (0..1000).map(|_| draw_wr_ids(1)).collect::<Vec<_>>()))
        .flat_map(|t| t.join().unwrap())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 4000);
}

fn posted(recv: &[u64], send: &[(u64, Option<&'static str>)]) -> Posted<&'static str> {
    let mut p = Posted::with_capacity(4, 4);
    for &id in recv {
        p.recv.push(id, "recv");
    }
    p.send.extend(send.iter().map(|&(id, b)| (id, b, false)));
    p
}

#[test]
fn a_completion_tells_read_buffers_from_send_buffers() {
    let mut p = posted(&[], &[(1, Some("send")), (2, None)]);
    p.send.push_back((3, None, true));
    p.send.push_back((4, Some("read"), true));
    p.send.push_back((5, Some("later"), false));
    let (mut sends, mut reads) = (Vec::new(), Vec::new());
    assert!(!p.complete_split(9, &mut sends, &mut reads), "not held");
    assert!(p.complete_split(4, &mut sends, &mut reads));
    assert_eq!((sends, reads), (vec!["send"], vec![(4, "read")]));
    assert_eq!(p.send.len(), 1, "the later send stays");
}

#[test]
fn a_receive_buffer_comes_back_once() {
    let mut p = posted(&[5, 6], &[]);
    assert_eq!(p.take_recv(5), Some("recv"));
    assert_eq!(p.take_recv(5), None, "a replayed completion gets nothing");
    assert_eq!(p.take_recv(0), None, "a default completion gets nothing");
    assert_eq!(p.recv.len(), 1);
}

#[test]
fn a_send_completion_retires_only_an_exact_posted_send_and_those_before_it() {
    let mut p = posted(
        &[],
        &[(3, Some("a")), (7, None), (9, Some("b")), (12, Some("c"))],
    );
    let mut out = Vec::new();
    for absent in [0, 1, 8, 10, 13, u64::MAX] {
        assert!(!p.complete_send(absent, &mut out), "{absent}");
    }
    assert_eq!((out.len(), p.send.len()), (0, 4), "nothing retired");
    assert!(p.complete_send(7, &mut out));
    assert_eq!(out, ["a"], "7 and the request before it");
    assert!(!p.complete_send(3, &mut out), "already retired");
    assert!(!p.complete_send(7, &mut out), "a replay retires nothing");
    assert!(p.complete_send(12, &mut out));
    assert_eq!(out, ["a", "b", "c"]);
    assert!(p.send.is_empty());
}

#[test]
fn receive_ids_never_retire_sends_and_send_ids_never_yield_receives() {
    // Ids are drawn from one counter, so a receive id lies between send ids.
    let mut p = posted(
        &[4, 8],
        &[(2, Some("s2")), (6, Some("s6")), (10, Some("s10"))],
    );
    let mut out = Vec::new();
    assert!(!p.complete_send(4, &mut out));
    assert!(!p.complete_send(8, &mut out));
    assert_eq!(p.send.len(), 3);
    assert_eq!(p.take_recv(6), None);
    assert_eq!(p.take_recv(2), None);
    assert_eq!(p.recv.len(), 2);
}

#[test]
fn receives_come_back_in_any_order_from_many_sequential_and_scattered_ids() {
    let mut p: Posted<u64> = Posted::with_capacity(0, 0);
    let ids: Vec<u64> = (1..5000u64)
        .chain((13..64).map(|i| 1u64 << i))
        .chain([u64::MAX - 1, u64::MAX])
        .collect();
    for &id in &ids {
        p.recv.push(id, id);
    }
    // In order (the usual case), then out of order, then the rest in reverse.
    for &id in &ids[..100] {
        assert_eq!(p.take_recv(id), Some(id));
    }
    for &id in ids[100..].iter().step_by(3) {
        assert_eq!(p.take_recv(id), Some(id));
        assert_eq!(p.take_recv(id), None, "once");
    }
    for &id in ids[100..].iter().rev() {
        let _ = p.take_recv(id);
    }
    assert_eq!(p.recv.len(), 0);
    assert!(p.recv.is_clear(), "handed-back entries do not pile up");
}

#[test]
fn shared_receives_come_back_once_in_any_order_whatever_else_was_drawn_between() {
    // An SRQ's requests are consumed by several QPs, so their completions arrive in any
    // order; other queues draw ids in between.
    let mut srq: InOrder<u64> = InOrder::with_capacity(0);
    let mut ids = Vec::new();
    for _ in 0..6 {
        let id = draw_wr_ids(1);
        srq.push(id, id);
        ids.push(id);
        let _other_queue = draw_wr_ids(2);
    }
    for &i in &[3, 0, 5, 1, 4, 2] {
        assert_eq!(srq.take(ids[i]), Some(ids[i]));
        assert_eq!(srq.take(ids[i]), None, "once");
        assert_eq!(srq.take(ids[i] + 1), None, "another queue's id");
    }
    assert_eq!(srq.take(0), None, "a default completion");
    assert_eq!(srq.len(), 0);
    assert!(srq.is_clear());
}

#[test]
fn a_post_error_prints_the_verb_why_and_what_was_posted() {
    let os = std::io::Error::from_raw_os_error(libc::ENOMEM);
    let e = PostError {
        error: Error::PostSend {
            qp_num: 0x11,
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        },
        unposted: Vec::new(),
        posted: 2,
    };
    let first =
        "ibv_post_send on QP 0x11 failed (ENOMEM); 2 work requests posted before it, 0 buffers handed back";
    assert_eq!(e.to_string(), first);
    // The chain as anyhow's `{:#}` prints it names the OS error once.
    let source = std::error::Error::source(&e).unwrap();
    assert_eq!(source.to_string(), os.to_string());
    assert!(source.source().is_none());
}

#[test]
fn attribute_defaults_are_the_documented_ones() {
    let remote = RemoteAddress {
        lid: 0,
        gid: None,
        sgid_index: 0,
        sl: 0,
        port: 1,
    };
    let rtr = RtrAttr::new(7, 1, Mtu::Mtu1024, remote);
    assert_eq!((rtr.min_rnr_timer, rtr.max_dest_rd_atomic), (12, 1));
    let rts = RtsAttr::new(1);
    assert_eq!((rts.timeout, rts.retry_cnt, rts.rnr_retry), (14, 7, 7));
    let req = SendRequest::empty().solicited(true).signaled(false).imm(3);
    assert!(req.solicited && !req.signaled && req.imm == Some(3));
}
