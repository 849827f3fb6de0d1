//! From samples to the report: medians over rounds, each rdmsg figure set against its anchor
//! from the same run, goals checked, written as markdown and JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::sample::{Bench, Sample};

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
        for (_, size, _) in m.points(Bench::Bw, "rdmsg", "mpps") {
            let Some(ours) = m.get(Bench::Bw, "rdmsg", "", size, 0, "mpps") else {
                continue;
            };
            let Some(theirs) = m.get(Bench::Bw, subject, "", size, 0, "mpps") else {
                continue;
            };
            let goal = (section == Section::ThroughputPerftest && size <= SMALL)
                .then_some(Goal::AtLeast(0.9));
            rows.push(Row::new(
                section,
                fmt_size(size),
                ours,
                Some((anchor, theirs.0)),
                goal,
            ));
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
        rows.push(Row::new(
            Section::CpuFloor,
            format!("{variant}, K={batch}"),
            ours,
            Some(("verbs-core floor", floor.0)),
            None,
        ));
    }
    for (variant, size, _) in m.points(Bench::Codec, "rdmsg", "ns") {
        let (Some(ours), Some(plain)) = (
            m.get(Bench::Codec, "rdmsg", &variant, size, 0, "ns"),
            m.get(Bench::Codec, "bincode", &variant, size, 0, "ns"),
        ) else {
            continue;
        };
        rows.push(Row::new(
            Section::Codec,
            format!("{variant} ({})", fmt_size(size)),
            ours,
            Some(("bincode", plain.0)),
            None,
        ));
    }
    rows.sort_by_key(|r| r.section);
    rows
}

fn mode_order(variant: &str) -> usize {
    ["busy-poll", "next", "hybrid", "solicited-only"]
        .iter()
        .position(|m| *m == variant)
        .unwrap_or(usize::MAX)
}

/// `64 B`, `4 KiB`, `64 KiB`.
pub fn fmt_size(bytes: u64) -> String {
    if bytes >= 1024 && bytes % 1024 == 0 {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

/// A number with three significant digits or so.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
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
        samples: &'a [Sample],
    }
    serde_json::to_string_pretty(&Report { rows, samples }).expect("a report always serializes")
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
        assert_eq!(bw[0].met, Some(true)); // 0.95×
        let verbs: Vec<&Row> = rows
            .iter()
            .filter(|r| r.section == Section::ThroughputVerbs)
            .collect();
        assert_eq!(verbs[0].goal, None);
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
        assert!(md.contains("Goals met: 4 of 4."), "{md}");
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

    #[test]
    fn formats() {
        assert_eq!(fmt_size(64), "64 B");
        assert_eq!(fmt_size(4096), "4 KiB");
        assert_eq!(fmt_num(171.456), "171");
        assert_eq!(fmt_num(1.0712), "1.07");
        assert_eq!(fmt_num(0.021005), "0.021");
        assert_eq!(fmt_num(0.0004), "4.00e-4");
    }
}
