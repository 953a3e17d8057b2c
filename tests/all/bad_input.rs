//! Bad inputs: each a typed error, none a panic, the buffer unchanged.

use std::sync::Arc;

use crate::common::{contents, random_bytes};
use vmmbuf::{
    Backend, BufferDesc, CudaBackend, Error, GrowableBuffer, GrowthPolicy, HostBackend, Location,
};

crate::register! {
    generic: [every_bad_argument_is_a_typed_error],
    host: [bad_backend_arguments_are_typed_errors, a_missing_device_or_driver_is_a_typed_error],
}

fn every_bad_argument_is_a_typed_error<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let new = |desc: BufferDesc| GrowableBuffer::new(backend.clone(), desc).map(|_| ());
    let invalid = |r: vmmbuf::Result<()>, what: &str| {
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{what}: {r:?}");
    };
    invalid(new(BufferDesc::new(0)), "zero max_bytes");
    invalid(new(BufferDesc::new(usize::MAX)), "overflowing max_bytes");
    invalid(
        new(BufferDesc::new(g).growth(GrowthPolicy::Fixed { chunk_bytes: 0 })),
        "zero chunk size",
    );
    invalid(
        new(BufferDesc::new(g).growth(GrowthPolicy::Fixed {
            chunk_bytes: usize::MAX,
        })),
        "overflowing chunk",
    );
    invalid(
        new(BufferDesc::new(g).growth(GrowthPolicy::Proportional { divisor: 0 })),
        "zero divisor",
    );
    let r = new(BufferDesc::new(g).placement(Location::Device(4242)));
    assert!(
        matches!(
            r,
            Err(Error::InvalidDevice { device: 4242, .. }) | Err(Error::Unsupported { .. })
        ),
        "a device that does not exist: {r:?}"
    );
    // Far more address space than any machine has: a typed error, not a panic.
    let r = new(BufferDesc::new(1 << 62));
    assert!(
        matches!(r, Err(Error::ReservationExhausted { .. })),
        "2^62 bytes: {r:?}"
    );

    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(8 * g)).unwrap();
    buf.grow_to(g + 1).unwrap();
    let data = random_bytes(5, g + 1);
    buf.write(0, &data).unwrap();
    let before = (buf.len(), buf.capacity(), buf.chunk_count(), backend.live());

    assert!(matches!(
        buf.grow_to(8 * g + 1),
        Err(Error::ReservationExhausted { .. })
    ));
    assert!(matches!(
        buf.grow_by(usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
    // As in Vec: truncating past the length and shrinking to a capacity
    // above the current one change nothing.
    buf.truncate(g + 2);
    buf.shrink_to(usize::MAX).unwrap();
    assert_eq!((buf.len(), buf.capacity()), (g + 1, before.1));
    let mut out = [0u8; 2];
    invalid(buf.read(g, &mut out), "read past len");
    invalid(buf.read(usize::MAX, &mut out), "read offset overflowing");
    invalid(buf.write(g, &[1, 2]), "write past len");
    invalid(
        buf.write(usize::MAX - 1, &[1, 2, 3]),
        "write offset overflowing",
    );

    assert_eq!(
        before,
        (buf.len(), buf.capacity(), buf.chunk_count(), backend.live())
    );
    assert!(contents(&buf) == data, "bad calls changed the data");
    // Empty reads and writes at the end are fine.
    buf.read(g + 1, &mut []).unwrap();
    buf.write(g + 1, &[]).unwrap();
}

fn bad_backend_arguments_are_typed_errors() {
    assert!(matches!(
        HostBackend::with_granularity(3),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        HostBackend::with_granularity(1024),
        Err(Error::InvalidArgument(_))
    ));
    let host = HostBackend::new();
    assert!(matches!(
        host.granularity(Location::Device(0)),
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        host.create(4096, Location::Device(0)),
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        host.create(0, Location::Host),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        host.reserve(100, 4096),
        Err(Error::InvalidArgument(_))
    ));
    // Token checks: mapping outside, twice, or unmapping part of a mapping.
    let g = host.granularity(Location::Host).unwrap();
    let mut res = host.reserve(4 * g, g).unwrap();
    let c = host.create(2 * g, Location::Host).unwrap();
    assert!(matches!(
        host.map(&mut res, 3 * g, &c),
        Err(Error::InvalidArgument(_))
    ));
    host.map(&mut res, 0, &c).unwrap();
    assert!(matches!(
        host.map(&mut res, g, &c),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        host.unmap(&mut res, 0, g),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        matches!(
            host.read(&res, 0, &mut [0u8; 4]),
            Err(Error::InvalidArgument(_))
        ),
        "no access yet"
    );
    assert!(matches!(host.free(host.reserve(g, g).unwrap()), Ok(())));
    assert!(
        matches!(host.free(res), Err(Error::InvalidArgument(_))),
        "free while mapped"
    );
    host.release(c).unwrap();
    assert_eq!(
        host.live(),
        vmmbuf::stats::LiveCounts::default(),
        "the dropped token cleaned up"
    );
}

fn a_missing_device_or_driver_is_a_typed_error() {
    match CudaBackend::check_driver() {
        Err(e) => {
            assert!(matches!(e, Error::DriverUnavailable { .. }));
            let r = CudaBackend::new(0);
            assert!(matches!(r, Err(Error::DriverUnavailable { .. })), "{r:?}");
            let nccl = vmmbuf::cuda::CudaBackendDesc::nccl_ready();
            let r = CudaBackend::with_desc(0, &nccl);
            assert!(matches!(r, Err(Error::DriverUnavailable { .. })), "{r:?}");
            eprintln!(
                "no CUDA driver here: CudaBackend::new answered {}",
                r.unwrap_err()
            );
        }
        Ok(()) => {
            let r = CudaBackend::new(4242);
            assert!(
                matches!(r, Err(Error::InvalidDevice { device: 4242, .. })),
                "{r:?}"
            );
            let nccl = vmmbuf::cuda::CudaBackendDesc::nccl_ready();
            let r = CudaBackend::with_desc(4242, &nccl);
            assert!(
                matches!(r, Err(Error::InvalidDevice { device: 4242, .. })),
                "{r:?}"
            );
        }
    }
}
