"""Every Python snippet of the README and of docs/ runs as written (issue 43), each in a
fresh interpreter: those marked ``# needs: cuda`` on a GPU (skipped without
one, failed under VMMBUF_REQUIRE_GPU=1), the rest anywhere."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Tuple

import pytest

from conftest import _need, _torch_gpu_reason, run_script

ROOT = Path(__file__).resolve().parents[2]


def _snippets() -> List[Tuple[str, int, str]]:
    out = []
    names = ["README.md", "python/README.md"]
    names += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    for name in names:
        text = (ROOT / name).read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[: m.start()].count("\n") + 1
            out.append((name, line, m.group(1)))
    return out


SNIPPETS = _snippets()


def test_the_readme_has_snippets_for_the_host_and_the_gpu():
    assert any("# needs: cuda" not in code for _, _, code in SNIPPETS)
    assert any("# needs: cuda" in code for _, _, code in SNIPPETS)


@pytest.mark.parametrize("where,line,code", SNIPPETS,
                         ids=[f"{w}:{n}" for w, n, _ in SNIPPETS])
def test_a_readme_snippet_runs_as_written(where, line, code):
    if "# needs: cuda" in code:
        _need(_torch_gpu_reason())
    run_script(code, timeout=240)


def test_the_python_quickstart_runs():
    out = run_script((ROOT / "python/examples/quickstart.py").read_text(), timeout=240)
    assert "vmmbuf quickstart" in out
