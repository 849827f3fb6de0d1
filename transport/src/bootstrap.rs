//! Drivers of the [`handshake`](crate::handshake) machine over the bootstrap TCP stream: a
//! blocking one for the connecting side, and the [`Listener`], which runs many accepting
//! handshakes at once from one poll loop.
//!
//! Both drive a [`Pending`] handshake over a non-blocking stream: write what the machine has
//! to say, serve its actions, read at most what it wants (so that nothing after the handshake
//! is read), repeat until a read would block. Deadlines are the drivers': each handshake has
//! `Config::handshake_timeout` in all, whatever the peer does byte by byte.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdmsg_verbs::{deadline_after, ReadyWatch};

use crate::addr::QpAddress;
use crate::config::Config;
use crate::connection::Connection;
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::failed::FailedHandshakes;
use crate::handshake::{Action, Handshake, Hello, Reject, Resumption};
use crate::handshake_set::{to_evict, Bound, Waiting};
use crate::resume::{self, Resume, Sessions};

/// What the client hello says for a connection made with `config`.
pub(crate) fn offer(config: &Config) -> Result<Resumption> {
    Ok(match config.resume_window {
        Some(_) => Resumption::Offer(resume::new_token()?),
        None => Resumption::Off,
    })
}
use crate::setup::{nonce, our_hello, LocalSide, Setup};
use crate::stream::{accept_next, bootstrap_err};
use crate::token;
use crate::trace::{self, trace_span};

/// One handshake over a non-blocking stream, and the resources it set up so far.
#[derive(Debug)]
pub(crate) struct Pending<S = Setup> {
    pub(crate) stream: TcpStream,
    /// Where the stream goes (read once, for errors and events).
    pub(crate) peer_addr: Option<SocketAddr>,
    pub(crate) hs: Handshake,
    /// The client's from the start; the server's once the client passed.
    pub(crate) setup: Option<S>,
    config: Config,
    /// When it began: `deadline` is `handshake_timeout` after.
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    /// The accepting side's resumable sessions, to check a resume's token against before
    /// anything is set up for it.
    pub(crate) sessions: Option<Arc<dyn resume::KnowsSessions>>,
}

impl<S: LocalSide> Pending<S> {
    pub(crate) fn new(
        stream: TcpStream,
        hs: Handshake,
        setup: Option<S>,
        config: &Config,
    ) -> Result<Self> {
        stream
            .set_nonblocking(true)
            .map_err(bootstrap_err("making the stream non-blocking"))?;
        stream
            .set_nodelay(true)
            .map_err(bootstrap_err("setting TCP_NODELAY"))?;
        let started = Instant::now();
        Ok(Self {
            peer_addr: stream.peer_addr().ok(),
            stream,
            hs,
            setup,
            config: config.clone(),
            started,
            deadline: deadline_after(started, config.handshake_timeout),
            sessions: None,
        })
    }

    /// A resume whose token names no session here is refused before anything is set up:
    /// the reason, if so.
    fn refuse_resume(&self) -> Option<Reject> {
        let sessions = self.sessions.as_ref()?;
        match self.hs.session() {
            Resumption::Resume(token) if !sessions.knows(&token) => Some(Reject::UnknownSession),
            _ => None,
        }
    }

    /// Moves the handshake on as far as the bytes at hand allow; `Ok(true)` once it is done.
    /// On an error the reject code, if any, has been sent (best effort). `create` makes the
    /// server's local side once the client passed.
    pub(crate) fn advance(
        &mut self,
        endpoint: &Endpoint,
        create: &mut dyn FnMut(&Config) -> Result<S>,
    ) -> Result<bool> {
        loop {
            self.flush()?;
            if let Some(Action::Connect { peer, send_buffers }) = self.hs.poll_action() {
                if let Some(reason) = self.refuse_resume() {
                    self.hs.abort(reason);
                    let _ = self.flush();
                    return Err(Error::BadHandshake(reason));
                }
                match self.connect_local(endpoint, &peer, send_buffers, create) {
                    Ok(addr) => self.hs.local_ready(addr),
                    Err(e) => {
                        self.hs.abort(Reject::Resources);
                        let _ = self.flush();
                        return Err(e);
                    }
                }
                continue;
            }
            if self.hs.is_done() {
                return Ok(true);
            }
            let want = self.hs.wanted();
            if want == 0 {
                return Ok(false);
            }
            let mut buf = [0u8; 256];
            match (&self.stream).read(&mut buf[..want.min(256)]) {
                Ok(0) => {
                    return Err(Error::Bootstrap {
                        stage: self.hs.stage(),
                        source: io::ErrorKind::UnexpectedEof.into(),
                    })
                }
                Ok(n) => {
                    if let Err(e) = self.hs.feed(&buf[..n]) {
                        let _ = self.flush();
                        return Err(e);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(Error::Bootstrap {
                        stage: self.hs.stage(),
                        source,
                    })
                }
            }
        }
    }

    /// Creates (server) and connects the local queue pair.
    fn connect_local(
        &mut self,
        endpoint: &Endpoint,
        peer: &Hello,
        send_buffers: u32,
        create: &mut dyn FnMut(&Config) -> Result<S>,
    ) -> Result<QpAddress> {
        let setup = match &mut self.setup {
            Some(s) => s,
            None => self.setup.insert(create(&self.config)?),
        };
        setup.connect(endpoint, &self.config, peer, send_buffers)
    }

    /// Writes out what the machine has to say. The whole handshake writes a few hundred
    /// bytes, far below any socket buffer: a write that would block means a peer that does
    /// not read, and fails the handshake.
    fn flush(&mut self) -> Result<()> {
        while !self.hs.output().is_empty() {
            match (&self.stream).write(self.hs.output()) {
                Ok(n) => self.hs.consume_output(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(Error::Bootstrap {
                        stage: "writing the handshake",
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    pub(crate) fn timed_out(&self) -> Error {
        Error::Bootstrap {
            stage: self.hs.stage(),
            source: io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "handshake with {} not done within {:?}",
                    self.peer_name(),
                    self.config.handshake_timeout
                ),
            ),
        }
    }

    /// The error of a handshake evicted to make room: `max` were pending.
    pub(crate) fn evicted(&self, max: u32) -> Error {
        Error::Bootstrap {
            stage: self.hs.stage(),
            source: io::Error::other(format!(
                "handshake with {} evicted: {max} handshakes pending",
                self.peer_name()
            )),
        }
    }

    pub(crate) fn peer_name(&self) -> String {
        self.peer_addr
            .map_or_else(|| "the peer".to_owned(), |a| a.to_string())
    }
}

impl Pending<Setup> {
    /// The connection, once the handshake is done.
    fn finish(self, endpoint: &Endpoint) -> Result<Connection> {
        let peer = *self.hs.peer().expect("a finished handshake knows its peer");
        let mut setup = self
            .setup
            .expect("a finished handshake set up its queue pair");
        setup.register_send_buffers(endpoint, &peer)?;
        Connection::establish(
            endpoint,
            setup,
            crate::control::Control::Tcp(self.stream),
            &self.config,
            peer,
        )
    }
}

/// The connecting side: runs the handshake over `stream`, blocking, within
/// `config.handshake_timeout`.
pub(crate) fn connect(
    endpoint: &Endpoint,
    stream: TcpStream,
    config: &Config,
    session: Resumption,
) -> Result<Connection> {
    config.check()?;
    let setup = Setup::new(endpoint, config)?;
    let ours = our_hello(
        endpoint,
        config,
        Some(endpoint.address_of(&setup.qp, setup.psn)),
    );
    let hs = Handshake::client_with(ours, config.limits(), config.psk.clone(), nonce()?, session);
    let mut p = Pending::new(stream, hs, Some(setup), config)?;
    let watch = ReadyWatch::new()?;
    watch.add(p.stream.as_fd(), 0)?;
    loop {
        if p.advance(endpoint, &mut |c| Setup::new(endpoint, c))? {
            let (resumable, addr) = (p.hs.resumable(), p.peer_addr);
            let mut conn = p.finish(endpoint)?;
            // A new session the server agreed to resume: we dial again when it is lost.
            if let (true, Resumption::Offer(token), Some(addr), Some(window)) =
                (resumable, session, addr, config.resume_window)
            {
                let patience = config.handshake_timeout;
                let (endpoint, config) = (endpoint.clone(), config.clone());
                let dial: resume::Dial<Connection> = std::sync::Arc::new(move |patience| {
                    dial_resume(&endpoint, addr, &config, token, patience)
                });
                conn.resume = Some(Box::new(Resume::dialing(
                    dial, addr, patience, token, window,
                )));
            }
            return Ok(conn);
        }
        let left = p.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(p.timed_out());
        }
        watch.wait(Some(left))?;
    }
}

/// Accepts bootstrap connections for an [`Endpoint`], running their handshakes concurrently.
///
/// [`accept`](Listener::accept) drives every pending handshake from one poll loop (no thread
/// per client): a client that says nothing, trickles its hello byte by byte or sends garbage
/// holds a socket and a slot, never the other clients, and the server allocates nothing for
/// a client until its hello passed every check (and its key proof, with
/// [`Config::psk`]). At most [`Config::max_pending_handshakes`] run at once; a new client
/// beyond that evicts the oldest pending one. Each has [`Config::handshake_timeout`] in all.
///
/// A client's failure is that client's: it is counted ([`Listener::failed_handshakes`]),
/// traced, and skipped by [`Listener::accept`] and [`Listener::accept_timeout`];
/// [`Listener::accept_outcome_timeout`] reports it. Only the listener's own failure is an
/// error of theirs (see [`Listener::accept`]).
pub struct Listener {
    endpoint: Endpoint,
    tcp: TcpListener,
    watch: ReadyWatch,
    /// Slot `i` is watched as [`token::listener::pending`]`(i)`.
    pending: Mutex<Vec<Option<Pending>>>,
    /// Accepting failed (descriptors or memory exhausted): the listening socket is out of the
    /// watch until then, so that pending handshakes go on and nothing spins on it.
    accept_paused: Mutex<Option<Instant>>,
    failed: FailedHandshakes,
    /// Sessions accepted here that may resume, by token.
    sessions: Arc<Sessions<Connection>>,
}

/// How long a listener stops accepting after `accept(2)` failed for want of resources.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pending = self
            .pending
            .lock()
            .map_or(0, |p| p.iter().flatten().count());
        f.debug_struct("Listener")
            .field("endpoint", &self.endpoint)
            .field("addr", &self.tcp.local_addr().ok())
            .field("pending", &pending)
            .finish()
    }
}

/// The nearest of the pending handshakes' deadlines and the end of an accept pause.
fn nearest_deadline(pending: &[Option<Pending>], paused: Option<Instant>) -> Option<Instant> {
    pending
        .iter()
        .flatten()
        .map(|p| p.deadline)
        .chain(paused)
        .min()
}

impl AsFd for Listener {
    /// The listener's epoll set (the listening socket and every pending handshake's stream):
    /// readable when [`Listener::accept_timeout`] has something to do.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.watch.as_fd()
    }
}

impl Listener {
    pub(crate) fn new(endpoint: Endpoint, tcp: TcpListener) -> Result<Self> {
        tcp.set_nonblocking(true)
            .map_err(bootstrap_err("making the listener non-blocking"))?;
        let watch = ReadyWatch::new()?;
        watch.add(tcp.as_fd(), token::listener::LISTEN)?;
        Ok(Self {
            endpoint,
            tcp,
            watch,
            pending: Mutex::new(Vec::new()),
            accept_paused: Mutex::new(None),
            failed: FailedHandshakes::default(),
            sessions: Arc::default(),
        })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp
            .local_addr()
            .map_err(bootstrap_err("reading the listening address"))
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Returns the first connection whose handshake completes, waiting as long as it takes.
    /// Handshakes begun here and not finished stay pending for the next call (each keeps the
    /// `config` of the call that accepted its client). A client that sends garbage, stalls
    /// past its deadline, does not match, is not authenticated or is evicted failed its own
    /// handshake: it is skipped (counted in [`Listener::failed_handshakes`], traced as
    /// `handshake failed`), and the other pending handshakes go on. An error is the
    /// listener's own: a bad `config`, its socket or epoll set failing, or `accept(2)` out
    /// of descriptors or memory (then the listener stops taking new clients for 100 ms while
    /// the pending handshakes go on, and stays usable).
    pub fn accept(&self, config: &Config) -> Result<Connection> {
        accept_blocking(&mut |left| self.accept_outcome_timeout(config, left))
    }

    /// [`Listener::accept`], waiting at most `timeout` (`None`: as long as it takes);
    /// `Ok(None)` if no handshake completed in time. `Duration::ZERO` moves every handshake
    /// on as far as it can go and never waits: with [`AsFd`], an event loop or async runtime
    /// calls it whenever the listener's descriptor is readable, and at least every
    /// [`Listener::next_timeout`] (handshake deadlines).
    pub fn accept_timeout(
        &self,
        config: &Config,
        timeout: Option<Duration>,
    ) -> Result<Option<Connection>> {
        skip_failed(timeout, &mut |left| {
            self.accept_outcome_timeout(config, left)
        })
    }

    /// How many clients failed their handshake on this listener so far (each also traced as
    /// `handshake failed` with the `tracing` feature).
    pub fn failed_handshakes(&self) -> u64 {
        self.failed.count()
    }

    /// The next client's outcome, for callers who want every client's (an async listener's
    /// stream of them): `Ok(Some(Ok))` a connection, `Ok(Some(Err))` a client that failed its
    /// handshake (the oldest not yet reported: up to 64 are kept between calls, the others
    /// only counted and traced), `Ok(None)` nothing within `timeout`, `Err` the listener's
    /// own failure. Otherwise as [`Listener::accept_timeout`], which is this with the
    /// failures skipped.
    pub fn accept_outcome_timeout(
        &self,
        config: &Config,
        timeout: Option<Duration>,
    ) -> Result<Option<Result<Connection>>> {
        // The clock is read after each wake-up, and again once the handshakes' work is done
        // (setting a queue pair up takes milliseconds), for the deadlines and the wait.
        let mut now = Instant::now();
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| now.checked_add(t));
        config.check()?;
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let mut paused = self
            .accept_paused
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Look at everything first: bytes may have arrived since the last call.
        let mut ready = u64::MAX;
        loop {
            if paused.is_some_and(|until| now >= until) {
                self.watch.add(self.tcp.as_fd(), token::listener::LISTEN)?;
                *paused = None;
                ready |= 1 << token::listener::LISTEN;
            }
            if paused.is_none() && ready & (1 << token::listener::LISTEN) != 0 {
                if let Err(e) = self.take_new(&mut pending, config) {
                    // Out of descriptors or memory, most likely: the listener's own failure.
                    // Report it, and stop accepting for a moment while the pending
                    // handshakes go on.
                    trace::client_refused(&e);
                    let _ = self.watch.remove(self.tcp.as_fd());
                    *paused = Some(now + ACCEPT_BACKOFF);
                    return Err(e);
                }
            }
            for i in 0..pending.len() {
                let Some(p) = &mut pending[i] else { continue };
                let advanced = if ready & (1 << token::listener::pending(i)) != 0 {
                    p.advance(&self.endpoint, &mut |c| Setup::new(&self.endpoint, c))
                } else {
                    Ok(false)
                };
                let outcome = match advanced {
                    Ok(false) if p.deadline > now => continue,
                    Ok(false) => Err(p.timed_out()),
                    Ok(true) => Ok(()),
                    Err(e) => Err(e),
                };
                let p = self.remove(&mut pending, i);
                let from = p.peer_addr;
                let (session, resumable) = (p.hs.session(), p.hs.resumable());
                match outcome.and_then(|()| p.finish(&self.endpoint)) {
                    Ok(conn) => {
                        trace::accepted(from, Ok((conn.qp_num(), conn.peer().addr.qpn)));
                        if let Some(conn) = self.resumable(conn, session, resumable, config) {
                            return Ok(Some(Ok(conn)));
                        }
                    }
                    Err(e) => self.failed.record(from, e),
                }
            }
            if let Some(e) = self.failed.take() {
                return Ok(Some(Err(e)));
            }
            now = Instant::now();
            let next = nearest_deadline(&pending, *paused)
                .into_iter()
                .chain(deadline)
                .min();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            ready = self
                .watch
                .wait(next.map(|d| d.saturating_duration_since(now)))?;
            now = Instant::now();
        }
    }

    /// A connection whose handshake just finished: a new session that may resume gets its
    /// slot here; a resume's connection goes to its session's slot instead of to the caller
    /// (`None`), or is dropped if the session ended since its token was checked.
    fn resumable(
        &self,
        mut conn: Connection,
        session: Resumption,
        resumable: bool,
        config: &Config,
    ) -> Option<Connection> {
        match (session, resumable, config.resume_window) {
            (Resumption::Offer(token), true, Some(window)) => {
                if let Some(slot) = self.sessions.register(token) {
                    conn.resume = Some(Box::new(Resume::accepted(
                        &self.sessions,
                        slot,
                        token,
                        window,
                    )));
                }
                Some(conn)
            }
            (Resumption::Resume(token), true, _) => {
                if let Some(slot) = self.sessions.find(&token) {
                    trace::resume_accepted(conn.qp_num());
                    slot.put(Ok(conn));
                }
                None
            }
            _ => Some(conn),
        }
    }

    /// Takes every waiting client into a free slot. When all are taken the oldest pending
    /// handshake is evicted (that client's failure). An error is the listener's own.
    fn take_new(&self, pending: &mut Vec<Option<Pending>>, config: &Config) -> Result<()> {
        let max = config.max_pending_handshakes as usize;
        loop {
            let stream = match accept_next(&self.tcp) {
                Ok(Some(s)) => s,
                Ok(None) => return Ok(()),
                Err(source) => {
                    return Err(Error::Bootstrap {
                        stage: "accepting",
                        source,
                    })
                }
            };
            let free = pending.iter().take(max).position(Option::is_none);
            let slot = match free {
                Some(i) => i,
                None if pending.len() < max => {
                    pending.push(None);
                    pending.len() - 1
                }
                None => {
                    let waiting = pending.iter().enumerate().filter_map(|(i, p)| {
                        p.as_ref().map(|p| Waiting {
                            key: i,
                            deadline: p.deadline,
                            memory: 0,
                        })
                    });
                    let bound = Bound {
                        most: max,
                        cap: u64::MAX,
                    };
                    let (oldest, _) =
                        to_evict(waiting, bound, 0).expect("a full table has a pending handshake");
                    let p = self.remove(pending, oldest);
                    self.failed.record(p.peer_addr, p.evicted(max as u32));
                    oldest
                }
            };
            let hs = Handshake::server(
                our_hello(&self.endpoint, config, None),
                config.limits(),
                config.psk.clone(),
                nonce()?,
            )
            .resuming(config.resume_window.is_some());
            match Pending::new(stream, hs, None, config) {
                Ok(mut p) => {
                    p.sessions = Some(self.sessions.clone());
                    self.watch
                        .add(p.stream.as_fd(), token::listener::pending(slot))?;
                    trace::handshake_started(p.peer_addr, None);
                    pending[slot] = Some(p);
                }
                Err(e) => self.failed.record(None, e),
            }
        }
    }

    /// Takes pending handshake `i` out of the table and the watch.
    fn remove(&self, pending: &mut [Option<Pending>], i: usize) -> Pending {
        let p = pending[i].take().expect("a pending handshake in this slot");
        // The stream goes on as a connection's (or is closed): the listener must not see it.
        let _ = self.watch.remove(p.stream.as_fd());
        p
    }

    /// Longest an event loop may wait on the listener's descriptor before calling
    /// [`Listener::accept_timeout`] again: the nearest handshake deadline.
    pub fn next_timeout(&self) -> Option<Duration> {
        let pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let paused = *self
            .accept_paused
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        nearest_deadline(&pending, paused).map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Accepts one raw TCP stream (blocking), for protocols of your own (such as
    /// `ibv_rc_pingpong`'s).
    pub fn accept_stream(&self) -> Result<TcpStream> {
        let watch = ReadyWatch::new()?;
        watch.add(self.tcp.as_fd(), 0)?;
        loop {
            match self.tcp.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(bootstrap_err("making the stream blocking"))?;
                    return Ok(s);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    watch.wait(None)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(Error::Bootstrap {
                        stage: "accepting",
                        source,
                    })
                }
            }
        }
    }
}

/// Connecting and listening, the two ways to make a [`Connection`] on an endpoint.
impl Endpoint {
    /// Listens for bootstrap connections on `addr`.
    pub fn listen(&self, addr: impl ToSocketAddrs + fmt::Debug) -> Result<Listener> {
        let tcp = TcpListener::bind(&addr).map_err(|source| Error::Listen {
            addr: format!("{addr:?}"),
            source,
        })?;
        Listener::new(self.clone(), tcp)
    }

    /// Connects to a [`Listener`] at `addr`.
    pub fn connect(
        &self,
        addr: impl ToSocketAddrs + fmt::Debug,
        config: &Config,
    ) -> Result<Connection> {
        let _span = trace_span!(INFO, "connect", addr = ?addr);
        trace::connecting(&addr);
        let made = dial(&addr).and_then(|stream| connect(self, stream, config, offer(config)?));
        trace::connected(
            &addr,
            made.as_ref().map(|c| (c.qp_num(), c.peer().addr.qpn)),
        );
        made
    }
}

/// A connection resuming the session `token` names, dialed to `addr` (where the session's
/// first connection was made) and handshaken within `patience` in all.
pub(crate) fn dial_resume(
    endpoint: &Endpoint,
    addr: SocketAddr,
    config: &Config,
    token: resume::Token,
    patience: Duration,
) -> Result<Connection> {
    let started = Instant::now();
    let stream = TcpStream::connect_timeout(
        &addr,
        patience
            .min(resume::CONNECT_ATTEMPT)
            .max(Duration::from_millis(1)),
    )
    .map_err(|source| Error::Connect {
        addr: addr.to_string(),
        source,
    })?;
    let config = Config {
        handshake_timeout: patience
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1)),
        ..config.clone()
    };
    connect(endpoint, stream, &config, Resumption::Resume(token))
}

/// The bootstrap TCP stream to `addr`, or [`Error::Connect`], which shows the OS's reason
/// (`connection refused`) and what it usually means.
fn dial(addr: &(impl ToSocketAddrs + fmt::Debug)) -> Result<TcpStream> {
    TcpStream::connect(addr).map_err(|source| Error::Connect {
        addr: format!("{addr:?}"),
        source,
    })
}

/// Connects two connections to each other through TCP on loopback, on the default device
/// ([`Endpoint::open_default`]): (accepting side, connecting side). For tests, examples and
/// benchmarks that run both peers in one process.
pub fn loopback_pair(server: &Config, client: &Config) -> Result<(Connection, Connection)> {
    let ep = Endpoint::open_default()?;
    let listener = ep.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let client_ep = ep.clone();
    let client = client.clone();
    let connector = std::thread::spawn(move || client_ep.connect(addr, &client));
    let accepted = listener.accept(server);
    let connected = connector
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    Ok((accepted?, connected?))
}

/// A listener's `accept_outcome_timeout` ([`Listener`], [`CmListener`](crate::CmListener)):
/// the next handshake's outcome within a timeout, a client's failure as `Some(Err)`.
type NextOutcome<'a> = dyn FnMut(Option<Duration>) -> Result<Option<Result<Connection>>> + 'a;

/// `accept` of either listener: the first client whose handshake succeeds, however long it
/// takes.
pub(crate) fn accept_blocking(next: &mut NextOutcome<'_>) -> Result<Connection> {
    loop {
        if let Some(conn) = skip_failed(None, next)? {
            return Ok(conn);
        }
    }
}

/// `accept_timeout` of either listener: its next outcomes with the clients' failures
/// skipped, within `timeout` in all.
pub(crate) fn skip_failed(
    timeout: Option<Duration>,
    next: &mut NextOutcome<'_>,
) -> Result<Option<Connection>> {
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match next(left.or(timeout))? {
            Some(Ok(conn)) => return Ok(Some(conn)),
            // Counted and traced already.
            Some(Err(_)) => {}
            None => return Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::Psk;

    #[test]
    fn a_refused_connect_shows_why_in_its_message() {
        // A port nobody listens on: one just freed.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let e = dial(&addr.as_str()).unwrap_err();
        assert!(
            matches!(&e, Error::Connect { source, .. } if source.kind() == io::ErrorKind::ConnectionRefused),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "cannot connect to \"{addr}\": connection refused (nothing listens there: start \
                 the peer's Listener or Hub first, or check the address and port)"
            )
        );
        let e = dial(&"127.0.0.1:1").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot connect to \"127.0.0.1:1\": connection refused"),
            "{e}"
        );
    }

    #[test]
    fn config_bounds_what_peers_may_ask_and_checks_its_key() {
        let ok = Config::default();
        assert!(ok.check().is_ok());
        assert_eq!(ok.limits().max_buf_size, 1 << 20);
        type Breaker = fn(&mut Config);
        let cases: [Breaker; 7] = [
            |c| c.max_peer_buf_size = 8,
            |c| c.max_peer_recv_depth = 0,
            |c| c.max_send_memory = 10,
            |c| c.max_pending_handshakes = 0,
            |c| c.max_pending_handshakes = 64,
            |c| c.psk = Some(Psk::new([1; 15])),
            |c| c.handshake_timeout = Duration::ZERO,
        ];
        for break_it in cases {
            let mut c = Config::default();
            break_it(&mut c);
            assert!(matches!(c.check(), Err(Error::Config(_))), "{c:?}");
        }
        let keyed = Config {
            psk: Some(Psk::new([1; 16])),
            ..Config::default()
        };
        assert!(keyed.check().is_ok());
        assert!(
            !format!("{keyed:?}").contains("[1, 1"),
            "the key is not printed"
        );
    }
}
