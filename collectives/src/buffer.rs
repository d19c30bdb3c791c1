//! Reuse of large value buffers. Every reduction writes a fresh result buffer; allocating
//! megabytes anew each time makes the allocator map fresh pages from the kernel, and the page
//! faults then cost more than the arithmetic. Dropped large buffers go back to a small global
//! pool (bounded in count and bytes) and the next reduction of a similar size reuses one.
//!
//! A buffer may also hold values that live outside this process's heap ([`ExternalValues`]:
//! a peer's message in a shared-memory ring), read in place and handed back when dropped.

use std::ops::Deref;
use std::sync::Mutex;

/// Buffers smaller than this come from the allocator's heap cheaply; not worth pooling.
const MIN_POOLED_ELEMENTS: usize = 1 << 12;
/// Upper bound on the memory the pool may hold.
const MAX_POOLED_BYTES: usize = 256 << 20;
const MAX_POOLED_BUFFERS: usize = 256;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// An empty vector with room for at least `len` values, reused from the pool when one fits
/// (capacity between `len` and `2 * len`).
pub(crate) fn take(len: usize) -> Vec<f32> {
    let mut v = take_used(len);
    v.clear();
    v
}

/// A vector of exactly `len` values for the caller to overwrite: a pooled buffer keeps what
/// it held (only a part beyond its old length is zeroed), so reading a peer's message into it
/// writes each byte once instead of zeroing it first.
pub(crate) fn take_filled(len: usize) -> Vec<f32> {
    let mut v = take_used(len);
    v.truncate(len);
    v.resize(len, 0.0);
    v
}

/// `len` values to be overwritten whole (a matmul's output with `beta = 0`): a pooled buffer
/// when one fits, so that a result made every step (a weight gradient that goes on into a
/// collective and back into the pool) reuses memory instead of faulting in fresh pages. The
/// values it holds on return are unspecified.
pub fn scratch(len: usize) -> Vec<f32> {
    take_filled(len)
}

/// A pooled vector that fits `len` (its old contents kept), or a new empty one.
fn take_used(len: usize) -> Vec<f32> {
    if len >= MIN_POOLED_ELEMENTS {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len && v.capacity() <= 2 * len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return pool.swap_remove(i);
        }
    }
    Vec::with_capacity(len)
}

fn recycle(v: Vec<f32>) {
    if v.capacity() < MIN_POOLED_ELEMENTS {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let held: usize = pool.iter().map(|b| b.capacity() * 4).sum();
    if pool.len() < MAX_POOLED_BUFFERS && held + v.capacity() * 4 <= MAX_POOLED_BYTES {
        pool.push(v);
    }
}

/// Read-only f32 values owned by something other than this process's allocator (a slot of a
/// shared-memory ring a peer wrote): a payload reads them in place, never writes them, and
/// dropping the owner gives the memory back to whoever lent it.
pub trait ExternalValues: Send + Sync + std::fmt::Debug {
    fn values(&self) -> &[f32];
    /// The owner itself, so that its lender can recognise it (a transport forwarding values
    /// it was lent by reference instead of copying them).
    fn as_any(&self) -> &dyn std::any::Any;
}

#[derive(Debug)]
enum Storage {
    Owned(Vec<f32>),
    External(Box<dyn ExternalValues>),
}

/// Immutable f32 values shared by ropes; returns its memory to the pool (or to its lender)
/// when dropped.
#[derive(Debug)]
pub(crate) struct Buffer {
    values: Storage,
}

impl Default for Buffer {
    fn default() -> Buffer {
        Buffer::new(Vec::new())
    }
}

impl Buffer {
    pub fn new(values: Vec<f32>) -> Buffer {
        Buffer {
            values: Storage::Owned(values),
        }
    }

    pub fn from_external(values: Box<dyn ExternalValues>) -> Buffer {
        Buffer {
            values: Storage::External(values),
        }
    }

    /// The owner of external values.
    pub fn external(&self) -> Option<&dyn ExternalValues> {
        match &self.values {
            Storage::Owned(_) => None,
            Storage::External(e) => Some(e.as_ref()),
        }
    }

    /// Whether the values are this process's to write in place once nothing shares them.
    pub fn is_owned(&self) -> bool {
        matches!(self.values, Storage::Owned(_))
    }

    /// The values, leaving nothing to recycle (a pooled copy of external values).
    pub fn into_vec(mut self) -> Vec<f32> {
        match &mut self.values {
            Storage::Owned(v) => std::mem::take(v),
            Storage::External(e) => {
                let mut v = take(e.values().len());
                v.extend_from_slice(e.values());
                v
            }
        }
    }
}

impl Deref for Buffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.values {
            Storage::Owned(v) => v,
            Storage::External(e) => e.values(),
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Storage::Owned(v) = &mut self.values {
            recycle(std::mem::take(v));
        }
    }
}
