"""The vision-language step the tracer runs (``memtrace/vision_step.py``).

* Its loss and update at sp = 1 (one process, float64) against an independent computation: the
  ViT written out from its weights (RMS norms, per-image softmax attention, SwiGLU), the features
  added to the token embeddings by hand, the decoder's blocks called one by one, full logits and
  ``cross_entropy``; SGD with lr 1 and no clipping, so the new weights are ``w - grad``.
* Under the tracer (fake process group, fake tensors, the step as on a CPU) at sp = 1 and 2: the
  ``vision`` phase exists, and its activations per rank at sp = 2 are half of sp = 1's up to the
  bytes every rank holds whatever the split (stated in the test).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.data import full_batch
from dtensor_ulysses.data.batch import IGNORE_INDEX
from dtensor_ulysses.memtrace.vision_step import (
    PATCH_VALUES,
    VisionSpec,
    VisionTower,
    merge_features,
    vl_step,
)
from dtensor_ulysses.models import build_model
from dtensor_ulysses.models.layers import rope_cos_sin

S = 32
PATCHES = [5, 3, 4]  # images of different sizes: R = 12 image tokens


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _ref_features(tower, pixels, heads):
    """The tower's projected features, written out from its weights (no library code)."""
    feats = []
    for x in pixels:
        h = x @ tower.patch_embed.weight.T
        for blk in tower.layers:
            a = _rms(h, blk.attention_norm.weight)
            q, k, v = (a @ blk.wqkv.weight.T).view(len(x), 3, heads, -1).unbind(1)
            scores = torch.einsum("inh,jnh->nij", q, k) / math.sqrt(q.shape[-1])
            o = torch.einsum("nij,jnh->inh", scores.softmax(-1), v).reshape(len(x), -1)
            h = h + o @ blk.wo.weight.T
            f = _rms(h, blk.ffn_norm.weight)
            ff = blk.feed_forward
            h = h + (F.silu(f @ ff.w1.weight.T) * (f @ ff.w3.weight.T)) @ ff.w2.weight.T
        feats.append(_rms(h, tower.norm.weight))
    return torch.cat(feats) @ tower.projector.weight.T


def _ref_loss(policy, tower, pixels, batch, heads):
    feats = _ref_features(tower, pixels, heads)
    h = policy.tok_embeddings(batch.input_ids).clone()
    h[0, : feats.shape[0]] += feats
    shape = policy.shape
    cos, sin = rope_cos_sin(batch.position_ids, shape.head_dim, shape.rope_theta, h.dtype)
    for layer in policy.layers:
        h = layer(h, cos, sin)
    logits = _rms(h, policy.norm.weight) @ policy.output.weight.T
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)


def test_vl_step_loss_and_update_equal_plain_computation():
    torch.manual_seed(0)
    spec = VisionSpec(layers=2, hidden=32, head_dim=8)
    policy = build_model("tiny", device="cpu").double()
    tower = VisionTower(spec, policy.shape.dim).double()
    with torch.no_grad():
        for p in tower.parameters():  # norms' gains away from 1 too
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    pixels = [torch.randn(r, PATCH_VALUES, dtype=torch.float64) for r in PATCHES]
    ids = torch.randint(0, 200, (1, S))
    labels = torch.roll(ids, -1, 1)
    labels[:, : sum(PATCHES)] = IGNORE_INDEX  # no loss on image tokens
    labels[:, -1] = IGNORE_INDEX
    batch = full_batch(ids, labels)

    ref_p, ref_t = copy.deepcopy(policy), copy.deepcopy(tower)
    want = _ref_loss(ref_p, ref_t, pixels, batch, spec.hidden // spec.head_dim)
    want.backward()
    expect = {
        **{f"p.{n}": (p - p.grad).detach() for n, p in ref_p.named_parameters()},
        **{f"t.{n}": (p - p.grad).detach() for n, p in ref_t.named_parameters()},
    }

    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (policy, tower)]
    sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda _: 1.0)
    loss = vl_step(policy, tower, batch, pixels, opts, sched, grad_clip=0)
    assert loss == pytest.approx(want.item(), rel=1e-6)  # the loss sum is float32
    got = {
        **{f"p.{n}": p for n, p in policy.named_parameters()},
        **{f"t.{n}": p for n, p in tower.named_parameters()},
    }
    for n, w in expect.items():
        torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-6, msg=n)

    with pytest.raises(ValueError, match="do not fit a row of 8 tokens"):
        vl_step(policy, tower, full_batch(ids[:, :8], labels[:, :8]), pixels, opts, sched)


def test_merge_features_adds_only_this_slices_image_tokens():
    h = torch.zeros(1, 4, 2)
    feats = torch.arange(12.0).view(6, 2)  # R = 6 image tokens
    torch.testing.assert_close(merge_features(h, feats, 4), torch.cat([feats[4:], h[0, 2:]])[None])
    assert merge_features(h, feats, 8) is h  # a slice past the images
    with pytest.raises(ValueError, match="hidden=100 must be a multiple of head_dim=64"):
        VisionSpec(hidden=100)


def test_vision_phase_per_rank_halves_at_sp2():
    from dtensor_ulysses.memtrace import StepSpec, trace_train_step

    v = VisionSpec(images=4, image_patches=1024, layers=2, hidden=128)
    traces = {
        sp: trace_train_step("tiny", 4096, sp=sp, layers=2, device="cpu",
                             step=StepSpec("vl", vision=v)).to_dict()
        for sp in (1, 2)
    }  # fmt: skip
    R, E, D, P = 4 * 1024, 128, 64, 2  # image tokens, tower width, decoder width (tiny)
    for t in traces.values():
        assert t["step"]["kind"] == "vl" and t["step"]["images"] == 4
        assert list(t["phases"])[0] == "vision"
    a1, a2 = (traces[sp]["phases"]["vision"]["by_category"]["activations_and_buffers"]
              for sp in (1, 2))  # fmt: skip
    # every rank holds the batch's pixel values whatever the split (fp32)
    pixels = R * PATCH_VALUES * 4
    # sp = 2 only: the gathered features (the all-gather's receive buffer, the features put back
    # in image order, their projection) and at most two tower blocks' all-gathered weights (FSDP2
    # prefetches the next block)
    block = 3 * E * E + E * E + 3 * E * 4 * E + 2 * E
    unsplit = (P * (R // P) * E + R * E + R * D) * 4 + 2 * block * 4
    # whole images: 4 equal images give each of the 2 ranks exactly 2; the rest is each rank's
    # encoder activations, halved
    half = (a1 - pixels) / 2
    assert 0.95 * half <= a2 - pixels <= half + unsplit, (a1, a2, pixels, unsplit)
    assert 0.45 < a2 / a1 < 0.6


def test_cli_trace_vl_bad_input(capsys):
    from simulations.cli import main

    base = ["trace", "--model", "llama3-8b", "--seq-len", "8192", "--sp", "8"]
    assert main([*base, "--step", "dpo", "--images", "2"]) == 2
    assert "--images do(es) not apply to --step dpo: use --step vl" in capsys.readouterr().err
    assert main([*base, "--step", "vl", "--images", "9", "--image-patches", "1024"]) == 2
    assert "9,216 image tokens, more than --seq-len 8,192" in capsys.readouterr().err
    assert main([*base, "--step", "vl", "--vision-hidden", "1000"]) == 2
    assert "hidden=1000 must be a multiple of head_dim=64" in capsys.readouterr().err
    assert main([*base, "--step", "vl", "--image-patches", "0"]) == 2
    assert "--image-patches 0 must be >= 1" in capsys.readouterr().err
    assert main(["trace", "--model", "qwen3.5-9b", "--seq-len", "8192", "--step", "vl"]) == 2
    assert "hybrid" in capsys.readouterr().err
