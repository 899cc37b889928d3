"""``python -m dtensor_ulysses.train --help`` answers without importing torch.

The help is printed by the torch-free parser (``train/cli.py``) before ``train/__main__.py``
imports the trainer; here torch is made unimportable (``sys.modules["torch"] = None``) in a fresh
interpreter that runs the module as ``python -m`` would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_RUN_WITHOUT_TORCH = """
import runpy, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
sys.argv = ["dtensor_ulysses.train", *sys.argv[1:]]
runpy.run_module("dtensor_ulysses.train", run_name="__main__", alter_sys=True)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))  # fmt: skip
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT_TORCH, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_does_not_import_torch(flag):
    out = _run("--sp", "2", flag)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("usage: python -m dtensor_ulysses.train"), out.stdout[:500]
    for option in ("--hf-model", "--tiled-loss", "--attention-backend", "--memory-headroom"):
        assert option in out.stdout, option


def test_without_help_the_trainer_needs_torch():
    # the shim really blocks torch: a run that is not --help gets as far as importing it
    out = _run("--steps", "1")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError") and "torch" in last, out.stderr[-2000:]
