//! Sending by rendezvous: a large message lent to the peer (its descriptor sent, its
//! memory exposed until the peer read it), the peer's acknowledgements, and waiting for them.

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::bulk::Piece;
use crate::frame;
use crate::rendezvous::{self, Descriptor, Segment};
use crate::trace::trace_event;
use crate::Result;

use super::*;

impl SendSide {
    /// The peer is done reading these messages: their exposures end.
    pub(crate) fn acknowledged(&mut self, seqs: &[u32]) {
        for &seq in seqs {
            if !self.lent.done(seq) {
                self.stats.stray_acks += 1;
            }
        }
    }

    /// Messages the peer may still be reading.
    pub(crate) fn lent(&self) -> usize {
        self.lent.count()
    }

    /// Waits, taking in what arrives ([`PeerIo::absorb`]), until the peer is done reading our
    /// messages (and with `record`, until its application took them all) or `deadline`
    /// passes: closing under a read would fail it. Returns how many it had not read by then.
    pub(crate) fn wait_until_returned(
        &mut self,
        link: &mut impl PeerIo,
        deadline: Instant,
        record: bool,
    ) -> Result<usize> {
        if record {
            self.ask_all();
            self.send_committed(link)?;
        }
        while self.lent() > 0 || (record && self.record.delivery().unconfirmed() > 0) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match self.wait_and_take_acks(link, Some(left)) {
                Ok(true) => {}
                Ok(false) => break,
                // Waiting for the record only: a connection that ended has told all it will.
                Err(_) if self.lent() == 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(self.lent())
    }

    /// Waits at most `timeout` for what arrives ([`PeerIo::absorb`]), takes in the peer's
    /// acknowledgements and sends ours as they can go; `false` if the link cannot wait so.
    pub(super) fn wait_and_take_acks(
        &mut self,
        link: &mut impl PeerIo,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        let Some(got) = link.absorb(timeout)? else {
            return Ok(false);
        };
        if let Some(t) = got.peer_taken {
            self.record.learn(t);
        }
        self.learn_note(got.note);
        self.taken_to_tell = got.taken;
        if got.answer {
            self.queue_answer();
        }
        self.acknowledged(&got.acked);
        let frame_max = link.max_message()?;
        self.queue_acks(&got.acks, frame_max);
        self.send_committed(link)?;
        Ok(true)
    }

    /// Queues acknowledgements of messages we are done reading, solicited (the peer may wait
    /// for room), to go with the next frames sent. They join the last acknowledgement still
    /// waiting to go, as far as a frame holds: a peer that withholds credits while we read
    /// finds few frames of many numbers waiting (4 bytes per message read), not a frame per
    /// read.
    pub(crate) fn queue_acks(&mut self, seqs: &[u32], frame_max: usize) {
        let mut rest = seqs;
        if let Some((waiting, _)) = self.outgoing.back_mut() {
            let header = frame::parse(waiting).ok().map(|(h, _)| h);
            if let Some(mut h) = header.filter(|h| h.flags & frame::DONE != 0) {
                let take = rest.len().min(frame_max.saturating_sub(waiting.len()) / 4);
                for seq in &rest[..take] {
                    waiting.extend_from_slice(&seq.to_be_bytes());
                }
                h.len += 4 * take as u32;
                h.write(&mut waiting[..frame::HEADER_LEN]);
                rest = &rest[take..];
            }
        }
        for f in rendezvous::done_frames(rest, frame_max) {
            self.outgoing.push_back((f, true));
        }
    }

    /// Sends `pieces` (message `seq` of type `tag`, `total` bytes) by rendezvous: exposes
    /// what does not travel in the descriptor, then sends the descriptor, solicited, waiting
    /// at most `timeout` for a credit. `Ok(false)`: not sent (nothing exposed any more).
    /// `Err` with nothing sent if the descriptor cannot fit a frame.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_rendezvous(
        &mut self,
        link: &mut impl PeerIo,
        tag: u32,
        seq: u32,
        mut pieces: Vec<Piece>,
        total: usize,
        requested: bool,
        timeout: Option<Duration>,
    ) -> Result<bool> {
        let copy = match self.record.keeps() {
            true => Copied::Owned(concat(pieces.clone())),
            false => Copied::No,
        };
        let frame_max = link.max_message()?;
        if pieces.len() > rendezvous::MAX_PIECES.min(link.max_exposures()) {
            // Too many payloads to name (or bind) one by one: copy them into one piece.
            pieces = vec![Piece::Encoded(concat(pieces))];
        }
        // Small encoded pieces travel in the descriptor, as far as the frame allows; the
        // others are exposed to this peer alone, all at once.
        let mut room = frame_max.saturating_sub(rendezvous::remote_frame_len(pieces.len()));
        let mut inline = Vec::with_capacity(pieces.len());
        let mut remote = Vec::new();
        for p in pieces {
            match p {
                Piece::Encoded(v)
                    if v.len() + rendezvous::INLINE_HEAD <= room && v.len() <= INLINE_PIECE =>
                {
                    room -= v.len() + rendezvous::INLINE_HEAD;
                    inline.push(Some(v));
                }
                other => {
                    remote.push(match other {
                        Piece::Encoded(v) => Bytes::from(v),
                        Piece::Bulk(b) => b,
                    });
                    inline.push(None);
                }
            }
        }
        let exposed = match link.expose_all(remote, timeout) {
            Ok(exposed) => exposed,
            Err(rdmsg_transport::Error::Timeout(_)) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let mut keys = exposed.iter();
        let segments = inline
            .into_iter()
            .map(|piece| match piece {
                Some(v) => Segment::Inline(v),
                None => {
                    let e = keys.next().expect("one exposure per remote piece");
                    Segment::Remote {
                        len: e.len() as u32,
                        addr: e.addr(),
                        rkey: e.rkey(),
                    }
                }
            })
            .collect();
        let descriptor = Descriptor {
            total: total as u32,
            segments,
        };
        let mut len = 0;
        let taken = self.taken_to_tell;
        let sent = link.send_with(true, timeout, |buf| {
            len = descriptor.write_frame(tag, seq, buf)?;
            frame::stamp_taken(&mut buf[..len], taken);
            Some(len)
        })?;
        if !sent {
            return Ok(false);
        }
        trace_event!(
            DEBUG,
            seq,
            tag,
            bytes = total,
            exposed = exposed.len(),
            "lent by rendezvous"
        );
        self.lent.lend(seq, exposed, total);
        self.stats.rendezvous_sent += 1;
        self.stats.bytes_sent += total as u64;
        self.finish(true, requested, len, 1, tag, copy);
        self.send_committed(link)?;
        Ok(true)
    }

    /// Whether a descriptor of `pieces` can fit in a frame of `frame_max` bytes.
    pub(super) fn descriptor_fits(pieces: usize, frame_max: usize) -> bool {
        rendezvous::remote_frame_len(pieces.min(rendezvous::MAX_PIECES)) <= frame_max
    }
}
