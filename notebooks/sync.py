"""Write each notebook from its jupytext source, and execute it: ``python notebooks/sync.py``.

    python notebooks/sync.py                 # every notebook: read the .py, execute, write .ipynb
    python notebooks/sync.py 02 05           # only these (by number or name)
    python notebooks/sync.py --no-execute    # cells only (outputs dropped)

The percent-format sources ``notebooks/0N_name.py`` are what you edit (or edit the ``.ipynb`` in
JupyterLab with jupytext installed: the two are paired, ``formats: ipynb,py:percent``, and
``jupytext --sync notebooks/*.ipynb`` brings the other side up to date). The ``.ipynb`` files are
committed *with* their outputs so that GitHub and the docs site show them; ``tests/
test_notebooks.py`` checks that their cells equal the sources and executes a copy of each.
Execution is deterministic except for timings and throughput: workers are seeded, figures are PNGs
without a software tag, and cell ids, cell timing metadata and widget state are not left to chance.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL = "python3"
CELL_TIMEOUT_S = 120
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FORMATS = "ipynb,py:percent"


def names() -> list[str]:
    """The notebooks, by file name: ``01_mesh_and_placements``, ..."""
    return sorted(p.stem for p in HERE.glob("[0-9][0-9]_*.py"))


def read_source(name: str):
    """The notebook ``name`` from its ``.py`` source (cells only, no outputs), ids stable."""
    import jupytext

    nb = jupytext.read(HERE / f"{name}.py", fmt="py:percent")
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:02d}"  # stable ids: no churn in diffs
        cell.metadata = {}
    nb.metadata = {
        "jupytext": {"formats": FORMATS},
        "kernelspec": {"name": KERNEL, "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def execute(nb, cwd: Path = HERE, timeout_s: int = CELL_TIMEOUT_S) -> float:
    """Execute ``nb`` in place (kernel ``python3``, working directory ``cwd``); returns seconds.

    The kernel runs in ``cwd`` (``notebooks/``, so ``import tutorial`` works). Widget state and
    cell timing metadata are not stored (the docs site must not load widget scripts from a CDN,
    and timestamps would churn every run).
    """
    from nbclient import NotebookClient

    t0 = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(cwd)}},
        store_widget_state=False,
        record_timing=False,
    ).execute()
    nb.metadata["language_info"] = {"name": "python"}  # no interpreter version: no churn
    strip_widget_views(nb)
    return time.perf_counter() - t0


def strip_widget_views(nb) -> None:
    """Drop widget views from outputs, keeping their text fallback.

    A widget view only means something to a live kernel, and its random model id would change
    on every execution; the figure next to it is an ordinary image output and stays.
    """
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            out.get("data", {}).pop(WIDGET_VIEW, None)


def _select(keys: list[str]) -> list[str]:
    if not keys:
        return names()
    out = []
    for k in keys:
        match = [n for n in names() if n == k or n.startswith(k)]
        if not match:
            raise SystemExit(f"no notebook matches {k!r}; choose from {', '.join(names())}")
        out += match
    return out


def main(argv: list[str] | None = None) -> int:
    import nbformat

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="notebooks (number or name); default: all")
    p.add_argument("--no-execute", action="store_true", help="write the cells only")
    args = p.parse_args(argv)
    for name in _select(args.names):
        nb = read_source(name)
        if not args.no_execute:
            print(f"{name}: executed in {execute(nb):.0f} s", flush=True)
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print(f"wrote notebooks/{name}.ipynb", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
