//! `cargo xtask`: setup, checks, host and device tests, the Soft-RoCE VM and the demo.

#![forbid(unsafe_code)]

mod vm;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  setup            install the Debian packages rdmsg needs (apt-get as root; prints the command otherwise)
  test             fmt, clippy, docs, host tests, the decoder fuzzed for a fixed time, the device
                   tests inside the Soft-RoCE VM, then the two-host test (as vm2)
  demo             run the telemetry demo on rxe0 inside the VM (solicited-only vs next)
  bench [--quick] [-- ARGS]
                   benchmarks side by side with perftest in one VM boot, codec on the host;
                   writes target/bench/report.md, report.json, chart.png (ARGS go to
                   `rdmsg-bench run`, e.g. --rounds 3 or --only lat)
  vm -- CMD...     boot the Soft-RoCE VM and run CMD in the repository (exit code is CMD's)
  vm2              two VMs on a qemu socket network, rxe0 on each one's virtio NIC: a msg
                   exchange between them, then one VM is killed; the other must report it

environment:
  RDMSG_VM_ACCEL   qemu accelerator (default tcg,thread=multi)
  RDMSG_VM_MEM     guest memory in MiB (default 4096)
  RDMSG_VM_TIMEOUT seconds a VM run may take (default 1500)
  RDMSG_FUZZ_SECS  seconds `test` fuzzes the frame decoder (default 60; 0 skips)
";

/// Debian packages the project needs: to build (libclang for rdma-sys' bindgen, the verbs
/// headers), to run the VM, and to compare with rdma-core's own tools inside it.
const PACKAGES: &[&str] = &[
    "libclang-dev",
    "libibverbs-dev",
    "librdmacm-dev",
    "pkg-config",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "rdmacm-utils",
    "perftest",
    "iproute2",
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "gzip",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("setup") => setup(),
        Some("test") => test(),
        Some("demo") => demo(),
        Some("bench") => bench(&args[1..]),
        Some("vm") => vm_cmd(&args[1..]),
        Some("vm2") => vm2_cmd(),
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        _ => {
            eprint!("{USAGE}");
            Ok(ExitCode::from(2))
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the repository root")
        .to_path_buf()
}

/// A named step: announces itself, and reports its duration when done.
#[derive(Debug)]
pub struct Step {
    name: &'static str,
    started: Instant,
}

impl Step {
    pub fn new(name: &'static str, what: &str) -> Self {
        eprintln!("==> [{name}] {what}");
        Self {
            name,
            started: Instant::now(),
        }
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        eprintln!(
            "==> [{}] done in {:.1} s",
            self.name,
            self.started.elapsed().as_secs_f64()
        );
    }
}

/// Runs a command with inherited output; fails with the command line if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// Quotes a string for a POSIX shell.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn missing_packages() -> Vec<&'static str> {
    PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .stderr(Stdio::null())
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
                .unwrap_or(false)
        })
        .collect()
}

fn setup() -> Result<ExitCode> {
    ensure_packages()?;
    Ok(ExitCode::SUCCESS)
}

/// Installs the missing packages (idempotent: nothing happens when all are there).
fn ensure_packages() -> Result<()> {
    let missing = missing_packages();
    if missing.is_empty() {
        eprintln!("==> [setup] all {} system packages present", PACKAGES.len());
        return Ok(());
    }
    let install = format!(
        "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    if !is_root() {
        bail!("missing packages {missing:?}; as root, run:\n  {install}");
    }
    let _s = Step::new("setup", &format!("installing {}", missing.join(" ")));
    run(Command::new("sh").arg("-c").arg(&install)).context("installing system packages")?;
    let still = missing_packages();
    if !still.is_empty() {
        bail!("packages still missing after apt-get install: {still:?}");
    }
    Ok(())
}

fn vm_timeout() -> Duration {
    let secs = std::env::var("RDMSG_VM_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500);
    Duration::from_secs(secs)
}

fn vm_cmd(args: &[String]) -> Result<ExitCode> {
    let args = match args.first().map(String::as_str) {
        Some("--") => &args[1..],
        _ => args,
    };
    if args.is_empty() {
        bail!("usage: cargo xtask vm -- CMD...");
    }
    ensure_packages()?;
    let script = args
        .iter()
        .map(|a| sh_quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    let _s = Step::new(
        "vm",
        &format!("booting the Soft-RoCE VM to run: {}", args.join(" ")),
    );
    let out =
        vm::Vm::new(&repo_root()).run_script(&script, vm_timeout(), &mut |l| println!("{l}"))?;
    eprintln!(
        "==> [vm] booted in {:.1} s; command exited with {}",
        out.boot_secs, out.code
    );
    Ok(exit_code(out.code))
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(repo_root());
    c
}

fn demo() -> Result<ExitCode> {
    ensure_packages()?;
    {
        let _s = Step::new(
            "build",
            "building the examples (release: the demo measures CPU time)",
        );
        run(cargo().args(["build", "--release", "-p", "rdmsg-examples", "--bins"]))?;
    }
    let _s = Step::new(
        "demo",
        "running the telemetry example on rxe0 inside the VM: solicited-only vs next arming",
    );
    let out = vm::Vm::new(&repo_root()).run_script(
        "./target/release/telemetry --arm both",
        vm_timeout(),
        &mut |l| println!("{l}"),
    )?;
    Ok(exit_code(out.code))
}

fn bench(args: &[String]) -> Result<ExitCode> {
    let (ours, run_args): (Vec<String>, Vec<String>) = match args.iter().position(|a| a == "--") {
        Some(i) => (args[..i].to_vec(), args[i + 1..].to_vec()),
        None => (args.to_vec(), Vec::new()),
    };
    let quick = match ours.as_slice() {
        [] => false,
        [q] if q == "--quick" => true,
        other => {
            bail!("usage: cargo xtask bench [--quick] [-- ARGS for rdmsg-bench run]; not {other:?}")
        }
    };
    ensure_packages()?;
    let out_dir = repo_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    {
        let _s = Step::new("build", "building rdmsg-bench and the examples (release)");
        run(cargo().args([
            "build",
            "--release",
            "-p",
            "rdmsg-bench",
            "-p",
            "rdmsg-examples",
        ]))?;
    }
    let bench_bin = repo_root().join("target/release/rdmsg-bench");
    let quick_flag: &[&str] = if quick { &["--quick"] } else { &[] };
    {
        let _s = Step::new("codec", "framing vs plain bincode, on the host");
        let out = Command::new(&bench_bin)
            .arg("codec")
            .args(quick_flag)
            .stderr(Stdio::inherit())
            .output()
            .context("running rdmsg-bench codec")?;
        if !out.status.success() {
            bail!("rdmsg-bench codec failed");
        }
        std::fs::write(out_dir.join("codec.samples"), &out.stdout)?;
    }
    let mut samples = String::new();
    let code = {
        let _s = Step::new(
            "device",
            "rdmsg vs perftest on rxe0, inside one VM boot (progress below)",
        );
        let mut script = String::from("./target/release/rdmsg-bench run");
        for a in quick_flag.iter().map(|s| s.to_string()).chain(run_args) {
            script.push(' ');
            script.push_str(&sh_quote(&a));
        }
        let out = vm::Vm::new(&repo_root()).run_script(&script, vm_timeout(), &mut |l| {
            if l.starts_with("SAMPLE ") {
                samples.push_str(l);
                samples.push('\n');
            } else {
                println!("{l}");
            }
        })?;
        out.code
    };
    std::fs::write(out_dir.join("device.samples"), &samples)?;
    if code != 0 {
        eprintln!("xtask: some device measurements failed (exit {code}); reporting the rest");
    }
    let _s = Step::new("report", "medians, ratios, goals");
    run(Command::new(&bench_bin)
        .args(["report", "--out"])
        .arg(&out_dir)
        .arg(out_dir.join("device.samples"))
        .arg(out_dir.join("codec.samples")))?;
    Ok(exit_code(code))
}

/// Runs the cargo-fuzz target `decode` (msg/fuzz) for `secs` seconds over its kept corpus.
/// cargo-fuzz needs the nightly `-Z` sanitizer flags: `RUSTC_BOOTSTRAP=1` allows them on the
/// stable toolchain. Installs cargo-fuzz first if it is missing.
fn fuzz_decoder(secs: u64) -> Result<()> {
    let has_fuzz = cargo()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_fuzz {
        let _s = Step::new("fuzz", "installing cargo-fuzz (first run only)");
        run(cargo().args(["install", "cargo-fuzz", "--locked"]))?;
    }
    let _s = Step::new(
        "fuzz",
        &format!("fuzzing the frame decoder for {secs} s (msg/fuzz, corpus kept in msg/fuzz/corpus/decode)"),
    );
    run(cargo()
        .current_dir(repo_root().join("msg"))
        .env("RUSTC_BOOTSTRAP", "1")
        .args([
            "fuzz",
            "run",
            "decode",
            "--",
            &format!("-max_total_time={secs}"),
        ])
        .args(["-print_final_stats=1"]))
    .context("the decoder fuzzer found a crash (see msg/fuzz/artifacts/decode) or did not build")
}

fn vm2_cmd() -> Result<ExitCode> {
    ensure_packages()?;
    {
        let _s = Step::new("build", "building the two_hosts example");
        run(cargo().args(["build", "-p", "rdmsg-examples", "--bin", "two_hosts"]))?;
    }
    let r = two_hosts()?;
    println!("{r}");
    Ok(ExitCode::SUCCESS)
}

/// What the two-host run showed.
#[derive(Debug)]
struct TwoHosts {
    boot_secs: f64,
    exchange: String,
    detected_after: Duration,
    report: String,
}

impl std::fmt::Display for TwoHosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "two hosts: booted in {:.1} s; {}; client VM killed, server reported \"{}\" {:.1} s later",
            self.boot_secs,
            self.exchange,
            self.report,
            self.detected_after.as_secs_f64()
        )
    }
}

/// Two VMs joined by a qemu socket network, each with rxe0 on its own virtio NIC: the server
/// VM (10.78.0.1) receives a msg exchange from the client VM (10.78.0.2); once it is done the
/// client's qemu is killed, and the server must report the vanished peer, typed, in time.
fn two_hosts() -> Result<TwoHosts> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    const MESSAGES: u32 = 5000;
    /// Keepalive gives up after 5 s by default; the VMs add their own slowness.
    const DETECT_LIMIT: Duration = Duration::from_secs(20);

    let _s = Step::new(
        "two-hosts",
        "two VMs, rxe0 on a virtio NIC each, joined by a qemu socket network",
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let repo = repo_root();
    // Host n (1 or 2) of the 10.78.0.0/24 network; `socket`: its qemu socket backend.
    let host = |name: &str, n: u8, socket: String| {
        vm::Vm::networked(
            &repo,
            name,
            vm::Nic {
                socket,
                mac: format!("52:54:00:78:00:{n:02x}"),
                addr: format!("10.78.0.{n}/24"),
            },
            1,
        )
    };
    let server_vm = host("a", 1, format!("listen=127.0.0.1:{port}"));
    let client_vm = host("b", 2, format!("connect=127.0.0.1:{port}"));
    server_vm.prepare()?;
    let timeout = Duration::from_secs(300);
    // Set when the client's VM is gone, whatever the reason: the server then has
    // DETECT_LIMIT to report it before its VM is killed too (no run waits out the timeout).
    let server_kill = Arc::new(AtomicBool::new(false));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let reported: Arc<Mutex<Option<(Instant, String)>>> = Arc::default();
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let server = {
        let (reported, lines, server_kill) = (
            Arc::clone(&reported),
            Arc::clone(&lines),
            Arc::clone(&server_kill),
        );
        std::thread::spawn(move || {
            server_vm.run_script_killable(
                &format!(
                    "./target/debug/two_hosts server --listen 0.0.0.0:18800 --messages {MESSAGES}"
                ),
                timeout,
                &mut |l| {
                    println!("[server vm] {l}");
                    if let Some(report) = l.split("server: peer failure: ").nth(1) {
                        *reported.lock().unwrap() = Some((Instant::now(), report.to_owned()));
                    }
                    lines.lock().unwrap().push(l.to_owned());
                },
                &server_kill,
            )
        })
    };
    // qemu's socket backend: the listening side must be up before the other connects.
    std::thread::sleep(Duration::from_secs(1));
    let kill = Arc::new(AtomicBool::new(false));
    let client = {
        let (kill, killed_at) = (Arc::clone(&kill), Arc::clone(&killed_at));
        std::thread::spawn(move || {
            client_vm.run_script_killable(
                &format!("./target/debug/two_hosts client --connect 10.78.0.1:18800 --messages {MESSAGES}"),
                timeout,
                &mut |l| {
                    println!("[client vm] {l}");
                    if l.contains("READY-TO-DIE") {
                        *killed_at.lock().unwrap() = Some(Instant::now());
                        kill.store(true, Ordering::SeqCst);
                    }
                },
                &kill,
            )
        })
    };
    let client = client
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    let client_gone = Instant::now();
    while !server.is_finished() && client_gone.elapsed() < DETECT_LIMIT {
        std::thread::sleep(Duration::from_millis(100));
    }
    server_kill.store(true, Ordering::SeqCst);
    let server = server
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
    let client = client?;
    if client.code != vm::KILLED {
        bail!(
            "the client VM ended by itself (exit {}) instead of being killed after its exchange",
            client.code
        );
    }
    let killed_at = killed_at
        .lock()
        .unwrap()
        .context("the client never got ready")?;
    let (when, report) = reported
        .lock()
        .unwrap()
        .clone()
        .context("the server reported no peer failure")?;
    if server.code != 0 {
        bail!("the server failed (exit {})", server.code);
    }
    let detected_after = when.saturating_duration_since(killed_at);
    if detected_after > DETECT_LIMIT {
        bail!("the server took {detected_after:?} to notice the dead host");
    }
    let exchange = lines
        .lock()
        .unwrap()
        .iter()
        .find_map(|l| {
            l.strip_prefix("server: ")
                .filter(|l| l.contains("readings in"))
                .map(str::to_owned)
        })
        .unwrap_or_default();
    Ok(TwoHosts {
        boot_secs: server.boot_secs,
        exchange,
        detected_after,
        report,
    })
}

/// Pass and fail counts parsed from libtest's `test result:` lines.
#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    passed: u64,
    failed: u64,
}

impl Tally {
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.split("test result: ").nth(1) else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().filter(|w| !w.ends_with('.'));
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                _ => {}
            }
        }
    }
}

fn test() -> Result<ExitCode> {
    let started = Instant::now();
    ensure_packages()?;
    let checks: [(&'static str, &str, Vec<&str>); 3] = [
        ("fmt", "cargo fmt --check", vec!["fmt", "--all", "--check"]),
        (
            "clippy",
            "cargo clippy --workspace --all-targets -- -D warnings",
            vec![
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        ),
        (
            "doc",
            "RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps",
            vec!["doc", "--workspace", "--no-deps"],
        ),
    ];
    for (name, line, args) in checks {
        let _s = Step::new(name, line);
        let status = cargo()
            .args(&args)
            .env("RUSTDOCFLAGS", "-Dwarnings")
            .status()?;
        if !status.success() {
            bail!("step `{name}` failed; rerun it alone with: {line}");
        }
    }

    let mut host = Tally::default();
    {
        let _s = Step::new(
            "host-tests",
            "cargo test --workspace (device tests are left out)",
        );
        let mut child = cargo()
            .args(["test", "--workspace"])
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().context("cargo test stdout")?;
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let line = line?;
            println!("{line}");
            host.add_line(&line);
        }
        let status = child.wait()?;
        if !status.success() && host.failed == 0 {
            bail!(
                "step `host-tests` failed before running tests; rerun with: cargo test --workspace"
            );
        }
    }

    let fuzz_secs: u64 = std::env::var("RDMSG_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    if fuzz_secs > 0 {
        match fuzz_decoder(fuzz_secs) {
            Ok(()) => host.passed += 1,
            Err(e) => {
                eprintln!("xtask: fuzzing failed: {e:#}");
                host.failed += 1;
            }
        }
    }

    let binaries = {
        let _s = Step::new("build-tests", "building test binaries for the VM");
        test_binaries()?
    };
    let mut device = Tally::default();
    let vm_secs;
    {
        let _s = Step::new(
            "device-tests",
            &format!(
                "{} test binaries, device tests only, inside the Soft-RoCE VM",
                binaries.len()
            ),
        );
        let mut script = String::from("status=0\n");
        for bin in &binaries {
            let rel = bin.strip_prefix(repo_root()).unwrap_or(bin);
            script.push_str(&format!(
                "echo \"--- {name}\"\ntimeout 600 {bin} --ignored --test-threads=1 --nocapture --color never || status=1\n",
                name = rel.display(),
                bin = sh_quote(&bin.to_string_lossy())
            ));
        }
        script.push_str("exit $status\n");
        let vm_started = Instant::now();
        let out = vm::Vm::new(&repo_root()).run_script(&script, vm_timeout(), &mut |l| {
            println!("{l}");
            device.add_line(l);
        })?;
        vm_secs = vm_started.elapsed().as_secs_f64();
        eprintln!("==> [device-tests] VM booted in {:.1} s", out.boot_secs);
        if out.code != 0 && device.failed == 0 {
            device.failed += 1;
            eprintln!("xtask: a device test binary failed without a test failure (crash?)");
        }
        if device.passed == 0 {
            device.failed += 1;
            eprintln!("xtask: no device test passed inside the VM: they did not run");
        }
    }
    match two_hosts() {
        Ok(r) => {
            println!("{r}");
            device.passed += 1;
        }
        Err(e) => {
            eprintln!("xtask: the two-host test failed: {e:#}");
            device.failed += 1;
        }
    }
    let total = Tally {
        passed: host.passed + device.passed,
        failed: host.failed + device.failed,
    };
    eprintln!(
        "==> host: {} passed, {} failed; device (rxe0): {} passed, {} failed; VM run {:.1} s; total {:.1} s",
        host.passed,
        host.failed,
        device.passed,
        device.failed,
        vm_secs,
        started.elapsed().as_secs_f64()
    );
    println!("{} passed, {} failed", total.passed, total.failed);
    Ok(if total.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Paths of the workspace's test executables (as `cargo test --no-run` builds them).
fn test_binaries() -> Result<Vec<PathBuf>> {
    let out = cargo()
        .args(["test", "--workspace", "--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("step `build-tests` failed; rerun with: cargo test --workspace --no-run");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut bins: Vec<PathBuf> = text
        .lines()
        // Test harnesses only: binaries built for integration tests have a non-test profile.
        .filter(|l| {
            l.find("\"profile\":{").is_some_and(|i| {
                let profile = &l[i..];
                profile[..profile.find('}').unwrap_or(profile.len())].contains("\"test\":true")
            })
        })
        .filter_map(|l| {
            let start = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = start + l[start..].find('"')?;
            Some(PathBuf::from(&l[start..end]))
        })
        .collect();
    bins.sort();
    bins.dedup();
    if bins.is_empty() {
        bail!("cargo built no test binaries");
    }
    Ok(bins)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_reads_libtest_summaries() {
        let mut t = Tally::default();
        t.add_line("test result: ok. 8 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out");
        t.add_line("test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured");
        t.add_line("test foo ... ok");
        assert_eq!((t.passed, t.failed), (11, 1));
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), "'it'\\''s'");
    }
}
