"""The trainer's held-out loss (``--eval-data``) at every layout it trains, ``--ring`` included:
the eval loss after each step, and the training losses, equal a plain single-process model
trained and evaluated on the same rows (:func:`tests.train.test_train.reference_run`), at
``(dp, ring, sp)`` in (1,1,2), (1,2,1), (1,2,2), (2,2,1). The ranks run with ``transformers``
unimportable (:mod:`tests.train.eval_workers`): the built-in model's train and eval path needs
neither it nor :mod:`dtensor_ulysses.hf`."""

from __future__ import annotations

import pytest

from dtensor_ulysses.data import PackedCorpus
from dtensor_ulysses.launch import WORLD_START_ENV, run_local_world
from tests.train import eval_workers
from tests.train.test_train import CFG, reference_run

STEPS = 2
LAYOUTS = {2: [(1, 1, 2), (1, 2, 1)], 4: [(1, 2, 2), (2, 2, 1)]}


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> str:
    """About 3 global batches of held-out text (64-token windows, batch 4)."""
    path = tmp_path_factory.mktemp("eval-data") / "heldout.txt"
    path.write_text(" ".join(f"held-out line {i}: {'xyzw'[i % 4] * (i % 9)}" for i in range(40)))
    return str(path)


@pytest.fixture(scope="module")
def reference(heldout):
    eval_corpus = PackedCorpus.from_paths([heldout], seq_len=CFG["seq_len"])
    assert len(eval_corpus) // CFG["batch_size"] >= 3, "several held-out batches"
    _, losses, evals = reference_run(STEPS, eval_corpus)
    return losses, evals


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_eval_loss_at_every_layout_equals_one_process_without_transformers(
    world_size, heldout, reference, monkeypatch
):
    # fresh processes (spawn): the suite's forkserver has transformers imported already
    monkeypatch.setenv(WORLD_START_ENV, "spawn")
    ref_losses, ref_evals = reference
    runs = [
        dict(CFG, dp=dp, ring=ring, sp=sp, steps=STEPS, eval_data=[heldout], eval_every=1)
        for dp, ring, sp in LAYOUTS[world_size]
    ]
    results = run_local_world(eval_workers.train_and_evaluate, world_size, runs, timeout_s=240)
    for rank, out in enumerate(results):
        assert out["blocked"] and out["before"] == [] and out["loaded"] == [], out
        for layout, records in zip(LAYOUTS[world_size], out["records"]):
            label = f"rank {rank} (dp, ring, sp)={layout}"
            assert [r["step"] for r in records] == list(range(1, STEPS + 1)), label
            for r, loss, ev in zip(records, ref_losses, ref_evals):
                assert r["loss"] == pytest.approx(loss, rel=1e-4), f"{label} step {r['step']}"
                assert r["eval_loss"] == pytest.approx(ev, rel=1e-5), f"{label} step {r['step']}"
                assert r["eval_tokens"] > 0
