//! Connecting through rdma_cm against the TCP bootstrap, on the same device in the same run:
//! how long a connection takes to make (the median of several), and how long after its peer's
//! process is killed a receiver asleep on it fails (the CM's disconnect against the end of
//! the bootstrap stream). A dead *host* cannot be made inside one VM: `cargo xtask vm2` and
//! the cluster measure that (liveness probes against TCP keepalive).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdmsg::transport::{Config, Connection, Endpoint};

use crate::sample::median;

/// How a connection is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// rdmsg's TCP bootstrap (`Endpoint::connect` / `listen`).
    Tcp,
    /// The RDMA connection manager (`Endpoint::connect_cm` / `listen_cm`).
    Cm,
}

impl Way {
    /// Both, TCP first.
    pub const ALL: [Way; 2] = [Way::Tcp, Way::Cm];

    /// The sample's subject.
    pub fn name(self) -> &'static str {
        match self {
            Way::Tcp => "tcp",
            Way::Cm => "rdma_cm",
        }
    }

    fn of(name: &str) -> Result<Self> {
        Ok(match name {
            "tcp" => Way::Tcp,
            "rdma_cm" => Way::Cm,
            other => bail!("no way of connecting called {other}"),
        })
    }
}

/// What one round measured.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    /// Median time to make a connection, ms.
    pub connect_ms: f64,
    /// Time from the SIGKILL of the peer's process to the failure of a receive here, ms.
    pub killed_notice_ms: f64,
}

/// The IPv4 address the endpoint's RoCE GID carries: where rdma_cm reaches this device.
fn device_ip(ep: &Endpoint) -> Result<Ipv4Addr> {
    let g = ep.gid().0;
    if g[..10].iter().all(|b| *b == 0) && g[10..12] == [0xff, 0xff] {
        Ok(Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    } else {
        bail!("the device's GID carries no IPv4 address for rdma_cm to reach")
    }
}

/// A listener of either way, accepting in a thread.
enum Listening {
    Tcp(rdmsg::transport::Listener),
    Cm(rdmsg::transport::CmListener),
}

impl Listening {
    fn open(ep: &Endpoint, way: Way) -> Result<(Self, SocketAddr)> {
        Ok(match way {
            Way::Tcp => {
                let l = ep.listen("127.0.0.1:0")?;
                let at = l.local_addr()?;
                (Listening::Tcp(l), at)
            }
            Way::Cm => {
                let l = ep.listen_cm(SocketAddr::new(IpAddr::V4(device_ip(ep)?), 0))?;
                let at = l.local_addr().context("the CM listener's address")?;
                (Listening::Cm(l), at)
            }
        })
    }

    fn accept(&self) -> Result<Connection> {
        Ok(match self {
            Listening::Tcp(l) => l.accept(&Config::default())?,
            Listening::Cm(l) => l.accept(&Config::default())?,
        })
    }
}

fn connect(ep: &Endpoint, way: Way, at: SocketAddr) -> Result<Connection> {
    Ok(match way {
        Way::Tcp => ep.connect(at, &Config::default())?,
        Way::Cm => ep.connect_cm(at, &Config::default())?,
    })
}

/// One round: `connects` connections timed, then one killed peer.
pub fn measure(way: Way, connects: usize) -> Result<Figures> {
    let ep = Endpoint::open_default()?;
    let (listening, at) = Listening::open(&ep, way)?;
    let server = std::thread::spawn(move || -> Result<Listening> {
        for _ in 0..connects {
            drop(listening.accept()?);
        }
        Ok(listening)
    });
    let mut times = Vec::with_capacity(connects);
    for _ in 0..connects {
        let t = Instant::now();
        let c = connect(&ep, way, at)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        drop(c);
    }
    let listening = crate::join(server)?;
    let killed_notice_ms = killed_notice(&listening, way, at)?;
    Ok(Figures {
        connect_ms: median(&times),
        killed_notice_ms,
    })
}

/// A peer process (`rdmsg-bench connect-peer`) connects and says hello; once its hello is
/// here it is killed, and a receive here must fail.
fn killed_notice(listening: &Listening, way: Way, at: SocketAddr) -> Result<f64> {
    let mut peer = spawn_peer(way, at)?;
    let res = (|| {
        let mut conn = listening.accept()?;
        conn.recv_timeout(Some(Duration::from_secs(30)))?
            .context("the peer's hello")?;
        let killed = Instant::now();
        peer.kill()?;
        peer.wait()?;
        match conn.recv_timeout(Some(Duration::from_secs(30))) {
            Err(_) => Ok(killed.elapsed().as_secs_f64() * 1e3),
            Ok(got) => bail!("the killed peer was not noticed: {got:?}"),
        }
    })();
    let _ = peer.kill();
    let _ = peer.wait();
    res
}

fn spawn_peer(way: Way, at: SocketAddr) -> Result<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args(["connect-peer", way.name(), &at.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?)
}

/// `rdmsg-bench connect-peer WAY ADDR`: connects, sends a solicited hello, and waits to be
/// killed (a minute at most).
pub fn peer_main(args: &[String]) -> Result<()> {
    let [way, at] = args else {
        bail!("usage: rdmsg-bench connect-peer tcp|rdma_cm ADDR");
    };
    let at: SocketAddr = at.parse().context("the address")?;
    let ep = Endpoint::open_default()?;
    let mut conn = connect(&ep, Way::of(way)?, at)?;
    conn.send(b"hello", true)?;
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}
