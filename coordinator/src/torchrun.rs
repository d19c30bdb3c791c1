//! `podsim run -- torchrun ...`: a torchrun command line run as podsim runs a program.
//!
//! podsim is the launcher: one rank per chip of the topology, each with torchrun's
//! environment. A command copied from a torchrun habit would start torchrun once per chip,
//! each starting ranks of its own (which then fail far from the cause). So the launcher is
//! taken away: its options, which describe a world podsim decides, are dropped and named in
//! a note, and the script runs as torchrun would run it: under torchrun's own Python, as a
//! module (`-m`), or as an executable (`--no-python`). Both spellings are recognised:
//! `torchrun ...` and `python -m torch.distributed.run ...` (or the older
//! `torch.distributed.launch`).

use std::path::{Path, PathBuf};

/// A torchrun command line with the launcher taken away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwrapped {
    /// What each rank runs.
    pub command: Vec<String>,
    /// torchrun's own options, as given (`--nproc-per-node 4`), left out.
    pub dropped: Vec<String>,
}

/// torchrun's options that take no value (torch's `run.py`, and `launch.py`'s `--use-env`);
/// every other option takes one, as `--opt value` or `--opt=value`.
const FLAGS: &[&str] = &[
    "--standalone",
    "-m",
    "--module",
    "--no-python",
    "--no_python",
    "--run-path",
    "--run_path",
    "--virtual-local-rank",
    "--virtual_local_rank",
    "--use-env",
    "--use_env",
];

const LAUNCHER_MODULES: &[&str] = &["torch.distributed.run", "torch.distributed.launch"];

/// `command` without its torchrun launcher, or `None` when it is not a torchrun command line;
/// an error when it names no script.
pub fn unwrapped(command: &[String]) -> Result<Option<Unwrapped>, String> {
    let Some((python, options)) = launcher(command) else {
        return Ok(None);
    };
    let (mut module, mut no_python) = (false, false);
    let mut dropped = Vec::new();
    let mut rest = options.iter();
    while let Some(arg) = rest.next() {
        if arg == "--" {
            // argparse's end of options: the script follows.
            return finish(python, module, no_python, rest.as_slice(), dropped);
        }
        if !arg.starts_with('-') || arg == "-" {
            let tail = std::iter::once(arg.clone()).chain(rest.cloned());
            return finish(
                python,
                module,
                no_python,
                &tail.collect::<Vec<_>>(),
                dropped,
            );
        }
        dropped.push(arg.clone());
        let name = arg.split('=').next().unwrap_or(arg);
        module |= matches!(name, "-m" | "--module");
        no_python |= matches!(name, "--no-python" | "--no_python");
        if !arg.contains('=')
            && !FLAGS.contains(&name)
            && let Some(value) = rest.next()
        {
            dropped.push(value.clone());
        }
    }
    Err(format!(
        "`{}` names no script for torchrun to run",
        command.join(" ")
    ))
}

/// The Python torchrun runs scripts with, and the arguments after the launcher itself.
fn launcher(command: &[String]) -> Option<(String, &[String])> {
    let first = command.first()?;
    let name = Path::new(first).file_name()?.to_str()?;
    if name == "torchrun" {
        return Some((python_of(first), &command[1..]));
    }
    let runs_module = name.starts_with("python")
        && command.get(1).map(String::as_str) == Some("-m")
        && command
            .get(2)
            .is_some_and(|m| LAUNCHER_MODULES.contains(&m.as_str()));
    runs_module.then(|| (first.clone(), &command[3..]))
}

fn finish(
    python: String,
    module: bool,
    no_python: bool,
    script_and_args: &[String],
    dropped: Vec<String>,
) -> Result<Option<Unwrapped>, String> {
    if script_and_args.is_empty() {
        return Err("a torchrun command line names no script to run".into());
    }
    let mut command = Vec::new();
    if !no_python {
        command.push(python);
        if module {
            command.push("-m".into());
        }
    }
    command.extend(script_and_args.iter().cloned());
    Ok(Some(Unwrapped { command, dropped }))
}

/// The interpreter of the `torchrun` entry point `program` (its `#!` line: the Python of the
/// environment it was installed in), else `python3`.
fn python_of(program: &str) -> String {
    let path = if program.contains('/') {
        Some(PathBuf::from(program))
    } else {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(program))
                .find(|p| p.is_file())
        })
    };
    path.and_then(|p| first_line(&p))
        .and_then(|bytes| interpreter(&bytes))
        .unwrap_or_else(|| "python3".into())
}

/// The first 4 KiB of the regular file `path` (a `#!` line fits), never blocking on a FIFO or
/// reading a device or a large file whole.
fn first_line(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let mut start = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(4096)
        .read_to_end(&mut start)
        .ok()?;
    Some(start)
}

/// The Python a script's `#!` line names (directly or through `env`).
fn interpreter(script: &[u8]) -> Option<String> {
    let line = script.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.strip_prefix("#!")?;
    let mut words = line.split_whitespace();
    let mut word = words.next()?;
    if Path::new(word).file_name()?.to_str()? == "env" {
        word = words.find(|w| !w.starts_with('-'))?;
    }
    let is_python = Path::new(word).file_name()?.to_str()?.starts_with("python");
    is_python.then(|| word.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn unwrap(s: &str) -> Unwrapped {
        unwrapped(&words(s)).unwrap().unwrap()
    }

    #[test]
    fn a_module_launcher_keeps_its_python_and_drops_its_options() {
        let u = unwrap(
            "/venv/bin/python -m torch.distributed.run --nproc-per-node 8 --standalone \
             --master_port=29500 train.py --lr 3e-4",
        );
        assert_eq!(u.command, words("/venv/bin/python train.py --lr 3e-4"));
        assert_eq!(
            u.dropped,
            words("--nproc-per-node 8 --standalone --master_port=29500")
        );
    }

    #[test]
    fn module_and_executable_modes_run_as_torchrun_runs_them() {
        let m = unwrap("python3 -m torch.distributed.launch --use-env -m pkg.train --steps 2");
        assert_eq!(m.command, words("python3 -m pkg.train --steps 2"));
        let x = unwrap("python -m torch.distributed.run --no-python --nnodes 1 ./train.sh a");
        assert_eq!(x.command, words("./train.sh a"));
        let dashes = unwrap("python -m torch.distributed.run -r 3 -- t.py -m x");
        assert_eq!(dashes.command, words("python t.py -m x"));
    }

    #[test]
    fn other_commands_are_left_alone_and_a_missing_script_is_an_error() {
        assert_eq!(
            unwrapped(&words("python train.py --nproc-per-node 8")),
            Ok(None)
        );
        assert_eq!(unwrapped(&words("python -m pkg.train")), Ok(None));
        assert!(unwrapped(&words("torchrun --nproc-per-node 8")).is_err());
        assert!(unwrapped(&words("python -m torch.distributed.run --standalone --")).is_err());
    }

    #[test]
    fn torchruns_python_is_read_from_its_first_line() {
        assert_eq!(
            interpreter(b"#!/venv/bin/python3.11\nimport sys\n"),
            Some("/venv/bin/python3.11".into())
        );
        assert_eq!(
            interpreter(b"#!/usr/bin/env -S python3\n"),
            Some("python3".into())
        );
        assert_eq!(interpreter(b"#!/bin/sh\nexec python\n"), None);
        let dir = std::env::temp_dir().join(format!("podsim-torchrun-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let torchrun = dir.join("torchrun");
        std::fs::write(
            &torchrun,
            "#!/opt/env/bin/python\nfrom torch.distributed.run import main\n",
        )
        .unwrap();
        let u = unwrap(&format!("{} --nproc_per_node=2 t.py", torchrun.display()));
        assert_eq!(u.command, words("/opt/env/bin/python t.py"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
