//! What the worker's integration tests share.

use std::future::Future;
use std::time::Duration;

use podsim_collectives::{Chip, run_chips};
use podsim_programs::ProgramError;

/// Runs `program` on every chip on a two-thread runtime: every chip's result, or the first
/// error. The test fails after 120 s: a test must not hang.
pub fn run_on_chips<T, F, Fut>(chips: Vec<Chip>, program: F) -> Result<Vec<T>, ProgramError>
where
    F: Fn(Chip) -> Fut,
    Fut: Future<Output = Result<T, ProgramError>> + Send + 'static,
    T: Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async move {
        tokio::time::timeout(Duration::from_secs(120), run_chips(chips, program)).await
    })
    .expect("the chips' programs timed out")
}
