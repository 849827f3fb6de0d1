//! `cargo xtask cluster`: H VMs on one layer-2 segment (a `vde_switch` on this machine: no
//! traffic leaves it), rxe0 on each one's virtio NIC, every host running the `mesh` example
//! (a hub exchanging typed, checked messages with every other host) under `tc netem` faults.
//! One host can be killed mid-run (its qemu dies: no FIN, no RST) and one host's link cut
//! for a while; the others must report the dead host, typed, and deliver everything else
//! exactly once, in order.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};

use crate::vm::{self, Kernel};
use crate::{repo_root, Step};

/// One cluster run.
#[derive(Debug, Clone)]
pub struct Plan {
    pub kernel: Kernel,
    pub hosts: u16,
    /// Seconds each host sends for.
    pub seconds: f64,
    /// `tc netem` arguments applied on every host's NIC (empty: none).
    pub netem: String,
    /// Host killed this many seconds into its sending.
    pub kill: Option<(u16, f64)>,
    /// Host whose link is cut `at` seconds into its sending, for `ms`.
    pub cut: Option<(u16, f64, u64)>,
    /// Run the release build of `mesh` (else the debug build, which `cargo xtask test` has).
    pub release: bool,
    /// The hosts connect through rdma_cm (`mesh --cm`) instead of the TCP bootstrap.
    pub cm: bool,
    /// A flap: sessions resumable (`mesh --resume-window`), the cut repeated.
    pub flap: Option<Flap>,
}

/// The flap mode: the cut host's link is cut `cuts` times, `every` seconds apart, each
/// for longer than the keepalive; every session is resumable.
#[derive(Debug, Clone, Copy)]
pub struct Flap {
    pub cuts: u32,
    pub every: f64,
    /// `Config::keepalive`, seconds.
    pub keepalive: u64,
    /// `Config::resume_window`, seconds.
    pub window: u64,
}

/// Longest a session may take to resume after its link came back.
const RESUME_LIMIT: Duration = Duration::from_secs(2);

impl Plan {
    /// The run `cargo xtask test` makes: 3 hosts, 1 % loss with delay, reordering and
    /// duplication, one host killed, one link cut for a second.
    pub fn small(kernel: Kernel) -> Self {
        Self {
            kernel,
            hosts: 3,
            seconds: 16.0,
            netem: faults(1.0),
            kill: Some((3, 5.0)),
            cut: Some((2, 9.0, 1000)),
            release: false,
            cm: false,
            flap: None,
        }
    }

    /// The flap mode: every session resumable, keepalive 3 s, the cut host's link cut
    /// `cuts` times for 9 s (three keepalives), 14 s apart; the killed host dies first.
    pub fn flapping(mut self, cuts: u32) -> Self {
        let flap = Flap {
            cuts,
            every: 14.0,
            keepalive: 3,
            window: 20,
        };
        let first = 6.0;
        self.cut = self
            .cut
            .map(|(h, _, _)| (h, first, 3 * 1000 * flap.keepalive));
        self.kill = self.kill.map(|(h, _)| (h, 4.0));
        self.seconds = self
            .seconds
            .max(first + flap.every * f64::from(cuts.saturating_sub(1)) + 9.0 + 2.0);
        self.flap = Some(flap);
        self
    }

    /// `cargo xtask cluster`: 4 hosts, otherwise the same faults.
    pub fn full(kernel: Kernel) -> Self {
        Self {
            hosts: 4,
            seconds: 30.0,
            kill: Some((4, 10.0)),
            cut: Some((2, 16.0, 1000)),
            release: true,
            ..Self::small(kernel)
        }
    }

    /// One point of the sweep: loss only, nobody killed, no cut.
    fn sweep_point(kernel: Kernel, hosts: u16, loss_pct: f64) -> Self {
        Self {
            kernel,
            hosts,
            seconds: 30.0,
            netem: format!("loss {loss_pct}%"),
            kill: None,
            cut: None,
            release: true,
            cm: false,
            flap: None,
        }
    }

    fn loss_pct(&self) -> f64 {
        netem_pct(&self.netem, "loss").unwrap_or(0.0)
    }
}

/// The fault mix of the default runs at `loss_pct` % loss.
pub fn faults(loss_pct: f64) -> String {
    format!("loss {loss_pct}% duplicate 1% delay 2ms reorder 10% 50%")
}

/// The percentage after `key` in netem arguments (`loss 1%` → 1).
fn netem_pct(netem: &str, key: &str) -> Option<f64> {
    let mut words = netem.split_whitespace();
    words.find(|w| *w == key)?;
    words.next()?.trim_end_matches('%').parse().ok()
}

/// What one host's report line said.
#[derive(Debug, Clone, Default)]
struct HostReport {
    fields: BTreeMap<String, String>,
}

impl HostReport {
    fn parse(line: &str) -> Self {
        Self {
            fields: line
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    fn num(&self, key: &str) -> f64 {
        self.fields
            .get(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

/// What a cluster run showed.
#[derive(Debug)]
pub struct Outcome {
    plan: Plan,
    /// Reports of the hosts that lived, by host.
    reports: BTreeMap<u16, HostReport>,
    /// Seconds from the kill to the last survivor's report of it.
    dead_noticed_s: Option<f64>,
    /// How each survivor reported the dead host.
    dead_reports: Vec<String>,
    boot_s: f64,
    wall_s: f64,
}

impl Outcome {
    fn sum(&self, key: &str) -> f64 {
        self.reports.values().map(|r| r.num(key)).sum()
    }

    fn mean(&self, key: &str) -> f64 {
        self.sum(key) / self.reports.len().max(1) as f64
    }

    /// Messages sent to a live host and never delivered: gaps, streams without their `Done`,
    /// queries never answered.
    fn undelivered(&self) -> f64 {
        self.sum("lost") + self.sum("missing_done") + self.sum("unanswered")
    }

    /// Messages delivered wrong: bad content or number, wrong answers, undecodable frames.
    fn corrupt(&self) -> f64 {
        self.sum("corrupt") + self.sum("wrong_answers") + self.sum("bad_frames")
    }

    /// Retransmissions rxe counted (its requester retrying after a timeout or a NAK).
    fn retransmits(&self) -> f64 {
        self.sum("hw_completer_retry_err")
    }

    /// The `cluster: key=value ...` line.
    pub fn line(&self) -> String {
        let p = &self.plan;
        let mut l = format!(
            "cluster: hosts={} kernel={} way={} build={} loss_pct={} netem=\"{}\" seconds={} messages={} bytes={} lost={} duplicated={} reordered={} corrupt={} unanswered={} missing_done={} msgs_per_s_per_host={:.0} bytes_per_s_per_host={:.0}",
            p.hosts,
            p.kernel,
            if p.cm { "rdma_cm" } else { "tcp" },
            if p.release { "release" } else { "debug" },
            p.loss_pct(),
            p.netem,
            p.seconds,
            self.sum("received"),
            self.sum("bytes_received"),
            self.sum("lost"),
            self.sum("duplicated"),
            self.sum("reordered"),
            self.corrupt(),
            self.sum("unanswered"),
            self.sum("missing_done"),
            self.mean("msgs_per_s"),
            self.mean("bytes_per_s"),
        );
        for (key, name) in [
            ("hw_completer_retry_err", "retransmits"),
            ("hw_duplicate_request", "duplicate_request"),
            ("hw_out_of_seq_request", "out_of_seq_request"),
            ("hw_rcvd_seq_err", "rcvd_seq_err"),
            ("hw_retry_exceeded_err", "retry_exceeded_err"),
            ("hw_rcvd_rnr_err", "rcvd_rnr_err"),
        ] {
            let _ = write!(l, " {name}={}", self.sum(key));
        }
        match (p.kill, self.dead_noticed_s) {
            (Some((host, _)), Some(s)) => {
                let _ = write!(l, " killed_host={host} dead_host_noticed_s={s:.2}");
            }
            (Some((host, _)), None) => {
                let _ = write!(l, " killed_host={host} dead_host_noticed_s=never");
            }
            (None, _) => l.push_str(" dead_host_noticed_s=n/a"),
        }
        if let Some((host, _, ms)) = p.cut {
            let _ = write!(l, " cut_host={host} cut_ms={ms} cut_survived=1");
            if let Some(f) = p.flap {
                let r = self.reports.get(&host);
                let num = |k| r.map_or(0.0, |r| r.num(k));
                let _ = write!(
                    l,
                    " cuts={} keepalive_s={} resume_window_s={} suspended={} resumes={} resumed_messages={} worst_resume_ms={}",
                    f.cuts,
                    f.keepalive,
                    f.window,
                    num("suspended"),
                    num("resumes"),
                    self.sum("resumed_messages"),
                    num("resume_ms"),
                );
            }
        }
        let _ = write!(l, " boot_s={:.1} wall_s={:.1}", self.boot_s, self.wall_s);
        l
    }
}

/// A `vde_switch` daemon, stopped when dropped.
struct Switch {
    dir: PathBuf,
    pidfile: PathBuf,
}

impl Switch {
    fn start(dir: &Path) -> Result<Self> {
        if !vm::which("vde_switch") {
            bail!("`vde_switch` not found: run `cargo xtask setup` (package vde2)");
        }
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir.parent().context("switch directory")?)?;
        let dir = std::path::absolute(dir)?;
        let pidfile = dir.with_extension("pid");
        let status = Command::new("vde_switch")
            .arg("-s")
            .arg(&dir)
            .arg("-d")
            .arg("-p")
            .arg(&pidfile)
            .status()
            .context("starting vde_switch")?;
        ensure!(status.success(), "vde_switch failed: {status}");
        Ok(Self { dir, pidfile })
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        if let Ok(pid) = fs::read_to_string(&self.pidfile) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        let _ = fs::remove_file(&self.pidfile);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The base of the cluster's network: host `n` is 10.79.0.n.
const PORT: u16 = 18900;
/// How long a survivor may take to report the killed host: keepalive gives up after 5 s, the
/// queue pairs' retries after about 2 s; the VMs add their slowness.
const DETECT_LIMIT: Duration = Duration::from_secs(20);

/// How [`run`]'s error starts when a guest's kernel panicked: the run says nothing about
/// rdmsg (Soft-RoCE under emulation has crashed in its own packet allocation), and
/// `cargo xtask test` runs the cluster once more.
pub const GUEST_PANIC: &str = "a guest kernel panicked";

/// Boots the cluster, runs `plan`, checks what every host reported.
pub fn run(plan: &Plan) -> Result<Outcome> {
    let _s = Step::new(
        "cluster",
        &format!(
            "{} VMs (Linux {}) on a vde_switch, netem \"{}\"{}{}{}",
            plan.hosts,
            plan.kernel,
            plan.netem,
            plan.kill
                .map(|(h, s)| format!(", host {h} killed {s} s into sending"))
                .unwrap_or_default(),
            plan.cut
                .map(|(h, s, ms)| format!(", host {h}'s link cut {s} s into sending for {ms} ms"))
                .unwrap_or_default(),
            plan.flap
                .map(|f| format!(
                    ", {} times {} s apart, sessions resumable ({} s window, keepalive {} s)",
                    f.cuts, f.every, f.window, f.keepalive
                ))
                .unwrap_or_default(),
        ),
    );
    ensure!(plan.hosts >= 2, "a cluster needs at least two hosts");
    let started = Instant::now();
    let repo = repo_root();
    // Under the temporary directory: a unix socket's path must stay short.
    let switch =
        Switch::start(&std::env::temp_dir().join(format!("rdmsg-vde-{}", std::process::id())))?;
    let addrs: Vec<String> = (1..=plan.hosts)
        .map(|n| format!("10.79.0.{n}:{PORT}"))
        .collect();
    let victim = plan.kill.map(|(h, _)| h);
    let timeout = Duration::from_secs(plan.seconds as u64 + 600);
    // Host n's VM is killed once `kills[n - 1]` is set: the victim's when it is ready to die,
    // every host's as soon as one fails (no run waits out the timeout).
    let kills: Arc<Vec<AtomicBool>> =
        Arc::new((0..plan.hosts).map(|_| AtomicBool::new(false)).collect());
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let noticed: Arc<Mutex<Vec<(u16, Instant, String)>>> = Arc::default();
    let reports: Arc<Mutex<BTreeMap<u16, HostReport>>> = Arc::default();
    // A guest kernel that panics (rxe itself, under emulation) says nothing about rdmsg.
    let guest_panicked: Arc<AtomicBool> = Arc::default();
    let mut threads = Vec::new();
    for n in 1..=plan.hosts {
        let vm = vm::Vm::networked(
            &repo,
            plan.kernel,
            &format!("c{n}"),
            vm::Nic {
                netdev: format!("vde,sock={}", switch.dir.display()),
                mac: format!("52:54:00:79:00:{n:02x}"),
                addr: format!("10.79.0.{n}/24"),
            },
            1,
        )
        .with_mem(1536);
        if n == 1 {
            // The kernel, fetched and unpacked once before the VMs start together.
            vm.prepare()?;
        }
        let mut cmd = format!(
            "./target/{}/mesh --id {n} --hosts {} --seconds {} --netdev eth0",
            if plan.release { "release" } else { "debug" },
            addrs.join(","),
            plan.seconds
        );
        if !plan.netem.is_empty() {
            let _ = write!(cmd, " --netem {}", crate::sh_quote(&plan.netem));
        }
        if plan.cm {
            cmd.push_str(" --cm");
        }
        if let Some(v) = victim {
            if v == n {
                let _ = write!(cmd, " --die-after {}", plan.kill.unwrap().1);
            } else {
                let _ = write!(cmd, " --may-lose {v}");
            }
        }
        if let Some((h, at, ms)) = plan.cut {
            if h == n {
                let _ = write!(cmd, " --cut-after {at} --cut-ms {ms}");
                if let Some(f) = plan.flap {
                    let _ = write!(cmd, " --cuts {} --cut-every {}", f.cuts, f.every);
                }
            }
        }
        if let Some(f) = plan.flap {
            let _ = write!(
                cmd,
                " --resume-window {} --keepalive {}",
                f.window, f.keepalive
            );
        }
        let (kills, killed_at, noticed, reports, guest_panicked) = (
            Arc::clone(&kills),
            Arc::clone(&killed_at),
            Arc::clone(&noticed),
            Arc::clone(&reports),
            Arc::clone(&guest_panicked),
        );
        threads.push((
            n,
            std::thread::spawn(move || {
                let kill = &kills[usize::from(n) - 1];
                let res = vm.run_script_killable(
                    &cmd,
                    timeout,
                    &mut |l| {
                        println!("[host {n}] {l}");
                        if l.contains("Kernel panic - not syncing") {
                            guest_panicked.store(true, Ordering::SeqCst);
                        }
                        if l.contains("mesh: ready-to-die") {
                            *killed_at.lock().unwrap() = Some(Instant::now());
                            kill.store(true, Ordering::SeqCst);
                        }
                        if let Some(rest) = l.split("mesh: peer-lost ").nth(1) {
                            noticed
                                .lock()
                                .unwrap()
                                .push((n, Instant::now(), rest.to_owned()));
                        }
                        if let Some(rest) = l.split("mesh: id=").nth(1) {
                            reports
                                .lock()
                                .unwrap()
                                .insert(n, HostReport::parse(&format!("id={rest}")));
                        }
                    },
                    kill,
                );
                // Killed is how the victim ends, or how another host's failure ended this one.
                if res
                    .as_ref()
                    .map_or(true, |r| r.code != 0 && r.code != vm::KILLED)
                {
                    kills.iter().for_each(|k| k.store(true, Ordering::SeqCst));
                }
                res
            }),
        ));
    }
    let mut boot_s: f64 = 0.0;
    let mut failures = Vec::new();
    for (n, t) in threads {
        let res = t.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        match res {
            Ok(r) if Some(n) == victim && r.code == vm::KILLED => boot_s = boot_s.max(r.boot_secs),
            Ok(r) if Some(n) == victim => {
                failures.push(format!(
                    "host {n} (the victim) ended by itself (exit {}) instead of being killed",
                    r.code
                ));
            }
            Ok(r) if r.code == 0 => boot_s = boot_s.max(r.boot_secs),
            Ok(r) if r.code == vm::KILLED => {
                failures.push(format!("host {n} was stopped (another host failed)"))
            }
            Ok(r) => failures.push(format!("host {n} failed (exit {})", r.code)),
            Err(e) => failures.push(format!("host {n}: {e:#}")),
        }
    }
    drop(switch);
    if guest_panicked.load(Ordering::SeqCst) {
        bail!("{GUEST_PANIC}: the panic and its trace are above");
    }
    let reports = std::mem::take(&mut *reports.lock().unwrap());
    let mut dead_noticed_s = None;
    let mut dead_reports = Vec::new();
    if let Some(v) = victim {
        let killed = (*killed_at.lock().unwrap()).context("the victim never got ready to die")?;
        let noticed = noticed.lock().unwrap();
        let mut worst = Duration::ZERO;
        for n in (1..=plan.hosts).filter(|n| *n != v) {
            match noticed
                .iter()
                .find(|(host, _, what)| *host == n && what.starts_with(&format!("id={v} ")))
            {
                Some((_, at, what)) => {
                    worst = worst.max(at.saturating_duration_since(killed));
                    dead_reports.push(format!("host {n}: {what}"));
                }
                None => failures.push(format!("host {n} never reported the killed host {v}")),
            }
        }
        // A resumable session to the dead host ends when its window runs out.
        let limit = DETECT_LIMIT
            + plan
                .flap
                .map_or(Duration::ZERO, |f| Duration::from_secs(f.window));
        if worst > limit {
            failures.push(format!("the killed host was noticed only after {worst:?}"));
        }
        dead_noticed_s = Some(worst.as_secs_f64());
        for (n, _, what) in noticed
            .iter()
            .filter(|(_, _, w)| !w.starts_with(&format!("id={v} ")))
        {
            failures.push(format!("host {n} lost a live peer: {what}"));
        }
    }
    for n in (1..=plan.hosts).filter(|n| Some(*n) != victim) {
        match reports.get(&n) {
            Some(r) if r.fields.get("ok").map(String::as_str) == Some("1") => {}
            Some(_) => failures.push(format!("host {n} reported loss, disorder or failure")),
            None => failures.push(format!("host {n} printed no report")),
        }
    }
    if let (Some(f), Some((h, _, _))) = (plan.flap, plan.cut) {
        // Every cut outlasted the keepalive: it suspended sessions, which resumed in time.
        if let Some(r) = reports.get(&h) {
            let suspended = r.num("suspended");
            if suspended < f64::from(f.cuts) {
                failures.push(format!(
                    "host {h}'s {} cuts suspended only {suspended} sessions",
                    f.cuts
                ));
            }
            let worst = Duration::from_millis(r.num("resume_ms") as u64);
            if worst > RESUME_LIMIT {
                failures.push(format!(
                    "host {h}'s sessions resumed {worst:?} after the link came back (limit {RESUME_LIMIT:?})"
                ));
            }
        }
    }
    let outcome = Outcome {
        plan: plan.clone(),
        reports,
        dead_noticed_s,
        dead_reports,
        boot_s,
        wall_s: started.elapsed().as_secs_f64(),
    };
    println!("{}", outcome.line());
    for r in &outcome.dead_reports {
        println!("cluster: the killed host as reported by {r}");
    }
    if !failures.is_empty() {
        bail!("the cluster run failed:\n  {}", failures.join("\n  "));
    }
    Ok(outcome)
}

/// Loss rates of the sweep, in percent.
const SWEEP: &[f64] = &[0.0, 0.1, 1.0, 5.0];

/// `cargo xtask cluster --sweep`: one run per loss rate; the table under `target/cluster/`
/// (`sweep.md`, `sweep.json`) and a plot of throughput against loss (`sweep.svg`).
pub fn sweep(kernel: Kernel, hosts: u16, seconds: Option<f64>, cm: bool) -> Result<Vec<Outcome>> {
    let mut outcomes = Vec::new();
    for &loss in SWEEP {
        let mut plan = Plan::sweep_point(kernel, hosts, loss);
        plan.cm = cm;
        if let Some(s) = seconds {
            plan.seconds = s;
        }
        outcomes.push(run(&plan)?);
    }
    let dir = repo_root().join("target/cluster");
    fs::create_dir_all(&dir)?;
    fs::write(dir.join("sweep.md"), sweep_markdown(&outcomes))?;
    fs::write(dir.join("sweep.json"), sweep_json(&outcomes))?;
    fs::write(dir.join("sweep.svg"), sweep_svg(&outcomes))?;
    println!("{}", sweep_markdown(&outcomes));
    eprintln!(
        "==> [cluster] wrote {0}/sweep.md, {0}/sweep.json, {0}/sweep.svg",
        dir.display()
    );
    Ok(outcomes)
}

fn sweep_markdown(outcomes: &[Outcome]) -> String {
    let mut md = String::from(
        "| loss % | hosts | messages | msgs/s per host | KiB/s per host | lost | duplicated | reordered | corrupt | retransmits | out_of_seq_request | duplicate_request | rcvd_seq_err |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for o in outcomes {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |",
            o.plan.loss_pct(),
            o.plan.hosts,
            o.sum("received"),
            o.mean("msgs_per_s"),
            o.mean("bytes_per_s") / 1024.0,
            o.undelivered(),
            o.sum("duplicated"),
            o.sum("reordered"),
            o.corrupt(),
            o.retransmits(),
            o.sum("hw_out_of_seq_request"),
            o.sum("hw_duplicate_request"),
            o.sum("hw_rcvd_seq_err"),
        );
    }
    md
}

fn sweep_json(outcomes: &[Outcome]) -> String {
    let rows: Vec<String> = outcomes
        .iter()
        .map(|o| {
            let hosts: Vec<String> = o
                .reports
                .iter()
                .map(|(n, r)| {
                    let fields: Vec<String> = r
                        .fields
                        .iter()
                        .filter(|(_, v)| v.parse::<f64>().is_ok())
                        .map(|(k, v)| format!("\"{k}\": {v}"))
                        .collect();
                    format!("      \"{n}\": {{{}}}", fields.join(", "))
                })
                .collect();
            format!(
                "    {{\"loss_pct\": {}, \"hosts\": {}, \"kernel\": \"{}\", \"seconds\": {}, \"messages\": {}, \"msgs_per_s_per_host\": {:.1}, \"bytes_per_s_per_host\": {:.1}, \"lost\": {}, \"duplicated\": {}, \"reordered\": {}, \"corrupt\": {}, \"retransmits\": {}, \"per_host\": {{\n{}\n    }}}}",
                o.plan.loss_pct(),
                o.plan.hosts,
                o.plan.kernel,
                o.plan.seconds,
                o.sum("received"),
                o.mean("msgs_per_s"),
                o.mean("bytes_per_s"),
                o.undelivered(),
                o.sum("duplicated"),
                o.sum("reordered"),
                o.corrupt(),
                o.retransmits(),
                hosts.join(",\n"),
            )
        })
        .collect();
    format!("{{\n  \"sweep\": [\n{}\n  ]\n}}\n", rows.join(",\n"))
}

/// Messages per second per host against loss (the loss axis is ordinal: 0, 0.1, 1, 5 %).
fn sweep_svg(outcomes: &[Outcome]) -> String {
    let (w, h, left, right, top, bottom) = (640.0, 400.0, 70.0, 20.0, 40.0, 50.0);
    let max = outcomes
        .iter()
        .map(|o| o.mean("msgs_per_s"))
        .fold(1.0, f64::max)
        * 1.1;
    let n = outcomes.len().max(2) as f64;
    // Points inset from both ends, so that their labels clear the axis and the edge.
    let x = |i: usize| left + 40.0 + (w - left - right - 80.0) * i as f64 / (n - 1.0);
    let y = |v: f64| top + (h - top - bottom) * (1.0 - v / max);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">rdmsg mesh on rxe: messages/s per host against packet loss</text>\n\
         <line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>\n",
        w / 2.0,
        h - bottom,
        w - right,
        h - bottom,
        h - bottom
    );
    for k in 0..=4 {
        let v = max * f64::from(k) / 4.0;
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.0}</text><line x1=\"{left}\" y1=\"{1}\" x2=\"{}\" y2=\"{1}\" stroke=\"#ddd\"/>",
            left - 6.0,
            y(v),
            w - right
        );
    }
    let points: Vec<String> = outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| format!("{:.1},{:.1}", x(i), y(o.mean("msgs_per_s"))))
        .collect();
    let _ = writeln!(
        svg,
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\"/>",
        points.join(" ")
    );
    for (i, o) in outcomes.iter().enumerate() {
        let v = o.mean("msgs_per_s");
        let _ = writeln!(
            svg,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"#1f77b4\"/><text x=\"{0:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{v:.0}</text><text x=\"{0:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}%</text>",
            x(i),
            y(v),
            y(v) - 8.0,
            h - bottom + 18.0,
            o.plan.loss_pct()
        );
    }
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">packet loss on every host's NIC (tc netem)</text>\n</svg>",
        w / 2.0,
        h - 8.0
    );
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netem_percentages_are_read() {
        assert_eq!(netem_pct(&faults(1.0), "loss"), Some(1.0));
        assert_eq!(netem_pct("loss 0.1%", "loss"), Some(0.1));
        assert_eq!(netem_pct("delay 2ms", "loss"), None);
    }

    #[test]
    fn host_reports_are_parsed() {
        let r = HostReport::parse("id=2 hosts=3 received=100 msgs_per_s=12.5 lost_ids=[] ok=1");
        assert_eq!(r.num("received"), 100.0);
        assert_eq!(r.num("msgs_per_s"), 12.5);
        assert_eq!(r.num("absent"), 0.0);
        assert_eq!(r.fields["ok"], "1");
    }
}
