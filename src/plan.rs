//! Growth policies and the pure arithmetic that turns "grow to N bytes" into a
//! list of chunk sizes. No driver calls here: this is tested anywhere.
#![deny(unsafe_code)]

use crate::error::{Error, Result};

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
    pub fn resolve(self, granularity: usize) -> Result<Self> {
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

    /// The sizes of the chunks to map so that `capacity` reaches at least
    /// `target` bytes without passing `limit` (the reservation), in mapping
    /// order. Empty when `target <= capacity`. Where the policy would pass
    /// `limit`, the last chunk is cut to fit.
    ///
    /// `self` must come from [`GrowthPolicy::resolve`] with the same
    /// granularity; `capacity` and `limit` are multiples of it.
    pub fn plan(
        self,
        granularity: usize,
        capacity: usize,
        target: usize,
        limit: usize,
    ) -> Result<Vec<usize>> {
        if target > limit {
            return Err(Error::ReservationExhausted {
                requested_bytes: target,
                reserved_bytes: limit,
            });
        }
        if target <= capacity {
            return Ok(Vec::new());
        }
        let need = round_up(target - capacity, granularity)
            .ok_or_else(|| Error::invalid(format!("growing to {target} bytes overflows")))?;
        let mut plan = match self {
            GrowthPolicy::Exact => vec![granularity; need / granularity],
            GrowthPolicy::Fixed { chunk_bytes } => {
                vec![chunk_bytes; (target - capacity).div_ceil(chunk_bytes)]
            }
            GrowthPolicy::Proportional { divisor } => {
                let proportional = target / divisor / granularity * granularity;
                vec![need.max(proportional)]
            }
        };
        let mut room = limit - capacity;
        plan.retain_mut(|c| {
            *c = (*c).min(room);
            room -= *c;
            *c > 0
        });
        Ok(plan)
    }

    /// The policy's bound on over-commit: right after a growth to `len` bytes
    /// that mapped new chunks, `capacity - len` is strictly below this.
    pub fn overcommit_bound(self, granularity: usize, len: usize) -> usize {
        match self {
            GrowthPolicy::Exact => granularity,
            GrowthPolicy::Fixed { chunk_bytes } => chunk_bytes,
            GrowthPolicy::Proportional { divisor } => granularity.max(len / divisor),
        }
    }
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn round_up(x: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    const G: usize = 2 << 20;

    #[test]
    fn proportional_keeps_mappings_logarithmic_and_overcommit_bounded() {
        let p = GrowthPolicy::default().resolve(G).unwrap();
        let (mut cap, mut chunks) = (0usize, 0usize);
        let mut worst = 0.0f64;
        // A KV cache filling up: 2 MiB at a time to 2 GiB.
        for step in 1..=1024usize {
            let target = step * G;
            let plan = p.plan(G, cap, target, usize::MAX / 2).unwrap();
            assert!(plan.len() <= 1);
            if let Some(&c) = plan.first() {
                assert_eq!(c % G, 0);
                cap += c;
                chunks += 1;
                assert!(cap - target < p.overcommit_bound(G, target));
            }
            assert!(cap >= target);
            worst = worst.max((cap - target) as f64 / target as f64);
        }
        assert!(chunks < 64, "{chunks} mappings for 1024 steps");
        assert!(
            worst <= 0.125 || cap - 1024 * G < G,
            "worst over-commit {worst}"
        );
    }

    #[test]
    fn exact_maps_granules_and_fixed_maps_fixed() {
        let e = GrowthPolicy::Exact.resolve(G).unwrap();
        assert_eq!(e.plan(G, 0, 3 * G + 1, 8 * G).unwrap(), vec![G; 4]);
        assert_eq!(e.plan(G, 4 * G, 3 * G, 8 * G).unwrap(), Vec::<usize>::new());
        let f = GrowthPolicy::Fixed {
            chunk_bytes: 3 * G - 5,
        }
        .resolve(G)
        .unwrap();
        assert_eq!(f, GrowthPolicy::Fixed { chunk_bytes: 3 * G });
        assert_eq!(f.plan(G, 3 * G, 7 * G, 16 * G).unwrap(), vec![3 * G; 2]);
    }

    #[test]
    fn bad_parameters_are_errors() {
        for bad in [
            GrowthPolicy::Proportional { divisor: 0 },
            GrowthPolicy::Fixed { chunk_bytes: 0 },
            GrowthPolicy::Fixed {
                chunk_bytes: usize::MAX,
            },
        ] {
            assert!(matches!(bad.resolve(G), Err(Error::InvalidArgument(_))));
        }
        assert!(GrowthPolicy::Exact.resolve(3).is_err());
        assert!(matches!(
            GrowthPolicy::Exact.plan(G, 0, 9 * G, 8 * G),
            Err(Error::ReservationExhausted { requested_bytes, reserved_bytes })
                if requested_bytes == 9 * G && reserved_bytes == 8 * G
        ));
    }

    #[test]
    fn plans_are_cut_to_the_reservation() {
        let p = GrowthPolicy::default().resolve(G).unwrap();
        // 64 GiB wants an 8 GiB chunk; only 1 GiB of room is left.
        let cap = 64 << 30;
        assert_eq!(
            p.plan(G, cap, cap + 1, cap + (1 << 30)).unwrap(),
            vec![1 << 30]
        );
        let f = GrowthPolicy::Fixed { chunk_bytes: 4 * G }
            .resolve(G)
            .unwrap();
        assert_eq!(f.plan(G, 0, 5 * G, 6 * G).unwrap(), vec![4 * G, 2 * G]);
    }
}
