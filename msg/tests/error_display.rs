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
        rdmsg_transport::Failure::PeerClosed,
    ));
    assert_eq!(
        e.to_string(),
        "connection failed: the peer closed the connection"
    );
}
