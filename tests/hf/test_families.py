"""Today's open model families under Ulysses equal the stock model on one process (issue 30).

For every family of the model table (docs/how-to/huggingface.md): a tiny random config with
its features on (a sliding window of 8 and a chunk of 6 on 19-token rows: shorter than the
sequence, the window longer than an sp=4 slice of 5; softcapping, sinks, the MoE router loss
with padding excluded), against the stock model with ``attn_implementation="eager"`` on the same
global batch:

* ``apply_ulysses`` (loss and every gradient) at (dp, sp) in {(1,2), (2,2), (1,4)}, on plain
  rows and on packed documents (each document run on its own, the router loss by the modeling
  file's own function over every document's tokens; Llama 4: the stock packed call, whose
  attention temperature counts rows of the packed row); gpt-oss with 6 q heads at sp=4
  (uneven heads: each rank gets the sinks of its own heads, no empty rank);
* ``with_ulysses(transformers.Trainer)``: three steps' logged losses (cross entropy plus the
  weighted router loss, as the stock model reports it) and gradient norms at (2,2) and (1,4)
  in one spawned world, and at (1,2) under ``torchrun`` (which also checks that a finished
  run exits 0: the process-group teardown); a MoE with gradient accumulation (the router loss
  per micro-batch, as the stock trainer computes it).

The features are checked to matter: without them the stock losses differ.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import family_workers as F  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-6)
RTOL = 1e-4
FAMILIES = F.FAMILIES
LAYOUTS = ((1, 2), (2, 2), (1, 4))
# the stock Trainer's batch: per device x dp = 4 rows; MoE accumulation: 2 x 2
GA = {"family": "mixtral", "batch": 2, "ga": 2}
# --hf-model (the same engine path as apply_ulysses, plus HFCausalLM's router loss and the
# loading): windows + sinks + router loss, windows + softcap, chunks + temperature. Mixtral,
# Qwen3-MoE and GLM-4-MoE (per-expert checkpoints): tests/hf/test_families_next.py.
HF_MODEL = ("gpt_oss", "gemma2", "llama4_text")


def _per_document(family: str) -> bool:
    return family != "llama4_text"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {f: F.save_family(f, root / f) for f in FAMILIES}
    # 6 q heads over sp=4: [2, 2, 1, 1] heads, each rank its own heads' sinks
    dirs["gpt_oss_uneven"] = F.save_family(
        "gpt_oss", root / "gpt_oss_uneven", num_attention_heads=6, num_key_value_heads=2
    )
    tok = root / "tok"
    W.make_tokenizer(tok, " ".join(T.TEXTS) * 5)
    return {"root": root, "dirs": dirs, "tok": str(tok)}


def _trainer_spec(assets, family: str, name: str, *, sp: int | None = None, dp: int = 1,
                  batch: int = 4, ga: int = 1) -> dict:  # fmt: skip
    return dict(kind="trainer", model=assets["dirs"][family], tok=assets["tok"], attn="eager",
                out=str(assets["root"] / name), sp=sp, batch=batch // dp, ga=ga)  # fmt: skip


def _cases(assets) -> list:
    d = assets["dirs"]
    cases = [(d[f], dp, sp, packed, {}) for f in FAMILIES for dp, sp in LAYOUTS
             for packed in (False, True)]  # fmt: skip
    cases.append((d["gpt_oss_uneven"], 1, 4, False, {"allow_uneven_heads": True}))
    return cases


@pytest.fixture(scope="module")
def world4(assets):
    """One 4-rank world: every apply_ulysses case, and the Trainer at (2,2) and (1,4)."""
    specs = [dict(_trainer_spec(assets, f, f"t_{f}_{dp}{sp}", sp=sp, dp=dp), capture_stdout=True)
             for f in FAMILIES for dp, sp in LAYOUTS[1:]]  # the start lines too  # fmt: skip
    specs.append(_trainer_spec(assets, GA["family"], "t_ga", sp=2, dp=2, batch=GA["batch"],
                               ga=GA["ga"]))  # fmt: skip
    dirs = {f: assets["dirs"][f] for f in HF_MODEL}
    jobs = [("cases", _cases(assets)), ("specs", specs), ("hf_model", (dirs, 2, 2)),
            ("refusal", (assets["dirs"]["mistral"], "sdpa"))]  # fmt: skip
    cases, runs, hf_model, refused = run_local_world(F.run_jobs, 4, jobs, timeout_s=600)[0]
    out = {"apply": {}, "trainer": {}, "hf_model": hf_model, "refused": refused}
    for (model_dir, dp, sp, packed, _), r in zip(_cases(assets), cases):
        out["apply"][(os.path.basename(model_dir), dp, sp, packed)] = r
    for spec, r in zip(specs, runs):
        out["trainer"][os.path.basename(spec["out"])] = r
    return out


@pytest.mark.timeout(600)
def test_start_lines_name_the_kernel_each_layer_kind_runs(world4):
    """with_ulysses' start line names, per layer kind, the kernel that runs on CPU: a family
    whose layers have windows, sinks, a softcap or chunks runs them in the exact blockwise
    kernel (SDPA runs none of them); gpt-oss (sinks on every layer) never says sdpa."""
    exact_only = {"window", "sinks", "softcap", "chunk"}
    for family in FAMILIES:
        [line] = world4["trainer"][f"t_{family}_22"]["stdout"].splitlines()
        kernels = line.split("attention kernel ")[1].split(", fp32 compute")[0]
        if exact_only & set(F.FEATURES[family]):
            assert "blockwise" in kernels, (family, line)
        else:
            assert kernels == "sdpa", (family, line)
    gpt_oss = world4["trainer"]["t_gpt_oss_22"]["stdout"]
    assert "sdpa" not in gpt_oss and "(window, sinks)" in gpt_oss, gpt_oss


@pytest.fixture(scope="module")
def torchrun2(assets):
    """The Trainer at (1,2) under torchrun, ending as a user's script ends: two launches (half
    of the families each), so a finished run is seen to exit 0 more than once."""
    launches = []
    for i, families in enumerate((FAMILIES[:5], FAMILIES[5:])):
        specs = [_trainer_spec(assets, f, f"t_{f}_12", sp=2) for f in families]
        spec_file = assets["root"] / f"specs12_{i}.json"
        spec_file.write_text(json.dumps(specs))
        out = assets["root"] / f"results12_{i}.pkl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "tests.hf.family_workers", str(spec_file), str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        runs = pickle.loads(out.read_bytes()) if out.is_file() else [None] * len(families)
        launches.append({"rc": proc.returncode, "stderr": proc.stderr[-4000:]})
        launches[-1]["runs"] = dict(zip(families, runs))
    return launches


@pytest.fixture(scope="module")
def refs(assets):
    """The stock model (eager attention) on this process."""
    d = assets["dirs"]
    apply = {
        (f, packed): F.reference(d[f], packed, per_document=_per_document(f))
        for f in FAMILIES
        for packed in (False, True)
    }
    apply[("gpt_oss_uneven", False)] = F.reference(d["gpt_oss_uneven"], False)
    trainer = {f: T.run(_trainer_spec(assets, f, f"ref_{f}")) for f in FAMILIES}
    trainer["ga"] = T.run(_trainer_spec(assets, GA["family"], "ref_ga", batch=GA["batch"],
                                        ga=GA["ga"]))  # fmt: skip
    return {"apply": apply, "trainer": trainer}


def _check(got: dict, ref: dict) -> None:
    assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, **TOL, msg=name)


def _close(got: dict, ref: dict) -> None:
    for k in ("loss", "grad_norm"):
        assert len(got[k]) == len(ref[k]) == 3, (k, got[k], ref[k])
        assert got[k] == pytest.approx(ref[k], rel=RTOL), (k, got[k], ref[k])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"dp{t[0]}sp{t[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_apply_ulysses_equals_stock_eager(world4, refs, family, layout, packed):
    _check(world4["apply"][(family, *layout, packed)], refs["apply"][(family, packed)])


@pytest.mark.timeout(900)
def test_uneven_heads_cut_sinks_per_rank(world4, refs):
    """gpt-oss, 6 q heads on sp=4 with allow_uneven_heads: the sinks' gradients included."""
    got = world4["apply"][("gpt_oss_uneven", 1, 4, False)]
    _check(got, refs["apply"][("gpt_oss_uneven", False)])
    sinks = [n for n in got["grads"] if n.endswith("sinks")]
    assert sinks and all(got["grads"][n].abs().min() > 0 for n in sinks)  # every head's sink


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda t: f"dp{t[0]}sp{t[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_equals_stock_eager(world4, refs, family, layout):
    _close(world4["trainer"][f"t_{family}_{layout[0]}{layout[1]}"], refs["trainer"][family])


@pytest.mark.timeout(900)
def test_trainer_router_loss_with_accumulation(world4, refs):
    """Mixtral at (2,2), 1 row per device x 2 accumulation steps == one process, 2 rows x 2:
    the router loss of each micro-batch over its rows on every rank."""
    _close(world4["trainer"]["t_ga"], refs["trainer"]["ga"])


@pytest.mark.timeout(900)
def test_finished_torchrun_runs_exit_0(torchrun2):
    """Each launch ends with status 0 and no rank aborts at exit (the process-group teardown)."""
    for launch in torchrun2:
        assert launch["rc"] == 0, launch["stderr"]
        assert "terminate called" not in launch["stderr"], launch["stderr"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_sp2_equals_stock_eager(torchrun2, refs, family):
    got = next(launch["runs"][family] for launch in torchrun2 if family in launch["runs"])
    _close(got, refs["trainer"][family])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", HF_MODEL)
def test_hf_model_trainer_equals_stock_eager(world4, refs, family):
    """The trainer's ``--hf-model`` build (HFCausalLM, FSDP2) at (2,2): step-1 loss (with the
    router loss where the stock model adds one) and every gradient."""
    got = world4["hf_model"][(family, 2, 2)]
    _check({"loss": got["losses"][0], "grads": got["grads"]}, refs["apply"][(family, False)])


@pytest.mark.timeout(900)
def test_backend_that_cannot_run_a_window_is_refused_before_step_1(world4):
    """``backend="sdpa"`` for Mistral's windowed layers: refused in apply_ulysses, naming the
    layer, the feature and the kernel's reason."""
    msg = world4["refused"]
    assert "model.layers.0.self_attn (MistralAttention, sliding_window=8)" in msg, msg
    assert "sliding window" in msg, msg


def _differs(a: dict, b: dict) -> bool:
    """Some gradient differs beyond the tolerance of the equality tests."""
    return any(not torch.allclose(g, b["grads"][n], **TOL) for n, g in a["grads"].items())


@pytest.mark.timeout(300)
def test_features_matter(assets, refs):
    """Each feature changes the stock gradients beyond the tolerance (so the equalities above
    can fail): the window, the chunk, Llama 4's temperature, the softcap, the router loss and
    the sinks turned off, one at a time, on the same weights."""
    from transformers import AutoModelForCausalLM

    root = assets["root"]
    off = {
        ("mistral", "sliding_window"): None,
        ("llama4_text", "attention_chunk_size"): None,
        ("llama4_text", "attn_temperature_tuning"): False,
        ("gemma2", "attn_logit_softcapping"): None,
        ("mixtral", "output_router_logits"): False,
    }
    for (family, key), value in off.items():
        d = F.save_family(family, root / f"off_{family}_{key}", **{key: value})
        assert _differs(F.reference(d, False), refs["apply"][(family, False)]), (family, key)
    model = AutoModelForCausalLM.from_pretrained(assets["dirs"]["gpt_oss"], dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-30.0)  # exp(sink) ~ 0: no sink
    model.save_pretrained(root / "off_sinks")
    assert _differs(F.reference(str(root / "off_sinks"), False), refs["apply"][("gpt_oss", False)])
