//! A small pub/sub broker on `rdmsg::tokio`: a listener with a task per client. Publishers
//! send `Publish`; subscribers send `Subscribe` and get `Event`s, each from a writer task fed by
//! a bounded queue, so a slow subscriber never stalls the others: when its queue is full, its
//! events are dropped and counted. SIGTERM or ctrl-c stops it gracefully: no more clients,
//! queued events get a second to go, every session is closed, and one summary line.
//!
//! ```text
//! broker --serve ADDR [--queue N] [--exit-after-ms N]
//! broker --publish ADDR [--count N] [--topics K]      message seq goes to topic t{seq % K}
//! broker --subscribe ADDR [--topic T]... [--slow-ms N]
//! broker                                              all of it here, checked
//! ```
//!
//! With no role it runs the broker, `--publishers` publishers and `--subscribers` subscribers
//! as tasks of one runtime (the last subscriber slow: every topic, 20 ms per event), checks that
//! every fast subscriber got every event of its topics once, in order per publisher, intact, and
//! that the slow one missed only what the broker counted as dropped, and ends with one line:
//!
//! ```text
//! broker: published=2000 delivered=... dropped_slow=... missing=0 duplicates=0 out_of_order=0 corrupt=0 shutdown_ms=...
//! ```

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use futures::future::join_all;
use futures::{SinkExt, StreamExt};
use rdmsg::tokio::{AsyncListener, AsyncSession};
use rdmsg::{message, Bulk, Config, Endpoint, SessionConfig};
use serde::{Deserialize, Serialize};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

/// A small pub/sub broker on rdmsg::tokio. With no role: broker, publishers and subscribers in
/// this process, every event checked, one `broker: key=value ...` line (non-zero exit on any
/// event missing, duplicated, out of order or corrupt).
#[derive(Debug, Parser)]
#[command(name = "broker")]
struct Cli {
    /// Run the broker alone at ADDR, until SIGTERM, ctrl-c or --exit-after-ms
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["publish", "subscribe"])]
    serve: Option<SocketAddr>,
    /// Publish --count messages over --topics topics to the broker at ADDR
    #[arg(long, value_name = "ADDR", conflicts_with = "subscribe")]
    publish: Option<SocketAddr>,
    /// Subscribe to each --topic at the broker at ADDR, until the broker closes
    #[arg(long, value_name = "ADDR")]
    subscribe: Option<SocketAddr>,
    /// Messages per publisher (1 in 16 large: 16 KiB to 256 KiB, the rest 16 B to 2 KiB)
    #[arg(long, value_name = "N", default_value_t = 500)]
    count: u64,
    /// Topics a publisher spreads its messages over: t0, t1, ...
    #[arg(long, value_name = "K", default_value_t = 4)]
    topics: u64,
    /// A topic to subscribe to (repeat for several)
    #[arg(long = "topic", value_name = "T", default_value = "t0")]
    topic: Vec<String>,
    /// Sleep this long after each event: a slow subscriber [default: 0; the demo's slow one: 20]
    #[arg(long, value_name = "MS")]
    slow_ms: Option<u64>,
    /// Publishers of the demo
    #[arg(long, value_name = "P", default_value_t = 4)]
    publishers: u64,
    /// Subscribers of the demo, the last one slow
    #[arg(long, value_name = "S", default_value_t = 8)]
    subscribers: u64,
    /// Events queued per subscriber; beyond that its events are dropped (and counted)
    #[arg(long, value_name = "N", default_value_t = 512)]
    queue: usize,
    /// Shut down after this long, as on SIGTERM (0: never)
    #[arg(long, value_name = "MS", default_value_t = 0)]
    exit_after_ms: u64,
}

/// A publisher's message, passed on to the topic's subscribers as an [`Event`].
#[derive(Serialize, Deserialize)]
struct Publish {
    topic: String,
    seq: u64,
    payload: Bulk,
}
#[derive(Serialize, Deserialize)]
struct Subscribe {
    topic: String,
}
/// The broker's answer to [`Subscribe`]: every event published from now on will come.
#[derive(Serialize, Deserialize)]
struct Subscribed {
    topic: String,
}
/// A published message, stamped with its publisher (the broker's number for its connection).
#[derive(Clone, Serialize, Deserialize)]
struct Event {
    topic: String,
    publisher: u64,
    seq: u64,
    payload: Bulk,
}
// Publishers stream: unsolicited, the broker wakes once per batch (when the publisher waits
// for credits, and at its flush), not once per message.
message!(Publish, solicited = false);
message!(Subscribe);
message!(Subscribed);
message!(Event);

/// Message `seq`'s payload: its seq, then a fixed pattern, so any receiver can check it.
fn payload(seq: u64) -> Vec<u8> {
    let len = if seq % 16 == 15 {
        16 << 10 << (seq / 16 % 5)
    } else {
        16 << (seq % 8)
    };
    let mut p = pattern()[..len].to_vec();
    p[..8].copy_from_slice(&seq.to_le_bytes());
    p
}
fn pattern() -> &'static [u8] {
    static PATTERN: OnceLock<Vec<u8>> = OnceLock::new();
    PATTERN.get_or_init(|| (0..256 << 10).map(|i| (i % 251) as u8).collect())
}

/// How long, at shutdown, queued events may still go.
const GRACE: Duration = Duration::from_secs(1);

/// A subscriber: its connection, and the queue its writer task sends from.
type Subscriber = (u64, mpsc::Sender<Event>);

/// What the connection tasks share.
struct Broker {
    /// Events queued per subscriber.
    queue: usize,
    /// Becomes true at shutdown.
    closing: watch::Sender<bool>,
    /// Each topic's subscribers. Locked for non-blocking steps only.
    topics: Mutex<HashMap<String, Vec<Subscriber>>>,
    /// Every client's session, to close at shutdown: any handle closes a session.
    sessions: Mutex<HashMap<u64, AsyncSession>>,
    published: AtomicU64,
    delivered: AtomicU64,
    dropped: AtomicU64,
}

impl Broker {
    fn topics(&self) -> MutexGuard<'_, HashMap<String, Vec<Subscriber>>> {
        self.topics.lock().unwrap()
    }
    fn sessions(&self) -> MutexGuard<'_, HashMap<u64, AsyncSession>> {
        self.sessions.lock().unwrap()
    }

    /// Adds a subscriber to `topic` (once).
    fn subscribe(&self, topic: &str, conn: u64, queue: &mpsc::Sender<Event>) {
        let mut topics = self.topics();
        let subscribers = topics.entry(topic.to_owned()).or_default();
        if !subscribers.iter().any(|(c, _)| *c == conn) {
            subscribers.push((conn, queue.clone()));
        }
    }

    /// Queues the event for every subscriber of its topic without waiting: a subscriber whose
    /// queue is full loses it (counted), and nobody else notices.
    fn publish(&self, publisher: u64, p: Publish) {
        let (topic, seq, payload) = (p.topic, p.seq, p.payload);
        let event = Event {
            topic,
            publisher,
            seq,
            payload,
        };
        self.published.fetch_add(1, Relaxed);
        for (_, queue) in self.topics().get(&event.topic).into_iter().flatten() {
            if let Err(mpsc::error::TrySendError::Full(_)) = queue.try_send(event.clone()) {
                self.dropped.fetch_add(1, Relaxed);
            }
        }
    }
}

/// One client, publisher or subscriber or both, until it leaves or the broker shuts down.
async fn connection(broker: Arc<Broker>, conn: u64, session: AsyncSession) {
    let mut closing = broker.closing.subscribe();
    let mut messages = session.stream();
    let (mut queue, mut writer) = (None, None);
    loop {
        let next = tokio::select! {
            _ = closing.wait_for(|c| *c) => break,
            next = messages.next() => next, // cancel-safe: taken only when returned
        };
        let mut env = match next {
            Some(Ok(env)) => env,
            Some(Err(e)) => {
                eprintln!("broker: client {conn}: {e}");
                continue; // after a fatal error, the stream ends
            }
            None => break, // the client closed, or its connection failed
        };
        if env.is::<Publish>() {
            // A large payload stays where it was read: every subscriber's event shares it.
            match env.decode_shared::<Publish>() {
                Ok(p) => broker.publish(conn, p),
                Err(e) => eprintln!("broker: client {conn}: {e}"),
            }
        } else if let Ok(Subscribe { topic }) = env.decode() {
            // Its writer task, fed by a bounded queue, at its first subscription.
            let tx = queue.get_or_insert_with(|| {
                let (tx, rx) = mpsc::channel(broker.queue);
                let (b, s) = (broker.clone(), session.clone());
                writer = Some(tokio::spawn(write_events(b, s, rx)));
                tx
            });
            broker.subscribe(&topic, conn, tx);
            if session.send(&Subscribed { topic }).await.is_err() {
                break;
            }
        }
    }
    // Unsubscribed, its queue has no sender left: the writer sends what is queued, and ends.
    for subscribers in broker.topics().values_mut() {
        subscribers.retain(|(c, _)| *c != conn);
    }
    drop(queue);
    if let Some(writer) = writer {
        let _ = writer.await;
    }
    if !*closing.borrow() {
        // The client left: the last handle dropped tears its session down, off the runtime.
        broker.sessions().remove(&conn);
    }
}

/// A subscriber's writer: its events, in order, until its queue ends. At shutdown what is
/// still queued after the grace period is dropped and counted.
async fn write_events(
    broker: Arc<Broker>,
    session: AsyncSession,
    mut queue: mpsc::Receiver<Event>,
) {
    let mut closing = broker.closing.subscribe();
    let cut_off = async move {
        let _ = closing.wait_for(|c| *c).await;
        tokio::time::sleep(GRACE).await;
    };
    tokio::pin!(cut_off);
    let mut lost = 0;
    loop {
        let event = tokio::select! {
            event = queue.recv() => event,
            () = &mut cut_off => None,
        };
        let Some(event) = event else { break };
        // Room first, then the event. `reserve` is cancel-safe: cut off while it waits, it
        // sent nothing, and `event` is still ours to count. The permit's `send` then commits
        // at once: the event goes whole and in order, never half.
        let permit = tokio::select! {
            permit = session.reserve() => permit,
            () = &mut cut_off => {
                lost += 1;
                break;
            }
        };
        if permit.and_then(|p| p.send(&event)).is_err() {
            lost += 1; // the subscriber is gone
            break;
        }
        broker.delivered.fetch_add(1, Relaxed);
    }
    queue.close();
    while queue.try_recv().is_ok() {
        lost += 1;
    }
    broker.dropped.fetch_add(lost, Relaxed);
}

/// What the broker did.
struct Report {
    published: u64,
    delivered: u64,
    dropped: u64,
    failed_handshakes: u64,
    shutdown_ms: u128,
}

/// The broker until `shutdown`; then it stops accepting, lets every client's tasks wind down,
/// closes every session and reports.
async fn serve(
    listener: AsyncListener,
    queue: usize,
    shutdown: impl Future<Output = ()>,
) -> Result<Report> {
    let broker = Arc::new(Broker {
        queue,
        closing: watch::channel(false).0,
        topics: Mutex::default(),
        sessions: Mutex::default(),
        published: AtomicU64::new(0),
        delivered: AtomicU64::new(0),
        dropped: AtomicU64::new(0),
    });
    let (mut clients, mut tasks) = (listener.incoming(), JoinSet::new());
    tokio::pin!(shutdown);
    for conn in 1u64.. {
        let client = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.join_next() => continue, // a client that left
            client = clients.next() => client,
        };
        match client {
            Some(Ok(session)) => {
                broker.sessions().insert(conn, session.clone());
                tasks.spawn(connection(broker.clone(), conn, session));
            }
            // Its handshake failed: the listener goes on.
            Some(Err(e)) => eprintln!("broker: a client failed to connect: {e}"),
            None => break, // the listener failed (its error came just before)
        }
    }
    let started = Instant::now();
    let failed_handshakes = listener.failed_handshakes();
    drop((clients, listener));
    broker.closing.send_replace(true);
    broker.topics().clear();
    while tasks.join_next().await.is_some() {}
    // Every session left, closed at once from here: what was committed goes first.
    let sessions: Vec<_> = broker.sessions().drain().map(|(_, s)| s).collect();
    for closed in join_all(sessions.iter().map(|s| s.close())).await {
        match closed {
            Err(e) if !e.is_peer_closed() => eprintln!("broker: closing a session: {e}"),
            _ => {}
        }
    }
    Ok(Report {
        published: broker.published.load(Relaxed),
        delivered: broker.delivered.load(Relaxed),
        dropped: broker.dropped.load(Relaxed),
        failed_handshakes,
        shutdown_ms: started.elapsed().as_millis(),
    })
}

/// The broker's listener. Closing waits for the peer to read what came before the close:
/// time for a slow subscriber.
fn listen(ep: &Endpoint, addr: SocketAddr) -> Result<AsyncListener> {
    let close_timeout = Duration::from_secs(10);
    let config = Config {
        close_timeout,
        ..Config::default()
    };
    let session = SessionConfig::default();
    Ok(AsyncListener::bind(ep, addr, config, session)?)
}

async fn connect(ep: &Endpoint, addr: SocketAddr) -> Result<AsyncSession> {
    Ok(AsyncSession::connect(ep, addr, Config::default(), SessionConfig::default()).await?)
}

/// A publisher: message `seq` to topic `t{seq % topics}`, then a graceful close.
async fn publisher(ep: Endpoint, addr: SocketAddr, count: u64, topics: u64) -> Result<()> {
    let session = connect(&ep, addr).await?;
    let mut sink = session.sink();
    for seq in 0..count {
        let (topic, payload) = (format!("t{}", seq % topics), Bulk::new(payload(seq)));
        sink.feed(Publish {
            topic,
            seq,
            payload,
        })
        .await?; // waits for room, no flush
    }
    // All of it sent.
    sink.flush().await?;
    Ok(session.close().await?)
}

/// What a subscriber saw.
#[derive(Debug, Default)]
struct Seen {
    received: u64,
    duplicates: u64,
    out_of_order: u64,
    corrupt: u64,
    seen: HashSet<(u64, u64)>,
    last: HashMap<u64, u64>,
}

impl Seen {
    fn check(&mut self, ev: &Event, topics: &[String]) {
        self.received += 1;
        let intact = ev.payload[..] == payload(ev.seq)[..] && topics.contains(&ev.topic);
        self.corrupt += u64::from(!intact);
        if !self.seen.insert((ev.publisher, ev.seq)) {
            self.duplicates += 1;
        } else if self.last.insert(ev.publisher, ev.seq) > Some(ev.seq) {
            self.out_of_order += 1;
        }
    }
}

/// A subscriber: subscribes to `topics`, then checks every event until the broker closes.
/// `ready` fires once every subscription is acknowledged, `done` once that many events came.
async fn subscriber(
    ep: Endpoint,
    addr: SocketAddr,
    topics: Vec<String>,
    slow: Duration,
    ready: oneshot::Sender<()>,
    mut done: Option<(u64, oneshot::Sender<()>)>,
) -> Result<Seen> {
    let (mut sink, mut stream) = connect(&ep, addr).await?.split();
    for topic in &topics {
        sink.send(Subscribe {
            topic: topic.clone(),
        })
        .await?;
    }
    let (mut ready, mut acks, mut seen) = (Some(ready), 0, Seen::default());
    while let Some(env) = stream.next().await {
        let mut env = env?;
        if let Ok(ev) = env.decode_shared::<Event>() {
            seen.check(&ev, &topics);
            if done
                .as_ref()
                .is_some_and(|(n, _)| seen.received - seen.duplicates == *n)
            {
                done.take().map(|(_, tx)| tx.send(()));
            }
            if !slow.is_zero() {
                tokio::time::sleep(slow).await;
            }
        } else if env.decode::<Subscribed>().is_ok() {
            acks += 1;
            if acks == topics.len() {
                ready.take().map(|tx| tx.send(()));
            }
        }
    }
    Ok(seen) // the stream ended: the broker closed
}

/// Broker, publishers and subscribers here; every event checked.
async fn demo(cli: &Cli) -> Result<()> {
    let (p, t, count) = (cli.publishers, cli.topics, cli.count);
    ensure!(
        p > 0 && cli.subscribers > 0,
        "--publishers and --subscribers must be at least 1"
    );
    // A fast subscriber may be late (under emulation, very): its queue holds a topic's burst.
    let burst = p * count.div_ceil(t);
    ensure!(
        burst <= cli.queue as u64,
        "--queue {} is less than a topic's {burst} events",
        cli.queue
    );
    let started = Instant::now();
    let ep = Endpoint::open_default()?;
    let listener = listen(&ep, ([127, 0, 0, 1], 0).into())?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let broker = tokio::spawn(serve(listener, cli.queue, async {
        let _ = stopped.await;
    }));
    let (mut subs, mut ready, mut done) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..cli.subscribers {
        // One topic each; the last subscriber slow, on every topic.
        let slow = i + 1 == cli.subscribers;
        let topics: Vec<u64> = if slow { (0..t).collect() } else { vec![i % t] };
        let expect = topics
            .iter()
            .map(|k| p * ((count + t - 1 - k) / t))
            .sum::<u64>();
        let names = topics.iter().map(|k| format!("t{k}")).collect();
        let pace = Duration::from_millis(if slow { cli.slow_ms.unwrap_or(20) } else { 0 });
        let (ready_tx, ready_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let finish = (!slow).then_some((expect, done_tx));
        let sub = tokio::spawn(subscriber(ep.clone(), addr, names, pace, ready_tx, finish));
        subs.push((slow, expect, sub));
        ready.push(ready_rx);
        done.extend((!slow).then_some(done_rx));
    }
    for r in ready {
        r.await.context("a subscriber failed before subscribing")?;
    }
    let publishers: Vec<_> = (0..p)
        .map(|_| tokio::spawn(publisher(ep.clone(), addr, count, t)))
        .collect();
    for publisher in publishers {
        publisher.await??;
    }
    // Shut down as SIGTERM would, once the fast subscribers have everything (a minute at most).
    let _ = tokio::time::timeout(Duration::from_secs(60), join_all(done)).await;
    let _ = stop.send(());
    let report = broker.await??;
    let (mut received, mut missing, mut duplicates, mut out_of_order, mut corrupt) =
        (0, 0, 0, 0, 0);
    for (slow, expect, sub) in subs {
        let seen = sub.await??;
        // Only the slow subscriber may miss events: those the broker counted as dropped.
        let excused = if slow { report.dropped } else { 0 };
        missing += expect.abs_diff(seen.received - seen.duplicates + excused);
        received += seen.received;
        duplicates += seen.duplicates;
        out_of_order += seen.out_of_order;
        corrupt += seen.corrupt;
    }
    println!(
        "broker: published={} delivered={} dropped_slow={} missing={missing} duplicates={duplicates} \
         out_of_order={out_of_order} corrupt={corrupt} shutdown_ms={} received={received} \
         publishers={p} subscribers={} secs={:.2}",
        report.published,
        report.delivered,
        report.dropped,
        report.shutdown_ms,
        cli.subscribers,
        started.elapsed().as_secs_f64()
    );
    ensure!(
        missing + duplicates + out_of_order + corrupt == 0,
        "events lost, repeated, reordered or corrupt"
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rdmsg_examples::run(|| tokio::runtime::Runtime::new()?.block_on(run(cli)))
}

async fn run(cli: Cli) -> Result<()> {
    ensure!(cli.topics > 0, "--topics must be at least 1");
    if let Some(addr) = cli.serve {
        let ep = Endpoint::open_default()?;
        let listener = listen(&ep, addr)?;
        // Handlers in place before anyone can know where to send a signal.
        let (mut term, mut int) = (
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        );
        println!("broker: listening on {}", listener.local_addr()?);
        let after = cli.exit_after_ms;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
                () = tokio::time::sleep(Duration::from_millis(after)), if after > 0 => {}
            }
        };
        let r = serve(listener, cli.queue, shutdown).await?;
        println!(
            "broker: published={} delivered={} dropped_slow={} failed_handshakes={} shutdown_ms={}",
            r.published, r.delivered, r.dropped, r.failed_handshakes, r.shutdown_ms
        );
    } else if let Some(addr) = cli.publish {
        publisher(Endpoint::open_default()?, addr, cli.count, cli.topics).await?;
        println!("publisher: published={}", cli.count);
    } else if let Some(addr) = cli.subscribe {
        let (ready_tx, ready) = oneshot::channel();
        let slow = Duration::from_millis(cli.slow_ms.unwrap_or(0));
        let (ep, topics) = (Endpoint::open_default()?, cli.topic.clone());
        let sub = tokio::spawn(subscriber(ep, addr, topics, slow, ready_tx, None));
        if ready.await.is_ok() {
            println!("subscriber: subscribed to {}", cli.topic.join(","));
        }
        let s = sub.await??;
        println!(
            "subscriber: received={} duplicates={} out_of_order={} corrupt={}",
            s.received, s.duplicates, s.out_of_order, s.corrupt
        );
        ensure!(
            s.duplicates + s.out_of_order + s.corrupt == 0,
            "events repeated, reordered or corrupt"
        );
    } else {
        demo(&cli).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(publisher: u64, seq: u64) -> Event {
        let (topic, payload) = ("t0".to_owned(), Bulk::new(payload(seq)));
        Event {
            topic,
            publisher,
            seq,
            payload,
        }
    }

    #[test]
    fn payloads_are_16_bytes_to_256_kib() {
        let lens: Vec<usize> = (0..80).map(|seq| payload(seq).len()).collect();
        assert_eq!(
            (lens.iter().min(), lens.iter().max()),
            (Some(&16), Some(&(256 << 10)))
        );
        assert_eq!(lens.iter().filter(|&&l| l >= 16 << 10).count(), 5);
    }

    #[test]
    fn a_subscriber_sees_duplicates_reordering_and_corruption() {
        let topics = ["t0".to_owned()];
        let mut seen = Seen::default();
        for (publisher, seq) in [(1, 0), (2, 0), (1, 15), (1, 15), (1, 4)] {
            seen.check(&event(publisher, seq), &topics);
        }
        let mut damaged = event(2, 31);
        damaged.payload = Bulk::new(payload(30));
        seen.check(&damaged, &topics);
        let mut elsewhere = event(2, 47);
        elsewhere.topic = "t1".to_owned();
        seen.check(&elsewhere, &topics);
        let counts = (
            seen.received,
            seen.duplicates,
            seen.out_of_order,
            seen.corrupt,
        );
        assert_eq!(counts, (7, 1, 1, 2));
    }
}
