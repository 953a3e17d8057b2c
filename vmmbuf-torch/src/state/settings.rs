//! The plug-in's settings (`VMMBUF_TORCH_*`, listed in docs/settings.md),
//! read once from the environment, and the arena description they make.
//! Each default is the measured choice; the comments say what measured it.

use std::sync::OnceLock;

use vmmbuf::ArenaDesc;

/// The largest chunk of a plug-in arena unless `VMMBUF_TORCH_MAX_CHUNK_BYTES`
/// says otherwise: expandable segments' page for their large pool.
const DEFAULT_MAX_CHUNK: usize = 20 << 20;

/// Who the plug-in's chunks are mapped for, from
/// `VMMBUF_TORCH_PEER_ACCESS`.
///
/// Every GPU that can reach a chunk's own must be able to touch it once the
/// process works with more than one GPU, as every GPU with peer access
/// enabled reaches cudaMalloc memory: PyTorch's and CuPy's copies between
/// devices (cudaMemcpyPeer, or a kernel on the other GPU) failed on memory
/// mapped for its own GPU only. But a process that uses one GPU (a rank of
/// FSDP or DDP, which sees every GPU of the host) only pays for mapping its
/// chunks for the others: one access descriptor per peer at every mapping
/// (on 4x H200 under FSDP the plug-in's time per step over a run was 2.15
/// ms mapping for the three peers against 1.44 ms without), and in one
/// 4-round run its steps read 0.973x paired step for step, with the same
/// shapes (summed time 0.943x), most of it from one round. So it maps as
/// PyTorch's expandable segments map theirs until peer access is asked
/// for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PeerMode {
    /// Unset (the default): for the chunk's own GPU until the process
    /// first allocates through the plug-in on a second GPU; then every
    /// arena of every device grants its peers access to the chunks it has
    /// and maps later ones for them too (`Arena::grant_peer_access`). A
    /// process that reads vmmbuf memory from another GPU without ever
    /// allocating there through vmmbuf (PyTorch's own allocator serving
    /// that GPU, under a `MemPool` scope) sets `1`.
    Auto,
    /// `1`: for every GPU that can reach it, from the first chunk.
    Always,
    /// `0`: for the chunk's own GPU only.
    Never,
}

/// The settings (see the module). A value that does not parse is logged
/// and the default kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Settings {
    /// `VMMBUF_TORCH_RELEASE_BEFORE_MAP=1`: whole free chunks are unmapped
    /// before new ones are mapped. Off: training changes tensor sizes every
    /// step, so free chunks stay mapped (given back on a budget, out of
    /// memory or empty_cache) under expandable segments' block rules. On an
    /// H100 that kept the median step within 1.4% of PyTorch's own
    /// allocator at 0.885-0.905 utilization, where unmapping them on every
    /// miss cost 2.5x the step time.
    pub(super) release_before_map: bool,
    /// `VMMBUF_TORCH_MAX_CHUNK_BYTES`: the largest chunk (20 MiB, as
    /// expandable segments map their large pool: growth maps what a request
    /// needs, rounded to the 2 MiB granularity, in a tenth of the mappings,
    /// and each mapping costs ~20 us whatever its size. Under FSDP on one
    /// H100 the plug-in's time per step was 6.1 ms with 2 MiB chunks and
    /// 3.7-4.4 ms with 20 MiB ones; NCCL's peer copies are faster on larger
    /// chunks too: all-gather at 0.8x of ncclMemAlloc's speed on 2 MiB
    /// chunks, equal on one chunk). 2 MiB with `move_free` unless set.
    pub(super) max_chunk: Option<usize>,
    /// `VMMBUF_TORCH_DEFER_FENCES=0`: an event at every free. On (the
    /// default), a free on the allocation's own stream records none and a
    /// later call on that stream records one for many
    /// (`ArenaDesc::defer_free_fences`). On 2x H200 that kept utilization
    /// (FSDP 0.947 against 0.948, DDP 0.944 against 0.942) and cut the
    /// plug-in's CPU per step (DDP malloc 1.27 -> 1.08 ms, free 0.99 ->
    /// 0.69; FSDP free 1.69 -> 1.31).
    pub(super) defer_fences: bool,
    /// `VMMBUF_TORCH_WAIT_BEFORE_GROW=0`: grow instead of waiting on the CPU
    /// for another stream's pending free block that fits
    /// (`ArenaDesc::wait_before_grow`). Under FSDP on 2x H200, growing left
    /// 6 of 11 launches at 0.79-0.93 utilization on one rank, as the GPU's
    /// lag decided; waiting kept all 11 at or above expandable segments'
    /// (0.948, 0.952), with no step-time cost the noise could show.
    pub(super) wait_before_grow: bool,
    /// `VMMBUF_TORCH_RELEASE_OVER_PERCENT=P` (P >= 100): whole free chunks
    /// go back before a mapping past P% of the peak allocated
    /// (`ArenaDesc::release_over_percent`): a footprint nearer the peak at
    /// more driver calls.
    pub(super) release_over_percent: Option<u32>,
    /// `VMMBUF_TORCH_MOVE_FREE=1`: a growth maps whole free chunks the
    /// requesting stream may take a second time where it grows
    /// (`ArenaDesc::move_free_chunks`; never with `register_nccl`'s hook).
    /// Off: it pays where shapes repeat and costs where every step brings
    /// new shapes (BENCHMARKS.md, the moves experiment).
    pub(super) move_free: bool,
    /// `VMMBUF_TORCH_PEER_ACCESS`: see [`PeerMode`].
    pub(super) peers: PeerMode,
    /// `VMMBUF_TORCH_GRAPHS=0`: the process never captures CUDA graphs, so
    /// malloc and free skip the capture query (`cuStreamIsCapturing`, a
    /// driver call PyTorch's own cache does not make on a hit). A capture
    /// with it set is not supported (allocations inside it are ordinary
    /// ones, and CUDA may refuse the frees' fences).
    pub(super) graphs: bool,
    /// `VMMBUF_TORCH_SHARE_GRAPH_POOLS=0`: every capture a graph pool of
    /// its own, even where captures share a PyTorch pool (see `pools`).
    pub(super) share_graph_pools: bool,
}

impl Settings {
    /// The process's settings, read at the first call.
    pub(super) fn get() -> &'static Settings {
        static SETTINGS: OnceLock<Settings> = OnceLock::new();
        SETTINGS.get_or_init(|| Settings::read(|k| std::env::var(k).ok()))
    }

    /// The settings `var` gives (a variable's value, `None` if unset).
    pub(super) fn read(var: impl Fn(&str) -> Option<String>) -> Settings {
        let flag = |k: &str, default: bool| match var(k).as_deref() {
            Some("1") => true,
            Some("0") => false,
            None | Some("") => default,
            Some(v) => {
                tracing::warn!(value = %v, "vmmbuf-torch: {k} is neither 0 nor 1; ignored");
                default
            }
        };
        let number = |k: &str, ok: &dyn Fn(usize) -> bool| {
            let v = var(k)?;
            match v.parse::<usize>() {
                Ok(n) if ok(n) => Some(n),
                _ => {
                    tracing::warn!(value = %v, "vmmbuf-torch: {k} is not a fitting number; ignored");
                    None
                }
            }
        };
        let peers = match var("VMMBUF_TORCH_PEER_ACCESS").as_deref() {
            Some("1") => PeerMode::Always,
            Some("0") => PeerMode::Never,
            None | Some("") => PeerMode::Auto,
            Some(v) => {
                tracing::warn!(value = %v, "vmmbuf-torch: VMMBUF_TORCH_PEER_ACCESS is neither 0 nor 1; peers get access once a second GPU is used");
                PeerMode::Auto
            }
        };
        Settings {
            release_before_map: flag("VMMBUF_TORCH_RELEASE_BEFORE_MAP", false),
            max_chunk: number("VMMBUF_TORCH_MAX_CHUNK_BYTES", &|n| n > 0),
            defer_fences: flag("VMMBUF_TORCH_DEFER_FENCES", true),
            wait_before_grow: flag("VMMBUF_TORCH_WAIT_BEFORE_GROW", true),
            release_over_percent: number("VMMBUF_TORCH_RELEASE_OVER_PERCENT", &|p| {
                (100..=u32::MAX as usize).contains(&p)
            })
            .map(|p| p as u32),
            move_free: flag("VMMBUF_TORCH_MOVE_FREE", false),
            peers,
            graphs: flag("VMMBUF_TORCH_GRAPHS", true),
            share_graph_pools: flag("VMMBUF_TORCH_SHARE_GRAPH_POOLS", true),
        }
    }

    /// Every arena's description: `reserve` bytes of address space, chunks
    /// mapped for the peers too if `peers`; blocks of at least 512 bytes,
    /// as PyTorch's (`kMinBlockSize`: its statistics count a small tensor as
    /// 512 bytes, and code and tests that check them expect that).
    pub(super) fn arena_desc(&self, reserve: usize, peers: bool) -> ArenaDesc {
        let mut desc = ArenaDesc::new(reserve);
        desc.release_before_map = self.release_before_map;
        let chunk = match (self.max_chunk, self.move_free) {
            (Some(n), _) => n,
            (None, true) => 2 << 20,
            (None, false) => DEFAULT_MAX_CHUNK,
        };
        desc = desc
            .max_chunk_bytes(chunk)
            .alignment(512)
            .defer_free_fences(self.defer_fences)
            .wait_before_grow(self.wait_before_grow)
            .peer_access(peers)
            .move_free_chunks(self.move_free);
        if let Some(p) = self.release_over_percent {
            desc = desc.release_over_percent(p);
        }
        desc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(vars: &[(&str, &str)]) -> Settings {
        Settings::read(|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_owned()))
    }

    #[test]
    fn the_defaults_are_the_measured_choices() {
        let s = read(&[]);
        assert_eq!(
            s,
            Settings {
                release_before_map: false,
                max_chunk: None,
                defer_fences: true,
                wait_before_grow: true,
                release_over_percent: None,
                move_free: false,
                peers: PeerMode::Auto,
                graphs: true,
                share_graph_pools: true,
            }
        );
        let d = s.arena_desc(1 << 30, false);
        assert_eq!((d.max_chunk_bytes, d.alignment), (20 << 20, 512));
        assert!(d.defer_free_fences && d.wait_before_grow && !d.move_free_chunks);
        assert!(!d.release_before_map && !d.peer_access && d.release_over_percent.is_none());
    }

    #[test]
    fn each_setting_reaches_the_arena_and_a_bad_value_keeps_the_default() {
        let s = read(&[
            ("VMMBUF_TORCH_RELEASE_BEFORE_MAP", "1"),
            ("VMMBUF_TORCH_DEFER_FENCES", "0"),
            ("VMMBUF_TORCH_WAIT_BEFORE_GROW", "0"),
            ("VMMBUF_TORCH_RELEASE_OVER_PERCENT", "120"),
            ("VMMBUF_TORCH_MOVE_FREE", "1"),
            ("VMMBUF_TORCH_PEER_ACCESS", "0"),
            ("VMMBUF_TORCH_GRAPHS", "0"),
            ("VMMBUF_TORCH_SHARE_GRAPH_POOLS", "0"),
        ]);
        assert!(!s.graphs && !s.share_graph_pools);
        let d = s.arena_desc(1 << 30, true);
        assert!(d.release_before_map && !d.defer_free_fences && !d.wait_before_grow);
        assert!(d.move_free_chunks && d.peer_access);
        assert_eq!(d.release_over_percent, Some(120));
        assert_eq!(
            d.max_chunk_bytes,
            2 << 20,
            "moving: 2 MiB chunks unless set"
        );
        assert_eq!(s.peers, PeerMode::Never);
        let set = read(&[
            ("VMMBUF_TORCH_MOVE_FREE", "1"),
            ("VMMBUF_TORCH_MAX_CHUNK_BYTES", "4194304"),
        ]);
        assert_eq!(set.arena_desc(1 << 30, false).max_chunk_bytes, 4 << 20);
        let bad = read(&[
            ("VMMBUF_TORCH_RELEASE_OVER_PERCENT", "90"),
            ("VMMBUF_TORCH_MAX_CHUNK_BYTES", "lots"),
            ("VMMBUF_TORCH_DEFER_FENCES", "yes"),
            ("VMMBUF_TORCH_PEER_ACCESS", "2"),
        ]);
        assert_eq!(bad, read(&[]), "every bad value keeps the default");
        assert_eq!(
            read(&[("VMMBUF_TORCH_PEER_ACCESS", "1")]).peers,
            PeerMode::Always
        );
    }
}
