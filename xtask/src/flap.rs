//! The flap step: two VMs on a qemu socket network, the `flap` example's server on one and its
//! client on the other; the client cuts its own link with `tc netem` for three times the
//! keepalive, twice, while notes and calls flow over a resumable session. Passes when both
//! sides report everything delivered once and in order, every call answered, and at least
//! one resume per cut.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::vm::{self, Kernel};
use crate::{repo_root, Step};

/// Notes the client sends (a call after every hundredth).
const MESSAGES: u32 = 20_000;
/// Cuts of the client's link, and how long each lasts (the keepalive is 3 s).
const CUTS: u32 = 2;
const CUT_SECS: f64 = 9.0;

/// What the two sides reported.
#[derive(Debug)]
pub struct Flap {
    pub server: String,
    pub client: String,
}

impl std::fmt::Display for Flap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.server)?;
        write!(f, "{}", self.client)
    }
}

/// Runs the flap step on `kernel`.
pub fn run(kernel: Kernel) -> Result<Flap> {
    let _s = Step::new(
        "flap",
        &format!(
            "two VMs (Linux {kernel}) on a socket network: a resumable session while the client's link is cut {CUTS} times for {CUT_SECS} s"
        ),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let repo = repo_root();
    let host = |name: &str, n: u8, socket: String| {
        vm::Vm::networked(
            &repo,
            kernel,
            name,
            vm::Nic {
                netdev: format!("socket,{socket}"),
                mac: format!("52:54:00:79:00:{n:02x}"),
                addr: format!("10.79.0.{n}/24"),
            },
            1,
        )
    };
    let server_vm = host("flap-a", 1, format!("listen=127.0.0.1:{port}"));
    let client_vm = host("flap-b", 2, format!("connect=127.0.0.1:{port}"));
    server_vm.prepare()?;
    let timeout = Duration::from_secs(300);
    let said: Arc<Mutex<Vec<String>>> = Arc::default();
    let server = {
        let said = Arc::clone(&said);
        std::thread::spawn(move || {
            server_vm.run_script(
                &format!(
                    "./target/debug/flap server --listen 10.79.0.1:18900 --messages {MESSAGES}"
                ),
                timeout,
                &mut |l| {
                    println!("[flap server vm] {l}");
                    said.lock().unwrap().push(l.to_owned());
                },
            )
        })
    };
    // qemu's socket backend: the listening side must be up before the other connects.
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    let client = client_vm.run_script(
        &format!(
            "./target/debug/flap client --connect 10.79.0.1:18900 --messages {MESSAGES} --cuts {CUTS} --cut-secs {CUT_SECS} --dev eth0"
        ),
        timeout,
        &mut |l| {
            println!("[flap client vm] {l}");
            said.lock().unwrap().push(l.to_owned());
        },
    )?;
    let server = server
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
    let said = said.lock().unwrap();
    let line = |who: &str| {
        said.iter()
            .find_map(|l| l.split(&format!("flap: {who}: ")).nth(1))
            .map(|l| format!("flap {who}: {l}"))
            .with_context(|| format!("the flap {who} printed no summary"))
    };
    if client.code != 0 || server.code != 0 {
        bail!(
            "the flap run failed: client exit {}, server exit {} (after {:.0} s)",
            client.code,
            server.code,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(Flap {
        server: line("server")?,
        client: line("client")?,
    })
}
