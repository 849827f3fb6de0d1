//! A job queue: clients call a coordinator, the coordinator forwards each job to a worker and
//! answers the client with the worker's answer. A worker that dies (killed, its machine gone)
//! costs nothing but time: the coordinator hears each of its calls fail (or run out of its
//! time, `TRY`) and sends the job to another worker, so every job is answered once, unless
//! its client's deadline passes first. Jobs here are pure (the sum of their numbers), so
//! doing one twice is harmless; a queue of jobs that are not must not retry a job its worker
//! may have taken (`RequestFate::Taken` or `Unknown`, see the README's calls): it answers
//! that client with an error of its own instead.
//!
//! `forward` waits on the coordinator's thread for room at the worker (up to `TRY`): a
//! worker alive but stuck holds the loop that long. A queue serving many clients would bound
//! the jobs in flight per worker, and count the time a job may wait in `waiting`.
//!
//! ```text
//! jobq coordinator --listen 127.0.0.1:7400 --clients 3
//! jobq worker --connect 127.0.0.1:7400            (as many as you like, at any time)
//! jobq client --connect 127.0.0.1:7400 --jobs 3000 --in-flight 32 --seed 1
//! ```
//!
//! Each role ends with one line, `jobq coordinator: jobs=... answered=... retried=...
//! workers_lost=...`, `jobq worker: jobs=...`, or `jobq client: jobs=... answered=...
//! wrong=...`, each with the process's CPU time (`user_ms=... system_ms=...`). A client
//! checks every answer (its job, the sum) and exits non-zero if one is wrong.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use clap::{Parser, Subcommand};
use rdmsg::{message, request, Config, Endpoint, Envelope, Hub, HubConfig, HubEvent, PeerId};
use rdmsg::{Error, Posted, RequestFate, Responder, Session};
use rdmsg_examples::jobq_demo;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Job {
    id: u64,
    numbers: Vec<u32>,
}

#[derive(Serialize, Deserialize)]
struct Done {
    id: u64,
    sum: u64,
}

/// What a worker says first, so that the coordinator tells it from a client.
#[derive(Serialize, Deserialize)]
struct Ready;

request!(Job => Done);
message!(Done);
message!(Ready);

/// How long a client gives a job, retries on other workers included (generous: a job of
/// 800 KB under emulation takes a while).
const DEADLINE: Duration = Duration::from_secs(300);
/// How long one worker gets a job (and the coordinator waits for room at it).
const TRY: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------- worker

fn worker(coordinator: &str) -> rdmsg::Result<()> {
    let mut session =
        Session::new(Endpoint::open_default()?.connect(coordinator, &Config::default())?);
    session.send(&Ready)?;
    let mut jobs = 0u64;
    loop {
        let mut msg = match session.recv() {
            Ok(msg) => msg,
            Err(e) if e.is_peer_closed() => break, // the coordinator is done with us
            Err(e) => return Err(e),
        };
        let job: Job = msg.decode()?;
        let sum = job.numbers.iter().map(|&n| u64::from(n)).sum();
        session.reply(msg.responder::<Job>()?, &Done { id: job.id, sum })?;
        jobs += 1;
    }
    println!("jobq worker: jobs={jobs} {}", cpu());
    Ok(())
}

// ---------------------------------------------------------------- coordinator

/// A client's job, kept (undecoded) until a worker answers it.
struct Pending {
    job: Envelope,
    client: Responder<Done>,
}

fn coordinator(listen: &str, clients: usize) -> rdmsg::Result<()> {
    let mut hub = Hub::new(&Endpoint::open_default()?, HubConfig::default())?;
    println!("listening {}", hub.listen(listen)?);
    let (mut workers, mut turn) = (Vec::<PeerId>::new(), 0);
    let (mut waiting, mut running) = (VecDeque::new(), HashMap::new());
    let (mut ready, mut served) = (HashSet::new(), 0);
    let (mut jobs, mut answered, mut retried, mut lost) = (0u64, 0u64, 0u64, 0u64);
    while served < clients {
        match hub.recv()? {
            HubEvent::Message { peer, msg } if msg.is::<Ready>() => {
                ready.insert(peer);
                workers.push(peer);
            }
            HubEvent::Message { mut msg, .. } => {
                // The client's deadline goes with the job: `time_left` below.
                let Ok(client) = msg.responder::<Job>() else {
                    continue;
                }; // not a call
                msg.detach(); // kept until answered: give the client its receive buffer back
                waiting.push_back(Pending { job: msg, client });
                jobs += 1;
            }
            HubEvent::CallEnded { call, result, .. } => {
                let pending: Pending = running.remove(&call).expect("a call of ours");
                match result {
                    // Not `PeerGone` (the client left) nor `Full` (it hears "no answer").
                    Ok(done) => {
                        let posted = hub.reply_with(pending.client, done)?;
                        answered += u64::from(matches!(posted, Posted::Sent | Posted::Queued));
                    }
                    // The worker failed or ran out of time: another one, within the deadline.
                    Err(Error::CallFailed { .. } | Error::CallTimedOut { .. }) => {
                        retried += 1;
                        waiting.push_front(pending);
                    }
                    Err(_) => {} // refused or unanswered: the client hears "no answer"
                }
            }
            HubEvent::Disconnected { peer, .. } if ready.remove(&peer) => {
                workers.retain(|&w| w != peer);
                lost += 1;
            }
            HubEvent::Disconnected { .. } => served += 1,
            _ => {}
        }
        // Hand out what waits, round robin over the workers.
        while !workers.is_empty() {
            let Some(pending) = waiting.pop_front() else {
                break;
            };
            if pending.client.expired() {
                continue; // the client gave up: dropped, unanswered
            }
            turn = (turn + 1) % workers.len();
            let left = pending.client.time_left().unwrap_or(DEADLINE).min(TRY);
            match hub.forward::<Job>(workers[turn], &pending.job, left) {
                Ok(call) => drop(running.insert(hub.watch(call)?, pending)),
                Err(Error::CallFailed {
                    fate: RequestFate::NotSent,
                    ..
                }) => {
                    workers.remove(turn); // it failed: its Disconnected is on its way
                    waiting.push_front(pending);
                }
                Err(_) => {
                    // It may have gone: try again after the next event (whatever failed
                    // shows up there), the job being harmless to run twice.
                    waiting.push_front(pending);
                    break;
                }
            }
        }
    }
    println!("jobq coordinator: jobs={jobs} answered={answered} retried={retried} workers_lost={lost} {}", cpu());
    for worker in workers {
        hub.close(worker)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- client

/// Sends `jobs` jobs of 16 to 200,000 numbers (sizes spread evenly on a log scale), at most
/// `in_flight` at once, and checks each answer; how many were wrong.
fn client(coordinator: &str, jobs: u64, in_flight: usize, seed: u64) -> rdmsg::Result<u64> {
    let mut session =
        Session::new(Endpoint::open_default()?.connect(coordinator, &Config::default())?);
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut calls, mut expected) = (Vec::new(), Vec::new());
    let (mut sent, mut answered, mut wrong) = (0, 0, 0);
    while answered < jobs {
        while sent < jobs && calls.len() < in_flight {
            let len = (16.0 * 12_500f64.powf(rng.f64())) as usize;
            let numbers: Vec<u32> = (0..len).map(|_| rng.u32(..)).collect();
            expected.push((sent, numbers.iter().map(|&n| u64::from(n)).sum::<u64>()));
            calls.push(session.start_call(&Job { id: sent, numbers }, DEADLINE)?);
            sent += 1;
        }
        let (i, done) = session.wait_any(&mut calls).expect("calls in flight");
        let done = done?;
        if (done.id, done.sum) != expected.remove(i) {
            eprintln!("jobq client: job {} answered wrongly", done.id);
            wrong += 1;
        }
        answered += 1;
    }
    session.close()?;
    println!(
        "jobq client: jobs={jobs} answered={answered} wrong={wrong} {}",
        cpu()
    );
    Ok(wrong)
}

// ---------------------------------------------------------------- arguments

/// This process's CPU time so far, as `user_ms=... system_ms=...`.
fn cpu() -> String {
    let (user, system) = rdmsg_examples::peers::process_cpu_split_ms().unwrap_or_default();
    format!("user_ms={user} system_ms={system}")
}

/// A job queue on rdmsg: a coordinator hub, workers and clients (see the module's doc).
#[derive(Debug, Parser)]
#[command(name = "jobq")]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Takes jobs from clients and forwards them to workers; prints `listening ADDR`, and
    /// ends (closing the workers) once `--clients` clients have come and gone.
    Coordinator {
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7400")]
        listen: String,
        #[arg(long, value_name = "N", default_value_t = 1)]
        clients: usize,
    },
    /// Serves jobs until the coordinator closes.
    Worker {
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7400")]
        connect: String,
    },
    /// Sends jobs and checks the answers.
    Client {
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7400")]
        connect: String,
        #[arg(long, value_name = "N", default_value_t = 3000)]
        jobs: u64,
        #[arg(long, value_name = "N", default_value_t = 32,
              value_parser = clap::value_parser!(u32).range(1..))]
        in_flight: u32,
        /// Seeds the jobs' sizes and numbers
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Runs it all here (a coordinator, workers and clients as child processes), kills one
    /// worker mid-run, and checks every answer; ends with one `jobq: ...` line.
    Demo {
        #[arg(long, default_value_t = 6)]
        workers: u32,
        #[arg(long, default_value_t = 3)]
        clients: u32,
        #[arg(long, default_value_t = 3000)]
        jobs: u64,
        #[arg(long, default_value_t = 32)]
        in_flight: u32,
        /// Seconds after the clients start to kill a worker (0: none)
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        kill_after: f64,
        /// Seconds the whole run may take before every process is killed (and it fails)
        #[arg(long, value_name = "SECONDS", default_value_t = 900)]
        limit: u64,
        /// Another program with the same roles to run (the bench's tokio + TCP version)
        #[arg(long, value_name = "PROGRAM")]
        roles_from: Option<std::path::PathBuf>,
    },
}

fn main() -> Result<(), rdmsg::Error> {
    match Cli::parse().role {
        Role::Coordinator { listen, clients } => coordinator(&listen, clients),
        Role::Worker { connect } => worker(&connect),
        Role::Client {
            connect,
            jobs,
            in_flight,
            seed,
        } => {
            if client(&connect, jobs, in_flight as usize, seed)? > 0 {
                std::process::exit(1);
            }
            Ok(())
        }
        Role::Demo {
            workers,
            clients,
            jobs,
            in_flight,
            kill_after,
            limit,
            roles_from,
        } => {
            let plan = jobq_demo::Plan {
                workers,
                clients,
                jobs,
                in_flight,
                kill_after: (kill_after > 0.0).then(|| Duration::from_secs_f64(kill_after)),
                limit: Duration::from_secs(limit),
            };
            let program = roles_from
                .or_else(|| std::env::current_exe().ok())
                .unwrap_or_default();
            match jobq_demo::run(&program, &plan) {
                Ok(outcome) => println!("{outcome}"),
                Err(e) => {
                    eprintln!("jobq: {e:#}");
                    std::process::exit(1);
                }
            }
            Ok(())
        }
    }
}
