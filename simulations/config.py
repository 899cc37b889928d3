"""The inputs of one prediction: model shape, sequence, layout, precision, memory options, GPU.

Kept in one file (~300 lines): one dataclass, its validation and the layout it derives.

:class:`Workload` validates everything up front, so every later formula can assume sane numbers;
each error names the offending numbers and the fix.

Legend used across the package (per rank unless said otherwise):

    L layers, D hidden, N q heads, K kv heads, H head dim, F FFN size, V vocab
    S sequence length, B micro-batch per dp rank, P sequence-parallel degree
    s = ceil(S / P) tokens of the busiest rank (S / P when P divides S), s_r those of rank r
    n_r, m_r q and kv heads rank r attends with under Ulysses (``dtensor_ulysses.plan.splits``)
    W = dp * P ranks in all, e bytes per activation element

Uneven layouts (Ulysses only, as the real code): ``P`` need not divide ``N`` (ranks attend with
``ceil`` or ``floor(N / P)`` heads, :func:`dtensor_ulysses.plan.head_split`; ``P > N`` is an
error) nor ``S`` (DTensor's ``Shard(1)``: chunks of ``ceil(S / P)``, the last ones shorter or
empty, :func:`dtensor_ulysses.plan.seq_split`). Every per-rank figure is then the busiest rank's:
attention work scales with ``max n_r`` (:attr:`Workload.attention_imbalance` = max / mean), the
rest of the block with ``max s_r`` (:attr:`Workload.token_imbalance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dtensor_ulysses.plan import (
    HeadPlan,
    ModelShape,
    check_sp_for_heads,
    divisors,
    get_shape,
    head_plan,
    seq_split,
)
from simulations.hardware import GpuProfile, get_gpu

__all__ = [
    "AC_MODES",
    "DTYPE_BYTES",
    "IMPLEMENTATIONS",
    "METHODS",
    "Workload",
    "divisors",
]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
METHODS = ("ulysses", "ring", "megatron-sp", "usp")
AC_MODES = ("none", "full")
SHARDING = ("fsdp", "ddp")
# Activation/state accounting profiles (see simulations/profiles.py):
#   "dtensor-ulysses": this project (FSDP2 + dtensor_ulysses/models/llama.py), the default;
#   "hf-deepspeed", "hf-deepspeed-fused", "hf": Hugging Face Transformers (+ DeepSpeed ZeRO-3), the
#   setups of the published ALST and Hugging Face rows (M3, M4, T2).
IMPLEMENTATIONS = ("dtensor-ulysses", "hf-deepspeed", "hf-deepspeed-fused", "hf")


def _fmt_set(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer; use {name} >= 1")
    return value


@dataclass(frozen=True)
class Workload:
    """One training configuration, per step of one micro-batch per dp rank.

    Attributes:
        shape: model shape (a :class:`~dtensor_ulysses.plan.ModelShape` or a preset name).
        seq_len: tokens per sequence ``S``.
        dp: data-parallel degree (different sequences).
        sp: sequence-parallel degree ``P`` (Ulysses degree; for ``ring`` the ring size, for
            ``megatron-sp`` the tensor-parallel size, for ``usp`` ulysses x ring).
        gpu: GPU profile or its name.
        micro_batch: sequences per dp rank per step ``B``.
        dtype: activation / compute dtype (``bf16``, ``fp16``, ``fp32``).
        ac: activation checkpointing, ``"none"`` or ``"full"`` (every block).
        offload_optimizer: optimizer states (and fp32 master weights) live on the CPU.
        offload_params: parameters, gradients and optimizer states live on the CPU (FSDP2
            ``CPUOffloadPolicy``).
        offload_activations: checkpointed block inputs are copied to the CPU (needs ``ac="full"``).
        tiled_mlp: the MLP runs over sequence tiles and is recomputed per tile in backward.
        tiled_loss: logits and loss are computed over sequence tiles, never materialized whole.
        loss_chunk_tokens: tokens per loss tile (``None``: the profile's default).
        mlp_chunk_tokens: tokens per MLP tile (``None``: ``ceil(s / ceil(s / D))``, ALST's
            choice of about ``D`` tokens per tile).
        head_chunks: Ulysses attention in ``K`` stages of ``N / K`` q heads each (UPipe-style;
            1: all heads at once); must divide the q heads each rank attends with.
        attention: ``ulysses``, ``ring``, ``megatron-sp`` or ``usp``.
        ulysses_degree: for ``usp``, the Ulysses part of ``sp`` (default: the largest divisor of
            ``sp`` that divides the q heads and fits in a node).
        reduce_dtype: gradient reduction dtype (FSDP2 ``MixedPrecisionPolicy.reduce_dtype``).
        sharding: ``fsdp`` (parameters sharded over all ranks) or ``ddp`` (replicated, gradients
            all-reduced; with ``sp=1`` this is plain data parallelism).
        impl: accounting profile, ``dtensor-ulysses`` or ``hf-deepspeed``.
        gpus: total GPUs; must equal ``dp * sp`` when given.
        pack_docs: packed documents: attention stays inside each document; no extra
            communication (the step's layout carries the document starts); attention FLOPs
            still count one causal sequence of ``S`` tokens (an upper bound).
    """

    shape: ModelShape
    seq_len: int
    dp: int = 1
    sp: int = 1
    gpu: GpuProfile = field(default_factory=lambda: get_gpu("h100"))
    micro_batch: int = 1
    dtype: str = "bf16"
    ac: str = "full"
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_activations: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool = False
    loss_chunk_tokens: int | None = None
    mlp_chunk_tokens: int | None = None
    head_chunks: int = 1
    attention: str = "ulysses"
    ulysses_degree: int | None = None
    reduce_dtype: str = "fp32"
    sharding: str = "fsdp"
    impl: str = "dtensor-ulysses"
    gpus: int | None = None
    pack_docs: bool = False

    def __post_init__(self) -> None:
        # Accept names for convenience; store the resolved objects.
        if isinstance(self.shape, str):
            object.__setattr__(self, "shape", get_shape(self.shape))
        if not isinstance(self.shape, ModelShape):
            raise ValueError(f"shape must be a ModelShape or a preset name, got {self.shape!r}")
        object.__setattr__(self, "gpu", get_gpu(self.gpu))
        self._validate()
        if self.attention == "usp" and self.ulysses_degree is None:
            object.__setattr__(self, "ulysses_degree", self._default_ulysses_degree())

    # ------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        _positive_int("seq_len", self.seq_len)
        _positive_int("dp", self.dp)
        _positive_int("sp", self.sp)
        _positive_int("micro_batch", self.micro_batch)
        for name, value, allowed in (
            ("dtype", self.dtype, tuple(DTYPE_BYTES)),
            ("reduce_dtype", self.reduce_dtype, tuple(DTYPE_BYTES)),
            ("ac", self.ac, AC_MODES),
            ("attention", self.attention, METHODS),
            ("sharding", self.sharding, SHARDING),
            ("impl", self.impl, IMPLEMENTATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; choose one of {allowed}")
        if self.gpus is not None:
            _positive_int("gpus", self.gpus)
            if self.gpus != self.dp * self.sp:
                raise ValueError(
                    f"gpus={self.gpus} but dp * sp = {self.dp} * {self.sp} = "
                    f"{self.dp * self.sp}; choose dp and sp whose product is {self.gpus}"
                )
        P, N, K = self.sp, self.shape.n_heads, self.shape.n_kv_heads
        if self.attention == "ulysses":  # uneven heads are allowed, as the real code does
            check_sp_for_heads(N, P, allow_uneven=True)
        if self.attention == "megatron-sp":
            if N % P or K % P:
                ok = [d for d in divisors(K) if N % d == 0]
                raise ValueError(
                    f"megatron-sp needs tp=sp={P} to divide both {N} q heads and {K} kv heads; "
                    f"choose sp in {_fmt_set(ok)}"
                )
            if self.sharding == "fsdp" and self.dp == 1:
                pass  # parameters are sharded by tp; fsdp over dp=1 is a no-op
        if self.attention == "usp" and self.ulysses_degree is not None:
            u = _positive_int("ulysses_degree", self.ulysses_degree)
            if P % u:
                raise ValueError(
                    f"ulysses_degree={u} does not divide sp={P}; choose it in "
                    f"{_fmt_set(divisors(P))}"
                )
            if N % u:
                ok = [d for d in divisors(P) if N % d == 0]
                raise ValueError(
                    f"{N} heads are not divisible by ulysses_degree={u}; choose it in "
                    f"{_fmt_set(ok)}"
                )
        elif self.ulysses_degree is not None and self.attention != "usp":
            raise ValueError(
                f"ulysses_degree is only meaningful with attention='usp', not {self.attention!r}"
            )
        if self.seq_len % P and self.attention != "ulysses":
            raise ValueError(
                f"seq_len={self.seq_len} tokens are not divisible by sp={P}; pad the sequence to "
                f"a multiple of {P} (e.g. {seq_split(self.seq_len, P)[0] * P}), or use "
                f"attention='ulysses' (uneven slices)"
            )
        if self.pack_docs and self.attention != "ulysses":
            raise ValueError(
                f"pack_docs is modeled for attention='ulysses' only, not {self.attention!r}"
            )
        if self.offload_activations and self.ac != "full":
            raise ValueError(
                "offload_activations offloads the checkpointed block inputs; it needs ac='full'"
            )
        for name in ("loss_chunk_tokens", "mlp_chunk_tokens"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        _positive_int("head_chunks", self.head_chunks)
        if self.head_chunks > 1:
            if self.attention != "ulysses":
                raise ValueError(
                    f"head_chunks={self.head_chunks} is a Ulysses feature; use "
                    f"attention='ulysses' or head_chunks=1"
                )
            per_rank = max(head_plan(N, K, P).q_heads)
            if N % P or per_rank % self.head_chunks:
                ok = divisors(per_rank) if N % P == 0 else [1]
                raise ValueError(
                    f"head_chunks={self.head_chunks} must divide the {per_rank} q heads each of "
                    f"the sp={P} ranks attends with ({N} heads / {P}); choose it in "
                    f"{_fmt_set(ok)}"
                )
        if self.sharding == "ddp" and (self.offload_params or self.offload_optimizer):
            raise ValueError("offload needs sharding='fsdp' (ZeRO-3 / FSDP2); use sharding='fsdp'")

    def _default_ulysses_degree(self) -> int:
        """USP: the largest divisor of sp that divides the q heads and stays inside one node."""
        cands = [
            d
            for d in divisors(self.sp)
            if self.shape.n_heads % d == 0 and d <= self.gpu.gpus_per_node
        ]
        return max(cands)

    # ------------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Ranks in all, ``W = dp * sp``."""
        return self.dp * self.sp

    @property
    def seq_sizes(self) -> list[int]:
        """Tokens of one sequence per sp rank, ``s_r`` (DTensor ``Shard(1)``: ``ceil(S / P)``
        chunks, the last ones shorter or empty; equal when ``P`` divides ``S``)."""
        return seq_split(self.seq_len, self.sp)

    @property
    def local_seq(self) -> int:
        """Tokens of one sequence held by the busiest rank, ``s = ceil(S / P)`` (rank 0)."""
        return seq_split(self.seq_len, self.sp)[0]

    @property
    def heads(self) -> HeadPlan:
        """q and kv heads per rank of the Ulysses all-to-all group (``dtensor_ulysses.plan``);
        one rank with every head when there is no all-to-all."""
        m = self.shape
        return head_plan(m.n_heads, m.n_kv_heads, self.a2a_degree)

    @property
    def attention_imbalance(self) -> float:
        """Attention work of the busiest rank over the mean, ``max(n_r) * P / N`` (1.0 when the
        heads split evenly; only Ulysses allows them not to)."""
        return self.heads.imbalance

    @property
    def token_imbalance(self) -> float:
        """Tokens of the busiest rank over the mean, ``ceil(S / P) * P / S`` (1.0 when ``P``
        divides ``S``): the matmuls and elementwise work outside attention scale with it."""
        return self.local_seq * self.sp / self.seq_len

    @property
    def e(self) -> int:
        """Bytes per activation element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def ring_degree(self) -> int:
        """Ranks in the ring (``ring``: sp; ``usp``: sp / ulysses degree; else 1)."""
        if self.attention == "ring":
            return self.sp
        if self.attention == "usp":
            return self.sp // int(self.ulysses_degree or 1)
        return 1

    @property
    def a2a_degree(self) -> int:
        """Ranks in the Ulysses all-to-all (``ulysses``: sp; ``usp``: ulysses degree; else 1)."""
        if self.attention == "ulysses":
            return self.sp
        if self.attention == "usp":
            return int(self.ulysses_degree or 1)
        return 1

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (``megatron-sp`` only)."""
        return self.sp if self.attention == "megatron-sp" else 1

    @property
    def shard_degree(self) -> int:
        """Ranks a parameter is sharded over (FSDP2 over dp x sp; Megatron: dp, times tp)."""
        if self.sharding == "ddp":
            return self.tp
        return self.world  # megatron-sp: tp-sharded, then fsdp over dp: dp * tp = world

    def with_(self, **changes) -> Workload:
        """A copy with some inputs changed (validated again)."""
        if "ulysses_degree" not in changes and ("sp" in changes or "attention" in changes):
            changes["ulysses_degree"] = None  # re-derive the USP split for the new layout
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "model": self.shape.name,
            "seq_len": self.seq_len,
            "dp": self.dp,
            "sp": self.sp,
            "gpus": self.world,
            "gpu": self.gpu.name,
            "micro_batch": self.micro_batch,
            "dtype": self.dtype,
            "ac": self.ac,
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "offload_activations": self.offload_activations,
            "tiled_mlp": self.tiled_mlp,
            "tiled_loss": self.tiled_loss,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "mlp_chunk_tokens": self.mlp_chunk_tokens,
            "head_chunks": self.head_chunks,
            "attention": self.attention,
            "ulysses_degree": self.a2a_degree if self.attention == "usp" else None,
            "reduce_dtype": self.reduce_dtype,
            "sharding": self.sharding,
            "impl": self.impl,
            "pack_docs": self.pack_docs,
        }
