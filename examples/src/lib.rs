//! Message types and helpers shared by the rdmsg examples and their device tests.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use serde::{Deserialize, Serialize};

/// A sensor reading: telemetry, which does not wake the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    /// Sensor number.
    pub sensor: u16,
    /// Sequence number of the reading.
    pub seq: u64,
    /// Measured value.
    pub value: f64,
}
rdmsg::msg::message!(Reading, tag = "rdmsg.example.Reading", solicited = false);

/// An alarm: wakes the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alarm {
    /// Sensor number.
    pub sensor: u16,
    /// Why.
    pub reason: String,
}
rdmsg::msg::message!(Alarm, tag = "rdmsg.example.Alarm");

/// A request: wakes the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Correlates the response.
    pub id: u64,
    /// Operands.
    pub operands: Vec<i64>,
}
rdmsg::msg::message!(Request, tag = "rdmsg.example.Request");

/// A response: wakes the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// The sum of the operands.
    pub sum: i64,
}
rdmsg::msg::message!(Response, tag = "rdmsg.example.Response");

/// A command for a worker: wakes the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Recalibrate a sensor.
    Calibrate {
        /// Sensor number.
        sensor: u16,
        /// New offset.
        offset: f64,
    },
    /// Ship a firmware image (large: fragmented).
    Firmware(Vec<u8>),
}
rdmsg::msg::message!(Command, tag = "rdmsg.example.Command");

pub mod jobq_demo;
pub mod mesh;

/// The `main` of every example: runs `main` and turns its error into one line on stderr,
/// `error: ` and the chain of causes (`what failed: why: root cause`), with exit code 1.
/// No backtrace unless asked for (`RUST_BACKTRACE` or `RUST_LIB_BACKTRACE` set and not `0`,
/// as anyhow captures one): then the error's full report, its backtrace included.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     rdmsg_examples::run(|| {
///         anyhow::ensure!(1 + 1 == 2, "arithmetic is broken");
///         Ok(())
///     })
/// }
/// ```
pub fn run(main: impl FnOnce() -> anyhow::Result<()>) -> std::process::ExitCode {
    match main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            if backtrace_wanted() {
                eprintln!("error: {err:?}");
            } else {
                eprintln!("error: {err:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether the user asked for backtraces, by the rule anyhow captures them by.
fn backtrace_wanted() -> bool {
    let on = |v: std::ffi::OsString| v != "0";
    match std::env::var_os("RUST_LIB_BACKTRACE") {
        Some(v) => on(v),
        None => std::env::var_os("RUST_BACKTRACE").is_some_and(on),
    }
}

pub use rdmsg::transport::loopback_pair;

/// The second process of the many-peer examples (`collector`'s sensors, `reqresp`'s clients):
/// started once the server listens, watched while it serves, reaped with its report line.
pub mod peers {
    use std::io::Read;
    use std::process::{Child, Command, ExitStatus};
    use std::time::{Duration, Instant};

    use anyhow::{bail, Context as _, Result};

    /// The process, not started until the server has an address to give it.
    #[derive(Debug)]
    pub struct PeerProcess {
        command: Command,
        child: Option<Child>,
        /// What it runs (`sensors`, `clients`): its report line starts with `{what}:`.
        what: &'static str,
    }

    impl PeerProcess {
        /// `command` runs `what` once given `--connect ADDR`.
        pub fn new(command: Command, what: &'static str) -> Self {
            Self {
                command,
                child: None,
                what,
            }
        }

        /// Starts it towards the server at `addr`.
        pub fn start(&mut self, addr: &str) -> Result<()> {
            let child = self
                .command
                .args(["--connect", addr])
                .spawn()
                .with_context(|| format!("starting the {} process", self.what))?;
            self.child = Some(child);
            Ok(())
        }

        /// Whether it has ended (or was never started): the server waits for no more peers.
        pub fn ended(&mut self) -> bool {
            self.child
                .as_mut()
                .map_or(true, |c| !matches!(c.try_wait(), Ok(None)))
        }

        /// Waits for it, killing it if it outlives `owner` (the server) by a minute: how it
        /// ended and its report line; `None` if it was never started.
        pub fn reap(self, owner: &str) -> Option<Result<(ExitStatus, Option<String>)>> {
            let what = self.what;
            let mut child = self.child?;
            Some((|| {
                let until = Instant::now() + Duration::from_secs(60);
                let status = loop {
                    if let Some(s) = child.try_wait()? {
                        break s;
                    }
                    if Instant::now() > until {
                        let _ = child.kill();
                        bail!("the {what} process did not end within 60 s of the {owner}: killed");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                };
                let mut out = String::new();
                if let Some(mut o) = child.stdout.take() {
                    o.read_to_string(&mut out)?;
                }
                let prefix = format!("{what}:");
                let line = out.lines().rfind(|l| l.starts_with(&prefix));
                Ok((status, line.map(str::to_owned)))
            })())
        }
    }

    /// The value of `key=` in a report line.
    pub fn field(line: &str, key: &str) -> Option<u64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
    }

    /// Entries of a directory such as `/proc/self/fd` (0 if unreadable).
    pub fn count_dir(path: &str) -> usize {
        std::fs::read_dir(path).map_or(0, Iterator::count)
    }

    /// CPU time this process has used (user and system), in milliseconds, from
    /// `/proc/self/stat` (kernel ticks of 10 ms: measure long stretches). `None` if unreadable.
    pub fn process_cpu_ms() -> Option<u64> {
        cpu_ms_of_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)
    }

    /// [`process_cpu_ms`] as user and system time apart.
    pub fn process_cpu_split_ms() -> Option<(u64, u64)> {
        cpu_split_ms_of_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)
    }

    /// `utime + stime` of a `/proc/PID/stat` line, in milliseconds (100 ticks a second, as
    /// on every Linux `USER_HZ`). The command name may hold spaces: fields count from its `)`.
    pub fn cpu_ms_of_stat(stat: &str) -> Option<u64> {
        let (user, system) = cpu_split_ms_of_stat(stat)?;
        Some(user + system)
    }

    /// `utime` and `stime` of a `/proc/PID/stat` line, in milliseconds.
    pub fn cpu_split_ms_of_stat(stat: &str) -> Option<(u64, u64)> {
        let rest = &stat[stat.rfind(')')? + 1..];
        let mut fields = rest.split_whitespace().skip(11);
        let user: u64 = fields.next()?.parse().ok()?;
        let system: u64 = fields.next()?.parse().ok()?;
        Some((user * 10, system * 10))
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn cpu_time_is_read_after_the_command_name() {
            let stat = "1234 (a b) c) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 1 0";
            assert_eq!(super::cpu_ms_of_stat(stat), Some(3250));
            assert_eq!(super::cpu_ms_of_stat("garbage"), None);
        }
    }
}
