import multiprocessing
import os

import pytest
import torch

from dtensor_ulysses.launch import WORLD_START_ENV

# Spawned worlds (dtensor_ulysses.launch.run_local_world) fork from one server process that has
# imported torch and the Hugging Face stack once, instead of each rank importing them afresh
# (seconds of CPU per rank, hundreds of ranks per suite). Each rank still gets the test's
# environment at the call. Set DTENSOR_ULYSSES_WORLD_START=spawn to run them the plain way.
os.environ.setdefault(WORLD_START_ENV, "forkserver")
multiprocessing.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "numpy",
        "transformers",
        "transformers.models.llama.modeling_llama",
        "transformers.trainer",
        "trl",
        "trl.trainer.sft_trainer",
        "trl.trainer.dpo_trainer",
        "trl.trainer.grpo_trainer",
        "peft",
        "accelerate",
        "datasets",
    ]
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
