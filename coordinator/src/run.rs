//! `podsim run`: a PyTorch program on the emulated pod with torchrun's habits. The flags make
//! the same job a `[job] kind = "torch"` config would (one rank per chip, every rank in one
//! worker's chips), so a run and a config are launched, watched and reported alike.

use std::path::PathBuf;

use clap::Args;

use crate::CliError;
use crate::config::{self, JobConfig};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The torus of each slice, e.g. `2x2x2` (one rank per chip).
    #[arg(long)]
    pub topology: String,
    /// Hardware preset of the modelled chips.
    #[arg(long, default_value = "v5p")]
    pub hardware: String,
    /// Slices joined by DCN.
    #[arg(long, default_value_t = 1)]
    pub slices: u32,
    /// Output folder (report.json); default `runs/run`.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The watchdog's hang timeout, ms.
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// `data`: every rank runs with real tensors; `meta`: tensors have shapes but no storage,
    /// collectives move sizes, and one process stands for every rank the torus makes alike.
    #[arg(long, default_value = "data")]
    pub mode: String,
    /// Run the program as it is: no interception of its backend or its `cuda` devices (it
    /// must `import podsim.torch` and call `init_process_group("podsim")` itself).
    #[arg(long)]
    pub no_intercept: bool,
    /// Meta mode: ranks run beside the representative to check that they call what it calls
    /// (a desync names the first that does not): a count spread over the pod (up to 64), or a
    /// list of ranks (`7,1234`; one rank up to 64 as `7,`). Default 2; 0 turns it off.
    #[arg(long, value_name = "COUNT|RANKS")]
    pub verify_ranks: Option<String>,
    /// Any other config field, e.g. `--set job.algo="ring"` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// A timeline of the run (`--trace FILE`), as `podsim launch` writes one.
    #[command(flatten)]
    pub trace: crate::trace::TraceArgs,
    /// The program every rank runs, after `--`: `-- python train.py ARGS...`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// TOML's basic strings take JSON's escapes.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The job `podsim run` launches, checked as a config file is.
pub fn config(args: &RunArgs) -> Result<JobConfig, CliError> {
    let command = match crate::torchrun::unwrapped(&args.command).map_err(CliError::Usage)? {
        Some(unwrapped) => {
            eprintln!(
                "podsim: running torchrun's program itself (`{}`), one rank per chip of {}; \
                 torchrun's own options were left out: {}",
                unwrapped.command.join(" "),
                args.topology,
                unwrapped.dropped.join(" ")
            );
            unwrapped.command
        }
        None => args.command.clone(),
    };
    let Some((program, rest)) = command.split_first() else {
        return Err(CliError::Usage(
            "podsim run needs a command after --".into(),
        ));
    };
    let list: Vec<String> = rest.iter().map(|a| quoted(a)).collect();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs").join("run"));
    let mut text = format!(
        "name = \"run\"\n[topology]\nshape = {}\nhardware = {}\nslices = {}\n\
         [launch]\nworkers = 1\n[job]\nkind = \"torch\"\nmode = {}\nintercept = {}\n{}\
         program = {}\nargs = [{}]\n[output]\ndir = {}\n",
        quoted(&args.topology),
        quoted(&args.hardware),
        args.slices,
        quoted(&args.mode),
        !args.no_intercept,
        match &args.verify_ranks {
            Some(v) => verify_ranks_key(v)?,
            None => String::new(),
        },
        quoted(program),
        list.join(", "),
        quoted(&out.display().to_string()),
    );
    if let Some(ms) = args.timeout_ms {
        text.push_str(&format!("[watchdog]\ntimeout_ms = {ms}\n"));
    }
    config::from_text("podsim run", &text, &args.sets).map_err(|e| CliError::Usage(by_flags(&e)))
}

/// The config's problems told by the flags that set each field: the lines and fields of the
/// job `podsim run` writes for itself mean nothing to whoever typed the command. A field no
/// flag sets came from a `--set`, and is named so.
fn by_flags(errors: &config::ConfigErrors) -> String {
    let told: Vec<String> = errors
        .0
        .iter()
        .map(|e| {
            let flag = match e.field.as_str() {
                "topology.shape" => "--topology".to_string(),
                "topology.hardware" => "--hardware".to_string(),
                "topology.slices" => "--slices".to_string(),
                "job.mode" => "--mode".to_string(),
                "job.verify_count" | "job.verify_ranks" => "--verify-ranks".to_string(),
                "job.program" | "job.args" => "the command after --".to_string(),
                "output.dir" => "--out".to_string(),
                "watchdog.timeout_ms" => "--timeout-ms".to_string(),
                "--set" => "--set".to_string(),
                field => format!("--set {field}"),
            };
            // The config's advice names its fields; the command's user knows the flag.
            let reason = e.reason.replace("set mode = \"meta\"", "use --mode meta");
            format!("{flag}: {reason}")
        })
        .collect();
    told.join("\n")
}

/// `--verify-ranks` as the `[job]` key it sets: a list of ranks when it has a comma or names a
/// rank past the largest count, else a count.
fn verify_ranks_key(value: &str) -> Result<String, CliError> {
    let bad = || {
        CliError::Usage(format!(
            "--verify-ranks {value:?}: expected a count or a list of ranks (7,1234)"
        ))
    };
    let ranks: Vec<u32> = value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let is_count = !value.contains(',') && ranks.len() == 1 && ranks[0] <= config::MAX_VERIFY_RANKS;
    Ok(if is_count {
        format!("verify_count = {}\n", ranks[0])
    } else {
        let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
        format!("verify_ranks = [{}]\n", list.join(", "))
    })
}
