"""The memory preflight: it refuses what cannot fit (an 8B model on a CPU machine, in seconds),
with the flags that would make it fit, obeys a capacity override and ``--allow-oversubscribe``,
parses memory sizes, and stays close to the real step traced with fake tensors.

Each torchrun job is a real one (2 CPU processes) with a timeout; the in-process checks need no
process group.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from dtensor_ulysses.plan import (
    ParallelOptions,
    check_fits,
    estimate_memory,
    get_shape,
    parse_bytes,
)
from tests.train.test_faults import TINY, _env, _errors, _run_all, _warnings

AC = ParallelOptions(activation_checkpointing=True)


@pytest.mark.timeout(60)
def test_preflight_refuses_8b_on_cpu_before_building_anything():
    """``--model llama3-8b`` on a CPU machine: one error line with the estimate, the capacity
    and what to do, before any model is built (it used to be OOM-killed after a minute). How
    long it takes is not asserted here (a loaded machine varies): the preflight reads no
    weights and builds nothing, which is what the missing start line shows."""
    env = _env()
    from dtensor_ulysses.plan import host_capacity

    cap, _ = host_capacity()
    if cap is None or cap > 32 * 2**30:  # a big machine: pretend it has 32 GiB per rank
        env = _env(DTENSOR_ULYSSES_MEMORY_CAPACITY="32GiB")
    t0 = time.monotonic()
    [res] = _run_all([(["--model", "llama3-8b", "--device", "cpu", "--steps", "1"], env)], 60)
    elapsed = time.monotonic() - t0
    label = f"rc={res.returncode} in {elapsed:.1f} s\n{res.stderr[-3000:]}"
    assert res.returncode != 0, label
    [error] = _errors(res.stderr)
    assert re.search(r"memory preflight: this run needs about [\d.]+ GiB of memory per rank", error)
    assert "but a rank has" in error and "--allow-oversubscribe" in error, error
    assert "model llama3-8b" not in res.stdout, label  # the start line: printed once built


@pytest.mark.timeout(300)
def test_preflight_capacity_override_refuses_then_allows(tmp_path):
    refused, forced = _run_all([
        ([*TINY, "--steps", "1"], _env(DTENSOR_ULYSSES_MEMORY_CAPACITY="1MiB")),
        ([*TINY, "--steps", "1", "--allow-oversubscribe"],
         _env(DTENSOR_ULYSSES_MEMORY_CAPACITY="1MiB")),
    ])  # fmt: skip
    assert refused.returncode != 0, refused.stderr[-2000:]
    [error] = _errors(refused.stderr)
    assert "but a rank has 1 MiB ($DTENSOR_ULYSSES_MEMORY_CAPACITY)" in error, error
    assert forced.returncode == 0, forced.stderr[-2000:]
    [warning] = _warnings(forced.stderr)
    assert "starting anyway" in warning
    assert re.search(r"^step 1/1 \| loss", forced.stdout, re.M), forced.stdout[-2000:]


def test_preflight_suggests_the_flags_that_fit():
    shape = get_shape("llama3-8b")
    run = dict(seq_len=131072, batch_size=2, dp=2, sp=8)
    plain = estimate_memory(shape, compute_bytes=2, **run)
    with_ac = estimate_memory(shape, AC, compute_bytes=2, **run)
    assert with_ac.device_bytes < plain.device_bytes / 2
    cap = (plain.device_bytes + with_ac.device_bytes) // 2
    res = check_fits(shape, device_type="cuda", device_cap=cap, host_cap=2**40,
                     capacity_source="test", **run)  # fmt: skip
    assert not res.fits and res.suggestion == ["--activation-checkpointing"], res.problem
    assert "add --activation-checkpointing" in (res.problem or "")
    ok = check_fits(shape, AC, device_type="cuda", device_cap=cap, host_cap=2**40, **run)
    assert ok.fits
    # on CPU the host is the device: offloading is never suggested
    cpu = check_fits(shape, device_type="cpu", device_cap=cap // 4, host_cap=None, **run)
    assert not cpu.fits and "offload" not in (cpu.problem or "")


def test_parse_bytes():
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("lots")


PREFLIGHT_VS_TRACE = """
import json
from dtensor_ulysses import memtrace as mt
f = dict(tiled_loss=True, tiled_mlp=True, offload_activations=True, head_chunks=4,
         offload_optimizer=True)
t = mt.trace_train_step("llama3-8b", 2097152, sp=8, layers=2, **f)
print(json.dumps(t.device_peak_bytes))
"""


@pytest.mark.timeout(300)
def test_preflight_is_close_to_the_traced_step():
    """The closed form against the real step traced with fake tensors (llama3-8b, 2 blocks,
    256K tokens per rank on sp = 8, every memory feature): within -10% to +15%."""
    r = subprocess.run([sys.executable, "-c", PREFLIGHT_VS_TRACE], capture_output=True,
                       text=True, timeout=280)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    traced = int(r.stdout.strip().splitlines()[-1])
    est = estimate_memory(
        get_shape("llama3-8b").with_(n_layers=2), ParallelOptions(**RECIPE), seq_len=2097152,
        batch_size=1, dp=1, sp=8, compute_bytes=2,
    )  # fmt: skip
    assert -0.10 <= est.device_bytes / traced - 1 <= 0.15, (est.device, traced)


# the CUDA branch with given capacities: an 80 GB GPU's bytes, host per rank as given
GPU_80GB = 80 * 10**9
RECIPE = dict(activation_checkpointing=True, tiled_loss=True, tiled_mlp=True, head_chunks=4,
              offload_activations=True, offload_optimizer=True)  # fmt: skip


def _cuda(features, *, host_cap, device_cap=GPU_80GB, seq_len=4_194_304, **run):
    run = dict(dict(batch_size=1, dp=1, sp=8), **run)
    caps = dict(device_cap=device_cap, host_cap=host_cap, capacity_source="test GPU",
                host_capacity_source="test host")  # fmt: skip
    return check_fits(get_shape("llama3-8b"), ParallelOptions(**features), device_type="cuda",
                      seq_len=seq_len, **caps, **run)  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def test_preflight_on_cuda_names_the_host_when_the_host_binds():
    """The 8x H100 recipe at 4M tokens with 64 GiB of host per rank: the device fits, the host
    does not. The message names the host, its need, capacity and shortfall, says the device
    fits, and suggests what shrinks host bytes (more ranks, fewer per node, a shorter sequence),
    not a device flag; with the host it needs, the same run fits."""
    host_cap = 64 * 2**30
    res = _cuda(RECIPE, host_cap=host_cap)
    need_host = res.estimate.host_bytes
    assert need_host > 0.9 * host_cap and res.estimate.device_bytes < 0.9 * GPU_80GB  # premise
    assert not res.fits and res.binding == "host", res.problem
    msg = res.problem or ""
    assert msg.startswith("host memory is the limit: this run needs about "
                          f"{_gib(need_host)} of host memory per rank"), msg  # fmt: skip
    assert "but a rank has 64.0 GiB of host memory (test host)" in msg, msg
    assert f"{_gib(need_host - 0.9 * host_cap)} short" in msg, msg
    assert "(the device fits: " in msg and "of device memory" not in msg, msg
    assert "x the ranks on more nodes, or fewer ranks per node" in msg, msg
    dropping = "dropping --offload-activations --offload-optimizer (any of them) does not fit"
    assert f"{dropping} both memories" in msg, msg
    assert res.suggestion == [] and "add --" not in msg, msg
    assert _cuda(RECIPE, host_cap=int(need_host / 0.9) + 1).fits


def test_preflight_on_cuda_host_bound_suggests_dropping_an_offload_that_the_device_holds():
    """A short run with --offload-optimizer and 8 GiB of host per rank: the AdamW states and
    master weights (16 bytes a parameter shard) do not fit the host, and the device holds them:
    the fix is to drop --offload-optimizer, and the run without it fits."""
    feats = dict(activation_checkpointing=True, offload_optimizer=True)
    res = _cuda(feats, host_cap=8 * 2**30, seq_len=65536)
    assert res.binding == "host" and res.suggestion == ["no --offload-optimizer"], res.problem
    assert "drop --offload-optimizer (about " in (res.problem or ""), res.problem
    assert _cuda(dict(feats, offload_optimizer=False), host_cap=8 * 2**30, seq_len=65536).fits


def test_preflight_on_cuda_names_the_device_when_the_device_binds():
    """No memory flags at 128K on 8 ranks, 512 GiB of host: the device binds; the message names
    the device memory and says the host fits; the fix is a device flag (checkpointing)."""
    res = _cuda({}, host_cap=512 * 2**30, seq_len=131072)
    assert res.binding == "device" and res.suggestion == ["--activation-checkpointing"]
    msg = res.problem or ""
    assert msg.startswith(f"this run needs about {_gib(res.estimate.device_bytes)} of device "
                          "memory per rank"), msg  # fmt: skip
    assert "but a rank has 74.5 GiB (test GPU)" in msg and "(the host fits: " in msg, msg
    assert "host memory is the limit" not in msg, msg
    # both bound: both named, and the ranks suggested cover the larger shortfall
    both = _cuda(RECIPE, host_cap=64 * 2**30, seq_len=12_000_000)
    assert both.binding == "device and host", both.problem
    assert "of device memory per rank" in (both.problem or "")
    assert "of host memory per rank" in (both.problem or "")
