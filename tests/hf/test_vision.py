"""Vision-language models under Ulysses (issue 40): the vision work split over sp, exact.

Tiny Qwen2.5-VL and Qwen3-VL models from the families' own configs (fp32, CPU), rows with one
and two images of different sizes (tests/hf/vision_workers.py), against the stock model on one
process:

* the vision split (``hf.vision.route_vision``'s ``get_image_features``): every image's features
  (Qwen3-VL's deepstack features too) and the vision tower's gradients equal the stock tower's;
  each image is encoded on exactly one rank (the tower's own calls, counted by a hook), a rank
  with no image of its own still gets (zero) gradients; one all-gather forward and one
  reduce-scatter backward on the group, with the closed-form bytes;
* ``parallelize`` (Ulysses + FSDP2) + ``shard_batch``, both families at (dp, sp) = (1, 2),
  (2, 2), (1, 4): the loss and every gradient (vision tower included) equal the stock model's,
  each image encoded on one rank of its sp group;
* ``with_ulysses(transformers.Trainer)``: two steps' losses and gradient norms equal the stock
  Trainer on one process, both families at (1, 2), (2, 2), (1, 4) (Qwen2.5-VL also against the
  stock Trainer at dp = 2), each step's images encoded once;
* videos (Qwen2.5-VL, Qwen3-VL: a group per frame) split like images, at (1, 2);
* ``with_ulysses(trl.SFTTrainer)`` with a Qwen2.5-VL processor and TRL's vision-language rows
  (sp = 2, 4); examples/vlm_trainer.py; the refusals (Gemma's videos, families without an
  adapter).

Two spawned worlds for the file (2 ranks, 4 ranks), many cases each.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dtensor_ulysses.hf.models.vision import assign_images  # noqa: E402
from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402
from tests.hf import vision_workers as V  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-6)
FAMILIES = V.FAMILIES
# the 4-rank split: 3 images over 4 ranks (one rank encodes none)
FEW = [V.IMAGES[0], V.IMAGES[1]]


LAYOUTS4 = ((2, 2), (1, 4))
BATCH = 4  # the Trainer's global batch


def _trainer_job(assets, family: str, dp: int, sp: int | None, variant: str | None = None):
    if variant is None:
        out = str(assets / f"out-{family}-{dp}-{sp}")
        return ("trainer_run", (str(assets / family), out, sp, BATCH // dp))
    out = str(assets / f"out-{family}-{dp}-{sp}-{variant}")
    return ("trainer_run", (str(assets / family), out, sp, BATCH // dp, 2, variant))


def _sft_job(assets, sp: int) -> tuple:
    out = str(assets / f"sft-{sp}")
    return ("sft_run", (str(assets / "qwen2_5_vl"), str(assets / "tok"), out, sp, 4))


def _jobs2(assets) -> list:
    return (
        [_sft_job(assets, 2), ("example_run", (str(assets / "example"),))]
        + [("split_check", (f,)) for f in FAMILIES]
        + [("model_check", (f, 1, 2)) for f in FAMILIES]
        + [("model_check", (f, 1, 2, 0, V.VIDEO_ROWS)) for f in FAMILIES]
        + [_trainer_job(assets, f, 1, 2) for f in FAMILIES]
        + [_trainer_job(assets, "qwen2_5_vl", 2, None)]  # the stock Trainer at dp=2
        + [_trainer_job(assets, "qwen2_5_vl", 2, None, "uneven")]  # ... rows of unequal targets
    )


def _jobs4(assets) -> list:
    return (
        [_sft_job(assets, 4)]
        + [("split_check", (f, 0, FEW)) for f in FAMILIES]
        + [("model_check", (f, dp, sp)) for f in FAMILIES for dp, sp in LAYOUTS4]
        + [_trainer_job(assets, f, dp, sp) for f in FAMILIES for dp, sp in LAYOUTS4]
        + [("model_check", (f, 1, 4, 0, V.SHORT_ROWS, V.SHORT_S)) for f in FAMILIES]
        + [_trainer_job(assets, "qwen2_5_vl", 1, 4, "short")]
        + [_trainer_job(assets, "qwen2_5_vl", 2, 2, "uneven")]
    )


def _job(world: tuple, name: str, args: tuple) -> list:
    """Every rank's result of job ``(name, args)`` in a world's results."""
    jobs, results = world
    i = jobs.index((name, args))
    return [r[i] for r in results]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    for f in FAMILIES:
        V.save_model(f, root / f)
    W.make_tokenizer(root / "tok", " ".join(T.TEXTS) * 5)
    return root


@pytest.fixture(scope="module")
def world2(assets):
    jobs = _jobs2(assets)
    return jobs, run_local_world(V.run_jobs, 2, jobs, timeout_s=600)


@pytest.fixture(scope="module")
def world4(assets):
    jobs = _jobs4(assets)
    return jobs, run_local_world(V.run_jobs, 4, jobs, timeout_s=600)


@pytest.fixture(scope="module")
def references():
    return {f: V.model_reference(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def video_references():
    return {f: V.model_reference(f, rows=V.VIDEO_ROWS) for f in FAMILIES}


def test_assign_images_balances_whole_images_deterministically():
    assert assign_images([16, 32, 32, 16, 16], 2) == (0, 0, 1, 1, 0)  # loads 64 / 48
    assert assign_images([8, 8, 8], 4) == (0, 1, 2)
    assert assign_images([], 3) == ()
    load = [32, 0]  # a step's images placed first: its videos fill the other ranks
    assert assign_images([64, 32], 2, load) == (1, 0) and load == [64, 64]
    with pytest.raises(ValueError, match="P >= 1"):
        assign_images([1], 0)


def _check_split(results, family: str, rows):
    ref = V.split_reference(family, rows=rows)
    encoded: list[int] = []
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["feats"], ref["feats"], **TOL)
        assert set(out["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], g, **TOL, msg=name)
        mine = [i for i, o in enumerate(out["owner"]) if o == rank]
        assert out["encoded"] == mine
        # the tower itself: at most one call per rank, with exactly this rank's images
        assert out["seen"] == ([[out["grid"][i] for i in mine]] if mine else [])
        encoded += mine
        f_bytes, b_bytes = out["want_bytes"]
        assert out["fwd"] == {"all_gather": {"count": 1, "bytes": f_bytes}}
        assert out["bwd"] == {"reduce_scatter": {"count": 1, "bytes": b_bytes}}
    assert sorted(encoded) == list(range(len(ref["grid"])))  # each image on exactly one rank
    return encoded


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_split_sp2_equals_stock_tower(world2, family):
    _check_split(_job(world2, "split_check", (family,)), family, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_split_sp4_with_an_idle_rank(world4, family):
    results = _job(world4, "split_check", (family, 0, FEW))
    _check_split(results, family, FEW)
    assert len(set(results[0]["owner"])) == 3  # 3 images on 4 ranks: one encoded none


def test_reference_uses_mrope_and_deepstack():
    """The features the decoder tests rely on change the stock result: M-RoPE positions
    (from mm_token_type_ids) and Qwen3-VL's deepstack features (their mergers get gradients)."""
    for family in FAMILIES:
        model = V.make_model(family)
        batch = V.global_batch(family)
        with torch.no_grad():
            with_mrope = model(**batch).loss
            pos = torch.arange(V.S).expand(len(batch["input_ids"]), V.S)
            plain = model(**batch, position_ids=pos).loss  # 1-D positions, no M-RoPE
        assert abs(with_mrope.item() - plain.item()) > 1e-4, family
    ref = V.model_reference("qwen3_vl")
    deep = [n for n in ref["grads"] if "deepstack_merger_list" in n]
    assert deep and all(ref["grads"][n].abs().sum() > 0 for n in deep)


def _check_model(results, ref, dp: int, sp: int, calls: int = 1):
    encoded_by_group: dict[int, list] = {}
    for out in results:
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert set(out["grads"]) >= set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], g, **TOL, msg=name)
        encoded_by_group.setdefault(out["dp_rank"], []).extend(
            grid for call in out["seen"] for grid in call
        )
        assert len(out["seen"]) <= calls  # one vision tower call per rank (and kind)
    for dp_rank, grids in encoded_by_group.items():  # each image on one rank of its sp group
        images = next(o["images"] for o in results if o["dp_rank"] == dp_rank)
        assert sorted(grids) == sorted(images)


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_ulysses_sp2_equals_stock_model(world2, references, family):
    _check_model(_job(world2, "model_check", (family, 1, 2)), references[family], 1, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_videos_split_like_images_sp2_equals_stock_model(world2, video_references, family):
    """A row with an image and a 2-frame video, a row with a longer video (Qwen3-VL: a group
    of tokens per frame): loss and every gradient equal the stock model, each video encoded
    whole on one rank (at most one tower call per rank for images, one for videos)."""
    results = _job(world2, "model_check", (family, 1, 2, 0, V.VIDEO_ROWS))
    _check_model(results, video_references[family], 1, 2, calls=2)
    # images and videos balanced together: 32 + 32 patches on one rank, 64 on the other
    work = [sum(t * h * w for call in out["seen"] for t, h, w in call) for out in results]
    assert work == [64, 64]


@pytest.mark.parametrize("layout", LAYOUTS4, ids=lambda x: f"dp{x[0]}sp{x[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_apply_ulysses_dp2_sp2_and_sp4_equal_stock_model(world4, references, family, layout):
    dp, sp = layout
    results = _job(world4, "model_check", (family, dp, sp))
    _check_model(results, references[family], dp, sp)


@pytest.fixture(scope="module")
def trainer_references(assets):
    """The stock Trainer on one process (dp = 1)."""
    return {f: V.trainer_run(0, 1, str(assets / f), str(assets / f"ref-{f}"), None, BATCH)
            for f in FAMILIES}  # fmt: skip


def _check_trainer(results: list, ref: dict):
    got = results[0]
    assert len(got["loss"]) == 2
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    # each step's images (the stock run's, one tower call) encoded once over all ranks, at most
    # one tower call per rank and step
    for step, want in enumerate(ref["seen"]):
        calls = [grids for out in results for s, grids in out["seen"] if s == step]
        assert all(sum(1 for s, _ in out["seen"] if s == step) <= 1 for out in results)
        assert sorted(g for grids in calls for g in grids) == sorted(want[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_sp2_equals_stock_trainer_and_stock_dp2(world2, assets, trainer_references,
                                                        family):  # fmt: skip
    ref = trainer_references[family]
    _check_trainer(_job(world2, *_trainer_job(assets, family, 1, 2)), ref)
    if family != "qwen2_5_vl":
        return
    stock = _job(world2, *_trainer_job(assets, family, 2, None))[0]  # the stock Trainer, dp=2
    # every row has the same number of targets, so the stock per-rank token mean (Qwen-VL's
    # loss takes no num_items_in_batch) is the global one, as with_ulysses computes
    assert stock["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert stock["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS4, ids=lambda x: f"dp{x[0]}sp{x[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_dp2_sp2_and_sp4_equal_stock_trainer(
    world2, world4, assets, trainer_references, family, layout
):
    dp, sp = layout
    results = _job(world4, *_trainer_job(assets, family, dp, sp))
    _check_trainer(results, trainer_references[family])
    if dp == 2 and family == "qwen2_5_vl":  # and the stock Trainer at the same dp
        stock = _job(world2, *_trainer_job(assets, family, 2, None))[0]
        assert results[0]["loss"] == pytest.approx(stock["loss"], rel=1e-4)
        assert results[0]["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_cut_with_an_empty_rank_equal_stock_model(world4, family):
    """Rows of 9 tokens with an image each at sp=4 (cut [3, 3, 3, 0]): the merged embeddings
    are padded after the merge (every rank holds a token), and the loss and every gradient
    (vision tower, Qwen3-VL's deepstack mergers included) equal the stock model's."""
    ref = V.model_reference(family, rows=V.SHORT_ROWS, length=V.SHORT_S)
    results = _job(world4, "model_check", (family, 1, 4, 0, V.SHORT_ROWS, V.SHORT_S))
    _check_model(results, ref, 1, 4)


def test_trainer_rows_cut_with_an_empty_rank_equal_stock_trainer(world4, assets):
    """The same rows through with_ulysses(Trainer) at sp=4: losses, gradient norms and the
    images the tower saw equal the stock Trainer on one process."""
    ref = V.trainer_run(0, 1, str(assets / "qwen2_5_vl"), str(assets / "ref-short"), None,
                        BATCH, 2, "short")  # fmt: skip
    _check_trainer(_job(world4, *_trainer_job(assets, "qwen2_5_vl", 1, 4, "short")), ref)


def test_per_rank_mean_of_a_model_without_loss_kwargs_equals_stock_dp2(world2, world4, assets):
    """Qwen2.5-VL (``accepts_loss_kwargs = False``): the stock Trainer at dp=2 logs the mean of
    each dp rank's token mean, which differs from one process when the rows hold unequal
    numbers of targets; with_ulysses at (2,2) logs and trains the same (losses, gradient
    norms)."""
    stock = _job(world2, *_trainer_job(assets, "qwen2_5_vl", 2, None, "uneven"))[0]
    got = _job(world4, *_trainer_job(assets, "qwen2_5_vl", 2, 2, "uneven"))[0]
    one = V.trainer_run(0, 1, str(assets / "qwen2_5_vl"), str(assets / "ref-uneven"), None,
                        BATCH, 2, "uneven")  # fmt: skip
    assert abs(one["loss"][0] - stock["loss"][0]) > 1e-3 * stock["loss"][0], (one, stock)
    assert got["loss"] == pytest.approx(stock["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("sp", (2, 4))
def test_sft_trainer_with_processor_and_vl_rows_equals_stock(world2, world4, assets, sp):
    """TRL's vision-language format (images + messages) through a Qwen2.5-VL processor and
    TRL's collator (right padding, one or two images a row): losses, gradient norms and TRL's
    metrics equal the stock SFTTrainer on one process."""
    pytest.importorskip("trl")
    ref = V.sft_run(0, 1, *_sft_job(assets, 2)[1][:2], str(assets / "sft-ref"), None, 4)
    got = _job(world2 if sp == 2 else world4, *_sft_job(assets, sp))[0]
    assert len(got["loss"]) == 2
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"):
        assert got[key] == pytest.approx(ref[key], rel=1e-4), key


def test_refusals_name_the_input_and_the_family():
    from types import SimpleNamespace

    from dtensor_ulysses.hf.models.vision import refuse_video, vision_family, vision_model_inputs

    videos = {"input_ids": torch.zeros(1, 4), "pixel_values_videos": torch.zeros(4, 12)}
    gemma = SimpleNamespace(config=SimpleNamespace(model_type="gemma3"))
    with pytest.raises(ValueError, match=r"video inputs \(pixel_values_videos\)"):
        refuse_video(videos, gemma)  # Gemma's videos are not split
    qwen = SimpleNamespace(config=SimpleNamespace(model_type="qwen2_5_vl"))
    refuse_video(videos, qwen)  # Qwen's are
    sb = SimpleNamespace(layout="L")
    assert set(vision_model_inputs(videos, sb)) == {"input_ids", "pixel_values_videos",
                                                   "ulysses_layout"}  # fmt: skip
    llava = SimpleNamespace(config=SimpleNamespace(model_type="llava"))
    with pytest.raises(ValueError, match=r"model_type 'llava'.*supported .*qwen2_5_vl"):
        vision_family(llava)


def test_example_vlm_trainer_trains(world2, assets):
    """examples/vlm_trainer.py at sp=2 (its main, in the 2-rank world) trains to the end."""
    metrics = _job(world2, "example_run", (str(assets / "example"),))[0]
    assert metrics["train_loss"] == pytest.approx(metrics["train_loss"])  # finite
    assert 3.0 < metrics["train_loss"] < 6.0  # about ln(96) = 4.56 at random init
