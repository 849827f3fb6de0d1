//! The receive loops: the blocking `recv` over `recv_timeout`, and the loop of
//! [`crate::Session::incoming`] and [`crate::Dispatcher::run`] over any source of results, so
//! that it can be driven by a scripted sequence as well as by a session; and the sooner of two
//! bounds, which their waits take.

use crate::{Envelope, Error, Result};

/// Calls `recv_timeout` until it yields something: the blocking `recv` of a session, a split
/// half or a hub, over its bounded form.
/// The sooner of two optional bounds, durations or deadlines (`None`: no bound).
pub(crate) fn earliest<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

pub(crate) fn wait_until_some<T>(mut recv_timeout: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    loop {
        if let Some(got) = recv_timeout()? {
            return Ok(got);
        }
    }
}

/// Calls `recv` until it yields a message or a fatal error ([`Error::is_fatal`]); each
/// non-fatal error is handed to `skipped` and the loop goes on. A fatal error is returned at
/// once: an error that will recur must not be retried (that would spin).
pub(crate) fn next_message(
    mut recv: impl FnMut() -> Result<Envelope>,
    mut skipped: impl FnMut(Error),
) -> Result<Envelope> {
    loop {
        match recv() {
            Ok(env) => return Ok(env),
            Err(e) if e.is_fatal() => return Err(e),
            Err(e) => skipped(e),
        }
    }
}

/// The messages `recv` yields, skipping non-fatal errors, until its first fatal error; after
/// that `None` for ever, without calling `recv` again.
pub(crate) fn messages(
    mut recv: impl FnMut() -> Result<Envelope>,
) -> impl Iterator<Item = Envelope> {
    std::iter::from_fn(move || next_message(&mut recv, |_| {}).ok()).fuse()
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::codec::{Decoder, FrameBytes};
    use crate::frame::{self, FIRST, LAST};

    fn envelope(seq: u32) -> Envelope {
        let f = frame::build(FIRST | LAST, crate::tag("drive.test"), seq, 0, &[]);
        Decoder::new(1024)
            .push(FrameBytes::Owned(f))
            .unwrap()
            .unwrap()
    }

    fn verbs_error() -> Error {
        rdmsg_transport::Error::from(rdmsg_verbs::Error::InvalidArgument("cq gone".into())).into()
    }

    /// A source that plays `script`, then repeats `then` for ever, counting its calls; it
    /// panics past `limit` calls, which a loop that spins on an error reaches.
    fn scripted(
        script: Vec<Result<Envelope>>,
        then: fn() -> Result<Envelope>,
        calls: &std::cell::Cell<u32>,
    ) -> impl FnMut() -> Result<Envelope> + '_ {
        let mut script: VecDeque<_> = script.into();
        move || {
            calls.set(calls.get() + 1);
            assert!(calls.get() <= 100, "the loop retried an error 100 times");
            script.pop_front().unwrap_or_else(then)
        }
    }

    #[test]
    fn a_persistent_verbs_error_ends_incoming_after_one_call() {
        let calls = std::cell::Cell::new(0);
        let mut it = messages(scripted(vec![], || Err(verbs_error()), &calls));
        assert!(it.next().is_none());
        assert!(it.next().is_none(), "and stays ended");
        assert_eq!(calls.get(), 1);
    }

    #[test]
    fn non_fatal_errors_are_skipped_and_the_loop_goes_on() {
        let calls = std::cell::Cell::new(0);
        let script = vec![
            Err(Error::UnknownTag {
                tag: 7,
                registered: Vec::new().into(),
            }),
            Ok(envelope(1)),
            Err(Error::BadFrame(frame::FrameError::TooShort(3))),
            Err(rdmsg_transport::Error::timeout(
                "sending",
                "(test)",
                std::time::Duration::from_millis(1),
            )
            .into()),
            Ok(envelope(2)),
        ];
        let seqs: Vec<u32> = messages(scripted(script, || Err(verbs_error()), &calls))
            .map(|e| e.seq())
            .collect();
        assert_eq!(seqs, [1, 2]);
        assert_eq!(
            calls.get(),
            6,
            "five scripted results, then one fatal error"
        );
    }

    #[test]
    fn next_message_hands_skipped_errors_over_and_returns_the_fatal_one() {
        let calls = std::cell::Cell::new(0);
        let script = vec![
            Err(Error::ReceiverGone(1)),
            Err(Error::UnknownTag {
                tag: 2,
                registered: Vec::new().into(),
            }),
        ];
        let mut skipped = Vec::new();
        let r = next_message(scripted(script, || Err(verbs_error()), &calls), |e| {
            skipped.push(e.to_string())
        });
        assert!(matches!(
            r,
            Err(Error::Transport(rdmsg_transport::Error::Verbs(_)))
        ));
        assert_eq!(skipped.len(), 2);
        assert_eq!(calls.get(), 3);
    }
}
