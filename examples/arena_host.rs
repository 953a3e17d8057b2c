//! The arena in host memory: an allocator for tensors that runs on any
//! Linux machine, the same code a GPU runs (`CudaArena` with cudarc's
//! streams there). Sequences of a toy server start and finish at random;
//! each holds KV-cache pages (allocations) that it fills as it goes; a
//! finished sequence's pages are checked and freed, on its own stream. At
//! the end every byte is checked, the cached memory goes back, and the
//! arena's counters are printed.
//!
//!     cargo run --example arena_host

#[cfg(target_os = "linux")]
fn main() -> Result<(), vmmbuf::Error> {
    use rand::{Rng, SeedableRng};
    use vmmbuf::host::{HostAllocation, HostArena, HostStream};
    use vmmbuf::{ArenaDesc, HostBackend};

    const PAGE: usize = 64 << 10;

    struct Sequence {
        id: u64,
        stream: HostStream,
        pages: Vec<HostAllocation>,
        tokens: usize,
    }

    // One page's bytes for (sequence, page): what a check expects back.
    fn fill(id: u64, page: usize) -> Vec<u8> {
        (0..PAGE)
            .map(|i| (id as usize * 31 + page * 7 + i) as u8)
            .collect()
    }

    let arena = HostArena::new(HostBackend::new(), ArenaDesc::new(4 << 30))?;
    println!(
        "arena: 4 GiB of address space reserved at {:#x}, nothing mapped",
        arena.base()
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut live: Vec<Sequence> = Vec::new();
    let (mut started, mut finished, mut checked) = (0u64, 0u64, 0usize);
    for step in 0..2000 {
        if live.len() < 32 && rng.gen_bool(0.3) {
            started += 1;
            live.push(Sequence {
                id: started,
                stream: HostStream(started % 4), // four streams, as four CUDA streams
                pages: Vec::new(),
                tokens: 0,
            });
        }
        for s in &mut live {
            s.tokens += 1;
            if s.tokens % 16 == 1 {
                let mut page = arena.alloc(PAGE, &s.stream)?;
                page.write(0, &fill(s.id, s.pages.len()))?;
                s.pages.push(page);
            }
        }
        if !live.is_empty() && rng.gen_bool(0.15) {
            let s = live.swap_remove(rng.gen_range(0..live.len()));
            let mut back = vec![0u8; PAGE];
            for (i, p) in s.pages.iter().enumerate() {
                p.read(0, &mut back)?;
                assert_eq!(back, fill(s.id, i), "sequence {} page {i} changed", s.id);
                checked += PAGE;
            }
            finished += 1;
            drop(s); // its pages are freed on its stream
        }
        if step % 500 == 499 {
            let st = arena.stats();
            println!(
                "step {:>4}: {:>2} sequences live, {:>7} KiB allocated, {:>7} KiB mapped",
                step + 1,
                live.len(),
                st.allocated_bytes.current >> 10,
                st.reserved_bytes.current >> 10
            );
        }
    }
    drop(live);
    arena.empty_cache()?;
    let st = arena.stats();
    assert_eq!(st.allocated_bytes.current, 0);
    assert_eq!(st.reserved_bytes.current, 0, "every chunk went back");
    println!(
        "{started} sequences started, {finished} finished and checked ({} MiB read back); \
         peak {} MiB mapped for {} MiB allocated; all of it back now",
        checked >> 20,
        st.reserved_bytes.peak >> 20,
        st.allocated_bytes.peak >> 20
    );
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn main() {
    println!("the host backend is Linux's: this example runs there (CudaArena runs on any GPU)");
}
