//! Where an rdma_cm handshake stands, as a machine: fed the kind and status of each event its
//! id gets, it says what the driver does next. The blocking client
//! ([`Endpoint::connect_cm`](crate::Endpoint::connect_cm)) and the hub's connections (client
//! and accepted) run it; the verbs (resolve, connect, move to RTS) stay with them, as the TCP
//! handshake's bytes stay with its [`Pending`](crate::bootstrap).

use std::time::{Duration, Instant};

use rdmsg_verbs::CmEventKind;

/// What a CM handshake waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Ours: the address resolved to our device.
    Address,
    /// Ours: the route.
    Route,
    /// Ours: the server's answer to our request (its hello, or a reject).
    Answer,
    /// Accepted: the client's side of the connection (`ESTABLISHED`).
    Established,
    /// Over: connected, or failed.
    Over,
}

impl Stage {
    /// What the handshake was doing, for an error.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Stage::Address => "resolving the address",
            Stage::Route => "resolving the route",
            Stage::Answer => "connecting",
            Stage::Established => "accepting",
            Stage::Over => "connected",
        }
    }
}

/// What the driver does after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CmNext {
    /// Resolve the route (`rdma_resolve_route`), within [`CmHandshake::left`].
    ResolveRoute,
    /// Check the device, make the queue pair, send the request with our hello
    /// (`rdma_connect`).
    Connect,
    /// The server's answer came: check its hello, move the queue pair to RTS, establish.
    Answered,
    /// The accepted connection is up.
    Established,
    /// The event ends the handshake: the error it stands for ([`super::cm_failure`]), at
    /// [`CmNext::Failed`]'s stage.
    Failed(Stage),
}

/// One rdma_cm handshake: its stage and deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CmHandshake {
    stage: Stage,
    started: Instant,
    deadline: Instant,
}

impl CmHandshake {
    /// A client's, which has asked to resolve the address.
    pub(crate) fn client(started: Instant, timeout: Duration) -> Self {
        Self::at(Stage::Address, started, timeout)
    }

    /// An accepted request's, waiting for the client to establish.
    pub(crate) fn accepted(started: Instant, timeout: Duration) -> Self {
        Self::at(Stage::Established, started, timeout)
    }

    fn at(stage: Stage, started: Instant, timeout: Duration) -> Self {
        Self {
            stage,
            started,
            deadline: rdmsg_verbs::deadline_after(started, timeout),
        }
    }

    /// What it waits for.
    pub(crate) fn stage(&self) -> Stage {
        self.stage
    }

    /// When it began.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// When it fails if not over.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Time left at `now` (zero once the deadline passed).
    pub(crate) fn left(&self, now: Instant) -> Duration {
        self.deadline.saturating_duration_since(now)
    }

    /// An event of the handshake's id: what to do next. Anything but the event the stage
    /// waits for, or that event with an error status, fails the handshake.
    pub(crate) fn on_event(&mut self, kind: CmEventKind, status: i32) -> CmNext {
        let at = self.stage;
        let next = match (at, kind) {
            _ if status != 0 => None,
            (Stage::Address, CmEventKind::AddrResolved) => {
                Some((Stage::Route, CmNext::ResolveRoute))
            }
            (Stage::Route, CmEventKind::RouteResolved) => Some((Stage::Answer, CmNext::Connect)),
            (Stage::Answer, CmEventKind::ConnectResponse) => Some((Stage::Over, CmNext::Answered)),
            (Stage::Established, CmEventKind::Established) => {
                Some((Stage::Over, CmNext::Established))
            }
            _ => None,
        };
        match next {
            Some((stage, next)) => {
                self.stage = stage;
                next
            }
            None => {
                self.stage = Stage::Over;
                CmNext::Failed(at)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> CmHandshake {
        CmHandshake::client(Instant::now(), Duration::from_secs(5))
    }

    #[test]
    fn a_client_resolves_connects_and_is_answered() {
        let mut hs = client();
        assert_eq!(
            hs.on_event(CmEventKind::AddrResolved, 0),
            CmNext::ResolveRoute
        );
        assert_eq!(hs.on_event(CmEventKind::RouteResolved, 0), CmNext::Connect);
        assert_eq!(hs.stage().name(), "connecting");
        assert_eq!(
            hs.on_event(CmEventKind::ConnectResponse, 0),
            CmNext::Answered
        );
        assert_eq!(hs.stage(), Stage::Over);
    }

    #[test]
    fn an_error_status_or_an_event_out_of_turn_fails_at_its_stage() {
        let mut hs = client();
        assert_eq!(
            hs.on_event(CmEventKind::AddrResolved, -110),
            CmNext::Failed(Stage::Address)
        );
        let mut hs = client();
        hs.on_event(CmEventKind::AddrResolved, 0);
        assert_eq!(
            hs.on_event(CmEventKind::Rejected, 0),
            CmNext::Failed(Stage::Route),
            "a reject before the request"
        );
        let mut hs = client();
        hs.on_event(CmEventKind::AddrResolved, 0);
        hs.on_event(CmEventKind::RouteResolved, 0);
        assert_eq!(
            hs.on_event(CmEventKind::Rejected, 28),
            CmNext::Failed(Stage::Answer)
        );
        assert_eq!(
            hs.on_event(CmEventKind::ConnectResponse, 0),
            CmNext::Failed(Stage::Over),
            "nothing moves an ended handshake on"
        );
    }

    #[test]
    fn an_accepted_request_waits_for_established_alone() {
        let mut hs = CmHandshake::accepted(Instant::now(), Duration::from_secs(5));
        assert_eq!(hs.stage().name(), "accepting");
        assert_eq!(
            hs.clone().on_event(CmEventKind::ConnectResponse, 0),
            CmNext::Failed(Stage::Established)
        );
        assert_eq!(
            hs.on_event(CmEventKind::Established, 0),
            CmNext::Established
        );
    }

    #[test]
    fn the_deadline_is_the_timeout_after_the_start_and_left_saturates() {
        let t0 = Instant::now();
        let hs = CmHandshake::client(t0, Duration::from_secs(2));
        assert_eq!(hs.deadline(), t0 + Duration::from_secs(2));
        assert_eq!(hs.left(t0 + Duration::from_secs(1)), Duration::from_secs(1));
        assert_eq!(hs.left(t0 + Duration::from_secs(3)), Duration::ZERO);
        assert_eq!(hs.started(), t0);
    }
}
