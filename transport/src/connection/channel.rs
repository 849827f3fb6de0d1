//! The completion channel of a connection and the other descriptors that end its sleep, in
//! one epoll set.

use std::os::fd::AsFd;
use std::time::Instant;

use rdmsg_notify::{EventChannel, EventTarget, Readiness};
use rdmsg_verbs::{CompletionChannel, CompletionQueue, ReadyWatch};

use crate::control::Control;
use crate::endpoint::Endpoint;
use crate::error::Result;
use crate::token::Token;

/// The completion channel of a connection plus what else should interrupt its sleep: buffers
/// coming back to the receive pool, the bootstrap stream (end-of-file: the peer process is
/// gone), and the device's asynchronous events. All four are registered once in an epoll set.
#[derive(Debug)]
pub(super) struct ConnChannel {
    channel: CompletionChannel,
    pub(super) watch: ReadyWatch,
    /// Registered in `watch`: kept open here.
    _wake: std::os::unix::net::UnixStream,
    /// The bootstrap stream, or the connection manager's id (see [`Control`]).
    pub(super) bootstrap: Control,
    /// Stop watching the bootstrap stream once it has ended (it stays readable forever).
    pub(super) watch_bootstrap: bool,
    /// Owns the context whose async-event descriptor is registered in `watch`.
    endpoint: Endpoint,
}

impl ConnChannel {
    pub(super) fn new(
        channel: CompletionChannel,
        wake: std::os::unix::net::UnixStream,
        bootstrap: Control,
        endpoint: Endpoint,
    ) -> Result<Self> {
        let watch = ReadyWatch::new()?;
        watch.add(channel.as_fd(), Token::Channel.bit())?;
        watch.add(wake.as_fd(), Token::Wake.bit())?;
        // Every connection of the device watches its async-event descriptor; one new event
        // wakes one sleeper, which routes it to its owner (see the `device_events` module).
        watch.add_exclusive(endpoint.context().async_fd(), Token::Async.bit())?;
        watch.add(bootstrap.as_fd(), Token::Stream(0).bit())?;
        Ok(Self {
            channel,
            watch,
            _wake: wake,
            bootstrap,
            watch_bootstrap: true,
            endpoint,
        })
    }

    pub(super) fn stop_watching_bootstrap(&mut self) {
        if std::mem::take(&mut self.watch_bootstrap) {
            // The stream stays readable at end-of-file; watching it would spin.
            let _ = self.watch.remove(self.bootstrap.as_fd());
        }
    }
}

impl EventChannel<CompletionQueue> for ConnChannel {
    fn next_event(&mut self, cqs: &[CompletionQueue]) -> rdmsg_notify::Result<Option<EventTarget>> {
        self.channel.next_event(cqs)
    }

    fn wait_readable(
        &mut self,
        deadline: Option<Instant>,
        now: Instant,
    ) -> rdmsg_notify::Result<Readiness> {
        let ready = self.watch.wait_until(deadline, now)?;
        if Token::Async.in_mask(ready) {
            // Exclusive: of the connections asleep on the device's async events, this one was
            // woken, and it may be the only one. Route them now, whatever else woke us: each
            // event lands in its owner's mailbox and wakes it (us too, through our wake-up
            // socket, if one is ours). A failure to read is found again by the owner's own
            // liveness check.
            let _ = self.endpoint.route_async_events();
        }
        Ok(if ready == 0 {
            Readiness::TimedOut
        } else if Token::Channel.in_mask(ready) {
            Readiness::Events
        } else {
            Readiness::Other
        })
    }
}
