//! Shared-memory payloads between workers on one host: each direction of a same-host link may
//! carry its large payloads through a region of memory both workers map, instead of through
//! the socket.
//!
//! Why: through a Unix socket every byte is copied twice by the kernel (into the socket, out
//! of it), with a buffer allocated and freed per packet. Through a shared region the sender
//! writes a payload once, straight from its reduction ([`Payload::write_into`]: a ring step's
//! sum is computed into the region, so the copy costs nothing beyond the arithmetic), and the
//! receiver reads it where it lies ([`Payload::from_external`]). A payload that is itself
//! values lent by a region (an all-gather passing on what it received) is not copied at all:
//! the record names the slot where it already lies, and the next worker reads it there. This
//! is what NCCL and Open MPI do between processes on one node.
//!
//! The socket stays: it carries every record's header in order, small payloads inline, and
//! each large payload's place (region, slot, offset). A region belongs to the worker that
//! sends through it, which creates it (`memfd`, so it lives only as long as the workers that
//! map it: nothing to clean up after a kill) and lends its slots out. Other workers map it
//! through `/proc/<pid>/fd` (the receiver when the link says hello, a worker further on when a
//! record first names it) after checking, on the descriptor it opened, that it is a region of
//! this job: a memfd named for the job's token, of the inode named, sealed against resizing
//! (a region that shrank under a mapping would fault whoever touched it). Passing a slot on
//! assumes that every worker of the job on this host can open every other's regions, as the
//! workers one coordinator spawns can (same user, same pid namespace). Each slot has a count of the payloads that
//! read it: the owner sets it to 1 (release) after writing the values, a worker passing the
//! slot on adds 1 before its record goes out, each reader checks it (acquire) before reading
//! and takes 1 off (release) when its last piece of the payload is dropped, and the owner
//! reuses the slot only after seeing 0 (acquire).
//!
//! Backpressure never blocks: a payload that finds no room (readers still hold what they were
//! lent) goes inline on the socket, so a slow or stuck receiver cannot deadlock a sender here.
//! Every region, slot and offset a peer names is checked before anything is read; a garbage
//! record is refused like any other bad record.
//!
//! `unsafe` here is mapping regions, and viewing parts of them as slices and counts (one of
//! four worker modules allowed it; docs/DESIGN.md lists them). Each block says why it holds.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use podsim_collectives::Payload;
use podsim_collectives::buffer::ExternalValues;

/// Bytes of one direction's region: address space reserved, not memory. Pages are allocated
/// as first touched, and slots are lent lowest offset first, so a link uses about as much
/// memory as the payloads its readers hold at once.
pub const REGION_BYTES: u64 = 256 << 20;
/// Payloads smaller than this stay inline on the socket: their copies are cheap and their
/// latency is the socket's either way.
pub const MIN_LENT_BYTES: usize = 64 << 10;
/// Payloads lent at once, at most: the counts fill the region's first page.
const SLOTS: usize = 1024;
/// Where payload values start: after the counts.
const DATA_START: usize = SLOTS * 4;
/// Alignment of a lent payload (a cache line).
const ALIGN: usize = 64;
/// Regions one process maps at most: a worker's links name a few; a peer naming more is
/// refused rather than allowed to use up this process's descriptors and address space.
const MAX_MAPPED: usize = 256;
/// Seals every region carries: its size is fixed for good.
const SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
/// Prefix of every region's memfd name; the rest is the job's tag ([`job_tag`]).
const NAME_PREFIX: &str = "podsim-link-";

/// The tag a job's regions are named with: a hash of its token, so that a worker maps only
/// regions of its own job (never another job's, whatever a peer's record names).
pub fn job_tag(token: &str) -> String {
    format!(
        "{:016x}",
        podsim_collectives::bits::fnv1a_bytes(token.bytes())
    )
}

/// Which region: its owner's pid, the memfd's number there, its inode. What a hello offers and
/// every lent record names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Region {
    pid: u32,
    fd: i32,
    ino: u64,
}

impl Region {
    pub const BYTES: usize = 16;

    /// No region (a hello that offers none).
    pub fn is_none(&self) -> bool {
        *self == Region::default()
    }

    pub fn encode(&self) -> [u8; Region::BYTES] {
        let mut out = [0u8; Region::BYTES];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.fd.to_le_bytes());
        out[8..].copy_from_slice(&self.ino.to_le_bytes());
        out
    }

    pub fn decode(b: &[u8]) -> Region {
        let mut word = [0u8; 4];
        let mut long = [0u8; 8];
        word.copy_from_slice(&b[..4]);
        let pid = u32::from_le_bytes(word);
        word.copy_from_slice(&b[4..8]);
        let fd = i32::from_le_bytes(word);
        long.copy_from_slice(&b[8..16]);
        Region {
            pid,
            fd,
            ino: u64::from_le_bytes(long),
        }
    }
}

/// Where a lent payload lies: what a record's header names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub region: Region,
    pub slot: u32,
    pub offset: u64,
}

/// A region mapped into this process.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
    region: Region,
    /// The owner's memfd, kept open so that others can open it through `/proc` (a mapping
    /// of someone else's region needs no descriptor: the mapping keeps the memory).
    _owned: Option<File>,
}

// SAFETY: the mapping is plain memory valid for the life of `Mapping`; which parts a thread
// may read or write is governed by the slot protocol (module docs), and the counts are atomics.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: shared access goes through atomics or through slots one side owns.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` shared, read and write; keeps `file` open when `owned`.
    fn map(file: File, len: usize, region: Region, owned: bool) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of an open file, at an address the kernel chooses;
        // nothing else in this process refers to it yet. The result is checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            region,
            _owned: owned.then_some(file),
        })
    }

    /// The read count of `slot` (`slot < SLOTS`).
    fn count(&self, slot: usize) -> &AtomicU32 {
        assert!(slot < SLOTS);
        // SAFETY: `slot * 4 + 4 <= DATA_START <= len`, the base is page-aligned so the address
        // is aligned for a u32, and the counts are only ever accessed atomically, by every
        // process that maps the region (lock-free atomics are address-free).
        unsafe { AtomicU32::from_ptr(self.ptr.add(slot * 4).cast::<u32>()) }
    }

    /// The values at `offset..offset + 4 * len` (in bounds, aligned: checked by callers).
    ///
    /// # Safety
    /// Nothing may write those bytes while the slice lives: they lie in a slot whose count
    /// this process holds a share of.
    unsafe fn values(&self, offset: usize, len: usize) -> &[f32] {
        debug_assert!(self.fits(offset, len));
        // SAFETY: in bounds and aligned (above); not written meanwhile (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset).cast::<f32>(), len) }
    }

    /// The values at `offset..offset + 4 * len`, to write.
    ///
    /// # Safety
    /// The range is free: in no slot with a count above zero.
    #[allow(clippy::mut_from_ref)]
    unsafe fn values_mut(&self, offset: usize, len: usize) -> &mut [f32] {
        debug_assert!(self.fits(offset, len));
        // SAFETY: in bounds and aligned; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset).cast::<f32>(), len) }
    }

    /// Whether `len` values at `offset` lie in the data part of the region, aligned for f32.
    fn fits(&self, offset: usize, len: usize) -> bool {
        let end = len
            .checked_mul(4)
            .and_then(|b| b.checked_add(offset))
            .unwrap_or(usize::MAX);
        offset >= DATA_START && offset.is_multiple_of(4) && end <= self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; every slice into it borrowed `self` (or
        // an `Arc` of it), so none outlives it.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Regions of other workers this process has mapped, kept for its life: a worker maps only
/// the few regions of its job's same-host links, and mapping one anew would fault its pages
/// in again.
/// Each with the tag of the job it was checked for.
static MAPPED: Mutex<Option<Registry>> = Mutex::new(None);

type Registry = HashMap<Region, (String, Arc<Mapping>)>;

/// `region`, mapped here (once per process), after checking that it is a region of the job
/// tagged `tag`: a memfd of that name, of the inode named, of a region's size.
fn mapped(region: Region, tag: &str) -> io::Result<Arc<Mapping>> {
    let refuse = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    let mut all = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    let all = all.get_or_insert_with(HashMap::new);
    if let Some((checked_for, m)) = all.get(&region) {
        return if checked_for == tag {
            Ok(m.clone())
        } else {
            Err(refuse("a region of another job".into()))
        };
    }
    if all.len() >= MAX_MAPPED {
        return Err(refuse(format!("more than {MAX_MAPPED} regions named")));
    }
    // Opened once; every check is of the descriptor opened, so a peer cannot swap the file
    // between a check and the mapping.
    let path = format!("/proc/{}/fd/{}", region.pid, region.fd);
    let file = File::options().read(true).write(true).open(&path)?;
    let name = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    let expected = format!("/memfd:{NAME_PREFIX}{tag}");
    let name = name.to_string_lossy();
    if name != expected && name != format!("{expected} (deleted)") {
        return Err(refuse(format!(
            "{path} is {name}, not a region of this job"
        )));
    }
    let meta = file.metadata()?;
    if meta.ino() != region.ino {
        return Err(refuse(format!("{path} is not the region named")));
    }
    // A region that could shrink under a mapping would fault (SIGBUS) whoever reads or
    // writes past its new end: only sealed regions are mapped.
    // SAFETY: a query of an open descriptor's seals; no memory is involved.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & SEALS != SEALS {
        return Err(refuse(format!("{path} is not sealed against resizing")));
    }
    let len = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    if len <= DATA_START || meta.len() > REGION_BYTES {
        return Err(refuse(format!("a region of {} bytes", meta.len())));
    }
    let m = Arc::new(Mapping::map(file, len, region, false)?);
    all.insert(region, (tag.to_string(), m.clone()));
    Ok(m)
}

/// The sending side: a region this worker created, and which of its slots are lent.
#[derive(Debug)]
pub struct Outbound {
    map: Mapping,
    lent: Mutex<Lent>,
}

/// Slots lent and not yet seen given back: offset, bytes, slot, by offset.
#[derive(Debug, Default)]
struct Lent {
    ranges: std::collections::BTreeMap<usize, (usize, u32)>,
    free_slots: Vec<u32>,
}

impl Outbound {
    /// A fresh region of `bytes` (a memfd named for the job tagged `tag`).
    pub fn create(bytes: u64, tag: &str) -> io::Result<Outbound> {
        let len = usize::try_from(bytes).map_err(|_| io::ErrorKind::InvalidInput)?;
        if len <= DATA_START {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let name = std::ffi::CString::new(format!("{NAME_PREFIX}{tag}"))
            .map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: a NUL-terminated name and flags; the result is checked and owned at once.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(bytes)?;
        // SAFETY: seals an open descriptor this function owns; no memory is involved.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let region = Region {
            pid: std::process::id(),
            fd,
            ino: file.metadata()?.ino(),
        };
        Ok(Outbound {
            map: Mapping::map(file, len, region, true)?,
            lent: Mutex::new(Lent {
                ranges: Default::default(),
                free_slots: (0..SLOTS as u32).rev().collect(),
            }),
        })
    }

    /// What the hello says about this region.
    pub fn region(&self) -> Region {
        self.map.region
    }

    /// Lends `payload`'s values to the peer: where they lie, or `None` when the payload is
    /// small, meta, or finds no room (it then goes inline). Values some region lent this
    /// worker are passed on where they lie (one more reader of their slot); others are
    /// written into a free slot of this region (a pending reduction computed straight into
    /// it).
    pub fn lend(&self, payload: &Payload) -> Option<Place> {
        if payload.is_meta() || payload.len() * 4 < MIN_LENT_BYTES {
            return None;
        }
        if let Some((owner, start)) = payload.external_run()
            && let Some(b) = owner.as_any().downcast_ref::<Borrowed>()
        {
            // This worker holds a share of the slot for as long as `payload` lives, so the
            // count is above zero and the values stay; the peer's share is added before the
            // record that names it goes out.
            b.map.count(b.slot).fetch_add(1, Ordering::Relaxed);
            return Some(Place {
                region: b.map.region,
                slot: b.slot as u32,
                offset: (b.offset + 4 * start) as u64,
            });
        }
        let bytes = payload.len() * 4;
        let mut lent = self.lent.lock().unwrap_or_else(|e| e.into_inner());
        // Take back what every reader gave back.
        let map = &self.map;
        let mut given_back = Vec::new();
        lent.ranges.retain(|_, &mut (_, slot)| {
            let back = map.count(slot as usize).load(Ordering::Acquire) == 0;
            if back {
                given_back.push(slot);
            }
            !back
        });
        lent.free_slots.extend(given_back);
        let slot = *lent.free_slots.last()?;
        // Lowest gap that fits, so the pages in use stay few and warm.
        let mut at = DATA_START;
        for (&start, &(len, _)) in &lent.ranges {
            if start >= at + bytes {
                break;
            }
            at = (start + len).next_multiple_of(ALIGN);
        }
        if at + bytes > map.len {
            return None;
        }
        lent.free_slots.pop();
        lent.ranges.insert(at, (bytes, slot));
        // SAFETY: `at..at + bytes` overlaps no lent range (the gap search above), and every
        // reader of the ranges it overlapped before has given its share back.
        payload.write_into(unsafe { map.values_mut(at, payload.len()) });
        map.count(slot as usize).store(1, Ordering::Release);
        Some(Place {
            region: map.region,
            slot,
            offset: at as u64,
        })
    }
}

/// The receiving side of a link: the peer's region mapped here (kept for the link's life),
/// and the job's tag, which any other region a record names must carry.
#[derive(Debug, Clone)]
pub struct Inbound {
    peer: Arc<Mapping>,
    tag: String,
}

impl Inbound {
    /// Maps the region a peer's hello offered.
    pub fn open(region: Region, tag: &str) -> io::Result<Inbound> {
        Ok(Inbound {
            peer: mapped(region, tag)?,
            tag: tag.to_string(),
        })
    }

    /// The `len` values lent at `place`, read in place; this worker's share of the slot is
    /// given back when the last piece of the payload is dropped. Refuses a region not of this
    /// job, a place outside it, a slot no one holds, a misaligned offset.
    pub fn take(&self, place: Place, len: usize) -> Result<Payload, String> {
        let map = if place.region == self.peer.region {
            self.peer.clone()
        } else {
            mapped(place.region, &self.tag).map_err(|e| {
                format!(
                    "shared payload in region {}/{} of pid {}: {e}",
                    place.region.fd, place.region.ino, place.region.pid
                )
            })?
        };
        let slot = place.slot as usize;
        let offset = usize::try_from(place.offset).unwrap_or(usize::MAX);
        if slot >= SLOTS || !map.fits(offset, len) {
            return Err(format!(
                "shared payload of {len} values at slot {slot}, offset {offset}: outside the \
                 region of {} bytes",
                map.len
            ));
        }
        if map.count(slot).load(Ordering::Acquire) == 0 {
            return Err(format!("shared payload in slot {slot}, which was not lent"));
        }
        Ok(Payload::from_external(Box::new(Borrowed {
            map,
            slot,
            offset,
            len,
        })))
    }
}

/// A lent slot's values as a payload buffer; gives this worker's share back when dropped.
#[derive(Debug)]
struct Borrowed {
    map: Arc<Mapping>,
    slot: usize,
    offset: usize,
    len: usize,
}

impl ExternalValues for Borrowed {
    fn values(&self) -> &[f32] {
        // SAFETY: checked in bounds and aligned by `Inbound::take`; the slot's owner does not
        // write it until its count is back to zero, and this holds a share until `drop`.
        unsafe { self.map.values(self.offset, self.len) }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        self.map.count(self.slot).fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_collectives::ReduceOp;

    const TAG: &str = "0123456789abcdef";

    fn region() -> (Outbound, Inbound) {
        let out = Outbound::create(8 << 20, TAG).unwrap_or_else(|e| panic!("{e}"));
        let inb = Inbound::open(out.region(), TAG).unwrap_or_else(|e| panic!("{e}"));
        (out, inb)
    }

    #[test]
    fn a_lent_payload_reads_back_and_its_slot_returns_when_dropped() {
        let (out, inb) = region();
        let values: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
        let place = out
            .lend(&Payload::from_vec(values.clone()))
            .unwrap_or_else(|| panic!("not lent"));
        let got = inb
            .take(place, values.len())
            .unwrap_or_else(|e| panic!("{e}"));
        // Pieces share the slot: it comes back only when the last one goes.
        let piece = got.slice(10, 5);
        drop(got);
        assert_eq!(piece.to_vec(), Some(values[10..15].to_vec()));
        let second = out
            .lend(&Payload::from_vec(values.clone()))
            .unwrap_or_else(|| panic!("not lent"));
        assert_ne!(second.offset, place.offset, "a held slot was reused");
        drop(piece);
        let _ = inb.take(second, values.len());
        let third = out.lend(&Payload::from_vec(values.clone()));
        assert_eq!(
            third.map(|p| p.offset),
            Some(place.offset),
            "lowest gap first"
        );
    }

    #[test]
    fn a_pending_reduction_is_computed_into_the_slot() {
        let (out, inb) = region();
        let n = 50_000;
        let a = Payload::from_vec((0..n).map(|i| i as f32).collect());
        let b = Payload::from_vec((0..n).map(|i| 0.5 * i as f32).collect());
        let sum = a
            .combine(&b, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{e}"));
        let expected = sum.to_vec();
        let place = out.lend(&sum).unwrap_or_else(|| panic!("not lent"));
        let got = inb.take(place, n).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.to_vec(), expected);
    }

    #[test]
    fn lent_values_passed_on_are_named_where_they_lie_until_every_reader_is_done() {
        // Worker A lends to B, B passes a slice on to C (here: through B's own region's
        // lender, as B's link to C would).
        let (a_out, b_in) = region();
        let (b_out, c_in) = region();
        let n = 1 << 16;
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
        let place = a_out
            .lend(&Payload::from_vec(values.clone()))
            .unwrap_or_else(|| panic!("not lent"));
        let at_b = b_in.take(place, n).unwrap_or_else(|e| panic!("{e}"));
        let half = at_b.slice(n / 2, n / 2);
        let passed = b_out.lend(&half).unwrap_or_else(|| panic!("not passed on"));
        assert_eq!(passed.region, a_out.region(), "copied instead of passed on");
        assert_eq!(passed.offset, place.offset + 2 * n as u64);
        let at_c = c_in.take(passed, n / 2).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(at_c.to_vec(), Some(values[n / 2..].to_vec()));
        // B lets go first: the slot is still C's, so A must not reuse it.
        drop((at_b, half));
        let other = a_out.lend(&Payload::from_vec(values.clone()));
        assert_ne!(other.map(|p| p.offset), Some(place.offset));
        drop(at_c);
        drop(other.map(|p| b_in.take(p, n)));
        let again = a_out.lend(&Payload::from_vec(values));
        assert_eq!(again.map(|p| p.offset), Some(place.offset));
    }

    #[test]
    fn a_full_region_sends_inline_and_small_or_meta_payloads_stay_inline() {
        let (out, _inb) = region();
        let big = Payload::from_vec(vec![1.0; (3 << 20) / 4]);
        let held: Vec<Place> = (0..2).filter_map(|_| out.lend(&big)).collect();
        assert_eq!(held.len(), 2);
        assert_eq!(out.lend(&big), None, "no room: inline");
        assert_eq!(out.lend(&Payload::from_vec(vec![1.0; 16])), None);
        assert_eq!(out.lend(&Payload::Meta(1 << 30)), None);
    }

    #[test]
    fn places_outside_the_region_or_not_lent_are_refused() {
        let (out, inb) = region();
        let place = out
            .lend(&Payload::from_vec(vec![2.0; 1 << 16]))
            .unwrap_or_else(|| panic!("not lent"));
        let at = |slot, offset| Place {
            slot,
            offset,
            ..place
        };
        for (p, len) in [
            (at(SLOTS as u32, place.offset), 16),
            (at(place.slot, 0), 16),
            (at(place.slot, place.offset + 2), 16),
            (at(place.slot, place.offset), usize::MAX / 2),
            (at(place.slot, u64::MAX), 16),
            (at(place.slot + 1, place.offset), 16),
        ] {
            assert!(inb.take(p, len).is_err(), "{p:?} {len}");
        }
        assert!(inb.take(place, 1 << 16).is_ok());
    }

    #[test]
    fn only_regions_of_this_job_are_mapped() {
        let (out, _) = region();
        let region = out.region();
        assert_eq!(Region::decode(&region.encode()), region);
        // Another job's region, a region that does not exist, a file that is not a region.
        assert!(Inbound::open(region, "ffffffffffffffff").is_err());
        let missing = Region {
            pid: u32::MAX,
            ..region
        };
        assert!(Inbound::open(missing, TAG).is_err());
        let file = File::open("/proc/self/exe").unwrap_or_else(|e| panic!("{e}"));
        let not_a_region = Region {
            fd: file.as_raw_fd(),
            ..region
        };
        assert!(Inbound::open(not_a_region, TAG).is_err());
        let other_inode = Region {
            ino: region.ino + 1,
            ..region
        };
        assert!(Inbound::open(other_inode, TAG).is_err());
        // A memfd of the right name that could still be resized.
        let name =
            std::ffi::CString::new(format!("{NAME_PREFIX}{TAG}")).unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: a NUL-terminated name and a flag; the result is checked and owned at once.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let unsealed = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        unsealed.set_len(1 << 20).unwrap_or_else(|e| panic!("{e}"));
        let resizable = Region {
            pid: std::process::id(),
            fd,
            ino: unsealed.metadata().map(|m| m.ino()).unwrap_or(0),
        };
        let refused = Inbound::open(resizable, TAG).map(|_| ());
        assert!(refused.is_err_and(|e| e.to_string().contains("sealed")));
    }
}
