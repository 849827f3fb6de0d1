//! Several message types on one connection, routed by a dispatcher: readings to a pool of
//! worker threads through a crossbeam channel, commands (one of them large enough to be
//! fragmented) to another worker, alarms to a handler on the dispatching thread.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use anyhow::{bail, Result};
use clap::Parser;
use rdmsg::msg::{Dispatcher, Session};
use rdmsg::transport::Config;
use rdmsg_examples::{loopback_pair, Alarm, Command, Reading};

const READINGS: u64 = 3000;
const WORKERS: usize = 2;

/// Several message types on one connection of one device, routed by a dispatcher: readings
/// to a pool of worker threads, commands (one of them fragmented) to another worker, alarms
/// to a handler on the dispatching thread. Takes no arguments.
#[derive(Debug, Parser)]
#[command(name = "dispatcher")]
struct Cli {}

fn main() -> ExitCode {
    Cli::parse();
    rdmsg_examples::run(dispatch)
}

fn dispatch() -> Result<()> {
    let (rx, tx) = loopback_pair(&Config::default(), &Config::default())?;
    let receiver = thread::spawn(
        move || -> Result<(Vec<u64>, u64, Vec<usize>, rdmsg::msg::DispatchStats)> {
            let mut session = Session::new(rx);
            let mut d = Dispatcher::new();
            let readings = d.channel::<Reading>(256)?;
            let commands = d.channel::<Command>(16)?;
            let alarms = Arc::new(AtomicU64::new(0));
            let seen = Arc::clone(&alarms);
            d.on::<Alarm>(move |_| {
                seen.fetch_add(1, Ordering::Relaxed);
            })?;
            let workers: Vec<_> = (0..WORKERS)
                .map(|_| {
                    let rx = readings.clone();
                    thread::spawn(move || rx.iter().count() as u64)
                })
                .collect();
            let commander = thread::spawn(move || {
                commands
                    .iter()
                    .map(|c| match c {
                        Command::Firmware(image) => image.len(),
                        Command::Calibrate { .. } => 0,
                    })
                    .collect::<Vec<_>>()
            });
            let end = d.run(&mut session);
            if !end.is_peer_closed() {
                return Err(end.into());
            }
            let stats = d.stats();
            drop(d); // closes the channels: the workers finish
            let per_worker = workers
                .into_iter()
                .map(|w| w.join().expect("worker"))
                .collect();
            let commands = commander.join().expect("commander");
            Ok((per_worker, alarms.load(Ordering::Relaxed), commands, stats))
        },
    );

    let mut s = Session::new(tx);
    for i in 0..READINGS {
        s.send(&Reading {
            sensor: (i % 4) as u16,
            seq: i,
            value: i as f64,
        })?;
        if i % 1000 == 999 {
            s.send(&Alarm {
                sensor: 2,
                reason: "over limit".into(),
            })?;
            s.send(&Command::Calibrate {
                sensor: 2,
                offset: -0.5,
            })?;
        }
    }
    s.send(&Command::Firmware(vec![0xa5; 100_000]))?;
    let fragmented = s.stats().fragmented;
    s.close()?;
    let (per_worker, alarms, commands, stats) = receiver.join().expect("receiver")?;
    let total: u64 = per_worker.iter().sum();
    println!(
        "readings {total} over {WORKERS} workers {per_worker:?}; alarms {alarms}; commands {commands:?} ({fragmented} fragmented); {stats:?}"
    );
    if total != READINGS || alarms != 3 || commands.len() != 4 || commands[3] != 100_000 {
        bail!("something went missing");
    }
    Ok(())
}
