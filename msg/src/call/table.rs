//! The calls waiting for answers, shared by the thread that drives the connection and the
//! callers' handles.

use super::*;
pub(crate) use crate::peer::LostCalls;

/// What a call came to, once its answer is in.
#[derive(Debug)]
pub(crate) enum Outcome {
    Answer(Envelope),
    Failed(Error),
}

impl Outcome {
    /// The answer still encoded, or the failure.
    pub(crate) fn into_result(self) -> Result<Envelope> {
        match self {
            Outcome::Answer(env) => Ok(env),
            Outcome::Failed(e) => Err(e),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Pending {
    peer: Option<PeerId>,
    /// The response type's tag and name.
    expect: (u32, &'static str),
    request: &'static str,
    /// The number its request went under, once it went.
    seq: Option<u32>,
    /// A hub hands its end out as an event ([`crate::Hub::watch`]).
    watched: bool,
    outcome: Option<Outcome>,
}

/// The calls of one session or hub waiting for answers.
#[derive(Debug, Default)]
pub(crate) struct CallTable {
    next: u64,
    pending: HashMap<u64, Pending>,
    stats: CallStats,
    /// A hub's counts per peer (its calls to the peer, and the peer's requests served).
    by_peer: HashMap<PeerId, CallStats>,
    /// Watched calls whose outcome came in, for their hub to hand out.
    ended: Vec<u64>,
}

/// A call table shared with the [`Call`] handles (whose drop cancels).
pub(crate) type Calls = Arc<Mutex<CallTable>>;

/// The call `id` of `R` whose request went (as message `went`, whatever failed after it: that
/// recurs, and ends the call, on the next call that drives the connection), did not go
/// within `timeout` (`Ok(false)`: [`crate::Error::CallTimedOut`]), or failed: a session's and
/// a hub's start.
pub(crate) fn started<R: Request>(
    calls: &Calls,
    id: u64,
    sent: Result<bool>,
    went: Option<u32>,
    timeout: Duration,
    deadline: Option<Instant>,
) -> Result<Call<R::Response>> {
    let request = std::any::type_name::<R>();
    if let Some(seq) = went {
        lock(calls).request_sent(id, seq);
        return Ok(Call::new(id, calls.clone(), request, timeout, deadline));
    }
    match sent {
        Ok(true) => Ok(Call::new(id, calls.clone(), request, timeout, deadline)),
        Ok(false) => {
            lock(calls).give_up(id, true);
            Err(crate::Error::CallTimedOut {
                request,
                after: timeout,
            })
        }
        Err(e) => {
            lock(calls).forget(id);
            Err(e)
        }
    }
}

/// The error of a hub's call to `peer` whose request never left because the peer failed or
/// is gone: [`Error::CallFailed`] with [`RequestFate::NotSent`], as each call the peer's
/// failure ends, so that one match tells a caller it may send the request elsewhere. Other
/// errors (a timeout, a request too large, the hub's own failure) are returned as they are.
pub(crate) fn never_sent<R: Request>(peer: PeerId, e: crate::Error) -> crate::Error {
    use rdmsg_transport::Error as T;
    match e {
        crate::Error::Transport(T::Connection(_) | T::UnknownPeer(_)) => crate::Error::CallFailed {
            request: std::any::type_name::<R>(),
            peer: Some(peer),
            fate: crate::RequestFate::NotSent,
            source: Box::new(e),
        },
        e => e,
    }
}

pub(crate) fn lock(calls: &Calls) -> MutexGuard<'_, CallTable> {
    calls.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CallTable {
    /// Whether call `id`'s answer (or its failure) is in.
    pub(crate) fn is_done(&self, id: u64) -> bool {
        self.pending.get(&id).is_some_and(|p| p.outcome.is_some())
    }

    /// Counts `f` in all and for `peer` (for a peer gone, in all only).
    fn count(&mut self, peer: Option<PeerId>, f: impl Fn(&mut CallStats)) {
        f(&mut self.stats);
        if let Some(s) = peer.and_then(|p| self.by_peer.get_mut(&p)) {
            f(s);
        }
    }

    /// The counts of a peer that is starting a call or has sent a request.
    fn counted(&mut self, peer: Option<PeerId>) {
        if let Some(p) = peer {
            self.by_peer.entry(p).or_default();
        }
    }

    /// A new call's number.
    pub(crate) fn start<R: Request>(&mut self, peer: Option<PeerId>) -> u64 {
        self.next = self.next.wrapping_add(1);
        let id = self.next;
        self.pending.insert(
            id,
            Pending {
                peer,
                expect: (R::Response::TAG, std::any::type_name::<R::Response>()),
                request: std::any::type_name::<R>(),
                seq: None,
                watched: false,
                outcome: None,
            },
        );
        self.counted(peer);
        self.count(peer, |s| {
            s.started += 1;
            s.in_flight += 1;
        });
        id
    }

    /// Call `id` is over: no longer in flight.
    fn remove(&mut self, id: u64) -> Option<Pending> {
        let p = self.pending.remove(&id)?;
        self.count(p.peer, |s| s.in_flight = s.in_flight.saturating_sub(1));
        Some(p)
    }

    /// A call whose request did not go.
    pub(crate) fn forget(&mut self, id: u64) {
        if let Some(p) = self.remove(id) {
            self.count(p.peer, |s| s.started -= 1);
        }
    }

    pub(crate) fn stats(&self) -> CallStats {
        self.stats
    }

    /// The counts of calls to and from `peer`, while it is connected.
    pub(crate) fn peer_stats(&self, peer: PeerId) -> CallStats {
        self.by_peer.get(&peer).copied().unwrap_or_default()
    }

    /// `peer` is gone: its counts are dropped (they stay in the totals).
    pub(crate) fn forget_peer(&mut self, peer: PeerId) {
        self.by_peer.remove(&peer);
    }

    pub(crate) fn answer_dropped(&mut self) {
        self.stats.answers_dropped += 1;
    }

    pub(crate) fn served(&mut self, peer: Option<PeerId>) {
        self.counted(peer);
        self.count(peer, |s| s.served += 1);
    }

    /// An answer arrived from `peer` (its body past the call number and status).
    pub(crate) fn answer(&mut self, peer: Option<PeerId>, id: u64, status: u8, mut env: Envelope) {
        let Some(p) = self
            .pending
            .get_mut(&id)
            .filter(|p| p.peer == peer && p.outcome.is_none())
        else {
            self.count(peer, |s| s.late += 1);
            return;
        };
        let request = p.request;
        p.outcome = Some(match status {
            ANSWERED => {
                env.retag(p.expect.0, p.expect.1);
                // It may wait for its caller a while: not in a receive buffer, whose credit
                // the peer needs.
                env.release_credit();
                Outcome::Answer(env)
            }
            NOT_SERVED => Outcome::Failed(Error::NotServed { request }),
            _ => Outcome::Failed(Error::NoAnswer { request }),
        });
        if p.watched {
            self.ended.push(id);
        }
    }

    /// A hub watches call `id` ([`crate::Hub::watch`]): its peer, if the call is pending. An
    /// outcome already in is listed ended at once.
    pub(crate) fn watch(&mut self, id: u64) -> Option<Option<PeerId>> {
        let p = self.pending.get_mut(&id)?;
        p.watched = true;
        if p.outcome.is_some() {
            self.ended.push(id);
        }
        Some(p.peer)
    }

    /// The watched calls whose outcome came in since last asked.
    pub(crate) fn take_ended(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.ended)
    }

    /// Whether a watched call's outcome came in.
    pub(crate) fn any_ended(&self) -> bool {
        !self.ended.is_empty()
    }

    /// Call `id`'s request went as message `seq`.
    pub(crate) fn request_sent(&mut self, id: u64, seq: u32) {
        if let Some(p) = self.pending.get_mut(&id) {
            p.seq = Some(seq);
        }
    }

    /// The connection to `peer` (every peer: `None` in a session) failed with `error`: each
    /// of its calls fails with [`Error::CallFailed`], saying what became of its request by
    /// `lost` (what the peer's application took, and the calls whose requests never went).
    pub(crate) fn fail_peer(
        &mut self,
        peer: Option<PeerId>,
        lost: &LostCalls,
        error: impl Fn() -> Error,
    ) {
        for (&id, p) in self.pending.iter_mut() {
            if p.outcome.is_none() && (peer.is_none() || p.peer == peer) {
                p.outcome = Some(Outcome::Failed(Error::CallFailed {
                    request: p.request,
                    peer: p.peer,
                    fate: lost.fate(id, p.seq),
                    source: Box::new(error()),
                }));
                if p.watched {
                    self.ended.push(id);
                }
            }
        }
    }

    /// The outcome of call `id`, if it is in (the call is then over).
    pub(crate) fn take(&mut self, id: u64) -> Option<Outcome> {
        let out = self.pending.get_mut(&id)?.outcome.take()?;
        let p = self.remove(id)?;
        if matches!(out, Outcome::Answer(_)) {
            self.count(p.peer, |s| s.answered += 1);
        }
        Some(out)
    }

    /// Call `id` ran out of time (or its handle went): an answer that comes now is late.
    pub(crate) fn give_up(&mut self, id: u64, timed_out: bool) {
        if let Some(p) = self.remove(id) {
            if p.outcome.is_none() && timed_out {
                self.count(p.peer, |s| s.timed_out += 1);
            }
        }
    }
}
