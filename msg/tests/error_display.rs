//! What users see when they print message-layer errors, with `{}` and as anyhow's `{:#}` prints
//! the chain: a transport failure shows what failed, not a generic wrapper.

use std::io;

const EINVAL: i32 = 22;

#[test]
fn a_failed_verb_prints_as_the_verb_and_why() {
    let e = rdmsg_msg::Error::from(rdmsg_transport::Error::from(rdmsg_verbs::Error::ModifyQp {
        qp_num: 0x2a,
        from: rdmsg_verbs::QpState::Init,
        to: rdmsg_verbs::QpState::Rtr,
        source: io::Error::from_raw_os_error(EINVAL),
    }));
    let first = "ibv_modify_qp on QP 0x2a from Init to Rtr failed (EINVAL)";
    assert_eq!(e.to_string(), first);
    assert_eq!(
        rdmsg_testkit::error_chain(&e),
        format!("{first}: {}", io::Error::from_raw_os_error(EINVAL))
    );
}

#[test]
fn a_failed_connection_prints_why_it_failed() {
    let e = rdmsg_msg::Error::from(rdmsg_transport::Error::Connection(
        rdmsg_transport::Failure::PeerVanished,
    ));
    assert_eq!(
        e.to_string(),
        "connection failed: the peer vanished (its side ended without a graceful close, or its host stopped answering)"
    );
    assert!(e.is_fatal() && !e.is_peer_closed());
}

#[test]
fn a_graceful_close_by_the_peer_reads_as_one() {
    let e = rdmsg_msg::Error::from(rdmsg_transport::Error::Connection(
        rdmsg_transport::Failure::PeerClosed,
    ));
    assert_eq!(e.to_string(), "the peer closed the connection");
    assert_eq!(
        rdmsg_testkit::error_chain(&e),
        e.to_string(),
        "nothing more"
    );
    assert!(e.is_fatal() && e.is_peer_closed());
}

#[test]
fn a_read_refused_for_want_of_memory_says_why() {
    let e = rdmsg_msg::Error::ReadRefused {
        tag: 1,
        seq: 7,
        source: rdmsg_transport::Error::from(rdmsg_verbs::Error::RegisterMemory {
            len: 1 << 20,
            source: io::Error::from_raw_os_error(12),
        }),
    };
    assert_eq!(
        e.to_string(),
        "message 7 (tag 0x00000001) could not be read: no buffer for it (cannot allocate memory)"
    );
    assert!(!e.is_fatal());
    assert!(
        rdmsg_testkit::error_chain(&e).contains("`ulimit -l`"),
        "the chain has the rest: {}",
        rdmsg_testkit::error_chain(&e)
    );
}

mod types {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Reading(pub u32);
    rdmsg_msg::message!(Reading);

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Alarm(pub u32);
    rdmsg_msg::message!(Alarm);

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Stray(pub u32);
    rdmsg_msg::message!(Stray, tag = "tests.stray");
}

use rdmsg_msg::codec::{self, Decoder, FrameBytes};
use rdmsg_msg::{Error, Message};
use types::{Alarm, Reading, Stray};

/// `m` as one frame, as a session sends it.
fn frame_of<M: Message>(m: &M) -> FrameBytes {
    let mut buf = vec![0u8; 64];
    let n = codec::encode_single(m, 0, &mut buf).unwrap().unwrap();
    buf.truncate(n);
    FrameBytes::Owned(buf)
}

#[test]
fn an_unknown_tag_lists_the_registered_types_and_what_to_do() {
    let mut dec = Decoder::new(1 << 20);
    dec.register::<Reading>().unwrap();
    dec.register::<Alarm>().unwrap();
    let e = dec.push(frame_of(&Stray(1))).unwrap_err();
    assert!(matches!(e, Error::UnknownTag { tag, .. } if tag == Stray::TAG));
    assert_eq!(
        e.to_string(),
        format!(
            "received a message of tag {:#010x}, but no type is registered under that tag here \
             (registered: error_display::types::Alarm {:#010x}, error_display::types::Reading \
             {:#010x}): register the sender's type on this side (`register::<T>()`, or a \
             Dispatcher route), or check that both programs give the type the same tag (its \
             name as written in `message!(T)`, or `message!(T, tag = \"...\")`)",
            Stray::TAG,
            Alarm::TAG,
            Reading::TAG
        )
    );
    let none = Error::UnknownTag {
        tag: 0x1a7b_bee6,
        registered: Vec::new().into(),
    };
    assert!(
        none.to_string().starts_with(
            "received a message of tag 0x1a7bbee6, but no type is registered under that tag \
             here (none are registered): "
        ),
        "{none}"
    );
}

#[test]
fn decoding_as_another_type_names_both_and_decodes_nothing() {
    let mut dec = Decoder::new(1 << 20);
    dec.register::<Reading>().unwrap();
    dec.register::<Alarm>().unwrap();
    let env = dec.push(frame_of(&Reading(7))).unwrap().unwrap();
    assert_eq!(env.type_name(), Some(std::any::type_name::<Reading>()));
    let e = env.decode::<Alarm>().unwrap_err();
    assert!(
        matches!(
            e,
            Error::WrongType { expected, expected_tag, tag, actual }
                if expected == std::any::type_name::<Alarm>()
                    && expected_tag == Alarm::TAG
                    && tag == Reading::TAG
                    && actual == Some(std::any::type_name::<Reading>())
        ),
        "{e:?}"
    );
    assert!(!e.is_fatal());
    assert_eq!(
        e.to_string(),
        format!(
            "decode::<error_display::types::Alarm>() on a message of type \
             error_display::types::Reading (tag {:#010x}; the type asked for has tag {:#010x}): \
             check `env.is::<T>()` (or match on `env.tag()`) before decoding, or check that the \
             sender sent the type you expect",
            Reading::TAG,
            Alarm::TAG
        )
    );
    assert!(matches!(
        env.decode_borrowed::<Alarm>(),
        Err(Error::WrongType { .. })
    ));
    assert_eq!(env.decode::<Reading>().unwrap().0, 7);
    // A decoder that accepts every tag knows no type by it.
    let env = Decoder::new(1 << 20)
        .push(frame_of(&Reading(7)))
        .unwrap()
        .unwrap();
    assert_eq!(env.type_name(), None);
    assert_eq!(
        env.decode::<Alarm>().unwrap_err().to_string(),
        format!(
            "decode::<error_display::types::Alarm>() on a message of tag {:#010x} (no type is \
             registered under it here; the type asked for has tag {:#010x}): check \
             `env.is::<T>()` (or match on `env.tag()`) before decoding, or check that the sender \
             sent the type you expect",
            Reading::TAG,
            Alarm::TAG
        )
    );
}

#[test]
fn a_message_too_large_names_max_message_and_says_to_raise_it_on_both_sides() {
    let e = Error::TooLarge {
        len: 17 << 20,
        max: 16 << 20,
    };
    assert_eq!(
        e.to_string(),
        "message of 17825792 bytes exceeds SessionConfig::max_message (16777216 bytes) on this \
         side: raise max_message on both sides (the sender refuses larger messages, the \
         receiver drops them)"
    );
    // Sending: refused before anything goes.
    let body = vec![0u8; 100];
    let e = codec::fragment(&body, Reading::TAG, 0, 64, 99).unwrap_err();
    assert!(matches!(e, Error::TooLarge { len: 100, max: 99 }), "{e:?}");
    // Receiving in fragments: dropped once the reassembled bytes pass the bound.
    let frames = codec::fragment(&body, Reading::TAG, 0, 64, 1 << 20).unwrap();
    let mut small = Decoder::new(50);
    let e = frames
        .into_iter()
        .find_map(|f| small.push(FrameBytes::Owned(f)).err())
        .expect("refused");
    assert_eq!(
        e.to_string(),
        "bad frame dropped: message in fragments exceeds SessionConfig::max_message (50 bytes) \
         on this side: raise max_message on both sides"
    );
    let e = Error::TooManyFragments {
        len: 200 << 20,
        max: 128 << 20,
    };
    assert_eq!(
        e.to_string(),
        "message of 209715200 bytes needs more than 65536 fragments (at most 134217728 bytes go \
         in fragments of the peer's receive buffers): let it go by rendezvous \
         (SessionConfig::rendezvous_threshold, and the peer's Config::max_read_bytes), or raise \
         the peer's Config::buf_size"
    );
}

#[test]
fn a_close_that_timed_out_says_what_it_waited_for() {
    let e = rdmsg_msg::Error::from(rdmsg_transport::Error::timeout(
        "closing",
        "waiting for the peer to acknowledge the close message (it may have gone); \
         Config::close_timeout bounds this wait",
        std::time::Duration::from_secs(2),
    ));
    assert!(!e.is_fatal());
    assert_eq!(
        e.to_string(),
        "closing timed out after 2s waiting for the peer to acknowledge the close message (it \
         may have gone); Config::close_timeout bounds this wait"
    );
}

#[test]
fn a_message_whose_fragments_stopped_says_how_far_it_got() {
    let e = rdmsg_msg::Error::ReassemblyTimedOut {
        tag: 0x2a,
        seq: 7,
        received: 65_512,
        after: std::time::Duration::from_secs(10),
    };
    assert_eq!(
        e.to_string(),
        "message 7 (tag 0x0000002a) in fragments got no fragment for 10s after 65512 bytes: \
         dropped (raise HubLimits::reassembly_timeout if the peer is that slow)"
    );
    assert!(!e.is_fatal());
}
