use serde::{Deserialize, Serialize};

use super::*;
use crate::bulk::Piece;
use crate::codec::{self, FrameBytes};
use crate::Bulk;

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Get {
    key: String,
}
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Value {
    data: Bulk,
}
#[derive(Debug, Serialize, Deserialize)]
struct Other;
crate::message!(Value);
crate::message!(Other);
crate::request!(Get => Value);

/// `m` as the decoder hands it out, from one frame.
fn received<M: Message>(m: &M, decoder: &mut Decoder) -> Result<Envelope> {
    let mut frame = vec![0; 1 << 20];
    let n = codec::encode_single(m, 0, &mut frame)?.expect("fits");
    frame.truncate(n);
    Ok(decoder
        .push(FrameBytes::Owned(frame))?
        .expect("one whole frame"))
}

fn deliver(env: Envelope, calls: &Calls, replies: &Arc<Replies>, d: &Decoder) -> Option<Envelope> {
    match route(env, None, calls, replies, d).unwrap() {
        Routed::Deliver(e) => Some(e),
        Routed::Consumed => None,
    }
}

#[test]
fn a_request_arrives_as_its_own_type_and_its_answer_reaches_its_call() {
    let (client, server) = (Calls::default(), Calls::default());
    let replies = Replies::new(None);
    let mut decoder = Decoder::new(1 << 20);
    decoder.register::<Get>().unwrap();
    let id = lock(&client).start::<Get>(None);
    let call: Call<Value> = Call::new(id, client.clone(), "Get", Duration::from_secs(1), None);
    let get = Get { key: "k".into() };
    let out = CallOut {
        id,
        deadline: None,
        m: &get,
    };
    let env = received(&out, &mut decoder).unwrap();
    let mut env = deliver(env, &server, &replies, &decoder).expect("for the application");
    assert!(env.is::<Get>() && env.is_request());
    assert_eq!(env.decode::<Get>().unwrap(), get);
    let responder = env.responder::<Get>().unwrap();
    assert!(matches!(
        env.responder::<Get>(),
        Err(Error::NotARequest { .. })
    ));
    assert_eq!(responder.call_id(), id);
    // The answer as it goes: large enough to be shared, not copied.
    let data = Bulk::new(vec![7u8; 8192]);
    let out = ReplyOut {
        id,
        status: ANSWERED,
        value: Some(&Value { data: data.clone() }),
    };
    let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
    assert!(deliver(answer, &client, &replies, &decoder).is_none());
    assert!(call.is_done());
    let Some(Outcome::Answer(mut env)) = call.take_outcome() else {
        panic!("answered")
    };
    let got: Value = env.decode_shared().unwrap();
    assert_eq!(got.data, data);
    let body = env.body().as_ptr_range();
    assert!(
        body.contains(&got.data.as_ptr()),
        "the payload shares the received bytes"
    );
    assert_eq!(lock(&client).stats().answered, 1);
    // A second answer to the same call is late.
    let again = received(&out, &mut Decoder::new(1 << 20)).unwrap();
    assert!(deliver(again, &client, &replies, &decoder).is_none());
    assert_eq!(lock(&client).stats().late, 1);
    drop(responder);
    let queued = replies.take();
    assert_eq!(
        queued.len(),
        1,
        "a responder dropped unanswered answers 'no answer'"
    );
}

#[test]
fn a_request_of_a_type_not_served_is_refused_at_once() {
    let (calls, replies) = (Calls::default(), Replies::new(None));
    let mut decoder = Decoder::new(1 << 20);
    decoder.register::<Other>().unwrap();
    let get = Get { key: "k".into() };
    let out = CallOut {
        id: 5,
        deadline: None,
        m: &get,
    };
    let env = received(&out, &mut decoder).unwrap();
    assert!(deliver(env, &calls, &replies, &decoder).is_none());
    assert_eq!(replies.take().len(), 1, "answered NOT_SERVED");
    // ... which the caller sees as NotServed.
    let client = Calls::default();
    let id = lock(&client).start::<Get>(None);
    let call: Call<Value> = Call::new(id, client.clone(), "Get", Duration::from_secs(1), None);
    let out = ReplyOut::<()> {
        id,
        status: NOT_SERVED,
        value: None,
    };
    let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
    assert!(deliver(answer, &client, &replies, &decoder).is_none());
    let err = finish::<Value>(call.take_outcome().unwrap()).unwrap_err();
    assert!(matches!(err, Error::NotServed { .. }), "{err}");
}

#[test]
fn forged_call_frames_are_bad_frames() {
    let (calls, replies) = (Calls::default(), Replies::new(None));
    let decoder = Decoder::new(1 << 20);
    let bad = |m: &dyn Fn(&mut Decoder) -> Envelope| {
        let env = m(&mut Decoder::new(1 << 20));
        let r = route(env, None, &calls, &replies, &decoder);
        matches!(r, Err(Error::BadCall { .. }))
    };
    // A request posing as one of the library's own tags.
    let inner = CallOut {
        id: 1,
        deadline: None,
        m: &ReplyOut::<()> {
            id: 1,
            status: 0,
            value: None,
        },
    };
    assert!(bad(&|d| received(&inner, d).unwrap()));
    // An answer of an unknown status.
    let status = ReplyOut::<()> {
        id: 1,
        status: 9,
        value: None,
    };
    assert!(bad(&|d| received(&status, d).unwrap()));
    // Headers that do not decode.
    #[derive(Serialize)]
    struct Junk(u8);
    impl Message for Junk {
        const TAG: u32 = CALL_TAG;
    }
    assert!(bad(&|d| received(&Junk(0xff), d).unwrap()));
    assert_eq!(
        lock(&calls).stats(),
        CallStats::default(),
        "nothing counted"
    );
}

#[test]
fn a_call_whose_answer_is_here_when_its_deadline_is_judged_ends_with_it() {
    // The caller's thread came back past the deadline (busy elsewhere) while the answer
    // sat in the connection: taking it in comes before judging the deadline.
    let (client, replies, decoder) = (Calls::default(), Replies::new(None), Decoder::new(1 << 20));
    let id = lock(&client).start::<Get>(None);
    let past = Instant::now();
    let mut calls = vec![Call::<Value>::new(
        id,
        client.clone(),
        "Get",
        Duration::ZERO,
        Some(past),
    )];
    let data = Bulk::new(vec![3u8; 16]);
    let out = ReplyOut {
        id,
        status: ANSWERED,
        value: Some(&Value { data: data.clone() }),
    };
    let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
    let mut took_in = 0;
    let ended = first_ended(&mut calls, || {
        took_in += 1;
        assert!(deliver(answer, &client, &replies, &decoder).is_none());
    });
    let Next::Ended(0, Ok(got)) = ended else {
        panic!("the answer that was here, not a timeout")
    };
    assert_eq!((got.data, took_in), (data, 1));
    let stats = lock(&client).stats();
    assert_eq!((stats.answered, stats.timed_out, stats.late), (1, 0, 0));
    // Nothing there: the deadline is the outcome.
    let id = lock(&client).start::<Get>(None);
    let mut calls = vec![Call::<Value>::new(
        id,
        client.clone(),
        "Get",
        Duration::ZERO,
        Some(past),
    )];
    let ended = first_ended(&mut calls, || {});
    assert!(matches!(
        ended,
        Next::Ended(0, Err(Error::CallTimedOut { .. }))
    ));
    // Before any deadline, nothing is taken in here (the wait receives).
    let id = lock(&client).start::<Get>(None);
    let mut calls = vec![Call::<Value>::new(
        id,
        client.clone(),
        "Get",
        Duration::from_secs(60),
        deadline(Duration::from_secs(60)),
    )];
    let ended = first_ended(&mut calls, || panic!("no deadline passed"));
    assert!(matches!(ended, Next::Wait(Some(_))));
}

#[test]
fn a_cancelled_or_expired_call_counts_its_answer_late() {
    let (client, replies, decoder) = (Calls::default(), Replies::new(None), Decoder::new(1 << 20));
    let id = lock(&client).start::<Get>(None);
    let call: Call<Value> = Call::new(id, client.clone(), "Get", Duration::ZERO, None);
    let err = call.expire();
    assert!(matches!(err, Error::CallTimedOut { .. }));
    let id2 = lock(&client).start::<Get>(None);
    drop(Call::<Value>::new(
        id2,
        client.clone(),
        "Get",
        Duration::ZERO,
        None,
    ));
    for id in [id, id2] {
        let out = ReplyOut {
            id,
            status: ANSWERED,
            value: Some(&Value {
                data: Bulk::default(),
            }),
        };
        let answer = received(&out, &mut Decoder::new(1 << 20)).unwrap();
        assert!(deliver(answer, &client, &replies, &decoder).is_none());
    }
    let stats = lock(&client).stats();
    assert_eq!((stats.late, stats.timed_out, stats.in_flight), (2, 1, 0));
}

/// A request carries what was left of its caller's deadline: the server's responder says how
/// long is left (never less than the caller has), a forwarded call can take the rest, and a
/// responder dropped after the deadline sends nothing and is counted.
#[test]
fn a_request_carries_its_deadline_and_an_expired_one_is_dropped_silently() {
    let (server, replies) = (Calls::default(), Replies::new(None));
    let mut decoder = Decoder::new(1 << 20);
    decoder.register::<Get>().unwrap();
    let get = Get { key: "k".into() };
    let request = |deadline, decoder: &mut Decoder| {
        let out = CallOut {
            id: 1,
            deadline,
            m: &get,
        };
        let env = received(&out, decoder).unwrap();
        let mut env = deliver(env, &server, &replies, decoder).expect("for the application");
        env.responder::<Get>().unwrap()
    };
    let before = Instant::now();
    let r = request(Some(Instant::now() + Duration::from_secs(5)), &mut decoder);
    let left = r.time_left().expect("a deadline");
    assert!(
        left <= Duration::from_secs(5) && left > Duration::from_secs(4),
        "{left:?}"
    );
    assert!(r.deadline().unwrap() >= before + Duration::from_secs(5));
    assert!(!r.expired());
    drop(r);
    assert_eq!(replies.take().len(), 1, "in time: 'no answer' goes");

    let r = request(None, &mut decoder);
    assert_eq!(
        (r.deadline(), r.time_left(), r.expired()),
        (None, None, false)
    );
    drop(r);
    assert_eq!(replies.take().len(), 1);

    let r = request(Some(Instant::now()), &mut decoder);
    assert!(r.expired());
    assert_eq!(r.time_left(), Some(Duration::ZERO));
    drop(r);
    assert!(
        replies.take().is_empty(),
        "its caller gave up: nothing sent"
    );
    assert_eq!(replies.expired(), 1);

    // What is left of an outbox's request is taken when it goes.
    let queued = CallOwned {
        id: 2,
        deadline: Some(Instant::now() + Duration::from_secs(60)),
        request: Get { key: "q".into() },
    };
    let env = received(&queued, &mut decoder).unwrap();
    let ((_, _, budget), _) = crate::codec::decode_prefix::<(u64, u32, u64)>(env.body()).unwrap();
    assert!(budget <= 60_000_000 && budget > 59_000_000, "{budget}");
    assert_eq!(
        budget_of(Some(Duration::MAX)),
        NO_DEADLINE - 1,
        "saturates, stays a deadline"
    );
}

/// A failed connection fails each call with what became of its request: never sent (it was
/// in the outbox), taken by the peer's application (its record said so), or not known.
#[test]
fn a_failed_connection_says_per_call_what_became_of_its_request() {
    use crate::RequestFate;
    let mut table = CallTable::default();
    // A session's calls (a hub's name their peer: the device tests show it).
    let peer = None;
    let ids: Vec<u64> = (0..4).map(|_| table.start::<Get>(peer)).collect();
    table.request_sent(ids[0], u32::MAX); // taken: the count wrapped past it
    table.request_sent(ids[1], 4); // sent, not known taken
                                   // ids[2] never said it went (in the outbox: listed unsent); ids[3] neither, and not listed.
    let lost = LostCalls {
        taken: 4,
        unsent: vec![ids[2]],
        nothing_went: false,
    };
    let vanished = || {
        Error::from(rdmsg_transport::Error::Connection(
            rdmsg_transport::Failure::PeerVanished,
        ))
    };
    table.fail_peer(peer, &lost, vanished);
    let fates: Vec<RequestFate> = ids
        .iter()
        .map(|&id| match table.take(id) {
            Some(Outcome::Failed(Error::CallFailed {
                fate,
                peer: p,
                request,
                source,
            })) => {
                assert_eq!((p, request), (peer, std::any::type_name::<Get>()));
                assert!(source.is_fatal() && source.to_string().contains("vanished"));
                fate
            }
            other => panic!("{other:?}"),
        })
        .collect();
    use RequestFate::*;
    assert_eq!(fates, [Taken, Unknown, NotSent, Unknown]);
    // A peer whose handshake failed was sent nothing.
    let id = table.start::<Get>(peer);
    table.request_sent(id, 0);
    let none = LostCalls {
        nothing_went: true,
        ..LostCalls::default()
    };
    table.fail_peer(peer, &none, vanished);
    assert!(matches!(
        table.take(id),
        Some(Outcome::Failed(Error::CallFailed { fate: NotSent, .. }))
    ));

    let e = Error::CallFailed {
        request: "app::Job",
        peer,
        fate: NotSent,
        source: Box::new(vanished()),
    };
    let text = e.to_string();
    assert!(
        text.starts_with("call app::Job failed: its request was never sent: "),
        "{text}"
    );
    assert!(text.contains("vanished"), "{text}");
    assert!(e.is_fatal(), "as fatal as the connection's failure");
    assert!(
        !format!("{e:?}").contains("Caused by"),
        "the report says the cause once: {e:?}"
    );
}

/// A watched call's outcome is listed for its hub once, whether it came before the watch or
/// after, by an answer or by its connection's failure.
#[test]
fn watched_calls_are_listed_once_when_they_end() {
    let mut table = CallTable::default();
    let (a, b, c) = (
        table.start::<Get>(None),
        table.start::<Get>(None),
        table.start::<Get>(None),
    );
    assert_eq!(table.watch(a), Some(None));
    assert!(!table.any_ended());
    let answer = |table: &mut CallTable, id| {
        let mut decoder = Decoder::new(1 << 20);
        let env = received(&Other, &mut decoder).unwrap();
        table.answer(None, id, NO_ANSWER, env);
    };
    answer(&mut table, a);
    answer(&mut table, b);
    assert_eq!(table.take_ended(), [a], "b is not watched");
    assert_eq!(table.watch(b), Some(None), "already in: listed at once");
    assert_eq!(table.take_ended(), [b]);
    table.watch(c);
    table.fail_peer(None, &LostCalls::default(), || Error::ForeignCall);
    assert_eq!(table.take_ended(), [c]);
    assert!(matches!(
        table.take(c),
        Some(Outcome::Failed(Error::CallFailed { .. }))
    ));
    assert_eq!(table.watch(c), None, "over: nothing to watch");
}

/// A request or an answer forwarded as it came goes out byte for byte as the same value
/// called or answered again: the receiving side cannot tell them apart.
#[test]
fn forwarded_requests_and_answers_are_the_frames_a_call_would_send() {
    let get = Get {
        key: "k".repeat(40),
    };
    let frame_of = |e: &dyn Encode| {
        let mut frame = vec![0; 4096];
        let n = e.encode_single(9, &mut frame).unwrap().expect("fits");
        frame.truncate(n);
        frame
    };
    let body = codec::encode_head(&get).unwrap();
    let called = CallOut {
        id: 5,
        deadline: None,
        m: &get,
    };
    let forwarded = forwarded_request(5, Get::TAG, None, &body[..]).unwrap();
    assert_eq!(frame_of(&called), frame_of(&forwarded));
    // A shared body (a detached envelope's) goes by reference: the same bytes, not copied.
    let shared = bytes::Bytes::from(body.clone());
    let by_reference = forwarded_request(5, Get::TAG, None, shared.clone()).unwrap();
    assert_eq!(frame_of(&called), frame_of(&by_reference));
    let pieces = by_reference.encode_pieces().unwrap();
    let copied = forwarded.encode_pieces().unwrap();
    assert!(matches!(&pieces[1], Piece::Bulk(b) if b.as_ptr() == shared.as_ptr()));
    let concat = |p: &[Piece]| -> Vec<u8> {
        p.iter()
            .flat_map(|p| match p {
                Piece::Encoded(v) => v.clone(),
                Piece::Bulk(b) => b.to_vec(),
            })
            .collect()
    };
    assert_eq!(concat(&pieces), concat(&copied));
    let mut packed = vec![0; 4096];
    let n = forwarded.encode_entry(&mut packed).unwrap().unwrap();
    assert_eq!(
        &packed[crate::frame::PACK_ENTRY..n],
        &frame_of(&called)[20..]
    );

    let value = Value {
        data: Bulk::from(vec![3u8; 100]),
    };
    let answer = codec::encode_head(&value).unwrap();
    let answered = ReplyOut {
        id: 5,
        status: ANSWERED,
        value: Some(&value),
    };
    let forwarded = forwarded_answer(5, answer.clone()).unwrap();
    assert_eq!(frame_of(&answered), frame_of(&forwarded));
    assert_eq!(forwarded.size(), encoded_len(&answered));
    let pieces = forwarded.encode_pieces().unwrap();
    let joined: Vec<u8> = pieces.iter().flat_map(|p| p.bytes().to_vec()).collect();
    assert_eq!(joined, frame_of(&answered)[20..]);
}
