"""``hf.UlyssesAccelerator``: a stock ``accelerate`` loop with the door equals the same loop under
the stock ``Accelerator`` at the same data parallelism.

The loop (:mod:`tests.hf.accelerate_workers`): a tiny local Llama (a Mixtral for the router
loss), AdamW and a warmup/decay schedule built before ``prepare``, 3 optimizer steps of 2
accumulated micro-batches of rows with right padding, masked prompts and packed documents
(uneven over sp = 2 and 4), ``clip_grad_norm_``, evaluation with ``gather_for_metrics`` on a
set whose last batch is short, ``save_state`` after step 2. The stock loop at dp = 1 runs in
this process. ``accelerate launch --config_file`` (FSDP2 and ``parallelism_config_cp_size: 2``,
as accelerate configures its own context parallelism) starts 2 CPU processes that run the
stock loop at dp = 2, then the door at (dp, sp) = (1, 2) with the degree from that config
(straight, resumed from its checkpoint, Mixtral, a LoRA adapter added with peft before
``prepare``, straight and resumed). One 4-rank world runs the door at (2, 2)
(straight, resumed) and at (1, 4) (the degree as a ``ParallelismConfig``'s ``cp_size``, the
loss over a token count gathered by hand as accelerate documents, no attention mask), and
examples/accelerate_loop.py. Compared at rtol 1e-5: every micro-batch loss of every rank
against the stock process of its dp group, every gradient norm, learning rate and evaluation
metric (the held-out loss, the gathered logits of real tokens and labels), every full gradient
before clipping, the final weights (``get_state_dict``, and ``unwrap_model(...).save_pretrained``
read back by ``from_pretrained``). Also: the door's collectives and its refusals (in this
process, at ``prepare`` and in the forward).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import accelerate_workers as A  # noqa: E402
from tests.hf import family_workers as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_accelerate")
    return {
        "root": root,
        "llama": str(W.save_model("llama", root / "llama")),
        "moe": F.save_family("mixtral", root / "mixtral"),
    }


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


@pytest.fixture(scope="module")
def stock1(assets):
    """The stock loop on one process (this one), and examples/accelerate_loop.py --stock."""
    torch.set_num_threads(1)
    out = {}
    try:
        root = assets["root"]
        lora = dict(lora=True, final=str(root / "final_lora_stock"), save_at=2,
                    ckpt=str(root / "ck1_lora_stock"))  # fmt: skip
        for name, kw in {"plain": {}, "tokens": {"tokens": True}, "moe": {}, "lora": lora}.items():
            model = assets["moe" if name == "moe" else "llama"]
            out[name] = A.run(dict(model=model, per_device=2, eval_at=(2, 3), **kw))
            _reset_accelerate()
        out["example"] = A.run_example(["--stock", "--steps", "2", "--out",
                                        str(assets["root"] / "example_stock")])  # fmt: skip
    finally:
        _reset_accelerate()
    return out


CONFIG = (  # accelerate's FSDP2 context parallelism on 2 processes: cp_size is the Ulysses degree
    "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
    "fsdp_config:\n  fsdp_version: 2\n"
    "parallelism_config:\n  parallelism_config_cp_size: 2\n"
    "num_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\n"
)


@pytest.fixture(scope="module")
def world2(assets):
    """2 processes started by ``accelerate launch --config_file`` (FSDP2 and
    ``parallelism_config_cp_size: 2``, on CPU): the stock loop at dp = 2 (a plain multi-process
    accelerator), then the door at (1, 2) with the degree from the config: straight (checkpoint
    after step 2, save_pretrained at the end), resumed, Mixtral, a LoRA model straight and
    resumed; then the collectives and refusals."""
    root, llama = assets["root"], assets["llama"]
    door = dict(door=True, model=llama, per_device=2)
    lora = dict(door, lora=True, eval_at=(3,), save_at=2)
    specs = [
        dict(model=llama, per_device=1, eval_at=(2, 3)),
        dict(door, eval_at=(2, 3), save_at=2, ckpt=str(root / "ck12"), final=str(root / "final")),
        dict(door, eval_at=(3,), save_at=2, resume=str(root / "ck12")),
        dict(door, model=assets["moe"], eval_at=(2, 3)),
        dict(lora, ckpt=str(root / "ck12_lora"), final=str(root / "final_lora")),
        dict(lora, resume=str(root / "ck12_lora")),
        dict(probe=True, model=llama),
    ]
    (root / "specs2.json").write_text(json.dumps(specs))
    (root / "cp2.yaml").write_text(CONFIG)
    out = root / "world2"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with socket.socket() as free:  # not accelerate's default 29500: another job may hold it
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(root / "cp2.yaml"), "--main_process_port", port, str(Path(A.__file__)),
         str(root / "specs2.json"), str(out)],
        capture_output=True, text=True, env=env, cwd=root, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "mesh dp=1 x sp=2 (2 processes, cpu; the degree from parallelism_config cp_size)" in (
        run.stdout
    )
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {
        "stock": [r[0] for r in res],
        "u12": [r[1] for r in res],
        "u12_resumed": [r[2] for r in res],
        "u12_moe": [r[3] for r in res],
        "u12_lora": [r[4] for r in res],
        "u12_lora_resumed": [r[5] for r in res],
        "probe": res[0][6],
        "stdout": run.stdout,
    }


@pytest.fixture(scope="module")
def world4(assets):
    """4 ranks: the door at (2, 2) straight and resumed, at (1, 4) from a ParallelismConfig's
    cp_size, and examples/accelerate_loop.py at sp = 4."""
    root, llama = assets["root"], assets["llama"]
    door = dict(door=True, sp=2, model=llama, per_device=1)
    specs = [
        dict(door, eval_at=(2, 3), save_at=2, ckpt=str(root / "ck22")),
        dict(door, eval_at=(3,), save_at=2, resume=str(root / "ck22")),
        dict(door=True, cp=4, model=llama, per_device=2, eval_at=(2, 3), tokens=True),
        dict(example=["--sp", "4", "--steps", "2", "--out", str(root / "example")]),
    ]
    res = run_local_world(A.run_specs, 4, specs, timeout_s=400)
    return {"u22": [r[0] for r in res], "u22_resumed": [r[1] for r in res],
            "u14": [r[2] for r in res], "example": res[0][3]}  # fmt: skip


def _close(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), (what, a, b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=RTOL, abs=1e-7), (what, a, b)


def _equal(got: dict, ref: dict, *, first_step: int = 0) -> None:
    """``got`` (a door rank, possibly resumed after ``first_step`` steps) against ``ref`` (the
    stock process of its dp group)."""
    micro = first_step * A.GA
    _close(got["loss"], ref["loss"][micro:], "loss")
    for key in ("norm", "lr"):
        _close(got[key], ref[key][first_step:], key)
    if "aux" in ref:
        _close(got["aux"], ref["aux"][micro:], "router loss")
    if "count" in ref:  # accelerator.gather over the dp ranks: the stock loop's token count
        assert got["count"] == ref["count"][micro:]
    grads = ref["grads"][first_step:]
    assert len(got["grads"]) == len(grads) == A.STEPS - first_step
    for step, (g, r) in enumerate(zip(got["grads"], grads)):
        assert g.keys() == r.keys()
        for name in r:
            x, y = torch.tensor(g[name]), torch.tensor(r[name])
            assert (x - y).abs().max() <= RTOL * y.abs().max() + 1e-8, (step, name)
    evals = ref["eval"][-len(got["eval"]) :]
    assert len(got["eval"]) >= 1 and len(evals) == len(got["eval"])
    for g, r in zip(got["eval"], evals):
        assert g["rows"] == r["rows"] == A.EVAL_ROWS and g["label_sum"] == r["label_sum"]
        for key in ("loss", "logit_abs", "accuracy"):
            assert g[key] == pytest.approx(r[key], rel=RTOL, abs=1e-6), (key, g, r)
        # a sum of ~10^4 logits of both signs: to float32 rounding of their magnitudes
        assert abs(g["logit_sum"] - r["logit_sum"]) <= RTOL * r["logit_abs"], (g, r)
    if "weights" in got:
        assert got["weights"].keys() == ref["weights"].keys()
        for name, w in ref["weights"].items():
            diff = (torch.tensor(got["weights"][name]) - torch.tensor(w)).abs().max()
            assert diff <= 1e-5, name


def test_dp1_sp2_equals_the_loop_on_one_process(stock1, world2):
    for rank in world2["u12"]:
        _equal(rank, stock1["plain"])
    assert "weights" in world2["u12"][0] and "weights" not in world2["u12"][1]


def test_dp2_sp2_equals_the_stock_loop_on_two_processes(world2, world4):
    stock = world2["stock"]
    assert stock[0]["loss"] != stock[1]["loss"]  # the two dp ranks see different rows
    for rank, got in enumerate(world4["u22"]):
        _equal(got, stock[rank // 2])  # ranks (0, 1) are dp group 0, (2, 3) dp group 1


def test_dp1_sp4_from_cp_size_with_a_hand_gathered_token_count(stock1, world4):
    for got in world4["u14"]:
        _equal(got, stock1["tokens"])


def test_save_state_and_load_state_resume_exactly(stock1, world2, world4):
    for got in world2["u12_resumed"]:
        _equal(got, stock1["plain"], first_step=2)
    for rank, got in enumerate(world4["u22_resumed"]):
        _equal(got, world2["stock"][rank // 2], first_step=2)


def test_mixture_of_experts_router_loss(stock1, world2):
    assert len(stock1["moe"]["aux"]) == A.STEPS * A.GA
    for got in world2["u12_moe"]:
        _equal(got, stock1["moe"])


def test_unwrap_model_save_pretrained_writes_the_full_weights(assets, stock1):
    from transformers import AutoModelForCausalLM

    final = Path(assets["root"]) / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ref = stock1["plain"]["weights"]
    state = model.state_dict()
    assert set(ref) <= set(state)
    for name, w in ref.items():
        assert (state[name].flatten() - torch.tensor(w)).abs().max() <= 1e-5, name


def test_lora_adapter_equals_the_loop_on_one_process(assets, stock1, world2):
    """A LoRA model (peft's ``get_peft_model`` before ``prepare``; its adapter initialized
    differently on each rank) at (1, 2): every loss, gradient norm, evaluation metric, the
    adapter's full gradients (nothing else has one) and the final weights equal the stock loop
    on one process, straight and resumed from ``save_state``; ``unwrap_model(model)
    .save_pretrained`` writes the adapter files the stock loop writes, and ``save_state`` the
    weights (base and adapter) it writes."""
    from safetensors.torch import load_file

    ref = stock1["lora"]
    assert all(".lora_" in name for name in ref["grads"][0]) and len(ref["grads"][0]) == 8
    for got in world2["u12_lora"]:
        _equal(got, ref)
    for got in world2["u12_lora_resumed"]:
        _equal(got, ref, first_step=2)
    # each rank drew its own adapter; prepare started every rank from rank 0's (8 tensors)
    assert "UlyssesAccelerator: 8 tensor(s) differed between ranks" in world2["stdout"]
    root = Path(assets["root"])
    door, stock = root / "final_lora", root / "final_lora_stock"
    assert sorted(p.name for p in door.iterdir()) == sorted(p.name for p in stock.iterdir())
    assert not (door / "model.safetensors").exists()  # the adapter only
    config = [json.loads((d / "adapter_config.json").read_text()) for d in (door, stock)]
    for c in config:  # peft keeps the target modules as a set: its order is the process's hash
        c["target_modules"] = sorted(c["target_modules"])
    assert config[0] == config[1]
    saved, expected = (load_file(str(d / "adapter_model.safetensors")) for d in (door, stock))
    assert saved.keys() == expected.keys() and len(saved) == 8
    for name, w in expected.items():
        assert (saved[name] - w).abs().max() <= 1e-5, name
    saved, expected = (load_file(str(root / d / "model.safetensors"))
                       for d in ("ck12_lora", "ck1_lora_stock"))  # fmt: skip
    assert saved.keys() == expected.keys() and any(".lora_" in k for k in saved)
    for name, w in expected.items():
        assert (saved[name] - w).abs().max() <= 1e-5, name


def test_collectives_of_a_training_and_an_evaluation_forward(world2):
    """At (1, 2), besides the engine's all-to-alls and FSDP2's gathers and reduce-scatters:
    one all-reduce of the loss (one float32), and in evaluation one all-gather of the logits
    (each rank's slice padded to the longest: ``B * ceil(S / sp) * V`` float32)."""
    probe = world2["probe"]
    assert tuple(probe["mesh"]) == ("dp", "sp")
    mine = {"all_reduce", "broadcast"}
    train = [tuple(c) for c in probe["train"] if c[0] in mine or c[1] == "allgather_"]
    assert train == [("all_reduce", "allreduce_", 4)], probe["train"]
    logits = 2 * (-(-A.S // 2)) * W.SMALL["vocab_size"] * 4
    evaluation = sorted(tuple(c) for c in probe["eval"] if c[0] in mine or c[1] == "allgather_")
    assert evaluation == [("all_gather", "allgather_", logits), ("all_reduce", "allreduce_", 4)]
    assert tuple(probe["logits_shape"]) == (2, A.S, W.SMALL["vocab_size"])


def test_prepare_and_forward_refusals(world2):
    r = world2["probe"]["refusals"]
    assert "['token_type_ids'] cannot be cut into sequence slices" in r["batch key"]
    assert "left padding" in r["left padding"] and "pad on the right" in r["left padding"]
    assert "last column" in r["shift_labels"] and "value=-100" in r["shift_labels"]
    assert "attention dropout" in r["dropout"] and "UnsupportedModelError" in r["dropout"]
    assert "LlamaForSequenceClassification" in r["classifier"]
    assert "dispatch_batches=False" in r["dispatch"]
    assert "prompt-learning adapter 'default' (PROMPT_TUNING)" in r["prompt tuning"]
    assert "LoRA" in r["prompt tuning"] and "UnsupportedModelError" in r["prompt tuning"]


@pytest.mark.parametrize(
    "kw, env, needles",
    [
        ({}, {"WORLD_SIZE": "2"}, ["needs the Ulysses degree", "cp_size=N"]),
        ({"sp": 2}, {}, ["needs a distributed launch: torchrun --nproc-per-node 2", "one process"]),
        ({"sp": 2}, {"ACCELERATE_MIXED_PRECISION": "no"},
         ["accelerate launch started one", "--multi_gpu"]),
        ({"sp": 3}, {"WORLD_SIZE": "4"}, ["sp=3 does not divide the 4 processes"]),
        ({"pc": dict(dp_shard_size=2, cp_size=2)}, {"WORLD_SIZE": "8"},
         ["dp_shard_size=2 x cp_size=2 = 4 processes", "started 8"]),
        ({"sp": 4, "pc": dict(cp_size=2)}, {"WORLD_SIZE": "4"},
         ["sp=4 and parallelism_config cp_size=2", "ring attention"]),
        ({"pc": dict(tp_size=2, dp_shard_size=2)}, {"WORLD_SIZE": "4"}, ["tp_size=2"]),
        ({"pc": dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2)}, {"WORLD_SIZE": "8"},
         ["dp_replicate_size=2", "dp_shard_size=4"]),
        ({"sp": 2}, {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, ["DeepSpeed"]),
        ({}, {"WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
              "PARALLELISM_CONFIG_SP_SIZE": "2"}, ["sp_size=2", "DeepSpeed sequence"]),
        ({"sp": 2, "fsdp": dict(fsdp_version=1)}, {"WORLD_SIZE": "2"}, ["fsdp_version=1"]),
        ({"sp": 2}, {"WORLD_SIZE": "2", "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"},
         ["dynamo_backend=INDUCTOR", "dynamo_backend='no'"]),
        ({"sp": 2, "fsdp": dict(fsdp_version=2, mixed_precision_policy="bf16")},
         {"WORLD_SIZE": "2"}, ["mixed_precision_policy", "mixed_precision='bf16'"]),
    ],
)  # fmt: skip
def test_construction_refusals(monkeypatch, kw, env, needles):
    """Refused in one line before any process group or accelerator state exists."""
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    from dtensor_ulysses.hf import UlyssesAccelerator

    for name in ("WORLD_SIZE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_DEEPSPEED",
                 "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_FSDP",
                 "ACCELERATE_DYNAMO_BACKEND"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kw = dict(kw)
    if "pc" in kw:
        kw["parallelism_config"] = ParallelismConfig(**kw.pop("pc"))
    if "fsdp" in kw:
        kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(**kw.pop("fsdp"))
    with pytest.raises(ValueError) as e:
        UlyssesAccelerator(**kw)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_example_equals_its_stock_run(stock1, world4):
    """examples/accelerate_loop.py at (1, 4) prints the losses and gradient norms of its
    ``--stock`` run on one process."""
    door = [line for line in world4["example"] if line.startswith("step ")]
    stock = [line for line in stock1["example"] if line.startswith("step ")]
    assert len(stock) == 2 and door == stock, (door, stock)
    assert any("mesh dp=1 x sp=4" in line for line in world4["example"])
