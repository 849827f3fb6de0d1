//! The handshake machine driven byte by byte: every exchange, every rejection, every forgery.

use super::*;

fn hello(qpn: u32) -> Hello {
    Hello {
        version: VERSION,
        addr: QpAddress {
            lid: 0,
            qpn,
            psn: 0xabcdef,
            gid: Gid([7; 16]),
        },
        mtu: 1024,
        buf_size: 4096,
        recv_depth: 64,
        grant_slots: 3,
        initial_credits: 64,
        reads: 16,
        max_read: 64 << 20,
    }
}

fn limits() -> Limits {
    Limits {
        max_buf_size: 1 << 20,
        max_recv_depth: 65_535,
        max_send_memory: 64 << 20,
        send_depth: 64,
    }
}

fn key(b: u8) -> Option<Psk> {
    Some(Psk::new([b; 32]))
}

const CLIENT_QPN: u32 = 0x12;
const SERVER_QPN: u32 = 0x34;

fn client(psk: Option<Psk>, nonce: u8) -> Handshake {
    Handshake::client(hello(CLIENT_QPN), limits(), psk, [nonce; NONCE_LEN])
}

fn server(psk: Option<Psk>, nonce: u8) -> Handshake {
    Handshake::server(hello(0), limits(), psk, [nonce; NONCE_LEN])
}

/// What happened when two machines talked.
#[derive(Debug, Default)]
struct Run {
    client_err: Option<Error>,
    server_err: Option<Error>,
    /// `Connect` actions the server asked for (it allocates only then).
    server_connects: Vec<Action>,
    client_connects: Vec<Action>,
    /// Everything each side sent.
    c2s: Vec<u8>,
    s2c: Vec<u8>,
}

/// Serves one side's action, as a driver would.
fn serve(hs: &mut Handshake, qpn: u32, seen: &mut Vec<Action>) {
    if let Some(a) = hs.poll_action() {
        seen.push(a);
        let mut addr = hello(qpn).addr;
        addr.qpn = qpn;
        hs.local_ready(addr);
    }
}

/// Feeds `side` from `queue` in chunks of at most `chunk` bytes; records its error.
fn pump(side: &mut Handshake, queue: &mut Vec<u8>, chunk: usize, err: &mut Option<Error>) {
    while err.is_none() && side.wanted() > 0 && !queue.is_empty() {
        let n = chunk.min(queue.len());
        match side.feed(&queue[..n]) {
            Ok(used) => {
                queue.drain(..used);
                if used == 0 {
                    break;
                }
            }
            Err(e) => *err = Some(e),
        }
    }
}

/// Drives a client and a server against each other until neither moves, shuttling
/// `chunk` bytes at a time.
fn talk(mut c: Handshake, mut s: Handshake, chunk: usize) -> (Handshake, Handshake, Run) {
    let mut run = Run::default();
    let (mut to_server, mut to_client) = (Vec::new(), Vec::new());
    for _ in 0..10_000 {
        serve(&mut c, CLIENT_QPN, &mut run.client_connects);
        serve(&mut s, SERVER_QPN, &mut run.server_connects);
        let (co, so) = (c.output().to_vec(), s.output().to_vec());
        c.consume_output(co.len());
        s.consume_output(so.len());
        run.c2s.extend_from_slice(&co);
        run.s2c.extend_from_slice(&so);
        to_server.extend_from_slice(&co);
        to_client.extend_from_slice(&so);
        let before = (to_server.len(), to_client.len());
        pump(&mut s, &mut to_server, chunk, &mut run.server_err);
        pump(&mut c, &mut to_client, chunk, &mut run.client_err);
        let idle = co.is_empty()
            && so.is_empty()
            && before == (to_server.len(), to_client.len())
            && c.output().is_empty()
            && s.output().is_empty();
        if idle {
            return (c, s, run);
        }
    }
    panic!("the handshake never went idle");
}

fn assert_connected(c: &Handshake, s: &Handshake, run: &Run) {
    assert!(
        run.client_err.is_none() && run.server_err.is_none(),
        "{run:?}"
    );
    assert!(c.is_done() && s.is_done());
    assert_eq!(c.peer().unwrap().addr.qpn, SERVER_QPN);
    assert_eq!(s.peer().unwrap(), &hello(CLIENT_QPN));
    assert_eq!(run.server_connects.len(), 1);
    assert_eq!(run.client_connects.len(), 1);
    // Nothing after the handshake is taken.
    assert_eq!((c.wanted(), s.wanted()), (0, 0));
}

#[test]
fn connects_without_keys_whole_or_byte_by_byte() {
    for chunk in [usize::MAX, 1, 7] {
        let (c, s, run) = talk(client(None, 1), server(None, 2), chunk);
        assert_connected(&c, &s, &run);
        assert_eq!(
            run.server_connects[0],
            Action::Connect {
                peer: hello(CLIENT_QPN),
                send_buffers: 64
            }
        );
        assert_eq!(
            run.c2s.len(),
            CLIENT_HELLO_LEN + PROOF_LEN + 1,
            "client hello, proof, ready"
        );
        assert_eq!(run.s2c.len(), SERVER_HELLO_LEN + ADDRESS_LEN);
    }
}

#[test]
fn the_right_key_connects() {
    for chunk in [usize::MAX, 1] {
        let (c, s, run) = talk(client(key(9), 1), server(key(9), 2), chunk);
        assert_connected(&c, &s, &run);
    }
}

#[test]
fn a_wrong_key_is_rejected_on_both_sides_before_the_server_allocates() {
    let (c, s, run) = talk(client(key(1), 1), server(key(2), 2), usize::MAX);
    // The client checks the server's MAC first.
    assert!(
        matches!(run.client_err, Some(Error::BadHandshake(Reject::BadKey))),
        "{run:?}"
    );
    assert!(
        matches!(run.server_err, Some(Error::Rejected(Reject::BadKey))),
        "{run:?}"
    );
    assert!(run.server_connects.is_empty() && run.client_connects.is_empty());
    assert!(c.is_failed() && s.is_failed());
}

#[test]
fn a_key_on_one_side_only_is_rejected_on_both_sides() {
    for (ck, sk) in [(key(1), None), (None, key(1))] {
        let (_, _, run) = talk(client(ck, 1), server(sk, 2), usize::MAX);
        assert!(
            matches!(
                run.server_err,
                Some(Error::BadHandshake(Reject::KeyMissing))
            ),
            "{run:?}"
        );
        assert!(
            matches!(run.client_err, Some(Error::Rejected(Reject::KeyMissing))),
            "{run:?}"
        );
        assert!(run.server_connects.is_empty());
    }
}

#[test]
fn a_replayed_client_transcript_does_not_authenticate() {
    let (_, _, recorded) = talk(client(key(5), 1), server(key(5), 2), usize::MAX);
    assert!(recorded.server_err.is_none());
    // The same client bytes to a server with a fresh nonce: the proof no longer matches.
    let mut s = server(key(5), 3);
    let mut input = recorded.c2s.clone();
    let mut err = None;
    pump(&mut s, &mut input, usize::MAX, &mut err);
    assert!(
        matches!(err, Some(Error::BadHandshake(Reject::BadKey))),
        "{err:?}"
    );
    assert!(s.poll_action().is_none(), "nothing allocated");
    assert_eq!(s.output().last(), Some(&Reject::BadKey.code()));
}

#[test]
fn a_replayed_server_transcript_does_not_authenticate() {
    let (_, _, recorded) = talk(client(key(5), 1), server(key(5), 2), usize::MAX);
    let mut c = client(key(5), 4);
    let mut input = recorded.s2c.clone();
    let mut err = None;
    pump(&mut c, &mut input, usize::MAX, &mut err);
    assert!(
        matches!(err, Some(Error::BadHandshake(Reject::BadKey))),
        "{err:?}"
    );
    assert!(c.poll_action().is_none());
}

#[test]
fn a_tampered_server_address_is_caught_by_the_key() {
    let mut c = client(key(5), 1);
    let mut s = server(key(5), 2);
    let mut err = None;
    let mut to_s = c.output().to_vec();
    pump(&mut s, &mut to_s, usize::MAX, &mut err);
    let mut to_c = s.output().to_vec();
    s.consume_output(to_c.len());
    pump(&mut c, &mut to_c, usize::MAX, &mut err);
    let mut to_s = c.output()[CLIENT_HELLO_LEN..].to_vec();
    pump(&mut s, &mut to_s, usize::MAX, &mut err);
    assert!(err.is_none(), "{err:?}");
    assert!(matches!(s.poll_action(), Some(Action::Connect { .. })));
    s.local_ready(hello(SERVER_QPN).addr);
    let mut to_c = s.output().to_vec();
    to_c[3] ^= 1; // the QPN
    pump(&mut c, &mut to_c, usize::MAX, &mut err);
    assert!(
        matches!(err, Some(Error::BadHandshake(Reject::BadKey))),
        "{err:?}"
    );
    assert!(c.poll_action().is_none());
}

#[test]
fn a_hello_beyond_our_limits_is_rejected_before_anything_is_allocated() {
    let mut forged = hello(CLIENT_QPN);
    forged.buf_size = 16 << 20;
    let c = Handshake::client(forged, limits(), None, [1; NONCE_LEN]);
    let (_, s, run) = talk(c, server(None, 2), usize::MAX);
    assert!(
        matches!(
            run.server_err,
            Some(Error::BadHandshake(Reject::Limits("buffer size")))
        ),
        "{run:?}"
    );
    assert!(
        matches!(run.client_err, Some(Error::Rejected(Reject::Limits(_)))),
        "{run:?}"
    );
    assert!(run.server_connects.is_empty() && s.is_failed());
    // The answer: a header with the code, padded to a whole hello.
    assert_eq!(run.s2c.len(), HELLO_LEN);
    assert_eq!(run.s2c[..8], MAGIC);
    assert_eq!(run.s2c[10], b'L');
}

#[test]
fn limits_bound_buffers_depth_and_send_memory() {
    let l = limits();
    let mut h = hello(1);
    assert_eq!(l.check(&h), Ok(64));
    h.buf_size = 1 << 20;
    assert_eq!(l.check(&h), Ok(64), "64 x 1 MiB fits in 64 MiB");
    h.buf_size = (1 << 20) + 1;
    assert_eq!(l.check(&h), Err(Reject::Limits("buffer size")));
    let small = Limits {
        max_send_memory: 4 << 20,
        ..l
    };
    h.buf_size = 1 << 20;
    assert_eq!(
        small.check(&h),
        Ok(4),
        "fewer send buffers, not more memory"
    );
    let tiny = Limits {
        max_send_memory: 1000,
        ..l
    };
    h.buf_size = 4096;
    assert_eq!(tiny.check(&h), Err(Reject::Limits("buffer size")));
    h.recv_depth = 65_536;
    h.initial_credits = 65_536;
    assert_eq!(l.check(&h), Err(Reject::Limits("receive depth")));
}

#[test]
fn garbage_and_other_versions_are_rejected_at_the_header() {
    let mut s = server(None, 2);
    assert_eq!(s.wanted(), HEADER_LEN);
    let err = s.feed(&[b'x'; 100]).unwrap_err();
    assert!(
        matches!(err, Error::BadHandshake(Reject::BadMagic)),
        "{err:?}"
    );
    assert_eq!(s.output().len(), HELLO_LEN);
    assert_eq!(s.output()[10], Reject::BadMagic.code());
    assert_eq!(s.wanted(), 0);

    // A version 1 hello (52 bytes, version at the same place).
    let mut v1 = [0u8; 52];
    v1[..8].copy_from_slice(&MAGIC);
    v1[9] = 1;
    let mut s = server(None, 2);
    let err = s.feed(&v1).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadHandshake(Reject::Version {
                peer: 1,
                ours: VERSION
            })
        ),
        "{err:?}"
    );
    // What a version 1 client reads first: 52 bytes whose version is ours.
    assert_eq!(&s.output()[8..10], &VERSION.to_be_bytes());

    // A version 1 server writes its hello first: the client sees the version.
    let mut c = client(None, 1);
    let err = c.feed(&v1).unwrap_err();
    assert!(
        matches!(err, Error::BadHandshake(Reject::Version { peer: 1, .. })),
        "{err:?}"
    );
}

#[test]
fn out_of_range_values_and_mtu_mismatches_are_rejected() {
    type Breaker = fn(&mut Hello);
    let cases: [(Breaker, Reject); 8] = [
        (|h| h.mtu = 1000, Reject::BadValue("MTU")),
        (|h| h.reads = 0, Reject::BadValue("reads served")),
        (|h| h.buf_size = 8, Reject::BadValue("buffer size")),
        (|h| h.recv_depth = 0, Reject::BadValue("receive depth")),
        (|h| h.grant_slots = 1, Reject::BadValue("grant slots")),
        (
            |h| h.initial_credits = 65,
            Reject::BadValue("initial credits"),
        ),
        (
            |h| h.addr.psn = 0x100_0000,
            Reject::BadValue("queue pair number or PSN"),
        ),
        (|h| h.mtu = 4096, Reject::Mtu),
    ];
    for (break_it, why) in cases {
        let mut h = hello(CLIENT_QPN);
        break_it(&mut h);
        let c = Handshake::client(h, limits(), None, [1; NONCE_LEN]);
        let (_, _, run) = talk(c, server(None, 2), usize::MAX);
        assert!(
            matches!(run.server_err, Some(Error::BadHandshake(r)) if r == why),
            "{why:?}: {run:?}"
        );
        assert!(
            matches!(run.client_err, Some(Error::Rejected(r)) if r.code() == why.code()),
            "{why:?}: {run:?}"
        );
    }
}

#[test]
fn a_side_that_cannot_set_up_tells_the_other() {
    let mut c = client(None, 1);
    let mut s = server(None, 2);
    let (mut err_c, mut err_s) = (None, None);
    let mut q = c.output().to_vec();
    pump(&mut s, &mut q, usize::MAX, &mut err_s);
    let mut q = s.output().to_vec();
    s.consume_output(q.len());
    pump(&mut c, &mut q, usize::MAX, &mut err_c);
    let mut q = c.output()[CLIENT_HELLO_LEN..].to_vec();
    pump(&mut s, &mut q, usize::MAX, &mut err_s);
    assert!(s.poll_action().is_some());
    s.abort(Reject::Resources);
    let mut q = s.output().to_vec();
    pump(&mut c, &mut q, usize::MAX, &mut err_c);
    assert!(
        matches!(err_c, Some(Error::Rejected(Reject::Resources))),
        "{err_c:?}"
    );
}

#[test]
fn verdict_codes_round_trip() {
    assert_eq!(Reject::from_code(ACCEPT), None);
    for r in [
        Reject::BadMagic,
        Reject::Mtu,
        Reject::KeyMissing,
        Reject::BadKey,
        Reject::Resources,
    ] {
        assert_eq!(Reject::from_code(r.code()), Some(r));
    }
    assert_eq!(
        Reject::from_code(Reject::Limits("buffer size").code()),
        Some(Reject::Limits("request"))
    );
    assert_eq!(Reject::from_code(b'z'), Some(Reject::Unknown(b'z')));
    let codes = [b'M', b'V', b'B', b'T', b'L', b'K', b'P', b'E'];
    for c in codes {
        assert!(![ACCEPT, READY, GOODBYE, CLIENT_HELLO].contains(&c));
    }
}

#[test]
fn a_key_does_not_print_its_bytes() {
    let k = Psk::new(b"very secret key bytes");
    let shown = format!("{k:?}");
    assert!(!shown.contains("secret"), "{shown}");
    assert!(shown.contains("21 bytes"), "{shown}");
    let hs = Handshake::client(hello(1), limits(), Some(k), [0; NONCE_LEN]);
    assert!(!format!("{hs:?}").contains("secret"));
}

#[test]
fn the_reads_served_and_the_largest_read_travel_both_ways() {
    let mut ours = hello(CLIENT_QPN);
    ours.reads = 4;
    ours.max_read = 123_456;
    let bytes = ours.encode(CLIENT_HELLO, 0);
    let back = Hello::decode_body(VERSION, &bytes[HEADER_LEN..]).unwrap();
    assert_eq!((back.reads, back.max_read), (4, 123_456));
    assert_eq!(back, ours);
}

fn resumable_client(psk: Option<Psk>, session: Resumption) -> Handshake {
    Handshake::client_with(hello(CLIENT_QPN), limits(), psk, [1; NONCE_LEN], session)
}

#[test]
fn a_session_is_resumable_only_if_both_sides_agree() {
    let token = [9; TOKEN_LEN];
    // Offered and agreed: both know it, the server knows the token.
    let (c, s, run) = talk(
        resumable_client(key(3), Resumption::Offer(token)),
        server(key(3), 2).resuming(true),
        7,
    );
    assert_connected(&c, &s, &run);
    assert!(c.resumable() && s.resumable());
    assert_eq!(s.session(), Resumption::Offer(token));
    // Offered, but the server resumes nothing: a plain connection on both sides.
    let (c, s, run) = talk(
        resumable_client(None, Resumption::Offer(token)),
        server(None, 2),
        usize::MAX,
    );
    assert_connected(&c, &s, &run);
    assert!(!c.resumable() && !s.resumable());
    // Not offered: not resumable, whatever the server does.
    let (c, s, run) = talk(client(None, 1), server(None, 2).resuming(true), usize::MAX);
    assert_connected(&c, &s, &run);
    assert!(!c.resumable() && !s.resumable());
    assert_eq!(s.session(), Resumption::Off);
}

#[test]
fn a_resume_to_a_server_that_resumes_nothing_is_refused_on_both_sides() {
    let (_, s, run) = talk(
        resumable_client(None, Resumption::Resume([4; TOKEN_LEN])),
        server(None, 2),
        usize::MAX,
    );
    assert!(
        matches!(
            run.client_err,
            Some(Error::BadHandshake(Reject::UnknownSession))
        ),
        "{run:?}"
    );
    assert!(
        matches!(
            run.server_err,
            Some(Error::Rejected(Reject::UnknownSession))
        ),
        "{run:?}"
    );
    assert!(run.server_connects.is_empty(), "nothing set up for it");
    assert!(!s.is_done());
    assert_eq!(
        Reject::from_code(Reject::UnknownSession.code()),
        Some(Reject::UnknownSession)
    );
}

#[test]
fn the_key_covers_the_session_token() {
    // A token changed on the way (a stranger presenting another session's token in a
    // recorded hello) breaks the server's MAC: the client refuses the server.
    let mut c = resumable_client(key(5), Resumption::Resume([4; TOKEN_LEN]));
    let mut s = server(key(5), 2).resuming(true);
    let mut err = None;
    let mut to_s = c.output().to_vec();
    to_s[CLIENT_HELLO_LEN - 1] ^= 1;
    pump(&mut s, &mut to_s, usize::MAX, &mut err);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        s.session(),
        Resumption::Resume({
            let mut t = [4; TOKEN_LEN];
            t[TOKEN_LEN - 1] ^= 1;
            t
        })
    );
    let mut to_c = s.output().to_vec();
    pump(&mut c, &mut to_c, usize::MAX, &mut err);
    assert!(
        matches!(err, Some(Error::BadHandshake(Reject::BadKey))),
        "{err:?}"
    );
}

#[test]
fn a_malformed_session_field_is_rejected() {
    let c = resumable_client(None, Resumption::Off);
    let mut bytes = c.output().to_vec();
    bytes[HELLO_LEN + NONCE_LEN] = 7;
    let mut s = server(None, 2);
    let mut err = None;
    pump(&mut s, &mut bytes, usize::MAX, &mut err);
    assert!(
        matches!(
            err,
            Some(Error::BadHandshake(Reject::BadValue("session field")))
        ),
        "{err:?}"
    );
}
