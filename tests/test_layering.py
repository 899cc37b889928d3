"""The layering, by an AST scan of every import (any form, at any depth, inside functions too).

* The library (``dtensor_ulysses/``) never imports ``simulations``, matplotlib or ipywidgets:
  teaching code lives beside the notebooks (``notebooks/tutorial/``), simulator reports in
  ``simulations/report.py``.
* ``simulations/`` imports torch only in its measurement modules (listed here); everywhere else it
  may use only library modules that are themselves torch-free, so ``import simulations`` and the
  simulator CLI never need torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "dtensor_ulysses"
SIMULATIONS = ROOT / "simulations"
NOT_IN_LIBRARY = ("simulations", "matplotlib", "ipywidgets")
MEASUREMENT_MODULES = {
    "simulations/_measure.py",
    "simulations/_trace.py",
    "simulations/trace_check.py",
}


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``; ``from a import b`` gives ``a`` and
    ``a.b`` (``b`` may be a submodule); relative imports are resolved against the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (  # importlib.import_module("name") / __import__("name") with a literal name
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def _top(module: str) -> str:
    return module.split(".")[0]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_scan_sees_every_import_form(tmp_path):
    probe = tmp_path / "dtensor_ulysses" / "probe.py"
    probe.parent.mkdir()
    probe.write_text(
        "import a.b as c\nfrom d import e\nfrom . import f\nfrom .g import h\n"
        "def k():\n    import matplotlib.pyplot\n    importlib.import_module('simulations')\n"
    )
    found = {m for _, m in imports(probe, root=tmp_path)}
    assert {"a.b", "d", "d.e", "dtensor_ulysses", "dtensor_ulysses.f", "dtensor_ulysses.g"} <= found
    assert {"dtensor_ulysses.g.h", "matplotlib.pyplot", "simulations"} <= found


def test_library_never_imports_simulations_matplotlib_or_ipywidgets():
    bad = [
        f"{_rel(path)}:{line} imports {module}"
        for path in sorted(LIBRARY.rglob("*.py"))
        for line, module in imports(path)
        if _top(module) in NOT_IN_LIBRARY
    ]
    assert not bad, "the library must not import teaching or simulator code:\n" + "\n".join(bad)


def _library_module_path(module: str) -> Path | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _torch_imports(path: Path, seen: set[Path]) -> list[str]:
    """torch imports of ``path`` and, transitively, of the library modules it imports."""
    if path in seen:
        return []
    seen.add(path)
    found = []
    for line, module in imports(path):
        if _top(module) == "torch":
            found.append(f"{_rel(path)}:{line} imports {module}")
        elif _top(module) == "dtensor_ulysses":
            target = _library_module_path(module)
            if target is not None and target.name != "__init__.py":
                found += _torch_imports(target, seen)
    return found


def test_simulations_import_torch_only_in_measurement_modules():
    for name in MEASUREMENT_MODULES:
        assert (ROOT / name).is_file(), f"{name} is listed as a measurement module but is gone"
    bad = []
    for path in sorted(SIMULATIONS.rglob("*.py")):
        if _rel(path) not in MEASUREMENT_MODULES:
            bad += _torch_imports(path, set())
    assert not bad, (
        "outside " + ", ".join(sorted(MEASUREMENT_MODULES)) + " simulations/ must be torch-free "
        "(directly and through the library modules it imports):\n" + "\n".join(bad)
    )


@pytest.mark.timeout(60)
def test_importing_the_simulator_does_not_import_torch():
    code = (
        "import sys, simulations, simulations.cli, simulations.report, simulations.validate; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_public_names_survive_importing_every_submodule():
    """A submodule named like a public function would replace the function on the package as
    soon as it is imported (``du.parallelize`` once did); in a fresh interpreter, import every
    submodule first, then check that each public name is not a module."""
    code = (
        "import importlib, pkgutil, types, dtensor_ulysses as du\n"
        "for m in pkgutil.iter_modules(du.__path__):\n"
        "    importlib.import_module('dtensor_ulysses.' + m.name)\n"
        "bad = [n for n in du.__all__ if isinstance(getattr(du, n), types.ModuleType)]\n"
        "assert not bad, bad\n"
    )
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
