"""Measure the real code's communication (spawned gloo ranks) and predict the same cases.

Run by ``python -m simulations validate`` and by ``tests/simulator/test_measured.py`` through
:func:`dtensor_ulysses.launch.run_local_world`, which needs a module-level worker: this module.
torch is imported only inside the worker, so importing ``simulations`` stays torch-free.

A *case* is ``(dp, sp, B, S, N, K, H, dtype, pack_docs)``: a global batch ``B`` of ``S`` tokens,
``N`` q heads, ``K`` kv heads of size ``H``, on a ``(dp, sp)`` mesh; ``sp`` need not divide ``N``
or ``S`` (uneven layouts: each rank holds its ``seq_split`` slice); ``pack_docs`` passes
two documents through the engine with the step's layout, as the trainer does (no position ids
travel). Each rank runs ``du.ulysses_attention`` (or the engine) forward and backward
under :class:`dtensor_ulysses.CommCounter` and reports what it passed into collectives, forward
and backward apart, by kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtensor_ulysses.plan import ModelShape, contiguous_stride, seq_split, ulysses_bytes_by_rank
from simulations import comm
from simulations.config import Workload

__all__ = [
    "CASES",
    "Case",
    "attention_comm_worker",
    "compare",
    "measure",
    "predicted",
    "predicted_by_workload",
]


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
    pack_docs: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.sp

    def label(self) -> str:
        return (
            f"dp={self.dp} sp={self.sp} B={self.B} S={self.S} N={self.N} K={self.K} H={self.H} "
            f"{self.dtype}" + (" packed" if self.pack_docs else "")
        )


# Tiny and non-tiny shapes, MHA, GQA with sp dividing K, GQA/MQA with sp > K (replication), an
# uneven replication (12 q / 3 kv heads on 4 ranks: 1, 3, 3, 1 kv heads per rank), uneven q heads,
# uneven sequences (S not divisible by sp, down to an empty rank), packed documents, dp x sp,
# fp32 and bf16. All cases of a world size share one spawn: adding one costs ~0.1 s.
CASES: dict[int, list[Case]] = {
    2: [
        Case(1, 2, 1, 16, 8, 2, 8),  # tiny, GQA, sp | K
        Case(1, 2, 2, 64, 32, 8, 64, "bf16"),  # Llama-3-8B head layout, bf16
        Case(2, 1, 2, 16, 4, 4, 8),  # dp only: Ulysses moves nothing
        Case(1, 2, 1, 16, 3, 1, 8),  # uneven q heads 2, 1 (MQA): imbalance 4/3
        Case(1, 2, 2, 37, 8, 2, 8),  # uneven S: 19, 18 tokens
    ],
    4: [
        Case(1, 4, 1, 16, 8, 2, 8),  # tiny GQA, sp > K: kv heads replicated (K' = 4)
        Case(2, 2, 2, 32, 8, 8, 16),  # dp x sp, MHA
        Case(1, 4, 1, 32, 8, 1, 16),  # MQA, K' = 4
        Case(1, 4, 1, 128, 32, 8, 64, "bf16"),  # non-tiny, Llama-3-8B heads, sp | K
        Case(1, 4, 1, 32, 12, 3, 8),  # per-rank kv lists of 1, 3, 3, 1 heads: K' = 8
        Case(1, 4, 1, 32, 6, 3, 8),  # uneven q heads 2, 2, 1, 1 (the real code allows it)
        Case(1, 4, 1, 32, 10, 2, 8),  # uneven q heads 3, 3, 2, 2; kv 1, 3, 1, 1 (K' = 6)
        Case(1, 4, 2, 37, 8, 2, 8),  # uneven S: 10, 10, 10, 7 tokens
        Case(2, 2, 2, 37, 6, 2, 8),  # dp x sp, uneven S: 19, 18 tokens
        Case(1, 4, 1, 6, 4, 4, 8),  # uneven S with an empty rank: 2, 2, 2, 0 tokens
        Case(1, 4, 1, 37, 6, 2, 8, "bf16", True),  # uneven S and heads (2, 2, 1, 1), packed docs
    ],
}
KINDS = ("all_to_all", "all_gather")


def _zero() -> dict[str, dict[str, int]]:
    return {k: {"count": 0, "bytes": 0} for k in KINDS}


def predicted(case: Case) -> list[dict[str, dict[str, dict[str, int]]]]:
    """Per rank ``{"forward"|"backward": {kind: {"count": n, "bytes": b}}}`` on the sp group."""
    e = {"fp32": 4, "bf16": 2}[case.dtype]
    if case.sp == 1:
        return [{p: _zero() for p in ("forward", "backward")} for _ in range(case.world)]
    Bl = case.B // case.dp
    sizes = seq_split(case.S, case.sp)
    tokens = [Bl * s for s in sizes]
    per_sp_rank = ulysses_bytes_by_rank(case.N, case.K, case.H, case.sp, tokens, e)
    out = []
    for rank in range(case.world):
        r = per_sp_rank[rank % case.sp]  # mesh (dp, sp): the sp coordinate is rank % sp
        row = {p: _zero() for p in ("forward", "backward")}
        for p in row:
            row[p]["all_to_all"] = {"count": 2, "bytes": r[f"{p}_qkv"] + r[f"{p}_o"]}
        out.append(row)
    return out


def predicted_by_workload(case: Case) -> list[dict[str, dict[str, dict[str, int]]]]:
    """The same per sp rank through :class:`~simulations.config.Workload` (the records'
    ``bytes_by_rank``); checks too that each record's ``bytes`` is the busiest rank's."""
    shape = ModelShape(
        "measure", 1, case.N * case.H, case.N, case.K, case.H, ffn_dim=8, vocab_size=8
    )
    w = Workload(
        shape,
        case.S,
        dp=case.dp,
        sp=case.sp,
        micro_batch=case.B // case.dp,
        dtype=case.dtype,
        ac="none",
        pack_docs=case.pack_docs,
    )
    busiest = comm.ulysses_busiest_rank(w)
    out = [{p: _zero() for p in ("forward", "backward")} for _ in range(case.sp)]
    for c in comm.per_layer_attention(w):
        per = c.bytes_by_rank or (c.bytes,) * case.sp
        if per[busiest] != c.bytes:
            raise AssertionError(f"{c.what} {c.phase}: bytes {c.bytes} != busiest rank's {per}")
        for r in range(case.sp):
            out[r][c.phase][c.kind]["count"] += c.calls
            out[r][c.phase][c.kind]["bytes"] += int(per[r])
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
        Bl = case.B // case.dp
        sizes = seq_split(case.S, case.sp)  # DTensor's Shard(1): uneven when sp does not divide S
        s = sizes[mesh.get_local_rank("sp")]

        def place(t, case=case, mesh=mesh):
            shape = torch.Size((case.B, case.S, *t.shape[2:]))
            return DTensor.from_local(
                t,
                mesh,
                [Shard(0), Shard(1)],
                run_check=False,
                shape=shape,
                stride=contiguous_stride(shape),
            )

        def make(heads: int, gen=gen, Bl=Bl, s=s, case=case):
            t = torch.randn(Bl, s, heads, case.H, generator=gen).to(dtypes[case.dtype])
            return place(t.requires_grad_(True))

        q, k, v = make(case.N), make(case.K), make(case.K)
        with du.CommCounter() as fwd:
            if case.pack_docs:  # as the trainer runs it: the engine with the step's layout
                starts = ((0, case.S // 3),) * Bl  # two documents
                layout = du.SeqLayout.split(case.S, case.sp, starts)
                engine = du.UlyssesAttention(du.LocalAttention("sdpa"), mesh["sp"])
                o_local = engine(q.to_local(), k.to_local(), v.to_local(), layout=layout)
            else:
                o = du.ulysses_attention(q, k, v, causal=True, backend="sdpa", allow_uneven=True)
                o_local = o.to_local()
        loss = o_local.float().square().sum()
        with du.CommCounter() as bwd:
            loss.backward()
        sp_group = mesh.get_group("sp")
        row = {}
        for phase, counter in (("forward", fwd), ("backward", bwd)):
            row[phase] = {
                "by_kind": counter.by_kind(),
                "sp": {
                    kind: {
                        "count": counter.count(kind, group=sp_group),
                        "bytes": counter.bytes(kind, group=sp_group),
                    }
                    for kind in KINDS
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
    # the Workload API (records, bytes_by_rank, busiest rank) must agree with the per-rank model
    try:
        via_workload = predicted_by_workload(case)
    except AssertionError as e:
        problems.append(f"Workload: {e}")
        via_workload = []
    for r, want in enumerate(via_workload):
        if want != pred[r]:
            problems.append(f"sp rank {r}: Workload reports {want}, per-rank model {pred[r]}")
    for r, meas in enumerate(ranks):
        for phase in ("forward", "backward"):
            kinds = meas[phase]["by_kind"]
            sp = meas[phase]["sp"]
            want = pred[r][phase]
            if sp != want:
                problems.append(f"rank {r} {phase}: measured {sp}, predicted {want}")
            on_sp = {k: v for k, v in sp.items() if v["count"]}
            if kinds != on_sp:
                problems.append(f"rank {r} {phase}: unexpected collectives {kinds}")
    return problems
