//! The examples against real processes on a real device (rxe0 in the test VM): our
//! `rc_pingpong` against rdma-core's `ibv_rc_pingpong` in both roles and both modes, and peers
//! killed with SIGKILL mid-stream. Ignored on hosts; `cargo xtask test` runs them in the VM.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rdmsg::transport::{Config, Endpoint, Error, Failure};

const OURS: &str = env!("CARGO_BIN_EXE_rc_pingpong");
const STREAM: &str = env!("CARGO_BIN_EXE_stream");
const THEIRS: &str = "ibv_rc_pingpong";

fn device() -> String {
    std::env::var("RDMSG_DEVICE").expect("device tests need $RDMSG_DEVICE")
}

/// The RoCE v2 GID index our endpoint picks, to hand to `ibv_rc_pingpong -g`.
fn gid_index() -> u8 {
    let ep = Endpoint::open_default().expect("device");
    ep.gid_index().expect("a RoCE v2 GID")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether something listens on TCP `port` (read from /proc, without connecting, which would
/// use up a single-accept server).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", cols[1]).ends_with(&want) && cols[3] == "0A"
            })
    })
}

fn wait_listening(port: u16, server: &mut Child) {
    let until = Instant::now() + Duration::from_secs(20);
    while !listening(port) {
        if let Ok(Some(status)) = server.try_wait() {
            panic!("the server exited before listening: {status}");
        }
        assert!(
            Instant::now() < until,
            "the server never listened on {port}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

fn finish(child: Child, what: &str) -> Output {
    let pid = child.id();
    let killer = thread::spawn(move || {
        thread::sleep(Duration::from_secs(60));
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    });
    let out = child.wait_with_output().unwrap();
    drop(killer);
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed: {}\n{text}\n{err}",
        out.status
    );
    assert!(
        text.contains("iters in"),
        "{what} did not finish:\n{text}\n{err}"
    );
    out
}

fn pingpong(server_bin: &str, client_bin: &str, extra: &[&str]) {
    let port = free_port().to_string();
    let gid = gid_index().to_string();
    let dev = device();
    let mut args: Vec<&str> = vec!["-d", &dev, "-g", &gid, "-p", &port, "-n", "200"];
    args.extend(extra);
    let spawn = |bin: &str, server: Option<&str>| {
        let mut cmd = Command::new(bin);
        cmd.args(&args);
        if let Some(s) = server {
            cmd.arg(s);
        }
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut server = spawn(server_bin, None);
    wait_listening(port.parse().unwrap(), &mut server);
    let client = spawn(client_bin, Some("127.0.0.1"));
    let c = finish(client, &format!("client {client_bin} {extra:?}"));
    let s = finish(server, &format!("server {server_bin} {extra:?}"));
    for (who, out) in [("server", &s), ("client", &c)] {
        let text = String::from_utf8_lossy(&out.stdout);
        let last = text.lines().rfind(|l| l.contains("iters in")).unwrap();
        println!("stats pingpong {server_bin} <- {client_bin} {extra:?} {who}: {last}");
    }
}

#[test]
#[ignore = "device"]
fn interop_our_server_their_client_polling() {
    pingpong(OURS, THEIRS, &[]);
}

#[test]
#[ignore = "device"]
fn interop_our_server_their_client_events() {
    pingpong(OURS, THEIRS, &["-e"]);
}

#[test]
#[ignore = "device"]
fn interop_their_server_our_client_polling() {
    pingpong(THEIRS, OURS, &[]);
}

#[test]
#[ignore = "device"]
fn interop_their_server_our_client_events_small_inline() {
    pingpong(THEIRS, OURS, &["-e", "-s", "32"]);
}

#[test]
#[ignore = "device"]
fn ours_against_ours_events() {
    pingpong(OURS, OURS, &["-e", "-s", "1024"]);
}

/// Reads the child's stdout until a line starting with `prefix` appears.
fn wait_for_line(child: &mut Child, prefix: &str) -> BufReader<std::process::ChildStdout> {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "child ended before {prefix:?}"
        );
        if line.starts_with(prefix) {
            return out;
        }
    }
}

fn sigkill(child: &mut Child) -> Instant {
    let t = Instant::now();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    t
}

/// A sender process killed mid-stream: the receiver, asleep solicited-only, gets a typed
/// error within 2 s and every receive buffer comes back.
#[test]
#[ignore = "device"]
fn killed_sender_is_reported_to_the_receiver() {
    let ep = Endpoint::open_default().unwrap();
    let listener = ep.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut child = Command::new(STREAM)
        .args(["send", &addr, "100000000", "64"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut conn = listener.accept(&Config::default()).unwrap();
    for _ in 0..2_000 {
        conn.recv_timeout(Some(Duration::from_secs(10)))
            .unwrap()
            .expect("message");
    }
    let killed = sigkill(&mut child);
    let err = loop {
        match conn.recv_timeout(Some(Duration::from_secs(5))) {
            Ok(Some(_)) => continue, // what was already on its way
            Ok(None) => panic!("no error within 5 s of the kill"),
            Err(e) => break e,
        }
    };
    let latency = killed.elapsed();
    println!("stats killed sender: receiver noticed after {latency:?}: {err}");
    assert!(
        matches!(err, Error::Connection(Failure::PeerVanished)),
        "{err:?}"
    );
    assert!(latency < Duration::from_secs(2), "{latency:?}");
    let pool = conn.pool_stats();
    assert_eq!((pool.posted, pool.lent), (0, 0), "{pool:?}");
}

/// A receiver process killed mid-stream: the sender gets a typed error within 2 s.
#[test]
#[ignore = "device"]
fn killed_receiver_is_reported_to_the_sender() {
    let port = free_port();
    let mut child = Command::new(STREAM)
        .args(["recv", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let _out = wait_for_line(&mut child, "listening");
    let ep = Endpoint::open_default().unwrap();
    let mut conn = ep.connect(("127.0.0.1", port), &Config::default()).unwrap();
    let payload = [0u8; 64];
    let mut seq: u64 = 0;
    let mut send = |conn: &mut rdmsg::transport::Connection| {
        let mut p = payload;
        p[..8].copy_from_slice(&seq.to_le_bytes());
        seq += 1;
        conn.send(&p, seq % 64 == 0)
    };
    for _ in 0..2_000 {
        send(&mut conn).unwrap();
    }
    let killed = sigkill(&mut child);
    let err = loop {
        if let Err(e) = send(&mut conn) {
            break e;
        }
        assert!(killed.elapsed() < Duration::from_secs(10), "still sending");
    };
    let latency = killed.elapsed();
    println!("stats killed receiver: sender noticed after {latency:?}: {err}");
    assert!(
        matches!(
            err,
            Error::Connection(Failure::PeerVanished | Failure::Completion { .. })
        ),
        "{err:?}"
    );
    assert!(latency < Duration::from_secs(2), "{latency:?}");
}
