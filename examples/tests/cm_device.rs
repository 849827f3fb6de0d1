//! Connections the RDMA connection manager sets up, against programs rdmsg did not write:
//! `cm_pingpong` (verbs-core's `CmId` and notify's waiter) against rdma-core's `rdma_server`
//! and `rdma_client` (rdmacm-utils) in both roles, and against itself with a hello in the
//! request's private data, a refusal carried in a reject, solicited-only wake-ups, and a peer
//! killed mid-run. Ignored on hosts; `cargo xtask test` runs them in the VM, where rxe0 sits on
//! a veth pair with an IPv4 address.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const OURS: &str = env!("CARGO_BIN_EXE_cm_pingpong");

/// A port no other test of this run uses (the CM's port space is its own, apart from TCP's).
fn port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 7600 + (std::process::id() % 200) as u16 * 10;
    base + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A server process whose stdout is read line by line on a thread.
struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Server {
    fn start(program: &str, args: &[&str]) -> Self {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"));
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `text`.
    fn wait_for(&mut self, text: &str) {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if self.seen.iter().any(|l| l.contains(text)) {
                return;
            }
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!(
                    "the server never printed {text:?}; it printed {:?}",
                    self.seen
                ),
            }
        }
    }

    /// Waits for the server to exit; its whole output.
    fn finish(mut self) -> (bool, String, String) {
        let until = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                panic!("the server did not exit; it printed {:?}", self.seen);
            }
            thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.seen.push(l);
        }
        (status.success(), self.seen.join("\n"), stderr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new("timeout")
        .arg("60")
        .arg(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a client until the server listens: a request that reaches no listener yet is
/// rejected by the peer's CM ("nothing listens there"), and retried.
fn client_until_listening(program: &str, args: &[&str]) -> Output {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let out = run(program, args);
        let all = text(&out);
        let early = all.contains("nothing listens there")
            || all.contains("ECONNREFUSED")
            || all.contains("Connection refused")
            || all.contains("rdma_connect: ");
        if out.status.success() || !early || Instant::now() > until {
            return out;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn rdma_client_against_our_server() {
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let mut server = Server::start(OURS, &["-p", &port, "-b", &ip]);
    server.wait_for("listening on");
    let out = run("rdma_client", &["-s", &ip, "-p", &port]);
    assert!(out.status.success(), "rdma_client: {}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("rdma_client: end 0"),
        "{}",
        text(&out)
    );
    let (ok, stdout, stderr) = server.finish();
    assert!(ok, "our server failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("a foreign client"), "{stdout}");
    assert!(stdout.contains("1 iters of 16 bytes"), "{stdout}");
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn our_client_against_rdma_server() {
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let server = Server::start("rdma_server", &["-p", &port]);
    let out = client_until_listening(OURS, &["-p", &port, &ip]);
    assert!(out.status.success(), "our client: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("1 iters of 16 bytes"), "{}", text(&out));
    assert!(!stdout.contains("an rdmsg server"), "{}", text(&out));
    let (ok, stdout, stderr) = server.finish();
    assert!(ok, "rdma_server failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("rdma_server: end 0"), "{stdout}");
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn ours_against_ours_with_a_hello_and_solicited_only_wakeups() {
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let common = ["-p", &port, "-n", "500", "-s", "256", "--solicited"];
    let mut server = Server::start(OURS, &[&common[..], &["-b", &ip]].concat());
    server.wait_for("listening on");
    let out = run(OURS, &[&common[..], &["--hello", &ip]].concat());
    assert!(out.status.success(), "our client: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("an rdmsg server"), "{}", text(&out));
    assert!(stdout.contains("500 iters of 256 bytes"), "{}", text(&out));
    let (ok, stdout, stderr) = server.finish();
    assert!(ok, "our server failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("an rdmsg client"), "{stdout}");
    // Both receive queues are armed solicited-only: the run ends only because every message
    // of ours is solicited. The client slept for its answers (each wake-up is an answer or a
    // send completion).
    let wakeups: u64 = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains(" wake-ups, "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .expect("a wake-up line");
    assert!(
        (1..=1000).contains(&wakeups),
        "{wakeups} wake-ups for 500 exchanges"
    );
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn a_disagreeing_hello_is_rejected_with_the_reason_and_the_server_goes_on() {
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let mut server = Server::start(OURS, &["-p", &port, "-b", &ip, "-n", "5", "-s", "64"]);
    server.wait_for("listening on");
    let out = run(OURS, &["-p", &port, "-n", "3", "-s", "64", "--hello", &ip]);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "the server rejected the connection: the server runs 5 exchanges of 64 bytes, \
             the client asked for 3 of 64"
        ),
        "{}",
        text(&out)
    );
    let out = run(OURS, &["-p", &port, "-n", "5", "-s", "64", "--hello", &ip]);
    assert!(out.status.success(), "{}", text(&out));
    let (ok, stdout, stderr) = server.finish();
    assert!(ok, "our server failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("rejected a client"), "{stdout}");
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn nothing_listening_is_a_clear_error() {
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let out = run(OURS, &["-p", &port, "-t", "5", &ip]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing listens there"),
        "{}",
        text(&out)
    );
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn a_killed_client_is_noticed_through_the_connection_manager() {
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let common = ["-p", &port, "-n", "100000000", "-s", "64", "-t", "30"];
    let mut server = Server::start(OURS, &[&common[..], &["-b", &ip]].concat());
    server.wait_for("listening on");
    let mut client = Command::new(OURS)
        .args([&common[..], &["--hello", &ip]].concat())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    server.wait_for("accepted");
    thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    client.kill().unwrap();
    client.wait().unwrap();
    let (ok, stdout, stderr) = server.finish();
    let noticed = killed.elapsed();
    assert!(!ok, "the server should fail:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("the peer disconnected"),
        "{stdout}\n{stderr}"
    );
    println!("killed client noticed by the server after {noticed:?} (CM disconnect)");
    assert!(noticed < Duration::from_secs(5), "{noticed:?}");
}

/// The librpma peer (`examples/c/rpma_peer.c`), compiled once per run with the system's C
/// compiler against Debian's librpma-dev.
fn rpma_peer() -> String {
    static BUILT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = concat!(env!("CARGO_MANIFEST_DIR"), "/c/rpma_peer.c");
            let dir = std::env::temp_dir().join(format!("rdmsg-rpma-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let bin = dir.join("rpma_peer");
            let out = Command::new("cc")
                .args(["-O1", "-Wall", "-o"])
                .arg(&bin)
                .arg(src)
                .args(["-lrpma", "-libverbs"])
                .output()
                .expect("running cc (librpma-dev is installed by cargo xtask setup)");
            assert!(out.status.success(), "compiling {src}: {}", text(&out));
            bin.to_string_lossy().into_owned()
        })
        .clone()
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn a_librpma_client_against_our_server() {
    let peer = rpma_peer();
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let mut server = Server::start(OURS, &["-p", &port, "-b", &ip, "-n", "100", "-s", "64"]);
    server.wait_for("listening on");
    let out = run(&peer, &["client", &ip, &port, "64", "100"]);
    assert!(out.status.success(), "rpma_peer: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("cm_pingpong's hello"), "{}", text(&out));
    assert!(stdout.contains("rpma_peer: end 0"), "{}", text(&out));
    let (ok, stdout, stderr) = server.finish();
    assert!(ok, "our server failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("an rdmsg client"), "{stdout}");
    assert!(stdout.contains("100 iters of 64 bytes"), "{stdout}");
}

#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn our_client_against_a_librpma_server() {
    let peer = rpma_peer();
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let mut server = Server::start(&peer, &["server", &ip, &port, "64", "100"]);
    server.wait_for("listening on");
    let out = run(
        OURS,
        &["-p", &port, "-n", "100", "-s", "64", "--hello", &ip],
    );
    assert!(out.status.success(), "our client: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The librpma server answers with the hello: our client checks every echo.
    assert!(stdout.contains("an rdmsg server"), "{}", text(&out));
    assert!(stdout.contains("100 iters of 64 bytes"), "{}", text(&out));
    let (ok, stdout, stderr) = server.finish();
    assert!(ok, "rpma_peer failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("cm_pingpong's hello"), "{stdout}");
    assert!(stdout.contains("rpma_peer: end 0"), "{stdout}");
}

/// librpma has no solicited flag: its sends never wake a receiver armed solicited-only. The
/// message does arrive (a receiver armed for every completion, as in the test above, gets
/// it); it is the wake-up that never comes.
#[test]
#[ignore = "needs an RDMA device with the connection manager (cargo xtask test runs it in the VM)"]
fn a_librpma_sender_never_wakes_a_solicited_only_receiver() {
    let peer = rpma_peer();
    let ip = rdmsg_testkit::device_ipv4().to_string();
    let port = port().to_string();
    let mut server = Server::start(
        OURS,
        &[
            "-p",
            &port,
            "-b",
            &ip,
            "-n",
            "1",
            "-s",
            "64",
            "--solicited",
            "-t",
            "3",
        ],
    );
    server.wait_for("listening on");
    let mut client = Command::new(&peer)
        // Half a second after the connection: the server is asleep when the message lands.
        .args(["client", &ip, &port, "64", "1", "500"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (ok, stdout, stderr) = server.finish();
    let _ = client.kill();
    let _ = client.wait();
    assert!(!ok, "the server should time out:\n{stdout}\n{stderr}");
    assert!(stdout.contains("accepted"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("after 0 of 1 exchanges")
            && stderr.contains("a peer that does not solicit its sends never wakes it"),
        "{stdout}\n{stderr}"
    );
}
