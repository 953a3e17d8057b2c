//! Where chunks come from: a pool, or the driver itself, and creating many
//! at once on several threads.

use super::*;

/// Where a user of chunks gets them and gives them back: the one supply
/// chain of buffers, arenas and the mover. Two sources: a [`ChunkPool`]
/// (pooled chunks first, unmapped ones kept), and [`Driver`] (created and
/// released). Budgets are counted where chunks are mapped and unmapped
/// ([`Budget`]), so that a migration, which holds a chunk's old and new
/// memory for a moment, is not refused by them.
pub(crate) trait ChunkSource<B: Backend>: Send + Sync {
    /// A chunk of `bytes` at `placement`, exportable if `shareable`.
    fn take(&self, shareable: bool, placement: Location, bytes: usize) -> Result<B::Chunk>;
    /// One chunk per `(placement, bytes)` of `wants`, in order, exportable
    /// if `shareable`. All or nothing: on an error the chunks already taken
    /// are given back. Chunks to create in host memory are created on
    /// several threads ([`create_threads`]): pinning pages is the cost.
    fn take_many(&self, shareable: bool, wants: &[(Location, usize)]) -> Result<Vec<B::Chunk>>;
    /// An unmapped chunk back, for reuse where the source keeps any. An
    /// error (the driver's, releasing it) is logged and returned; the chunk
    /// is gone either way.
    fn give(&self, placement: Location, bytes: usize, chunk: B::Chunk) -> Result<()>;
    /// An unmapped chunk straight back to the driver: one another process
    /// may still map, or that must never be reused here. Errors as `give`.
    fn release(&self, chunk: B::Chunk) -> Result<()>;
}

impl<B: Backend> ChunkSource<B> for ChunkPool<B> {
    fn take(&self, shareable: bool, placement: Location, bytes: usize) -> Result<B::Chunk> {
        self.take_or_create(shareable, placement, bytes)
    }
    fn take_many(&self, shareable: bool, wants: &[(Location, usize)]) -> Result<Vec<B::Chunk>> {
        let pooled: Vec<Option<B::Chunk>> = wants
            .iter()
            .map(|&(p, b)| self.take_exact(shareable, p, b))
            .collect();
        fill_by_creating(&*self.backend, shareable, wants, pooled, |p, b, c| {
            self.put(p, b, c)
        })
    }
    fn give(&self, placement: Location, bytes: usize, chunk: B::Chunk) -> Result<()> {
        self.put(placement, bytes, chunk);
        Ok(())
    }
    fn release(&self, chunk: B::Chunk) -> Result<()> {
        Driver(&*self.backend).release(chunk)
    }
}

/// The driver as a source: chunks are created, and given back to it.
pub(crate) struct Driver<'a, B>(pub(crate) &'a B);

impl<B: Backend> ChunkSource<B> for Driver<'_, B> {
    fn take(&self, shareable: bool, placement: Location, bytes: usize) -> Result<B::Chunk> {
        crate::backend::create_chunk(self.0, shareable, bytes, placement)
    }
    fn take_many(&self, shareable: bool, wants: &[(Location, usize)]) -> Result<Vec<B::Chunk>> {
        let none = wants.iter().map(|_| None).collect();
        fill_by_creating(self.0, shareable, wants, none, |_, _, c| {
            let _ = self.release(c);
        })
    }
    fn give(&self, _placement: Location, _bytes: usize, chunk: B::Chunk) -> Result<()> {
        self.release(chunk)
    }
    fn release(&self, chunk: B::Chunk) -> Result<()> {
        self.0.release(chunk).inspect_err(|e| {
            tracing::error!(error = %e, "vmmbuf: releasing a chunk failed");
        })
    }
}

/// How many threads create host-memory chunks at once: `VMMBUF_CREATE_THREADS`
/// (1 to 64), else 4. Creating a host chunk pins its pages, which costs
/// ~300-400 ms per GiB on one thread (H100); see BENCHMARKS.md for how it
/// scales.
pub(crate) fn create_threads() -> usize {
    std::env::var("VMMBUF_CREATE_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(4, |n| n.clamp(1, 64))
}

/// Creates the chunks `have` lacks (one per `wants` entry), host-memory ones
/// on up to [`create_threads`] threads, device ones on this thread (a
/// device chunk costs microseconds). All or nothing: on an error every chunk
/// in hand goes to `give_back`.
pub(super) fn fill_by_creating<B: Backend>(
    backend: &B,
    shareable: bool,
    wants: &[(Location, usize)],
    mut have: Vec<Option<B::Chunk>>,
    give_back: impl Fn(Location, usize, B::Chunk),
) -> Result<Vec<B::Chunk>> {
    let missing: Vec<usize> = (0..wants.len()).filter(|&i| have[i].is_none()).collect();
    let host: Vec<usize> = missing
        .iter()
        .copied()
        .filter(|&i| wants[i].0 == Location::Host)
        .collect();
    let threads = create_threads().min(host.len());
    let mut first_err: Option<Error> = None;
    if threads > 1 {
        let made = create_on_threads(backend, shareable, wants, &host, threads);
        for (i, r) in made {
            match r {
                Ok(c) => have[i] = Some(c),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
    }
    if first_err.is_none() {
        for &i in &missing {
            if have[i].is_some() {
                continue;
            }
            match crate::backend::create_chunk(backend, shareable, wants[i].1, wants[i].0) {
                Ok(c) => have[i] = Some(c),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
    }
    match first_err {
        None => Ok(have
            .into_iter()
            .map(|c| c.expect("every chunk made"))
            .collect()),
        Some(e) => {
            for (i, c) in have.into_iter().enumerate() {
                if let Some(c) = c {
                    give_back(wants[i].0, wants[i].1, c);
                }
            }
            Err(e)
        }
    }
}

/// Creates the chunks `wants[i]` for every `i` in `todo` on `threads`
/// threads, each taking the next index until all are made or one fails
/// (the others then stop). Every chunk made comes back with its index.
fn create_on_threads<B: Backend>(
    backend: &B,
    shareable: bool,
    wants: &[(Location, usize)],
    todo: &[usize],
    threads: usize,
) -> Vec<(usize, Result<B::Chunk>)> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Relaxed);
                        if k >= todo.len() || failed.load(Relaxed) {
                            break;
                        }
                        let i = todo[k];
                        let r = crate::backend::create_chunk(
                            backend, shareable, wants[i].1, wants[i].0,
                        );
                        if r.is_err() {
                            failed.store(true, Relaxed);
                        }
                        out.push((i, r));
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    })
}
