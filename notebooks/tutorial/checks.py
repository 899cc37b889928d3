"""What a real run on local ranks reports, compared with the plan and the closed form.

The notebooks (and ``tests/debug/test_layout_helpers.py``) run the library on a gloo world and get
plain data back from every rank; these functions check it against :mod:`dtensor_ulysses.debug`:
the cells each rank holds, the all-to-alls and bytes ``du.CommCounter`` saw, the heads the kernel
received.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dtensor_ulysses.debug import (
    a2a_plan,
    head_ranges,
    kv_plan,
    ownership,
    send_matrix,
    token_ranges,
    ulysses_closed_form,
)

__all__ = [
    "cells_by_stage",
    "decode",
    "loss_agreement",
    "owned_cells",
    "placement_mismatches",
    "round_trip_report",
    "stage_cells",
]


def owned_cells(ranges: Sequence[tuple[int, int]]) -> set[tuple[int, ...]]:
    """Every index tuple inside ``ranges`` (small tensors only: it enumerates them)."""
    return set(itertools.product(*(range(lo, hi) for lo, hi in ranges)))


def decode(codes: Iterable[float], shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Flat (row-major) indices into a ``shape`` tensor -> sorted index tuples."""
    out = []
    for c in sorted({int(v) for v in codes}):
        idx = []
        for size in reversed(shape):
            c, i = divmod(c, size)
            idx.append(i)
        out.append(tuple(idx[::-1]))
    return out


def placement_mismatches(
    cases: Sequence[Mapping[str, Any]], per_rank: Sequence[Sequence[Mapping[str, Any]]]
) -> list[str]:
    """Differences between :func:`~dtensor_ulysses.debug.ownership` and a real run.

    Args:
        cases: ``{"dp", "sp", "shape", "placements"}`` per case.
        per_rank: per rank, per case, ``{"local_shape", "codes"}``: the flat indices of the
            global tensor found in the rank's local shard after ``distribute_tensor``.
    """
    problems = []
    for i, case in enumerate(cases):
        own = ownership(case["shape"], case["placements"], (case["dp"], case["sp"]))
        for rank, rows in enumerate(per_rank):
            got = set(decode(rows[i]["codes"], case["shape"]))
            want = owned_cells(own[rank])
            if got != want or rows[i]["local_shape"] != [hi - lo for lo, hi in own[rank]]:
                problems.append(
                    f"case {i} {case['placements']} rank {rank}: distribute_tensor placed "
                    f"{len(got)} cells, shape {rows[i]['local_shape']}; the placements say "
                    f"{len(want)} ({own[rank]})"
                )
    return problems


def stage_cells(S: int, N: int, sp: int) -> dict[str, dict[int, set[tuple[int, int]]]]:
    """Planned ``(token, head)`` cells per sp rank before, inside and after the round trip."""
    toks, heads = token_ranges(S, sp), head_ranges(N, sp)
    seq = {r: owned_cells([toks[r], (0, N)]) for r in range(sp)}
    head = {r: owned_cells([(0, S), heads[r]]) for r in range(sp)}
    return {"before": seq, "inside": head, "after": seq}


def _cells(codes: Iterable[float], S: int, N: int) -> list[tuple[int, int, int]]:
    """Codes ``(b*S + s)*N + n`` -> sorted ``(b, s, n)``."""
    out = set()
    for c in codes:
        rest, n = divmod(int(c), N)
        b, s = divmod(rest, S)
        out.add((b, s, n))
    return sorted(out)


def cells_by_stage(
    rows: Sequence[Mapping[str, Any]], case: Mapping[str, Any], batch: int = 0, dp_rank: int = 0
) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """``{stage: {sp_rank: [(token, head), ...]}}`` of one batch element, from a real run.

    Args:
        rows: one case's rows, one per rank (``{"coord", "codes": {stage: [...]}}``).
        case: its sizes (``S``, ``N``).
        batch: the batch element to keep.
        dp_rank: the dp coordinate whose sp group to keep.
    """
    out: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for row in rows:
        d, r = row["coord"]
        if d != dp_rank:
            continue
        for stage, codes in row["codes"].items():
            cells = _cells(codes, case["S"], case["N"])
            out.setdefault(stage, {})[r] = [(t, h) for b, t, h in cells if b == batch]
    return out


def round_trip_report(
    rows: Sequence[Mapping[str, Any]], case: Mapping[str, Any]
) -> tuple[str, list[str]]:
    """Compare one case of a real round trip with the plan and the closed form.

    Per rank: the cells held before, inside and after (:func:`~dtensor_ulysses.debug.a2a_plan`);
    one all-to-all per ``seq_to_head``/``head_to_seq`` whose input bytes equal the rank's row of
    :func:`~dtensor_ulysses.debug.send_matrix`; ``ulysses_attention`` forward and backward against
    :func:`~dtensor_ulysses.debug.ulysses_closed_form`; no other collective; the q and kv heads
    the kernel received against :func:`~dtensor_ulysses.debug.kv_plan`. The run is fp32.

    Returns:
        ``(report text, problems)``; no problems means everything matched exactly.
    """
    dp, sp, B, S, N, K, H = (case[k] for k in ("dp", "sp", "B", "S", "N", "K", "H"))
    b_local, e = B // dp, 4
    plan_s2h = send_matrix(a2a_plan(S, N, sp, B=b_local, H=H, elem_bytes=e), sp)
    plan_h2s = send_matrix(a2a_plan(S, N, sp, "head_to_seq", B=b_local, H=H, elem_bytes=e), sp)
    heads = kv_plan(N, K, sp)
    want_cells = stage_cells(S, N, sp)
    problems: list[str] = []
    lines = [
        f"dp={dp} sp={sp}: x[B={B}, S={S}, N={N}, H={H}] fp32, attention with K={K} kv heads",
        f"{'rank':>4} {'(dp,sp)':>7} {'seq_to_head B':>14} {'plan':>6} {'head_to_seq B':>14} "
        f"{'plan':>6} {'attn fwd B':>11} {'closed':>7} {'bwd B':>7} {'closed':>7}  kv heads",
    ]
    for row in rows:
        d, r = row["coord"]
        cf = ulysses_closed_form(b_local, S, N, K, H, sp, e, rank=r)
        first_b = d * b_local  # the first batch element this dp rank holds
        for stage, want in want_cells.items():
            got = {(t, h) for b, t, h in _cells(row["codes"][stage], S, N) if b == first_b}
            if b_local and got != want[r]:
                problems.append(f"rank {row['rank']}: cells {stage} differ from the plan")
        att = row["attention"]
        checks = [
            ("seq_to_head", row["seq_to_head"], 1, sum(plan_s2h[r])),
            ("head_to_seq", row["head_to_seq"], 1, sum(plan_h2s[r])),
            ("attention forward", att["forward"], 2, cf["forward"]["bytes"]),
            ("attention backward", att["backward"], 2, cf["backward"]["bytes"]),
        ]
        for what, m, count, nbytes in checks:
            if sp == 1:
                count, nbytes = 0, 0
            if (m["count"], m["bytes"], m["other"]) != (count, nbytes, 0):
                problems.append(
                    f"rank {row['rank']} {what}: measured {m['count']} all-to-alls, "
                    f"{m['bytes']} B, {m['other']} other collectives; expected {count}, "
                    f"{nbytes} B, 0"
                )
        kern = row.get("kernel", {})
        if kern and (kern["q_heads"], kern["kv_heads"]) != (
            heads[r]["q_heads"],
            heads[r]["kv_heads"],
        ):
            problems.append(f"rank {row['rank']}: kernel got heads {kern}, plan {heads[r]}")
        if not row.get("round_trip_exact", True):
            problems.append(f"rank {row['rank']}: head_to_seq(seq_to_head(x)) != x")
        lines.append(
            f"{row['rank']:>4} {f'({d},{r})':>7} {row['seq_to_head']['bytes']:>14,} "
            f"{sum(plan_s2h[r]):>6,} {row['head_to_seq']['bytes']:>14,} {sum(plan_h2s[r]):>6,} "
            f"{att['forward']['bytes']:>11,} {cf['forward']['bytes']:>7,} "
            f"{att['backward']['bytes']:>7,} {cf['backward']['bytes']:>7,}  {kern.get('kv_heads')}"
        )
    lines.append("all equal to the plan and the closed form" if not problems else "MISMATCHES:")
    lines += problems
    return "\n".join(lines), problems


def loss_agreement(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """Largest relative loss difference of every run from the first one, over common steps."""
    names = list(runs)
    if not names:
        return {}
    ref = {r["step"]: r["loss"] for r in runs[names[0]]}
    out = {}
    for name in names[1:]:
        diffs = [
            abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]])
            for r in runs[name]
            if r["step"] in ref
        ]
        out[name] = max(diffs) if diffs else math.nan
    return out
