//! One measurement, as the runner prints it and the report reads it.

use serde::{Deserialize, Serialize};

/// Prefix of the stdout lines that carry a sample (one JSON object each); everything else the
/// runner prints is progress.
pub const LINE_PREFIX: &str = "SAMPLE ";

/// Which benchmark a sample belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bench {
    /// Ping-pong, both sides sleeping on completion events; value: one-way µs (median).
    LatEvent,
    /// Ping-pong, both sides busy polling; value: one-way µs (median).
    LatPoll,
    /// One-way stream; value: million messages per second.
    Bw,
    /// Receiver wake-ups and CPU per message at a low rate.
    Wake,
    /// Encoding and decoding on the host; value: ns per message.
    Codec,
    /// Many connections into one server: one hub thread vs a thread per connection.
    Fanin,
    /// rdmsg on tokio vs the blocking API: ping-pong, and the low-rate receiver.
    Async,
    /// Large messages: rendezvous vs fragmentation vs `ib_read_bw` and `ib_send_bw`; values:
    /// MiB/s, receiver CPU µs per MiB.
    Large,
    /// Receivers waiting by each policy at offered rates from low to saturation; values:
    /// one-way µs (median), receiver CPU µs per message, achieved messages per second.
    Rates,
    /// Instructions, syscalls and heap allocations per round trip of each layer, counted by
    /// callgrind against `ibv_rc_pingpong -e`; values per round trip.
    Cost,
    /// Connecting through rdma_cm against the TCP bootstrap: connect time, and how soon a
    /// killed peer is noticed; values: ms.
    Connect,
    /// The README's collector example (`rdmsg-examples`' `collector`) at N sensors, run as a
    /// process of its own: connect time, memory and descriptors per connection, CPU and
    /// wake-ups per message; the figures users get from the program they run.
    Collector,
}

/// One measurement of one round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The benchmark.
    pub bench: Bench,
    /// Who was measured: `rdmsg`, `ib_send_lat`, `ib_send_bw`, `ib_read_bw`, `verbs-core`,
    /// `bincode`.
    pub subject: String,
    /// Variant within the benchmark (receiver mode, codec operation, large messages' path), or
    /// empty.
    pub variant: String,
    /// Message size in bytes (0 when not applicable).
    pub size: u64,
    /// Messages per solicited batch (0 when not applicable).
    pub batch: u32,
    /// Round number, from 0.
    pub round: u32,
    /// What `value` is: `us`, `mpps`, `wakeups_per_msg`, `cpu_us_per_msg`, `ns`, `mib_per_s`,
    /// `cpu_us_per_mib` (user space), `cpu_all_us_per_mib` (kernel included).
    pub metric: String,
    /// The measured value.
    pub value: f64,
    /// Connections into the server (fan-in; sensors of the collector; 0 when not applicable).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub conns: u32,
    /// Why a measurement failed (with metric `failed`), or empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The functions with the most own instructions per round trip, most first (cost section,
    /// metric `instructions`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(String, f64)>,
    /// Offered messages per second (rate sweep; 0: as fast as the sender can, or not
    /// applicable).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rate: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Sample {
    /// The stdout line carrying this sample.
    pub fn to_line(&self) -> String {
        format!(
            "{LINE_PREFIX}{}",
            serde_json::to_string(self).expect("a sample always serializes")
        )
    }

    /// Parses a sample line; `None` for any other line.
    pub fn from_line(line: &str) -> Option<Result<Self, serde_json::Error>> {
        let json = line.trim_end().strip_prefix(LINE_PREFIX)?;
        Some(serde_json::from_str(json))
    }
}

/// The median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_survives_its_line() {
        let s = Sample {
            bench: Bench::LatEvent,
            subject: "rdmsg".into(),
            variant: String::new(),
            size: 64,
            batch: 0,
            round: 2,
            metric: "us".into(),
            value: 171.5,
            conns: 0,
            note: String::new(),
            top: Vec::new(),
            rate: 0,
        };
        let line = s.to_line();
        assert!(line.starts_with("SAMPLE {\"bench\":\"lat_event\""));
        assert_eq!(Sample::from_line(&line).unwrap().unwrap(), s);
        assert!(Sample::from_line("[3/40] progress").is_none());
        assert!(Sample::from_line("SAMPLE {broken").unwrap().is_err());
        let fanin = Sample {
            bench: Bench::Fanin,
            conns: 1024,
            metric: "failed".into(),
            note: "accepting connection 700 of 1024: out of descriptors".into(),
            ..s
        };
        let line = fanin.to_line();
        assert!(line.contains("\"conns\":1024"), "{line}");
        assert_eq!(Sample::from_line(&line).unwrap().unwrap(), fanin);
    }
}
