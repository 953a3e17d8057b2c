//! Allocation, free (in every capture state) and `record_stream`.

use super::*;

/// Allocates `size` bytes on `device` for work on `stream`, under this
/// thread's tag; the address.
pub(crate) fn malloc(size: usize, dev: c_int, stream: *mut c_void) -> Result<u64> {
    let _t = Timed::start(&MALLOC_NS);
    if size == 0 {
        return Err(Error::InvalidArgument("an allocation of 0 bytes".into()));
    }
    // A capture in CUDA's global mode (PyTorch's default) forbids every
    // thread's unsafe calls: vmmbuf makes each of its own (an event query,
    // a mapping) in relaxed mode, so the common path switches no mode.
    let dref = device(dev)?;
    let mut d = dref.lock();
    d.release_graphs();
    let tag = tag();
    let s = d.stream(stream);
    // PyTorch's graph trees restore a pool's checkpoint: a block graphs
    // hold lives again (see `pools`).
    if let Some((at, pool)) = pools::take_retake() {
        let a = d.retake(at, size, &s)?;
        return Ok(d.note_live(a, size, Some(pool)));
    }
    // Captured into a CUDA graph: the memory is the graph's until CUDA
    // destroys it (the graph replays the captured work at these addresses).
    let graph = match capture(&s)? {
        Some(c) => Some(d.graph_pool(&c)?),
        None => None,
    };
    let alloc = |a: &TorchArena| match graph {
        Some(g) => a.alloc_in_graph(size, &s, g),
        None => a.alloc(size, &s),
    };
    let a = match alloc(d.arena(&tag)?) {
        // At the device's budget, shared by every tag: the other tags'
        // cached memory goes back too, then one more try (an arena gives
        // back only its own before failing).
        Err(e) if e.is_transient() && d.arenas.len() > 1 => {
            d = make_room_in_every_tag(dref, d, graph.is_some());
            alloc(d.arena(&tag)?)?
        }
        r => r?,
    };
    let pool = d.pool_for(dev, graph);
    Ok(d.note_live(a, size, pool))
}

/// At the device's budget: every tag's cached memory goes back, after a
/// device synchronisation (as PyTorch's out-of-memory path synchronises:
/// frees still pending go too, and those that owe their fence, deferred by
/// default, which a tag no call uses again would otherwise keep for ever),
/// without the device's lock, which other threads' calls need meanwhile.
/// Under a capture (`in_graph`, or one announced under way) nothing
/// synchronises: only what has passed goes back. The device's lock again.
fn make_room_in_every_tag(
    dref: &'static Mutex<Device>,
    d: parking_lot::MutexGuard<'static, Device>,
    in_graph: bool,
) -> parking_lot::MutexGuard<'static, Device> {
    let arenas: Vec<TorchArena> = d.arenas.values().cloned().collect();
    let (announced, underway) = CAPTURES.state();
    if in_graph || (announced && underway > 0) {
        release_cached_of(&arenas, false);
        return d;
    }
    drop(d);
    release_cached_of(&arenas, true);
    dref.lock()
}

/// Gives the cached memory of `arenas` back (`all`: frees that owe their
/// fence too, after a device synchronisation); a failure is logged.
fn release_cached_of(arenas: &[TorchArena], all: bool) {
    for a in arenas {
        let r = if all {
            a.release_all_cached()
        } else {
            a.release_cached()
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "vmmbuf-torch: releasing cached memory failed");
        }
    }
}

/// What the plug-in has been told of CUDA graph captures. Unless told,
/// malloc and free ask the driver about the stream at every call
/// (`cuStreamIsCapturing`, 0.4-0.7 us with cold caches, twice a pair).
/// Once a caller announces captures (the Python package does: it hooks
/// `torch.cuda.CUDAGraph`'s capture_begin and capture_end), the plug-in
/// asks only while one is under way, as PyTorch's own cache consults its
/// list of captures under way. Every uncertainty keeps it asking: a count
/// that cannot be brought down stays up. The count is vmmbuf's own
/// ([`vmmbuf::cuda::capture_begins`]), so that no arena synchronises the
/// device while an announced capture is under way.
pub(crate) struct Captures {
    /// Every capture that can touch this plug-in's memory is announced.
    announced: std::sync::atomic::AtomicBool,
}

impl Captures {
    pub(super) const fn new() -> Self {
        Self {
            announced: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// From now on every capture is announced (`on`): a stream is asked
    /// only while one is under way; or not (every call asks again).
    pub(crate) fn announce(&self, on: bool) {
        self.announced
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// A capture is about to begin (call it before `cudaStreamBeginCapture`).
    pub(crate) fn begins(&self) {
        vmmbuf::cuda::capture_begins();
    }

    /// A capture has ended (call it after `cudaStreamEndCapture`). An end
    /// with none under way is refused and changes nothing.
    pub(crate) fn ends(&self) -> Result<()> {
        vmmbuf::cuda::capture_ends()
    }

    /// Whether streams must be asked: captures are not announced, or one is
    /// under way.
    pub(super) fn may_capture(&self) -> bool {
        !self.announced.load(std::sync::atomic::Ordering::SeqCst)
            || vmmbuf::cuda::captures_underway() > 0
    }

    /// `(announced, under way)`.
    pub(crate) fn state(&self) -> (bool, usize) {
        (
            self.announced.load(std::sync::atomic::Ordering::SeqCst),
            vmmbuf::cuda::captures_underway(),
        )
    }
}

/// Streams asked about their capture so far (`num_capture_queries`).
pub(super) static CAPTURE_QUERIES: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// The process's announcements (see [`Captures`]).
pub(crate) static CAPTURES: Captures = Captures::new();

/// `capture_state`, or `None` without a query when graphs are off or no
/// announced capture is under way.
fn capture_state_of(s: &Arc<CudaStream>) -> Result<CaptureState> {
    if Settings::get().graphs && CAPTURES.may_capture() {
        CAPTURE_QUERIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        capture_state(s)
    } else {
        Ok(CaptureState::None)
    }
}

/// The capture `s` is in, if one is active (an invalidated capture is
/// none: allocations on its stream are ordinary ones).
fn capture(s: &Arc<CudaStream>) -> Result<Option<Capture>> {
    Ok(capture_state_of(s)?.into_active())
}

/// Frees `ptr` in stream order on `stream` (if it is not the allocation's
/// own, the free waits for both).
///
/// Everything that may fail is done while the allocation is still live (a
/// failure then changes nothing, and the block is never freed as an
/// ordinary one when a graph may use it): the streams, their captures, the
/// graph's pool and a fence on its own stream. Only then does it leave
/// `live`.
pub(crate) fn free(ptr: u64, dev: c_int, stream: *mut c_void) -> Result<()> {
    let _t = Timed::start(&FREE_NS);
    let d = existing(dev).ok_or_else(|| unknown_free(ptr, dev))?;
    let mut d = d.lock();
    d.release_graphs();
    let streams = d.free_streams(ptr, dev, stream)?;
    let into = d.free_into(ptr, &streams)?;
    let (a, _) = d.take_live(ptr, dev)?;
    d.forget_pool(ptr);
    streams.finish(a, into);
    Ok(())
}

/// The streams a free touches, each asked about its capture once: the
/// allocation's own, and every other that used the block (the one the free
/// names, if not its own, and those `record_stream` named).
///
/// Freed while its stream (or another that used it) is captured, no fence
/// can be recorded there, and the graph may use the bytes in every replay,
/// so they are the graph's until CUDA destroys it. A stream whose capture
/// was invalidated takes no fence either: the free is owed there, and
/// covered at its next call once the capture has ended. A failed question
/// counts as "invalidated": a fence is then recorded nowhere it might not
/// belong.
struct FreeStreams {
    own: CaptureState,
    others: Vec<(Arc<CudaStream>, CaptureState)>,
}

/// Where a free under a capture goes: the graph's pool, and (its own stream
/// not captured) a fence recorded there.
type IntoGraph = Option<(GraphPoolId, Option<vmmbuf::cuda::CudaFence>)>;

impl FreeStreams {
    /// Frees `a`: each other stream not captured gets a fence of its own,
    /// at the free or (an ordinary free) with the free's (its capture
    /// invalidated, the fence fails and the free is owed there instead:
    /// nothing is lost). One under capture makes the block its graph's,
    /// since the graph's replays may use it, and the free is owed there:
    /// work it queued before the capture may still run.
    fn finish(self, a: CudaAllocation, into: IntoGraph) {
        for (t, c) in &self.others {
            match c.active() {
                None => a.record_stream(t),
                Some(_) => a.record_captured_stream(t),
            }
        }
        match into {
            Some((g, fence)) => {
                if let Some(f) = fence {
                    a.record_use(f);
                }
                a.free_into_graph(g);
            }
            None if matches!(self.own, CaptureState::None) => drop(a),
            None => a.free_deferred(),
        }
    }
}

/// `t`'s capture; a failed question counts as invalidated (see
/// [`FreeStreams`]).
fn ask_capture(t: &Arc<CudaStream>) -> CaptureState {
    capture_state_of(t).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "vmmbuf-torch: asking a stream's capture failed");
        CaptureState::Invalidated
    })
}

/// A stream's key, as the arena tells streams apart.
fn stream_key(t: &Arc<CudaStream>) -> vmmbuf::StreamKey {
    <Arc<CudaStream> as ArenaStream<CudaBackend>>::key(t)
}

impl Device {
    /// The allocation `a` (of `size` bytes asked) is live, in PyTorch's
    /// `pool` if any; its address.
    fn note_live(&mut self, a: CudaAllocation, size: usize, pool: Option<pools::PoolId>) -> u64 {
        let p = a.address();
        self.live.insert(p as usize, a);
        if let Some(pool) = pool {
            self.note_pool(p, size, pool);
        }
        p
    }

    /// The streams the free of the live allocation at `ptr`, named on
    /// `stream`, touches (see [`FreeStreams`]).
    fn free_streams(&mut self, ptr: u64, dev: c_int, stream: *mut c_void) -> Result<FreeStreams> {
        // The allocation's own stream, read in place (no reference taken:
        // the free is a hot path).
        let (own_key, own_handle, own) = {
            let a = self
                .live
                .get(&(ptr as usize))
                .ok_or_else(|| unknown_free(ptr, dev))?;
            (
                stream_key(a.stream()),
                a.stream().cu_stream(),
                ask_capture(a.stream()),
            )
        };
        // PyTorch frees on the allocation's own stream: then its handle is
        // the allocation's, and the stream map is not consulted.
        let named =
            (!std::ptr::eq(own_handle.cast::<c_void>(), stream)).then(|| self.stream(stream));
        let recorded = self
            .recorded
            .get(&(ptr as usize))
            .cloned()
            .unwrap_or_default();
        let mut others: Vec<Arc<CudaStream>> = Vec::new();
        for t in named.into_iter().chain(recorded) {
            if stream_key(&t) != own_key && !others.iter().any(|o| stream_key(o) == stream_key(&t))
            {
                others.push(t);
            }
        }
        let others = others
            .into_iter()
            .map(|t| {
                let c = ask_capture(&t);
                (t, c)
            })
            .collect();
        Ok(FreeStreams { own, others })
    }

    /// Under a capture (its own stream's, or another's that used the
    /// block): the graph's pool (its release callback registered) and, its
    /// own stream not captured, a real fence there.
    fn free_into(&mut self, ptr: u64, streams: &FreeStreams) -> Result<IntoGraph> {
        let captured = streams.own.active();
        let Some(c) = captured.or(streams.others.iter().find_map(|(_, c)| c.active())) else {
            return Ok(None);
        };
        let g = fail_point(FreeStep::GraphPool).and_then(|()| self.graph_pool(c))?;
        let fence = match streams.own {
            CaptureState::None => Some(
                fail_point(FreeStep::Fence)
                    .and_then(|()| self.backend.fence(self.live[&(ptr as usize)].stream()))?,
            ),
            _ => None,
        };
        Ok(Some((g, fence)))
    }
}

/// The fallible steps of a free under a capture, for fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreeStep {
    /// The graph's pool: its release callback (`cuUserObjectCreate`).
    GraphPool,
    /// A fence on the allocation's own stream.
    Fence,
}

/// A step made to fail by the tests (`FAIL_FREE_STEP`); always passes in
/// a build without tests.
fn fail_point(step: FreeStep) -> Result<()> {
    #[cfg(test)]
    if *FAIL_FREE_STEP.lock() == Some(step) {
        return Err(Error::InvalidArgument(format!(
            "injected failure of {step:?}"
        )));
    }
    let _ = step;
    Ok(())
}

/// The free step the tests make fail.
#[cfg(test)]
pub(crate) static FAIL_FREE_STEP: parking_lot::Mutex<Option<FreeStep>> =
    parking_lot::Mutex::new(None);

/// Frees a segment that the cache above vmmbuf gives back, as `cudaFree`
/// would: PyTorch's caching allocator over a vmmbuf `MemPool` calls this
/// only when it releases memory (`empty_cache`, a retry after running out,
/// a pool's end), and expects the memory back on the device for anyone.
/// Kept in vmmbuf's cache instead, it would be cached twice and starve
/// allocations that never come to vmmbuf (another thread's outside the
/// pool, PyTorch's own allocator): after the free, the device's work is
/// waited for (`cudaFree` synchronises the device too) and every whole
/// free chunk goes back to the driver. Not while a capture may be under
/// way (a synchronisation would invalidate it): the memory then stays
/// cached, for vmmbuf's next allocation or `empty_cache`.
pub(crate) fn free_segment(ptr: u64, dev: c_int, stream: *mut c_void) -> Result<()> {
    free(ptr, dev, stream)?;
    if CAPTURES.may_capture() {
        return Ok(());
    }
    give_back_cached(dev)
}

/// The device's work waited for, every whole free chunk of the device back
/// to the driver (see [`free_segment`]). Not during a capture: the caller
/// knows none is under way.
pub(super) fn give_back_cached(dev: c_int) -> Result<()> {
    let Some(d) = existing(dev) else {
        return Ok(());
    };
    // The wait runs without the device's lock, which other threads'
    // allocations and frees need meanwhile (as in `preload_free`).
    let backend = d.lock().backend.clone();
    vmmbuf::Backend::synchronize(&*backend)?;
    let d = d.lock();
    d.arenas.values().try_for_each(|a| a.empty_cache())
}

/// Frees `ptr` after its stream was destroyed (a CuPy stream collected
/// before the memory it allocated): nothing is recorded on that stream,
/// and no stream takes the bytes before a device synchronisation shows its
/// work finished (see `Allocation::free_stream_destroyed`).
pub(crate) fn free_stream_destroyed(ptr: u64, dev: c_int) -> Result<()> {
    let _t = Timed::start(&FREE_NS);
    let d = existing(dev).ok_or_else(|| unknown_free(ptr, dev))?;
    let mut d = d.lock();
    d.release_graphs();
    // The streams record_stream named need nothing more: the device
    // synchronisation this free waits for covers them too.
    let (a, _recorded) = d.take_live(ptr, dev)?;
    d.forget_pool(ptr);
    a.free_stream_destroyed();
    Ok(())
}

/// PyTorch's `Tensor.record_stream` on the plug-in's memory (PyTorch's
/// pluggable allocator calls it once `set_record_stream_fn` names it; without
/// it PyTorch skips the call): the free of the live allocation at `ptr`
/// then also waits for the work queued on `stream` up to the free, or, if
/// `stream` is being captured at the free, leaves the block to that graph.
/// `ptr` must be an allocation's start, as PyTorch passes it.
pub(crate) fn record_stream(ptr: u64, stream: *mut c_void) -> Result<()> {
    let key = <Arc<CudaStream> as ArenaStream<CudaBackend>>::key;
    for (_, d) in all_devices() {
        let mut d = d.lock();
        let Some(own) = d.live.get(&(ptr as usize)).map(|a| key(a.stream())) else {
            continue;
        };
        let s = d.stream(stream);
        if key(&s) != own {
            let v = d.recorded.entry(ptr as usize).or_default();
            if !v.iter().any(|t| key(t) == key(&s)) {
                v.push(s);
            }
        }
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "record_stream of {ptr:#x}: not a live allocation of the plug-in"
    )))
}

impl Device {
    /// The live allocation at `ptr`, taken out to be freed, with the
    /// streams `record_stream` named for it (which leave with it). Callers
    /// release the graphs CUDA destroyed since the last call first.
    fn take_live(
        &mut self,
        ptr: u64,
        dev: c_int,
    ) -> Result<(CudaAllocation, Vec<Arc<CudaStream>>)> {
        let a = self
            .live
            .remove(&(ptr as usize))
            .ok_or_else(|| unknown_free(ptr, dev))?;
        Ok((a, self.recorded.remove(&(ptr as usize)).unwrap_or_default()))
    }
}

fn unknown_free(ptr: u64, dev: c_int) -> Error {
    Error::InvalidArgument(format!(
        "free of {ptr:#x} on device {dev}: not a live allocation (unknown, or freed already)"
    ))
}
