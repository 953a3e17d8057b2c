//! cudarc interop on the GPU: views through cudarc's copies and kernel
//! launches, and the non-owning CudaSlice wrapper.

use cudarc::driver::PushKernelArg;
use vmmbuf::{Backend, BufferDesc, Error, GrowableBuffer};

use crate::common::{gpu, random_bytes};
use crate::cuda_only::{pattern, Kernels};

crate::register! {
    gpu: [views_round_trip_through_cudarc_copies, a_kernel_writes_through_a_view_and_reads_through_a_cuda_slice],
}

fn views_round_trip_through_cudarc_copies() {
    let backend = gpu();
    let stream = backend.context().new_stream().unwrap();
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(1 << 30)).unwrap();
    buf.grow_to(9 << 20).unwrap();
    let background = random_bytes(1, 9 << 20);
    buf.write(0, &background).unwrap();
    let mut model = background.clone();
    for (i, (offset, words)) in [
        (0usize, 1usize),
        (4, 1000),
        (4096, 1 << 18),
        ((2 << 20) - 8, 4),
        (7 << 20, 123_457),
    ]
    .into_iter()
    .enumerate()
    {
        let data: Vec<u32> = random_bytes(100 + i as u64, words * 4)
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        {
            let mut v = buf.view_mut::<u32>(&stream, offset, words).unwrap();
            stream.memcpy_htod(&data, &mut v).unwrap();
        }
        let v = buf.view::<u32>(&stream, offset, words).unwrap();
        assert_eq!(
            stream.clone_dtoh(&v).unwrap(),
            data,
            "round trip at {offset}+{words}"
        );
        model[offset..offset + words * 4].copy_from_slice(bytemuck_bytes(&data));
    }
    // dtod from one view into another, then everything through the backend's own read.
    {
        let mut tmp = stream.alloc_zeros::<u8>(4096).unwrap();
        stream
            .memcpy_dtod(&buf.view::<u8>(&stream, 100, 4096).unwrap(), &mut tmp)
            .unwrap();
        let mut dst = buf.view_mut::<u8>(&stream, (8 << 20) + 1, 4096).unwrap();
        stream.memcpy_dtod(&tmp, &mut dst).unwrap();
        let src = model[100..100 + 4096].to_vec();
        model[(8 << 20) + 1..(8 << 20) + 1 + 4096].copy_from_slice(&src);
    }
    stream.synchronize().unwrap();
    let mut back = vec![0u8; 9 << 20];
    buf.read(0, &mut back).unwrap();
    assert!(back == model, "bytes outside the views were disturbed");
    // Bad views are typed errors.
    assert!(
        matches!(
            buf.view::<u32>(&stream, 2, 1),
            Err(Error::InvalidArgument(_))
        ),
        "misaligned"
    );
    assert!(
        matches!(
            buf.view::<u32>(&stream, 9 << 20, 1),
            Err(Error::InvalidArgument(_))
        ),
        "past len"
    );
    assert!(
        matches!(
            buf.view::<u64>(&stream, 0, usize::MAX),
            Err(Error::InvalidArgument(_))
        ),
        "overflow"
    );
}

fn bytemuck_bytes(v: &[u32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn a_kernel_writes_through_a_view_and_reads_through_a_cuda_slice() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let stream = k.stream.clone();
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(1 << 30)).unwrap();
    let words = 3_000_001u64;
    buf.grow_to(words as usize * 4 + 64).unwrap();
    {
        let mut v = buf.view_mut::<u32>(&stream, 64, words as usize).unwrap();
        let mut l = stream.launch_builder(&k.fill);
        l.arg(&mut v).arg(&0u64).arg(&words).arg(&5u32);
        // SAFETY: test code; fill writes `words` u32s at the view.
        unsafe { l.launch(Kernels::cfg(words)) }.unwrap();
    }
    let mut host = vec![0u8; words as usize * 4];
    buf.read(64, &mut host).unwrap();
    for (i, w) in host.chunks_exact(4).enumerate().step_by(997) {
        assert_eq!(
            u32::from_le_bytes(w.try_into().unwrap()),
            pattern(i as u64, 5),
            "word {i}"
        );
    }

    // The CudaSlice wrapper, used by cudarc APIs that take &CudaSlice.
    let live = backend.live();
    {
        let slice = buf.cuda_slice::<u32>(&stream, 64, words as usize).unwrap();
        let copy = stream.clone_dtoh(&*slice).unwrap();
        assert!(copy
            .iter()
            .enumerate()
            .all(|(i, &w)| w == pattern(i as u64, 5)));
        let mut bad = stream.alloc_zeros::<u32>(1).unwrap();
        let mut l = stream.launch_builder(&k.spin_check);
        l.arg(&*slice)
            .arg(&0u64)
            .arg(&words)
            .arg(&5u32)
            .arg(&mut bad)
            .arg(&0u64);
        // SAFETY: test code; check reads `words` u32s from the slice.
        unsafe { l.launch(Kernels::cfg(words)) }.unwrap();
        assert_eq!(stream.clone_dtoh(&bad).unwrap()[0], 0);
        let mut other = stream.alloc_zeros::<u32>(words as usize).unwrap();
        stream.memcpy_dtod(&*slice, &mut other).unwrap();
        assert_eq!(stream.clone_dtoh(&other).unwrap(), copy);
    }
    {
        // Outputs go through a mutable view: cudarc writes through it.
        let mut s = buf.view_mut::<u32>(&stream, 64, 4).unwrap();
        stream.memcpy_htod(&[1u32, 2, 3, 4], &mut s).unwrap();
    }
    stream.synchronize().unwrap();
    // The wrappers are gone; the buffer and its memory are not.
    assert_eq!(backend.live(), live, "the wrapper freed nothing");
    let mut head = [0u8; 16];
    buf.read(64, &mut head).unwrap();
    assert_eq!(head, *bytemuck::cast_slice::<u32, u8>(&[1, 2, 3, 4]));
    assert_eq!(
        k.mismatches(buf.base() + 64 + 16, 4, words - 4, 5),
        0,
        "the rest intact"
    );
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
}
