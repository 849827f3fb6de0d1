//! A peer's settings and counts, shared by both front ends ([`crate::Session`] and
//! [`crate::Hub`]) and the per-peer layer below them: here, so that the per-peer layer imports
//! nothing from a front end.

use std::time::Duration;

use crate::codec;

/// Bounds of a session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Largest message, encoded, and bound on what decoding one may allocate (its strings and
    /// container elements; see [`crate::DecodeFailure::TooLarge`]). Default 16 MiB.
    pub max_message: usize,
    /// Unsolicited messages in a row before the next is solicited anyway. Default: a quarter
    /// of the peer's receive depth.
    pub max_unsolicited_run: Option<u32>,
    /// Unsolicited bytes in a row before the next message is solicited anyway. Default 64 KiB.
    pub max_unsolicited_bytes: usize,
    /// How long a message sent unsolicited may go unnoticed by a peer asleep solicited-only.
    ///
    /// `None` (the default): until this session next waits. Before a receive (or an event
    /// loop's [`crate::Session::step`]) waits, whatever went unsolicited is flushed at once, and in
    /// a [split](crate::Session::split) session a message sent while the other half waits goes
    /// solicited. No wake-up is saved across a wait, and none is missed.
    ///
    /// `Some(d)`: at most `d`. The first message sent once `d` has passed since the oldest
    /// unsolicited one is solicited, and a wait flushes only when `d` runs out (it wakes for
    /// that), so unsolicited messages keep batching across waits. The bound holds while the
    /// session is in a call or any thread (or task) waits on it: a split or async session's
    /// receiver keeps it even when the sender has gone quiet. A session nobody calls cannot
    /// send, and flushes on its next call.
    pub max_unsolicited_delay: Option<Duration>,
    /// Messages whose encoding is at least this long (and longer than one of the peer's
    /// receive buffers) go by rendezvous: the peer reads them from our memory (see the
    /// [`rendezvous`](crate::rendezvous) module) instead of receiving them in fragments.
    /// `None`: always fragments (for a peer that must not read our memory). Messages that fit
    /// one receive buffer always go whole in one (inline, if small enough for the
    /// transport's `max_inline`). Default [`DEFAULT_RENDEZVOUS_THRESHOLD`].
    pub rendezvous_threshold: Option<usize>,
    /// Bound on the bytes of our messages the peer may be reading at once by rendezvous (a
    /// send beyond it waits for the peer's acknowledgements, taking in what arrives
    /// meanwhile). A message larger than this, or than the peer announced it reads
    /// ([`rdmsg_transport::Config::max_read_bytes`] on its side), is fragmented. What *we*
    /// read is bounded by our connection's (or hub's) `Config::max_read_bytes`, announced in
    /// the handshake: the registered memory our reads land in, shared by all peers of a
    /// hub. Holding received messages holds their buffers: as with receive buffers, a
    /// receiver that keeps that much unread stops the peer's large messages. Default 64 MiB.
    pub max_rendezvous_bytes: usize,
    /// Keep a copy of every message sent until the peer's application has taken it, up to
    /// this many bytes of copies (a send beyond it waits for the peer's record, as beyond
    /// its credits): after a failure or a close, [`crate::Session::take_unconfirmed`] (or
    /// [`crate::Session::close_with_record`], or the hub's [`crate::HubEvent::Unconfirmed`]) hands
    /// back the ones it did not take, in order, to be sent elsewhere. With copies kept, a
    /// close also waits (within `close_timeout`) until the peer's application has taken
    /// everything. `None` (the default): no copies; [`crate::Session::delivery`] still says what
    /// was taken.
    pub keep_unconfirmed: Option<usize>,
    /// Read once, when a hub is made, as its first [`crate::HubLimits::max_reassembly_bytes`].
    #[deprecated(note = "a hub's setting: HubLimits::max_reassembly_bytes (Hub::set_limits)")]
    pub max_reassembly_bytes: usize,
    /// Read once, when a hub is made, as its first [`crate::HubLimits::reassembly_timeout`].
    #[deprecated(note = "a hub's setting: HubLimits::reassembly_timeout (Hub::set_limits)")]
    pub reassembly_timeout: Duration,
    /// Bound on the bytes (encoded) a peer's outbox holds: a hub's posts
    /// ([`crate::Hub::post`]), and for a session or a hub, answers to the peer's requests
    /// given on other threads, waiting for its credits. A post beyond it is refused
    /// ([`crate::Posted::Full`]) and a [`crate::HubEvent::Writable`] follows once the outbox
    /// has drained to half of it; an answer beyond it becomes "no answer" (its caller learns
    /// at once, [`crate::Error::NoAnswer`]). One message always fits an empty outbox. So a
    /// slow or stalled peer costs at most this much memory, and never blocks the thread that
    /// drives it. Default 4 MiB.
    pub max_outbox_bytes: usize,
    /// Bound on the bytes of a peer's messages that a call's wait keeps for the next receive
    /// ([`crate::Session::wait`], [`crate::Session::poll_calls`], and the hub's, for each peer): messages
    /// that arrive while a call waits for its answer are moved out of their receive buffers
    /// (the peer may need those credits to send the answer) and kept, in order. Once this
    /// much is kept (one message always is), the wait takes no more of that peer's messages
    /// in: they stay unread in their receive buffers, holding its credits, so the peer
    /// stops; a call then ends with its answer if that was taken in already, with the
    /// connection's failure, or at its deadline ([`crate::Error::CallTimedOut`]). Receiving
    /// what is kept lets the rest in again. Counted as bodies plus a few dozen bytes each
    /// ([`crate::Session::held_bytes`]). Default 4 MiB.
    pub max_held_bytes: usize,
}

/// Default [`SessionConfig::rendezvous_threshold`]: 16 KiB (see the README for the
/// measurement behind it).
pub const DEFAULT_RENDEZVOUS_THRESHOLD: usize = 16 << 10;

/// Default [`crate::HubLimits::reassembly_timeout`]: 10 s.
pub const DEFAULT_REASSEMBLY_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for SessionConfig {
    // The two fields kept for code that sets them.
    #[allow(deprecated)]
    fn default() -> Self {
        Self {
            max_message: codec::DEFAULT_MAX_MESSAGE,
            max_unsolicited_run: None,
            max_unsolicited_bytes: 64 << 10,
            max_unsolicited_delay: None,
            rendezvous_threshold: Some(DEFAULT_RENDEZVOUS_THRESHOLD),
            max_rendezvous_bytes: 64 << 20,
            keep_unconfirmed: None,
            max_reassembly_bytes: 256 << 20,
            reassembly_timeout: DEFAULT_REASSEMBLY_TIMEOUT,
            max_outbox_bytes: 4 << 20,
            max_held_bytes: 4 << 20,
        }
    }
}

/// What a session did (or, in a [`crate::Hub`], what was exchanged with one peer, or with
/// all of them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Messages sent.
    pub sent: u64,
    /// Solicited frames that carried messages: a message's own (its last fragment's), or a
    /// packed frame's, counted once for all its messages.
    pub sent_solicited: u64,
    /// Of those, solicited by the policy rather than the caller.
    pub policy_solicited: u64,
    /// Messages that needed several frames.
    pub fragmented: u64,
    /// Frames sent.
    pub frames_sent: u64,
    /// Messages sent packed, several to a frame: a [`crate::Session::send_batch`]'s, and
    /// messages that queued up while the peer had no credit (committed ones, a hub's
    /// outbox).
    pub packed: u64,
    /// Payload-less solicited frames sent because a receive was about to wait while
    /// messages sent unsolicited had not woken the peer (see [`crate::Session::recv`]).
    pub wait_flushes: u64,
    /// Messages received.
    pub received: u64,
    /// Frames received: the receive buffers (and credits) the peer's messages, nudges and
    /// acknowledgements used. Below [`SessionStats::received`] when messages came packed.
    pub frames_received: u64,
    /// Frames dropped as malformed, out of order or of an unknown tag (a message of a packed
    /// frame refused alone counts as one).
    pub dropped_frames: u64,
    /// Messages sent by rendezvous (the peer read them from our memory).
    pub rendezvous_sent: u64,
    /// Messages received by rendezvous (read from the peer's memory).
    pub rendezvous_received: u64,
    /// Times a send waited for the peer to finish reading earlier messages
    /// ([`SessionConfig::max_rendezvous_bytes`]).
    pub rendezvous_waits: u64,
    /// Acknowledgements for messages that were not lent (a confused or lying peer); ignored.
    pub stray_acks: u64,
    /// Bytes registered for rendezvous reads now (for a hub: shared by its peers).
    pub rendezvous_registered: u64,
    /// Bytes of the messages sent: their encoded bodies (frame headers, fragments' framing,
    /// nudges, acknowledgements and rendezvous descriptors left out; a message sent by
    /// rendezvous counts its whole body).
    pub bytes_sent: u64,
    /// Bytes of the messages received, counted as [`SessionStats::bytes_sent`] counts them.
    pub bytes_received: u64,
    /// Credit stalls: times sends had to wait because the peer had no credit for us, each
    /// episode once (from the first send that found none until a send went, however many
    /// sends waited or were refused meanwhile). The connection's
    /// [`ConnStats::credit_stalls`](rdmsg_transport::ConnStats::credit_stalls).
    pub credit_waits: u64,
    /// Wake-ups. For a session, times its connection was woken by the completion channel
    /// ([`Connection::wakeups`](rdmsg_transport::Connection::wakeups): a receive or a send
    /// that slept until an event came, or a [`crate::Session::step`] after an event loop's wait that
    /// found one). For a hub's peer ([`crate::Hub::peer_stats`]), the hub's wake-ups
    /// ([`RawHub::wakeups`](rdmsg_transport::RawHub::wakeups)) that brought frames of that
    /// peer, each counted once however many frames it brought (what `received / wakeups`
    /// makes a batch); in a hub's totals, the sum over its peers.
    pub wakeups: u64,
    /// Messages committed to go ([`crate::Session::commit_as`]) that failed for a reason of their
    /// own when their turn came (their memory could not be registered, say) while the
    /// connection stayed up: dropped, unsent, each error returned once.
    pub committed_dropped: u64,
    /// Times the session resumed on a new connection after its connection was lost.
    pub resumes: u64,
    /// Messages sent again on a new connection because the peer's application had not taken
    /// them when the old one was lost.
    pub resumed_messages: u64,
    /// Time spent suspended, between losing a connection and resuming on the next (or
    /// failing at the end of the window).
    pub time_suspended: Duration,
}

impl SessionStats {
    /// Adds `other`'s counts: a hub's totals over its peers.
    pub(crate) fn add(&mut self, other: &SessionStats) {
        self.sent += other.sent;
        self.sent_solicited += other.sent_solicited;
        self.policy_solicited += other.policy_solicited;
        self.fragmented += other.fragmented;
        self.frames_sent += other.frames_sent;
        self.packed += other.packed;
        self.frames_received += other.frames_received;
        self.wait_flushes += other.wait_flushes;
        self.received += other.received;
        self.dropped_frames += other.dropped_frames;
        self.rendezvous_sent += other.rendezvous_sent;
        self.rendezvous_received += other.rendezvous_received;
        self.rendezvous_waits += other.rendezvous_waits;
        self.stray_acks += other.stray_acks;
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.credit_waits += other.credit_waits;
        self.wakeups += other.wakeups;
        self.committed_dropped += other.committed_dropped;
        self.resumes += other.resumes;
        self.resumed_messages += other.resumed_messages;
        self.time_suspended += other.time_suspended;
        self.rendezvous_registered = self.rendezvous_registered.max(other.rendezvous_registered);
    }
}
