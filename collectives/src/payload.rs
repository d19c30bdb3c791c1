//! Payloads: what a message carries and what a collective consumes and returns.
//!
//! In data mode a payload is a [`Rope`]: a list of shared, immutable slices of f32 buffers.
//! Splitting, concatenating and forwarding a rope never copies values, so chips in one process
//! share what they can; only a reduction writes new values (in place when the buffer is no
//! longer shared). In meta mode a payload is only its element count: every operation is O(1),
//! which is what lets 100,000 chips run the same algorithms.

use std::sync::{Arc, OnceLock};

use tokio::sync::Semaphore;

use crate::buffer::{self, Buffer, ExternalValues};
use crate::error::CollectiveError;
use crate::reduce::ReduceOp;

/// A shared slice of f32 values, or a run of zeros that owns no memory (padding).
#[derive(Debug, Clone)]
struct Seg {
    buf: Option<Arc<Buffer>>,
    start: usize,
    len: usize,
}

impl Seg {
    fn values(&self) -> Option<&[f32]> {
        self.buf
            .as_ref()
            .map(|b| &b[self.start..self.start + self.len])
    }

    fn slice(&self, offset: usize, len: usize) -> Seg {
        Seg {
            buf: self.buf.clone(),
            start: self.start + offset,
            len,
        }
    }
}

/// One run of a [`Rope`].
#[derive(Debug, Clone, Copy)]
pub enum Run<'a> {
    Values(&'a [f32]),
    Zeros(usize),
}

/// A sequence of f32 values stored as shared slices.
#[derive(Debug, Clone, Default)]
pub struct Rope {
    segs: Vec<Seg>,
    len: usize,
}

impl Rope {
    pub fn from_vec(values: Vec<f32>) -> Rope {
        Rope::from_shared(Arc::new(Buffer::new(values)))
    }

    fn from_shared(values: Arc<Buffer>) -> Rope {
        let len = values.len();
        let mut r = Rope::default();
        r.push(Seg {
            buf: Some(values),
            start: 0,
            len,
        });
        r
    }

    pub fn zeros(len: usize) -> Rope {
        let mut r = Rope::default();
        r.push(Seg {
            buf: None,
            start: 0,
            len,
        });
        r
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of shared slices the rope is made of.
    pub fn segments(&self) -> usize {
        self.segs.len()
    }

    fn push(&mut self, seg: Seg) {
        if seg.len == 0 {
            return;
        }
        // Merge with the previous slice when it continues the same buffer (or both are zeros).
        if let Some(last) = self.segs.last_mut() {
            let same_buf = match (&last.buf, &seg.buf) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b) && last.start + last.len == seg.start,
                (None, None) => true,
                _ => false,
            };
            if same_buf {
                last.len += seg.len;
                self.len += seg.len;
                return;
            }
        }
        self.len += seg.len;
        self.segs.push(seg);
    }

    fn append(&mut self, other: Rope) {
        for s in other.segs {
            self.push(s);
        }
    }

    /// Calls `f` on each run of values in order (zeros are materialised in small chunks).
    pub fn for_each_run(&self, mut f: impl FnMut(&[f32])) {
        const ZEROS: [f32; 1024] = [0.0; 1024];
        for s in &self.segs {
            match s.values() {
                Some(v) => f(v),
                None => {
                    let mut left = s.len;
                    while left > 0 {
                        let n = left.min(ZEROS.len());
                        f(&ZEROS[..n]);
                        left -= n;
                    }
                }
            }
        }
    }

    /// The runs of the rope in order: shared values, or a count of zeros (padding that owns no
    /// memory). What a transport writes without first gathering the values into one buffer.
    pub fn runs(&self) -> impl Iterator<Item = Run<'_>> {
        self.segs.iter().map(|s| match s.values() {
            Some(v) => Run::Values(v),
            None => Run::Zeros(s.len),
        })
    }

    /// The values as one vector: the buffer itself when the rope is the whole of one buffer
    /// nothing else shares (a collective's fresh result), a copy otherwise.
    pub fn into_vec(mut self) -> Vec<f32> {
        if let [seg] = self.segs.as_mut_slice()
            && seg.start == 0
            && let Some(buf) = seg.buf.take()
        {
            if buf.len() == seg.len {
                match Arc::try_unwrap(buf) {
                    Ok(owned) => return owned.into_vec(),
                    Err(shared) => seg.buf = Some(shared),
                }
            } else {
                seg.buf = Some(buf);
            }
        }
        self.to_vec()
    }

    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = buffer::take(self.len);
        self.for_each_run(|run| out.extend_from_slice(run));
        out
    }

    fn is_all_zeros(&self) -> bool {
        self.segs.iter().all(|s| s.buf.is_none())
    }

    /// The whole rope as one uniquely owned buffer that can be written in place, if it is one.
    fn into_unique(mut self) -> Result<Vec<f32>, Rope> {
        if self.segs.len() == 1 {
            let seg = &mut self.segs[0];
            if let Some(buf) = seg.buf.as_mut()
                && seg.start == 0
                && seg.len == buf.len()
                && buf.is_owned()
                && Arc::get_mut(buf).is_some()
            {
                let buf = seg.buf.take().expect("checked above");
                return Arc::try_unwrap(buf)
                    .map(Buffer::into_vec)
                    .map_err(Rope::from_shared);
            }
        }
        Err(self)
    }
}

/// Reads a rope front to back, handing out consecutive sub-ropes without copying.
struct Cursor<'a> {
    segs: &'a [Seg],
    idx: usize,
    offset: usize,
}

impl<'a> Cursor<'a> {
    fn new(rope: &'a Rope) -> Cursor<'a> {
        Cursor {
            segs: &rope.segs,
            idx: 0,
            offset: 0,
        }
    }

    fn take(&mut self, mut len: usize) -> Rope {
        let mut out = Rope::default();
        while len > 0 {
            let Some(seg) = self.segs.get(self.idx) else {
                break;
            };
            let n = (seg.len - self.offset).min(len);
            out.push(seg.slice(self.offset, n));
            len -= n;
            self.offset += n;
            if self.offset == seg.len {
                self.idx += 1;
                self.offset = 0;
            }
        }
        out
    }

    /// Calls `f` on borrowed runs covering the next `len` elements (zeros from a static).
    fn runs(&mut self, mut len: usize, mut f: impl FnMut(&[f32])) {
        const ZEROS: [f32; 1024] = [0.0; 1024];
        while len > 0 {
            let Some(seg) = self.segs.get(self.idx) else {
                break;
            };
            let n = (seg.len - self.offset).min(len);
            match &seg.buf {
                Some(buf) => {
                    let from = seg.start + self.offset;
                    f(&buf[from..from + n]);
                }
                None => {
                    let mut left = n;
                    while left > 0 {
                        let k = left.min(ZEROS.len());
                        f(&ZEROS[..k]);
                        left -= k;
                    }
                }
            }
            len -= n;
            self.offset += n;
            if self.offset == seg.len {
                self.idx += 1;
                self.offset = 0;
            }
        }
    }

    fn skip(&mut self, len: usize) {
        let _ = self.take(len);
    }
}

/// What a message carries: real values, or only how many there are.
#[derive(Debug, Clone)]
pub enum Payload {
    /// Meta mode: an element count, no buffer.
    Meta(usize),
    /// Data mode: real f32 values. (Boxed, as is `Pending`, so that a payload is two words:
    /// at 100,000 chips in meta mode the lists of payloads a collective keeps per chip are
    /// most of its memory.)
    Data(Box<Rope>),
    /// Data mode: a reduction whose terms are shared but not yet combined. Ring reductions pass
    /// these along inside a process so each element is combined once, by its final owner, in
    /// one pass over all terms, instead of being written and re-read at every hop. The terms
    /// are combined left to right, exactly as hop-by-hop reduction would, so the values are
    /// bit-identical. Anything other than `len`, `combine` and `resolve` resolves it first.
    Pending(Box<PendingReduction>),
}

/// The terms of a deferred reduction, all of one length.
#[derive(Debug, Clone)]
pub struct PendingReduction {
    op: ReduceOp,
    terms: Vec<Rope>,
}

impl PendingReduction {
    /// Combines the terms left to right into a fresh (pooled) buffer.
    fn evaluate(&self) -> Rope {
        let len = self.terms.first().map_or(0, Rope::len);
        let mut out = buffer::take_filled(len);
        self.evaluate_into(&mut out);
        Rope::from_vec(out)
    }

    /// Combines the terms left to right into `out` (as long as a term), a cache-sized chunk
    /// at a time: one read of every term and one write of the result.
    fn evaluate_into(&self, out: &mut [f32]) {
        const CHUNK: usize = 16384;
        let len = out.len();
        let mut cursors: Vec<Cursor<'_>> = self.terms.iter().map(Cursor::new).collect();
        let Some((first, rest)) = cursors.split_first_mut() else {
            return;
        };
        let mut start = 0;
        while start < len {
            let n = CHUNK.min(len - start);
            // The first two terms are combined in one pass over the output (copying the first
            // and then folding the second into it would pass over every value twice).
            let others = match rest.split_first_mut() {
                Some((second, others)) => {
                    let mut at = start;
                    first.runs(n, |a| {
                        let mut done = 0;
                        second.runs(a.len(), |b| {
                            let o = &mut out[at..at + b.len()];
                            self.op.combine_into(o, &a[done..done + b.len()], b);
                            done += b.len();
                            at += b.len();
                        });
                    });
                    others
                }
                None => {
                    let mut at = start;
                    first.runs(n, |run| {
                        out[at..at + run.len()].copy_from_slice(run);
                        at += run.len();
                    });
                    &mut []
                }
            };
            for c in others.iter_mut() {
                let mut at = start;
                c.runs(n, |run| {
                    self.op.apply_in_place(&mut out[at..at + run.len()], run);
                    at += run.len();
                });
            }
            start += n;
        }
    }
}

impl Payload {
    fn data(rope: Rope) -> Payload {
        Payload::Data(Box::new(rope))
    }

    pub fn from_vec(values: Vec<f32>) -> Payload {
        Payload::data(Rope::from_vec(values))
    }

    /// The values of `iter` (exactly `len` of them) in a reused buffer: for callers that
    /// build a payload every step (training), so that steady state allocates nothing new.
    pub fn collect_from(len: usize, iter: impl IntoIterator<Item = f32>) -> Payload {
        let mut v = buffer::take(len);
        v.extend(iter.into_iter().take(len));
        Payload::from_vec(v)
    }

    /// A copy of `values` in a reused buffer.
    pub fn copy_of(values: &[f32]) -> Payload {
        let mut v = buffer::take(values.len());
        v.extend_from_slice(values);
        Payload::from_vec(v)
    }

    /// A buffer of `len` values to be overwritten (a pooled one keeps stale values), for a
    /// transport to read a peer's values into (then [`Payload::from_vec`]): at steady state
    /// no fresh pages are mapped and nothing is zeroed for received data.
    pub fn receive_buffer(len: usize) -> Vec<f32> {
        buffer::take_filled(len)
    }

    /// Values that stay where a transport received them (see [`ExternalValues`]): read in
    /// place, copied only by whoever must write them.
    pub fn from_external(values: Box<dyn ExternalValues>) -> Payload {
        Payload::data(Rope::from_shared(Arc::new(Buffer::from_external(values))))
    }

    /// When the values are one run of external values ([`Payload::from_external`], perhaps a
    /// slice of them): their owner and where in it they start.
    pub fn external_run(&self) -> Option<(&dyn ExternalValues, usize)> {
        match self {
            Payload::Data(r) => match r.segs.as_slice() {
                [seg] => seg.buf.as_ref()?.external().map(|e| (e, seg.start)),
                _ => None,
            },
            Payload::Meta(_) | Payload::Pending(_) => None,
        }
    }

    /// Writes the values into `out` (exactly [`Payload::len`] long): a deferred reduction is
    /// performed straight into it, so a transport's send slot is the reduction's only output.
    /// Meta payloads write nothing.
    pub fn write_into(&self, out: &mut [f32]) {
        match self {
            Payload::Meta(_) => {}
            Payload::Data(r) => {
                let mut at = 0;
                r.for_each_run(|run| {
                    out[at..at + run.len()].copy_from_slice(run);
                    at += run.len();
                });
            }
            Payload::Pending(p) => p.evaluate_into(out),
        }
    }

    /// Values decoded from little-endian f32 bytes (a peer's message), into a reused buffer.
    /// `None` if the byte count is not a whole number of values.
    pub fn from_f32_le(bytes: &[u8]) -> Option<Payload> {
        if !bytes.len().is_multiple_of(4) {
            return None;
        }
        let mut values = buffer::take(bytes.len() / 4);
        values.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        Some(Payload::from_vec(values))
    }

    /// The values as little-endian bytes appended to `out` (data mode; meta adds nothing).
    pub fn write_f32_le(&self, out: &mut Vec<u8>) {
        match self {
            Payload::Meta(_) => {}
            Payload::Data(r) => {
                out.reserve(r.len() * 4);
                r.for_each_run(|run| {
                    for v in run {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                });
            }
            Payload::Pending(_) => self.resolved().write_f32_le(out),
        }
    }

    /// A payload of `len` zeros in the same mode as `self`.
    pub fn zeros_like(&self, len: usize) -> Payload {
        match self {
            Payload::Meta(_) => Payload::Meta(len),
            Payload::Data(_) | Payload::Pending(_) => Payload::data(Rope::zeros(len)),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Payload::Meta(n) => *n,
            Payload::Data(r) => r.len(),
            Payload::Pending(p) => p.terms.first().map_or(0, Rope::len),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_meta(&self) -> bool {
        matches!(self, Payload::Meta(_))
    }

    /// The values, if this is a resolved data payload (collectives always return those).
    pub fn as_rope(&self) -> Option<&Rope> {
        match self {
            Payload::Data(r) => Some(r),
            Payload::Meta(_) | Payload::Pending(_) => None,
        }
    }

    /// Performs a deferred reduction; other payloads are returned unchanged.
    pub fn resolve(self) -> Payload {
        match self {
            Payload::Pending(p) => Payload::data(p.evaluate()),
            other => other,
        }
    }

    /// [`Payload::resolve`], off the async runtime for large reductions: the work goes to the
    /// blocking pool, at most one reduction per core at a time, so the reductions of many
    /// chips spread over every core whichever runtime thread their chips run on, without
    /// more concurrent memory streams than the cores can feed.
    pub async fn resolve_async(self) -> Result<Payload, CollectiveError> {
        const OFFLOAD_ELEMENTS: usize = 1 << 17;
        static SLOTS: OnceLock<Semaphore> = OnceLock::new();
        match self {
            Payload::Pending(p) if p.terms.first().map_or(0, Rope::len) >= OFFLOAD_ELEMENTS => {
                let slots = SLOTS.get_or_init(|| {
                    Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
                });
                let failed = |e: String| CollectiveError::Internal(format!("reduction task: {e}"));
                let _slot = slots.acquire().await.map_err(|e| failed(e.to_string()))?;
                tokio::task::spawn_blocking(move || Payload::data(p.evaluate()))
                    .await
                    .map_err(|e| failed(e.to_string()))
            }
            other => Ok(other.resolve()),
        }
    }

    /// A copy with any deferred reduction performed (used where a method needs the values).
    fn resolved(&self) -> Payload {
        self.clone().resolve()
    }

    /// FNV-1a over the values' f32 bits (debug-mode message checksums); `None` in meta mode.
    pub fn checksum(&self) -> Option<u64> {
        let resolved;
        let rope = match self {
            Payload::Pending(_) => {
                resolved = self.resolved();
                resolved.as_rope()?
            }
            _ => self.as_rope()?,
        };
        let mut h = crate::bits::fnv1a_f32([]);
        rope.for_each_run(|run| h = crate::bits::fnv1a_f32_from(h, run.iter().copied()));
        Some(h)
    }

    /// The values as one vector, without a copy where [`Rope::into_vec`] can; `None` in meta
    /// mode.
    pub fn into_vec(self) -> Option<Vec<f32>> {
        match self.resolve() {
            Payload::Data(rope) => Some(rope.into_vec()),
            _ => None,
        }
    }

    /// The values as one vector (a copy); `None` in meta mode.
    pub fn to_vec(&self) -> Option<Vec<f32>> {
        match self {
            Payload::Pending(_) => self.resolved().to_vec(),
            _ => self.as_rope().map(Rope::to_vec),
        }
    }

    /// Elements `[start, start + len)`; out-of-range parts are dropped.
    pub fn slice(&self, start: usize, len: usize) -> Payload {
        let start = start.min(self.len());
        let len = len.min(self.len() - start);
        match self {
            Payload::Meta(_) => Payload::Meta(len),
            Payload::Data(r) => {
                let mut c = Cursor::new(r);
                c.skip(start);
                Payload::data(c.take(len))
            }
            Payload::Pending(_) => self.resolved().slice(start, len),
        }
    }

    /// The first `len` elements.
    pub fn truncate(self, len: usize) -> Payload {
        if len >= self.len() {
            self
        } else {
            self.slice(0, len)
        }
    }

    /// This payload followed by `len` zeros.
    pub fn pad(self, len: usize) -> Payload {
        if len == 0 {
            return self;
        }
        let zeros = self.zeros_like(len);
        Payload::concat([self, zeros])
    }

    /// Concatenation of payloads of one mode, in order.
    pub fn concat(parts: impl IntoIterator<Item = Payload>) -> Payload {
        let mut meta = None;
        let mut rope = Rope::default();
        for p in parts {
            match p {
                Payload::Meta(n) => *meta.get_or_insert(0) += n,
                Payload::Data(r) => rope.append(*r),
                pending @ Payload::Pending(_) => {
                    if let Payload::Data(r) = pending.resolve() {
                        rope.append(*r);
                    }
                }
            }
        }
        match meta {
            Some(n) => Payload::Meta(n),
            None => Payload::data(rope),
        }
    }

    /// Splits into consecutive parts of the given lengths.
    pub fn split_lengths(&self, lengths: &[usize]) -> Vec<Payload> {
        match self {
            Payload::Meta(_) => lengths.iter().map(|&n| Payload::Meta(n)).collect(),
            Payload::Data(r) => {
                let mut c = Cursor::new(r);
                lengths.iter().map(|&n| Payload::data(c.take(n))).collect()
            }
            Payload::Pending(_) => self.resolved().split_lengths(lengths),
        }
    }

    /// Splits into `n` equal consecutive parts (the length must divide by `n`).
    pub fn split_even(&self, n: usize) -> Vec<Payload> {
        let each = self.len() / n.max(1);
        self.split_lengths(&vec![each; n])
    }

    /// The buffer holds consecutive chunks of `chunk` elements; chunk `k` belongs to group
    /// `k % n`. Returns the `n` groups, each in chunk order. This is how a chip picks out the
    /// blocks bound for each position along one axis of a multi-axis layout.
    pub fn split_interleaved(&self, chunk: usize, n: usize) -> Vec<Payload> {
        match self {
            Payload::Meta(len) => vec![Payload::Meta(len / n.max(1)); n],
            Payload::Data(r) => {
                let mut groups = vec![Rope::default(); n];
                let mut c = Cursor::new(r);
                let chunks = r.len().checked_div(chunk).unwrap_or(0);
                for k in 0..chunks {
                    groups[k % n].append(c.take(chunk));
                }
                groups.into_iter().map(Payload::data).collect()
            }
            Payload::Pending(_) => self.resolved().split_interleaved(chunk, n),
        }
    }

    /// Inverse of [`Payload::split_interleaved`]: interleaves `chunk`-sized pieces of the groups.
    pub fn merge_interleaved(groups: Vec<Payload>, chunk: usize) -> Payload {
        if groups.iter().any(Payload::is_meta) || chunk == 0 {
            return Payload::concat(groups);
        }
        let ropes: Vec<Rope> = groups
            .into_iter()
            .map(|g| match g.resolve() {
                Payload::Data(r) => *r,
                Payload::Meta(_) | Payload::Pending(_) => Rope::default(),
            })
            .collect();
        let per_group = ropes.first().map_or(0, |r| r.len() / chunk);
        let mut cursors: Vec<Cursor<'_>> = ropes.iter().map(Cursor::new).collect();
        let mut out = Rope::default();
        for _ in 0..per_group {
            for c in &mut cursors {
                out.append(c.take(chunk));
            }
        }
        Payload::data(out)
    }

    /// Element-wise `self (op) other`. In data mode the result is a deferred reduction (see
    /// [`Payload::Pending`]): nothing is computed until the result is resolved or used.
    pub fn combine(self, other: &Payload, op: ReduceOp) -> Result<Payload, CollectiveError> {
        if self.len() != other.len() {
            return Err(CollectiveError::Internal(format!(
                "reduction of payloads of {} and {} elements",
                self.len(),
                other.len()
            )));
        }
        let term = match other {
            Payload::Meta(_) if self.is_meta() => return Ok(self),
            Payload::Meta(_) => return Err(mixed()),
            Payload::Data(r) => Rope::clone(r),
            Payload::Pending(p) => p.evaluate(),
        };
        // Adding zeros (broadcast contributions, padding) changes nothing: skip the term.
        let adds_nothing = |r: &Rope| op == ReduceOp::Sum && r.is_all_zeros();
        match self {
            Payload::Meta(_) => Err(mixed()),
            Payload::Data(acc) if adds_nothing(&acc) => Ok(Payload::data(term)),
            _ if adds_nothing(&term) => Ok(self),
            Payload::Data(acc) => Ok(Payload::Pending(Box::new(PendingReduction {
                op,
                terms: vec![*acc, term],
            }))),
            Payload::Pending(mut p) if p.op == op => {
                p.terms.push(term);
                Ok(Payload::Pending(p))
            }
            pending @ Payload::Pending(_) => pending.resolve().combine(&Payload::data(term), op),
        }
    }

    /// Multiplies every value by `1 / divisor` (used by `avg`), computed as a division so that
    /// results match a reference that divides.
    pub fn divide(self, divisor: f32) -> Payload {
        // `x / 1` is `x`: an average over one chip costs no pass over its values.
        if divisor == 1.0 {
            return self;
        }
        // By a power of two the reciprocal is exact, so multiplying by it rounds to the same
        // values as dividing, and runs at memory speed where a division would not.
        let reciprocal = 1.0 / divisor;
        if divisor.is_normal() && reciprocal.is_normal() && divisor.to_bits() & 0x007f_ffff == 0 {
            self.map_values(|x| x * reciprocal)
        } else {
            self.map_values(|x| x / divisor)
        }
    }

    /// `f` of every value: in place when the rope is one unshared buffer; otherwise one pass
    /// that writes the results into a single fresh buffer (not a copy, then a pass).
    fn map_values(self, f: impl Fn(f32) -> f32) -> Payload {
        match self {
            Payload::Meta(n) => Payload::Meta(n),
            Payload::Data(r) => {
                let v = match r.into_unique() {
                    Ok(mut v) => {
                        v.iter_mut().for_each(|x| *x = f(*x));
                        v
                    }
                    Err(r) => {
                        let mut v = buffer::take(r.len);
                        r.for_each_run(|run| v.extend(run.iter().map(|&x| f(x))));
                        v
                    }
                };
                Payload::data(Rope::from_vec(v))
            }
            pending @ Payload::Pending(_) => pending.resolve().map_values(f),
        }
    }
}

fn mixed() -> CollectiveError {
    CollectiveError::Internal("reduction mixes data and meta payloads".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(v: &[f32]) -> Payload {
        Payload::from_vec(v.to_vec())
    }

    #[test]
    fn into_vec_takes_a_buffer_only_when_nothing_else_shares_it() {
        let values: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let whole = Payload::from_vec(values.clone());
        let address = whole
            .as_rope()
            .and_then(|r| r.segs[0].values())
            .map(<[f32]>::as_ptr);
        let taken = whole.into_vec().unwrap_or_default();
        assert_eq!(taken, values);
        assert_eq!(
            Some(taken.as_ptr()),
            address,
            "the unshared buffer is moved, not copied"
        );
        // Shared (a clone is alive) or a part of a buffer: a copy, the other holder unchanged.
        let shared = Payload::from_vec(values.clone());
        let other = shared.clone();
        assert_eq!(shared.into_vec().unwrap_or_default(), values);
        assert_eq!(other.to_vec().unwrap_or_default(), values);
        let part = Payload::from_vec(values.clone()).slice(2, 3);
        assert_eq!(part.into_vec().unwrap_or_default(), vec![2.0, 3.0, 4.0]);
        assert_eq!(Payload::Meta(3).into_vec(), None);
    }

    #[test]
    fn slicing_and_concatenation_share_buffers() {
        let p = data(&[0., 1., 2., 3., 4., 5.]);
        let joined = Payload::concat([p.slice(0, 2), p.slice(2, 4)]);
        assert_eq!(joined.as_rope().unwrap().segments(), 1);
        assert_eq!(joined.to_vec().unwrap(), vec![0., 1., 2., 3., 4., 5.]);
        let padded = p.slice(4, 10).pad(2);
        assert_eq!(padded.to_vec().unwrap(), vec![4., 5., 0., 0.]);
    }

    #[test]
    fn interleaved_split_round_trips() {
        let p = data(&(0..12).map(|x| x as f32).collect::<Vec<_>>());
        let groups = p.split_interleaved(2, 3);
        assert_eq!(groups[1].to_vec().unwrap(), vec![2., 3., 8., 9.]);
        let back = Payload::merge_interleaved(groups, 2);
        assert_eq!(back.to_vec().unwrap(), p.to_vec().unwrap());
    }

    /// A payload of `values` cut into pieces at `cuts` (so its runs start at unusual
    /// places), followed by `zeros` zero values held as a zero run.
    fn cut(values: &[f32], cuts: &[usize], zeros: usize) -> Payload {
        let mut at = 0;
        let mut pieces = Vec::new();
        for &c in cuts.iter().chain([&values.len()]) {
            let c = c.clamp(at, values.len());
            pieces.push(data(&values[at..c]));
            at = c;
        }
        Payload::concat(pieces).pad(zeros)
    }

    proptest::proptest! {
        /// A reduction of several differently cut payloads equals the naive reference
        /// reduction of their values, bit for bit (whatever path evaluates it).
        #[test]
        fn a_reduction_equals_the_element_wise_fold(
            len in 0usize..40_000,
            terms in proptest::collection::vec(
                (proptest::collection::vec(0usize..40_000, 0..4), 0usize..3_000, 0u32..1000),
                2..5,
            ),
            op in 0usize..4,
        ) {
            let op = ReduceOp::ALL[op];
            let mut inputs: Vec<Vec<f32>> = Vec::new();
            let mut acc: Option<Payload> = None;
            for (cuts, zeros, seed) in &terms {
                let zeros = (*zeros).min(len);
                let mut values: Vec<f32> = (0..len - zeros)
                    .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 * 1e-3 - 1e3)
                    .collect();
                let payload = cut(&values, cuts, zeros);
                values.resize(len, 0.0);
                inputs.push(values);
                acc = Some(match acc {
                    None => payload,
                    Some(a) => a.combine(&payload, op).unwrap(),
                });
            }
            let got = acc.unwrap().resolve().to_vec().unwrap();
            // A combined payload is the sum for `avg` too (the division comes once, after).
            let summed = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
            let expected = crate::reference::all_reduce(&inputs, summed);
            proptest::prop_assert_eq!(got.len(), expected.len());
            for (g, e) in got.iter().zip(&expected) {
                proptest::prop_assert_eq!(g.to_bits(), e.to_bits());
            }
        }

        /// Dividing a payload (owned or cut, any divisor, powers of two taking the
        /// multiplying path) gives exactly the quotients `x / d`, subnormals and
        /// extremes included.
        #[test]
        fn a_division_equals_the_quotients(
            bits in proptest::collection::vec(proptest::num::u32::ANY, 0..3_000),
            cuts in proptest::collection::vec(0usize..3_000, 0..3),
            power in proptest::bool::ANY,
            k in 0i32..8,
            d in 1u32..300,
        ) {
            let divisor = if power { 2f32.powi(k) } else { d as f32 };
            let values: Vec<f32> = bits
                .iter()
                .map(|&b| f32::from_bits(b))
                .filter(|x| x.is_finite())
                .collect();
            let expected: Vec<u32> = values.iter().map(|x| (x / divisor).to_bits()).collect();
            for payload in [Payload::from_vec(values.clone()), cut(&values, &cuts, 0)] {
                let got = payload.divide(divisor).to_vec().unwrap();
                let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                proptest::prop_assert_eq!(&got, &expected);
            }
        }
    }

    #[test]
    fn combine_defers_then_resolves_in_order() {
        let a = data(&[1., 2.]);
        let b = data(&[10., 20.]);
        let c = a.combine(&b, ReduceOp::Max).unwrap();
        assert!(matches!(c, Payload::Pending(_)));
        let c = c
            .combine(&data(&[15., 5.]), ReduceOp::Max)
            .unwrap()
            .resolve();
        assert_eq!(c.to_vec().unwrap(), vec![15., 20.]);
        assert!(data(&[1.]).combine(&b, ReduceOp::Sum).is_err());
        assert_eq!(
            Payload::Meta(4)
                .combine(&Payload::Meta(4), ReduceOp::Sum)
                .unwrap()
                .len(),
            4
        );
    }
}
