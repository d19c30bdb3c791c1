//! Reuse of large value buffers. Every reduction writes a fresh result buffer; allocating
//! megabytes anew each time makes the allocator map fresh pages from the kernel, and the page
//! faults then cost more than the arithmetic. Dropped large buffers go back to a small global
//! pool (bounded in count and bytes) and the next reduction of a similar size reuses one.

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

/// Immutable f32 values shared by ropes; returns its memory to the pool when dropped.
#[derive(Debug, Default)]
pub(crate) struct Buffer {
    values: Vec<f32>,
}

impl Buffer {
    pub fn new(values: Vec<f32>) -> Buffer {
        Buffer { values }
    }

    /// The values, leaving nothing to recycle.
    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.values)
    }
}

impl Deref for Buffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.values
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        recycle(std::mem::take(&mut self.values));
    }
}
