"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) under Ulysses equal the stock model.

Tiny random configs of the three families (``layer_types`` with linear and full attention; 4
linear key heads, 8 value heads; Qwen3-Next with its output gate and partial rotary), saved
locally. One 4-rank world runs ``apply_ulysses`` at (dp, sp) in {(1,2), (2,2), (1,4)} ((1,2) as
two independent sp pairs), on plain and packed rows of S = 71 tokens (two delta-rule chunks,
uneven over sp), float64: the loss and EVERY gradient equal the stock model on this process
(packed: each document run alone); the closed-form bytes of one layer's exchanges; the guard
with a Gated DeltaNet layer left unrouted; key heads that sp does not divide (refused, then
exact with ``allow_uneven_heads``); then ``with_ulysses(transformers.Trainer)`` at (2,2) and
(1,4), and a 2-rank world at (1,2): three steps' losses equal the stock Trainer's (fp32).

The bugs users of other integrations met, each answered here: the right forward with wrong
gradients (every gradient is compared); Ulysses a silent no-op (each layer's input and output
are the rank's slice, and its delta-rule kernel receives the full sequence of ``K / sp`` key
heads); sp silently 1 (the same numbers, and the exchanged bytes, per sp).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from dtensor_ulysses.hf.models.mixers.linear_attention import gdn_bytes  # noqa: E402
from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as HW  # noqa: E402
from tests.hf import linear_workers as W  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL = 1e-5  # float64 models; the delta-rule kernel computes in fp32 inside
TRAINER_RTOL = 1e-4  # fp32


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn")
    fams = (*W.FAMILIES, "qwen3_next_uneven")
    dirs = {f: W.save_model(f, root / f) for f in fams}
    tok = root / "tok"
    HW.make_tokenizer(tok, " ".join(T.TEXTS) * 5)
    return {"root": root, "dirs": dirs, "tok": str(tok)}


def _trainer_spec(assets, family: str, sp: int | None, dp: int = 1) -> dict:
    name = f"{family}_{dp}_{sp}"
    return dict(kind="trainer", model=assets["dirs"][family], tok=assets["tok"],
                out=str(assets["root"] / name), sp=sp, batch=4 // dp)  # fmt: skip


@pytest.fixture(scope="module")
def world4(assets):
    dirs = {f: assets["dirs"][f] for f in W.FAMILIES}
    specs = [_trainer_spec(assets, f, sp, dp) for dp, sp in ((2, 2), (1, 4)) for f in W.FAMILIES]
    runs = run_local_world(W.run_jobs, 4, [
        ("equivalence", (dirs, False)),
        ("equivalence", (dirs, True)),
        ("features", (assets["dirs"],)),
        ("trainers", (specs,)),
    ], timeout_s=600)  # fmt: skip
    trained = {
        (f, dp, sp): r
        for (dp, sp), f, r in zip(
            [(dp, sp) for dp, sp in ((2, 2), (1, 4)) for _ in W.FAMILIES],
            [f for _ in range(2) for f in W.FAMILIES],
            runs[0][3],
        )
    }
    return {"plain": runs[0][0], "packed": runs[0][1], "features": [r[2] for r in runs],
            "trained": trained}  # fmt: skip


@pytest.fixture(scope="module")
def world2_trainer(assets):
    specs = [_trainer_spec(assets, f, 2) for f in W.FAMILIES]
    runs = run_local_world(W.run_jobs, 2, [("trainers", (specs,))], timeout_s=400)[0][0]
    return {(f, 1, 2): r for f, r in zip(W.FAMILIES, runs)}


@pytest.fixture(scope="module")
def references(assets):
    return {
        (f, packed): W.reference(assets["dirs"][f], packed)
        for f in W.FAMILIES
        for packed in (False, True)
    }


def _assert_grads_close(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=RTOL, atol=RTOL * float(g.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("layout", W.LAYOUTS, ids=lambda x: f"dp{x[0]}sp{x[1]}")
@pytest.mark.parametrize("family", W.FAMILIES)
def test_apply_ulysses_equals_stock(world4, references, family, layout, packed):
    """Loss and every gradient (conv weight, A_log, dt_bias, the gated norm, every projection,
    the full-attention layer, the MoE experts) equal the stock model on one process; packed:
    each document run alone (conv and recurrence restart at every document)."""
    dp, sp = layout
    got = world4["packed" if packed else "plain"][(family, dp, sp)]
    ref = references[(family, packed)]
    assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    _assert_grads_close(got["grads"], ref["grads"])
    # not a silent no-op: the layer ran on this rank's slice of the sequence, and its kernel on
    # the full sequence (or, packed, whole documents) of K / sp key heads
    local_rows = W.G // dp
    s0 = -(-W.S // sp)  # rank 0's slice (the larger piece)
    assert got["layer_out"] == [(local_rows, s0, 32)]
    lengths = sorted({q[1] for q in got["kernel_q"]})
    assert {q[2] for q in got["kernel_q"]} == {4 // sp}
    if packed:
        rows = range(W.G // dp)  # rank 0 holds dp group 0's rows
        assert lengths == sorted({n for b in rows for n in W.DOCS[b]})
    else:
        assert lengths == [W.S]


def test_exchanged_bytes_closed_form(world4):
    """One Gated DeltaNet layer, per rank: forward one all-to-all of q, k, v, b, a of the slice
    (all key heads), one of the output (its key heads' value heads, full length); backward the
    same two reversed. Nothing else; z (the norm's gate) never travels."""
    e = 8  # float64
    K, V, dk, dv = 4, 8, 8, 4
    r = V // K
    for rank, res in enumerate(world4["features"]):
        sizes = res["bytes"]["sizes"]
        P, S, s = len(sizes), sum(sizes), sizes[rank]
        k = K // P
        fwd_in = W.G * s * (2 * K * dk + V * dv + 2 * V) * e
        fwd_out = W.G * S * (k * r * dv) * e
        bwd_out = W.G * s * V * dv * e
        bwd_in = W.G * S * k * (2 * dk + r * dv + 2 * r) * e
        assert res["bytes"]["forward"] == [fwd_in, fwd_out], rank
        assert res["bytes"]["backward"] == [bwd_out, bwd_in], rank
        assert res["bytes"]["other"] == []
        # the library's closed form (for the simulator) says the same
        lib = gdn_bytes(W.G, sizes, rank, key_heads=K, value_heads=V, key_dim=dk,
                        value_dim=dv, elem_bytes=e)  # fmt: skip
        assert lib == {"forward": [fwd_in, fwd_out], "backward": [bwd_out, bwd_in]}


def test_guard_names_unrouted_linear_layer(world4):
    """A Gated DeltaNet layer given back its stock forward (it would mix this rank's slice only)
    is named by the first-forward guard."""
    for res in world4["features"]:
        assert "model.layers.2.linear_attn" in res["guard"]
        assert "model.layers.0" not in res["guard"]


def test_uneven_key_heads(world4, assets):
    """6 key heads on sp=4: refused with the numbers and the valid sp; with allow_uneven_heads
    (2, 2, 1, 1 key heads per rank) the logits and every gradient equal the stock model's."""
    from transformers import AutoModelForCausalLM

    res = world4["features"]
    msg = res[0]["uneven_refused"]
    assert "6 linear-attention key heads" in msg and "sp=4" in msg and "{1, 2, 3, 6}" in msg
    model = AutoModelForCausalLM.from_pretrained(
        assets["dirs"]["qwen3_next_uneven"], dtype=W.DTYPE, **W._EXPERTS
    )
    ids, _, _ = W.global_batch(False)
    logits = model(input_ids=ids).logits
    (logits.pow(2).sum() / logits.numel()).backward()
    for r in res:
        lo, hi = r["slice"]
        torch.testing.assert_close(r["uneven_logits"], logits[:, lo:hi].detach(), rtol=RTOL,
                                   atol=1e-9)  # fmt: skip
    _assert_grads_close(res[0]["uneven_grads"], {n: p.grad for n, p in model.named_parameters()})


@pytest.fixture(scope="module")
def trainer_refs(assets):
    return {f: T.run(_trainer_spec(assets, f, None)) for f in W.FAMILIES}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", W.LAYOUTS, ids=lambda x: f"dp{x[0]}sp{x[1]}")
@pytest.mark.parametrize("family", W.FAMILIES)
def test_trainer_equals_stock(world4, world2_trainer, trainer_refs, family, layout):
    """``with_ulysses(transformers.Trainer)``: three steps' losses, gradient norms and learning
    rates equal the stock Trainer on one process (padded batches: padding runs as its own
    document through the linear-attention layers)."""
    dp, sp = layout
    got = (world2_trainer if layout == (1, 2) else world4["trained"])[(family, dp, sp)]
    ref = trainer_refs[family]
    for key in ("loss", "grad_norm", "lr"):
        assert len(got[key]) == len(ref[key]) == 3, (key, got[key], ref[key])
    assert got["loss"] == pytest.approx(ref["loss"], rel=TRAINER_RTOL)
    assert got["lr"] == pytest.approx(ref["lr"], rel=TRAINER_RTOL)
    # step 1's gradient norm to 1e-4; later ones drift with the fp32 delta-rule kernel (the
    # A_log gradients, sums of both signs, carry ~5e-4 relative noise in fp32: see the
    # float64 test above for their exactness)
    assert got["grad_norm"][0] == pytest.approx(ref["grad_norm"][0], rel=TRAINER_RTOL)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
