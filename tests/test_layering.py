"""The layering, by an AST scan of every import (any form, at any depth, inside functions too).

* **Layers**: the library is a stack of subpackages (:data:`LAYERS`, bottom first); a module
  imports only from its own subpackage and the layers below it.
* **No import cycles** among the library's files (``if TYPE_CHECKING:`` blocks, which never run,
  left out), and **no private module or private name** (``_x``) imported from outside the folder
  that owns it.
* **The model never imports ``torch.distributed``**, not even through another module: the
  import-time closure of ``models/llama.py``, ``models/layers.py`` and ``models/loss.py``.
* The library (``dtensor_ulysses/``) never imports ``simulations``, matplotlib or ipywidgets:
  teaching code lives beside the notebooks (``notebooks/tutorial/``), simulator reports in
  ``simulations/report.py``.
* ``simulations/`` imports torch only in its measurement modules (listed here); everywhere else it
  may use only library modules that are themselves torch-free, so ``import simulations`` and the
  simulator CLI never need torch.
* **The recipe travels as one object**: the parallel option set (five or more of
  :data:`OPTION_NAMES` in one function signature, call, literal or class body) is spelled out in
  at most :data:`MAX_OPTION_PLACES` places of the library; the mesh's axis names (``"dp"``,
  ``"sp"``, ``"ring"``) are string literals on at most :data:`MAX_AXIS_LINES` lines outside
  ``plan/splits.py``, which names them once.

Each checker is also run on a small synthetic tree that breaks its rule, so none can pass by
seeing nothing.
"""

from __future__ import annotations

import ast
import functools
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

# The layer contract, bottom first: a unit (a subpackage, or a module in the package root) imports
# only from itself and from units of lower layers. The root's private helpers serve every layer;
# the root __init__ (the lazy ``du.*`` facade) sits under the tools that use it.
LAYERS: list[set[str]] = [
    {"_torch_private", "_exit", "_public", "_file_modes", "_safe_pickle"},
    {"plan"},  # torch-free: splits, presets, hardware, preflight (the simulator imports only this)
    {"comm", "memory", "debug"},
    {"attention", "data"},
    {"models"},
    {"parallel"},
    # the Hugging Face door, by concern: its batch and data helpers (hf/*.py), the model side,
    # the trainers on top (never the reverse), then its facade (hf/__init__.py)
    {"hf"},
    {"hf.models"},
    {"hf.trainers"},
    {"hf.__init__"},
    {"train"},
    {"__init__"},
    {"memtrace", "demo", "launch"},
]
THE_MODEL = ("models/llama.py", "models/layers.py", "models/loss.py")
# the built-in model's train and eval path (``python -m dtensor_ulysses.train`` without
# --hf-model): never imports dtensor_ulysses.hf or transformers at import time; the one slicer
# lives in data/batch.py, evaluation in train/evaluation.py (the sums in parallel/global_loss.py)
BUILTIN_TRAIN_PATH = (
    "train/loop.py", "train/evaluation.py", "train/checks.py", "train/spec.py",
    "data/batch.py", "parallel/global_loss.py", "parallel/mesh.py",
)  # fmt: skip


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports(
    path: Path, root: Path = ROOT, *, runtime: bool = False, import_time: bool = False
) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``; ``from a import b`` gives ``a`` and
    ``a.b`` (``b`` may be a submodule); relative imports are resolved against the package.

    ``runtime``: leave out ``if TYPE_CHECKING:`` blocks (they never run). ``import_time``: only
    the imports that run when the module is imported (not inside functions or classes' methods).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if (runtime or import_time) and _is_type_checking(node):
            return
        if import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif (  # importlib.import_module("name") / __import__("name") with a literal name
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def imported_names(path: Path, root: Path = ROOT) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` for every ``from module import name`` in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out += [(node.lineno, base, alias.name) for alias in node.names]
    return out


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The library file that ``import module`` runs last (a module, or a package's
    ``__init__``), or None outside the library."""
    parts = module.split(".")
    if parts[0] != "dtensor_ulysses":
        return None
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


# subpackages whose folders are floors of their own: ``hf/models/...`` is unit ``hf.models``,
# ``hf/batch.py`` unit ``hf``, ``hf/__init__.py`` (the facade above its floors) ``hf.__init__``
FLOORED = ("hf",)


def unit(path: Path, root: Path = ROOT) -> str:
    """The layer unit of a library file: its subpackage (a floor of a floored one), or its own
    name in the package root."""
    parts = path.relative_to(root / "dtensor_ulysses").parts
    if len(parts) == 1:
        return Path(parts[0]).stem
    if parts[0] in FLOORED:
        if len(parts) > 2:
            return f"{parts[0]}.{parts[1]}"
        if parts[1] == "__init__.py":
            return f"{parts[0]}.__init__"
    return parts[0]


def library_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "dtensor_ulysses").rglob("*.py"))


def upward_imports(root: Path = ROOT) -> list[str]:
    """Imports from a unit into a unit of a higher (or the same but another) layer."""
    layer = {u: i for i, units in enumerate(LAYERS) for u in units}
    bad = []
    for path in library_files(root):
        me = unit(path, root)
        for line, module in imports(path, root):
            target = module_file(module, root)
            if target is None or target == path:
                continue
            other = unit(target, root)
            if other != me and layer.get(other, len(LAYERS)) >= layer.get(me, -1):
                bad.append(f"{_rel(path, root)}:{line} ({me}, layer {layer.get(me)}) imports "
                           f"{module} ({other}, layer {layer.get(other)})")  # fmt: skip
    return bad


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected groups of two or more library files (runtime imports, any depth)."""
    files = library_files(root)
    edges = {
        f: {t for _, m in imports(f, root, runtime=True) if (t := module_file(m, root)) and t != f}
        for f in files
    }
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    groups: list[list[str]] = []

    def connect(v: Path) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(_rel(w, root))
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for f in files:
        if f not in index:
            connect(f)
    return groups


# the library modules that may import a module whose name is computed, and why: the facades'
# lazy map (their names are the TYPE_CHECKING imports the scan reads), flash-attn's modules,
# the checkpoint unpickler's allow-list (exact module and name, nothing of the library)
DYNAMIC_IMPORTS = {"_public.py", "attention/_flash_seam.py", "_safe_pickle.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def string_named_modules(root: Path = ROOT) -> list[str]:
    """Library modules named by a string (a table of ``"dtensor_ulysses.x.y"`` names to load,
    ``import_module`` of one), which the import scan cannot see as an arrow; and computed
    imports outside :data:`DYNAMIC_IMPORTS`."""
    bad = []
    for path in library_files(root):
        rel = path.relative_to(root / "dtensor_ulysses").as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and node.value.startswith("dtensor_ulysses.")
                and all(part.isidentifier() for part in node.value.split("."))
                and module_file(node.value, root) is not None
            ):
                bad.append(f"{_rel(path, root)}:{node.lineno} names the module {node.value!r}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None))
                in ("import_module", "__import__")
                and node.args
                and not isinstance(node.args[0], ast.Constant)
                and rel not in DYNAMIC_IMPORTS
            ):
                bad.append(f"{_rel(path, root)}:{node.lineno} imports a computed module name")
    return bad


def _owner(path: Path) -> Path:
    return path.parent


def private_crossings(root: Path = ROOT) -> list[str]:
    """Private modules (``_x.py``) and private names (``_x``) imported from outside the folder
    that owns them (its subtree)."""
    bad = []
    for path in library_files(root):
        for line, module in imports(path, root):
            target = module_file(module, root)
            if target is None or target.name == "__init__.py" or not target.name.startswith("_"):
                continue
            if not path.is_relative_to(_owner(target)):
                bad.append(f"{_rel(path, root)}:{line} imports the private module {module}")
        for line, module, name in imported_names(path, root):
            target = module_file(module, root)
            if target is None or not name.startswith("_") or name.startswith("__"):
                continue
            if module_file(f"{module}.{name}", root) not in (None, target):
                continue  # a submodule: judged above
            if not path.is_relative_to(_owner(target)):
                bad.append(f"{_rel(path, root)}:{line} imports the private name {name} of {module}")
    return bad


def import_time_closure(paths: list[Path], root: Path = ROOT) -> list[tuple[Path, int, str]]:
    """Every ``(file, line, module)`` imported when ``paths`` are imported: their module-level
    imports, and those of the library files (packages' ``__init__`` first) they reach."""
    seen: set[Path] = set()
    out = []
    todo = list(paths)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        rel = path.relative_to(root)
        todo += [root.joinpath(*rel.parts[:n], "__init__.py") for n in range(1, len(rel.parts))]
        for line, module in imports(path, root, import_time=True):
            out.append((path, line, module))
            target = module_file(module, root)
            if target is not None:
                todo.append(target)
    return out


# The parallel recipe's options, written here independently of the library (a test holds them
# equal to ParallelOptions' fields), and the most places that may spell five or more of them.
OPTION_NAMES = frozenset({
    "activation_checkpointing", "offload_activations", "offload_params", "offload_optimizer",
    "head_chunks", "overlap_comm", "compile", "attention_backend", "allow_uneven_heads",
    "tiled_loss", "loss_chunk_tokens", "tiled_mlp", "mlp_chunk_tokens", "mixed_precision",
})  # fmt: skip
SPELLED_OUT = 5  # this many option names in one place spell the set out
MAX_OPTION_PLACES = 5
AXIS_NAMES = frozenset({"dp", "sp", "ring"})
AXES_HOME = "dtensor_ulysses/plan/splits.py"
MAX_AXIS_LINES = 2

_LITERALS = (ast.Tuple, ast.List, ast.Set)


def _literal_strings(node: ast.AST) -> list[str]:
    """The string constants of a tuple / list / set literal, nested literals included (a table
    of pairs spells its names too)."""
    out = []
    for elt in getattr(node, "elts", []):
        if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
            out.append(elt.value)
        elif isinstance(elt, _LITERALS):
            out += _literal_strings(elt)
    return out


def _spelled_names(node: ast.AST, parent: ast.AST | None) -> tuple[str, list[str]] | None:
    """``(kind, names)`` a node spells, for the kinds that can spell the option set."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        return "signature", [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if isinstance(node, ast.Call):
        return "call", [k.arg for k in node.keywords if k.arg]
    if isinstance(node, ast.Dict):
        keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
        return "dict literal", [k for k in keys if isinstance(k, str)]
    if isinstance(node, _LITERALS) and not isinstance(parent, _LITERALS):  # outermost only
        return f"{type(node).__name__.lower()} literal", _literal_strings(node)
    if isinstance(node, ast.ClassDef):
        names = []
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names.append(stmt.target.id)
            elif isinstance(stmt, ast.Assign):
                names += [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        return "class body", names
    return None


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def option_set_places(root: Path = ROOT) -> list[str]:
    """``file:line kind (n names)`` for every place of the library that spells out the option
    set: five or more of :data:`OPTION_NAMES` in one function signature, call, dict / set /
    tuple / list literal (nested ones with it) or class body."""
    found = []
    for path in library_files(root):
        tree = _parsed(path)
        parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            spelled = _spelled_names(node, parents.get(id(node)))
            if spelled is None:
                continue
            kind, names = spelled
            hit = OPTION_NAMES & set(names)
            if len(hit) >= SPELLED_OUT:
                found.append(f"{_rel(path, root)}:{node.lineno} {kind} ({len(hit)} options)")
    return found


def axis_name_lines(root: Path = ROOT) -> list[str]:
    """``file:line`` of every line of the library outside :data:`AXES_HOME` holding a string
    literal that is a mesh axis name (docstrings left out)."""
    lines: set[tuple[str, int]] = set()
    for path in library_files(root):
        rel = _rel(path, root)
        if rel == AXES_HOME:
            continue
        tree = _parsed(path)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in AXIS_NAMES and id(node) not in docs:
                lines.add((rel, node.lineno))
    return [f"{f}:{n}" for f, n in sorted(lines)]


def _top(module: str) -> str:
    return module.split(".")[0]


def _rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


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


def _torch_imports(path: Path) -> list[str]:
    """torch imports that run when ``path`` is imported (directly, or through the library
    modules and packages it imports)."""
    return [
        f"{_rel(f)}:{line} imports {module}"
        for f, line, module in import_time_closure([path])
        if _top(module) == "torch"
    ]


def test_simulations_import_torch_only_in_measurement_modules():
    for name in MEASUREMENT_MODULES:
        assert (ROOT / name).is_file(), f"{name} is listed as a measurement module but is gone"
    bad = []
    for path in sorted(SIMULATIONS.rglob("*.py")):
        if _rel(path) not in MEASUREMENT_MODULES:
            bad += _torch_imports(path)
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
    """A submodule named like a public function would replace the function on its package as
    soon as it is imported (``du.parallelize`` once did); in a fresh interpreter, import every
    module first, then check that no public name of the package or of a subpackage is a module,
    and that each is importable."""
    code = (
        "import importlib, pkgutil, types, dtensor_ulysses as du\n"
        "mods = [m.name for m in pkgutil.walk_packages(du.__path__, 'dtensor_ulysses.')]\n"
        "mods = [m for m in mods if not m.endswith('.__main__')]\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "bad = []\n"
        "for pkg in [du] + [importlib.import_module(m) for m in mods]:\n"
        "    if not hasattr(pkg, '__path__') or pkg.__name__.endswith('.hf'):\n"
        "        continue\n"
        "    bad += [f'{pkg.__name__}.{n}' for n in pkg.__all__\n"
        "            if isinstance(getattr(pkg, n), types.ModuleType)]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_every_library_module_is_in_a_layer():
    placed = set().union(*LAYERS)
    missing = sorted({unit(p) for p in library_files()} - placed)
    assert not missing, f"add these to LAYERS (tests/test_layering.py): {missing}"


def test_layers_import_only_downward():
    bad = upward_imports()
    assert not bad, "a unit may import only itself and lower layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles among the library's files:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_library_module_is_named_by_a_string():
    bad = string_named_modules()
    assert not bad, (
        "import library modules by name (a static table or registration the import graph "
        "sees), never by a string:\n" + "\n".join(bad)
    )


def test_private_modules_and_names_stay_in_their_folder():
    bad = private_crossings()
    assert not bad, "private modules and names stay in the folder that owns them:\n" + "\n".join(
        bad
    )


def test_the_model_never_imports_torch_distributed():
    found = [
        f"{_rel(f)}:{line} imports {module}"
        for f, line, module in import_time_closure([LIBRARY / m for m in THE_MODEL])
        if module == "torch.distributed" or module.startswith("torch.distributed.")
    ]
    assert not found, "the model must not import torch.distributed, even indirectly:\n" + (
        "\n".join(found)
    )


def test_the_builtin_train_and_eval_path_never_imports_hf():
    found = [
        f"{_rel(f)}:{line} imports {module}"
        for f, line, module in import_time_closure([LIBRARY / m for m in BUILTIN_TRAIN_PATH])
        if _top(module) == "transformers" or module.startswith("dtensor_ulysses.hf")
    ]
    assert not found, "the built-in train/eval path must not import hf:\n" + "\n".join(found)


def test_facades_derive_all_from_their_one_list_and_the_docs_show_every_module():
    """Each ``__init__`` lists its names once (the ``TYPE_CHECKING`` imports): ``__all__`` is that
    list, every name resolves, and each defining module has its ``:::`` block on the API page."""
    code = (
        "import importlib, pathlib, json\n"
        "from dtensor_ulysses._public import public_names\n"
        "out = {}\n"
        "for p in sorted(pathlib.Path('dtensor_ulysses').glob('*/__init__.py')):\n"
        "    name = 'dtensor_ulysses.' + p.parent.name\n"
        "    pkg = importlib.import_module(name)\n"
        "    names = public_names(name)\n"
        "    assert list(pkg.__all__) == list(names), name\n"
        "    out[p.parent.name] = sorted(set(names.values()))\n"
        "print(json.dumps(out))\n"
    )
    import json

    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    missing = []
    for pkg, modules in json.loads(run.stdout).items():
        page = ROOT / "docs" / "reference" / "api" / f"{'tools' if pkg == 'memtrace' else pkg}.md"
        text = page.read_text()
        missing += [
            f"{pkg}.{m}"
            for m in modules
            if not m.startswith("_") and f"::: dtensor_ulysses.{pkg}.{m}\n" not in text + "\n"
        ]
    assert not missing, f"modules with public names missing from the API pages: {missing}"


def test_the_option_names_are_the_recipes_fields():
    from dtensor_ulysses.plan import ParallelOptions

    assert set(ParallelOptions.fields()) == OPTION_NAMES


def test_the_option_set_is_spelled_out_in_at_most_five_places():
    """The recipe travels as one object (``ParallelOptions``): its fields are named where the
    type is declared, not typed out again at every door that passes it on."""
    places = option_set_places()
    assert any("plan/recipe.py" in p and "class body" in p for p in places), places
    assert len(places) <= MAX_OPTION_PLACES, (
        f"the parallel option set is spelled out in {len(places)} places (at most "
        f"{MAX_OPTION_PLACES}); pass the ParallelOptions object instead:\n" + "\n".join(places)
    )


def test_mesh_axis_names_are_written_once():
    lines = axis_name_lines()
    assert len(lines) <= MAX_AXIS_LINES, (
        f"mesh axis names written as literals on {len(lines)} lines outside {AXES_HOME} (at "
        f"most {MAX_AXIS_LINES}); use DP_AXIS / SP_AXIS / RING_AXIS from plan/splits.py or ask "
        f"the run's ParallelDims:\n" + "\n".join(lines)
    )


def test_hf_without_transformers_is_one_line_naming_the_extra():
    code = (
        "import importlib.abc, sys\n"
        "class F(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, F())\n"
        "import dtensor_ulysses.train.loop\n"
        "import dtensor_ulysses.hf.models.pretrained\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and last.startswith("ImportError: dtensor_ulysses.hf needs"), last
    assert 'pip install -e ".[hf]"' in last


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "dtensor_ulysses" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checkers_catch_what_they_forbid(tmp_path):
    """A synthetic package that breaks every rule: each checker must name the offence."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "plan/__init__.py": "",
            "plan/splits.py": "from dtensor_ulysses.models.llama import Model\n",  # upward
            "models/__init__.py": "",
            "models/llama.py": (
                "import torch.nn\nfrom dtensor_ulysses.models import _layers\n"
                "from dtensor_ulysses.models.weights import init\n"
            ),
            "models/_layers.py": "import dtensor_ulysses.parallel.global_loss\n",  # upward, dist
            "models/weights.py": (
                "def init():\n    from dtensor_ulysses.models.llama import Model\n"  # cycle
            ),
            "parallel/__init__.py": "",
            "parallel/global_loss.py": (
                "import torch.distributed as dist\n"
                "from dtensor_ulysses.models._layers import X\n"  # private module, other folder
                "from dtensor_ulysses.plan.splits import _helper\n"  # private name
            ),
            "hf/__init__.py": "from dtensor_ulysses.hf.trainers import wrap\n",  # the facade
            "hf/batch.py": "",
            "hf/models/__init__.py": "",
            "hf/models/routing.py": "from dtensor_ulysses.hf.trainers.wrap import X\n",  # up
            "hf/trainers/__init__.py": "",
            "hf/trainers/wrap.py": (
                '"""A docstring naming dtensor_ulysses.hf.batch is fine."""\n'
                "import importlib\nfrom dtensor_ulysses.hf.models import routing\n"
                "FAMILIES = {'DPO': ('dtensor_ulysses.hf.trainers.dpo', 'Mixin')}\n"  # a string
                "def load(name):\n    return importlib.import_module(name)\n"  # computed
            ),
            "hf/trainers/dpo.py": "from dtensor_ulysses.hf.batch import x\n",
        },
    )
    up = "\n".join(upward_imports(root))
    assert "plan/splits.py:1" in up and "models/_layers.py:1" in up
    assert "hf/models/routing.py:1 (hf.models" in up  # the model side never imports trainers
    assert "hf/__init__.py" not in up and "hf/trainers/" not in up  # facade on top; down is fine
    named = "\n".join(string_named_modules(root))
    assert "hf/trainers/wrap.py:4 names the module 'dtensor_ulysses.hf.trainers.dpo'" in named
    assert "hf/trainers/wrap.py:6 imports a computed module name" in named
    assert "hf.batch" not in named  # a docstring may name a module
    pair = {"dtensor_ulysses/models/llama.py", "dtensor_ulysses/models/weights.py"}
    assert any(pair <= set(c) for c in import_cycles(root)), import_cycles(root)
    crossings = "\n".join(private_crossings(root))
    assert "parallel/global_loss.py:2 imports the private module" in crossings
    assert "parallel/global_loss.py:3 imports the private name _helper" in crossings
    assert "models/llama.py" not in crossings  # its own folder's private module is fine
    closure = import_time_closure([root / "dtensor_ulysses/models/llama.py"], root)
    assert "torch.distributed" in {m for _, _, m in closure}, "the closure follows _layers"
    lazy = import_time_closure([root / "dtensor_ulysses/models/weights.py"], root)
    assert "dtensor_ulysses.models.llama" not in {m for _, _, m in lazy}  # a function's import


def test_the_recipe_checkers_catch_what_they_forbid(tmp_path):
    """A synthetic package spelling the option set in each kind of place, and axis names as
    literals: each is named; four names, a docstring and the axes' home are not."""
    five = ("activation_checkpointing", "offload_params", "head_chunks", "tiled_loss",
            "attention_backend")  # fmt: skip
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "plan/__init__.py": "",
            "plan/splits.py": 'DP_AXIS, RING_AXIS, SP_AXIS = "dp", "ring", "sp"\n',  # the home
            "doors.py": (
                f"def door(model, {', '.join(n + '=False' for n in five)}):\n"  # 1 signature
                f"    return parallelize(model, {', '.join(n + '=' + n for n in five)})\n"  # 2
                f"KW = {{{', '.join(repr(n) + ': 1' for n in five)}}}\n"  # 3 dict literal
                f"TABLE = ({', '.join('(' + repr(n) + ', True)' for n in five)})\n"  # 4 nested
                f"class Flags:\n"
                + "".join(f"    {n}: bool = False\n" for n in five)  # 5
                + f"FOUR = {set(five[:4])!r}\n"  # four names: not the set
            ),
            "mesh.py": (
                '"""The ("dp", "sp") mesh; a docstring may name "sp"."""\n'
                "def groups(mesh):\n"
                '    return mesh["sp"], mesh["dp"]\n'  # one line, two names
                '    ring = mesh.get_local_rank("ring")\n'
            ),
        },
    )
    places = "\n".join(option_set_places(root))
    for line, kind in ((1, "signature"), (2, "call"), (3, "dict literal"),
                       (4, "tuple literal"), (5, "class body")):  # fmt: skip
        assert f"dtensor_ulysses/doors.py:{line} {kind} (5 options)" in places, places
    assert "doors.py:11" not in places and len(option_set_places(root)) == 5, places
    lines = axis_name_lines(root)
    assert lines == ["dtensor_ulysses/mesh.py:3", "dtensor_ulysses/mesh.py:4"], lines
