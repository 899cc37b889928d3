"""How tokens and heads are split over the sp ranks — torch-free, shared with the simulator.

Legend: ``S`` tokens, ``N`` q heads, ``K`` kv heads, ``P`` the sp degree. Under Ulysses a rank
holds a contiguous slice of the tokens outside attention (:func:`seq_split`, DTensor's
``Shard(1)``) and a contiguous range of heads inside it (:func:`head_split`); :func:`head_plan`
says which kv heads travel to which rank (GQA replication).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DP_AXIS",
    "RING_AXIS",
    "SP_AXIS",
    "check_head_chunks",
    "check_ring_mesh",
    "check_ring_seq",
    "check_sp_for_heads",
    "contiguous_stride",
    "default_loss_chunk",
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "divisors",
    "HEAD_DIM",
    "head_plan",
    "head_split",
    "HeadPlan",
    "kv_head_index",
    "local_tokens",
    "nearby_multiples",
    "padded_seq_len",
    "ring_chunks",
    "ring_closed_form",
    "RING_ORDERS",
    "ring_seq_sizes",
    "SEQ_DIM",
    "seq_split",
    "SeqLayout",
    "ulysses_bytes_by_rank",
    "zigzag_permutation",
    "zigzag_positions",
]

# The device mesh's axis names, spelled here only (plan is the bottom layer, so every layer reads
# them): data-parallel, ring-attention and Ulysses sequence-parallel.
DP_AXIS, RING_AXIS, SP_AXIS = "dp", "ring", "sp"

# The Ulysses layout ``[B, S, N, H]``: the sequence and head dims the all-to-all swaps.
SEQ_DIM, HEAD_DIM = 1, 2

# The tiled loss's default chunk: this many tokens, or all local tokens if fewer.
DEFAULT_LOSS_CHUNK_TOKENS = 2048


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


def padded_seq_len(S: int, sp: int, ring: int = 1) -> int:
    """The shortest length ``>= S`` whose cut leaves every sp rank at least one token.

    DTensor's ``Shard(1)`` cut (:func:`seq_split`) gives chunks of ``ceil(S / sp)``, so a
    row shorter than ``sp`` leaves ranks empty, and so do some longer ones (``S=5, sp=4 ->
    [2, 2, 1, 0]``; ``S=9 -> [3, 3, 3, 0]``). A model layer cannot run on an empty slice
    (transformers' attention reshapes it with a ``-1``), so such a batch is padded at the end
    to this length (``5 -> 7: [2, 2, 2, 1]``; ``2 -> 4``); padding appended after the last real
    token, a document of its own with no labels, changes no real token's result under causal
    attention. With ``ring > 1`` each ring rank's ``S / ring`` tokens are cut over ``sp``; a
    length that is not a multiple of ``2 * ring`` is returned unchanged (the slicer refuses
    it with the lengths that work), else the result stays a multiple of ``2 * ring``.

    Args:
        S: the batch's full length (``0`` allowed).
        sp: the sp degree.
        ring: the ring degree.

    Returns:
        ``S`` when no rank would be empty, else the shortest longer length that leaves none.
    """
    if ring == 1:
        n = max(S, sp)
        while min(seq_split(n, sp)) == 0:  # ends by the next multiple of sp
            n += 1
        return n
    step = 2 * ring
    if S % step:
        return S
    n = max(S, -(-sp * ring // step) * step)
    while min(seq_split(n // ring, sp)) == 0:
        n += step
    return n


def local_tokens(batch_size: int, dp: int, seq_len: int, sp: int, ring: int = 1) -> int:
    """Tokens of the busiest rank's slice: ``(G / dp) * ceil(S / (ring * sp))`` for a global
    batch of ``G`` sequences of ``S`` tokens (with a ring, an sp group sees ``S / ring``)."""
    return batch_size // dp * -(-seq_len // (ring * sp))


def default_loss_chunk(local: int) -> int:
    """The tiled loss's chunk when none is given: :data:`DEFAULT_LOSS_CHUNK_TOKENS`, or all
    ``local`` tokens if fewer."""
    return min(DEFAULT_LOSS_CHUNK_TOKENS, local)


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
    check_sp_for_heads(n_q, sp, allow_uneven=True)
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


@dataclass(frozen=True)
class SeqLayout:
    """One step's sequence layout over the sp ranks, computed once per step with the batch.

    The model passes it, unchanged, to every attention layer, so no layer has to rediscover the
    layout (no position-id all-gather, no device-to-host sync per layer).

    Attributes:
        seq_sizes: tokens held by each sp rank, in rank order (DTensor's ``Shard(1)`` pieces,
            :func:`seq_split`). With ``ring == 1`` ``sum(seq_sizes)`` is the full length ``S``;
            with a ring, they are the pieces of *this ring rank's* ``S / ring`` tokens
            (:func:`ring_seq_sizes`), which the Ulysses all-to-all gathers.
        doc_starts: packed documents: per batch row, the token indices in ``[0, S)`` where a
            document starts (always including 0), for the *full* window (global positions,
            also with a ring); ``None`` when attention runs over the whole sequence.
        ring: the ring degree (Ulysses x Ring); ``1`` without ring attention. The full length
            is then ``S = ring * sum(seq_sizes)`` (:attr:`seq_len`).
        blocks: bidirectional blocks inside causal attention (the tokens of one image, which
            see each other both ways): per batch row, each block's ``(start, end)`` in ``[0, S)``
            (global positions, rising, not overlapping); ``None``: none. The attention kernel
            receives them as ``block_ids[B, S]`` (see ``attention.local_attention``).
    """

    seq_sizes: tuple[int, ...]
    doc_starts: tuple[tuple[int, ...], ...] | None = None
    ring: int = 1
    # doc_starts as device tensors (``_doc_tensors.DocTensors``), attached by the model once per
    # step so that compiled blocks neither guard on the ints nor sync; not part of equality
    doc_tensors: Any = field(default=None, compare=False, repr=False)
    blocks: tuple[tuple[tuple[int, int], ...], ...] | None = None
    # blocks as a device tensor ``[B, S]`` of block ids, attached with doc_tensors
    block_ids: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def split(
        cls,
        seq_len: int,
        sp: int,
        doc_starts: tuple[tuple[int, ...], ...] | None = None,
        *,
        ring: int = 1,
    ) -> SeqLayout:
        """``seq_len`` tokens cut over ``sp`` ranks as DTensor's ``Shard(1)`` does.

        With ``ring > 1``: ``seq_len`` is the full length ``S`` (a multiple of ``2 * ring``,
        :func:`check_ring_seq`), and each ring rank's ``S / ring`` tokens are cut over ``sp``.
        """
        if ring == 1:
            return cls(tuple(seq_split(seq_len, sp)), doc_starts)
        check_ring_seq(seq_len, ring)
        return cls(tuple(ring_seq_sizes(seq_len, ring, sp)), doc_starts, ring)

    def __post_init__(self) -> None:
        if not self.seq_sizes or any(n < 0 for n in self.seq_sizes):
            raise ValueError(f"seq_sizes {self.seq_sizes} must be non-negative, one per sp rank")
        if isinstance(self.ring, bool) or not isinstance(self.ring, int) or self.ring < 1:
            raise ValueError(f"ring={self.ring!r} must be an int >= 1 (1: no ring attention)")
        if self.doc_starts is not None:
            for row, starts in enumerate(self.doc_starts):
                if not starts or starts[0] != 0 or list(starts) != sorted(set(starts)):
                    raise ValueError(
                        f"doc_starts row {row} is {starts}; it must start at 0 and increase"
                    )
                if starts[-1] >= self.seq_len:
                    raise ValueError(
                        f"doc_starts row {row} has a start at {starts[-1]}, past the sequence "
                        f"length {self.seq_len}"
                        + (
                            f" (ring={self.ring} x {self.ring_len} tokens per ring rank; "
                            f"doc_starts are global positions)"
                            if self.ring > 1
                            else ""
                        )
                    )
        for row, spans in enumerate(self.blocks or ()):
            ends = [0, *(x for span in spans for x in span)]
            if any(len(span) != 2 or span[0] >= span[1] for span in spans) or ends != sorted(ends):
                raise ValueError(
                    f"blocks row {row} is {spans}; each block is (start, end) with start < end, "
                    f"the blocks rising and not overlapping"
                )
            if spans and spans[-1][1] > self.seq_len:
                raise ValueError(
                    f"blocks row {row} ends at {spans[-1][1]}, past the sequence length "
                    f"{self.seq_len}"
                )
        if self.blocks is not None and self.ring != 1:
            raise ValueError(
                f"bidirectional blocks with ring={self.ring}: ring attention runs causal "
                f"attention and packed documents only; train without a ring"
            )

    @property
    def seq_len(self) -> int:
        """The full sequence length ``S`` (over all ring ranks: ``ring * sum(seq_sizes)``)."""
        return self.ring * sum(self.seq_sizes)

    @property
    def ring_len(self) -> int:
        """Tokens one ring rank holds, ``sum(seq_sizes)`` (``S`` when ``ring == 1``)."""
        return sum(self.seq_sizes)

    @property
    def sp(self) -> int:
        """The number of sp ranks."""
        return len(self.seq_sizes)

    def offset(self, rank: int) -> int:
        """Index of sp rank ``rank``'s first token in the full sequence (with a ring: in this
        ring rank's tokens, in their local zigzag order)."""
        return sum(self.seq_sizes[:rank])


# ----------------------------------------------------------------------------------------------
# sp checks and the closed-form Ulysses bytes (one wording, one formula: the library, the
# trainer and the simulator all call these)
# ----------------------------------------------------------------------------------------------


def _fmt_set(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def check_sp_for_heads(
    n_heads: int,
    sp: int,
    *,
    what: str = "q heads",
    allow_uneven: bool = False,
    uneven_option: str | None = None,
) -> None:
    """The one sp-vs-heads check: every rank must attend with at least one head, and unless
    ``allow_uneven`` (ranks then attend with ``ceil`` or ``floor(n_heads / sp)`` heads, see
    :func:`head_split`) ``sp`` must divide ``n_heads``.

    Args:
        n_heads: the heads to split (q heads for Ulysses).
        sp: the sp degree.
        what: how the message names the heads (``"q heads"``, ``"heads"``, ``"heads of model
            'tiny'"``).
        allow_uneven: accept ``sp`` not dividing ``n_heads``.
        uneven_option: how the caller spells ``allow_uneven`` (``"--allow-uneven-heads"``,
            ``"allow_uneven_heads=True"``); when given, the message offers it as the other fix.

    Raises:
        ValueError: ``sp < 1``; ``sp > n_heads`` (a rank would hold no head); or ``n_heads % sp``
            without ``allow_uneven``. The message names the valid degrees.
    """
    if sp < 1:
        raise ValueError(f"sp={sp} must be a positive integer; use sp >= 1")
    even = _fmt_set(divisors(n_heads))
    if sp > n_heads:
        raise ValueError(
            f"sp={sp} exceeds the {n_heads} {what} (a rank would hold no head); use sp <= "
            f"{n_heads}: the largest valid sp is {n_heads} (sp in {even} split the heads evenly)"
        )
    if n_heads % sp and not allow_uneven:
        other = f" (or pass {uneven_option} to accept a load imbalance)" if uneven_option else ""
        raise ValueError(
            f"{n_heads} {what} are not divisible by sp={sp}; choose sp in {even}{other}"
        )


def check_head_chunks(
    n_heads: int, sp: int, head_chunks: int, *, name: str = "head_chunks="
) -> None:
    """Head-chunked Ulysses needs even heads per rank and ``head_chunks`` dividing them (the
    rule :meth:`~dtensor_ulysses.plan.ParallelOptions.check` applies; the engine applies it
    again to the heads it is called with).

    ``name`` is how the caller spells the parameter in messages (the trainer: ``"--head-chunks "``).

    Raises:
        ValueError: the numbers and the valid choices.
    """
    if n_heads % sp:
        raise ValueError(
            f"{name}{head_chunks} needs sp={sp} to divide the {n_heads} q heads (ranks "
            f"must hold equal heads); choose sp in {{{', '.join(map(str, divisors(n_heads)))}}}"
        )
    per_rank = n_heads // sp
    if per_rank % head_chunks:
        raise ValueError(
            f"{name}{head_chunks} does not divide the {per_rank} q heads each of the "
            f"sp={sp} ranks holds; choose head_chunks in "
            f"{{{', '.join(map(str, divisors(per_rank)))}}} (UPipe's choice: {per_rank}, one "
            f"head per rank per stage)"
        )


def ulysses_bytes_by_rank(
    n_q: int, n_kv: int, head_dim: int, sp: int, tokens: int | list[int] | tuple[int, ...], e: int
) -> list[dict[str, int]]:
    """Per sp rank, the input bytes of the four all-to-alls of one Ulysses attention call.

    ``tokens``: per rank ``B * s_r`` (the rank's sequence slice, :func:`seq_split`), or one number
    when every rank holds the same; ``e`` bytes per element. Rank ``r`` attends with ``n_r`` q and
    ``m_r`` kv heads (:func:`head_plan`; ``K' = sum_r m_r``) over all ``T = sum_r B * s_r``
    tokens:

    * forward q,k,v (one fused all-to-all): its sequence slice with every (replicated) head,
      ``B*s_r*(N + 2K')*H*e``;
    * forward o: its head slice, ``T*n_r*H*e``;
    * backward o (first in backward): the gradient of its sequence slice, ``B*s_r*N*H*e``;
    * backward q,k,v: the gradients of its head slices, ``T*(n_r + 2 m_r)*H*e``.

    With ``sp`` dividing the heads and the sequence evenly every rank moves
    ``B*s*(N + 2K')*H*e`` and ``B*s*N*H*e`` both ways. ``sp == 1`` issues no all-to-all at all
    (the real code returns early); this formula does not special-case it.

    Raises:
        ValueError: ``tokens`` lists a number of ranks other than ``sp``; the head checks of
            :func:`head_plan`.
    """
    plan = head_plan(n_q, n_kv, sp)
    per_rank = [tokens] * sp if isinstance(tokens, int) else list(tokens)
    if len(per_rank) != sp:
        raise ValueError(f"tokens lists {len(per_rank)} ranks; expected one per rank, sp={sp}")
    k_prime = sum(plan.kv_heads)
    total = sum(per_rank)
    return [
        {
            "forward_qkv": t * (n_q + 2 * k_prime) * head_dim * e,
            "forward_o": total * n * head_dim * e,
            "backward_qkv": total * (n + 2 * m) * head_dim * e,
            "backward_o": t * n_q * head_dim * e,
        }
        for t, n, m in zip(per_rank, plan.q_heads, plan.kv_heads)
    ]


# ----------------------------------------------------------------------------------------------
# ring attention (Ulysses x Ring): who holds which tokens, checks, closed-form p2p bytes. Here,
# torch-free, so the data loader, the trainer's checks, the ring and the simulator share one copy.
# ----------------------------------------------------------------------------------------------
RING_ORDERS = ("zigzag", "contiguous")


def check_ring_seq(S: int, ring: int, order: str = "zigzag") -> None:
    """``S`` tokens must cut into ``2 * ring`` (zigzag) or ``ring`` equal chunks.

    Raises:
        ValueError: the numbers and the nearest lengths that work.
    """
    if order not in RING_ORDERS:
        raise ValueError(f"order={order!r}; use one of {RING_ORDERS}")
    if ring < 1:
        raise ValueError(f"ring={ring} must be >= 1")
    parts = 2 * ring if order == "zigzag" else ring
    if parts > S or S % parts:
        lo, hi = S // parts * parts, -(-S // parts) * parts
        why = f"2 x ring = {parts} zigzag chunks" if order == "zigzag" else f"ring = {parts} blocks"
        raise ValueError(
            f"ring attention over ring={ring} needs the sequence to divide into {why}; "
            f"S={S} tokens {'is shorter than that' if parts > S else 'does not'}: use a multiple "
            f"of {parts} (e.g. {max(lo, parts)} or {hi})"
        )


def ring_chunks(S: int, ring: int, ring_rank: int, order: str = "zigzag") -> list[tuple[int, int]]:
    """Global ``[lo, hi)`` token ranges ring rank ``ring_rank`` holds, in its local order.

    Zigzag: chunks ``ring_rank`` and ``2*ring-1-ring_rank`` of ``S / (2*ring)`` tokens;
    contiguous: ``[r*S/ring, (r+1)*S/ring)``.
    """
    check_ring_seq(S, ring, order)
    if not 0 <= ring_rank < ring:
        raise ValueError(f"ring_rank={ring_rank} is not in 0..{ring - 1}")
    if order == "contiguous":
        L = S // ring
        return [(ring_rank * L, (ring_rank + 1) * L)]
    c = S // (2 * ring)
    head, tail = ring_rank, 2 * ring - 1 - ring_rank
    return [(head * c, (head + 1) * c), (tail * c, (tail + 1) * c)]


def ring_seq_sizes(S: int, ring: int, sp: int) -> list[int]:
    """Tokens of each sp rank within a ring rank's ``S / ring`` (the engine's ``seq_sizes``)."""
    check_ring_seq(S, ring, "contiguous")
    return seq_split(S // ring, sp)


def zigzag_positions(
    S: int, ring: int, sp: int, ring_rank: int, sp_rank: int, order: str = "zigzag"
) -> list[int]:
    """The global token positions the rank at ``(ring_rank, sp_rank)`` holds, in local order.

    A ring rank's tokens (:func:`ring_chunks`, concatenated) are cut over ``sp`` like DTensor's
    ``Shard(1)`` (:func:`ring_seq_sizes`); the Ulysses all-to-all gathers them back in sp order.
    The data loader slices ``tokens[:, zigzag_positions(...)]`` (and labels, position ids alike).
    """
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank={sp_rank} is not in 0..{sp - 1}")
    local = [t for lo, hi in ring_chunks(S, ring, ring_rank, order) for t in range(lo, hi)]
    sizes = seq_split(len(local), sp)
    start = sum(sizes[:sp_rank])
    return local[start : start + sizes[sp_rank]]


def zigzag_permutation(S: int, ring: int, sp: int, order: str = "zigzag") -> list[int]:
    """All ranks' :func:`zigzag_positions`, ring-major then sp: ``x[:, perm]`` reorders a global
    sequence so that DTensor's ``Shard(1)`` on a ``("ring", "sp")`` mesh (ring cuts first) gives
    every rank its zigzag tokens; ``argsort(perm)`` undoes it."""
    return [
        t
        for r in range(ring)
        for p in range(sp)
        for t in zigzag_positions(S, ring, sp, r, p, order)
    ]


def check_ring_mesh(dp: int, ring: int, sp: int, world_size: int) -> None:
    """``dp * ring * sp`` must equal the world size (for ``init_mesh(dp, sp, ring=...)``)."""
    for name, n in ((DP_AXIS, dp), (RING_AXIS, ring), (SP_AXIS, sp)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} must be an int >= 1")
    if dp * ring * sp != world_size:
        raise ValueError(
            f"dp x ring x sp = {dp} x {ring} x {sp} = {dp * ring * sp}, but the world has "
            f"{world_size} ranks; choose degrees whose product is {world_size}"
        )


def ring_closed_form(
    B: int, L: int, n_kv: int, H: int, ring: int, elem_bytes: int = 4, grad_bytes: int = 4
) -> dict[str, dict[str, int]]:
    """p2p sends of one ring-attention call on one rank (receives: the same count and bytes).

    ``L`` tokens per ring rank, ``n_kv`` kv heads the kernel sees (after Ulysses: this sp rank's),
    ``grad_bytes`` the dk/dv accumulators' element size (4; 8 for float64 inputs). With
    ``kv = B*L*2*n_kv*H``: forward ``ring-1`` sends of ``kv*elem_bytes``; backward ``ring-1``
    of ``kv*elem_bytes`` and ``ring`` of ``kv*grad_bytes``. Nothing when ``ring == 1``.
    """
    if ring == 1:
        return {"forward": {"count": 0, "bytes": 0}, "backward": {"count": 0, "bytes": 0}}
    kv = B * L * 2 * n_kv * H
    return {
        "forward": {"count": ring - 1, "bytes": (ring - 1) * kv * elem_bytes},
        "backward": {
            "count": 2 * ring - 1,
            "bytes": (ring - 1) * kv * elem_bytes + ring * kv * grad_bytes,
        },
    }
