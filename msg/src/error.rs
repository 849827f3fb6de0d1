//! Errors of the message layer.

use std::fmt;
use std::sync::Arc;

use crate::frame::FrameError;

/// What became of a call's request when its connection failed ([`Error::CallFailed`]), as the
/// delivery record tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestFate {
    /// It never left this side (it waited in a hub's outbox, or its peer's handshake failed):
    /// the peer never saw it, and sending it elsewhere cannot do its work twice.
    NotSent,
    /// The peer's application took it (its delivery record said so): it may have acted on it.
    Taken,
    /// It went, and the peer's application had not said it took it when the connection
    /// failed: it may or may not have.
    Unknown,
}

impl fmt::Display for RequestFate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RequestFate::NotSent => "its request was never sent",
            RequestFate::Taken => {
                "the peer's application took its request (and may have acted on it)"
            }
            RequestFate::Unknown => {
                "its request was sent, and whether the peer's application took it is unknown"
            }
        })
    }
}

/// " to peer N.G", or nothing (a session's call).
struct OnPeer(Option<rdmsg_transport::PeerId>);

impl fmt::Display for OnPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(p) => write!(f, " to {p}"),
            None => Ok(()),
        }
    }
}

/// Result alias for msg.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A message-layer failure. [`Error::is_fatal`] says whether the session can go on.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection failed (fatal) or a transport call was refused.
    #[error(transparent)]
    Transport(#[from] rdmsg_transport::Error),
    /// A message could not be serialized.
    #[error("cannot encode message with tag {tag:#010x}")]
    Encode {
        /// Its tag.
        tag: u32,
        /// Why.
        #[source]
        source: bincode::error::EncodeError,
    },
    /// A body could not be deserialized (truncated, invalid, trailing bytes): the message
    /// was dropped.
    #[error("cannot decode message with tag {tag:#010x}")]
    Decode {
        /// Its tag.
        tag: u32,
        /// Why.
        #[source]
        source: DecodeFailure,
    },
    /// A frame that was dropped (its fault in the message: the frame error is not repeated as
    /// a source).
    #[error("bad frame dropped: {0}")]
    BadFrame(FrameError),
    /// A message of a tag no type is registered for on this side (with the session, hub or
    /// dispatcher that received it): it was dropped. The message lists the types registered
    /// and says what to do: register the sender's type here, or make both programs agree on
    /// its tag.
    #[error(
        "received a message of tag {tag:#010x}, but no type is registered under that tag here \
         ({}): register the sender's type on this side (`register::<T>()`, or a Dispatcher \
         route), or check that both programs give the type the same tag (its name as written \
         in `message!(T)`, or `message!(T, tag = \"...\")`)",
        Registered(.registered)
    )]
    UnknownTag {
        /// The message's tag.
        tag: u32,
        /// The types registered on this side, by name (`std::any::type_name`), with their tags.
        registered: Arc<[(&'static str, u32)]>,
    },
    /// Every receiver of a dispatcher channel for this tag is gone: the message was dropped.
    #[error("no receiver left for message tag {0:#010x}")]
    ReceiverGone(u32),
    /// A message was dispatched without its peer (from a session) to a route that needs one
    /// (`Dispatcher::on_from`, `Dispatcher::channel_from`): it was dropped.
    #[error("message tag {0:#010x} is routed to a handler of hub peers but came without a peer")]
    NoPeer(u32),
    /// `decode` asked for another type than the message has: nothing was decoded. Check
    /// [`Envelope::is`](crate::Envelope::is) (or match on the tag) before decoding.
    #[error(
        "decode::<{expected}>() on a message of {}: check `env.is::<T>()` (or match on \
         `env.tag()`) before decoding, or check that the sender sent the type you expect",
        Actual { tag: *.tag, actual: *.actual, expected_tag: *.expected_tag }
    )]
    WrongType {
        /// The type asked for (`std::any::type_name`).
        expected: &'static str,
        /// Its tag.
        expected_tag: u32,
        /// The message's tag.
        tag: u32,
        /// The type registered under the message's tag on this side, if the decoder that
        /// received it knew one.
        actual: Option<&'static str>,
    },
    /// A message sent by rendezvous could not be read (the connection failed under the read,
    /// or the sender's memory was not what its descriptor said): the message is lost, and
    /// the connection's failure follows.
    #[error("message {seq} (tag {tag:#010x}) could not be read from the peer")]
    ReadFailed {
        /// Its tag.
        tag: u32,
        /// Its sequence number.
        seq: u32,
    },
    /// A message sent by rendezvous could not be read because no buffer could be registered
    /// for it (the memory-lock limit, `RLIMIT_MEMLOCK`, is a common cause): it was refused
    /// alone and its sender told to free it; the connection goes on.
    #[error(
        "message {seq} (tag {tag:#010x}) could not be read: no buffer for it{}",
        OsCause(.source)
    )]
    ReadRefused {
        /// Its tag.
        tag: u32,
        /// Its sequence number.
        seq: u32,
        /// Why the registration failed.
        #[source]
        source: rdmsg_transport::Error,
    },
    /// A graceful close ran out of `close_timeout` before the peer finished reading the
    /// messages this side lent it by rendezvous: the connection is closed all the same, and
    /// the peer's reads of those messages fail (it learns so as `ReadFailed`). Resend them
    /// elsewhere if they matter.
    #[error(
        "closed before the peer read {messages} message(s) lent to it (close_timeout ran out): \
         their reads fail"
    )]
    Unread {
        /// Messages the peer had not finished reading.
        messages: usize,
    },
    /// A close gave up on messages committed to go (see
    /// [`Session::commit_as`](crate::Session::commit_as); for [`crate::Hub::close`], posts
    /// waiting in the peer's outbox too) that found no room within `close_timeout`: they
    /// were not sent (the connection is closed all the same; with
    /// [`crate::SessionConfig::keep_unconfirmed`] they are among the messages not confirmed).
    #[error(
        "closed with {messages} committed message(s) unsent: the peer gave no room for them \
         within close_timeout (raise Config::close_timeout, or make sure the peer reads)"
    )]
    Unsent {
        /// Committed messages not sent.
        messages: usize,
    },
    /// A hub's peer sent part of a message in fragments, then no fragment of it for
    /// [`crate::HubLimits::reassembly_timeout`] (a stopped or stalled sender): the
    /// message is dropped in its place (the peer's messages before and after it are
    /// delivered), and what it held of the hub's reassembly budget goes back to other peers.
    /// Fragments of it that come later are dropped quietly.
    #[error(
        "message {seq} (tag {tag:#010x}) in fragments got no fragment for {after:?} after \
         {received} bytes: dropped (raise HubLimits::reassembly_timeout if the peer is \
         that slow)"
    )]
    ReassemblyTimedOut {
        /// Its tag.
        tag: u32,
        /// Its sequence number.
        seq: u32,
        /// Body bytes received of it.
        received: usize,
        /// The timeout that ran out ([`crate::HubLimits::reassembly_timeout`]).
        after: std::time::Duration,
    },
    /// A message larger than [`crate::SessionConfig::max_message`] (on this side: a sender
    /// refuses to send it, a receiver drops it). Both sides must allow it: raise
    /// `max_message` on both. [`Bulk`](crate::Bulk) payloads count towards it too.
    #[error(
        "message of {len} bytes exceeds SessionConfig::max_message ({max} bytes) on this side: \
         raise max_message on both sides (the sender refuses larger messages, the receiver \
         drops them)"
    )]
    TooLarge {
        /// Encoded length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// A message that would go in fragments needs more than a frame's fragment index can
    /// count (65,536 fragments of one receive buffer of the peer's each): it was not sent.
    #[error(
        "message of {len} bytes needs more than 65536 fragments (at most {max} bytes go in \
         fragments of the peer's receive buffers): let it go by rendezvous \
         (SessionConfig::rendezvous_threshold, and the peer's Config::max_read_bytes), or \
         raise the peer's Config::buf_size"
    )]
    TooManyFragments {
        /// Encoded length.
        len: usize,
        /// The most that fragments of the peer's buffers hold.
        max: usize,
    },
    /// A type was registered for a tag that another registration already holds (two types
    /// with the same name, a type registered twice, or a real FNV-1a collision). Declare a
    /// distinct tag with `rdmsg_msg::message!(T, tag = "...")`.
    #[error("tag {tag:#010x} of {new} is already registered for {existing}")]
    DuplicateTag {
        /// The tag.
        tag: u32,
        /// The type registered first (`std::any::type_name`).
        existing: &'static str,
        /// The type whose registration was refused.
        new: &'static str,
    },
    /// A call's deadline passed before its answer came (the request may or may not have
    /// been served; an answer that comes later is dropped and counted late).
    #[error(
        "call {request} timed out after {after:?} without an answer (the server is slow, \
         stalled or gone; a later answer is dropped): give the call a longer timeout or check \
         the server"
    )]
    CallTimedOut {
        /// The request type.
        request: &'static str,
        /// The call's timeout.
        after: std::time::Duration,
    },
    /// The server dropped the request's [`crate::Responder`] without answering.
    #[error("call {request} was not answered: the server dropped its responder unanswered")]
    NoAnswer {
        /// The request type.
        request: &'static str,
    },
    /// The server does not take requests of this type: it registered types, and not this
    /// one.
    #[error(
        "call {request} was refused: the server registered its types and not this one \
         (register it there with `register::<{request}>()`)"
    )]
    NotServed {
        /// The request type.
        request: &'static str,
    },
    /// The connection a call went over failed before its answer came: which call, to which
    /// peer, and what became of its request, so that the caller knows whether sending it
    /// elsewhere could do its work twice.
    #[error("call {request}{} failed: {fate}: {source}", OnPeer(*.peer))]
    CallFailed {
        /// The request type.
        request: &'static str,
        /// The peer called (a hub's calls; `None` for a session's).
        peer: Option<rdmsg_transport::PeerId>,
        /// What became of the request.
        fate: RequestFate,
        /// Why the connection failed.
        #[source]
        source: Box<Error>,
    },
    /// A request or an answer whose call header is malformed (a confused or lying peer): it
    /// was dropped.
    #[error("bad call frame dropped: {reason}")]
    BadCall {
        /// What was wrong.
        reason: &'static str,
    },
    /// A [`crate::Responder`] handed to another session or hub than the one its request came
    /// through: nothing was sent (answer it with [`crate::Responder::respond`], or through
    /// the session or hub that received the request).
    #[error("this responder answers a request received by another session or hub")]
    ForeignResponder,
    /// [`crate::Hub::watch`] was given a call started by another session or hub: the call is
    /// cancelled (its handle was consumed).
    #[error("this call was started by another session or hub")]
    ForeignCall,
    /// [`crate::Envelope::responder`] on a message that is not a request (or whose responder
    /// was taken already).
    #[error("this {request} message is not a request waiting for an answer (sent with `send`, or its responder was taken already)")]
    NotARequest {
        /// The request type asked for.
        request: &'static str,
    },
    /// The session could not resume on a new connection after its connection was lost
    /// (fatal: the session has ended, with its delivery record as it stood).
    #[error("the session cannot resume: {0}")]
    CannotResume(Unresumable),
}

/// Why a session could not resume on a new connection ([`Error::CannotResume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unresumable {
    /// The peer counts fewer of our messages taken than it told us before: its numbers are
    /// gone, as when its process restarted. What it took before is in the delivery record;
    /// what followed is not known.
    #[error(
        "the peer counts {peer} of our messages taken, behind the {known} it told us before: \
         it restarted (its numbers are gone)"
    )]
    PeerRestarted {
        /// The count the peer told us before.
        known: u64,
        /// The count it gives now (modulo 2^32).
        peer: u32,
    },
    /// The peer counts more of our messages taken than we sent: a confused or lying peer.
    #[error(
        "the peer counts {peer} of our messages taken (modulo 2^32), beyond the {sent} we sent"
    )]
    BeyondSent {
        /// Messages we sent.
        sent: u64,
        /// The count the peer gives (modulo 2^32).
        peer: u32,
    },
    /// No copies of the unconfirmed messages are kept
    /// ([`SessionConfig::keep_unconfirmed`](crate::SessionConfig::keep_unconfirmed)), so
    /// they cannot go again.
    #[error("copies of unconfirmed messages are not kept, so they cannot be sent again")]
    NoCopies,
    /// The peer has no such session: its process restarted (its numbers are gone), or the
    /// session ended on its side (its window ran out, or it closed).
    #[error("the peer has no such session: it restarted, or the session ended on its side")]
    UnknownSession,
    /// The first frame on the new connection was not the peer's resume frame: a peer that
    /// does not follow the protocol.
    #[error("the peer's first frame on the new connection was not its resume frame")]
    NoCount,
}

// `Debug` is the report (see `Report`): advice, not variants.
rdmsg_verbs::debug_as_report!(Error);

// By hand rather than `#[from]`, which would also make the frame error the error's source and
// print its text twice in a chain.
impl From<FrameError> for Error {
    fn from(e: FrameError) -> Self {
        Error::BadFrame(e)
    }
}

/// Most registered types an [`Error::UnknownTag`] names.
const NAMED_TYPES: usize = 8;

/// The registered types as an [`Error::UnknownTag`] lists them.
struct Registered<'a>(&'a [(&'static str, u32)]);

impl fmt::Display for Registered<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none are registered");
        }
        f.write_str("registered: ")?;
        for (i, (name, tag)) in self.0.iter().take(NAMED_TYPES).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name} {tag:#010x}")?;
        }
        if self.0.len() > NAMED_TYPES {
            write!(f, " and {} more", self.0.len() - NAMED_TYPES)?;
        }
        Ok(())
    }
}

/// ` (cannot allocate memory)`: the OS error behind a transport error, in short, for a message
/// whose source that error is (the OS's reason shows without printing the chain); nothing if
/// none is.
struct OsCause<'a>(&'a rdmsg_transport::Error);

impl fmt::Display for OsCause<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(self.0);
        while let Some(e) = cur {
            if let Some(os) = e.downcast_ref::<std::io::Error>() {
                return write!(f, " ({})", rdmsg_transport::Brief(os));
            }
            cur = e.source();
        }
        Ok(())
    }
}

/// The message an [`Error::WrongType`] was asked to decode.
struct Actual {
    tag: u32,
    actual: Option<&'static str>,
    expected_tag: u32,
}

impl fmt::Display for Actual {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.actual {
            Some(name) => write!(f, "type {name} (tag {:#010x}", self.tag)?,
            None => write!(
                f,
                "tag {:#010x} (no type is registered under it here",
                self.tag
            )?,
        }
        write!(
            f,
            "; the type asked for has tag {:#010x})",
            self.expected_tag
        )
    }
}

/// What a send that timed out waited for, by the message layer's waits (see
/// [`rdmsg_transport::TimedOut`]).
pub(crate) const WAIT_RECORD: &str = "waiting for the peer's application to take earlier \
    messages (16,384 are untaken, or the copies SessionConfig::keep_unconfirmed keeps are at \
    their bound): the peer is not receiving, or has gone";

/// What a send waits for while the rest of an earlier message waits to go.
pub(crate) const WAIT_COMMITTED: &str = "waiting for credits to send the rest of an earlier \
    message (the peer is not taking its messages, or has gone)";

/// What a send by rendezvous waits for.
pub(crate) const WAIT_LENT: &str = "waiting for the peer to finish reading earlier large \
    messages (SessionConfig::max_rendezvous_bytes bounds what it may be reading) or for a \
    credit (the peer is not taking its messages, or has gone)";

/// Why a body did not decode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeFailure {
    /// bincode refused it.
    #[error(transparent)]
    Bincode(#[from] bincode::error::DecodeError),
    /// It decoded without using every byte.
    #[error("{0} trailing bytes")]
    Trailing(usize),
    /// The decoded value would hold more than the bound ([`crate::SessionConfig::max_message`]):
    /// its strings, byte strings and container elements, counted as they are decoded, before
    /// anything that large is allocated.
    #[error("decoded message would exceed {max} bytes")]
    TooLarge {
        /// The bound.
        max: usize,
    },
    /// The decoded value would nest more than [`crate::codec::MAX_DEPTH`] levels deep
    /// (sequence and map elements, enum variants, options, newtypes), which could overflow the
    /// stack: a recursive type nested by the peer, refused before it is that deep.
    #[error("decoded message would nest more than {max} levels deep")]
    TooDeep {
        /// The depth limit.
        max: usize,
    },
}

impl Error {
    /// Whether this error will recur: the session is unusable (or the setup is wrong) and a
    /// loop that retries must stop. [`crate::Session::incoming`] and
    /// [`crate::Dispatcher::run`] end on the first fatal error.
    ///
    /// Not fatal, they cost only the message or the call concerned: bad frames, unknown tags,
    /// undecodable or mistyped bodies, messages too large or unencodable, a dispatcher channel
    /// nobody reads or a peer route given no peer, and the transport's
    /// [`Timeout`](rdmsg_transport::Error::Timeout) and
    /// [`TooLarge`](rdmsg_transport::Error::TooLarge). Fatal: a failed connection
    /// ([`rdmsg_transport::Failure`]), a verb, wait, wake-up pipe or bootstrap call that failed (it
    /// would fail again, and retrying it would spin), setup errors, a
    /// [`DuplicateTag`](Error::DuplicateTag), and any transport error this version does not
    /// know. For a [`crate::Hub`], a failed connection or an
    /// [`UnknownPeer`](rdmsg_transport::Error::UnknownPeer) is fatal to that peer only.
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::Transport(e) => transport_is_fatal(e),
            Error::DuplicateTag { .. } | Error::CannotResume(_) => true,
            Error::CallFailed { source, .. } => source.is_fatal(),
            Error::Encode { .. }
            | Error::Decode { .. }
            | Error::BadFrame(_)
            | Error::UnknownTag { .. }
            | Error::ReceiverGone(_)
            | Error::NoPeer(_)
            | Error::WrongType { .. }
            | Error::ReadFailed { .. }
            | Error::ReadRefused { .. }
            | Error::ReassemblyTimedOut { .. }
            | Error::Unread { .. }
            | Error::Unsent { .. }
            | Error::TooLarge { .. }
            | Error::TooManyFragments { .. }
            | Error::CallTimedOut { .. }
            | Error::NoAnswer { .. }
            | Error::NotServed { .. }
            | Error::NotARequest { .. }
            | Error::BadCall { .. }
            | Error::ForeignResponder
            | Error::ForeignCall => false,
        }
    }

    /// Whether this is the peer's graceful close: everything it sent has been received (a
    /// message it lent us but took back too soon came before, as
    /// [`ReadFailed`](Error::ReadFailed)).
    ///
    /// A call the close ended ([`Error::CallFailed`]) says so too.
    pub fn is_peer_closed(&self) -> bool {
        match self {
            Error::Transport(rdmsg_transport::Error::Connection(
                rdmsg_transport::Failure::PeerClosed,
            )) => true,
            Error::CallFailed { source, .. } => source.is_peer_closed(),
            _ => false,
        }
    }
}

/// `Ok` if the peer read everything it was lent before a close, else [`Error::Unread`].
pub(crate) fn unread_error(messages: usize) -> Result<()> {
    if messages == 0 {
        Ok(())
    } else {
        Err(Error::Unread { messages })
    }
}

/// `Ok` if a close sent everything committed, else [`Error::Unsent`].
pub(crate) fn unsent_error(messages: usize) -> Result<()> {
    if messages == 0 {
        Ok(())
    } else {
        Err(Error::Unsent { messages })
    }
}

/// Whether a transport error will recur. Only per-call errors are not fatal.
fn transport_is_fatal(e: &rdmsg_transport::Error) -> bool {
    use rdmsg_transport::Error as T;
    match e {
        // This message or this wait only: the next one may succeed. A full hub or receive
        // queue refuses this connection only.
        T::Timeout(_)
        | T::TooLarge { .. }
        | T::ReadTooLarge { .. }
        | T::HubFull { .. }
        | T::ReceiveQueueFull { .. } => false,
        // A failed connection stays failed; a verb, a wait, the wake-up pipe or the bootstrap
        // stream that failed fails again; setup errors do not go away by retrying.
        T::Connection(_)
        | T::Verbs(_)
        | T::Notify(_)
        | T::WakePipe(_)
        | T::Bootstrap { .. }
        | T::Listen { .. }
        | T::Connect { .. }
        | T::BadRecord(_)
        | T::BadHandshake(_)
        | T::Rejected(_)
        | T::Config(_)
        // A hub's connection that is gone stays gone.
        | T::UnknownPeer(_) => true,
        // `rdmsg_transport::Error` is non-exhaustive: a variant added later is fatal until it is
        // classified here, so that no loop spins on it.
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_send_that_timed_out_says_what_it_waited_for() {
        let ms = Duration::from_millis(10);
        let cases = [
            (
                WAIT_RECORD,
                "sending timed out after 10ms waiting for the peer's application to take \
                 earlier messages (16,384 are untaken, or the copies \
                 SessionConfig::keep_unconfirmed keeps are at their bound): the peer is not \
                 receiving, or has gone",
            ),
            (
                WAIT_COMMITTED,
                "sending timed out after 10ms waiting for credits to send the rest of an \
                 earlier message (the peer is not taking its messages, or has gone)",
            ),
            (
                WAIT_LENT,
                "sending timed out after 10ms waiting for the peer to finish reading earlier \
                 large messages (SessionConfig::max_rendezvous_bytes bounds what it may be \
                 reading) or for a credit (the peer is not taking its messages, or has gone)",
            ),
        ];
        for (waiting_for, want) in cases {
            let e = Error::from(rdmsg_transport::Error::timeout("sending", waiting_for, ms));
            assert_eq!(e.to_string(), want);
            assert!(!e.is_fatal());
        }
    }
}
