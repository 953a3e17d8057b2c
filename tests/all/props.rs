//! Property test: random grow / truncate / shrink / trim / write / read
//! sequences against a plain `Vec<u8>` model.

use std::sync::Arc;

use proptest::prelude::*;

use crate::common::{assert_consistent, contents, random_bytes};
use vmmbuf::{Backend, BufferDesc, GrowableBuffer, GrowthPolicy};

crate::register! {
    host: [host_matches_a_vec_model],
    gpu: [cuda_matches_a_vec_model],
}

#[derive(Clone, Debug)]
enum Op {
    Grow(usize),
    Truncate(f64),
    ShrinkTo(f64),
    Trim,
    Write { at: f64, len: usize, seed: u64 },
    Read { at: f64, len: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..400_000).prop_map(Op::Grow),
        1 => (0.0..1.0f64).prop_map(Op::Truncate),
        1 => (0.0..1.0f64).prop_map(Op::ShrinkTo),
        1 => Just(Op::Trim),
        3 => (0.0..1.0f64, 1usize..100_000, any::<u64>()).prop_map(|(at, len, seed)| Op::Write { at, len, seed }),
        1 => (0.0..1.0f64, 1usize..100_000).prop_map(|(at, len)| Op::Read { at, len }),
    ]
}

fn policy() -> impl Strategy<Value = GrowthPolicy> {
    prop_oneof![
        Just(GrowthPolicy::default()),
        Just(GrowthPolicy::Exact),
        (1usize..4).prop_map(|d| GrowthPolicy::Proportional { divisor: d * 4 }),
        (1usize..300_000).prop_map(|c| GrowthPolicy::Fixed { chunk_bytes: c }),
    ]
}

/// Runs one sequence; panics (failing the property) on any divergence.
fn run<B: Backend>(backend: Arc<B>, policy: GrowthPolicy, ops: &[Op]) {
    let baseline = backend.live();
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf =
        GrowableBuffer::new(backend.clone(), BufferDesc::new(4096 * g).growth(policy)).unwrap();
    let base = buf.base();
    let mut model: Vec<u8> = Vec::new();
    for op in ops {
        let grows = buf.stats().grows;
        match *op {
            Op::Grow(n) => {
                buf.grow_to(model.len() + n).unwrap();
                model.resize(model.len() + n, 0);
                // New bytes are not zeroed by contract: adopt them, then
                // overwrite with known data so later checks see real values.
                let fresh = random_bytes(n as u64, n);
                let at = model.len() - n;
                buf.write(at, &fresh).unwrap();
                model[at..].copy_from_slice(&fresh);
            }
            Op::Truncate(f) => {
                let to = (model.len() as f64 * f) as usize;
                buf.truncate(to);
                model.truncate(to);
            }
            Op::ShrinkTo(f) => {
                let to = (model.len() as f64 * f) as usize;
                buf.truncate(to);
                buf.shrink_to_fit().unwrap();
                model.truncate(to);
            }
            Op::Trim => buf.shrink_to_fit().unwrap(),
            Op::Write { at, len, seed } => {
                if model.is_empty() {
                    continue;
                }
                let at = (model.len() as f64 * at) as usize;
                let len = len.min(model.len() - at);
                let data = random_bytes(seed, len);
                buf.write(at, &data).unwrap();
                model[at..at + len].copy_from_slice(&data);
            }
            Op::Read { at, len } => {
                let at = (model.len() as f64 * at) as usize;
                let len = len.min(model.len() - at);
                let mut got = vec![0u8; len];
                buf.read(at, &mut got).unwrap();
                assert!(got[..] == model[at..at + len], "read at {at}+{len}");
            }
        }
        assert_eq!(buf.base(), base, "the base moved");
        assert_eq!(buf.len(), model.len());
        assert!(buf.capacity() >= buf.len());
        if buf.stats().grows > grows {
            let bound = crate::common::overcommit_bound(buf.growth_policy(), g, buf.len());
            assert!(
                buf.capacity() - buf.len() < bound,
                "over-commit past the policy's bound after {op:?}"
            );
        }
        if matches!(op, Op::Trim | Op::ShrinkTo(_)) {
            let r = buf.report();
            assert!(
                r.chunks.iter().all(|c| c.offset < buf.len()),
                "a chunk wholly past len survived a trim\n{r}"
            );
        }
        assert_consistent(&buf, baseline);
        assert!(contents(&buf) == model, "contents diverged after {op:?}");
    }
    drop(buf);
    assert_eq!(backend.live(), baseline, "leaked after drop");
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    fn host_matches_a_vec_model(policy in policy(), ops in prop::collection::vec(op(), 1..40)) {
        run(crate::common::host(), policy, &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases().min(24), ..ProptestConfig::default() })]

    fn cuda_matches_a_vec_model(policy in policy(), ops in prop::collection::vec(op(), 1..40)) {
        { let b = crate::common::gpu();
            run(b, policy, &ops);
        }
    }
}
