//! Asynchronous events, read once per endpoint and routed to the connections they concern.
//!
//! A device has one async-event descriptor for all its queue pairs and queues. Every
//! connection watches it (exclusively: a new event wakes one sleeping connection, not all of
//! them); whoever reads it routes each event: to the connection whose queue pair or completion
//! queue it names, to every connection for a device-wide event (`DeviceFatal`, or `PortErr` on
//! the endpoint's port), waking each recipient through its own waker. So no connection can
//! consume another's event, and an event for a sleeping connection wakes that one.

use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use rdmsg_verbs::{AsyncElement, AsyncEvent, AsyncEventKind};

/// Events nobody claimed (an SRQ's, a queue pair created outside rdmsg's connections) kept for
/// later claimants, oldest dropped first.
const UNCLAIMED_BACKLOG: usize = 256;

/// Where a connection's events are left for it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    events: Mutex<Vec<AsyncEvent>>,
    /// Write end of the connection's wake-up socket.
    waker: Option<UnixStream>,
}

impl Mailbox {
    pub(crate) fn new(waker: Option<UnixStream>) -> Arc<Self> {
        Arc::new(Self {
            events: Mutex::new(Vec::new()),
            waker,
        })
    }

    fn deliver(&self, ev: AsyncEvent) {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(ev);
        if let Some(w) = &self.waker {
            // Non-blocking; a full socket already holds a wake-up.
            let _ = (&*w).write(&[2]);
        }
    }

    /// Takes the events routed here so far.
    pub(crate) fn take(&self) -> Vec<AsyncEvent> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[derive(Debug)]
struct Route {
    qp_num: u32,
    cqs: Vec<usize>,
    mailbox: Weak<Mailbox>,
}

impl Route {
    fn claims(&self, el: &AsyncElement) -> bool {
        match *el {
            AsyncElement::Qp(n) => n == self.qp_num,
            AsyncElement::Cq(addr) => self.cqs.contains(&addr),
            _ => false,
        }
    }
}

/// The routing table of one endpoint. Pure: the endpoint reads the descriptor and feeds it.
#[derive(Debug, Default)]
pub(crate) struct Router {
    routes: Vec<Route>,
    unclaimed: VecDeque<AsyncEvent>,
    /// The first device-wide failure seen, handed to connections registered later too.
    device_failure: Option<AsyncEventKind>,
}

impl Router {
    /// Registers a connection's queue pair and completion queues; events already read for
    /// them, and an earlier device-wide failure, are delivered at once.
    pub(crate) fn register(&mut self, qp_num: u32, cqs: Vec<usize>, mailbox: &Arc<Mailbox>) {
        self.routes.retain(|r| r.mailbox.strong_count() > 0);
        let route = Route {
            qp_num,
            cqs,
            mailbox: Arc::downgrade(mailbox),
        };
        let (mine, rest): (Vec<_>, Vec<_>) = self
            .unclaimed
            .drain(..)
            .partition(|e| route.claims(&e.element));
        self.unclaimed = rest.into();
        for ev in mine {
            mailbox.deliver(ev);
        }
        if let Some(kind) = self.device_failure {
            mailbox.deliver(AsyncEvent {
                kind,
                element: AsyncElement::Device,
            });
        }
        self.routes.push(route);
    }

    /// Routes one event read from the device of an endpoint on `port`.
    pub(crate) fn route(&mut self, ev: AsyncEvent, port: u8) {
        let device_wide = match (ev.kind, ev.element) {
            (AsyncEventKind::DeviceFatal, _) => true,
            (AsyncEventKind::PortErr, AsyncElement::Port(p)) => p == port,
            _ => false,
        };
        if device_wide {
            self.device_failure.get_or_insert(ev.kind);
            for mb in self.routes.iter().filter_map(|r| r.mailbox.upgrade()) {
                mb.deliver(ev);
            }
            return;
        }
        let target = self
            .routes
            .iter()
            .find(|r| r.claims(&ev.element))
            .and_then(|r| r.mailbox.upgrade());
        match target {
            Some(mb) => mb.deliver(ev),
            None => {
                if self.unclaimed.len() == UNCLAIMED_BACKLOG {
                    self.unclaimed.pop_front();
                }
                self.unclaimed.push_back(ev);
            }
        }
    }

    /// Forgets the port failure once the port is active again (a later `PortErr` counts anew).
    pub(crate) fn port_active(&mut self) {
        if self.device_failure == Some(AsyncEventKind::PortErr) {
            self.device_failure = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: AsyncEventKind, element: AsyncElement) -> AsyncEvent {
        AsyncEvent { kind, element }
    }

    #[test]
    fn an_event_reaches_only_the_connection_it_names_and_wakes_it() {
        let (wake_a, mut woken_a) = UnixStream::pair().unwrap();
        let a = Mailbox::new(Some(wake_a));
        let b = Mailbox::new(None);
        let mut r = Router::default();
        r.register(7, vec![0x1000, 0x2000], &a);
        r.register(9, vec![0x3000], &b);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(7)), 1);
        r.route(ev(AsyncEventKind::CqErr, AsyncElement::Cq(0x3000)), 1);
        assert_eq!(
            a.take(),
            vec![ev(AsyncEventKind::QpFatal, AsyncElement::Qp(7))]
        );
        assert_eq!(
            b.take(),
            vec![ev(AsyncEventKind::CqErr, AsyncElement::Cq(0x3000))]
        );
        assert!(a.take().is_empty(), "taken once");
        let mut byte = [0u8; 1];
        std::io::Read::read_exact(&mut woken_a, &mut byte).unwrap();
    }

    #[test]
    fn device_wide_events_reach_everyone_including_latecomers() {
        let (a, b, c) = (Mailbox::new(None), Mailbox::new(None), Mailbox::new(None));
        let mut r = Router::default();
        r.register(1, vec![], &a);
        r.register(2, vec![], &b);
        r.route(ev(AsyncEventKind::PortErr, AsyncElement::Port(2)), 1);
        assert!(a.take().is_empty(), "another port's error is not ours");
        r.route(ev(AsyncEventKind::PortErr, AsyncElement::Port(1)), 1);
        assert_eq!(a.take().len(), 1);
        assert_eq!(b.take().len(), 1);
        r.register(3, vec![], &c);
        assert_eq!(c.take()[0].kind, AsyncEventKind::PortErr);
        r.port_active();
        let d = Mailbox::new(None);
        r.register(4, vec![], &d);
        assert!(d.take().is_empty(), "the port came back");
    }

    #[test]
    fn events_read_before_registration_wait_for_their_owner() {
        let mut r = Router::default();
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(5)), 1);
        r.route(ev(AsyncEventKind::SrqLimitReached, AsyncElement::Srq(1)), 1);
        let a = Mailbox::new(None);
        r.register(5, vec![], &a);
        assert_eq!(a.take().len(), 1);
        assert_eq!(r.unclaimed.len(), 1, "the SRQ event stays unclaimed");
        drop(a);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(5)), 1);
        assert_eq!(r.unclaimed.len(), 2, "a dropped connection claims nothing");
    }
}
