"""How tokens and heads are split over the sp ranks — torch-free, shared with the simulator.

Legend: ``S`` tokens, ``N`` q heads, ``K`` kv heads, ``P`` the sp degree. Under Ulysses a rank
holds a contiguous slice of the tokens outside attention (:func:`seq_split`, DTensor's
``Shard(1)``) and a contiguous range of heads inside it (:func:`head_split`); :func:`head_plan`
says which kv heads travel to which rank (GQA replication).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = [
    "HeadPlan",
    "contiguous_stride",
    "divisors",
    "head_plan",
    "head_split",
    "kv_head_index",
    "nearby_multiples",
    "seq_split",
]


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order (the degrees that split ``n`` evenly)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def nearby_multiples(n: int, k: int) -> str:
    """The multiples of ``k`` around ``n``, for error messages: ``(63, 2) -> "62 or 64"``."""
    lo, hi = n // k * k, (n // k + 1) * k
    return f"{lo} or {hi}" if lo > 0 else str(hi)


def contiguous_stride(shape) -> tuple[int, ...]:
    """Row-major strides of a tensor of ``shape`` (for ``DTensor.from_local(shape=, stride=)``)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def seq_split(S: int, P: int) -> list[int]:
    """Tokens per sp rank under DTensor's ``Shard(1)``: chunks of ``ceil(S / P)``, the last ones
    shorter or empty (``S=37, P=4 -> [10, 10, 10, 7]``)."""
    chunk = -(-S // P)
    return [max(0, min(chunk, S - r * chunk)) for r in range(P)]


def head_split(N: int, P: int) -> list[int]:
    """q heads per sp rank inside attention: as even as possible, the first ``N % P`` ranks one
    more (``N=12, P=8 -> [2, 2, 2, 2, 1, 1, 1, 1]``)."""
    return [N // P + (1 if r < N % P else 0) for r in range(P)]


@dataclass(frozen=True)
class HeadPlan:
    """Which q and kv heads each sp rank attends with.

    Attributes:
        q_heads: q heads per rank (rank ``r`` holds a contiguous range, in rank order).
        kv_index: per rank, the kv heads sent to it, ordered so that its local q head ``j`` uses
            its local kv head ``j // (q_heads[r] / len(kv_index[r]))``.
        n_kv: kv heads of the model.
    """

    q_heads: tuple[int, ...]
    kv_index: tuple[tuple[int, ...], ...]
    n_kv: int

    @property
    def kv_heads(self) -> list[int]:
        """kv heads per rank after replication."""
        return [len(k) for k in self.kv_index]

    @property
    def is_plain_shard(self) -> bool:
        """True when the kv heads are simply split in order (no replication, no reordering)."""
        return [h for heads in self.kv_index for h in heads] == list(range(self.n_kv))

    @property
    def imbalance(self) -> float:
        """Attention work of the busiest rank over the mean (1.0 when N divides evenly)."""
        return max(self.q_heads) * len(self.q_heads) / sum(self.q_heads)


@functools.cache  # a pure function of three ints, asked once per attention layer and call
def head_plan(n_q: int, n_kv: int, sp: int) -> HeadPlan:
    """Split ``n_q`` q heads over ``sp`` ranks and give each rank the kv heads its q heads use.

    q head ``i`` uses kv head ``i // (n_q / n_kv)``. A rank whose q heads use each of its distinct
    kv heads for equally many consecutive q heads receives just those (sharded, or replicated on
    several ranks when ``sp > n_kv``); otherwise it receives one kv head per q head.

    Raises:
        ValueError: ``n_kv`` does not divide ``n_q``, or ``sp > n_q`` (a rank would hold no head).
    """
    if n_q % n_kv:
        raise ValueError(f"{n_q} q heads are not a multiple of {n_kv} kv heads")
    if sp > n_q:
        raise ValueError(
            f"sp={sp} exceeds the {n_q} q heads (a rank would hold no head); "
            f"use sp <= {n_q} (the largest valid sp is {n_q})"
        )
    group = n_q // n_kv
    q_heads = head_split(n_q, sp)
    kv_index, first = [], 0
    for n in q_heads:
        needed = [i // group for i in range(first, first + n)]
        first += n
        distinct = list(dict.fromkeys(needed))
        m = len(distinct)
        uniform = n % m == 0 and all(needed[j] == distinct[j // (n // m)] for j in range(n))
        kv_index.append(tuple(distinct if uniform else needed))
    return HeadPlan(tuple(q_heads), tuple(kv_index), n_kv)


def kv_head_index(n_q: int, n_kv: int, sp: int) -> list[int] | None:
    """The kv heads sent to each rank, concatenated in rank order (see :func:`head_plan`).

    ``None`` means "no replication needed: the kv heads are sharded as they are".

    Examples: ``(8, 2, 4) -> [0, 0, 1, 1]`` (each kv head on two ranks);
    ``(8, 1, 4) -> [0, 0, 0, 0]``; ``(8, 4, 2) -> None``.
    """
    plan = head_plan(n_q, n_kv, sp)
    return None if plan.is_plain_shard else [h for heads in plan.kv_index for h in heads]
