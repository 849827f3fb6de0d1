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
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdmsg_verbs::{
    Access, Buffer, CompletionChannel, CompletionQueue, QpCaps, QueuePair, ReadyWatch,
};

use crate::addr::QpAddress;
use crate::connection::{random_psn, Config, Connection};
use crate::endpoint::Endpoint;
use crate::handshake::{Action, Handshake, Hello, Reject, GOODBYE, NONCE_LEN, VERSION};
use crate::pool::RecvPool;
use crate::{Error, Result};

/// The verbs resources of one connection in the making.
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) channel: CompletionChannel,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) qp: QueuePair,
    pub(crate) pool: RecvPool,
    /// Registered only once the handshake is complete (see [`Setup::register_send_buffers`]).
    pub(crate) send_bufs: Vec<Buffer>,
    /// How many send buffers the handshake settled on.
    send_buffers: u32,
    pub(crate) psn: u32,
}

impl Setup {
    /// Creates the completion channel, both CQs and the queue pair, moves it to INIT and posts
    /// every receive buffer (before RTR: the credits the peer starts with are real).
    fn new(endpoint: &Endpoint, config: &Config) -> Result<Self> {
        let ctx = endpoint.context();
        let pd = endpoint.pd();
        let recv_total = config.recv_depth + u32::from(config.grant_slots);
        let channel = CompletionChannel::new(ctx)?;
        let send_cq = CompletionQueue::new(ctx, config.send_depth, Some(&channel))?;
        let recv_cq = CompletionQueue::new(
            ctx,
            config.recv_cq_entries().unwrap_or(recv_total),
            Some(&channel),
        )?;
        let caps = QpCaps {
            max_send_wr: config.send_depth,
            max_recv_wr: recv_total,
            max_inline_data: config.max_inline,
        };
        let mut qp = QueuePair::new_rc(pd, &send_cq, &recv_cq, caps)?;
        qp.to_init(endpoint.port())?;
        let mut pool = RecvPool::new(pd, recv_total as usize, config.buf_size as usize)?;
        if let Err(e) = qp.post_recv(pool.take_free()) {
            for b in e.unposted {
                pool.put_back(b);
            }
            return Err(e.error.into());
        }
        let psn = random_psn(qp.qp_num());
        Ok(Self {
            channel,
            send_cq,
            recv_cq,
            qp,
            pool,
            send_bufs: Vec::new(),
            send_buffers: 0,
            psn,
        })
    }

    /// Registers the send buffers, sized by the peer's receive buffers. Only once the handshake
    /// is complete: a client that stops before its "ready" (authenticated or not) must not
    /// hold `send_depth` × its buffer size of pinned memory per pending handshake.
    fn register_send_buffers(&mut self, endpoint: &Endpoint, peer: &Hello) -> Result<()> {
        let size = peer.buf_size as usize;
        self.send_bufs = endpoint
            .pd()
            .register(self.send_buffers as usize * size, Access::LOCAL_WRITE)?
            .chunks(size)?;
        Ok(())
    }
}

/// The local half of a connection in the making: its queue pair, created (by the server) only
/// once the client's hello passed, then connected towards the peer.
pub(crate) trait LocalSide: Sized {
    /// Moves the queue pair to RTR and RTS towards `peer`, noting how many send buffers the
    /// handshake settled on; returns the queue pair's address.
    fn connect(
        &mut self,
        endpoint: &Endpoint,
        config: &Config,
        peer: &Hello,
        send_buffers: u32,
    ) -> Result<QpAddress>;
}

impl LocalSide for Setup {
    fn connect(
        &mut self,
        endpoint: &Endpoint,
        config: &Config,
        peer: &Hello,
        send_buffers: u32,
    ) -> Result<QpAddress> {
        self.send_buffers = send_buffers;
        endpoint.connect_qp(&mut self.qp, self.psn, &peer.addr, &config.path)?;
        Ok(endpoint.address_of(&self.qp, self.psn))
    }
}

/// What this side announces; `addr` is `None` on the server until its queue pair exists.
pub(crate) fn our_hello(endpoint: &Endpoint, config: &Config, addr: Option<QpAddress>) -> Hello {
    #[cfg(feature = "test-hooks")]
    let (lie, lie_buf) = (
        config.hooks.overstate_credits,
        config.hooks.overstate_buf_size,
    );
    #[cfg(not(feature = "test-hooks"))]
    let (lie, lie_buf) = (0, 0);
    Hello {
        version: VERSION,
        addr: addr.unwrap_or(QpAddress {
            lid: 0,
            qpn: 0,
            psn: 0,
            gid: rdmsg_verbs::Gid([0; 16]),
        }),
        mtu: endpoint.path_mtu(&config.path).bytes() as u32,
        buf_size: config.buf_size + lie_buf,
        recv_depth: config.recv_depth + lie,
        grant_slots: config.grant_slots,
        initial_credits: config.recv_depth + lie,
    }
}

/// Fresh random bytes for a handshake nonce, from the operating system.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| Error::Bootstrap {
        stage: "drawing a random nonce",
        source: e.raw_os_error().map_or_else(
            || io::Error::other(e.to_string()),
            io::Error::from_raw_os_error,
        ),
    })?;
    Ok(n)
}

pub(crate) fn bootstrap_err(stage: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Bootstrap { stage, source }
}

/// What a bootstrap stream brings after the handshake, where at most a goodbye may come. Read
/// by a connection's liveness check and by the hub when the stream is readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterHandshake {
    /// Nothing to read now.
    Nothing,
    /// Junk (this byte): the connection fails at once.
    Garbage(u8),
    /// The peer closed gracefully: its close message is delivered or on its way.
    Goodbye,
    /// The stream ended without a goodbye: the peer's process is gone, or its side failed.
    Ended,
}

impl AfterHandshake {
    /// Reads what is there on the non-blocking `stream`.
    pub(crate) fn read(stream: &TcpStream) -> Self {
        let mut buf = [0u8; 64];
        let (n, eof) = match (&*stream).read(&mut buf) {
            Ok(0) => (0, true),
            Ok(n) => (n, false),
            Err(e) => (
                0,
                !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ),
            ),
        };
        if let Some((_, &byte)) = buf[..n]
            .iter()
            .enumerate()
            .find(|&(i, &b)| i > 0 || b != GOODBYE)
        {
            Self::Garbage(byte)
        } else if n == 1 {
            Self::Goodbye
        } else if eof {
            Self::Ended
        } else {
            Self::Nothing
        }
    }

    /// How long to wait for the peer's close message before calling it vanished: up to
    /// `close_timeout` after a goodbye, 50 ms after a bare end of stream (one may still be in
    /// flight).
    pub(crate) fn grace(self, close_timeout: Duration) -> Duration {
        if self == Self::Goodbye {
            close_timeout
        } else {
            Duration::from_millis(50)
        }
    }
}

/// Accepts the next waiting client on the non-blocking `tcp`: `Ok(None)` when none waits;
/// interrupted calls and clients gone before they were accepted are skipped.
pub(crate) fn accept_next(tcp: &TcpListener) -> io::Result<Option<TcpStream>> {
    loop {
        match tcp.accept() {
            Ok((s, _)) => return Ok(Some(s)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

/// One handshake over a non-blocking stream, and the resources it set up so far.
#[derive(Debug)]
pub(crate) struct Pending<S = Setup> {
    pub(crate) stream: TcpStream,
    peer_addr: Option<SocketAddr>,
    pub(crate) hs: Handshake,
    /// The client's from the start; the server's once the client passed.
    pub(crate) setup: Option<S>,
    config: Config,
    pub(crate) deadline: Instant,
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
        Ok(Self {
            peer_addr: stream.peer_addr().ok(),
            stream,
            hs,
            setup,
            config: config.clone(),
            deadline: Instant::now() + config.handshake_timeout,
        })
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
        Connection::establish(endpoint, setup, self.stream, &self.config, peer)
    }
}

/// The connecting side: runs the handshake over `stream`, blocking, within
/// `config.handshake_timeout`.
pub(crate) fn connect(
    endpoint: &Endpoint,
    stream: TcpStream,
    config: &Config,
) -> Result<Connection> {
    config.check()?;
    let setup = Setup::new(endpoint, config)?;
    let ours = our_hello(
        endpoint,
        config,
        Some(endpoint.address_of(&setup.qp, setup.psn)),
    );
    let hs = Handshake::client(ours, config.limits(), config.psk.clone(), nonce()?);
    let mut p = Pending::new(stream, hs, Some(setup), config)?;
    let watch = ReadyWatch::new()?;
    watch.add(p.stream.as_fd(), 0)?;
    loop {
        if p.advance(endpoint, &mut |c| Setup::new(endpoint, c))? {
            return p.finish(endpoint);
        }
        let left = p.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(p.timed_out());
        }
        watch.wait(Some(left))?;
    }
}

/// Watch token of the listening socket; pending handshake `i` has token `i + 1`.
const LISTEN_TOKEN: u8 = 0;
/// Most handshakes a listener runs at once (tokens below 64).
pub(crate) const MAX_PENDING: u32 = 63;

/// Accepts bootstrap connections for an [`Endpoint`], running their handshakes concurrently.
///
/// [`accept`](Listener::accept) drives every pending handshake from one poll loop (no thread
/// per client): a client that says nothing, trickles its hello byte by byte or sends garbage
/// holds a socket and a slot, never the other clients, and the server allocates nothing for
/// a client until its hello passed every check (and its key proof, with
/// [`Config::psk`]). At most [`Config::max_pending_handshakes`] run at once; a new client
/// beyond that evicts the oldest pending one. Each has [`Config::handshake_timeout`] in all.
pub struct Listener {
    endpoint: Endpoint,
    tcp: TcpListener,
    watch: ReadyWatch,
    /// Slot `i` is watched as token `i + 1`.
    pending: Mutex<Vec<Option<Pending>>>,
    /// Accepting failed (descriptors or memory exhausted): the listening socket is out of the
    /// watch until then, so that pending handshakes go on and nothing spins on it.
    accept_paused: Mutex<Option<Instant>>,
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
        watch.add(tcp.as_fd(), LISTEN_TOKEN)?;
        Ok(Self {
            endpoint,
            tcp,
            watch,
            pending: Mutex::new(Vec::new()),
            accept_paused: Mutex::new(None),
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
    /// past its deadline, does not match, is not authenticated or is evicted makes this call
    /// return its error ([`Error::BadHandshake`], [`Error::Rejected`], [`Error::Bootstrap`]):
    /// the listener stays usable and the other pending handshakes go on.
    pub fn accept(&self, config: &Config) -> Result<Connection> {
        loop {
            if let Some(conn) = self.accept_timeout(config, None)? {
                return Ok(conn);
            }
        }
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
        // A timeout too long to add to the clock is no deadline at all.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        config.check()?;
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let mut paused = self
            .accept_paused
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Look at everything first: bytes may have arrived since the last call.
        let mut ready = u64::MAX;
        loop {
            if paused.is_some_and(|until| Instant::now() >= until) {
                self.watch.add(self.tcp.as_fd(), LISTEN_TOKEN)?;
                *paused = None;
                ready |= 1 << LISTEN_TOKEN;
            }
            if paused.is_none() && ready & (1 << LISTEN_TOKEN) != 0 {
                match self.take_new(&mut pending, config) {
                    Ok(None) => {}
                    Ok(Some(evicted)) => return Err(evicted),
                    Err(e) => {
                        // Out of descriptors or memory, most likely: report it, and stop
                        // accepting for a moment while the pending handshakes go on.
                        let _ = self.watch.remove(self.tcp.as_fd());
                        *paused = Some(Instant::now() + ACCEPT_BACKOFF);
                        return Err(e);
                    }
                }
            }
            let now = Instant::now();
            for i in 0..pending.len() {
                let Some(p) = &mut pending[i] else { continue };
                let advanced = if ready & (1 << (i + 1)) != 0 {
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
                return outcome.and_then(|()| p.finish(&self.endpoint)).map(Some);
            }
            let next = nearest_deadline(&pending, *paused)
                .into_iter()
                .chain(deadline)
                .min();
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            ready = self
                .watch
                .wait(next.map(|d| d.saturating_duration_since(Instant::now())))?;
        }
    }

    /// Takes every waiting client into a free slot. When all are taken the oldest pending
    /// handshake is evicted; the first one evicted is returned, to be reported.
    fn take_new(
        &self,
        pending: &mut Vec<Option<Pending>>,
        config: &Config,
    ) -> Result<Option<Error>> {
        let max = config.max_pending_handshakes as usize;
        let mut evicted = None;
        loop {
            let stream = match accept_next(&self.tcp) {
                Ok(Some(s)) => s,
                Ok(None) => return Ok(evicted),
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
                    let oldest = (0..pending.len())
                        .filter(|&i| pending[i].is_some())
                        .min_by_key(|&i| pending[i].as_ref().map(|p| p.deadline))
                        .expect("a full table has a pending handshake");
                    let p = self.remove(pending, oldest);
                    evicted.get_or_insert(p.evicted(max as u32));
                    oldest
                }
            };
            let hs = Handshake::server(
                our_hello(&self.endpoint, config, None),
                config.limits(),
                config.psk.clone(),
                nonce()?,
            );
            match Pending::new(stream, hs, None, config) {
                Ok(p) => {
                    self.watch.add(p.stream.as_fd(), slot as u8 + 1)?;
                    pending[slot] = Some(p);
                }
                Err(e) => {
                    evicted.get_or_insert(e);
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::Psk;

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
