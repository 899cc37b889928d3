"""Run a function on a local gloo world of spawned processes (tests, notebooks, validation).

``torchrun`` is the way to launch training; this helper is for code that wants a small CPU world
from inside Python — a test, a notebook cell, ``python -m simulations validate`` — and wants each
rank's return value back. Every run has a deadline: a mismatched collective fails with a
``TimeoutError`` naming the ranks still running instead of hanging.

Example::

    from dtensor_ulysses.launch import run_local_world
    results = run_local_world(my_module.worker, 4, arg1, timeout_s=120)  # one result per rank

``worker(rank, world_size, *args)`` must be importable by module path (spawned processes cannot
unpickle functions defined in ``__main__`` or a notebook).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtensor_ulysses._exit import exit_process

__all__ = ["run_local_world"]


def _entry(rank: int, fn: Callable, world_size: int, tmp: str, args: tuple, coll_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=coll_s),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(f"{tmp}/result_{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # leave together: a gloo teardown racing a peer's collective can abort
    except BaseException:
        with open(f"{tmp}/error_{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    exit_process(0)  # results are written: skip the teardown that can abort (see _exit.py)


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes joined by gloo.

    Args:
        fn: a module-level function (picklable by reference).
        world_size: number of processes.
        *args: picklable arguments passed to every rank.
        timeout_s: deadline for the whole run; past it every process is killed.
        collective_timeout_s: gloo's timeout for a single collective.

    Returns:
        The return values, indexed by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message).
        TimeoutError: the deadline passed.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; use world_size >= 1")
    with tempfile.TemporaryDirectory(prefix="du-world-") as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, tmp, args, collective_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} ranks passed its {timeout_s:.0f} s "
                        f"deadline; "
                        f"ranks still running: {alive} (a collective mismatch or a hang)"
                    )
        except mp.ProcessRaisedException as e:
            errors = []
            for name in sorted(os.listdir(tmp)):
                if name.startswith("error_"):
                    with open(os.path.join(tmp, name)) as f:
                        errors.append(f.read())
            raise RuntimeError("\n".join(errors) or str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
