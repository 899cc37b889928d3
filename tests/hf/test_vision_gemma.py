"""Gemma 3 and Gemma 4 multimodal under Ulysses (issue 40): the decoder sharded after the image
merge, the vision tower split over sp (``hf.vision``), the bidirectional image blocks run by the
kernel feature (``block_ids``), exact against the stock model.

Tiny ``Gemma3ForConditionalGeneration`` (SigLIP tower, every layer with image blocks) and
``Gemma4ForConditionalGeneration`` (images of different sizes, blocks on the sliding layers
only, global layers of another head shape, per-layer inputs, KV sharing), fp32, CPU, eager
attention as the reference; rows with one and two images (longer than the sliding window of 5,
one spanning the sp=2 cut, one row right-padded; tests/hf/vision_gemma_workers.py):
``hf.parallelize`` (Ulysses + FSDP2) with ``shard_batch`` at (dp, sp) = (1, 2), (2, 2), (1, 4)
gives the stock model's loss and every gradient (vision tower and projector included); each
image is encoded on exactly one rank of its sp group; the blocks matter (without them the stock
loss and gradients differ); the layers with blocks run the blockwise kernel (SDPA cannot), the
others keep SDPA.

Two spawned worlds for the file (2 ranks, 4 ranks).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests.hf import vision_gemma_workers as V  # noqa: E402

RTOL = 1e-4  # fp32; atol: 1e-6 + 1e-5 of each tensor's largest gradient (sums in another order)


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6 + 1e-5 * float(want.abs().max()),
                               msg=name)  # fmt: skip


FAMILIES = V.FAMILIES
# per family, the (features, kernel) of its layer kinds on CPU in fp32
KERNELS = {
    "gemma3": {("window, blocks", "blockwise"), ("blocks", "blockwise")},
    "gemma4": {("window, blocks", "blockwise"), ("causal", "sdpa")},  # global layers: causal
}
LAYOUTS = {2: ((1, 2),), 4: ((2, 2), (1, 4))}


def _jobs(world: int, root) -> list:
    jobs = [("model_check", (f, dp, sp)) for f in FAMILIES for dp, sp in LAYOUTS[world]]
    # the SFTTrainer door (Gemma 3) at sp = world
    jobs += [("sft_run", (str(root / "tok"), str(root / f"sft-{world}"), world))]
    # packed documents with images (Gemma 3) at (1, world)
    jobs += [("model_check", ("gemma3", 1, world, 0, True))]
    if world == 2:  # the Trainer door at (1, 2) for both families, then the refusals
        jobs += [("trainer_run", (f, str(root / f"ulysses-{f}"), 2)) for f in FAMILIES]
        jobs += [("refusal_check", ())]
    return jobs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from tests.hf import trainer_workers as T

    path = tmp_path_factory.mktemp("gemma_doors")
    V.save_tokenizer(path / "tok", " ".join(T.TEXTS) * 5)
    return path


@pytest.fixture(scope="module")
def world2(root):
    return run_local_world(V.run_jobs, 2, _jobs(2, root), timeout_s=600)


@pytest.fixture(scope="module")
def world4(root):
    return run_local_world(V.run_jobs, 4, _jobs(4, root), timeout_s=600)


@pytest.fixture(scope="module")
def references():
    return {f: V.model_reference(f) for f in FAMILIES}


@pytest.mark.parametrize("sp", [2, 4])
def test_packed_documents_with_images_equal_each_document_alone(world2, world4, sp):
    """Rows packed from two documents (position ids restarting), images inside them: at
    (1, sp) the loss and every gradient equal the stock model run on each document on its own
    (no attention, no image block across a document)."""
    ref = V.packed_reference("gemma3")
    world = world2 if sp == 2 else world4
    _check(world, ref, "gemma3", 1, len(FAMILIES) * len(LAYOUTS[sp]) + 1)


def _check(results, ref, family: str, dp: int, index: int) -> None:
    encoded: dict[int, list[int]] = {}
    for res in results:
        out = res[index]
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for name, g in ref["grads"].items():
            _close(out["grads"][name], g, name)
        unused = set(out["grads"]) - set(ref["grads"])  # the stock model gives them no gradient
        assert all(not out["grads"][n].abs().any() for n in unused), unused
        # each image of a dp rank's rows encoded by one call on exactly one rank of its sp group
        assert out["calls"] == ([len(out["encoded"])] if out["encoded"] else [])
        encoded.setdefault(out["dp_rank"], []).extend(out["encoded"])
        assert set(out["kernels"]) == KERNELS[family], out["kernels"]
    for d in range(dp):
        n_images = next(r[index]["images"] for r in results if r[index]["dp_rank"] == d)
        assert sorted(encoded[d]) == list(range(n_images)), (d, encoded[d])


@pytest.mark.parametrize("family", FAMILIES)
def test_sp2_equals_stock_model(world2, references, family):
    _check(world2, references[family], family, 1, FAMILIES.index(family))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS[4])
def test_dp2_sp2_and_sp4_equal_stock_model(world4, references, family, layout):
    index = FAMILIES.index(family) * len(LAYOUTS[4]) + LAYOUTS[4].index(layout)
    _check(world4, references[family], family, layout[0], index)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_image_blocks_matter(references, family):
    """Without the token types the stock model attends causally over the images: a loss and
    gradients outside the tolerances the tests above hold."""
    causal, ref = V.model_reference(family, blocks=False), references[family]
    assert causal["loss"] != pytest.approx(ref["loss"], rel=1e-5)
    name = next(n for n in ref["grads"] if "vision_tower" in n)
    with pytest.raises(AssertionError):
        _close(causal["grads"][name], ref["grads"][name], name)


def test_refusals_name_the_input_and_the_reason(world2):
    """Video and audio inputs of Gemma 4, and a padding mask without the batch's layout: one
    line each, before any attention runs; SDPA asked for Gemma 3's layers with image blocks:
    refused when the model is prepared, naming the layer, its features and the kernels that
    run them."""
    for res in world2:
        out = res[-1]
        assert out["video"].startswith("video inputs (pixel_values_videos) are not supported")
        assert out["audio"].startswith("audio inputs (input_features) are not supported")
        assert "attention_mask with padding needs the batch's layout" in out["padding"]
        assert out["sdpa"].startswith("model.language_model.layers.0.self_attn (Gemma3Attention, "
                                      "sliding_window=5, bidirectional image blocks): no "
                                      "attention kernel runs it exactly")  # fmt: skip
        assert out["sdpa"].endswith(
            "or one of ['blockwise'] (these train with window, blocks on cpu)"
        )
        assert all("\n" not in why for why in out.values())


def test_other_multimodal_families_are_refused_by_name():
    import transformers as tf

    from dtensor_ulysses.hf.models.routing import check_supported

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4)  # fmt: skip
    cfg = tf.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=95)
    model = tf.PaliGemmaForConditionalGeneration(cfg)
    with pytest.raises(
        ValueError,
        match=r"^PaliGemmaForConditionalGeneration \(model_type "
        r"'paligemma'\): its vision tower has no adapter .*'gemma3', 'gemma4'",
    ):
        check_supported(model)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_sp2_equals_stock_trainer(world2, tmp_path, family):
    """``with_ulysses(transformers.Trainer)`` with a collator giving pixel_values and the token
    types: two steps' logged losses and gradient norms equal the stock Trainer's (dp = 1, one
    process); each step's images encoded once per sp group (split over its two ranks)."""
    ref = V.trainer_run(0, 1, family, str(tmp_path / "stock"), None)
    index = len(_jobs(2, tmp_path)) - 1 - len(FAMILIES) + FAMILIES.index(family)
    encoded = [0] * len(ref["encoded"])
    for res in world2:
        got = res[index]
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)
        assert len(got["encoded"]) <= len(ref["encoded"])  # at most one tower call per step
        for step, n in enumerate(got["encoded"]):
            encoded[step] += n
    assert len(ref["loss"]) == 2 and sum(encoded) == sum(ref["encoded"])


@pytest.fixture(scope="module")
def sft_reference(root):
    return V.sft_run(0, 1, str(root / "tok"), str(root / "sft-stock"), None)


@pytest.mark.parametrize("sp", [2, 4])
def test_sft_trainer_with_processor_and_vl_rows_equals_stock(world2, world4, sft_reference, sp):
    """``with_ulysses(trl.SFTTrainer)`` on Gemma 3 with its processor (token_type_ids from it)
    and TRL's vision-language rows (images + messages): losses, grad norms and TRL's metrics of
    two steps equal the stock SFTTrainer's (dp = 1)."""
    world = world2 if sp == 2 else world4
    index = len(FAMILIES) * len(LAYOUTS[sp])
    for res in world:
        got = res[index]
        for key, want in sft_reference.items():
            assert got[key] == pytest.approx(want, rel=RTOL), key
    assert len(sft_reference["loss"]) == 2
    assert all(n > 0 for n in sft_reference["image_tokens"])  # the processor's token types
