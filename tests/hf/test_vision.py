"""Vision-language models under Ulysses (issue 40): the vision work split over sp, exact.

Tiny Qwen2.5-VL and Qwen3-VL models from the families' own configs (fp32, CPU), rows with one
and two images of different sizes (tests/hf_vision_workers.py), against the stock model on one
process:

* the vision split (``hf.vision.route_vision``'s ``get_image_features``): every image's features
  (Qwen3-VL's deepstack features too) and the vision tower's gradients equal the stock tower's;
  each image is encoded on exactly one rank (the tower's own calls, counted by a hook), a rank
  with no image of its own still gets (zero) gradients; one all-gather forward and one
  reduce-scatter backward on the group, with the closed-form bytes.

Two spawned worlds for the file (2 ranks, 4 ranks), many cases each.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dtensor_ulysses.hf.vision import assign_images  # noqa: E402
from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_vision_workers as V  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-6)
FAMILIES = V.FAMILIES
# the 4-rank split: 3 images over 4 ranks (one rank encodes none)
FEW = [V.IMAGES[0], V.IMAGES[1]]


@pytest.fixture(scope="module")
def world2():
    jobs = [("split_check", (f,)) for f in FAMILIES]
    return run_local_world(V.run_jobs, 2, jobs, timeout_s=600)


@pytest.fixture(scope="module")
def world4():
    jobs = [("split_check", (f, 0, FEW)) for f in FAMILIES]
    return run_local_world(V.run_jobs, 4, jobs, timeout_s=600)


def test_assign_images_balances_whole_images_deterministically():
    assert assign_images([16, 32, 32, 16, 16], 2) == (0, 0, 1, 1, 0)  # loads 64 / 48
    assert assign_images([8, 8, 8], 4) == (0, 1, 2)
    assert assign_images([], 3) == ()
    with pytest.raises(ValueError, match="P >= 1"):
        assign_images([1], 0)


def _check_split(results, family: str, rows, world: int, index: int):
    ref = V.split_reference(family, rows=rows)
    encoded: list[int] = []
    for rank, res in enumerate(results):
        out = res[index]
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
    _check_split(world2, family, None, 2, FAMILIES.index(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_split_sp4_with_an_idle_rank(world4, family):
    _check_split(world4, family, FEW, 4, FAMILIES.index(family))
    owners = world4[0][FAMILIES.index(family)]["owner"]
    assert len(set(owners)) == 3  # 3 images on 4 ranks: one rank encoded none, yet matched
