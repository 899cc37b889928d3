"""Gemma 3 multimodal under Ulysses (issue 40): the decoder sharded after the image merge, the
vision tower split over sp (``hf.vision``), the bidirectional image blocks run by the kernel
feature (``block_ids``), exact against the stock model.

A tiny ``Gemma3ForConditionalGeneration`` (SigLIP tower, fp32, CPU, eager attention as the
reference), rows with one and two 9-token images (longer than the sliding window of 5, one
spanning the sp=2 cut, one row right-padded; tests/hf_vision_gemma_workers.py):
``hf.parallelize`` (Ulysses + FSDP2) with ``shard_batch`` at (dp, sp) = (1, 2), (2, 2), (1, 4)
gives the stock model's loss and every gradient (vision tower and projector included); each
image is encoded on exactly one rank of its sp group; the blocks matter (without them the stock
loss differs); the layers run the blockwise kernel with the blocks (SDPA cannot).

Two spawned worlds for the file (2 ranks, 4 ranks).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_vision_gemma_workers as V  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-6)
FAMILIES = V.FAMILIES
LAYOUTS = {2: ((1, 2),), 4: ((2, 2), (1, 4))}


def _jobs(world: int) -> list:
    return [("model_check", (f, dp, sp)) for f in FAMILIES for dp, sp in LAYOUTS[world]]


@pytest.fixture(scope="module")
def world2():
    return run_local_world(V.run_jobs, 2, _jobs(2), timeout_s=600)


@pytest.fixture(scope="module")
def world4():
    return run_local_world(V.run_jobs, 4, _jobs(4), timeout_s=600)


@pytest.fixture(scope="module")
def references():
    return {f: V.model_reference(f) for f in FAMILIES}


def _check(results, ref, dp: int, sp: int, index: int) -> None:
    encoded: dict[int, list[int]] = {}
    for res in results:
        out = res[index]
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], g, **TOL, msg=name)
        unused = set(out["grads"]) - set(ref["grads"])  # the stock model gives them no gradient
        assert all(not out["grads"][n].abs().any() for n in unused), unused
        # each image of a dp rank's rows encoded by one call on exactly one rank of its sp group
        assert out["calls"] == ([len(out["encoded"])] if out["encoded"] else [])
        encoded.setdefault(out["dp_rank"], []).extend(out["encoded"])
        labels = {label for label, _ in out["kernels"]}
        assert labels == {"window, blocks", "blocks"}, out["kernels"]
        assert {what for _, what in out["kernels"]} == {"blockwise"}
    for d in range(dp):
        n_images = next(r[index]["images"] for r in results if r[index]["dp_rank"] == d)
        assert sorted(encoded[d]) == list(range(n_images)), (d, encoded[d])


@pytest.mark.parametrize("family", FAMILIES)
def test_sp2_equals_stock_model(world2, references, family):
    _check(world2, references[family], 1, 2, FAMILIES.index(family))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS[4])
def test_dp2_sp2_and_sp4_equal_stock_model(world4, references, family, layout):
    index = FAMILIES.index(family) * len(LAYOUTS[4]) + LAYOUTS[4].index(layout)
    _check(world4, references[family], *layout, index)


def test_the_image_blocks_matter(references):
    """Without token_type_ids the stock model attends causally over the images: a loss and
    gradients outside the tolerances the tests above hold."""
    causal, ref = V.model_reference("gemma3", blocks=False), references["gemma3"]
    assert causal["loss"] != pytest.approx(ref["loss"], rel=1e-5)
    name = "model.vision_tower.embeddings.patch_embedding.weight"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(causal["grads"][name], ref["grads"][name], **TOL)
