//! How a sleep cuts the arena's chunks: groups for a kept sleep, pieces
//! for the others, what a stash still lacks. Pure planning over the chunk
//! table and the free ranges.

use super::Host;
use crate::backend::pages::PageableBuf;
use crate::backend::Backend;
use crate::location::Location;
use crate::migration::Group;
use crate::table::{ChunkTable, Entry};

/// Groups the table's chunks that `select` picks into pieces of at most
/// `max_piece` bytes (a bigger chunk is a group of its own): adjacent
/// chunks of one placement, access and CPU grant, never across `split_at`
/// (the arena's zone boundary), each bound for `to`.
pub(super) fn plan_groups<C>(
    table: &ChunkTable<C>,
    select: impl Fn(usize, &Entry<C>) -> bool,
    to: Location,
    max_piece: usize,
    split_at: usize,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut first: Option<&Entry<C>> = None;
    for (o, e) in table.iter() {
        if !select(o, e) {
            first = None;
            continue;
        }
        let joins = match (groups.last(), first) {
            (Some(g), Some(f)) => {
                g.offset + g.bytes == o
                    && !(g.offset < split_at && o >= split_at)
                    && g.bytes + e.bytes <= max_piece
                    && f.placement == e.placement
                    && f.cpu == e.cpu
                    && f.access[..] == e.access[..]
            }
            _ => false,
        };
        if joins {
            groups.last_mut().expect("checked").bytes += e.bytes;
        } else {
            groups.push(Group {
                offset: o,
                bytes: e.bytes,
                to,
            });
            first = Some(e);
        }
    }
    groups
}

/// The most bytes of a stash's pieces `prepare_sleep` maps under one
/// hold of the arena's lock (mapping and granting cost ~30 ms per GiB on an
/// H200).
/// (Unit tests take 1 MiB, so that their arenas stage in several holds.)
pub(crate) const STAGE_BATCH_BYTES: usize = if cfg!(test) { 1 << 20 } else { 1 << 30 };

/// Whether the merged `free` ranges cover `[o, o + n)`.
pub(super) fn covers(free: &[(usize, usize)], o: usize, n: usize) -> bool {
    let i = free.partition_point(|&(a, _)| a <= o);
    i > 0 && free[i - 1].1 >= o + n
}

/// The pieces `(offset, bytes)` a stashing sleep would copy now: the runs
/// left mapped once whole free chunks are gone, cut at multiples of
/// `piece` across chunks, never across the zones' border (as
/// `sleep_stash` cuts them).
fn stash_parts<B: Backend>(host: &impl Host<B>, piece: usize) -> Vec<(usize, usize)> {
    let free = host.free_ranges();
    let runs = host
        .region()
        .table
        .runs_without(|o, e| covers(&free, o, e.bytes));
    runs.iter()
        .flat_map(|&(o, b)| pieces(o, b, piece, host.zone_border()))
        .collect()
}

/// Whether the stash holds a piece of exactly `n` bytes at `o`.
pub(super) fn stash_holds<B: Backend>(host: &impl Host<B>, o: usize, n: usize) -> bool {
    host.state()
        .backup
        .stash
        .as_ref()
        .is_some_and(|x| x.table.get(o).is_some_and(|e| e.bytes == n))
}

/// The pieces of [`stash_parts`] the stash does not hold yet: what a
/// stashing sleep would still have to take and map.
pub(super) fn stash_missing<B: Backend>(host: &impl Host<B>, piece: usize) -> Vec<(usize, usize)> {
    stash_parts(host, piece)
        .into_iter()
        .filter(|&(o, n)| !stash_holds(host, o, n))
        .collect()
}

/// Splits the run `[offset, offset + bytes)` into pieces of at most
/// `max_piece` (multiples of `g`), never across `split_at`.
pub(super) fn pieces(
    offset: usize,
    bytes: usize,
    max_piece: usize,
    split_at: usize,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let end = offset + bytes;
    let mut at = offset;
    while at < end {
        let limit = if at < split_at {
            end.min(split_at)
        } else {
            end
        };
        let n = (limit - at).min(max_piece);
        out.push((at, n));
        at += n;
    }
    out
}

/// Bytes of a pageable or disk sleep's copies, `(offset, buffer)`.
pub(super) fn pages_bytes(pages: &[(usize, PageableBuf)]) -> usize {
    pages.iter().map(|p| p.1.len()).sum()
}

/// How many chunks of `table` the groups cover.
pub(super) fn count_in<C>(table: &ChunkTable<C>, groups: &[Group]) -> usize {
    groups
        .iter()
        .map(|g| table.overlapping(g.offset..g.offset + g.bytes).count())
        .sum()
}
