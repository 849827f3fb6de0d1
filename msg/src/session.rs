//! A message session over one transport connection.

use std::time::Duration;

use rdmsg_transport::Connection;

use crate::codec::{self, Decoder, Envelope, FrameBytes, NUDGE_TAG};
use crate::frame::{self, FIRST, LAST};
use crate::policy::SolicitPolicy;
use crate::{Message, Result};

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
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            max_message: codec::DEFAULT_MAX_MESSAGE,
            max_unsolicited_run: None,
            max_unsolicited_bytes: 64 << 10,
        }
    }
}

/// What a session did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Messages sent.
    pub sent: u64,
    /// Messages whose (last) frame was solicited.
    pub sent_solicited: u64,
    /// Of those, solicited by the policy rather than the caller.
    pub policy_solicited: u64,
    /// Messages that needed several frames.
    pub fragmented: u64,
    /// Frames sent.
    pub frames_sent: u64,
    /// Messages received.
    pub received: u64,
    /// Frames dropped as malformed, out of order or of an unknown tag.
    pub dropped_frames: u64,
}

/// Typed messages over a [`Connection`]. The sender decides per message whether it wakes the
/// receiver; the receiver sleeps solicited-only (the connection's default) and drains
/// everything that arrived before the waking message, in order.
#[derive(Debug)]
pub struct Session {
    conn: Connection,
    config: SessionConfig,
    policy: SolicitPolicy,
    decoder: Decoder,
    seq: u32,
    stats: SessionStats,
}

impl Session {
    /// A session with default bounds.
    pub fn new(conn: Connection) -> Self {
        Self::with_config(conn, SessionConfig::default())
    }

    /// A session with these bounds.
    pub fn with_config(conn: Connection, config: SessionConfig) -> Self {
        let run = config
            .max_unsolicited_run
            .unwrap_or(conn.peer().recv_depth / 4);
        Self {
            policy: SolicitPolicy::new(run, config.max_unsolicited_bytes),
            decoder: Decoder::new(config.max_message),
            conn,
            config,
            seq: 0,
            stats: SessionStats::default(),
        }
    }

    /// Accept only registered types from now on; others are dropped with
    /// [`crate::Error::UnknownTag`] (a fragmented one at its first fragment, before anything
    /// of it is buffered). [`crate::Error::DuplicateTag`] if `M`'s tag is registered already.
    pub fn register<M: Message>(&mut self) -> Result<&mut Self> {
        self.decoder.register::<M>()?;
        Ok(self)
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The connection underneath, to send raw bytes or tune it.
    pub fn connection_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// Statistics.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// Sends `m`, solicited or not as its type says ([`Message::SOLICITED`]).
    pub fn send<M: Message>(&mut self, m: &M) -> Result<()> {
        self.send_as(m, M::SOLICITED)
    }

    /// Sends `m`, solicited or not as given (the policy may still solicit it).
    pub fn send_as<M: Message>(&mut self, m: &M, solicited: bool) -> Result<()> {
        let seq = self.seq;
        let want = self.policy.decide(solicited);
        // Straight into the registered send buffer when it fits.
        let mut outcome: Result<Option<usize>> = Ok(None);
        let sent = self.conn.send_with(want, None, |buf| {
            outcome = codec::encode_single(m, seq, buf);
            outcome.as_ref().ok().copied().flatten()
        })?;
        let single = outcome?;
        if sent {
            self.finish(want, solicited, single.unwrap_or(0), 1);
            return Ok(());
        }
        let frames =
            codec::encode_fragments(m, seq, self.conn.max_message(), self.config.max_message)?;
        let count = frames.len();
        let mut bytes = 0;
        for (i, f) in frames.iter().enumerate() {
            let last = i + 1 == count;
            self.conn.send(f, last && want)?;
            bytes += f.len();
        }
        self.stats.fragmented += 1;
        self.finish(want, solicited, bytes, count as u64);
        Ok(())
    }

    fn finish(&mut self, solicited: bool, requested: bool, bytes: usize, frames: u64) {
        self.seq = self.seq.wrapping_add(1);
        self.policy.record(solicited, bytes);
        self.stats.sent += 1;
        self.stats.frames_sent += frames;
        self.stats.sent_solicited += u64::from(solicited);
        self.stats.policy_solicited += u64::from(solicited && !requested);
    }

    /// Sends a batch: every message unsolicited but the last, which is solicited. One
    /// wake-up for the whole batch.
    pub fn send_batch<'a, M: Message + 'a>(
        &mut self,
        batch: impl IntoIterator<Item = &'a M>,
    ) -> Result<usize> {
        let mut iter = batch.into_iter().peekable();
        let mut n = 0;
        while let Some(m) = iter.next() {
            self.send_as(m, iter.peek().is_none())?;
            n += 1;
        }
        Ok(n)
    }

    /// If anything went unsolicited since the last solicited frame, sends a payload-less
    /// solicited frame so that the receiver looks now. Call it when a burst ends.
    pub fn flush(&mut self) -> Result<()> {
        if !self.policy.pending() {
            return Ok(());
        }
        let nudge = frame::build(FIRST | LAST, NUDGE_TAG, self.seq, 0, &[]);
        self.conn.send(&nudge, true)?;
        self.policy.record(true, 0);
        Ok(())
    }

    /// Receives the next message, waiting as long as it takes. A bad frame gives its error
    /// (not fatal: call again); a failed connection gives a fatal one.
    pub fn recv(&mut self) -> Result<Envelope> {
        loop {
            if let Some(env) = self.recv_timeout(None)? {
                return Ok(env);
            }
        }
    }

    /// Receives the next message, waiting at most `timeout`; `Ok(None)` if none came.
    pub fn recv_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<Envelope>> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
            let Some(frame) = self.conn.recv_timeout(left)? else {
                return Ok(None);
            };
            if let Some(env) = self.take(frame)? {
                return Ok(Some(env));
            }
        }
    }

    /// Returns a message that has already arrived, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Envelope>> {
        while let Some(frame) = self.conn.try_recv()? {
            if let Some(env) = self.take(frame)? {
                return Ok(Some(env));
            }
        }
        Ok(None)
    }

    fn take(&mut self, frame: rdmsg_transport::Received) -> Result<Option<Envelope>> {
        match self.decoder.push(FrameBytes::Received(frame)) {
            Ok(Some(env)) => {
                self.stats.received += 1;
                Ok(Some(env))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.stats.dropped_frames += 1;
                Err(e)
            }
        }
    }

    /// An iterator over received messages; it skips non-fatal errors (bad frames, unknown
    /// tags) and ends for good at the first fatal one ([`crate::Error::is_fatal`]: the peer
    /// closing, a failed connection, a verb or wait that failed), never retrying an error that
    /// would recur. Use [`Session::recv`] to see the error that ended it.
    pub fn incoming(&mut self) -> impl Iterator<Item = Envelope> + '_ {
        crate::drive::messages(move || self.recv())
    }

    /// Closes gracefully (see [`Connection::close`]).
    pub fn close(self) -> Result<()> {
        Ok(self.conn.close()?)
    }
}
