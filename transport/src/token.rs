//! What each descriptor in a driver's epoll set is: one [`Token`] for the connection's and the
//! hub's sets, as a bit of [`ReadyWatch::wait`](rdmsg_verbs::ReadyWatch::wait)'s mask (a
//! connection) or as a key of `wait_keys` (a hub, with a stream per connection slot).

/// A descriptor of a driver's epoll set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Token {
    /// The completion channel: its events say which CQ fired.
    Channel,
    /// The wake-up socket: a received message's buffer came back while the driver slept, a
    /// thread sharing it has news, or an asynchronous event was routed to it.
    Wake,
    /// The device's asynchronous-event descriptor (watched exclusively: one sleeper of the
    /// device is woken and routes every event).
    Async,
    /// The hub's listening socket.
    Listen,
    /// The event channel of the hub's rdma_cm listener.
    CmListen,
    /// A bootstrap stream (a connection's own, or that of a hub's slot), or the event channel
    /// of a slot's rdma_cm id.
    Stream(u32),
}

/// Keys at and above this are streams: `STREAM | slot`.
const STREAM: u64 = 1 << 32;

impl Token {
    /// As a key of `ReadyWatch::add_keyed`.
    pub(crate) const fn key(self) -> u64 {
        match self {
            Token::Channel => 0,
            Token::Wake => 1,
            Token::Async => 2,
            Token::Listen => 3,
            Token::CmListen => 4,
            Token::Stream(slot) => STREAM | slot as u64,
        }
    }

    /// The token of a key [`Token::key`] made.
    pub(crate) fn of_key(key: u64) -> Option<Self> {
        Some(match key {
            0 => Token::Channel,
            1 => Token::Wake,
            2 => Token::Async,
            3 => Token::Listen,
            4 => Token::CmListen,
            k if k & STREAM != 0 => Token::Stream((k & !STREAM) as u32),
            _ => return None,
        })
    }

    /// As a bit index of `ReadyWatch::add` (one stream only: a connection's).
    pub(crate) const fn bit(self) -> u8 {
        match self {
            Token::Channel => 0,
            Token::Wake => 1,
            Token::Async => 2,
            Token::Listen => 3,
            Token::CmListen => 5,
            Token::Stream(_) => 4,
        }
    }

    /// Whether this token's bit is set in `mask`.
    pub(crate) const fn in_mask(self, mask: u64) -> bool {
        mask & (1 << self.bit()) != 0
    }
}

/// The bits of a TCP [`Listener`](crate::Listener)'s epoll set: the listening socket, and
/// each pending handshake's stream by its place in the listener's table.
pub(crate) mod listener {
    /// The listening socket.
    pub(crate) const LISTEN: u8 = 0;

    /// The stream of the pending handshake in place `i` (at most 62 places: a bit each).
    pub(crate) const fn pending(i: usize) -> u8 {
        i as u8 + 1
    }
}

/// The keys of a [`CmListener`](crate::CmListener)'s epoll set: its own event channel, and
/// each pending accept's event and completion channels by their descriptors (never this key,
/// nor 0: a CM channel is opened after stdin).
pub(crate) mod cm_listener {
    use std::os::fd::{AsFd, AsRawFd};

    /// The listener's own event channel.
    pub(crate) const LISTENER: u64 = u64::MAX;

    /// The key of a pending accept's descriptor `fd`.
    pub(crate) fn descriptor(fd: &impl AsFd) -> u64 {
        fd.as_fd().as_raw_fd() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for t in [
            Token::Channel,
            Token::Wake,
            Token::Async,
            Token::Listen,
            Token::CmListen,
            Token::Stream(0),
            Token::Stream(1 << 20),
        ] {
            assert_eq!(Token::of_key(t.key()), Some(t));
        }
        assert_eq!(Token::of_key(7), None);
    }
}
