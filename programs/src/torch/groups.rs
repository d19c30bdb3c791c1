//! The groups a rank asks for: the group podsim runs, a refusal the rank raises, or, in meta
//! mode, a regroup when the job's representative ranks do not stand for it.

use podsim_topology::{Group, Pod};

use crate::error::ProgramError;
use podsim_job::torch::TorchSpec;

/// A group request of a rank: the group, unless the ranks do not make one podsim can run
/// (a refusal the rank raises), or, on the mirror fabric, the job's representatives do not
/// stand for it ([`ProgramError::Regroup`]: the job runs again with finer classes).
pub(super) fn declare(
    pod: &Pod,
    spec: &TorchSpec,
    rank: u32,
    ranks: &[u32],
    site: Option<&str>,
    mirrored: bool,
) -> Result<Result<Group, String>, ProgramError> {
    let group = match Group::from_members(pod, rank, ranks) {
        Ok(group) => group,
        Err(e) => {
            return Ok(Err(format!(
                "podsim cannot make a group of ranks {ranks:?}: {e}"
            )));
        }
    };
    if !mirrored {
        return Ok(Ok(group));
    }
    let symmetry = spec.symmetry(pod);
    let needed = symmetry.clone().keeping(&group.parts(pod), pod);
    if needed == symmetry {
        return Ok(Ok(group));
    }
    // Classes exist only for steps that divide their axes (a 4-chip segment of a 6-chip
    // ring repeats nowhere), and each is a process of this host.
    let torus = pod.torus();
    let divides = (0..torus.ndims()).all(|a| torus.dim(a).is_multiple_of(needed.steps()[a]));
    if !divides || needed.classes() > MAX_REPRESENTATIVES {
        return Ok(Err(format!(
            "podsim cannot make a group of ranks {}: it is alike only every {:?} chips along \
             the torus axes, {}; run every rank with --set job.symmetric=false",
            shown_ranks(ranks),
            needed.steps(),
            match divides {
                false => "which do not divide the axes".to_string(),
                true => format!("more than {MAX_REPRESENTATIVES} representative ranks"),
            }
        )));
    }
    Err(ProgramError::Regroup {
        steps: needed.steps().to_vec(),
        why: format!(
            "rank {rank} made a group of ranks {} at {}, alike only every {:?} chips along \
             the torus axes",
            shown_ranks(ranks),
            site.unwrap_or("an unknown line"),
            needed.steps()
        ),
    })
}

/// Most representative ranks (processes of this host) a meta-mode job runs: one per class
/// of ranks alike.
const MAX_REPRESENTATIVES: u32 = 64;

/// A rank list as a message shows it: the first few, and how many in all.
fn shown_ranks(ranks: &[u32]) -> String {
    const SHOWN: usize = 8;
    if ranks.len() <= SHOWN {
        return format!("{ranks:?}");
    }
    let head: Vec<String> = ranks[..SHOWN].iter().map(u32::to_string).collect();
    format!("[{}, ... ({} ranks)]", head.join(", "), ranks.len())
}
