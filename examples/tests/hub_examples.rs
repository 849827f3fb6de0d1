//! The hub examples as real processes on a real device (rxe0 in the test VM): `collector`
//! with 256 sensors in a second process (and with sensors split over two processes started
//! here), `reqresp` with a few dozen clients. Each prints one `key=value` line, checked
//! here. Ignored on hosts; `cargo xtask test` runs them in the VM.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const COLLECTOR: &str = env!("CARGO_BIN_EXE_collector");
const REQRESP: &str = env!("CARGO_BIN_EXE_reqresp");
const MESH: &str = env!("CARGO_BIN_EXE_mesh");
const TOKIO_SERVER: &str = env!("CARGO_BIN_EXE_tokio_server");
const EPOLL_HUB: &str = env!("CARGO_BIN_EXE_epoll_hub");
const JOBQ: &str = env!("CARGO_BIN_EXE_jobq");

/// Long enough for 256 handshakes and their traffic under emulation (qemu TCG).
const LIMIT: Duration = Duration::from_secs(300);

fn device() {
    std::env::var("RDMSG_DEVICE").expect("device tests need $RDMSG_DEVICE");
}

/// Waits for `child`, killing it after `LIMIT`, and requires success.
fn finish(child: Child, what: &str) -> Output {
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let killer = thread::spawn(move || {
        if done_rx.recv_timeout(LIMIT).is_err() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    });
    let t = Instant::now();
    let out = child.wait_with_output().unwrap();
    let _ = done_tx.send(());
    killer.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed after {:?}: {}\n{text}\n{err}",
        t.elapsed(),
        out.status
    );
    out
}

fn run(bin: &str, args: &[&str]) -> Output {
    let child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, &format!("{bin} {args:?}"))
}

/// The report line starting with `prefix` (the last line of stdout), as key → value.
fn report(out: &Output, prefix: &str) -> HashMap<String, String> {
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(prefix),
        "the output does not end with a {prefix} line:\n{text}"
    );
    println!("stats {last}");
    last[prefix.len()..]
        .split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{kv:?}"));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn num(r: &HashMap<String, String>, key: &str) -> u64 {
    r.get(key)
        .unwrap_or_else(|| panic!("no {key}= in {r:?}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {e}"))
}

/// Checks a collector line for `sensors` connections and what `sensors` sensors send with
/// the default workload (4 batches of 8 samples, an alarm every 4th batch, a Done each).
fn check_collector(r: &HashMap<String, String>, sensors: u64) {
    for key in [
        "connections",
        "server_threads",
        "fds",
        "registered_kib",
        "messages",
        "lost",
        "wakeups",
    ] {
        num(r, key);
    }
    assert_eq!(num(r, "connections"), sensors, "{r:?}");
    assert_eq!(num(r, "server_threads"), 1, "{r:?}");
    assert_eq!(num(r, "lost"), 0, "{r:?}");
    assert_eq!(num(r, "errors"), 0, "{r:?}");
    // One descriptor per connection (its bootstrap stream) and a few of the hub's and the
    // process's own.
    let fds = num(r, "fds");
    assert!(
        fds as f64 <= 1.1 * sensors as f64 + 24.0,
        "{fds} descriptors for {sensors} connections"
    );
    assert_eq!(num(r, "samples"), sensors * 4 * 8, "{r:?}");
    assert_eq!(num(r, "alarms"), sensors, "{r:?}");
    assert_eq!(num(r, "messages"), sensors * (4 * 8 + 1 + 1), "{r:?}");
    // Batches wake the collector once, not once per sample: fewer wake-ups than messages
    // (not one per batch: a sample that spends the collector's last credit for its sensor is
    // solicited too, see `forced_solicited`).
    let wakeups = num(r, "wakeups");
    assert!(wakeups > 0 && wakeups < num(r, "messages"), "{r:?}");
}

#[test]
#[ignore = "device"]
fn collector_256_sensors() {
    device();
    let t = Instant::now();
    let out = run(COLLECTOR, &["--sensors", "256"]);
    println!("stats collector 256 sensors took {:?}", t.elapsed());
    check_collector(&report(&out, "collector: "), 256);
}

/// The collector alone, its sensors in two processes started here (sensors 0-31 and 32-63):
/// the hub serves connections from several processes at once, and the sensors' `Done`
/// messages say what was sent.
#[test]
#[ignore = "device"]
fn collector_with_two_sensor_processes() {
    device();
    let mut server = Command::new(COLLECTOR)
        .args(["serve", "--listen", "127.0.0.1:0", "--sensors", "64"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("not a listening line: {line:?}"))
        .trim()
        .to_owned();
    let sensors: Vec<Child> = ["0", "32"]
        .iter()
        .map(|first| {
            Command::new(COLLECTOR)
                .args([
                    "sensors",
                    "--connect",
                    &addr,
                    "--count",
                    "32",
                    "--first",
                    first,
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for s in sensors {
        let o = finish(s, "sensors");
        let r = report(&o, "sensors: ");
        assert_eq!(num(&r, "sent"), 32 * (4 * 8 + 1 + 1), "{r:?}");
        assert_eq!(num(&r, "threads"), 1, "{r:?}");
    }
    // Its stdout was taken: the rest of it is read here once it has ended.
    let mut end = finish(server, "collector serve");
    std::io::Read::read_to_end(&mut out, &mut end.stdout).unwrap();
    check_collector(&report(&end, "collector: "), 64);
}

#[test]
#[ignore = "device"]
fn reqresp_48_clients() {
    device();
    let t = Instant::now();
    let out = run(REQRESP, &["--clients", "48", "--requests", "40"]);
    println!("stats reqresp 48 clients took {:?}", t.elapsed());
    let r = report(&out, "reqresp: ");
    assert_eq!(num(&r, "clients"), 48, "{r:?}");
    assert_eq!(num(&r, "requests"), 48 * 40, "{r:?}");
    assert_eq!(num(&r, "responses"), 48 * 40, "{r:?}");
    assert_eq!(num(&r, "errors"), 0, "{r:?}");
    assert_eq!(num(&r, "server_threads"), 1, "{r:?}");
    let wakeups = num(&r, "wakeups");
    assert!(wakeups > 0 && wakeups <= 2 * 48 * 40 + 4 * 48, "{r:?}");
}

/// Starts `hosts` mesh processes on one device (at `ip`, ports from `base`); `extra(id)` adds
/// arguments per host.
fn mesh_hosts(
    hosts: u16,
    ip: &str,
    base: u16,
    extra: impl Fn(u16) -> Vec<String>,
) -> Vec<(u16, Child)> {
    let addrs: Vec<String> = (1..=hosts).map(|n| format!("{ip}:{}", base + n)).collect();
    (1..=hosts)
        .map(|n| {
            let child = Command::new(MESH)
                .args([
                    "--id",
                    &n.to_string(),
                    "--hosts",
                    &addrs.join(","),
                    "--seconds",
                    "4",
                ])
                .args(extra(n))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (n, child)
        })
        .collect()
}

fn check_mesh(out: &Output, hosts: u64, lost_peers: u64) -> HashMap<String, String> {
    let r = report(out, "mesh: ");
    assert_eq!(num(&r, "hosts"), hosts, "{r:?}");
    assert_eq!(num(&r, "lost_peers"), lost_peers, "{r:?}");
    assert!(num(&r, "received") > 100, "{r:?}");
    for key in [
        "lost",
        "missing_done",
        "duplicated",
        "reordered",
        "corrupt",
        "unanswered",
        "wrong_answers",
        "bad_frames",
        "errors",
    ] {
        assert_eq!(num(&r, key), 0, "{key}: {r:?}");
    }
    assert_eq!(r["ok"], "1", "{r:?}");
    r
}

#[test]
#[ignore = "device"]
fn mesh_four_hosts_on_one_device() {
    device();
    let t = Instant::now();
    for (n, child) in mesh_hosts(4, "127.0.0.1", 19200, |_| Vec::new()) {
        let out = finish(child, &format!("mesh host {n}"));
        let r = check_mesh(&out, 4, 0);
        println!(
            "stats mesh host {n}: received {} in {} s",
            r["received"], r["secs"]
        );
    }
    println!("stats mesh 4 hosts took {:?}", t.elapsed());
}

#[test]
#[ignore = "device"]
fn mesh_host_killed_mid_run() {
    device();
    mesh_host_killed("127.0.0.1", 19300, &[]);
}

/// The same over rdma_cm: every hub listens and connects through the connection manager on
/// the device's address, and the killed host's connections end with the CM's disconnects.
#[test]
#[ignore = "device"]
fn mesh_host_killed_mid_run_through_the_connection_manager() {
    device();
    let ip = rdmsg_testkit::device_ipv4().to_string();
    mesh_host_killed(&ip, 19400, &["--cm"]);
}

/// Four mesh hosts at `ip`, ports from `base`, with `flags`; the fourth is killed 1.5 s into
/// sending, and every other must report it vanished and be whole otherwise.
fn mesh_host_killed(ip: &str, base: u16, flags: &[&str]) {
    let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
    let mut hosts = mesh_hosts(4, ip, base, |n| {
        let mut args = match n {
            4 => vec!["--die-after".into(), "1.5".into()],
            _ => vec!["--may-lose".into(), "4".into()],
        };
        args.extend(flags.iter().cloned());
        args
    });
    let (_, mut victim) = hosts.pop().unwrap();
    // SIGKILL once it says so: its connections end without a close.
    let mut lines = BufReader::new(victim.stdout.take().unwrap()).lines();
    let said = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("ready-to-die"));
    assert!(said, "the victim never got ready");
    victim.kill().unwrap();
    victim.wait().unwrap();
    for (n, child) in hosts {
        let out = finish(child, &format!("mesh host {n}"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("mesh: peer-lost id=4 ") && text.contains("vanished"),
            "host {n} did not report host 4 as vanished:\n{text}"
        );
        check_mesh(&out, 4, 1);
    }
}

/// The tokio example: 24 async clients of an async listener, 100 typed round trips each, one
/// task per client on the multi-thread runtime.
#[test]
#[ignore = "device"]
fn tokio_server_answers_24_async_clients() {
    device();
    let out = run(TOKIO_SERVER, &["--clients", "24", "--requests", "100"]);
    let r = report(&out, "tokio_server: ");
    assert_eq!(num(&r, "answered"), 2400);
    assert_eq!(num(&r, "errors"), 0);
    // Asleep between requests, woken by each (solicited) one: no busy polling.
    let w = num(&r, "server_wakeups");
    assert!(w > 0 && w <= 2 * 2400, "{r:?}");
}

/// The epoll example: one thread, one epoll set, a hub and a TCP status port; 12 blocking
/// clients with 200 round trips each.
#[test]
#[ignore = "device"]
fn epoll_hub_serves_rdma_clients_beside_a_tcp_listener() {
    device();
    let out = run(EPOLL_HUB, &["--clients", "12", "--requests", "200"]);
    let r = report(&out, "epoll_hub: ");
    assert_eq!(num(&r, "answered"), 2400);
    assert_eq!(num(&r, "status_requests"), 1);
    assert_eq!(num(&r, "errors"), 0);
    // No spinning: every turn of the loop either waited or handled something (a request, a
    // departure, another event, an answer sent late, the status request). A server kept
    // busy by its clients may never need to wait.
    assert_eq!(
        num(&r, "other_events"),
        num(&r, "clients"),
        "one Connected per client, nothing else: {r:?}"
    );
    let handled = num(&r, "answered")
        + 2 * num(&r, "clients")
        + num(&r, "resent")
        + num(&r, "status_requests");
    assert!(
        num(&r, "turns") <= num(&r, "loop_waits") + handled,
        "a turn without work or a wait: {r:?}"
    );
}

/// The job queue example as the README teaches it, in separate processes: a coordinator hub,
/// 6 workers and 3 clients (of 150 jobs each here, 16 to 200,000 numbers, up to 32 in
/// flight: a debug build; `cargo xtask test` runs the release build at 3,000 each), one
/// worker killed with SIGKILL mid-run. The demo checks that every job was answered once and
/// rightly, that the coordinator lost that one worker, and that every other process ended well.
#[test]
#[ignore = "device"]
fn jobq_answers_every_job_once_when_a_worker_is_killed() {
    device();
    let args = ["demo", "--workers", "6", "--clients", "3", "--jobs", "150"];
    // The demo's own limit comes before this test's: it kills its processes, and fails.
    let out = run(
        JOBQ,
        &[&args[..], &["--kill-after", "4", "--limit", "240"]].concat(),
    );
    let r = report(&out, "jobq:");
    assert_eq!(num(&r, "jobs"), 450, "{r:?}");
    assert_eq!(num(&r, "answered"), 450, "{r:?}");
    assert_eq!(num(&r, "wrong"), 0, "{r:?}");
    assert_eq!(num(&r, "workers_lost"), 1, "{r:?}");
}
