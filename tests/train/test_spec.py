"""The trainer's model spec: one MFU convention for the built-in model and ``--hf-model``.

A transformers Llama with the built-in ``tiny`` preset's shape (untied, and tied) must get the
FLOPs per token the built-in model gets, counted independently here from the shape: ``6 *`` the
matrix-multiply weights (attention and MLP projections, the output head) plus the causal attention
term ``6 * L * N * H * S``; the input embedding is a lookup, not a matrix multiply.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from dtensor_ulysses.models import model_flops_per_token  # noqa: E402
from dtensor_ulysses.plan import get_shape  # noqa: E402
from dtensor_ulysses.train import TrainConfig, model_spec  # noqa: E402


class _Wrapped(nn.Module):
    """What the HF spec describes: a module holding the transformers model as ``hf_model``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf


@pytest.mark.parametrize("tied", [False, True])
def test_hf_and_builtin_mfu_conventions_agree(tied):
    import transformers as tf

    shape = get_shape("tiny").with_(tie_embeddings=tied)
    config = tf.LlamaConfig(
        hidden_size=shape.dim, intermediate_size=shape.ffn_dim,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab_size, tie_word_embeddings=tied,
    )  # fmt: skip
    with torch.device("meta"):
        hf = tf.LlamaForCausalLM(config)
    S = 4096
    cfg = TrainConfig(hf_model="/models/tiny-llama", seq_len=S)
    name, n_params, flops = model_spec(cfg).describe(cfg, _Wrapped(hf))

    D, L, V, F = shape.dim, shape.n_layers, shape.vocab_size, shape.ffn_dim
    N, K, H = shape.n_heads, shape.n_kv_heads, shape.head_dim
    per_block = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
    expected = 6.0 * (L * per_block + V * D) + 6.0 * L * N * H * S
    assert flops == pytest.approx(expected, rel=1e-12)
    assert flops == pytest.approx(model_flops_per_token(shape, S), rel=1e-12)
    assert n_params == sum(p.numel() for p in hf.parameters())
    assert name.startswith("tiny-llama (--hf-model, LlamaForCausalLM)")
