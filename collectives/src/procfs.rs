//! What Linux's `/proc` tells about this process's threads and about other processes: a
//! thread's id and run-queue delay (for [`crate::CpuWaitMeter`]), and the fields of a
//! process's or thread's `stat` line (for the watchdogs that ask whether a process is stopped,
//! running or asleep). Everything here is `None` or zero where the kernel does not tell.

/// This thread's id in the kernel, or 0 where the kernel does not tell.
pub(crate) fn os_thread_id() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// The time thread `tid` of this process has spent, in all, ready to run but waiting for a
/// CPU, ns (`None` where the kernel does not tell).
pub(crate) fn run_queue_delay_ns(tid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    parse_schedstat_delay(&text)
}

/// Each thread of process `pid` with its run-queue delay so far, ns (empty where the kernel
/// does not tell, or the process is gone).
pub fn process_run_queue_delays(pid: u32) -> Vec<(u32, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let tid: u32 = t.file_name().to_str()?.parse().ok()?;
            let text = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            Some((tid, parse_schedstat_delay(&text)?))
        })
        .collect()
}

/// The run-queue delay of a `schedstat` line: `<on-cpu ns> <run-queue ns> <timeslices>`.
fn parse_schedstat_delay(text: &str) -> Option<u64> {
    text.split_whitespace().nth(1)?.parse().ok()
}

/// The fields of a `/proc/PID/stat` (or `/proc/PID/task/TID/stat`) line after the command
/// name, which may itself hold spaces and parentheses: the state (`R`, `S`, `T`, ...) first,
/// then the parent's pid, and so on (utime and stime are at 11 and 12).
pub fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_queue_delay_is_the_second_field() {
        assert_eq!(
            parse_schedstat_delay("208603983 13944972 383\n"),
            Some(13944972)
        );
        assert_eq!(parse_schedstat_delay("garbage"), None);
        assert_eq!(parse_schedstat_delay(""), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_threads_delay_is_read_where_the_kernel_counts_it() {
        let tid = os_thread_id();
        assert!(tid > 0);
        // Kernels built without scheduler statistics have no file: the measure is absent.
        if std::path::Path::new(&format!("/proc/self/task/{tid}/schedstat")).exists() {
            assert!(run_queue_delay_ns(tid).is_some());
        }
    }

    #[test]
    fn stat_fields_start_after_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (py (worker) 1) S 1 2 3 4 5 6 7 8 9 10 111 222 0";
        let f = stat_fields(line).expect("fields");
        assert_eq!((f[0], f[11], f[12]), ("S", "111", "222"));
        assert_eq!(stat_fields("no parenthesis"), None);
    }
}
