//! What an arena is made with.

use super::*;

/// How to create an [`Arena`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaDesc {
    /// Address space to reserve (costs no memory): the most the arena can
    /// ever map.
    pub max_bytes: usize,
    /// Where chunks are placed; `None` for the backend's home.
    pub placement: Option<Location>,
    /// Alignment (and size multiple) of every allocation: a power of two up
    /// to the granularity, 256 by default.
    pub alignment: usize,
    /// The largest chunk one mapping uses: bigger requests map several. The
    /// unit in which free memory goes back to the pool. 2 MiB by default
    /// (rounded up to the granularity). Replaying a PyTorch Transformer
    /// trace, memory taken over memory allocated peaked at 1.010x with 2 MiB,
    /// 1.031x with 4 MiB and 1.077x with 8 MiB: bigger chunks mean fewer
    /// mappings when the arena grows, and more memory held.
    pub max_chunk_bytes: usize,
    /// A budget: the arena never maps more than this many bytes.
    pub max_reserved_bytes: Option<usize>,
    /// A budget shared with other arenas or buffers (see [`Budget`]): the
    /// bytes all of them map together stay under its limit.
    pub shared_budget: Option<Arc<Budget>>,
    /// Give whole free chunks to the pool before mapping new ones (true by
    /// default): memory taken follows memory allocated (the PyTorch trace:
    /// 1.0098x its peak). False keeps them mapped until `release_cached`,
    /// `empty_cache`, a budget or out of memory: fewer unmaps and maps when
    /// sizes keep changing, more memory held. Kept mapped, the free blocks
    /// behave as PyTorch's expandable segments: a stream's free joins its
    /// settled neighbours at once, and the block that ends where mapped
    /// memory ends is spared while another fits. Replaying PyTorch traces
    /// with the GPU lagging by 0 to 1000 events: 1.047x the peak (conv net)
    /// and 1.076x (Transformer), with fewer driver calls than events.
    pub release_before_map: bool,
    /// Defer the fence of a free on the allocation's own stream (false by
    /// default): instead of recording an event at every free, the arena
    /// numbers the free and records one event (a "cover") at a later call
    /// on the same stream, once 32 frees are owed there or another stream
    /// found no block, and at once when the free joins a free block of 64
    /// MiB or more. The stream reuses the block at once either way;
    /// other streams once the cover has passed. Where the arena must wait
    /// for frees that have no cover yet (out of memory, a sleep, its
    /// drop), it synchronises the device ([`Backend::synchronize`]), which
    /// covers streams destroyed since. PyTorch's cache records no event for
    /// such frees either; the PyTorch plug-in turns this on by default
    /// (`VMMBUF_TORCH_DEFER_FENCES=0` turns it off there).
    pub defer_free_fences: bool,
    /// With free chunks kept mapped (`release_before_map` false): give the
    /// whole free chunks back before a mapping that would take the arena
    /// past this percentage of its peak allocated (`Some(102)`: 1.02x).
    /// `None` (the default) keeps them until `release_cached`,
    /// `empty_cache`, a budget or out of memory; an arena with a map hook
    /// uses 110 then. Chunks given back this way go on to the driver.
    pub release_over_percent: Option<u32>,
    /// Wait rather than grow (false by default): when a request finds no
    /// block it may take and would map new memory, but a free block of
    /// another stream that fits is still pending (its fences recorded and
    /// not yet passed), the arena waits on the CPU for that block's fences
    /// and takes it. The GPU's lag behind the CPU then no longer decides how
    /// much memory the arena maps: under FSDP on two GPUs, one rank took
    /// up to 1.48x its peak allocated (expandable segments: 1.05x) in the
    /// launches where one stream's frees had not passed when another
    /// stream asked, and about 1.05x in the others. A block with a
    /// [deferred](Self::defer_free_fences) free is waited for once a cover
    /// stands for that free (the wait is on the cover's event), never
    /// before: only a device-wide synchronisation could wait for it then,
    /// and the request grows instead (the miss asks that stream for a
    /// cover at its next call). [`ArenaStats::num_waits_before_grow`]
    /// counts the waits. The
    /// PyTorch plug-in turns it on (`VMMBUF_TORCH_WAIT_BEFORE_GROW=0` turns
    /// it off there).
    pub wait_before_grow: bool,
    /// Maps every chunk for the peer devices too (false by default): each
    /// device that [`Backend::peers`] names may then read and write the
    /// arena's memory, as every GPU with peer access enabled may read
    /// `cudaMalloc` memory. Without it a kernel on another GPU faults on
    /// the arena's addresses and `cudaMemcpyPeer` from them fails
    /// (`cudaErrorInvalidValue`): CuPy's copies between devices did both
    /// (issue 38). Each mapping then costs one page-table update per GPU.
    pub peer_access: bool,
    /// Move free memory to where the arena grows (false by default): when
    /// a request must map memory, whole free chunks the requesting stream
    /// may take now (settled, or freed on that stream alone) are mapped a
    /// second time at the new addresses instead of new chunks, so the
    /// memory taken stays near the memory allocated while free space is
    /// fragmented. The stream's work queued before is ordered before the
    /// new use; the old addresses stay mapped until a fence recorded on
    /// the stream after the move has passed, then go (checked at the next
    /// growth, a release, a sleep, out of memory, the drop). Other streams
    /// take the moved memory once that fence has passed. Needs a backend
    /// that [maps a chunk twice](crate::Backend::maps_a_chunk_twice), and
    /// no map hook (an NCCL registration follows the addresses): otherwise
    /// it does nothing. Each moved chunk costs a mapping, a share of an
    /// access call (one for each run of adjacent destinations) and of an
    /// unmapping (one for each run of adjacent old addresses), as a pooled
    /// chunk costs the first two; made while the GPU works, these cost
    /// more than idle (85-211 us a 2 MiB chunk on H100s under training one
    /// chunk a call, 67-84 us batched on H200s). Where shapes change at
    /// every step, the free space is rearranged at every step: less
    /// memory, a slower step (on an H200, against expandable segments: a
    /// causal LM 0.973x the memory in 1.004x the time, a conv net whose
    /// batch size changes every step 0.957x in 1.442x; BENCHMARKS.md,
    /// "Moving free chunks").
    pub move_free_chunks: bool,
}

impl ArenaDesc {
    /// The reservation and the largest chunk, in bytes rounded to the
    /// granularity `g`; a description that can make no arena is refused
    /// (no bytes, an alignment that is not a power of two up to `g`,
    /// sizes that overflow).
    pub(super) fn sizes(&self, g: usize) -> Result<(usize, usize)> {
        let reserved = crate::plan::reservation(self.max_bytes, self.alignment, g)?;
        let chunk_bytes = round_up(self.max_chunk_bytes.max(1), g)
            .ok_or_else(|| Error::invalid("max_chunk_bytes overflows"))?;
        Ok((reserved, chunk_bytes))
    }

    /// A description reserving `max_bytes`, with the defaults.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            placement: None,
            alignment: 256,
            max_chunk_bytes: 2 << 20,
            max_reserved_bytes: None,
            shared_budget: None,
            release_before_map: true,
            defer_free_fences: false,
            release_over_percent: None,
            wait_before_grow: false,
            peer_access: false,
            move_free_chunks: false,
        }
    }

    /// Moves whole free chunks to where the arena grows instead of mapping
    /// new memory (see [`move_free_chunks`](Self::move_free_chunks)).
    pub fn move_free_chunks(mut self, on: bool) -> Self {
        self.move_free_chunks = on;
        self
    }

    /// Maps chunks for the peer devices too (see
    /// [`peer_access`](Self::peer_access)).
    pub fn peer_access(mut self, peers: bool) -> Self {
        self.peer_access = peers;
        self
    }

    /// Waits for another stream's pending free block rather than growing
    /// (see [`wait_before_grow`](Self::wait_before_grow)).
    pub fn wait_before_grow(mut self, wait: bool) -> Self {
        self.wait_before_grow = wait;
        self
    }

    /// Defers the fences of frees on their own stream (see
    /// [`defer_free_fences`](Self::defer_free_fences)).
    pub fn defer_free_fences(mut self, defer: bool) -> Self {
        self.defer_free_fences = defer;
        self
    }

    /// Gives whole free chunks back before mapping past `percent` of the
    /// peak allocated (see [`release_over_percent`](Self::release_over_percent)).
    pub fn release_over_percent(mut self, percent: u32) -> Self {
        self.release_over_percent = Some(percent);
        self
    }

    /// Shares `budget` with the other arenas and buffers given it.
    pub fn shared_budget(mut self, budget: Arc<Budget>) -> Self {
        self.shared_budget = Some(budget);
        self
    }

    /// Sets the budget.
    pub fn max_reserved_bytes(mut self, bytes: usize) -> Self {
        self.max_reserved_bytes = Some(bytes);
        self
    }

    /// Sets the largest chunk one mapping uses.
    pub fn max_chunk_bytes(mut self, bytes: usize) -> Self {
        self.max_chunk_bytes = bytes;
        self
    }

    /// Sets the alignment of allocations.
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }
}
