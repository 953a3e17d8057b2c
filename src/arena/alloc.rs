//! Hand-outs: ordinary, into a graph's pool, and the search behind both;
//! a graph pool's release.

use super::*;

impl<B: Backend, S: ArenaStream<B>> Arena<B, S> {
    /// Allocates `bytes` (rounded up to the alignment) for work on `stream`.
    ///
    /// When no free block fits, maps chunks at the lowest unmapped address
    /// that fits (pooled ones first). Out of memory or over the budget, it
    /// waits for the arena's frees still in flight (on their streams, as
    /// PyTorch's allocator does before giving up), gives back whole free
    /// chunks and cached pool memory and tries once more; then
    /// [`Error::ArenaOutOfMemory`], with the device's free and total bytes
    /// where the backend knows them. A request larger than the budget, the
    /// reservation or the device fails at once with `never_fits` set (not
    /// [transient](Error::is_transient)). Existing allocations are never
    /// touched by a failure.
    pub fn alloc(&self, bytes: usize, stream: &S) -> Result<Allocation<B, S>> {
        self.alloc_inner(bytes, stream, None)
    }

    /// Allocates `bytes` for work on `stream` while it is being captured
    /// into a CUDA graph whose pool is `graph`: the block belongs to the
    /// graph, which replays the captured work at these addresses, until
    /// [`release_graph`](Self::release_graph). Freed (dropped, or with
    /// [`Allocation::free_into_graph`]), it stays the graph's.
    ///
    /// It is taken from the blocks `graph` holds that were freed on
    /// `stream` during the capture (the graph orders them as the stream
    /// did), else from free memory whose last use has passed, else from
    /// newly mapped memory: never a block another use may still touch when
    /// the graph replays, on whatever stream that is.
    ///
    /// Several graphs captured in turn may share one `graph` id (a PyTorch
    /// pool shared by captures); a later capture then takes the blocks an
    /// earlier one freed on `stream`, which is sound only if the caller
    /// replays them in capture order and never concurrently (PyTorch's
    /// contract for a pool shared with `pool=`).
    ///
    /// No fence is recorded or waited for on `stream`. Fences of earlier
    /// frees are queried (`cuEventQuery`), which a capture in CUDA's global
    /// mode forbids on any thread: the CUDA backend makes that query, and
    /// every other call CUDA counts as unsafe, in relaxed capture mode on
    /// its own (see [`cuda::RelaxedCapture`](crate::cuda::RelaxedCapture)).
    pub fn alloc_in_graph(
        &self,
        bytes: usize,
        stream: &S,
        graph: GraphPoolId,
    ) -> Result<Allocation<B, S>> {
        self.alloc_inner(bytes, stream, Some(graph))
    }

    /// The graph is gone: `graph`'s pool, every executable graph made from
    /// it destroyed and their launches finished (CUDA runs a graph's user
    /// object destructor then). Its held blocks join the free index, with
    /// the fences of uses made after the capture; its allocations still
    /// live are ordinary ones from now on. Returns the bytes freed. Unknown
    /// pools free nothing.
    pub fn release_graph(&self, graph: GraphPoolId) -> Result<usize> {
        let mut st = self.shared.state.lock();
        let Some(gone) = st.heap.release_graph(graph) else {
            return Ok(0);
        };
        let mut freed = 0;
        for (o, size, fences) in gone {
            freed += size;
            let stream = fences
                .iter()
                .next()
                .map(|f| f.key)
                .filter(|&k| fences.only_on(k));
            st.give_back_block(o, size, stream, fences);
        }
        self.shared.count(&mut st);
        Ok(freed)
    }

    /// Takes again, at `address`, a block that CUDA graphs hold (an
    /// allocation made in a capture, or freed into one, then freed): it
    /// lives again, for `bytes` on `stream`, as it was. For a caller that
    /// keeps a graph pool's state itself: PyTorch's CUDA graph trees
    /// restore a pool's checkpoint, and the outputs of the graphs replayed
    /// since live again at the addresses those graphs write. The caller
    /// knows the bytes are the ones it wants (a replay wrote them); the
    /// arena keeps its rule: at the next free the block is held again for
    /// the graphs that held it (those still alive; with none, it goes back
    /// to the free blocks), and that free waits for the uses its earlier
    /// life left on the block as well as for the new ones.
    ///
    /// Fails, changing nothing, if no graph holds a block starting at
    /// `address` of at least `bytes`, or while the arena sleeps.
    pub fn retake(&self, address: u64, bytes: usize, stream: &S) -> Result<Allocation<B, S>> {
        let size = self.rounded(bytes)?;
        let key = stream.key();
        let mut st = self.shared.state.lock();
        st.region.check_poison()?;
        if st.sleep.is_asleep() {
            return Err(Error::invalid(format!(
                "retake of {address:#x}: the arena is asleep (wake it first)"
            )));
        }
        let taken = address
            .checked_sub(self.shared.base)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| st.heap.retake(o, size, bytes, key).map(|t| (o, t)));
        let Some((offset, (size, uses))) = taken else {
            return Err(Error::invalid(format!(
                "retake of {bytes} bytes at {address:#x}: no block of that size that graphs hold starts there"
            )));
        };
        self.count_alloc(&mut st, offset, size, bytes, true);
        drop(st);
        Ok(self.handle(offset, size, bytes, stream, uses))
    }

    /// The graph pools alive: each one's id, bytes held free and live
    /// allocations.
    pub fn graph_pools(&self) -> Vec<(GraphPoolId, usize, usize)> {
        let st = self.shared.state.lock();
        st.heap.graph_pools()
    }

    fn alloc_inner(
        &self,
        bytes: usize,
        stream: &S,
        graph: Option<GraphPoolId>,
    ) -> Result<Allocation<B, S>> {
        let size = self.rounded(bytes)?;
        let key = stream.key();
        let mut st = self.shared.state.lock();
        st.region.check_poison()?;
        if graph.is_none() {
            self.cover_owed(&mut st, stream);
        }
        let (offset, from_held) = self.place(&mut st, size, bytes, key, graph)?;
        let uses = st.heap.note_live(offset, size, bytes, key, graph);
        self.count_alloc(&mut st, offset, size, bytes, from_held);
        drop(st);
        Ok(self.handle(offset, size, bytes, stream, uses))
    }

    /// The handle of the allocation just noted live at `offset` (`size`
    /// bytes held, `bytes` asked for on `stream`), with its id in the trace
    /// being recorded. Called without the arena's lock.
    fn handle(
        &self,
        offset: usize,
        size: usize,
        bytes: usize,
        stream: &S,
        uses: Arc<Uses<B::Fence>>,
    ) -> Allocation<B, S> {
        Allocation {
            id: self.trace_alloc(bytes, stream.key()),
            arena: self.shared.clone(),
            offset,
            size,
            requested: bytes,
            stream: stream.clone(),
            extra: Mutex::new(Vec::new()),
            uses,
            how: allocation::Freeing::Fence,
        }
    }

    /// `bytes` rounded up to the alignment; 0 and overflow refused.
    fn rounded(&self, bytes: usize) -> Result<usize> {
        if bytes == 0 {
            return Err(Error::invalid("an allocation of 0 bytes"));
        }
        round_up(bytes, self.shared.alignment)
            .ok_or_else(|| Error::invalid(format!("{bytes} bytes overflow")))
    }

    /// The frees owed on `stream` get their fence now if they should (never
    /// inside a capture, where the fence would be captured: callers skip
    /// this for a graph's allocation).
    fn cover_owed(&self, st: &mut State<B>, stream: &S) {
        let key = stream.key();
        if self.shared.defer_free_fences {
            self.shared.note_stream(key);
        }
        if st.heap.needs_cover(key) {
            self.shared.cover(st, stream);
        }
    }

    /// Where `size` bytes go, and whether they came from the graph's own
    /// held blocks: a graph's held blocks first; then, from the arena, only
    /// memory no pending use touches (for a graph, a key no stream has:
    /// settled blocks only). Out of memory, of budget or of room, it waits
    /// for the frees still in flight (their streams only; not inside a
    /// capture, where the error says so), gives everything cached back and
    /// tries once more; a request that can never fit fails at once.
    fn place(
        &self,
        st: &mut State<B>,
        size: usize,
        bytes: usize,
        key: StreamKey,
        graph: Option<GraphPoolId>,
    ) -> Result<(usize, bool)> {
        if let Some(o) = graph.and_then(|g| st.heap.take_for_graph(g, size, key)) {
            return Ok((o, true));
        }
        let find_key = if graph.is_some() { GRAPH_KEY } else { key };
        // Inside a capture (a graph's allocation, or one the backend knows
        // may be under way) nothing waits: a synchronisation would
        // invalidate the capture.
        let capturing = graph.is_some() || self.shared.backend.capture_underway();
        let oom = |st: &mut State<B>| {
            st.stats.num_ooms += 1;
            let device = self.shared.backend.device_memory();
            let mut e = self.shared.out_of_memory(st, bytes, device);
            if let Error::ArenaOutOfMemory {
                during_capture,
                never_fits: false,
                ..
            } = &mut e
            {
                *during_capture = capturing;
            }
            e
        };
        match self.shared.find(st, size, find_key) {
            Ok(o) => Ok((o, false)),
            Err(Error::ArenaOutOfMemory {
                never_fits: true, ..
            }) => Err(oom(st)),
            Err(e) if e.is_transient() => {
                if !capturing {
                    self.shared.wait_pending_frees(st)?;
                }
                self.shared.release_free_chunks(st)?;
                let _ = self.shared.pool.trim();
                match self.shared.find(st, size, find_key) {
                    Ok(o) => {
                        st.stats.num_alloc_retries += 1;
                        Ok((o, false))
                    }
                    Err(e) if e.is_transient() => Err(oom(st)),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Counts an allocation of `size` bytes (`bytes` asked for) at
    /// `offset`, noted live in the heap; `from_held`: a block graphs held,
    /// which counts as allocated in the split already.
    fn count_alloc(
        &self,
        st: &mut State<B>,
        offset: usize,
        size: usize,
        bytes: usize,
        from_held: bool,
    ) {
        if !from_held {
            let State { split, region, .. } = &mut *st;
            split.change(&region.table, offset, size, true);
        }
        st.stats.num_allocs += 1;
        st.stats.allocated_bytes_total += size as u64;
        st.stats.requested_bytes_total += bytes as u64;
        self.shared.count(st);
    }

    /// The allocation's id in the trace being recorded (0 with none).
    fn trace_alloc(&self, bytes: usize, key: StreamKey) -> u64 {
        if !self
            .shared
            .tracing
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return 0;
        }
        match self.shared.trace.lock().as_mut() {
            Some(sink) => {
                sink.next_id += 1;
                sink.line("alloc", sink.next_id, bytes, key);
                sink.next_id
            }
            None => 0,
        }
    }
}
