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
//! - `groups`: the groups a rank asks for, and when meta mode must regroup;
//! - [`verify`]: ranks run beside a representative to check it stands for them;
//! - [`ranks`]: starting the rank processes, their output and exits, their connections;
//! - [`serve`]: a chip serving its rank's requests;
//! - `report`: what a rank did, as the job's report gives it.

pub mod boot;
mod groups;
mod objects;
pub mod ranks;
pub(crate) mod report;
pub mod serve;
pub mod verify;
pub use podsim_links::rank_wire as wire;
pub use report::{OpTotals, RankReport, RankStep};
pub use wire::StepCounting;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use podsim_collectives::trace::ChipTrace;
use podsim_collectives::{Chip, run_chips};

pub use podsim_job::torch::TorchSpec;

use crate::error::ProgramError;

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
    pub fn name(&self, error: podsim_collectives::CollectiveError) -> ProgramError {
        use podsim_collectives::CollectiveError as E;
        let pair = match &error {
            E::Desync { chip, peer, .. } | E::Mismatch { chip, peer, .. } => Some((*chip, *peer)),
            _ => None,
        };
        match pair {
            Some((chip, peer)) => ProgramError::AtCallSites {
                mine: self.get(chip),
                theirs: self.get(peer),
                error: Box::new(error),
                chip,
                peer,
                verified: false,
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
fn with_stopped_ranks(error: ProgramError, progress: &serve::Progress) -> ProgramError {
    let stopped = progress.taken();
    if stopped.is_empty() || error.is_regroup() {
        return error;
    }
    let (error, mut ranks) = match error {
        ProgramError::TorchFailed { error, ranks } => (error, ranks),
        other => (Box::new(other), Vec::new()),
    };
    let failed: Vec<u32> = ranks.iter().map(|r| r.rank).collect();
    ranks.extend(stopped.into_iter().filter(|r| !failed.contains(&r.rank)));
    ranks.sort_by_key(|r| r.rank);
    ProgramError::TorchFailed { error, ranks }
}

pub async fn run(
    chips: Vec<Chip>,
    spec: &TorchSpec,
    done: Arc<AtomicU64>,
) -> Result<(Vec<RankReport>, Vec<ChipTrace>), ProgramError> {
    let Some(world) = chips.first().map(|c| c.pod().chips()) else {
        return Ok((Vec::new(), Vec::new()));
    };
    let pod = chips[0].pod().clone();
    let shadows = shadow_ranks(&chips, spec, world);
    let symmetry = spec.symmetry(&pod);
    let class_of = |rank: u32| symmetry.representative(&pod, rank);
    let recorders = recorders(&chips, &shadows);
    let hardware = chips[0].hardware().clone();
    let (ranks, guard) = ranks::start(spec, world, &recorders, &hardware).await?;
    let mut ranks: HashMap<u32, ranks::Rank> = ranks.into_iter().map(|r| (r.rank, r)).collect();
    // The calls of each representative that a shadow checks.
    let references: HashMap<u32, Arc<verify::Reference>> = shadows
        .iter()
        .map(|&s| (class_of(s), Arc::new(verify::Reference::default())))
        .collect();
    let quiet = guard.quiet();
    let board = Arc::new(objects::Board::new(
        chips.iter().map(Chip::id).chain(shadows.iter().copied()),
    ));
    let shadow_ranks: Vec<_> = shadows.iter().filter_map(|s| ranks.remove(s)).collect();
    let (shadow_tasks, mut failure) = start_shadows(
        shadow_ranks,
        spec,
        &references,
        &class_of,
        &pod,
        (&board, &quiet),
    );
    let progress = serve::Progress::default();
    let shared = Shared {
        references: &references,
        board: &board,
        quiet: quiet.clone(),
    };
    let served = serve_chips(chips, spec, done, ranks, &shared, &progress);
    tokio::pin!(served);
    let reports = tokio::select! {
        reports = &mut served => reports,
        Some(e) = failure.recv() => return Err(second_opinion(e, served, &progress).await),
    };
    let reports = match reports {
        Ok(reports) => reports,
        Err(e) => {
            // The representatives' failure is the job's; the shadows stop with it (their
            // processes go with the job's when `guard` drops).
            for task in &shadow_tasks {
                task.abort();
            }
            return Err(with_stopped_ranks(e, &progress));
        }
    };
    // The representatives ended: a shadow's desync is still the job's failure.
    for task in shadow_tasks {
        let _ = task.await;
    }
    if let Ok(e) = failure.try_recv() {
        return Err(e);
    }
    let (reports, traces): (Vec<RankReport>, Vec<Option<ChipTrace>>) = reports.into_iter().unzip();
    if !reports.is_empty() && reports.iter().all(|r| !r.connected) {
        return Err(went_around_podsim(spec));
    }
    Ok((reports, traces.into_iter().flatten().collect()))
}

/// The job's error when shadow rank's failure `e` came first. A shadow whose representative
/// ended (a regroup) fails second: the representative's own ending decides. So it does when
/// both programs failed (the same line on every rank): the representative is the rank the
/// user knows (rank 0), not a verified one they never asked about.
async fn second_opinion<F>(
    e: ProgramError,
    served: std::pin::Pin<&mut F>,
    progress: &serve::Progress,
) -> ProgramError
where
    F: std::future::Future<Output = Result<Vec<(RankReport, Option<ChipTrace>)>, ProgramError>>,
{
    let shadow_failed = matches!(e, ProgramError::RankExited { .. });
    match tokio::time::timeout(SECOND_OPINION, served).await {
        Ok(Err(rep)) if rep.is_regroup() => rep,
        Ok(Err(rep)) if shadow_failed => with_stopped_ranks(rep, progress),
        _ => e,
    }
}

/// A flight recorder per rank process: the chips' own, and a small one for each shadow.
fn recorders(chips: &[Chip], shadows: &[u32]) -> Vec<Arc<podsim_collectives::FlightRecorder>> {
    let mut recorders: Vec<_> = chips.iter().map(Chip::recorder).collect();
    for &shadow in shadows {
        recorders.push(Arc::new(podsim_collectives::FlightRecorder::new(
            shadow,
            16,
            Arc::new(podsim_collectives::Inbox::new()),
        )));
    }
    recorders
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
    (board, quiet): (&Arc<objects::Board>, &Arc<AtomicBool>),
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    tokio::sync::mpsc::Receiver<ProgramError>,
) {
    let (failed, failure) = tokio::sync::mpsc::channel(1);
    let tasks = shadows
        .into_iter()
        .map(|rank| {
            let rep = class_of(rank.rank);
            let reference = references[&rep].clone();
            let (spec, failed, pod) = (spec.clone(), failed.clone(), pod.clone());
            let (board, quiet) = (board.clone(), quiet.clone());
            tokio::spawn(async move {
                let shadow = verify::Shadow {
                    representative: rep,
                    reference: &reference,
                    board: &board,
                    quiet: &quiet,
                };
                if let Err(e) = verify::serve_shadow(rank, &spec, &shadow, &pod).await {
                    // The first failure is the job's; a later shadow's must not wait for a
                    // reader (the job waits for every shadow task at its end).
                    let _ = failed.try_send(e);
                }
            })
        })
        .collect();
    (tasks, failure)
}

/// What the representatives' servings share: each one's calls for its shadows, the object
/// board, and the flag that silences the ranks' output at a regroup.
struct Shared<'a> {
    references: &'a HashMap<u32, Arc<verify::Reference>>,
    board: &'a Arc<objects::Board>,
    quiet: Arc<AtomicBool>,
}

/// Serves every representative rank on its chip until all end or one fails.
async fn serve_chips(
    chips: Vec<Chip>,
    spec: &TorchSpec,
    done: Arc<AtomicU64>,
    ranks: HashMap<u32, ranks::Rank>,
    shared: &Shared<'_>,
    progress: &serve::Progress,
) -> Result<Vec<(RankReport, Option<ChipTrace>)>, ProgramError> {
    let ranks = Arc::new(std::sync::Mutex::new(ranks));
    let sites = CallSites::default();
    run_chips(chips, |mut chip| {
        let (spec, done, ranks) = (spec.clone(), done.clone(), ranks.clone());
        let (progress, board) = (progress.clone(), shared.board.clone());
        let (sites, checked) = (sites.clone(), shared.references.get(&chip.id()).cloned());
        let quiet = shared.quiet.clone();
        async move {
            let rank = ranks
                .lock()
                .ok()
                .and_then(|mut r| r.remove(&chip.id()))
                .ok_or_else(|| ProgramError::Internal(format!("no rank for chip {}", chip.id())))?;
            let context = serve::Context {
                spec: &spec,
                sites: &sites,
                reference: checked.as_deref(),
                board: &board,
                quiet: &quiet,
            };
            let report = serve::serve(&mut chip, rank, &context, &progress).await?;
            done.fetch_add(report.steps.len() as u64, Ordering::Relaxed);
            Ok::<_, ProgramError>((report, chip.take_trace()))
        }
    })
    .await
}

/// The error of a job in which no rank created a podsim process group.
fn went_around_podsim(spec: &TorchSpec) -> ProgramError {
    ProgramError::Invalid(format!(
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
