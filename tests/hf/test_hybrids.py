"""State-space and convolution hybrids under Ulysses equal the stock model.

Nemotron-H, Granite 4.0-H, Falcon-H1 (Mamba-2 mixers, head-sharded between two all-to-alls;
Falcon-H1 with attention and Mamba-2 side by side in each layer), LFM2 / LFM2-MoE (short
convolutions through a halo exchange) and OLMo hybrid (Gated DeltaNet with its own q/k/v/a/b/g
projections, beta in [0, 2]): tiny random configs of each family's own class, saved locally,
every feature shorter than a rank's slice (scan chunks of 8, conv kernels of 4 and 3; S = 71
tokens, 18 or 17 per rank at sp=4). One 4-rank world runs ``apply_ulysses`` at (dp, sp) in
{(1,2), (2,2), (1,4)} ((1,2) as two independent sp pairs), plain and packed, float64: the loss
and EVERY gradient equal the stock model on this process (packed: each document run alone);
the exchanged bytes of one layer of each new kind against the closed form written here; the
guard with a mixer left unrouted; the refusals; then ``with_ulysses(transformers.Trainer)`` at
(2,2) and (1,4): two steps' losses equal the stock Trainer's (fp32).

Kimi Linear: a model of KDA layers only, and one with KDA beside multi-head latent attention
(hf/models/latent_attention.py), in the same tests.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from dtensor_ulysses.comm.halo import halo_bytes  # noqa: E402
from dtensor_ulysses.hf.models.mixers.kda import kda_bytes  # noqa: E402
from dtensor_ulysses.hf.models.mixers.mamba import mamba_bytes  # noqa: E402
from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as HW  # noqa: E402
from tests.hf import hybrid_workers as W  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL = 1e-5  # float64 models; the Mamba-2 scan computes in fp32 inside
TRAINER_RTOL = 1e-4  # fp32
TRAINED = ("granitemoehybrid", "lfm2")  # one Mamba-2 family, one convolution family
TRAINER_LAYOUTS = ((2, 2), (1, 4))
# Kimi Linear: its KDA layers beside its multi-head latent attention layers
FAMILIES = (*W.FAMILIES, "kimi_linear_mla")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    dirs = {f: W.save_model(f, root / f) for f in (*W.FAMILIES, "kimi_linear_mla", "falcon_6heads")}
    tok = root / "tok"
    HW.make_tokenizer(tok, " ".join(T.TEXTS) * 5)
    return {"root": root, "dirs": dirs, "tok": str(tok)}


def _trainer_spec(assets, family: str, sp: int | None, dp: int = 1) -> dict:
    return dict(kind="trainer", model=assets["dirs"][family], tok=assets["tok"],
                out=str(assets["root"] / f"{family}_{dp}_{sp}"), sp=sp, batch=4 // dp,
                steps=2)  # fmt: skip


@pytest.fixture(scope="module")
def world4(assets):
    dirs = {f: assets["dirs"][f] for f in FAMILIES}
    keys = [(f, dp, sp) for dp, sp in TRAINER_LAYOUTS for f in TRAINED]
    specs = [_trainer_spec(assets, f, sp, dp) for f, dp, sp in keys]
    runs = run_local_world(W.run_jobs, 4, [
        ("equivalence", (dirs, False)),
        ("equivalence", (dirs, True)),
        ("features", (assets["dirs"],)),
        ("trainers", (specs,)),
    ], timeout_s=600)  # fmt: skip
    return {"plain": runs[0][0], "packed": runs[0][1], "features": [r[2] for r in runs],
            "trained": dict(zip(keys, runs[0][3]))}  # fmt: skip


@contextlib.contextmanager
def _one_thread():
    """Tiny models on one intra-op thread: on a loaded 2-core machine two threads made the
    references 40x slower (measured), for no gain on tensors this small."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def references(assets):
    with _one_thread():
        return {
            (f, packed): W.reference(assets["dirs"][f], packed)
            for f in FAMILIES
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
@pytest.mark.parametrize("family", FAMILIES)
def test_apply_ulysses_equals_stock(world4, references, family, layout, packed):
    """Loss and every gradient (conv weights, A_log, D, dt_bias, the gated norms, every
    projection, the attention layers, the experts) equal the stock model on one process;
    packed: each document run alone (conv and scan restart at every document, a 3-token
    document included)."""
    dp, sp = layout
    got = world4["packed" if packed else "plain"][(family, dp, sp)]
    ref = references[(family, packed)]
    assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    _assert_grads_close(got["grads"], ref["grads"])
    # not a silent no-op: each mixer ran on this rank's slice (rank 0: the larger piece)
    assert got["mixer_out"] == [(W.G // dp, -(-W.S // sp), 32)]


def test_kernels_see_what_they_need(world4):
    """At sp=4: the Mamba-2 scan kernel receives the full sequence of ``8 / 4`` heads on every
    rank; LFM2's convolution receives all 32 channels of the rank's slice plus the 2-token
    halo (no head split, no full sequence)."""
    for rank, res in enumerate(world4["features"]):
        assert res["nemotron_h_kernel"] == [(W.G, W.S, 8 // 4, 4)]
        assert res["lfm2_kernel"] == [(W.G, 32, res["sizes"][rank] + 2)]
        assert res["kimi_linear_kda_kernel"] == [(W.G, W.S, 4 // 4, 8)]


def test_mamba_bytes_closed_form(world4):
    """One Nemotron-H Mamba-2 layer at sp=4, per rank: forward one all-to-all of x, dt and the
    B, C of the groups each rank's heads read (2 groups over 4 ranks: each group sent to two
    ranks), one of y (its heads, full length); backward the same two reversed; nothing else.
    The gate z never travels."""
    e, N, Pd, n, P = 8, 8, 4, 8, 4
    h = N // P  # heads per rank; each rank's heads lie in one group
    sent_groups = P  # one group per rank, replicated: 4 sent in all (2 distinct)
    for rank, res in enumerate(world4["features"]):
        sizes = res["sizes"]
        S, s = sum(sizes), sizes[rank]
        fwd = [("all_to_all", W.G * s * (N * Pd + N + 2 * n * sent_groups) * e),
               ("all_to_all", W.G * S * h * Pd * e)]  # fmt: skip
        bwd = [("all_to_all", W.G * s * N * Pd * e),
               ("all_to_all", W.G * S * (h * Pd + h + 2 * n * 1) * e)]  # fmt: skip
        assert res["nemotron_h_bytes"] == {"forward": fwd, "backward": bwd}, rank
        lib = mamba_bytes(W.G, sizes, rank, heads=N, head_dim=Pd, groups=2, state=n,
                          elem_bytes=e)  # fmt: skip
        assert lib == {"forward": [b for _, b in fwd], "backward": [b for _, b in bwd]}


def test_kda_bytes_closed_form(world4):
    """One Kimi Delta Attention layer at sp=4 (4 heads of 8), per rank: forward one all-to-all
    of q, k, v, the forget gate's raw projection (all ``d`` wide) and beta (1 wide) of the
    slice, one of the output (its head, full length); backward the same two reversed. The
    output gate never travels; the fp32 decay is computed after the exchange."""
    e, H, d, P = 8, 4, 8, 4
    h = H // P
    for rank, res in enumerate(world4["features"]):
        sizes = res["sizes"]
        S, s = sum(sizes), sizes[rank]
        fwd = [("all_to_all", W.G * s * H * (4 * d + 1) * e), ("all_to_all", W.G * S * h * d * e)]
        bwd = [("all_to_all", W.G * s * H * d * e), ("all_to_all", W.G * S * h * (4 * d + 1) * e)]
        assert res["kimi_linear_kda_bytes"] == {"forward": fwd, "backward": bwd}, rank
        lib = kda_bytes(W.G, sizes, rank, heads=H, head_dim=d, elem_bytes=e)
        assert lib == {"forward": [b for _, b in fwd], "backward": [b for _, b in bwd]}


def test_short_conv_halo_bytes_closed_form(world4):
    """One LFM2 short convolution (width 3) at sp=4: forward each rank but the last sends its
    last 2 gated inputs ``[G, 2, 32]`` to the next (one send, one receive where a neighbour
    exists); backward the gradient of the received halo goes back. No all-to-all."""
    e, k, D, P = 8, 2, 32, 4
    for rank, res in enumerate(world4["features"]):
        one = W.G * k * D * e
        fwd = ([("p2p", one)] if rank < P - 1 else []) + ([("p2p_recv", one)] if rank else [])
        bwd = ([("p2p", one)] if rank else []) + ([("p2p_recv", one)] if rank < P - 1 else [])
        assert sorted(res["lfm2_bytes"]["forward"]) == sorted(fwd), rank
        assert sorted(res["lfm2_bytes"]["backward"]) == sorted(bwd), rank
        lib = halo_bytes(W.G, k, D, e, rank, P)
        assert lib == {"forward": one if rank < P - 1 else 0, "backward": one if rank else 0}


def test_guard_names_unrouted_mixer(world4):
    """A mixer given back its stock forward (it would mix this rank's slice only) is named by
    the first-forward guard."""
    for res in world4["features"]:
        assert "model.layers.0.mixer" in res["nemotron_h_guard"]
        assert "model.layers.0.conv" in res["lfm2_guard"]
        assert "model.layers.2" not in res["lfm2_guard"]


def test_refusals(world4):
    """6 Mamba heads on sp=4: refused at construction with the numbers and the valid sp. A
    slice shorter than the halo (S=4 on sp=4, kernel 3): refused with the slices."""
    res = world4["features"][0]
    msg = res["heads_refused"]
    assert msg.startswith("SequenceMixerError") and "6 Mamba heads" in msg
    assert "sp=4" in msg and "{1, 2, 3, 6}" in msg and "\n" not in msg
    short = res["short_refused"]
    assert "width 3" in short and "[1, 1, 1, 1]" in short and "\n" not in short


@pytest.fixture(scope="module")
def trainer_refs(assets):
    with _one_thread():
        return {f: T.run(_trainer_spec(assets, f, None)) for f in TRAINED}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", TRAINER_LAYOUTS, ids=lambda x: f"dp{x[0]}sp{x[1]}")
@pytest.mark.parametrize("family", TRAINED)
def test_trainer_equals_stock(world4, trainer_refs, family, layout):
    """``with_ulysses(transformers.Trainer)``: two steps' losses, gradient norms and learning
    rates equal the stock Trainer on one process (padded batches: padding runs as its own
    document through the mixers)."""
    dp, sp = layout
    got = world4["trained"][(family, dp, sp)]
    ref = trainer_refs[family]
    for key in ("loss", "grad_norm", "lr"):
        assert len(got[key]) == len(ref[key]) == 2, (key, got[key], ref[key])
        assert got[key] == pytest.approx(ref[key], rel=TRAINER_RTOL), key
