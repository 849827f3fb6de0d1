//! The `jobq` example (`examples/src/bin/jobq.rs`) on tokio + TCP, to measure it against: the
//! same roles, command line, jobs and report lines, so that `jobq demo --roles-from jobq_tcp`
//! runs it the same way. Length-delimited frames of a kind byte, a routing tag and a bincode
//! body; the coordinator forwards bodies as they came (retagged, not decoded), answers a
//! client's job once, and sends the jobs of a worker whose connection ended to another.

use std::collections::{HashMap, HashSet, VecDeque};

use anyhow::{Context as _, Result};
use bytes::{BufMut as _, Bytes, BytesMut};
use clap::{Parser, Subcommand};
use futures::{SinkExt, StreamExt as _};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::{Framed, FramedRead, FramedWrite, LengthDelimitedCodec};

const READY: u8 = 0;
const JOB: u8 = 1;
const DONE: u8 = 2;
/// A frame's head: its kind and its tag (the client's job number, or the coordinator's).
const HEAD: usize = 9;

#[derive(Serialize, Deserialize)]
struct Job {
    numbers: Vec<u32>,
}

#[derive(Serialize, Deserialize)]
struct Done {
    sum: u64,
}

fn frame(kind: u8, tag: u64, body: &[u8]) -> Bytes {
    let mut f = BytesMut::with_capacity(HEAD + body.len());
    f.put_u8(kind);
    f.put_u64_le(tag);
    f.put_slice(body);
    f.freeze()
}

fn encode<T: Serialize>(kind: u8, tag: u64, value: &T) -> Result<Bytes> {
    let mut f = BytesMut::new();
    f.put_u8(kind);
    f.put_u64_le(tag);
    let mut w = f.writer();
    bincode::serde::encode_into_std_write(value, &mut w, bincode::config::standard())?;
    Ok(w.into_inner().freeze())
}

fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T> {
    Ok(bincode::serde::decode_from_slice(body, bincode::config::standard())?.0)
}

/// A frame's kind, tag and body.
fn parse(f: &[u8]) -> Result<(u8, u64, &[u8])> {
    anyhow::ensure!(f.len() >= HEAD, "a frame of {} bytes", f.len());
    let tag = u64::from_le_bytes(f[1..HEAD].try_into()?);
    Ok((f[0], tag, &f[HEAD..]))
}

async fn worker(coordinator: &str) -> Result<()> {
    let stream = TcpStream::connect(coordinator).await?;
    stream.set_nodelay(true)?;
    let mut conn = Framed::new(stream, LengthDelimitedCodec::new());
    conn.send(frame(READY, 0, &[])).await?;
    let mut jobs = 0u64;
    while let Some(f) = conn.next().await {
        let f = f?;
        let (_, tag, body) = parse(&f)?;
        let job: Job = decode(body)?;
        let sum = job.numbers.iter().map(|&n| u64::from(n)).sum();
        conn.send(encode(DONE, tag, &Done { sum })?).await?;
        jobs += 1;
    }
    println!("jobq worker: jobs={jobs} {}", cpu());
    Ok(())
}

enum Event {
    Frame(u64, Bytes),
    Closed(u64),
}

struct Pending {
    client: u64,
    tag: u64,
    job: Bytes,
}

async fn coordinator(listen: &str, clients: usize) -> Result<()> {
    let listener = TcpListener::bind(listen).await?;
    println!("listening {}", listener.local_addr()?);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut writers = HashMap::new();
    let (mut next_conn, mut next_tag, mut turn) = (0u64, 0u64, 0usize);
    let mut workers = Vec::new();
    let (mut waiting, mut running) = (VecDeque::new(), HashMap::<u64, (u64, Pending)>::new());
    let (mut seen, mut served) = (HashSet::new(), 0);
    let (mut jobs, mut answered, mut retried, mut lost) = (0u64, 0u64, 0u64, 0u64);
    while served < clients {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted?;
                stream.set_nodelay(true)?;
                let (read, write) = stream.into_split();
                let (conn, events_tx) = (next_conn, events_tx.clone());
                next_conn += 1;
                tokio::spawn(async move {
                    let mut read = FramedRead::new(read, LengthDelimitedCodec::new());
                    while let Some(Ok(f)) = read.next().await {
                        let _ = events_tx.send(Event::Frame(conn, f.freeze()));
                    }
                    let _ = events_tx.send(Event::Closed(conn));
                });
                let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
                writers.insert(conn, tx);
                tokio::spawn(async move {
                    let mut write = FramedWrite::new(write, LengthDelimitedCodec::new());
                    while let Some(f) = rx.recv().await {
                        write.feed(f).await?;
                        while let Ok(f) = rx.try_recv() {
                            write.feed(f).await?;
                        }
                        SinkExt::<Bytes>::flush(&mut write).await?;
                    }
                    anyhow::Ok(())
                });
            }
            Some(event) = events.recv() => match event {
                Event::Frame(conn, f) => {
                    let (kind, tag, _) = parse(&f)?;
                    match kind {
                        READY => workers.push(conn),
                        JOB => {
                            seen.insert(conn);
                            waiting.push_back(Pending { client: conn, tag, job: f.slice(HEAD..) });
                            jobs += 1;
                        }
                        _ => {
                            if let Some((_, p)) = running.remove(&tag) {
                                if let Some(w) = writers.get(&p.client) {
                                    let _ = w.send(frame(DONE, p.tag, &f[HEAD..]));
                                }
                                answered += 1;
                            }
                        }
                    }
                }
                Event::Closed(conn) => {
                    writers.remove(&conn);
                    if seen.remove(&conn) {
                        served += 1;
                    } else {
                        workers.retain(|&w| w != conn);
                        lost += 1;
                        let failed: Vec<u64> =
                            running.iter().filter(|(_, (w, _))| *w == conn).map(|(&t, _)| t).collect();
                        for tag in failed {
                            waiting.push_front(running.remove(&tag).expect("listed").1);
                            retried += 1;
                        }
                    }
                }
            },
        }
        while !workers.is_empty() {
            let Some(p) = waiting.pop_front() else { break };
            turn = (turn + 1) % workers.len();
            let worker = workers[turn];
            let _ = writers[&worker].send(frame(JOB, next_tag, &p.job));
            running.insert(next_tag, (worker, p));
            next_tag += 1;
        }
    }
    println!(
        "jobq coordinator: jobs={jobs} answered={answered} retried={retried} workers_lost={lost} {}",
        cpu()
    );
    Ok(())
}

async fn client(coordinator: &str, jobs: u64, in_flight: usize, seed: u64) -> Result<u64> {
    let stream = TcpStream::connect(coordinator).await?;
    stream.set_nodelay(true)?;
    let mut conn = Framed::new(stream, LengthDelimitedCodec::new());
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut expected = HashMap::new();
    let (mut sent, mut answered, mut wrong) = (0, 0, 0);
    while answered < jobs {
        while sent < jobs && expected.len() < in_flight {
            let len = (16.0 * 12_500f64.powf(rng.f64())) as usize;
            let numbers: Vec<u32> = (0..len).map(|_| rng.u32(..)).collect();
            expected.insert(sent, numbers.iter().map(|&n| u64::from(n)).sum::<u64>());
            conn.feed(encode(JOB, sent, &Job { numbers })?).await?;
            sent += 1;
        }
        SinkExt::<Bytes>::flush(&mut conn).await?;
        let f = conn.next().await.context("the coordinator closed")??;
        let (_, tag, body) = parse(&f)?;
        let done: Done = decode(body)?;
        if expected.remove(&tag) != Some(done.sum) {
            eprintln!("jobq client: job {tag} answered wrongly");
            wrong += 1;
        }
        answered += 1;
    }
    println!(
        "jobq client: jobs={jobs} answered={answered} wrong={wrong} {}",
        cpu()
    );
    Ok(wrong)
}

/// This process's CPU time so far, as `user_ms=... system_ms=...` (as the jobq example says it).
fn cpu() -> String {
    let (user, system) = rdmsg_examples::peers::process_cpu_split_ms().unwrap_or_default();
    format!("user_ms={user} system_ms={system}")
}

/// The `jobq` example's roles on tokio + TCP.
#[derive(Debug, Parser)]
#[command(name = "jobq_tcp")]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Takes jobs from clients and forwards them to workers.
    Coordinator {
        #[arg(long, default_value = "127.0.0.1:7400")]
        listen: String,
        #[arg(long, default_value_t = 1)]
        clients: usize,
    },
    /// Serves jobs until the coordinator closes.
    Worker {
        #[arg(long, default_value = "127.0.0.1:7400")]
        connect: String,
    },
    /// Sends jobs and checks the answers.
    Client {
        #[arg(long, default_value = "127.0.0.1:7400")]
        connect: String,
        #[arg(long, default_value_t = 3000)]
        jobs: u64,
        #[arg(long, default_value_t = 32)]
        in_flight: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match Cli::parse().role {
            Role::Coordinator { listen, clients } => coordinator(&listen, clients).await,
            Role::Worker { connect } => worker(&connect).await,
            Role::Client {
                connect,
                jobs,
                in_flight,
                seed,
            } => {
                if client(&connect, jobs, in_flight, seed).await? > 0 {
                    std::process::exit(1);
                }
                Ok(())
            }
        }
    })
}
