//! Shared-memory payloads between workers on one host: each direction of a same-host link may
//! carry its large payloads through a region of memory both workers map, instead of through
//! the socket.
//!
//! Why: through a Unix socket every byte is copied twice by the kernel (into the socket, out
//! of it), with a buffer allocated and freed per packet. Through a shared region the sender
//! writes a payload once, straight from its reduction ([`Payload::write_into`]: a ring step's
//! sum is computed into the region, so the copy costs nothing beyond the arithmetic), and the
//! receiver reads it where it lies ([`Payload::from_external`]): a payload that crosses a
//! process costs what one crossing two chips in one process costs. This is what NCCL and
//! Open MPI do between processes on one node.
//!
//! The socket stays: it carries every record's header in order, small payloads inline, and
//! each large payload's place in the region (slot and offset). The region belongs to the
//! sending worker, which creates it (`memfd`, so it lives only as long as the workers that map
//! it: nothing to clean up after a kill) and lends its slots out; the receiving worker maps it
//! through `/proc/<pid>/fd` when the link says hello and gives a slot back by clearing the
//! slot's flag when the last payload piece reading it is dropped. Flags are the only shared
//! state both sides write: the sender sets a slot's flag (release) after writing its values,
//! the receiver checks it (acquire) before reading them and clears it (release) when done,
//! and the sender reuses a slot only after seeing it cleared (acquire).
//!
//! Backpressure never blocks: a payload that finds no room (the receiver still holds what
//! it was lent) goes inline on the socket as before, so a slow or stuck receiver cannot
//! deadlock a sender here. Every slot and offset a peer names is checked against the region
//! before anything is read; a garbage record is refused like any other bad record.
//!
//! This is the one module of podsim with `unsafe` code: mapping the region, and viewing parts
//! of it as slices and flags. Each block says why it holds.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use podsim_collectives::Payload;
use podsim_collectives::buffer::ExternalValues;

/// Bytes of one direction's region: address space reserved, not memory. Pages are allocated
/// as first touched, and slots are lent lowest offset first, so a link uses about as much
/// memory as the payloads its receiver holds at once.
pub const REGION_BYTES: u64 = 256 << 20;
/// Payloads smaller than this stay inline on the socket: their copies are cheap and their
/// latency is the socket's either way.
pub const MIN_LENT_BYTES: usize = 64 << 10;
/// Payloads lent at once, at most: the flags fill the region's first page.
const SLOTS: usize = 1024;
/// Where payload values start: after the flags.
const DATA_START: usize = SLOTS * 4;
/// Alignment of a lent payload (a cache line).
const ALIGN: usize = 64;

/// A region mapped into this process.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// Keeps the memfd open (the sender's), so that the peer can open it through `/proc`.
    file: File,
}

// SAFETY: the mapping is plain memory valid for the life of `Mapping`; which parts a thread
// may read or write is governed by the slot protocol (module docs), and the flags are atomics.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: shared access goes through atomics or through slots one side owns.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` shared, read and write.
    fn map(file: File, len: usize) -> io::Result<Mapping> {
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
            file,
        })
    }

    /// The flag of `slot` (`slot < SLOTS`).
    fn flag(&self, slot: usize) -> &AtomicU32 {
        assert!(slot < SLOTS);
        // SAFETY: `slot * 4 + 4 <= DATA_START <= len`, the base is page-aligned so the address
        // is aligned for a u32, and the flags are only ever accessed atomically, by both
        // processes (lock-free atomics are address-free).
        unsafe { AtomicU32::from_ptr(self.ptr.add(slot * 4).cast::<u32>()) }
    }

    /// The values at `offset..offset + 4 * len` (in bounds, aligned: checked by callers).
    ///
    /// # Safety
    /// Nothing may write those bytes while the slice lives: the range is a slot the peer
    /// lent this side and has not seen given back.
    unsafe fn values(&self, offset: usize, len: usize) -> &[f32] {
        debug_assert!(
            offset >= DATA_START && offset.is_multiple_of(ALIGN) && offset + 4 * len <= self.len
        );
        // SAFETY: in bounds and aligned (above); not written meanwhile (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset).cast::<f32>(), len) }
    }

    /// The values at `offset..offset + 4 * len`, to write.
    ///
    /// # Safety
    /// The range is a slot this side owns: not lent out, not being read by anyone.
    #[allow(clippy::mut_from_ref)]
    unsafe fn values_mut(&self, offset: usize, len: usize) -> &mut [f32] {
        debug_assert!(
            offset >= DATA_START && offset.is_multiple_of(ALIGN) && offset + 4 * len <= self.len
        );
        // SAFETY: in bounds and aligned; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset).cast::<f32>(), len) }
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

/// What a hello says about the region its sender will lend from: its pid, the memfd's
/// number in that process and its size (0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offer {
    pid: u32,
    fd: i32,
    bytes: u64,
}

impl Offer {
    pub const BYTES: usize = 16;

    pub fn is_none(&self) -> bool {
        self.bytes == 0
    }

    pub fn encode(&self) -> [u8; Offer::BYTES] {
        let mut out = [0u8; Offer::BYTES];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.fd.to_le_bytes());
        out[8..].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    pub fn decode(b: &[u8; Offer::BYTES]) -> Offer {
        Offer {
            pid: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            fd: i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            bytes: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        }
    }
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

/// Where a lent payload lies: what a record's header names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub slot: u32,
    pub offset: u64,
}

impl Outbound {
    /// A fresh region of `bytes` (an anonymous memfd).
    pub fn create(bytes: u64) -> io::Result<Outbound> {
        let len = usize::try_from(bytes).map_err(|_| io::ErrorKind::InvalidInput)?;
        if len <= DATA_START {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a C string literal and a flag; the result is checked and owned at once.
        let fd = unsafe { libc::memfd_create(c"podsim-link".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(bytes)?;
        Ok(Outbound {
            map: Mapping::map(file, len)?,
            lent: Mutex::new(Lent {
                ranges: Default::default(),
                free_slots: (0..SLOTS as u32).rev().collect(),
            }),
        })
    }

    /// What the hello says about this region.
    pub fn offer(&self) -> Offer {
        Offer {
            pid: std::process::id(),
            fd: self.map.file.as_raw_fd(),
            bytes: self.map.len as u64,
        }
    }

    /// Writes `payload`'s values into a free slot and lends it: where they are, or `None`
    /// when the payload is small, meta, or finds no room (it then goes inline).
    pub fn lend(&self, payload: &Payload) -> Option<Place> {
        if payload.is_meta() || payload.len() * 4 < MIN_LENT_BYTES {
            return None;
        }
        let bytes = payload.len() * 4;
        let mut lent = self.lent.lock().unwrap_or_else(|e| e.into_inner());
        // Take back what the receiver gave back.
        let map = &self.map;
        let mut given_back = Vec::new();
        lent.ranges.retain(|_, &mut (_, slot)| {
            let back = map.flag(slot as usize).load(Ordering::Acquire) == 0;
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
        // SAFETY: `at..at + bytes` overlaps no lent range (the gap search above) and the
        // receiver has given back every range it read here, so no one reads it now.
        payload.write_into(unsafe { map.values_mut(at, payload.len()) });
        map.flag(slot as usize).store(1, Ordering::Release);
        Some(Place {
            slot,
            offset: at as u64,
        })
    }
}

/// The receiving side: the peer's region, mapped here.
#[derive(Debug, Clone)]
pub struct Inbound {
    map: Arc<Mapping>,
}

impl Inbound {
    /// Maps the region a peer's hello offered.
    pub fn open(offer: &Offer) -> io::Result<Inbound> {
        let len = usize::try_from(offer.bytes).map_err(|_| io::ErrorKind::InvalidInput)?;
        if len <= DATA_START || offer.bytes > REGION_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a region of {} bytes", offer.bytes),
            ));
        }
        let file = File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/{}/fd/{}", offer.pid, offer.fd))?;
        if file.metadata()?.len() != offer.bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the offered region is not the size offered",
            ));
        }
        Ok(Inbound {
            map: Arc::new(Mapping::map(file, len)?),
        })
    }

    /// The `len` values the peer lent at `place`, read in place; the slot is given back when
    /// the last piece of the payload is dropped. Refuses a place outside the region, a slot
    /// not lent, or a misaligned offset.
    pub fn take(&self, place: Place, len: usize) -> Result<Payload, String> {
        let slot = place.slot as usize;
        let offset = usize::try_from(place.offset).unwrap_or(usize::MAX);
        let end = len
            .checked_mul(4)
            .and_then(|b| b.checked_add(offset))
            .unwrap_or(usize::MAX);
        if slot >= SLOTS
            || offset < DATA_START
            || !offset.is_multiple_of(ALIGN)
            || end > self.map.len
        {
            return Err(format!(
                "shared payload of {len} values at slot {slot}, offset {offset}: outside the \
                 region of {} bytes",
                self.map.len
            ));
        }
        if self.map.flag(slot).load(Ordering::Acquire) != 1 {
            return Err(format!("shared payload in slot {slot}, which was not lent"));
        }
        Ok(Payload::from_external(Box::new(Borrowed {
            map: self.map.clone(),
            slot,
            offset,
            len,
        })))
    }
}

/// A lent slot's values as a payload buffer; gives the slot back when dropped.
#[derive(Debug)]
struct Borrowed {
    map: Arc<Mapping>,
    slot: usize,
    offset: usize,
    len: usize,
}

impl ExternalValues for Borrowed {
    fn values(&self) -> &[f32] {
        // SAFETY: checked in bounds and aligned by `Inbound::take`; the sender does not write
        // the slot until this gives it back (in `drop`, after the last borrow of `self`).
        unsafe { self.map.values(self.offset, self.len) }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        self.map.flag(self.slot).store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_collectives::ReduceOp;

    fn region() -> (Outbound, Inbound) {
        let out = Outbound::create(8 << 20).unwrap_or_else(|e| panic!("{e}"));
        let inb = Inbound::open(&out.offer()).unwrap_or_else(|e| panic!("{e}"));
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
        for (slot, offset, len) in [
            (SLOTS as u32, place.offset, 16),
            (place.slot, 0, 16),
            (place.slot, place.offset + 4, 16),
            (place.slot, place.offset, usize::MAX / 2),
            (place.slot, u64::MAX, 16),
            (place.slot + 1, place.offset, 16),
        ] {
            assert!(
                inb.take(Place { slot, offset }, len).is_err(),
                "{slot} {offset} {len}"
            );
        }
        assert!(inb.take(place, 1 << 16).is_ok());
    }

    #[test]
    fn an_offer_survives_its_encoding_and_a_bad_one_is_refused() {
        let (out, _) = region();
        let offer = out.offer();
        assert_eq!(Offer::decode(&offer.encode()), offer);
        let missing = Offer {
            pid: u32::MAX,
            ..offer
        };
        assert!(Inbound::open(&missing).is_err());
        let huge = Offer {
            bytes: REGION_BYTES * 2,
            ..offer
        };
        assert!(Inbound::open(&huge).is_err());
    }
}
