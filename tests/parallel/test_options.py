"""ParallelOptions alone, without a mesh: every rule between options, each message spelled for
its caller (``--flag`` for the trainer, ``keyword=`` for the Python doors) and naming the fix;
every front door reads the same fields (the trainer's flags, with_ulysses' options, the
preflight's and the tracer's memory features, the kernel names)."""

from __future__ import annotations

import dataclasses

import pytest

from dtensor_ulysses.plan import ATTENTION_BACKENDS, MEMORY_FEATURES, ParallelOptions

# (options, check's context, the flag message, the keyword message)
RULES = [
    (
        dict(offload_activations=True),
        {},
        r"^--offload-activations moves .* add --activation-checkpointing$",
        r"^offload_activations=True moves .* add activation_checkpointing=True$",
    ),
    (
        dict(activation_checkpointing=True, offload_activations=True, compile="inductor"),
        {},
        r"^--offload-activations with --compile inductor: .*drop one of them",
        r"^offload_activations=True with compile='inductor': .*drop one of them",
    ),
    (
        dict(offload_params=True, offload_optimizer=True),
        {},
        r"^--offload-params already keeps .* one of --offload-params and --offload-optimizer",
        r"^offload_params=True already keeps .* offload_params=True and offload_optimizer=True",
    ),
    (
        dict(loss_chunk_tokens=64),
        {},
        r"^--loss-chunk-tokens 64 needs --tiled-loss$",
        r"^loss_chunk_tokens=64 needs tiled_loss",
    ),
    (
        dict(tiled_mlp=True, mlp_chunk_tokens=0),
        {},
        r"^--mlp-chunk-tokens 0 is not a positive int",
        r"^mlp_chunk_tokens=0 is not a positive",
    ),
    (
        dict(tiled_loss=True, loss_chunk_tokens=300),
        dict(local_tokens=256),
        r"^--loss-chunk-tokens 300 must be between 1 and the 256 tokens a rank holds",
        r"^loss_chunk_tokens=300 must be between 1 and the 256 tokens",
    ),
    (dict(head_chunks=0), {}, r"^--head-chunks 0 must be >= 1", r"^head_chunks=0 must be >= 1"),
    (
        dict(compile="aot_eager"),
        dict(ring=2),
        r"^--compile aot_eager with ring=2: .*P2POp",
        r"^compile='aot_eager' with ring=2: .*P2POp",
    ),
    (
        dict(overlap_comm=True),
        dict(hf_model=True),
        r"^--overlap-comm applies to the built-in model only",
        r"^overlap_comm=True applies to the built-in model only",
    ),
    (
        dict(attention_backend="fast"),
        {},
        r"^--attention-backend fast is not a kernel; choose one of \['auto'",
        r"^attention_backend='fast' is not a kernel",
    ),
    (dict(), dict(n_heads=6, sp=4), r"--allow-uneven-heads", r"allow_uneven_heads=True"),
]


@pytest.mark.parametrize("options,context,flag,keyword", RULES)
def test_every_rule_is_refused_in_the_callers_spelling(options, context, flag, keyword):
    opts = ParallelOptions(**options)
    for spelling, pattern in (("flag", flag), ("keyword", keyword)):
        with pytest.raises(ValueError, match=pattern) as e:
            opts.check(spelling, **context)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "options,context",
    [
        (dict(), dict(n_heads=8, sp=4, ring=1, local_tokens=64)),
        (dict(activation_checkpointing=True, offload_activations=True), {}),
        (dict(tiled_loss=True, loss_chunk_tokens=256), dict(local_tokens=256)),
        (dict(offload_optimizer=True, head_chunks=2, overlap_comm=True, compile="inductor"), {}),
        (dict(allow_uneven_heads=True), dict(n_heads=6, sp=4)),
        (dict(attention_backend="blockwise"), dict(ring=2, hf_model=True)),
    ],
)
def test_combinations_that_run_pass(options, context):
    ParallelOptions(**options).check("flag", **context)
    ParallelOptions(**options).check("keyword", **context)


def test_unknown_options_name_the_valid_fields():
    with pytest.raises(ValueError, match=r"unknown with_ulysses option\(s\) \['tiled'\]; the "
                                         r"options are \['activation_checkpointing'"):  # fmt: skip
        ParallelOptions.from_options({"tiled": True}, door="with_ulysses")
    opts = ParallelOptions.from_options({"head_chunks": 2}, door="du.parallelize")
    assert opts == ParallelOptions(head_chunks=2)


def test_every_front_door_reads_the_same_fields():
    """The trainer's flags are ParallelOptions fields (TrainConfig.options() builds the type
    from them); with_ulysses' options, the preflight's and the tracer's memory features and
    the kernel names are the type's fields and names, not lists of their own."""
    pytest.importorskip("transformers")
    from dtensor_ulysses.attention import KERNELS
    from dtensor_ulysses.hf.trainers.wrap import OPTIONS
    from dtensor_ulysses.memtrace.trace import FEATURES
    from dtensor_ulysses.train import TrainConfig

    fields = set(ParallelOptions.fields())
    trainer = {f.name for f in dataclasses.fields(TrainConfig)}
    assert fields - {"mixed_precision"} <= trainer
    cfg = TrainConfig(activation_checkpointing=True, head_chunks=4, compile="aot_eager")
    assert cfg.options() == ParallelOptions(
        activation_checkpointing=True, head_chunks=4, compile="aot_eager"
    )
    assert set(OPTIONS) <= fields
    assert {k: v for k, v in OPTIONS.items() if k != "mixed_precision"} == {
        k: getattr(ParallelOptions(), k) for k in OPTIONS if k != "mixed_precision"
    }
    assert set(MEMORY_FEATURES) <= fields and set(FEATURES) <= set(MEMORY_FEATURES)
    assert set(ATTENTION_BACKENDS) >= {"auto", *KERNELS}


def test_the_options_module_is_torch_free():
    import subprocess
    import sys

    code = (
        "import sys; from dtensor_ulysses.plan import ParallelOptions; "
        "ParallelOptions(head_chunks=2).check('flag', n_heads=8, sp=2); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
