"""The simulator against the real code: measured communication (gloo, world sizes 2 and 4) must
equal the prediction exactly; memory traced with fake tensors must be within 10%."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulations import _measure


@pytest.mark.parametrize("world_size", [2, 4])
def test_measured_attention_comm_equals_prediction(world_size):
    rows = _measure.measure(world_size)
    assert len(rows) == len(_measure.CASES[world_size])
    for case, pred, ranks in rows:
        assert len(ranks) == world_size
        assert _measure.compare(case, pred, ranks) == [], case.label()
    # the GQA cases with sp > kv heads replicate kv heads (K' > K): the bytes include them
    for case, pred, _ in rows:
        if case.sp > case.K:
            plain = case.B // case.dp * case.S // case.sp * (case.N + 2 * case.K)
            e = 4 if case.dtype == "fp32" else 2
            assert pred[0]["forward"]["bytes"] > (plain + case.B // case.dp * case.S // case.sp
                                                  * case.N) * case.H * e  # fmt: skip


TRACE = """
from simulations import _trace
cases = [_trace.TraceCase("llama3-8b", 16384, 1, 8, "full", n_layers=2),
         _trace.TraceCase("qwen3-4b", 8192, 2, 2, "none", n_layers=2)]
bad = [(c.label(), i) for c in cases for i in _trace.check(c) if i.status != "pass"]
assert not bad, bad
print("ok")
"""


def test_traced_memory_within_10_percent():
    # a fresh interpreter: the trace owns the (fake) default process group
    r = subprocess.run([sys.executable, "-c", TRACE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
