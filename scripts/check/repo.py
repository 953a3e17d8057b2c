#!/usr/bin/env python3
"""The repository's own bars, checked in CI (`.ci/run`):

- README.md at most 250 lines, BENCHMARKS.md at most 400, RELIABILITY.md
  at most 300: each states the current truth briefly (history goes to
  CHANGELOG.md and git);
- benches/results/ holds at most 30 files (data under stable names by
  benchmark and GPU, each listed in benches/results/index.json);
- no tracked path is named after an issue, a review round or a dated
  session label (`issue42`, `redteam4`, `2026-11-22`, `1128g`).

    python3 scripts/check/repo.py        # exit 1 with every breach listed
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"README.md": 250, "BENCHMARKS.md": 400, "RELIABILITY.md": 300}
MAX_RESULTS = 30
BAD_NAME = re.compile(r"issue[-_]?\d|redteam|round\d|session|\d{4}-\d{2}-\d{2}|(?<![0-9a-f])11[23]\d[a-h](?![0-9a-z])",
                      re.IGNORECASE)


def breaches() -> list[str]:
    out = []
    for name, limit in LIMITS.items():
        n = (ROOT / name).read_text().count("\n")
        if n > limit:
            out.append(f"{name} has {n} lines (at most {limit})")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    results = [p for p in tracked if p.startswith("benches/results/")]
    if len(results) > MAX_RESULTS:
        out.append(f"benches/results/ holds {len(results)} files (at most {MAX_RESULTS})")
    for p in tracked:
        if BAD_NAME.search(p):
            out.append(f"{p}: a path named after an issue, a round or a dated label")
    return out


def main() -> int:
    found = breaches()
    for b in found:
        print(b, file=sys.stderr)
    if found:
        return 1
    print("repository bars hold: " + ", ".join(f"{k} <= {v} lines" for k, v in LIMITS.items())
          + f", benches/results/ <= {MAX_RESULTS} files, no path named after an issue")
    return 0


if __name__ == "__main__":
    sys.exit(main())
