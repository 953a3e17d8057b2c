"""Comparing two allocators step by step, for scripts/bench/dist_train.py and
scripts/bench/torch_allocators.py: every run draws the same shapes in the same
order (one seed), and a step's time moves with its shape (up to 2x), which a
median over steps mixes with the allocator. So step i of one run is compared
with step i of the reference's run in the same round."""

from __future__ import annotations

import statistics
from typing import Iterable, List, Optional, Sequence, Tuple


def step_ratios(pairs: Iterable[Tuple[Sequence[float], Sequence[float]]],
                skip: int) -> Optional[Tuple[float, float, float, float, int]]:
    """``pairs``: per round, (this allocator's step times, the reference's).
    After the first ``skip`` steps of each: the median of the per-step ratios,
    its lower and upper quartiles, the ratio of the summed time (what a run
    of these steps costs, growth included), and the number of steps; None
    with fewer than 4."""
    per: List[float] = []
    num = den = 0.0
    for mine, theirs in pairs:
        mine, theirs = mine[skip:], theirs[skip:]
        per += [x / y for x, y in zip(mine, theirs) if y > 0]
        num, den = num + sum(mine[:len(theirs)]), den + sum(theirs[:len(mine)])
    if len(per) < 4 or den <= 0:
        return None
    q = statistics.quantiles(per, n=4)
    return q[1], q[0], q[2], num / den, len(per)
