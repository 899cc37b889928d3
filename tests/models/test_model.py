"""The built-in model: parameter counts, a float64 reference, RoPE, init, checkpointing, FLOPs.

Single process on CPU except ``test_init_and_sp_attention_on_two_ranks`` (a 2-rank gloo world:
FSDP2-sharded ``init_weights`` and the Ulysses path of ``Attention``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dtensor_ulysses.models.layers as layers_mod  # RMSNorm reads NORM_CHUNK_ELEMENTS there
from dtensor_ulysses.attention import LocalAttention
from dtensor_ulysses.memory import checkpoint_module
from dtensor_ulysses.models import (
    Transformer,
    apply_rope,
    build_model,
    init_weights,
    model_flops_per_token,
    rope_cos_sin,
    set_tiling,
)
from dtensor_ulysses.plan import PRESETS, get_shape

TINY = get_shape("tiny")
B, S = 2, 12


def _batch(shape, batch: int = B, seq: int = S, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, shape.vocab_size, (batch, seq), generator=g)
    position_ids = torch.arange(seq).expand(batch, seq).contiguous()
    return input_ids, position_ids


def _model64(shape, seed: int = 0) -> Transformer:
    model = build_model(shape, device="cpu")
    init_weights(model, seed)
    return model.to(torch.float64)


# ----------------------------------------------------------------------------------------------
# an independent reference, plain torch ops on a state dict
# ----------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_ref(x, pos, theta):
    """x[B, S, h, H]; explicit angle per (position, frequency), rotate-half convention."""
    H = x.shape[-1]
    freqs = torch.tensor([theta ** (-(2 * j) / H) for j in range(H // 2)], dtype=torch.float64)
    ang = pos.to(torch.float64)[:, :, None, None] * freqs  # [B, S, 1, H/2]
    c, s = torch.cos(ang), torch.sin(ang)
    a, b = x[..., : H // 2], x[..., H // 2 :]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


def _reference_logits(sd: dict, shape, input_ids, position_ids):
    N, K, H, eps = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.norm_eps
    h = sd["tok_embeddings.weight"][input_ids]
    Bb, Ss, _ = h.shape
    mask = torch.ones(Ss, Ss, dtype=torch.bool).tril()
    for i in range(shape.n_layers):
        p = f"layers.{i}."
        x = _rms(h, sd[p + "attention_norm.weight"], eps)
        q = (x @ sd[p + "attention.wq.weight"].T).reshape(Bb, Ss, N, H)
        k = (x @ sd[p + "attention.wk.weight"].T).reshape(Bb, Ss, K, H)
        v = (x @ sd[p + "attention.wv.weight"].T).reshape(Bb, Ss, K, H)
        if shape.qk_norm:
            q = _rms(q, sd[p + "attention.q_norm.weight"], eps)
            k = _rms(k, sd[p + "attention.k_norm.weight"], eps)
        q, k = (
            _rope_ref(q, position_ids, shape.rope_theta),
            _rope_ref(k, position_ids, shape.rope_theta),
        )
        k = k.repeat_interleave(N // K, dim=2)
        v = v.repeat_interleave(N // K, dim=2)
        scores = torch.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(H)
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.einsum("bnqk,bknh->bqnh", scores.softmax(-1), v).reshape(Bb, Ss, N * H)
        h = h + o @ sd[p + "attention.wo.weight"].T
        x = _rms(h, sd[p + "ffn_norm.weight"], eps)
        a = x @ sd[p + "feed_forward.w1.weight"].T
        g = x @ sd[p + "feed_forward.w3.weight"].T
        h = h + (a * torch.sigmoid(a) * g) @ sd[p + "feed_forward.w2.weight"].T
    h = _rms(h, sd["norm.weight"], eps)
    out = sd["tok_embeddings.weight"] if shape.tie_embeddings else sd["output.weight"]
    return h @ out.T


def _loss(logits, input_ids):
    w = torch.linspace(0.5, 1.5, logits.shape[-1], dtype=logits.dtype)
    return (logits.sin() * w).sum() / input_ids.numel()


@pytest.mark.parametrize(
    "variant",
    ["tiny", "qk_norm", "tied", "mha", "tiled"],
)
def test_matches_float64_reference(variant, monkeypatch):
    changes = {
        "tiny": {},
        "qk_norm": {"qk_norm": True},
        "tied": {"tie_embeddings": True},
        "mha": {"n_kv_heads": 8, "rope_theta": 500000.0},
        "tiled": {},
    }[variant]
    shape = TINY.with_(**changes)
    model = _model64(shape)
    if variant == "tiled":  # RMSNorm over 3-row chunks, the MLP over 5-token chunks
        monkeypatch.setattr(layers_mod, "NORM_CHUNK_ELEMENTS", 3 * shape.dim)
        set_tiling(model, mlp_chunk_tokens=5)
    input_ids, position_ids = _batch(shape)
    # non-trivial positions (a slice from the middle of a long sequence), varied per row
    position_ids = position_ids + torch.tensor([[37], [1000]])

    logits = model(input_ids, position_ids)
    _loss(logits, input_ids).backward()

    sd = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    ref = _reference_logits(sd, shape, input_ids, position_ids)
    _loss(ref, input_ids).backward()

    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-10)
    names = dict(model.named_parameters())
    assert set(names) == set(sd)
    for name, p in names.items():
        torch.testing.assert_close(p.grad, sd[name].grad, rtol=0, atol=1e-10, msg=name)


# ----------------------------------------------------------------------------------------------
# structure and parameter counts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_matches_shape_on_meta(name):
    shape = get_shape(name)
    model = build_model(name)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert not list(model.buffers())
    assert sum(p.numel() for p in params) == shape.n_params


def test_param_count_llama_magnitudes():
    assert build_model("llama3-1b").shape.n_params == pytest.approx(1.236e9, rel=1e-3)
    n_8b = sum(p.numel() for p in build_model("llama3-8b").parameters())
    assert n_8b == pytest.approx(8.03e9, rel=1e-3)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="llama3-1b"):
        build_model("llama-nope")
    with pytest.raises(TypeError):
        build_model(3)  # type: ignore[arg-type]


def test_module_names():
    model = build_model(TINY.with_(qk_norm=True))
    names = {n for n, _ in model.named_parameters()}
    expected_block = {
        "attention_norm.weight",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "attention.q_norm.weight",
        "attention.k_norm.weight",
        "ffn_norm.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    }
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(TINY.n_layers) for n in expected_block}
    assert names == expected
    block = model.layers[0]
    kernel = block.attention.inner_attention
    assert isinstance(kernel, LocalAttention) and kernel.backend == "auto" and kernel.causal
    assert build_model(TINY).layers[0].attention.q_norm is None


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
def test_forward_shapes_and_finite():
    model = build_model("tiny", device="cpu")
    input_ids, position_ids = _batch(TINY)
    logits = model(input_ids, position_ids)
    assert logits.shape == (B, S, TINY.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    h = model.forward_hidden(input_ids, position_ids)
    assert h.shape == (B, S, TINY.dim)
    assert model.output_weight().shape == (TINY.vocab_size, TINY.dim)
    torch.testing.assert_close(F.linear(h, model.output_weight()), logits)
    with pytest.raises(ValueError, match="same"):
        model(input_ids, position_ids[:, :-1])


def test_tied_and_untied():
    untied = build_model("tiny", device="cpu")
    tied = build_model(TINY.with_(tie_embeddings=True), device="cpu")
    assert untied.output is not None and untied.output_weight() is untied.output.weight
    assert tied.output is None and tied.output_weight() is tied.tok_embeddings.weight
    diff = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert diff == TINY.vocab_size * TINY.dim
    # with tied weights the embedding gets gradient from the lookup and from the logits
    input_ids, position_ids = _batch(TINY, batch=1, seq=4)
    tied(input_ids, position_ids).sum().backward()
    unused = torch.ones(TINY.vocab_size, dtype=torch.bool)
    unused[input_ids.flatten()] = False
    assert tied.tok_embeddings.weight.grad[unused].abs().sum() > 0


def test_bfloat16_forward_runs():
    model = build_model("tiny", device="cpu").to(torch.bfloat16)
    input_ids, position_ids = _batch(TINY)
    logits = model(input_ids, position_ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    ref = build_model("tiny", device="cpu")(input_ids, position_ids)
    torch.testing.assert_close(logits.float(), ref, atol=0.05, rtol=0.05)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------
def test_rope_scores_depend_only_on_position_difference():
    g = torch.Generator().manual_seed(0)
    H = 16
    q = torch.randn(1, 1, 1, H, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, H, generator=g, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        pos_m, pos_n = torch.tensor([[m]]), torch.tensor([[n]])
        qr = apply_rope(q, *rope_cos_sin(pos_m, H, 10000.0, torch.float64))
        kr = apply_rope(k, *rope_cos_sin(pos_n, H, 10000.0, torch.float64))
        return (qr * kr).sum()

    for m, n, shift in [(5, 2, 100), (7, 7, 3), (0, 9, 4096)]:
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift), rtol=0, atol=1e-12)
    assert not torch.allclose(score(5, 2), score(5, 3))
    # rotation keeps norms; position 0 is the identity
    torch.testing.assert_close(apply_rope(q, *rope_cos_sin(torch.tensor([[0]]), H, 1e4)), q)


def test_rope_pairs_halves():
    """Rotate-half convention: element j pairs with j + H/2, rotated by theta^(-2j/H) * pos."""
    H, theta, pos = 8, 100.0, 3
    cos, sin = rope_cos_sin(torch.tensor([[pos]]), H, theta, torch.float64)
    for j in range(H // 2):
        x = torch.zeros(1, 1, 1, H, dtype=torch.float64)
        x[..., j] = 1.0
        y = apply_rope(x, cos, sin)
        angle = pos * theta ** (-2 * j / H)
        expected = torch.zeros_like(x)
        expected[..., j], expected[..., j + H // 2] = math.cos(angle), math.sin(angle)
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-14)


def test_model_uses_position_ids():
    model = _model64(TINY)
    input_ids, position_ids = _batch(TINY)
    logits = model(input_ids, position_ids)
    # a uniform shift leaves every q.k score, hence the whole output, unchanged (relative RoPE)
    torch.testing.assert_close(model(input_ids, position_ids + 1000), logits, rtol=0, atol=1e-9)
    # moving part of the sequence relative to the rest changes the output
    moved = position_ids.clone()
    moved[:, S // 2 :] += 7
    changed = model(input_ids, moved)
    assert not torch.allclose(changed, logits, atol=1e-6)
    # causal: tokens before the moved ones are unaffected
    torch.testing.assert_close(changed[:, : S // 2], logits[:, : S // 2], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# initialization
# ----------------------------------------------------------------------------------------------
def test_init_weights_deterministic_and_seeded():
    a = build_model("tiny", device="cpu")  # build_model initializes with seed 0
    b = Transformer(TINY)  # torch's default init on CPU
    init_weights(b, seed=0)
    c = build_model("tiny")
    c.to_empty(device="cpu")
    init_weights(c, seed=0)
    d = build_model("tiny", device="cpu")
    init_weights(d, seed=1)
    sa, sb, sc, sd = (m.state_dict() for m in (a, b, c, d))
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
        assert torch.equal(sa[name], sc[name]), name
        if "norm" not in name:
            assert not torch.equal(sa[name], sd[name]), name
    # distinct parameters get distinct draws
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sa["layers.1.attention.wq.weight"])


def test_init_weights_statistics():
    shape = TINY.with_(n_layers=8, qk_norm=True)
    model = build_model(shape, device="cpu")
    residual_std = 0.02 / math.sqrt(2 * shape.n_layers)
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.1), name
            assert abs(p.mean().item()) < 0.1 * std, name


def test_init_weights_refuses_meta_and_bad_seed():
    with pytest.raises(RuntimeError, match="to_empty"):
        init_weights(build_model("tiny"))
    with pytest.raises(ValueError, match="seed"):
        init_weights(build_model("tiny", device="cpu"), seed=-1)


def test_init_weights_ignores_wrapper_prefixes():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = build_model("tiny", device="cpu")
    wrapped = build_model("tiny", device="cpu")
    for i, block in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(block)
    init_weights(wrapped, seed=3)
    init_weights(plain, seed=3)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    for (_, p), (_, q) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------------------------
# activation checkpointing
# ----------------------------------------------------------------------------------------------
def test_checkpoint_gives_identical_outputs_and_grads():
    shape = TINY.with_(qk_norm=True)
    plain, ckpt = build_model(shape, device="cpu"), build_model(shape, device="cpu")
    for block in ckpt.layers:
        checkpoint_module(block)
    names_before = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in ckpt.named_parameters()] == names_before
    input_ids, position_ids = _batch(shape)
    out_p, out_c = plain(input_ids, position_ids), ckpt(input_ids, position_ids)
    assert torch.equal(out_p, out_c)
    _loss(out_p, input_ids).backward()
    _loss(out_c, input_ids).backward()
    for (name, p), (_, c) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p.grad, c.grad), name
    with torch.no_grad():  # no grad: plain forward, same values
        assert torch.equal(ckpt(input_ids, position_ids), out_p)


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------
def test_model_flops_per_token():
    shape = get_shape("llama3-8b")
    S_ = 8192
    dense = shape.n_params - shape.vocab_size * shape.dim - shape.dim * (2 * shape.n_layers + 1)
    attn = 12 * shape.n_layers * shape.n_heads * shape.head_dim * S_ / 2
    assert model_flops_per_token(shape, S_) == pytest.approx(6 * dense + attn)
    assert model_flops_per_token("llama3-8b", S_) == model_flops_per_token(shape, S_)
    # tied: the embedding matrix is the output head, counted once
    tied = get_shape("llama3-1b")
    dense_tied = tied.n_params - tied.dim * (2 * tied.n_layers + 1)
    assert model_flops_per_token(tied, 0) == pytest.approx(6 * dense_tied)
    # ~6 * 8B * (1 + small attention share) at 8k
    assert 4.5e10 < model_flops_per_token(shape, S_) < 6.0e10


# ----------------------------------------------------------------------------------------------
# two ranks: FSDP2-sharded init equals the unsharded init; Ulysses attention equals local
# ----------------------------------------------------------------------------------------------
def _two_rank_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    results = {}

    # (1) init_weights on FSDP2 DTensor parameters, including uneven shards (273 and 175 rows)
    shape = TINY.with_(vocab_size=273, ffn_dim=175, qk_norm=True)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_sp",))
    sharded = build_model(shape)
    for block in sharded.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded.to_empty(device="cpu")
    init_weights(sharded, seed=5)
    plain = build_model(shape, device="cpu")
    init_weights(plain, seed=5)
    mismatched = []
    for (name, p), (_, q) in zip(sharded.named_parameters(), plain.named_parameters()):
        if not (type(p).__name__ == "DTensor" and torch.equal(p.full_tensor(), q)):
            mismatched.append(name)
    results["init_mismatched"] = mismatched

    # (2) inner_attention swapped for the Ulysses engine: each rank holds a contiguous slice
    from dtensor_ulysses.attention import UlyssesAttention

    sp_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "sp"))["sp"]
    model = _model64(TINY)
    input_ids, position_ids = _batch(TINY, seq=8)
    full = model(input_ids, position_ids)
    full_grads = torch.autograd.grad(_loss(full, input_ids), list(model.parameters()))
    for block in model.layers:
        block.attention.inner_attention = UlyssesAttention(block.attention.inner_attention, sp_mesh)
    s = input_ids.shape[1] // world_size
    cut = slice(rank * s, (rank + 1) * s)
    local = model(input_ids[:, cut], position_ids[:, cut])
    # the loss is a sum over tokens, so summing rank gradients gives the full gradient
    grads = torch.autograd.grad(_loss(local, input_ids), list(model.parameters()))
    for g in grads:
        torch.distributed.all_reduce(g)
    results["logits_err"] = (local - full[:, cut]).abs().max().item()
    results["grad_err"] = max((g - f).abs().max().item() for g, f in zip(grads, full_grads))
    return results


def test_init_and_sp_attention_on_two_ranks():
    from dtensor_ulysses.launch import run_local_world

    for result in run_local_world(_two_rank_worker, 2, timeout_s=120):
        assert result["init_mismatched"] == []
        assert result["logits_err"] < 1e-12
        assert result["grad_err"] < 1e-12
