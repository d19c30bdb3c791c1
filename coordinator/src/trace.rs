//! `--trace FILE`: a run as a timeline that ui.perfetto.dev and chrome://tracing open, in the
//! Chrome JSON trace format (small for sampled chips, and readable without a schema).
//!
//! Layout of the file:
//! - process "virtual time": per traced chip one track per kind of work: `steps` (training
//!   steps, script iterations, bench cases), `compute` (kernels with their flops), one per
//!   communication stream (`collectives`, or the trainer's `gather`, `reduce`, `tensor`), the
//!   phases of parts that run beside the first (`... part 1`), `host` (offload transfers);
//!   counters of HBM in use and of each torus axis's outgoing links in use (0 to 1);
//! - process "pod": pod-wide aggregates over every chip (each step or iteration from its
//!   first chip in to its last chip out, and how many chips had finished it);
//! - process "wall clock" (`--trace-wall`): the same slices on the host's clock;
//! - flow arrows from each message's departure to its arrival (`--trace-flows`, between traced
//!   chips);
//! - a hung run: the collectives of the traced chips from their flight recorders, the one each
//!   chip was inside left unfinished, and the diagnosis as an instant event.
//!
//! Times are microseconds (the format's unit); virtual nanoseconds are divided by 1000.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Args;
use podsim_collectives::trace::{Arg, ChipTrace, Span};
use podsim_collectives::{OpState, link_slot};
use podsim_job::{RecorderDump, TraceRequest};
use podsim_topology::{Dir, Link, MAX_AXES, Pod};
use serde::Deserialize;
use serde_json::{Value, json};

/// The trace options of `podsim launch`, `podsim coordinator` and `podsim bench`.
#[derive(Debug, Clone, Default, Args)]
pub struct TraceArgs {
    /// Write a timeline of the run to FILE (Chrome JSON trace: ui.perfetto.dev,
    /// chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Chips to trace, e.g. `0,17,33` (default: `--trace-sample` chips spread evenly).
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub trace_chips: Vec<u32>,
    /// How many chips to trace, spread evenly over the pod, when `--trace-chips` is not given.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub trace_sample: u32,
    /// Also draw each message between traced chips as a flow arrow.
    #[arg(long)]
    pub trace_flows: bool,
    /// Also draw the wall-clock timeline beside the virtual one.
    #[arg(long)]
    pub trace_wall: bool,
}

impl TraceArgs {
    /// The flags checked before a run on a pod of `chips`, so that no run ends in a trace
    /// it cannot write: the chips to trace (none without `--trace`; an id outside the pod is
    /// an error naming it), once the target is known to be writable as a file.
    pub fn resolve(&self, chips: u32) -> Result<Vec<u32>, String> {
        let Some(path) = &self.trace else {
            return Ok(Vec::new());
        };
        if let Some(why) = crate::outdir::file_target_problem(path) {
            return Err(format!("--trace: {why}"));
        }
        if !replaceable(path) {
            return Err(format!(
                "--trace: {} exists and is not a trace podsim wrote: podsim will not replace \
                 it (remove it, or name another file)",
                path.display()
            ));
        }
        self.chips(chips)
    }

    /// The chips to trace on a pod of `chips`, given `--trace`.
    fn chips(&self, chips: u32) -> Result<Vec<u32>, String> {
        if let Some(bad) = self.trace_chips.iter().find(|&&c| c >= chips) {
            return Err(format!(
                "--trace-chips: chip {bad} is not in the pod (chips 0 to {})",
                chips.saturating_sub(1)
            ));
        }
        if self.trace_chips.is_empty() {
            Ok(sample(chips, self.trace_sample))
        } else {
            let mut ids = self.trace_chips.clone();
            ids.sort_unstable();
            ids.dedup();
            Ok(ids)
        }
    }
}

/// How every trace file podsim writes begins (`build`'s top-level keys, in the sorted order
/// serde_json writes them): how a file is told apart from one podsim must not replace.
const TRACE_START: &[u8] = br#"{"displayTimeUnit":"ns","metadata":{"chips":"#;

/// Whether `--trace` may write over `path`: it does not exist, is empty, or is a trace podsim
/// wrote. A mistyped `--trace job.toml` replaced the job's config with a timeline.
fn replaceable(path: &Path) -> bool {
    use std::io::Read;
    let Ok(file) = std::fs::File::open(path) else {
        return !path.exists();
    };
    let mut start = Vec::with_capacity(TRACE_START.len());
    match file.take(TRACE_START.len() as u64).read_to_end(&mut start) {
        Ok(0) => true,
        Ok(_) => start == TRACE_START,
        Err(_) => false,
    }
}

/// `n` chip ids spread evenly over `0..chips`, the first and the last among them.
pub fn sample(chips: u32, n: u32) -> Vec<u32> {
    let n = n.min(chips);
    if n <= 1 {
        return vec![0; n as usize];
    }
    let last = u64::from(chips - 1);
    (0..u64::from(n))
        .map(|i| ((i * last + u64::from(n - 1) / 2) / u64::from(n - 1)) as u32)
        .collect()
}

/// What the workers are asked to trace: `chips`, plus chip 0, whose step timeline every
/// report shows.
pub fn request(chips: &[u32], flows: bool) -> TraceRequest {
    let mut ids = chips.to_vec();
    ids.push(0);
    ids.sort_unstable();
    ids.dedup();
    TraceRequest { chips: ids, flows }
}

/// A slice over the whole pod (process "pod").
#[derive(Debug, Clone)]
pub struct PodSpan {
    pub name: String,
    pub start_ns: f64,
    pub end_ns: f64,
    /// Virtual time at which each chip finished it (for the "chips finished" counter).
    pub chip_ends_ns: Vec<f64>,
}

/// A diagnosed hang, for the trace.
#[derive(Debug, Clone)]
pub struct HangMark {
    pub title: String,
    pub explanation: String,
    pub culprit: Option<u32>,
}

/// Everything a trace file is made from.
#[derive(Debug, Default)]
pub struct TraceInput<'a> {
    pub chips: Vec<ChipTrace>,
    pub pod_spans: Vec<PodSpan>,
    pub hang: Option<HangMark>,
    pub wall: bool,
    pub pod: Option<&'a Pod>,
}

/// The traces of the chips in `wanted` (and the culprit) from a hung run's flight recorders:
/// a traced chip's timeline as it was at the dump; for the others, each collective of the
/// recorder a slice on the `collectives` track. The collective in progress stays unfinished.
pub fn from_recorders(
    recorders: &BTreeMap<u32, Value>,
    wanted: &[u32],
    culprit: Option<u32>,
) -> Vec<ChipTrace> {
    let mut out = Vec::new();
    // A dump holds every chip of its worker (110,592 on one worker): only the wanted ones are
    // read in full.
    let wanted_chip = |v: &&Value| {
        v["status"]["chip"]
            .as_u64()
            .and_then(|c| u32::try_from(c).ok())
            .is_some_and(|c| wanted.contains(&c) || culprit == Some(c))
    };
    for dump in recorders.values() {
        let dumps = dump.as_array().map(Vec::as_slice).unwrap_or_default();
        for chip in dumps.iter().filter(wanted_chip) {
            let Ok(chip) = RecorderDump::deserialize(chip) else {
                continue;
            };
            let id = chip.status.chip;
            if let Some(trace) = chip.trace {
                out.push(trace);
                continue;
            }
            let spans = chip
                .entries
                .iter()
                .map(|e| Span {
                    track: podsim_collectives::DEFAULT_STREAM.into(),
                    name: format!("{}#{}", e.fingerprint.op.name(), e.fingerprint.seq),
                    cat: "collective".into(),
                    virtual_start_ns: e.virtual_start_ns,
                    virtual_end_ns: match e.state {
                        OpState::Completed => e.virtual_end_ns,
                        OpState::Started => None,
                    },
                    wall_start_ns: e.wall_start_ns,
                    wall_end_ns: e.wall_end_ns,
                    args: vec![
                        ("collective".into(), Arg::from(e.fingerprint.to_string())),
                        ("state".into(), Arg::from(format!("{:?}", e.state))),
                    ],
                })
                .collect();
            out.push(ChipTrace {
                chip: id,
                spans,
                ..ChipTrace::default()
            });
        }
    }
    out.sort_by_key(|c| c.chip);
    out
}

const VIRTUAL_PID: u32 = 1;
const POD_PID: u32 = 2;
const WALL_PID: u32 = 3;
/// Tracks a chip may have (the first tracks of each chip keep this order).
const TRACK_ORDER: [&str; 7] = [
    podsim_programs::STEPS_TRACK,
    podsim_programs::COMPUTE_TRACK,
    podsim_collectives::DEFAULT_STREAM,
    "gather",
    "reduce",
    "tensor",
    "host",
];
/// Track ids per chip: room for the fixed tracks, parts and counters.
const TRACKS_PER_CHIP: u64 = 64;

fn us(ns: f64) -> f64 {
    ns / 1e3
}

fn args_json(args: &[(String, Arg)]) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in args {
        m.insert(
            k.clone(),
            match v {
                Arg::Num(x) => json!(x),
                Arg::Text(t) => json!(t),
            },
        );
    }
    Value::Object(m)
}

/// The track ids of one chip, by name.
struct Tracks {
    base: u64,
    ids: BTreeMap<String, u64>,
}

impl Tracks {
    fn of(trace: &ChipTrace) -> Tracks {
        let mut names: Vec<&str> = trace.spans.iter().map(|s| s.track.as_str()).collect();
        names.sort_by_key(|n| {
            (
                TRACK_ORDER
                    .iter()
                    .position(|t| n.starts_with(t))
                    .unwrap_or(TRACK_ORDER.len()),
                n.to_string(),
            )
        });
        names.dedup();
        let base = u64::from(trace.chip) * TRACKS_PER_CHIP;
        let ids = names
            .into_iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), base + i as u64))
            .collect();
        Tracks { base, ids }
    }

    fn id(&self, name: &str) -> u64 {
        self.ids.get(name).copied().unwrap_or(self.base)
    }
}

fn chip_label(pod: Option<&Pod>, chip: u32) -> String {
    match pod {
        Some(pod) => format!("chip {chip} {:?}", pod.coord(chip).to_vec()),
        None => format!("chip {chip}"),
    }
}

/// Slices of one chip on process `pid`, on the virtual clock or, with `wall_origin`, on the
/// wall clock (ns since that origin).
fn chip_slices(
    trace: &ChipTrace,
    tracks: &Tracks,
    pid: u32,
    wall_origin: Option<u64>,
    events: &mut Vec<Value>,
) {
    for s in &trace.spans {
        let (start, end) = match wall_origin {
            None => (s.virtual_start_ns, s.virtual_end_ns),
            Some(o) => (
                s.wall_start_ns.saturating_sub(o) as f64,
                s.wall_end_ns.map(|e| e.saturating_sub(o) as f64),
            ),
        };
        let tid = tracks.id(&s.track);
        let mut e = json!({
            "name": s.name, "cat": s.cat, "pid": pid, "tid": tid,
            "ts": us(start), "args": args_json(&s.args),
        });
        match end {
            Some(end) => {
                e["ph"] = json!("X");
                e["dur"] = json!(us(end - start));
            }
            // Never finished: the viewer draws it open to the end of the trace.
            None => e["ph"] = json!("B"),
        }
        events.push(e);
    }
}

/// Counters of one chip: HBM in use, and per torus axis the share of its two outgoing links
/// busy sending (DCN: the chip's one egress).
fn chip_counters(trace: &ChipTrace, label: &str, events: &mut Vec<Value>) {
    for c in &trace.counters {
        events.push(json!({
            "ph": "C", "name": format!("{label} {}", c.name), "pid": VIRTUAL_PID,
            "ts": us(c.virtual_ns), "args": {"bytes": c.value},
        }));
    }
    let dcn = link_slot(Link::Dcn { peer_slice: 0 });
    for axis in 0..=MAX_AXES {
        let (slots, links, name) = if axis == MAX_AXES {
            (vec![dcn], 1.0, "DCN".to_string())
        } else {
            let a = axis;
            (
                vec![
                    link_slot(Link::ici(a, Dir::Plus)),
                    link_slot(Link::ici(a, Dir::Minus)),
                ],
                2.0,
                format!("ICI {}", ["x", "y", "z"].get(axis).copied().unwrap_or("?")),
            )
        };
        let busy: Vec<(f64, f64)> = trace
            .link_busy
            .iter()
            .filter(|b| slots.contains(&b.slot))
            .map(|b| (b.start_ns, b.end_ns))
            .collect();
        let counter = format!("{label} {name} links in use");
        for (t, share) in link_use(&busy, links) {
            events.push(json!({
                "ph": "C", "name": counter, "pid": VIRTUAL_PID,
                "ts": us(t), "args": {"share": share},
            }));
        }
    }
}

/// Points of a link-use counter at most this many per chip and axis: past it, the share is
/// averaged over as many equal windows (a long run's counter stays small).
const LINK_USE_POINTS: usize = 1000;

/// The share of `links` links busy over time, from their busy intervals: exact steps, or the
/// average over [`LINK_USE_POINTS`] windows when there would be more steps than that.
fn link_use(busy: &[(f64, f64)], links: f64) -> Vec<(f64, f64)> {
    if busy.is_empty() {
        return Vec::new();
    }
    if 2 * busy.len() > LINK_USE_POINTS {
        let start = busy.iter().map(|b| b.0).fold(f64::INFINITY, f64::min);
        let end = busy.iter().map(|b| b.1).fold(0.0, f64::max);
        let width = (end - start) / LINK_USE_POINTS as f64;
        if width > 0.0 {
            let mut sum = vec![0.0; LINK_USE_POINTS];
            for &(a, b) in busy {
                let first = (((a - start) / width) as usize).min(LINK_USE_POINTS - 1);
                let last = (((b - start) / width) as usize).min(LINK_USE_POINTS - 1);
                for (w, slot) in sum.iter_mut().enumerate().take(last + 1).skip(first) {
                    let (lo, hi) = (start + width * w as f64, start + width * (w + 1) as f64);
                    *slot += (b.min(hi) - a.max(lo)).max(0.0);
                }
            }
            let mut out: Vec<(f64, f64)> = sum
                .iter()
                .enumerate()
                .map(|(w, busy)| (start + width * w as f64, busy / (width * links)))
                .collect();
            out.push((end, 0.0));
            return out;
        }
    }
    let mut edges: Vec<(f64, f64)> = busy
        .iter()
        .flat_map(|&(a, b)| [(a, 1.0), (b, -1.0)])
        .collect();
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut out = Vec::new();
    let mut in_use = 0.0;
    let mut i = 0;
    while i < edges.len() {
        let t = edges[i].0;
        while i < edges.len() && edges[i].0 == t {
            in_use += edges[i].1;
            i += 1;
        }
        out.push((t, in_use / links));
    }
    out
}

/// The track (of `trace`) with a collective slice covering `t`.
fn stream_at(trace: &ChipTrace, t: f64) -> Option<&str> {
    trace
        .spans
        .iter()
        .find(|s| {
            s.cat == "collective"
                && s.virtual_start_ns <= t
                && s.virtual_end_ns.is_none_or(|e| t <= e)
        })
        .map(|s| s.track.as_str())
}

/// Builds the whole trace.
pub fn build(input: &TraceInput<'_>) -> Value {
    let mut events = Vec::new();
    let process = |pid: u32, name: &str, sort: u32| {
        [
            json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}),
            json!({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort}}),
        ]
    };
    events.extend(process(POD_PID, "pod", 0));
    events.extend(process(VIRTUAL_PID, "virtual time", 1));
    let tracks: BTreeMap<u32, Tracks> = input
        .chips
        .iter()
        .map(|t| (t.chip, Tracks::of(t)))
        .collect();
    let wall_origin = input
        .chips
        .iter()
        .flat_map(|t| t.spans.iter().map(|s| s.wall_start_ns))
        .min();
    if input.wall {
        events.extend(process(WALL_PID, "wall clock", 2));
    }
    for trace in &input.chips {
        let t = &tracks[&trace.chip];
        let label = chip_label(input.pod, trace.chip);
        for (name, &tid) in &t.ids {
            for pid in [VIRTUAL_PID]
                .into_iter()
                .chain(input.wall.then_some(WALL_PID))
            {
                events.push(
                    json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": format!("{label} {name}")}}),
                );
                events.push(
                    json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid}}),
                );
            }
        }
        chip_slices(trace, t, VIRTUAL_PID, None, &mut events);
        if input.wall {
            chip_slices(trace, t, WALL_PID, wall_origin, &mut events);
        }
        chip_counters(trace, &label, &mut events);
    }
    message_flows(input, &tracks, &mut events);
    pod_aggregates(&input.pod_spans, &mut events);
    if let Some(h) = &input.hang {
        diagnosis_marker(input, h, &tracks, &mut events);
    }
    // Records a chip left out past its bound (a very long job), said where a reader looks.
    let left_out: u64 = input.chips.iter().map(|t| t.left_out).sum();
    json!({"traceEvents": events, "displayTimeUnit": "ns",
        "metadata": {"chips": input.chips.len(), "records_left_out": left_out}})
}

/// Flow arrows for the messages between traced chips, from the sender's track to the
/// receiver's.
fn message_flows(input: &TraceInput<'_>, tracks: &BTreeMap<u32, Tracks>, events: &mut Vec<Value>) {
    let by_chip: BTreeMap<u32, &ChipTrace> = input.chips.iter().map(|t| (t.chip, t)).collect();
    let mut flow = 0u64;
    for trace in &input.chips {
        for m in &trace.messages {
            let Some(dst) = by_chip.get(&m.dst) else {
                continue;
            };
            let from =
                tracks[&trace.chip].id(stream_at(trace, m.depart_ns).unwrap_or("collectives"));
            let to = tracks[&m.dst].id(stream_at(dst, m.arrive_ns).unwrap_or("collectives"));
            flow += 1;
            events.push(json!({"ph": "s", "id": flow, "name": "message", "cat": "message",
                "pid": VIRTUAL_PID, "tid": from, "ts": us(m.depart_ns), "args": {"bytes": m.bytes}}));
            events.push(
                json!({"ph": "f", "bp": "e", "id": flow, "name": "message", "cat": "message",
                "pid": VIRTUAL_PID, "tid": to, "ts": us(m.arrive_ns)}),
            );
        }
    }
}

/// The diagnosis of a hang, as an instant on the culprit's collectives track at the end.
fn diagnosis_marker(
    input: &TraceInput<'_>,
    h: &HangMark,
    tracks: &BTreeMap<u32, Tracks>,
    events: &mut Vec<Value>,
) {
    let end = input
        .chips
        .iter()
        .flat_map(|t| {
            t.spans
                .iter()
                .map(|s| s.virtual_end_ns.unwrap_or(s.virtual_start_ns))
        })
        .fold(0.0, f64::max);
    let tid = h
        .culprit
        .and_then(|c| tracks.get(&c))
        .map_or(0, |t| t.id("collectives"));
    events.push(
        json!({"ph": "i", "s": "g", "name": h.title, "pid": VIRTUAL_PID, "tid": tid,
        "ts": us(end), "args": {"diagnosis": h.explanation}}),
    );
}

/// Pod-wide slices and the counter of chips that have finished each.
fn pod_aggregates(spans: &[PodSpan], events: &mut Vec<Value>) {
    if spans.is_empty() {
        return;
    }
    events.push(
        json!({"ph": "M", "name": "thread_name", "pid": POD_PID, "tid": 0,
        "args": {"name": "steps, first chip in to last chip out"}}),
    );
    for s in spans {
        events.push(
            json!({"ph": "X", "name": s.name, "cat": "step", "pid": POD_PID, "tid": 0,
            "ts": us(s.start_ns), "dur": us(s.end_ns - s.start_ns),
            "args": {"chips": s.chip_ends_ns.len()}}),
        );
        // At most 64 points a slice, however many chips: the pod-wide counter stays small.
        let mut ends = s.chip_ends_ns.clone();
        ends.sort_by(f64::total_cmp);
        let n = ends.len();
        let points = n.min(64);
        for p in 1..=points {
            let k = p * n / points;
            events.push(
                json!({"ph": "C", "name": "pod chips finished", "pid": POD_PID,
                "ts": us(ends[k - 1]), "args": {"chips": k}}),
            );
        }
    }
}

/// Moves every time of `trace` `by` ns later (runs laid one after another).
pub fn shift(trace: &mut ChipTrace, by: f64) {
    for s in &mut trace.spans {
        s.virtual_start_ns += by;
        s.virtual_end_ns = s.virtual_end_ns.map(|e| e + by);
    }
    for c in &mut trace.counters {
        c.virtual_ns += by;
    }
    for b in &mut trace.link_busy {
        b.start_ns += by;
        b.end_ns += by;
    }
    for m in &mut trace.messages {
        m.depart_ns += by;
        m.arrive_ns += by;
    }
}

/// Writes `trace` to `path` (its folder created); returns its size in bytes.
pub fn write(path: &Path, trace: &Value) -> Result<u64, String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let text = serde_json::to_vec(trace).map_err(|e| e.to_string())?;
    crate::outdir::write_atomic(path, &text)?;
    Ok(text.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_spreads_over_the_pod_from_first_to_last() {
        assert_eq!(sample(8, 4), vec![0, 2, 5, 7]);
        assert_eq!(sample(3, 16), vec![0, 1, 2]);
        assert_eq!(sample(110_592, 2), vec![0, 110_591]);
        assert!(sample(100, 0).is_empty());
    }

    #[test]
    fn a_trace_replaces_only_a_trace() {
        let dir = std::env::temp_dir().join(format!("podsim-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let args = |name: &str| TraceArgs {
            trace: Some(dir.join(name)),
            trace_sample: 8,
            ..TraceArgs::default()
        };
        // A trace as `build` writes it, an empty file and a new name may be written.
        let input = TraceInput {
            chips: Vec::new(),
            pod_spans: Vec::new(),
            hang: None,
            wall: false,
            pod: None,
        };
        write(&dir.join("old.json"), &build(&input)).unwrap();
        std::fs::write(dir.join("empty.json"), b"").unwrap();
        for name in ["old.json", "empty.json", "new.json"] {
            assert_eq!(
                args(name).resolve(8),
                Ok(vec![0, 1, 2, 3, 4, 5, 6, 7]),
                "{name}"
            );
        }
        // A user's file (the job's own config) is refused and kept.
        std::fs::write(dir.join("job.toml"), b"[job]\nkind = \"collectives\"\n").unwrap();
        let e = args("job.toml").resolve(8).unwrap_err();
        assert!(e.contains("job.toml exists and is not a trace"), "{e}");
        assert!(
            std::fs::read_to_string(dir.join("job.toml"))
                .unwrap()
                .starts_with("[job]")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chips_outside_the_pod_are_refused_by_name() {
        let args = TraceArgs {
            trace: Some("t.json".into()),
            trace_chips: vec![3, 9],
            ..TraceArgs::default()
        };
        let e = args.resolve(8).unwrap_err();
        assert!(e.contains("chip 9"), "{e}");
    }

    #[test]
    fn link_use_counts_busy_links_of_an_axis() {
        let plus = link_slot(Link::ici(0, Dir::Plus));
        let minus = link_slot(Link::ici(0, Dir::Minus));
        assert_ne!(plus, minus);
        let trace = ChipTrace {
            chip: 0,
            link_busy: vec![
                podsim_collectives::trace::LinkBusy {
                    slot: plus,
                    start_ns: 0.0,
                    end_ns: 10.0,
                },
                podsim_collectives::trace::LinkBusy {
                    slot: minus,
                    start_ns: 5.0,
                    end_ns: 10.0,
                },
            ],
            ..ChipTrace::default()
        };
        let mut events = Vec::new();
        chip_counters(&trace, "chip 0", &mut events);
        let shares: Vec<(f64, f64)> = events
            .iter()
            .map(|e| {
                (
                    e["ts"].as_f64().unwrap(),
                    e["args"]["share"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(shares, vec![(0.0, 0.5), (0.005, 1.0), (0.01, 0.0)]);
    }

    #[test]
    fn a_long_run_averages_link_use_over_windows() {
        // 2000 sends on two links, each link busy for the first half of every 10 ns.
        let busy: Vec<(f64, f64)> = (0..2000)
            .map(|i| (f64::from(i / 2) * 10.0, f64::from(i / 2) * 10.0 + 5.0))
            .collect();
        let points = link_use(&busy, 2.0);
        assert_eq!(points.len(), LINK_USE_POINTS + 1);
        let width = points[1].0 - points[0].0;
        // Busy time is conserved: the windows' shares add up to the intervals' lengths.
        let total: f64 = points.iter().map(|p| p.1 * width * 2.0).sum();
        assert!((total - 2000.0 * 5.0).abs() < 1e-6, "{total}");
        assert!(points.iter().all(|p| (0.0..=1.0).contains(&p.1)));
        assert_eq!(points.last(), Some(&(9995.0, 0.0)));
    }
}
