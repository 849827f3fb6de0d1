//! A deterministic model of a completion channel and its queues that obeys the verbs
//! notification semantics, for testing arming and draining logic without a device.
//!
//! Semantics modelled (from the `ibv_req_notify_cq` and `ibv_get_cq_event` documentation):
//! - arming is one-shot: an event disarms the queue;
//! - completions already queued when a queue is armed do not produce an event;
//! - arming again before an event changes nothing but the mode, and `Next` wins over
//!   `SolicitedOnly`: several arms yield one event;
//! - `SolicitedOnly` fires for a receive completion of a solicited message and for any
//!   unsuccessful completion; `Next` fires for any completion;
//! - every event read must be acked before the queue is destroyed ([`ModelCq::destroy`] reports
//!   the hang a real destroy would be);
//! - a queue holding more completions than its capacity overruns.
//!
//! Time is a counter of operations. Arrivals can be scheduled for a given operation number, so a
//! test can make a completion land exactly between a waiter's poll and its arm.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::time::Instant;

use crate::source::{ArmMode, CompletionSource, EventChannel, EventTarget, Readiness};
use crate::Result;

/// A completion in the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelCompletion {
    /// Global arrival number: arrival order across all queues.
    pub seq: u64,
    /// Index of the queue it landed in.
    pub cq: usize,
    /// A receive completion (else a send completion).
    pub recv: bool,
    /// The sender set `IBV_SEND_SOLICITED`.
    pub solicited: bool,
    /// Completed successfully.
    pub success: bool,
}

/// What arrives: the queue and the kind of completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelArrival {
    /// Index of the queue (order of [`Model::add_cq`]).
    pub cq: usize,
    /// A receive completion (else a send completion).
    pub recv: bool,
    /// The sender set `IBV_SEND_SOLICITED`.
    pub solicited: bool,
    /// Completed successfully.
    pub success: bool,
}

impl ModelArrival {
    /// A successful receive.
    pub fn recv(cq: usize, solicited: bool) -> Self {
        Self {
            cq,
            recv: true,
            solicited,
            success: true,
        }
    }

    /// A successful send completion.
    pub fn send(cq: usize) -> Self {
        Self {
            cq,
            recv: false,
            solicited: false,
            success: true,
        }
    }

    /// An error completion (e.g. a flushed receive or a failed send).
    pub fn error(cq: usize, recv: bool) -> Self {
        Self {
            cq,
            recv,
            solicited: false,
            success: false,
        }
    }

    fn wakes(&self, mode: ArmMode) -> bool {
        wakes(mode, self.recv, self.solicited, self.success)
    }
}

/// Whether a completion of this kind produces an event on a queue armed with `mode`.
fn wakes(mode: ArmMode, recv: bool, solicited: bool, success: bool) -> bool {
    match mode {
        ArmMode::Next => true,
        ArmMode::SolicitedOnly => !success || (recv && solicited),
    }
}

#[derive(Debug, Default)]
struct CqModel {
    queue: VecDeque<ModelCompletion>,
    armed: Option<ArmMode>,
    /// Mode of the most recent arm, for the sleeping check.
    last_mode: Option<ArmMode>,
    capacity: usize,
    overrun: bool,
    got: u64,
    acked: u64,
}

#[derive(Debug, Default)]
struct State {
    cqs: Vec<CqModel>,
    events: VecDeque<usize>,
    next_seq: u64,
    now: u64,
    schedule: BTreeMap<u64, Vec<ModelArrival>>,
    violations: Vec<String>,
    arms: u64,
}

impl State {
    fn arrive(&mut self, a: ModelArrival) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let cq = &mut self.cqs[a.cq];
        cq.queue.push_back(ModelCompletion {
            seq,
            cq: a.cq,
            recv: a.recv,
            solicited: a.solicited,
            success: a.success,
        });
        if cq.queue.len() > cq.capacity {
            cq.overrun = true;
        }
        if let Some(mode) = cq.armed {
            if a.wakes(mode) {
                cq.armed = None;
                self.events.push_back(a.cq);
            }
        }
        seq
    }

    /// Advances time by one operation, delivering what was scheduled for it.
    fn tick(&mut self) {
        self.now += 1;
        if let Some(arrivals) = self.schedule.remove(&self.now) {
            for a in arrivals {
                self.arrive(a);
            }
        }
    }
}

/// The model: create queues and a channel from it, then make completions arrive.
#[derive(Debug, Clone, Default)]
pub struct Model {
    state: Rc<RefCell<State>>,
}

impl Model {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// A queue of `capacity` entries reporting to this model's channel.
    pub fn add_cq(&self, capacity: usize) -> ModelCq {
        let mut s = self.state.borrow_mut();
        s.cqs.push(CqModel {
            capacity,
            ..CqModel::default()
        });
        ModelCq {
            id: s.cqs.len() - 1,
            state: self.state.clone(),
        }
    }

    /// The channel.
    pub fn channel(&self) -> ModelChannel {
        ModelChannel {
            state: self.state.clone(),
        }
    }

    /// A completion lands now; returns its arrival number.
    pub fn arrive(&self, a: ModelArrival) -> u64 {
        self.state.borrow_mut().arrive(a)
    }

    /// A completion will land just before operation number `at` (see [`Model::now`]).
    pub fn schedule(&self, at: u64, a: ModelArrival) {
        self.state
            .borrow_mut()
            .schedule
            .entry(at)
            .or_default()
            .push(a);
    }

    /// Operations performed so far (polls, arms, event reads, waits).
    pub fn now(&self) -> u64 {
        self.state.borrow().now
    }

    /// Arrivals scheduled and not yet delivered.
    pub fn pending_schedule(&self) -> usize {
        self.state.borrow().schedule.values().map(Vec::len).sum()
    }

    /// Times a waiter went to sleep while a completion that should wake it sat unreported in a
    /// queue (it would sleep forever), or while a queue was unarmed.
    pub fn violations(&self) -> Vec<String> {
        self.state.borrow().violations.clone()
    }

    /// Completions still queued in queue `cq`.
    pub fn queued(&self, cq: usize) -> usize {
        self.state.borrow().cqs[cq].queue.len()
    }

    /// Events pending in the channel.
    pub fn pending_events(&self) -> usize {
        self.state.borrow().events.len()
    }

    /// Arm calls so far.
    pub fn arms(&self) -> u64 {
        self.state.borrow().arms
    }

    /// Whether queue `cq` overran.
    pub fn overrun(&self, cq: usize) -> bool {
        self.state.borrow().cqs[cq].overrun
    }
}

/// A queue of the model.
#[derive(Debug)]
pub struct ModelCq {
    id: usize,
    state: Rc<RefCell<State>>,
}

impl ModelCq {
    /// Index of this queue in its model.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Events read for this queue and not acked.
    pub fn unacked(&self) -> u64 {
        let s = self.state.borrow();
        s.cqs[self.id].got - s.cqs[self.id].acked
    }

    /// Destroys the queue: fails, as `ibv_destroy_cq` would hang, if events are unacked.
    pub fn destroy(self) -> std::result::Result<(), String> {
        match self.unacked() {
            0 => Ok(()),
            n => Err(format!(
                "ibv_destroy_cq would wait forever for {n} unacked events"
            )),
        }
    }
}

impl CompletionSource for ModelCq {
    type Completion = ModelCompletion;

    fn poll(&mut self, out: &mut [ModelCompletion]) -> Result<usize> {
        let mut s = self.state.borrow_mut();
        s.tick();
        let q = &mut s.cqs[self.id].queue;
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }

    fn arm(&self, mode: ArmMode) -> Result<()> {
        let mut s = self.state.borrow_mut();
        s.tick();
        s.arms += 1;
        let cq = &mut s.cqs[self.id];
        cq.armed = match (cq.armed, mode) {
            (Some(ArmMode::Next), _) => Some(ArmMode::Next),
            (_, m) => Some(m),
        };
        cq.last_mode = cq.armed;
        Ok(())
    }

    fn ack(&self, n: u32) {
        let mut s = self.state.borrow_mut();
        let cq = &mut s.cqs[self.id];
        cq.acked = (cq.acked + u64::from(n)).min(cq.got);
    }
}

/// The model's channel.
#[derive(Debug)]
pub struct ModelChannel {
    state: Rc<RefCell<State>>,
}

impl EventChannel<ModelCq> for ModelChannel {
    fn next_event(&mut self, cqs: &[ModelCq]) -> Result<Option<EventTarget>> {
        let mut s = self.state.borrow_mut();
        s.tick();
        let Some(id) = s.events.pop_front() else {
            return Ok(None);
        };
        s.cqs[id].got += 1;
        Ok(Some(
            cqs.iter()
                .position(|c| c.id == id)
                .map_or(EventTarget::Foreign, EventTarget::Cq),
        ))
    }

    /// Does not sleep: delivers what is scheduled for this instant and reports whether an event
    /// is pending. When it is not, the caller would block: the model then checks that nothing
    /// that should wake it is stranded.
    fn wait_readable(&mut self, _deadline: Option<Instant>, _now: Instant) -> Result<Readiness> {
        let mut s = self.state.borrow_mut();
        s.tick();
        if !s.events.is_empty() {
            return Ok(Readiness::Events);
        }
        let now = s.now;
        let mut found = Vec::new();
        for (i, cq) in s.cqs.iter().enumerate() {
            let Some(mode) = cq.last_mode else {
                found.push(format!("t={now}: sleeping while queue {i} was never armed"));
                continue;
            };
            if cq.armed.is_none() {
                found.push(format!("t={now}: sleeping while queue {i} is not armed"));
            }
            let waking = cq
                .queue
                .iter()
                .find(|c| wakes(mode, c.recv, c.solicited, c.success));
            if let Some(c) = waking {
                found.push(format!(
                    "t={now}: sleeping while completion #{} in queue {i} should have woken the waiter",
                    c.seq
                ));
            }
        }
        s.violations.extend(found);
        Ok(Readiness::TimedOut)
    }
}
