#!/usr/bin/env python3
"""A decode loop captured once as a CUDA graph and replayed while its KV
cache grows.

Each step runs, per layer: q, k, v projections of the hidden state, the new
k and v appended at the position a device counter holds, attention over the
cache up to that position (a CuPy kernel that reads the length on the
device), an output projection; then the counter moves on. Shapes never
change, so one graph serves every step as long as the cache's address does
not move.

Variants, one process each (``--variant``, or ``--all`` to run them in
turn and print the table):
- ``vmmbuf``: vmmbuf is PyTorch's allocator (``vmmbuf.torch.use()``; the
  capture's temporaries come from a graph pool) and each layer's cache is a
  ``vmmbuf.GrowableTensor`` grown in place 256 rows ahead of the position:
  captured once;
- ``torch-max``: PyTorch's allocator, each cache preallocated at its
  maximum: captured once;
- ``torch-doubling``: PyTorch's allocator, each cache doubled (new tensor,
  copy) when full, so its address moves and the graph is captured again.

Prints one JSON line per variant (steps per second, device memory at its
peak over the loop, re-captures, a checksum of the final hidden state that
must be equal across variants).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

VARIANTS = ("vmmbuf", "torch-max", "torch-doubling")

KERNELS = r"""
extern "C" __global__ void append_kv(float* cache, const float* k, const float* v,
                                     const int* pos, int hd) {
    // cache rows are [2, H*D]: k then v.
    long long row = (long long)pos[0] * 2 * hd;
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < hd; i += blockDim.x * gridDim.x) {
        cache[row + i] = k[i];
        cache[row + hd + i] = v[i];
    }
}

extern "C" __global__ void attend(const float* cache, const float* q, float* scores,
                                  float* out, const int* pos, int heads, int d, int tmax) {
    // One block per head, d threads. Length = pos + 1 (the row just appended).
    int h = blockIdx.x, tid = threadIdx.x, n = pos[0] + 1, hd = heads * d;
    float* s = scores + (long long)h * tmax;
    __shared__ float red[1024];
    float scale = rsqrtf((float)d), mx = -1e30f;
    for (int t = tid; t < n; t += blockDim.x) {
        const float* kr = cache + (long long)t * 2 * hd + h * d;
        float acc = 0.f;
        for (int j = 0; j < d; ++j) acc += q[h * d + j] * kr[j];
        acc *= scale;
        s[t] = acc;
        mx = fmaxf(mx, acc);
    }
    red[tid] = mx;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (tid < w) red[tid] = fmaxf(red[tid], red[tid + w]);
        __syncthreads();
    }
    mx = red[0];
    __syncthreads();
    float sum = 0.f;
    for (int t = tid; t < n; t += blockDim.x) {
        float e = __expf(s[t] - mx);
        s[t] = e;
        sum += e;
    }
    red[tid] = sum;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (tid < w) red[tid] += red[tid + w];
        __syncthreads();
    }
    sum = red[0];
    for (int j = tid; j < d; j += blockDim.x) {
        float acc = 0.f;
        for (int t = 0; t < n; ++t) acc += s[t] * cache[(long long)t * 2 * hd + hd + h * d + j];
        out[h * d + j] = acc / sum;
    }
}

extern "C" __global__ void bump(int* pos) { pos[0] += 1; }
"""


def run(variant: str, steps: int, tmax: int, layers: int, heads: int, d: int) -> Dict[str, Any]:
    import torch

    if variant == "vmmbuf":
        import vmmbuf
        import vmmbuf.torch as vt

        vt.use()
    import cupy

    dev = torch.device("cuda")
    hd = heads * d
    mod = cupy.RawModule(code=KERNELS)
    append_kv, attend, bump = (mod.get_function(n) for n in ("append_kv", "attend", "bump"))
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [[torch.randn(hd, hd, device=dev, generator=g) / hd ** 0.5 for _ in range(4)]
          for _ in range(layers)]
    x0 = torch.randn(1, hd, device=dev, generator=g)
    x = x0.clone()
    pos = torch.zeros(1, dtype=torch.int32, device=dev)
    scores = torch.empty(heads, tmax, device=dev)
    row = 2 * hd  # floats per cache row
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]

    if variant == "vmmbuf":
        caches = [vmmbuf.GrowableTensor("float32", (tmax, row), "cuda") for _ in range(layers)]
        for c in caches:
            c.resize(256)
        ptrs = [c.data_ptr() for c in caches]
    elif variant == "torch-max":
        caches = [torch.empty(tmax, row, device=dev) for _ in range(layers)]
        ptrs = [c.data_ptr() for c in caches]
    else:
        caches = [torch.empty(256, row, device=dev) for _ in range(layers)]
        ptrs = [c.data_ptr() for c in caches]

    def step() -> None:
        cs = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with cs:
            h = x
            for li in range(layers):
                wq, wk, wv, wo = ws[li]
                q, k, v = h @ wq, h @ wk, h @ wv
                args_a = (cupy.uint64(ptrs[li]), cupy.uint64(k.data_ptr()), cupy.uint64(v.data_ptr()),
                          cupy.uint64(pos.data_ptr()), cupy.int32(hd))
                append_kv((max(1, hd // 256),), (256,), args_a)
                o = torch.empty(1, hd, device=dev)
                attend((heads,), (d,), (cupy.uint64(ptrs[li]), cupy.uint64(q.data_ptr()),
                                        cupy.uint64(scores.data_ptr()), cupy.uint64(o.data_ptr()),
                                        cupy.uint64(pos.data_ptr()), cupy.int32(heads),
                                        cupy.int32(d), cupy.int32(tmax)))
                h = torch.tanh(h + o @ wo)
            x.copy_(h)
            bump((1,), (1,), (cupy.uint64(pos.data_ptr()),))

    def capture() -> Any:
        # Warm up on a side stream (kernels loaded), then capture; the
        # counter is saved and restored around both.
        saved_x, saved_pos = x.clone(), pos.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        x.copy_(saved_x)
        pos.copy_(saved_pos)
        torch.cuda.synchronize()
        return graph

    graph = capture()
    captures = 1
    peak_used = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        need = i + 1
        if variant == "vmmbuf":
            for c in caches:
                if need > len(c):
                    c.resize(min(tmax, len(c) + 256))
        elif variant == "torch-doubling" and need > caches[0].shape[0]:
            n = caches[0].shape[0]
            grown = []
            for c in caches:
                new = torch.empty(min(tmax, 2 * n), row, device=dev)
                new[:n].copy_(c)
                grown.append(new)
            caches = grown
            ptrs = [c.data_ptr() for c in caches]
            del grown
            graph = capture()
            captures += 1
        graph.replay()
        if i % 512 == 511 or i == steps - 1:
            torch.cuda.synchronize()
            peak_used = max(peak_used, free0 - torch.cuda.mem_get_info()[0])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert int(pos.item()) == steps, f"counter {int(pos.item())} after {steps} steps"
    return {
        "variant": variant,
        "steps": steps,
        "steps_per_s": steps / dt,
        "peak_used_mib": peak_used / 2**20,
        "cache_max_mib": layers * tmax * row * 4 / 2**20,
        "cache_final_mib": layers * steps * row * 4 / 2**20,
        "captures": captures,
        "checksum": float(x.double().sum().item()),
        "finite": bool(torch.isfinite(x).all().item()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--tmax", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    if a.all:
        rows: List[Dict[str, Any]] = []
        for _ in range(a.repeats):
            for v in VARIANTS:
                cmd = [sys.executable, __file__, "--variant", v] + [
                    f"--{k}={getattr(a, k)}" for k in ("steps", "tmax", "layers", "heads", "d")]
                p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if p.returncode != 0:
                    sys.exit(f"{v} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                print(json.dumps(r), flush=True)
                rows.append(r)
        print(f"\n{a.steps} decode steps, {a.layers} layers, cache up to {a.tmax} tokens "
              f"({rows[0]['cache_max_mib']:.0f} MiB at most; {rows[0]['cache_final_mib']:.0f} MiB used)\n")
        print("| variant | steps/s | device memory at peak (MiB) | captures | checksum |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['steps_per_s']:.0f} | {r['peak_used_mib']:.0f} | "
                  f"{r['captures']} | {r['checksum']:.6f} |")
        sums = {r["checksum"] for r in rows}
        print(f"\nfinal states equal across variants: {len(sums) == 1}")
        return
    if not a.variant:
        ap.error("--variant or --all")
    r = run(a.variant, a.steps, a.tmax, a.layers, a.heads, a.d)
    print(json.dumps(r), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
