"""Model shapes, torch-free: the one table read by the model and the simulator.

Importing this module does not import torch, so ``simulations/`` stays a pure-Python cost model.
Shapes follow the published configs of each model family.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from dtensor_ulysses.plan.splits import divisors

__all__ = ["ModelShape", "PRESETS", "get_shape", "training_flops_per_token"]


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
        return V * D + L * block + D + head

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


def get_shape(name: str) -> ModelShape:
    """The preset called ``name``; ``ValueError`` listing the presets if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None


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
