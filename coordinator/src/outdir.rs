//! One owner per output folder: a job (or a study) takes an exclusive lock on
//! `<dir>/.podsim.lock` for its whole life, so a second job given the same folder is refused
//! at once, naming the first, instead of overwriting its checkpoints and report.
//!
//! The lock is the kernel's (`flock` through [`std::fs::File::try_lock`]): it goes with the
//! process however that ends, `kill -9` included, so a stale lock never blocks a folder. The
//! file's text only says who holds it, for the refusal's message.
//!
//! A folder inside another job's folder is refused too (a job given a study's `point-001`
//! while the study runs would have the study fail when it reached that point), unless the
//! holder is this process's parent: a study's own points run inside its folder.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside an output folder.
pub const LOCK_FILE: &str = ".podsim.lock";

/// An output folder held by this process until the value is dropped.
#[derive(Debug)]
pub struct OutputLock {
    path: PathBuf,
    /// Holding the open file holds the lock.
    _file: File,
}

impl OutputLock {
    /// Takes `dir` (created if missing) for this process; `what` says who holds it
    /// (`podsim launch configs/ddp.toml`). A folder another live process holds is an error
    /// naming that process.
    pub fn acquire(dir: &Path, what: &str) -> Result<OutputLock, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        if let Some((outer, holder)) = held_ancestor(dir) {
            return Err(format!(
                "the output folder {} is inside {}, in use by another job ({holder}); give this one a folder of its own (--out DIR or [output] dir)",
                dir.display(),
                outer.display()
            ));
        }
        let path = dir.join(LOCK_FILE);
        let mut file = open_in_output(&path, OpenOptions::new().read(true).truncate(false))
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                // The holder's command line: a few lines, whatever else the file holds.
                let mut holder = String::new();
                let _ = (&mut file).take(4096).read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() {
                    "another podsim process"
                } else {
                    holder
                };
                return Err(format!(
                    "the output folder {} is in use by another job ({holder}); give this one its own folder (--out DIR or [output] dir)",
                    dir.display()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(format!("cannot lock {}: {e}", path.display()));
            }
        }
        // Who holds it, for a refused job's message; a failure to say so is no reason to
        // refuse the folder.
        let _ = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "pid {}: {what}", std::process::id()));
        Ok(OutputLock { path, _file: file })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The nearest folder above `dir` whose lock another live process holds, with who holds it,
/// unless that is this process (a study checking its point folders) or its parent (a study,
/// whose points run inside its folder).
fn held_ancestor(dir: &Path) -> Option<(PathBuf, String)> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = dir.canonicalize().ok()?;
    let ours =
        [std::process::id(), std::os::unix::process::parent_id()].map(|p| format!("pid {p}:"));
    dir.ancestors().skip(1).find_map(|outer| {
        // Read only, never through a link, never blocking on a FIFO: nothing is created here.
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(outer.join(LOCK_FILE))
            .ok()
            .filter(|f| f.metadata().is_ok_and(|m| m.is_file()))?;
        // Free (a shared lock is granted, and let go when the file closes) or failing to
        // tell: no live holder to refuse for.
        match file.try_lock_shared() {
            Err(std::fs::TryLockError::WouldBlock) => {}
            _ => return None,
        }
        let mut holder = String::new();
        let _ = (&mut file).take(4096).read_to_string(&mut holder);
        let holder = holder.trim().to_string();
        let by_us = ours.iter().any(|p| holder.starts_with(p.as_str()));
        (!by_us).then(|| (outer.to_path_buf(), holder))
    })
}

/// Opens (creating it) a file podsim writes in an output folder, with `options` beyond
/// writing: never through a symbolic link (it wrote wherever the link pointed: a
/// `worker-0.log` linked to a file elsewhere truncated that file) and never a FIFO or a
/// device (the open blocked, or the job wrote into it).
pub fn open_in_output(path: &Path, options: &mut OpenOptions) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = options
        .write(true)
        .create(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// Why podsim cannot write a file at `path`: something there that is not a regular file (the
/// rename of [`write_atomic`] would replace a device such as /dev/full, or a folder's name),
/// or a parent that is not a folder. Checked before a run as well as at the write, so that a
/// bad `--trace` is refused before the work, not after.
pub fn file_target_problem(path: &Path) -> Option<String> {
    if std::fs::metadata(path).is_ok_and(|meta| !meta.is_file()) {
        return Some(format!(
            "{}: not a regular file (podsim writes a file there)",
            path.display()
        ));
    }
    let parent = path.parent().filter(|d| !d.as_os_str().is_empty())?;
    match std::fs::metadata(parent) {
        Ok(meta) if !meta.is_dir() => Some(format!("{}: not a folder", parent.display())),
        _ => None,
    }
}

/// Writes `bytes` to `path` whole or not at all: into a temporary file beside it, flushed to
/// disk, then renamed over `path`. On failure (a full disk) the temporary file is removed
/// and `path` keeps what it held; the error names the file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<PathBuf, String> {
    if let Some(why) = file_target_problem(path) {
        return Err(why);
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp~");
    let tmp = PathBuf::from(tmp);
    let written = File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    let result = written.and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", path.display()));
    }
    Ok(path.to_path_buf())
}

/// Why `name` (a job's or a study's) cannot name its default output folder, `runs/<name>`:
/// a path there would put the output anywhere (`../..` is the folder above the current one).
pub fn folder_name_problem(name: &str) -> Option<&'static str> {
    if name.contains(['/', '\\', '\0']) || matches!(name.trim(), "." | "..") {
        Some(
            "must be a name, not a path (no /, not . or ..): the output folder is runs/<name> unless set",
        )
    } else {
        None
    }
}

/// `path`'s text, if it is a regular file of at most `most` bytes: a device, a FIFO or a
/// wrong file (`/dev/zero`, a log) given where a config or table was meant is refused at once
/// instead of read until memory runs out or blocking forever. Errors say why, not where (the
/// caller names the file).
pub fn read_text(path: &Path, most: u64) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("not a file".into());
    }
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|f| f.take(most + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > most {
        return Err(format!(
            "larger than {} KiB: not what was meant here",
            most >> 10
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        // Where, as a line and column: a byte offset means nothing in an editor.
        let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = good.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = good.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
        format!("not UTF-8 text: line {line}, column {column} is not a UTF-8 character (save the file as UTF-8)")
    })
}

/// The largest file podsim reads back from an output folder (`report.json` of the largest
/// pod, a study's `results.csv`): far above any it writes, below what would exhaust a host.
pub const MOST_OUTPUT_BYTES: u64 = 1 << 32;

/// The last `bytes` of `path`'s text (all of it when shorter), if it is a regular file: a
/// log's last words without reading a log of gigabytes whole.
pub fn read_tail(path: &Path, bytes: u64) -> Result<String, String> {
    use std::io::{Seek, SeekFrom};
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("not a file".into());
    }
    let mut file = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    file.seek(SeekFrom::Start(meta.len().saturating_sub(bytes)))
        .map_err(|e| format!("cannot read it: {e}"))?;
    let mut tail = Vec::new();
    file.take(bytes)
        .read_to_end(&mut tail)
        .map_err(|e| format!("cannot read it: {e}"))?;
    Ok(String::from_utf8_lossy(&tail).into_owned())
}

/// This process's command line, for the lock file (a `--token`'s value left out).
pub fn this_command() -> String {
    redacted(std::env::args())
}

fn redacted(args: impl IntoIterator<Item = String>) -> String {
    let mut out = Vec::new();
    let mut hide_next = false;
    for a in args {
        if hide_next {
            out.push("***".to_string());
            hide_next = false;
        } else if a == "--token" {
            hide_next = true;
            out.push(a);
        } else if a.starts_with("--token=") {
            out.push("--token=***".to_string());
        } else {
            out.push(a);
        }
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_inside_a_held_one_is_refused_unless_the_parent_holds_it() {
        let dir = std::env::temp_dir().join(format!("podsim-nested-{}", std::process::id()));
        let outer = OutputLock::acquire(&dir, "podsim study s.toml").unwrap();
        // Held by this process (a study looking into its points' folders): free to it.
        drop(OutputLock::acquire(&dir.join("point-000"), "podsim study s.toml").unwrap());
        // Held by another process.
        std::fs::write(outer.path(), "pid 1: podsim study s.toml\n").unwrap();
        let err = OutputLock::acquire(&dir.join("point-001"), "podsim launch j.toml").unwrap_err();
        assert!(
            err.contains("is inside") && err.contains("podsim study s.toml"),
            "{err}"
        );
        // A study's own point: the folder's holder is its parent.
        let parent = std::os::unix::process::parent_id();
        std::fs::write(outer.path(), format!("pid {parent}: podsim study s.toml\n")).unwrap();
        let inner = OutputLock::acquire(&dir.join("point-001"), "podsim launch j.toml");
        assert!(inner.is_ok(), "{inner:?}");
        drop((inner, outer));
        // Once let go, the folder inside is free.
        std::fs::write(dir.join(LOCK_FILE), "pid 1: gone\n").unwrap();
        assert!(OutputLock::acquire(&dir.join("point-002"), "podsim launch j.toml").is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_command_line_keeps_no_token() {
        let line = |a: &[&str]| redacted(a.iter().map(|s| s.to_string()));
        assert_eq!(
            line(&[
                "podsim",
                "coordinator",
                "--token",
                "s3cret",
                "--token=x2",
                "a.toml"
            ]),
            "podsim coordinator --token *** --token=*** a.toml"
        );
    }

    #[test]
    fn an_atomic_write_replaces_whole_and_a_failed_one_leaves_the_old_file() {
        let dir = std::env::temp_dir().join(format!("podsim-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("report.json");
        write_atomic(&p, b"old").unwrap();
        write_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        // A folder where the file should be: refused, nothing is left behind.
        let blocked = dir.join("blocked");
        std::fs::create_dir_all(blocked.join("x")).unwrap();
        let e = write_atomic(&blocked, b"text").unwrap_err();
        assert!(e.contains("blocked: not a regular file"), "{e}");
        // A device is not replaced by the file (the rename did, as root).
        let e = write_atomic(Path::new("/dev/null"), b"text").unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        // A write that fails (its folder is a file) names the file, and leaves nothing.
        let e = write_atomic(&p.join("under"), b"text").unwrap_err();
        assert!(e.contains("not a folder"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_owner_is_refused_naming_the_first_and_the_folder_frees_on_drop() {
        let dir = std::env::temp_dir().join(format!("podsim-outdir-{}", std::process::id()));
        let first = OutputLock::acquire(&dir, "podsim launch a.toml").unwrap();
        // A second open file description conflicts with the first even in one process.
        let e = OutputLock::acquire(&dir, "podsim launch b.toml").unwrap_err();
        assert!(e.contains("in use by another job"), "{e}");
        assert!(
            e.contains(&format!("pid {}: podsim launch a.toml", std::process::id())),
            "{e}"
        );
        assert!(first.path().ends_with(LOCK_FILE));
        drop(first);
        let again = OutputLock::acquire(&dir, "podsim launch b.toml");
        assert!(again.is_ok(), "{again:?}");
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_regular_file_of_bounded_size_is_read() {
        let dir = std::env::temp_dir().join(format!("podsim-read-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        std::fs::write(dir.join("small"), "name = 1\n").unwrap();
        std::fs::write(dir.join("big"), vec![b'x'; 2048]).unwrap();
        assert_eq!(
            read_text(&dir.join("small"), 1024).as_deref(),
            Ok("name = 1\n")
        );
        assert!(
            read_text(&dir.join("big"), 1024)
                .unwrap_err()
                .contains("larger than 1 KiB")
        );
        assert_eq!(read_text(&dir, 1024), Err("not a file".into()));
        assert_eq!(
            read_text(Path::new("/dev/zero"), 1024),
            Err("not a file".into())
        );
        // A FIFO blocked the reader until a writer came.
        if made.is_ok_and(|s| s.success()) {
            assert_eq!(read_text(&fifo, 1024), Err("not a file".into()));
            assert_eq!(read_tail(&fifo, 1024), Err("not a file".into()));
        }
        // A tail: the last bytes of a long file, or all of a short one.
        std::fs::write(
            dir.join("log"),
            format!("{}\npodsim: the end\n", "x".repeat(5000)),
        )
        .unwrap();
        assert_eq!(
            read_tail(&dir.join("log"), 16).as_deref(),
            Ok("podsim: the end\n")
        );
        assert_eq!(
            read_tail(&dir.join("small"), 1024).as_deref(),
            Ok("name = 1\n")
        );
        assert_eq!(
            read_tail(Path::new("/dev/zero"), 16),
            Err("not a file".into())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_output_file_is_not_written_through_a_link_or_into_a_fifo() {
        let dir = std::env::temp_dir().join(format!("podsim-open-out-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let outside = dir.join("outside.txt");
        std::fs::write(&outside, "keep").unwrap();
        let link = dir.join("worker-0.log");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        assert!(open_in_output(&link, OpenOptions::new().truncate(true)).is_err());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        // The lock file too: its text was written into the linked file.
        std::os::unix::fs::symlink(&outside, dir.join(LOCK_FILE)).unwrap();
        assert!(OutputLock::acquire(&dir, "test").is_err());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        let fifo = dir.join("worker-1.log");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // No reader: the open would have blocked.
            assert!(open_in_output(&fifo, OpenOptions::new().truncate(true)).is_err());
        }
        let fresh = open_in_output(&dir.join("worker-2.log"), OpenOptions::new().truncate(true));
        assert!(fresh.is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
