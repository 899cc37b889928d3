"""Checkpoints that never run code and never load silently damaged (issue: trust).

* Every gadget of ``tests/train/gadgets.py`` (each first shown to run under plain ``pickle``
  where it can) planted in every file a resume reads (``.metadata``, ``trainer.pt``, an RNG
  file, a non-tensor and a tensor item inside a ``.distcp`` file), with the manifest resealed as
  an attacker would: ``verify`` (what ``--resume`` checks before building anything) or ``load``
  refuses it, the payload never runs, and the intact checkpoint still loads exactly.
* The manifest: a byte changed in a tensor, a file added, removed or resized, a bad manifest,
  each found; a checkpoint without one (an older version's) still loads.
* A real 2-rank run: a checkpoint directory whose newer checkpoints are each damaged another
  way (gadgets, a truncated and a byte-flipped ``.distcp``, a bad manifest, an item DCP itself
  fails to read): ``--resume`` prints one ``warning:`` line per damaged checkpoint, resumes from
  the older intact one and equals the straight run; with none left, one ``error:`` line.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from dtensor_ulysses.train import checkpoint as ckpt
from dtensor_ulysses.train import manifest
from tests.train import gadgets
from tests.train.test_faults import TINY, _env, _run_all, _tiny_checkpoint, _warnings


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _fresh():
    from dtensor_ulysses.models import build_model

    model = build_model("tiny", device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_gadget_in_every_file_a_resume_reads_is_refused(tmp_path):
    import pickle

    good = _tiny_checkpoint(tmp_path / "good")
    marker = tmp_path / "payload-ran"
    for name, (make, runs) in gadgets.GADGETS.items():  # each gadget is real
        if runs:
            with gadgets.with_extension():
                pickle.loads(make(str(marker)))
            for _ in range(50):  # copyreg's gadget starts a process
                if marker.exists():
                    break
                time.sleep(0.1)
            assert marker.is_dir(), f"{name}: the gadget does not run under plain pickle"
            marker.rmdir()
    model, opt, sched = _fresh()
    refused = {}
    with gadgets.with_extension():  # the EXT gadget finds its registry entry
        for where in gadgets.FILES:
            for name, (make, _) in gadgets.GADGETS.items():
                bad = tmp_path / f"{where}-{name}" / good.name
                shutil.copytree(good, bad)
                gadgets.plant(bad, where, make(str(marker)))
                problem = ckpt.verify(bad)
                if problem is None:  # the .distcp items are read only when loading
                    assert where.startswith("distcp"), (where, name)
                    with pytest.raises(ckpt.DamagedCheckpoint) as info:
                        ckpt.load(bad, model, opt, sched)
                    problem = str(info.value)
                refused[(where, name)] = problem
                assert not marker.exists(), f"{name} planted in {where} ran"
    assert len(refused) == len(gadgets.FILES) * len(gadgets.GADGETS)
    for (where, name), problem in refused.items():
        if where in (".metadata", "trainer.pt", "rng_rank0.pt"):
            assert problem.startswith(where), (where, name, problem)
    # after all those partial loads, the intact checkpoint loads exactly what was saved
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    want = _fresh()
    ckpt.load(good, *want)
    assert ckpt.load(good, model, opt, sched)["step"] == 7
    a, b = get_model_state_dict(model), get_model_state_dict(want[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_manifest_finds_changed_added_and_missing_bytes(tmp_path):
    good = _tiny_checkpoint(tmp_path / "good")
    files = manifest.read(good)
    assert files is not None and set(files) == {".metadata", "__0_0.distcp", "trainer.pt",
                                                 "rng_rank0.pt"}  # fmt: skip
    assert manifest.check(good, files) is None

    def case(name: str, damage) -> str | None:
        bad = tmp_path / name / good.name
        shutil.copytree(good, bad)
        damage(bad)
        problem = ckpt.verify(bad)
        if problem is None:
            model, opt, sched = _fresh()
            with pytest.raises(ckpt.DamagedCheckpoint) as info:
                ckpt.load(bad, model, opt, sched)
            problem = str(info.value)
        return problem

    def flip(bad: Path) -> None:  # 64 bytes overwritten inside the last tensor's data
        md = ckpt.read_dcp_metadata(bad)
        info = max(md.storage_data.values(), key=lambda i: i.offset)
        f = bad / info.relative_path
        data = bytearray(f.read_bytes())
        at = info.offset + info.length - 200
        data[at : at + 64] = b"\xff" * 64
        f.write_bytes(bytes(data))

    problem = case("flip", flip)
    assert "__0_0.distcp does not match its checksum" in problem, problem
    problem = case("added", lambda d: (d / "extra.pt").write_bytes(b"x"))
    assert "extra.pt is not listed in manifest.json" in problem, problem
    problem = case("bad-json", lambda d: (d / manifest.MANIFEST).write_text("{"))
    assert problem == "manifest.json cannot be read (JSONDecodeError)", problem
    problem = case("other-version", lambda d: (d / manifest.MANIFEST).write_text(
        json.dumps({"version": 99, "files": {}})))  # fmt: skip
    assert "not a manifest this version wrote" in problem, problem

    def grow(bad: Path) -> None:
        with (bad / "trainer.pt").open("ab") as f:
            f.write(b"\0")

    assert "trainer.pt has" in (case("grow", grow) or "")
    # an older version's checkpoint (no manifest) still verifies and loads
    old = tmp_path / "old" / good.name
    shutil.copytree(good, old)
    (old / manifest.MANIFEST).unlink()
    assert ckpt.verify(old) is None
    assert ckpt.load(old, *_fresh())["step"] == 7


def _rewrite_step(step_dir: Path, step: int) -> None:
    trainer = torch.load(step_dir / "trainer.pt", weights_only=True)
    torch.save(dict(trainer, step=step), step_dir / "trainer.pt")
    gadgets.reseal(step_dir)


def _flip_tensor(step_dir: Path, rank: int, at_header: bool) -> None:
    """Overwrite 64 bytes of the last tensor item of rank ``rank``'s ``.distcp``: inside its
    data, or in its zip header (which DCP itself then fails to read)."""
    md = ckpt.read_dcp_metadata(step_dir)
    rel = f"__{rank}_0.distcp"
    info = max((i for i in md.storage_data.values() if i.relative_path == rel),
               key=lambda i: i.offset)  # fmt: skip
    f = step_dir / rel
    data = bytearray(f.read_bytes())
    at = info.offset + 2 if at_header else info.offset + info.length - 200
    data[at : at + 64] = b"\x07" * 64
    f.write_bytes(bytes(data))


@pytest.mark.timeout(500)
def test_resume_skips_each_damaged_checkpoint_and_equals_the_straight_run(tmp_path):
    straight = tmp_path / "straight"
    args = ["--steps", "12", "--checkpoint-every", "2", "--checkpoint-dir", str(straight)]
    [res] = _run_all([([*TINY, *args, "--metrics-file", str(tmp_path / "a.jsonl")], _env())])
    assert res.returncode == 0, res.stderr[-3000:]
    a = _losses(tmp_path / "a.jsonl")
    base = straight / "step_00000004"
    marker = tmp_path / "payload-ran"
    root = tmp_path / "root"
    shutil.copytree(straight / "step_00000002", root / "step_00000002")

    def damaged(step: int, where: Path = root) -> Path:
        d = where / f"step_{step:08d}"
        shutil.copytree(base, d)
        _rewrite_step(d, step)
        return d

    _flip_tensor(damaged(11), 1, at_header=False)  # found by the checksums, in load
    d = damaged(10)
    f = d / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated: verify
    (damaged(9) / manifest.MANIFEST).write_text("[]")
    d = damaged(8)
    (d / manifest.MANIFEST).unlink()  # an old checkpoint whose item DCP fails to read
    _flip_tensor(d, 0, at_header=True)
    planted = {7: (".metadata", "build-setstate"), 6: ("trainer.pt", "operator-getters"),
               5: ("rng_rank0.pt", "dotted-name"), 4: ("distcp-bytes-item", "nested-pickle"),
               3: ("distcp-tensor-item", "builtins-getattr")}  # fmt: skip
    for step, (where, name) in planted.items():
        gadgets.plant(damaged(step), where, gadgets.GADGETS[name][0](str(marker)))
    [resumed] = _run_all([([*TINY, "--steps", "12", "--resume", "--checkpoint-dir", str(root),
                            "--metrics-file", str(tmp_path / "b.jsonl")], _env())])  # fmt: skip
    label = f"rc={resumed.returncode}\n{resumed.stderr[-4000:]}"
    assert resumed.returncode == 0, label
    assert not marker.exists(), "a planted payload ran"
    good = root / "step_00000002"
    assert f"resumed from {good}" in resumed.stdout, resumed.stdout[-2000:]
    warnings = _warnings(resumed.stderr)
    damaged_steps = [11, 10, 9, 8, *planted]
    for step in damaged_steps:
        mine = [w for w in warnings if f"checkpoint {root / f'step_{step:08d}'} is damaged" in w]
        assert len(mine) == 1, (step, label)
        assert re.search(rf"resuming from {root}/step_\d{{8}} instead$", mine[0]), mine[0]
    chain = [w for w in warnings if " is damaged " in w]  # each names the next one tried
    assert chain[-1].endswith(f"resuming from {good} instead"), chain
    old = [w for w in warnings if "has no manifest.json" in w]
    assert len(old) == 1 and "step_00000008" in old[0], warnings
    assert len(warnings) == len(damaged_steps) + 1, warnings
    assert "Traceback" not in resumed.stderr and "CheckpointException" not in resumed.stderr
    b = _losses(tmp_path / "b.jsonl")
    assert sorted(b) == list(range(3, 13)) and b == {s: a[s] for s in b}, (a, b)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_damage_found_while_loading_with_nothing_older_is_one_error(tmp_path, capsys):
    """The load-time path alone (one process): the only checkpoint's bytes changed, so verify()
    passes and the manifest check in load() fails; no older one: one ``error:`` line (a
    UsageError), naming the checkpoint, the file and what to do."""
    from dtensor_ulysses.train.cli import TrainConfig, UsageError
    from dtensor_ulysses.train.resume import load_checkpoint

    good = _tiny_checkpoint(tmp_path / "ck")
    _flip_tensor(good, 0, at_header=False)
    assert ckpt.verify(good) is None  # sizes intact: only the checksums see it
    cfg = TrainConfig(checkpoint_dir=str(tmp_path / "ck"), resume=True)
    with pytest.raises(UsageError) as info:
        load_checkpoint(cfg, good, *_fresh())
    size = (good / "__0_0.distcp").stat().st_size  # one chunk: the range is the whole file
    assert size < manifest.CHUNK_BYTES
    assert re.fullmatch(
        rf"--resume: checkpoint {good} is damaged \(__0_0\.distcp does not match its checksum "
        rf"\(bytes 0 to {size} of its {size} changed since it was written\)\) and no older "
        r"intact checkpoint is left in '.*'\. Restore it from a copy, or delete the damaged "
        r"directories to start over without --resume",
        str(info.value),
    ), str(info.value)


def test_a_checksum_mismatch_names_the_changed_bytes_of_the_file(tmp_path, monkeypatch):
    """The range in the message is the changed chunk's, cut at the end of the file: chunks of
    1000 bytes (the constant patched), a file of 2500 bytes, one byte changed in each chunk."""
    monkeypatch.setattr(manifest, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(manifest, "_READ_BYTES", 300)
    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(250)) * 10)
    files = manifest.checksum(tmp_path, ["x.bin"])
    assert files["x.bin"]["size"] == 2500 and len(files["x.bin"]["crc32"]) == 3
    for at, (lo, hi) in ((10, (0, 1000)), (1500, (1000, 2000)), (2499, (2000, 2500))):
        data = bytearray(f.read_bytes())
        data[at] ^= 0xFF
        f.write_bytes(bytes(data))
        assert manifest.check(tmp_path, files) == (
            f"x.bin does not match its checksum (bytes {lo} to {hi} of its 2500 changed since "
            f"it was written)"
        )
        data[at] ^= 0xFF
        f.write_bytes(bytes(data))
    assert manifest.check(tmp_path, files) is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_non_finite_hint_never_calls_a_checkpoint_intact(tmp_path):
    """A checkpoint changed and resealed passes every check, loads, and may be what makes the
    next step non-finite: the stop's hint names it as the newest checkpoint that passes its
    checks and, when this run started from it, says so and how to take an older one."""
    from dtensor_ulysses.train.cli import TrainConfig
    from dtensor_ulysses.train.guard import NonFiniteStep, RunGuard

    good = _tiny_checkpoint(tmp_path / "ck")
    data = bytearray((good / "__0_0.distcp").read_bytes())
    data[-300:-236] = b"\x07" * 64  # bytes of a tensor changed, then the manifest resealed
    (good / "__0_0.distcp").write_bytes(bytes(data))
    gadgets.reseal(good)
    assert ckpt.verify(good) is None
    cfg = TrainConfig(checkpoint_dir=str(tmp_path / "ck"), steps=9)
    for resumed_from, caveat in ((None, False), (good, True)):
        guard = RunGuard(cfg, 0, "cpu")
        guard.resumed_from = resumed_from
        with pytest.raises(NonFiniteStep) as info:
            guard.check_finite(8, float("nan"), 1.0)
        text = str(info.value)
        assert "intact" not in text, text
        assert (
            f"The newest checkpoint that passes its checks (files, sizes, checksums) is "
            f"{good} (step 7): continue from it with the same command plus --resume"
        ) in text
        assert ("this run started from it" in text) is caveat, text
        assert (f"move {good} aside to resume from an older one" in text) is caveat, text
