//! Errors of the message layer.

use crate::frame::FrameError;

/// Result alias for msg.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A message-layer failure. [`Error::is_fatal`] says whether the session can go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection failed (fatal) or a transport call was refused.
    #[error("transport failure")]
    Transport(#[from] transport::Error),
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
    /// A frame that was dropped.
    #[error("bad frame dropped")]
    BadFrame(#[from] FrameError),
    /// A tag nobody registered: the message was dropped.
    #[error("unknown message tag {0:#010x}")]
    UnknownTag(u32),
    /// Every receiver of a dispatcher channel for this tag is gone: the message was dropped.
    #[error("no receiver left for message tag {0:#010x}")]
    ReceiverGone(u32),
    /// `decode` asked for another type than the message has.
    #[error("message has tag {got:#010x}, not {expected:#010x}")]
    WrongType {
        /// The tag of the type asked for.
        expected: u32,
        /// The message's tag.
        got: u32,
    },
    /// A message larger than the configured bound.
    #[error("message of {len} bytes exceeds {max} bytes")]
    TooLarge {
        /// Encoded length.
        len: usize,
        /// The bound.
        max: usize,
    },
}

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
}

impl Error {
    /// Whether the session is unusable after this error. Bad frames, unknown tags and
    /// undecodable bodies only cost the message concerned.
    pub fn is_fatal(&self) -> bool {
        matches!(self, Error::Transport(transport::Error::Connection(_)))
    }

    /// Whether this is the peer's graceful close: everything it sent has been received.
    pub fn is_peer_closed(&self) -> bool {
        matches!(
            self,
            Error::Transport(transport::Error::Connection(transport::Failure::PeerClosed))
        )
    }
}
