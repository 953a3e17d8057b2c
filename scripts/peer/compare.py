#!/usr/bin/env python3
"""Per-test outcomes of one suite under two allocators (pytest -v logs), and
the differences: every test whose outcome under the second differs from the
first, and whether either run ended without pytest's closing line (a crash).

Usage: compare.py BASELINE.log OTHER.log [--names BASELINE OTHER] > diff.md
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Dict, Tuple

LINE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
CLOSING = re.compile(r"^=+ .*\b(passed|failed|error|skipped)\b.* in [0-9.]+s")


def outcomes(path: str) -> Tuple[Dict[str, str], bool, str]:
    tests: Dict[str, str] = {}
    closed, last = False, ""
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                # A test reported twice (call failed, then teardown error)
                # keeps its worst outcome.
                prev = tests.get(m.group(1))
                if prev is None or m.group(2) in ("FAILED", "ERROR"):
                    tests[m.group(1)] = m.group(2)
            if CLOSING.match(line.strip()):
                closed, last = True, line.strip()
            if "Fatal Python error" in line or "Segmentation fault" in line:
                last = line.strip()
    return tests, closed, last


def main() -> int:
    args = sys.argv[1:]
    names = ("baseline", "vmmbuf")
    if "--names" in args:
        i = args.index("--names")
        names = (args[i + 1], args[i + 2])
        args = args[:i] + args[i + 3:]
    (a, a_closed, a_last), (b, b_closed, b_last) = outcomes(args[0]), outcomes(args[1])
    print(f"| run | tests | outcomes | ended |")
    print("|---|---|---|---|")
    for name, t, closed, last in ((names[0], a, a_closed, a_last), (names[1], b, b_closed, b_last)):
        c = Counter(t.values())
        summary = ", ".join(f"{k.lower()} {v}" for k, v in sorted(c.items()))
        print(f"| {name} | {len(t)} | {summary} | {'closing line: ' + last if closed else 'NO closing line: ' + last} |")
    print()
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    print(f"{len(diff)} tests differ:")
    print()
    if diff:
        print(f"| test | {names[0]} | {names[1]} |")
        print("|---|---|---|")
        for k in diff:
            print(f"| `{k}` | {a.get(k, 'not run')} | {b.get(k, 'not run')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
