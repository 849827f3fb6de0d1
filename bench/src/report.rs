//! From samples to the report: medians over rounds, each rdmsg figure set against its anchor
//! from the same run, goals checked, written as markdown and JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::sample::{median, Bench, Sample};

/// A goal on a row's checked value (its ratio, or its own value when it has no anchor).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Goal {
    /// At most this.
    AtMost(f64),
    /// At least this.
    AtLeast(f64),
}

impl Goal {
    fn met(self, v: f64) -> bool {
        match self {
            Goal::AtMost(g) => v <= g,
            Goal::AtLeast(g) => v >= g,
        }
    }

    fn text(self) -> String {
        match self {
            Goal::AtMost(g) => format!("≤ {}", fmt_num(g)),
            Goal::AtLeast(g) => format!("≥ {}", fmt_num(g)),
        }
    }
}

/// The report's sections, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    /// Event-mode latency vs `ib_send_lat -e`.
    LatencyEvent,
    /// Polling latency vs `ib_send_lat`.
    LatencyPoll,
    /// The verbs-level ping-pong, event mode: rdmsg's `rc_pingpong` vs `ibv_rc_pingpong -e`.
    LayerEvent,
    /// The verbs-level ping-pong, polling.
    LayerPoll,
    /// Stream throughput vs `ib_send_bw`.
    ThroughputPerftest,
    /// Stream throughput vs the raw verbs-core stream.
    ThroughputVerbs,
    /// Wake-ups per message vs 1/K.
    Wakeups,
    /// Receiver CPU per message vs busy polling.
    Cpu,
    /// Receiver CPU per message vs the minimal verbs-core sleeping receiver.
    CpuFloor,
    /// Framing vs plain bincode.
    Codec,
    /// Many connections into one server: one hub thread vs a thread per connection.
    Fanin,
    /// rdmsg on tokio vs the blocking API.
    Async,
    /// Large messages: rendezvous vs `ib_read_bw` and vs fragmentation.
    Large,
}

impl Section {
    /// Heading of the section's table.
    pub fn title(self) -> &'static str {
        match self {
            Section::LatencyEvent => {
                "Latency, event mode: one-way median µs, rdmsg solicited-only vs `ib_send_lat -e`"
            }
            Section::LatencyPoll => "Latency, polling: one-way median µs, rdmsg vs `ib_send_lat`",
            Section::LayerEvent => {
                "Layer by layer, event mode, one-way µs: `transport` alone (raw bytes through `Connection`s, median) vs `ib_send_lat -e`; rdmsg's `rc_pingpong` (notify + verbs-core, mean) vs `ibv_rc_pingpong -e`"
            }
            Section::LayerPoll => {
                "Layer by layer, polling, one-way µs: `transport` alone vs `ib_send_lat`; rdmsg's `rc_pingpong` vs `ibv_rc_pingpong`"
            }
            Section::ThroughputPerftest => {
                "Throughput: million messages/s, rdmsg (batches of 64) vs `ib_send_bw`"
            }
            Section::ThroughputVerbs => {
                "Throughput: million messages/s, rdmsg vs the same stream on raw verbs-core"
            }
            Section::Wakeups => {
                "Receiver wake-ups per message at a low rate (batch of K, last solicited) vs 1/K"
            }
            Section::Cpu => "Receiver CPU µs per message at a low rate vs busy polling",
            Section::CpuFloor => {
                "Receiver CPU µs per message at a low rate vs the floor: a verbs-core receiver that only blocks in `ibv_get_cq_event`, acks, re-arms, polls and re-posts"
            }
            Section::Codec => {
                "Encode/decode ns per message on the host: rdmsg framing vs plain bincode"
            }
            Section::Fanin => {
                "Fan-in: N connections from one client process into one server, one hub thread (rdmsg column) vs a thread per connection (anchor), server side"
            }
            Section::Async => {
                "Async (rdmsg-tokio, a current-thread runtime per side) vs the blocking API: ping-pong one-way median µs, and the low-rate solicited-only receiver's CPU µs and wake-ups per message"
            }
            Section::Large => {
                "Large messages, one-way stream: MiB/s at the receiver, rdmsg by rendezvous (the receiver reads the sender's `Bulk` payload) vs `ib_read_bw` and vs rdmsg fragmenting into 4 KiB receive buffers, fragmentation vs `ib_send_bw`; receiver user-space CPU µs per MiB (Soft-RoCE's kernel work, which a NIC would do, left out)"
            }
        }
    }

    /// Short name for the chart.
    pub fn short(self) -> &'static str {
        match self {
            Section::LatencyEvent => "lat event",
            Section::LatencyPoll => "lat poll",
            Section::LayerEvent => "layer event",
            Section::LayerPoll => "layer poll",
            Section::ThroughputPerftest => "bw/perftest",
            Section::ThroughputVerbs => "bw/verbs",
            Section::Wakeups => "wakeups",
            Section::Cpu => "cpu/poll",
            Section::CpuFloor => "cpu/floor",
            Section::Codec => "codec",
            Section::Fanin => "fanin",
            Section::Async => "async",
            Section::Large => "large",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Its section.
    pub section: Section,
    /// What it measures within the section (`64 B`, `solicited-only, K=8`...).
    pub label: String,
    /// rdmsg's median.
    pub ours: f64,
    /// The anchor's name, if any.
    pub anchor_name: Option<String>,
    /// The anchor's median from the same run.
    pub anchor: Option<f64>,
    /// ours / anchor.
    pub ratio: Option<f64>,
    /// The goal on the ratio (or on `ours` when there is no ratio).
    pub goal: Option<Goal>,
    /// Whether the goal is met.
    pub met: Option<bool>,
    /// Rounds behind rdmsg's median.
    pub rounds: usize,
}

impl Row {
    fn new(
        section: Section,
        label: String,
        ours: (f64, usize),
        anchor: Option<(&str, f64)>,
        goal: Option<Goal>,
    ) -> Self {
        let ratio = anchor.map(|(_, a)| ours.0 / a);
        let checked = ratio.unwrap_or(ours.0);
        Self {
            section,
            label,
            ours: ours.0,
            anchor_name: anchor.map(|(n, _)| n.to_owned()),
            anchor: anchor.map(|(_, a)| a),
            ratio,
            goal,
            met: goal.map(|g| g.met(checked)),
            rounds: ours.1,
        }
    }

    /// A row whose goal (if any) is on its own value, with another figure beside it for
    /// comparison (no ratio).
    fn beside(
        section: Section,
        label: String,
        ours: (f64, usize),
        other: Option<(&str, f64)>,
        goal: Option<Goal>,
    ) -> Self {
        Self {
            anchor_name: other.map(|(n, _)| n.to_owned()),
            anchor: other.map(|(_, a)| a),
            ..Self::new(section, label, ours, None, goal)
        }
    }
}

/// Identity of a measured series: everything but the round.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    bench: Bench,
    subject: String,
    variant: String,
    size: u64,
    batch: u32,
    metric: String,
}

/// Medians of every series, keyed by what identifies it.
#[derive(Debug, Default)]
pub struct Medians {
    series: BTreeMap<Key, Vec<f64>>,
}

impl Medians {
    /// Groups samples by series.
    pub fn new(samples: &[Sample]) -> Self {
        let mut series: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
        for s in samples {
            series
                .entry(Key {
                    bench: s.bench,
                    subject: s.subject.clone(),
                    variant: s.variant.clone(),
                    size: s.size,
                    batch: s.batch,
                    metric: s.metric.clone(),
                })
                .or_default()
                .push(s.value);
        }
        Self { series }
    }

    /// (median, rounds) of one series.
    fn get(
        &self,
        bench: Bench,
        subject: &str,
        variant: &str,
        size: u64,
        batch: u32,
        metric: &str,
    ) -> Option<(f64, usize)> {
        let key = Key {
            bench,
            subject: subject.into(),
            variant: variant.into(),
            size,
            batch,
            metric: metric.into(),
        };
        self.series.get(&key).map(|v| (median(v), v.len()))
    }

    /// Distinct (variant, size, batch) of a bench and subject, in order.
    fn points(&self, bench: Bench, subject: &str, metric: &str) -> Vec<(String, u64, u32)> {
        self.series
            .keys()
            .filter(|k| k.bench == bench && k.subject == subject && k.metric == metric)
            .map(|k| (k.variant.clone(), k.size, k.batch))
            .collect()
    }
}

/// Sizes the throughput goal applies to: batched small messages.
const SMALL: u64 = 512;

/// Sizes the packed throughput goals apply to (issue 44: 64-byte messages).
const PACKED: u64 = 64;

/// Builds every row the samples allow, in section order.
pub fn rows(samples: &[Sample]) -> Vec<Row> {
    let m = Medians::new(samples);
    let mut rows = Vec::new();
    // Latency: (bench, section, our subject, their subject, their label, goal on the ratio).
    for (bench, section, ours_subject, theirs_subject, anchor, goal) in [
        (
            Bench::LatEvent,
            Section::LatencyEvent,
            "rdmsg",
            "ib_send_lat",
            "ib_send_lat -e",
            Some(1.15),
        ),
        (
            Bench::LatPoll,
            Section::LatencyPoll,
            "rdmsg",
            "ib_send_lat",
            "ib_send_lat",
            Some(1.10),
        ),
        (
            Bench::LatEvent,
            Section::LayerEvent,
            "transport",
            "ib_send_lat",
            "ib_send_lat -e",
            None,
        ),
        (
            Bench::LatPoll,
            Section::LayerPoll,
            "transport",
            "ib_send_lat",
            "ib_send_lat",
            None,
        ),
        (
            Bench::LatEvent,
            Section::LayerEvent,
            "rc_pingpong",
            "ibv_rc_pingpong",
            "ibv_rc_pingpong -e",
            None,
        ),
        (
            Bench::LatPoll,
            Section::LayerPoll,
            "rc_pingpong",
            "ibv_rc_pingpong",
            "ibv_rc_pingpong",
            None,
        ),
    ] {
        for (_, size, _) in m.points(bench, ours_subject, "us") {
            let Some(ours) = m.get(bench, ours_subject, "", size, 0, "us") else {
                continue;
            };
            let theirs = m.get(bench, theirs_subject, "", size, 0, "us");
            // The layer sections mix subjects: name them.
            let label = match section {
                Section::LayerEvent | Section::LayerPoll => {
                    format!("{ours_subject}, {}", fmt_size(size))
                }
                _ => fmt_size(size),
            };
            rows.push(Row::new(
                section,
                label,
                ours,
                theirs.map(|t| (anchor, t.0)),
                theirs.and(goal).map(Goal::AtMost),
            ));
        }
    }
    for (subject, section, anchor) in [
        ("ib_send_bw", Section::ThroughputPerftest, "ib_send_bw"),
        ("verbs-core", Section::ThroughputVerbs, "verbs-core"),
    ] {
        let mut points = m.points(Bench::Bw, "rdmsg", "mpps");
        points.sort_by_key(|(variant, size, _)| (*size, variant.clone()));
        for (variant, size, _) in points {
            let Some(ours) = m.get(Bench::Bw, "rdmsg", &variant, size, 0, "mpps") else {
                continue;
            };
            let Some(theirs) = m.get(Bench::Bw, subject, "", size, 0, "mpps") else {
                continue;
            };
            let packed = variant == "packed";
            // Issue 26: 64 B one message per send at least `ib_send_bw`'s rate and 0.9 of the
            // raw verbs-core stream's; issue 44: packed, three times `ib_send_bw`'s.
            let goal = match (packed, section) {
                (true, Section::ThroughputPerftest) if size <= PACKED => Some(Goal::AtLeast(3.0)),
                (true, _) => None,
                (false, Section::ThroughputPerftest) if size <= SMALL => Some(Goal::AtLeast(1.0)),
                (false, _) if size <= SMALL => Some(Goal::AtLeast(0.9)),
                (false, _) => None,
            };
            let label = match packed {
                true => format!("{}, packed", fmt_size(size)),
                false => fmt_size(size),
            };
            rows.push(Row::new(
                section,
                label.clone(),
                ours,
                Some((anchor, theirs.0)),
                goal,
            ));
            if section == Section::ThroughputPerftest {
                // Receive buffers (and credits) per message: issue 44, at most 1/16 packed.
                if let Some(buffers) =
                    m.get(Bench::Bw, "rdmsg", &variant, size, 0, "buffers_per_msg")
                {
                    let goal = (packed && size <= PACKED).then_some(Goal::AtMost(1.0 / 16.0));
                    rows.push(Row::beside(
                        section,
                        format!("{label}: receive buffers per message"),
                        buffers,
                        None,
                        goal,
                    ));
                }
            }
        }
    }
    let mut wake = m.points(Bench::Wake, "rdmsg", "cpu_us_per_msg");
    wake.sort_by_key(|(variant, _, batch)| (mode_order(variant), *batch));
    for (variant, size, batch) in &wake {
        if let Some(ours) = m.get(
            Bench::Wake,
            "rdmsg",
            variant,
            *size,
            *batch,
            "wakeups_per_msg",
        ) {
            // The goal is for receivers that sleep until a solicited message.
            let goal = (variant != "next").then(|| Goal::AtMost(1.0 / f64::from(*batch) + 0.01));
            rows.push(Row::new(
                Section::Wakeups,
                format!("{variant}, K={batch}"),
                ours,
                None,
                goal,
            ));
        }
    }
    for (variant, size, batch) in &wake {
        if variant == "busy-poll" {
            continue;
        }
        let Some(ours) = m.get(
            Bench::Wake,
            "rdmsg",
            variant,
            *size,
            *batch,
            "cpu_us_per_msg",
        ) else {
            continue;
        };
        let poll = m.get(
            Bench::Wake,
            "rdmsg",
            "busy-poll",
            *size,
            *batch,
            "cpu_us_per_msg",
        );
        rows.push(Row::new(
            Section::Cpu,
            format!("{variant}, K={batch}"),
            ours,
            poll.map(|p| ("busy-poll", p.0)),
            poll.map(|_| Goal::AtMost(0.1)),
        ));
    }
    for (variant, size, batch) in &wake {
        if variant == "busy-poll" {
            continue;
        }
        let (Some(ours), Some(floor)) = (
            m.get(
                Bench::Wake,
                "rdmsg",
                variant,
                *size,
                *batch,
                "cpu_us_per_msg",
            ),
            m.get(
                Bench::Wake,
                "verbs-core",
                "floor",
                *size,
                *batch,
                "cpu_us_per_msg",
            ),
        ) else {
            continue;
        };
        // Sleeping receivers within 1.2× of the minimal sleeping receiver on verbs-core.
        let goal =
            matches!(variant.as_str(), "solicited-only" | "hybrid").then_some(Goal::AtMost(1.2));
        rows.push(Row::new(
            Section::CpuFloor,
            format!("{variant}, K={batch}"),
            ours,
            Some(("verbs-core floor", floor.0)),
            goal,
        ));
    }
    for (variant, size, _) in m.points(Bench::Codec, "rdmsg", "ns") {
        let (Some(ours), Some(plain)) = (
            m.get(Bench::Codec, "rdmsg", &variant, size, 0, "ns"),
            m.get(Bench::Codec, "bincode", &variant, size, 0, "ns"),
        ) else {
            continue;
        };
        // Decoding a small struct within 1.5× of plain bincode.
        let goal = (variant == "decode reading").then_some(Goal::AtMost(1.5));
        rows.push(Row::new(
            Section::Codec,
            format!("{variant} ({})", fmt_size(size)),
            ours,
            Some(("bincode", plain.0)),
            goal,
        ));
    }
    rows.extend(async_rows(&m));
    rows.extend(large_rows(&m));
    rows.extend(fanin_rows(&fanin_table(samples)));
    rows.sort_by_key(|r| r.section);
    rows
}

/// The async rows: each async figure against the blocking one of the same run.
fn async_rows(m: &Medians) -> Vec<Row> {
    let mut rows = Vec::new();
    let pairs = |variant: &str, metric: &str| {
        m.points(Bench::Async, "rdmsg-tokio", metric)
            .into_iter()
            .filter(|(v, _, _)| v == variant)
            .filter_map(|(v, size, batch)| {
                let ours = m.get(Bench::Async, "rdmsg-tokio", &v, size, batch, metric)?;
                let blocking = m.get(Bench::Async, "rdmsg", &v, size, batch, metric)?;
                Some((size, batch, ours, blocking.0))
            })
            .collect::<Vec<_>>()
    };
    for (size, _, ours, blocking) in pairs("latency", "us") {
        rows.push(Row::new(
            Section::Async,
            format!("ping-pong {}", fmt_size(size)),
            ours,
            Some(("blocking", blocking)),
            Some(Goal::AtMost(1.1)),
        ));
    }
    for (_, batch, ours, blocking) in pairs("receiver", "cpu_us_per_msg") {
        rows.push(Row::new(
            Section::Async,
            format!("receiver CPU µs/msg, K={batch}"),
            ours,
            Some(("blocking", blocking)),
            Some(Goal::AtMost(1.1)),
        ));
    }
    for (_, batch, ours, blocking) in pairs("receiver", "wakeups_per_msg") {
        // Unchanged: the same solicited messages wake it (a hundredth of slack per message).
        rows.push(Row::beside(
            Section::Async,
            format!("receiver wake-ups/msg, K={batch}"),
            ours,
            Some(("blocking", blocking)),
            Some(Goal::AtMost(blocking + 0.01)),
        ));
    }
    rows
}

/// Large-message sizes the throughput goal against `ib_read_bw` and the CPU goal apply to
/// (below, the fixed cost per message weighs more than the bytes).
const LARGE: u64 = 1 << 20;

/// The large-message rows, per size: rendezvous against `ib_read_bw` (≥ 0.9× from 1 MiB on)
/// and against fragmentation (≥ 3× at 1 MiB), fragmentation against `ib_send_bw` (no goal),
/// and the receiver's CPU per MiB by rendezvous against fragmentation (≤ 0.3× from 1 MiB on).
fn large_rows(m: &Medians) -> Vec<Row> {
    let get = |subject: &str, variant: &str, size: u64, metric: &str| {
        m.get(Bench::Large, subject, variant, size, 0, metric)
    };
    let mut sizes: Vec<u64> = m
        .points(Bench::Large, "rdmsg", "mib_per_s")
        .into_iter()
        .map(|(_, size, _)| size)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut rows = Vec::new();
    for size in sizes {
        let mut row = |label: &str,
                       ours: Option<(f64, usize)>,
                       anchor: Option<(&str, (f64, usize))>,
                       goal: Option<Goal>| {
            if let Some(ours) = ours {
                let anchor = anchor.map(|(name, a)| (name, a.0));
                rows.push(Row::new(
                    Section::Large,
                    format!("{}: {label}", fmt_size(size)),
                    ours,
                    anchor,
                    anchor.and(goal),
                ));
            }
        };
        let rendezvous = get("rdmsg", "rendezvous", size, "mib_per_s");
        let fragmentation = get("rdmsg", "fragmentation", size, "mib_per_s");
        row(
            "rendezvous vs RDMA read, MiB/s",
            rendezvous,
            get("ib_read_bw", "", size, "mib_per_s").map(|r| ("ib_read_bw", r)),
            (size >= LARGE).then_some(Goal::AtLeast(0.9)),
        );
        row(
            "rendezvous vs fragments, MiB/s",
            rendezvous,
            fragmentation.map(|f| ("fragmentation", f)),
            (size == LARGE).then_some(Goal::AtLeast(3.0)),
        );
        row(
            "fragments vs send, MiB/s",
            fragmentation,
            get("ib_send_bw", "", size, "mib_per_s").map(|s| ("ib_send_bw", s)),
            None,
        );
        row(
            "receiver user CPU µs/MiB, rendezvous vs fragments",
            get("rdmsg", "rendezvous", size, "cpu_us_per_mib"),
            get("rdmsg", "fragmentation", size, "cpu_us_per_mib").map(|f| ("fragmentation", f)),
            (size >= LARGE).then_some(Goal::AtMost(0.3)),
        );
    }
    rows
}

/// One large-message size: the medians over its rounds of every subject, and their ratios.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LargePoint {
    /// Payload bytes.
    pub size: u64,
    /// Rounds behind rdmsg's rendezvous figure.
    pub rounds: usize,
    /// `ib_read_bw`, MiB/s.
    pub ib_read_bw: Option<f64>,
    /// `ib_send_bw`, MiB/s.
    pub ib_send_bw: Option<f64>,
    /// rdmsg by rendezvous, MiB/s.
    pub rendezvous: Option<f64>,
    /// rdmsg in fragments, MiB/s.
    pub fragmentation: Option<f64>,
    /// rendezvous / `ib_read_bw`.
    pub rendezvous_vs_read: Option<f64>,
    /// rendezvous / fragmentation.
    pub rendezvous_vs_fragmentation: Option<f64>,
    /// Receiver CPU µs per MiB, rendezvous.
    pub rendezvous_cpu_us_per_mib: Option<f64>,
    /// Receiver CPU µs per MiB, fragmentation.
    pub fragmentation_cpu_us_per_mib: Option<f64>,
    /// Their ratio, rendezvous / fragmentation.
    pub cpu_ratio: Option<f64>,
}

/// The large-message samples, one point per size, smallest first.
pub fn large_table(samples: &[Sample]) -> Vec<LargePoint> {
    let m = Medians::new(samples);
    let mut sizes: Vec<u64> = samples
        .iter()
        .filter(|s| s.bench == Bench::Large)
        .map(|s| s.size)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let ratio = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    sizes
        .into_iter()
        .map(|size| {
            let get = |subject: &str, variant: &str, metric: &str| {
                m.get(Bench::Large, subject, variant, size, 0, metric)
            };
            let rendezvous = get("rdmsg", "rendezvous", "mib_per_s");
            let [ib_read_bw, ib_send_bw, fragmentation, rendezvous_cpu, fragmentation_cpu] = [
                get("ib_read_bw", "", "mib_per_s"),
                get("ib_send_bw", "", "mib_per_s"),
                get("rdmsg", "fragmentation", "mib_per_s"),
                get("rdmsg", "rendezvous", "cpu_us_per_mib"),
                get("rdmsg", "fragmentation", "cpu_us_per_mib"),
            ]
            .map(|v| v.map(|(median, _)| median));
            let rounds = rendezvous.map_or(0, |r| r.1);
            let rendezvous = rendezvous.map(|r| r.0);
            LargePoint {
                size,
                rounds,
                ib_read_bw,
                ib_send_bw,
                rendezvous,
                fragmentation,
                rendezvous_vs_read: ratio(rendezvous, ib_read_bw),
                rendezvous_vs_fragmentation: ratio(rendezvous, fragmentation),
                rendezvous_cpu_us_per_mib: rendezvous_cpu,
                fragmentation_cpu_us_per_mib: fragmentation_cpu,
                cpu_ratio: ratio(rendezvous_cpu, fragmentation_cpu),
            }
        })
        .collect()
}

/// Every large-message figure side by side, one line per size (empty without any).
pub fn large_markdown(samples: &[Sample]) -> String {
    let points = large_table(samples);
    if points.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\n### Large messages, every figure (medians over the rounds, same run)\n\n\
         MiB/s of payload at the receiver; receiver thread user-space CPU µs per MiB \
         (Soft-RoCE's kernel work, a NIC's on hardware, left out; `cpu_all_us_per_mib` in \
         report.json has it). rdmsg, timed at the receiver after a quarter of the messages \
         (at most 8) warmed up: one sender thread streams `Blob { id, data: Bulk }` messages (one \
         payload shared by all), the receiver decodes a borrowed view and checks the length \
         only; rendezvous with the default 16 KiB threshold, fragmentation with \
         `rendezvous_threshold: None` (4 KiB receive buffers). perftest: the reading client \
         of `ib_read_bw`, the receiving server of `ib_send_bw`, with as many iterations as \
         rdmsg sends messages.\n\n\
         | size | rounds | ib_read_bw | ib_send_bw | rendezvous | fragmentation | \
         rendezvous / ib_read_bw | rendezvous / fragmentation | CPU µs/MiB rendezvous | \
         CPU µs/MiB fragmentation | CPU rendezvous / fragmentation |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let f = |v: Option<f64>| v.map_or("—".into(), fmt_num);
    let x = |v: Option<f64>| v.map_or("—".into(), |v| format!("{}×", fmt_num(v)));
    for p in &points {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            fmt_size(p.size),
            p.rounds,
            f(p.ib_read_bw),
            f(p.ib_send_bw),
            f(p.rendezvous),
            f(p.fragmentation),
            x(p.rendezvous_vs_read),
            x(p.rendezvous_vs_fragmentation),
            f(p.rendezvous_cpu_us_per_mib),
            f(p.fragmentation_cpu_us_per_mib),
            x(p.cpu_ratio),
        );
    }
    out
}

/// The rate sweep of report.md: latency and CPU per message of each waiting policy at each
/// offered rate, and the adaptive policy against the better of busy polling and
/// solicited-only sleep on each (goal: within 1.15×).
pub fn rates_markdown(samples: &[Sample]) -> String {
    let rates: Vec<&Sample> = samples.iter().filter(|s| s.bench == Bench::Rates).collect();
    if rates.is_empty() {
        return String::new();
    }
    let get = |rate: u32, mode: &str, metric: &str| -> Option<f64> {
        let v: Vec<f64> = rates
            .iter()
            .filter(|s| s.rate == rate && s.variant == mode && s.metric == metric)
            .map(|s| s.value)
            .collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let mut offered: Vec<u32> = rates.iter().map(|s| s.rate).collect();
    offered.sort_by_key(|&r| if r == 0 { u32::MAX } else { r });
    offered.dedup();
    let modes = ["busy-poll", "solicited-only", "hybrid", "adaptive"];
    let mut out = String::from(
        "\n### Waiting policies across message rates (medians over the rounds, same run)\n\n\
         One sender thread offers 64-byte messages, each solicited, at a fixed rate (or as fast \
         as it can: saturation); the receiver waits by each policy: busy-poll (`Policy::Poll`), \
         solicited-only sleep (`Policy::Sleep`), hybrid (a fixed 50 µs spin, then sleep) and \
         adaptive (`Policy::ADAPTIVE`: spins twice the longest but one of its last 4 waits \
         when that is at most 50 µs, else sleeps at once and probes with a 50 µs spin one \
         wait in 8). Latency: one-way, send call \
         to decoded message, µs; CPU: receiver thread µs per message. The goal: adaptive within \
         1.15× of the better of busy-poll and solicited-only on latency (busy-poll's, at every \
         rate) and on CPU (solicited-only's, but at saturation), without being told the rate. \
         Below the rate where messages come within the spin limit of each other, the latency \
         goal asks for a spinning receiver's latency at a sleeping receiver's CPU, which no \
         policy can give; the table shows where adaptive stands.\n\n\
         | offered | achieved | latency µs: busy-poll / solicited / hybrid / adaptive | \
         CPU µs/msg: busy-poll / solicited / hybrid / adaptive | adaptive / better latency | \
         adaptive / better CPU |\n|---|---:|---|---|---:|---:|\n",
    );
    let f = |v: Option<f64>| v.map_or("—".into(), fmt_num);
    for &rate in &offered {
        let lat: Vec<Option<f64>> = modes.iter().map(|m| get(rate, m, "us")).collect();
        let cpu: Vec<Option<f64>> = modes
            .iter()
            .map(|m| get(rate, m, "cpu_us_per_msg"))
            .collect();
        let achieved = get(rate, "adaptive", "rate");
        // Against the better of busy-poll (0) and solicited-only (1) on each metric.
        let vs = |v: &[Option<f64>]| {
            let best = match (v[0], v[1]) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            v[3].zip(best).map_or("—".into(), |(a, b)| {
                let r = a / b;
                format!("{}× {}", fmt_num(r), if r <= 1.15 { "✓" } else { "✗" })
            })
        };
        let join = |v: &[Option<f64>]| v.iter().map(|x| f(*x)).collect::<Vec<_>>().join(" / ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            if rate == 0 {
                "saturation".to_string()
            } else {
                format!("{rate}/s")
            },
            f(achieved),
            join(&lat),
            join(&cpu),
            vs(&lat),
            vs(&cpu),
        );
    }
    out
}

/// One layer of the cost section: medians over its rounds, per round trip.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostPoint {
    /// The layer (`cost::Subject::name`).
    pub subject: String,
    /// Rounds measured.
    pub rounds: usize,
    /// User-space instructions (median).
    pub instructions: f64,
    /// Smallest and largest instruction count of the rounds.
    pub spread: (f64, f64),
    /// System calls.
    pub syscalls: f64,
    /// Clock reads (a vDSO call natively).
    pub clock_reads: f64,
    /// Heap allocations (the largest of the rounds: any is a failure).
    pub allocations: f64,
    /// Wake-ups of the measured side, where it reports them.
    pub wakeups: Option<f64>,
    /// Instructions over the anchor's (`ibv_rc_pingpong -e`).
    pub ratio: Option<f64>,
    /// The goal for `ratio`.
    pub goal: Option<f64>,
    /// The top functions of the round with the median count.
    pub top: Vec<(String, f64)>,
}

/// The cost section's points, the anchor first.
pub fn cost_table(samples: &[Sample]) -> Vec<CostPoint> {
    let of = |subject: &str, metric: &str| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.bench == Bench::Cost && s.subject == subject && s.metric == metric)
            .collect()
    };
    let median_of = |v: &[&Sample]| median(&v.iter().map(|s| s.value).collect::<Vec<_>>());
    let mut points = Vec::new();
    let mut anchor = None;
    for subject in crate::cost::Subject::ALL {
        let name = subject.name();
        let instr = of(name, "instructions");
        if instr.is_empty() {
            continue;
        }
        let values: Vec<f64> = instr.iter().map(|s| s.value).collect();
        let m = median(&values);
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let closest = instr
            .iter()
            .min_by(|a, b| (a.value - m).abs().total_cmp(&(b.value - m).abs()))
            .map(|s| s.top.clone())
            .unwrap_or_default();
        if subject == crate::cost::Subject::IbvRcPingpong {
            anchor = Some(m);
        }
        let wakeups = of(name, "wakeups");
        points.push(CostPoint {
            subject: name.to_owned(),
            rounds: instr.len(),
            instructions: m,
            spread: (lo, hi),
            syscalls: median_of(&of(name, "syscalls")),
            clock_reads: median_of(&of(name, "clock_reads")),
            allocations: of(name, "allocations")
                .iter()
                .map(|s| s.value)
                .fold(0.0, f64::max),
            wakeups: (!wakeups.is_empty()).then(|| median_of(&wakeups)),
            ratio: subject.goal().and(anchor).map(|a| m / a),
            goal: subject.goal(),
            top: closest,
        });
    }
    points
}

/// The cost section of report.md.
pub fn cost_markdown(samples: &[Sample]) -> String {
    let points = cost_table(samples);
    if points.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\n### Cost per round trip: instructions, syscalls, allocations (callgrind)\n\n\
         User-space instructions per round trip counted by valgrind's callgrind inside the VM, \
         event mode, 8-byte payloads (a 14-byte `Tick` for the typed layers): the profile of \
         3n round trips minus that of n, divided by 2n, so set-up and teardown cancel. The \
         client is measured, except for the hub (the hub's process, serving one `Session`). \
         Allocations are calls into the C allocator per round trip (goal: none). Counts do not \
         depend on time; in event mode they move with how completions batch into wake-ups, \
         which the min-max column shows.\n\n\
         Syscalls leave out clock reads, which valgrind turns into syscalls (natively the vDSO \
         answers them); they have a column of their own.\n\n\
         | layer | rounds | instructions | min–max | ratio | goal | syscalls | clock reads | \
         wake-ups | allocations |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let f = |v: Option<f64>| v.map_or("—".into(), fmt_num);
    for p in &points {
        let goal = match (p.ratio, p.goal) {
            (Some(r), Some(g)) => format!("≤ {}× {}", fmt_num(g), if r <= g { "✓" } else { "✗" }),
            _ => "—".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0}–{:.0} | {} | {} | {} | {} | {} | {} {} |",
            p.subject,
            p.rounds,
            p.instructions,
            p.spread.0,
            p.spread.1,
            p.ratio.map_or("—".into(), |r| format!("{}×", fmt_num(r))),
            goal,
            fmt_num(p.syscalls),
            fmt_num(p.clock_reads),
            f(p.wakeups),
            fmt_num(p.allocations),
            if p.allocations < 0.01 { "✓" } else { "✗" },
        );
    }
    out.push_str("\nWhere the instructions go (own instructions per round trip, top functions):\n");
    for p in &points {
        let _ = writeln!(out, "\n- **{}**:", p.subject);
        for (f, v) in &p.top {
            let _ = writeln!(out, "  - {v:.0} `{f}`");
        }
    }
    out
}

/// The connect section of report.md: rdma_cm against the TCP bootstrap, medians over the
/// rounds.
pub fn connect_markdown(samples: &[Sample]) -> String {
    let of = |way: &str, metric: &str| -> Vec<f64> {
        samples
            .iter()
            .filter(|s| s.bench == Bench::Connect && s.subject == way && s.metric == metric)
            .map(|s| s.value)
            .collect()
    };
    let ways = ["tcp", "rdma_cm"];
    if ways.iter().all(|w| of(w, "connect_ms").is_empty()) {
        return String::new();
    }
    let mut out = String::from(
        "\n### Connecting: rdma_cm against the TCP bootstrap\n\n\
         Both ways on the same device in the same run. *Connect*: the median time of \
         `Endpoint::connect_cm` / `Endpoint::connect` to an accepting listener in another \
         thread (the median of each round's median). *Killed peer noticed*: a peer process \
         connects, says hello and is killed (SIGKILL); the time until a receive asleep on its \
         connection fails (the CM's disconnect, sent by the peer's kernel, against the end of \
         the bootstrap stream). A dead host is not in this table (it cannot be made inside one \
         VM): `cargo xtask vm2` measures it, liveness probes against TCP keepalive.\n\n\
         | way | rounds | connect, ms | min–max | killed peer noticed, ms | min–max |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    let span = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{}–{}", fmt_num(lo), fmt_num(hi))
    };
    let mut medians = Vec::new();
    for way in ways {
        let (connect, notice) = (of(way, "connect_ms"), of(way, "killed_notice_ms"));
        if connect.is_empty() {
            continue;
        }
        medians.push((median(&connect), median(&notice)));
        let _ = writeln!(
            out,
            "| {way} | {} | {} | {} | {} | {} |",
            connect.len(),
            fmt_num(median(&connect)),
            span(&connect),
            fmt_num(median(&notice)),
            span(&notice),
        );
    }
    if let [(tcp_c, tcp_n), (cm_c, cm_n)] = medians[..] {
        let _ = writeln!(
            out,
            "\nrdma_cm / TCP: connect {}×, killed peer noticed {}×.",
            fmt_num(cm_c / tcp_c),
            fmt_num(cm_n / tcp_n)
        );
    }
    out
}

/// One run of the collector example (sensors × credits): medians over its rounds (it runs in
/// one).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CollectorPoint {
    /// Sensors.
    pub sensors: u32,
    /// Credits each sensor kept however idle (`--min-credits`).
    pub min_credits: u32,
    /// Rounds that gave figures.
    pub rounds: usize,
    /// Median of each metric over the rounds (see `collector::Figures::metrics`).
    pub figures: BTreeMap<String, f64>,
    /// Why a round failed, if one did.
    pub failed: Option<String>,
}

impl CollectorPoint {
    /// A figure's median.
    pub fn get(&self, metric: &str) -> Option<f64> {
        self.figures.get(metric).copied()
    }
}

/// The collector's runs, by sensors and then the example's default credits first.
pub fn collector_table(samples: &[Sample]) -> Vec<CollectorPoint> {
    type Series = BTreeMap<String, BTreeMap<u32, f64>>;
    let mut points: BTreeMap<(u32, std::cmp::Reverse<u32>), (Series, Option<String>)> =
        BTreeMap::new();
    for s in samples.iter().filter(|s| s.bench == Bench::Collector) {
        // A variant it cannot read is kept apart (as 0) rather than dropped.
        let credits = s
            .variant
            .strip_prefix("min_credits=")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let entry = points
            .entry((s.conns, std::cmp::Reverse(credits)))
            .or_default();
        if s.metric == "failed" {
            entry.1.get_or_insert_with(|| s.note.clone());
        } else {
            entry
                .0
                .entry(s.metric.clone())
                .or_default()
                .insert(s.round, s.value);
        }
    }
    points
        .into_iter()
        .map(
            |((sensors, std::cmp::Reverse(min_credits)), (series, failed))| CollectorPoint {
                sensors,
                min_credits,
                rounds: series.values().map(BTreeMap::len).max().unwrap_or(0),
                figures: series
                    .iter()
                    .map(|(m, by_round)| {
                        (
                            m.clone(),
                            median(&by_round.values().copied().collect::<Vec<_>>()),
                        )
                    })
                    .collect(),
                failed,
            },
        )
        .collect()
}

/// How much longer a sensor may take to connect at the largest count than at the smallest.
pub const COLLECTOR_CONNECT_SCALING: f64 = 10.0;

/// The collector section of report.md: the README's example itself, at each sensor count.
pub fn collector_markdown(samples: &[Sample]) -> String {
    let points = collector_table(samples);
    if points.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\n### Collector (the README's example)\n\n\
         `collector --sensors N --batches 2 --min-credits C` from `rdmsg-examples`, run as a \
         process of its own as users run it: one hub on one thread serves N sensors, which a \
         second process (one hub, one connection per sensor) connects over the TCP bootstrap \
         on 127.0.0.1; each sensor sends 2 batches of 8 samples (the last solicited), alarms \
         and a final `Done`. Figures are the example's own report line, in the first round \
         only. Connect: until every sensor was connected. KiB/conn: the hub's registered \
         receive and send buffers per connection; fds/conn: the collector's descriptors per \
         connection, all connected. CPU: the collector process's user + system time over the \
         traffic, per message (10 ms ticks); wake-ups: the hub's, per message. Probes: \
         liveness probes the collector's hub sent (one per silent peer host, not per \
         connection). Failed: sensor connections that failed; lost: messages the finished \
         sensors sent that did not arrive. A run that exits non-zero, fails a connection or \
         loses a message is marked failed with why.\n\n\
         | sensors | min credits | connect s | connect ms per 1000 sensors | KiB/conn | \
         fds/conn | CPU µs/msg | wake-ups/msg | probes | failed | lost |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut failures = Vec::new();
    for p in &points {
        let mark = if p.failed.is_some() {
            " **failed**"
        } else {
            ""
        };
        if let Some(why) = &p.failed {
            failures.push(format!(
                "- {} sensors, min credits {}: {}",
                p.sensors,
                p.min_credits,
                why.replace('\n', " ")
            ));
        }
        if p.rounds == 0 {
            let _ = writeln!(
                out,
                "| {}{mark} | {} | — | — | — | — | — | — | — | — | — |",
                p.sensors, p.min_credits
            );
            continue;
        }
        let f = |metric: &str| p.get(metric).map_or("—".into(), fmt_num);
        let _ = writeln!(
            out,
            "| {}{mark} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            p.sensors,
            p.min_credits,
            p.get("connect_ms")
                .map_or("—".into(), |ms| fmt_num(ms / 1e3)),
            f("connect_ms_per_1000"),
            f("kib_per_conn"),
            f("fds_per_conn"),
            f("cpu_us_per_msg"),
            f("wakeups_per_msg"),
            f("probes"),
            f("failed_conns"),
            f("lost"),
        );
    }
    // Where connect time went, for the runs whose line says.
    let parts: Vec<&CollectorPoint> = points
        .iter()
        .filter(|p| p.get("handshake_wall_us").is_some())
        .collect();
    if !parts.is_empty() {
        out.push_str(
            "\nWhere a connection's connect time went, µs per connection: the collector's CPU \
             time until all were connected; a handshake's wall time from its stream's accept to \
             its connection (waits for the sensors' side included); and the collector hub's own \
             work in it: receive buffers set aside (registered in batches as the pool grows), \
             the queue pair created and in INIT, moved to RTR and RTS, and the hellos read, \
             checked and written.\n\n\
             | sensors | min credits | CPU | handshake wall | admission | QP create | RTR+RTS | hellos |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for p in parts {
            let _ = write!(out, "| {} | {} |", p.sensors, p.min_credits);
            // The columns are the collector line's parts, in their order.
            for (_, metric) in crate::collector::CONNECT_PARTS {
                let _ = write!(out, " {} |", p.get(metric).map_or("—".into(), fmt_num));
            }
            out.push('\n');
        }
    }
    if !failures.is_empty() {
        out.push_str("\nFailed runs:\n\n");
        for line in failures {
            let _ = writeln!(out, "{line}");
        }
    }
    // Connect time per sensor, the largest count against the smallest, at each credit setting
    // measured at more than one count.
    let mut credits: Vec<u32> = points.iter().map(|p| p.min_credits).collect();
    credits.sort_unstable_by(|a, b| b.cmp(a));
    credits.dedup();
    let mut notes = Vec::new();
    for c in credits {
        let at: Vec<(u32, f64)> = points
            .iter()
            .filter(|p| p.min_credits == c)
            .filter_map(|p| Some((p.sensors, p.get("connect_ms_per_1000")?)))
            .collect();
        let (Some(&(small_n, small)), Some(&(large_n, large))) = (at.first(), at.last()) else {
            continue;
        };
        if large_n == small_n || small <= 0.0 {
            continue;
        }
        let r = large / small;
        notes.push(format!(
            "{} sensors against {} at {c} credits: {}× (goal ≤ {}× {})",
            large_n,
            small_n,
            fmt_num(r),
            fmt_num(COLLECTOR_CONNECT_SCALING),
            if r <= COLLECTOR_CONNECT_SCALING {
                "✓"
            } else {
                "✗"
            }
        ));
    }
    if !notes.is_empty() {
        let _ = writeln!(
            out,
            "\nConnect time per sensor, the largest count against the smallest: {}.",
            notes.join("; ")
        );
    }
    out
}

/// One fan-in point (connections × server): medians over its rounds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaninPoint {
    /// Connections.
    pub conns: u32,
    /// `hub` or `threads`.
    pub server: String,
    /// Rounds measured (failed ones not counted).
    pub rounds: usize,
    /// Median of each metric over the rounds (see `runner::fanin_samples` for the names).
    pub figures: BTreeMap<String, f64>,
    /// Median over the rounds of the worst one-second window's most / least served peer;
    /// infinite (`null` in JSON) if a peer got nothing in it.
    pub fairness: Option<f64>,
    /// Why a round failed, if one did.
    pub failed: Option<String>,
}

impl FaninPoint {
    /// A figure's median.
    pub fn get(&self, metric: &str) -> Option<f64> {
        self.figures.get(metric).copied()
    }
}

/// The fan-in samples as points, by connections and then hub before threads.
pub fn fanin_table(samples: &[Sample]) -> Vec<FaninPoint> {
    type Series = BTreeMap<String, BTreeMap<u32, f64>>;
    let mut points: BTreeMap<(u32, bool, String), (Series, Option<String>)> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.bench == Bench::Fanin) {
        let entry = points
            .entry((s.conns, s.subject != "hub", s.subject.clone()))
            .or_default();
        if s.metric == "failed" {
            entry.1.get_or_insert_with(|| s.note.clone());
        } else {
            entry
                .0
                .entry(s.metric.clone())
                .or_default()
                .insert(s.round, s.value);
        }
    }
    points
        .into_iter()
        .map(|((conns, _, server), (series, failed))| {
            let figures: BTreeMap<String, f64> = series
                .iter()
                .map(|(m, by_round)| {
                    (
                        m.clone(),
                        median(&by_round.values().copied().collect::<Vec<_>>()),
                    )
                })
                .collect();
            let ratios: Vec<f64> = match (series.get("fair_max"), series.get("fair_min")) {
                (Some(max), Some(min)) => max
                    .iter()
                    .filter_map(|(r, hi)| min.get(r).map(|lo| hi / lo))
                    .collect(),
                _ => Vec::new(),
            };
            FaninPoint {
                conns,
                server,
                rounds: series.values().map(BTreeMap::len).max().unwrap_or(0),
                figures,
                fairness: (!ratios.is_empty()).then(|| median(&ratios)),
                failed,
            }
        })
        .collect()
}

/// Connections from which the fan-in's goals apply (fixed costs must be spread thin).
pub const FANIN_GOALS_FROM: u32 = 1024;

/// The fan-in's rows: the hub's CPU per message against the thread-per-connection server's
/// at every N (bars of the chart), then, at the largest N the hub was measured at, the
/// figures with goals (checked only from [`FANIN_GOALS_FROM`] connections): one server
/// thread, at most 1.05 descriptors and 4 KiB of registered memory per idle connection, no
/// receiver-not-ready, at most one wake-up per solicited message, CPU per message within
/// 1.3× of the hub's with one connection, connecting no slower per connection than at 1024
/// (linear), and the most served peer of any window within 1.5× of the least served; then
/// the hub groups: throughput and CPU per message against the group of one.
fn fanin_rows(points: &[FaninPoint]) -> Vec<Row> {
    let find = |conns: u32, server: &str| {
        points
            .iter()
            .find(|p| p.conns == conns && p.server == server && p.rounds > 0)
    };
    let mut rows = Vec::new();
    for hub in points.iter().filter(|p| p.server == "hub") {
        let Some(cpu) = hub.get("cpu_us_per_msg") else {
            continue;
        };
        let threads = find(hub.conns, "threads").and_then(|t| t.get("cpu_us_per_msg"));
        rows.push(Row::new(
            Section::Fanin,
            format!("N={}: CPU µs per message, hub vs threads", hub.conns),
            (cpu, hub.rounds),
            threads.map(|t| ("threads", t)),
            None,
        ));
    }
    let Some(top) = points
        .iter()
        .filter(|p| p.server == "hub" && p.rounds > 0)
        .max_by_key(|p| p.conns)
    else {
        return rows;
    };
    let n = top.conns;
    let goal = |g: f64| (n >= FANIN_GOALS_FROM).then_some(Goal::AtMost(g));
    let threads = find(n, "threads");
    let beside = |metric: &str| threads.and_then(|t| t.get(metric)).map(|v| ("threads", v));
    for (metric, what, limit) in [
        ("threads", "server threads", 1.0),
        ("fds_per_conn", "descriptors per connection", 1.05),
        (
            "registered_kib_per_conn",
            "registered KiB per idle connection",
            4.0,
        ),
        ("rnr", "RNR NAKs (rcvd + send)", 0.0),
        (
            "wakeups_per_solicited",
            "wake-ups per solicited message",
            1.0,
        ),
    ] {
        if let Some(v) = top.get(metric) {
            rows.push(Row::beside(
                Section::Fanin,
                format!("N={n}: {what}"),
                (v, top.rounds),
                beside(metric),
                goal(limit),
            ));
        }
    }
    let one = points
        .iter()
        .filter(|p| p.server == "hub" && p.rounds > 0 && p.conns < n)
        .min_by_key(|p| p.conns);
    if let (Some(at_n), Some(one)) = (top.get("cpu_us_per_msg"), one) {
        if let Some(at_one) = one.get("cpu_us_per_msg") {
            rows.push(Row::new(
                Section::Fanin,
                format!("N={n}: hub CPU µs per message vs N={}", one.conns),
                (at_n, top.rounds),
                Some((&format!("hub, N={}", one.conns), at_one)),
                goal(1.3),
            ));
        }
    }
    let base = FANIN_GOALS_FROM;
    if let (Some(at_n), Some(at_base)) = (
        top.get("connect_s"),
        find(base, "hub").and_then(|p| p.get("connect_s")),
    ) {
        if n > base {
            // Linear: N / 1024 times as long.
            rows.push(Row::new(
                Section::Fanin,
                format!(
                    "N={n}: connect seconds vs N={base} (linear: ×{})",
                    fmt_num(f64::from(n) / f64::from(base))
                ),
                (at_n, top.rounds),
                Some((&format!("hub, N={base}"), at_base)),
                goal(f64::from(n) / f64::from(base)),
            ));
        }
    }
    if let Some(f) = top.fairness {
        let window = top.get("fair_window_s").unwrap_or(1.0);
        rows.push(Row::beside(
            Section::Fanin,
            if window <= 1.0 {
                format!("N={n}: most / least served peer, worst second")
            } else {
                format!(
                    "N={n}: most / least served peer, worst {} s window",
                    fmt_num(window)
                )
            },
            (f, top.rounds),
            threads.and_then(|t| t.fairness).map(|v| ("threads", v)),
            goal(1.5),
        ));
    }
    let one_hub = points.iter().find(|p| p.server == "group1" && p.rounds > 0);
    for g in points
        .iter()
        .filter(|p| p.server.starts_with("group") && p.server != "group1" && p.rounds > 0)
    {
        for (metric, what) in [
            ("rate", "messages/s"),
            ("cpu_us_per_msg", "CPU µs per message"),
        ] {
            if let Some(v) = g.get(metric) {
                let anchor = one_hub.and_then(|o| o.get(metric)).map(|a| ("group1", a));
                rows.push(Row::new(
                    Section::Fanin,
                    format!("N={}: {}, {what} vs one hub", g.conns, g.server),
                    (v, g.rounds),
                    anchor,
                    None,
                ));
            }
        }
    }
    rows
}

/// The fan-in's figures as one wide table (empty without fan-in samples).
pub fn fanin_markdown(samples: &[Sample]) -> String {
    let points = fanin_table(samples);
    if points.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\n### Fan-in, every figure (hub and thread-per-connection, same run)\n\n\
         The client is one process with one client hub: it opens the N connections, then \
         sends the same number of 64-byte messages on each, in batches of 8 whose last is \
         solicited, interleaved message by message across the connections and paced to one \
         total rate, the same at every N. Hub: `HubConfig::default()` on the measuring thread. \
         Threads: a `Listener` accepting on the measuring thread and a thread per `Connection` \
         blocked in `recv`, each with the hub's per-connection settings (2 KiB buffers, 16 send \
         slots) and 64 receive buffers (the hub's `max_credits`). CPU: user + system time of \
         the whole server process (`/proc/self/stat`, 10 ms ticks) from `GO` to the last \
         message. Wake-ups: the completion-channel wake-ups of the hub, or of every \
         connection summed (health-check timer wake-ups are not counted, their CPU is); per \
         solicited: over the solicited messages the client sent, those the transport forced \
         (a sender's last credit) included. Per connection: (all connected and idle − before \
         the server created anything) / N, for descriptors (`/proc/self/fd`), `VmPin` \
         (registered memory, as pinned pages) and `VmRSS`; registered KiB: the hub's \
         `registered_bytes` / N, or each connection's receive pool and send buffers. RNR: the \
         device's `rcvd_rnr_err + send_rnr_err` over the measurement (client side included). \
         Fairness: per-peer messages received in each whole second from the first message, \
         most / least served in the worst second (∞: a peer got nothing in a second), with \
         the mean per peer and second.\n\n\
         Grants: explicit credit grants the server sent per message (the server sends no \
         data, so every credit goes back that way); asleep: the share of the messages' time \
         the hub spent in its sleeping waits (from the start of each wait's turn to its wake-up).\n\n\
         | N | server | CPU µs/msg | wake-ups/msg | wake-ups/solicited | solicited (forced) | \
         grants/msg | asleep | fds/conn | registered KiB/conn | VmPin KiB/conn | \
         RSS KiB/conn | threads | RNR | fairness (mean/s) | msgs/s | connect s |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in &points {
        if p.rounds == 0 {
            let note = p
                .failed
                .as_deref()
                .unwrap_or("no samples")
                .replace('|', "/");
            let _ = writeln!(
                out,
                "| {} | {} | **failed**: {note} |||||||||||||||",
                p.conns, p.server
            );
            continue;
        }
        let f = |metric: &str| p.get(metric).map_or("—".into(), fmt_num);
        let fairness = match (p.fairness, p.get("fair_mean")) {
            (Some(r), Some(mean)) => format!("{} ({})", fmt_num(r), fmt_num(mean)),
            _ => "—".into(),
        };
        let _ =
            writeln!(
            out,
            "| {} | {}{} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            p.conns,
            p.server,
            if p.failed.is_some() { " (a round failed)" } else { "" },
            f("cpu_us_per_msg"),
            f("wakeups_per_msg"),
            f("wakeups_per_solicited"),
            f("solicited"),
            f("forced_solicited"),
            f("grants_per_msg"),
            f("asleep"),
            f("fds_per_conn"),
            f("registered_kib_per_conn"),
            f("pinned_kib_per_conn"),
            f("rss_kib_per_conn"),
            f("threads"),
            f("rnr"),
            fairness,
            f("rate"),
            f("connect_s"),
        );
    }
    if let Some(p) = points.iter().find(|p| p.get("messages").is_some()) {
        let _ = writeln!(
            out,
            "\nOffered: {} messages per measurement at {} messages/s.",
            fmt_num(p.get("messages").unwrap_or(0.0)),
            fmt_num(p.get("offered_rate").unwrap_or(0.0))
        );
    }
    out
}

fn mode_order(variant: &str) -> usize {
    ["busy-poll", "next", "hybrid", "solicited-only"]
        .iter()
        .position(|m| *m == variant)
        .unwrap_or(usize::MAX)
}

/// `64 B`, `4 KiB`, `64 KiB`, `16 MiB`.
pub fn fmt_size(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1024 && bytes % 1024 == 0 {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

/// A number with three significant digits or so.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if v == f64::INFINITY {
        "∞".into()
    } else if !v.is_finite() {
        format!("{v}")
    } else if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

/// The report in markdown: one table per section.
pub fn markdown(rows: &[Row], preamble: &str) -> String {
    let mut out = String::from("# rdmsg benchmarks\n\n");
    out.push_str(preamble);
    let missed: Vec<&Row> = rows.iter().filter(|r| r.met == Some(false)).collect();
    let checked = rows.iter().filter(|r| r.met.is_some()).count();
    let _ = writeln!(
        out,
        "\nGoals met: {} of {checked}.\n",
        checked - missed.len()
    );
    let mut section = None;
    for r in rows {
        if section != Some(r.section) {
            section = Some(r.section);
            let _ = writeln!(out, "\n## {}\n", r.section.title());
            out.push_str("| | rdmsg | anchor | ratio | goal | |\n|---|---:|---:|---:|---|---|\n");
        }
        let anchor = match (&r.anchor_name, r.anchor) {
            (Some(n), Some(a)) => format!("{} ({n})", fmt_num(a)),
            _ => "—".into(),
        };
        let ratio = r.ratio.map_or("—".into(), |x| format!("{}×", fmt_num(x)));
        let goal = r.goal.map_or(String::new(), |g| {
            if r.ratio.is_some() {
                format!("{}×", g.text())
            } else {
                g.text()
            }
        });
        let met = match r.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {anchor} | {ratio} | {goal} | {met} |",
            r.label,
            fmt_num(r.ours)
        );
    }
    out
}

/// The report as JSON: rows and every sample behind them.
pub fn json(rows: &[Row], samples: &[Sample]) -> String {
    #[derive(Serialize)]
    struct Report<'a> {
        rows: &'a [Row],
        fanin: Vec<FaninPoint>,
        large: Vec<LargePoint>,
        collector: Vec<CollectorPoint>,
        samples: &'a [Sample],
    }
    serde_json::to_string_pretty(&Report {
        rows,
        fanin: fanin_table(samples),
        large: large_table(samples),
        collector: collector_table(samples),
        samples,
    })
    .expect("a report always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample of round 0; `(size, batch)` locate it.
    fn s(
        bench: Bench,
        subject: &str,
        variant: &str,
        at: (u64, u32),
        metric: &str,
        value: f64,
    ) -> Sample {
        Sample {
            bench,
            subject: subject.into(),
            variant: variant.into(),
            size: at.0,
            batch: at.1,
            round: 0,
            metric: metric.into(),
            value,
            conns: 0,
            note: String::new(),
            top: Vec::new(),
            rate: 0,
        }
    }

    #[test]
    fn medians_of_rounds_become_ratios_and_goals() {
        let mut samples = Vec::new();
        for (round, (ours, theirs)) in [(110.0, 100.0), (300.0, 100.0), (112.0, 98.0)]
            .into_iter()
            .enumerate()
        {
            let round = round as u32;
            samples.push(Sample {
                round,
                ..s(Bench::LatEvent, "rdmsg", "", (8, 0), "us", ours)
            });
            samples.push(Sample {
                round,
                ..s(Bench::LatEvent, "ib_send_lat", "", (8, 0), "us", theirs)
            });
        }
        samples.push(s(Bench::Bw, "rdmsg", "", (64, 0), "mpps", 0.019));
        samples.push(s(Bench::Bw, "ib_send_bw", "", (64, 0), "mpps", 0.020));
        samples.push(s(Bench::Bw, "verbs-core", "", (64, 0), "mpps", 0.024));
        samples.push(s(
            Bench::Wake,
            "rdmsg",
            "busy-poll",
            (64, 8),
            "cpu_us_per_msg",
            1000.0,
        ));
        samples.push(s(
            Bench::Wake,
            "rdmsg",
            "solicited-only",
            (64, 8),
            "cpu_us_per_msg",
            50.0,
        ));
        samples.push(s(
            Bench::Wake,
            "rdmsg",
            "solicited-only",
            (64, 8),
            "wakeups_per_msg",
            0.13,
        ));
        let rows = rows(&samples);
        let lat = &rows[0];
        assert_eq!(lat.section, Section::LatencyEvent);
        assert_eq!((lat.ours, lat.anchor, lat.rounds), (112.0, Some(100.0), 3));
        assert!((lat.ratio.unwrap() - 1.12).abs() < 1e-9);
        assert_eq!(lat.met, Some(true));
        let bw: Vec<&Row> = rows
            .iter()
            .filter(|r| r.section == Section::ThroughputPerftest)
            .collect();
        assert_eq!(bw[0].met, Some(false)); // 0.95×, the goal is 1.0×
        let verbs: Vec<&Row> = rows
            .iter()
            .filter(|r| r.section == Section::ThroughputVerbs)
            .collect();
        assert_eq!(verbs[0].goal, Some(Goal::AtLeast(0.9)));
        assert_eq!(verbs[0].met, Some(false)); // 0.79×
        let wake: Vec<&Row> = rows
            .iter()
            .filter(|r| r.section == Section::Wakeups)
            .collect();
        assert_eq!(wake.len(), 1, "busy polling has no wake-ups to count");
        assert_eq!(wake[0].met, Some(true)); // 0.13 <= 1/8 + 0.01
        let cpu: Vec<&Row> = rows.iter().filter(|r| r.section == Section::Cpu).collect();
        assert_eq!(cpu[0].ratio, Some(0.05));
        assert_eq!(cpu[0].met, Some(true));
        let md = markdown(&rows, "");
        assert!(md.contains("Goals met: 3 of 5."), "{md}");
        assert!(
            md.contains("| 8 B | 112 | 100 (ib_send_lat -e) | 1.12× | ≤ 1.15× | met |"),
            "{md}"
        );
        assert!(json(&rows, &samples).contains("\"section\": \"latency_event\""));
    }

    #[test]
    fn a_missing_anchor_leaves_the_ratio_empty() {
        let samples = [s(Bench::LatPoll, "rdmsg", "", (64, 0), "us", 30.0)];
        let rows = rows(&samples);
        assert_eq!((rows[0].ratio, rows[0].met), (None, None));
        assert!(markdown(&rows, "").contains("| 64 B | 30.0 | — | — |  |  |"));
    }

    /// A fan-in sample.
    fn f(server: &str, conns: u32, round: u32, metric: &str, value: f64) -> Sample {
        Sample {
            round,
            conns,
            ..s(Bench::Fanin, server, "", (0, 0), metric, value)
        }
    }

    /// Every figure the goals look at, for one round of one point.
    fn point(server: &str, conns: u32, round: u32, cpu: f64, fair: (f64, f64)) -> Vec<Sample> {
        let hub = server == "hub";
        [
            ("cpu_us_per_msg", cpu),
            ("wakeups_per_solicited", if hub { 0.2 } else { 1.0 }),
            ("threads", if hub { 1.0 } else { f64::from(conns) + 1.0 }),
            ("fds_per_conn", if hub { 1.01 } else { 7.0 }),
            ("registered_kib_per_conn", if hub { 3.5 } else { 166.0 }),
            ("rnr", 0.0),
            ("fair_max", fair.0),
            ("fair_min", fair.1),
            ("fair_mean", 8.0),
        ]
        .into_iter()
        .map(|(m, v)| f(server, conns, round, m, v))
        .collect()
    }

    #[test]
    fn the_fanin_checks_its_goals_at_the_largest_n() {
        let mut samples = Vec::new();
        for round in 0..2 {
            samples.extend(point("hub", 1, round, 20.0, (8000.0, 8000.0)));
            samples.extend(point("threads", 1, round, 22.0, (8000.0, 8000.0)));
            samples.extend(point(
                "hub",
                1024,
                round,
                28.0 + f64::from(round) * 10.0,
                (8.0, 7.0),
            ));
            samples.extend(point("threads", 1024, round, 40.0, (8.0, 0.0)));
        }
        let rows = rows(&samples);
        let fanin: Vec<&Row> = rows
            .iter()
            .filter(|r| r.section == Section::Fanin)
            .collect();
        let labels: Vec<&str> = fanin.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "N=1: CPU µs per message, hub vs threads",
                "N=1024: CPU µs per message, hub vs threads",
                "N=1024: server threads",
                "N=1024: descriptors per connection",
                "N=1024: registered KiB per idle connection",
                "N=1024: RNR NAKs (rcvd + send)",
                "N=1024: wake-ups per solicited message",
                "N=1024: hub CPU µs per message vs N=1",
                "N=1024: most / least served peer, worst second",
            ]
        );
        // Hub vs threads: a ratio, no goal.
        assert_eq!(
            (fanin[1].ours, fanin[1].ratio, fanin[1].met),
            (33.0, Some(33.0 / 40.0), None)
        );
        // Goals on the hub's own figure, the threads' beside it without a ratio.
        assert_eq!(
            (fanin[2].ours, fanin[2].anchor, fanin[2].ratio, fanin[2].met),
            (1.0, Some(1025.0), None, Some(true))
        );
        assert!(fanin[2..7].iter().all(|r| r.met == Some(true)));
        // 33 µs against 20 µs with one connection: 1.65×, missed.
        assert_eq!(fanin[7].anchor_name.as_deref(), Some("hub, N=1"));
        assert_eq!(fanin[7].met, Some(false));
        let fair = fanin[8];
        assert!((fair.ours - 8.0 / 7.0).abs() < 1e-9);
        assert_eq!(
            fair.anchor,
            Some(f64::INFINITY),
            "a starved peer among the threads"
        );
        assert_eq!(fair.met, Some(true));
        let md = markdown(&rows, "");
        assert!(
            md.contains("| N=1024: server threads | 1.00 | 1025 (threads) | — | ≤ 1.00 | met |"),
            "{md}"
        );
        assert!(
            md.contains("| N=1024: most / least served peer, worst second | 1.14 | ∞ (threads)"),
            "{md}"
        );
        // Serializes, infinities as null.
        assert!(json(&rows, &samples).contains("\"fanin\": ["));
        // The quick run's 64 connections: the same figures, no goals.
        let small: Vec<Sample> = samples
            .iter()
            .filter(|s| s.conns == 1)
            .cloned()
            .chain(point("hub", 64, 0, 30.0, (8.0, 7.0)))
            .collect();
        let small = super::rows(&small);
        assert_eq!(small.len(), 9);
        assert!(small.iter().all(|r| r.goal.is_none()), "{small:?}");
    }

    #[test]
    fn a_failed_fanin_point_is_a_row_of_the_table() {
        let mut samples = point("hub", 1024, 0, 30.0, (8.0, 7.0));
        samples.push(f("hub", 1024, 0, "messages", 32768.0));
        samples.push(f("hub", 1024, 0, "offered_rate", 8192.0));
        samples.push(Sample {
            note: "accepting connection 700 of 1024: out of | descriptors".into(),
            ..f("threads", 1024, 0, "failed", 1.0)
        });
        let table = fanin_table(&samples);
        assert_eq!(table.len(), 2);
        assert_eq!((table[0].server.as_str(), table[0].rounds), ("hub", 1));
        assert_eq!(table[0].fairness, Some(8.0 / 7.0));
        assert_eq!((table[1].server.as_str(), table[1].rounds), ("threads", 0));
        assert!(table[1].failed.as_deref().unwrap().starts_with("accepting"));
        let rows = rows(&samples);
        let cpu = rows
            .iter()
            .find(|r| r.label == "N=1024: CPU µs per message, hub vs threads")
            .unwrap();
        assert_eq!((cpu.anchor, cpu.ratio), (None, None));
        let md = fanin_markdown(&samples);
        assert!(
            md.contains("| 1024 | threads | **failed**: accepting connection 700 of 1024: out of / descriptors |"),
            "{md}"
        );
        assert!(md.contains("| 1024 | hub | 30.0 |"), "{md}");
        assert!(md.contains("1.14 (8.00)"), "{md}");
        assert!(
            md.contains("Offered: 32768 messages per measurement at 8192 messages/s."),
            "{md}"
        );
        assert_eq!(fanin_markdown(&[]), "");
    }

    #[test]
    fn large_messages_set_rendezvous_against_ib_read_bw_and_fragmentation() {
        let mut samples = Vec::new();
        // (size, ib_read_bw, ib_send_bw, rendezvous, fragmentation, CPU rendezvous, CPU
        // fragmentation), per round.
        for (round, figures) in [
            [
                (16 << 10, 60.0, 50.0, 30.0, 20.0, 900.0, 1000.0),
                (1 << 20, 200.0, 150.0, 190.0, 50.0, 100.0, 1000.0),
                (16 << 20, 210.0, 160.0, 170.0, 55.0, 500.0, 1000.0),
            ],
            [
                (16 << 10, 62.0, 52.0, 32.0, 21.0, 800.0, 1000.0),
                (1 << 20, 220.0, 150.0, 200.0, 60.0, 120.0, 1000.0),
                (16 << 20, 230.0, 170.0, 180.0, 60.0, 400.0, 1000.0),
            ],
        ]
        .into_iter()
        .enumerate()
        {
            for (size, read, send, rndv, frag, rndv_cpu, frag_cpu) in figures {
                let at = (size, 0);
                for (subject, variant, metric, value) in [
                    ("ib_read_bw", "", "mib_per_s", read),
                    ("ib_send_bw", "", "mib_per_s", send),
                    ("rdmsg", "rendezvous", "mib_per_s", rndv),
                    ("rdmsg", "fragmentation", "mib_per_s", frag),
                    ("rdmsg", "rendezvous", "cpu_us_per_mib", rndv_cpu),
                    ("rdmsg", "fragmentation", "cpu_us_per_mib", frag_cpu),
                ] {
                    samples.push(Sample {
                        round: round as u32,
                        ..s(Bench::Large, subject, variant, at, metric, value)
                    });
                }
            }
        }
        let rows = rows(&samples);
        let large: Vec<&Row> = rows
            .iter()
            .filter(|r| r.section == Section::Large)
            .collect();
        let labels: Vec<&str> = large.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            &labels[..4],
            [
                "16 KiB: rendezvous vs RDMA read, MiB/s",
                "16 KiB: rendezvous vs fragments, MiB/s",
                "16 KiB: fragments vs send, MiB/s",
                "16 KiB: receiver user CPU µs/MiB, rendezvous vs fragments",
            ]
        );
        assert_eq!(large.len(), 3 * 4);
        // 16 KiB: figures and ratios, no goals.
        assert!(large[..4].iter().all(|r| r.goal.is_none()), "{large:?}");
        assert_eq!((large[0].ours, large[0].anchor), (31.0, Some(61.0)));
        assert_eq!(large[0].anchor_name.as_deref(), Some("ib_read_bw"));
        assert_eq!(large[2].anchor_name.as_deref(), Some("ib_send_bw"));
        // 1 MiB: 195 / 210 = 0.93×, met; 195 / 55 = 3.5×, met; CPU 110 / 1000, met.
        assert_eq!(large[4].goal, Some(Goal::AtLeast(0.9)));
        assert_eq!(large[5].goal, Some(Goal::AtLeast(3.0)));
        assert_eq!(large[6].goal, None);
        assert_eq!(large[7].goal, Some(Goal::AtMost(0.3)));
        assert!([4, 5, 7].iter().all(|&i| large[i].met == Some(true)));
        // 16 MiB: 175 / 220 = 0.8×, missed; no 3× goal there; CPU 0.45×, missed.
        assert_eq!((large[8].met, large[9].goal), (Some(false), None));
        assert_eq!(large[11].met, Some(false));
        let table = large_table(&samples);
        assert_eq!(table.len(), 3);
        let mib = &table[1];
        assert_eq!((mib.size, mib.rounds), (1 << 20, 2));
        assert_eq!(
            (mib.ib_read_bw, mib.ib_send_bw, mib.fragmentation),
            (Some(210.0), Some(150.0), Some(55.0))
        );
        assert!((mib.rendezvous_vs_read.unwrap() - 195.0 / 210.0).abs() < 1e-9);
        assert!((mib.cpu_ratio.unwrap() - 0.11).abs() < 1e-9);
        let md = large_markdown(&samples);
        assert!(
            md.contains(
                "| 1 MiB | 2 | 210 | 150 | 195 | 55.0 | 0.929× | 3.55× | 110 | 1000 | 0.110× |"
            ),
            "{md}"
        );
        assert!(markdown(&rows, "").contains(
            "| 1 MiB: rendezvous vs RDMA read, MiB/s | 195 | 210 (ib_read_bw) | 0.929× | ≥ 0.900× | met |"
        ));
        let json = json(&rows, &samples);
        assert!(json.contains("\"section\": \"large\""), "{json}");
        assert!(json.contains("\"large\": ["), "{json}");
        assert_eq!(large_markdown(&[]), "");
        // A size without its anchors: rendezvous alone, no ratio, no goal.
        let alone = [s(
            Bench::Large,
            "rdmsg",
            "rendezvous",
            (1 << 20, 0),
            "mib_per_s",
            9.0,
        )];
        let rows = super::rows(&alone);
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.ratio.is_none() && r.goal.is_none()));
    }

    #[test]
    fn the_connect_section_sets_rdma_cm_against_tcp() {
        assert_eq!(connect_markdown(&[]), "");
        let samples: Vec<Sample> = [
            ("tcp", "connect_ms", 10.0),
            ("tcp", "connect_ms", 12.0),
            ("tcp", "killed_notice_ms", 60.0),
            ("rdma_cm", "connect_ms", 15.0),
            ("rdma_cm", "killed_notice_ms", 66.0),
        ]
        .into_iter()
        .map(|(way, metric, v)| s(Bench::Connect, way, "", (0, 0), metric, v))
        .collect();
        let md = connect_markdown(&samples);
        assert!(
            md.contains("| tcp | 2 | 11.0 | 10.0–12.0 | 60.0 | 60.0–60.0 |"),
            "{md}"
        );
        assert!(md.contains("| rdma_cm | 1 | 15.0 |"), "{md}");
        assert!(
            md.contains("rdma_cm / TCP: connect 1.36×, killed peer noticed 1.10×."),
            "{md}"
        );
    }

    #[test]
    fn the_collector_section_shows_each_run_and_how_connecting_scales() {
        assert_eq!(collector_markdown(&[]), "");
        let run = |sensors: u32, credits: u32, figures: &[(&str, f64)]| -> Vec<Sample> {
            figures
                .iter()
                .map(|&(metric, v)| Sample {
                    conns: sensors,
                    ..s(
                        Bench::Collector,
                        "collector",
                        &format!("min_credits={credits}"),
                        (0, 0),
                        metric,
                        v,
                    )
                })
                .collect()
        };
        let figures = |connect_ms: f64, sensors: f64| {
            [
                ("connect_ms", connect_ms),
                ("connect_ms_per_1000", connect_ms * 1000.0 / sensors),
                ("kib_per_conn", 16.5),
                ("fds_per_conn", 1.01),
                ("cpu_us_per_msg", 41.7),
                ("wakeups_per_msg", 0.117),
                ("probes", 3.0),
                ("failed_conns", 0.0),
                ("lost", 0.0),
            ]
        };
        let mut samples = run(10_000, 8, &figures(120_000.0, 10_000.0));
        samples.extend(run(1000, 8, &figures(4000.0, 1000.0)));
        samples.extend(run(5000, 8, &figures(30_000.0, 5000.0)));
        // 10,000 at one credit: it printed its line, then lost messages.
        let mut lossy = figures(100_000.0, 10_000.0);
        lossy[8] = ("lost", 2.0);
        samples.extend(run(10_000, 1, &lossy));
        samples.push(Sample {
            note: "2 messages lost".into(),
            ..run(10_000, 1, &[("failed", 1.0)]).remove(0)
        });
        // One that never printed a line.
        samples.push(Sample {
            note: "the collector exited with exit status: 1: error: out of descriptors".into(),
            ..run(20_000, 8, &[("failed", 1.0)]).remove(0)
        });
        let md = collector_markdown(&samples);
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(rows.len(), 6, "{md}");
        assert!(
            rows[0].starts_with("| sensors | min credits | connect s |"),
            "{md}"
        );
        assert_eq!(
            &rows[1..],
            [
                "| 1000 | 8 | 4.00 | 4000 | 16.5 | 1.01 | 41.7 | 0.117 | 3.00 | 0 | 0 |",
                "| 5000 | 8 | 30.0 | 6000 | 16.5 | 1.01 | 41.7 | 0.117 | 3.00 | 0 | 0 |",
                "| 10000 | 8 | 120 | 12000 | 16.5 | 1.01 | 41.7 | 0.117 | 3.00 | 0 | 0 |",
                "| 10000 **failed** | 1 | 100 | 10000 | 16.5 | 1.01 | 41.7 | 0.117 | 3.00 | 0 \
                 | 2.00 |",
                "| 20000 **failed** | 8 | — | — | — | — | — | — | — | — | — |",
            ],
            "{md}"
        );
        assert!(
            md.contains("- 10000 sensors, min credits 1: 2 messages lost\n"),
            "{md}"
        );
        assert!(
            md.contains("- 20000 sensors, min credits 8: the collector exited with"),
            "{md}"
        );
        // 20,000 has no figures: the scaling is 10,000's against 1,000's, at 8 credits only
        // (1 credit ran at one count).
        assert!(
            md.contains(
                "the largest count against the smallest: 10000 sensors against 1000 at 8 \
                 credits: 3.00× (goal ≤ 10.0× ✓)."
            ),
            "{md}"
        );
        let table = collector_table(&samples);
        assert_eq!(table[3].failed.as_deref(), Some("2 messages lost"));
        assert_eq!((table[4].sensors, table[4].rounds), (20_000, 0));
    }

    #[test]
    fn the_collector_section_says_where_connect_time_went() {
        let sample = |metric: &str, v: f64| Sample {
            conns: 1000,
            ..s(
                Bench::Collector,
                "collector",
                "min_credits=8",
                (0, 0),
                metric,
                v,
            )
        };
        let mut samples: Vec<Sample> = [("connect_ms", 3300.0), ("connect_ms_per_1000", 3300.0)]
            .into_iter()
            .map(|(m, v)| sample(m, v))
            .collect();
        assert!(!collector_markdown(&samples).contains("connect time went"));
        samples.extend(
            [
                ("connect_cpu_us", 2650.0),
                ("handshake_wall_us", 9141.0),
                ("admission_us", 247.3),
                ("qp_create_us", 604.2),
                ("rtr_rts_us", 321.8),
                ("hello_us", 455.6),
            ]
            .into_iter()
            .map(|(m, v)| sample(m, v)),
        );
        let md = collector_markdown(&samples);
        assert!(md.contains("connect time went"), "{md}");
        assert!(
            md.contains("| 1000 | 8 | 2650 | 9141 | 247 | 604 | 322 | 456 |"),
            "{md}"
        );
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_size(64), "64 B");
        assert_eq!(fmt_size(4096), "4 KiB");
        assert_eq!(fmt_size(16 << 20), "16 MiB");
        assert_eq!(fmt_size(1536 << 10), "1536 KiB");
        assert_eq!(fmt_num(171.456), "171");
        assert_eq!(fmt_num(1.0712), "1.07");
        assert_eq!(fmt_num(0.021005), "0.021");
        assert_eq!(fmt_num(0.0004), "4.00e-4");
        assert_eq!(fmt_num(f64::INFINITY), "∞");
        assert_eq!(fmt_num(f64::NAN), "NaN");
    }
}
