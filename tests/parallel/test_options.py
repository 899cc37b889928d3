"""ParallelOptions alone, without a mesh: every rule between options (the head stages against
the heads included), each message spelled for its caller (``--flag`` for the trainer,
``keyword=`` for the Python doors) and naming the fix; the object or its keywords at a door,
never both; every front door reads the same fields (the trainer's flags, with_ulysses'
options, the preflight's and the tracer's memory features, the kernel names), and the trainer
builds the object once and hands that one on."""

from __future__ import annotations

import dataclasses

import pytest

from dtensor_ulysses.plan import ATTENTION_BACKENDS, MEMORY_FEATURES, ParallelOptions
from dtensor_ulysses.plan.recipe import HF_PARALLELIZE, PARALLELIZE, TRAINER, WITH_ULYSSES

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
        r"^--attention-backend fast is not an attention kernel; choose one of \['auto'",
        r"^attention_backend='fast' is not an attention kernel",
    ),
    (dict(), dict(n_heads=6, sp=4), r"--allow-uneven-heads", r"allow_uneven_heads=True"),
    (
        dict(head_chunks=3),
        dict(n_heads=8, sp=2),
        r"^--head-chunks 3 does not divide the 4 q heads each of the sp=2 ranks holds; choose "
        r"head_chunks in \{1, 2, 4\}",
        r"^head_chunks=3 does not divide the 4 q heads",
    ),
    (
        dict(head_chunks=2, allow_uneven_heads=True),
        dict(n_heads=6, sp=4),
        r"^--head-chunks 2 needs sp=4 to divide the 6 q heads",
        r"^head_chunks=2 needs sp=4 to divide the 6 q heads",
    ),
    (
        dict(compile="inductor"),
        dict(hf_model=True),
        r"^--compile inductor applies to the built-in model only",
        r"^compile='inductor' applies to the built-in model only",
    ),
    (
        dict(tiled_mlp=True),
        dict(hf_model=True),
        r"^--tiled-mlp applies to the built-in model only",
        r"^tiled_mlp=True applies to the built-in model only",
    ),
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
        ParallelOptions.from_options({"tiled": True}, door=WITH_ULYSSES)
    opts = ParallelOptions.from_options({"head_chunks": 2}, door=PARALLELIZE)
    assert opts == ParallelOptions(head_chunks=2)
    # a door takes the names it applies: the loss's options are not du.parallelize's
    with pytest.raises(ValueError, match=r"unknown du.parallelize option\(s\) \['tiled_loss'\]"):
        ParallelOptions.from_options({"tiled_loss": True}, door=PARALLELIZE)


def test_a_door_takes_the_object_or_its_keywords_never_both():
    """``at_door``: the object as it is, or the keywords as one; both at once, a non-object,
    and (at a door that is the whole path, with_ulysses) a field the door does not apply are
    refused, each naming the fix."""
    opts = ParallelOptions(activation_checkpointing=True, head_chunks=2)
    assert ParallelOptions.at_door(opts, {}, door=PARALLELIZE) is opts
    assert ParallelOptions.at_door(None, {"head_chunks": 2}, door=HF_PARALLELIZE) == (
        ParallelOptions(head_chunks=2)
    )
    both = r"^with_ulysses: pass the options as a ParallelOptions or as keywords, not both "
    with pytest.raises(ValueError, match=both + r".*replace\(options, tiled_loss=\.\.\.\)$"):
        ParallelOptions.at_door(opts, {"tiled_loss": True}, door=WITH_ULYSSES)
    with pytest.raises(TypeError, match=r"takes its options as a .*ParallelOptions .* got dict"):
        ParallelOptions.at_door({"head_chunks": 2}, {}, door=PARALLELIZE)  # type: ignore[arg-type]
    whole = ParallelOptions(offload_optimizer=True, compile="aot_eager")
    with pytest.raises(ValueError, match=r"^with_ulysses does not apply offload_optimizer=True, "
                                         r"compile='aot_eager'; the options it applies are "
                                         r"\['activation_checkpointing'"):  # fmt: skip
        ParallelOptions.at_door(whole, {}, door=WITH_ULYSSES, whole=True)
    # a part of the path (du.parallelize in the trainer's spec) takes the whole recipe
    assert ParallelOptions.at_door(whole, {}, door=PARALLELIZE) is whole
    # compile=True is the default backend, False none (du.parallelize's old spellings)
    assert ParallelOptions(compile=True).compile == "inductor"
    assert ParallelOptions(compile=False).compile is None


def test_du_parallelize_takes_the_object_or_its_keywords_and_a_kernel_of_its_layer_kind():
    """The built-in model's door refuses both spellings at once and a keyword it does not
    apply before it touches the mesh (a stand-in here); a kernel chosen beforehand must be of
    the model's layer kind (what validate chooses for the trainer)."""
    from types import SimpleNamespace

    import torch

    import dtensor_ulysses as du
    from dtensor_ulysses.attention import AttnFeatures, choose_kernel
    from dtensor_ulysses.models import build_model
    from dtensor_ulysses.parallel.apply import _layer_choice

    model = build_model("tiny", device="meta")
    mesh = SimpleNamespace(mesh_dim_names=("dp", "sp"))  # refused before it is used
    both = r"^du.parallelize: pass the options as a ParallelOptions or as keywords, not both"
    with pytest.raises(ValueError, match=both + r".*replace\(options, head_chunks=\.\.\.\)$"):
        du.parallelize(model, mesh, ParallelOptions(), head_chunks=2)
    with pytest.raises(ValueError, match=r"^unknown du.parallelize option\(s\) \['tiled_loss'\]"):
        du.parallelize(model, mesh, tiled_loss=True)
    cpu = dict(device_type="cpu", dtype=torch.float32, head_dim=16)
    causal, window = AttnFeatures(), AttnFeatures(window=True)
    chosen = choose_kernel(causal, **cpu)
    assert _layer_choice(chosen, causal, ring=False, **cpu) is chosen  # stored as it is
    with pytest.raises(ValueError, match=r"kernel='sdpa' was chosen for 'causal' layers, but the "
                                         r"model has 'window' layers"):  # fmt: skip
        _layer_choice(chosen, window, ring=False, **cpu)
    with pytest.raises(ValueError, match=r"but the model has 'causal' layers in a ring"):
        _layer_choice(chosen, causal, ring=True, **cpu)


def test_every_front_door_reads_the_same_fields():
    """The trainer's flags are ParallelOptions fields (TrainConfig.options() builds the type
    from them); each door's keywords, the preflight's and the tracer's memory features and the
    kernel names are the type's fields and names, not lists of their own."""
    from dtensor_ulysses.attention import KERNELS
    from dtensor_ulysses.memtrace.trace import FEATURES
    from dtensor_ulysses.train import TrainConfig

    fields = set(ParallelOptions.fields())
    trainer = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(ParallelOptions.fields(TRAINER)) == fields - {"mixed_precision"} <= trainer
    cfg = TrainConfig(activation_checkpointing=True, head_chunks=4, compile="aot_eager")
    assert cfg.options() == ParallelOptions(
        activation_checkpointing=True, head_chunks=4, compile="aot_eager"
    )
    # what each Python door applies (its keywords): the model's recipe, then the loss's
    model = {"activation_checkpointing", "offload_activations", "offload_params", "head_chunks",
             "attention_backend", "allow_uneven_heads", "mixed_precision"}  # fmt: skip
    assert set(ParallelOptions.fields(HF_PARALLELIZE)) == model
    assert set(ParallelOptions.fields(PARALLELIZE)) == model | {"overlap_comm", "compile"}
    assert set(ParallelOptions.fields(WITH_ULYSSES)) == model | {"tiled_loss", "loss_chunk_tokens"}
    assert set(MEMORY_FEATURES) <= fields and set(FEATURES) <= set(MEMORY_FEATURES)
    assert set(ATTENTION_BACKENDS) >= {"auto", *KERNELS}


def test_the_trainer_builds_the_recipe_once_and_hands_it_on():
    """validate() builds the one ParallelOptions from the flags, checks it (the head stages
    against the model's heads too) and keeps it (``parallel_options``, what ``options()``
    returns from then on), with the built-in model's kernel choice; the caller's
    configuration is left as it was."""
    from dtensor_ulysses.attention import KernelChoice
    from dtensor_ulysses.train import TrainConfig, UsageError, validate

    raw = TrainConfig(dp=1, seq_len=64, batch_size=2, steps=1, device="cpu",
                      activation_checkpointing=True, head_chunks=2)  # fmt: skip
    cfg = validate(raw, 2)
    assert isinstance(cfg.parallel_options, ParallelOptions)
    assert cfg.options() is cfg.parallel_options == raw.options()
    assert isinstance(cfg.kernel_choice, KernelChoice) and cfg.kernel_choice.label == "causal"
    assert raw.parallel_options is None and raw.kernel_choice is None
    with pytest.raises(UsageError, match=r"^--head-chunks 3 does not divide the 4 q heads"):
        validate(TrainConfig(dp=1, seq_len=64, batch_size=2, steps=1, device="cpu",
                             head_chunks=3), 2)  # fmt: skip


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
