//! The anchors: rdma-core's perftest (`ib_send_lat`, `ib_send_bw`, `ib_read_bw`) run as a server
//! and a client process on the same device, and the parsers of their result tables.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Longest a perftest pair may take before both are killed.
const DEADLINE: Duration = Duration::from_secs(120);

/// How often the client retries while the server is not listening yet.
const CONNECT_ATTEMPTS: u32 = 50;

/// Ports for successive runs, so that none waits for the previous one's socket to close.
static NEXT_PORT: AtomicU16 = AtomicU16::new(18700);

/// Where and how perftest runs.
#[derive(Debug, Clone)]
pub struct Perftest {
    /// RDMA device name.
    pub device: String,
    /// GID index (`-x`); RoCE needs one.
    pub gid_index: u8,
}

/// What one perftest pair printed.
#[derive(Debug)]
pub struct Outputs {
    /// The server's standard output.
    pub server: String,
    /// The client's standard output.
    pub client: String,
}

impl Perftest {
    /// Runs `tool` as a server and then as a client to it on 127.0.0.1, both with `args`
    /// (besides device, GID, port and `-F`), and returns their outputs.
    pub fn run(&self, tool: &str, args: &[String]) -> Result<Outputs> {
        self.run_pair(tool, tool, |port| {
            let mut common: Vec<String> = vec![
                "-d".into(),
                self.device.clone(),
                "-x".into(),
                self.gid_index.to_string(),
                "-F".into(),
                "-p".into(),
                port.to_string(),
            ];
            common.extend_from_slice(args);
            common
        })
    }

    /// Runs `ibv_rc_pingpong`-style peers (`server` and `client` programs taking its flags:
    /// rdma-core's or rdmsg's `rc_pingpong`) for `iters` round trips of `size` bytes; returns
    /// the client's µs per round trip.
    pub fn pingpong(
        &self,
        server: &str,
        client: &str,
        size: usize,
        iters: usize,
        events: bool,
    ) -> Result<f64> {
        let out = self.run_pair(server, client, |port| {
            let mut args: Vec<String> = [
                "-d",
                &self.device,
                "-g",
                &self.gid_index.to_string(),
                "-p",
                &port.to_string(),
                "-n",
                &iters.to_string(),
                "-s",
                &size.to_string(),
            ]
            .map(String::from)
            .to_vec();
            if events {
                args.push("-e".into());
            }
            args
        })?;
        parse_pingpong_usec(&out.client)
    }

    /// Runs `server` with `args(port)`, then `client` with the same arguments plus 127.0.0.1,
    /// retrying the client while the server is not listening yet.
    fn run_pair(
        &self,
        server_cmd: &str,
        client_cmd: &str,
        args: impl Fn(u16) -> Vec<String>,
    ) -> Result<Outputs> {
        let common = args(next_port());
        let server: Vec<String> = std::iter::once(server_cmd.to_owned())
            .chain(common.iter().cloned())
            .collect();
        let mut client: Vec<String> = std::iter::once(client_cmd.to_owned())
            .chain(common)
            .collect();
        client.push("127.0.0.1".into());
        run_commands(&server, &client, DEADLINE)
    }
}

/// A port no earlier run of this process used.
pub fn next_port() -> u16 {
    NEXT_PORT.fetch_add(1, Ordering::Relaxed)
}

/// Runs the command line `server`, then `client`, retrying the client while the server is not
/// listening yet; kills both after `limit`. Returns their outputs.
pub fn run_commands(server: &[String], client: &[String], limit: Duration) -> Result<Outputs> {
    let name = |cmd: &[String]| -> String {
        let c = cmd.first().map(String::as_str).unwrap_or("?");
        c.rsplit('/').next().unwrap_or(c).to_owned()
    };
    let tool = name(server);
    let id = NEXT_RUN.fetch_add(1, Ordering::Relaxed);
    let deadline = Instant::now() + limit;
    let server_out = scratch_file(&tool, id, "server");
    let mut server = Proc::spawn(&server[0], &server[1..], &server_out, limit)?;
    let client_out = scratch_file(&tool, id, "client");
    let mut attempt = 0;
    let client = loop {
        attempt += 1;
        let mut c = Proc::spawn(&client[0], &client[1..], &client_out, limit)?;
        let ok = c.wait_until(deadline)?;
        let text = c.output()?;
        if ok {
            break text;
        }
        let refused = text.contains("Couldn't connect") || text.contains("couldn't connect");
        if !refused || attempt >= CONNECT_ATTEMPTS || server.exited()? {
            server.kill();
            bail!(
                "{} client failed ({attempt} attempts):\n{text}",
                name(client)
            );
        }
        thread::sleep(Duration::from_millis(100));
    };
    if !server.wait_until(deadline)? {
        bail!("{tool} server failed:\n{}", server.output()?);
    }
    let server = server.output()?;
    let _ = std::fs::remove_file(&server_out);
    let _ = std::fs::remove_file(&client_out);
    Ok(Outputs { server, client })
}

/// Distinguishes the output files of successive runs.
static NEXT_RUN: AtomicU16 = AtomicU16::new(0);

fn scratch_file(tool: &str, run: u16, side: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "rdmsg-bench-{tool}-{}-{run}-{side}.txt",
        std::process::id()
    ))
}

/// A child process whose output goes to a file (no pipe to fill up).
struct Proc {
    child: Child,
    out: PathBuf,
    name: String,
    limit: Duration,
}

impl Proc {
    fn spawn(tool: &str, args: &[String], out: &PathBuf, limit: Duration) -> Result<Self> {
        let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
        let err = file.try_clone()?;
        let child = Command::new(tool)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {tool} (is perftest installed?)"))?;
        Ok(Self {
            child,
            out: out.clone(),
            name: tool.to_owned(),
            limit,
        })
    }

    /// Waits for the process to exit; kills it at `deadline`. True if it exited with 0.
    fn wait_until(&mut self, deadline: Instant) -> Result<bool> {
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            if Instant::now() >= deadline {
                self.kill();
                bail!("{} did not finish within {:?}", self.name, self.limit);
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn exited(&mut self) -> Result<bool> {
        Ok(self.child.try_wait()?.is_some())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn output(&self) -> Result<String> {
        std::fs::read_to_string(&self.out)
            .with_context(|| format!("reading {}", self.out.display()))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// The data row following the last header line that contains `header_word`.
fn result_row<'a>(output: &'a str, header_word: &str) -> Option<(&'a str, &'a str)> {
    let lines: Vec<&str> = output.lines().collect();
    let at = lines.iter().rposition(|l| l.contains(header_word))?;
    let row = lines[at + 1..].iter().find(|l| !l.trim().is_empty())?;
    Some((lines[at], row))
}

/// `t_typical` (the median one-way latency, µs) of an `ib_send_lat` result table.
pub fn parse_lat_typical(output: &str) -> Result<f64> {
    let (header, row) =
        result_row(output, "t_typical").context("no latency table in the perftest output")?;
    let column = header
        .split_whitespace()
        .position(|w| w.starts_with("t_typical"))
        .context("no t_typical column")?;
    let value = row
        .split_whitespace()
        .nth(column)
        .with_context(|| format!("short latency row: {row:?}"))?;
    finite(
        value
            .parse()
            .with_context(|| format!("bad t_typical {value:?}"))?,
    )
}

/// µs per round trip from `ibv_rc_pingpong`'s `N iters in S seconds = U usec/iter` line.
pub fn parse_pingpong_usec(output: &str) -> Result<f64> {
    let line = output
        .lines()
        .rfind(|l| l.contains("usec/iter"))
        .context("no `usec/iter` line in the ping-pong output")?;
    let value = line
        .split_whitespace()
        .rev()
        .nth(1)
        .with_context(|| format!("short ping-pong line: {line:?}"))?;
    finite(
        value
            .parse()
            .with_context(|| format!("bad usec/iter {value:?}"))?,
    )
}

/// Rejects what a confused run prints: `inf`, `nan`, zero or negative figures.
fn finite(v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        bail!("implausible figure {v}")
    }
}

/// The message rate (million messages per second) of an `ib_send_bw` result table: the last
/// column of its row.
pub fn parse_bw_mpps(output: &str) -> Result<f64> {
    let (_, row) =
        result_row(output, "MsgRate").context("no bandwidth table in the perftest output")?;
    let value = row
        .split_whitespace()
        .last()
        .with_context(|| format!("empty bandwidth row: {row:?}"))?;
    finite(
        value
            .parse()
            .with_context(|| format!("bad MsgRate {value:?}"))?,
    )
}

/// The average bandwidth of an `ib_*_bw` result table in MiB/s (perftest's `MB/sec` are
/// 2^20 bytes): its `BW average[MB/sec]` column. Large messages need it rather than the message
/// rate, whose six decimals leave one or two digits at a few messages per second.
pub fn parse_bw_average_mib(output: &str) -> Result<f64> {
    let (header, row) =
        result_row(output, "BW average").context("no bandwidth table in the perftest output")?;
    // Column names may be two words (`BW peak[MB/sec]`): a word without its unit in brackets
    // goes with the next.
    let mut columns = Vec::new();
    let mut pending = String::new();
    for word in header.split_whitespace() {
        pending.push_str(word);
        if word.starts_with('#') || word.contains('[') {
            columns.push(std::mem::take(&mut pending));
        } else {
            pending.push(' ');
        }
    }
    let column = columns
        .iter()
        .position(|c| c.starts_with("BW average"))
        .context("no BW average column")?;
    if !columns[column].ends_with("[MB/sec]") {
        bail!("bandwidth not in MB/sec: {header:?}");
    }
    let value = row
        .split_whitespace()
        .nth(column)
        .with_context(|| format!("short bandwidth row: {row:?}"))?;
    finite(
        value
            .parse()
            .with_context(|| format!("bad BW average {value:?}"))?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAT: &str = "\
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 8       1000          100.25         857.70       168.00   	       172.74      	40.59  		318.43  		857.70 
---------------------------------------------------------------------------------------
";

    const BW: &str = "\
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 64         2000             1.47               1.22   		   0.019999
---------------------------------------------------------------------------------------
";

    /// `ib_read_bw`'s client, 16 MiB reads.
    const READ_BW: &str = "\
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 16777216   8                142.31             138.07 		     0.000009
---------------------------------------------------------------------------------------
";

    #[test]
    fn reads_perftest_tables() {
        assert_eq!(parse_lat_typical(LAT).unwrap(), 168.0);
        assert_eq!(parse_bw_mpps(BW).unwrap(), 0.019999);
        assert_eq!(parse_bw_average_mib(BW).unwrap(), 1.22);
        assert_eq!(parse_bw_average_mib(READ_BW).unwrap(), 138.07);
        let qos = BW
            .replace("#bytes     #iterations", "#bytes    #sl      #iterations")
            .replace(" 64         2000", " 64  0   2000");
        assert_eq!(parse_bw_average_mib(&qos).unwrap(), 1.22);
        let gbits = BW.replace("MB/sec", "Gb/sec");
        assert!(parse_bw_average_mib(&gbits).is_err(), "another unit");
    }

    #[test]
    fn reads_pingpong_lines() {
        let out = "  local address: ...\n8192000 bytes in 0.29 seconds = 226.0 Mbit/sec\n\
                   5000 iters in 0.29 seconds = 58.03 usec/iter\n";
        assert_eq!(parse_pingpong_usec(out).unwrap(), 58.03);
        assert!(parse_pingpong_usec("couldn't connect").is_err());
        let inf = LAT.replace("168.00", "inf");
        assert!(
            parse_lat_typical(&inf).is_err(),
            "perftest prints inf when confused"
        );
    }

    #[test]
    fn missing_tables_are_errors() {
        assert!(parse_lat_typical("Couldn't connect to 127.0.0.1:18602").is_err());
        assert!(parse_bw_mpps(LAT).is_err());
        assert!(parse_bw_average_mib(LAT).is_err());
        assert!(parse_lat_typical(" #bytes t_typical\n 8\n").is_err());
    }
}
