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
from typing import Dict, List, Tuple

LINE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
# pytest-xdist's -v lines: "[gw3] PASSED path::test" (or "[gw3] [ 12%] PASSED ...").
XLINE = re.compile(r"^\[gw\d+\](?: \[\s*\d+%\])? (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+::\S.*?)\s*$")
CLOSING = re.compile(r"^=+ .*\b(passed|failed|error|skipped)\b.* in [0-9.]+s")


def outcomes(path: str) -> Tuple[Dict[str, str], bool, str]:
    tests: Dict[str, str] = {}
    closed, last = False, ""
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            x = XLINE.match(line)
            name, outcome = (m.group(1), m.group(2)) if m else (x.group(2), x.group(1)) if x else (None, None)
            if name is not None:
                # A test reported twice (call failed, then teardown error)
                # keeps its worst outcome.
                prev = tests.get(name)
                if prev is None or outcome in ("FAILED", "ERROR"):
                    tests[name] = outcome
            if CLOSING.match(line.strip()):
                closed, last = True, line.strip()
            if "Fatal Python error" in line or "Segmentation fault" in line:
                last = line.strip()
    return tests, closed, last


def table(title: str, keys: List[str], a: Dict[str, str], b: Dict[str, str],
          names: Tuple[str, str]) -> None:
    """Prints `title` and, if there are any, each test's two outcomes."""
    print(title)
    print()
    if keys:
        print(f"| test | {names[0]} | {names[1]} |")
        print("|---|---|---|")
        for k in keys:
            print(f"| `{k}` | {a.get(k, 'not reached')} | {b.get(k, 'not reached')} |")
        print()


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
    both = set(a) & set(b)
    diff = sorted(k for k in both if a[k] != b[k])
    only = sorted((set(a) | set(b)) - both)
    table(f"{len(diff)} tests differ (of {len(both)} that both runs reached):", diff, a, b, names)
    # A run cut by its time cap (or a crash) never reaches some tests; they
    # are listed apart, since their outcome is unknown rather than different.
    table(f"{len(only)} tests reached by one run only:", only, a, b, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
