"""Run notebook code on real processes: a local gloo world, or a ``torchrun`` training job.

:func:`run_on_ranks` runs a function *written in a notebook cell* on every rank of a local gloo
world (``dtensor_ulysses.launch.run_local_world``). Spawned processes cannot import a function
defined in a notebook, so its source is sent instead, with how to rebuild the globals it uses:
modules and importable objects are imported again by name in each process, functions defined in
the notebook are sent as source too, plain data (numbers, lists, placements) is pickled::

    def where_am_i(rank, world_size):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))
        return mesh.get_coordinate()

    run_on_ranks(where_am_i, 4)  # [[0], [1], [2], [3]]

:class:`SavedActivations` measures what autograd keeps for backward (notebook 3);
:func:`run_training` runs ``python -m dtensor_ulysses.train`` under torchrun and streams its
output (notebook 5).
"""

from __future__ import annotations

import dis
import importlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["SavedActivations", "run_on_ranks", "run_training", "torchrun_command"]


# ----------------------------------------------------------------------------------------------
# a notebook function on a local gloo world
# ----------------------------------------------------------------------------------------------
def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions and comprehensions inside it) reads as globals."""
    names = {
        ins.argval
        for ins in dis.get_instructions(code)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _importable(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` when ``obj`` can be imported again by name in another process."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return (module, qualname) if found is obj else None


def _package(fn: Callable) -> dict[str, Any]:
    """The source of ``fn`` and of the notebook functions it uses; how to rebuild its globals."""
    sources: dict[str, str] = {}
    imports: dict[str, tuple[str, str | None]] = {}
    values: dict[str, Any] = {}
    todo = [fn]
    while todo:
        f = todo.pop()
        if f.__name__ in sources:
            continue
        sources[f.__name__] = textwrap.dedent(inspect.getsource(f))
        for name in sorted(_global_names(f.__code__)):
            if name in sources or name in imports or name in values or name not in f.__globals__:
                continue  # a builtin, or assigned inside the function
            obj = f.__globals__[name]
            if isinstance(obj, types.ModuleType):
                imports[name] = (obj.__name__, None)
            elif (ref := _importable(obj)) is not None:
                imports[name] = ref
            elif inspect.isfunction(obj):
                todo.append(obj)
            else:
                try:
                    pickle.dumps(obj)
                except Exception as e:
                    raise TypeError(
                        f"{fn.__name__} uses the global {name!r} ({type(obj).__name__}), which "
                        f"cannot be sent to another process ({e}); create it inside the function"
                    ) from None
                values[name] = obj
    return {"name": fn.__name__, "sources": sources, "imports": imports, "values": values}


def _run_package(rank: int, world_size: int, package: dict[str, Any], *args: Any) -> Any:
    """In a spawned process: rebuild the globals, define the functions, call the entry point."""
    ns: dict[str, Any] = {"__name__": "__notebook__"}
    for name, (module, qualname) in package["imports"].items():
        obj: Any = importlib.import_module(module)
        if qualname:
            for part in qualname.split("."):
                obj = getattr(obj, part)
        ns[name] = obj
    ns.update(package["values"])
    for name, src in package["sources"].items():
        exec(compile(src, f"<notebook cell: {name}>", "exec"), ns)
    return ns[package["name"]](rank, world_size, *args)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0):
    """``fn(rank, world_size, *args)`` on ``world_size`` local processes joined by gloo.

    ``fn`` may be defined in a notebook cell (see the module docstring). Returns the results,
    indexed by rank; a rank's exception is raised here with its traceback.
    """
    from dtensor_ulysses.launch import run_local_world

    if _importable(fn) is not None:
        return run_local_world(fn, world_size, *args, timeout_s=timeout_s)
    return run_local_world(_run_package, world_size, _package(fn), *args, timeout_s=timeout_s)


# ----------------------------------------------------------------------------------------------
# what autograd saves for backward
# ----------------------------------------------------------------------------------------------
class SavedActivations:
    """Record every tensor autograd saves inside the ``with`` block, and where it was saved.

    ``blocks`` are modules (e.g. ``model.layers``) whose saved tensors count as "blocks"; the
    rest (embedding, final norm, output head, loss) counts as "other". :meth:`bytes` sums the
    distinct storages still held (a tensor saved twice, or a view, counts once), excluding
    parameters: the activation memory at the start of backward, independent of allocator caching.
    """

    def __init__(self, blocks: Iterable[Any]) -> None:
        self.blocks = list(blocks)
        self.region = "other"
        self.saved: list[tuple[str, Any]] = []

    def __enter__(self) -> SavedActivations:
        import torch

        self._hooks = []
        for b in self.blocks:
            self._hooks.append(b.register_forward_pre_hook(lambda *_: self._enter("blocks")))
            self._hooks.append(b.register_forward_hook(lambda *_: self._enter("other")))
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saving.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saving.__exit__(*exc)
        for h in self._hooks:
            h.remove()

    def _enter(self, region: str) -> None:
        self.region = region

    def _pack(self, t: Any) -> Any:
        self.saved.append((self.region, t))
        return t

    def bytes(self, model: Any) -> dict[str, int]:
        """``{"blocks_bytes", "other_bytes"}`` of the recorded tensors; forgets them."""
        params = set()
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            params.add(local.untyped_storage().data_ptr())
        seen: dict[int, tuple[str, int]] = {}
        for region, t in self.saved:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in params and ptr not in seen and st.nbytes():
                seen[ptr] = (region, st.nbytes())
        self.saved.clear()
        blocks = sum(nb for region, nb in seen.values() if region == "blocks")
        return {"blocks_bytes": blocks, "other_bytes": sum(nb for _, nb in seen.values()) - blocks}


# ----------------------------------------------------------------------------------------------
# a real torchrun job
# ----------------------------------------------------------------------------------------------
def torchrun_command(
    dp: int,
    sp: int,
    *,
    model: str = "tiny",
    seq_len: int = 128,
    batch_size: int = 4,
    steps: int = 10,
    seed: int = 0,
    metrics_file: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``torchrun --standalone --nproc-per-node dp*sp -m dtensor_ulysses.train ...`` as argv.

    ``python -m torch.distributed.run`` is what the ``torchrun`` script runs; calling it through
    the running interpreter keeps the job in the notebook's environment.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(dp * sp), "-m", "dtensor_ulysses.train"]
    cmd += ["--dp", str(dp), "--sp", str(sp), "--model", model, "--seq-len", str(seq_len)]
    cmd += ["--batch-size", str(batch_size), "--steps", str(steps), "--seed", str(seed)]
    if metrics_file:
        cmd += ["--metrics-file", metrics_file]
    return cmd + list(extra)


def run_training(
    dp: int,
    sp: int,
    *,
    echo: Callable[[str], Any] | None = print,
    timeout_s: float = 300.0,
    **options: Any,
) -> list[dict]:
    """Run a training job with torchrun, stream its output, return its per-step metrics.

    Args:
        dp, sp: the layout; ``dp * sp`` processes are started.
        echo: called with every line the job prints, as it arrives (``None``: quiet).
        timeout_s: the job is killed past this many seconds.
        **options: :func:`torchrun_command` keyword arguments (``model``, ``seq_len``, ...).

    Returns:
        The ``--metrics-file`` records, one dict per step.

    Raises:
        RuntimeError: the job failed or timed out (the message ends with its last lines).
    """
    with tempfile.TemporaryDirectory(prefix="du-train-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = torchrun_command(dp, sp, metrics_file=metrics, **options)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        tail: list[str] = []
        deadline = time.monotonic() + timeout_s
        with subprocess.Popen(
            cmd,
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail = (tail + [line])[-20:]
                if echo is not None:
                    echo(line)
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"training passed {timeout_s:.0f} s:\n" + "\n".join(tail))
            rc = proc.wait()
        if rc != 0:
            raise RuntimeError(f"training exited with {rc}:\n" + "\n".join(tail))
        with open(metrics) as f:
            return [json.loads(line) for line in f if line.strip()]
