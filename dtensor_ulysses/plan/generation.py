"""How a rollout round holds the policy's weights: gathered once for the round, or layer by layer.

Torch-free (the numbers come from the trainer). During a round each rank of an sp group decodes
its ``1/sp`` share of the group's rollouts (``r`` rows). Two ways to hold the FSDP2-sharded
weights while it does (TRL's ``ds3_gather_for_generation`` names the same choice for ZeRO-3):

* ``"round"``: every unit is all-gathered once when the round starts and resharded when it
  ends; decoding needs no collective, so each rank steps on its own. Per rank this holds the
  **whole model** in its compute dtype (``W`` bytes) besides the rank's shards and optimizer
  states (``R``) and the KV cache of its own rows (``K``): ``R + W + K``.
* ``"layer"``: the root unit is gathered for the round and each decoder layer is all-gathered
  again in every decoding step (transformers' ``synced_gpus``: every rank of the world steps
  until the slowest is done): ``R + root + 2 x largest layer + K``, and about the model's bytes
  moved per rank and generated token.

:func:`choose_weight_gathering` takes ``"round"`` when its estimate fits in :data:`HEADROOM`
of the capacity (the memory preflight's rule), else ``"layer"``; ``requested=False``
(``ds3_gather_for_generation=False``) takes ``"layer"``.

``K = 2 x layers x kv heads x head dim x bytes x r x tokens`` with ``tokens`` the longest row
the round can make (the prompt the caller counts plus ``max_completion_length``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtensor_ulysses.plan._preflight_capacity import device_capacity
from dtensor_ulysses.plan._preflight_estimate import format_bytes
from dtensor_ulysses.plan.preflight import HEADROOM

__all__ = ["GATHER_MODES", "GenerationMemory", "choose_weight_gathering", "kv_cache_bytes"]

GATHER_MODES = ("round", "layer")


@dataclass(frozen=True)
class GenerationMemory:
    """One rank's memory during a rollout round, in bytes.

    Attributes:
        resident: what the rank holds anyway (its parameter shards, optimizer states, the
            reference model's shards).
        gathered_weights: the whole policy gathered in its compute dtype (``"round"``).
        layer_weights: what ``"layer"`` holds gathered at once (the root unit and two decoder
            layers: the running one and FSDP2's prefetch of the next).
        kv_cache: the KV cache of the rank's own rows at their longest.
    """

    resident: int
    gathered_weights: int
    layer_weights: int
    kv_cache: int

    def peak(self, mode: str) -> int:
        """The estimate for ``mode`` (:data:`GATHER_MODES`)."""
        if mode not in GATHER_MODES:
            raise ValueError(f"mode must be one of {GATHER_MODES}, got {mode!r}")
        held = self.gathered_weights if mode == "round" else self.layer_weights
        return self.resident + held + self.kv_cache


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, rows: int,
                   tokens: int) -> int:  # fmt: skip
    """``2 x layers x kv_heads x head_dim x dtype_bytes`` per token, for ``rows x tokens``."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes * rows * tokens


def choose_weight_gathering(
    mem: GenerationMemory,
    device_type: str,
    *,
    requested: bool = True,
    capacity: int | None = None,
    headroom: float = HEADROOM,
) -> tuple[str, str]:
    """``(mode, why)``: ``"round"`` when requested and its estimate fits in ``headroom`` of a
    rank's capacity (``capacity``, else the preflight's probe of ``device_type``: the GPU's
    memory, on CPU this rank's share of the host's; unknown: assumed to fit), else
    ``"layer"``; ``why`` is one line with the numbers.

    Raises:
        ValueError: ``headroom`` outside ``(0, 1]``.
    """
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom {headroom} must be a fraction in (0, 1], e.g. {HEADROOM}")
    if capacity is None:
        capacity, _ = device_capacity(device_type)
    need = mem.peak("round")
    parts = (f"gathered weights {format_bytes(mem.gathered_weights)} + KV cache "
             f"{format_bytes(mem.kv_cache)} + shards and optimizer states "
             f"{format_bytes(mem.resident)}")  # fmt: skip
    if not requested:
        return "layer", (
            f"each decoder layer gathered per decoding step (ds3_gather_for_generation=False; "
            f"about {format_bytes(mem.peak('layer'))} per rank)"
        )
    if capacity is None or need <= capacity * headroom:
        cap = "" if capacity is None else f" of {format_bytes(capacity)}"
        return "round", (
            f"weights gathered once per round (about {format_bytes(need)} per rank{cap}: {parts})"
        )
    return "layer", (
        f"each decoder layer gathered per decoding step: gathering the weights once per round "
        f"needs about {format_bytes(need)} per rank ({parts}), more than {headroom:.0%} of "
        f"{format_bytes(capacity)}; layer by layer needs about "
        f"{format_bytes(mem.peak('layer'))}"
    )
