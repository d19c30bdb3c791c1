//! The `podsim` command: a thin shell over the coordinator library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use podsim_coordinator::bench::{self, BenchArgs};

/// podsim: a distributed training runtime that emulates a TPU pod.
#[derive(Debug, Parser)]
#[command(name = "podsim", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark one collective over a range of sizes (nccl-tests style table).
    Bench(BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Bench(args) => bench::main(args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("podsim: wrong results");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("podsim: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
