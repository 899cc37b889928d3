"""The trainer refuses before training, stops cleanly when told to, never trains on NaN (issue 21).

Each torchrun job is a real one (2 CPU processes, gloo) with a timeout. Refusals: one ``error:``
line from rank 0, status 2, and nothing written (no checkpoint, no metrics line). Preemption:
SIGTERM to torchrun (as Kubernetes sends it) or SIGUSR1 to one worker (as SLURM's ``--signal``
can) stops every rank after the same step with the checkpoint written and status 75; ``--resume``
then gives the straight run's losses exactly. A NaN injected through the test hook stops the run
at that step naming the newest intact checkpoint. The memory preflight refuses an estimate within
its headroom of the capacity.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dtensor_ulysses.plan.preflight import HEADROOM, check_fits, estimate_memory
from dtensor_ulysses.plan.presets import get_shape
from dtensor_ulysses.train.guard import EXIT_NONFINITE, EXIT_PREEMPTED, NAN_HOOK_ENV
from tests.processes import gone, kill_trees
from tests.train.test_faults import ROOT, TINY, _cmd, _env, _errors, _run_all, _worker_pids

COMMON = [*TINY, "--lr", "3e-3", "--warmup-steps", "2", "--decay-steps", "20"]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _written(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


# ----------------------------------------------------------------------------------------------
# refused before training
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_refusals_happen_before_the_first_step(tmp_path):
    """Two refusals as torchrun jobs (one ``error:`` line, rank 0's status 2, no metrics line,
    the checkpoints untouched), the rest through ``validate`` in process; ``--overwrite``
    deletes the other run's checkpoints when its run starts."""
    from dtensor_ulysses.train import validate
    from dtensor_ulysses.train.cli import TrainConfig, UsageError

    ck = tmp_path / "ck"
    [first] = _run_all([([*COMMON, "--steps", "2", "--checkpoint-dir", str(ck)], _env())])
    assert first.returncode == 0, first.stderr[-3000:]
    assert _written(ck) == ["step_00000002"]
    m = tmp_path / "m.jsonl"  # no refused job may create it
    cases = [
        (["--steps", "2", "--resume", "--checkpoint-dir", str(ck)],
         r"checkpoint .*step_00000002 has done 2 steps and --steps is 2, so there is nothing to "
         r"train; pass --steps greater than 2"),
        (["--steps", "3", "--seed", "1", "--checkpoint-dir", str(ck)],
         r"holds the checkpoints of another run \(.*seed=0.*--overwrite"),
    ]  # fmt: skip
    jobs = [([*COMMON, *args, "--metrics-file", str(m)], _env()) for args, _ in cases]
    shutil.copytree(ck / "step_00000002", tmp_path / "ck2" / "step_00000005")
    jobs.append(([*COMMON, "--steps", "1", "--seed", "1", "--overwrite", "--checkpoint-dir",
                  str(tmp_path / "ck2")], _env()))  # fmt: skip
    results = _run_all(jobs)
    for (args, pattern), res in zip(cases, results):
        label = f"{args}: rc={res.returncode}\n{res.stderr[-2000:]}"
        assert res.returncode != 0 and re.search(r"exitcode\s*: 2 ", res.stderr), label
        errors = _errors(res.stderr)
        assert len(errors) == 1 and re.search(pattern, errors[0]), label
        assert "step 1/" not in res.stdout, f"it trained; {label}"
    assert not m.exists(), "a refused run wrote a metrics line"
    assert _written(ck) == ["step_00000002"], "a refused run touched the checkpoints"
    over = results[-1]
    assert over.returncode == 0, over.stderr[-3000:]
    assert _written(tmp_path / "ck2") == ["step_00000001"]
    assert "--overwrite: deleted 1 checkpoint(s)" in over.stdout

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    base = dict(seq_len=64, batch_size=2, steps=3, device="cpu")
    in_process = [
        (dict(checkpoint_dir=str(ck)),
         r"already holds this run's checkpoints \(the newest: step 2\).*pass --resume"),
        (dict(checkpoint_dir=str(a_file)), r"is a file, not a directory"),
        (dict(checkpoint_dir=str(a_file / "ck")), r"is a file, so no directory"),
        (dict(metrics_file=str(tmp_path)), r"--metrics-file .* is a directory"),
        (dict(resume=True, overwrite=True, checkpoint_dir=str(ck)),
         r"--overwrite deletes the checkpoints that --resume would continue"),
        (dict(lr=-1.0), r"^--lr -1.0 must be > 0"),
        (dict(lr=float("nan")), r"^--lr nan must be > 0"),
        (dict(min_lr_ratio=1.5), r"^--min-lr-ratio 1.5 must be between 0 and 1"),
        (dict(warmup_steps=-1), r"^--warmup-steps -1 must be >= 0"),
        (dict(warmup_steps=30, decay_steps=20), r"--warmup-steps 30 is longer than --decay-st"),
        (dict(weight_decay=float("inf")), r"^--weight-decay inf must be >= 0"),
        (dict(grad_clip=-0.5), r"^--grad-clip -0.5 must be >= 0"),
        (dict(collective_timeout_s=0.0), r"^--collective-timeout-s 0.0 must be > 0"),
        (dict(memory_headroom=0.0), r"^--memory-headroom 0.0 must be a fraction"),
    ]  # fmt: skip
    for kw, pattern in in_process:
        with pytest.raises(UsageError, match=pattern):
            validate(TrainConfig(**{**base, **kw}), 1)
    assert _written(ck) == ["step_00000002"] and _written(tmp_path / "ck2") == ["step_00000001"]


def test_what_a_new_user_gets_wrong_is_refused_with_the_fix(tmp_path, monkeypatch):
    """In process: ``--checkpoint-every -1``; an ``--eval-data`` too small (named, not "the
    corpus"); chat JSONL with the built-in model (needs ``--hf-model``); ``--sp 2`` in a plain
    ``python -m`` process (launch with torchrun)."""
    from dtensor_ulysses.train import validate
    from dtensor_ulysses.train.cli import TrainConfig, UsageError
    from dtensor_ulysses.train.guard import SINGLE_PROCESS_ENV

    small, chat = tmp_path / "held.txt", tmp_path / "chat.jsonl"
    small.write_text("x y\n")
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    base = dict(seq_len=64, batch_size=2, steps=3, device="cpu")
    cases = [
        (dict(checkpoint_every=-1), r"^--checkpoint-every -1 must be >= 0 steps \(0: checkpoint"),
        (dict(checkpoint_every=5), r"^--checkpoint-every 5 writes nothing without "
                                   r"--checkpoint-dir; add --checkpoint-dir DIR"),
        (dict(compile="nosuchbackend"), r"^--compile nosuchbackend: torch\.compile has no "
                                        r"backend of that name; use one of .*inductor"),
        (dict(eval_data=[str(small)]), r"^--eval-data '.*held\.txt' has \d+ tokens but one wi"),
        (dict(data=[str(chat)]), r"chat template: train a transformers model on them with "
                                 r"--hf-model DIR"),
    ]  # fmt: skip
    for kw, pattern in cases:
        with pytest.raises(UsageError, match=pattern):
            validate(TrainConfig(**{**base, **kw}), 1)
    with pytest.raises(UsageError, match=r"torchrun started 1 processes"):
        validate(TrainConfig(**base, sp=2), 1)
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    with pytest.raises(UsageError, match=r"one process, not started by torchrun: launch it with "
                                         r"`torchrun --nproc-per-node N"):  # fmt: skip
        validate(TrainConfig(**base, sp=2), 1)


def test_the_kernel_that_cannot_run_the_run_is_refused_before_step_1():
    """An explicit ``--attention-backend`` that cannot run the built-in model's features (compiled
    SDPA with packed documents: it would need an ``S x S`` mask) is refused by the checks, naming
    the feature and the backends that can; the flag offers every backend the kernel layer has."""
    from dtensor_ulysses.attention import KERNELS
    from dtensor_ulysses.train import validate
    from dtensor_ulysses.train.cli import ATTENTION_BACKENDS, TrainConfig, UsageError

    assert set(ATTENTION_BACKENDS) >= {"auto", *KERNELS}
    base = dict(seq_len=64, batch_size=2, steps=3, device="cpu", sp=1, pack_docs=True)
    with pytest.raises(UsageError, match=r"^--attention-backend sdpa: .*packed documents.*"
                                         r"inside torch.compile.*'blockwise'"):  # fmt: skip
        validate(TrainConfig(**base, compile="aot_eager", attention_backend="sdpa"), 1)
    validate(TrainConfig(**base, attention_backend="sdpa"), 1)  # eager: one call per document
    validate(TrainConfig(**base, compile="aot_eager", attention_backend="blockwise"), 1)


def test_a_rank_leaves_its_note_before_its_first_step(tmp_path, monkeypatch):
    """The note torchrun's summary shows for a rank killed before it finished step 1 (while
    building, or out of memory in step 1), read back as torchrun reads it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dtensor_ulysses.train.guard import clear_rank_note, note_building

    error_file = tmp_path / "attempt_0" / "1" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    note_building(1, 30)
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file=str(error_file))
    shown = failure.message["extraInfo"]["py_callstack"]  # what the summary prints
    assert re.match(r"rank 1 \(pid \d+\) had not finished step 1 of 30 \(it was building",
                    shown), shown  # fmt: skip
    assert "out-of-memory killer" in shown
    clear_rank_note()
    assert not error_file.exists()


def test_save_hf_and_unwritable_paths_are_refused(tmp_path):
    """In process (no torchrun): ``--save-hf`` naming a file; a directory the user may not
    write (as root, in a child that drops to user nobody, beside a writable control)."""
    from dtensor_ulysses.train.cli import TrainConfig, UsageError
    from dtensor_ulysses.train.guard import check_targets

    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(UsageError, match=r"--save-hf '.*f' is a file; name a directory"):
        check_targets(TrainConfig(save_hf=str(a_file)))
    with pytest.raises(UsageError, match=r"is a file, so no directory can be created"):
        check_targets(TrainConfig(save_hf=str(a_file / "out" / "model")))
    check_targets(TrainConfig(save_hf=str(tmp_path / "new" / "model")))  # creatable: fine
    assert not (tmp_path / "new").exists(), "the check creates nothing"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    kws = [{"checkpoint_dir": str(ro / "ck")}, {"metrics_file": str(ro / "m.jsonl")},
           {"save_hf": str(ro / "out")}]  # fmt: skip
    try:
        if os.geteuid() != 0:
            for kw in kws:
                with pytest.raises(UsageError, match="cannot write in"):
                    check_targets(TrainConfig(**kw))
            return
    finally:
        ro.chmod(0o700)
    # root (as on CI), whom permissions do not stop: the checks run in a child that drops to
    # an unprivileged user, on a directory it may not write and one it may (the control)
    base = Path(tempfile.mkdtemp(prefix="du-perm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "ro").mkdir(mode=0o555)
        (base / "rw").mkdir()
        (base / "rw").chmod(0o777)
        kws = [{k: v.replace(str(ro), str(base / d)) for k, v in kw.items()}
               for d in ("ro", "rw") for kw in kws]  # fmt: skip
        got = _as_nobody(lambda: [_refusal(check_targets, TrainConfig(**kw)) for kw in kws])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for kw, message in zip(kws[:3], got[:3]):
        assert message and "cannot write in" in message, (kw, message)
    assert got[3:] == [None, None, None], got[3:]


def _refusal(check, cfg) -> str | None:
    from dtensor_ulysses.train.cli import UsageError

    try:
        check(cfg)
    except UsageError as e:
        return str(e)
    return None


def _as_nobody(fn):
    """``fn()`` in a forked child running as uid/gid 65534 (nobody); returns its result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, run, report, leave without cleanup
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and out, f"the unprivileged child failed (status {status})"
    return json.loads(out)


# ----------------------------------------------------------------------------------------------
# preemption
# ----------------------------------------------------------------------------------------------
def _wait_for_step(metrics: Path, proc: subprocess.Popen, step: int, deadline: float) -> None:
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.monotonic() < deadline, "the job did not train"
        time.sleep(0.05)


def _launch_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "dtensor_ulysses.launch", "--standalone", "--nproc-per-node=2",
            "-m", "dtensor_ulysses.train", *args]  # fmt: skip


# (how the job is launched, the signal, sent to the launcher's pid alone or to its group; the
# groups of `launch ... | tee log`: tee dies with the group, rank 0's stdout has no reader)
_STOPS = {
    "launch_usr1_pid": ("launch", signal.SIGUSR1, "pid"),
    "launch_tee_usr1_group": ("launch_tee", signal.SIGUSR1, "group"),
    "launch_term_pid": ("launch", signal.SIGTERM, "pid"),
    "launch_tee_term_group": ("launch_tee", signal.SIGTERM, "group"),
    "launch_ctrl_c_group": ("launch", signal.SIGINT, "group"),
    "torchrun_usr1_rank1": ("torchrun", signal.SIGUSR1, "rank1"),
}
_PIPE_JOB = str(Path(__file__).with_name("pipe_job.py"))


@pytest.mark.timeout(500)
def test_preempt_then_resume_equals_straight_run(tmp_path):
    """SIGUSR1 and SIGTERM to ``python -m dtensor_ulysses.launch``, to its pid alone and to the
    process group of ``launch ... | tee log`` (as SLURM's batch-script trap, ``scancel
    --signal`` and Kubernetes send them; ``tee`` dies with the group), a Ctrl-C (SIGINT to the
    launcher's group), and SIGUSR1 to one torchrun worker: every rank stops after the same step,
    the checkpoint of that step is written, one ``preempted:`` line, no worker is left running,
    the status is 75 (the launcher's own; torchrun's summary names the workers' 75); a closed
    stdout is noticed once and costs nothing; resuming gives the straight run's losses bit for
    bit, and a resumed run drops the metrics rows logged past its checkpoint (a crash leaves
    them; planted here). The straight run is made afterwards, as long as the stops need (the
    schedule does not depend on ``--steps``), so how fast the jobs run cannot matter."""
    procs, workers = {}, {}
    for how, (launcher, _, _) in _STOPS.items():
        args = [*COMMON, "--steps", "1000", "--checkpoint-dir", str(tmp_path / how),
                "--metrics-file", str(tmp_path / f"{how}.jsonl")]  # fmt: skip
        cmd = _launch_cmd(args) if launcher.startswith("launch") else _cmd(args)
        if launcher == "launch_tee":
            cmd = [sys.executable, _PIPE_JOB, str(tmp_path / f"{how}.log"), *cmd]
        procs[how] = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        for how, proc in procs.items():
            _wait_for_step(tmp_path / f"{how}.jsonl", proc, 2, deadline)
            workers[how] = _worker_pids(proc.pid)
            assert sorted(workers[how]) == [0, 1], (how, workers[how])
            _, sig, target = _STOPS[how]
            if target == "pid":
                proc.send_signal(sig)
            elif target == "group":
                os.killpg(proc.pid, sig)  # start_new_session: the launcher leads its group
            else:
                os.kill(workers[how][1], sig)
        outs = {how: proc.communicate(timeout=150) for how, proc in procs.items()}
    finally:
        kill_trees(proc.pid for proc in procs.values())
    resume_jobs, stops = [], {}
    for how, (_, stderr) in outs.items():
        launcher, sig, _ = _STOPS[how]
        label = f"{how}: rc={procs[how].returncode}\n{stderr[-3000:]}"
        lines = re.findall(r"^preempted: .*$", stderr, re.M)
        assert len(lines) == 1, label
        m = re.match(r"preempted: (SIG\w+)(?: \(Ctrl-C\))? received: stopped after step (\d+) of "
                     r"1000; checkpoint (\S+) written", lines[0])  # fmt: skip
        assert m and m.group(1) == sig.name, label
        stop = int(m.group(2))
        assert sorted(_losses(tmp_path / f"{how}.jsonl")) == list(range(1, stop + 1)), label
        ck = tmp_path / how
        assert _written(ck) == [f"step_{stop:08d}"], label
        left = [pid for pid in workers[how].values() if not gone(pid)]
        assert not left, f"workers {left} still running; {label}"
        if launcher == "launch_tee":  # its stdout closed: noticed once, every step recorded
            assert len(re.findall(r"^warning: rank 0: stdout is closed", stderr, re.M)) == 1, label
            assert "BrokenPipeError" not in stderr, label
        if launcher.startswith("launch"):
            assert procs[how].returncode == EXIT_PREEMPTED, label
            assert lines[0].endswith("(exit status 75)"), label
            assert "Traceback" not in stderr, label  # torchrun's report: one line instead
            assert "launch: every worker stopped pre-empted (status 75" in stderr, label
        else:  # torchrun's own status is 1; its summary names the workers' status and the stop
            assert re.search(rf"exitcode\s*: {EXIT_PREEMPTED}\b", stderr), label
            assert "stopped after step" in stderr.split("Root Cause")[-1], label
        stops[how] = stop
        metrics = tmp_path / f"{how}.jsonl"
        if how == "launch_usr1_pid":  # rows a crash after the checkpoint would have left
            with metrics.open("a") as f:
                f.write(json.dumps({"step": stop + 1, "loss": 0.0}) + '\n{"step": ')
        else:
            metrics = tmp_path / f"{how}.b.jsonl"
        resume_jobs.append(([*COMMON, "--steps", str(stop + 2), "--resume", "--checkpoint-dir",
                             str(ck), "--metrics-file", str(metrics)], _env()))  # fmt: skip
    straight = ([*COMMON, "--steps", str(max(stops.values()) + 2), "--metrics-file",
                 str(tmp_path / "a.jsonl")], _env())  # fmt: skip
    straight_res, *resumed = _run_all([straight, *resume_jobs])
    assert straight_res.returncode == 0, straight_res.stderr[-3000:]
    a = _losses(tmp_path / "a.jsonl")
    for (how, stop), res in zip(stops.items(), resumed):
        assert res.returncode == 0, res.stderr[-3000:]
        if how == "launch_usr1_pid":
            rows = [json.loads(x)["step"] for x in (tmp_path / f"{how}.jsonl").read_text().split(
                "\n") if x]  # fmt: skip
            assert rows == list(range(1, stop + 3)), f"one row per step: {rows}"
            assert f"dropped 2 row(s) past step {stop}" in res.stdout, res.stdout[-2000:]
            got = _losses(tmp_path / f"{how}.jsonl")
        else:
            b = _losses(tmp_path / f"{how}.b.jsonl")
            assert sorted(b) == [stop + 1, stop + 2], (how, sorted(b))
            got = {**_losses(tmp_path / f"{how}.jsonl"), **b}
        assert sorted(got) == list(range(1, stop + 3)), (how, sorted(got))
        assert got == {s: a[s] for s in got}, f"{how}: resumed losses differ from the straight run"


# ----------------------------------------------------------------------------------------------
# numerical faults
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_injected_nan_stops_at_that_step(tmp_path):
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    args = [*COMMON, "--steps", "6", "--checkpoint-every", "1", "--checkpoint-dir", str(ck),
            "--metrics-file", str(m)]  # fmt: skip
    m2 = tmp_path / "skip.jsonl"
    skip = [*COMMON, "--steps", "5", "--skip-nonfinite", "--metrics-file", str(m2)]
    res, skipped = _run_all([(args, _env(**{NAN_HOOK_ENV: "3"})),
                             (skip, _env(**{NAN_HOOK_ENV: "3"}))])  # fmt: skip
    label = f"rc={res.returncode}\n{res.stderr[-3000:]}"
    assert res.returncode != 0, label  # torchrun's own status is 1; the workers' is 3
    assert re.search(rf"exitcode\s*: {EXIT_NONFINITE} ", res.stderr), label
    [error] = _errors(res.stderr)
    assert re.match(r"error: step 3: non-finite loss nan", error), label
    assert (f"newest checkpoint that passes its checks (files, sizes, checksums) is "
            f"{ck / 'step_00000002'} (step 2): continue from it") in error, label  # fmt: skip
    assert "this run started from it" not in error, label
    assert "--resume" in error, label
    assert sorted(_losses(m)) == [1, 2], "the NaN step must not be logged as a step"
    assert _written(ck) == ["step_00000001", "step_00000002"], "the NaN state must not be saved"
    assert "Traceback" not in res.stderr.split("error: step 3")[0], label
    # --skip-nonfinite (the hook's fault is transient there): the step is skipped and counted
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert re.search(r"^warning: step 3: non-finite loss nan.*skipped", skipped.stderr, re.M)
    recs = {r["step"]: r for r in map(json.loads, m2.read_text().splitlines())}
    assert sorted(recs) == [1, 2, 3, 4, 5]
    assert [recs[s]["skipped_nonfinite"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(recs[s]["loss"]) for s in (1, 2, 4, 5)), recs
    assert [recs[s]["loss"] for s in (1, 2)] == [_losses(m)[s] for s in (1, 2)]


# ----------------------------------------------------------------------------------------------
# memory headroom
# ----------------------------------------------------------------------------------------------
def test_preflight_refuses_an_estimate_within_the_headroom():
    shape = get_shape("llama3-1b")
    run = dict(seq_len=64, batch_size=2, dp=1, sp=2)
    need = estimate_memory(shape, compute_bytes=4, **run).device_bytes
    cap = int(need / 0.95)  # the estimate is 95% of the capacity: in the margin
    res = check_fits(shape, device_type="cpu", device_cap=cap, host_cap=cap,
                     capacity_source="test", **run)  # fmt: skip
    assert not res.fits, "an estimate at 95% of the capacity must be refused"
    assert f"a run may use {HEADROOM:.0%}" in (res.problem or ""), res.problem
    assert "--memory-headroom" in (res.problem or "")
    loose = check_fits(shape, device_type="cpu", device_cap=cap, host_cap=cap,
                       headroom=0.97, **run)  # fmt: skip
    assert loose.fits
    roomy = check_fits(shape, device_type="cpu", device_cap=int(need / 0.85),
                       host_cap=None, **run)  # fmt: skip
    assert roomy.fits
    with pytest.raises(ValueError, match="headroom 1.5 must be a fraction"):
        check_fits(shape, device_type="cpu", device_cap=cap, host_cap=cap,
                   headroom=1.5, **run)  # fmt: skip


def test_trainer_refuses_in_the_margin_and_sets_the_cuda_allocator(monkeypatch):
    """validate() with the capacity set so that the estimate is 95% of it: refused, one message;
    --allow-oversubscribe starts with a warning. The allocator setting respects the user's."""
    from dtensor_ulysses.train import validate
    from dtensor_ulysses.train.cli import TrainConfig, UsageError
    from dtensor_ulysses.train.guard import prepare_cuda_allocator

    kw = dict(model="llama3-1b", seq_len=64, batch_size=2, steps=1, device="cpu")
    need = estimate_memory(get_shape("llama3-1b"), seq_len=64, batch_size=2, dp=1, sp=1,
                           compute_bytes=4).device_bytes  # fmt: skip
    monkeypatch.setenv("DTENSOR_ULYSSES_MEMORY_CAPACITY", str(int(need / 0.95)))
    with pytest.raises(UsageError, match=r"memory preflight: .*a run may use 90%"):
        validate(TrainConfig(**kw), 1)
    validate(TrainConfig(**kw, memory_headroom=0.97), 1)
    validate(TrainConfig(**kw, allow_oversubscribe=True), 1)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    prepare_cuda_allocator(TrainConfig(device="cpu"))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    prepare_cuda_allocator(TrainConfig())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    prepare_cuda_allocator(TrainConfig())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


# ----------------------------------------------------------------------------------------------
# exported files
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_save_hf_files_follow_the_umask(tmp_path, umask):
    """An exported model directory gets the modes of a plain mkdir/open under the umask (as a
    checkpoint does), not mkdtemp's 0700 nor a private 0600 weight file."""
    pytest.importorskip("transformers")
    import stat

    from transformers import LlamaConfig, LlamaForCausalLM

    from dtensor_ulysses.hf.models.pretrained import save_pretrained

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    out = tmp_path / "export" / "model"
    out.parent.mkdir()
    old = os.umask(umask)
    try:
        save_pretrained(LlamaForCausalLM(config), out)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert "model.safetensors" in modes and "config.json" in modes, modes
    for name, mode in modes.items():
        want = (0o777 if name == "model" else 0o666) & ~umask
        assert mode == want, f"{name}: {oct(mode)} vs {oct(want)} under umask {oct(umask)}"


# ----------------------------------------------------------------------------------------------
# the built-in corpus through a transformers tokenizer: progress and a cache
# ----------------------------------------------------------------------------------------------
def _byte_tokenizer(extra: str = ""):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    if extra:
        vocab[extra] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_builtin_corpus_tokens_are_cached_by_tokenizer_and_text(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from dtensor_ulysses.hf import _token_cache as tc
    from dtensor_ulysses.hf.data import _encode_all

    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    docs = ["def f(x):\n    return x\n", "import os\n" * 3]
    tok = _byte_tokenizer()
    want = _encode_all(docs, tok)  # the reference: no cache involved
    first = tc.builtin_documents(docs, tok, _encode_all)
    assert first == want
    err = capsys.readouterr().err
    assert "tokenizing the built-in corpus (2 documents)" in err and "cached in" in err, err
    [cache] = list((tmp_path / "tokens").iterdir())
    calls = []
    again = tc.builtin_documents(docs, tok, lambda d, t: calls.append(1) or _encode_all(d, t))
    assert again == want and not calls, "the second run must read the cache"
    tc.builtin_documents([*docs, "x = 1\n"], tok, _encode_all)  # other text: another key
    tc.builtin_documents(docs, _byte_tokenizer(extra="<pad>"), _encode_all)  # other tokenizer
    assert len(list((tmp_path / "tokens").iterdir())) == 3 and cache.is_file()
    monkeypatch.setenv(tc.CACHE_ENV, "")
    assert tc.cache_dir() is None
    assert tc.builtin_documents(docs, tok, _encode_all) == want


def test_million_token_commands_pass_the_preflight_with_its_headroom(monkeypatch):
    """The how-to's H100 commands start under the default headroom (closed form, no GPU), and
    the zero-slack lengths they replaced would not (that is what the headroom is for)."""
    import shlex

    from dtensor_ulysses.train import parse_args
    from dtensor_ulysses.train.checks import _preflight
    from dtensor_ulysses.train.cli import UsageError
    from simulations.hardware import get_gpu

    text = (ROOT / "docs" / "how-to" / "million-tokens.md").read_text()
    blocks = re.findall(r"```bash\n(torchrun .*?dtensor_ulysses\.train .*?)\n```", text, re.S)
    assert len(blocks) == 2, blocks
    monkeypatch.setenv("DTENSOR_ULYSSES_MEMORY_CAPACITY", str(get_gpu("h100").memory_bytes))
    monkeypatch.setenv("DTENSOR_ULYSSES_HOST_MEMORY_CAPACITY", "4TiB")
    for block in blocks:
        argv = shlex.split(block.replace("\\\n", " "))
        cfg = parse_args(argv[argv.index("dtensor_ulysses.train") + 1 :])
        assert cfg.sp is not None
        _preflight(cfg, get_shape(cfg.model or "tiny"), "cuda")  # raises if refused
        cfg.seq_len = int(cfg.seq_len / 0.9 / 1024) * 1024  # the zero-slack neighbourhood
        with pytest.raises(UsageError, match="a run may use 90%"):
            _preflight(cfg, get_shape(cfg.model or "tiny"), "cuda")
