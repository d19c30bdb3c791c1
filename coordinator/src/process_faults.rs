//! Crash and freeze faults, which no worker can report: a `crash` aborts its worker's process
//! and a `freeze` stops it as the fault fires, before a heartbeat can carry the event. The
//! coordinator records one as fired when it sees the mark it leaves - the worker it was aimed
//! at killed by SIGABRT, or found stopped - at a step its trigger allows. A worker that died or
//! stopped otherwise (a `kill -9`, running out of memory, a lost external session) leaves no
//! such mark, and nothing is inferred from it.

use podsim_job::{FaultEvent, FaultKind, FaultSpec};
use podsim_links::procs::killed_by;
use podsim_programs::job::JobSpec;

use crate::watchdog::{Finding, HangKind, STOPPED};

/// SIGABRT, what `std::process::abort` (a crash fault) ends a process with.
const SIGABRT: i32 = 6;

/// The crash or freeze fault `finding` shows fired, if no worker told of it (`told`): the
/// one of that kind aimed at the finding's worker, not told of, whose `at_step` the job had
/// reached (`step_reached`: the furthest step a live chip entered; the fault's own chip may
/// be one ahead), the earliest such if several are. Dated at the finding's effect, the
/// worker's last heartbeat: the earliest it can have fired.
pub fn seen_fired(
    spec: &JobSpec,
    finding: &Finding,
    told: &[FaultEvent],
    step_reached: u64,
) -> Option<FaultEvent> {
    let (kind, effect) = match finding.kind {
        HangKind::DeadWorker if finding.explanation.contains(&killed_by(SIGABRT)) => {
            (FaultKind::Crash, "aborted")
        }
        HangKind::FrozenWorker if finding.explanation.contains(STOPPED) => {
            (FaultKind::Freeze, "stopped")
        }
        _ => return None,
    };
    let worker = finding.worker?;
    let placement = podsim_topology::Placement::new(&spec.pod, spec.workers).ok()?;
    let aimed_here =
        |f: &FaultSpec| f.worker.or_else(|| f.chip.map(|c| placement.worker_of(c))) == Some(worker);
    let reached = |f: &FaultSpec| f.at_step.is_none_or(|n| n <= step_reached + 1);
    let (fault, _) = spec
        .faults
        .iter()
        .enumerate()
        .filter(|(i, f)| {
            f.kind == kind && aimed_here(f) && reached(f) && told.iter().all(|e| e.fault != *i)
        })
        .min_by_key(|(_, f)| f.at_step.unwrap_or(0))?;
    Some(FaultEvent {
        fault,
        kind,
        at_wall_ns: finding.effect_wall_ns,
        detail: format!(
            "worker {worker} {effect}, as a {} fault makes it: seen by the coordinator (the fault stops the worker before it can tell), dated at its last heartbeat",
            kind.name()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4-chip job on 2 workers (chips 0-1 on worker 0, 2-3 on worker 1) with `faults`.
    fn spec(faults: &str) -> JobSpec {
        let text = format!(
            "name = \"t\"\n[topology]\nshape = \"4\"\n[launch]\nworkers = 2\n[job]\n\
             kind = \"collectives\"\niterations = 20\n[[job.collectives]]\nop = \"all-reduce\"\n\
             size = \"1KiB\"\n{faults}"
        );
        crate::config::from_text("test.toml", &text, &[])
            .unwrap_or_else(|e| panic!("{e:?}"))
            .spec()
    }

    fn finding(kind: HangKind, explanation: &str) -> Finding {
        Finding {
            kind,
            chip: Some(2),
            worker: Some(1),
            link: None,
            seq: None,
            op: None,
            waiting: Default::default(),
            explanation: explanation.to_string(),
            effect_wall_ns: 7,
        }
    }

    const TWO_CRASHES: &str = "[[faults]]\nkind = \"crash\"\nworker = 1\nat_step = 9\n\
                               [[faults]]\nkind = \"crash\"\nchip = 3\nat_step = 3\n";

    #[test]
    fn an_aborted_worker_fired_the_crash_whose_step_it_reached() {
        let spec = spec(TWO_CRASHES);
        let aborted = finding(HangKind::DeadWorker, &format!("Worker 1 {}", killed_by(6)));
        let seen = seen_fired(&spec, &aborted, &[], 3).unwrap();
        assert_eq!(
            (seen.fault, seen.kind, seen.at_wall_ns),
            (1, FaultKind::Crash, 7)
        );
        // Told of already: nothing more is inferred; before step 3 neither could fire.
        assert!(seen_fired(&spec, &aborted, &[seen], 3).is_none());
        assert!(seen_fired(&spec, &aborted, &[], 1).is_none());
        // At step 9 both could have: the earlier one fired first.
        assert_eq!(seen_fired(&spec, &aborted, &[], 9).unwrap().fault, 1);
    }

    #[test]
    fn a_worker_that_ended_otherwise_or_elsewhere_fired_nothing() {
        let spec = spec(TWO_CRASHES);
        let killed = finding(HangKind::DeadWorker, &format!("Worker 1 {}", killed_by(9)));
        assert!(seen_fired(&spec, &killed, &[], 9).is_none());
        let mut other = finding(HangKind::DeadWorker, &killed_by(6));
        other.worker = Some(0);
        assert!(seen_fired(&spec, &other, &[], 9).is_none());
        let frozen = finding(HangKind::FrozenWorker, STOPPED);
        assert!(
            seen_fired(&spec, &frozen, &[], 9).is_none(),
            "no freeze fault"
        );
    }

    #[test]
    fn a_stopped_worker_fired_its_freeze() {
        let spec = spec("[[faults]]\nkind = \"freeze\"\nchip = 2\nafter_ms = 100\n");
        let stopped = finding(HangKind::FrozenWorker, STOPPED);
        let seen = seen_fired(&spec, &stopped, &[], 0).unwrap();
        assert_eq!((seen.fault, seen.kind), (0, FaultKind::Freeze));
        let hung = finding(HangKind::FrozenWorker, "the process runs but ...");
        assert!(seen_fired(&spec, &hung, &[], 0).is_none());
    }
}
