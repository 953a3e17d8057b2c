//! Reading what a stashing sleep kept, while the arena is asleep.

use super::*;

impl<B: Backend, S: ArenaStream<B>> Arena<B, S> {
    /// Copies the bytes a stashing sleep kept for `[address, address +
    /// dst.len())` into `dst`, while the arena is asleep in
    /// [`SleepMode::Stash`] (torch_memory_saver's `get_cpu_backup`): true.
    /// False, with `dst` untouched, when the arena is not asleep with a
    /// stash, or the stash does not hold every byte of the range (a range
    /// outside the arena, or outside what was mapped at the sleep).
    /// Synchronous; the stash stays as it is.
    pub fn read_backup(&self, address: u64, dst: &mut [u8]) -> Result<bool> {
        let sh = &*self.shared;
        let Some(offset) = address
            .checked_sub(sh.base)
            .and_then(|o| usize::try_from(o).ok())
        else {
            return Ok(false);
        };
        let Some(end) = offset.checked_add(dst.len()) else {
            return Ok(false);
        };
        let mut guard = sh.state.lock();
        let st = &mut *guard;
        if !matches!(&st.asleep, Some(a) if a.mode == SleepMode::Stash) {
            return Ok(false);
        }
        let Some(stash) = st.stash.as_mut() else {
            return Ok(false);
        };
        let held: usize = stash
            .table
            .overlapping(offset..end)
            .map(|(o, e)| (o + e.bytes).min(end) - o.max(offset))
            .sum();
        if held != dst.len() {
            return Ok(false);
        }
        if dst.is_empty() {
            return Ok(true);
        }
        let (res, table) = stash.parts();
        crate::migration::grant_cpu(&*sh.backend, res, table, offset, dst.len())?;
        sh.backend.read(res, offset, dst)?;
        Ok(true)
    }
}
