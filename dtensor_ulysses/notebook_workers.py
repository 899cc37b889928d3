"""What the notebooks run for real: workers for ``run_local_world`` and a torchrun launcher.

Spawned processes import a worker by its module path, so a function defined in a notebook cannot
be one; these are. Each worker runs every case it is given in one world (starting a world costs
seconds) and returns plain data (lists, ints, floats) that the notebook plots with
:mod:`dtensor_ulysses.viz`::

    from dtensor_ulysses.launch import run_local_world
    from dtensor_ulysses import notebook_workers as nw
    per_rank = run_local_world(nw.placement_worker, 4, [nw.placement_case(2, 2, (2, 8, 4, 2))])

* :func:`placement_worker` - what ``distribute_tensor`` puts on each rank (notebook 01);
* :func:`ulysses_round_trip_worker` - ``seq_to_head``/``head_to_seq``/``ulysses_attention`` with
  the cells each rank holds at each stage, the kv heads it receives and the bytes it moves,
  counted by ``du.CommCounter`` (notebook 02);
* :func:`activation_memory_worker` - bytes the real model saves for backward per rank (03);
* :func:`run_training` - a ``torchrun ... -m dtensor_ulysses.train`` job whose output is streamed
  line by line, returning its ``--metrics-file`` records (notebook 05).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "activation_memory_worker",
    "placement_case",
    "placement_worker",
    "round_trip_case",
    "run_training",
    "torchrun_command",
    "ulysses_round_trip_worker",
]


def _mesh(dp: int, sp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))


def _decode(codes, shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Flat indices of a ``shape`` tensor -> sorted index tuples."""
    out = []
    for c in sorted({int(v) for v in codes}):
        idx = []
        for size in reversed(shape):
            idx.append(c % size)
            c //= size
        out.append(tuple(idx[::-1]))
    return out


# ----------------------------------------------------------------------------------------------
# notebook 01: what distribute_tensor places on each rank
# ----------------------------------------------------------------------------------------------
def placement_case(
    dp: int, sp: int, shape: Sequence[int], placements: Sequence[str] = ("Shard(0)", "Shard(1)")
) -> dict[str, Any]:
    """A case for :func:`placement_worker` (placements spelled as strings, picklable)."""
    return {"dp": dp, "sp": sp, "shape": tuple(shape), "placements": tuple(placements)}


def placement_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Per case: the index tuples of the global tensor this rank holds after ``distribute_tensor``.

    The global tensor holds its own flat index in every element, so the local shard names the
    cells it holds; ``distribute_tensor`` scatters from rank 0 over gloo as it would in training.
    """
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_ulysses.viz import parse_placement

    out = []
    meshes: dict[tuple[int, int], Any] = {}
    for case in cases:
        key = (case["dp"], case["sp"])
        if key not in meshes:
            meshes[key] = _mesh(*key)
        mesh = meshes[key]
        shape = case["shape"]
        x = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).reshape(shape)
        placements = [
            Replicate() if (d := parse_placement(p)) is None else Shard(d)
            for p in case["placements"]
        ]
        xd = distribute_tensor(x, mesh, placements)
        local = xd.to_local()
        out.append(
            {
                "rank": rank,
                "coord": list(mesh.get_coordinate()),
                "local_shape": list(local.shape),
                "cells": _decode(local.reshape(-1).tolist(), shape),
            }
        )
    return out


# ----------------------------------------------------------------------------------------------
# notebook 02: the Ulysses all-to-all, observed
# ----------------------------------------------------------------------------------------------
def round_trip_case(
    dp: int = 1,
    sp: int = 4,
    B: int | None = None,
    S: int = 16,
    N: int = 8,
    K: int = 2,
    H: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """A case for :func:`ulysses_round_trip_worker`: global ``B`` (default ``dp``), fp32."""
    return {"dp": dp, "sp": sp, "B": B or dp, "S": S, "N": N, "K": K, "H": H, "seed": seed}


def _cells(t, S: int, N: int) -> list[list[int]]:
    """Decode a local tensor filled with ``(b*S + s)*N + n`` into sorted ``[b, s, n]`` cells."""
    return [list(divmod_cell(v, S, N)) for v in sorted(set(t[..., 0].reshape(-1).tolist()))]


def ulysses_round_trip_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Per case, what this rank holds and moves during Ulysses, as seen on a real gloo world.

    1. ``x[b, s, n, :] = (b*S + s)*N + n`` is distributed ``(Shard(0), Shard(1))``; the cells of
       the local tensor are recorded before ``du.seq_to_head``, after it (``Shard(2)``) and after
       ``du.head_to_seq``, with the all-to-alls and bytes each call issues (``du.CommCounter``).
    2. ``du.ulysses_attention`` on random q and k/v with ``K`` kv heads, forward and backward under
       ``du.CommCounter``; the result is compared with single-device attention.
    3. ``du.UlyssesAttention`` with a kernel that records which q and kv heads it receives (k is
       filled with its kv-head index, q with its q-head index).
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import dtensor_ulysses as du

    out = []
    meshes: dict[tuple[int, int], Any] = {}
    for case in cases:
        dp, sp, B, S, N, K, H = (case[k] for k in ("dp", "sp", "B", "S", "N", "K", "H"))
        if (dp, sp) not in meshes:
            meshes[(dp, sp)] = _mesh(dp, sp)
        mesh = meshes[(dp, sp)]
        sp_group = mesh.get_group("sp")
        place = [Shard(0), Shard(1)]
        row: dict[str, Any] = {"rank": rank, "coord": list(mesh.get_coordinate())}

        # 1. the round trip, on a tensor whose values name their cells
        code = torch.arange(B * S * N, dtype=torch.float32).reshape(B, S, N, 1).expand(B, S, N, H)
        xd = distribute_tensor(code.contiguous(), mesh, place)

        with du.CommCounter() as c_s2h:
            yd = du.seq_to_head(xd)
        with du.CommCounter() as c_h2s:
            zd = du.head_to_seq(yd)
        row["cells"] = {
            "before": _cells(xd.to_local(), S, N),
            "inside": _cells(yd.to_local(), S, N),
            "after": _cells(zd.to_local(), S, N),
        }
        row["placements"] = {
            "before": [_placement_name(p) for p in xd.placements],
            "inside": [_placement_name(p) for p in yd.placements],
            "after": [_placement_name(p) for p in zd.placements],
        }
        row["round_trip_exact"] = bool(torch.equal(zd.to_local(), xd.to_local()))
        row["seq_to_head"] = _a2a_summary(c_s2h, sp_group)
        row["head_to_seq"] = _a2a_summary(c_h2s, sp_group)

        # 2. attention, forward and backward
        g = torch.Generator().manual_seed(case.get("seed", 0))
        q, k, v = (torch.randn(B, S, n, H, generator=g) for n in (N, K, K))
        qd, kd, vd = (
            distribute_tensor(t, mesh, place, src_data_rank=None).detach().requires_grad_(True)
            for t in (q, k, v)
        )
        with du.CommCounter() as fwd:
            od = du.ulysses_attention(qd, kd, vd, causal=True, backend="sdpa")
        ref = du.local_attention(q, k, v, causal=True, backend="sdpa")
        full = od.full_tensor()
        with du.CommCounter() as bwd:
            od.to_local().square().sum().backward()
        row["attention"] = {"forward": _a2a_summary(fwd, sp_group),
                            "backward": _a2a_summary(bwd, sp_group)}  # fmt: skip
        row["max_abs_err"] = float((full.detach() - ref).abs().max())

        # 3. which heads the kernel receives
        kernel = _RecordingKernel()
        qh, kh = (
            distribute_tensor(_by_head(B, S, n, H), mesh, place, src_data_rank=None) for n in (N, K)
        )
        du.UlyssesAttention(kernel, mesh)(
            qh.to_local(), kh.to_local(), kh.to_local(), causal=True, backend="sdpa"
        )
        row["kernel"] = kernel.seen
        row["is_dtensor"] = isinstance(od, DTensor)
        out.append(row)
    return out


class _RecordingKernel:
    """A local attention kernel that records the q and kv heads it is given (their fill values)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}

    def __call__(self, q, k, v, **kwargs):
        from dtensor_ulysses.attention import local_attention

        self.seen["q_heads"] = [int(x) for x in q[0, 0, :, 0].tolist()]
        self.seen["kv_heads"] = [int(x) for x in k[0, 0, :, 0].tolist()]
        self.seen["shape_q"], self.seen["shape_kv"] = list(q.shape), list(k.shape)
        return local_attention(q, k, v, **kwargs)


def _by_head(B: int, S: int, n: int, H: int):
    """``[B, S, n, H]`` filled with each element's head index."""
    import torch

    return torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1).expand(B, S, n, H).contiguous()


def _placement_name(p) -> str:
    return f"Shard({p.dim})" if type(p).__name__ == "Shard" else f"{type(p).__name__}()"


def _a2a_summary(counter, group) -> dict[str, int]:
    """All-to-alls on ``group`` (count, input bytes) and how many other collectives ran."""
    n = counter.count("all_to_all", group)
    return {"count": n, "bytes": counter.bytes("all_to_all", group), "other": counter.count() - n}


def divmod_cell(code: float, S: int, N: int) -> tuple[int, int, int]:
    """``(b, s, n)`` of the code ``(b*S + s)*N + n``."""
    c = int(code)
    rest, n = divmod(c, N)
    b, s = divmod(rest, S)
    return b, s, n


# ----------------------------------------------------------------------------------------------
# notebook 03: activation memory of the real model
# ----------------------------------------------------------------------------------------------
class _SavedTensors:
    """saved_tensors_hooks that remember every saved tensor and whether a block saved it."""

    def __init__(self) -> None:
        self.region = "other"
        self.saved: list[tuple[str, Any]] = []

    def enter_block(self, module, args) -> None:
        self.region = "blocks"

    def leave_block(self, module, args, output) -> None:
        self.region = "other"

    def pack(self, t):
        self.saved.append((self.region, t))
        return t

    @staticmethod
    def unpack(t):
        return t


def activation_memory_worker(
    rank: int,
    world_size: int,
    layouts: Sequence[tuple[int, int]],
    seq_lens: Sequence[int],
    model: str = "tiny",
) -> list[dict]:
    """Bytes the real model saves for backward on this rank, per (dp, sp) layout and length.

    For each ``(dp, sp)`` with ``dp * sp == world_size``: the model is built, parallelized
    (``du.parallelize``: Ulysses + FSDP2 over dp x sp), fp32 on CPU, no activation checkpointing;
    each rank runs one sequence of ``S`` tokens (its ``S / sp`` slice; random token ids) through
    forward and the loss under ``torch.autograd.graph.saved_tensors_hooks``. Every tensor autograd
    saves is recorded with the region that saved it (inside a transformer block, or elsewhere:
    embedding, final norm, output head, loss); after the loss, the sizes of the distinct storages
    still held are summed, excluding parameters. Then backward runs and memory is released.

    Returns:
        rows ``{"dp", "sp", "seq_len", "local_tokens", "blocks_bytes", "other_bytes"}``.
    """
    import torch

    from dtensor_ulysses.loss import cross_entropy_sum
    from dtensor_ulysses.mesh import init_mesh
    from dtensor_ulysses.model import build_model, init_weights
    from dtensor_ulysses.parallelize import parallelize

    rows = []
    for dp, sp in layouts:
        if dp * sp != world_size:
            raise ValueError(f"layout dp={dp} x sp={sp} does not fill {world_size} ranks")
        mesh = init_mesh(dp, sp, device_type="cpu")
        dp_rank, sp_rank = mesh.get_coordinate()
        net = build_model(model)
        parallelize(net, mesh)
        net.to_empty(device="cpu")
        init_weights(net, seed=0)
        recorder = _SavedTensors()
        hooks = []
        for block in net.layers:
            hooks.append(block.register_forward_pre_hook(recorder.enter_block))
            hooks.append(block.register_forward_hook(recorder.leave_block))
        for S in seq_lens:
            if S % sp:
                raise ValueError(f"S={S} is not divisible by sp={sp}")
            s = S // sp
            g = torch.Generator().manual_seed(1000 * dp_rank + S)
            ids = torch.randint(0, 256, (1, S + 1), generator=g)
            sl = slice(sp_rank * s, (sp_rank + 1) * s)
            inputs, labels = ids[:, :-1][:, sl], ids[:, 1:][:, sl]
            positions = torch.arange(S)[None, sl]
            recorder.saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
                loss = cross_entropy_sum(net(inputs, positions), labels)
            params = set()
            for p in net.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                params.add(local.untyped_storage().data_ptr())
            seen: dict[int, tuple[str, int]] = {}
            for reg, t in recorder.saved:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr in params or ptr in seen or st.nbytes() == 0:
                    continue
                seen[ptr] = (reg, st.nbytes())
            blocks = sum(nb for reg, nb in seen.values() if reg == "blocks")
            other = sum(nb for reg, nb in seen.values() if reg != "blocks")
            recorder.saved.clear()
            loss.backward()
            net.zero_grad(set_to_none=True)
            rows.append({"dp": dp, "sp": sp, "seq_len": S, "local_tokens": s,
                         "blocks_bytes": blocks, "other_bytes": other})  # fmt: skip
        for h in hooks:
            h.remove()
    return rows


# ----------------------------------------------------------------------------------------------
# notebook 05: a real torchrun job
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
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(dp * sp), "-m", "dtensor_ulysses.train",
        "--dp", str(dp), "--sp", str(sp), "--model", model, "--seq-len", str(seq_len),
        "--batch-size", str(batch_size), "--steps", str(steps), "--seed", str(seed),
    ]  # fmt: skip
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
            cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1,
        ) as proc:  # fmt: skip
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
