//! What a rank's interpreter loads before the user's program: a `sitecustomize.py` in a
//! folder of its own, put first on the rank's `PYTHONPATH`, that imports `podsim._intercept`
//! (any backend, any `cuda` device lands on podsim; meta mode's fake tensors). The folder
//! lives as long as the job's ranks and is removed after them.

use std::path::PathBuf;

use crate::error::ProgramError;

const SITECUSTOMIZE: &str = include_str!("sitecustomize.py");

/// The folder holding the ranks' `sitecustomize.py`, removed when dropped.
#[derive(Debug)]
pub struct BootDir(PathBuf);

impl BootDir {
    /// Writes the folder under the system's temporary directory, named for this process.
    /// Folders of workers that no longer run (killed before they could remove theirs) go.
    pub fn write() -> Result<BootDir, ProgramError> {
        remove_orphans();
        let dir =
            std::env::temp_dir().join(format!("podsim-boot-{}-{}", std::process::id(), unique()));
        let failed = |e: std::io::Error| {
            ProgramError::Invalid(format!(
                "cannot write the ranks' sitecustomize.py under {}: {e}",
                dir.display()
            ))
        };
        std::fs::create_dir_all(&dir).map_err(failed)?;
        std::fs::write(dir.join("sitecustomize.py"), SITECUSTOMIZE).map_err(failed)?;
        Ok(BootDir(dir))
    }

    /// The rank's `PYTHONPATH`: this folder first, then what the worker had.
    pub fn python_path(&self) -> std::ffi::OsString {
        let mut paths = vec![self.0.clone()];
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            paths.extend(std::env::split_paths(&old));
        }
        std::env::join_paths(paths).unwrap_or_else(|_| self.0.clone().into_os_string())
    }
}

impl Drop for BootDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Removes the boot folders of processes that have ended (`podsim-boot-PID-N` with no
/// `/proc/PID`): a worker killed with its ranks cannot remove its own. A PID used again
/// only keeps a folder longer.
fn remove_orphans() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("podsim-boot-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A number no other boot folder of this process has.
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn folders_of_ended_processes_go_and_live_ones_stay() {
        let temp = std::env::temp_dir();
        // No process has this PID (above Linux's largest, 2^22).
        let ended = temp.join("podsim-boot-4294967294-7");
        let mine = BootDir::write().unwrap();
        std::fs::create_dir_all(&ended).unwrap();
        let again = BootDir::write().unwrap();
        assert!(!ended.exists(), "the folder of an ended process is left");
        assert!(mine.0.exists() && again.0.exists());
        let path = mine.0.clone();
        drop(mine);
        assert!(!path.exists(), "a dropped folder stays");
    }
}
