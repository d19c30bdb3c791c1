//! The collectives crate's error type.

use podsim_topology::{ChipId, Link, TopologyError};
use thiserror::Error;

use crate::fingerprint::Fingerprint;

/// Why a collective failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CollectiveError {
    /// A chip received a message from a different collective than the one it is in.
    #[error(
        "desync: chip {chip} is in {expected} but chip {peer} sent a message of {got} on link {link}"
    )]
    Desync {
        chip: ChipId,
        expected: Fingerprint,
        peer: ChipId,
        got: Fingerprint,
        link: Link,
    },
    /// Debug mode: the members of a collective disagree on what they are calling.
    #[error("desync: chip {chip} is in {mine} but chip {peer} of its group is in {theirs}")]
    Mismatch {
        chip: ChipId,
        mine: Fingerprint,
        peer: ChipId,
        theirs: String,
    },
    /// Debug mode: a message's payload does not match the checksum its sender computed.
    #[error(
        "corrupt message: chip {chip} received {fingerprint} from chip {peer} on link {link} with a payload that does not match its sender's checksum"
    )]
    Corrupt {
        chip: ChipId,
        peer: ChipId,
        link: Link,
        fingerprint: Fingerprint,
    },
    /// The algorithm needs a link that does not exist in this topology.
    #[error("chip {chip} has no link {link}")]
    NoLink { chip: ChipId, link: Link },
    /// The fabric stopped delivering (a peer or the runtime shut down).
    #[error("chip {chip}: fabric closed while waiting on link {link}: {reason}")]
    Closed {
        chip: ChipId,
        link: Link,
        reason: String,
    },
    #[error("invalid collective: {0}")]
    Invalid(String),
    #[error("transport: {0}")]
    Transport(String),
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error("internal error: {0}")]
    Internal(String),
}
