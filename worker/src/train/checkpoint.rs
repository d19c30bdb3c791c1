//! Checkpoints: every chip's training state (its parameter pieces, their optimizer state and
//! the step reached) written to `<dir>/step-<N>/chip-<id>.ckpt` every `checkpoint_every` steps,
//! and read back to resume. The data position is the step itself (samples are drawn by
//! index), so a resumed run continues bit for bit where the checkpoint left off.
//!
//! Format (little endian): `PODSIMCK`, version u32, step u32, tensor count u32, then per
//! tensor its element count u64 and f32 values. Files are written to a temporary name and
//! renamed, so a checkpoint file is either whole or absent.

use std::path::{Path, PathBuf};

use crate::error::WorkerError;

const MAGIC: &[u8; 8] = b"PODSIMCK";
const VERSION: u32 = 1;

/// Where chip `chip`'s checkpoint after `step` steps lives.
pub fn path(dir: &Path, step: u32, chip: u32) -> PathBuf {
    dir.join(format!("step-{step}"))
        .join(format!("chip-{chip}.ckpt"))
}

/// Writes `tensors` (each a flat list of values) for `chip` after `step` steps.
pub fn write(dir: &Path, step: u32, chip: u32, tensors: &[Vec<f32>]) -> Result<(), WorkerError> {
    let p = path(dir, step, chip);
    let fail = |e: std::io::Error| WorkerError::Invalid(format!("checkpoint {}: {e}", p.display()));
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).map_err(fail)?;
    }
    let mut out = Vec::with_capacity(16 + tensors.iter().map(|t| 8 + 4 * t.len()).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&step.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
    for t in tensors {
        out.extend_from_slice(&(t.len() as u64).to_le_bytes());
        for v in t {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, &out).map_err(fail)?;
    std::fs::rename(&tmp, &p).map_err(fail)
}

/// Reads chip `chip`'s checkpoint after `step` steps.
pub fn read(dir: &Path, step: u32, chip: u32) -> Result<Vec<Vec<f32>>, WorkerError> {
    let p = path(dir, step, chip);
    let bad = |why: &str| WorkerError::Invalid(format!("checkpoint {}: {why}", p.display()));
    let bytes = std::fs::read(&p).map_err(|e| bad(&e.to_string()))?;
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], WorkerError> {
        let end = at.checked_add(n).ok_or_else(|| bad("truncated"))?;
        let s = bytes.get(at..end).ok_or_else(|| bad("truncated"))?;
        at += n;
        Ok(s)
    };
    if take(8)? != MAGIC {
        return Err(bad("not a podsim checkpoint"));
    }
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if word(take(4)?) != VERSION {
        return Err(bad("unknown version"));
    }
    if word(take(4)?) != step {
        return Err(bad("written for another step"));
    }
    let count = word(take(4)?) as usize;
    let mut tensors = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let n = take(8)?;
        let n = u64::from_le_bytes([n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7]]) as usize;
        let raw = take(n.checked_mul(4).ok_or_else(|| bad("oversized tensor"))?)?;
        tensors.push(
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        );
    }
    Ok(tensors)
}

/// The latest step for which all `chips` chips wrote a checkpoint under `dir`.
pub fn latest_complete(dir: &Path, chips: u32) -> Option<u32> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse::<u32>()
                .ok()
        })
        .filter(|&step| (0..chips).all(|c| path(dir, step, c).is_file()))
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_bits_and_refuses_garbage() {
        let dir = std::env::temp_dir().join(format!("podsim-ckpt-{}", std::process::id()));
        let t = vec![vec![1.5f32, -0.0, f32::MIN_POSITIVE], vec![], vec![3.0]];
        write(&dir, 5, 2, &t).unwrap();
        let back = read(&dir, 5, 2).unwrap();
        assert_eq!(
            back.iter()
                .flatten()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            t.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(latest_complete(&dir, 3), None);
        write(&dir, 5, 0, &t).unwrap();
        write(&dir, 5, 1, &t).unwrap();
        assert_eq!(latest_complete(&dir, 3), Some(5));
        std::fs::write(path(&dir, 5, 1), b"garbage").unwrap();
        assert!(read(&dir, 5, 1).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
