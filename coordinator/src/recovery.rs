//! Recovery of training jobs that checkpoint (`[recovery] checkpoint_every`, `max_restarts`):
//! after a hang or a dead worker the job is launched again from the last checkpoint every chip
//! completed, without the faults that were injected (they model transient failures). A
//! desync or a corrupting link is not recovered from: it would happen again. Jobs whose
//! workers were started by hand are not relaunched (nothing could start them again).
//!
//! [`Recovery`] is the policy, pure but for reading which checkpoints exist;
//! [`run_with_recovery`] runs attempts under it. It also runs a meta-mode torch job again when
//! its representative rank found it needs one representative per class of ranks
//! ([`LaunchError::Regroup`]): no failure, and no restart counted.

use std::path::PathBuf;

use podsim_programs::job::{JobSpec, Program};
use podsim_programs::train::checkpoint;

use crate::launch::{HangReport, LaunchError, Outcome, WorkerInfo};
use crate::report::Restart;
use crate::watchdog::HangKind;

/// When and from where a failed job is launched again.
#[derive(Debug)]
pub struct Recovery {
    checkpoints: Option<PathBuf>,
    /// The job's [`checkpoint::job_fingerprint`]: only its own checkpoints are resumed from.
    job: String,
    max_restarts: u32,
    relaunchable: bool,
    chips: u32,
    restarts: Vec<Restart>,
    /// Why the job was not restarted although it could have been: no checkpoint verified.
    refused: Option<String>,
}

impl Recovery {
    /// The policy for `spec` (which checkpoints, if it trains with a checkpoint directory):
    /// at most `max_restarts` relaunches, none when the workers are `external`.
    pub fn new(spec: &JobSpec, max_restarts: u32, external: bool) -> Recovery {
        let (checkpoints, job) = match &spec.program {
            Program::Train(t) => (
                t.checkpoint_dir.clone().map(PathBuf::from),
                checkpoint::job_fingerprint(t, &spec.pod),
            ),
            _ => (None, String::new()),
        };
        Recovery {
            checkpoints,
            job,
            refused: None,
            max_restarts,
            relaunchable: !external,
            chips: spec.pod.chips(),
            restarts: Vec::new(),
        }
    }

    /// Removes the checkpoints of an earlier run of the same config (they must not be resumed
    /// from), and nothing else in their folder.
    pub fn clear_old_checkpoints(&self) {
        if let Some(dir) = &self.checkpoints {
            checkpoint::clear(dir);
        }
    }

    /// After an attempt that hung: the restart to make (and `spec` changed to resume from the
    /// last complete checkpoint, without its injected faults), or `None` to stop here.
    pub fn after(&mut self, hang: &HangReport, spec: &mut JobSpec) -> Option<&Restart> {
        // A desync, a corrupt link and a program's exception would come back on a restart.
        let recoverable = !matches!(
            hang.finding.kind,
            HangKind::Desync | HangKind::Corrupt | HangKind::ProgramError
        );
        let allowed = (self.restarts.len() as u32) < self.max_restarts;
        if !(self.relaunchable && recoverable && allowed) {
            return None;
        }
        let dir = self.checkpoints.as_deref()?;
        let found = checkpoint::latest_verified(dir, self.chips, &self.job);
        if found.step.is_none()
            && let Some(newest) = found.skipped.first()
        {
            // Checkpoints were written and none can be trusted: starting over would hide
            // it, resuming would train on damaged state.
            self.refused = Some(format!(
                "not restarted: no checkpoint verifies ({} step(s) tried; the newest, after step {}: {}: {})",
                found.skipped.len(),
                newest.step,
                newest.file,
                newest.reason
            ));
            return None;
        }
        let resume = found.step;
        let resumed_from = resume.unwrap_or(0);
        self.restarts.push(Restart {
            attempt: self.restarts.len() as u32 + 1,
            kind: hang.finding.kind,
            explanation: hang.finding.explanation.clone(),
            failed_at_step: hang.step_reached,
            resumed_from_step: resumed_from,
            steps_lost: hang.step_reached.saturating_sub(u64::from(resumed_from)),
            checkpoints_skipped: found.skipped,
            faults_fired: hang.faults.clone(),
        });
        if let Program::Train(t) = &mut spec.program {
            t.resume_from = resume;
        }
        spec.faults.clear();
        self.restarts.last()
    }

    pub fn max_restarts(&self) -> u32 {
        self.max_restarts
    }

    pub fn into_restarts(self) -> (Vec<Restart>, Option<String>) {
        (self.restarts, self.refused)
    }
}

/// What a job's attempts came to: the last attempt's result, the workers of the last attempt
/// that all joined, and the restarts made.
#[derive(Debug)]
pub struct Attempts {
    pub result: Result<Outcome, LaunchError>,
    pub roster: Vec<WorkerInfo>,
    pub restarts: Vec<Restart>,
    /// Why the last failure was not recovered from although restarts remained.
    pub refused: Option<String>,
    /// Each time the job ran again with finer classes of representative ranks: why.
    pub regroups: Vec<String>,
}

/// Runs `attempt` (one launch: its result and roster) until one ends without a failure
/// `recovery` relaunches after; `on_restart` hears of each restart.
pub fn run_with_recovery(
    mut spec: JobSpec,
    mut recovery: Recovery,
    mut attempt: impl FnMut(&JobSpec) -> (Result<Outcome, LaunchError>, Vec<WorkerInfo>),
    mut on_restart: impl FnMut(&Restart, u32),
    mut on_regroup: impl FnMut(&str, u32),
) -> Attempts {
    recovery.clear_old_checkpoints();
    let max = recovery.max_restarts();
    let mut regroups = Vec::new();
    loop {
        let (result, roster) = attempt(&spec);
        if let Err(LaunchError::Regroup { steps, why }) = &result
            && let Some(finer) = regrouped(&spec, steps)
        {
            let classes = match &finer.program {
                Program::Torch(t) => t.symmetry(&finer.pod).classes(),
                _ => 1,
            };
            on_regroup(why, classes);
            regroups.push(why.clone());
            spec = finer;
            continue;
        }
        let restart = match &result {
            Err(LaunchError::Hang(h)) => recovery.after(h, &mut spec),
            _ => None,
        };
        match restart {
            Some(r) => on_restart(r, max),
            None => {
                let (restarts, refused) = recovery.into_restarts();
                return Attempts {
                    result,
                    roster,
                    restarts,
                    refused,
                    regroups,
                };
            }
        }
    }
}

/// `spec` with its torch representatives standing for the classes of `steps`, if they are
/// finer than the ones it has (each attempt only refines them, so the job runs again at
/// most once per factor of the pod's size).
fn regrouped(spec: &JobSpec, steps: &[u32]) -> Option<JobSpec> {
    let Program::Torch(torch) = &spec.program else {
        return None;
    };
    let mut finer = torch.clone();
    finer.representative_steps = steps.to_vec();
    if finer.symmetry(&spec.pod) == torch.symmetry(&spec.pod) {
        return None;
    }
    Some(JobSpec {
        program: Program::Torch(finer),
        ..spec.clone()
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use podsim_programs::train::{
        Eager, MlpSpec, ModelSpec, OptimizerSpec, Remat, Strategy, TpActivations, TrainSpec,
    };
    use podsim_topology::{Hardware, Pod};

    use super::*;
    use crate::watchdog::Finding;

    fn train_spec(dir: &std::path::Path) -> JobSpec {
        let pod = Pod::single("2".parse().unwrap_or_else(|e| panic!("{e}")));
        JobSpec {
            name: "recovery".into(),
            pod,
            hardware: Hardware::preset("v5p").unwrap_or_else(|e| panic!("{e}")),
            workers: 2,
            program: Program::Train(TrainSpec {
                strategy: Strategy::Ddp,
                eager: Eager::Fused,
                model: ModelSpec::Mlp(MlpSpec { widths: vec![4, 4] }),
                steps: 10,
                batch: 2,
                grad_accum: 1,
                optimizer: OptimizerSpec::Sgd {
                    lr: 0.1,
                    momentum: 0.0,
                    weight_decay: 0.0,
                },
                seed: 0,
                bucket_cap_mb: 25.0,
                reshard_after_forward: true,
                tp: 1,
                replicas: 1,
                algo: podsim_collectives::Algo::Ring,
                meta: false,
                check: false,
                checkpoint_every: 2,
                checkpoint_dir: Some(dir.display().to_string()),
                resume_from: None,
                symmetric: false,
                remat: Remat::default(),
                tp_activations: TpActivations::default(),
                replica_sync: Default::default(),
                grad_reduce: Default::default(),
                reduce_dtype: None,
            }),
            faults: Vec::new(),
            heartbeat_ms: 100,
            recorder_entries: 100,
            watchdog_ms: 2000,
            busy_ms: podsim_job::DEFAULT_BUSY_MS,
            symmetric: false,
            trace: None,
            transport: Default::default(),
        }
    }

    fn hang(kind: HangKind, step: u64) -> LaunchError {
        LaunchError::Hang(Box::new(HangReport {
            finding: Finding {
                kind,
                chip: Some(1),
                worker: Some(1),
                link: None,
                seq: None,
                op: None,
                waiting: Default::default(),
                explanation: format!("{kind:?}"),
                effect_wall_ns: 0,
            },
            recorders: BTreeMap::new(),
            faults: Vec::new(),
            detected_wall_ns: 0,
            step_reached: step,
            pids: BTreeMap::new(),
            torch: Vec::new(),
        }))
    }

    /// Writes a complete checkpoint (every chip) of `spec`'s job after `step`.
    fn checkpointed(dir: &std::path::Path, spec: &JobSpec, step: u32) {
        let Program::Train(t) = &spec.program else {
            panic!("a train job")
        };
        let job = checkpoint::job_fingerprint(t, &spec.pod);
        for chip in 0..2 {
            checkpoint::write(dir, step, chip, &job, &checkpoint::Checkpoint::default())
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn a_dead_worker_is_relaunched_from_the_last_complete_checkpoint_at_most_n_times() {
        let dir = std::env::temp_dir().join(format!("podsim-recovery-{}", std::process::id()));
        let spec = train_spec(&dir);
        let mut results = vec![
            Err(hang(HangKind::DeadWorker, 5)),
            Err(hang(HangKind::StalledChip, 7)),
            Err(hang(HangKind::DeadWorker, 9)),
        ]
        .into_iter();
        let mut seen = Vec::new();
        let attempts = run_with_recovery(
            spec,
            Recovery::new(&train_spec(&dir), 2, false),
            |spec| {
                seen.push(match &spec.program {
                    Program::Train(t) => t.resume_from,
                    _ => None,
                });
                // The attempt wrote checkpoints after steps 4 (first) and 6 (second).
                checkpointed(&dir, spec, 4 + 2 * (seen.len() as u32 - 1));
                (
                    results.next().unwrap_or(Err(LaunchError::Interrupted)),
                    Vec::new(),
                )
            },
            |_, _| {},
            |_, _| {},
        );
        // First run from scratch, then resumed after steps 4 and 6; the third failure is
        // past the two restarts allowed.
        assert_eq!(seen, vec![None, Some(4), Some(6)]);
        let lost: Vec<u64> = attempts.restarts.iter().map(|r| r.steps_lost).collect();
        assert_eq!(lost, vec![1, 1]);
        assert!(matches!(attempts.result, Err(LaunchError::Hang(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_checkpoint_is_skipped_for_an_older_one_and_none_verifying_is_no_restart() {
        let dir = std::env::temp_dir().join(format!("podsim-recovery-ok-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut spec = train_spec(&dir);
        let mut recovery = Recovery::new(&spec, 3, false);
        checkpointed(&dir, &spec, 2);
        checkpointed(&dir, &spec, 4);
        std::fs::write(checkpoint::path(&dir, 4, 1), b"torn").unwrap_or_else(|e| panic!("{e}"));
        let LaunchError::Hang(h) = hang(HangKind::DeadWorker, 5) else {
            return;
        };
        let r = recovery
            .after(&h, &mut spec)
            .unwrap_or_else(|| panic!("restarted"));
        assert_eq!(r.resumed_from_step, 2);
        assert_eq!(r.checkpoints_skipped.len(), 1);
        assert!(
            r.checkpoints_skipped[0]
                .file
                .ends_with("step-4/chip-1.safetensors")
        );
        // Another job's checkpoints (another seed) in the folder: none verifies, no restart.
        let mut other = train_spec(&dir);
        if let Program::Train(t) = &mut other.program {
            t.seed = 9;
        }
        let mut recovery = Recovery::new(&other, 3, false);
        assert!(recovery.after(&h, &mut other).is_none());
        let (_, refused) = recovery.into_restarts();
        let refused = refused.unwrap_or_default();
        assert!(
            refused.contains("no checkpoint verifies") && refused.contains("written for job"),
            "{refused}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_regroup_runs_the_torch_job_again_with_finer_classes_once() {
        let dir = std::env::temp_dir().join(format!("podsim-regroup-{}", std::process::id()));
        let mut spec = train_spec(&dir);
        let torus: podsim_topology::Torus = "4x4".parse().unwrap_or_else(|e| panic!("{e}"));
        spec.pod = Pod::single(torus.set_wrap_all(true));
        spec.program = Program::Torch(podsim_job::TorchSpec {
            command: vec!["python".into()],
            cwd: None,
            topology: "4x4".into(),
            algo: podsim_collectives::Algo::Ring,
            connect_timeout_s: 300,
            meta: true,
            intercept: true,
            prefork: false,
            eager: Eager::Fused,
            count: podsim_job::Count::Steady,
            verify_ranks: Vec::new(),
            representative_steps: Vec::new(),
        });
        let regroup = |steps: Vec<u32>| LaunchError::Regroup {
            steps,
            why: "a segment".into(),
        };
        // Finer classes once; the same classes asked again end the job with that error.
        let mut results = vec![Err(regroup(vec![2, 1])), Err(regroup(vec![2, 1]))].into_iter();
        let (mut seen, mut told) = (Vec::new(), Vec::new());
        let attempts = run_with_recovery(
            spec.clone(),
            Recovery::new(&spec, 2, false),
            |spec| {
                if let Program::Torch(t) = &spec.program {
                    seen.push(t.representative_steps.clone());
                }
                (
                    results.next().unwrap_or(Err(LaunchError::Interrupted)),
                    Vec::new(),
                )
            },
            |_, _| {},
            |why, classes| told.push((why.to_string(), classes)),
        );
        assert_eq!(seen, vec![vec![], vec![2, 1]]);
        assert_eq!(told, vec![("a segment".to_string(), 2)]);
        assert_eq!(attempts.regroups, vec!["a segment".to_string()]);
        assert!(attempts.restarts.is_empty());
        assert!(matches!(attempts.result, Err(LaunchError::Regroup { .. })));
    }

    #[test]
    fn desyncs_corruption_and_external_workers_are_not_relaunched() {
        let dir = std::env::temp_dir().join(format!("podsim-recovery-no-{}", std::process::id()));
        for (kind, external) in [
            (HangKind::Desync, false),
            (HangKind::Corrupt, false),
            (HangKind::DeadWorker, true),
        ] {
            let mut spec = train_spec(&dir);
            let mut recovery = Recovery::new(&spec, 3, external);
            let LaunchError::Hang(h) = hang(kind, 3) else {
                return;
            };
            assert!(recovery.after(&h, &mut spec).is_none(), "{kind:?}");
        }
    }
}
