//! What users see when they print transport errors, with `{}` and as anyhow's `{:#}` prints the
//! chain: the verb that failed and why, each cause once.

use std::io;

const ENOMEM: i32 = 12;
const EBADF: i32 = 9;

#[test]
fn a_failed_verb_prints_as_the_verb_and_why() {
    let e = rdmsg_transport::Error::from(rdmsg_verbs::Error::PostSend {
        qp_num: 0x11,
        source: io::Error::from_raw_os_error(ENOMEM),
    });
    assert_eq!(e.to_string(), "ibv_post_send on QP 0x11 failed (ENOMEM)");
    assert_eq!(
        rdmsg_testkit::error_chain(&e),
        format!(
            "ibv_post_send on QP 0x11 failed (ENOMEM): {}",
            io::Error::from_raw_os_error(ENOMEM)
        )
    );
}

#[test]
fn a_failed_wait_prints_as_the_verb_and_why() {
    let e = rdmsg_transport::Error::from(rdmsg_notify::Error::from(
        rdmsg_verbs::Error::GetCqEvent(io::Error::from_raw_os_error(EBADF)),
    ));
    assert_eq!(e.to_string(), "ibv_get_cq_event failed (EBADF)");
    assert_eq!(
        rdmsg_testkit::error_chain(&e),
        format!(
            "ibv_get_cq_event failed (EBADF): {}",
            io::Error::from_raw_os_error(EBADF)
        )
    );
}
