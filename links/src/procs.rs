//! Processes this one starts that must not outlive it: a PyTorch job's ranks, and whatever
//! they start themselves (data-loader workers, a shell's children).
//!
//! Three things hold a rank to its worker, each covering what the others cannot:
//! - the kernel: [`die_with_parent`] gives the rank `SIGKILL` as its parent-death signal before
//!   it runs anything, so the rank dies with its worker however the worker ends (`kill -9`
//!   included). The signal is not inherited across `fork`: it takes the rank, not its children;
//! - its process group: each rank leads a group of its own (its pgid is its pid), which its
//!   children join unless they leave it on purpose. A [`Group`] kills the whole group when the
//!   job ends, when its rank has exited (what it left behind), and when dropped;
//! - the keeper: a small shell started once per process (`/bin/sh`, its own process group,
//!   deaf to `SIGINT`, `SIGHUP` and `SIGTERM`), told each group as it comes and goes over a
//!   pipe whose write end only this process holds. The pipe reaches end-of-file when this
//!   process ends, however it ends (`kill -9`, `exit` without destructors, a crash), and the
//!   keeper then kills every group still listed: the ranks' children, which the parent-death
//!   signal does not reach, die then too.
//!
//! One group per rank rather than one for all: a rank's group exists from its start until its
//! last member ends, whatever the other ranks do. A shared group would be named after its
//! first rank, and a later rank could no longer join it once that rank had exited and been
//! reaped (`setpgid` fails), which a rank refused at once (a wrong token) does within
//! milliseconds. torchrun does the same (a session per worker process, killed with `killpg`).
//!
//! A fourth catches what leaves the group and the session (`setsid`): [`adopt_orphans`] makes
//! the worker (and the coordinator above it) the reaper of orphaned descendants, and
//! [`kill_escaped`] kills those that started a session of their own when the job ends.
//!
//! `unsafe` here is what std does not wrap: the `pre_exec` hook between `fork` and `exec`
//! (`prctl`, `getppid`, `_exit`), `kill(2)` of a process group, `getrlimit(2)` (how many
//! processes a job may start, [`process_limit`]), and the child subreaper (`prctl`, `kill`
//! and `waitpid` of an adopted child).
#![allow(unsafe_code)]

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Starts `command`'s process in a process group of its own (its pgid is its pid) with
/// `SIGKILL` as its parent-death signal, set before it runs anything.
///
/// Linux sends the parent-death signal when the *thread* that forked the child ends, not the
/// process: call this and `spawn` on a thread that lives as long as the child should (a
/// worker's main thread, which polls its job). A tokio command passes `as_std_mut()`.
pub fn die_with_parent(command: &mut Command) {
    command.process_group(0);
    killed_with_parent(command);
}

/// `SIGKILL` as `command`'s parent-death signal, set before it runs anything; its process
/// group is left as it is (a study's points stay in the terminal's group, so Ctrl-C reaches
/// them). The same caveat as [`die_with_parent`]: the signal comes when the forking thread ends.
pub fn killed_with_parent(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the hook runs in the child between `fork` and `exec`, where only
    // async-signal-safe calls are sound: `prctl`, `getppid` and `_exit` are plain system calls
    // (no lock, no allocation), the closure only reads an integer it captured, and
    // `Error::last_os_error` builds an error from `errno` without allocating.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died between `fork` and `prctl`: then no signal will come,
            // and the child has already been handed to another parent. Nobody waits for it.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Sends `SIGKILL` to process group `pgid`. Ids below 2 are refused: `kill(0)` would signal
/// this process's own group and `kill(-1)` every process it may signal.
fn kill_group(pgid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid < 2 {
        return;
    }
    // SAFETY: kill(2) touches no memory of this process; a group that no longer exists is
    // ESRCH, ignored.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// The process group of one rank (its pgid is the rank's pid), listed with the keeper while
/// it may have members.
#[derive(Debug)]
pub struct Group {
    pgid: u32,
    /// The group's leader has been reaped and what it left killed: the id is no longer ours
    /// to signal (once the group is empty, the kernel may give the number to another).
    ended: AtomicBool,
}

impl Group {
    /// The group that [`die_with_parent`] made for the process `pgid`, just spawned (and not
    /// yet waited for).
    pub fn new(pgid: u32) -> Group {
        if pgid >= 2 {
            tell_keeper('+', pgid);
        }
        Group {
            pgid,
            ended: AtomicBool::new(false),
        }
    }

    /// Kills every process of the group (the rank and what it started), unless it ended.
    pub fn kill(&self) {
        if !self.ended.load(Ordering::Acquire) {
            kill_group(self.pgid);
        }
    }

    /// The rank has exited and been reaped: kills what it left in its group, and forgets the
    /// group.
    pub fn end(&self) {
        if !self.ended.swap(true, Ordering::AcqRel) && self.pgid >= 2 {
            kill_group(self.pgid);
            tell_keeper('-', self.pgid);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.end();
    }
}

/// The keeper's script: reads `+ PGID` and `- PGID` lines while this process lives; at
/// end-of-file kills every group still listed. `kill -9 -PGID` is the form both dash and
/// bash take (dash refuses `-s KILL -PGID` and `--`).
const KEEPER_SCRIPT: &str = r#"trap '' INT HUP TERM
groups=
while read -r op g; do
  case $op in
    +) groups="$groups $g" ;;
    -) left=; for x in $groups; do [ "$x" = "$g" ] || left="$left $x"; done; groups=$left ;;
  esac
done
for g in $groups; do kill -9 -"$g" 2>/dev/null; done
"#;

enum Keeper {
    NotStarted,
    Running {
        stdin: ChildStdin,
        _child: Child,
    },
    /// It could not start, or its pipe broke: the ranks still have their parent-death signal
    /// and their [`Group`]s.
    Failed,
}

static KEEPER: Mutex<Keeper> = Mutex::new(Keeper::NotStarted);

fn start_keeper() -> Keeper {
    // std makes its pipes close-on-exec: the write end stays in this process alone (a child
    // forked meanwhile holds it only until its `exec`).
    let started = Command::new("/bin/sh")
        .arg("-c")
        .arg(KEEPER_SCRIPT)
        .arg("podsim-keeper")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Out of this process's group: a Ctrl-C at the terminal, or a kill of the group,
        // must leave the keeper to do its work.
        .process_group(0)
        .spawn();
    match started {
        Ok(mut child) => match child.stdin.take() {
            Some(stdin) => Keeper::Running {
                stdin,
                _child: child,
            },
            None => Keeper::Failed,
        },
        Err(e) => {
            tracing::warn!(
                "cannot start the keeper of rank process groups (/bin/sh: {e}): a rank's own \
                 children may outlive a worker that is killed"
            );
            Keeper::Failed
        }
    }
}

fn tell_keeper(op: char, pgid: u32) {
    let mut keeper = KEEPER.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(*keeper, Keeper::NotStarted) {
        *keeper = start_keeper();
    }
    if let Keeper::Running { stdin, .. } = &mut *keeper {
        // One short line: written whole (a pipe takes up to PIPE_BUF bytes at once).
        if let Err(e) = stdin.write_all(format!("{op} {pgid}\n").as_bytes()) {
            tracing::warn!("the keeper of rank process groups is gone: {e}");
            *keeper = Keeper::Failed;
        }
    }
}

/// What the kernel says process `pid` is doing, in words, for a report: its state, where it
/// sleeps, its CPU time, threads, and the other processes of its group (empty when `/proc`
/// cannot tell).
pub fn describe(pid: u32) -> String {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return String::new();
    };
    let Some(fields) = podsim_collectives::procfs::stat_fields(&stat) else {
        return String::new();
    };
    let state = match fields.first().copied().unwrap_or("?") {
        "R" => "running or waiting for a core (state R)",
        "S" => "sleeping (state S)",
        "D" => "in an uninterruptible wait, usually I/O (state D)",
        "T" => "stopped (state T)",
        "t" => "stopped by a debugger (state t)",
        "Z" => "a zombie (state Z)",
        _ => "in state ?",
    };
    let mut parts = vec![state.to_string()];
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    let wchan = wchan.trim();
    if !wchan.is_empty() && wchan != "0" {
        parts.push(format!("in {wchan}"));
    }
    // SAFETY: sysconf(3) only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    if let (Some(user), Some(system)) = (ticks(11), ticks(12)) {
        parts.push(format!("{:.1} s of CPU", (user + system) as f64 / hz));
    }
    if let Some(threads) = ticks(17) {
        parts.push(format!(
            "{threads} thread{}",
            if threads == 1 { "" } else { "s" }
        ));
    }
    let others = group_members(pid).len();
    if others > 0 {
        parts.push(format!(
            "{others} more process{} in its group",
            if others == 1 { "" } else { "es" }
        ));
    }
    parts.join(", ")
}

/// The processes of process group `pgid` other than its leader.
fn group_members(pgid: u32) -> Vec<u32> {
    processes()
        .filter(|p| p.pid != pgid && p.pgrp == pgid)
        .map(|p| p.pid)
        .collect()
}

/// What `/proc/PID/stat` says of a process: who it is and where it belongs.
#[derive(Debug, Clone, Copy)]
struct ProcStat {
    pid: u32,
    ppid: u32,
    pgrp: u32,
    session: u32,
}

/// The processes `/proc` shows (none when it cannot be read).
fn processes() -> impl Iterator<Item = ProcStat> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(proc_stat)
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = podsim_collectives::procfs::stat_fields(&text)?;
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u32>().ok());
    Some(ProcStat {
        pid,
        ppid: field(1)?,
        pgrp: field(2)?,
        session: field(3)?,
    })
}

/// Makes this process the parent of its orphaned descendants (Linux's child subreaper): a
/// rank's child that left the rank's process group and session (`setsid`, Python's
/// `start_new_session=True`, a daemon) escapes the group kill, and when the rank ends it
/// comes here instead of to init, where [`kill_escaped`] finds it.
pub fn adopt_orphans() {
    // SAFETY: prctl(2) with PR_SET_CHILD_SUBREAPER sets a flag of this process; no memory.
    let set = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if set != 0 {
        tracing::warn!(
            "cannot adopt orphaned rank descendants: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Kills and reaps this process's children that left its session: descendants of ranks that
/// started sessions of their own and were adopted (see [`adopt_orphans`]); their own children
/// come next, adopted in turn. Returns their ids. Ranks, their groups and the keeper share
/// this process's session and are left alone.
pub fn kill_escaped() -> Vec<u32> {
    let me = std::process::id();
    let Some(session) = proc_stat(me).map(|s| s.session) else {
        return Vec::new();
    };
    let mut killed = Vec::new();
    // A killed escapee's children are adopted in turn: a few rounds reach a daemon's tree.
    for _ in 0..8 {
        let escaped: Vec<u32> = processes()
            .filter(|p| p.ppid == me && p.session != session)
            .map(|p| p.pid)
            .collect();
        if escaped.is_empty() {
            break;
        }
        for pid in escaped {
            let Ok(id) = libc::pid_t::try_from(pid) else {
                continue;
            };
            // SAFETY: kill(2) on a child of this process touches no memory.
            unsafe {
                libc::kill(id, libc::SIGKILL);
            }
            // Reaped with WNOHANG, polled for a second at most: a process stuck in the kernel
            // (state D) must not hold this one's exit.
            for _ in 0..100 {
                let mut status = 0;
                // SAFETY: waitpid(2) on a child of this process writes only `status`.
                if unsafe { libc::waitpid(id, &mut status, libc::WNOHANG) } != 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            killed.push(pid);
        }
    }
    killed
}

/// How a process killed by signal `sig` is told, with the usual cause of the two that have
/// one: SIGKILL, the kernel's out-of-memory killer's (or a `kill -9`); SIGABRT, an abort (what
/// a crash fault does). Worker and rank exits alike.
pub fn killed_by(sig: i32) -> String {
    match sig {
        libc::SIGKILL => {
            "killed by signal 9 (SIGKILL: the host out of memory, or a kill -9)".into()
        }
        libc::SIGABRT => "killed by signal 6 (SIGABRT: it aborted)".into(),
        _ => format!("killed by signal {sig}"),
    }
}

/// The most processes this host lets the user start: the kernel's `pid_max`, or the soft
/// `RLIMIT_NPROC` when lower and the user is not root (the kernel does not hold root to it);
/// none when neither can be read.
pub fn process_limit() -> Option<u64> {
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok());
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut limit) } == 0;
    // SAFETY: getuid(2) reads this process's real user id; it cannot fail. The kernel checks
    // the real user's count, and exempts the root of the initial user namespace (and
    // holders of CAP_SYS_RESOURCE or CAP_SYS_ADMIN, not looked for: the limit is kept then).
    let root = unsafe { libc::getuid() } == 0 && in_initial_user_namespace();
    let nproc = (read && !root && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur);
    match (pid_max, nproc) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Whether this process's user namespace is the initial one: its uid map is the identity
/// over every id (`0 0 4294967295`), where a container's maps a range of ids.
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map").is_ok_and(|map| {
        let fields: Vec<&str> = map.split_whitespace().collect();
        fields == ["0", "0", "4294967295"]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_group_below_2_is_ever_signalled() {
        // Would kill this test's own group (0) or every process it may signal (1).
        kill_group(0);
        kill_group(1);
        kill_group(u32::MAX);
    }

    #[test]
    fn this_process_is_described_by_its_state_and_cpu_time() {
        let me = describe(std::process::id());
        assert!(me.contains("state") && me.contains("s of CPU"), "{me}");
        assert_eq!(describe(u32::MAX), "");
    }
}
