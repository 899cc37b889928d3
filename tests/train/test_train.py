"""Training equals single-device training: one step's loss and every gradient, then five steps of
losses, for (dp, sp) in {(1,2), (2,1), (1,4), (2,2)}; resume; the README's main job; bad input.

The reference is a plain single-process model with plain PyTorch (mean cross entropy, AdamW, the
warmup+cosine schedule and clipping written out here), on the same weights and global batch.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.data import PackedCorpus, get_batch
from dtensor_ulysses.launch import run_local_world
from dtensor_ulysses.models import build_model, init_weights
from tests import train_workers
from tests.processes import kill_trees
from tests.reference import reference_adamw

ROOT = Path(__file__).resolve().parents[2]
CFG = dict(model="tiny", seq_len=64, batch_size=4, seed=0, lr=3e-3, warmup_steps=2, decay_steps=8)
LAYOUTS = {2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2)]}


def _plain_model_and_optimizer():
    """The tiny model on CPU with the trainer's weights, and plain AdamW with its settings."""
    model = build_model(CFG["model"], device="cpu")
    init_weights(model, seed=CFG["seed"])
    opt = reference_adamw(model, CFG["lr"])
    return model, opt


def _reference(steps: int):
    """Plain single-device training: (step-1 loss, step-1 grads, losses of ``steps`` steps)."""
    first, losses, _ = reference_run(steps)
    return first[0], first[1], losses


def reference_run(steps: int, eval_corpus: PackedCorpus | None = None):
    """Plain single-device training: ``((step-1 loss, grads), losses, eval losses)``; with
    ``eval_corpus``, the held-out loss after every step: every full global batch of its windows
    in order (read here with ``PackedCorpus.windows``), one mean over all their tokens."""
    model, opt = _plain_model_and_optimizer()
    warm, horizon, floor = CFG["warmup_steps"], CFG["decay_steps"], 0.1

    def lr_at(step):
        if step < warm:
            return CFG["lr"] * (step + 1) / warm
        t = min(1.0, (step - warm) / (horizon - warm))
        return CFG["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))

    corpus = PackedCorpus.from_paths(None, seq_len=CFG["seq_len"])
    losses, first, evals = [], None, []
    for step in range(steps):
        b = get_batch(corpus, step, global_batch_size=CFG["batch_size"], dp_rank=0, dp=1,
                      sp_rank=0, sp=1, seed=CFG["seed"])  # fmt: skip
        logits = model(b.input_ids, b.position_ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.labels.reshape(-1))
        loss.backward()
        if first is None:
            first = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if eval_corpus is not None:
            evals.append(_reference_eval(model, eval_corpus))
    assert first is not None
    return first, losses, evals


@torch.no_grad()
def _reference_eval(model, corpus: PackedCorpus) -> float:
    G, S = CFG["batch_size"], CFG["seq_len"]
    total, count = 0.0, 0
    for k in range(len(corpus) // G):
        win = corpus.windows(list(range(k * G, (k + 1) * G)))
        logits = model(win[:, :-1], torch.arange(S).expand(G, S))
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                             win[:, 1:].reshape(-1), reduction="sum")  # fmt: skip
        total, count = total + ce.item(), count + G * S
    return total / count


@pytest.fixture(scope="module")
def reference():
    return _reference(5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_step_loss_and_every_gradient_equal_single_device(world_size, reference):
    ref_loss, ref_grads, _ = reference
    results = run_local_world(train_workers.one_step_grads, world_size, LAYOUTS[world_size], CFG)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            label = f"rank {rank} (dp, sp)={r['layout']}"
            assert r["stored"] and all(r["stored"]), f"{label}: not validate's kernel choice"
            assert abs(r["loss"] - ref_loss) < 1e-5, f"{label}: loss {r['loss']} vs {ref_loss}"
            assert set(r["grads"]) == set(ref_grads), f"{label}: parameter names differ"
            for name, g in r["grads"].items():
                torch.testing.assert_close(
                    g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} {name}: {m}"
                )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_five_steps_of_losses_equal_single_device(world_size, reference):
    _, _, ref_losses = reference
    runs = [dict(CFG, dp=dp, sp=sp, steps=5) for dp, sp in LAYOUTS[world_size]]
    results = run_local_world(train_workers.run_training, world_size, runs)
    for per_rank in results:
        for run, losses in zip(runs, per_rank):
            got = [loss for _, loss in losses]
            assert [s for s, _ in losses] == [1, 2, 3, 4, 5]
            for step, (a, b) in enumerate(zip(got, ref_losses), start=1):
                assert abs(a - b) < 1e-4, (
                    f"(dp, sp)=({run['dp']}, {run['sp']}) step {step}: {a} vs {b}"
                )


@pytest.mark.timeout(300)
def test_resume_equals_straight_run(tmp_path):
    """6 steps straight vs 3 steps, a new run resuming from the checkpoint for 3 more."""
    base = dict(CFG, dp=1, sp=2)
    runs = [
        dict(base, steps=6),
        dict(base, steps=3, checkpoint_dir=str(tmp_path / "ck")),
    ]
    straight, first_half = run_local_world(train_workers.run_training, 2, runs)[0]
    assert (tmp_path / "ck" / "step_00000003").is_dir()
    # a fresh world (new processes), as after a crash or a job boundary
    [second_half] = run_local_world(
        train_workers.run_training, 2, [dict(base, steps=6, checkpoint_dir=str(tmp_path / "ck"),
                                             resume=True)]
    )[0]  # fmt: skip
    assert [s for s, _ in first_half + second_half] == [1, 2, 3, 4, 5, 6]
    assert first_half + second_half == straight, "resumed losses differ from the straight run"


def _torchrun(args: list[str], nproc: int = 2, timeout: float = 240, **popen_kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "dtensor_ulysses.train", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT, **popen_kw)  # fmt: skip


@pytest.mark.timeout(400)
def test_kill_and_resume_with_torchrun(tmp_path):
    """SIGKILL a torchrun job once it has checkpointed; resuming gives the straight run's losses.

    Wherever the kill lands (mid-step or mid-save), the newest complete checkpoint is used.
    """
    common = ["--dp", "1", "--sp", "2", "--seq-len", "128", "--batch-size", "8", "--lr", "3e-3",
              "--warmup-steps", "2", "--decay-steps", "20"]  # fmt: skip
    total = 16
    straight = _torchrun([*common, "--steps", str(total), "--metrics-file",
                          str(tmp_path / "a.jsonl")])  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "dtensor_ulysses.train", *common, "--steps", "1000", "--checkpoint-every", "2",
           "--checkpoint-dir", str(ck)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while not (ck / "step_00000002").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    # torchrun starts each worker in a session of its own: kill the whole tree, as a crash would
    kill_trees([proc.pid])
    proc.wait(timeout=60)
    done = sorted(p.name for p in ck.iterdir() if not p.name.endswith(".tmp"))
    last = int(done[-1].removeprefix("step_"))
    assert last + 2 <= total, f"the kill came too late (checkpoints {done}); raise `total`"
    resumed = _torchrun([*common, "--steps", str(last + 2), "--resume", "--checkpoint-dir",
                         str(ck), "--metrics-file", str(tmp_path / "b.jsonl")])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def losses(path):
        return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}

    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(b) == [last + 1, last + 2], f"resumed steps {sorted(b)} after checkpoint {last}"
    for step in b:
        assert b[step] == a[step], f"step {step}: resumed {b[step]} vs straight {a[step]}"


@pytest.mark.timeout(400)
def test_readme_main_job_runs():
    """The torchrun part of the README's main set-up command, end to end on 2 CPU processes."""
    sys.path.insert(0, str(ROOT / ".ci"))
    from readme_command import commands

    main = commands((ROOT / "README.md").read_text())["main"]
    torchrun = main.split("&&")[-1].strip()
    assert torchrun.startswith("torchrun "), torchrun
    t0 = time.monotonic()
    res = subprocess.run(torchrun, shell=True, capture_output=True, text=True, timeout=360,
                         cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert time.monotonic() - t0 < 300, "the main job should take a few minutes at most"
    assert re.search(r"step \d+/\d+ \| loss", res.stdout), res.stdout[-2000:]


BAD = [
    (["--dp", "2", "--sp", "2"], 2, r"--dp 2 x --sp 2 = 4 but torchrun started 2 processes"),
    (["--sp", "2", "--seq-len", "63", "--strict-seq-len"], 2, r"--seq-len 63 is not divisible by sp=2; use a multiple of 2, e.g. 62 or 64"),
    (["--sp", "2", "--model", "tiny", "--seq-len", "64", "--batch-size", "2"], 3, r"--dp 1 x --sp 2 = 2 but torchrun started 3 processes"),
    (["--sp", "3", "--seq-len", "63"], 3, r"8 heads of model 'tiny' are not divisible by sp=3; choose sp in \{1, 2, 4, 8\} \(or pass --allow-uneven-heads"),
    (["--model", "gpt-9000"], 2, r"unknown model preset 'gpt-9000'; choose one of tiny, llama3-1b"),
    (["--resume", "--checkpoint-dir", "{tmp}/none"], 2, r"--resume: no checkpoint in .*; run once without --resume"),
    (["--data", "{tmp}/missing.txt"], 2, r"missing\.txt"),
    (["--data", "{tmp}/empty.txt"], 2, r"empty\.txt"),
    (["--batch-size", "3", "--dp", "2", "--sp", "1"], 2, r"--batch-size 3 \(global\) is not divisible by dp=2"),
]  # fmt: skip


@pytest.mark.timeout(600)
def test_bad_input_exits_with_one_message(tmp_path):
    """Every bad command line, each a real torchrun job (launched together to save time)."""
    (tmp_path / "empty.txt").write_text("")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = []
    for args, nproc, pattern in BAD:
        args = [a.replace("{tmp}", str(tmp_path)) for a in args]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "dtensor_ulysses.train",
            *args,
            "--steps",
            "1",
        ]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
        jobs.append((args, pattern, proc))
    for args, pattern, proc in jobs:
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{args}: still running after 300 s (a hang)")
        label = f"{args}: rc={proc.returncode}\n{stderr[-2000:]}"
        assert proc.returncode != 0, label
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, f"expected one message from rank 0; {label}"
        assert re.search(pattern, errors[0]), label
        assert "dtensor_ulysses/" not in stderr, f"a worker traceback leaked; {label}"


@pytest.mark.timeout(300)
def test_resume_with_another_model_shape_is_refused(tmp_path):
    ck = tmp_path / "ck"
    ok = _torchrun(["--seq-len", "64", "--batch-size", "2", "--steps", "1", "--checkpoint-dir",
                    str(ck)])  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    res = _torchrun(["--model", "llama3-1b", "--seq-len", "64", "--batch-size", "2", "--steps",
                     "2", "--resume", "--checkpoint-dir", str(ck)])  # fmt: skip
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "holds model 'tiny' but this run builds 'llama3-1b'" in errors[0]


def _per_document_reference(seq_len: int, steps: int) -> list[float]:
    """Plain single-device training where every packed document runs through the model *alone*
    (positions 0..n-1), so nothing can leak across documents; returns the per-step losses."""
    cfg = dict(CFG, seq_len=seq_len)
    model, opt = _plain_model_and_optimizer()
    corpus = PackedCorpus.from_paths(None, seq_len=seq_len)
    warm = cfg["warmup_steps"]
    losses = []
    for step in range(steps):
        b = get_batch(corpus, step, global_batch_size=cfg["batch_size"], dp_rank=0, dp=1,
                      sp_rank=0, sp=1, seed=cfg["seed"], pack_docs=True)  # fmt: skip
        total, count = 0.0, 0
        for row in range(b.input_ids.shape[0]):
            starts = (b.position_ids[row] == 0).nonzero().flatten().tolist()
            if not starts or starts[0] != 0:
                starts = [0, *starts]
            for lo, hi in zip(starts, starts[1:] + [seq_len]):
                ids = b.input_ids[row : row + 1, lo:hi]
                pos = torch.arange(hi - lo).reshape(1, -1)
                logits = model(ids, pos)
                total = total + F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), b.labels[row, lo:hi], reduction="sum"
                )
                count += hi - lo
        loss = total / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:  # warmup only: these steps stay below warmup_steps + 1
            group["lr"] = cfg["lr"] * min(1.0, (step + 1) / warm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pack_docs_with_odd_seq_len_equals_per_document_single_device(world_size):
    """--pack-docs and a prime --seq-len (uneven sp slices): the first losses equal a single
    device that runs each document on its own."""
    seq_len, steps = 61, 2
    ref = _per_document_reference(seq_len, steps)
    layouts = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}[world_size]
    runs = [dict(CFG, dp=dp, sp=sp, steps=steps, seq_len=seq_len, pack_docs=True)
            for dp, sp in layouts]  # fmt: skip
    results = run_local_world(train_workers.run_training, world_size, runs)
    for per_rank in results:
        for run, losses in zip(runs, per_rank):
            for (step, got), want in zip(losses, ref):
                assert abs(got - want) < 1e-4, (
                    f"{run['dp'], run['sp']} step {step}: {got} vs {want}"
                )


@pytest.mark.timeout(200)
def test_packed_step_needs_no_position_gather(tmp_path):
    """The step's layout carries the document starts, so packing costs no communication: the
    packed step issues exactly the collectives and bytes of the unpacked one (no position-id
    all-gather), and its all-to-alls are Ulysses' 2 per block forward and 2 backward."""
    from dtensor_ulysses.plan import get_shape

    n_layers = get_shape(CFG["model"]).n_layers
    data = tmp_path / "short_docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}: " + "ab" * (i % 7)}) + "\n"
                            for i in range(200)))  # fmt: skip
    cfg = dict(CFG, seq_len=61, pack_docs=True, data=[str(data)])
    for r in run_local_world(train_workers.packed_step_collectives, 2, cfg):
        assert r["docs"] > 1, "the window must hold several documents for this test to bite"
        assert r[True] == r[False], r
        assert r[True]["all_to_all"][0] == 4 * n_layers, r
