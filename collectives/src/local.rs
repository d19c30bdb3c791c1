//! The in-memory fabric: any number of chips in one process, each a future polled by the chip
//! executor (`executor`), links as pushes into the destination chip's inbox. Payloads move by reference (no copy).

use std::future::Future;
use std::sync::Arc;

use podsim_topology::{ChipId, Hardware, Pod};

use crate::chip::Chip;
use crate::error::CollectiveError;
use crate::executor::{ChipFuture, IdleWait, run_on_threads};
use crate::fabric::{Delivery, Inbox, Message, Router};

/// Delivers every message into the destination's inbox in this process.
#[derive(Debug)]
pub struct LocalRouter {
    inboxes: Vec<Arc<Inbox>>,
}

impl Router for LocalRouter {
    fn deliver(&self, msg: Message) -> Result<Delivery<'_>, CollectiveError> {
        let inbox = self.inboxes.get(msg.dst as usize).ok_or_else(|| {
            CollectiveError::Transport(format!("no chip {} in this fabric", msg.dst))
        })?;
        inbox.push(msg);
        Ok(Delivery::Done)
    }
}

/// All chips of a pod in one process.
#[derive(Debug, Clone)]
pub struct LocalFabric {
    pod: Arc<Pod>,
    hardware: Arc<Hardware>,
    router: Arc<LocalRouter>,
}

impl LocalFabric {
    pub fn new(pod: Pod, hardware: Hardware) -> LocalFabric {
        let inboxes = (0..pod.chips()).map(|_| Arc::new(Inbox::new())).collect();
        LocalFabric {
            pod: Arc::new(pod),
            hardware: Arc::new(hardware),
            router: Arc::new(LocalRouter { inboxes }),
        }
    }

    pub fn pod(&self) -> &Pod {
        &self.pod
    }

    /// A fresh chip object for every chip of the pod, in id order.
    pub fn chips(&self) -> Vec<Chip> {
        (0..self.pod.chips()).map(|id| self.chip(id)).collect()
    }

    pub fn chip(&self, id: ChipId) -> Chip {
        Chip::new(
            id,
            self.pod.clone(),
            self.hardware.clone(),
            self.router.inboxes[id as usize].clone(),
            self.router.clone(),
        )
    }
}

/// Runs `program` on every chip concurrently and returns the results in chip order. The first
/// chip error stops all the others and is returned. Chips run on the chip executor (see
/// `executor`) with as many threads as the calling tokio runtime has workers.
pub async fn run_chips<T, E, F, Fut>(chips: Vec<Chip>, program: F) -> Result<Vec<T>, E>
where
    F: Fn(Chip) -> Fut,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: From<CollectiveError> + Send + 'static,
{
    run_chips_waiting(chips, program, None).await
}

/// [`run_chips`], with what the executor's thread does instead of parking when it has only
/// one thread (see [`IdleWait`]).
pub async fn run_chips_waiting<T, E, F, Fut>(
    chips: Vec<Chip>,
    program: F,
    idle: Option<Arc<dyn IdleWait>>,
) -> Result<Vec<T>, E>
where
    F: Fn(Chip) -> Fut,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: From<CollectiveError> + Send + 'static,
{
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    // Each chip's flight recorder learns whether it waits for a thread or for a wake-up.
    let observers = chips.iter().map(Chip::recorder).collect();
    let futures: Vec<ChipFuture<T, E>> = chips
        .into_iter()
        .map(|chip| Box::pin(program(chip)) as ChipFuture<T, E>)
        .collect();
    run_on_threads(futures, threads, observers, idle).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_topology::{Hardware, Pod};

    /// The executor tells each chip's flight recorder whether it waits for a wake-up (idle) or
    /// for its thread: a chip stopped for good is idle, one that keeps yielding never is.
    #[test]
    fn a_stopped_chip_is_idle_and_a_busy_one_is_not() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let pod = Pod::single("4".parse().unwrap());
        let fabric = LocalFabric::new(pod, Hardware::preset("v5p").unwrap());
        let chips = fabric.chips();
        let recorders: Vec<_> = chips.iter().map(Chip::recorder).collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let run = {
            let stop = stop.clone();
            rt.spawn(run_chips(chips, move |chip| {
                let stop = stop.clone();
                async move {
                    match chip.id() {
                        0 => std::future::pending::<()>().await,
                        1 => {
                            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                                tokio::task::yield_now().await;
                            }
                        }
                        _ => {}
                    }
                    Ok::<_, CollectiveError>(())
                }
            }))
        };
        // Chip 0 is idle after its first poll; a loaded machine may take a while to get there.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !recorders[0].glance().idle && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let idle: Vec<bool> = recorders.iter().map(|r| r.glance().idle).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        run.abort();
        // Chips 2 and 3 finished (done, not idle).
        assert_eq!(idle, vec![true, false, false, false]);
    }
}
