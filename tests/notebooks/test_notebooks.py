"""The teaching notebooks: jupytext sources paired with committed, executed ``.ipynb`` files.

Decision on outputs: the notebooks in ``notebooks/`` are committed **with** their outputs (figures
as PNG images, text, the streamed training log), so GitHub and the docs site (mkdocs-jupyter with
``execute: false``) show them without running anything. Their source is the percent-format
``notebooks/0N_name.py`` (paired: ``formats: ipynb,py:percent``); ``python notebooks/sync.py``
rewrites and re-executes the ``.ipynb`` from it (seeded workers, PNGs without a software tag, no
cell timestamps, no widget state, so re-running changes little besides timings and throughput).

These tests never write to ``notebooks/``:

* every ``.ipynb`` has a ``.py`` source and its cells are exactly the source's cells (read with
  jupytext), so the two cannot drift apart; the sources pass ``ruff check`` and ``ruff format``;
* the committed outputs are there: at least one image per notebook, no errors, no widget state
  or widget views (which would need a live kernel, or widget scripts from a CDN on the site);
* every notebook executes headless with nbclient (kernel ``python3``, a copy, working directory
  ``notebooks/`` as in JupyterLab) within its 120 s budget, every cell succeeds (a failing cell,
  including the notebooks' own ``assert`` checks against the real library, fails the test), the
  execution produces at least one image output, and nothing is written into ``notebooks/``.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
BUDGET_S = 120  # per notebook, on 2 CPU cores


def _sync_module():
    spec = importlib.util.spec_from_file_location("notebooks_sync", NOTEBOOK_DIR / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SYNC = _sync_module()
NAMES = SYNC.names()


def _read(name: str):
    nbformat = pytest.importorskip("nbformat")
    return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


def _images(nb) -> int:
    return sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


def _listing() -> set[Path]:
    return {p for p in NOTEBOOK_DIR.rglob("*") if "__pycache__" not in p.parts}


def test_every_notebook_has_a_source_and_a_number():
    on_disk = sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert on_disk == NAMES, "each notebooks/0N_name.ipynb needs its notebooks/0N_name.py"
    assert [n[:2] for n in NAMES] == ["01", "02", "03", "04", "05"]


@pytest.mark.parametrize("name", NAMES)
def test_committed_cells_equal_the_jupytext_source(name):
    pytest.importorskip("jupytext")
    nb = _read(name)
    want = SYNC.read_source(name)
    assert [(c.cell_type, c.source) for c in nb.cells] == [
        (c.cell_type, c.source) for c in want.cells
    ], f"notebooks/{name}.ipynb differs from notebooks/{name}.py: run python notebooks/sync.py"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent"  # paired in JupyterLab


def test_sources_pass_ruff():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    files = [str(NOTEBOOK_DIR / f"{n}.py") for n in NAMES] + [str(NOTEBOOK_DIR)]
    for args in (["check"], ["format", "--check"]):
        r = subprocess.run([ruff, *args, *files], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_committed_with_outputs(name):
    nb = _read(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "commit the notebook executed (sync.py)"
    assert _images(nb) >= 1
    assert "widgets" not in nb.metadata, "widget state must not be stored"
    for cell in code:
        for out in cell.outputs:
            assert out.output_type != "error", f"{name}: an error output is committed"
            assert SYNC.WIDGET_VIEW not in out.get("data", {})


@pytest.mark.slow
@pytest.mark.timeout(BUDGET_S + 120)  # kernel start and teardown on top of the budget
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_headless(name):
    for module in ("nbclient", "ipykernel", "ipywidgets", "matplotlib", "jupytext"):
        pytest.importorskip(module)
    nb = copy.deepcopy(_read(name))
    for cell in nb.cells:  # start from a clean copy: outputs must come from this execution
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    before = _listing()
    t0 = time.perf_counter()
    SYNC.execute(nb, cwd=NOTEBOOK_DIR, timeout_s=BUDGET_S)  # raises CellExecutionError
    elapsed = time.perf_counter() - t0
    assert _images(nb) >= 1, f"{name} produced no figure"
    assert elapsed < BUDGET_S, f"{name} took {elapsed:.0f} s (budget {BUDGET_S} s)"
    assert _listing() == before, "a notebook wrote into notebooks/"
