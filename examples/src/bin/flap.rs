//! A session that survives link flaps: the client sends numbered notes and makes calls over a
//! resumable session (`Config::resume_window`) while its own network interface is cut with
//! `tc netem` (`--cuts` times, `--cut-secs` each, longer than the keepalive). Each cut ends
//! the connection on both sides; each side suspends, the client dials again, the server's
//! listener hands the new connection to its session, and the two go on from each other's
//! count: the server checks every note arrives once and in order, the client that every call
//! is answered. `cargo xtask test` runs it between two VMs (its flap step).
//!
//! ```text
//! flap server [--listen ADDR] [--messages N]
//! flap client --connect ADDR [--messages N] [--cuts K] [--cut-secs S] [--dev IFACE]
//! ```

#![forbid(unsafe_code)]

use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use rdmsg::transport::Listener;
use rdmsg::{message, request, Config, Endpoint, Session};
use serde::{Deserialize, Serialize};

/// A resumable session under link flaps: every note once and in order, every call answered.
#[derive(Debug, Parser)]
#[command(name = "flap", args_override_self = true)]
struct Options {
    /// Which side this host is
    #[arg(value_enum)]
    role: Role,
    /// Where the server listens, or the client connects (the same option)
    #[arg(
        long = "listen",
        visible_alias = "connect",
        value_name = "ADDR",
        default_value = "0.0.0.0:18900"
    )]
    addr: String,
    /// Notes the client sends (one call follows every hundredth)
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    messages: u32,
    /// Times the client cuts its link
    #[arg(long, value_name = "K", default_value_t = 2)]
    cuts: u32,
    /// How long each cut lasts
    #[arg(long, value_name = "S", default_value_t = 9.0)]
    cut_secs: f64,
    /// The client's interface to cut
    #[arg(long, value_name = "IFACE", default_value = "eth0")]
    dev: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Accepts one session and checks what comes, resuming as often as it takes
    Server,
    /// Sends notes and calls while cutting its own link
    Client,
}

/// A numbered note.
#[derive(Debug, Serialize, Deserialize)]
struct Note {
    n: u32,
    pad: [u8; 32],
}
/// A call: the server answers with `a + b`.
#[derive(Debug, Serialize, Deserialize)]
struct Add {
    a: u32,
    b: u32,
}
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Sum(u32);
/// The client is done.
#[derive(Debug, Serialize, Deserialize)]
struct Done;
message!(Note, solicited = false);
message!(Sum);
message!(Done);
request!(Add => Sum);

/// Both sides: resumable for a minute, a keepalive of 3 s (each cut is longer).
fn config() -> Config {
    Config {
        resume_window: Some(Duration::from_secs(60)),
        keepalive: Some(Duration::from_secs(3)),
        handshake_timeout: Duration::from_secs(2),
        ..Config::default()
    }
}

fn main() -> ExitCode {
    let o = Options::parse();
    rdmsg_examples::run(|| match o.role {
        Role::Server => serve(&o),
        Role::Client => client(&o),
    })
}

fn serve(o: &Options) -> Result<()> {
    let ep = Endpoint::open_default()?;
    let listener = Arc::new(ep.listen(o.addr.as_str())?);
    // The listener keeps accepting: a resume's connection goes to its session from there.
    let (sessions, stop) = accept(listener);
    let mut s = sessions.recv()?;
    s.register::<Note>()?
        .register::<Add>()?
        .register::<Done>()?;
    let (mut next, mut calls) = (0u32, 0u32);
    loop {
        let mut env = s.recv().context("the session ended")?;
        if env.is::<Note>() {
            let note: Note = env.decode()?;
            ensure!(note.n == next, "note {} arrived as number {next}", note.n);
            next += 1;
        } else if env.is::<Add>() {
            let add: Add = env.decode()?;
            let r = env.responder::<Add>()?;
            s.reply(r, &Sum(add.a + add.b))?;
            calls += 1;
        } else {
            env.decode::<Done>()?;
            break;
        }
    }
    let st = s.stats();
    println!(
        "flap: server: notes={next} in_order=yes calls_answered={calls} resumes={} resumed_messages={} suspended_ms={}",
        st.resumes,
        st.resumed_messages,
        st.time_suspended.as_millis()
    );
    ensure!(next == o.messages, "{next} notes of {}", o.messages);
    s.close()?;
    stop.store(true, Ordering::Release);
    Ok(())
}

/// Accepts on its own thread until `stop`: the first session comes out, resumes go to it.
fn accept(listener: Arc<Listener>) -> (mpsc::Receiver<Session>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    thread::spawn(move || {
        while !stopped.load(Ordering::Acquire) {
            match listener.accept_timeout(&config(), Some(Duration::from_millis(100))) {
                Ok(Some(conn)) => {
                    let _ = tx.send(Session::new(conn));
                }
                Ok(None) => {}
                Err(e) => eprintln!("flap: server: listener: {e}"),
            }
        }
    });
    (rx, stop)
}

fn client(o: &Options) -> Result<()> {
    let ep = Endpoint::open_default()?;
    // The server's host may still be booting: retry for a while.
    let deadline = Instant::now() + Duration::from_secs(60);
    let conn = loop {
        match ep.connect(o.addr.as_str(), &config()) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(e.into()),
        }
    };
    let mut s = Session::new(conn);
    // When each cut ended.
    let restored: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let cutter = {
        let (restored, dev, cuts) = (restored.clone(), o.dev.clone(), o.cuts);
        let cut = Duration::from_secs_f64(o.cut_secs);
        thread::spawn(move || -> Result<()> {
            for _ in 0..cuts {
                thread::sleep(Duration::from_secs(2));
                tc(&format!("qdisc add dev {dev} root netem loss 100%"))?;
                thread::sleep(cut);
                tc(&format!("qdisc del dev {dev} root"))?;
                restored.lock().unwrap().push(Instant::now());
            }
            Ok(())
        })
    };
    let started = Instant::now();
    // When each resume was first seen after a send or call (the first one that could go).
    let mut resumed_at = Vec::new();
    let mut seen = 0;
    let mut calls = 0;
    let mut n = 0;
    // The notes go while the cuts last: paced so that traffic spans them all.
    let span = Duration::from_secs_f64((2.0 + o.cut_secs) * f64::from(o.cuts) + 2.0);
    while n < o.messages || !cutter.is_finished() {
        if n < o.messages {
            s.send(&Note { n, pad: [7; 32] })?;
            n += 1;
            if n % 100 == 0 {
                let sum = s.call(&Add { a: n, b: 1 }, Duration::from_secs(120))?;
                ensure!(sum == Sum(n + 1), "call {n} answered {sum:?}");
                calls += 1;
            }
            let due = span.mul_f64(f64::from(n) / f64::from(o.messages));
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                thread::sleep(wait.min(Duration::from_millis(20)));
            }
        } else {
            let sum = s.call(&Add { a: 0, b: 0 }, Duration::from_secs(120))?;
            ensure!(sum == Sum(0));
            calls += 1;
            thread::sleep(Duration::from_millis(50));
        }
        let resumes = s.stats().resumes;
        if resumes > seen {
            seen = resumes;
            resumed_at.push(Instant::now());
        }
    }
    cutter.join().expect("the cutter")?;
    s.send(&Done)?;
    s.flush()?;
    // The server closes once it has checked everything.
    match s.recv_timeout(Some(Duration::from_secs(60))) {
        Err(e) if e.is_peer_closed() => {}
        other => bail!("expected the server's close, got {other:?}"),
    }
    let restored = restored.lock().unwrap().clone();
    // Each resume against the end of the cut before it.
    let after: Vec<Duration> = resumed_at
        .iter()
        .filter_map(|r| {
            restored
                .iter()
                .rev()
                .find(|c| *c <= r)
                .map(|c| r.duration_since(*c))
        })
        .collect();
    let worst = after.iter().max().copied().unwrap_or_default();
    let st = s.stats();
    println!(
        "flap: client: cuts={} notes={n} calls={calls} resumes={} resumed_messages={} suspended_ms={} worst_resume_after_link_back_ms={} secs={:.1}",
        o.cuts,
        st.resumes,
        st.resumed_messages,
        st.time_suspended.as_millis(),
        worst.as_millis(),
        started.elapsed().as_secs_f64()
    );
    // At least one resume per cut: an attempt that the peer was not ready for within the
    // handshake's timeout is given up and made again, and that counts as one more.
    ensure!(
        st.resumes >= u64::from(o.cuts),
        "{} resumes for {} cuts",
        st.resumes,
        o.cuts
    );
    Ok(())
}

fn tc(args: &str) -> Result<()> {
    let status = Command::new("tc").args(args.split(' ')).status()?;
    ensure!(status.success(), "tc {args}: {status}");
    Ok(())
}
