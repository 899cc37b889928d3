"""Measure the real code's communication (spawned gloo ranks) and predict the same cases.

Run by ``python -m simulations validate`` and by ``tests/test_simulations_measured.py`` through
:func:`dtensor_ulysses.launch.run_local_world`, which needs a module-level worker: this module.
torch is imported only inside the worker, so importing ``simulations`` stays torch-free.

A *case* is ``(dp, sp, B, S, N, K, H, dtype)``: a global batch ``B`` of ``S`` tokens, ``N`` q heads,
``K`` kv heads of size ``H``, on a ``(dp, sp)`` mesh. Each rank runs
``du.ulysses_attention`` forward and backward under :class:`dtensor_ulysses.CommCounter` and
reports what it passed into collectives, forward and backward apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtensor_ulysses.presets import ModelShape
from simulations import comm
from simulations.config import Workload

__all__ = ["CASES", "Case", "attention_comm_worker", "compare", "measure", "predicted"]


@dataclass(frozen=True)
class Case:
    """One attention call to measure."""

    dp: int
    sp: int
    B: int
    S: int
    N: int
    K: int
    H: int
    dtype: str = "fp32"

    @property
    def world(self) -> int:
        return self.dp * self.sp

    def label(self) -> str:
        return (
            f"dp={self.dp} sp={self.sp} B={self.B} S={self.S} N={self.N} K={self.K} H={self.H} "
            f"{self.dtype}"
        )


# Tiny and non-tiny shapes, MHA, GQA with sp dividing K, GQA/MQA with sp > K (replication), and an
# uneven replication (12 q / 3 kv heads on 4 ranks: 1, 3, 3, 1 kv heads per rank), fp32 and bf16.
CASES: dict[int, list[Case]] = {
    2: [
        Case(1, 2, 1, 16, 8, 2, 8),  # tiny, GQA, sp | K
        Case(1, 2, 2, 64, 32, 8, 64, "bf16"),  # Llama-3-8B head layout, bf16
        Case(2, 1, 2, 16, 4, 4, 8),  # dp only: Ulysses moves nothing
    ],
    4: [
        Case(1, 4, 1, 16, 8, 2, 8),  # tiny GQA, sp > K: kv heads replicated (K' = 4)
        Case(2, 2, 2, 32, 8, 8, 16),  # dp x sp, MHA
        Case(1, 4, 1, 32, 8, 1, 16),  # MQA, K' = 4
        Case(1, 4, 1, 128, 32, 8, 64, "bf16"),  # non-tiny, Llama-3-8B heads, sp | K
        Case(1, 4, 1, 32, 12, 3, 8),  # per-rank kv lists of 1, 3, 3, 1 heads: K' = 8
        Case(1, 4, 1, 32, 6, 3, 8),  # uneven q heads 2, 2, 1, 1 (the real code allows it)
    ],
}


def predicted(case: Case) -> list[dict[str, dict[str, int]]]:
    """Per rank ``{"forward"|"backward": {"count": n, "bytes": b}}`` of its all-to-alls."""
    e = {"fp32": 4, "bf16": 2}[case.dtype]
    if case.sp == 1:
        return [{p: {"count": 0, "bytes": 0} for p in ("forward", "backward")}] * case.world
    tokens = case.B // case.dp * (case.S // case.sp)
    per_sp_rank = comm.ulysses_bytes_by_rank(case.N, case.K, case.H, case.sp, tokens, e)
    out = []
    for rank in range(case.world):
        r = per_sp_rank[rank % case.sp]  # mesh (dp, sp): the sp coordinate is rank % sp
        out.append({
            p: {"count": 2, "bytes": r[f"{p}_qkv"] + r[f"{p}_o"]} for p in ("forward", "backward")
        })  # fmt: skip
    return out


def predicted_by_workload(case: Case) -> dict[str, dict[str, int]]:
    """The same through :class:`~simulations.config.Workload` (the busiest rank)."""
    shape = ModelShape(
        "measure", 1, case.N * case.H, case.N, case.K, case.H, ffn_dim=8, vocab_size=8
    )
    w = Workload(shape, case.S, dp=case.dp, sp=case.sp, micro_batch=case.B // case.dp,
                 dtype=case.dtype, ac="none")  # fmt: skip
    out = {p: {"count": 0, "bytes": 0} for p in ("forward", "backward")}
    for c in comm.per_layer_attention(w):
        out[c.phase]["count"] += c.calls
        out[c.phase]["bytes"] += int(c.bytes)
    return out


def attention_comm_worker(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """Per case: collectives this rank issued in forward and backward (kind, count, bytes)."""
    import warnings

    import torch
    from torch.distributed.tensor import DTensor, Shard

    import dtensor_ulysses as du

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    # the uneven-heads case is deliberate: silence the real code's load-imbalance warning
    warnings.filterwarnings("ignore", message=".*attention load imbalance.*")
    results = []
    for i, case in enumerate(cases):
        mesh = du.init_mesh(case.dp, case.sp, device_type="cpu")
        gen = torch.Generator().manual_seed(1000 * i + rank)
        Bl, s = case.B // case.dp, case.S // case.sp

        def make(heads: int, gen=gen, Bl=Bl, s=s, case=case, mesh=mesh):
            t = torch.randn(Bl, s, heads, case.H, generator=gen).to(dtypes[case.dtype])
            t.requires_grad_(True)
            return DTensor.from_local(t, mesh, [Shard(0), Shard(1)], run_check=False)

        q, k, v = make(case.N), make(case.K), make(case.K)
        with du.CommCounter() as fwd:
            o = du.ulysses_attention(q, k, v, causal=True, backend="sdpa")
        loss = o.to_local().float().square().sum()
        with du.CommCounter() as bwd:
            loss.backward()
        sp_group = mesh.get_group("sp")
        row = {}
        for phase, counter in (("forward", fwd), ("backward", bwd)):
            row[phase] = {
                "by_kind": counter.by_kind(),
                "sp_all_to_all": {
                    "count": counter.count("all_to_all", group=sp_group),
                    "bytes": counter.bytes("all_to_all", group=sp_group),
                },
            }
        results.append(row)
    return results


def measure(world_size: int, cases: list[Case] | None = None, timeout_s: float = 300.0):
    """Run the cases on a local gloo world; ``[(case, predicted, measured rank 0..W-1)]``.

    Raises:
        RuntimeError: a rank failed (traceback in the message).
    """
    from dtensor_ulysses.launch import run_local_world

    cases = CASES[world_size] if cases is None else cases
    per_rank = run_local_world(attention_comm_worker, world_size, cases, timeout_s=timeout_s)
    return [(c, predicted(c), [r[i] for r in per_rank]) for i, c in enumerate(cases)]


def compare(case: Case, pred: list[dict], ranks: list[dict]) -> list[str]:
    """Differences between prediction and every rank's measurement (empty: exact match)."""
    problems = []
    # the Workload API refuses sp not dividing the q heads; compare it only where it applies
    busiest = predicted_by_workload(case) if case.N % case.sp == 0 else {}
    for phase in busiest:
        top = max(p[phase]["bytes"] for p in pred)
        if busiest[phase]["bytes"] != top:
            problems.append(f"{phase}: Workload reports {busiest[phase]}, busiest rank {top}")
    for r, meas in enumerate(ranks):
        for phase in ("forward", "backward"):
            kinds = meas[phase]["by_kind"]
            sp = meas[phase]["sp_all_to_all"]
            want = pred[r][phase]
            if sp != want:
                problems.append(f"rank {r} {phase}: measured {sp}, predicted {want}")
            other = {k: v for k, v in kinds.items() if k != "all_to_all"}
            total = kinds.get("all_to_all", {"count": 0, "bytes": 0})
            if other or total != sp:
                problems.append(f"rank {r} {phase}: unexpected collectives {kinds}")
    return problems
