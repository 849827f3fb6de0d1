//! rdmsg's own threads for the verbs work that has no place on a runtime's threads:
//! handshakes (creating queue pairs, registering memory), closes, and the teardown of what
//! the last handle let go of.
//!
//! Not tokio's blocking pool: when all its threads are busy it creates one more on the
//! caller's thread, which takes milliseconds too (and a dropped handle would wait for it).
//! Here a runtime thread only queues the job and wakes a thread; a thread of the pool's own
//! creates the workers, and workers idle for [`IDLE`] end, all but one: the close after a
//! quiet spell (a session that only exchanged messages for a while) finds a thread waiting
//! rather than starting one, which costs milliseconds and a few dozen allocations.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

/// A job; it returns whether it counted itself in [`State::handing_back`] (see [`spawn`]),
/// which the worker undoes once it is back for the next job.
type Job = Box<dyn FnOnce() -> bool + Send>;

/// How long a worker waits for a job before it ends.
const IDLE: Duration = Duration::from_secs(10);

/// Most workers at once: beyond, jobs wait their turn (closes waiting for their peers could
/// otherwise take a thread each).
const MAX_WORKERS: usize = 64;

struct Pool {
    state: Mutex<State>,
    work: Condvar,
    /// Asks the thread that creates workers for one more.
    grow: mpsc::Sender<()>,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Workers running.
    workers: usize,
    idle: usize,
    /// Workers asked for and not started yet.
    coming: usize,
    /// Workers whose job has its result and is handing it back: each takes the next job
    /// before it idles. Without them counted, a job queued by the task that the result woke
    /// (a session's teardown right after its close) found no worker idle yet and started a
    /// thread, which the cost check counted as 0.023 allocations per round trip.
    handing_back: usize,
}

fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (grow, asked) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("rdmsg-spawner".into())
            .spawn(move || {
                for () in asked {
                    let started = std::thread::Builder::new()
                        .name("rdmsg-verbs".into())
                        .spawn(work);
                    if started.is_err() {
                        // No thread to be had: the jobs waiting run here.
                        if let Some(p) = pool() {
                            p.lock().coming -= 1;
                            loop {
                                let next = p.lock().jobs.pop_front();
                                let Some(job) = next else { break };
                                let done =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                                if matches!(done, Ok(true)) {
                                    p.lock().handing_back -= 1;
                                }
                            }
                        }
                    }
                }
            })
            .ok()
            .map(|_| Pool {
                state: Mutex::default(),
                work: Condvar::new(),
                grow,
            })
    })
    .as_ref()
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Jobs run outside the lock: nothing panics holding it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A worker: runs jobs until none came for [`IDLE`] (the last one stays).
fn work() {
    let Some(pool) = pool() else { return };
    let mut state = pool.lock();
    state.coming -= 1;
    state.workers += 1;
    loop {
        if let Some(job) = state.jobs.pop_front() {
            drop(state);
            // A job that panics ends its own task's result, not the worker.
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            state = pool.lock();
            if matches!(done, Ok(true)) {
                state.handing_back -= 1;
            }
            continue;
        }
        state.idle += 1;
        let (next, waited) = pool
            .work
            .wait_timeout(state, IDLE)
            .unwrap_or_else(|p| p.into_inner());
        state = next;
        state.idle -= 1;
        if waited.timed_out() && state.jobs.is_empty() && state.workers > 1 {
            state.workers -= 1;
            return;
        }
    }
}

/// Runs `job` on a worker; where no thread can be had at all, here.
pub(crate) fn run(job: impl FnOnce() + Send + 'static) {
    queue(Box::new(move || {
        job();
        false
    }));
}

fn queue(job: Job) {
    let Some(pool) = pool() else {
        job();
        return;
    };
    let mut state = pool.lock();
    state.jobs.push_back(job);
    // Idle workers, those handing a result back and those on their way take the jobs
    // waiting; more jobs, more workers.
    if state.idle + state.handing_back + state.coming < state.jobs.len()
        && state.workers + state.coming < MAX_WORKERS
    {
        state.coming += 1;
        if pool.grow.send(()).is_err() {
            state.coming -= 1;
        }
    }
    drop(state);
    pool.work.notify_one();
}

/// Runs `job` on a worker, its result awaited: `None` if it panicked.
pub(crate) async fn spawn<T: Send + 'static>(
    job: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    queue(Box::new(move || {
        let result = job();
        let Some(p) = pool() else {
            let _ = tx.send(result);
            return false;
        };
        // Counted before the result wakes its task, which may queue the next job at once.
        p.lock().handing_back += 1;
        match tx.send(result) {
            Ok(()) => true,
            Err(unwanted) => {
                // Nobody awaits it: dropping it (a session's teardown) is work of its own.
                p.lock().handing_back -= 1;
                drop(unwanted);
                false
            }
        }
    }));
    rx.await.ok()
}

/// Drops `what` on a worker: verbs teardown (destroying queue pairs, deregistering memory,
/// leaving the reactor) takes milliseconds.
pub(crate) fn tear_down(what: impl Send + 'static) {
    run(move || drop(what));
}
