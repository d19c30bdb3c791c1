//! The `podsim` command: a thin shell over the coordinator and worker libraries.
#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use podsim_coordinator::bench::{self, BenchArgs};
use podsim_coordinator::compare::{self, CompareArgs};
use podsim_coordinator::config::{self, JobConfig};
use podsim_coordinator::launch::{self, ControlPlane, Launch, LaunchError, Workers, new_token};
use podsim_coordinator::recovery::{Recovery, run_with_recovery};
use podsim_coordinator::study::{self, StudyArgs};
use podsim_coordinator::trace::TraceArgs;
use podsim_coordinator::{CliError, JobStatus, report};
use podsim_programs::job::JobSpec;
use podsim_worker::tls::{Tls, TlsFiles};
use podsim_worker::{WorkerOptions, run_worker};

/// Large message buffers are allocated and freed at a high rate; the system allocator hands
/// their memory back to the kernel and page-faults it in again each time, which cost more
/// CPU than moving the data. mimalloc keeps and reuses it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// podsim: a distributed training runtime that emulates a TPU pod.
#[derive(Debug, Parser)]
#[command(name = "podsim", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a job from a config: spawn its workers, run it, write report.json.
    Launch(LaunchArgs),
    /// Check a config and report every problem in it.
    Validate(ConfigArgs),
    /// Run a job whose workers are started elsewhere (`podsim worker --join ...`).
    Coordinator(CoordinatorArgs),
    /// Run one worker process (started by a coordinator, or by hand with --join).
    Worker(WorkerArgs),
    /// Benchmark one collective over a range of sizes (nccl-tests style table).
    Bench(BenchArgs),
    /// Run a scaling study: sweep config fields, run every point, write results.csv and plots.
    Study(StudyArgs),
    /// Predict measured training runs (a CSV of published step times) and report the error.
    Compare(CompareArgs),
    /// Run a PyTorch program with one rank per emulated chip (`-- python train.py ...`).
    Run(podsim_coordinator::run::RunArgs),
    /// Draw report.html (and a study's study.html) again from the files in DIR.
    Report(ReportArgs),
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// A job's output folder (with report.json) or a study's (with results.csv).
    dir: PathBuf,
}

#[derive(Debug, Clone, Args)]
struct ConfigArgs {
    /// The job config (TOML).
    config: PathBuf,
    /// Override a config field, e.g. `--set launch.workers=2` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Override `launch.workers`.
    #[arg(long)]
    workers: Option<u32>,
    /// Override `output.dir`.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct LaunchArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    trace: TraceArgs,
}

#[derive(Debug, Args)]
struct CoordinatorArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Address the control service listens on, `host:port`.
    #[arg(long)]
    listen: String,
    /// Job token workers must present (default: a random one, printed).
    #[arg(long, env = "PODSIM_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// How long to wait for every worker to join, seconds.
    #[arg(long, default_value_t = 600)]
    join_timeout: u64,
    #[command(flatten)]
    trace: TraceArgs,
}

#[derive(Debug, Args)]
struct WorkerArgs {
    /// The coordinator's control address, `host:port`.
    #[arg(long)]
    join: String,
    /// The job token (or PODSIM_TOKEN).
    #[arg(long, env = "PODSIM_TOKEN", hide_env_values = true)]
    token: String,
    /// Worker id to ask for (default: assigned by the coordinator).
    #[arg(long)]
    worker_id: Option<u32>,
    /// Address to bind this worker's link service to (`host` or `host:port`).
    #[arg(long, default_value = "127.0.0.1")]
    bind: String,
    /// Host name other workers should use to reach this one.
    #[arg(long)]
    advertise: Option<String>,
    /// Exit when standard input closes (used by `podsim launch`).
    #[arg(long, hide = true)]
    watch_stdin: bool,
    /// Runtime threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// The job's certificate authority (PEM): mutual TLS with the coordinator and the other
    /// workers (with --tls-cert and --tls-key; the job's `[launch.tls]`).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// This worker's certificate, signed by the authority (PEM).
    #[arg(long, requires = "tls_ca")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_ca")]
    tls_key: Option<PathBuf>,
    /// The name the job's certificates carry.
    #[arg(long, requires = "tls_ca", default_value = podsim_worker::tls::DEFAULT_SERVER_NAME)]
    tls_server_name: String,
}

impl WorkerArgs {
    /// `--join` as an address to dial: `127.0.0.1:99999` or `http://...` was retried for half
    /// a minute before it failed.
    fn join_address(&self) -> Result<(), CliError> {
        match podsim_links::net::dial_address_problem(&self.join) {
            Some(why) => Err(CliError::Usage(format!("--join {why}"))),
            None => Ok(()),
        }
    }

    /// The TLS files given, loaded (a problem names the flag).
    fn tls(&self) -> Result<Option<Tls>, CliError> {
        let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key)
        else {
            return Ok(None);
        };
        let files = TlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
            server_name: self.tls_server_name.clone(),
        };
        Tls::load(&files).map(Some).map_err(|problems| {
            let lines: Vec<String> = problems
                .iter()
                .map(|(file, why)| format!("--tls-{}: {why}", file.key()))
                .collect();
            CliError::Usage(lines.join("\n"))
        })
    }
}

fn load(args: &ConfigArgs) -> Result<JobConfig, CliError> {
    let mut sets = args.sets.clone();
    if let Some(w) = args.workers {
        sets.push(format!("launch.workers={w}"));
    }
    if let Some(out) = &args.out {
        sets.push(format!("output.dir={:?}", out.display().to_string()));
    }
    config::load(&args.config, &sets)
        .map_err(|e| CliError::Usage(e.to_string().trim_end().to_string()))
}

/// `--listen` as an address to bind: `host:port` (port 0 for any free one); a mistyped
/// address ran the job's setup and wrote a failed report instead of a usage error.
fn listen_address(listen: &str) -> Result<(), CliError> {
    match podsim_links::net::listen_address_problem(listen) {
        Some(why) => Err(CliError::Usage(format!("--listen {why}"))),
        None => Ok(()),
    }
}

/// The config of `podsim coordinator`, whose workers run elsewhere (`[launch] external`:
/// this host's memory is not theirs to check).
fn load_external(args: &ConfigArgs) -> Result<JobConfig, CliError> {
    let mut args = args.clone();
    args.sets.push("launch.external=true".into());
    load(&args)
}

/// The config of `podsim launch`, which starts every worker on this host: a config that
/// says its workers are started elsewhere is meant for `podsim coordinator` (launch
/// started them here anyway, unchecked against this host's memory).
fn load_local(args: &ConfigArgs) -> Result<JobConfig, CliError> {
    let cfg = load(args)?;
    if cfg.external {
        return Err(CliError::Usage(format!(
            "{}: [launch] external = true says the workers are started elsewhere (podsim worker --join): run it with `podsim coordinator`, which waits for them; `podsim launch` starts them on this host",
            args.config.display()
        )));
    }
    Ok(cfg)
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    runtime_with(None)
}

fn runtime_with(threads: Option<usize>) -> Result<tokio::runtime::Runtime, CliError> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(t) = threads {
        builder.worker_threads(t.max(1));
    }
    builder
        .enable_all()
        .build()
        .map_err(|e| CliError::Job(format!("cannot start the runtime: {e}")))
}

/// Shows progress: a bar on a terminal, a log line every second otherwise.
fn progress_reporter() -> impl FnMut(u64, u64) + Send {
    let bar = std::io::stdout().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} chip-steps",
        ) {
            bar.set_style(style);
        }
        bar
    });
    let mut last = std::time::Instant::now();
    move |done, total| match &bar {
        // A job that does not know its length ahead (a PyTorch program) shows none.
        _ if total == 0 => {}
        Some(bar) => {
            bar.set_length(total);
            bar.set_position(done);
            if done >= total && total > 0 {
                bar.finish_and_clear();
            }
        }
        None => {
            if last.elapsed() >= Duration::from_secs(1) || (done >= total && total > 0) {
                println!("progress: {done}/{total} chip-steps");
                last = std::time::Instant::now();
            }
        }
    }
}

/// One launch of the job's workers (several when it recovers from failures): how it ended,
/// and the workers that had all joined (for the report of a job that failed).
/// One attempt of the job: its first run (`restart` none), or a run after `n` others (a
/// restart from a checkpoint or a regroup).
fn run_attempt(
    cfg: &JobConfig,
    spec: &JobSpec,
    listen: Option<&(&str, String)>,
    join_timeout: Duration,
    restart: Option<u32>,
    rt: &tokio::runtime::Runtime,
) -> (
    Result<launch::Outcome, LaunchError>,
    Vec<launch::WorkerInfo>,
) {
    let external = listen.is_some();
    if restart.is_some() {
        // What the last attempt's killed workers' ranks left in sessions of their own ends
        // with that attempt, not with the job.
        left_behind("podsim");
    }
    if podsim_coordinator::was_interrupted() {
        // Interrupted after the last attempt ended: no restart.
        return (Err(LaunchError::Interrupted), Vec::new());
    }
    rt.block_on(async {
        let (addr, token) = match listen {
            Some((addr, token)) => (addr.to_string(), token.clone()),
            None => (podsim_links::net::host_port(&cfg.bind, 0), new_token()),
        };
        let mut control = match ControlPlane::start(&addr, token, cfg.tls.clone()).await {
            Ok(control) => control,
            Err(e) => return (Err(e), Vec::new()),
        };
        let workers = if external {
            let tls = cfg
                .tls
                .as_ref()
                .map(|t| format!(" {}", launch::tls_args(t.files()).join(" ")))
                .unwrap_or_default();
            println!(
                "waiting for {} workers: podsim worker --join {} --token {}{tls}",
                cfg.workers,
                control.addr,
                shown_token(&control.token)
            );
            Workers::External
        } else {
            let spawn_error = |reason: String| LaunchError::Spawn { id: 0, reason };
            if let Err(e) = std::fs::create_dir_all(&cfg.output_dir) {
                let why = format!("cannot create {}: {e}", cfg.output_dir.display());
                return (Err(spawn_error(why)), Vec::new());
            }
            let exe = match std::env::current_exe() {
                Ok(exe) => exe,
                Err(e) => return (Err(spawn_error(e.to_string())), Vec::new()),
            };
            Workers::Spawn {
                exe,
                log_dir: Some(cfg.output_dir.clone()),
                restart,
            }
        };
        let mut progress = progress_reporter();
        let launch = Launch::new(spec, workers)
            .join_timeout(join_timeout)
            .progress(&mut progress);
        let result = tokio::select! {
            r = launch.run(&mut control) => r,
            _ = podsim_coordinator::interrupted() => Err(LaunchError::Interrupted),
        };
        (result, control.roster().to_vec())
    })
}

/// The token as the "waiting for workers" line shows it: a token from `PODSIM_TOKEN` stays
/// in the environment (the line names the variable), a generated one is printed for the
/// workers' command lines.
fn shown_token(token: &str) -> String {
    match std::env::var("PODSIM_TOKEN") {
        Ok(env) if env == token => "\"$PODSIM_TOKEN\"".to_string(),
        _ => token.to_string(),
    }
}

fn run_job(
    cfg: &JobConfig,
    listen: Option<(&str, String)>,
    join_timeout: Duration,
    trace: &TraceArgs,
) -> Result<JobStatus, CliError> {
    // Held until the job's report is written; every attempt of the job runs under it.
    let _lock = podsim_coordinator::outdir::OutputLock::acquire(
        &cfg.output_dir,
        &podsim_coordinator::outdir::this_command(),
    )
    .map_err(CliError::Usage)?;
    // What a killed worker's ranks leave in sessions of their own comes here.
    podsim_links::procs::adopt_orphans();
    let started = std::time::Instant::now();
    let rt = runtime()?;
    let mut spec = cfg.spec();
    let traced = traced_chips(cfg, trace, &mut spec)?;
    let recovery = Recovery::new(&spec, cfg.max_restarts, listen.is_some());
    let mut attempts_made = 0u32;
    let attempts = run_with_recovery(
        spec,
        recovery,
        |spec| {
            let restart = (attempts_made > 0).then_some(attempts_made);
            attempts_made += 1;
            run_attempt(cfg, spec, listen.as_ref(), join_timeout, restart, &rt)
        },
        |r, max| {
            println!(
                "restart {} of {max}: {}; resuming from the checkpoint after step {}",
                r.attempt, r.explanation, r.resumed_from_step
            );
        },
        |why, classes| println!("{why}: running again with {classes} representative ranks"),
    );
    left_behind("podsim");
    let (result, roster, restarts, refused) = (
        attempts.result,
        attempts.roster,
        attempts.restarts,
        attempts.refused,
    );
    let report = job_report(cfg, &result, &roster, restarts, refused, started);
    // The summary first: a report that cannot be written (a full disk) still leaves the
    // job's outcome on the terminal, and the command then fails saying why.
    print!("{}", report::summary(&report));
    let path = report::write(&cfg.output_dir, &report).map_err(CliError::Job)?;
    println!("report: {}", path.display());
    let page = report::write_html(&cfg.output_dir, &report).map_err(CliError::Job)?;
    println!("page: {}", page.display());
    if let Some(file) = &trace.trace {
        write_trace(
            file,
            &report::trace_input(cfg, &result, &traced, trace.trace_wall),
        )?;
    }
    match result {
        Ok(_) => Ok(report.status),
        Err(LaunchError::Hang(h)) => Err(CliError::Hang {
            status: h.finding.kind.status(),
            // The report's sentence (it names a PyTorch culprit's Python line).
            message: report
                .hang
                .as_ref()
                .map_or_else(|| h.finding.explanation.clone(), |x| x.explanation.clone()),
        }),
        Err(e) => Err(CliError::Job(e.to_string())),
    }
}

/// The report of a job whose attempts came to `result`: its diagnosis when it hung, its
/// restarts, and, when it failed, its wall time from `started` to now (a failed job has no
/// finished attempt's).
fn job_report(
    cfg: &JobConfig,
    result: &Result<launch::Outcome, LaunchError>,
    roster: &[launch::WorkerInfo],
    restarts: Vec<podsim_coordinator::report::Restart>,
    refused: Option<String>,
    started: std::time::Instant,
) -> report::Report {
    let mut report = report::build(cfg, result.as_ref().map_err(|e| (e.to_string(), roster)));
    if let Err(LaunchError::Hang(h)) = result {
        report::add_hang(&mut report, cfg, h);
        report::add_failed_torch(&mut report, cfg, h);
    }
    report::add_recovery(&mut report, cfg, result.as_ref().ok(), restarts, refused);
    if result.is_err() {
        report.wall_s = started.elapsed().as_secs_f64();
    }
    report
}

/// The chips whose timelines the job records (`spec.trace` is set to ask for them): those
/// asked for, and the chips faults are injected into, which are always the ones to look at
/// (the report's step timeline shows the slowest traced chip; the trace file has them too
/// when there is one). Returns the chips of the trace file.
fn traced_chips(
    cfg: &JobConfig,
    trace: &TraceArgs,
    spec: &mut podsim_programs::job::JobSpec,
) -> Result<Vec<u32>, CliError> {
    let mut traced = trace.resolve(cfg.pod.chips()).map_err(CliError::Usage)?;
    let faulty: Vec<u32> = cfg.faults.iter().filter_map(|f| f.chip).collect();
    if trace.trace.is_some() {
        traced.extend(&faulty);
        traced.sort_unstable();
        traced.dedup();
    }
    spec.trace = Some(podsim_coordinator::trace::request(
        &[traced.as_slice(), &faulty].concat(),
        trace.trace_flows,
    ));
    Ok(traced)
}

/// Writes the Chrome trace of `input` to `file`, saying where and how large.
fn write_trace(
    file: &std::path::Path,
    input: &podsim_coordinator::trace::TraceInput<'_>,
) -> Result<(), CliError> {
    let t0 = std::time::Instant::now();
    let size = podsim_coordinator::trace::write(file, &podsim_coordinator::trace::build(input))
        .map_err(CliError::Job)?;
    println!(
        "trace: {} ({}, {} chips, written in {:.2} s)",
        file.display(),
        podsim_coordinator::units::format_size(size),
        input.chips.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `podsim worker`: joins a coordinator and runs its share of the job, then exits the process
/// at once (without waiting for the stdin watcher's blocking read).
fn worker(args: &WorkerArgs) -> ! {
    // Ranks' descendants that leave their session come here when their rank ends.
    podsim_links::procs::adopt_orphans();
    let done = args
        .join_address()
        .and_then(|()| args.tls())
        .and_then(|tls| {
            let opts = WorkerOptions {
                join: args.join.clone(),
                token: args.token.clone(),
                worker_id: args.worker_id,
                bind: args.bind.clone(),
                advertise: args.advertise.clone(),
                watch_stdin: args.watch_stdin,
                tls,
            };
            let rt = runtime_with(args.threads)?;
            let r = rt.block_on(run_worker(opts));
            rt.shutdown_background();
            left_behind("podsim worker");
            r.map_err(|e| CliError::Job(e.to_string()))
        });
    std::process::exit(match done {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("podsim worker: {e}");
            i32::from(e.exit_code())
        }
    });
}

/// Kills what ranks left behind in sessions of their own (see `procs::adopt_orphans`), saying
/// so: a program whose helper outlived it would otherwise never hear that it had one.
fn left_behind(who: &str) {
    let killed = podsim_links::procs::kill_escaped();
    if !killed.is_empty() {
        eprintln!(
            "{who}: killed {} process{} a rank left behind in a session of its own (pids {killed:?})",
            killed.len(),
            if killed.len() == 1 { "" } else { "es" }
        );
    }
}

/// Log lines on stderr at the levels `RUST_LOG` names, `warn` when it is unset: one level
/// (`info`) or per-target directives (`warn,podsim_links=debug`). Targets and levels only,
/// no span or field filters: that is what a user of podsim sets, and the full filter's regular
/// expressions were the largest part of the logging's build.
fn init_logging() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt};
    let warn = || Targets::new().with_default(LevelFilter::WARN);
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) => spec.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!(
                "podsim: RUST_LOG={spec:?} is not a list of target=level ({e}); logging warnings"
            );
            warn()
        }),
        Err(_) => warn(),
    };
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let result = match &cli.command {
        Command::Bench(args) => bench::main(args),
        Command::Study(args) => study::main(args),
        Command::Compare(args) => compare::main(args),
        Command::Report(args) => podsim_coordinator::pages::redraw(&args.dir)
            .map(|pages| {
                for p in pages {
                    println!("page: {}", p.display());
                }
                JobStatus::Ok
            })
            .map_err(CliError::Usage),
        Command::Validate(args) => load(args).map(|cfg| {
            println!(
                "{}: ok ({} job on {}, {} chips, {} workers)",
                args.config.display(),
                cfg.kind(),
                cfg.pod,
                cfg.pod.chips(),
                cfg.workers
            );
            JobStatus::Ok
        }),
        Command::Run(args) => podsim_coordinator::run::config(args)
            .and_then(|cfg| run_job(&cfg, None, Duration::from_secs(30), &args.trace)),
        Command::Launch(args) => load_local(&args.config)
            .and_then(|cfg| run_job(&cfg, None, Duration::from_secs(30), &args.trace)),
        Command::Coordinator(args) => listen_address(&args.listen)
            .and_then(|()| load_external(&args.config))
            .and_then(|cfg| {
                let token = args.token.clone().unwrap_or_else(new_token);
                run_job(
                    &cfg,
                    Some((&args.listen, token)),
                    Duration::from_secs(args.join_timeout),
                    &args.trace,
                )
            }),
        Command::Worker(args) => worker(args),
    };
    match result {
        Ok(JobStatus::Ok) => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("podsim: the job ended with status {status}");
            ExitCode::from(status.exit_code())
        }
        Err(e) => {
            eprintln!("podsim: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
