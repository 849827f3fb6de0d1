//! How a connection is set up ([`Config`]), checked before anything is created, and the
//! faults a test can inject (feature `test-hooks`).

use std::time::Duration;

use rdmsg_notify::{ArmMode, Policy};

use crate::endpoint::PathParams;
use crate::error::{Error, Result};
use crate::handshake;

/// Most handshakes a listener runs at once (its watch tokens stay below 64).
pub(crate) const MAX_PENDING: u32 = 63;

/// How a connection is set up. Both sides announce their receive side in the handshake; the
/// send side adapts to the peer.
#[derive(Debug, Clone)]
pub struct Config {
    /// Size of each receive buffer: the largest message the peer may send us. Default 4096.
    pub buf_size: u32,
    /// Receive buffers for data messages: the credits the peer starts with. Default 64.
    pub recv_depth: u32,
    /// Extra receive buffers reserved for credit grants (3..=64). Default 3.
    pub grant_slots: u8,
    /// Send queue depth and number of send buffers. Default 64.
    pub send_depth: u32,
    /// Request a send completion every this many sends (at least 1). Default 16.
    pub signal_every: u32,
    /// Payloads up to this size are sent inline, without a send buffer (bounded by what the
    /// device grants). Default 64.
    pub max_inline: u32,
    /// How the receive queue is armed while waiting for messages. Default
    /// [`ArmMode::SolicitedOnly`]: only solicited messages (and errors) wake a receiver.
    pub recv_arm: ArmMode,
    /// How waits wait. Default [`Policy::Sleep`] (the least CPU); [`Policy::ADAPTIVE`] spins
    /// while messages come close together, for busy-polling latency at high rates and
    /// sleeping CPU at low ones; [`Policy::Poll`] never sleeps.
    pub policy: Policy,
    /// Path parameters of the queue pair.
    pub path: PathParams,
    /// Longest a whole handshake may take, whatever the peer does byte by byte (a
    /// [`Listener`](crate::Listener) runs many at once, each with its own deadline). Default
    /// 5 s.
    pub handshake_timeout: Duration,
    /// Largest receive buffer a peer may announce. Our send buffers are that big, so this is
    /// what a peer can make us register per send buffer; a bigger announcement is rejected
    /// ([`Reject::Limits`](crate::handshake::Reject::Limits)) before anything is allocated.
    /// Default 1 MiB.
    pub max_peer_buf_size: u32,
    /// Deepest receive queue a peer may announce (its initial credits are at most that).
    /// Default 65535 (the most credits one message can return).
    pub max_peer_recv_depth: u32,
    /// Most memory registered for send buffers (`send_depth` buffers of the peer's buffer
    /// size): beyond it, fewer send buffers are registered (at least one; a peer whose one
    /// buffer does not fit is rejected). A [`CmListener`](crate::CmListener) also keeps the
    /// receive buffers of all its handshakes under way within it (or one handshake's, if
    /// more), evicting the oldest beyond: a flood of requests that never complete (or never
    /// prove the key) pins no more. Default 64 MiB.
    pub max_send_memory: u64,
    /// Most handshakes a [`Listener`](crate::Listener) runs at once (1..=63); a new client
    /// beyond that evicts the oldest pending one. Default 32.
    pub max_pending_handshakes: u32,
    /// A pre-shared key both sides must prove they know (HMAC-SHA256 challenge-response over
    /// the handshake, see the `handshake` module); the server allocates nothing for a client
    /// that has not. Both sides must have the same key, or none. Default `None`.
    pub psk: Option<handshake::Psk>,
    /// Longest wait in [`Connection::close`](crate::Connection::close) for the close message to be delivered. Default 2 s.
    pub close_timeout: Duration,
    /// How long a peer *host* may stay silent before it is declared gone
    /// ([`Failure::PeerVanished`](crate::Failure::PeerVanished)), through TCP keepalive on the bootstrap stream (a peer
    /// process that dies is noticed at once by its stream's end; a host that dies or drops off
    /// the network sends nothing). `None`: never. Default 5 s; whole seconds, at least 3 s.
    /// The first half of it is idle, the second probes once a second (3 to 30 probes), and
    /// the peer is declared gone only when every probe went unanswered: on a lossy link,
    /// where probes are lost too, a longer limit makes false alarms much rarer (at 5 % loss
    /// each way, 3 probes all fail about once in a thousand rounds, 5 about once in 10^5).
    ///
    /// A connection made through rdma_cm has no stream, and the connection manager no
    /// keepalive: once a third of it passes with nothing from the peer, the connection posts
    /// a probe, a zero-length RDMA read that the peer's device answers without its process
    /// ([`ConnStats::probes`](crate::ConnStats::probes)); one still unanswered a third later
    /// means the peer is gone, so a dead host is noticed between two thirds of the limit and
    /// the whole of it. While an RDMA read of ours is under way (a probe behind it completes
    /// only once all its bytes have come), twice the limit.
    ///
    /// A hub (TCP or rdma_cm alike) watches peer *hosts*, not connections: its bootstrap
    /// streams have no TCP keepalive (ten thousand of them probing made a small machine drop
    /// the answers and end live connections). Every third of the limit, a connection whose
    /// own probe or signaled send went unanswered for a third ends as vanished; a host none
    /// of whose connections was heard from, and none of which has anything out, gets one
    /// probe; a silent host one of whose connections went unanswered gets two more probed,
    /// and when they too go unanswered all its connections end. So a dead host's connections
    /// end within about four thirds of the limit, and an idle host costs one probe per third
    /// (two, while the connection longest unheard is probed in turn), whatever its number of
    /// connections ([`HubStats::liveness_probes`](crate::HubStats::liveness_probes)).
    pub keepalive: Option<Duration>,
    /// Longest a sleeping connection goes without polling its queues for an error nothing
    /// woke it for. The verbs specification has an error completion fire even a solicited-only
    /// arm, but providers bend it: Linux 6.12's rxe does not wake a solicited-only receiver for
    /// receives flushed by a queue pair error, and rxe never marks send-side errors solicited.
    /// The send queue is armed for any completion while a signaled send is outstanding;
    /// this bound covers the rest. Costs one timer wake-up per interval while idle (not counted as a
    /// wake-up in [`rdmsg_notify::Stats`]). `None`: never. Default 1 s.
    pub health_check: Option<Duration>,
    /// Largest message this side reads from its peer's memory (rdmsg's typed layer sends
    /// large messages by RDMA read, see `rdmsg_msg::rendezvous`), and bound on what it
    /// registers for such reads: announced in the handshake, so that the peer sends larger
    /// ones in fragments instead of by a read we would refuse. Announced as at most half the
    /// process's locked-memory limit (`RLIMIT_MEMLOCK`) when that is finite, so that a peer
    /// cannot make us register what the system would refuse. Default 64 MiB; 0: we read
    /// nothing (the peer fragments everything).
    pub max_read_bytes: u32,
    /// How long a session over this connection may stay suspended after the connection was
    /// lost for a reason a network can cause (the peer vanished, its queue pair stopped
    /// answering), waiting for a new connection to resume on. The connecting side dials
    /// again through the same bootstrap, with jittered backoff; the accepting side's
    /// [`Listener`](crate::Listener) hands the new connection to the session whose token it
    /// carries (see [`Resume`](crate::Resume)), so the server must keep accepting. Both sides
    /// must set it (the server's accept `config` decides for it); the typed layer's `Session`
    /// then sends again what the peer had not taken and nothing twice (hubs, the tokio layer,
    /// split sessions and rdma_cm connections do not resume yet). `None` (the default): a
    /// lost connection ends the session.
    pub resume_window: Option<Duration>,
    /// Fault injection for tests (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub hooks: TestHooks,
}

/// Faults a test can inject into a connection's setup (feature `test-hooks`); never used
/// otherwise.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct TestHooks {
    /// Entries of the receive CQ instead of what the receive queue needs: provokes a CQ
    /// overrun.
    pub recv_cq_entries: Option<u32>,
    /// Credits announced to the peer beyond the receive buffers really posted: a lying peer,
    /// whose partner's excess sends meet receiver-not-ready.
    pub overstate_credits: u32,
    /// Bytes announced beyond the real size of each receive buffer: the partner's larger
    /// messages complete here with a local length error, a real error completion.
    pub overstate_buf_size: u32,
    /// Credits this side believes it has beyond what the peer granted: a lying sender, whose
    /// excess messages break the peer's credit books.
    pub extra_credits: u32,
    /// A hub's receive pool cannot grow: every registration for it fails (`ENOMEM`), as
    /// past `RLIMIT_MEMLOCK`.
    pub refuse_pool_growth: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            buf_size: 4096,
            recv_depth: 64,
            grant_slots: 3,
            send_depth: 64,
            signal_every: 16,
            max_inline: 64,
            recv_arm: ArmMode::SolicitedOnly,
            policy: Policy::Sleep,
            path: PathParams::default(),
            handshake_timeout: Duration::from_secs(5),
            max_peer_buf_size: 1 << 20,
            max_peer_recv_depth: 65_535,
            max_send_memory: 64 << 20,
            max_pending_handshakes: 32,
            psk: None,
            close_timeout: Duration::from_secs(2),
            keepalive: Some(Duration::from_secs(5)),
            health_check: Some(Duration::from_secs(1)),
            max_read_bytes: 64 << 20,
            resume_window: None,
            #[cfg(feature = "test-hooks")]
            hooks: TestHooks::default(),
        }
    }
}

impl Config {
    /// The largest read this side announces ([`Config::max_read_bytes`] within half the
    /// locked-memory limit).
    pub fn announced_max_read(&self) -> u32 {
        let pinnable = rdmsg_verbs::locked_memory_limit()
            .map_or(u64::MAX, |limit| limit / 2)
            .min(u64::from(u32::MAX)) as u32;
        self.max_read_bytes.min(pinnable)
    }

    #[cfg(feature = "test-hooks")]
    pub(crate) fn recv_cq_entries(&self) -> Option<u32> {
        self.hooks.recv_cq_entries
    }

    #[cfg(not(feature = "test-hooks"))]
    pub(crate) fn recv_cq_entries(&self) -> Option<u32> {
        None
    }

    /// What a peer's hello may ask of us.
    pub(crate) fn limits(&self) -> handshake::Limits {
        handshake::Limits {
            max_buf_size: self.max_peer_buf_size,
            max_recv_depth: self.max_peer_recv_depth,
            max_send_memory: self.max_send_memory,
            send_depth: self.send_depth,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Config(what.to_owned()));
        if !(handshake::MIN_BUF_SIZE..=handshake::MAX_BUF_SIZE).contains(&self.buf_size) {
            return bad("buf_size must be between 64 bytes and 1 GiB");
        }
        if self.recv_depth == 0 || self.recv_depth > 0xff_ffff {
            return bad("recv_depth must be between 1 and 2^24 - 1");
        }
        if self.grant_slots < 3 || self.grant_slots > handshake::MAX_GRANT_SLOTS {
            return bad("grant_slots must be between 3 and 64");
        }
        if self.send_depth == 0 || self.signal_every == 0 {
            return bad("send_depth and signal_every must be at least 1");
        }
        if self.path.rnr_retry > 6 {
            return bad("path.rnr_retry must be at most 6 (7 retries forever: a peer that lies about its buffers would hang us)");
        }
        if self.health_check.is_some_and(|h| h.is_zero()) {
            return bad("health_check must be longer than zero (None turns it off)");
        }
        if self.keepalive.is_some_and(|k| k < Duration::from_secs(3)) {
            return bad("keepalive must be at least 3 s (TCP keepalive counts whole seconds)");
        }
        if self.handshake_timeout.is_zero() {
            return bad("handshake_timeout must be longer than zero");
        }
        if !(handshake::MIN_BUF_SIZE..=handshake::MAX_BUF_SIZE).contains(&self.max_peer_buf_size) {
            return bad("max_peer_buf_size must be between 64 bytes and 1 GiB");
        }
        if self.max_peer_recv_depth == 0 {
            return bad("max_peer_recv_depth must be at least 1");
        }
        if self.max_send_memory < u64::from(handshake::MIN_BUF_SIZE) {
            return bad("max_send_memory must hold at least one 64-byte buffer");
        }
        if self.max_pending_handshakes == 0 || self.max_pending_handshakes > MAX_PENDING {
            return bad("max_pending_handshakes must be between 1 and 63");
        }
        if self
            .psk
            .as_ref()
            .is_some_and(|k| k.len() < handshake::Psk::MIN_LEN)
        {
            return bad("psk must be at least 16 bytes");
        }
        Ok(())
    }
}

/// Test hook: credits a lying sender believes it has beyond the peer's grant.
pub(crate) fn extra_credits(config: &Config) -> u32 {
    #[cfg(feature = "test-hooks")]
    return config.hooks.extra_credits;
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = config;
        0
    }
}

/// Verbs a test can make fail (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Polling and waiting fail, as on a completion queue or channel that can no longer be
    /// used.
    Poll,
    /// Posting a send fails (after its credit was taken).
    Post,
    /// Once the queue pair failed, one of its receives never comes back flushed (as from a
    /// provider slow to flush, or one that loses a flush): the drain lasts until its
    /// deadline. Nothing fails because of it.
    LostFlush,
}

/// What an injected fault reports: the error of a queue that can no longer be used (EIO, as
/// a provider reports for a queue it can no longer reach).
#[cfg(feature = "test-hooks")]
pub(crate) fn injected_fault(fault: Fault, qp_num: u32) -> Error {
    let source = std::io::Error::from_raw_os_error(5);
    Error::Verbs(match fault {
        Fault::Poll => rdmsg_verbs::Error::PollCq(source),
        Fault::Post | Fault::LostFlush => rdmsg_verbs::Error::PostSend { qp_num, source },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retrying_receiver_not_ready_for_ever_is_refused() {
        assert_eq!(Config::default().path.rnr_retry, 6, "finite by default");
        let mut c = Config::default();
        c.path.rnr_retry = 7;
        assert!(matches!(c.check(), Err(Error::Config(m)) if m.contains("rnr_retry")));
        c.path.rnr_retry = 6;
        assert!(c.check().is_ok());
    }

    #[test]
    fn the_health_check_is_bounded_and_can_be_turned_off() {
        assert_eq!(Config::default().health_check, Some(Duration::from_secs(1)));
        let mut c = Config {
            health_check: Some(Duration::ZERO),
            ..Config::default()
        };
        assert!(c.check().is_err());
        c.health_check = None;
        assert!(c.check().is_ok());
    }
}
