//! Growth policies and the one growth plan: the pure arithmetic that turns
//! "grow to N bytes" (with what a pool offers) into the chunks to map. No
//! driver calls here: this is tested anywhere.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::location::Location;

/// How a buffer sizes the physical chunks it maps as it grows.
///
/// Every chunk is a whole multiple of the backend's granularity. The cost of
/// growing is per mapping, not per byte (each CUDA mapping costs ~20 us in
/// `cuMemSetAccess` alone), so the default sizes chunks with the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrowthPolicy {
    /// One chunk per growing call, of at least `len / divisor` bytes (rounded
    /// down to the granularity) and at least what the call needs. The number
    /// of mappings grows logarithmically with the size, and the bytes mapped
    /// beyond `len` after a growth stay below `max(granularity, len / divisor)`.
    /// The default is `divisor: 8` (at most 12.5% over-commit).
    Proportional {
        /// Over-commit bound as a fraction `1 / divisor` of the length. At least 1.
        divisor: usize,
    },
    /// Granularity-sized chunks only: the finest shrink and per-chunk control,
    /// at the price of one mapping per granularity unit.
    Exact,
    /// Chunks of a fixed size, rounded up to a multiple of the granularity.
    Fixed {
        /// Bytes per chunk. Not zero.
        chunk_bytes: usize,
    },
}

impl Default for GrowthPolicy {
    fn default() -> Self {
        GrowthPolicy::Proportional { divisor: 8 }
    }
}

impl GrowthPolicy {
    /// Checks the policy's parameters and resolves them against `granularity`
    /// (a `Fixed` size is rounded up to a whole number of granules).
    pub(crate) fn resolve(self, granularity: usize) -> Result<Self> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(Error::invalid(format!(
                "granularity {granularity} is not a power of two"
            )));
        }
        match self {
            GrowthPolicy::Proportional { divisor: 0 } => {
                Err(Error::invalid("GrowthPolicy::Proportional divisor is 0"))
            }
            GrowthPolicy::Fixed { chunk_bytes: 0 } => {
                Err(Error::invalid("GrowthPolicy::Fixed chunk_bytes is 0"))
            }
            GrowthPolicy::Fixed { chunk_bytes } => Ok(GrowthPolicy::Fixed {
                chunk_bytes: round_up(chunk_bytes, granularity).ok_or_else(|| {
                    Error::invalid(format!("chunk_bytes {chunk_bytes} overflows"))
                })?,
            }),
            p => Ok(p),
        }
    }

    /// The policy's bound on over-commit: right after a growth to `len` bytes
    /// that mapped new chunks, `capacity - len` is strictly below this.
    pub(crate) fn overcommit_bound(self, granularity: usize, len: usize) -> usize {
        match self {
            GrowthPolicy::Exact => granularity,
            GrowthPolicy::Fixed { chunk_bytes } => chunk_bytes,
            GrowthPolicy::Proportional { divisor } => granularity.max(len / divisor.max(1)),
        }
    }
}

/// The most mappings one growth may plan. Around 2^19 live mappings a process
/// hits the driver's ceiling (`cuMemSetAccess` fails with out of memory and
/// the context stays unusable, measured on an H200), so a plan past it can
/// never be carried out; refusing it up front costs no memory and no call.
pub(crate) const MAX_PLANNED_CHUNKS: usize = 1 << 19;

/// Chunks a pool holds, by (placement, bytes): how many of each.
pub(crate) type PoolOffer = BTreeMap<(Location, usize), usize>;

/// Everything a growth depends on.
pub(crate) struct GrowthRequest<'a> {
    /// A policy from [`GrowthPolicy::resolve`] with this granularity.
    pub(crate) policy: GrowthPolicy,
    pub(crate) granularity: usize,
    /// Where the new chunks start: the end of what is mapped now.
    pub(crate) at: usize,
    /// The capacity to reach (the new length).
    pub(crate) target: usize,
    /// The reservation's size: nothing may be mapped past it.
    pub(crate) limit: usize,
    /// Where a chunk starting at an offset is placed.
    pub(crate) placement_at: &'a dyn Fn(usize) -> Location,
    /// What a pool holds, taken first where it fits the policy.
    pub(crate) pool: Option<&'a PoolOffer>,
}

/// One chunk a growth maps, in address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Planned {
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    pub(crate) placement: Location,
    /// Take it from the pool (one of this size and placement was offered).
    pub(crate) pooled: bool,
}

/// The one growth plan: the chunks to map so that the capacity reaches
/// `target` from `at` without passing `limit`. Pooled chunks come first, as
/// long as they keep the policy's over-commit bound (exact sizes for `Exact`
/// and `Fixed`; for `Proportional`, at least half the policy's chunk, so a
/// pool full of small chunks cannot multiply the mappings); the rest follows
/// the policy, the last chunk cut to fit the reservation. Empty when
/// `target <= at`.
///
/// Pure arithmetic, every step checked: bad or huge inputs are errors, never
/// a panic or a wrap, and the plan's memory is bounded by
/// [`MAX_PLANNED_CHUNKS`].
pub(crate) fn plan_growth(req: &GrowthRequest<'_>) -> Result<Vec<Planned>> {
    let GrowthRequest {
        policy,
        granularity: g,
        at,
        target,
        limit,
        ..
    } = *req;
    check_request(req)?;
    let mut plan = Vec::new();
    if target <= at {
        return Ok(plan);
    }
    let overflow = || Error::invalid(format!("growing to {target} bytes overflows"));
    let mut offer = req.pool.cloned();
    // The biggest pooled chunk that keeps over-commit within the bound.
    let bound = policy.overcommit_bound(g, target);
    let mut end = at;
    while end < target {
        let room = limit - end;
        let need = round_up(target - end, g).ok_or_else(overflow)?.min(room);
        let place = (req.placement_at)(end);
        let pooled = offer.as_mut().and_then(|offer| {
            let step = Step {
                end,
                need,
                room,
                place,
            };
            take_pooled(offer, req, bound, step)
        });
        let (bytes, from_pool) = match pooled {
            Some(size) => (size, true),
            None => match policy {
                GrowthPolicy::Exact => (g, false),
                GrowthPolicy::Fixed { chunk_bytes } => (chunk_bytes.min(room), false),
                GrowthPolicy::Proportional { divisor } => {
                    let proportional = target / divisor.max(1) / g * g;
                    (need.max(proportional).min(room), false)
                }
            },
        };
        push(&mut plan, end, bytes, place, from_pool)?;
        end += bytes;
    }
    Ok(plan)
}

/// Refuses a request no plan can serve: a target past the reservation, a
/// granularity that is not a power of two, a start or limit off it, and
/// (for `Exact` and `Fixed`, which map a known number of chunks whatever the
/// pool holds) more mappings than a process can hold, before building it.
fn check_request(req: &GrowthRequest<'_>) -> Result<()> {
    let (g, at, target, limit) = (req.granularity, req.at, req.target, req.limit);
    if target > limit {
        return Err(Error::ReservationExhausted {
            requested_bytes: target,
            reserved_bytes: limit,
        });
    }
    if !g.is_power_of_two() || at % g != 0 || limit % g != 0 || at > limit {
        return Err(Error::invalid(format!(
            "growth from {at:#x} within {limit:#x} at granularity {g:#x}"
        )));
    }
    if target <= at {
        return Ok(());
    }
    let overflow = || Error::invalid(format!("growing to {target} bytes overflows"));
    let policy = req.policy;
    let count = match policy {
        GrowthPolicy::Exact => round_up(target - at, g).ok_or_else(overflow)? / g,
        GrowthPolicy::Fixed { chunk_bytes } => (target - at).div_ceil(chunk_bytes),
        GrowthPolicy::Proportional { .. } => 1,
    };
    if count > MAX_PLANNED_CHUNKS {
        return Err(Error::invalid(format!(
            "growing to {target} bytes with {policy:?} needs {count} mappings, more than \
             the {MAX_PLANNED_CHUNKS} a process can hold; choose larger chunks"
        )));
    }
    Ok(())
}

/// Takes out of `offer` the pooled chunk a growth step uses (see
/// [`pooled_size`]), if any; its size.
fn take_pooled(
    offer: &mut PoolOffer,
    req: &GrowthRequest<'_>,
    bound: usize,
    step: Step,
) -> Option<usize> {
    let size = pooled_size(offer, req, bound, step)?;
    let key = (step.place, size);
    let n = offer.get_mut(&key)?;
    *n -= 1;
    if *n == 0 {
        offer.remove(&key);
    }
    Some(size)
}

/// Where a growth step is: at `end` (a chunk there placed at `place`),
/// `need` bytes still to map, `room` left in the reservation.
#[derive(Clone, Copy)]
struct Step {
    end: usize,
    need: usize,
    room: usize,
    place: Location,
}

/// The size of the pooled chunk a growth [`Step`] takes, if
/// `offer` has one that suits `policy`: exactly the granule for `Exact`,
/// the policy's chunk for `Fixed`; for `Proportional` the pooled chunk
/// closest to what the policy would create: the smallest at or above that
/// size within the over-commit `bound`, else the largest below it that
/// covers the need, else the largest smaller one (the growth then takes
/// several). Chunks under half the policy's size stay pooled: each mapping
/// costs ~20-40 us whatever its size, so small ones would turn a
/// logarithmic count into one per step.
fn pooled_size(
    offer: &PoolOffer,
    req: &GrowthRequest<'_>,
    bound: usize,
    step: Step,
) -> Option<usize> {
    let (policy, g, target) = (req.policy, req.granularity, req.target);
    let Step {
        end,
        need,
        room,
        place,
    } = step;
    let fit = ((target - end).saturating_add(bound - 1) / g * g).min(room);
    match policy {
        GrowthPolicy::Exact => Some(g),
        GrowthPolicy::Fixed { chunk_bytes } => Some(chunk_bytes).filter(|s| *s <= room),
        GrowthPolicy::Proportional { divisor } => {
            let proportional = target / divisor.max(1) / g * g;
            let floor = (proportional / 2).max(g);
            let (lo, hi) = (need.max(floor), fit.max(need));
            let want = need.max(proportional).clamp(lo, hi.max(lo));
            let range = |a: usize, b: usize, up: bool| {
                (a < b)
                    .then(|| {
                        let mut r = offer.range((place, a)..(place, b));
                        if up {
                            r.next()
                        } else {
                            r.next_back()
                        }
                    })
                    .flatten()
                    .map(|(k, _)| k.1)
            };
            range(want, hi.saturating_add(1), true)
                .or_else(|| range(lo, want, false))
                .or_else(|| range(floor, need, false))
        }
    }
}

fn push(
    plan: &mut Vec<Planned>,
    offset: usize,
    bytes: usize,
    placement: Location,
    pooled: bool,
) -> Result<()> {
    if plan.len() >= MAX_PLANNED_CHUNKS {
        return Err(Error::invalid(format!(
            "a growth of more than {MAX_PLANNED_CHUNKS} mappings"
        )));
    }
    plan.push(Planned {
        offset,
        bytes,
        placement,
        pooled,
    });
    Ok(())
}

/// The bytes a reservation of `max_bytes` takes at granularity `g`, for
/// allocations aligned to `alignment`; refused (`InvalidArgument`, in
/// words) with no bytes, an alignment that is not a power of two up to
/// `g`, or a size that overflows. The one check of an arena's and a
/// buffer's description.
pub(crate) fn reservation(max_bytes: usize, alignment: usize, g: usize) -> Result<usize> {
    if max_bytes == 0 {
        return Err(Error::invalid("max_bytes is 0"));
    }
    if !alignment.is_power_of_two() || alignment > g {
        return Err(Error::invalid(format!(
            "alignment {alignment} is not a power of two up to the granularity {g}"
        )));
    }
    round_up(max_bytes, g).ok_or_else(|| Error::invalid(format!("max_bytes {max_bytes} overflows")))
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn round_up(x: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

#[cfg(test)]
mod tests;
