//! How messages between two workers travel ([`Transport`]), as a job, a flag or
//! `PODSIM_TRANSPORT` chooses it: a leaf both the fabric and its links name.

use serde::{Deserialize, Serialize};

/// How messages between two workers travel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Between workers on the same host a Unix domain socket, with large payloads in shared
    /// memory where both workers can map it; records over TCP to other hosts (inside TLS
    /// under `[launch.tls]`).
    #[default]
    Auto,
    /// Records over TCP, wherever the peer is (inside TLS under `[launch.tls]`).
    Tcp,
    /// A Unix domain socket carrying every byte; a peer on another host is an error.
    Uds,
    /// A Unix domain socket with large payloads in shared memory; a peer on another host, or
    /// a region that cannot be mapped, is an error.
    Shm,
    /// gRPC (HTTP/2) over TCP, wherever the peer is.
    Grpc,
}

/// The environment variable that sets the default transport (tests run every cross-process
/// test over each transport in turn with it).
pub const TRANSPORT_ENV: &str = "PODSIM_TRANSPORT";

podsim_collectives::named_enum!(Transport, "transport", {
    Auto => "auto",
    Tcp => "tcp",
    Uds => "uds",
    Shm => "shm",
    Grpc => "grpc",
});

impl Transport {
    /// `given` (the config key or flag called `what`), else `PODSIM_TRANSPORT`, else `auto`;
    /// an unknown name is an error naming where it came from.
    pub fn choose(given: Option<&str>, what: &str) -> Result<Transport, String> {
        let from_env = std::env::var(TRANSPORT_ENV).ok();
        let (name, source) = match (given, from_env.as_deref()) {
            (Some(name), _) => (name, what),
            (None, Some(name)) => (name, TRANSPORT_ENV),
            (None, None) => return Ok(Transport::Auto),
        };
        name.parse().map_err(|e| format!("{source}: {e}"))
    }
}
