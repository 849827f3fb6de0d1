//! Large messages: rdmsg's rendezvous (the receiver reads the payload straight from the
//! sender's memory) against its fragmentation into receive buffers, each a one-way stream of
//! `Bulk` payloads between two sessions on the device's loopback, measured at the receiver; the
//! runner sets them next to perftest moving the same bytes by RDMA read (`ib_read_bw`) and by
//! send (`ib_send_bw`).

use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use rdmsg::msg::Session;
use rdmsg::transport::Config;
use rdmsg::{Bulk, SessionConfig, SessionStats};
use serde::{Deserialize, Serialize};

use crate::join;
use crate::rdmsg::expect_close;

/// A large message: an id and a payload that, by rendezvous, the peer reads from where it is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Blob {
    /// Its number in the stream.
    pub id: u32,
    /// The payload (shared, never copied to be sent by rendezvous).
    pub data: Bulk,
}
rdmsg::msg::message!(Blob, tag = "rdmsg.bench.Blob");

/// [`Blob`] read in place, as a receiver that only looks at the bytes would: the payload stays
/// in the buffer it arrived in (the rendezvous read's, or the reassembled fragments').
#[derive(Debug, Serialize, Deserialize)]
pub struct BlobView<'a> {
    /// Its number in the stream.
    pub id: u32,
    /// The payload, borrowed.
    #[serde(borrow, with = "serde_bytes")]
    pub data: &'a [u8],
}
rdmsg::msg::message!(BlobView<'_>, tag = "rdmsg.bench.Blob");

/// The receiver's word that it has every message. The sender closes only then: a close while
/// the receiver may still be reading lent payloads would cut those reads short (`close` waits
/// for them only its `close_timeout`, shorter than a 16 MiB read may take under emulation).
#[derive(Debug, Serialize, Deserialize)]
struct Received {
    messages: u32,
}
rdmsg::msg::message!(Received, tag = "rdmsg.bench.Received");

/// Fewest messages per run: the 16 MiB ones move 128 MiB, enough for a steady figure.
pub const MIN_MESSAGES: usize = 8;
/// Most messages per run: with 16 KiB ones that is 31 MiB, and each message costs some
/// hundreds of µs under emulation whatever its size.
pub const MAX_MESSAGES: usize = 2000;

/// Messages per run of `size`-byte payloads (perftest's iterations, the same for rdmsg): about
/// `bytes` in all, between [`MIN_MESSAGES`] and [`MAX_MESSAGES`].
pub fn messages(size: usize, bytes: usize) -> usize {
    (bytes / size.max(1)).clamp(MIN_MESSAGES, MAX_MESSAGES)
}

/// How the sender sends its large messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// By rendezvous (the default threshold, 16 KiB): a descriptor, then the receiver's read.
    Rendezvous,
    /// In fragments of one receive buffer each (`rendezvous_threshold: None`), reassembled by
    /// the receiver.
    Fragmentation,
}

impl Path {
    /// Both, in report order.
    pub const ALL: [Path; 2] = [Path::Rendezvous, Path::Fragmentation];

    /// Name in samples (their variant) and tables.
    pub fn name(self) -> &'static str {
        match self {
            Path::Rendezvous => "rendezvous",
            Path::Fragmentation => "fragmentation",
        }
    }
}

/// What the receiver of a stream paid and got.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Payload MiB per second, from the first send to the last message decoded (perftest's
    /// `MB/sec` are MiB too).
    pub mib_per_s: f64,
    /// Receiver thread user-space CPU time (`RUSAGE_THREAD`'s `ru_utime`) per MiB of payload,
    /// µs: rdmsg's own work. Soft-RoCE does the device's work in the kernel, much of it in
    /// the thread that posts (a reader's `ibv_post_send` runs the whole loopback read, both
    /// copies included), which a NIC would do without the CPU: that is `cpu_all_us_per_mib`.
    pub cpu_us_per_mib: f64,
    /// Receiver thread CPU time with the kernel's (`CLOCK_THREAD_CPUTIME_ID`) per MiB, µs.
    pub cpu_all_us_per_mib: f64,
}

/// Room besides the payload for the encoding (id, length prefix) and the frame header.
const ENCODING_ROOM: usize = 4096;

/// A session for `size`-byte payloads sent by `path`: the default, but with room for the whole
/// message (a 16 MiB payload and its encoding exceed the default 16 MiB bound).
fn session_config(size: usize, path: Path) -> SessionConfig {
    let defaults = SessionConfig::default();
    SessionConfig {
        max_message: defaults.max_message.max(size + ENCODING_ROOM),
        rendezvous_threshold: match path {
            Path::Rendezvous => defaults.rendezvous_threshold,
            Path::Fragmentation => None,
        },
        ..defaults
    }
}

/// A one-way stream of `count` [`Blob`]s of `size` payload bytes sent by `path`, both sides
/// with the default transport configuration (4 KiB receive buffers); the receiver (sessions'
/// defaults otherwise) decodes each as a [`BlobView`] and checks its length only: under
/// emulation a copy or a check of the bytes would cost more than moving them.
pub fn stream(path: Path, size: usize, count: usize) -> Result<Measured> {
    let (rx, tx) = rdmsg::transport::loopback_pair(&Config::default(), &Config::default())?;
    // The receiver's own sends (its reply) are tiny: its threshold does not matter.
    let rx_config = session_config(size, Path::Rendezvous);
    // The first messages warm both sides up (the receiver's read buffers are registered
    // then, once); the figures are of the rest, timed at the receiver.
    let warm = (count / 4).min(8);
    let receiver = thread::spawn(
        move || -> Result<(Duration, (Duration, Duration), SessionStats)> {
            let mut r = Session::with_config(rx, rx_config);
            let mut start = (
                Instant::now(),
                rdmsg::verbs::thread_cpu_time(),
                rdmsg::verbs::thread_user_time(),
            );
            for i in 0..count {
                if i == warm {
                    start = (
                        Instant::now(),
                        rdmsg::verbs::thread_cpu_time(),
                        rdmsg::verbs::thread_user_time(),
                    );
                }
                let env = r.recv()?;
                let m: BlobView = env.decode_borrowed()?;
                if m.data.len() != size || m.id != i as u32 {
                    bail!(
                        "message {i}: id {} of {} bytes, sent {size}",
                        m.id,
                        m.data.len()
                    );
                }
            }
            let cpu = (
                rdmsg::verbs::thread_cpu_time() - start.1,
                rdmsg::verbs::thread_user_time() - start.2,
            );
            let elapsed = start.0.elapsed();
            let stats = r.stats();
            r.send(&Received {
                messages: count as u32,
            })?;
            expect_close(&mut r)?;
            Ok((elapsed, cpu, stats))
        },
    );
    let mut t = Session::with_config(tx, session_config(size, path));
    // Made once: every message shares these bytes, as a server sending one file would.
    let data = Bulk::from(vec![0xa5; size]);
    let sent = match send_all(&mut t, &data, count) {
        Ok(stats) => stats,
        Err(e) => {
            // Dropping the session ends a receiver still waiting; its failure, if it had one
            // of its own, may be what failed ours.
            drop(t);
            return Err(match join(receiver) {
                Ok(_) => e,
                Err(theirs) => e.context(format!("the receiver failed: {theirs:#}")),
            });
        }
    };
    t.close()?;
    let (elapsed, cpu, received) = join(receiver)?;
    check_path(path, count, &sent, &received)?;
    let mib = ((count - warm) * size) as f64 / f64::from(1 << 20);
    Ok(Measured {
        mib_per_s: mib / elapsed.as_secs_f64(),
        cpu_us_per_mib: cpu.1.as_secs_f64() * 1e6 / mib,
        cpu_all_us_per_mib: cpu.0.as_secs_f64() * 1e6 / mib,
    })
}

/// Sends `count` [`Blob`]s of `data` and waits for the receiver's [`Received`]; the sender's
/// statistics.
fn send_all(t: &mut Session, data: &Bulk, count: usize) -> Result<SessionStats> {
    for id in 0..count {
        t.send(&Blob {
            id: id as u32,
            data: data.clone(),
        })?;
    }
    let env = t.recv()?;
    let reply: Received = env.decode()?;
    if reply.messages as usize != count {
        bail!("the receiver got {} messages, sent {count}", reply.messages);
    }
    Ok(t.stats())
}

/// Whether every message went the way it was meant to (else the figure would be another
/// path's under this one's name).
fn check_path(
    path: Path,
    count: usize,
    sent: &SessionStats,
    received: &SessionStats,
) -> Result<()> {
    let count = count as u64;
    let ok = match path {
        Path::Rendezvous => sent.rendezvous_sent == count && received.rendezvous_received == count,
        Path::Fragmentation => sent.fragmented == count && received.rendezvous_received == 0,
    };
    if !ok {
        bail!(
            "{count} messages by {}, but {} sent by rendezvous, {} fragmented, {} received by \
             rendezvous",
            path.name(),
            sent.rendezvous_sent,
            sent.fragmented,
            received.rendezvous_received
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_move_about_64_mib_within_the_bounds() {
        let bytes = 64 << 20;
        assert_eq!(messages(16 << 10, bytes), MAX_MESSAGES);
        assert_eq!(messages(256 << 10, bytes), 256);
        assert_eq!(messages(1 << 20, bytes), 64);
        assert_eq!(messages(16 << 20, bytes), MIN_MESSAGES);
    }

    #[test]
    fn a_view_reads_what_a_blob_encodes() {
        let blob = Blob {
            id: 7,
            data: Bulk::from(vec![1, 2, 3]),
        };
        let plain = bincode::serde::encode_to_vec(&blob, bincode::config::standard()).unwrap();
        let (view, _): (BlobView, usize) =
            bincode::serde::borrow_decode_from_slice(&plain, bincode::config::standard()).unwrap();
        assert_eq!((view.id, view.data), (7, &[1u8, 2, 3][..]));
        use rdmsg::msg::Message;
        assert_eq!(Blob::TAG, BlobView::TAG);
    }

    #[test]
    fn the_16_mib_payload_fits_and_only_rendezvous_has_a_threshold() {
        let c = session_config(16 << 20, Path::Fragmentation);
        assert!(c.max_message >= (16 << 20) + 64);
        assert_eq!(c.rendezvous_threshold, None);
        let c = session_config(16 << 10, Path::Rendezvous);
        assert_eq!(c.max_message, SessionConfig::default().max_message);
        assert_eq!(c.rendezvous_threshold, Some(16 << 10));
    }
}
