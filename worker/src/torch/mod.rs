//! PyTorch programs on the emulated pod: each chip serves one rank, a process running the
//! user's script with the `podsim` torch.distributed backend (`python/podsim/torch.py`).
//!
//! The rank computes with its own torch; every collective it calls comes here as a request
//! and runs on its chip, on podsim's fabric, algorithms and virtual clock, under the same
//! flight recorder, fault hooks and desync checks as podsim's own programs. So the watchdog
//! diagnoses a Python program as it does any other: a rank that never arrives is a stalled
//! chip (its flight recorder carries the rank's Python stack), a rank that calls a different
//! collective is a desync, a rank that dies is reported with its exit code or signal.
//!
//! - [`wire`]: the frames between a rank and its chip;
//! - [`boot`]: what a rank's interpreter loads before the program (`podsim._intercept`);
//! - [`verify`]: ranks run beside a representative to check it stands for them;
//! - [`ranks`]: starting the rank processes, their output and exits, their connections;
//! - [`serve`]: a chip serving its rank's requests.

pub mod boot;
pub mod ranks;
pub mod serve;
pub mod verify;
pub use podsim_links::rank_wire as wire;
pub use wire::StepCounting;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use podsim_collectives::{Chip, run_chips};
use serde::{Deserialize, Serialize};

pub use podsim_job::torch::{Count, TorchSpec};

use crate::error::WorkerError;

/// What one rank did, in virtual time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: u32,
    pub pid: u32,
    /// How the process ended.
    pub exit: Option<String>,
    /// The chip's virtual clock at the end, ns.
    pub virtual_ns: f64,
    /// Compute charged from the torch ops the rank ran, ns.
    pub compute_ns: f64,
    /// Time in collectives, ns.
    pub comm_ns: f64,
    /// Per collective kind: calls, bytes of this rank's inputs, virtual time.
    pub collectives: Vec<OpTotals>,
    /// Per step the program marked (`podsim.torch.step()`, or each `optimizer.step()`).
    pub steps: Vec<RankStep>,
    /// Whether the rank connected to its chip (created a podsim process group).
    #[serde(default)]
    pub connected: bool,
    /// Meta mode: the values made up for the program, by what and where.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stand_ins: Vec<wire::StandIn>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpTotals {
    pub op: String,
    pub calls: u64,
    pub bytes: u64,
    pub virtual_ns: f64,
}

/// One step of a rank, in virtual ns. A collective runs on a communication stream from its
/// issue and the rank's compute waits for it where the program waits (see
/// `python/podsim/_streams.py`), so communication overlapped with compute is hidden.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankStep {
    pub step_ns: f64,
    pub compute_ns: f64,
    pub comm_ns: f64,
    /// Step time minus compute.
    pub exposed_comm_ns: f64,
    /// The rank's peak of live device bytes over the step (0: not counted).
    #[serde(default)]
    pub peak_hbm_bytes: u64,
    /// Those bytes by kind at the peak.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hbm_by_kind: Vec<(String, u64)>,
    /// Matmul and attention flops the step executed (recomputation included).
    #[serde(default)]
    pub flops: f64,
    /// Of `flops`, the model's: what activation checkpointing recomputed left out.
    #[serde(default)]
    pub model_flops: f64,
    /// How the step's compute was known: counted op by op, or replayed from the rank's
    /// steady step (`python/podsim/_replay.py`).
    #[serde(default)]
    pub counting: StepCounting,
}

/// Where each rank made its latest call (`file:line function`), so that a desync names the
/// line of both programs.
#[derive(Debug, Clone, Default)]
pub struct CallSites(Arc<std::sync::Mutex<std::collections::HashMap<u32, String>>>);

impl CallSites {
    pub fn set(&self, chip: u32, site: Option<String>) {
        if let (Ok(mut map), Some(site)) = (self.0.lock(), site) {
            map.insert(chip, site);
        }
    }

    pub fn get(&self, chip: u32) -> String {
        self.0
            .lock()
            .ok()
            .and_then(|m| m.get(&chip).cloned())
            .unwrap_or_else(|| "an unknown line".into())
    }

    /// `error` with both chips' call sites, when it is a disagreement between two chips.
    pub fn name(&self, error: podsim_collectives::CollectiveError) -> WorkerError {
        use podsim_collectives::CollectiveError as E;
        let pair = match &error {
            E::Desync { chip, peer, .. } | E::Mismatch { chip, peer, .. } => Some((*chip, *peer)),
            _ => None,
        };
        match pair {
            Some((chip, peer)) => WorkerError::AtCallSites {
                mine: self.get(chip),
                theirs: self.get(peer),
                error: Box::new(error),
                chip,
                peer,
            },
            None => error.into(),
        }
    }
}

/// How long a shadow's failure waits for the representatives' own ending, which decides when
/// it is a regroup (the shadow then failed only because its representative stopped).
const SECOND_OPINION: std::time::Duration = std::time::Duration::from_secs(1);

/// Starts a rank per chip and serves each until it exits; `done` counts marked steps. The
/// representative chips of the mirror fabric have the job's `verify_ranks` run beside them
/// as shadows, each compared with the representative of its class (see [`verify`]).
/// A failed job's error, carrying also the steps of this worker's ranks that the failure
/// stopped mid-run (their serving was dropped): the report keeps every rank's work.
fn with_stopped_ranks(error: WorkerError, progress: &serve::Progress) -> WorkerError {
    let stopped = progress.taken();
    if stopped.is_empty() || error.is_regroup() {
        return error;
    }
    let (error, mut ranks) = match error {
        WorkerError::TorchFailed { error, ranks } => (error, ranks),
        other => (Box::new(other), Vec::new()),
    };
    let failed: Vec<u32> = ranks.iter().map(|r| r.rank).collect();
    ranks.extend(stopped.into_iter().filter(|r| !failed.contains(&r.rank)));
    ranks.sort_by_key(|r| r.rank);
    WorkerError::TorchFailed { error, ranks }
}

pub async fn run(
    chips: Vec<Chip>,
    spec: &TorchSpec,
    done: Arc<AtomicU64>,
) -> Result<Vec<RankReport>, WorkerError> {
    let Some(world) = chips.first().map(|c| c.pod().chips()) else {
        return Ok(Vec::new());
    };
    let pod = chips[0].pod().clone();
    let shadows = shadow_ranks(&chips, spec, world);
    let symmetry = spec.symmetry(&pod);
    let class_of = |rank: u32| symmetry.representative(&pod, rank);
    let mut recorders: Vec<_> = chips.iter().map(Chip::recorder).collect();
    for &shadow in &shadows {
        recorders.push(Arc::new(podsim_collectives::FlightRecorder::new(
            shadow,
            16,
            Arc::new(podsim_collectives::Inbox::new()),
        )));
    }
    let hardware = chips[0].hardware().clone();
    let (ranks, _guard) = ranks::start(spec, world, &recorders, &hardware).await?;
    let mut ranks: HashMap<u32, ranks::Rank> = ranks.into_iter().map(|r| (r.rank, r)).collect();
    // The calls of each representative that a shadow checks.
    let references: HashMap<u32, Arc<verify::Reference>> = shadows
        .iter()
        .map(|&s| (class_of(s), Arc::new(verify::Reference::default())))
        .collect();
    let shadow_ranks: Vec<_> = shadows.iter().filter_map(|s| ranks.remove(s)).collect();
    let (shadow_tasks, mut failure) =
        start_shadows(shadow_ranks, spec, &references, &class_of, &pod);
    let progress = serve::Progress::default();
    let served = serve_chips(chips, spec, done, ranks, &references, &progress);
    tokio::pin!(served);
    let reports = tokio::select! {
        reports = &mut served => reports,
        Some(e) = failure.recv() => {
            // A shadow whose representative ended (a regroup) fails second: the
            // representative's own ending decides.
            return match tokio::time::timeout(SECOND_OPINION, &mut served).await {
                Ok(Err(rep)) if rep.is_regroup() => Err(rep),
                _ => Err(e),
            };
        }
    };
    // The representatives ended: a shadow's desync is still the job's failure.
    for task in shadow_tasks {
        let _ = task.await;
    }
    if let Ok(e) = failure.try_recv()
        && !matches!(&reports, Err(rep) if rep.is_regroup())
    {
        return Err(e);
    }
    let reports = reports.map_err(|e| with_stopped_ranks(e, &progress))?;
    if !reports.is_empty() && reports.iter().all(|r| !r.connected) {
        return Err(went_around_podsim(spec));
    }
    Ok(reports)
}

/// The `--verify-ranks` ranks this worker runs besides its chips' (only when its chips
/// mirror their classes: then every other rank is a representative's).
fn shadow_ranks(chips: &[Chip], spec: &TorchSpec, world: u32) -> Vec<u32> {
    if !chips.iter().all(Chip::mirrored) {
        return Vec::new();
    }
    let representatives: Vec<u32> = chips.iter().map(Chip::id).collect();
    spec.verify_ranks
        .iter()
        .copied()
        .filter(|r| !representatives.contains(r) && *r < world)
        .collect()
}

/// Serves each shadow against its representative's calls (`references`, by representative),
/// each on a task of its own; the receiver gets the first shadow's failure, which ends the
/// job at once, whatever the representatives are doing.
fn start_shadows(
    shadows: Vec<ranks::Rank>,
    spec: &TorchSpec,
    references: &HashMap<u32, Arc<verify::Reference>>,
    class_of: &dyn Fn(u32) -> u32,
    pod: &podsim_topology::Pod,
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    tokio::sync::mpsc::Receiver<WorkerError>,
) {
    let (failed, failure) = tokio::sync::mpsc::channel(1);
    let tasks = shadows
        .into_iter()
        .map(|rank| {
            let rep = class_of(rank.rank);
            let reference = references[&rep].clone();
            let (spec, failed, pod) = (spec.clone(), failed.clone(), pod.clone());
            tokio::spawn(async move {
                if let Err(e) = verify::serve_shadow(rank, &spec, &reference, rep, &pod).await {
                    // The first failure is the job's; a later shadow's must not wait for a
                    // reader (the job waits for every shadow task at its end).
                    let _ = failed.try_send(e);
                }
            })
        })
        .collect();
    (tasks, failure)
}

/// Serves every representative rank on its chip until all end or one fails.
async fn serve_chips(
    chips: Vec<Chip>,
    spec: &TorchSpec,
    done: Arc<AtomicU64>,
    ranks: HashMap<u32, ranks::Rank>,
    references: &HashMap<u32, Arc<verify::Reference>>,
    progress: &serve::Progress,
) -> Result<Vec<RankReport>, WorkerError> {
    let ranks = Arc::new(std::sync::Mutex::new(ranks));
    let sites = CallSites::default();
    run_chips(chips, |mut chip| {
        let (spec, done, ranks) = (spec.clone(), done.clone(), ranks.clone());
        let progress = progress.clone();
        let (sites, checked) = (sites.clone(), references.get(&chip.id()).cloned());
        async move {
            let rank = ranks
                .lock()
                .ok()
                .and_then(|mut r| r.remove(&chip.id()))
                .ok_or_else(|| WorkerError::Internal(format!("no rank for chip {}", chip.id())))?;
            let (checked, progress) = (checked.as_deref(), &progress);
            let report = serve::serve(&mut chip, rank, &spec, &sites, checked, progress).await?;
            done.fetch_add(report.steps.len() as u64, Ordering::Relaxed);
            Ok::<_, WorkerError>(report)
        }
    })
    .await
}

/// The error of a job in which no rank created a podsim process group.
fn went_around_podsim(spec: &TorchSpec) -> WorkerError {
    WorkerError::Invalid(format!(
        "no rank used podsim: every rank ended without creating a podsim process group, so \
         its collectives (if any) went around the emulated pod{}",
        if spec.intercept {
            " - does the program call torch.distributed.init_process_group?"
        } else {
            " - with --no-intercept the program must `import podsim.torch` and call \
             init_process_group(\"podsim\")"
        }
    ))
}
