//! What waits to cross a link to another worker ([`Outgoing`]) and why a link is refused
//! ([`Refusal`]): the fabric queues them, the links' pumps take them.

use podsim_collectives::Message;
use tokio::sync::OwnedSemaphorePermit;

/// A message queued for another worker, holding its share of the queue's room.
pub(crate) struct Outgoing {
    pub msg: Message,
    /// The bytes it holds of the queue's room (its payload's).
    pub bytes: usize,
    /// Bytes of the message's record a chip already wrote to the socket itself (a Unix-socket
    /// link's direct write that the socket did not take whole); the writer task sends the rest.
    pub skip: usize,
    /// Where that direct write put the payload in the link's shared region, if it did.
    pub lent: Option<crate::shm::Place>,
    /// Held until the message is sent, then given back to the queue.
    _room: Option<OwnedSemaphorePermit>,
}

impl Outgoing {
    /// `msg`, of `bytes`, holding `room` of its queue until it is sent; `skip` and `lent` as
    /// the fields say.
    pub(crate) fn new(
        msg: Message,
        bytes: usize,
        skip: usize,
        lent: Option<crate::shm::Place>,
        room: Option<OwnedSemaphorePermit>,
    ) -> Outgoing {
        Outgoing {
            msg,
            bytes,
            skip,
            lent,
            _room: room,
        }
    }

    /// A message queued without a share of any queue's room (the link tests' own queues).
    #[cfg(test)]
    pub(crate) fn unbudgeted(msg: Message, skip: usize) -> Outgoing {
        Outgoing {
            bytes: msg.payload.len() * 4,
            msg,
            skip,
            lent: None,
            _room: None,
        }
    }
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Outgoing({} -> {}, {} bytes)",
            self.msg.src, self.msg.dst, self.bytes
        )
    }
}

/// Why a link from a worker is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("{0}")]
    NoLink(String),
    #[error("{0}")]
    Taken(String),
}
