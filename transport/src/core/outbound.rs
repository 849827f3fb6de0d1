//! What the core gives its driver to post: data messages, grants, the close message, and the
//! bookkeeping of what was posted (signaling, unsignaled sends, reads, credit stalls).

use std::time::Instant;

use super::*;

impl Core {
    /// A data message to post now, spending a credit: its immediate data, solicited if the
    /// caller asked or the protocol needs it (our last credit, or credits for a peer that may
    /// be blocked), signaled as [`Core::signal_for`] decides given the `room` left once it is
    /// posted. `None` without a credit or while the connection may not send.
    #[inline]
    pub(crate) fn data(&mut self, solicited: bool, room: Room) -> Option<Post> {
        if self.check_send().is_err() || !self.is_linked() {
            return None;
        }
        let (imm, must) = self.credits.take_for_data(0)?;
        self.stats.sent += 1;
        self.stats.forced_solicited += u64::from(must && !solicited);
        self.stats.sent_solicited += u64::from(solicited || must);
        Some(Post {
            imm,
            solicited: solicited || must,
            signaled: self.signal_for(room),
        })
    }

    /// A data message went inline (counted).
    #[inline]
    pub(crate) fn sent_inline(&mut self) {
        self.stats.sent_inline += 1;
    }

    /// When a close that begins at `now` must have ended: `close_timeout` later. The driver
    /// (or the layer above it) takes it once, when the close begins, and every stage of the
    /// close (its own waits, then [`Core::start_close`]) spends what is left of it: a close
    /// lasts one `close_timeout`, not one per thing it waited for.
    pub(crate) fn close_deadline(&self, now: Instant) -> Instant {
        deadline_after(now, self.close_timeout)
    }

    /// Starts a graceful close at `now`: the close message to post (solicited, signaled,
    /// spending a credit), after which nothing more may be sent; closed once it completes, or
    /// failed with [`Failure::CloseTimedOut`] at `deadline` (the close's, from
    /// [`Core::close_deadline`] when it began, whatever it waited for since), or
    /// [`CLOSE_ACK_GRACE`] from `now` if that is later (a close whose earlier waits spent its
    /// time still gives its message the time an acknowledgement takes), or with
    /// [`Failure::PeerVanished`] when the peer's stream ended (before or since) and the
    /// message did not complete within that end's grace. `None` without a credit, or when
    /// the connection may not send.
    pub(crate) fn start_close(&mut self, deadline: Instant, now: Instant) -> Option<Post> {
        if self.check_send().is_err() || !self.is_linked() {
            return None;
        }
        let (imm, _) = self.credits.take_for_data(Imm::CLOSE)?;
        self.state = State::Closing { close_wr: None };
        self.timers
            .set(Timer::Close, deadline.max(now + CLOSE_ACK_GRACE));
        self.unsignaled = 0;
        Some(Post {
            imm,
            solicited: true,
            signaled: true,
        })
    }

    /// A credit grant, if one is due and there is room to post it (its credits count as
    /// returned: post it).
    #[inline]
    pub(crate) fn grant(&mut self, room: Room) -> Option<Post> {
        if self.failure.is_some()
            || room.sq == 0
            || room.cq == 0
            || self.credits.grant_needs_slots()
        {
            return None;
        }
        let g = self.credits.take_grant()?;
        self.stats.grants_sent += 1;
        Some(Post {
            imm: g.imm,
            solicited: g.solicited,
            signaled: self.signal_for(room),
        })
    }

    /// Sends posted unsignaled since the last signaled one (they leave the send CQ only
    /// with a later signaled send's completion, or flushed).
    #[inline]
    pub(crate) fn unsignaled_behind(&self) -> usize {
        self.unsignaled as usize
    }

    /// Whether the next send is signaled: every `signal_every`-th, once `room.unsignaled`
    /// sends went unsignaled, and always when the send queue, the send buffers or the send CQ
    /// are about to run out (`room` is what is left once it is posted), so that a blocked
    /// sender has a completion coming.
    #[inline]
    fn signal_for(&mut self, room: Room) -> bool {
        // The send that takes the last free buffer is signaled: else nothing might ever come
        // back to retire it, and no buffer would free (a send that waits sleeps for good).
        let must = room.sq <= 1 || room.buffers <= 1 || room.cq <= 1;
        let signaled = must
            || self.unsignaled + 1 >= self.signal_every
            || self.unsignaled as usize >= room.unsignaled;
        self.unsignaled = if signaled { 0 } else { self.unsignaled + 1 };
        signaled
    }

    /// RDMA reads were posted, the last (signaled) as `wr_id`.
    pub(crate) fn posted_read(&mut self, wr_id: u64) {
        self.posted(wr_id, true);
        self.last_read = Some(wr_id);
    }

    /// A send (or read) was posted as `wr_id` (the first after [`Core::start_close`] is the
    /// close message).
    #[inline]
    pub(crate) fn posted(&mut self, wr_id: u64, signaled: bool) {
        if signaled {
            self.last_signaled = Some(wr_id);
        }
        if let State::Closing { close_wr: w @ None } = &mut self.state {
            *w = Some(wr_id);
            self.our_close_wr = Some(wr_id);
        }
    }

    /// Whether an RDMA read of `segments` pieces can ever be posted on a send queue of
    /// `sq_depth` slots.
    pub(crate) fn read_fits(&self, segments: usize, sq_depth: usize) -> Result<(), Error> {
        if segments > sq_depth {
            return Err(Error::ReadTooLarge {
                segments,
                send_slots: sq_depth,
            });
        }
        Ok(())
    }

    /// A send found no credit or send slot (`blocked`), or one goes now: see
    /// [`Core::wants_any_completion`]. Whether a credit stall ended (a send goes after one
    /// found no credit), for the driver to report.
    #[inline]
    pub(crate) fn send_waits(&mut self, blocked: bool) -> bool {
        self.send_blocked = blocked;
        !blocked && std::mem::take(&mut self.stalled)
    }

    /// A send waited for a credit, or else for a send slot (counted). Whether a credit stall
    /// began (the first send to find no credit since one went), for the driver to report.
    #[inline]
    pub(crate) fn send_waited(&mut self) -> bool {
        if self.credits.available() == 0 {
            self.stats.credit_waits += 1;
            let began = !std::mem::replace(&mut self.stalled, true);
            self.stats.credit_stalls += u64::from(began);
            began
        } else {
            self.stats.send_slot_waits += 1;
            false
        }
    }

    /// `n` receive buffers were re-posted for this connection.
    #[inline]
    pub(crate) fn reposted(&mut self, n: u32) {
        self.stats.refills += 1;
        self.credits.on_reposted(n);
    }
}
