//! Reading what a stashing or pageable sleep kept: while the arena is
//! asleep, and after a wake that kept it (`WakeDesc::keep_backup`).

use super::*;
use crate::backend::pages::PageableBuf;

/// Where the backup of an arena lies now.
enum Source<'a, B: Backend> {
    /// A pageable sleep's copies, `(offset, buffer)` in address order.
    Pages(&'a [(usize, PageableBuf)]),
    /// The stash.
    Stash(&'a mut crate::region::Region<B>),
}

impl<B: Backend, S: ArenaStream<B>> Arena<B, S> {
    /// Copies the bytes a stashing or pageable sleep kept for `[address,
    /// address + dst.len())` into `dst`, while the arena is asleep in
    /// [`SleepMode::Stash`] or [`SleepMode::Pageable`], or awake after a
    /// wake that kept the backup ([`WakeDesc::keep_backup`]):
    /// torch_memory_saver's `get_cpu_backup`. True; false, with `dst`
    /// untouched, when there is no such backup, or it does not hold every
    /// byte of the range (a range outside the arena, or outside what was
    /// mapped at the sleep). Synchronous; the backup stays as it is.
    pub fn read_backup(&self, address: u64, dst: &mut [u8]) -> Result<bool> {
        let sh = &*self.shared;
        let Some((offset, end)) = self.offsets(address, dst.len()) else {
            return Ok(false);
        };
        let mut guard = sh.state.lock();
        match source(&mut guard) {
            None => Ok(false),
            Some(Source::Pages(paged)) => Ok(read_pages(paged, offset, dst)),
            Some(Source::Stash(stash)) => {
                if !grant_stash(&*sh.backend, stash, offset, end)? {
                    return Ok(false);
                }
                if !dst.is_empty() {
                    sh.backend.read(stash.res(), offset, dst)?;
                }
                Ok(true)
            }
        }
    }

    /// The host address at which the copy a [`SleepMode::Pageable`] or
    /// [`SleepMode::Disk`] sleep kept of `[address, address + len)` lies,
    /// whole and readable by the CPU (while asleep, or after a wake that
    /// kept it), or `None`: torch_memory_saver's
    /// `get_cpu_backup(zero_copy=True)`. The address stays valid, and
    /// stays the same, until the copy goes: a wake that does not keep it,
    /// [`release_stash`](Self::release_stash), or the arena's drop; a later
    /// sleep reuses it where the runs are the same (its bytes then change).
    /// Reading through it after that is the caller's fault, as after any
    /// free. An empty range has none. A [`SleepMode::Stash`] copy (pinned
    /// host memory mapped in the stash's own reservation) is offered too:
    /// its pieces are mapped for the device, and the host's access is
    /// given to the ones the range covers first (the CPU faults reading
    /// them otherwise). The stash's pieces stay at their addresses between
    /// sleeps of the same runs, so the address then stays the same.
    pub fn backup_address(&self, address: u64, len: usize) -> Result<Option<u64>> {
        let sh = &*self.shared;
        let Some((offset, end)) = self.offsets(address, len) else {
            return Ok(None);
        };
        if len == 0 {
            return Ok(None);
        }
        let mut guard = sh.state.lock();
        match source(&mut guard) {
            None => Ok(None),
            Some(Source::Pages(paged)) => {
                let i = paged.partition_point(|(o, b)| o + b.len() <= offset);
                Ok(paged
                    .get(i)
                    .filter(|(o, b)| *o <= offset && end <= o + b.len())
                    .map(|(o, b)| b.address() + (offset - o) as u64))
            }
            Some(Source::Stash(stash)) => Ok(grant_stash(&*sh.backend, stash, offset, end)?
                .then(|| stash.base() + offset as u64)),
        }
    }

    /// Whether a backup readable now (a sleep's, or one a wake kept) holds
    /// every byte of `[address, address + len)`: what
    /// [`read_backup`](Self::read_backup) would find, asked without a
    /// buffer (a caller sizes one only for a backup that exists).
    pub fn holds_backup(&self, address: u64, len: usize) -> bool {
        let Some((offset, end)) = self.offsets(address, len) else {
            return false;
        };
        let mut guard = self.shared.state.lock();
        match source(&mut guard) {
            None => false,
            Some(Source::Pages(paged)) => pages_hold(paged, offset, end),
            Some(Source::Stash(stash)) => stash_holds(stash, offset, end),
        }
    }

    /// `[address, address + len)` as offsets in the arena, if it starts in
    /// it.
    fn offsets(&self, address: u64, len: usize) -> Option<(usize, usize)> {
        let offset = usize::try_from(address.checked_sub(self.shared.base)?).ok()?;
        Some((offset, offset.checked_add(len)?))
    }
}

/// The backup readable now: a sleep's, or one a wake kept.
fn source<B: Backend>(st: &mut State<B>) -> Option<Source<'_, B>> {
    let SleepState {
        asleep,
        stash,
        kept_pages,
        backup_kept,
    } = &mut st.sleep;
    match asleep.as_ref().map(|a| a.mode) {
        Some(m) if m.pages() => asleep.as_ref().map(|a| Source::Pages(&a.paged)),
        Some(SleepMode::Stash) => stash.as_mut().map(Source::Stash),
        Some(_) => None,
        None if !*backup_kept => None,
        None if !kept_pages.is_empty() => Some(Source::Pages(kept_pages)),
        None => stash.as_mut().map(Source::Stash),
    }
}

/// Whether the stash holds every byte of `offset..end`; if so (and the
/// range is not empty), the host's access to the pieces that hold them is
/// given first (the stash is mapped
/// for the device; the CPU, and the driver's synchronous copies, fault
/// reading it otherwise).
fn grant_stash<B: Backend>(
    backend: &B,
    stash: &mut crate::region::Region<B>,
    offset: usize,
    end: usize,
) -> Result<bool> {
    if !stash_holds(stash, offset, end) {
        return Ok(false);
    }
    if end > offset {
        let (res, table) = stash.parts();
        crate::migration::grant_cpu(backend, res, table, offset, end - offset)?;
    }
    Ok(true)
}

/// Whether the stash holds every byte of `offset..end`.
fn stash_holds<B: Backend>(stash: &crate::region::Region<B>, offset: usize, end: usize) -> bool {
    let held: usize = stash
        .table
        .overlapping(offset..end)
        .map(|(o, e)| (o + e.bytes).min(end) - o.max(offset))
        .sum();
    held == end - offset
}

/// Whether a pageable sleep's copies hold every byte of `offset..end`.
fn pages_hold(paged: &[(usize, PageableBuf)], offset: usize, end: usize) -> bool {
    let first = paged.partition_point(|(o, b)| o + b.len() <= offset);
    let mut at = offset;
    for (o, b) in &paged[first..] {
        if at >= end || *o > at {
            break;
        }
        at = (o + b.len()).min(end);
    }
    at >= end
}

/// Copies `[offset, offset + dst.len())` out of a pageable sleep's copies
/// (`(offset, buffer)` in address order, side by side where runs of two
/// sleeps meet): true if they hold every byte of it, else false with `dst`
/// untouched.
fn read_pages(paged: &[(usize, PageableBuf)], offset: usize, dst: &mut [u8]) -> bool {
    let end = offset + dst.len();
    // The copies that overlap the range, in order, must tile it.
    let first = paged.partition_point(|(o, b)| o + b.len() <= offset);
    let mut at = offset;
    let mut parts = Vec::new();
    for (o, b) in &paged[first..] {
        if at >= end || *o > at {
            break;
        }
        let to = (o + b.len()).min(end);
        parts.push((at, &b.as_slice()[at - o..to - o]));
        at = to;
    }
    if at < end {
        return false;
    }
    for (from, src) in parts {
        dst[from - offset..from - offset + src.len()].copy_from_slice(src);
    }
    true
}
