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
  ``notebooks/`` as in JupyterLab; two notebooks at a time, each in its own process) within its
  120 s budget, every cell succeeds (a failing cell,
  including the notebooks' own ``assert`` checks against the real library, fails the test), the
  execution produces at least one image output, and nothing is written into ``notebooks/``.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


_EXECUTE = """
import sys, time
import nbformat
sys.path.insert(0, sys.argv[1])
import sync
nb = nbformat.read(sys.argv[2], as_version=4)
t0 = time.perf_counter()
sync.execute(nb, cwd=sync.HERE, timeout_s=int(sys.argv[4]))  # raises CellExecutionError
elapsed = time.perf_counter() - t0
nbformat.write(nb, sys.argv[3])
print(elapsed)
"""


def _execute_copy(name: str, tmp: Path) -> tuple:
    """A clean copy of ``name`` executed headless in its own process (and kernel): the
    executed notebook, the seconds ``SYNC.execute`` took, and what went wrong if it failed."""
    import nbformat

    nb = copy.deepcopy(_read(name))
    for cell in nb.cells:  # start from a clean copy: outputs must come from this execution
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    src, dst = tmp / f"{name}.in.ipynb", tmp / f"{name}.out.ipynb"
    nbformat.write(nb, src)
    r = subprocess.run(
        [sys.executable, "-c", _EXECUTE, str(NOTEBOOK_DIR), str(src), str(dst), str(BUDGET_S)],
        capture_output=True, text=True, timeout=BUDGET_S + 100,
    )  # fmt: skip
    if r.returncode != 0:
        return None, None, r.stdout[-2000:] + r.stderr[-8000:]
    return nbformat.read(dst, as_version=4), float(r.stdout.strip().splitlines()[-1]), ""


@pytest.fixture(scope="module")
def executions(tmp_path_factory):
    """Every notebook executed two at a time (2 cores; a notebook's kernel is mostly one
    process): ``(listing before, {name: future})``, each test waits for its own."""
    for module in ("nbclient", "ipykernel", "ipywidgets", "matplotlib", "jupytext"):
        pytest.importorskip(module)
    tmp = tmp_path_factory.mktemp("executed")
    before = _listing()
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield before, {name: pool.submit(_execute_copy, name, tmp) for name in NAMES}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET_S + 120)  # its own run and, at most, the one beside it
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_headless(name, executions):
    before, futures = executions
    nb, elapsed, problem = futures[name].result()
    assert nb is not None, f"{name} failed to execute:\n{problem}"
    assert _images(nb) >= 1, f"{name} produced no figure"
    assert elapsed < BUDGET_S, f"{name} took {elapsed:.0f} s (budget {BUDGET_S} s)"
    assert _listing() == before, "a notebook wrote into notebooks/"
