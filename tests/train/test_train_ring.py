"""Ulysses x Ring trains like one process: the tiny model on ``init_mesh(dp, sp, ring=R)``,
``parallelize`` (ring attention inside the Ulysses engine, FSDP2 over dp x ring x sp) and
``get_batch(..., ring=R, ring_rank=r)`` (zigzag tokens, global positions) gives the first step's
loss and every gradient, and the losses of three steps, of a plain single-process model on the
same weights and global batch. Plain and packed documents, activation checkpointing and head
chunks; worlds of 2 and 4 gloo ranks. Bad input: degrees whose product is not the world size, a
sequence too short for 2 x ring blocks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.data import PackedCorpus, get_batch
from dtensor_ulysses.launch import run_local_world
from dtensor_ulysses.models import build_model, init_weights
from dtensor_ulysses.plan import SeqLayout, zigzag_permutation
from tests import ring_workers
from tests.reference import reference_adamw

# tiny: 8 q heads, 2 kv heads; seq_len a multiple of 2 * ring * sp
CFG = dict(model="tiny", seq_len=64, batch_size=4, seed=0, lr=3e-3, steps=3)


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """A JSONL corpus of short documents, so every 64-token window holds several."""
    path = tmp_path_factory.mktemp("ring-data") / "docs.jsonl"
    g = torch.Generator().manual_seed(1)
    lines = []
    for i in range(400):
        n = int(torch.randint(3, 40, (1,), generator=g))
        lines.append(json.dumps({"text": f"doc {i}: " + "abcdefgh"[i % 8] * n}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _reference(cfg: dict) -> dict:
    """Plain single-device training: the first step's loss and grads, and every step's loss."""
    model = build_model(cfg["model"], device="cpu")
    init_weights(model, seed=cfg["seed"])
    opt = reference_adamw(model, cfg["lr"])
    corpus = PackedCorpus.from_paths(cfg.get("data"), seq_len=cfg["seq_len"])
    losses, grads = [], None
    for step in range(cfg["steps"]):
        b = get_batch(
            corpus, step, global_batch_size=cfg["batch_size"], dp_rank=0, dp=1, sp_rank=0, sp=1,
            seed=cfg["seed"], pack_docs=cfg.get("pack_docs", False),
        )  # fmt: skip
        logits = model(b.input_ids, b.position_ids, layout=b.layout)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.labels.reshape(-1))
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _check(results: list[list[dict]], runs: list[dict]) -> None:
    refs: dict[bool, dict] = {}
    for rank, per_rank in enumerate(results):
        for run, r in zip(runs, per_rank):
            key = run.get("pack_docs", False)
            if key not in refs:
                refs[key] = _reference(run)
            ref = refs[key]
            label = f"rank {rank} (dp, ring, sp)={r['layout']} pack_docs={key}"
            for step, (a, b) in enumerate(zip(r["losses"], ref["losses"]), start=1):
                assert abs(a - b) < (1e-5 if step == 1 else 1e-4), (
                    f"{label} step {step}: {a} vs {b}"
                )
            assert set(r["grads"]) == set(ref["grads"]), f"{label}: parameter names differ"
            for name, g in r["grads"].items():
                torch.testing.assert_close(
                    g, ref["grads"][name], rtol=1e-4, atol=1e-6,
                    msg=lambda m, name=name: f"{label} {name}: {m}",
                )  # fmt: skip


@pytest.mark.timeout(400)
def test_ring2_sp2_and_dp2_ring2_train_like_one_process(short_docs):
    runs = [
        dict(CFG, dp=1, ring=2, sp=2),
        dict(CFG, dp=1, ring=2, sp=2, data=short_docs, pack_docs=True, steps=1),
        dict(CFG, dp=2, ring=2, sp=1),
        # the ring recomputed in backward (checkpointed blocks), and head-chunked Ulysses
        dict(CFG, dp=1, ring=2, sp=2, steps=1, activation_checkpointing=True, head_chunks=2),
    ]
    _check(run_local_world(ring_workers.ring_training, 4, runs), runs)


@pytest.mark.timeout(300)
def test_ring2_alone_trains_like_one_process(short_docs):
    runs = [
        dict(CFG, dp=1, ring=2, sp=1, data=short_docs, pack_docs=True, steps=2),
        # the explicit CPU kernel the ring runs (sdpa and flex are refused: see below)
        dict(CFG, dp=1, ring=2, sp=1, steps=1, backend="blockwise"),
    ]
    _check(run_local_world(ring_workers.ring_training, 2, runs), runs)


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "flash_attn"])
@pytest.mark.parametrize("pack_docs", [False, True])
def test_ring_refuses_a_kernel_that_cannot_run_its_blocks_before_step_1(kernel, pack_docs):
    """``--ring 2 --sp 1 --attention-backend sdpa|flex`` (no log-sum-exp to merge the ring's
    blocks) and ``flash_attn`` on CPU are refused by the checks in one line naming the kernels
    that can; ``blockwise`` passes them (and trains exactly, above); so does ``--compile``
    with a ring (dynamo cannot trace its point-to-point exchange), refused up front."""
    from dtensor_ulysses.train import TrainConfig, UsageError, validate

    base = dict(dp=1, ring=2, sp=1, seq_len=64, batch_size=2, device="cpu", pack_docs=pack_docs)
    with pytest.raises(UsageError) as e:
        validate(TrainConfig(**base, attention_backend=kernel), 2)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--attention-backend {kernel}: "), message
    assert "'blockwise'" in message, message
    validate(TrainConfig(**base, attention_backend="blockwise"), 2)
    with pytest.raises(UsageError, match=r"^--compile aot_eager with ring=2: .*P2POp"):
        validate(TrainConfig(**base, compile="aot_eager"), 2)


# ----------------------------------------------------------------------------------------------
# the data side, torch-free layout, bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ring,sp", [(2, 2), (2, 1), (4, 2), (1, 4)])
@pytest.mark.parametrize("pack_docs", [False, True])
def test_ring_batches_tile_the_global_batch(short_docs, ring, sp, pack_docs):
    """The ring x sp ranks' slices are the full batch's ids, labels and positions, permuted."""
    S = 64
    corpus = PackedCorpus.from_paths(short_docs, seq_len=S)
    kw = dict(global_batch_size=2, dp_rank=0, dp=1, seed=3, pack_docs=pack_docs)
    full = get_batch(corpus, 5, sp_rank=0, sp=1, **kw)
    parts = [
        get_batch(corpus, 5, sp_rank=p, sp=sp, ring=ring, ring_rank=r, **kw)
        for r in range(ring)
        for p in range(sp)
    ]
    perm = zigzag_permutation(S, ring, sp)
    for field in ("input_ids", "labels", "position_ids"):
        got = torch.cat([getattr(b, field) for b in parts], dim=1)
        assert torch.equal(got, getattr(full, field)[:, perm]), field
    layout = parts[0].layout
    assert layout == SeqLayout.split(S, sp, full.layout.doc_starts, ring=ring)
    assert layout.seq_len == S and layout.ring_len == S // ring
    assert layout.doc_starts == full.layout.doc_starts
    if pack_docs:
        assert max(len(row) for row in layout.doc_starts) > 2


def test_ring_layout_checks_global_doc_starts():
    layout = SeqLayout.split(16, 2, ((0, 9, 15),), ring=2)
    assert layout.seq_sizes == (4, 4) and layout.seq_len == 16 and layout.ring == 2
    assert SeqLayout.split(16, 2) == SeqLayout((8, 8))  # ring = 1: the 2-D meaning
    with pytest.raises(ValueError, match=r"past the sequence length 16 \(ring=2 x 8"):
        SeqLayout.split(16, 2, ((0, 16),), ring=2)
    with pytest.raises(ValueError, match="2 x ring = 4 zigzag chunks"):
        SeqLayout.split(18, 2, ring=2)
    with pytest.raises(ValueError, match="ring=0"):
        SeqLayout((4, 4), ring=0)


def test_get_batch_refuses_bad_ring_input():
    corpus = PackedCorpus.from_paths(None, seq_len=6)
    kw = dict(global_batch_size=1, dp_rank=0, dp=1, seed=0, sp_rank=0, sp=1)
    with pytest.raises(ValueError, match=r"2 x ring = 8 zigzag chunks; S=6 tokens is shorter"):
        get_batch(corpus, 0, ring=4, **kw)
    with pytest.raises(ValueError, match="ring_rank=2 is out of range for ring=2"):
        get_batch(corpus, 0, ring=2, **{**kw, "ring_rank": 2})
    corpus = PackedCorpus.from_paths(None, seq_len=12)
    with pytest.raises(ValueError, match=r"12 gives each of the ring=2 ranks 6 tokens, not "):
        get_batch(corpus, 0, ring=2, **{**kw, "sp": 4})


def test_mesh_bad_degrees_and_short_sequence_name_the_numbers():
    results = run_local_world(ring_workers.ring_bad_input, 4)
    msgs = results[0]
    assert "dp x ring x sp = 1 x 2 x 3 = 6, but the world has 4 ranks" in msgs["product"]
    assert "dp x ring = 3 x 1" not in msgs["product"]
    assert "dp x ring = 3 x 2 = 6 does not divide world_size=4" in msgs["sp_none"]
    assert "2 x ring = 4 zigzag chunks" in msgs["short"] and "S=2" in msgs["short"]
    assert "needs the documents' global starts" in msgs["position_ids"]
    assert msgs["flatten"] == ["dp_ring_sp"]
    assert msgs["world"] == 4


@pytest.mark.timeout(300)
def test_trainer_ring_2_x_sp_2_gives_the_single_device_losses():
    """The trainer itself (``--ring 2 --sp 2``): three steps of losses equal the plain
    single-process run, as ``--sp 4`` does."""
    from tests import train_workers
    from tests.train.test_train import CFG, _reference

    _, _, ref = _reference(3)
    runs = [dict(CFG, dp=1, ring=2, sp=2, steps=3), dict(CFG, dp=1, sp=4, steps=3)]
    for run, losses in zip(runs, run_local_world(train_workers.run_training, 4, runs)[0]):
        for (step, got), want in zip(losses, ref):
            assert abs(got - want) < 1e-4, f"{run} step {step}: {got} vs {want}"


def test_trainer_refuses_bad_ring_layouts():
    from dtensor_ulysses.train import TrainConfig, UsageError, validate

    with pytest.raises(UsageError, match=r"--dp 1 x --ring 2 x --sp 4 = 8 but torchrun started 4"):
        validate(TrainConfig(dp=1, ring=2, sp=4, seq_len=64), 4)
    with pytest.raises(UsageError, match=r"--seq-len: .*62"):
        validate(TrainConfig(dp=1, ring=2, sp=2, seq_len=62), 4)
