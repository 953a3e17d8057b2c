//! [`Allocation`]: the owned handle of arena memory, freed in stream order.

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use super::graph::GraphPoolId;
use super::{ArenaStream, Mark, Shared, State};
use crate::backend::{Backend, Uses};
use crate::error::{Error, Result};
use crate::order::FenceSet;
use crate::StreamKey;

/// Memory from an [`Arena`](crate::Arena): the owned handle a tensor stores. Holds the
/// arena alive; `Send + Sync`; freed on drop in stream order (see
/// [`Arena`](crate::Arena)).
///
/// # Example
///
/// Work on another stream, recorded so that the free waits for it too:
///
/// ```
/// # #[cfg(target_os = "linux")] {
/// use vmmbuf::host::{HostArena, HostStream};
/// use vmmbuf::{ArenaDesc, HostBackend};
///
/// let arena = HostArena::new(HostBackend::new(), ArenaDesc::new(64 << 20))?;
/// let (compute, copy) = (HostStream(1), HostStream(2));
/// let a = arena.alloc(4096, &compute)?;
/// assert_eq!(a.len(), 4096);
/// a.record_stream(&copy);   // work queued on `copy` uses it as well
/// drop(a);                  // reused only after both streams' work
/// # }
/// # Ok::<(), vmmbuf::Error>(())
/// ```
pub struct Allocation<B: Backend, S: ArenaStream<B>> {
    /// Its id in the trace being recorded (0 without one).
    pub(super) id: u64,
    pub(super) arena: Arc<Shared<B>>,
    pub(super) offset: usize,
    pub(super) size: usize,
    pub(super) requested: usize,
    pub(super) stream: S,
    /// Other streams that used it: each gets a fence at the free, or, if
    /// `true`, is being captured ([`record_captured_stream`](Self::record_captured_stream))
    /// and the free is owed there.
    pub(super) extra: Mutex<Vec<(S, bool)>>,
    /// Uses recorded by views and [`record_use`](Self::record_use); the
    /// arena holds the same list, so that offload waits for them.
    pub(super) uses: Arc<Uses<B::Fence>>,
    /// How the drop frees it: set by [`free_into_graph`](Self::free_into_graph),
    /// [`free_deferred`](Self::free_deferred) and
    /// [`free_stream_destroyed`](Self::free_stream_destroyed).
    pub(super) how: Freeing,
}

/// How an [`Allocation`]'s drop orders its free on its own stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Freeing {
    /// A fence recorded on the stream now (or deferred, with
    /// [`ArenaDesc::defer_free_fences`](crate::ArenaDesc::defer_free_fences)).
    Fence,
    /// No fence now (the stream is being captured into this graph): the
    /// block is the graph's until it is released.
    IntoGraph(GraphPoolId),
    /// No fence now (the stream cannot take one): one recorded at a later
    /// call on the stream covers the free, and a wait before then
    /// synchronises the device.
    Deferred,
    /// The stream is gone: no fence is ever recorded on it; only a device
    /// synchronisation shows its work finished.
    StreamGone,
}

/// The key owed frees of destroyed streams are numbered on: no stream has
/// it, so no cover ever stands for them and no stream takes their blocks
/// before a device synchronisation.
pub(super) const GONE_KEY: crate::StreamKey = (u64::MAX, u64::MAX - 1);

impl<B: Backend, S: ArenaStream<B>> fmt::Debug for Allocation<B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("address", &format_args!("{:#x}", self.address()))
            .field("bytes", &self.requested)
            .finish()
    }
}

impl<B: Backend, S: ArenaStream<B>> Allocation<B, S> {
    /// The device address of the first byte (aligned to the arena's alignment).
    pub fn address(&self) -> u64 {
        self.arena.base + self.offset as u64
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.requested
    }

    /// Never true: allocations are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// Bytes the block holds (the request rounded up to the alignment).
    pub fn capacity(&self) -> usize {
        self.size
    }

    /// The stream it was allocated for.
    pub fn stream(&self) -> &S {
        &self.stream
    }

    /// Copies `src` into the allocation at `at` (synchronous; ordered after
    /// nothing on the device: use it before queueing work, or after
    /// synchronising the allocation's stream).
    pub fn write(&mut self, at: usize, src: &[u8]) -> Result<()> {
        self.check(at, src.len())?;
        self.with_cpu_access(at, src.len(), |b, res, o| b.write(res, o, src))
    }

    /// Copies bytes of the allocation from `at` into `dst` (synchronous, as
    /// [`write`](Self::write)).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<()> {
        self.check(at, dst.len())?;
        self.with_cpu_access(at, dst.len(), |b, res, o| b.read(res, o, dst))
    }

    /// Runs `f(backend, reservation, offset)` under the arena's lock once
    /// the host-placed chunks of `[at, at + n)` grant the CPU access: the
    /// driver copies host memory (an offloaded arena) with the CPU, and so
    /// do cudarc's copies through views.
    pub(super) fn with_cpu_access<T>(
        &self,
        at: usize,
        n: usize,
        f: impl FnOnce(&B, &mut B::Reservation, usize) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.arena.state.lock();
        let st = &mut *guard;
        let (res, table) = st.region.parts();
        let o = self.offset + at;
        crate::migration::grant_cpu(&*self.arena.backend, res, table, o, n)?;
        f(&self.arena.backend, res, o)
    }

    /// cudarc's copies of host memory (an offloaded arena) run on the CPU
    /// inside the driver: host-placed chunks need the host's access entry.
    pub(crate) fn grant_cpu(&self) -> Result<()> {
        self.with_cpu_access(0, self.size, |_, _, _| Ok(()))
    }

    /// The list views record their uses in.
    pub(crate) fn uses_ref(&self) -> &Uses<B::Fence> {
        &self.uses
    }

    fn check(&self, at: usize, n: usize) -> Result<()> {
        match at.checked_add(n) {
            Some(end) if end <= self.requested => Ok(()),
            _ => Err(Error::invalid(format!(
                "bytes {at}+{n} are outside the {}-byte allocation",
                self.requested
            ))),
        }
    }

    /// Records that work before `fence` uses this allocation (a kernel that
    /// reaches it by address, a CUDA graph, a copy on a stream the arena does
    /// not know of): its free waits for the fence before another stream gets
    /// the bytes, and so do [`Arena::offload`](crate::Arena::offload),
    /// [`Arena::restore`](crate::Arena::restore) and the arena's unmaps. A
    /// later fence of the same queue replaces the earlier one: hand over one
    /// queue's fences in the order they were recorded.
    pub fn record_use(&self, fence: B::Fence) {
        let key = self.arena.backend.fence_key(&fence);
        self.uses.put(key, fence);
    }

    /// The graph whose pool it came from, if it was allocated with
    /// [`Arena::alloc_in_graph`](crate::Arena::alloc_in_graph) and that
    /// graph has not been released since (after
    /// [`Arena::release_graph`](crate::Arena::release_graph) it is an
    /// ordinary allocation).
    pub fn graph(&self) -> Option<GraphPoolId> {
        let st = self.arena.state.lock();
        st.heap.graph_of(self.offset)
    }

    /// Frees it while its stream (and every stream it was recorded on) is
    /// being captured into the CUDA graph whose pool is `graph`: no fence
    /// is recorded (an event recorded in a capture is a graph node, not a
    /// point a query can see pass), and the block becomes `graph`'s until
    /// [`Arena::release_graph`](crate::Arena::release_graph), because the
    /// graph's replays use it. The same capture's later allocations on this
    /// stream may take it again; nothing else does. For an allocation made
    /// before the capture and freed during it, too (the graph may have used
    /// it before the free). Streams given to [`record_stream`](Self::record_stream)
    /// get a fence at the free, kept with the block until the release: they
    /// must not be under capture then.
    ///
    /// An allocation made before the capture (or in another graph's) may
    /// still be used by work queued on its stream before the capture
    /// began: its free is then owed on that stream as with
    /// [`free_deferred`](Self::free_deferred), and the block reaches other
    /// streams after the graph's release only once a fence recorded on its
    /// stream after the capture (or a device synchronisation) has passed.
    /// The capture never takes such a block again. A block of another
    /// graph that is still alive stays that graph's (its replays use it).
    pub fn free_into_graph(mut self, graph: GraphPoolId) {
        self.how = Freeing::IntoGraph(graph);
    }

    /// Frees it without recording a fence on its stream now, for a stream
    /// that cannot take one: its capture was invalidated and not yet ended,
    /// or it is being captured into a graph that does not own the block.
    /// The free is numbered on the stream; the next allocation or free on
    /// that stream outside a capture records one fence after it, and the
    /// block reaches other streams once that fence has passed (a wait
    /// before then, out of memory or in
    /// [`Arena::empty_cache`](crate::Arena::empty_cache), synchronises the
    /// device). Its own stream may take it again at once, as after any
    /// free. Streams given to [`record_stream`](Self::record_stream) get
    /// their fences as usual.
    pub fn free_deferred(mut self) {
        self.how = Freeing::Deferred;
    }

    /// Frees it after its stream was destroyed (a stream cannot be asked
    /// whether it still exists: the caller knows). Nothing is recorded on
    /// it; the work it queued may still run, so no stream takes the block
    /// until a device synchronisation (out of memory, a sleep,
    /// [`Arena::empty_cache`](crate::Arena::empty_cache)) shows that work
    /// finished. A new stream that gets the old one's handle is not taken
    /// for it. Streams given to [`record_stream`](Self::record_stream) get
    /// their fences as usual.
    pub fn free_stream_destroyed(mut self) {
        self.how = Freeing::StreamGone;
    }

    /// Records that work queued on `stream` before its capture began may
    /// use this allocation, while `stream` is being captured (no fence can
    /// be recorded there now: an event recorded in a capture is a graph
    /// node no query sees pass). The free is owed on `stream`: the block
    /// reaches other streams once a fence recorded on `stream` after the
    /// capture (at its next allocation or free outside a capture), or a
    /// device synchronisation, has passed. Use it with
    /// [`free_into_graph`](Self::free_into_graph) when the allocation's
    /// own stream is not the one being captured; the graph's own uses are
    /// the graph's (see [`Arena::release_graph`](crate::Arena::release_graph)).
    pub fn record_captured_stream(&self, stream: &S) {
        let key = stream.key();
        let mut v = self.extra.lock();
        if key == self.stream.key() {
            return;
        }
        match v.iter_mut().find(|(s, _)| s.key() == key) {
            Some(e) => e.1 = true,
            None => v.push((stream.clone(), true)),
        }
    }

    /// Records that work on `stream` uses this allocation: its free waits
    /// for that stream's work queued up to the free, as PyTorch's
    /// `Tensor.record_stream`.
    pub fn record_stream(&self, stream: &S) {
        let mut v = self.extra.lock();
        if stream.key() != self.stream.key() && !v.iter().any(|s| s.0.key() == stream.key()) {
            v.push((stream.clone(), false));
        }
    }
}

/// A free's mark on `key` with no fence: numbered now in the stream's order;
/// a fence recorded there later (a cover) stands for it.
fn owed_mark<F>(key: crate::StreamKey) -> crate::order::Stamped<Mark<F>> {
    super::owed::owed_at(key, crate::order::stamp(key))
}

impl<B: Backend, S: ArenaStream<B>> Drop for Allocation<B, S> {
    fn drop(&mut self) {
        let own_key = self.stream.key();
        let fence_own = self.how == Freeing::Fence;
        // A deferred fence: the free is numbered on its own stream, and a
        // later call there records one fence for many frees (`owed`).
        // Only on a stream the caller keeps working on (the one of the call
        // before): a stream called rarely would keep its blocks from the
        // others until its next call.
        let owed_on =
            (fence_own && self.arena.defer_free_fences && self.arena.note_stream(own_key))
                .then_some(own_key);
        let (mut fences, failed) = self.record_fences(owed_on);
        if self.id != 0 {
            if let Some(sink) = self.arena.trace.lock().as_mut() {
                sink.line("free", self.id, self.requested, own_key);
            }
        }
        // Views and `record_use` recorded their own fences, numbered when
        // recorded: on the allocation's own stream, the free's fence is later
        // and stays.
        fences.merge(self.uses.take().map(Mark::Fence));
        let no_other_stream = self.extra.get_mut().is_empty();
        let mut st = self.arena.state.lock();
        // The graph it came from, unless that graph was released since (it
        // is an ordinary allocation then, whatever pool has the id now).
        let freed = st.heap.take_live(self.offset);
        let graph = freed.graph;
        let into = match self.how {
            Freeing::IntoGraph(g) => Some(g),
            _ => None,
        };
        self.owe(&mut st, graph, owed_on, failed, &mut fences);
        self.settle_accounts(&mut st, graph);
        // The graphs that keep the block (see `graph`'s rule): the one it
        // came from while that graph lives (and, retaken from graphs, those
        // still alive, behind its earlier life's fences too), and the one
        // whose capture frees it; with none, it goes back.
        let mut graphs = freed.keepers;
        graphs.extend(into);
        fences.merge(freed.fences);
        if graphs.is_empty() {
            self.give_back(&mut st, owed_on, fences);
        } else {
            self.keep_in_graphs(&mut st, graphs, into.is_some() && no_other_stream, fences);
        }
        self.arena.count(&mut st);
    }
}

impl<B: Backend, S: ArenaStream<B>> Allocation<B, S> {
    /// The free's fences, each recorded and numbered in one step
    /// (`order::record`), so that a block freed later on a stream always
    /// carries the larger number, whichever thread takes the arena's lock
    /// first: on its own stream (unless the free is owed there, `owed_on`,
    /// or its stream is captured or gone) and on every stream given to
    /// `record_stream` (not captured: work there runs now; a graph's block
    /// keeps theirs until its release). With the streams on which recording
    /// failed: their frees are owed there instead (a later fence, or a
    /// device synchronisation, stands for them), so a failure loses no
    /// memory.
    fn record_fences(
        &mut self,
        owed_on: Option<StreamKey>,
    ) -> (FenceSet<Mark<B::Fence>>, Vec<StreamKey>) {
        let backend = &*self.arena.backend;
        let mut fences = FenceSet::default();
        if let Some(key) = owed_on {
            fences.add(owed_mark(key));
        }
        let mut failed = Vec::new();
        let recorded = (self.how == Freeing::Fence && owed_on.is_none()).then_some(&self.stream);
        let others = self.extra.get_mut().iter().filter(|e| !e.1).map(|e| &e.0);
        for s in recorded.into_iter().chain(others) {
            match crate::order::record(s.key(), || s.fence(backend)) {
                Ok(f) => fences.add(f.map(Mark::Fence)),
                Err(e) => {
                    tracing::warn!(error = %e, "vmmbuf arena: recording a free's fence failed; the free waits for a later fence on that stream or a device synchronisation");
                    fences.add(owed_mark(s.key()));
                    failed.push(s.key());
                }
            }
        }
        (fences, failed)
    }

    /// What the free owes and where: the own stream's free when no fence
    /// can be recorded there now (owed on it, or, a stream destroyed, on a
    /// key no stream has; a block freed into the graph it came from needs
    /// none: only the capture used it), the streams whose recording failed,
    /// the deferred fence. Frees owed on the own stream get their cover now
    /// if they should: a call on the stream outside a capture.
    fn owe(
        &self,
        st: &mut State<B>,
        graph: Option<GraphPoolId>,
        owed_on: Option<StreamKey>,
        failed: Vec<StreamKey>,
        fences: &mut FenceSet<Mark<B::Fence>>,
    ) {
        let own_key = self.stream.key();
        // Captured streams whose earlier work may use it: owed there.
        for (s, _) in self.extra.lock().iter().filter(|e| e.1) {
            fences.add(owed_mark(s.key()));
            st.heap.owe_wanted(s.key());
        }
        let owe_own = match self.how {
            Freeing::Fence => None,
            Freeing::IntoGraph(g) if graph == Some(g) => None,
            Freeing::IntoGraph(_) | Freeing::Deferred => Some(own_key),
            Freeing::StreamGone => Some(GONE_KEY),
        };
        if let Some(key) = owe_own {
            fences.add(owed_mark(key));
        }
        for key in owe_own.into_iter().chain(failed) {
            st.heap.owe_wanted(key);
        }
        if let Some(key) = owed_on {
            st.heap.owe(key);
        }
        if self.how == Freeing::Fence && st.heap.needs_cover(own_key) {
            self.arena.cover(st, &self.stream);
        }
    }

    /// The counts: frees, allocated and requested bytes, the live count of
    /// the graph it came from; and its use list (emptied, and now held by
    /// nothing else: the arena's entry just went, views borrow the
    /// allocation) kept for the next allocation.
    fn settle_accounts(&self, st: &mut State<B>, graph: Option<GraphPoolId>) {
        st.heap
            .note_freed(self.size, self.requested, graph, &self.uses);
        st.stats.num_frees += 1;
        st.stats.freed_bytes_total += self.size as u64;
        st.stats.requested_freed_total += self.requested as u64;
    }

    /// The block is held for `graphs` until the last of them is
    /// released; retaken in the capture only if it was freed into a graph
    /// during its capture, used by nothing but its own, captured, stream
    /// (`retakable`), nothing was queued on it before, and no other graph
    /// references it.
    fn keep_in_graphs(
        &self,
        st: &mut State<B>,
        graphs: Vec<GraphPoolId>,
        retakable: bool,
        fences: FenceSet<Mark<B::Fence>>,
    ) {
        let reuse = (retakable && fences.is_empty()).then_some(self.stream.key());
        st.heap.hold(self.offset, self.size, graphs, reuse, fences);
    }

    /// The block goes back to the arena's free blocks, behind `fences`
    /// (or, if a sleep gave its memory back, to the free bytes of the
    /// wake).
    fn give_back(
        &self,
        st: &mut State<B>,
        owed_on: Option<StreamKey>,
        fences: FenceSet<Mark<B::Fence>>,
    ) {
        let own_key = self.stream.key();
        // Only the allocation's own stream may reuse the block before the
        // fences pass, and only if no other stream used it.
        let stream = fences.only_on(own_key).then_some(own_key);
        st.give_back_block(self.offset, self.size, stream, fences);
        // Joined into a large free block (settled neighbours), the owed
        // free would keep all of it from the other streams until its
        // stream's next call: covered now instead.
        if let Some(key) = owed_on {
            if st.heap.cover_now_after(self.offset, key) {
                self.arena.cover(st, &self.stream);
            }
        }
    }
}
