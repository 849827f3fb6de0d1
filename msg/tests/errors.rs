//! Which errors end a session's loops, and the loops driven by scripted error sequences, as a
//! failing device would produce them, without a device.

use std::cell::Cell;
use std::collections::VecDeque;
use std::io;
use std::time::Duration;

use rdmsg_msg::codec::{self, Decoder, FrameBytes};
use rdmsg_msg::frame::FrameError;
use rdmsg_msg::{Dispatcher, Envelope, Error, Message};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Ping(u32);
rdmsg_msg::message!(Ping);

#[derive(Debug, Serialize, Deserialize)]
struct Stray;
rdmsg_msg::message!(Stray);

fn envelope<M: Message>(m: &M) -> Envelope {
    let mut buf = vec![0u8; 256];
    let n = codec::encode_single(m, 0, &mut buf).unwrap().unwrap();
    buf.truncate(n);
    Decoder::new(1 << 20)
        .push(FrameBytes::Owned(buf))
        .unwrap()
        .unwrap()
}

fn verbs() -> Error {
    rdmsg_transport::Error::from(rdmsg_verbs::Error::InvalidArgument("cq gone".into())).into()
}

fn notify() -> Error {
    rdmsg_transport::Error::from(rdmsg_notify::Error::UnknownCq(3)).into()
}

#[test]
fn every_error_is_classified() {
    let io = || io::Error::from(io::ErrorKind::BrokenPipe);
    let fatal: Vec<Error> = vec![
        verbs(),
        notify(),
        rdmsg_transport::Error::WakePipe(io()).into(),
        rdmsg_transport::Error::Bootstrap {
            stage: "reading",
            source: io(),
        }
        .into(),
        rdmsg_transport::Error::Config("depth".into()).into(),
        rdmsg_transport::Error::Connection(rdmsg_transport::Failure::PeerClosed).into(),
        rdmsg_transport::Error::Connection(rdmsg_transport::Failure::QpError).into(),
        Error::DuplicateTag {
            tag: 1,
            existing: "a",
            new: "b",
        },
    ];
    for e in &fatal {
        assert!(e.is_fatal(), "{e:?} must be fatal");
    }
    let per_message: Vec<Error> = vec![
        rdmsg_transport::Error::timeout("sending", "(test)", Duration::from_millis(1)).into(),
        rdmsg_transport::Error::TooLarge { len: 9, max: 8 }.into(),
        Error::BadFrame(FrameError::TooShort(1)),
        Error::UnknownTag {
            tag: 5,
            registered: Vec::new().into(),
        },
        Error::ReceiverGone(5),
        Error::NoPeer(5),
        Error::WrongType {
            expected: "Ping",
            expected_tag: 1,
            tag: 2,
            actual: None,
        },
        Error::TooLarge { len: 9, max: 8 },
        Error::TooManyFragments { len: 9, max: 8 },
        Error::Unread { messages: 2 },
        Error::Unsent { messages: 2 },
        Error::ReadRefused {
            tag: 1,
            seq: 2,
            source: rdmsg_transport::Error::Verbs(rdmsg_verbs::Error::InvalidArgument(
                "no memory".into(),
            )),
        },
        codec::decode_body::<Ping>(Ping::TAG, &[], 8).unwrap_err(),
    ];
    for e in &per_message {
        assert!(!e.is_fatal(), "{e:?} costs one message only");
    }
}

/// Plays `script`, then returns `then()` for ever; counts calls and fails the test past 100,
/// which a loop retrying a lasting error reaches at once.
fn scripted(
    script: Vec<rdmsg_msg::Result<Envelope>>,
    then: fn() -> Error,
    calls: &Cell<u32>,
) -> impl FnMut() -> rdmsg_msg::Result<Envelope> + '_ {
    let mut script: VecDeque<_> = script.into();
    move || {
        calls.set(calls.get() + 1);
        assert!(calls.get() <= 100, "the loop spins on a lasting error");
        script.pop_front().unwrap_or_else(|| Err(then()))
    }
}

#[test]
fn a_persistent_verbs_error_ends_the_dispatcher_after_one_call() {
    let calls = Cell::new(0);
    let mut d = Dispatcher::new();
    let e = d.run_from(scripted(vec![], verbs, &calls));
    assert!(
        matches!(e, Error::Transport(rdmsg_transport::Error::Verbs(_))),
        "{e:?}"
    );
    assert_eq!(calls.get(), 1);
    assert_eq!(d.stats().bad_frames, 0);
}

#[test]
fn the_dispatcher_skips_per_message_errors_and_goes_on() {
    let calls = Cell::new(0);
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut d = Dispatcher::new();
    let sink = got.clone();
    d.on::<Ping>(move |p| sink.lock().unwrap().push(p.0))
        .unwrap();
    let script = vec![
        Err(Error::BadFrame(FrameError::TooShort(2))),
        Ok(envelope(&Ping(1))),
        Err(Error::UnknownTag {
            tag: 9,
            registered: Vec::new().into(),
        }),
        Ok(envelope(&Stray)),
        Err(rdmsg_transport::Error::timeout("sending", "(test)", Duration::from_millis(1)).into()),
        Ok(envelope(&Ping(2))),
    ];
    let e = d.run_from(scripted(script, notify, &calls));
    assert!(
        matches!(e, Error::Transport(rdmsg_transport::Error::Notify(_))),
        "{e:?}"
    );
    assert_eq!(calls.get(), 7, "six scripted results, then the fatal one");
    assert_eq!(*got.lock().unwrap(), [1, 2]);
    let stats = d.stats();
    assert_eq!(
        (stats.dispatched, stats.unknown, stats.bad_frames),
        (2, 1, 3)
    );
}

/// `fn main() -> Result<(), rdmsg::Error>` ends with `Debug`: it must say what `Display` says
/// (here the Soft-RoCE advice), then the OS's words once, and not the variants' structure.
#[test]
fn debug_tells_the_message_and_its_cause_not_the_variants() {
    let e: Error = rdmsg_transport::Error::from(rdmsg_verbs::Error::ListDevices(
        io::Error::from_raw_os_error(38),
    ))
    .into();
    let debug = format!("{e:?}");
    assert!(
        debug.starts_with("ibv_get_device_list failed (ENOSYS)"),
        "{debug}"
    );
    assert!(debug.contains(rdmsg_verbs::SETUP_HINT), "{debug}");
    assert!(
        !debug.contains("ListDevices") && !debug.contains("Os {"),
        "{debug}"
    );
    let os = io::Error::from_raw_os_error(38).to_string();
    assert_eq!(debug, format!("{e}\n\nCaused by:\n    {os}"));
    assert_eq!(format!("{e:#?}"), debug);

    // A cause whose words the message already holds is not said twice.
    let e: Error =
        rdmsg_transport::Error::Connection(rdmsg_transport::Failure::PeerVanished).into();
    assert_eq!(format!("{e:?}"), e.to_string());
    assert!(!format!("{e:?}").contains("Caused by"));
}
