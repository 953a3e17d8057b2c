#!/usr/bin/env python3
"""Reverts one stream-order fix in a scratch copy of the tree, so
that the oracle (tests/all/oracle.rs) can be shown to catch it.

Usage: scripts/check/oracle_reverts.py TREE NAME, NAME one of rt3 rt4 rt5 rt6 rt8 (issue
19), g1 g2 (the CUDA graph pools of issue 23), g3 (RT4-1, issue 38), h1 h2 (map hooks, issue 24;
no longer faults since issue 40, which reports every chunk as its own range: releasing
single chunks and cutting at chunk ends is then what the code does anyway),
d1 (deferred free fences), w1 (a wake around a graph's blocks) or b1
(waiting for another stream's block before growing), g4 (a block two
graphs use, kept by the first alone) or g5 (a free into a graph owing
nothing on the captured stream).
Run the oracle there afterwards:
  cargo test --test all -- oracle_; cargo test --test all -- reviewed_defects; cargo test --test all -- capture_frees
(w1: cargo test --lib a_graphs_block_across, the oracle's fixed case no longer reaching it)
Never run it on the working tree you commit from, and build the scratch
tree with a target directory of its own (CARGO_TARGET_DIR): in a shared one,
cargo may take the reverted library as up to date for the other tree.
"""
import sys

tree, name = sys.argv[1], sys.argv[2]


def edit(path, old, new):
    p = f"{tree}/{path}"
    s = open(p).read()
    assert old in s, f"{name}: pattern not found in {path}"
    open(p, "w").write(s.replace(old, new, 1))


ADD_IF_ABSENT = '''    /// Adds every fence of `other` (see [`add`](Self::add)).'''
ADD_IF_ABSENT_NEW = '''    /// (revert) Adds `f` only if its stream has no fence yet.
    pub(crate) fn add_if_absent(&mut self, f: Stamped<F>) {
        if !self.0.iter().any(|s| s.key == f.key) {
            self.0.push(f);
        }
    }

    /// Adds every fence of `other` (see [`add`](Self::add)).'''

if name == "rt3":
    # coalesce keeps the left (pending) block's fence per stream, as the
    # position-based merge did (the left block's fences are made to win).
    edit("src/arena/heap/blocks/store.rs", "            self.link(left, merge(l, r, self.join_settled()));",
         """            let mut l = l;
            if !l.settled() {
                for f in l.fences.iter_mut() {
                    f.seq = u64::MAX;
                }
            }
            self.link(left, merge(l, r, self.join_settled()));""")
elif name == "rt4":
    # The free's fence is recorded before it is numbered (outside the lock
    # that orders them), as it was recorded before the arena's lock.
    edit("src/arena/allocation.rs", "            match crate::order::record(s.key(), || s.fence(backend)) {\n                Ok(f) => fences.add(f.map(Mark::Fence)),",
         "            match s.fence(backend) {\n                Ok(f) => fences.add(crate::order::given(s.key(), f).map(Mark::Fence)),")
elif name == "rt5":
    # shrink_to_fit drops deferred fences unwaited.
    edit("src/buffer/shrink.rs", "        if wait {\n            self.wait_all(g)?;\n        }",
         "        if wait {\n            self.wait_uses()?;\n        }")
    edit("src/buffer/shrink.rs", "        if self.release_from(&mut g, keep_to, true)? {\n            g.pending.clear();\n        }",
         "        self.release_from(&mut g, keep_to, true)?;\n        g.pending.clear();")
elif name == "rt6":
    # drop does not wait for deferred fences.
    edit("src/buffer/mod.rs", "let waited = if busy { self.wait_all(&g) } else { Ok(()) };",
         "let waited = if busy { self.wait_uses() } else { Ok(()) };")
elif name == "rt8":
    # A view's (older) fence on the allocation's own stream shadows the
    # free's fence, as the duplicate-key list did on merge.
    edit("src/order.rs", ADD_IF_ABSENT, ADD_IF_ABSENT_NEW)
    edit("src/order.rs", "    pub(crate) fn is_empty(&self) -> bool {",
         "    pub(crate) fn into_vec(self) -> Vec<Stamped<F>> {\n        self.0.into_vec()\n    }\n\n    pub(crate) fn is_empty(&self) -> bool {")
    edit("src/arena/allocation.rs", "        fences.merge(self.uses.take().map(Mark::Fence));",
         "        let own = std::mem::take(&mut fences);\n        fences = self.uses.take().map(Mark::Fence);\n        for f in own.into_vec() {\n            fences.add_if_absent(f);\n        }")
elif name == "g1":
    # A capture's allocation takes a block still pending on its own stream
    # (the graph replays later, on any stream).
    edit("src/arena/alloc.rs", "let find_key = if graph.is_some() { GRAPH_KEY } else { key };",
         "let find_key = key;")
elif name == "g2":
    # A graph's allocation, freed after the capture, goes back to the free
    # index instead of staying the graph's until its release.
    edit("src/arena/heap/held.rs", "            .filter(|&g| self.graphs.contains(g))\n            .into_iter()\n            .collect();",
         "            .filter(|_| false)\n            .into_iter()\n            .collect();")
elif name == "h1":
    # With a map hook, the arena releases single free chunks instead of
    # whole reported ranges (a neighbour's use may be in flight).
    edit("src/arena/mapping.rs", "let hooked = st.region.has_hook();", "let hooked = false;")
elif name == "h2":
    # With a map hook, a buffer's shrink cuts a reported range in two.
    edit("src/buffer/shrink.rs", "let keep_to = g.region.span_boundary_at_or_after(keep_to);",
         "let keep_to = keep_to;")
elif name == "d1":
    # A deferred free asks the oldest cover, even one recorded before it.
    edit("src/arena/heap/owed.rs", "let Some(i) = d.covers.iter().position(|c| c.seq > seq) else {",
         "let Some(i) = d.covers.iter().position(|_| true) else {")
elif name == "w1":
    # A wake counts only the graph-held ranges that start in a run.
    edit("src/sleep/unmapped.rs", "held.extend(graphs.iter().copied().filter_map(cut));",
         "held.extend(graphs.iter().copied().filter(|l| l.0 >= o && l.0 < o + b));")
elif name == "b1":
    # Waiting before growth takes another stream's pending block as settled
    # without waiting for its fences.
    edit("src/arena/heap/owing.rs", "        Some(owed.wait_set(backend, &f.fences))",
         "        let _ = (&f, &owed, backend);\n        Some(Ok(()))")
    edit("src/arena/heap/mod.rs", "    // ---- Free blocks.\n",
         "    // ---- Free blocks.\n\n    /// (revert) Settles zone `z` as if every fence had passed.\n"
         "    pub(super) fn settle_as_passed(&mut self, z: usize, walls: &impl Walls) {\n"
         "        self.zones[z].settle_in(|_| true, walls);\n    }\n")
    edit("src/arena/mapping.rs", "        self.settle_zone(st, z);\n        let o = self.take(st, z, size, key)?;",
         "        {\n            let State { heap, region, .. } = &mut *st;\n            heap.settle_as_passed(z, &region.walls());\n        }\n        let o = self.take(st, z, size, key)?;")
elif name == "g3":
    # RT4-1: a block allocated before a capture and freed into
    # it owes no fence on its stream: the capture retakes it, and after
    # the release other streams take it, while work queued before the
    # capture may still use it.
    edit("src/arena/allocation.rs",
         "            Freeing::IntoGraph(_) | Freeing::Deferred => Some(own_key),",
         "            Freeing::IntoGraph(_) => None,\n            Freeing::Deferred => Some(own_key),")
elif name == "g4":
    # Graph ownership: a block made in one graph's capture and freed in
    # another's is kept by the first graph alone, and goes back when that
    # graph is released while the second still replays over it.
    edit("src/arena/allocation.rs",
         "        graphs.extend(into);",
         "        if graphs.is_empty() {\n            graphs.extend(into);\n        }")
elif name == "g5":
    # A free into a graph owes nothing on a captured stream whose work,
    # queued before the capture, used the block.
    edit("src/arena/allocation.rs",
         "            fences.add(owed_mark(s.key()));\n            st.heap.owe_wanted(s.key());",
         "            let _ = s;")
else:
    sys.exit(f"unknown revert {name}")
print(f"reverted {name} in {tree}")
