//! The Soft-RoCE test VM: Debian's kernel with `rdma_rxe`, a busybox initramfs, the host's root
//! shared read-only over 9p, a writable scratch directory, and `rxe0` on a veth pair.
//!
//! The guest has no network card: the veth pair and its address exist only inside it.
//!
//! Two Debian 12 kernels can be booted ([`KERNELS`]): 6.1 (`linux-image-amd64`, the default) and
//! 6.12 (`linux-image-6.12-amd64`, from bookworm-security). Each is cached in its own
//! `target/vm/kernel-<release>` directory and gets its own initramfs.

use std::collections::HashSet;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{is_root, run, sh_quote, Step};

/// Kernel modules the guest loads, in order; their dependencies are resolved from modules.dep.
/// The same names serve 6.1 and 6.12: there `virtio_pci` is built in (skipped), 9p no longer
/// needs `fscache` (modules.dep says so), and the modules are shipped xz-compressed (unpacked
/// on the host, see [`unpack_module`]).
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "veth",
    "virtio_net",
    // tc netem, for the cluster's lossy links.
    "sch_netem",
    // rxe computes its ICRC with crc32; without the generic implementation `rdma link add`
    // fails with a bare "failed to add".
    "crc32_generic",
    "ib_uverbs",
    // The RDMA connection manager for user space (/dev/infiniband/rdma_cm): rdma_ucm, with
    // rdma_cm, ib_cm, iw_cm and configfs as modules.dep orders them.
    "configfs",
    "ib_cm",
    "iw_cm",
    "rdma_cm",
    "rdma_ucm",
    "rdma_rxe",
];

/// The device name tests see in `$RDMSG_DEVICE`.
pub const DEVICE: &str = "rxe0";

/// A Debian kernel the VM can boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    /// What `--kernel` and `RDMSG_KERNELS` call it: `6.1`, `6.12`.
    pub label: &'static str,
    /// The metapackage whose dependency names the image package of the current ABI.
    meta: &'static str,
}

/// The kernels the VM can boot; the first is the default, and `cargo xtask test` runs the
/// device tests on each, in this order.
pub const KERNELS: &[Kernel] = &[
    Kernel {
        label: "6.1",
        meta: "linux-image-amd64",
    },
    Kernel {
        label: "6.12",
        meta: "linux-image-6.12-amd64",
    },
];

impl Kernel {
    /// 6.1, Debian 12's own kernel.
    pub fn default_kernel() -> Self {
        KERNELS[0]
    }

    /// The kernel called `label` (`6.1`, `6.12`).
    pub fn parse(label: &str) -> std::result::Result<Self, String> {
        KERNELS
            .iter()
            .copied()
            .find(|k| k.label == label.trim())
            .ok_or_else(|| {
                let known: Vec<&str> = KERNELS.iter().map(|k| k.label).collect();
                format!("unknown kernel {label:?}; known: {}", known.join(", "))
            })
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label)
    }
}

/// Paths of the cached VM artefacts under `target/vm`, and how this VM is set up.
#[derive(Debug)]
pub struct Vm {
    dir: PathBuf,
    kernel: Kernel,
    repo: PathBuf,
    /// Name of this VM's scratch directory under `target/vm`.
    scratch: String,
    /// A network card, for VMs that talk to each other; `None`: rxe0 on a private veth pair.
    nic: Option<Nic>,
    smp: u8,
    /// Guest memory in MiB (`None`: `$RDMSG_VM_MEM`, else 4096).
    mem: Option<u32>,
}

/// A virtio network card on a network of VMs, carrying rxe0.
#[derive(Debug, Clone)]
pub struct Nic {
    /// The `-netdev` backend and its options (qemu adds `id=n0`): `socket,listen=127.0.0.1:P`
    /// and `socket,connect=127.0.0.1:P` join two VMs, `vde,sock=DIR` plugs one into a
    /// `vde_switch`.
    pub netdev: String,
    /// MAC address of the card.
    pub mac: String,
    /// The guest's address on it, with prefix length (`10.78.0.1/24`).
    pub addr: String,
}

/// Exit code reported for a VM killed from the host.
pub const KILLED: i32 = 137;

/// The result of one command run inside the VM.
#[derive(Debug)]
pub struct VmRun {
    /// Exit code of the command.
    pub code: i32,
    /// Seconds from qemu start to the command starting.
    pub boot_secs: f64,
    /// The kernel's release (`uname -r`).
    pub release: String,
}

impl Vm {
    pub fn new(repo: &Path, kernel: Kernel) -> Self {
        Self {
            dir: repo.join("target/vm"),
            kernel,
            repo: repo.to_path_buf(),
            scratch: "scratch".into(),
            nic: None,
            smp: 2,
            mem: None,
        }
    }

    /// A VM with its own scratch directory and a network card, `smp` vCPUs.
    pub fn networked(repo: &Path, kernel: Kernel, name: &str, nic: Nic, smp: u8) -> Self {
        Self {
            scratch: format!("scratch-{name}"),
            nic: Some(nic),
            smp,
            ..Self::new(repo, kernel)
        }
    }

    /// The same VM with `mib` MiB of memory.
    pub fn with_mem(self, mib: u32) -> Self {
        Self {
            mem: Some(mib),
            ..self
        }
    }

    /// Fetches and unpacks the kernel (cached), so that VMs started together do not race to.
    pub fn prepare(&self) -> Result<()> {
        self.kernel().map(|_| ())
    }

    /// Downloads and unpacks this VM's kernel once, into `target/vm/kernel-<release>`; returns
    /// (vmlinuz, modules dir, release). A newer ABI of the same kernel (after `apt-get update`)
    /// is fetched anew and replaces the older one's directory.
    fn kernel(&self) -> Result<(PathBuf, PathBuf, String)> {
        let pkg = image_package(self.kernel)?;
        let release = pkg
            .strip_prefix("linux-image-")
            .context("kernel package name")?
            .to_owned();
        let root = self.dir.join(format!("kernel-{release}"));
        let stamp = root.join(".unpacked");
        if !stamp.exists() {
            let _s = Step::new(
                "vm",
                &format!(
                    "fetching and unpacking {pkg} (Linux {}, first run only)",
                    self.kernel
                ),
            );
            let _ = fs::remove_dir_all(&root);
            // Older ABIs of this kernel, and the single `kernel` directory of earlier xtasks.
            let _ = fs::remove_dir_all(self.dir.join("kernel"));
            if let Ok(entries) = fs::read_dir(&self.dir) {
                for dir in entries.filter_map(|e| e.ok().map(|e| e.path())) {
                    let label = fs::read_to_string(dir.join(".label")).unwrap_or_default();
                    if label == self.kernel.label {
                        let _ = fs::remove_dir_all(&dir);
                    }
                }
            }
            let dl = self.dir.join(format!("download-{}", self.kernel));
            let _ = fs::remove_dir_all(&dl);
            fs::create_dir_all(&dl)?;
            run(Command::new("apt-get")
                .args(["download", "-q", &pkg])
                .current_dir(&dl))
            .with_context(|| format!("downloading {pkg}"))?;
            let deb = fs::read_dir(&dl)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| p.extension().is_some_and(|e| e == "deb"))
                .context("apt-get download produced no .deb")?;
            run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))
                .context("unpacking the kernel package")?;
            let version = only_child(&root.join("lib/modules"))?;
            if version != release {
                bail!("{pkg} holds modules for {version}, not {release}");
            }
            run(Command::new("depmod").arg("-b").arg(&root).arg(&version))
                .context("running depmod on the unpacked modules")?;
            fs::write(root.join(".label"), self.kernel.label)?;
            fs::write(&stamp, &version)?;
            let _ = fs::remove_dir_all(&dl);
        }
        let vmlinuz = root.join(format!("boot/vmlinuz-{release}"));
        if !vmlinuz.exists() {
            bail!(
                "{} is missing; delete {} to refetch",
                vmlinuz.display(),
                root.display()
            );
        }
        let modules = root.join("lib/modules").join(&release);
        Ok((vmlinuz, modules, release))
    }

    /// Builds the initramfs: busybox, the modules in load order, and the init script.
    fn initramfs(&self, modules: &Path, release: &str) -> Result<PathBuf> {
        // Per kernel (its own modules) and per VM (two VMs starting together each pack their own).
        let name = format!("initramfs-{release}-{}", self.scratch);
        let tree = self.dir.join(&name);
        let _ = fs::remove_dir_all(&tree);
        for d in ["bin", "mods", "proc", "sys", "dev", "host", "tmp"] {
            fs::create_dir_all(tree.join(d))?;
        }
        let busybox = Path::new("/bin/busybox");
        if !busybox.exists() {
            bail!("/bin/busybox is missing: run `cargo xtask setup` (package busybox-static)");
        }
        fs::copy(busybox, tree.join("bin/busybox"))?;
        let order = module_order(modules)?;
        let mut names = String::new();
        for rel in &order {
            let file = unpack_module(&modules.join(rel), &tree.join("mods"))?;
            names.push_str(&file);
            names.push('\n');
        }
        fs::write(tree.join("mods/order"), names)?;
        let init = tree.join("init");
        fs::write(&init, INIT_SCRIPT)?;
        run(Command::new("chmod").arg("755").arg(&init))?;
        let image = self.dir.join(format!("{name}.cpio.gz"));
        run(Command::new("sh").arg("-c").arg(format!(
            "cd {} && find . | cpio -o -H newc --quiet | gzip -1 > {}",
            sh_quote(&tree.to_string_lossy()),
            sh_quote(&image.to_string_lossy())
        )))
        .context("packing the initramfs (needs cpio and gzip)")?;
        Ok(image)
    }

    /// Boots the VM, runs `script` (a shell script) as root in the repository directory with
    /// `$RDMSG_DEVICE` set, streams its output through `on_line`, and returns its exit code.
    pub fn run_script(
        &self,
        script: &str,
        timeout: Duration,
        on_line: &mut dyn FnMut(&str),
    ) -> Result<VmRun> {
        self.run_script_killable(script, timeout, on_line, &AtomicBool::new(false))
    }

    /// [`Vm::run_script`], and qemu is killed (the guest dies without a word on its network)
    /// as soon as `kill` is set; the run then reports [`KILLED`].
    ///
    /// A guest kernel that dies while booting, before the command starts (an oops or a
    /// panic in its boot log: under TCG, 6.12 has been seen to trap in `sched_clock_tick`
    /// while it patches its own text), ran nothing of ours: the VM is booted once more
    /// (said on stderr) rather than failing the run.
    pub fn run_script_killable(
        &self,
        script: &str,
        timeout: Duration,
        on_line: &mut dyn FnMut(&str),
        kill: &AtomicBool,
    ) -> Result<VmRun> {
        match self.boot_and_run(script, timeout, on_line, kill) {
            Err(e) if e.is::<DiedBooting>() => {
                eprintln!(
                    "xtask: {e:#}
xtask: booting the VM once more"
                );
                self.boot_and_run(script, timeout, on_line, kill)
            }
            other => other,
        }
    }

    fn boot_and_run(
        &self,
        script: &str,
        timeout: Duration,
        on_line: &mut dyn FnMut(&str),
        kill: &AtomicBool,
    ) -> Result<VmRun> {
        for tool in ["qemu-system-x86_64", "cpio", "depmod", "dpkg"] {
            if !which(tool) {
                bail!("`{tool}` not found: run `cargo xtask setup`");
            }
        }
        let (vmlinuz, modules, release) = self.kernel()?;
        let initrd = self.initramfs(&modules, &release)?;
        let scratch = self.dir.join(&self.scratch);
        let _ = fs::remove_dir_all(&scratch);
        fs::create_dir_all(&scratch)?;
        let scratch_abs = fs::canonicalize(&scratch)?;
        let repo_abs = fs::canonicalize(&self.repo)?;
        fs::write(
            scratch.join("cmd.sh"),
            format!(
                "export RDMSG_DEVICE={DEVICE} HOME=/dev/shm TMPDIR=/dev/shm PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
                 export RDMSG_SCRATCH={scratch}\ncd {repo} || exit 97\n{script}\n",
                scratch = sh_quote(&scratch_abs.to_string_lossy()),
                repo = sh_quote(&repo_abs.to_string_lossy()),
            ),
        )?;
        let accel = std::env::var("RDMSG_VM_ACCEL").unwrap_or_else(|_| "tcg,thread=multi".into());
        let mem = match self.mem {
            Some(mib) => mib.to_string(),
            None => std::env::var("RDMSG_VM_MEM").unwrap_or_else(|_| "4096".into()),
        };
        let mut cmd = Command::new("qemu-system-x86_64");
        let smp = self.smp.to_string();
        cmd.args(["-accel", &accel, "-cpu", "max", "-smp", &smp, "-m", &mem])
            .args([
                "-display", "none", "-vga", "none", "-monitor", "none", "-serial", "stdio",
            ])
            .arg("-no-reboot");
        let mut net_param = String::new();
        match &self.nic {
            None => {
                cmd.args(["-nic", "none"]);
            }
            Some(nic) => {
                cmd.arg("-netdev")
                    .arg(format!("{},id=n0", nic.netdev))
                    .arg("-device")
                    .arg(format!("virtio-net-pci,netdev=n0,mac={}", nic.mac));
                net_param = format!(" rdmsg.net={}", nic.addr);
            }
        }
        cmd
            .arg("-kernel")
            .arg(&vmlinuz)
            .arg("-initrd")
            .arg(&initrd)
            .arg("-append")
            // Under TCG the kernel finds the vCPUs' TSCs "unsynchronized" and falls back to the
            // HPET, whose every read is an emulated MMIO access: clock_gettime then costs
            // microseconds and dominates any program that looks at the time. qemu derives all
            // vCPUs' TSCs from one host clock, so they are in fact consistent; real machines
            // use the TSC too.
            .arg(format!(
                "console=ttyS0 quiet loglevel=3 panic=-1 tsc=reliable clocksource=tsc rdmsg.scratch={}{net_param}",
                scratch_abs.display()
            ))
            .arg("-virtfs")
            .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=scratch,security_model=none,multidevs=remap",
                scratch_abs.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = cmd.spawn().context("starting qemu-system-x86_64")?;
        let (tx, rx) = mpsc::channel::<Option<String>>();
        let stdout = child.stdout.take().context("qemu stdout")?;
        let stderr = child.stderr.take().context("qemu stderr")?;
        for (stream, tx) in [
            (
                Box::new(stdout) as Box<dyn std::io::Read + Send>,
                tx.clone(),
            ),
            (Box::new(stderr), tx),
        ] {
            std::thread::spawn(move || {
                for line in BufReader::new(stream).split(b'\n') {
                    let Ok(line) = line else { break };
                    let text = String::from_utf8_lossy(&line)
                        .trim_end_matches('\r')
                        .to_owned();
                    if tx.send(Some(text)).is_err() {
                        return;
                    }
                }
                let _ = tx.send(None);
            });
        }
        let mut boot_log = Vec::new();
        let mut in_command = false;
        let mut reached_command = false;
        let mut boot_secs = 0.0;
        let mut failed_step = None;
        let mut open_streams = 2;
        let deadline = started + timeout;
        while open_streams > 0 {
            if kill.load(Ordering::SeqCst) {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(VmRun {
                    code: KILLED,
                    boot_secs,
                    release,
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) => {
                    if line.contains("RDMSG-VM: command start") {
                        in_command = true;
                        reached_command = true;
                        boot_secs = started.elapsed().as_secs_f64();
                        continue;
                    }
                    if line.contains("RDMSG-VM: command end") {
                        in_command = false;
                        continue;
                    }
                    if let Some(step) = line.split("RDMSG-VM-FAIL: ").nth(1) {
                        failed_step = Some(step.to_owned());
                    }
                    if in_command {
                        on_line(&line);
                    } else {
                        boot_log.push(line);
                    }
                }
                Ok(None) => open_streams -= 1,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!(
                        "the VM did not finish within {timeout:?}; killed it (boot log:\n{})",
                        boot_log.join("\n")
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let status = child.wait()?;
        if let Some(step) = failed_step {
            bail!(
                "VM setup failed at step: {step}\nboot log:\n{}",
                boot_log.join("\n")
            );
        }
        let code_file = scratch.join("exit_code");
        let code = fs::read_to_string(&code_file)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        match code {
            Some(code) => Ok(VmRun {
                code,
                boot_secs,
                release,
            }),
            None if !reached_command
                && failed_step.is_none()
                && boot_log
                    .iter()
                    .any(|l| l.contains("Oops:") || l.contains("Kernel panic")) =>
            {
                Err(DiedBooting {
                    release,
                    log: boot_log.join("\n"),
                }
                .into())
            }
            None => bail!(
                "the VM stopped ({status}) without reporting the command's exit code\nboot log:\n{}",
                boot_log.join("\n")
            ),
        }
    }
}

/// The guest kernel died while booting, before the command started.
#[derive(Debug)]
struct DiedBooting {
    release: String,
    log: String,
}

impl std::fmt::Display for DiedBooting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the VM's kernel ({}) died while booting, before the command started; boot log:\n{}",
            self.release, self.log
        )
    }
}

impl std::error::Error for DiedBooting {}

/// Load order of [`MODULES`]: each module after its dependencies, each once; built-ins skipped.
/// Paths are relative to the modules directory, as modules.dep gives them (`.ko` or compressed).
fn module_order(modules: &Path) -> Result<Vec<String>> {
    let dep = fs::read_to_string(modules.join("modules.dep")).context("reading modules.dep")?;
    let builtin = fs::read_to_string(modules.join("modules.builtin")).unwrap_or_default();
    let deps: Vec<(String, Vec<String>)> = dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(m, d)| {
            (
                m.to_owned(),
                d.split_whitespace().map(str::to_owned).collect(),
            )
        })
        .collect();
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    fn visit(
        m: &str,
        deps: &[(String, Vec<String>)],
        order: &mut Vec<String>,
        seen: &mut HashSet<String>,
    ) {
        if !seen.insert(m.to_owned()) {
            return;
        }
        if let Some((_, ds)) = deps.iter().find(|(name, _)| name == m) {
            // modules.dep lists the modules a module needs, the ones loaded last first.
            for d in ds.iter().rev() {
                visit(d, deps, order, seen);
            }
        }
        order.push(m.to_owned());
    }
    for name in MODULES {
        let name = name.replace('-', "_");
        if builtin.lines().any(|l| module_name(l) == name) {
            continue;
        }
        let path = deps
            .iter()
            .map(|(m, _)| m.as_str())
            .find(|m| module_name(m) == name)
            .with_context(|| {
                format!("kernel module {name} is in neither modules.dep nor modules.builtin")
            })?
            .to_owned();
        visit(&path, &deps, &mut order, &mut seen);
    }
    Ok(order)
}

/// Compressed module suffixes, and the tool that unpacks each.
const COMPRESSED: &[(&str, &str)] = &[(".ko.xz", "xz"), (".ko.zst", "zstd"), (".ko.gz", "gzip")];

/// A module's name from its path in modules.dep or modules.builtin, as the kernel spells it
/// (`kernel/arch/x86/crypto/crc32-pclmul.ko.xz` is `crc32_pclmul`).
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = COMPRESSED
        .iter()
        .map(|(ext, _)| *ext)
        .chain([".ko"])
        .find_map(|ext| file.strip_suffix(ext))
        .unwrap_or(file);
    stem.replace('-', "_")
}

/// Copies module `src` into `dir` as a plain `.ko`, decompressing it if the kernel ships it
/// compressed (6.12's are `.ko.xz`); returns the file name. Busybox 1.35's insmod would unpack
/// xz itself, but not zstd, and unpacking on the host spares the emulated guest the work.
fn unpack_module(src: &Path, dir: &Path) -> Result<String> {
    let file = src
        .file_name()
        .context("module path")?
        .to_string_lossy()
        .into_owned();
    let Some((ext, tool)) = COMPRESSED.iter().find(|(ext, _)| file.ends_with(ext)) else {
        fs::copy(src, dir.join(&file))?;
        return Ok(file);
    };
    let plain = format!("{}.ko", &file[..file.len() - ext.len()]);
    let out = Command::new(tool)
        .arg("-dc")
        .arg(src)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {tool} to unpack {file} (run `cargo xtask setup`)"))?;
    if !out.status.success() || out.stdout.is_empty() {
        bail!("{tool} -dc {} failed ({})", src.display(), out.status);
    }
    fs::write(dir.join(&plain), out.stdout)?;
    Ok(plain)
}

/// The image package behind `kernel`'s metapackage (`linux-image-6.12.117+deb12-amd64`). If apt
/// knows no candidate for the metapackage, runs `apt-get update` (once per xtask run, as root)
/// and asks again.
fn image_package(kernel: Kernel) -> Result<String> {
    static UPDATED: Mutex<bool> = Mutex::new(false);
    let ask = || -> Result<Option<String>> {
        let depends = capture("apt-cache", &["depends", kernel.meta])?;
        Ok(image_dependency(&depends))
    };
    if let Some(pkg) = ask()? {
        return Ok(pkg);
    }
    let mut updated = UPDATED.lock().unwrap_or_else(|e| e.into_inner());
    if !*updated {
        if !is_root() {
            bail!(
                "apt-cache knows no candidate for {} (Linux {kernel}); as root, run:\n  apt-get update",
                kernel.meta
            );
        }
        let _s = Step::new(
            "vm",
            &format!("apt-get update: apt knows no candidate for {}", kernel.meta),
        );
        *updated = true;
        run(Command::new("apt-get").args(["update", "-q"])).context("apt-get update")?;
    }
    ask()?.with_context(|| {
        format!(
            "apt-cache names no kernel package behind {} even after apt-get update \
             (is bookworm-security in /etc/apt/sources.list?)",
            kernel.meta
        )
    })
}

/// The `linux-image-<release>` package among `apt-cache depends` output's dependencies.
fn image_dependency(depends: &str) -> Option<String> {
    depends
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .map(str::to_owned)
}

fn only_child(dir: &Path) -> Result<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    names.sort();
    names
        .pop()
        .with_context(|| format!("{} is empty", dir.display()))
}

fn capture(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(tool).is_file()))
}

/// The guest's /init: load modules, mount the host, bring up rxe0, run the command, power off.
/// Each step that can fail says which one it was (`RDMSG-VM-FAIL: <step>`).
const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "RDMSG-VM-FAIL: $*"; poweroff -f; }
mount -t proc proc /proc && mount -t sysfs sys /sys && mount -t devtmpfs dev /dev || fail "mounting /proc, /sys, /dev"
for m in $(cat /mods/order); do insmod "/mods/$m" || fail "loading kernel module $m"; done
scratch=$(sed -n 's/.*rdmsg\.scratch=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /host || fail "mounting the host root over 9p"
H=/host
mount -t proc proc $H/proc && mount -t sysfs sys $H/sys && mount -t devtmpfs dev $H/dev || fail "mounting /proc, /sys, /dev in the host root"
mkdir -p $H/dev/shm $H/dev/pts; mount -t tmpfs shm $H/dev/shm && mount -t devpts pts $H/dev/pts || fail "mounting /dev/shm, /dev/pts"
# A writable /tmp, unless the repository itself lives under the host's /tmp (then TMPDIR, set
# to /dev/shm for the command, is the writable temporary directory).
case "$scratch" in /tmp/*) ;; *) mount -t tmpfs tmp $H/tmp || fail "mounting /tmp";; esac
mount -t tmpfs run $H/run 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 scratch "$H$scratch" || fail "mounting the scratch directory at $scratch"
ip() { chroot $H /usr/sbin/ip "$@"; }
ip link set lo up || fail "bringing up lo"
net=$(sed -n 's/.*rdmsg\.net=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$net" ]; then
  # A network card shared with another VM: rxe0 on it.
  ip addr add "$net" dev eth0 || fail "addressing eth0"
  ip link set eth0 up || fail "bringing up eth0"
  dev=eth0
else
  ip link add veth0 type veth peer name veth1 || fail "creating veth0/veth1"
  ip addr add 10.77.0.1/24 dev veth0 || fail "addressing veth0"
  ip link set veth0 up && ip link set veth1 up || fail "bringing up veth0/veth1"
  dev=veth0
fi
chroot $H /usr/bin/rdma link add rxe0 type rxe netdev $dev || fail "rdma link add rxe0 on $dev (is crc32_generic loaded?)"
i=0
until chroot $H /usr/bin/ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE; do
  i=$((i+1)); [ $i -gt 100 ] && fail "waiting for rxe0 port 1 to become active"; usleep 100000
done
echo "RDMSG-VM: command start"
chroot $H /bin/sh "$scratch/cmd.sh"
code=$?
echo "RDMSG-VM: command end"
echo $code > "$H$scratch/exit_code"
sync
poweroff -f
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory holding `modules.dep` and `modules.builtin`.
    fn modules_dir(tag: &str, dep: &str, builtin: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rdmsg-xtask-{tag}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("modules.dep"), dep).unwrap();
        fs::write(dir.join("modules.builtin"), builtin).unwrap();
        dir
    }

    #[test]
    fn modules_load_after_their_dependencies() {
        let mut dep = String::from(
            "k/rdma_rxe.ko: k/ib_uverbs.ko k/ib_core.ko k/udp_tunnel.ko\nk/ib_uverbs.ko: k/ib_core.ko\nk/ib_core.ko:\nk/udp_tunnel.ko:\n",
        );
        for m in MODULES
            .iter()
            .filter(|m| !["rdma_rxe", "ib_uverbs", "virtio_pci"].contains(m))
        {
            dep.push_str(&format!("k/{m}.ko:\n"));
        }
        let dir = modules_dir("61", &dep, "kernel/drivers/virtio/virtio_pci.ko\n");
        let order = module_order(&dir).unwrap();
        let pos = |m: &str| order.iter().position(|o| o == m).unwrap();
        assert!(pos("k/ib_core.ko") < pos("k/ib_uverbs.ko"));
        assert!(pos("k/ib_uverbs.ko") < pos("k/rdma_rxe.ko"));
        assert!(pos("k/udp_tunnel.ko") < pos("k/rdma_rxe.ko"));
        assert!(
            !order.iter().any(|o| o.contains("virtio_pci")),
            "built-ins are skipped"
        );
        assert_eq!(
            order.len(),
            order.iter().collect::<HashSet<_>>().len(),
            "each once"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    /// 6.12's layout: xz-compressed modules, virtio_pci built in, crc32_generic next to
    /// crc32c_generic and crc32-pclmul (which must not be mistaken for it).
    #[test]
    fn compressed_modules_are_found_by_name() {
        let mut dep = String::from(
            "kernel/arch/x86/crypto/crc32-pclmul.ko.xz:\n\
             kernel/crypto/crc32c_generic.ko.xz:\n\
             kernel/crypto/crc32_generic.ko.xz:\n\
             kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz: kernel/drivers/infiniband/core/ib_uverbs.ko.xz kernel/drivers/infiniband/core/ib_core.ko.xz\n\
             kernel/drivers/infiniband/core/ib_uverbs.ko.xz: kernel/drivers/infiniband/core/ib_core.ko.xz\n\
             kernel/drivers/infiniband/core/ib_core.ko.xz:\n",
        );
        for m in MODULES
            .iter()
            .filter(|m| !["rdma_rxe", "ib_uverbs", "virtio_pci", "crc32_generic"].contains(m))
        {
            dep.push_str(&format!("kernel/x/{m}.ko.xz:\n"));
        }
        let dir = modules_dir(
            "612",
            &dep,
            "kernel/lib/crc32.ko\nkernel/drivers/virtio/virtio_pci.ko\n",
        );
        let order = module_order(&dir).unwrap();
        assert!(order.contains(&"kernel/crypto/crc32_generic.ko.xz".to_owned()));
        assert!(!order
            .iter()
            .any(|o| o.contains("crc32c") || o.contains("pclmul")));
        assert!(!order.iter().any(|o| o.contains("virtio_pci")));
        assert_eq!(
            order.last().map(String::as_str),
            Some("kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz")
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_module_is_named() {
        let dir = modules_dir("missing", "k/veth.ko:\n", "");
        let err = module_order(&dir).unwrap_err().to_string();
        assert!(err.contains("virtio_pci"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn module_names_as_the_kernel_spells_them() {
        assert_eq!(
            module_name("kernel/crypto/crc32_generic.ko"),
            "crc32_generic"
        );
        assert_eq!(
            module_name("kernel/arch/x86/crypto/crc32-pclmul.ko.xz"),
            "crc32_pclmul"
        );
        assert_eq!(module_name("k/9pnet_virtio.ko.zst"), "9pnet_virtio");
    }

    #[test]
    fn xz_modules_are_unpacked() {
        if !which("xz") {
            return;
        }
        let dir = std::env::temp_dir().join(format!("rdmsg-xtask-xz-{}", std::process::id()));
        fs::create_dir_all(dir.join("out")).unwrap();
        fs::write(dir.join("m.ko"), b"\x7fELF module").unwrap();
        run(Command::new("xz").arg(dir.join("m.ko"))).unwrap();
        let name = unpack_module(&dir.join("m.ko.xz"), &dir.join("out")).unwrap();
        assert_eq!(name, "m.ko");
        assert_eq!(fs::read(dir.join("out/m.ko")).unwrap(), b"\x7fELF module");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn apt_cache_depends_names_the_image() {
        let out = "linux-image-6.12-amd64\n  Depends: linux-image-6.12.117+deb12-amd64\n";
        assert_eq!(
            image_dependency(out).as_deref(),
            Some("linux-image-6.12.117+deb12-amd64")
        );
        assert_eq!(image_dependency(""), None);
    }

    #[test]
    fn kernels_by_label() {
        assert_eq!(
            Kernel::parse("6.12").unwrap().meta,
            "linux-image-6.12-amd64"
        );
        assert_eq!(Kernel::parse("6.1").unwrap(), Kernel::default_kernel());
        assert!(Kernel::parse("5.10").unwrap_err().contains("6.1, 6.12"));
    }
}
