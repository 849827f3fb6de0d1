//! Host-only: the cost of rdmsg's framing (header, tag check, bincode under a limit) next to
//! plain bincode on the same values, in ns per message.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{bail, Result};
use rdmsg::msg::{codec, frame, Message};
use serde::{Deserialize, Serialize};

use crate::rdmsg::Payload;

/// A small fixed-layout message, like a sensor reading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    /// Sensor number.
    pub sensor: u16,
    /// Sequence number.
    pub seq: u64,
    /// Value.
    pub value: f64,
}
rdmsg::msg::message!(Reading, tag = "rdmsg.bench.Reading");

/// A job of the `jobq` example: numbers decoded one by one (a sequence of 20,000 varints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Numbers {
    /// The numbers.
    pub numbers: Vec<u32>,
}
rdmsg::msg::message!(Numbers, tag = "rdmsg.bench.Numbers");

/// One codec measurement: ns per message for rdmsg and for plain bincode.
#[derive(Debug, Clone)]
pub struct CodecResult {
    /// `encode` or `decode`.
    pub op: &'static str,
    /// The message measured (`reading`, `1 KiB bytes`...).
    pub message: String,
    /// Serialized size in bytes (bincode body, without the 20-byte frame header).
    pub size: usize,
    /// rdmsg, ns per message.
    pub rdmsg_ns: f64,
    /// Plain bincode, ns per message.
    pub bincode_ns: f64,
}

/// Chunks each side of a comparison is timed in, alternating, so that both meet the same
/// machine state (the allocator's, above all: a 64 KiB decode allocates and frees 64 KiB, and
/// whether glibc then trims the heap changes the cost tenfold).
const CHUNKS: u32 = 10;

/// Times `a` and `b` over `iters` calls each, alternating chunks; ns per call of each.
fn time_pair(iters: u32, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let per_chunk = (iters / CHUNKS).max(1);
    let (mut ta, mut tb) = (0.0, 0.0);
    for _ in 0..CHUNKS {
        let t = Instant::now();
        for _ in 0..per_chunk {
            a();
        }
        ta += t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..per_chunk {
            b();
        }
        tb += t.elapsed().as_secs_f64();
    }
    let n = f64::from(per_chunk * CHUNKS);
    (ta * 1e9 / n, tb * 1e9 / n)
}

fn measure<M: Message + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
    name: &str,
    m: &M,
    iters: u32,
) -> Result<[CodecResult; 2]> {
    let config = bincode::config::standard();
    let mut buf = vec![0u8; 1 << 20];
    // Both must agree before anything is timed.
    let framed = codec::encode_single(m, 1, &mut buf)?.unwrap_or(0);
    let mut plain_buf = vec![0u8; 1 << 20];
    let plain = bincode::serde::encode_into_slice(m, &mut plain_buf, config)?;
    if framed != plain + frame::HEADER_LEN || buf[frame::HEADER_LEN..framed] != plain_buf[..plain] {
        bail!("{name}: framed body differs from plain bincode");
    }
    let (_, body) = frame::parse(&buf[..framed])?;
    let back: M = codec::decode_body(M::TAG, body, codec::DEFAULT_MAX_MESSAGE)?;
    if &back != m {
        bail!("{name}: did not decode to what was encoded");
    }

    // Every timed call must succeed: a failing one would be cheap and flatter its side.
    let failures = std::cell::Cell::new(0u32);
    let check = |ok: bool| failures.set(failures.get() + u32::from(!ok));
    let mut plain_out = vec![0u8; 1 << 20];
    let (enc_rdmsg, enc_plain) = time_pair(
        iters,
        || {
            check(matches!(
                codec::encode_single(black_box(m), 1, &mut buf),
                Ok(Some(_))
            ))
        },
        || check(bincode::serde::encode_into_slice(black_box(m), &mut plain_out, config).is_ok()),
    );
    let frame_bytes = &buf[..framed];
    let plain_bytes = &plain_buf[..plain];
    let (dec_rdmsg, dec_plain) = time_pair(
        iters,
        || {
            // What a session does with a single-frame message: check the header, decode.
            let decoded = frame::parse(black_box(frame_bytes))
                .ok()
                .and_then(|(h, body)| {
                    codec::decode_body::<M>(h.tag, body, codec::DEFAULT_MAX_MESSAGE).ok()
                });
            check(black_box(decoded).is_some());
        },
        || {
            let decoded: Option<(M, usize)> =
                bincode::serde::decode_from_slice(black_box(plain_bytes), config).ok();
            check(black_box(decoded).is_some());
        },
    );
    let failures = failures.get();
    if failures > 0 {
        bail!("{name}: {failures} timed calls failed");
    }
    Ok([
        CodecResult {
            op: "encode",
            message: name.to_owned(),
            size: plain,
            rdmsg_ns: enc_rdmsg,
            bincode_ns: enc_plain,
        },
        CodecResult {
            op: "decode",
            message: name.to_owned(),
            size: plain,
            rdmsg_ns: dec_rdmsg,
            bincode_ns: dec_plain,
        },
    ])
}

/// One round over every message shape; `scale` multiplies the iteration counts.
pub fn round(scale: f64) -> Result<Vec<CodecResult>> {
    let iters = |n: f64| (n * scale).max(10.0) as u32;
    let reading = Reading {
        sensor: 3,
        seq: 123_456_789,
        value: 21.5,
    };
    let small = Payload {
        bytes: vec![0x5a; 64],
    };
    let kib = Payload {
        bytes: vec![0x5a; 1024],
    };
    let big = Payload {
        bytes: vec![0x5a; 64 * 1024],
    };
    let mut out = Vec::new();
    out.extend(measure("reading", &reading, iters(200_000.0))?);
    out.extend(measure("64 B bytes", &small, iters(200_000.0))?);
    out.extend(measure("1 KiB bytes", &kib, iters(100_000.0))?);
    out.extend(measure("64 KiB bytes", &big, iters(5_000.0))?);
    let numbers = Numbers {
        numbers: (0..20_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect(),
    };
    out.extend(measure("20,000 u32", &numbers, iters(2_000.0))?);
    Ok(out)
}
