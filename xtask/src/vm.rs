//! The Soft-RoCE test VM: Debian's kernel with `rdma_rxe`, a busybox initramfs, the host's root
//! shared read-only over 9p, a writable scratch directory, and `rxe0` on a veth pair.
//!
//! The guest has no network card: the veth pair and its address exist only inside it.

use std::collections::HashSet;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{run, sh_quote, Step};

/// Kernel modules the guest loads, in order; their dependencies are resolved from modules.dep.
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "veth",
    "virtio_net",
    // rxe computes its ICRC with crc32; without the generic implementation `rdma link add`
    // fails with a bare "failed to add".
    "crc32_generic",
    "ib_uverbs",
    "rdma_rxe",
];

/// The device name tests see in `$RDMSG_DEVICE`.
pub const DEVICE: &str = "rxe0";

/// Paths of the cached VM artefacts under `target/vm`, and how this VM is set up.
#[derive(Debug)]
pub struct Vm {
    dir: PathBuf,
    repo: PathBuf,
    /// Name of this VM's scratch directory under `target/vm`.
    scratch: String,
    /// A network card, for VMs that talk to each other; `None`: rxe0 on a private veth pair.
    nic: Option<Nic>,
    smp: u8,
}

/// A virtio network card on a qemu socket network, carrying rxe0.
#[derive(Debug, Clone)]
pub struct Nic {
    /// The `-netdev` backend options after `socket,id=n0,`: `listen=127.0.0.1:P` for the first
    /// VM, `connect=127.0.0.1:P` for the second.
    pub socket: String,
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
}

impl Vm {
    pub fn new(repo: &Path) -> Self {
        Self {
            dir: repo.join("target/vm"),
            repo: repo.to_path_buf(),
            scratch: "scratch".into(),
            nic: None,
            smp: 2,
        }
    }

    /// A VM with its own scratch directory and a network card, `smp` vCPUs.
    pub fn networked(repo: &Path, name: &str, nic: Nic, smp: u8) -> Self {
        Self {
            scratch: format!("scratch-{name}"),
            nic: Some(nic),
            smp,
            ..Self::new(repo)
        }
    }

    /// Fetches and unpacks the kernel (cached), so that VMs started together do not race to.
    pub fn prepare(&self) -> Result<()> {
        self.kernel().map(|_| ())
    }

    /// Downloads and unpacks Debian's kernel once; returns (vmlinuz, modules dir).
    fn kernel(&self) -> Result<(PathBuf, PathBuf)> {
        let root = self.dir.join("kernel");
        let stamp = root.join(".unpacked");
        if !stamp.exists() {
            let _s = Step::new(
                "vm",
                "fetching and unpacking Debian's kernel (first run only)",
            );
            let _ = fs::remove_dir_all(&root);
            let dl = self.dir.join("download");
            fs::create_dir_all(&dl)?;
            let depends = capture("apt-cache", &["depends", "linux-image-amd64"])?;
            let pkg = depends
                .lines()
                .filter_map(|l| l.trim().strip_prefix("Depends: "))
                .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
                .context("apt-cache names no kernel package behind linux-image-amd64 (run `apt-get update`)")?
                .to_owned();
            for entry in fs::read_dir(&dl)? {
                fs::remove_file(entry?.path())?;
            }
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
            run(Command::new("depmod").arg("-b").arg(&root).arg(&version))
                .context("running depmod on the unpacked modules")?;
            fs::write(&stamp, &version)?;
            let _ = fs::remove_dir_all(&dl);
        }
        let version = fs::read_to_string(&stamp)?;
        let vmlinuz = root.join(format!("boot/vmlinuz-{version}"));
        if !vmlinuz.exists() {
            bail!(
                "{} is missing; delete {} to refetch",
                vmlinuz.display(),
                root.display()
            );
        }
        Ok((vmlinuz, root.join("lib/modules").join(version)))
    }

    /// Builds the initramfs: busybox, the modules in load order, and the init script.
    fn initramfs(&self, modules: &Path) -> Result<PathBuf> {
        // Per VM: two VMs starting together each pack their own.
        let tree = self.dir.join(format!("initramfs-{}", self.scratch));
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
            let file = Path::new(rel).file_name().context("module path")?;
            fs::copy(modules.join(rel), tree.join("mods").join(file))?;
            names.push_str(&file.to_string_lossy());
            names.push('\n');
        }
        fs::write(tree.join("mods/order"), names)?;
        let init = tree.join("init");
        fs::write(&init, INIT_SCRIPT)?;
        run(Command::new("chmod").arg("755").arg(&init))?;
        let image = self.dir.join(format!("initramfs-{}.cpio.gz", self.scratch));
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
    pub fn run_script_killable(
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
        let (vmlinuz, modules) = self.kernel()?;
        let initrd = self.initramfs(&modules)?;
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
        let mem = std::env::var("RDMSG_VM_MEM").unwrap_or_else(|_| "4096".into());
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
                    .arg(format!("socket,id=n0,{}", nic.socket))
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
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) => {
                    if line.contains("RDMSG-VM: command start") {
                        in_command = true;
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
            }),
            None => bail!(
                "the VM stopped ({status}) without reporting the command's exit code\nboot log:\n{}",
                boot_log.join("\n")
            ),
        }
    }
}

/// Load order of [`MODULES`]: each module after its dependencies, each once; built-ins skipped.
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
        let file = format!("/{name}.ko");
        if builtin.lines().any(|l| l.ends_with(&file)) {
            continue;
        }
        let path = deps
            .iter()
            .map(|(m, _)| m.as_str())
            .find(|m| m.ends_with(&file) || m.ends_with(&format!("{file}.xz")))
            .with_context(|| {
                format!("kernel module {name} is in neither modules.dep nor modules.builtin")
            })?
            .to_owned();
        visit(&path, &deps, &mut order, &mut seen);
    }
    Ok(order)
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

    #[test]
    fn modules_load_after_their_dependencies() {
        let dir = std::env::temp_dir().join(format!("rdmsg-xtask-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let mut dep = String::from(
            "k/rdma_rxe.ko: k/ib_uverbs.ko k/ib_core.ko k/udp_tunnel.ko\nk/ib_uverbs.ko: k/ib_core.ko\nk/ib_core.ko:\nk/udp_tunnel.ko:\n",
        );
        for m in MODULES
            .iter()
            .filter(|m| !["rdma_rxe", "ib_uverbs", "virtio_pci"].contains(m))
        {
            dep.push_str(&format!("k/{m}.ko:\n"));
        }
        fs::write(dir.join("modules.dep"), dep).unwrap();
        fs::write(
            dir.join("modules.builtin"),
            "kernel/drivers/virtio/virtio_pci.ko\n",
        )
        .unwrap();
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
}
