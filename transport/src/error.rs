//! Errors of the transport layer.

use std::io;
use std::time::Duration;

use rdmsg_verbs::{AsyncEventKind, WcOpcode, WcStatus};

use crate::credits::Violation;
use crate::handshake::Reject;

/// Result alias for transport.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A transport failure.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verb failed.
    #[error(transparent)]
    Verbs(#[from] rdmsg_verbs::Error),
    /// Waiting for completions failed.
    #[error(transparent)]
    Notify(#[from] rdmsg_notify::Error),
    /// The wake-up pipe of a receive pool could not be set up.
    #[error("cannot create the receive pool's wake-up pipe: {}", Brief(.0))]
    WakePipe(#[source] io::Error),
    /// Listening for bootstrap connections failed.
    #[error("cannot listen on {addr}: {}{}", Brief(.source), ListenHint(.source))]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Connecting the bootstrap TCP stream failed.
    #[error("cannot connect to {addr}: {}{}", Brief(.source), ConnectHint(.source))]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Bootstrap socket I/O failed (peer gone, timeout, ...).
    #[error("bootstrap exchange failed while {stage}: {}", Brief(.source))]
    Bootstrap {
        /// What was being exchanged.
        stage: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The peer's connection record is not `LID:QPN:PSN:GID`.
    #[error("invalid connection record from the peer")]
    BadRecord(#[from] crate::addr::RecordError),
    /// The RDMA connection manager could not make the connection: an event other than the
    /// one awaited, or a refusal that is not rdmsg's.
    #[error("rdma_cm could not connect to {addr} while {stage}: {detail}")]
    Cm {
        /// The peer's address.
        addr: String,
        /// What was being done.
        stage: &'static str,
        /// What happened instead.
        detail: String,
    },
    /// The connection manager resolved the address to another device or port than the
    /// endpoint's, where the queue pair would have to be.
    #[error(
        "rdma_cm resolved {addr} to {resolved} port {port}, but the endpoint is on {ours} port \
         {our_port}: open the endpoint on that device, or use an address of this one"
    )]
    CmDevice {
        /// The address.
        addr: String,
        /// The device the CM chose.
        resolved: String,
        /// Its port.
        port: u8,
        /// The endpoint's device.
        ours: String,
        /// The endpoint's port.
        our_port: u8,
    },
    /// The peer's hello is unacceptable; it was told why.
    #[error("rejected the peer's handshake: {0}")]
    BadHandshake(Reject),
    /// The peer rejected our hello.
    #[error("the peer rejected our handshake: {0}")]
    Rejected(Reject),
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A combination of settings or calls rdmsg does not support, and what to do instead.
    #[error("{what} is not supported: {instead}")]
    Unsupported {
        /// What was asked.
        what: &'static str,
        /// What to do instead.
        instead: &'static str,
    },
    /// The hub's shared receive pool refused the hub's credit settings.
    #[error("invalid credit settings of the hub's shared pool: {0}")]
    ShareConfig(#[from] crate::share::ConfigError),
    /// The hub's shared receive pool refused to admit a connection it should have taken (the
    /// hub's books and the pool's disagree: a bug of rdmsg's).
    #[error("the hub's shared receive pool refused a connection: {0}")]
    Admit(crate::share::AdmitError),
    /// A member hub's thread of a [`HubGroup`](crate::HubGroup) ended in a panic; its own
    /// message went to stderr.
    #[error("member hub {member} of the group panicked")]
    MemberPanicked {
        /// The member's index.
        member: usize,
    },
    /// An RDMA read in more pieces than the queue pair's send queue has slots: it could never
    /// be posted.
    #[error("a read of {segments} segments needs more than the {send_slots} send queue slots; split it, or raise send_depth")]
    ReadTooLarge {
        /// Pieces of the read.
        segments: usize,
        /// Slots of the send queue.
        send_slots: usize,
    },
    /// The hub has `max_connections` connections (counting handshakes under way): close one,
    /// or raise `HubConfig::max_connections`.
    #[error("the hub has its max_connections ({max}) connections; close one or raise HubConfig::max_connections")]
    HubFull {
        /// `max_connections`.
        max: u32,
    },
    /// The hub's shared receive queue cannot back another connection's minimum credits.
    #[error("no receive buffers for another connection: {spare} spare, {needed} needed, the shared receive queue holds {capacity}; lower min_credits or max_connections")]
    ReceiveQueueFull {
        /// Buffers spare now.
        spare: u32,
        /// Buffers a connection needs (its minimum credits and grant slots).
        needed: u32,
        /// Most requests the shared receive queue holds.
        capacity: u32,
    },
    /// A message larger than the peer's receive buffers (for a hub, than its own buffers if
    /// they are smaller).
    #[error(
        "message of {len} bytes exceeds the largest this connection sends whole, {max} bytes \
         (the peer's Config::buf_size, or a hub's own if smaller): the transport sends a message \
         in one buffer, so split it, or send it through a Session or typed Hub, which fragment"
    )]
    TooLarge {
        /// Message length.
        len: usize,
        /// The peer's buffer size.
        max: usize,
    },
    /// A wait ran out of time: which operation, what it waited for and how long (see
    /// [`TimedOut`]). Not fatal: the next call may succeed.
    #[error(transparent)]
    Timeout(TimedOut),
    /// No connection of the hub has this id (never had, or it was disconnected).
    #[error("no connection {0} in the hub")]
    UnknownPeer(crate::PeerId),
    /// The connection ended: it failed, or either side closed it; every later call reports
    /// the same. A close reads as one (`the peer closed the connection`), a failure as
    /// `connection failed: ` and why.
    #[error("{}", Ended(.0))]
    Connection(Failure),
}

// `Debug` is the report (see `Report`): advice, not variants.
rdmsg_verbs::debug_as_report!(Error);

impl Error {
    /// A [`Error::Timeout`] of `op` (`"sending"`, `"closing"`) after `after`, spent
    /// `waiting_for` what it says (see [`TimedOut`]).
    pub fn timeout(op: &'static str, waiting_for: &'static str, after: Duration) -> Self {
        Error::Timeout(TimedOut {
            op,
            waiting_for,
            after,
        })
    }

    /// This error, a [`Error::Timeout`] renamed as `op` spent `waiting_for` (a wait shared by
    /// several operations, named by the one that called it); any other error unchanged.
    pub fn timeout_as(self, op: &'static str, waiting_for: &'static str) -> Self {
        match self {
            Error::Timeout(t) => Error::timeout(op, waiting_for, t.after),
            e => e,
        }
    }
}

/// A wait that ran out of time ([`Error::Timeout`]): `"{op} timed out after {after:?}
/// {waiting_for}"`, for example `closing timed out after 2s waiting for the peer to
/// acknowledge the close message (…)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{op} timed out after {after:?} {waiting_for}")]
pub struct TimedOut {
    /// The operation that waited: `"sending"`, `"closing"`, ...
    pub op: &'static str,
    /// What it waited for, and where its bound is set or what may be wrong.
    pub waiting_for: &'static str,
    /// How long it waited.
    pub after: Duration,
}

/// What a send waits for when the peer has no credit left for us, or every send slot is in
/// flight ([`Error::timeout`]).
pub(crate) const WAIT_SEND: &str =
    "waiting for a credit from the peer or a free send slot (the peer \
                             is not taking its messages, or has gone)";

/// What a close waits for before its close message can go ([`Error::timeout`]).
pub(crate) const WAIT_CLOSE_CREDIT: &str =
    "waiting for a credit to send the close message (the peer \
                                     is not taking its messages, or has gone); \
                                     Config::close_timeout bounds this wait";

/// What a close waits for once its close message went ([`Error::timeout`]).
pub(crate) const WAIT_CLOSE_ACK: &str =
    "waiting for the peer to acknowledge the close message (it \
                                  may have gone); Config::close_timeout bounds this wait";

/// The short text of an I/O error, for a message whose source it is: the OS's description
/// without ` (os error N)`, first letter in lower case (`connection refused`); for a limit on
/// open descriptors (`EMFILE`, `ENFILE`), which one and what to do
/// ([`rdmsg_verbs::FdLimit`]). The layers above format their own I/O errors with it too.
#[derive(Debug)]
pub struct Brief<'a>(pub &'a io::Error);

impl std::fmt::Display for Brief<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(limit) = rdmsg_verbs::FdLimit::of(self.0) {
            return limit.fmt(f);
        }
        let text = self.0.to_string();
        let text = match self.0.raw_os_error() {
            Some(n) => text
                .strip_suffix(&format!(" (os error {n})"))
                .unwrap_or(&text),
            None => &text,
        };
        let mut chars = text.chars();
        match (chars.next(), chars.next()) {
            (Some(a), Some(b)) if a.is_uppercase() && !b.is_uppercase() => {
                write!(f, "{}{}", a.to_lowercase(), &text[a.len_utf8()..])
            }
            _ => f.write_str(text),
        }
    }
}

/// After a failed connect: what the usual causes mean.
struct ConnectHint<'a>(&'a io::Error);

impl std::fmt::Display for ConnectHint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.kind() {
            io::ErrorKind::ConnectionRefused => f.write_str(
                " (nothing listens there: start the peer's Listener or Hub first, or check the \
                 address and port)",
            ),
            io::ErrorKind::TimedOut => f.write_str(
                " (the host did not answer: check the address, and that a firewall lets the \
                 port through)",
            ),
            _ => Ok(()),
        }
    }
}

/// After a failed listen: what the usual cause means.
struct ListenHint<'a>(&'a io::Error);

impl std::fmt::Display for ListenHint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.kind() {
            io::ErrorKind::AddrInUse => f.write_str(
                " (another process, or an earlier run of this one, holds the port: pick \
                 another, or port 0 for any free one)",
            ),
            _ => Ok(()),
        }
    }
}

/// An [`Error::Connection`]: a close reads as what it is, anything else as a failure.
struct Ended<'a>(&'a Failure);

impl std::fmt::Display for Ended<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Failure::PeerClosed | Failure::Closed | Failure::CloseTimedOut => self.0.fmt(f),
            failure => write!(f, "connection failed: {failure}"),
        }
    }
}

// By hand rather than `#[from]`, which would also make the failure the error's source and print
// its text twice in a chain.
impl From<Failure> for Error {
    fn from(f: Failure) -> Self {
        Error::Connection(f)
    }
}

/// Why a connection stopped working. Sticky: once failed, a connection keeps reporting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The peer closed the connection gracefully; everything it sent was delivered.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// The peer's bootstrap stream ended (or, over rdma_cm, it disconnected) without a close:
    /// its process is gone, or its side of the connection failed. Or its host stopped
    /// answering: TCP keepalive on the stream, liveness probes over rdma_cm
    /// ([`Config::keepalive`](crate::Config::keepalive)).
    #[error("the peer vanished (its side ended without a graceful close, or its host stopped answering)")]
    PeerVanished,
    /// Our queue pair entered the error state with no completion error or asynchronous event
    /// to explain it (every posted receive was flushed).
    #[error("the queue pair entered the error state")]
    QpError,
    /// This side closed the connection.
    #[error("the connection was closed locally")]
    Closed,
    /// This side closed the connection, but the peer had not taken our close message within
    /// `close_timeout`: what went last may not have reached it.
    #[error(
        "the connection was closed locally before the peer took the close (close_timeout ran out)"
    )]
    CloseTimedOut,
    /// A work request completed with an error (for example `RetryExcErr`: the peer's queue
    /// pair no longer answers).
    #[error("a work request completed with {status:?} (vendor error {vendor_err:#x})")]
    Completion {
        /// Completion status.
        status: WcStatus,
        /// Completion opcode (undefined on error completions, whose opcode the device may
        /// leave unset).
        opcode: WcOpcode,
        /// Provider-specific error.
        vendor_err: u32,
    },
    /// An asynchronous event concerning this connection's queue pair or completion queues.
    #[error("asynchronous event {0:?}")]
    AsyncEvent(AsyncEventKind),
    /// The peer broke the credit protocol.
    #[error("protocol violation: {0}")]
    Protocol(Violation),
    /// A message without the immediate data every rdmsg message carries.
    #[error("protocol violation: message without immediate data")]
    MissingImm,
    /// A verb the connection drives failed locally (a send or receive could not be posted,
    /// a completion queue could not be polled or armed, the channel could not be waited on):
    /// it would fail again, and credits taken for a lost post cannot be accounted for.
    #[error("{op} failed{}", errno_suffix(*errno))]
    Local {
        /// What the connection was doing.
        op: &'static str,
        /// The OS error number, if the failure carried one.
        errno: Option<i32>,
    },
    /// A resumable session's connection was lost and the peer refused the resume: it has no
    /// such session (its process restarted, or the session ended there). Nothing more of
    /// the session can reach it.
    #[error("the peer refused to resume the session (it restarted, or the session ended there)")]
    ResumeRefused,
    /// The peer wrote something other than a goodbye on the bootstrap stream after the
    /// handshake: a buggy or hostile peer, or something else speaking on the stream.
    #[error("protocol violation: unexpected byte {byte:#04x} on the bootstrap stream after the handshake")]
    BootstrapGarbage {
        /// The first unexpected byte.
        byte: u8,
    },
}

fn errno_suffix(errno: Option<i32>) -> String {
    let Some(n) = errno else {
        return String::new();
    };
    let e = io::Error::from_raw_os_error(n);
    match rdmsg_verbs::FdLimit::of(&e) {
        Some(limit) => format!(": {limit}"),
        None => format!(" ({e})"),
    }
}

impl Failure {
    /// Whether a network can cause this failure, so that a session may resume after it on a
    /// new connection ([`Config::resume_window`](crate::Config::resume_window)): the peer
    /// vanished or stopped answering (retries exceeded, requests flushed by the queue pair's
    /// error, an error state nothing explained, a fatal event on the queue pair). Not a close,
    /// a protocol violation, a local verb's failure or a completion queue overrun.
    pub fn may_resume(&self) -> bool {
        use rdmsg_verbs::{AsyncEventKind as Ev, WcStatus as S};
        match self {
            Failure::PeerVanished | Failure::QpError => true,
            Failure::Completion { status, .. } => {
                matches!(status, S::RetryExcErr | S::RnrRetryExcErr | S::WrFlushErr)
            }
            Failure::AsyncEvent(kind) => matches!(kind, Ev::QpFatal),
            _ => false,
        }
    }

    /// The failure an unsuccessful work completion stands for.
    pub fn of_completion(wc: &rdmsg_verbs::WorkCompletion) -> Self {
        Failure::Completion {
            status: wc.status(),
            opcode: wc.opcode(),
            vendor_err: wc.vendor_err(),
        }
    }
}

/// The error number behind an error, if any of its sources is an OS error.
pub(crate) fn errno_of(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io.raw_os_error();
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_is_found_anywhere_in_the_chain() {
        let e = Error::Verbs(rdmsg_verbs::Error::PollCq(io::Error::from_raw_os_error(5)));
        assert_eq!(errno_of(&e), Some(5));
        assert_eq!(errno_of(&Error::Config("x".into())), None);
        let f = Failure::Local {
            op: "polling the completion queues",
            errno: Some(5),
        };
        assert_eq!(
            f.to_string(),
            "polling the completion queues failed (Input/output error (os error 5))"
        );
    }

    #[test]
    fn messages_say_what_failed_and_what_to_do() {
        let os = io::Error::from_raw_os_error;
        let cases: Vec<(Error, &str)> = vec![
            (
                Error::Connect {
                    addr: "\"127.0.0.1:1\"".into(),
                    source: os(111),
                },
                "cannot connect to \"127.0.0.1:1\": connection refused (nothing listens there: \
                 start the peer's Listener or Hub first, or check the address and port)",
            ),
            (
                Error::Connect {
                    addr: "\"nowhere:1\"".into(),
                    source: io::ErrorKind::NotFound.into(),
                },
                "cannot connect to \"nowhere:1\": entity not found",
            ),
            (
                Error::Listen {
                    addr: "\"0.0.0.0:18600\"".into(),
                    source: os(98),
                },
                "cannot listen on \"0.0.0.0:18600\": address already in use (another process, \
                 or an earlier run of this one, holds the port: pick another, or port 0 for \
                 any free one)",
            ),
            (
                Error::Bootstrap {
                    stage: "reading the peer's hello",
                    source: os(104),
                },
                "bootstrap exchange failed while reading the peer's hello: connection reset by \
                 peer",
            ),
            (
                Error::timeout("closing", WAIT_CLOSE_ACK, Duration::from_secs(2)),
                "closing timed out after 2s waiting for the peer to acknowledge the close \
                 message (it may have gone); Config::close_timeout bounds this wait",
            ),
            (
                Error::timeout("sending", WAIT_SEND, Duration::from_millis(10))
                    .timeout_as("closing", WAIT_CLOSE_CREDIT),
                "closing timed out after 10ms waiting for a credit to send the close message \
                 (the peer is not taking its messages, or has gone); Config::close_timeout \
                 bounds this wait",
            ),
            (
                Error::timeout("sending", WAIT_SEND, Duration::from_millis(10)),
                "sending timed out after 10ms waiting for a credit from the peer or a free send \
                 slot (the peer is not taking its messages, or has gone)",
            ),
            (
                Error::TooLarge {
                    len: 5000,
                    max: 4096,
                },
                "message of 5000 bytes exceeds the largest this connection sends whole, 4096 \
                 bytes (the peer's Config::buf_size, or a hub's own if smaller): the transport \
                 sends a message in one buffer, so split it, or send it through a Session or \
                 typed Hub, which fragment",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }

    /// What `EMFILE` (24 on Linux) reads as, with the process's soft limit as it is now.
    fn emfile_text() -> String {
        let now = rdmsg_verbs::fd_limit().map_or(String::new(), |n| format!(", currently {n}"));
        format!(
            "too many open files (EMFILE): this process reached its descriptor limit (`ulimit \
             -n`{now}): raise it, or serve many peers from one `Hub` (one descriptor per peer; a \
             session holds about 9) instead of a session each"
        )
    }

    #[test]
    fn a_descriptor_limit_says_so_wherever_it_is_met() {
        let os = io::Error::from_raw_os_error;
        let emfile = emfile_text();
        let cases: Vec<(Error, String)> = vec![
            (
                Error::WakePipe(os(24)),
                format!("cannot create the receive pool's wake-up pipe: {emfile}"),
            ),
            (
                Error::Bootstrap {
                    stage: "accepting",
                    source: os(24),
                },
                format!("bootstrap exchange failed while accepting: {emfile}"),
            ),
            (
                Error::Connect {
                    addr: "\"127.0.0.1:7000\"".into(),
                    source: os(24),
                },
                format!("cannot connect to \"127.0.0.1:7000\": {emfile}"),
            ),
            (
                Error::Listen {
                    addr: "\"0.0.0.0:7000\"".into(),
                    source: os(24),
                },
                format!("cannot listen on \"0.0.0.0:7000\": {emfile}"),
            ),
            (
                Error::Verbs(rdmsg_verbs::Error::CreateCompChannel(os(24))),
                format!("ibv_create_comp_channel failed: {emfile}"),
            ),
            (
                Error::Verbs(rdmsg_verbs::Error::WaitFd {
                    call: "epoll_create1",
                    fd: -1,
                    source: os(24),
                }),
                format!("epoll_create1 failed: {emfile}"),
            ),
            (
                Error::Connection(Failure::Local {
                    op: "waiting on the completion channel",
                    errno: Some(24),
                }),
                format!("connection failed: waiting on the completion channel failed: {emfile}"),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
        // ENFILE (23) too, as the system's limit.
        let e = Error::Bootstrap {
            stage: "accepting",
            source: os(23),
        };
        assert!(
            e.to_string().starts_with(
                "bootstrap exchange failed while accepting: too many open files in the system \
                 (ENFILE): the system reached its limit on open files (`sysctl fs.file-max`)"
            ),
            "{e}"
        );
        // Other errors are shown as before.
        assert_eq!(
            Brief(&os(104)).to_string(),
            "connection reset by peer",
            "no hint for other errors"
        );
    }

    #[test]
    fn a_close_reads_as_a_close_and_a_failure_as_a_failure() {
        let cases = [
            (Failure::PeerClosed, "the peer closed the connection"),
            (Failure::Closed, "the connection was closed locally"),
            (
                Failure::CloseTimedOut,
                "the connection was closed locally before the peer took the close \
                 (close_timeout ran out)",
            ),
            (
                Failure::PeerVanished,
                "connection failed: the peer vanished (its side ended without a graceful close, \
                 or its host stopped answering)",
            ),
            (
                Failure::QpError,
                "connection failed: the queue pair entered the error state",
            ),
        ];
        for (f, want) in cases {
            assert_eq!(Error::Connection(f).to_string(), want);
        }
    }

    #[test]
    fn a_peer_that_could_not_set_up_its_side_may_have_hit_its_limits() {
        assert_eq!(
            Error::Rejected(Reject::Resources).to_string(),
            "the peer rejected our handshake: the peer could not set up its side of the \
             connection (its queue pair, buffers or descriptors): it may have reached its \
             descriptor limit (`ulimit -n`) or locked-memory limit (`ulimit -l`); the error on \
             its side says which"
        );
    }
}
