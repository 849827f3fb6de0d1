//! The accepting side of rdma_cm: [`CmListener`], its accepted requests waiting for their
//! `ESTABLISHED`, and the connections waiting for their client's proof of the key.

use std::fmt;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdmsg_verbs::{CmEventChannel, CmId, ReadyWatch};

use super::*;
use crate::token;

/// Accepts connections made through the RDMA connection manager for an [`Endpoint`]
/// ([`Endpoint::listen_cm`]). A request whose hello fails a check is rejected with the reason
/// in the reject, and accepting goes on with the next one. Accepted requests wait for their
/// `ESTABLISHED` (and, with [`Config::psk`], for the client's proof over the queue pair) side
/// by side, each within [`Config::handshake_timeout`], in the same wait as new requests: a
/// client that never completes its side holds its own slot, not the others. At most
/// [`Config::max_pending_handshakes`] wait at once, their receive buffers within
/// [`Config::max_send_memory`] ([`CmListener::handshake_memory`]); beyond either the oldest is
/// dropped. With [`Config::psk`], a client's queue pair grants no remote access (and has no
/// send buffers) until its proof is in: an RDMA read by a stranger of what the endpoint
/// exposes fails.
///
/// A client's failure is that client's, as on every listener: counted
/// ([`CmListener::failed_handshakes`]), traced, skipped by [`CmListener::accept`] and
/// [`CmListener::accept_timeout`], reported by [`CmListener::accept_outcome_timeout`]. Only
/// the listener's own failure is an error of theirs.
pub struct CmListener {
    endpoint: Endpoint,
    channel: CmEventChannel,
    id: CmId,
    watch: ReadyWatch,
    /// Accepted, waiting for the client's side (its `ESTABLISHED`).
    pending: Mutex<Vec<Accepted>>,
    /// Established, waiting for the client's proof of the key (its first message).
    proving: Mutex<Vec<Proving>>,
    failed: FailedHandshakes,
}

/// An established connection whose client has yet to prove the key.
struct Proving {
    conn: Connection,
    /// The client's address, for its failure's trace.
    from: Option<SocketAddr>,
    check: ProofCheck,
    /// Send buffers to register once it has.
    send_buffers: u32,
    deadline: Instant,
    /// The handshake timeout it was accepted with, for its error.
    timeout: Duration,
    /// Bytes registered for it (its receive buffers).
    memory: u64,
}

/// A request accepted and set up, on its own channel (in the listener's watch, keyed by its
/// descriptor), waiting for the client to complete the connection.
struct Accepted {
    id: CmId,
    channel: CmEventChannel,
    setup: Setup,
    peer: Hello,
    config: Config,
    deadline: Instant,
    /// With a key: what the client's first message must prove, and the send buffers to
    /// register once it has.
    proof: Option<(ProofCheck, u32)>,
    /// The CM was told of the client's first message (`rdma_notify`).
    notified: bool,
    /// Bytes registered for it (its receive buffers).
    memory: u64,
}

impl fmt::Debug for CmListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmListener")
            .field("local", &self.id.local_addr())
            .finish()
    }
}

impl AsFd for CmListener {
    /// The listener's epoll set (its event channel, every accepted request's, and every
    /// connection waiting for its client's proof): readable when
    /// [`CmListener::accept_timeout`] has something to do.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.watch.as_fd()
    }
}

impl CmListener {
    /// A listener on `id`, alone on `channel`, listening already.
    pub(super) fn new(endpoint: Endpoint, channel: CmEventChannel, id: CmId) -> Result<Self> {
        let watch = ReadyWatch::new()?;
        watch.add_keyed(channel.as_fd(), token::cm_listener::LISTENER)?;
        Ok(Self {
            endpoint,
            channel,
            id,
            watch,
            pending: Mutex::new(Vec::new()),
            proving: Mutex::new(Vec::new()),
            failed: FailedHandshakes::default(),
        })
    }

    /// How long until the nearest deadline of a handshake under way (`None`: none is): an
    /// event loop waiting on the listener's descriptor calls
    /// [`CmListener::accept_timeout`] by then, so that it fails on time.
    pub fn next_timeout(&self) -> Option<Duration> {
        let pending = self.lock_pending().iter().map(|a| a.deadline).min();
        let proving = self.lock_proving().iter().map(|p| p.deadline).min();
        pending
            .into_iter()
            .chain(proving)
            .min()
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// The address listened on (with the port picked, if 0 was asked for).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The endpoint connections are made on.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Waits for the next client whose handshake succeeds. A client that fails its own (a
    /// hello refused with the reason, silence or a wrong proof past its deadline, gone
    /// half-way, evicted to make room, or what could not be set up for it) is skipped:
    /// counted in [`CmListener::failed_handshakes`], traced as `handshake failed`. An error
    /// is the listener's own: a bad `config`, its event channel or epoll set failing.
    pub fn accept(&self, config: &Config) -> Result<Connection> {
        crate::bootstrap::accept_blocking(&mut |left| self.accept_outcome_timeout(config, left))
    }

    /// [`CmListener::accept`] for at most `timeout` (`None`: for ever); `Ok(None)` when no
    /// client finished its handshake in time. `Duration::ZERO` moves every handshake on as
    /// far as it can go and never waits (for an event loop on [`AsFd`]).
    pub fn accept_timeout(
        &self,
        config: &Config,
        timeout: Option<Duration>,
    ) -> Result<Option<Connection>> {
        crate::bootstrap::skip_failed(timeout, &mut |left| {
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
    /// own failure. Otherwise as [`CmListener::accept_timeout`], which is this with the
    /// failures skipped.
    pub fn accept_outcome_timeout(
        &self,
        config: &Config,
        timeout: Option<Duration>,
    ) -> Result<Option<Result<Connection>>> {
        config.check()?;
        // The clock is read after each wake-up, and again once the handshakes' work is done
        // (setting a queue pair up takes milliseconds), for the deadlines and the wait.
        let mut now = Instant::now();
        let deadline = timeout.map(|t| deadline_after(now, t));
        let mut ready = Vec::new();
        loop {
            // New requests: checked, set up and accepted at once (nothing in them waits).
            while let Some(mut ev) = self.channel.next_event()? {
                if ev.kind == CmEventKind::ConnectRequest {
                    let from = ev.request.as_ref().and_then(CmId::peer_addr);
                    match self.start(&mut ev, config, now) {
                        Ok(accepted) => {
                            self.watch
                                .add_keyed(accepted.channel.as_fd(), accepted.key())?;
                            self.watch.add_keyed(
                                accepted.setup.channel.as_fd(),
                                accepted.completions_key(),
                            )?;
                            self.lock_pending().push(accepted);
                        }
                        Err(e) => self.failed.record(from, e),
                    }
                }
            }
            if let Some(conn) = self.finish_one(now)? {
                return Ok(Some(Ok(conn)));
            }
            if let Some(conn) = self.prove_one(now) {
                return Ok(Some(Ok(conn)));
            }
            if let Some(e) = self.failed.take() {
                return Ok(Some(Err(e)));
            }
            now = Instant::now();
            let next = self
                .lock_pending()
                .iter()
                .map(|a| a.deadline)
                .chain(self.lock_proving().iter().map(|p| p.deadline))
                .chain(deadline)
                .min();
            if deadline.is_some_and(|d| d <= now) {
                return Ok(None);
            }
            ready.clear();
            self.watch
                .wait_keys(next.map(|n| n.saturating_duration_since(now)), &mut ready)?;
            now = Instant::now();
        }
    }

    /// Takes a pending accept's channels out of the watch: its id's goes on as the
    /// connection's (or is closed), its completion channel is the connection's to wait on.
    fn unwatch(&self, a: &Accepted) {
        let _ = self.watch.remove(a.channel.as_fd());
        let _ = self.watch.remove(a.setup.channel.as_fd());
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Vec<Accepted>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_proving(&self) -> std::sync::MutexGuard<'_, Vec<Proving>> {
        self.proving.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops the oldest waiting handshakes (accepted or proving) until one more costing
    /// `memory` fits: fewer than `most` wait, and the memory they registered and `memory`
    /// stay within `cap` (or none waits: one handshake always fits).
    fn make_room(&self, most: usize, memory: u64, cap: u64) {
        let mut pending = self.lock_pending();
        let mut proving = self.lock_proving();
        let bound = Bound { most, cap };
        loop {
            // Accepted ones first: of two as old, the one further from done goes.
            let accepted = pending.iter().enumerate().map(|(i, a)| Waiting {
                key: (true, i),
                deadline: a.deadline,
                memory: a.memory,
            });
            let waiting = accepted.chain(proving.iter().enumerate().map(|(i, p)| Waiting {
                key: (false, i),
                deadline: p.deadline,
                memory: p.memory,
            }));
            let Some(((accepted, i), why)) = to_evict(waiting, bound, memory) else {
                return;
            };
            let why = why.to_string();
            if accepted {
                let a = pending.swap_remove(i);
                self.unwatch(&a);
                let from = a.id.peer_addr();
                self.failed
                    .record(from, evicted(from, "its ESTABLISHED", &why));
            } else {
                let p = proving.swap_remove(i);
                let _ = self.watch.remove(p.conn.as_fd());
                self.failed
                    .record(p.from, evicted(p.from, "its proof of the key", &why));
            }
        }
    }

    /// Memory registered for the handshakes under way (accepted, or established and waiting
    /// for the client's proof of the key): their receive buffers, nothing else (send
    /// buffers wait for the handshake's end). At most [`Config::max_send_memory`] of the
    /// accepting call's config, or one handshake's if that is more: beyond it the oldest is
    /// dropped, however few wait.
    pub fn handshake_memory(&self) -> u64 {
        let pending: u64 = self.lock_pending().iter().map(|a| a.memory).sum();
        pending + self.lock_proving().iter().map(|p| p.memory).sum::<u64>()
    }

    /// The first established connection whose client proved the key; those that sent
    /// anything else, failed, or ran out of time are dropped (which disconnects them) and
    /// recorded as failed.
    fn prove_one(&self, now: Instant) -> Option<Connection> {
        let mut proving = self.lock_proving();
        let mut i = 0;
        while i < proving.len() {
            let p = &mut proving[i];
            let outcome = (|| -> Result<Option<()>> {
                // Armed for the next message once nothing is left to handle.
                while p.conn.step()? {}
                match p.conn.try_recv()? {
                    Some(first) => p.check.check(&first).map(Some).map_err(Error::BadHandshake),
                    None if p.deadline <= now => Err(handshake_timed_out(
                        "the client's proof of the key (its first message)",
                        p.timeout,
                    )),
                    None => Ok(None),
                }
            })();
            if let Ok(None) = outcome {
                i += 1;
                continue;
            }
            let mut p = proving.swap_remove(i);
            let _ = self.watch.remove(p.conn.as_fd());
            // Proved: its queue pair may now serve reads of what the endpoint exposes, and
            // its send buffers are registered.
            let granted = outcome
                .and_then(|_| p.conn.allow_remote_read())
                .and_then(|()| p.conn.add_send_buffers(p.send_buffers));
            match granted {
                Ok(()) => return Some(p.conn),
                Err(e) => self.failed.record(p.from, e),
            }
        }
        None
    }

    /// The first pending accept whose client completed the connection, as a connection;
    /// those that failed or ran out of time are dropped (which refuses or disconnects them)
    /// and recorded as failed. An error is the listener's own (its epoll set).
    fn finish_one(&self, now: Instant) -> Result<Option<Connection>> {
        let mut pending = self.lock_pending();
        let mut i = 0;
        while i < pending.len() {
            let a = &mut pending[i];
            if !a.notified && a.data_arrived() {
                // The client's first message: its side is connected whatever became of its
                // RTU. The CM establishes the connection on this (ESTABLISHED follows on the
                // id's channel); where it cannot, the RTU still does.
                a.notified = true;
                let _ = a.id.notify_established();
            }
            let from = a.id.peer_addr();
            let name = || from.map_or_else(|| "?".into(), |a| a.to_string());
            let outcome = match a.channel.next_event() {
                Ok(Some(ev)) if ev.kind == CmEventKind::Established && ev.status == 0 => Ok(()),
                Ok(Some(ev)) => Err(cm_failure(&ev, &name(), "accepting")),
                Ok(None) if a.deadline <= now => Err(handshake_timed_out(
                    "the client's side of the connection (its RTU or first message)",
                    a.config.handshake_timeout,
                )),
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Err(e) => Err(e.into()),
            };
            let a = pending.swap_remove(i);
            self.unwatch(&a);
            if let Err(e) = outcome {
                self.failed.record(from, e);
                continue;
            }
            drop(pending);
            let Accepted {
                id,
                channel,
                setup,
                peer,
                config,
                deadline,
                proof,
                memory,
                ..
            } = a;
            let conn = match Connection::establish(
                &self.endpoint,
                setup,
                Control::Cm(CmLink::new(channel, id)),
                &config,
                peer,
            ) {
                Ok(conn) => conn,
                Err(e) => {
                    self.failed.record(from, e);
                    return self.finish_one(now);
                }
            };
            let Some((check, send_buffers)) = proof else {
                return Ok(Some(conn));
            };
            // Handed out once its client's first message proves the key.
            self.watch.add_keyed(conn.as_fd(), proving_key(&conn))?;
            self.lock_proving().push(Proving {
                conn,
                from,
                check,
                send_buffers,
                deadline,
                timeout: config.handshake_timeout,
                memory,
            });
            // The others may be done too: look at them now (an event loop waiting on the
            // listener's descriptor is not told twice).
            return self.finish_one(now);
        }
        Ok(None)
    }

    /// Checks one request's hello, sets up its side and accepts it; rejects it with the
    /// reason on a failed check.
    fn start(&self, request: &mut CmEvent, config: &Config, now: Instant) -> Result<Accepted> {
        let mut id = request.request.take().ok_or_else(|| Error::Cm {
            addr: "?".into(),
            stage: "accepting",
            detail: "a connection request without its id".into(),
        })?;
        let name = id.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
        let endpoint = &self.endpoint;
        let ours = our_hello(endpoint, config, None);
        let keyed = config.psk.is_some();
        let (send_buffers, peer) = match check_request(&ours, config, request) {
            Ok(ok) => ok,
            Err(reason) => {
                let _ = id.reject(&encode_reject(reason));
                return Err(Error::BadHandshake(reason));
            }
        };
        if let Err(e) = check_device(endpoint, &id, &name) {
            let _ = id.reject(&encode_reject(Reject::Resources));
            return Err(e);
        }
        // Only a request that passed its checks takes a place among the waiting ones, within
        // both bounds: their number, and what they register in all.
        let memory = handshake_memory(config);
        self.make_room(
            config.max_pending_handshakes as usize,
            memory,
            config.max_send_memory,
        );
        let params = read_params(endpoint, config, &request.params);
        let made = (|| -> Result<Setup> {
            // With a key, a client that has proved nothing gets no remote access: a region
            // exposed in the endpoint's protection domain is readable under its key through
            // any of its queue pairs that allows remote read. Granted once the proof is in.
            let mut setup = if keyed {
                Setup::closed(endpoint, config)?
            } else {
                Setup::new(endpoint, config)?
            };
            setup.set_send_buffers(send_buffers);
            // With a key, a client that has proved nothing pins no send buffers: they are
            // registered once its proof is in.
            if !keyed {
                setup.register_send_buffers(endpoint, &peer)?;
            }
            id.ready_qp(&mut setup.qp, &tuning(endpoint, config, Some(params)))?;
            // The client's first message may come before its RTU (which may be lost): its
            // receive completion is watched for ([`Accepted::data_arrived`]). Armed before
            // the accept, when nothing can have arrived yet (the client learns our queue
            // pair's number from the accept).
            setup.channel.set_nonblocking(true)?;
            setup.recv_cq.req_notify(false)?;
            Ok(setup)
        })();
        let setup = match made {
            Ok(s) => s,
            Err(e) => {
                let _ = id.reject(&encode_reject(Reject::Resources));
                return Err(e);
            }
        };
        // Its own channel before the accept, so that its ESTABLISHED (and everything after)
        // lands there, not among the listener's requests.
        let channel = CmEventChannel::new()?;
        id.migrate(&channel)?;
        let (answer, proof) = match encode_accept(
            &ours,
            config.psk.as_ref(),
            &request.private_data,
            &cm_nonce()?,
            &Ends {
                client_qpn: request.peer_qp_num,
                server_qpn: setup.qp.qp_num(),
                client_ip: ip_of(id.peer_addr()),
                server_ip: ip_of(id.local_addr()),
            },
        ) {
            Ok(a) => a,
            Err(reason) => {
                let _ = id.reject(&encode_reject(reason));
                return Err(Error::BadHandshake(reason));
            }
        };
        id.accept(&setup.qp, &params, &answer)?;
        Ok(Accepted {
            id,
            channel,
            setup,
            peer,
            config: config.clone(),
            deadline: deadline_after(now, config.handshake_timeout),
            proof: proof.map(|check| (check, send_buffers)),
            notified: false,
            memory,
        })
    }
}

/// What one handshake under way registers with `config`: its receive buffers.
fn handshake_memory(config: &Config) -> u64 {
    u64::from(config.recv_depth + u32::from(config.grant_slots)) * u64::from(config.buf_size)
}

/// A handshake with a client that ran out of time waiting for `what`.
fn handshake_timed_out(what: &'static str, after: Duration) -> Error {
    Error::Timeout(TimedOut {
        op: "accepting over rdma_cm",
        waiting_for: what,
        after,
    })
}

/// The failure of a handshake evicted from a listener full of them (`why`) while waiting
/// for `what` of the client at `from`.
fn evicted(from: Option<SocketAddr>, what: &str, why: &str) -> Error {
    Error::Cm {
        addr: from.map_or_else(|| "?".into(), |a| a.to_string()),
        stage: "accepting",
        detail: format!("evicted while waiting for {what}: {why}"),
    }
}

/// Watch key of a connection waiting for its client's proof: its descriptor, as a pending
/// accept's key is its channel's (never the same while both are open).
fn proving_key(conn: &Connection) -> u64 {
    use std::os::fd::AsRawFd;
    conn.as_fd().as_raw_fd() as u64
}

impl Accepted {
    fn key(&self) -> u64 {
        token::cm_listener::descriptor(&self.channel)
    }

    /// Watch key of its completion channel: its descriptor too.
    fn completions_key(&self) -> u64 {
        token::cm_listener::descriptor(&self.setup.channel)
    }

    /// Whether a receive completed on its queue pair since the accept (the CQ armed then has
    /// fired). Each event read is acknowledged here; the CQ is not armed again (the
    /// connection that takes the channel over arms it its own way, and an event of this arm
    /// that it reads instead is one spurious wake-up).
    fn data_arrived(&self) -> bool {
        let mut arrived = false;
        while let Ok(Some(ev)) = self.setup.channel.get_event() {
            let cq = if ev.is_for(&self.setup.recv_cq) {
                arrived = true;
                &self.setup.recv_cq
            } else {
                &self.setup.send_cq
            };
            drop(ev);
            cq.ack_events(1);
        }
        arrived
    }
}
