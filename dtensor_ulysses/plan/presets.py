"""Model shapes, torch-free: the one table read by the model and the simulator.

Importing this module does not import torch, so ``simulations/`` stays a pure-Python cost model.
Shapes follow the published configs of each model family.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from dtensor_ulysses.plan.splits import divisors

__all__ = [
    "HYBRID_PRESETS",
    "LinearAttentionShape",
    "ModelShape",
    "PRESETS",
    "get_shape",
    "training_flops_per_token",
]


@dataclass(frozen=True)
class LinearAttentionShape:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3-Next).

    Attributes:
        k_heads: linear key heads (``linear_num_key_heads``; q has as many).
        v_heads: value heads (``linear_num_value_heads``; a multiple of ``k_heads``).
        k_dim: key head dim (``linear_key_head_dim``).
        v_dim: value head dim (``linear_value_head_dim``).
        conv_kernel: the depthwise causal convolution's width (``linear_conv_kernel_dim``).
        full_every: every ``full_every``-th layer is full attention (``full_attention_interval``),
            the others Gated DeltaNet.
        model_type: the transformers ``model_type`` the memory tracer builds.
    """

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4
    full_every: int = 4
    model_type: str = "qwen3_5_text"

    def layer_types(self, n_layers: int) -> list[str]:
        """``config.layer_types`` of ``n_layers`` blocks (transformers' rule)."""
        return [
            "full_attention" if (i + 1) % self.full_every == 0 else "linear_attention"
            for i in range(n_layers)
        ]

    def params(self, dim: int) -> int:
        """Weights of one Gated DeltaNet mixer (projections, conv, A_log, dt_bias, norm)."""
        kd, vd = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        conv = (2 * kd + vd) * self.conv_kernel
        return (
            dim * (2 * kd + vd)
            + dim * vd
            + 2 * dim * self.v_heads
            + conv
            + 2 * (self.v_heads)
            + self.v_dim
            + vd * dim
        )


@dataclass(frozen=True)
class ModelShape:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    Attributes:
        name: preset name.
        n_layers: transformer blocks.
        dim: hidden size.
        n_heads: q heads.
        n_kv_heads: k/v heads (GQA when smaller than ``n_heads``).
        head_dim: per-head size (``n_heads * head_dim`` may differ from ``dim``, as in Qwen3).
        ffn_dim: SwiGLU inner size.
        vocab_size: embedding rows.
        tie_embeddings: output head shares the embedding matrix.
        qk_norm: RMSNorm on q and k per head (Qwen3).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        linear: a hybrid's Gated DeltaNet layers (``None``: every layer is full attention).
            The full-attention layers of a hybrid have Qwen3.5's output gate (``q_proj`` twice
            as wide). The cost model (``simulations predict``) still treats every layer as full
            attention; the memory tracer builds the real transformers model
            (:meth:`hf_config`).
    """

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    qk_norm: bool = False
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    linear: LinearAttentionShape | None = None

    def __post_init__(self) -> None:
        for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field}={value!r} must be a positive int")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.name}: {self.n_heads} q heads are not a multiple of "
                f"{self.n_kv_heads} kv heads"
            )

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        D, L, V = self.dim, self.n_layers, self.vocab_size
        attn = (
            D * self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
            + self.n_heads * self.head_dim * D
        )
        qk = 2 * self.head_dim if self.qk_norm else 0
        block = attn + 3 * D * self.ffn_dim + 2 * D + qk
        head = 0 if self.tie_embeddings else V * D
        if self.linear is None:
            return V * D + L * block + D + head
        n_full = self.linear.layer_types(L).count("full_attention")
        gate = D * self.n_heads * self.head_dim  # the output gate's half of q_proj
        mlp = 3 * D * self.ffn_dim + 2 * D
        mixers = n_full * (attn + qk + gate) + (L - n_full) * self.linear.params(D)
        return V * D + L * mlp + mixers + D + head

    def hf_config(self) -> dict:
        """The transformers ``config.json`` of a hybrid preset (what the memory tracer builds).

        Raises:
            ValueError: the shape has no linear-attention layers.
        """
        lin = self.linear
        if lin is None:
            raise ValueError(f"{self.name} is not a hybrid (no linear-attention layers)")
        return {
            "model_type": lin.model_type, "architectures": None,
            "vocab_size": self.vocab_size, "hidden_size": self.dim,
            "intermediate_size": self.ffn_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "linear_num_key_heads": lin.k_heads, "linear_num_value_heads": lin.v_heads,
            "linear_key_head_dim": lin.k_dim, "linear_value_head_dim": lin.v_dim,
            "linear_conv_kernel_dim": lin.conv_kernel,
            "layer_types": lin.layer_types(self.n_layers),
        }  # fmt: skip

    def valid_sp(self) -> list[int]:
        """sp degrees that divide the q-head count."""
        return divisors(self.n_heads)

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> ModelShape:
        return replace(self, **changes)


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in [
        # CPU tests and the default training run; vocab 272 >= the byte tokenizer's 257 ids.
        ModelShape("tiny", 2, 64, 8, 2, 8, 176, 272, tie_embeddings=False, rope_theta=10000.0),
        # Llama-3.2-1B
        ModelShape("llama3-1b", 16, 2048, 32, 8, 64, 8192, 128256, tie_embeddings=True),
        # Llama-3.1-8B
        ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        # Llama-3.1-70B
        ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        # Qwen3-4B
        ModelShape(
            "qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936,
            tie_embeddings=True, qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
        ),
        # Qwen3-32B
        ModelShape(
            "qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936,
            qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
        ),
        # The DeepSpeed-Ulysses paper's GPT 7B shape (MHA); SwiGLU with Llama-7B's FFN 11008 keeps
        # ~7B parameters (a GPT 4h GELU MLP has the same 2*4h*h = 3*11008*h weights, to 0.8%).
        ModelShape("gpt-7b", 32, 4096, 32, 32, 128, 11008, 50304, rope_theta=10000.0),
    ]
}  # fmt: skip


# Hybrid linear-attention models: kept out of PRESETS (whose every entry the cost model and the
# notebooks sweep as Llama-style decoders); get_shape and the memory tracer find them.
HYBRID_PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in [
        # Qwen3.5-9B class: transformers 5.24's Qwen3_5TextConfig defaults, documented there as
        # "the Qwen3.5-9B style configuration": 32 layers (every 4th full attention), hidden
        # 4096, FFN 12288, 16 q / 4 kv heads of 256 (output gate, q/k norm), Gated DeltaNet
        # with 16 key and 32 value heads of 128, conv width 4, vocab 248320.
        ModelShape(
            "qwen3.5-9b", 32, 4096, 16, 4, 256, 12288, 248320, qk_norm=True,
            rope_theta=1e7, norm_eps=1e-6,
            linear=LinearAttentionShape(16, 32, 128, 128, conv_kernel=4, full_every=4),
        ),
    ]
}  # fmt: skip


def get_shape(name: str) -> ModelShape:
    """The preset called ``name`` (also a hybrid's); ``ValueError`` listing them if none."""
    shape = PRESETS.get(name) or HYBRID_PRESETS.get(name)
    if shape is None:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {', '.join([*PRESETS, *HYBRID_PRESETS])}"
        )
    return shape


def training_flops_per_token(
    *, n_matmul: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token (forward + backward, no recomputation): the MFU convention of
    both the built-in model and ``--hf-model``.

    ``6 * n_matmul + 6 * L * N * H * S``: ``n_matmul`` counts the weights used in matrix
    multiplies (every linear, including the output head, which for tied embeddings is the
    embedding matrix; not the embedding lookup or the norm gains). The attention term is
    ``12 * L * N * H * S / 2``: ``QK^T`` and ``PV`` cost ``4 * N * H * S`` per token in forward,
    times 3 for training, halved because causal attention computes half of the score matrix.
    """
    return 6.0 * n_matmul + 12.0 * n_layers * n_heads * head_dim * seq_len / 2
