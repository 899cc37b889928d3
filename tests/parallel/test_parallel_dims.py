"""ParallelDims alone, without a mesh or a process group (torchtitan's test_parallel_dims.py is
the model): the degrees a world resolves to, the checks between them in the caller's spelling
(the trainer's flags use the same arithmetic), the axis names and shape of the mesh they build,
that degrees without their mesh refuse to answer groups, and that the trainer builds them once
and hands them on. Bound to a mesh (groups, coordinates, the slicer's arguments): the bad-input
world, ``tests/attention/test_bad_input.py``."""

from __future__ import annotations

import pytest

from dtensor_ulysses.parallel import ParallelDims


@pytest.mark.parametrize(
    "world,dp,sp,ring,want",
    [
        (8, 1, None, 1, (1, 1, 8)),  # sp takes the ranks left
        (8, 2, None, 1, (2, 1, 4)),
        (8, 2, None, 2, (2, 2, 2)),
        (8, None, 4, 1, (2, 1, 4)),  # with_ulysses(sp=4): dp takes them
        (8, None, 2, 2, (2, 2, 2)),
        (6, 3, 2, 1, (3, 1, 2)),
        (1, 1, None, 1, (1, 1, 1)),
    ],
)
def test_resolve_fills_in_the_degree_left(world, dp, sp, ring, want):
    dims = ParallelDims.resolve(world, dp=dp, sp=sp, ring=ring)
    assert (dims.dp, dims.ring, dims.sp) == want
    assert dims.world_size == world == want[0] * want[1] * want[2]


@pytest.mark.parametrize(
    "world,kw,match",
    [
        (8, dict(dp=3), r"dp=3 does not divide world_size=8; choose dp in \[1, 2, 4, 8\]"),
        (8, dict(dp=3, ring=2), r"dp x ring = 3 x 2 = 6 does not divide world_size=8"),
        (6, dict(dp=None, sp=4), r"sp=4 does not divide the 6 ranks"),
        (8, dict(dp=2, sp=2), r"dp \* sp = 2 \* 2 = 4 but the world size is 8"),
        (8, dict(dp=None, sp=None), r"give dp or sp"),
        (8, dict(dp=0), r"dp"),
        (8, dict(dp=1, ring=0), r"ring"),
    ],
)
def test_resolve_refuses_degrees_that_do_not_make_the_world(world, kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.resolve(world, **kw)


@pytest.mark.parametrize(
    "world,kw,match",
    [
        (8, dict(dp=2, sp=2), r"^--dp 2 x --sp 2 = 4 but torchrun started 8 processes; make dp "
                              r"\* sp equal --nproc-per-node x --nnodes$"),
        (4, dict(dp=1, sp=4, ring=2), r"^--dp 1 x --ring 2 x --sp 4 = 8 but torchrun started 4"),
        (8, dict(dp=3, sp=None), r"^--dp 3 does not divide the world size 8; choose dp in"),
        (8, dict(dp=3, sp=None, ring=2), r"^--dp 3 x --ring 2 does not divide the world size 8"),
        (8, dict(dp=0), r"^--dp 0 is not a positive degree; use --dp >= 1$"),
        (8, dict(dp=1, sp=0), r"^--sp 0 is not a positive degree; use --sp >= 1$"),
    ],
)  # fmt: skip
def test_the_trainers_flags_get_the_same_arithmetic_in_their_spelling(world, kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.resolve(
            world, **kw, spelling="flag", world=f"torchrun started {world} processes"
        )


def test_degrees_without_their_mesh_refuse_to_answer_groups():
    dims = ParallelDims(2, 1, 2)
    assert dims.mesh is None
    for name in ("world_mesh", "sp_mesh", "dp_mesh", "flat_mesh", "sp_rank", "dp_rank"):
        with pytest.raises(ValueError, match=r"has no mesh yet: bind .* ParallelDims.from_mesh"):
            getattr(dims, name)
    with pytest.raises(ValueError, match="has no mesh yet"):
        dims.cut()


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("2", TypeError)])  # fmt: skip
def test_a_degree_is_a_positive_int(bad, error):
    for name in ("dp", "ring", "sp"):
        with pytest.raises(error, match=name):
            ParallelDims(**{name: bad})


def test_axis_names_shape_and_description():
    flat, ringed = ParallelDims(2, 1, 4), ParallelDims(2, 2, 2)
    assert flat.axis_names == ("dp", "sp") and flat.shape == (2, 4)
    assert ringed.axis_names == ("dp", "ring", "sp") and ringed.shape == (2, 2, 2)
    assert flat.describe() == "dp=2 x sp=4"
    assert ringed.describe() == "dp=2 x ring=2 x sp=2"
    flat.check_world(8)
    with pytest.raises(ValueError, match="world size is 4"):
        flat.check_world(4)


def test_the_trainer_resolves_the_degrees_once_and_keeps_them():
    """validate() builds the one ParallelDims and keeps it in the resolved configuration
    (``parallel_dims``, what ``cfg.dims()`` returns); a configuration that was never
    validated has none (nothing rebuilds it behind validate's back)."""
    from dtensor_ulysses.train import TrainConfig, validate

    raw = TrainConfig(dp=2, seq_len=64, batch_size=2, steps=1, device="cpu")
    with pytest.raises(AssertionError, match="validate"):
        raw.dims()
    cfg = validate(raw, 4)
    assert cfg.parallel_dims == ParallelDims(2, 1, 2) and cfg.sp == 2
    assert cfg.dims() is cfg.parallel_dims
    assert raw.parallel_dims is None  # the caller's configuration is left as it was
