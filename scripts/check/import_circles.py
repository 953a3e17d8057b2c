#!/usr/bin/env python3
"""Import circles among vmmbuf's modules: every `crate::` path in
src/ (comments stripped; names the crate root re-exports mapped to the
module that defines them) is an edge from the module of the file to the
module it names; `backend::cuda` and `backend::host` count as modules of
their own. Prints the strongly connected components of more than one
module (none is the goal) and exits 1 if there is any besides the backend
module sealing its own children.

Usage: scripts/check/import_circles.py   (from the repository root)
"""
from __future__ import annotations

import collections
import glob
import os
import re
import sys
from typing import Dict, List, Set


def node(path: str) -> str:
    parts = os.path.relpath(path, "src").replace(".rs", "").split("/")
    if parts[0] == "backend" and len(parts) > 1 and parts[1] in ("cuda", "host"):
        return "backend::" + parts[1]
    return parts[0]


def root_names() -> Dict[str, str]:
    names: Dict[str, str] = {}
    lib = open("src/lib.rs").read()
    for m in re.finditer(r"pub use (?:crate::)?([a-z_:]+)::\{?([^;]+?)\}?;", lib):
        mod = m.group(1).split("::")
        where = "backend::" + mod[1] if mod[:1] == ["backend"] and len(mod) > 1 and mod[1] in ("cuda", "host") else mod[0]
        for name in re.split(r"[,\s]+", m.group(2)):
            if name[:1].isupper():
                names[name] = where
    return names


def edges() -> Dict[str, Set[str]]:
    names = root_names()
    deps: Dict[str, Set[str]] = collections.defaultdict(set)
    for f in glob.glob("src/**/*.rs", recursive=True):
        n = node(f)
        if n == "lib":
            continue
        text = re.sub(r"//[^\n]*", "", open(f).read())
        for m in re.finditer(r"crate::([A-Za-z_]+)(?:::(cuda|host)\b)?", text):
            t = m.group(1)
            if t == "backend" and m.group(2):
                t = "backend::" + m.group(2)
            elif t in ("cuda", "host"):
                t = "backend::" + t
            elif t[:1].isupper():
                t = names.get(t, "")
            if t and t != n:
                deps[n].add(t)
    return deps


def circles(deps: Dict[str, Set[str]]) -> List[List[str]]:
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in deps.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(deps):
        if v not in index:
            strong(v)
    return out


def main() -> int:
    found = circles(edges())
    # backend/mod.rs seals its own children's types: a parent naming its
    # child, not two modules leaning on each other.
    real = [c for c in found if not all(m == "backend" or m.startswith("backend::") for m in c)]
    for c in found:
        print(("circle: " if c in real else "parent and child: ") + " <-> ".join(c))
    print(f"{len(real)} import circles")
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
