//! The bootstrap TCP stream once the handshake is done: what may still come on it (a goodbye,
//! its end, or junk), keepalive probing of a silent peer host, and accepting clients.

use std::io::{self, Read};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use crate::core::StreamNews;
use crate::error::Error;
use crate::handshake::GOODBYE;

/// The error of bootstrap stream I/O at `stage`.
pub(crate) fn bootstrap_err(stage: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Bootstrap { stage, source }
}

/// Keepalive probing that gives up on a silent peer after about `limit`: see
/// [`keepalive_schedule`].
pub(crate) fn keepalive_probes(limit: Duration) -> socket2::TcpKeepalive {
    let (idle, interval, probes) = keepalive_schedule(limit);
    socket2::TcpKeepalive::new()
        .with_time(idle)
        .with_interval(interval)
        .with_retries(probes)
}

/// (idle time before the first probe, interval, probes) for a keepalive that gives up after
/// about `limit`: half of it idle, the other half probing once a second (at least 3 probes, at
/// most 30, spread out beyond that). A lossy link drops probes and their answers too: at 5 %
/// loss each way one probe in ten goes unanswered, so a peer is declared gone only after
/// every probe of a row failed, and the more a row holds, the rarer a false alarm.
pub(crate) fn keepalive_schedule(limit: Duration) -> (Duration, Duration, u32) {
    // Linux refuses an idle time or interval above 32,767 s: longer limits probe at most so.
    let secs = limit.as_secs().clamp(3, 2 * MAX_KEEPALIVE_SECS);
    let idle = secs / 2;
    let probing = secs - idle;
    let probes = probing.clamp(3, 30);
    let interval = (probing / probes).max(1);
    (
        Duration::from_secs(idle),
        Duration::from_secs(interval),
        probes as u32,
    )
}

/// The longest idle time and probe interval Linux takes (`MAX_TCP_KEEPIDLE`,
/// `MAX_TCP_KEEPINTVL`).
const MAX_KEEPALIVE_SECS: u64 = 32_767;

/// What the non-blocking bootstrap `stream` brings now that the handshake is done, where at
/// most a goodbye may come: read by a connection's liveness check and by the hub when the
/// stream is readable.
pub(crate) fn read_after_handshake(stream: &TcpStream) -> StreamNews {
    let mut buf = [0u8; 64];
    let (n, eof) = match (&*stream).read(&mut buf) {
        Ok(0) => (0, true),
        Ok(n) => (n, false),
        Err(e) => (
            0,
            !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        ),
    };
    if let Some((_, &byte)) = buf[..n]
        .iter()
        .enumerate()
        .find(|&(i, &b)| i > 0 || b != GOODBYE)
    {
        StreamNews::Garbage(byte)
    } else if n == 1 {
        StreamNews::Goodbye
    } else if eof {
        StreamNews::Ended
    } else {
        StreamNews::Nothing
    }
}

/// Accepts the next waiting client on the non-blocking `tcp`: `Ok(None)` when none waits;
/// interrupted calls and clients gone before they were accepted are skipped.
pub(crate) fn accept_next(tcp: &TcpListener) -> io::Result<Option<TcpStream>> {
    loop {
        match tcp.accept() {
            Ok((s, _)) => return Ok(Some(s)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalive_stays_within_what_linux_takes() {
        for limit in [Duration::from_secs(100_000), Duration::MAX] {
            let (idle, interval, probes) = keepalive_schedule(limit);
            assert_eq!(idle.as_secs(), MAX_KEEPALIVE_SECS);
            assert!(interval.as_secs() <= MAX_KEEPALIVE_SECS && probes <= 30);
        }
    }

    #[test]
    fn keepalive_gives_up_after_about_its_limit_with_more_probes_for_longer_limits() {
        let total = |(idle, interval, probes): (Duration, Duration, u32)| {
            (idle + interval * probes).as_secs()
        };
        for (limit, probes) in [(3, 3), (5, 3), (10, 5), (20, 10), (60, 30), (7200, 30)] {
            let s = keepalive_schedule(Duration::from_secs(limit));
            assert_eq!(s.2, probes, "{limit} s");
            assert!(s.1 >= Duration::from_secs(1), "{limit} s");
            let t = total(s);
            assert!(
                t >= limit && t <= limit + 1,
                "{limit} s gives up after {t} s"
            );
        }
    }
}
