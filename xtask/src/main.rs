//! `cargo xtask`: setup, checks, host and device tests, the Soft-RoCE VM and the demo.

#![forbid(unsafe_code)]

mod cluster;
mod flap;
mod fuzz;
#[cfg(test)]
mod imports;
mod package;
mod vm;
mod worktree;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use vm::Kernel;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  setup            install the Debian packages rdmsg needs (apt-get as root; prints the command otherwise)
  test [--kernel K]
                   fmt, clippy, docs, host tests, the decoder fuzzed for a fixed time (new
                   inputs go to target/fuzz/corpus/decode, failing ones to target/fuzz/artifacts),
                   `cargo package` of the published crates (verified, not uploaded), the README's
                   quick start built as a project of its own (target/scratch/app), the device
                   tests inside the Soft-RoCE VM once per kernel (6.1, then 6.12, one boot each;
                   --kernel or RDMSG_KERNELS picks; the quick start runs in the first boot), then
                   the two-host test (as vm2, on 6.1), the cost check, the collector example at
                   10,000 sensors and the jobq example at 9,000 jobs with a worker killed (on
                   6.1), the small cluster (3 VMs, 1 % loss, a host killed, a link cut; on each
                   kernel); last, `git status` must show nothing the
                   run added. The two soaks run 200,000 messages on each kernel; --full-soaks
                   runs their million. For work on the driver: --device-only (device tests only:
                   no checks, fuzzing, packaging, quick start, two-host test or cluster),
                   --bins NAME,... (only the test binaries whose names start so)
  package          `cargo package` of the published crates, each verified by building it from
                   its packaged sources (no upload); lists the .crate files
  quickstart [--kernel K]
                   build the README's first ```rust block as a project of its own outside the
                   workspace (target/scratch/app: the rdmsg facade by path, serde, crates.io's
                   notify) and run it on rxe0 inside the VM
  fuzz-merge       merge the fuzzer's working corpus (target/fuzz/corpus/decode) into the kept
                   one (msg/fuzz/corpus/decode), keeping only inputs that add coverage
  demo [--kernel K]
                   run the telemetry demo on rxe0 inside the VM (solicited-only vs next vs
                   busy-poll, 7 rounds interleaved: medians and spread)
  bench [--quick] [--kernel K] [-- ARGS]
                   benchmarks side by side with perftest in one VM boot, codec on the host,
                   and the fan-in (1 to 1024 connections: one hub thread vs a thread per
                   connection), and the collector example at 1,000 to 10,000 sensors; writes
                   target/bench/report.md, report.json, chart.png (ARGS go to `rdmsg-bench
                   run`, e.g. --rounds 3, --only lat, --only fanin or --only collector)
  vm [--kernel K] [--env NAME[=VALUE]]... -- CMD...
                   boot the Soft-RoCE VM and run CMD in the repository (exit code is CMD's).
                   The guest has none of the host's environment but RUST_LOG and RUST_BACKTRACE
                   (when set); --env passes NAME with the host's value, or sets it to VALUE
                   (repeatable)
  vm2 [--kernel K] two VMs on a qemu socket network, rxe0 on each one's virtio NIC: a msg
                   exchange between them over TCP and one over rdma_cm, then one VM is killed;
                   the other must report it on both
  flap [--kernel K] two VMs on a qemu socket network: a resumable session carries notes and
                   calls while the client cuts its own link (tc netem) twice for 9 s; every
                   note once and in order, every call answered, a resume per cut
  cluster [--kernel K] [--hosts H] [--seconds S] [--sweep] [--cm] [--flap N]
                   H VMs (default 4) on a vde_switch, rxe0 on each one's virtio NIC, every host
                   exchanging checked typed messages with every other (the `mesh` example) under
                   tc netem loss, delay, reordering and duplication; one host is killed mid-run
                   and one link cut for a second. Prints `cluster: key=value ...`. --sweep: one
                   run per loss rate (0, 0.1, 1, 5 %), nobody killed; writes
                   target/cluster/sweep.md, sweep.json and sweep.svg (throughput against loss).
                   --cm: the hosts connect through rdma_cm instead of the TCP bootstrap.
                   --flap N: every session resumable (window 20 s, keepalive 3 s), the link
                   cut N times for 9 s, 14 s apart; nothing lost or repeated, every session
                   resumed within 2 s of the link's return (cargo xtask test runs N = 2)

kernels (K): 6.1 (Debian 12's linux-image-amd64, the default), 6.12 (linux-image-6.12-amd64,
  bookworm-security); each is fetched once into target/vm/kernel-<release>

environment:
  RDMSG_KERNELS    kernels `test` runs the device tests on, e.g. 6.12 (default 6.1,6.12)
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
    // The librpma peer of the rdma_cm interop tests (compiled by the test with cc).
    "librpma-dev",
    "perftest",
    "iproute2",
    "vde2",
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "gzip",
    "xz-utils",
    // The cost check counts instructions and allocations with callgrind (in the VM, which
    // runs the host's binaries).
    "valgrind",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = match parse(&args, std::env::var("RDMSG_KERNELS").ok().as_deref()) {
        Ok(task) => task,
        Err(usage) => {
            eprintln!("xtask: {usage}\n");
            eprint!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match task {
        Task::Setup => setup(),
        Task::Test(plan) => test(&plan),
        Task::Demo(kernel) => demo(kernel),
        Task::Bench {
            quick,
            kernel,
            run_args,
        } => bench(quick, kernel, run_args),
        Task::Vm { kernel, cmd, env } => vm_cmd(kernel, &cmd, &env),
        Task::Vm2(kernel) => vm2_cmd(kernel),
        Task::Flap(kernel) => flap_cmd(kernel),
        Task::Cluster {
            kernel,
            hosts,
            seconds,
            sweep,
            cm,
            flap,
        } => cluster_cmd(kernel, hosts, seconds, sweep, cm, flap),
        Task::FuzzMerge => fuzz::fuzz_merge(),
        Task::Package => package_cmd(),
        Task::Quickstart(kernel) => quickstart_cmd(kernel),
        Task::Help => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
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

/// What the command line asks for.
#[derive(Debug, PartialEq)]
enum Task {
    Setup,
    Test(TestPlan),
    Demo(Kernel),
    Bench {
        quick: bool,
        kernel: Kernel,
        run_args: Vec<String>,
    },
    Vm {
        kernel: Kernel,
        cmd: Vec<String>,
        /// `--env` arguments, `NAME` or `NAME=VALUE`, in order.
        env: Vec<String>,
    },
    Vm2(Kernel),
    Flap(Kernel),
    Cluster {
        kernel: Kernel,
        hosts: Option<u16>,
        seconds: Option<f64>,
        sweep: bool,
        /// Connect through rdma_cm instead of the TCP bootstrap.
        cm: bool,
        /// The flap mode, with this many cuts.
        flap: Option<u32>,
    },
    FuzzMerge,
    Package,
    Quickstart(Kernel),
    Help,
}

/// What `cargo xtask test` runs.
#[derive(Debug, PartialEq)]
struct TestPlan {
    /// Kernels to run the device tests on, each in its own VM boot, in [`vm::KERNELS`] order.
    kernels: Vec<Kernel>,
    /// Skip fmt, clippy, docs, host tests, fuzzing, packaging, the quick start and the two-host
    /// test.
    device_only: bool,
    /// Only the test binaries whose file names start with one of these (all when empty).
    bins: Vec<String>,
    /// Run the two soaks at their full million messages (default: [`SOAK_MESSAGES`] each).
    full_soaks: bool,
}

/// Options given before `--` (or, for `vm`, before the command), and what follows.
#[derive(Debug, Default)]
struct Opts {
    kernel: Option<Kernel>,
    quick: bool,
    device_only: bool,
    full_soaks: bool,
    bins: Vec<String>,
    hosts: Option<u16>,
    seconds: Option<f64>,
    sweep: bool,
    cm: bool,
    /// `cargo xtask cluster --flap N`: cuts of the flap mode.
    flap: Option<u32>,
    /// `--env` arguments, in order.
    env: Vec<String>,
    rest: Vec<String>,
}

/// Reads `task`'s options among `allowed`, up to `--` (what follows is `rest`); with
/// `command_follows`, the first word that is no option starts `rest` too (`vm ls -l`).
fn options(
    task: &str,
    args: &[String],
    allowed: &[&str],
    command_follows: bool,
) -> Result<Opts, String> {
    let mut o = Opts::default();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        if arg == "--" {
            o.rest = args[i + 1..].to_vec();
            break;
        }
        if command_follows && !arg.starts_with('-') {
            o.rest = args[i..].to_vec();
            break;
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v.to_owned())),
            None => (arg, None),
        };
        if !allowed.contains(&flag) {
            return Err(format!("`{task}` takes no option {arg:?}"));
        }
        let takes_value = matches!(
            flag,
            "--kernel" | "--bins" | "--hosts" | "--seconds" | "--env" | "--flap"
        );
        let value = match (takes_value, inline) {
            (true, Some(v)) => v,
            (true, None) => {
                i += 1;
                args.get(i)
                    .cloned()
                    .ok_or_else(|| format!("{flag} needs a value"))?
            }
            (false, Some(_)) => return Err(format!("{flag} takes no value")),
            (false, None) => String::new(),
        };
        match flag {
            "--kernel" => o.kernel = Some(Kernel::parse(&value)?),
            "--bins" => {
                o.bins = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            }
            "--hosts" => {
                o.hosts = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|h| (2..=16).contains(h))
                        .ok_or("--hosts must be between 2 and 16")?,
                )
            }
            "--seconds" => {
                o.seconds = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|s: &f64| *s > 0.0)
                        .ok_or("--seconds must be a positive number")?,
                )
            }
            "--env" => o.env.push(env_arg(&value)?),
            "--flap" => {
                o.flap = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|n: &u32| (1..=20).contains(n))
                        .ok_or("--flap must be between 1 and 20 cuts")?,
                )
            }
            "--sweep" => o.sweep = true,
            "--cm" => o.cm = true,
            "--quick" => o.quick = true,
            "--device-only" => o.device_only = true,
            "--full-soaks" => o.full_soaks = true,
            _ => unreachable!("{flag} is allowed but not handled"),
        }
        i += 1;
    }
    Ok(o)
}

/// Kernels listed in `RDMSG_KERNELS` (`6.1,6.12`), in [`vm::KERNELS`] order, each once.
fn kernel_list(list: &str) -> Result<Vec<Kernel>, String> {
    let mut kernels = list
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(Kernel::parse)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("RDMSG_KERNELS: {e}"))?;
    kernels.sort_by_key(|k| vm::KERNELS.iter().position(|known| known == k));
    kernels.dedup();
    if kernels.is_empty() {
        return Err("RDMSG_KERNELS names no kernel".into());
    }
    Ok(kernels)
}

/// Parses the command line (without the program name); `rdmsg_kernels` is `$RDMSG_KERNELS`.
/// An error is a usage error: `main` prints it with the usage and exits with 2.
fn parse(args: &[String], rdmsg_kernels: Option<&str>) -> Result<Task, String> {
    let Some((task, rest)) = args.split_first() else {
        return Err("no task given".into());
    };
    let no_rest = |o: Opts| -> Result<Opts, String> {
        if o.rest.is_empty() {
            Ok(o)
        } else {
            Err(format!("`{task}` takes no arguments {:?}", o.rest))
        }
    };
    let kernel = |o: &Opts| o.kernel.unwrap_or_else(Kernel::default_kernel);
    Ok(match task.as_str() {
        "setup" => {
            no_rest(options(task, rest, &[], false)?)?;
            Task::Setup
        }
        "test" => {
            let o = no_rest(options(
                task,
                rest,
                &["--kernel", "--device-only", "--full-soaks", "--bins"],
                false,
            )?)?;
            let kernels = match (o.kernel, rdmsg_kernels) {
                (Some(k), _) => vec![k],
                (None, Some(list)) => kernel_list(list)?,
                (None, None) => vm::KERNELS.to_vec(),
            };
            Task::Test(TestPlan {
                kernels,
                device_only: o.device_only,
                bins: o.bins,
                full_soaks: o.full_soaks,
            })
        }
        "demo" => Task::Demo(kernel(&no_rest(options(
            task,
            rest,
            &["--kernel"],
            false,
        )?)?)),
        "bench" => {
            let o = options(task, rest, &["--quick", "--kernel"], false)?;
            Task::Bench {
                quick: o.quick,
                kernel: kernel(&o),
                run_args: o.rest,
            }
        }
        "vm" => {
            let o = options(task, rest, &["--kernel", "--env"], true)?;
            if o.rest.is_empty() {
                return Err(
                    "usage: cargo xtask vm [--kernel K] [--env NAME[=VALUE]]... -- CMD...".into(),
                );
            }
            Task::Vm {
                kernel: kernel(&o),
                cmd: o.rest,
                env: o.env,
            }
        }
        "vm2" => Task::Vm2(kernel(&no_rest(options(
            task,
            rest,
            &["--kernel"],
            false,
        )?)?)),
        "flap" => Task::Flap(kernel(&no_rest(options(
            task,
            rest,
            &["--kernel"],
            false,
        )?)?)),
        "cluster" => {
            let o = no_rest(options(
                task,
                rest,
                &[
                    "--kernel",
                    "--hosts",
                    "--seconds",
                    "--sweep",
                    "--cm",
                    "--flap",
                ],
                false,
            )?)?;
            Task::Cluster {
                kernel: kernel(&o),
                hosts: o.hosts,
                seconds: o.seconds,
                sweep: o.sweep,
                cm: o.cm,
                flap: o.flap,
            }
        }
        "fuzz-merge" => {
            no_rest(options(task, rest, &[], false)?)?;
            Task::FuzzMerge
        }
        "package" => {
            no_rest(options(task, rest, &[], false)?)?;
            Task::Package
        }
        "quickstart" => Task::Quickstart(kernel(&no_rest(options(
            task,
            rest,
            &["--kernel"],
            false,
        )?)?)),
        "-h" | "--help" | "help" => Task::Help,
        other => return Err(format!("unknown task {other:?}")),
    })
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

/// An `--env` argument, checked: `NAME` or `NAME=VALUE`, NAME a shell variable's name (the
/// guest exports it).
fn env_arg(arg: &str) -> Result<String, String> {
    let name = arg.split_once('=').map_or(arg, |(name, _)| name);
    let mut chars = name.chars();
    let valid = chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric());
    if valid {
        Ok(arg.to_owned())
    } else {
        Err(format!(
            "--env {arg:?}: give NAME or NAME=VALUE, NAME made of letters, digits and _ (not \
             starting with a digit)"
        ))
    }
}

/// Variables passed into the guest whenever the host has them: what a failing program's
/// output depends on.
const PASSED_BY_DEFAULT: &[&str] = &["RUST_LOG", "RUST_BACKTRACE"];

/// What `cargo xtask vm` sets in the guest: [`PASSED_BY_DEFAULT`] as the host has them, then
/// each `--env` argument in order (`NAME=VALUE` as given, `NAME` with the host's value, read
/// through `host`), a later one for a name replacing an earlier one. Second: the names given
/// alone that the host does not have (left out).
fn guest_env(
    args: &[String],
    host: impl Fn(&str) -> Option<String>,
) -> (Vec<(String, String)>, Vec<String>) {
    fn set(vars: &mut Vec<(String, String)>, name: &str, value: String) {
        vars.retain(|(n, _)| n != name);
        vars.push((name.to_owned(), value));
    }
    let mut vars = Vec::new();
    let mut unset = Vec::new();
    for name in PASSED_BY_DEFAULT {
        if let Some(value) = host(name) {
            set(&mut vars, name, value);
        }
    }
    for arg in args {
        match arg.split_once('=') {
            Some((name, value)) => set(&mut vars, name, value.to_owned()),
            None => match host(arg) {
                Some(value) => set(&mut vars, arg, value),
                None => unset.push(arg.clone()),
            },
        }
    }
    (vars, unset)
}

/// Shell lines that export `vars` (values quoted: any byte but NUL survives).
fn env_exports(vars: &[(String, String)]) -> String {
    vars.iter()
        .map(|(name, value)| format!("export {name}={}\n", sh_quote(value)))
        .collect()
}

fn vm_cmd(kernel: Kernel, args: &[String], env: &[String]) -> Result<ExitCode> {
    ensure_packages()?;
    let (vars, unset) = guest_env(env, |name| std::env::var(name).ok());
    for name in unset {
        eprintln!("xtask: --env {name}: the host has no {name}; not set in the guest");
    }
    let script = env_exports(&vars)
        + &args
            .iter()
            .map(|a| sh_quote(a))
            .collect::<Vec<_>>()
            .join(" ");
    let passed = if vars.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
        format!(" (with {})", names.join(", "))
    };
    let _s = Step::new(
        "vm",
        &format!(
            "booting the Soft-RoCE VM (Linux {kernel}) to run: {}{passed}",
            args.join(" ")
        ),
    );
    let out = vm::Vm::new(&repo_root(), kernel)
        .run_script(&script, vm_timeout(), &mut |l| println!("{l}"))?;
    eprintln!(
        "==> [vm] Linux {} booted in {:.1} s; command exited with {}",
        out.release, out.boot_secs, out.code
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

fn demo(kernel: Kernel) -> Result<ExitCode> {
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
        "running the telemetry example on rxe0 inside the VM: solicited-only vs next arming vs busy polling, 7 rounds interleaved",
    );
    let out = vm::Vm::new(&repo_root(), kernel).run_script(
        "./target/release/telemetry --arm all --rounds 7 --messages 4000",
        vm_timeout(),
        &mut |l| println!("{l}"),
    )?;
    Ok(exit_code(out.code))
}

fn bench(quick: bool, kernel: Kernel, run_args: Vec<String>) -> Result<ExitCode> {
    ensure_packages()?;
    let out_dir = repo_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    build_bench("build")?;
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
            &format!(
                "rdmsg vs perftest on rxe0, inside one VM boot on Linux {kernel} (progress below)"
            ),
        );
        let mut script = String::from("./target/release/rdmsg-bench run");
        for a in quick_flag.iter().map(|s| s.to_string()).chain(run_args) {
            script.push(' ');
            script.push_str(&sh_quote(&a));
        }
        let out =
            vm::Vm::new(&repo_root(), kernel).run_script(&script, vm_timeout(), &mut |l| {
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

/// The cost check: release builds of the bench and the examples, then `rdmsg-bench
/// cost-check` in the VM (callgrind counts each layer's instructions and allocations per
/// round trip). Whether every layer is within its ceilings and allocates nothing per message.
fn cost_check(kernel: Kernel) -> Result<bool> {
    build_bench("cost-build")?;
    let _s = Step::new(
        "cost",
        "instructions and allocations per round trip of each layer (callgrind, in the VM)",
    );
    let out = vm::Vm::new(&repo_root(), kernel).run_script(
        "./target/release/rdmsg-bench cost-check",
        vm_timeout(),
        &mut |l| println!("{l}"),
    )?;
    Ok(out.code == 0)
}

/// Sensors of the collector run `cargo xtask test` makes: the README's example at the scale
/// issue 41 found it failing (10,000 peers on one hub thread), the largest that fits the run's
/// time (about a minute in the VM with a release build).
const COLLECTOR_SENSORS: u32 = 10_000;

/// The README's collector example at [`COLLECTOR_SENSORS`] sensors, in the VM, from the
/// release build [`cost_check`] made: whether it passed (nothing lost, no connection failed:
/// the example's own exit code) and its report line.
fn collector_at_scale(kernel: Kernel) -> Result<(bool, Option<String>)> {
    let _s = Step::new(
        "collector",
        &format!(
            "the README's collector example with {COLLECTOR_SENSORS} sensors, one hub thread (release build, in the VM)"
        ),
    );
    let mut line = None;
    let out = vm::Vm::new(&repo_root(), kernel).run_script(
        &format!(
            "ulimit -n 65536 && ./target/release/collector --sensors {COLLECTOR_SENSORS} --batches 2"
        ),
        vm_timeout(),
        &mut |l| {
            println!("{l}");
            if l.starts_with("collector: connections=") {
                line = Some(l.to_owned());
            }
        },
    )?;
    Ok((out.code == 0, line))
}

/// The `jobq` example at the scale issue 45 asked for (a coordinator, 6 workers, 3 clients of
/// 3,000 jobs each, up to 32 in flight; one worker killed with SIGKILL 5 s in), in the VM,
/// from the release build [`cost_check`] made: whether every job was answered once and
/// rightly (the demo's own checks and exit code), and its report line.
fn jobq_at_scale(kernel: Kernel) -> Result<(bool, Option<String>)> {
    let _s = Step::new(
        "jobq",
        "the jobq example: 6 workers, 3 clients x 3,000 jobs, a worker killed mid-run (release build, in the VM)",
    );
    let mut line = None;
    let out = vm::Vm::new(&repo_root(), kernel).run_script(JOBQ_DEMO, vm_timeout(), &mut |l| {
        println!("{l}");
        if l.starts_with("jobq: jobs=") {
            line = Some(l.to_owned());
        }
    })?;
    Ok((out.code == 0, line))
}

/// The command [`jobq_at_scale`] runs.
const JOBQ_DEMO: &str =
    "./target/release/jobq demo --workers 6 --clients 3 --jobs 3000 --in-flight 32 --kill-after 5";

/// Builds `rdmsg-bench` and the examples it runs (`rc_pingpong`, `collector`) in release
/// mode, as step `step`: all of `rdmsg-examples`' binaries, so that they land next to
/// `target/release/rdmsg-bench`, where it looks for them.
fn build_bench(step: &'static str) -> Result<()> {
    let _s = Step::new(step, "building rdmsg-bench and the examples (release)");
    run(cargo().args([
        "build",
        "--release",
        "-p",
        "rdmsg-bench",
        "-p",
        "rdmsg-examples",
    ]))
}

/// `cargo xtask package`: with `--allow-dirty` when the work tree has uncommitted changes.
fn package_cmd() -> Result<ExitCode> {
    let repo = repo_root();
    let dirty = worktree::Snapshot::take(&repo).is_some_and(|s| !s.is_clean());
    for (path, size) in package::package(dirty)? {
        println!(
            "packaged: {} ({})",
            path.strip_prefix(&repo).unwrap_or(&path).display(),
            package::kib(size)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn quickstart_cmd(kernel: Kernel) -> Result<ExitCode> {
    ensure_packages()?;
    let repo = repo_root();
    let bin = package::build_scratch(&repo, &repo.join("README.md"))?;
    let _s = Step::new(
        "quickstart",
        &format!("running the quick start on rxe0 inside the VM (Linux {kernel})"),
    );
    let out = vm::Vm::new(&repo, kernel).run_script(
        &format!("timeout 300 {}", sh_quote(&bin.to_string_lossy())),
        vm_timeout(),
        &mut |l| println!("{l}"),
    )?;
    eprintln!("==> [quickstart] exited with {}", out.code);
    Ok(exit_code(out.code))
}

fn vm2_cmd(kernel: Kernel) -> Result<ExitCode> {
    ensure_packages()?;
    {
        let _s = Step::new("build", "building the two_hosts example");
        run(cargo().args(["build", "-p", "rdmsg-examples", "--bin", "two_hosts"]))?;
    }
    let r = two_hosts(kernel)?;
    println!("{r}");
    Ok(ExitCode::SUCCESS)
}

fn flap_cmd(kernel: Kernel) -> Result<ExitCode> {
    ensure_packages()?;
    {
        let _s = Step::new("build", "building the flap example");
        run(cargo().args(["build", "-p", "rdmsg-examples", "--bin", "flap"]))?;
    }
    println!("{}", flap::run(kernel)?);
    Ok(ExitCode::SUCCESS)
}

fn cluster_cmd(
    kernel: Kernel,
    hosts: Option<u16>,
    seconds: Option<f64>,
    sweep: bool,
    cm: bool,
    flap: Option<u32>,
) -> Result<ExitCode> {
    ensure_packages()?;
    build_mesh(true)?;
    if sweep {
        cluster::sweep(kernel, hosts.unwrap_or(4), seconds, cm)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut plan = cluster::Plan::full(kernel);
    plan.cm = cm;
    if let Some(h) = hosts {
        plan.hosts = h;
        // The last host dies, the second one's link is cut.
        plan.kill = plan.kill.map(|(_, at)| (h, at));
        if h < 3 {
            plan.kill = None;
        }
    }
    if let Some(s) = seconds {
        plan.seconds = s;
        plan.kill = plan.kill.map(|(h, _)| (h, s / 3.0));
        plan.cut = plan.cut.map(|(h, _, ms)| (h, s / 2.0, ms));
    }
    if let Some(cuts) = flap {
        anyhow::ensure!(
            !cm,
            "the flap mode resumes through the TCP bootstrap (not yet rdma_cm)"
        );
        plan = plan.flapping(cuts);
    }
    cluster::run(&plan)?;
    Ok(ExitCode::SUCCESS)
}

fn build_mesh(release: bool) -> Result<()> {
    let _s = Step::new("build", "building the mesh example");
    let mut cmd = cargo();
    cmd.args(["build", "-p", "rdmsg-examples", "--bin", "mesh"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)
}

/// What the two-host run showed.
#[derive(Debug)]
struct TwoHosts {
    boot_secs: f64,
    /// Per way of connecting: (way, exchange, noticed after, report).
    ways: Vec<(&'static str, String, Duration, String)>,
}

impl std::fmt::Display for TwoHosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "two hosts: booted in {:.1} s", self.boot_secs)?;
        for (way, exchange, after, report) in &self.ways {
            write!(
                f,
                "; {way}: {exchange}, client VM killed, server reported \"{report}\" {:.1} s later",
                after.as_secs_f64()
            )?;
        }
        Ok(())
    }
}

/// The ways the two-host run connects, side by side in the same VMs: (name as `two_hosts`
/// prints it, its flag, the server's port).
const TWO_HOST_WAYS: [(&str, &str, u16); 2] = [("tcp", "", 18800), ("rdma_cm", "--cm ", 18801)];

/// Two VMs joined by a qemu socket network, each with rxe0 on its own virtio NIC: the server
/// VM (10.78.0.1) receives a msg exchange from the client VM (10.78.0.2) over the TCP
/// bootstrap and, at the same time, over rdma_cm; once both are done the client's qemu is
/// killed, and each server must report the vanished peer, typed, in time.
fn two_hosts(kernel: Kernel) -> Result<TwoHosts> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    const MESSAGES: u32 = 5000;
    /// Keepalive gives up after 5 s by default; the VMs add their own slowness.
    const DETECT_LIMIT: Duration = Duration::from_secs(20);

    let _s = Step::new(
        "two-hosts",
        &format!(
            "two VMs (Linux {kernel}), rxe0 on a virtio NIC each, joined by a qemu socket network"
        ),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let repo = repo_root();
    // Host n (1 or 2) of the 10.78.0.0/24 network; `socket`: its qemu socket backend.
    let host = |name: &str, n: u8, socket: String| {
        vm::Vm::networked(
            &repo,
            kernel,
            name,
            vm::Nic {
                netdev: format!("socket,{socket}"),
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
    // Per way: when and what its server reported.
    type Reports = Vec<(&'static str, Instant, String)>;
    let reported: Arc<Mutex<Reports>> = Arc::default();
    // Both sides of every way in one script each: `a & b & wait`, failing if any failed.
    let both = |role: &str, addr: &str| {
        let runs: Vec<String> = TWO_HOST_WAYS
            .iter()
            .map(|(_, flag, port)| {
                format!("./target/debug/two_hosts {role} {flag}--listen {addr}:{port} --messages {MESSAGES}")
            })
            .collect();
        format!(
            "{} & first=$!; {}; second=$?; wait $first; exit $(( $? | second ))",
            runs[0], runs[1]
        )
    };
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let server = {
        let (reported, lines, server_kill) = (
            Arc::clone(&reported),
            Arc::clone(&lines),
            Arc::clone(&server_kill),
        );
        std::thread::spawn(move || {
            server_vm.run_script_killable(
                &both("server", "10.78.0.1"),
                timeout,
                &mut |l| {
                    println!("[server vm] {l}");
                    for (way, _, _) in TWO_HOST_WAYS {
                        let tag = format!("server: peer failure over {way}: ");
                        if let Some(report) = l.split(&tag).nth(1) {
                            reported
                                .lock()
                                .unwrap()
                                .push((way, Instant::now(), report.to_owned()));
                        }
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
            let mut ready = 0;
            client_vm.run_script_killable(
                &both("client", "10.78.0.1"),
                timeout,
                &mut |l| {
                    println!("[client vm] {l}");
                    // Killed once every way's exchange is done.
                    ready += usize::from(l.contains("READY-TO-DIE"));
                    if ready == TWO_HOST_WAYS.len() {
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
    if server.code != 0 {
        bail!("the server failed (exit {})", server.code);
    }
    let reported = reported.lock().unwrap().clone();
    let lines = lines.lock().unwrap();
    let mut ways = Vec::new();
    for (way, _, _) in TWO_HOST_WAYS {
        let (_, when, report) = reported
            .iter()
            .find(|(w, _, _)| *w == way)
            .with_context(|| format!("the server over {way} reported no peer failure"))?;
        let detected_after = when.saturating_duration_since(killed_at);
        if detected_after > DETECT_LIMIT {
            bail!("the server over {way} took {detected_after:?} to notice the dead host");
        }
        let exchange = lines
            .iter()
            .find_map(|l| {
                l.strip_prefix("server: ")
                    .filter(|l| l.contains(&format!("readings over {way} in")))
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        ways.push((way, exchange, detected_after, report.clone()));
    }
    Ok(TwoHosts {
        boot_secs: server.boot_secs,
        ways,
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

/// A step's duration for the closing `step times` line.
fn took(name: impl std::fmt::Display, since: Instant) -> String {
    format!("{name} {:.1} s", since.elapsed().as_secs_f64())
}

fn test(plan: &TestPlan) -> Result<ExitCode> {
    let started = Instant::now();
    let repo = repo_root();
    // What is uncommitted before the run is the developer's own work: never counted against it.
    let tree_before = worktree::Snapshot::take(&repo);
    ensure_packages()?;
    let mut host = Tally::default();
    // Checks that count as one test each: (name, passed).
    let mut checks: Vec<(String, bool)> = Vec::new();
    let mut step_times = Vec::new();
    let mut quickstart = None;
    if !plan.device_only {
        let lints: [(&'static str, &str, Vec<&str>); 4] = [
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
                "clippy-tracing",
                "cargo clippy --workspace --all-targets --features rdmsg/tracing -- -D warnings",
                vec![
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--features",
                    "rdmsg/tracing",
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
        for (name, line, args) in lints {
            let t = Instant::now();
            let _s = Step::new(name, line);
            let status = cargo()
                .args(&args)
                .env("RUSTDOCFLAGS", "-Dwarnings")
                .status()?;
            if !status.success() {
                bail!("step `{name}` failed; rerun it alone with: {line}");
            }
            step_times.push(took(name, t));
        }

        // The workspace's host tests, then the layers' own again with their events on (the
        // `tracing` feature's tests, which record what the drivers report).
        let host_tests: [(&str, &str, Vec<&str>); 2] = [
            (
                "host-tests",
                "cargo test --workspace",
                vec!["test", "--workspace"],
            ),
            (
                "host-tests-tracing",
                "cargo test -p rdmsg-transport -p rdmsg-msg --lib --features rdmsg-transport/tracing,rdmsg-msg/tracing",
                vec![
                    "test",
                    "-p",
                    "rdmsg-transport",
                    "-p",
                    "rdmsg-msg",
                    "--lib",
                    "--features",
                    "rdmsg-transport/tracing,rdmsg-msg/tracing",
                ],
            ),
        ];
        for (name, line, args) in host_tests {
            let t = Instant::now();
            let _s = Step::new(name, &format!("{line} (device tests are left out)"));
            let failed_before = host.failed;
            let mut child = cargo().args(&args).stdout(Stdio::piped()).spawn()?;
            let stdout = child.stdout.take().context("cargo test stdout")?;
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let line = line?;
                println!("{line}");
                host.add_line(&line);
            }
            let status = child.wait()?;
            if !status.success() && host.failed == failed_before {
                bail!("step `{name}` failed before running tests; rerun with: {line}");
            }
            step_times.push(took(name, t));
        }

        let fuzz_secs: u64 = std::env::var("RDMSG_FUZZ_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60);
        if fuzz_secs > 0 {
            let t = Instant::now();
            let result = fuzz::fuzz_decoder(fuzz_secs);
            if let Err(e) = &result {
                eprintln!("xtask: fuzzing failed: {e:#}");
            }
            checks.push(("fuzz".into(), result.is_ok()));
            step_times.push(took("fuzz", t));
        }

        let t = Instant::now();
        let allow_dirty = tree_before.as_ref().is_some_and(|s| !s.is_clean());
        let packaged = package::package(allow_dirty);
        match &packaged {
            Ok(crates) => {
                for (path, size) in crates {
                    println!(
                        "packaged: {} ({})",
                        path.strip_prefix(&repo).unwrap_or(path).display(),
                        package::kib(*size)
                    );
                }
            }
            Err(e) => eprintln!("xtask: packaging failed (alone: cargo xtask package): {e:#}"),
        }
        checks.push(("package".into(), packaged.is_ok()));
        step_times.push(took("package", t));

        let t = Instant::now();
        match package::build_scratch(&repo, &repo.join("README.md")) {
            Ok(bin) => quickstart = Some(bin),
            Err(e) => {
                eprintln!(
                    "xtask: the quick start did not build (alone: cargo xtask quickstart): {e:#}"
                );
                checks.push(("quickstart".into(), false));
            }
        }
        step_times.push(took("quickstart build", t));
    }

    let binaries = {
        let t = Instant::now();
        let _s = Step::new("build-tests", "building test binaries for the VM");
        let all = test_binaries()?;
        let chosen = select_binaries(all, &plan.bins)?;
        step_times.push(took("build-tests", t));
        chosen
    };
    // The quick start runs in the first boot: 6.1's unless the kernels are restricted.
    let runs: Vec<KernelRun> = plan
        .kernels
        .iter()
        .enumerate()
        .map(|(i, &kernel)| {
            device_tests(
                kernel,
                &binaries,
                quickstart.as_deref().filter(|_| i == 0),
                plan.full_soaks,
            )
        })
        .collect();
    for r in &runs {
        let Some(q) = &r.quickstart else { continue };
        let ok = q.code == Some(0);
        match q.code {
            Some(0) => {}
            Some(code) => eprintln!(
                "xtask: the quick start exited with {code} on Linux {} (alone: cargo xtask quickstart --kernel {0})",
                r.kernel
            ),
            None => eprintln!("xtask: the quick start did not run on Linux {}", r.kernel),
        }
        if q.code.is_some() && q.said.is_empty() {
            eprintln!("xtask: the quick start printed no line starting `quickstart:`");
        }
        for l in &q.said {
            println!("{l}");
        }
        checks.push((format!("quickstart ({})", r.kernel), ok));
        step_times.push(format!("quickstart run ({}) {:.1} s", r.kernel, q.secs));
    }
    // Two VMs on a socket network: on the default kernel only.
    let two_host_kernel = Kernel::default_kernel();
    let two_host = (!plan.device_only).then(|| {
        let vm_started = Instant::now();
        let result = two_hosts(two_host_kernel);
        let secs = vm_started.elapsed().as_secs_f64();
        match &result {
            Ok(r) => println!("{r}"),
            Err(e) => eprintln!("xtask: the two-host test failed: {e:#}"),
        }
        eprintln!("==> [two-hosts] VM run (Linux {two_host_kernel}, two VMs) {secs:.1} s");
        (result.is_ok(), secs)
    });
    // A resumable session under link flaps, two VMs: on the default kernel only.
    let flap = (!plan.device_only).then(|| {
        let vm_started = Instant::now();
        let result = flap::run(two_host_kernel);
        let secs = vm_started.elapsed().as_secs_f64();
        match &result {
            Ok(r) => println!("{r}"),
            Err(e) => eprintln!("xtask: the flap step failed (alone: cargo xtask flap): {e:#}"),
        }
        eprintln!("==> [flap] VM run (Linux {two_host_kernel}, two VMs) {secs:.1} s");
        (result.is_ok(), secs)
    });

    // Instructions and allocations per round trip of each layer: on the default kernel only
    // (the counts are user space's, the same on either).
    let cost = (!plan.device_only).then(|| {
        let vm_started = Instant::now();
        let result = cost_check(two_host_kernel);
        let secs = vm_started.elapsed().as_secs_f64();
        let ok = match result {
            Ok(ok) => ok,
            Err(e) => {
                eprintln!("xtask: the cost check did not run: {e:#}");
                false
            }
        };
        if !ok {
            eprintln!(
                "xtask: the cost check failed (alone: cargo xtask vm -- ./target/release/rdmsg-bench cost-check)"
            );
        }
        eprintln!("==> [cost] VM run (Linux {two_host_kernel}) {secs:.1} s");
        (ok, secs)
    });

    // The README's collector at ten thousand sensors (the release build the cost check made).
    let collector = (!plan.device_only).then(|| {
        let vm_started = Instant::now();
        let ok = match collector_at_scale(two_host_kernel) {
            Ok((ok, line)) => {
                if !ok {
                    eprintln!(
                        "xtask: the collector at {COLLECTOR_SENSORS} sensors failed: {} (alone: cargo xtask vm -- sh -c 'ulimit -n 65536; ./target/release/collector --sensors {COLLECTOR_SENSORS} --batches 2')",
                        line.as_deref().unwrap_or("no report line")
                    );
                }
                ok
            }
            Err(e) => {
                eprintln!("xtask: the collector at {COLLECTOR_SENSORS} sensors did not run: {e:#}");
                false
            }
        };
        let secs = vm_started.elapsed().as_secs_f64();
        eprintln!("==> [collector] VM run (Linux {two_host_kernel}) {secs:.1} s");
        (ok, secs)
    });

    // The job queue example at scale, a worker killed mid-run.
    let jobq = (!plan.device_only).then(|| {
        let vm_started = Instant::now();
        let ok = match jobq_at_scale(two_host_kernel) {
            Ok((ok, line)) => {
                if !ok {
                    eprintln!(
                        "xtask: the jobq example at scale failed: {} (alone: cargo xtask vm -- {JOBQ_DEMO})",
                        line.as_deref().unwrap_or("no report line")
                    );
                }
                ok
            }
            Err(e) => {
                eprintln!("xtask: the jobq example at scale did not run: {e:#}");
                false
            }
        };
        let secs = vm_started.elapsed().as_secs_f64();
        eprintln!("==> [jobq] VM run (Linux {two_host_kernel}) {secs:.1} s");
        (ok, secs)
    });

    // Several VMs on a switch, with faults: on every kernel the device tests ran on, through
    // the TCP bootstrap on the default kernel and through rdma_cm on the other.
    let cluster_runs: Vec<(Kernel, bool, f64)> = if plan.device_only {
        Vec::new()
    } else {
        plan.kernels
            .iter()
            .map(|&kernel| {
                let vm_started = Instant::now();
                let mut plan = cluster::Plan::small(kernel);
                plan.cm = kernel != Kernel::default_kernel();
                if !plan.cm {
                    // Through the TCP bootstrap, the cut is a flap that sessions resume from.
                    plan = plan.flapping(2);
                }
                let cm = if plan.cm { " --cm" } else { "" };
                let mut result = build_mesh(false).and_then(|()| cluster::run(&plan));
                if matches!(&result, Err(e) if e.to_string().starts_with(cluster::GUEST_PANIC)) {
                    // Once: a second crash fails the run all the same.
                    eprintln!(
                        "==> [cluster] a guest kernel panicked on Linux {kernel} (below rdmsg); running the cluster once more"
                    );
                    result = cluster::run(&plan);
                }
                let secs = vm_started.elapsed().as_secs_f64();
                if let Err(e) = &result {
                    eprintln!(
                        "xtask: the cluster test failed on Linux {kernel} (a larger one alone: cargo xtask cluster --kernel {kernel}{cm}): {e:#}"
                    );
                }
                eprintln!("==> [cluster] VM run (Linux {kernel}, three VMs) {secs:.1} s");
                (kernel, result.is_ok(), secs)
            })
            .collect()
    };

    let mut total = host;
    let mut counts = Vec::new();
    let mut times = Vec::new();
    if !plan.device_only {
        counts.push(format!(
            "host: {} passed, {} failed",
            host.passed, host.failed
        ));
    }
    for r in &runs {
        total.passed += r.tally.passed;
        total.failed += r.tally.failed;
        counts.push(format!(
            "device ({}): {} passed, {} failed",
            r.kernel, r.tally.passed, r.tally.failed
        ));
        times.push(match r.boot_secs {
            Some(boot) => format!(
                "device ({}) {:.1} s, booted in {boot:.1} s",
                r.kernel, r.secs
            ),
            None => format!("device ({}) {:.1} s, did not boot", r.kernel, r.secs),
        });
    }
    if let Some((ok, secs)) = two_host {
        checks.push((format!("two-host ({two_host_kernel} only)"), ok));
        times.push(format!("two-host ({two_host_kernel}) {secs:.1} s"));
    }
    if let Some((ok, secs)) = flap {
        checks.push((format!("flap ({two_host_kernel} only)"), ok));
        times.push(format!("flap ({two_host_kernel}) {secs:.1} s"));
    }
    if let Some((ok, secs)) = cost {
        checks.push((format!("cost ({two_host_kernel} only)"), ok));
        times.push(format!("cost ({two_host_kernel}) {secs:.1} s"));
    }
    if let Some((ok, secs)) = collector {
        checks.push((
            format!("collector {COLLECTOR_SENSORS} ({two_host_kernel} only)"),
            ok,
        ));
        times.push(format!("collector ({two_host_kernel}) {secs:.1} s"));
    }
    if let Some((ok, secs)) = jobq {
        checks.push((format!("jobq ({two_host_kernel} only)"), ok));
        times.push(format!("jobq ({two_host_kernel}) {secs:.1} s"));
    }
    for (kernel, ok, secs) in cluster_runs {
        checks.push((format!("cluster ({kernel})"), ok));
        times.push(format!("cluster ({kernel}) {secs:.1} s"));
    }
    match (&tree_before, worktree::Snapshot::take(&repo)) {
        (Some(before), Some(after)) => {
            let c = worktree::compare(before, &after);
            for l in &c.changed {
                eprintln!("xtask: work tree: {l}; uncommitted before the run already, not counted");
            }
            if !c.new.is_empty() {
                eprintln!(
                    "xtask: the run left {} new entries in `git status` (clean when it started):",
                    c.new.len()
                );
                for l in &c.new {
                    eprintln!("  {l}");
                }
            }
            checks.push(("work tree clean".into(), c.new.is_empty()));
        }
        _ => eprintln!("==> [work tree] not a git work tree (or no git): check skipped"),
    }
    for (name, ok) in &checks {
        if *ok {
            total.passed += 1;
        } else {
            total.failed += 1;
        }
        counts.push(format!("{name}: {}", if *ok { "passed" } else { "failed" }));
    }
    eprintln!("==> {}", counts.join("; "));
    eprintln!("==> step times: {}", step_times.join("; "));
    eprintln!(
        "==> VM runs: {}; total {:.1} s",
        times.join("; "),
        started.elapsed().as_secs_f64()
    );
    println!("{} passed, {} failed", total.passed, total.failed);
    Ok(if total.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The device tests' run on one kernel.
#[derive(Debug)]
struct KernelRun {
    kernel: Kernel,
    tally: Tally,
    /// Seconds the VM ran, boot included (the kernel's first download not).
    secs: f64,
    /// Seconds to a ready rxe0; `None`: the VM did not boot.
    boot_secs: Option<f64>,
    /// The quick start's run in this boot, if it was given one.
    quickstart: Option<QuickstartRun>,
}

/// The README's quick start (built in `target/scratch`) run inside a device-test boot.
#[derive(Debug, Default)]
struct QuickstartRun {
    /// Its exit code; `None`: it did not run (the VM did not boot, or died first).
    code: Option<i32>,
    /// The lines it printed that start with `quickstart:`.
    said: Vec<String>,
    secs: f64,
}

/// Marks the quick start's output in a device-test boot; the line after it gives its exit code.
const QUICKSTART_START: &str = "--- quickstart: ";
const QUICKSTART_EXIT: &str = "RDMSG-QUICKSTART-EXIT: ";

/// Messages of each soak (split halves: each way; bursty consumer: in all) that `cargo xtask
/// test` runs on every kernel, unless `--full-soaks` asks for the tests' own million. A million
/// took 309 s and 463 s of a debug build under emulation (6.1), and put CI over its 45 minutes;
/// a fifth of them crosses every window, credit and CQ wrap the tests check many times over.
const SOAK_MESSAGES: u64 = 200_000;

/// Runs every test binary with `--ignored` in one VM boot on `kernel`, after the quick start's
/// binary if one is given. A VM that does not boot, a binary that dies without a failed test,
/// and a run where no test passed count as failures: a device test never passes by not running.
/// The quick start's exit code is its own result and leaves the device tests' alone.
fn device_tests(
    kernel: Kernel,
    binaries: &[PathBuf],
    quickstart: Option<&Path>,
    full_soaks: bool,
) -> KernelRun {
    let _s = Step::new(
        "device-tests",
        &format!(
            "{} test binaries, device tests only, inside the Soft-RoCE VM on Linux {kernel}{}",
            binaries.len(),
            if quickstart.is_some() {
                ", after the README's quick start"
            } else {
                ""
            }
        ),
    );
    let mut script = String::from("status=0\n");
    if !full_soaks {
        script.push_str(&format!(
            "export RDMSG_SPLIT_MESSAGES={SOAK_MESSAGES} RDMSG_SOAK_MESSAGES={SOAK_MESSAGES}\n"
        ));
    }
    if let Some(bin) = quickstart {
        let rel = bin.strip_prefix(repo_root()).unwrap_or(bin);
        script.push_str(&format!(
            "echo \"{QUICKSTART_START}{name} (the README's quick start, built outside the workspace)\"\ntimeout 300 {bin}\necho \"{QUICKSTART_EXIT}$?\"\n",
            name = rel.display(),
            bin = sh_quote(&bin.to_string_lossy())
        ));
    }
    for bin in binaries {
        let rel = bin.strip_prefix(repo_root()).unwrap_or(bin);
        script.push_str(&format!(
            "echo \"--- {name}\"\ntimeout 600 {bin} --ignored --test-threads=1 --nocapture --color never || status=1\n",
            name = rel.display(),
            bin = sh_quote(&bin.to_string_lossy())
        ));
    }
    script.push_str("exit $status\n");
    let vm = vm::Vm::new(&repo_root(), kernel);
    let mut tally = Tally::default();
    let mut quick = quickstart.map(|_| QuickstartRun::default());
    let mut quick_started = None;
    // The kernel's first download is not part of the run's time.
    let mut vm_started = Instant::now();
    let result = vm.prepare().and_then(|()| {
        vm_started = Instant::now();
        vm.run_script(&script, vm_timeout(), &mut |l| {
            println!("{l}");
            tally.add_line(l);
            let Some(q) = quick.as_mut() else { return };
            if l.starts_with(QUICKSTART_START) {
                quick_started = Some(Instant::now());
            } else if let Some(code) = l.strip_prefix(QUICKSTART_EXIT) {
                q.code = Some(code.trim().parse().unwrap_or(-1));
                q.secs = quick_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
            } else if l.starts_with("quickstart:") && q.code.is_none() {
                q.said.push(l.to_owned());
            }
        })
    });
    let secs = vm_started.elapsed().as_secs_f64();
    let boot_secs = match result {
        Ok(out) => {
            eprintln!(
                "==> [device-tests] Linux {} ({}): VM run {secs:.1} s, booted in {:.1} s",
                kernel, out.release, out.boot_secs
            );
            if out.code != 0 && tally.failed == 0 {
                tally.failed += 1;
                eprintln!("xtask: a device test binary failed without a test failure on Linux {kernel} (crash?)");
            }
            if tally.passed == 0 {
                tally.failed += 1;
                eprintln!("xtask: no device test passed inside the VM on Linux {kernel}: they did not run");
            }
            Some(out.boot_secs)
        }
        Err(e) => {
            eprintln!("xtask: the VM on Linux {kernel} failed: {e:#}");
            tally.failed += 1;
            None
        }
    };
    KernelRun {
        kernel,
        tally,
        secs,
        boot_secs,
        quickstart: quick,
    }
}

/// The binaries whose file names start with one of `names` (all of them when `names` is empty).
fn select_binaries(all: Vec<PathBuf>, names: &[String]) -> Result<Vec<PathBuf>> {
    if names.is_empty() {
        return Ok(all);
    }
    let chosen: Vec<PathBuf> = all
        .into_iter()
        .filter(|b| {
            let file = b.file_name().unwrap_or_default().to_string_lossy();
            names.iter().any(|n| file.starts_with(n.as_str()))
        })
        .collect();
    if chosen.is_empty() {
        bail!("no test binary's name starts with any of {names:?}");
    }
    Ok(chosen)
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

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    fn k(label: &str) -> Kernel {
        Kernel::parse(label).unwrap()
    }

    #[test]
    fn unknown_or_missing_tasks_are_usage_errors() {
        assert!(parse(&args("bogus"), None).unwrap_err().contains("bogus"));
        assert!(parse(&[], None).is_err());
        assert!(parse(&args("test --frobnicate"), None).is_err());
        assert!(parse(&args("vm --kernel 5.10 -- true"), None).is_err());
        assert!(parse(&args("vm --kernel"), None).is_err());
        assert!(
            parse(&args("vm --kernel 6.12"), None).is_err(),
            "no command"
        );
        assert!(parse(&args("demo extra"), None).is_err());
        assert_eq!(parse(&args("--help"), None), Ok(Task::Help));
        assert!(parse(&args("fuzz-merge --kernel 6.1"), None).is_err());
        assert!(parse(&args("package extra"), None).is_err());
    }

    #[test]
    fn corpus_packaging_and_quick_start_tasks() {
        assert_eq!(parse(&args("fuzz-merge"), None), Ok(Task::FuzzMerge));
        assert_eq!(parse(&args("package"), None), Ok(Task::Package));
        assert_eq!(
            parse(&args("quickstart"), None),
            Ok(Task::Quickstart(k("6.1")))
        );
        assert_eq!(
            parse(&args("quickstart --kernel 6.12"), None),
            Ok(Task::Quickstart(k("6.12")))
        );
    }

    #[test]
    fn cluster_options() {
        assert_eq!(
            parse(&args("cluster"), None),
            Ok(Task::Cluster {
                kernel: k("6.1"),
                hosts: None,
                seconds: None,
                sweep: false,
                cm: false,
                flap: None,
            })
        );
        assert_eq!(
            parse(&args("cluster --flap 3"), None),
            Ok(Task::Cluster {
                kernel: k("6.1"),
                hosts: None,
                seconds: None,
                sweep: false,
                cm: false,
                flap: Some(3),
            })
        );
        assert_eq!(
            parse(
                &args("cluster --kernel 6.12 --hosts 6 --seconds=12.5 --sweep --cm"),
                None
            ),
            Ok(Task::Cluster {
                kernel: k("6.12"),
                hosts: Some(6),
                seconds: Some(12.5),
                sweep: true,
                cm: true,
                flap: None,
            })
        );
        for bad in [
            "cluster --flap 0",
            "cluster --flap",
            "cluster --hosts 1",
            "cluster --hosts 17",
            "cluster --seconds 0",
            "cluster x",
        ] {
            assert!(parse(&args(bad), None).is_err(), "{bad}");
        }
    }

    #[test]
    fn vm_takes_a_kernel_then_the_command() {
        let vm = |kernel: &str, cmd: &str| Task::Vm {
            kernel: k(kernel),
            cmd: args(cmd),
            env: vec![],
        };
        assert_eq!(
            parse(&args("vm -- uname -r"), None),
            Ok(vm("6.1", "uname -r"))
        );
        assert_eq!(
            parse(&args("vm --kernel 6.12 -- uname -r"), None),
            Ok(vm("6.12", "uname -r"))
        );
        assert_eq!(
            parse(&args("vm --kernel=6.12 ls --kernel"), None),
            Ok(vm("6.12", "ls --kernel")),
            "options end at the command"
        );
        assert_eq!(
            parse(&args("vm2 --kernel 6.12"), None),
            Ok(Task::Vm2(k("6.12")))
        );
        assert_eq!(parse(&args("demo"), None), Ok(Task::Demo(k("6.1"))));
        assert_eq!(
            parse(&args("bench --kernel 6.12 --quick -- --rounds 3"), None),
            Ok(Task::Bench {
                quick: true,
                kernel: k("6.12"),
                run_args: args("--rounds 3"),
            })
        );
    }

    #[test]
    fn test_runs_on_both_kernels_unless_told() {
        let kernels = |line: &str, env: Option<&str>| match parse(&args(line), env) {
            Ok(Task::Test(plan)) => plan.kernels.iter().map(|k| k.label).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(kernels("test", None), ["6.1", "6.12"]);
        assert_eq!(kernels("test --kernel 6.12", None), ["6.12"]);
        assert_eq!(kernels("test", Some("6.12")), ["6.12"]);
        assert_eq!(kernels("test", Some("6.12, 6.1,6.12")), ["6.1", "6.12"]);
        assert_eq!(
            kernels("test --kernel 6.1", Some("6.12")),
            ["6.1"],
            "the option wins"
        );
        assert!(parse(&args("test"), Some("6.1,4.19")).is_err());
        assert!(parse(&args("test"), Some("")).is_err());
        assert_eq!(
            parse(&args("test --device-only --bins device,soak"), None),
            Ok(Task::Test(TestPlan {
                kernels: vm::KERNELS.to_vec(),
                device_only: true,
                bins: args("device soak"),
                full_soaks: false,
            }))
        );
        assert!(matches!(
            parse(&args("test --full-soaks"), None),
            Ok(Task::Test(TestPlan {
                full_soaks: true,
                device_only: false,
                ..
            }))
        ));
    }

    #[test]
    fn binaries_are_chosen_by_name() {
        let all: Vec<PathBuf> = ["t/device-1", "t/device-2", "t/soak-3", "t/msg-4"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(select_binaries(all.clone(), &[]).unwrap().len(), 4);
        assert_eq!(
            select_binaries(all.clone(), &args("device soak"))
                .unwrap()
                .len(),
            3
        );
        assert!(select_binaries(all, &args("nothing")).is_err());
    }

    #[test]
    fn vm_takes_environment_variables_for_the_guest() {
        assert_eq!(
            parse(
                &args("vm --env RUST_LOG=debug --env=HOME --kernel 6.12 --env A=b=c -- env"),
                None
            ),
            Ok(Task::Vm {
                kernel: k("6.12"),
                cmd: args("env"),
                env: args("RUST_LOG=debug HOME A=b=c"),
            })
        );
        assert_eq!(
            parse(&args("vm ls --env X=1"), None),
            Ok(Task::Vm {
                kernel: k("6.1"),
                cmd: args("ls --env X=1"),
                env: vec![],
            }),
            "options end at the command"
        );
        for bad in [
            "vm --env -- ls",
            "vm --env 1X=2 -- ls",
            "vm --env A-B -- ls",
            "vm --env =v -- ls",
        ] {
            assert!(parse(&args(bad), None).is_err(), "{bad}");
        }
        assert!(
            parse(&args("demo --env A=1"), None).is_err(),
            "only vm takes --env"
        );
    }

    #[test]
    fn the_guest_gets_the_logging_variables_and_what_env_names() {
        let host = |name: &str| match name {
            "RUST_LOG" => Some("rdmsg_transport=debug".to_owned()),
            "HOME" => Some("/root".to_owned()),
            _ => None,
        };
        let (vars, unset) = guest_env(&args("HOME K=v NOPE RUST_LOG=info K=w"), host);
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(pairs, [("HOME", "/root"), ("RUST_LOG", "info"), ("K", "w")]);
        assert_eq!(unset, ["NOPE"]);
        let (vars, unset) = guest_env(&[], host);
        assert_eq!(
            vars,
            [("RUST_LOG".to_owned(), "rdmsg_transport=debug".to_owned())]
        );
        assert!(unset.is_empty());
        assert_eq!(guest_env(&[], |_| None), (vec![], vec![]));
    }

    #[test]
    fn guest_variables_are_quoted_for_the_shell() {
        let vars = [
            ("A".to_owned(), "it's $HOME `id` \"x\"\nline 2".to_owned()),
            ("B".to_owned(), String::new()),
        ];
        let exports = env_exports(&vars);
        assert_eq!(
            exports,
            "export A='it'\\''s $HOME `id` \"x\"\nline 2'\nexport B=''\n"
        );
        // What a shell makes of them: the values, byte for byte.
        if let Ok(out) = Command::new("sh")
            .arg("-c")
            .arg(format!("{exports}printf '%s|%s' \"$A\" \"$B\""))
            .output()
        {
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "it's $HOME `id` \"x\"\nline 2|"
            );
        }
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), "'it'\\''s'");
    }
}
