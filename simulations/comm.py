"""Communication per rank: which collectives, on which group, how many calls and bytes.

Kept in one file (~500 lines): every collective of a step, for every method, read against the
one byte convention below; split by method the shared records and the per-step sum would scatter.

Byte convention (the project's, as ``CommCounter`` counts): *a rank's bytes for one collective are
the size of the buffer it passes into it* - the local shard for an all-gather, the full buffer for a
reduce-scatter or an all-reduce, the send buffer for an all-to-all or a point-to-point send. The
bytes that actually leave the rank (``wire_bytes``) follow the NCCL bus-bandwidth factors (row C3):

    all-reduce of S bytes           2 (n-1)/n * S
    all-gather (S = gathered size)  (n-1)/n * S  =  (n-1) * input
    reduce-scatter (S = input)      (n-1)/n * S
    all-to-all (S = input)          (n-1)/n * S
    send                            S

Per attention layer, forward (``s = S/P`` local tokens, ``e`` bytes, ``K'`` kv heads after GQA
replication, see :func:`kv_heads_after_replication`):

* Ulysses (``dtensor_ulysses/attention/ulysses.py``): one fused all-to-all of
  ``B*s*(N + 2K')*H*e`` for q, k, v and one of ``B*s*N*H*e`` for o; backward the same two
  again; full recompute replays forward.
  Uneven layouts (``P`` not dividing ``N`` or ``S``) move uneven pieces, per rank ``r`` with
  ``s_r`` tokens, ``n_r`` q and ``m_r`` kv heads (:func:`ulysses_bytes_by_rank`): forward
  ``B*s_r*(N + 2K')*H*e`` and ``B*S*n_r*H*e``, backward ``B*s_r*N*H*e`` (d o) and
  ``B*S*(n_r + 2 m_r)*H*e`` (d q,k,v); the records carry the busiest rank's bytes and every
  rank's in ``bytes_by_rank`` (the closed form is the library's,
  :func:`dtensor_ulysses.plan.ulysses_bytes_by_rank`). Packed documents cost nothing more: the
  step's layout carries the document starts to every layer (only the DTensor API's
  ``position_ids=`` adds an all-gather of ``B*ceil(S/P)*8`` bytes per call; the trainer does not
  use it).
* Ring attention (``dtensor_ulysses/attention/ring.py``, as ring-flash-attn / torch context
  parallel):
  ``P-1`` sends of the local k,v block ``B*s*2K*H*e`` forward; backward ``P-1`` k,v sends plus
  ``P`` sends of the dK,dV accumulators (float32: ``promote_types(dtype, float32)`` in
  ``_ring_kernel.py``). The counts and bytes are the library's closed form,
  :func:`dtensor_ulysses.plan.ring_closed_form` (one formula for the code and the simulator).
* Megatron-LM sequence parallelism (Korthikanti et al., TP size ``t = P``): forward two
  all-gathers of ``B*s*D*e`` (before attention and MLP) and two reduce-scatters of ``B*S*D*e``
  (after them); backward the conjugates (two reduce-scatters, two all-gathers) plus two all-gathers
  that re-gather the sequence-sharded inputs for the weight gradients.
* USP (Fang & Zhao): Ulysses over ``u`` ranks, then a ring over ``r = P/u`` ranks on the
  head-sharded ``S/r``-token blocks.

Per step: FSDP2 all-gathers each block's parameter shard in forward and again in backward (blocks
reshard after forward; the root module does not) and reduce-scatters every unit's gradients;
plain data parallelism all-reduces gradients in 25 MiB buckets; the loss all-reduces the global
valid-token count (int64) and the training loop the gradient norm and the logged loss (fp32 each).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dtensor_ulysses.plan import ModelShape, head_plan, ring_closed_form, ulysses_bytes_by_rank
from simulations.config import DTYPE_BYTES, Workload

__all__ = [
    "KINDS",
    "Collective",
    "CommSummary",
    "bus_factor",
    "collectives",
    "fsdp_units",
    "kv_heads_after_replication",
    "per_layer_attention",
    "ring_min_block",
    "summarize",
    "ulysses_busiest_rank",
    "ulysses_bytes_by_rank",
    "ulysses_rank_tokens",
    "wire_bytes",
]

KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "p2p")
PHASES = ("forward", "backward", "recompute", "optimizer")
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP default bucket_cap_mb=25


# ----------------------------------------------------------------------------------------------
# NCCL accounting (row C3) and ring-attention overlap (row C4)
# ----------------------------------------------------------------------------------------------
def bus_factor(kind: str, n: int) -> float:
    """NCCL bus-bandwidth factor (nccl-tests ``doc/PERFORMANCE.md``): ``busbw = algbw * f``.

    all-reduce ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all ``(n-1)/n``; p2p ``1``.
    """
    if n < 1:
        raise ValueError(f"group size n={n} must be >= 1")
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "p2p":
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}; choose one of {KINDS}")


def wire_bytes(kind: str, input_bytes: float, n: int) -> float:
    """Bytes one rank sends for a collective whose input buffer is ``input_bytes``.

    nccl-tests sizes an all-gather by its *output* (``n * input``), every other collective by its
    input; sent bytes = size * :func:`bus_factor`.
    """
    size = input_bytes * n if kind == "all_gather" else input_bytes
    return size * bus_factor(kind, n)


def ring_min_block(flops_per_s: float, bytes_per_s: float) -> float:
    """Ring Attention (Liu et al.): the smallest block size ``c`` whose compute hides its transfer.

    A block step computes ``4 d c^2`` FLOPs (``q k^T`` and ``p v`` on a ``c``-token block, 2 FLOPs
    per multiply-add) and sends ``4 c d`` bytes (k and v, 16-bit); overlap needs
    ``4 d c^2 / F >= 4 c d / B``, i.e. ``c >= F / B`` tokens.
    """
    return flops_per_s / bytes_per_s


# ----------------------------------------------------------------------------------------------
# GQA replication: the real code's plan (dtensor_ulysses.plan.splits is torch-free)
# ----------------------------------------------------------------------------------------------
def _head_plan(n_q: int, n_kv: int, sp: int) -> list[tuple[int, int]]:
    """Per rank ``(q heads, kv heads after replication)``, from ``dtensor_ulysses.plan.splits``.

    The q heads are split over the ranks as evenly as possible (the first ``n_q % sp`` ranks one
    more); q head ``i`` uses kv head ``i // (n_q / n_kv)``; a rank receives its distinct kv heads
    when each serves equally many consecutive q heads, else one kv head per q head.
    """
    if sp < 1:
        raise ValueError(f"sp={sp} must be between 1 and the {n_q} q heads")
    plan = head_plan(n_q, n_kv, sp)
    return list(zip(plan.q_heads, plan.kv_heads))


def kv_heads_after_replication(n_q: int, n_kv: int, sp: int) -> int:
    """``K'``: kv heads the Ulysses all-to-all moves, summed over the sp ranks they are sent to.

    The real code's plan (:func:`_head_plan`); ``K' = K`` when ``sp`` divides ``n_kv``.
    """
    return sum(m for _, m in _head_plan(n_q, n_kv, sp))


def ulysses_rank_tokens(w: Workload) -> list[int]:
    """``B * s_r`` per rank of the Ulysses all-to-all group (USP: equal ``S/P`` slices)."""
    if w.attention == "ulysses":
        return [w.micro_batch * s for s in w.seq_sizes]
    return [w.micro_batch * w.local_seq] * w.a2a_degree


def ulysses_busiest_rank(w: Workload) -> int:
    """The all-to-all group rank that moves the most bytes per layer (the per-rank figure)."""
    m = w.shape
    ranks = ulysses_bytes_by_rank(
        m.n_heads, m.n_kv_heads, m.head_dim, w.a2a_degree, ulysses_rank_tokens(w), w.e
    )
    totals = [sum(r.values()) for r in ranks]
    return totals.index(max(totals))


# ----------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """Calls of one collective that a rank issues, per layer or per step.

    Attributes:
        what: what moves (``"ulysses q,k,v"``, ``"fsdp params"``, ...).
        kind: one of :data:`KINDS`.
        group: process group (``sp``, ``dp_sp``, ``dp``, ``tp``, ``ring``, ``ulysses``).
        group_size: ranks in the group.
        span: consecutive global ranks the group covers (``> gpus_per_node``: crosses nodes).
        phase: ``forward``, ``backward`` or ``recompute``.
        scope: ``layer`` (issued by every block) or ``step`` (once per step).
        calls: calls per scope.
        bytes: input-buffer bytes per scope (all calls together), of this rank (for Ulysses with
            an uneven layout, the busiest rank of the group).
        bytes_by_rank: where ranks of the group differ (uneven Ulysses layouts), ``bytes`` of
            every rank of the group in group-rank order; ``None`` when all are equal.
    """

    what: str
    kind: str
    group: str
    group_size: int
    span: int
    phase: str
    scope: str
    calls: int
    bytes: float
    bytes_by_rank: tuple[float, ...] | None = None

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends per scope (NCCL bus factors, row C3)."""
        return wire_bytes(self.kind, self.bytes, self.group_size)

    def per_step(self, n_layers: int) -> tuple[int, float, float]:
        """``(calls, bytes, wire_bytes)`` per training step."""
        k = n_layers if self.scope == "layer" else 1
        return self.calls * k, self.bytes * k, self.wire_bytes * k

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.bytes_by_rank is None:
            del d["bytes_by_rank"]
        else:
            d["bytes_by_rank"] = [_num(b) for b in self.bytes_by_rank]
        d["wire_bytes"] = self.wire_bytes
        return d


def _phases(w: Workload, items: list[Collective]) -> list[Collective]:
    """Forward items plus their replay under full activation checkpointing."""
    if w.ac != "full":
        return items
    from dataclasses import replace

    return items + [replace(c, phase="recompute") for c in items if c.phase == "forward"]


# ----------------------------------------------------------------------------------------------
# attention layer, per method
# ----------------------------------------------------------------------------------------------
def _ulysses(w: Workload, P: int, group: str, span: int) -> list[Collective]:
    """Ulysses all-to-alls of one layer over ``P`` ranks, for the busiest rank (all ranks are
    equal when ``P`` divides the q heads and the sequence and the kv heads split evenly). Packed
    documents add nothing: the trainer passes the step's layout, no position ids travel."""
    if P == 1:
        return []  # dtensor_ulysses.comm.alltoall returns early for a one-rank group
    m = w.shape
    ranks = ulysses_bytes_by_rank(
        m.n_heads, m.n_kv_heads, m.head_dim, P, ulysses_rank_tokens(w), w.e
    )
    worst = ranks[ulysses_busiest_rank(w)]
    out = []
    # ulysses.py: q,k,v in one fused all-to-all, o in another; backward moves the gradients
    for phase in ("forward", "backward"):
        for what, key in (("ulysses q,k,v", f"{phase}_qkv"), ("ulysses o", f"{phase}_o")):
            per = tuple(r[key] for r in ranks)
            out.append(
                Collective(
                    what,
                    "all_to_all",
                    group,
                    P,
                    span,
                    phase,
                    "layer",
                    1,
                    worst[key],
                    None if len(set(per)) == 1 else per,
                )
            )
    return out


def _ring_grad_bytes(e: int) -> int:
    """Element size of the dK,dV accumulators: the ring kernel accumulates in
    ``promote_types(dtype, float32)`` (``dtensor_ulysses/attention/_ring_kernel.py``), 4 bytes
    for bf16, fp16 and fp32 alike."""
    return max(e, DTYPE_BYTES["fp32"])


def _ring(w: Workload, r: int, kv_heads: int, tokens: int, group: str, span: int):
    """Ring attention over ``r`` ranks, each holding ``tokens`` tokens of ``kv_heads`` kv heads.

    Counts and bytes are :func:`dtensor_ulysses.plan.ring_closed_form` (``L = tokens``,
    ``n_kv = kv_heads``). Its backward (``2r - 1`` sends) is listed as two records: the k,v blocks
    going round again (``r - 1`` sends of ``kv * e``, the closed form with ``grad_bytes=0``) and
    the dK,dV accumulators travelling with them, one more hop home (``r`` sends of ``kv * 4``, the
    closed form with ``elem_bytes=0``).
    """
    if r == 1:
        return []
    B, H, e, g = w.micro_batch, w.shape.head_dim, w.e, _ring_grad_bytes(w.e)
    whole = ring_closed_form(B, tokens, kv_heads, H, r, elem_bytes=e, grad_bytes=g)
    kv = ring_closed_form(B, tokens, kv_heads, H, r, elem_bytes=e, grad_bytes=0)["backward"]
    dkv = ring_closed_form(B, tokens, kv_heads, H, r, elem_bytes=0, grad_bytes=g)["backward"]
    fwd, bwd = whole["forward"], whole["backward"]
    kv_calls = fwd["count"]  # backward replays the forward's k,v hops
    assert kv["bytes"] + dkv["bytes"] == bwd["bytes"], "the split must add up to the closed form"
    return [
        # forward: each of the r-1 steps passes the k,v block on
        Collective(
            "ring k,v", "p2p", group, r, span, "forward", "layer", fwd["count"], fwd["bytes"]
        ),
        # backward: k,v go round again, and the dK,dV accumulators travel with them, one more
        # hop to return home
        Collective("ring k,v", "p2p", group, r, span, "backward", "layer", kv_calls, kv["bytes"]),
        Collective(
            "ring dk,dv", "p2p", group, r, span, "backward", "layer", bwd["count"] - kv_calls,
            dkv["bytes"],
        ),
    ]  # fmt: skip


def _megatron(w: Workload) -> list[Collective]:
    """Megatron-LM TP + sequence parallelism over ``t = sp`` ranks, one layer."""
    t = w.tp
    if t == 1:
        return []
    D = w.shape.dim
    shard = w.micro_batch * w.local_seq * D * w.e  # B*s*D*e: a sequence shard
    full = shard * t  # B*S*D*e: the gathered sequence
    g, span = "tp", t
    return [
        # forward: g (all-gather) before attention and MLP, g-bar (reduce-scatter) after them
        Collective("tp+sp gather", "all_gather", g, t, span, "forward", "layer", 2, 2 * shard),
        Collective("tp+sp scatter", "reduce_scatter", g, t, span, "forward", "layer", 2, 2 * full),
        # backward: conjugates, plus the re-gather of the saved sharded inputs for weight grads
        Collective("tp+sp gather", "all_gather", g, t, span, "backward", "layer", 4, 4 * shard),
        Collective("tp+sp scatter", "reduce_scatter", g, t, span, "backward", "layer", 2, 2 * full),
        # norm weights are replicated over tp but see different tokens: all-reduce their grads
        Collective("tp+sp norm grads", "all_reduce", g, t, span, "backward", "layer", 1,
                   2 * D * DTYPE_BYTES[w.reduce_dtype]),
    ]  # fmt: skip


def per_layer_attention(w: Workload) -> list[Collective]:
    """The collectives one transformer block issues (forward, backward, recompute)."""
    m = w.shape
    if w.attention == "ulysses":
        items = _ulysses(w, w.sp, "sp", w.sp)
    elif w.attention == "ring":
        items = _ring(w, w.sp, m.n_kv_heads, w.local_seq, "ring", w.sp)
    elif w.attention == "megatron-sp":
        items = _megatron(w)
    else:  # usp: ulysses inside, ring across
        u, r = w.a2a_degree, w.ring_degree
        items = _ulysses(w, u, "ulysses", u)
        # after the all-to-all a rank holds S/r tokens of its m_r kv heads (K'/u when they split
        # evenly); the ring's kernel sees those, the busiest rank the most
        items += _ring(w, r, max(w.heads.kv_heads), w.local_seq * u, "ring", u * r)
    return _phases(w, items)


# ----------------------------------------------------------------------------------------------
# parameters: FSDP2 / DDP; loss
# ----------------------------------------------------------------------------------------------
def fsdp_units(shape: ModelShape) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes of one block and of the root module (embedding, final norm, head)."""
    D, N, K, H, F, V = (
        shape.dim,
        shape.n_heads,
        shape.n_kv_heads,
        shape.head_dim,
        shape.ffn_dim,
        shape.vocab_size,
    )
    block = [(N * H, D), (K * H, D), (K * H, D), (D, N * H), (F, D), (F, D), (D, F), (D,), (D,)]
    if shape.qk_norm:
        block += [(H,), (H,)]
    root = [(V, D), (D,)] + ([] if shape.tie_embeddings else [(V, D)])
    return {"block": block, "root": root}


def _padded_shard_numel(shapes: list[tuple[int, ...]], n: int) -> tuple[int, int]:
    """FSDP2 pads dim 0 of each parameter to a multiple of ``n``: (shard numel, padded numel)."""
    shard = 0
    for sh in shapes:
        rest = math.prod(sh[1:])
        shard += -(-sh[0] // n) * rest
    return shard, shard * n


def _params(w: Workload) -> list[Collective]:
    m = w.shape
    units = fsdp_units(m)
    t = w.tp
    if t > 1:  # Megatron: matmul weights are split by t; the vocab by t too
        units = {
            "block": [(a // t, *b) if len(b) else (a,) for a, *b in units["block"]],
            "root": [(a // t, *b) if len(b) else (a,) for a, *b in units["root"]],
        }
    pe, re_ = DTYPE_BYTES[w.dtype], DTYPE_BYTES[w.reduce_dtype]
    if w.sharding == "ddp":
        n = w.world // t
        if n == 1:
            return []
        numel = sum(math.prod(s) for s in units["block"]) * m.n_layers + sum(
            math.prod(s) for s in units["root"]
        )
        b = numel * re_
        calls = max(1, math.ceil(b / DDP_BUCKET_BYTES))
        grp = "dp" if t > 1 else "dp_sp"
        return [
            Collective("ddp grads", "all_reduce", grp, n, w.world, "backward", "step", calls, b)
        ]
    n = w.world // t  # FSDP over dp (x sp) ranks
    if n == 1:
        return []
    grp = "dp" if t > 1 else "dp_sp"
    blk_shard, blk_full = _padded_shard_numel(units["block"], n)
    root_shard, root_full = _padded_shard_numel(units["root"], n)
    L = m.n_layers
    return [
        # FSDP2: forward all-gather of every unit's shard in param_dtype (root + L blocks) ...
        Collective("fsdp params", "all_gather", grp, n, w.world, "forward", "step", L + 1,
                   (L * blk_shard + root_shard) * pe),
        # ... backward all-gather again for blocks (reshard_after_forward=True; the root keeps
        # its unsharded parameters between forward and backward)
        Collective("fsdp params", "all_gather", grp, n, w.world, "backward", "step", L,
                   L * blk_shard * pe),
        # reduce-scatter of every unit's full gradient in reduce_dtype
        Collective("fsdp grads", "reduce_scatter", grp, n, w.world, "backward", "step", L + 1,
                   (L * blk_full + root_full) * re_),
    ]  # fmt: skip


def _loss(w: Workload) -> list[Collective]:
    out = []
    if w.world > 1:
        # dtensor_ulysses/models/loss.py global_valid_tokens: one int64 all-reduce before backward;
        # train/loop.py: the gradient-norm clip (one fp32 scalar) and the logged loss sum (one fp32)
        out += [
            Collective("valid token count", "all_reduce", "world", w.world, w.world,
                       "forward", "step", 1, 8),
            Collective("grad norm, loss log", "all_reduce", "world", w.world, w.world,
                       "optimizer", "step", 2, 2 * DTYPE_BYTES["fp32"]),
        ]  # fmt: skip
    t = w.tp
    if t > 1:  # Megatron vocab-parallel embedding, head and cross entropy
        shard = w.micro_batch * w.local_seq * w.shape.dim * w.e
        rows = w.micro_batch * w.seq_len * DTYPE_BYTES["fp32"]
        out += [
            Collective("embedding out", "reduce_scatter", "tp", t, t, "forward", "step", 1,
                       shard * t),
            Collective("embedding out", "all_gather", "tp", t, t, "backward", "step", 1, shard),
            Collective("head in", "all_gather", "tp", t, t, "forward", "step", 1, shard),
            Collective("head in", "reduce_scatter", "tp", t, t, "backward", "step", 1, shard * t),
            # vocab-parallel cross entropy: max, sum of exp, target logit over the vocab shards
            Collective("vocab-parallel CE", "all_reduce", "tp", t, t, "forward", "step", 3,
                       3 * rows),
        ]  # fmt: skip
    return out


def collectives(w: Workload) -> list[Collective]:
    """Every collective of one training step (per-layer ones listed once, ``scope="layer"``)."""
    return per_layer_attention(w) + _params(w) + _loss(w)


# ----------------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommSummary:
    """Per-rank communication of one step.

    Attributes:
        bytes_by_kind: input-buffer bytes per step by collective kind (all of :data:`KINDS`).
        wire_by_kind: bytes sent per step by kind.
        calls_by_kind: calls per step by kind.
        by_phase: ``{phase: {kind: bytes}}`` per step.
        per_layer: ``{phase: {kind: bytes}}`` of one block.
        items: the underlying records.
    """

    bytes_by_kind: dict[str, float]
    wire_by_kind: dict[str, float]
    calls_by_kind: dict[str, int]
    by_phase: dict[str, dict[str, float]]
    per_layer: dict[str, dict[str, float]]
    items: list[Collective]

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_by_kind.values())

    @property
    def total_wire(self) -> float:
        return sum(self.wire_by_kind.values())

    def to_dict(self) -> dict:
        return {
            "comm_bytes": {k: _num(v) for k, v in self.bytes_by_kind.items()},
            "comm_wire_bytes": {k: _num(v) for k, v in self.wire_by_kind.items()},
            "comm_calls": dict(self.calls_by_kind),
            "comm_bytes_by_phase": {
                p: {k: _num(v) for k, v in d.items()} for p, d in self.by_phase.items()
            },
            "comm_bytes_per_layer": {
                p: {k: _num(v) for k, v in d.items()} for p, d in self.per_layer.items()
            },
            "collectives": [c.to_dict() for c in self.items],
        }


def _num(v: float) -> int | float:
    return int(v) if float(v).is_integer() else v


def summarize(w: Workload) -> CommSummary:
    """Aggregate :func:`collectives` into per-step totals by kind and phase."""
    items = collectives(w)
    L = w.shape.n_layers
    b = dict.fromkeys(KINDS, 0.0)
    wb = dict.fromkeys(KINDS, 0.0)
    calls = dict.fromkeys(KINDS, 0)
    by_phase = {p: dict.fromkeys(KINDS, 0.0) for p in PHASES}
    per_layer = {p: dict.fromkeys(KINDS, 0.0) for p in PHASES}
    for c in items:
        n, by, wi = c.per_step(L)
        b[c.kind] += by
        wb[c.kind] += wi
        calls[c.kind] += n
        by_phase[c.phase][c.kind] += by
        if c.scope == "layer":
            per_layer[c.phase][c.kind] += c.bytes
    return CommSummary(b, wb, calls, by_phase, per_layer, items)
