//! `rdmsg-bench`: runs rdmsg's benchmarks next to their anchors and writes the report.
//!
//! ```text
//! rdmsg-bench run [--quick] [--rounds N]
//!                   [--only lat,bw,wake,async,large,fanin,rates,cost,connect,collector]
//!                   [--filter TEXT] [--device D] [--gid-index I] [--fanin-conns 1,16,...]
//!                   [--fanin-rate R] [--fanin-messages M] [--fanin-rounds N]
//!                   [--collector-sensors 1000,5000,...]
//! rdmsg-bench codec [--quick] [--rounds N]
//! rdmsg-bench report --out DIR SAMPLE_FILE...
//! rdmsg-bench fanin-server ...   (a fan-in's server process, started by `run`)
//! rdmsg-bench fanin-client ...   (its client process, started by the server)
//! ```
//!
//! `run` (on an RDMA device) and `codec` (anywhere) print one `SAMPLE {json}` line per
//! measurement on stdout and progress on stderr; `report` turns sample files into
//! `report.md`, `report.json` and `chart.png`. `cargo xtask bench` does all three.

#![forbid(unsafe_code)]

use std::fs;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use bench::perftest::Perftest;
use bench::runner::{self, Plan};
use bench::{chart, codec, cost, fanin, report, Bench, Sample};

const USAGE: &str = "usage:
  rdmsg-bench run [--quick] [--rounds N]
                  [--only lat,bw,wake,async,large,fanin,rates,cost,connect,collector]
                  [--filter TEXT] [--lat-iters N] [--large-mib N] [--device D] [--gid-index I]
                  [--fanin-conns 1,16,256,1024] [--fanin-rate R] [--fanin-messages M]
                  [--fanin-rounds N] [--fanin-large-group HUBSxCONNS]
                  [--collector-sensors 1000,5000,10000]
      --filter runs only the measurements whose progress line contains TEXT
      --lat-iters N round trips per latency measurement (default 1000)
      --large-mib N MiB each large-message run moves, about (default 64; --quick 8): the
                  message count is N MiB / size, at least 8 and at most 2000
      --fanin-conns connection counts of the fan-in (default 1,16,256,1024; --quick 1,16,64)
      --fanin-rate messages per second the fan-in client offers, all connections (8192)
      --fanin-messages messages per fan-in measurement (32768; --quick 16384)
      --fanin-rounds rounds that include the fan-in (default 1)
      --fanin-large-group HUBSxCONNS one more fan-in point, first round only: a group of
                  HUBS hubs at CONNS connections (default 4x20000; --quick none)
      --collector-sensors sensor counts the collector example runs at, in the first round,
                  each with 8 credits a sensor and the largest also with 1 (default
                  1000,5000,10000; --quick 256, 8 credits only); needs target/release/collector
  rdmsg-bench codec [--quick] [--rounds N]
  rdmsg-bench cost-check [--iters N] [--runs K] [--only LAYER]
      counts instructions and allocations per round trip of each layer with callgrind
      (the smallest of K runs, default 2) and fails above the ceilings (cargo xtask test runs it)
  rdmsg-bench report --out DIR SAMPLE_FILE...";

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rdmsg-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("run") => run(&args[1..]),
        Some("codec") => codec_rounds(&args[1..]),
        Some("report") => write_report(&args[1..]),
        Some("fanin-server") => {
            fanin::server_main(&args[1..])?;
            Ok(ExitCode::SUCCESS)
        }
        Some("fanin-client") => {
            fanin::client_main(&args[1..])?;
            Ok(ExitCode::SUCCESS)
        }
        Some("cost-check") => {
            let perf = Perftest {
                device: std::env::var("RDMSG_DEVICE").unwrap_or_else(|_| "rxe0".into()),
                gid_index: 1,
            };
            Ok(if cost::check_main(&args[1..], &perf)? {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Some("connect-peer") => {
            bench::connect::peer_main(&args[1..])?;
            Ok(ExitCode::SUCCESS)
        }
        Some("cost-peer") => {
            cost::peer_main(&args[1..])?;
            Ok(ExitCode::SUCCESS)
        }
        Some("-h" | "--help") => {
            println!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        _ => {
            eprintln!("{USAGE}");
            Ok(ExitCode::from(2))
        }
    }
}

/// Flags with their values that [`plan_from`] leaves to the caller.
type OtherFlags = Vec<(String, String)>;

/// Common flags: `--quick`, `--rounds N`; returns the plan, whether it is the quick one, and
/// the flags it did not know.
fn plan_from(args: &[String]) -> Result<(Plan, bool, OtherFlags)> {
    let mut plan = Plan::full();
    let mut quick = false;
    let mut rest = Vec::new();
    let mut rounds = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => {
                plan = Plan::quick();
                quick = true;
            }
            flag => {
                let value = it
                    .next()
                    .with_context(|| format!("{flag} needs a value\n{USAGE}"))?
                    .clone();
                if flag == "--rounds" {
                    rounds = Some(value.parse().context("--rounds")?);
                } else {
                    rest.push((flag.to_owned(), value));
                }
            }
        }
    }
    if let Some(r) = rounds {
        if r == 0 {
            bail!("--rounds must be positive");
        }
        plan.rounds = r;
    }
    Ok((plan, quick, rest))
}

fn run(args: &[String]) -> Result<ExitCode> {
    let (mut plan, _, rest) = plan_from(args)?;
    let mut perf = Perftest {
        device: std::env::var("RDMSG_DEVICE").unwrap_or_else(|_| "rxe0".into()),
        gid_index: 1,
    };
    for (flag, value) in rest {
        match flag.as_str() {
            "--device" => perf.device = value,
            "--filter" => plan.filter = Some(value),
            "--lat-iters" => plan.lat_iters = value.parse().context("--lat-iters")?,
            "--large-mib" => {
                let mib: usize = value.parse().context("--large-mib")?;
                plan.large_bytes = mib.saturating_mul(1 << 20);
            }
            "--gid-index" => perf.gid_index = value.parse().context("--gid-index")?,
            "--fanin-conns" => {
                plan.fanin.conns = value
                    .split(',')
                    .map(|n| match n.parse::<usize>() {
                        Ok(n) if n > 0 => Ok(n),
                        _ => bail!("--fanin-conns takes positive counts, not {n}"),
                    })
                    .collect::<Result<_>>()?;
            }
            "--fanin-large-group" => {
                plan.fanin.large_group = match value.as_str() {
                    "none" => None,
                    v => {
                        let parsed = v
                            .split_once('x')
                            .and_then(|(h, c)| Some((h.parse().ok()?, c.parse().ok()?)));
                        match parsed {
                            Some((hubs, conns)) if fanin::Server::GROUPS.contains(&hubs) && conns > 0 => {
                                Some((hubs, conns))
                            }
                            _ => bail!(
                                "--fanin-large-group takes HUBSxCONNS (HUBS one of 1, 2, 4, 8) or none, not {v}"
                            ),
                        }
                    }
                };
            }
            "--collector-sensors" => {
                plan.collector.sensors = value
                    .split(',')
                    .map(|n| match n.parse::<usize>() {
                        Ok(n) if n > 0 => Ok(n),
                        _ => bail!("--collector-sensors takes positive counts, not {n}"),
                    })
                    .collect::<Result<_>>()?;
            }
            "--fanin-rate" => plan.fanin.rate = value.parse().context("--fanin-rate")?,
            "--fanin-messages" => {
                plan.fanin.messages = value.parse().context("--fanin-messages")?;
            }
            "--fanin-rounds" => plan.fanin.rounds = value.parse().context("--fanin-rounds")?,
            "--only" => {
                plan.benches = value
                    .split(',')
                    .map(|b| match b {
                        "lat" => Ok(vec![Bench::LatEvent, Bench::LatPoll]),
                        "lat-event" => Ok(vec![Bench::LatEvent]),
                        "lat-poll" => Ok(vec![Bench::LatPoll]),
                        "bw" => Ok(vec![Bench::Bw]),
                        "wake" => Ok(vec![Bench::Wake]),
                        "fanin" => Ok(vec![Bench::Fanin]),
                        "cost" => Ok(vec![Bench::Cost]),
                        "connect" => Ok(vec![Bench::Connect]),
                        "collector" => Ok(vec![Bench::Collector]),
                        "rates" => Ok(vec![Bench::Rates]),
                        "async" => Ok(vec![Bench::Async]),
                        "large" => Ok(vec![Bench::Large]),
                        other => {
                            bail!(
                                "--only takes lat, lat-event, lat-poll, bw, wake, async, large, \
                                 fanin, rates, cost, connect, collector; not {other}"
                            )
                        }
                    })
                    .collect::<Result<Vec<_>>>()?
                    .concat();
            }
            other => bail!("unknown flag {other}\n{USAGE}"),
        }
    }
    // rdmsg's endpoints open the same device.
    std::env::set_var("RDMSG_DEVICE", &perf.device);
    eprintln!(
        "rdmsg-bench: {} measurements on {} ({} rounds)",
        plan.tasks().len(),
        perf.device,
        plan.rounds
    );
    let failed = runner::run_all(&plan, &perf, &mut std::io::stdout().lock())?;
    if failed > 0 {
        eprintln!("rdmsg-bench: {failed} measurements failed");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn codec_rounds(args: &[String]) -> Result<ExitCode> {
    let (plan, quick, rest) = plan_from(args)?;
    if let Some((flag, _)) = rest.first() {
        bail!("unknown flag {flag}\n{USAGE}");
    }
    let scale = if quick { 0.05 } else { 1.0 };
    let rounds = if quick { 1 } else { plan.rounds.max(7) };
    let mut out = std::io::stdout().lock();
    for round in 0..rounds {
        for r in codec::round(scale)? {
            eprintln!(
                "[codec {}/{rounds}] {} {}: rdmsg {:.0} ns, bincode {:.0} ns",
                round + 1,
                r.op,
                r.message,
                r.rdmsg_ns,
                r.bincode_ns
            );
            for (subject, ns) in [("rdmsg", r.rdmsg_ns), ("bincode", r.bincode_ns)] {
                let s = Sample {
                    bench: Bench::Codec,
                    subject: subject.into(),
                    variant: format!("{} {}", r.op, r.message),
                    size: r.size as u64,
                    batch: 0,
                    round,
                    metric: "ns".into(),
                    value: ns,
                    conns: 0,
                    note: String::new(),
                    top: Vec::new(),
                    rate: 0,
                };
                writeln!(out, "{}", s.to_line())?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

const PREAMBLE: &str = "\
Every ratio is rdmsg's median over the rounds divided by its anchor's median, both measured in
the same run and interleaved round by round: Soft-RoCE `rxe0` in a qemu TCG guest with 2 vCPUs,
where code runs 10 to 40 times slower than natively and memory copies some 200 times slower, and
one round trip costs hundreds of µs. Only the ratios mean anything, and single rounds vary by
±20 %. Both peers run on the one device, over its loopback: rdmsg as two threads of one
process, perftest as two processes.

rdmsg side: `rdmsg::msg::Session`s carrying a byte-string message (20-byte frame header + bincode),
read in place by the receiver (`decode_borrowed`, as perftest does not touch its data either).
Latency: `Policy::Sleep` with solicited-only arming (event) or `Policy::Poll` (polling),
defaults otherwise, one-way = half the round trip, median of 1000 after 50 of warm-up.
Throughput: batches of 64 (the last solicited), receive depth 256, from the first send to the
last message read at the receiver, sent one `send` per message (a frame, a receive buffer and a
credit each) and by `send_batch` (`packed`: as many messages to a frame as fit); `ib_send_bw`'s figure is its receiver's; `verbs-core` is the same stream
written directly on verbs-core (128 in flight, a completion every 64, 512 receives, polling, no
framing, no credits). Wake-ups: 200 batches of K messages of 64 B, the last solicited, 5 ms
apart, receiver thread CPU time (`CLOCK_THREAD_CPUTIME_ID`, kernel time included); busy-poll:
`Policy::Poll`; next: `Policy::Sleep` armed for any completion; hybrid: up to 50 µs of spinning,
then solicited-only sleep; solicited-only: `Policy::Sleep`. Codec (on the host, not in the VM):
one frame encoded into a buffer, and header check + decode, against `bincode::serde` on the same
value, timed in alternating chunks. Large messages: see their section. Fan-in: see its section.
Collector: see its section.
";

fn write_report(args: &[String]) -> Result<ExitCode> {
    let mut out_dir = None;
    let mut files = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out_dir = Some(PathBuf::from(it.next().context("--out needs a value")?)),
            f if f.starts_with('-') => bail!("unknown flag {f}\n{USAGE}"),
            f => files.push(PathBuf::from(f)),
        }
    }
    let out_dir = out_dir.context("--out DIR is required")?;
    if files.is_empty() {
        bail!("no sample files\n{USAGE}");
    }
    let mut samples = Vec::new();
    for f in &files {
        let text = fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        for (n, line) in text.lines().enumerate() {
            if let Some(s) = Sample::from_line(line) {
                samples.push(s.with_context(|| format!("{}:{}: bad sample", f.display(), n + 1))?);
            }
        }
    }
    if samples.is_empty() {
        bail!("no samples in {files:?}");
    }
    let rows = report::rows(&samples);
    fs::create_dir_all(&out_dir)?;
    let mut md = report::markdown(&rows, PREAMBLE);
    md.push_str(&report::large_markdown(&samples));
    md.push_str(&report::fanin_markdown(&samples));
    md.push_str(&report::rates_markdown(&samples));
    md.push_str(&report::cost_markdown(&samples));
    md.push_str(&report::connect_markdown(&samples));
    md.push_str(&report::collector_markdown(&samples));
    fs::write(out_dir.join("report.md"), &md)?;
    fs::write(out_dir.join("report.json"), report::json(&rows, &samples))?;
    let png = fs::File::create(out_dir.join("chart.png"))?;
    let bars = chart::write_png(&rows, "rdmsg benchmarks: rdmsg / anchor", png)?;
    println!("{md}");
    eprintln!(
        "rdmsg-bench: {} samples, {} rows, {bars} bars: {}/report.md, report.json, chart.png",
        samples.len(),
        rows.len(),
        out_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
