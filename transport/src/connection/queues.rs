//! What lies under a connection's core, for the one driver ([`crate::drive`]): its own queue
//! pair, CQs, receive pool, send buffers and bootstrap stream.

use std::time::{Duration, Instant};

use rdmsg_notify::ArmMode;
use rdmsg_verbs::{Buffer, Exposed};

use super::turn::async_failure_of;
use super::Connection;
use crate::core::{Core, Post, Room};
use crate::drive::{Exposes, Queues};
use crate::error::{Error, Failure, Result};
use crate::peer_id::PeerId;
use crate::send::{self, Payload};

impl Queues for Connection {
    type Buf = Buffer;
    type Payload = Payload;

    #[inline]
    fn core(&mut self) -> &mut Core {
        &mut self.core
    }

    #[inline]
    fn clock(&self) -> impl FnOnce() -> Instant + 'static {
        // Asked only on the rare paths (a failure's drain, a close's linger), which a public
        // call may reach without a turn of its own: the clock itself, never an old turn's.
        Instant::now
    }

    #[inline]
    fn names(&self) -> (u32, Option<PeerId>) {
        (self.qp.qp_num(), None)
    }

    #[inline]
    fn room(&self) -> Room {
        Connection::room(self)
    }

    #[inline]
    fn post(&mut self, payload: Payload, post: Post) -> Result<()> {
        Connection::post(self, payload, post)
    }

    #[inline]
    fn note(&mut self) -> Payload {
        self.send.note(self.core.note())
    }

    #[inline]
    fn note_in(&self, buf: &Buffer, byte_len: u32) -> Option<u32> {
        send::note_of(buf.as_slice(), byte_len)
    }

    #[inline]
    fn deliver(&mut self, buf: Buffer, byte_len: u32) {
        self.ready.push_back(self.pool.lend(buf, byte_len as usize));
    }

    #[inline]
    fn recycle(&mut self, buf: Buffer) {
        self.pool.put_back(buf);
    }

    fn explain_flush(&mut self) -> Option<Failure> {
        // A CQ overrun or a fatal queue pair error may be waiting in the events.
        async_failure_of(&self.endpoint, &self.mailbox)
            .ok()
            .flatten()
    }

    fn post_probe(&mut self) -> Result<()> {
        let wr_id = self.qp.post_probe().map_err(Error::from)?;
        self.core.probe_posted(wr_id);
        Ok(())
    }

    fn bind(&mut self, window: &mut Exposed) -> Result<()> {
        match self.qp.bind(window) {
            Ok(wr_id) => {
                self.core.posted(wr_id, true);
                Ok(())
            }
            Err(e) => Err(self.local_failure("binding a memory window (ibv_post_send)", e.into())),
        }
    }

    fn say_goodbye(&mut self) {
        // The peer reading its end waits for our close message rather than calling us
        // vanished.
        self.waiter.channel_mut().bootstrap.say_goodbye();
    }

    fn unwatch_stream(&mut self) {
        self.waiter.channel_mut().stop_watching_bootstrap();
    }

    fn shut_down_stream(&mut self) {
        self.waiter.channel_mut().bootstrap.shut_down();
    }

    fn to_error(&mut self) {
        let _ = self.qp.to_error();
    }

    fn flushing(&mut self) {
        // Every flush must wake a sleeper or an event loop: 6.12's rxe fires no
        // solicited-only arm for flushed receives. (The keys are ours: this cannot fail.)
        let _ = self.waiter.set_mode(self.recv_key, ArmMode::Next);
        let _ = self.waiter.set_mode(self.send_key, ArmMode::Next);
    }

    #[inline]
    fn flushes_outstanding(&self) -> usize {
        // Sends are not waited for: unsignaled sends that had already succeeded never complete
        // again; their buffers go with the queue pair.
        self.qp.recv_outstanding() + self.lost_flushes()
    }
}

impl Exposes for Connection {
    fn endpoint(&self) -> &crate::endpoint::Endpoint {
        &self.endpoint
    }

    fn sq_depth(&self) -> Option<usize> {
        Some(self.sq_depth)
    }

    fn wait_for_send_slots(&mut self, reserve: usize, timeout: Option<Duration>) -> Result<()> {
        self.sq_reserve = reserve;
        let waited = self.wait_to_send(timeout);
        self.sq_reserve = 0;
        waited
    }
}
