//! Fuzzing the public API's arguments: arbitrary sizes, offsets, ranges,
//! devices and access values to every entry point of a buffer. None may
//! panic; every failure is a typed error that leaves the buffer as it was.

use std::sync::Arc;

use proptest::prelude::*;

use crate::common::{assert_consistent, contents};
use vmmbuf::migration::MigrationPolicy;
use vmmbuf::{Access, Backend, BufferDesc, Error, GrowableBuffer, GrowthPolicy, Location};

crate::register! {
    host: [host_api_survives_arbitrary_arguments],
    gpu: [cuda_api_survives_arbitrary_arguments],
}

#[derive(Clone, Debug)]
enum Call {
    GrowTo(usize),
    GrowBy(usize),
    Claim(usize),
    Truncate(usize),
    ShrinkTo(usize),
    Resize(usize),
    ShrinkToFit,
    Reclaim,
    Read(usize, usize),
    Write(usize, usize),
    Migrate(usize, usize, Location),
    SetAccess(usize, usize, Location, Access),
    ApplyPolicy(usize, usize, MigrationPolicy),
    MakeWritable(usize, usize),
    AddPeer(u32),
}

/// Sizes that hit the edges: zero, small, around the granularity and the
/// reservation, and near `usize::MAX`.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        1usize..5000,
        (1usize..40).prop_map(|k| k * (64 << 10) + 1),
        (1usize..40).prop_map(|k| k * (2 << 20) - 1),
        Just(usize::MAX),
        Just(usize::MAX / 2),
        any::<usize>(),
    ]
}

fn location() -> impl Strategy<Value = Location> {
    prop_oneof![
        Just(Location::Host),
        (0u32..3).prop_map(Location::Device),
        any::<u32>().prop_map(Location::Device)
    ]
}

fn access() -> impl Strategy<Value = Access> {
    prop_oneof![
        Just(Access::None),
        Just(Access::Read),
        Just(Access::ReadWrite)
    ]
}

fn policy() -> impl Strategy<Value = MigrationPolicy> {
    prop_oneof![
        Just(MigrationPolicy::Default),
        Just(MigrationPolicy::PreferHost),
        Just(MigrationPolicy::ReadMostly),
        any::<u32>().prop_map(MigrationPolicy::PreferDevice),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        size().prop_map(Call::GrowTo),
        size().prop_map(Call::GrowBy),
        size().prop_map(Call::Claim),
        size().prop_map(Call::Truncate),
        size().prop_map(Call::ShrinkTo),
        size().prop_map(Call::Resize),
        Just(Call::ShrinkToFit),
        Just(Call::Reclaim),
        (size(), 0usize..70_000).prop_map(|(a, n)| Call::Read(a, n)),
        (size(), 0usize..70_000).prop_map(|(a, n)| Call::Write(a, n)),
        (size(), size(), location()).prop_map(|(a, b, l)| Call::Migrate(a, b, l)),
        (size(), size(), location(), access()).prop_map(|(a, b, l, x)| Call::SetAccess(a, b, l, x)),
        (size(), size(), policy()).prop_map(|(a, b, p)| Call::ApplyPolicy(a, b, p)),
        (size(), size()).prop_map(|(a, b)| Call::MakeWritable(a, b)),
        any::<u32>().prop_map(Call::AddPeer),
    ]
}

fn typed(e: &Error) -> bool {
    // Driver errors are typed too, but arguments alone must never reach the
    // driver as a failure: they are checked first.
    !matches!(e, Error::Driver { .. } | Error::Os { .. })
}

fn run<B: Backend>(backend: Arc<B>, calls: &[Call]) {
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(32 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    let baseline = {
        let mut b = backend.live();
        b.reservations -= 1;
        b.reserved_bytes -= buf.reserved();
        b
    };
    let base = buf.base();
    for c in calls {
        let before = (buf.len(), buf.capacity(), buf.chunk_count());
        let snapshot = contents(&buf);
        let r: vmmbuf::Result<()> = match *c {
            Call::GrowTo(n) => buf.grow_to(n),
            Call::GrowBy(n) => buf.grow_by(n).map(drop),
            Call::Claim(n) => buf.claim(n).map(drop),
            Call::Truncate(n) => {
                buf.truncate(n);
                Ok(())
            }
            Call::ShrinkTo(n) => buf.shrink_to(n),
            Call::Resize(n) => buf.resize(n),
            Call::ShrinkToFit => buf.shrink_to_fit(),
            Call::Reclaim => buf.reclaim(),
            Call::Read(a, n) => buf.read(a, &mut vec![0u8; n]),
            Call::Write(a, n) => buf.write(a, &vec![0x5a; n]),
            Call::Migrate(a, b, l) => buf.migrate(a..b, l).map(drop),
            Call::SetAccess(a, b, l, x) => buf.set_access(a..b, l, x),
            Call::ApplyPolicy(a, b, p) => buf.apply_migration_policy(a..b, p).map(drop),
            Call::MakeWritable(a, b) => buf.make_writable(a..b),
            Call::AddPeer(d) => buf.add_peer(d),
        };
        assert_eq!(buf.base(), base);
        // Restore full access so bytes can be compared and the next call
        // starts from a usable buffer.
        if buf.capacity() > 0 {
            buf.make_writable(0..buf.capacity()).unwrap();
        }
        if let Err(e) = &r {
            assert!(typed(e), "{c:?} failed untyped: {e}");
            assert_eq!(
                before,
                (buf.len(), buf.capacity(), buf.chunk_count()),
                "{c:?} failed but changed the buffer"
            );
            assert!(contents(&buf) == snapshot, "{c:?} failed but changed bytes");
        }
        assert_consistent(&buf, baseline);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    fn host_api_survives_arbitrary_arguments(calls in prop::collection::vec(call(), 1..30)) {
        run(crate::common::host(), &calls);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    fn cuda_api_survives_arbitrary_arguments(calls in prop::collection::vec(call(), 1..30)) {
        { let b = crate::common::gpu();
            run(b, &calls);
        }
    }
}
