//! A fast hasher for the maps an allocator consults at every call, keyed by
//! addresses, offsets, stream handles or short names.
//!
//! The standard library's SipHash resists keys chosen by an attacker and
//! costs several times a multiply per word. These keys come from the driver
//! and the caller, so [`QuickHasher`] does FxHash's step (rotate, mix the
//! word in, multiply by an odd constant) and rotates the well-mixed high
//! bits down at the end, because tables pick buckets by the low bits and an
//! address aligned to 512 bytes leaves the product's low 9 bits at zero
//! (rustc-hash 2 does the same).
#![deny(unsafe_code)]

use std::collections::HashMap;

/// One multiply per word; see the [module](self).
#[derive(Clone, Copy, Debug, Default)]
pub struct QuickHasher(u64);

impl std::hash::Hasher for QuickHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// Builds [`QuickHasher`]s.
pub type QuickBuildHasher = std::hash::BuildHasherDefault<QuickHasher>;

/// A hash map with [`QuickHasher`].
pub type QuickMap<K, V> = HashMap<K, V, QuickBuildHasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn aligned_addresses_spread_over_buckets_and_tags() {
        let b = QuickBuildHasher::default();
        // 4096 keys 512 B, 64 B and 2 MiB apart (allocations, stream
        // handles, chunks): the low 10 bits (a 1024-bucket table's index)
        // and the top 7 (hashbrown's tags) must take many values.
        for step in [512usize, 64, 2 << 20] {
            let mut low = std::collections::HashSet::new();
            let mut top = std::collections::HashSet::new();
            for i in 0..4096usize {
                let h = b.hash_one(0x7f00_0000_0000usize + i * step);
                low.insert(h & 1023);
                top.insert(h >> 57);
            }
            assert!(
                low.len() > 900,
                "step {step}: {} of 1024 buckets",
                low.len()
            );
            assert_eq!(top.len(), 128, "step {step}");
        }
        // Strings hash by all their bytes.
        assert_ne!(b.hash_one("weights"), b.hash_one("weightz"));
        assert_ne!(b.hash_one(""), b.hash_one("a"));
        // Pairs (stream keys) by both words.
        assert_ne!(b.hash_one((1u64, 2u64)), b.hash_one((2u64, 1u64)));
    }
}
