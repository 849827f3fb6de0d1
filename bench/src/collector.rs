//! The README's collector example (`rdmsg-examples`' `collector` binary), run as users run it:
//! a process of its own that starts its sensors process and ends with one `collector: ` line
//! of `key=value` figures. The bench measures the program itself, not a copy of its loop, so
//! that a change to the example or to the hub under it shows here (issue 41).

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::sample::Sample;

/// The binary, found next to `rdmsg-bench` (both in `target/release`).
pub const PROGRAM: &str = "collector";

/// Prefix of the collector's report line.
const LINE: &str = "collector: ";

/// The figures of one run, as its report line gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// Sensors connected at once.
    pub connections: u64,
    /// Until every sensor was connected, ms.
    pub connect_ms: f64,
    /// The hub's registered receive and send buffers per connection, KiB.
    pub registered_kib_per_conn: f64,
    /// The collector's descriptors per connection.
    pub fds_per_conn: f64,
    /// The collector's CPU time over the traffic per message, µs (`None`: it could not read
    /// its CPU time).
    pub cpu_us_per_msg: Option<f64>,
    /// The hub's wake-ups per message.
    pub wakeups_per_msg: f64,
    /// Liveness probes the collector's hub sent.
    pub probes: u64,
    /// Sensor connections that failed.
    pub failed: u64,
    /// Why they failed (`none`, or each reason with its count).
    pub failures: String,
    /// Messages the finished sensors sent that did not arrive (negative: more arrived).
    pub lost: i64,
    /// Where a connection's connect time went, µs per connection, as `(metric, value)`: the
    /// collector's CPU time, a handshake's wall time, and the hub's own work in it (absent
    /// from lines of older builds).
    pub connect_parts: Vec<(&'static str, f64)>,
}

/// The keys of the collector's line that say where connect time went, as the report names
/// them: the collector's CPU time per connection until all were connected, a handshake's start
/// to its connection, and the hub's work in it (receive buffers set aside, the queue pair
/// created, moved to RTR and RTS, the hellos).
pub const CONNECT_PARTS: [(&str, &str); 6] = [
    ("connect_cpu_us_per_conn", "connect_cpu_us"),
    ("hs_wall_us", "handshake_wall_us"),
    ("admission_us", "admission_us"),
    ("qp_create_us", "qp_create_us"),
    ("rtr_rts_us", "rtr_rts_us"),
    ("hello_us", "hello_us"),
];

impl Figures {
    /// Parses the collector's report line.
    pub fn parse(line: &str) -> Result<Self> {
        let body = line
            .trim_end()
            .strip_prefix(LINE)
            .with_context(|| format!("not a collector report line: {line}"))?;
        // `failures=` is last and may be a quoted string with spaces.
        let (head, failures) = body
            .split_once(" failures=")
            .context("the collector's line has no failures=")?;
        let kv: HashMap<&str, &str> = head
            .split_whitespace()
            .filter_map(|t| t.split_once('='))
            .collect();
        let get = |key: &str| {
            kv.get(key)
                .copied()
                .with_context(|| format!("the collector's line has no {key}="))
        };
        let num = |key: &str| -> Result<f64> {
            let v = get(key)?;
            v.parse()
                .with_context(|| format!("the collector's {key}={v} is not a number"))
        };
        let int = |key: &str| -> Result<u64> {
            let v = get(key)?;
            v.parse()
                .with_context(|| format!("the collector's {key}={v} is not a count"))
        };
        let cpu_us_per_msg = match get("cpu_us_per_msg")? {
            "n/a" => None,
            _ => Some(num("cpu_us_per_msg")?),
        };
        let lost = get("lost")?;
        let mut connect_parts = Vec::new();
        for (key, metric) in CONNECT_PARTS {
            if kv.get(key).is_some_and(|v| *v != "n/a") {
                connect_parts.push((metric, num(key)?));
            }
        }
        Ok(Self {
            connect_parts,
            connections: int("connections")?,
            connect_ms: num("connect_ms")?,
            registered_kib_per_conn: num("registered_kib_per_conn")?,
            fds_per_conn: num("fds_per_conn")?,
            cpu_us_per_msg,
            wakeups_per_msg: num("wakeups_per_msg")?,
            probes: int("probes")?,
            failed: int("failed")?,
            failures: failures.trim().trim_matches('"').to_owned(),
            lost: lost
                .parse()
                .with_context(|| format!("the collector's lost={lost} is not a number"))?,
        })
    }

    /// `(metric, value)` of each figure, as the report reads them.
    pub fn metrics(&self, sensors: usize) -> Vec<(&'static str, f64)> {
        let mut v = vec![
            ("connect_ms", self.connect_ms),
            (
                "connect_ms_per_1000",
                self.connect_ms * 1000.0 / sensors.max(1) as f64,
            ),
            ("kib_per_conn", self.registered_kib_per_conn),
            ("fds_per_conn", self.fds_per_conn),
            ("wakeups_per_msg", self.wakeups_per_msg),
            ("probes", self.probes as f64),
            ("failed_conns", self.failed as f64),
            ("lost", self.lost as f64),
        ];
        if let Some(cpu) = self.cpu_us_per_msg {
            v.push(("cpu_us_per_msg", cpu));
        }
        v.extend(self.connect_parts.iter().copied());
        v
    }

    /// Why the run counts as failed, if it does: connections failed or messages lost.
    pub fn trouble(&self) -> Option<String> {
        let mut why = Vec::new();
        if self.failed > 0 {
            why.push(format!(
                "{} sensor connections failed: {}",
                self.failed, self.failures
            ));
        }
        if self.lost != 0 {
            why.push(format!("{} messages lost", self.lost));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// What a run gave: its figures (if it printed its line) and why it failed (if it did).
#[derive(Debug)]
pub struct Outcome {
    /// The figures of its report line.
    pub figures: Option<Figures>,
    /// Why the run failed: its exit status, failed connections, lost messages, or no line.
    pub failure: Option<String>,
}

/// A run that failed, with the samples of what it measured all the same: the runner reports
/// both, so that a failure is in the report beside its figures.
#[derive(Debug)]
pub struct Failed {
    /// Why.
    pub reason: String,
    /// The figures' samples (empty if it printed no line).
    pub samples: Vec<Sample>,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for Failed {}

/// Lines of the collector's stderr kept for a failure's reason.
const TAIL: usize = 5;

/// Runs `collector --sensors N --batches B --min-credits C` and reads its line; kills it (and
/// its sensors process) after `timeout`. Its stderr goes on to ours as progress.
pub fn run(sensors: usize, min_credits: u32, batches: u32, timeout: Duration) -> Result<Outcome> {
    let program = crate::sibling_program(PROGRAM)?;
    // Both processes need a descriptor per sensor. Each raises its soft limit itself, but
    // only up to the hard limit, which only a privileged process (this one, as root in the
    // VM) can raise: they inherit it.
    let want = sensors as u64 + 256;
    let limit = crate::fanin::ensure_fd_limit(want)?;
    if limit < want {
        bail!(
            "{sensors} sensors need about {want} descriptors; the limit is {limit} \
             (raise it with ulimit -n)"
        );
    }
    let mut child = Command::new(&program)
        .args(["--sensors", &sensors.to_string()])
        .args(["--batches", &batches.to_string()])
        .args(["--min-credits", &min_credits.to_string()])
        // A group of its own, so that a timeout kills its sensors process too.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    let stdout = child.stdout.take().context("the collector's stdout")?;
    let stderr = child.stderr.take().context("the collector's stderr")?;
    let (out_tx, out_rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = out_tx.send(report_line(stdout));
    });
    let (err_tx, err_rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = err_tx.send(forward_tail(stderr));
    });
    let status = match wait_within(&mut child, timeout)? {
        Some(status) => status,
        None => {
            kill_group(&mut child);
            bail!("the collector did not finish in {timeout:?} (killed)");
        }
    };
    // The sensors process may hold the pipes a little longer than its parent lives.
    let grace = Duration::from_secs(30);
    let line = out_rx.recv_timeout(grace).ok().flatten();
    let tail = err_rx.recv_timeout(grace).unwrap_or_default();
    let figures = line.as_deref().map(Figures::parse).transpose()?;
    let mut why = Vec::new();
    if !status.success() {
        // The example prints its error last, as `error: ...`.
        let said = tail
            .iter()
            .rev()
            .find(|l| l.starts_with("error: "))
            .or(tail.last())
            .map_or(String::new(), |l| format!(": {l}"));
        why.push(format!("the collector exited with {status}{said}"));
    }
    match &figures {
        Some(f) => why.extend(f.trouble()),
        None => why.push("the collector printed no report line".into()),
    }
    Ok(Outcome {
        figures,
        failure: (!why.is_empty()).then(|| why.join("; ").replace(['\n', '|'], " ")),
    })
}

/// The last report line on the collector's stdout.
fn report_line(stdout: impl Read) -> Option<String> {
    BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .filter(|l| l.starts_with(LINE))
        .last()
}

/// Passes the collector's stderr on to ours (progress in the bench's log) and returns its last
/// lines.
fn forward_tail(stderr: impl Read) -> Vec<String> {
    let mut tail = VecDeque::with_capacity(TAIL);
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        eprintln!("  {line}");
        if tail.len() == TAIL {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    tail.into()
}

/// The child's exit status, or `None` if it is still running after `limit`.
fn wait_within(child: &mut Child, limit: Duration) -> Result<Option<std::process::ExitStatus>> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().context("waiting for the collector")? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Kills the collector's process group (it and its sensors process), then reaps it.
fn kill_group(child: &mut Child) {
    let group = format!("-{}", child.id());
    let killed = Command::new("kill")
        .args(["-KILL", "--", &group])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(killed, Ok(s) if s.success()) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "collector: connections=1000 server_threads=1 fds=1013 \
        registered_kib=16500 messages=18000 lost=0 wakeups=2100 samples=16000 alarms=1000 \
        batches=2 fds_per_conn=1.01 registered_kib_per_conn=16.5 recv_buffers=8256 \
        spare_buffers=256 forced_solicited=0 msgs_per_wakeup=8.6 spurious_wakeups=0 rnr=n/a \
        errors=0 connect_ms=4200 elapsed_ms=9000 traffic_ms=3000 cpu_us_per_msg=41.7 \
        wakeups_per_msg=0.117 probes=3 finished=1000 failed=0 failures=none";

    #[test]
    fn the_collectors_line_gives_its_figures() {
        let f = Figures::parse(GOOD).unwrap();
        assert_eq!(
            (f.connections, f.connect_ms, f.probes, f.failed, f.lost),
            (1000, 4200.0, 3, 0, 0)
        );
        assert_eq!(f.cpu_us_per_msg, Some(41.7));
        assert_eq!(f.registered_kib_per_conn, 16.5);
        assert_eq!(f.failures, "none");
        assert_eq!(f.trouble(), None);
        let m: HashMap<&str, f64> = f.metrics(1000).into_iter().collect();
        assert_eq!(m["connect_ms_per_1000"], 4200.0);
        assert_eq!(m["kib_per_conn"], 16.5);
        assert_eq!(m.len(), 9);
        let m: HashMap<&str, f64> = f.metrics(10_000).into_iter().collect();
        assert_eq!(m["connect_ms_per_1000"], 420.0);
    }

    #[test]
    fn where_connect_time_went_is_read_when_the_line_has_it() {
        let line = GOOD.replace(
            "probes=3 ",
            "probes=3 connect_cpu_us_per_conn=2650 hs_wall_us=9141 admission_us=247.3 \
             qp_create_us=604.2 rtr_rts_us=321.8 hello_us=455.6 ",
        );
        let f = Figures::parse(&line).unwrap();
        let m: HashMap<&str, f64> = f.metrics(1000).into_iter().collect();
        assert_eq!(m.len(), 15);
        assert_eq!(m["connect_cpu_us"], 2650.0);
        assert_eq!(m["handshake_wall_us"], 9141.0);
        assert_eq!(m["qp_create_us"], 604.2);
        assert_eq!(m["hello_us"], 455.6);
        assert!(Figures::parse(&line.replace("rtr_rts_us=321.8", "rtr_rts_us=x")).is_err());
    }

    #[test]
    fn failures_losses_and_missing_cpu_are_read() {
        let bad = GOOD
            .replace("lost=0", "lost=-2")
            .replace("cpu_us_per_msg=41.7", "cpu_us_per_msg=n/a")
            .replace(
                "failed=0 failures=none",
                "failed=3 failures=\"peer vanished x2; handshake: timed out x1\"",
            );
        let f = Figures::parse(&bad).unwrap();
        assert_eq!((f.failed, f.lost, f.cpu_us_per_msg), (3, -2, None));
        assert_eq!(f.failures, "peer vanished x2; handshake: timed out x1");
        assert_eq!(
            f.trouble().unwrap(),
            "3 sensor connections failed: peer vanished x2; handshake: timed out x1; \
             -2 messages lost"
        );
        assert!(!f.metrics(5).iter().any(|(m, _)| *m == "cpu_us_per_msg"));
    }

    #[test]
    fn a_broken_line_is_an_error_not_a_zero() {
        assert!(Figures::parse("sensors: sent=5").is_err());
        assert!(Figures::parse(&GOOD.replace(" failures=none", "")).is_err());
        assert!(Figures::parse(&GOOD.replace("connect_ms=4200", "connect_ms=soon")).is_err());
        assert!(Figures::parse(&GOOD.replace("probes=3 ", "")).is_err());
    }
}
