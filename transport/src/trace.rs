//! What the `tracing` feature reports, and the macros that compile to nothing without it.
//!
//! The drivers report (the bootstrap, [`Connection`], the hub, and in tests the simulator),
//! never the protocol core: the core says what happened (a failure, through the action that
//! fails the queue pair; a credit stall that began or ended, through what `Core::send_waited`
//! and `Core::send_waits` return) and the driver says it here. Without the feature every
//! function below is empty and inlined, and the macros expand to nothing: the hot path has no
//! code for events at all.
//!
//! | event | level | from |
//! |---|---|---|
//! | `connecting`, `connected` | info | [`Endpoint::connect`](crate::Endpoint::connect), a hub's connect |
//! | `connect failed` | warn | [`Endpoint::connect`](crate::Endpoint::connect), a hub's connect (its TCP connect) |
//! | `handshake started` | debug | a listener's or hub's client accepted over TCP |
//! | `accepted` | info | a listener's or hub's handshake done |
//! | `handshake failed` | warn | a listener's or hub's handshake (the reason as `error`) |
//! | `client refused` | warn | a hub full, or `accept(2)` failing |
//! | `close started` | info | [`Connection::close`], a hub's `start_close` |
//! | `closed`, `peer closed` | info | a connection's end, either driver |
//! | `close timed out` | warn | the close message not taken within `close_timeout` |
//! | `receiver not ready` | warn | `RnrRetryExcErr`, or a peer sending beyond its credits |
//! | `connection failed` | warn | any other failure (the `Failure` as `failure`) |
//! | `disconnected` | debug | a hub's connection released |
//! | `hub failed` | error | a hub's own queues or channel |
//! | `credit stall`, `credit stall ended` | debug | a send finding no credit; the first that goes after (with how long it `waited`) |
//!
//! Spans: `connect` (the client's TCP connect and handshake) and `close` ([`Connection::close`]).

#[cfg(feature = "tracing")]
use std::time::Instant;
use std::{fmt, net::SocketAddr};

use crate::error::{Error, Failure, Result};
use crate::peer_id::PeerId;

/// `tracing::event!` at `tracing::Level::$level` with the `tracing` feature; nothing without
/// it (its arguments are not even compiled).
macro_rules! trace_event {
    ($level:ident, $($rest:tt)+) => {{
        #[cfg(feature = "tracing")]
        ::tracing::event!(::tracing::Level::$level, $($rest)+);
    }};
}

/// `tracing::span!(..).entered()` with the `tracing` feature (the span is left when the value
/// is dropped); a [`NoSpan`] without it.
macro_rules! trace_span {
    ($level:ident, $($rest:tt)+) => {{
        #[cfg(feature = "tracing")]
        let span = ::tracing::span!(::tracing::Level::$level, $($rest)+).entered();
        #[cfg(not(feature = "tracing"))]
        let span = $crate::trace::NoSpan;
        span
    }};
}

/// What [`trace_span!`] gives without the `tracing` feature: nothing.
#[cfg(not(feature = "tracing"))]
pub(crate) struct NoSpan;

pub(crate) use trace_span;

/// Which connection an event is about: a queue pair, and for a hub's the peer.
#[cfg(feature = "tracing")]
#[derive(Clone, Copy)]
struct Conn(u32, Option<PeerId>);

#[cfg(feature = "tracing")]
impl fmt::Display for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(p) => write!(f, "{p} (qp {:#x})", self.0),
            None => write!(f, "qp {:#x}", self.0),
        }
    }
}

/// Takes what only an event reads (so that nothing is unused without the feature).
#[inline(always)]
fn unused<T: ?Sized>(_: &T) {}

/// A client starts connecting to `addr`.
#[inline(always)]
pub(crate) fn connecting(addr: &dyn fmt::Debug) {
    unused(addr);
    trace_event!(INFO, addr = ?addr, "connecting");
}

/// A client's connect (TCP connect and handshake) to `addr` came to `res`: the queue pair
/// numbers, ours and the peer's.
#[inline(always)]
pub(crate) fn connected(addr: &dyn fmt::Debug, res: Result<(u32, u32), &Error>) {
    unused(&(addr, &res));
    #[cfg(feature = "tracing")]
    match res {
        Ok((qp, peer_qp)) => trace_event!(
            INFO,
            addr = ?addr,
            conn = %Conn(qp, None),
            peer_qp = peer_qp,
            "connected"
        ),
        Err(e) => connect_failed(addr, e),
    }
}

/// A client's connect to `addr` failed with `error` (a hub's: before its handshake).
#[inline(always)]
pub(crate) fn connect_failed(addr: &dyn fmt::Debug, error: &Error) {
    unused(&(addr, error));
    trace_event!(WARN, addr = ?addr, error = %error, "connect failed");
}

/// A client's TCP connection was accepted (from `from`): its handshake starts.
#[inline(always)]
pub(crate) fn handshake_started(from: Option<SocketAddr>, peer: Option<PeerId>) {
    unused(&(from, peer));
    trace_event!(DEBUG, from = ?from, peer = ?peer, "handshake started");
}

/// A listener's handshake with the client at `from` came to `res`: the queue pair numbers,
/// ours and the peer's.
#[inline(always)]
pub(crate) fn accepted(from: Option<SocketAddr>, res: Result<(u32, u32), &Error>) {
    unused(&(from, &res));
    #[cfg(feature = "tracing")]
    match res {
        Ok((qp, peer_qp)) => trace_event!(
            INFO,
            from = ?from,
            conn = %Conn(qp, None),
            peer_qp = peer_qp,
            "accepted"
        ),
        Err(e) => handshake_failed(from, None, e),
    }
}

/// A listener accepted a resume: the new connection (queue pair `qp`) goes to its session.
#[inline(always)]
pub(crate) fn resume_accepted(qp: u32) {
    unused(&qp);
    trace_event!(INFO, conn = %Conn(qp, None), "resume accepted");
}

/// A hub starts connecting `peer` over a stream to `to`.
#[inline(always)]
pub(crate) fn hub_connecting(peer: PeerId, to: Option<SocketAddr>) {
    unused(&(peer, to));
    trace_event!(INFO, peer = %peer, addr = ?to, "connecting");
}

/// A hub's handshake with `peer` (at `addr`) is done: its queue pair `qp` is linked to the
/// peer's `peer_qp`.
#[inline(always)]
pub(crate) fn hub_linked(
    peer: PeerId,
    addr: Option<SocketAddr>,
    accepted: bool,
    qp: u32,
    peer_qp: u32,
) {
    unused(&(peer, addr, accepted, qp, peer_qp));
    #[cfg(feature = "tracing")]
    if accepted {
        trace_event!(INFO, conn = %Conn(qp, Some(peer)), from = ?addr, peer_qp, "accepted");
    } else {
        trace_event!(INFO, conn = %Conn(qp, Some(peer)), addr = ?addr, peer_qp, "connected");
    }
}

/// A handshake (with the client at `from`; a hub's `peer` if it was ours) failed.
#[inline(always)]
pub(crate) fn handshake_failed(from: Option<SocketAddr>, peer: Option<PeerId>, error: &Error) {
    unused(&(from, peer, error));
    trace_event!(WARN, from = ?from, peer = ?peer, error = %error, "handshake failed");
}

/// A client was turned away before its handshake (the hub is full, or `accept(2)` failed).
#[inline(always)]
pub(crate) fn client_refused(error: &Error) {
    unused(error);
    trace_event!(WARN, error = %error, "client refused");
}

/// A graceful close of queue pair `qp` (a hub's `peer`) begins: its close message is posted.
#[inline(always)]
pub(crate) fn close_started(qp: u32, peer: Option<PeerId>) {
    unused(&(qp, peer));
    trace_event!(INFO, conn = %Conn(qp, peer), "close started");
}

/// Queue pair `qp` (a hub's `peer`) ended with `failure` (the driver moves it to the error
/// state now): a close done or timed out, the peer's close, or a failure, each at its level.
#[inline(always)]
pub(crate) fn ended(qp: u32, peer: Option<PeerId>, failure: Option<Failure>) {
    unused(&(qp, peer, failure));
    #[cfg(feature = "tracing")]
    {
        use rdmsg_verbs::WcStatus;

        use crate::credits::Violation;

        let conn = Conn(qp, peer);
        let Some(f) = failure else { return };
        match f {
            Failure::Closed => trace_event!(INFO, conn = %conn, "closed"),
            Failure::PeerClosed => trace_event!(INFO, conn = %conn, "peer closed"),
            Failure::CloseTimedOut => trace_event!(WARN, conn = %conn, "close timed out"),
            Failure::Completion {
                status: WcStatus::RnrRetryExcErr,
                ..
            }
            | Failure::Protocol(Violation::Overrun) => {
                trace_event!(WARN, conn = %conn, failure = %f, "receiver not ready");
            }
            _ => trace_event!(WARN, conn = %conn, failure = %f, "connection failed"),
        }
    }
}

/// A hub released `peer` (its `Disconnected` is queued).
#[inline(always)]
pub(crate) fn hub_suspended(peer: PeerId, failure: Failure) {
    unused(&(peer, failure));
    trace_event!(WARN, peer = %peer, failure = %failure, "session suspended");
}

/// A hub's session goes on over a new connection (in `slot`).
#[inline(always)]
pub(crate) fn hub_resumed(peer: PeerId, slot: usize) {
    unused(&(peer, slot));
    trace_event!(INFO, peer = %peer, slot, "session resumed");
}

/// A hub's attempt to resume a session failed.
#[inline(always)]
pub(crate) fn resume_attempt_failed(error: &crate::Error) {
    unused(error);
    trace_event!(WARN, error = %error, "resume attempt failed");
}

/// A hub's connection ended.
#[inline(always)]
pub(crate) fn disconnected(peer: PeerId, failure: Failure) {
    unused(&(peer, failure));
    trace_event!(DEBUG, peer = %peer, failure = %failure, "disconnected");
}

/// A hub's own queues or channel failed: every connection fails with it.
#[inline(always)]
pub(crate) fn hub_failed(failure: Failure) {
    unused(&failure);
    trace_event!(ERROR, failure = %failure, "hub failed");
}

/// The credit stall of one connection: when it began, with the `tracing` feature (nothing
/// without it). A stall is an episode: from the first send that found no credit until a send
/// goes, however many sends were refused (or waited) meanwhile.
#[derive(Debug, Default)]
pub(crate) struct Stall {
    #[cfg(feature = "tracing")]
    since: Option<Instant>,
}

impl Stall {
    /// A credit stall of queue pair `qp` (a hub's `peer`) began (`Core::send_waited` said so).
    #[inline(always)]
    pub(crate) fn began(&mut self, qp: u32, peer: Option<PeerId>) {
        unused(&(qp, peer));
        #[cfg(feature = "tracing")]
        {
            self.since = Some(Instant::now());
            trace_event!(DEBUG, conn = %Conn(qp, peer), "credit stall");
        }
    }

    /// It ended: a send goes (`Core::send_waits` said so).
    #[inline(always)]
    pub(crate) fn ended(&mut self, qp: u32, peer: Option<PeerId>) {
        unused(&(qp, peer));
        #[cfg(feature = "tracing")]
        if let Some(since) = self.since.take() {
            trace_event!(
                DEBUG,
                conn = %Conn(qp, peer),
                waited = ?since.elapsed(),
                "credit stall ended"
            );
        }
    }
}
