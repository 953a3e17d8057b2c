"""Announced captures without a GPU: the hook's counting around a stand-in
graph class, in a fresh interpreter each (the plug-in's count is
process-wide)."""

from __future__ import annotations

import json

from conftest import run_script

_HOOK = """
    import json
    from vmmbuf import _captures

    capturing = {{}}        # stream -> captured now

    class Graph:
        def __init__(self, stream, fail_begin=False, fail_end=None):
            self.stream, self.fail_begin, self.fail_end = stream, fail_begin, fail_end
        def capture_begin(self, pool=None):
            capturing[self.stream] = True
            if self.fail_begin:
                raise RuntimeError("begin failed")
        def capture_end(self):
            if self.fail_end == "before":      # refused, still capturing
                raise RuntimeError("wrong stream")
            capturing[self.stream] = False
            if self.fail_end == "after":       # ended, with an error
                raise RuntimeError("invalidated")

    current = ["s0"]
    out = {{"before": _captures.state()}}
    out["hooked"] = _captures.hook(Graph, lambda: current[0], lambda s: capturing.get(s, False))
    out["again"] = _captures.hook(Graph, lambda: current[0], lambda s: capturing.get(s, False))
    out["announced"] = _captures.state()
    steps = {steps!r}
    graphs = {{}}
    for name, op in steps:
        if op == "new":
            graphs[name] = Graph(name)
        elif op.startswith("new:"):
            kw = {{"begin": dict(fail_begin=True), "before": dict(fail_end="before"),
                  "after": dict(fail_end="after")}}[op[4:]]
            graphs[name] = Graph(name, **kw)
        elif op in ("begin", "end"):
            current[0] = name
            try:
                getattr(graphs[name], "capture_" + op)()
                r = "ok"
            except RuntimeError as e:
                r = str(e)
            out[name + "." + op] = [r, list(_captures.state())]
    print(json.dumps(out))
"""


def _run(steps: list) -> dict:
    return json.loads(run_script(_HOOK.format(steps=steps)).strip().splitlines()[-1])


def test_nothing_is_announced_until_a_class_is_hooked_and_each_capture_is_counted():
    r = _run([("a", "new"), ("b", "new"), ("a", "begin"), ("b", "begin"), ("a", "end"),
              ("b", "end")])
    assert r["before"] == [False, 0], "unhooked: every call asks"
    assert r["hooked"] and r["again"]
    assert r["announced"] == [True, 0]
    assert r["a.begin"] == ["ok", [True, 1]]
    assert r["b.begin"] == ["ok", [True, 2]]
    assert r["a.end"] == ["ok", [True, 1]], "one of two still under way"
    assert r["b.end"] == ["ok", [True, 0]]


def test_a_second_hook_does_not_count_twice():
    r = _run([("a", "new"), ("a", "begin"), ("a", "end")])
    assert r["a.begin"][1] == [True, 1] and r["a.end"][1] == [True, 0]


def test_every_doubt_keeps_the_count_up():
    r = _run([("x", "new:begin"), ("x", "begin"), ("y", "new:before"), ("y", "begin"),
              ("y", "end"), ("z", "new:after"), ("z", "begin"), ("z", "end"), ("w", "new"),
              ("w", "end")])
    # A begin that raised may have begun: counted, and never brought down.
    assert r["x.begin"] == ["begin failed", [True, 1]]
    assert r["y.begin"] == ["ok", [True, 2]]
    # An end refused while the stream is still captured: still counted.
    assert r["y.end"] == ["wrong stream", [True, 2]]
    assert r["z.begin"] == ["ok", [True, 3]]
    # An end that raised after the capture ended (an invalidated capture):
    # its stream is asked, and the count comes down.
    assert r["z.end"] == ["invalidated", [True, 2]]
    # The end of a capture never begun through the hook changes nothing.
    assert r["w.end"] == ["ok", [True, 2]]


def test_a_class_that_cannot_be_hooked_announces_nothing():
    out = run_script("""
        import json
        from vmmbuf import _captures

        class Frozen(type):
            def __setattr__(cls, name, value):
                raise TypeError("read-only class")

        class Graph(metaclass=Frozen):
            def capture_begin(self):
                pass
            def capture_end(self):
                pass

        class NoCapture:
            pass

        begin = Graph.capture_begin
        r = [_captures.hook(Graph, lambda: 0, lambda s: False),
             _captures.hook(NoCapture, lambda: 0, lambda s: False),
             list(_captures.state()), Graph.capture_begin is begin]
        print(json.dumps(r))
    """)
    assert json.loads(out.strip().splitlines()[-1]) == [False, False, [False, 0], True]


def test_ending_a_capture_none_began_is_refused():
    out = run_script("""
        import json
        from vmmbuf import _native, errors
        try:
            _native.capture_ends()
            r = "accepted"
        except errors.InvalidArgumentError as e:
            r = str(e)
        print(json.dumps([r, list(_native.captures())]))
    """)
    r = json.loads(out.strip().splitlines()[-1])
    assert "none announced as begun" in r[0] and r[1] == [False, 0], r
