//! Asynchronous events, read once per device context and routed to the connections they
//! concern.
//!
//! A device context has one async-event descriptor for all its queue pairs and queues, shared
//! by every endpoint opened on it (another port, another GID choice): so one router per
//! context ([`router_for`]). Every connection watches the descriptor (exclusively: a new event
//! wakes one sleeping connection, not all of them), and whoever is woken by it, or looks at it
//! when its liveness check is due, reads it and routes each event: to the connection whose
//! queue pair or completion queue it names, to every connection of the device for
//! `DeviceFatal` and of the port for `PortErr`, waking each recipient through its own waker.
//! So no connection can consume another's event, and an event for a sleeping connection wakes
//! that one. Events naming a connection that is gone are dropped, not kept for a newcomer
//! that might reuse its queue pair number or CQ address.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use rdmsg_verbs::{AsyncElement, AsyncEvent, AsyncEventKind, Context};

/// The routers of the open device contexts, by the address of their `ibv_context`. An entry
/// lives as long as an endpoint holds its router (and with it the context, so the address is
/// not reused meanwhile).
static ROUTERS: Mutex<Vec<(usize, Weak<Mutex<Router>>)>> = Mutex::new(Vec::new());

/// The router of `ctx`'s asynchronous events, shared by every endpoint on it.
pub(crate) fn router_for(ctx: &Context) -> Arc<Mutex<Router>> {
    let key = ctx.as_raw() as usize;
    let mut routers = ROUTERS.lock().unwrap_or_else(PoisonError::into_inner);
    routers.retain(|(_, r)| r.strong_count() > 0);
    if let Some(r) = routers
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, r)| r.upgrade())
    {
        return r;
    }
    let r = Arc::new(Mutex::new(Router::default()));
    routers.push((key, Arc::downgrade(&r)));
    r
}

/// Events nobody claimed (an SRQ's, a queue pair created outside rdmsg's connections) kept for
/// later claimants, oldest dropped first.
const UNCLAIMED_BACKLOG: usize = 256;

/// Whether an asynchronous event of this kind breaks what it names: a fatal, request or access
/// error of a queue pair, an overrun of a CQ, a fatal device error, an error of the port.
pub(crate) fn is_fatal(kind: AsyncEventKind) -> bool {
    use AsyncEventKind as K;
    matches!(
        kind,
        K::QpFatal | K::QpReqErr | K::QpAccessErr | K::CqErr | K::DeviceFatal | K::PortErr
    )
}

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

/// A mailbox and the port of its connections, for events that concern a whole port or device.
#[derive(Debug)]
struct Recipient {
    port: u8,
    mailbox: Weak<Mailbox>,
}

/// The routing table of one device context. Pure: an endpoint reads the descriptor and feeds
/// it.
///
/// A queue pair number or a CQ address names one live object at a time, but is reused once it
/// is destroyed: registering it again replaces the old route, and a hub unregisters each queue
/// pair it destroys, so an event reaches the newest owner and the table holds what lives (plus
/// the routes of dropped connections, pruned as registrations go on). Lookups are by key.
#[derive(Debug, Default)]
pub(crate) struct Router {
    qps: HashMap<u32, Weak<Mailbox>>,
    cqs: HashMap<usize, Weak<Mailbox>>,
    /// Every mailbox once (by address), for device- and port-wide events.
    recipients: HashMap<usize, Recipient>,
    /// Registrations since dead routes were last pruned.
    since_prune: usize,
    /// Routes left by that pruning.
    after_prune: usize,
    unclaimed: VecDeque<AsyncEvent>,
    /// A fatal device error was seen: connections registered later fail too.
    device_fatal: bool,
    /// Ports in error and not active again: their later connections fail too.
    failed_ports: Vec<u8>,
}

impl Router {
    /// Registers a connection's queue pair (`None`: only queues, such as a hub's) and
    /// completion queues; events already read for them, and an earlier device-wide failure,
    /// are delivered at once.
    pub(crate) fn register(
        &mut self,
        qp_num: Option<u32>,
        cqs: Vec<usize>,
        port: u8,
        mailbox: &Arc<Mailbox>,
    ) {
        self.prune_now_and_then();
        let weak = Arc::downgrade(mailbox);
        // A mailbox registering another queue pair has had the device-wide news already.
        let known = self
            .recipients
            .contains_key(&(Arc::as_ptr(mailbox) as usize));
        let claims = |el: &AsyncElement| match *el {
            AsyncElement::Qp(n) => Some(n) == qp_num,
            AsyncElement::Cq(addr) => cqs.contains(&addr),
            _ => false,
        };
        let (mine, rest): (Vec<_>, Vec<_>) =
            self.unclaimed.drain(..).partition(|e| claims(&e.element));
        self.unclaimed = rest.into();
        for ev in mine {
            mailbox.deliver(ev);
        }
        if self.device_fatal && !known {
            mailbox.deliver(AsyncEvent {
                kind: AsyncEventKind::DeviceFatal,
                element: AsyncElement::Device,
            });
        }
        if self.failed_ports.contains(&port) && !known {
            mailbox.deliver(AsyncEvent {
                kind: AsyncEventKind::PortErr,
                element: AsyncElement::Port(port),
            });
        }
        if let Some(n) = qp_num {
            self.qps.insert(n, weak.clone());
        }
        for addr in cqs {
            self.cqs.insert(addr, weak.clone());
        }
        self.recipients
            .entry(Arc::as_ptr(mailbox) as usize)
            .or_insert(Recipient {
                port,
                mailbox: weak,
            });
    }

    /// The queue pair `qp_num` of `mailbox`'s owner is destroyed: its events, read now or
    /// later, go nowhere (a dead route, not none: an event left unclaimed would wait for, and
    /// fail, the next owner of the number). A route of a newer owner stays.
    pub(crate) fn unregister_qp(&mut self, qp_num: u32, mailbox: &Arc<Mailbox>) {
        if let Some(w) = self.qps.get_mut(&qp_num) {
            if std::ptr::eq(w.as_ptr(), Arc::as_ptr(mailbox)) {
                *w = Weak::new();
            }
        }
    }

    /// Drops the routes of mailboxes that are gone, once per as many registrations as routes
    /// were left by the last pruning (at least 32): amortized O(1) per registration, and the
    /// table stays within a few times what lives.
    fn prune_now_and_then(&mut self) {
        self.since_prune += 1;
        if self.since_prune <= self.after_prune.max(32) {
            return;
        }
        self.since_prune = 0;
        self.qps.retain(|_, w| w.strong_count() > 0);
        self.cqs.retain(|_, w| w.strong_count() > 0);
        self.recipients.retain(|_, r| r.mailbox.strong_count() > 0);
        self.after_prune = self.qps.len() + self.cqs.len() + self.recipients.len();
    }

    /// Routes one event read from the device.
    pub(crate) fn route(&mut self, ev: AsyncEvent) {
        let to_all = |recipients: &HashMap<usize, Recipient>, port: Option<u8>| {
            for r in recipients
                .values()
                .filter(|r| port.map_or(true, |p| r.port == p))
            {
                if let Some(mb) = r.mailbox.upgrade() {
                    mb.deliver(ev);
                }
            }
        };
        match (ev.kind, ev.element) {
            (AsyncEventKind::DeviceFatal, _) => {
                self.device_fatal = true;
                return to_all(&self.recipients, None);
            }
            (AsyncEventKind::PortErr, AsyncElement::Port(p)) => {
                if !self.failed_ports.contains(&p) {
                    self.failed_ports.push(p);
                }
                return to_all(&self.recipients, Some(p));
            }
            (AsyncEventKind::PortActive, AsyncElement::Port(p)) => {
                // A later PortErr counts anew; connections that failed stay failed.
                self.failed_ports.retain(|&q| q != p);
                return;
            }
            _ => {}
        }
        let route = match ev.element {
            AsyncElement::Qp(n) => self.qps.get(&n),
            AsyncElement::Cq(addr) => self.cqs.get(&addr),
            _ => None,
        };
        match route {
            // A dead route: its connection is gone, and the event with it.
            Some(w) => {
                if let Some(mb) = w.upgrade() {
                    mb.deliver(ev);
                }
            }
            None => {
                if self.unclaimed.len() == UNCLAIMED_BACKLOG {
                    self.unclaimed.pop_front();
                }
                self.unclaimed.push_back(ev);
            }
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
        r.register(Some(7), vec![0x1000, 0x2000], 1, &a);
        r.register(Some(9), vec![0x3000], 1, &b);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(7)));
        r.route(ev(AsyncEventKind::CqErr, AsyncElement::Cq(0x3000)));
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
        let other_port = Mailbox::new(None);
        let mut r = Router::default();
        r.register(Some(1), vec![], 1, &a);
        r.register(Some(2), vec![], 1, &b);
        r.register(Some(8), vec![], 2, &other_port);
        r.route(ev(AsyncEventKind::PortErr, AsyncElement::Port(1)));
        assert_eq!(a.take().len(), 1);
        assert_eq!(b.take().len(), 1);
        assert!(
            other_port.take().is_empty(),
            "another port's error is not its"
        );
        r.register(Some(3), vec![], 1, &c);
        assert_eq!(c.take()[0].kind, AsyncEventKind::PortErr);
        r.route(ev(AsyncEventKind::PortActive, AsyncElement::Port(1)));
        let d = Mailbox::new(None);
        r.register(Some(4), vec![], 1, &d);
        assert!(d.take().is_empty(), "the port came back");
        r.route(ev(AsyncEventKind::DeviceFatal, AsyncElement::Device));
        for mb in [&a, &b, &c, &d, &other_port] {
            assert_eq!(mb.take()[0].kind, AsyncEventKind::DeviceFatal);
        }
        let e = Mailbox::new(None);
        r.register(Some(5), vec![], 2, &e);
        assert_eq!(e.take()[0].kind, AsyncEventKind::DeviceFatal);
    }

    #[test]
    fn events_read_before_registration_wait_for_their_owner() {
        let mut r = Router::default();
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(5)));
        r.route(ev(AsyncEventKind::SrqLimitReached, AsyncElement::Srq(1)));
        let a = Mailbox::new(None);
        r.register(Some(5), vec![], 1, &a);
        assert_eq!(a.take().len(), 1);
        assert_eq!(r.unclaimed.len(), 1, "the SRQ event stays unclaimed");
        drop(a);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(5)));
        assert_eq!(
            r.unclaimed.len(),
            1,
            "an event of a connection that is gone is dropped"
        );
        let newcomer = Mailbox::new(None);
        r.register(Some(5), vec![], 1, &newcomer);
        assert!(
            newcomer.take().is_empty(),
            "nothing stale for a reused QP number"
        );
    }

    #[test]
    fn a_reused_queue_pair_number_routes_to_its_newest_owner() {
        // A hub lives on after destroying a queue pair; the number goes to a new connection.
        let hub = Mailbox::new(None);
        let conn = Mailbox::new(None);
        let mut r = Router::default();
        r.register(None, vec![0x1000], 1, &hub);
        r.register(Some(5), vec![], 1, &hub);
        r.register(Some(6), vec![], 1, &hub);
        r.register(Some(5), vec![0x2000], 1, &conn);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(5)));
        assert_eq!(conn.take().len(), 1, "the newest owner of 5 gets it");
        assert!(hub.take().is_empty(), "not the hub, whose 5 is gone");
        // The hub's late unregistration of its old 5 leaves the new owner's route.
        r.unregister_qp(5, &hub);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(5)));
        assert_eq!(conn.take().len(), 1);
        r.unregister_qp(6, &hub);
        r.route(ev(AsyncEventKind::QpFatal, AsyncElement::Qp(6)));
        assert!(hub.take().is_empty(), "unregistered");
        let newcomer = Mailbox::new(None);
        r.register(Some(6), vec![], 1, &newcomer);
        assert!(
            newcomer.take().is_empty(),
            "an event of the destroyed 6 is not kept for the next owner of the number"
        );
        // A port-wide event reaches each mailbox once, however many queue pairs it has, and
        // is not delivered again when it registers another.
        r.route(ev(AsyncEventKind::PortErr, AsyncElement::Port(1)));
        assert_eq!(hub.take().len(), 1);
        assert_eq!(conn.take().len(), 1);
        r.register(Some(7), vec![], 1, &hub);
        assert!(hub.take().is_empty(), "told once");
    }

    #[test]
    fn routes_of_dropped_connections_do_not_pile_up() {
        let mut r = Router::default();
        for n in 0..10_000 {
            let conn = Mailbox::new(None);
            r.register(Some(n), vec![0x1000 + n as usize], 1, &conn);
        }
        let routes = r.qps.len() + r.cqs.len() + r.recipients.len();
        assert!(routes <= 3 * 33, "{routes} routes for nothing alive");
    }

    #[test]
    fn endpoints_on_one_context_share_its_router() {
        // Without a device: the registry is keyed by address; two lookups of one key share.
        let mut routers = ROUTERS.lock().unwrap();
        let r = Arc::new(Mutex::new(Router::default()));
        routers.push((0xdead_0000, Arc::downgrade(&r)));
        let found = routers
            .iter()
            .find(|(k, _)| *k == 0xdead_0000)
            .and_then(|(_, w)| w.upgrade())
            .unwrap();
        assert!(Arc::ptr_eq(&found, &r));
    }
}
