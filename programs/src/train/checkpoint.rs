//! Checkpoints: every chip's training state (its parameter pieces, their optimizer state and
//! the step reached) written to `<dir>/step-<N>/chip-<id>.safetensors` every
//! `checkpoint_every` steps, and read back to resume. The data position is the step itself
//! (samples are drawn by index), so a resumed run continues bit for bit where the checkpoint
//! left off.
//!
//! The format is safetensors, so a user opens a chip's checkpoint from Python with one call
//! (`safetensors.numpy.load_file(path)` or `safetensors.torch.load_file(path)`): one f32
//! tensor per parameter piece under the parameter's name (`fc1.weight`) with the piece's shape,
//! its optimizer buffers as `fc1.weight.optimizer.0`, `.1`, ... (SGD's momentum; AdamW's
//! first and second moments), and in the metadata the `step`, the `chip` and each parameter's
//! optimizer step count (`fc1.weight.optimizer_step`). Files are written to a temporary name
//! and renamed, so a checkpoint file is either whole or absent.
//!
//! A checkpoint proves itself before it is resumed from: its metadata names the job it
//! belongs to ([`job_fingerprint`]: a hash of everything that determines the training, so a
//! file of another job, or of the same job on another pod, is refused), its chip and its step,
//! and carries an FNV-1a checksum of every tensor's bytes (`<name>.fnv1a`; FNV-1a detects
//! every change confined to one byte, so every single flipped bit). [`read`] checks all of
//! them; [`latest_verified`] finds the newest step whose every chip passes, saying which newer
//! ones it skipped and why.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use podsim_collectives::bits::fnv1a_bytes;
use podsim_topology::Pod;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::ProgramError;
use crate::train::TrainSpec;

const EXTENSION: &str = "safetensors";
/// Metadata keys podsim writes beside the tensors.
const KEY_FORMAT: &str = "podsim_checkpoint";
const KEY_JOB: &str = "job";
const KEY_STEP: &str = "step";
const KEY_CHIP: &str = "chip";
/// The suffix of a tensor's checksum key (`fc1.weight.fnv1a`).
const CHECKSUM_SUFFIX: &str = ".fnv1a";
/// The version of the layout above; a file of another version is refused.
const FORMAT_VERSION: &str = "2";

/// One named tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// A chip's checkpoint: its tensors and the string metadata beside them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checkpoint {
    pub tensors: Vec<Saved>,
    pub metadata: HashMap<String, String>,
}

impl Checkpoint {
    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&Saved> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A hash of everything that determines `spec`'s training on `pod`: two jobs with the same
/// fingerprint compute the same values step for step, so one may resume from the other's
/// checkpoint. Where checkpoints go and which one a run resumes from are left out: they
/// differ between the attempts of one job.
pub fn job_fingerprint(spec: &TrainSpec, pod: &Pod) -> String {
    let mut spec = spec.clone();
    spec.checkpoint_dir = None;
    spec.resume_from = None;
    // Serialising plain structs does not fail; should it ever, Debug is as deterministic.
    let text = serde_json::to_vec(&(&spec, pod))
        .unwrap_or_else(|_| format!("{spec:?} {pod:?}").into_bytes());
    format!("{:016x}", fnv1a_bytes(text))
}

/// Removes the checkpoints under `dir` that podsim writes - `step-N/chip-M.safetensors` and
/// their temporary `.tmp` files - and each `step-N` folder left empty; anything else there is
/// someone else's and stays (the whole folder was removed, a user's files with it).
pub fn clear(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for step in entries.flatten() {
        let is_step = step
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .is_some_and(|n| n.parse::<u32>().is_ok());
        if !is_step || !step.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(files) = std::fs::read_dir(step.path()) else {
            continue;
        };
        for file in files.flatten() {
            let name = file.file_name();
            let ours = name.to_str().is_some_and(|n| {
                let chip = n
                    .strip_suffix(&format!(".{EXTENSION}"))
                    .or_else(|| n.strip_suffix(".tmp"));
                chip.and_then(|c| c.strip_prefix("chip-"))
                    .is_some_and(|c| c.parse::<u32>().is_ok())
            });
            if ours && file.file_type().is_ok_and(|t| t.is_file()) {
                let _ = std::fs::remove_file(file.path());
            }
        }
        // Only when empty: `remove_dir` refuses a folder with anything left in it.
        let _ = std::fs::remove_dir(step.path());
    }
}

/// Where chip `chip`'s checkpoint after `step` steps lives.
pub fn path(dir: &Path, step: u32, chip: u32) -> PathBuf {
    dir.join(format!("step-{step}"))
        .join(format!("chip-{chip}.{EXTENSION}"))
}

fn checksum(values: &[f32]) -> String {
    let bytes: &[u8] = bytemuck::cast_slice(values);
    format!("{:016x}", fnv1a_bytes(bytes.iter().copied()))
}

/// Writes `checkpoint` for `chip` of job `job` after `step` steps (the job, step, chip and
/// each tensor's checksum go into the metadata). The file is written under a temporary
/// name, flushed to disk and renamed: it is whole or absent, never torn.
pub fn write(
    dir: &Path,
    step: u32,
    chip: u32,
    job: &str,
    checkpoint: &Checkpoint,
) -> Result<(), ProgramError> {
    let p = path(dir, step, chip);
    let fail = |e: String| ProgramError::Invalid(format!("checkpoint {}: {e}", p.display()));
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).map_err(|e| fail(e.to_string()))?;
    }
    let views = checkpoint
        .tensors
        .iter()
        .map(|t| {
            let bytes: &[u8] = bytemuck::cast_slice(&t.values);
            TensorView::new(Dtype::F32, t.shape.clone(), bytes)
                .map(|view| (t.name.clone(), view))
                .map_err(|e| fail(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut metadata = checkpoint.metadata.clone();
    metadata.insert(KEY_FORMAT.into(), FORMAT_VERSION.into());
    metadata.insert(KEY_JOB.into(), job.into());
    metadata.insert(KEY_STEP.into(), step.to_string());
    metadata.insert(KEY_CHIP.into(), chip.to_string());
    for t in &checkpoint.tensors {
        metadata.insert(format!("{}{CHECKSUM_SUFFIX}", t.name), checksum(&t.values));
    }
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| fail(e.to_string()))?;
    let tmp = p.with_extension("tmp");
    write_synced(&tmp, &bytes).map_err(|e| fail(e.to_string()))?;
    std::fs::rename(&tmp, &p).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(e.to_string())
    })
}

/// Writes `bytes` to `path` and waits until they are on disk; on failure removes what it
/// wrote, so a full disk leaves no partial file behind.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let result = std::fs::File::create(path).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Reads chip `chip`'s checkpoint of job `job` after `step` steps, verified (see
/// [`verify`]); an error names the file and what is wrong with it.
pub fn read(dir: &Path, step: u32, chip: u32, job: &str) -> Result<Checkpoint, ProgramError> {
    let p = path(dir, step, chip);
    verify(&p, step, chip, job)
        .map_err(|why| ProgramError::Invalid(format!("checkpoint {}: {why}", p.display())))
}

/// Reads the file `p` and checks that it is a podsim checkpoint of job `job`, chip `chip`
/// after `step` steps, whose every tensor matches its checksum. The error says what failed.
pub fn verify(p: &Path, step: u32, chip: u32, job: &str) -> Result<Checkpoint, String> {
    let bytes = read_whole_file(p)?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let field = |key: &str| metadata.get(key).map(String::as_str).unwrap_or("none");
    if field(KEY_FORMAT) != FORMAT_VERSION {
        return Err(format!(
            "not a podsim checkpoint of format {FORMAT_VERSION} ({KEY_FORMAT} is {})",
            field(KEY_FORMAT)
        ));
    }
    let expect = [
        (KEY_JOB, job.to_string()),
        (KEY_STEP, step.to_string()),
        (KEY_CHIP, chip.to_string()),
    ];
    for (key, want) in expect {
        if field(key) != want {
            return Err(format!(
                "written for {key} {}, not {key} {want}",
                field(key)
            ));
        }
    }
    let file = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(format!("tensor {name} is {:?}, not F32", view.dtype()));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = metadata.get(&format!("{name}{CHECKSUM_SUFFIX}"));
        match want {
            None => return Err(format!("tensor {name} has no checksum")),
            Some(want) if *want != checksum(&values) => {
                return Err(format!(
                    "tensor {name} fails its checksum (the file changed after it was written)"
                ));
            }
            Some(_) => {}
        }
        tensors.push(Saved {
            shape: view.shape().to_vec(),
            values,
            name,
        });
    }
    let names: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    if let Some(lost) = metadata
        .keys()
        .filter_map(|k| k.strip_suffix(CHECKSUM_SUFFIX))
        .find(|n| !names.contains(n))
    {
        return Err(format!("tensor {lost} is missing"));
    }
    Ok(Checkpoint { tensors, metadata })
}

/// The most bytes of a safetensors header (the format's own bound).
const MOST_HEADER_BYTES: u64 = 100_000_000;

/// The bytes of the checkpoint file `p`, read only once it is known to be one whole: a
/// regular file (a FIFO among the checkpoints blocked the restart for ever) whose size is
/// what its safetensors header declares (a foreign or truncated file, or a huge one, is
/// refused from its first bytes instead of read into memory whole).
fn read_whole_file(p: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let meta = std::fs::metadata(p).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mut file = std::fs::File::open(p).map_err(|e| e.to_string())?;
    let mut start = [0u8; 8];
    file.read_exact(&mut start)
        .map_err(|_| "not a safetensors file: shorter than its header".to_string())?;
    let header_len = u64::from_le_bytes(start);
    if header_len > MOST_HEADER_BYTES || 8 + header_len > meta.len() {
        return Err(format!(
            "not a safetensors file: a header of {header_len} bytes in {} bytes",
            meta.len()
        ));
    }
    let mut bytes = start.to_vec();
    (&mut file)
        .take(header_len)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    let data = declared_data_bytes(&bytes[8..])?;
    // A crafted header's offsets can overflow the sum: no such file exists.
    let whole = (8 + header_len).checked_add(data);
    if whole != Some(meta.len()) {
        let whole = whole.map_or("more than 2^64".to_string(), |w| w.to_string());
        return Err(format!(
            "not a whole checkpoint: {} bytes where its header declares {whole}",
            meta.len()
        ));
    }
    file.take(data)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// The bytes of tensor data a safetensors header declares: the end of its last tensor.
fn declared_data_bytes(header: &[u8]) -> Result<u64, String> {
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| format!("not a safetensors file: its header: {e}"))?;
    header
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .map(|(name, tensor)| {
            tensor["data_offsets"][1]
                .as_u64()
                .ok_or_else(|| format!("not a safetensors file: tensor {name} has no data offsets"))
        })
        .try_fold(0, |end, tensor_end| Ok(end.max(tensor_end?)))
}

/// A checkpoint step passed over when choosing where to resume, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub step: u32,
    /// The first file of the step that failed (or is missing).
    pub file: String,
    pub reason: String,
}

/// Where a job can resume: the newest step whose every chip's checkpoint verifies, and the
/// newer steps passed over on the way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resumable {
    pub step: Option<u32>,
    pub skipped: Vec<Skipped>,
}

/// The newest step under `dir` at which all `chips` chips of job `job` wrote a checkpoint
/// that [`verify`] accepts. Reads every file of each step it tries, newest first.
pub fn latest_verified(dir: &Path, chips: u32, job: &str) -> Resumable {
    let mut steps: Vec<u32> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    let mut found = Resumable::default();
    for step in steps {
        let failure = (0..chips).find_map(|chip| {
            let p = path(dir, step, chip);
            verify(&p, step, chip, job).err().map(|reason| Skipped {
                step,
                file: p.display().to_string(),
                reason,
            })
        });
        match failure {
            Some(s) => found.skipped.push(s),
            None => {
                found.step = Some(step);
                break;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {

    #[test]
    fn clearing_removes_podsims_checkpoints_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("podsim-ckpt-clear-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = [
            ("step-3/chip-0.safetensors", false),
            ("step-3/chip-1.tmp", false),
            ("step-4/chip-0.safetensors", false),
            ("step-4/notes.txt", true),
            ("mine/thesis.txt", true),
            ("step-x/chip-0.safetensors", true),
            ("thesis.safetensors", true),
        ];
        for (f, _) in files {
            let p = dir.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"x").unwrap();
        }
        clear(&dir);
        for (f, kept) in files {
            assert_eq!(dir.join(f).exists(), kept, "{f}");
        }
        assert!(!dir.join("step-3").exists(), "an emptied step folder stays");
        let _ = std::fs::remove_dir_all(&dir);
    }

    use super::*;

    const JOB: &str = "00000000000000aa";

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("podsim-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn sample() -> Checkpoint {
        let tensor = |name: &str, shape: Vec<usize>, values: Vec<f32>| Saved {
            name: name.into(),
            shape,
            values,
        };
        Checkpoint {
            tensors: vec![
                tensor("fc1.weight", vec![1, 3], vec![1.5, -0.0, f32::MIN_POSITIVE]),
                tensor("fc1.bias", vec![0], vec![]),
                tensor(
                    "fc1.weight.optimizer.0",
                    vec![1, 3],
                    vec![3.0, f32::NAN, -1.0],
                ),
            ],
            metadata: HashMap::from([("fc1.weight.optimizer_step".into(), "7".into())]),
        }
    }

    #[test]
    fn round_trips_bits_names_shapes_and_refuses_garbage() {
        let dir = scratch("trip");
        let c = sample();
        write(&dir, 5, 2, JOB, &c).unwrap();
        let back = read(&dir, 5, 2, JOB).unwrap();
        for t in &c.tensors {
            let b = back.tensor(&t.name).unwrap();
            assert_eq!(b.shape, t.shape);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&b.values), bits(&t.values), "{}", t.name);
        }
        assert_eq!(back.metadata["fc1.weight.optimizer_step"], "7");
        assert!(read(&dir, 6, 2, JOB).is_err(), "a missing step");
        std::fs::write(path(&dir, 5, 2), b"garbage").unwrap();
        let e = read(&dir, 5, 2, JOB).unwrap_err().to_string();
        assert!(
            e.contains("chip-2.safetensors") && e.contains("not a safetensors"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_fifo_a_folder_a_cut_or_a_grown_file_is_refused_without_reading_it_whole() {
        let dir = scratch("odd");
        let c = sample();
        write(&dir, 5, 0, JOB, &c).unwrap();
        let file = path(&dir, 5, 0);
        let whole = std::fs::read(&file).unwrap();
        let refused = |why: &str| {
            let e = read(&dir, 5, 0, JOB).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        };
        // A FIFO blocked the read (and the restart) for ever; a folder is not a file either.
        std::fs::remove_file(&file).unwrap();
        let status = std::process::Command::new("mkfifo")
            .arg(&file)
            .status()
            .unwrap();
        assert!(status.success());
        refused("not a regular file");
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        refused("not a regular file");
        std::fs::remove_dir(&file).unwrap();
        // A cut file, one with bytes after its data, and a huge sparse one.
        std::fs::write(&file, &whole[..whole.len() - 1]).unwrap();
        refused("not a whole checkpoint");
        std::fs::write(&file, [whole.as_slice(), b"x"].concat()).unwrap();
        refused("not a whole checkpoint");
        std::fs::File::create(&file)
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        refused("not a safetensors file");
        std::fs::write(&file, &whole).unwrap();
        assert!(read(&dir, 5, 0, JOB).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Flips bit `bit` of the byte at `offset` from the end of the file (inside the data).
    fn flip(p: &Path, offset_from_end: usize, bit: u8) {
        let mut bytes = std::fs::read(p).unwrap();
        let i = bytes.len() - offset_from_end;
        bytes[i] ^= 1 << bit;
        std::fs::write(p, bytes).unwrap();
    }

    #[test]
    fn every_single_bit_flip_in_the_data_and_every_foreign_file_is_refused() {
        let dir = scratch("flip");
        let c = sample();
        // Every bit of every data byte (the data is the end of the file).
        let data_bytes = 4 * 6;
        for offset in 1..=data_bytes {
            for bit in 0..8 {
                write(&dir, 4, 0, JOB, &c).unwrap();
                flip(&path(&dir, 4, 0), offset, bit);
                let e = read(&dir, 4, 0, JOB).unwrap_err().to_string();
                assert!(
                    e.contains("fails its checksum"),
                    "byte -{offset} bit {bit}: {e}"
                );
            }
        }
        // Chip 1's file copied over chip 0's; a file renamed to another step; another job's.
        write(&dir, 4, 1, JOB, &c).unwrap();
        std::fs::copy(path(&dir, 4, 1), path(&dir, 4, 0)).unwrap();
        let e = read(&dir, 4, 0, JOB).unwrap_err().to_string();
        assert!(e.contains("written for chip 1, not chip 0"), "{e}");
        std::fs::create_dir_all(dir.join("step-6")).unwrap();
        std::fs::copy(path(&dir, 4, 1), path(&dir, 6, 1)).unwrap();
        let e = read(&dir, 6, 1, JOB).unwrap_err().to_string();
        assert!(e.contains("written for step 4, not step 6"), "{e}");
        let e = read(&dir, 4, 1, "ffffffffffffffff")
            .unwrap_err()
            .to_string();
        assert!(e.contains("written for job 00000000000000aa"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn resumes_from_the_newest_step_whose_every_chip_verifies_and_says_what_it_skipped() {
        let dir = scratch("latest");
        let c = sample();
        assert_eq!(latest_verified(&dir, 2, JOB), Resumable::default());
        for step in [2, 4, 6] {
            for chip in 0..2 {
                write(&dir, step, chip, JOB, &c).unwrap();
            }
        }
        write(&dir, 8, 0, JOB, &c).unwrap(); // incomplete: chip 1 never wrote step 8
        flip(&path(&dir, 6, 1), 3, 7);
        let r = latest_verified(&dir, 2, JOB);
        assert_eq!(r.step, Some(4));
        let skipped: Vec<(u32, bool)> = r
            .skipped
            .iter()
            .map(|s| (s.step, s.file.ends_with("chip-1.safetensors")))
            .collect();
        assert_eq!(skipped, vec![(8, true), (6, true)]);
        assert!(r.skipped[1].reason.contains("checksum"), "{:?}", r.skipped);
        // Another job's checkpoints verify nowhere.
        let other = latest_verified(&dir, 2, "0000000000000bbb");
        assert_eq!((other.step, other.skipped.len()), (None, 4));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_fingerprint_changes_with_what_trains_and_not_with_where_it_is_saved() {
        use crate::train::{
            Eager, MlpSpec, ModelSpec, OptimizerSpec, Remat, Strategy, TpActivations,
        };
        let spec = TrainSpec {
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
            checkpoint_dir: Some("a".into()),
            resume_from: None,
            symmetric: false,
            remat: Remat::default(),
            tp_activations: TpActivations::default(),
            replica_sync: Default::default(),
            grad_reduce: Default::default(),
            reduce_dtype: None,
        };
        let pod = Pod::single("2x2".parse().unwrap());
        let base = job_fingerprint(&spec, &pod);
        let mut moved = spec.clone();
        moved.checkpoint_dir = Some("b".into());
        moved.resume_from = Some(4);
        assert_eq!(job_fingerprint(&moved, &pod), base);
        let mut seeded = spec.clone();
        seeded.seed = 1;
        assert_ne!(job_fingerprint(&seeded, &pod), base);
        assert_ne!(
            job_fingerprint(&spec, &Pod::single("4".parse().unwrap())),
            base
        );
    }
}
