//! The `jobq` example's whole run on one machine: a coordinator, workers and clients as child
//! processes (of `jobq` itself, or of another program with the same roles, such as the
//! bench's tokio + TCP version), one worker killed with SIGKILL mid-run, and every answer
//! checked from the roles' own report lines.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};

use crate::peers::field;

/// What a run is made of.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Worker processes.
    pub workers: u32,
    /// Client processes.
    pub clients: u32,
    /// Jobs per client.
    pub jobs: u64,
    /// Jobs a client keeps in flight.
    pub in_flight: u32,
    /// How long after the clients start one worker is killed (`None`: nobody).
    pub kill_after: Option<Duration>,
    /// How long the whole run may take: then every process is killed, and the run fails.
    pub limit: Duration,
}

/// What a run came to: the sums of the roles' report lines.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Jobs the clients sent.
    pub jobs: u64,
    /// Answers the clients checked.
    pub answered: u64,
    /// Answers that were wrong.
    pub wrong: u64,
    /// Jobs the coordinator sent to a second worker.
    pub retried: u64,
    /// Workers the coordinator lost.
    pub workers_lost: u64,
    /// From the clients' start to the last client's end.
    pub elapsed: Duration,
    /// CPU time of the coordinator, user and system, in milliseconds.
    pub coordinator_ms: (u64, u64),
    /// CPU time of the clients, user and system, in milliseconds.
    pub clients_ms: (u64, u64),
    /// CPU time of the workers that reported (the killed one cannot), user and system.
    pub workers_ms: (u64, u64),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per_job = |ms: u64| ms as f64 * 1000.0 / self.jobs.max(1) as f64;
        write!(
            f,
            "jobq: jobs={} answered={} wrong={} retried={} workers_lost={} seconds={:.1} \
             coordinator_user_us_per_job={:.0} coordinator_system_us_per_job={:.0} \
             clients_user_us_per_job={:.0} clients_system_us_per_job={:.0} \
             workers_user_us_per_job={:.0} workers_system_us_per_job={:.0}",
            self.jobs,
            self.answered,
            self.wrong,
            self.retried,
            self.workers_lost,
            self.elapsed.as_secs_f64(),
            per_job(self.coordinator_ms.0),
            per_job(self.coordinator_ms.1),
            per_job(self.clients_ms.0),
            per_job(self.clients_ms.1),
            per_job(self.workers_ms.0),
            per_job(self.workers_ms.1),
        )
    }
}

/// Runs `plan` with the roles of `program`; an error if a process failed or an answer is
/// missing, wrong or doubled.
pub fn run(program: &Path, plan: &Plan) -> Result<Outcome> {
    let spawn = |args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} {args:?}", program.display()))
    };
    let clients = plan.clients.to_string();
    let mut coordinator = Role::new(
        "coordinator",
        spawn(&[
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--clients",
            &clients,
        ])?,
    );
    let listening = coordinator.line()?;
    let addr = listening
        .strip_prefix("listening ")
        .with_context(|| format!("the coordinator said {listening:?}"))?
        .to_owned();
    let mut workers = (0..plan.workers)
        .map(|_| Ok(Role::new("worker", spawn(&["worker", "--connect", &addr])?)))
        .collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    let (jobs, in_flight) = (plan.jobs.to_string(), plan.in_flight.to_string());
    let mut clients = (1..=plan.clients)
        .map(|seed| {
            let seed = seed.to_string();
            let args = ["client", "--connect", &addr, "--jobs", &jobs];
            let args = [&args[..], &["--in-flight", &in_flight, "--seed", &seed]].concat();
            Ok(Role::new("client", spawn(&args)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let pids = [&coordinator]
        .into_iter()
        .chain(&workers)
        .chain(&clients)
        .map(|r| r.child.id());
    let _watchdog = Watchdog::start(pids.collect(), plan.limit);
    let mut killed = false;
    if let Some(after) = plan.kill_after {
        std::thread::sleep(after);
        let victim = &mut workers[0].child;
        ensure!(
            victim.try_wait()?.is_none(),
            "the worker to kill ended before {after:?}"
        );
        ensure!(
            clients
                .iter_mut()
                .all(|c| matches!(c.child.try_wait(), Ok(None))),
            "a client ended before a worker was killed, {after:?} in: kill sooner"
        );
        victim.kill()?; // SIGKILL: its connection ends without a close
        victim.wait()?;
        killed = true;
    }
    let mut outcome = Outcome::default();
    for client in &mut clients {
        let line = client.report("jobq client:")?;
        ensure!(
            field(&line, "answered") == Some(plan.jobs) && field(&line, "wrong") == Some(0),
            "a client's jobs were not all answered rightly: {line}"
        );
        outcome.jobs += plan.jobs;
        outcome.answered += plan.jobs;
        outcome.clients_ms = add(outcome.clients_ms, cpu(&line));
    }
    outcome.elapsed = start.elapsed();
    let line = coordinator.report("jobq coordinator:")?;
    let total = plan.jobs * u64::from(plan.clients);
    ensure!(
        field(&line, "jobs") == Some(total) && field(&line, "answered") == Some(total),
        "the coordinator did not answer each of {total} jobs once: {line}"
    );
    outcome.retried = field(&line, "retried").unwrap_or_default();
    outcome.workers_lost = field(&line, "workers_lost").unwrap_or_default();
    ensure!(
        outcome.workers_lost == u64::from(killed),
        "the coordinator lost {} workers, {} killed: {line}",
        outcome.workers_lost,
        u64::from(killed)
    );
    outcome.coordinator_ms = cpu(&line);
    for worker in workers.iter_mut().skip(usize::from(killed)) {
        let line = worker.report("jobq worker:")?;
        outcome.workers_ms = add(outcome.workers_ms, cpu(&line));
    }
    Ok(outcome)
}

fn cpu(line: &str) -> (u64, u64) {
    let ms = |key| field(line, key).unwrap_or_default();
    (ms("user_ms"), ms("system_ms"))
}

fn add(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 + b.0, a.1 + b.1)
}

/// Kills every process of a run that outlives its limit (the reads of their output then end,
/// and the run fails), unless dropped first.
struct Watchdog(Option<std::sync::mpsc::Sender<()>>);

impl Watchdog {
    fn start(pids: Vec<u32>, limit: Duration) -> Self {
        let (done, wait) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
                eprintln!("jobq: the run took longer than {limit:?}: killing it");
                for pid in pids {
                    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                }
            }
        });
        Watchdog(Some(done))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(done) = self.0.take() {
            let _ = done.send(());
        }
    }
}

/// A role's process and its standard output.
struct Role {
    what: &'static str,
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Role {
    fn new(what: &'static str, mut child: Child) -> Self {
        let out = BufReader::new(child.stdout.take().expect("stdout is piped"));
        Role { what, child, out }
    }

    /// Its next line of output.
    fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.out.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("the {} ended ({status}) without a word", self.what);
        }
        Ok(line.trim_end().to_owned())
    }

    /// Waits for it to end well, and returns its last line starting with `prefix`.
    fn report(&mut self, prefix: &str) -> Result<String> {
        let mut report = None;
        for line in (&mut self.out).lines() {
            let line = line?;
            if line.starts_with(prefix) {
                report = Some(line);
            }
        }
        let status = self.child.wait()?;
        ensure!(status.success(), "a {} failed: {status}", self.what);
        report.with_context(|| format!("a {} printed no `{prefix}` line", self.what))
    }
}

impl Drop for Role {
    /// A run that failed leaves no process behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
