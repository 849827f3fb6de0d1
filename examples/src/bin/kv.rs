//! A key-value service on the call API: one hub thread serves every client; each client
//! thread keeps up to `--in-flight` calls under way, each with its own deadline, and checks
//! every answer against a model of what the server must hold. Values are 16 B to
//! `--max-value` (4 MiB by default): small ones travel inline, large ones by rendezvous, and
//! the server stores what it receives without copying it (`decode_shared`) and answers gets
//! from its store by reference (`Bulk`). Ends with one line:
//!
//! ```text
//! kv: clients=4 requests=10000 ok=10000 timed_out=0 late=0 mismatches=0 ...
//! ```
//!
//! Non-zero exit code on any mismatch or error.

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use clap::Parser;
use rdmsg::{
    message, request, Bulk, Call, Config, Endpoint, Envelope, Error, Hub, HubConfig, HubEvent,
    Posted, Session, SessionConfig,
};
use serde::{Deserialize, Serialize};

/// A key-value service on the call API: one hub thread, several client threads with calls
/// in flight, every answer checked against a model.
#[derive(Debug, Clone, Parser)]
#[command(name = "kv")]
struct Cli {
    /// Client threads (one connection each).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Requests in all, split evenly between the clients.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Calls each client keeps under way.
    #[arg(long, default_value_t = 8)]
    in_flight: usize,
    /// Deadline of each call, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Largest value, in bytes (one value in 16 is large: 16 KiB up to this).
    #[arg(long, default_value_t = 4 << 20)]
    max_value: usize,
    /// Print the server's per-peer counters every this many milliseconds (0: never).
    #[arg(long, default_value_t = 0)]
    live_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct Put {
    key: String,
    value: Bulk,
}
#[derive(Serialize, Deserialize)]
struct Get {
    key: String,
}
#[derive(Serialize, Deserialize)]
struct Delete {
    key: String,
}
#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    replaced: bool,
}
#[derive(Debug, Serialize, Deserialize)]
struct Value(Option<Bulk>);
#[derive(Debug, Serialize, Deserialize)]
struct Deleted(bool);

request!(Put => Stored);
request!(Get => Value);
request!(Delete => Deleted);
message!(Stored);
message!(Value);
message!(Deleted);

fn main() -> ExitCode {
    rdmsg_examples::run(|| {
        let cli = Cli::parse();
        ensure!(
            cli.clients > 0 && cli.in_flight > 0,
            "clients and in-flight must be at least 1"
        );
        let endpoint = Endpoint::open_default()?;
        let (addr_tx, addr_rx) = mpsc::channel();
        let server_ep = endpoint.clone();
        let (clients, live) = (cli.clients, Duration::from_millis(cli.live_ms));
        let server = thread::spawn(move || serve(&server_ep, clients, live, addr_tx));
        let addr = addr_rx.recv().context("the server did not start")?;
        let started = Instant::now();
        let per_client = cli.requests / cli.clients;
        let workers: Vec<_> = (0..cli.clients)
            .map(|c| {
                let (endpoint, cli) = (endpoint.clone(), cli.clone());
                thread::spawn(move || client(&endpoint, addr, c, per_client, &cli))
            })
            .collect();
        let mut total = Tally::default();
        for w in workers {
            total.add(&w.join().expect("a client panicked")?);
        }
        let served = server.join().expect("the server panicked")?;
        println!(
            "kv: clients={} requests={} ok={} timed_out={} late={} mismatches={} \
             stored_keys={} shared_values={} secs={:.2}",
            cli.clients,
            total.sent,
            total.ok,
            total.timed_out,
            total.late,
            total.mismatches,
            served.keys,
            served.shared,
            started.elapsed().as_secs_f64()
        );
        ensure!(
            total.mismatches == 0,
            "{} answers were wrong",
            total.mismatches
        );
        Ok(())
    })
}

/// What the server ended with.
struct Served {
    keys: usize,
    shared: usize,
}

/// The server: one hub, one thread; values kept as the `Bulk`s they arrived as.
fn serve(
    endpoint: &Endpoint,
    clients: usize,
    live: Duration,
    addr: mpsc::Sender<SocketAddr>,
) -> Result<Served> {
    // Answers of up to 4 MiB, several waiting for one client: room for them (`Bulk` bytes
    // count, though they are not copied).
    let session = SessionConfig {
        max_outbox_bytes: 64 << 20,
        ..SessionConfig::default()
    };
    let mut hub = Hub::with_config(endpoint, HubConfig::default(), session)?;
    hub.register::<Put>()?
        .register::<Get>()?
        .register::<Delete>()?;
    addr.send(hub.listen("127.0.0.1:0")?)?;
    let mut store: HashMap<String, Bulk> = HashMap::new();
    let (mut gone, mut shared) = (0, 0);
    let mut print_at = Instant::now() + live;
    while gone < clients {
        if !live.is_zero() && Instant::now() >= print_at {
            print_peers(&hub);
            print_at += live;
        }
        let wait = (!live.is_zero()).then(|| print_at.saturating_duration_since(Instant::now()));
        let Some(event) = hub.recv_timeout(wait)? else {
            continue;
        };
        match event {
            HubEvent::Message { mut msg, .. } => {
                let answered = answer(&mut hub, &mut store, &mut msg, &mut shared)?;
                ensure!(answered, "an answer found its client's outbox full");
            }
            HubEvent::Disconnected { .. } => gone += 1,
            HubEvent::BadFrame { peer, error } => bail!("bad frame from {peer}: {error}"),
            HubEvent::HandshakeFailed { error, .. } => bail!("handshake failed: {error}"),
            _ => {}
        }
    }
    Ok(Served {
        keys: store.len(),
        shared,
    })
}

/// One line per peer: what the hub counts for it.
fn print_peers(hub: &Hub) {
    for peer in hub.peers() {
        let (Some(s), Some(o), Some(c)) = (
            hub.peer_stats(peer),
            hub.outbox(peer),
            hub.peer_call_stats(peer),
        ) else {
            continue;
        };
        println!(
            "kv live: peer={peer} received={} bytes_in={} sent={} bytes_out={} wakeups={} \
             credit_waits={} outbox={}/{}B served={} in_flight={} late={}",
            s.received,
            s.bytes_received,
            s.sent,
            s.bytes_sent,
            s.wakeups,
            s.credit_waits,
            o.messages,
            o.bytes,
            c.served,
            c.in_flight,
            c.late
        );
    }
}

/// Answers one request; whether the answer went (or waits in the outbox).
fn answer(
    hub: &mut Hub,
    store: &mut HashMap<String, Bulk>,
    msg: &mut Envelope,
    shared: &mut usize,
) -> Result<bool, Error> {
    let posted = if msg.is::<Put>() {
        let responder = msg.responder::<Put>()?;
        let put: Put = msg.decode_shared()?;
        let body = msg.body().as_ptr_range();
        *shared += usize::from(body.contains(&put.value.as_ptr()));
        let replaced = store.insert(put.key, put.value).is_some();
        !matches!(hub.reply(responder, Stored { replaced })?, Posted::Full(_))
    } else if msg.is::<Get>() {
        let responder = msg.responder::<Get>()?;
        let get: Get = msg.decode()?;
        let value = Value(store.get(&get.key).cloned());
        !matches!(hub.reply(responder, value)?, Posted::Full(_))
    } else {
        let responder = msg.responder::<Delete>()?;
        let delete: Delete = msg.decode()?;
        let deleted = Deleted(store.remove(&delete.key).is_some());
        !matches!(hub.reply(responder, deleted)?, Posted::Full(_))
    };
    Ok(posted)
}

#[derive(Debug, Default)]
struct Tally {
    sent: u64,
    ok: u64,
    timed_out: u64,
    late: u64,
    mismatches: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.sent += o.sent;
        self.ok += o.ok;
        self.timed_out += o.timed_out;
        self.late += o.late;
        self.mismatches += o.mismatches;
    }
}

/// A call under way and what its answer must be.
enum Pending {
    Put(Call<Stored>, bool),
    Get(Call<Value>, Option<Bulk>),
    Delete(Call<Deleted>, bool),
}

/// One client: its own keys, a model of them, calls in flight checked as they end.
fn client(
    endpoint: &Endpoint,
    addr: SocketAddr,
    me: usize,
    requests: usize,
    cli: &Cli,
) -> Result<Tally> {
    let mut session = Session::new(endpoint.connect(addr, &Config::default())?);
    let timeout = Duration::from_millis(cli.timeout_ms);
    let mut rng = fastrand::Rng::with_seed(me as u64 + 1);
    let mut model: HashMap<String, Bulk> = HashMap::new();
    let mut flight: VecDeque<(String, Pending)> = VecDeque::new();
    let mut unknown = Vec::new(); // keys whose state a timed-out write left unknown
    let mut tally = Tally::default();
    for _ in 0..requests {
        if flight.len() == cli.in_flight {
            let (key, pending) = flight.pop_front().expect("full");
            check(&mut session, key, pending, &mut tally, &mut unknown)?;
        }
        let key = loop {
            let k = format!("c{me}-k{}", rng.usize(..64));
            if !unknown.contains(&k) && !flight.iter().any(|(f, _)| *f == k) {
                break k;
            }
        };
        let pending = match rng.u8(..10) {
            0..=3 => {
                let value = Bulk::new(value_of(&mut rng, cli.max_value));
                let replaced = model.insert(key.clone(), value.clone()).is_some();
                let put = Put {
                    key: key.clone(),
                    value,
                };
                Pending::Put(session.start_call(&put, timeout)?, replaced)
            }
            4..=7 => Pending::Get(
                session.start_call(&Get { key: key.clone() }, timeout)?,
                model.get(&key).cloned(),
            ),
            _ => Pending::Delete(
                session.start_call(&Delete { key: key.clone() }, timeout)?,
                model.remove(&key).is_some(),
            ),
        };
        tally.sent += 1;
        flight.push_back((key, pending));
    }
    while let Some((key, pending)) = flight.pop_front() {
        check(&mut session, key, pending, &mut tally, &mut unknown)?;
    }
    tally.late = session.call_stats().late;
    session.close()?;
    Ok(tally)
}

/// Waits for one call and checks its answer against the model.
fn check(
    session: &mut Session,
    key: String,
    pending: Pending,
    tally: &mut Tally,
    unknown: &mut Vec<String>,
) -> Result<()> {
    let right = match pending {
        Pending::Put(call, replaced) => session.wait(call).map(|s| s.replaced == replaced),
        Pending::Get(call, want) => session.wait(call).map(|v| v.0 == want),
        Pending::Delete(call, deleted) => session.wait(call).map(|d| d.0 == deleted),
    };
    match right {
        Ok(true) => tally.ok += 1,
        Ok(false) => tally.mismatches += 1,
        Err(Error::CallTimedOut { .. }) => {
            tally.timed_out += 1;
            unknown.push(key);
        }
        Err(e) => return Err(e).context("a call failed"),
    }
    Ok(())
}

/// A value: one in 16 large (16 KiB up to `max`), the rest 16 B to 2 KiB. Byte `i` is
/// `(i as u8) * 31 ^ seed`: a 256-byte block repeated, copied rather than computed byte by
/// byte, which in a debug build under emulation took the client's thread 5 to 11 s for 4 MiB
/// (its other calls' deadlines running meanwhile).
fn value_of(rng: &mut fastrand::Rng, max: usize) -> Vec<u8> {
    let len = if rng.u8(..16) == 0 {
        (16usize << 10 << rng.u32(..9)).min(max)
    } else {
        16 << rng.u32(..8)
    };
    let seed = rng.u8(..);
    let block: Vec<u8> = (0..=255u8).map(|i| i.wrapping_mul(31) ^ seed).collect();
    let mut value = block.repeat(len.div_ceil(block.len()));
    value.truncate(len);
    value
}
