//! What a timeline viewer shows of one chip: its slices (compute kernels, collectives, the
//! algorithm phases inside them, steps), counters (HBM in use) and link occupancy, on the
//! virtual clock and the wall clock at once.
//!
//! Tracing is off unless a program asks for it on a chip ([`crate::Chip::enable_trace`]): a
//! job samples a few chips of a large pod. A traced chip pays a lock per message (link
//! occupancy is recorded where a send is booked, by whichever lane of a collective sends);
//! untraced chips pay one branch. Turning a [`ChipTrace`] into a file is the coordinator's job.

use serde::{Deserialize, Serialize};

use crate::nanos::Nanos;
use crate::wall::wall_ns;

/// An argument of a slice, shown by the viewer when the slice is selected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Arg {
    Num(f64),
    Text(String),
}

impl From<f64> for Arg {
    fn from(v: f64) -> Arg {
        Arg::Num(v)
    }
}

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg::Num(v as f64)
    }
}

impl From<String> for Arg {
    fn from(v: String) -> Arg {
        Arg::Text(v)
    }
}

impl From<&str> for Arg {
    fn from(v: &str) -> Arg {
        Arg::Text(v.to_string())
    }
}

/// One slice on one of a chip's tracks. `virtual_end_ns` is absent for a slice that never
/// ended (a collective the chip was inside when the job hung).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// The track: `compute`, a communication stream (`collectives`, `gather`, `reduce`,
    /// `tensor`), `host`, or a collective's phases (`phases`, `phases part 1`, ...).
    pub track: String,
    pub name: String,
    /// What kind of slice: `step`, `kernel`, `collective`, `phase`, `transfer`.
    pub cat: String,
    pub virtual_start_ns: Nanos,
    pub virtual_end_ns: Option<Nanos>,
    pub wall_start_ns: u64,
    pub wall_end_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<(String, Arg)>,
}

/// A counter's value from a moment of virtual time on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CounterSample {
    pub name: String,
    pub virtual_ns: Nanos,
    pub value: f64,
}

/// An interval during which an outgoing link of the chip was busy sending (consecutive
/// messages merged).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkBusy {
    /// Link slot (see [`crate::link_slot`]): ICI (axis, direction), then DCN.
    pub slot: usize,
    pub start_ns: Nanos,
    pub end_ns: Nanos,
}

/// One message the chip sent, for flow arrows: departure on this chip, arrival at `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MessageEvent {
    pub dst: u32,
    pub depart_ns: Nanos,
    pub arrive_ns: Nanos,
    pub bytes: u64,
}

/// Everything traced on one chip.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChipTrace {
    pub chip: u32,
    pub spans: Vec<Span>,
    pub counters: Vec<CounterSample>,
    pub link_busy: Vec<LinkBusy>,
    /// Only when flows were asked for.
    pub messages: Vec<MessageEvent>,
    /// Records left out once a list reached [`MAX_RECORDS`] (a long job's trace stays bounded).
    #[serde(default)]
    pub left_out: u64,
}

/// Records one chip's trace keeps per list (slices, counter points, busy intervals, messages):
/// a few hundred bytes each, so a trace stays within tens of MB however long the job runs.
pub const MAX_RECORDS: usize = 200_000;

/// Pushes `item` unless `list` is full; counts what is left out.
fn push_bounded<T>(list: &mut Vec<T>, left_out: &mut u64, item: T) -> bool {
    if list.len() < MAX_RECORDS {
        list.push(item);
        true
    } else {
        *left_out += 1;
        false
    }
}

/// A chip's trace while it is being recorded.
#[derive(Debug)]
pub(crate) struct TraceLog {
    pub trace: ChipTrace,
    flows: bool,
    /// Per link slot, the index in `link_busy` of its latest interval.
    last_busy: Vec<Option<usize>>,
}

impl TraceLog {
    pub fn new(chip: u32, flows: bool) -> TraceLog {
        TraceLog {
            trace: ChipTrace {
                chip,
                ..ChipTrace::default()
            },
            flows,
            last_busy: vec![None; crate::fabric::LINK_SLOTS],
        }
    }

    /// Opens a slice at `t`; returns its index for [`TraceLog::close`].
    pub fn open(
        &mut self,
        track: &str,
        cat: &str,
        name: String,
        t: Nanos,
        args: Vec<(String, Arg)>,
    ) -> Option<usize> {
        let span = Span {
            track: track.to_string(),
            name,
            cat: cat.to_string(),
            virtual_start_ns: t,
            virtual_end_ns: None,
            wall_start_ns: wall_ns(),
            wall_end_ns: None,
            args,
        };
        let t = &mut self.trace;
        push_bounded(&mut t.spans, &mut t.left_out, span).then(|| t.spans.len() - 1)
    }

    pub fn close(&mut self, index: usize, t: Nanos) {
        if let Some(s) = self.trace.spans.get_mut(index) {
            s.virtual_end_ns = Some(t.max(s.virtual_start_ns));
            s.wall_end_ns = Some(wall_ns().max(s.wall_start_ns));
        }
    }

    /// A slice whose virtual extent `[start, end)` is known when it is recorded (its wall
    /// extent is the moment of recording).
    pub fn closed(
        &mut self,
        track: String,
        cat: &str,
        name: String,
        (start, end): (Nanos, Nanos),
        args: Vec<(String, Arg)>,
    ) {
        let wall = wall_ns();
        let span = Span {
            track,
            name,
            cat: cat.to_string(),
            virtual_start_ns: start,
            virtual_end_ns: Some(end.max(start)),
            wall_start_ns: wall,
            wall_end_ns: Some(wall),
            args,
        };
        let t = &mut self.trace;
        push_bounded(&mut t.spans, &mut t.left_out, span);
    }

    pub fn counter(&mut self, name: &str, t: Nanos, value: f64) {
        let sample = CounterSample {
            name: name.to_string(),
            virtual_ns: t,
            value,
        };
        let t = &mut self.trace;
        push_bounded(&mut t.counters, &mut t.left_out, sample);
    }

    /// Books a send on link `slot` busy over `[start, end)`, merged with the slot's previous
    /// interval when they touch.
    pub fn link(&mut self, slot: usize, start: Nanos, end: Nanos) {
        if let Some(Some(i)) = self.last_busy.get(slot)
            && let Some(last) = self.trace.link_busy.get_mut(*i)
            && start <= last.end_ns
        {
            last.end_ns = last.end_ns.max(end);
            return;
        }
        let busy = LinkBusy {
            slot,
            start_ns: start,
            end_ns: end,
        };
        let t = &mut self.trace;
        if push_bounded(&mut t.link_busy, &mut t.left_out, busy)
            && let Some(l) = self.last_busy.get_mut(slot)
        {
            *l = Some(t.link_busy.len() - 1);
        }
    }

    pub fn message(&mut self, event: MessageEvent) {
        if self.flows {
            let t = &mut self.trace;
            push_bounded(&mut t.messages, &mut t.left_out, event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_list_counts_what_it_leaves_out() {
        let mut log = TraceLog::new(0, false);
        for i in 0..MAX_RECORDS + 3 {
            log.counter("c", i as f64, 1.0);
        }
        assert_eq!(log.trace.counters.len(), MAX_RECORDS);
        assert_eq!(log.trace.left_out, 3);
        assert_eq!(log.open("t", "step", "s".into(), 0.0, Vec::new()), Some(0));
    }

    #[test]
    fn touching_sends_merge_into_one_busy_interval() {
        let mut log = TraceLog::new(3, false);
        log.link(0, 0.0, 10.0);
        log.link(1, 5.0, 8.0);
        log.link(0, 10.0, 20.0);
        log.link(0, 25.0, 30.0);
        let busy: Vec<(usize, f64, f64)> = log
            .trace
            .link_busy
            .iter()
            .map(|b| (b.slot, b.start_ns, b.end_ns))
            .collect();
        assert_eq!(busy, vec![(0, 0.0, 20.0), (1, 5.0, 8.0), (0, 25.0, 30.0)]);
    }

    #[test]
    fn a_closed_slice_never_ends_before_it_starts() {
        let mut log = TraceLog::new(0, false);
        let i = log
            .open("compute", "kernel", "k".into(), 5.0, Vec::new())
            .unwrap();
        log.close(i, 4.0);
        assert_eq!(log.trace.spans[0].virtual_end_ns, Some(5.0));
        assert!(log.trace.messages.is_empty());
        log.message(MessageEvent {
            dst: 1,
            depart_ns: 0.0,
            arrive_ns: 1.0,
            bytes: 4,
        });
        assert!(log.trace.messages.is_empty(), "no flows asked for");
    }
}
