"""The traced figures quoted in the docs are those of ``benchmarks/results/trace_max_seq.json``,
and that file is what the library traces today.

``python -m benchmarks.trace_max_seq`` writes the JSON, with ``figures``: every documented number
by name (``h100x8.max_seq_len``, ``h100x8.max_seq_len_headroom``, ``h100x8.host_gib``, ...). A page
quotes one through a marker that the rendered page does not show:

    fits <!-- fig: h100x8.max_seq_len_headroom -->6,176,768 tokens (<!-- fig: ... -->6.18M) ...

and a fenced command that uses one is followed by ``<!-- fig-above: --seq-len=NAME -->``. The
number after a marker must be the figure at the precision shown (``6,176,768`` exactly,
``6.18M``, ``828K``, ``69.8`` GiB, ``0.35`` as a ratio). The last test traces the documented 8x
H100 recipe once at a short length (the generator's ``fingerprint``, recorded with the rows) and
compares its bytes with the file's, so a change of the library's memory makes this test ask for
the generator to be run again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results/trace_max_seq.json"
# every page that may quote a traced figure
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "simulations/README.md",
        ROOT / "benchmarks/README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]  # fmt: skip
)
_FIG_RE = re.compile(r"<!--\s*fig:\s*([\w.]+)\s*-->\**(\d[\d,]*(?:\.\d+)?[KM]?)")
_ABOVE_RE = re.compile(r"^<!--\s*fig-above:\s*(--[\w-]+)=([\w.]+)\s*-->\s*$", re.M)
_SCALE = {"": 1, "K": 1e3, "M": 1e6}


def _figures() -> dict[str, float]:
    return json.loads(RESULTS.read_text())["figures"]


def shown_as(value: float, shown: str) -> bool:
    """Is ``shown`` (``6,176,768``, ``6.18M``, ``828K``, ``69.8``) ``value`` at its precision?"""
    m = re.fullmatch(r"(\d[\d,]*(?:\.(\d+))?)([KM]?)", shown)
    if m is None:
        return False
    number, decimals, suffix = m.group(1), len(m.group(2) or ""), m.group(3)
    spec = f"{',' if ',' in number else ''}.{decimals}f"
    return format(value / _SCALE[suffix], spec) == number


def test_shown_as():  # the comparison itself, on hand-written cases
    assert shown_as(6_176_768, "6,176,768") and not shown_as(6_176_768, "6,184,960")
    assert shown_as(6_176_768, "6.18M") and not shown_as(6_176_768, "6.19M")
    assert shown_as(828_416, "828K") and shown_as(69.84, "69.8") and shown_as(0.354, "0.35")
    assert not shown_as(6_176_768, "6176769") and not shown_as(6_176_768, "6,176,77")
    assert not shown_as(69.84, "69.9") and not shown_as(828_416, "829K")


def _marked() -> list[tuple[str, str, str]]:
    """(where, name, shown) for every marked figure, inline and after a fenced command."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        rel = page.relative_to(ROOT).as_posix()
        for m in _FIG_RE.finditer(text):
            out.append((f"{rel}:{text.count(chr(10), 0, m.start()) + 1}", m[1], m[2]))
        for m in _ABOVE_RE.finditer(text):
            where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
            block = text[: m.start()].rstrip()
            assert block.endswith("```"), f"{where}: fig-above must follow a fenced block"
            block = block[block.rstrip("`").rstrip().rfind("```") :]
            flag = re.search(rf"{re.escape(m[1])}[ =](\S+)", block)
            assert flag, f"{where}: the block above has no {m[1]}"
            out.append((where, m[2], flag[1]))
    return out


def test_marked_figures_match_the_results():
    figures, marked = _figures(), _marked()
    assert len(marked) >= 10, "the docs lost their figure markers"
    bad = [
        f"{where}: {shown} is not {name} = {figures.get(name)}"
        for where, name, shown in marked
        if name not in figures or not shown_as(figures[name], shown)
    ]
    assert not bad, "re-run `python -m benchmarks.trace_max_seq` or fix the docs:\n" + "\n".join(
        bad
    )


def test_the_million_token_command_uses_the_headroom_length():
    names = {name for _, name, shown in _marked() if shown.isdigit()}
    assert "h100x8.max_seq_len_headroom" in names  # the documented --seq-len is marked


@pytest.mark.timeout(400)
def test_results_are_current():
    """The generator's fingerprint (one trace of the 8x H100 recipe at 131,072 tokens: seconds,
    where the documented length takes minutes) traced again gives the bytes the file records."""
    recorded = json.loads(RESULTS.read_text())["fingerprint"]
    cmd = recorded["command"].split()
    assert cmd[:3] == ["python", "-m", "simulations"], cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))  # fmt: skip
    out = subprocess.run(
        [sys.executable, *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    now = json.loads(out.stdout)
    assert (now["device_peak_bytes"], now["host_bytes"]) == (
        recorded["device_peak_bytes"],
        recorded["host_bytes"],
    ), "the library's memory changed: run `python -m benchmarks.trace_max_seq` again"
