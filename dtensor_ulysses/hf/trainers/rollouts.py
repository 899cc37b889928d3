"""On-policy rollouts under :func:`~dtensor_ulysses.hf.with_ulysses`: what the trainers that build
their inputs by generation (TRL's ``GRPOTrainer``, ``RLOOTrainer``; its ``DistillationTrainer``)
share.

* **The stock rank's step, over dp.** The sp ranks of a group are replicas of one stock rank for
  everything outside the model's forward: the stock trainer's gathers and reductions over its
  ranks (``accelerator.gather`` / ``reduce`` / ``num_processes`` / ``process_index`` and the
  module-level ``gather`` / ``gather_object`` of its TRL module) run over dp
  (:meth:`_Rollouts._du_dp_view`), and every rank draws from the random stream of the stock rank
  with its dp index.
* **Generation** (:meth:`_Rollouts._generate_single_turn`): on whole prompts, with the model's
  own attention (:func:`~dtensor_ulysses.hf.models.routing.plain_attention`), ``synced_gpus`` on
  so that every rank joins FSDP2's all-gathers until the slowest dp group ends; one set of
  rollouts per sp group (sp rank 0's, broadcast).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dtensor_ulysses.hf.models.routing import plain_attention
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.hf.trainers._accel import dp_gather
from dtensor_ulysses.parallel.mesh import ParallelDims

__all__: list[str] = []


# ----------------------------------------------------------------------------------------------
# the stock trainer's collectives, over dp
# ----------------------------------------------------------------------------------------------
class _DpAccelerator:
    """Mixin placed over the accelerator's class inside :meth:`_UlyssesRL._du_dp_view`."""

    _du_dims: ParallelDims  # set by _accel.install

    @property
    def process_index(self) -> int:
        return self._du_dims.dp_rank

    @property
    def num_processes(self) -> int:
        return self._du_dims.dp

    def gather(self, tensor: Any) -> Any:
        return _dp_gather_same(tensor, self._du_dims.dp_mesh.get_group())

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0):
        group = self._du_dims.dp_mesh.get_group()
        out = tensor.clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
        if reduction == "mean":
            out = out / dist.get_world_size(group)
        return out * scale if scale != 1.0 else out


def _dp_gather_same(data: Any, group: dist.ProcessGroup) -> Any:
    """accelerate's ``gather`` over ``group``: tensors concatenated along dim 0 (a scalar
    becomes one row), nested lists / tuples / dicts of them likewise."""
    if isinstance(data, dict):
        return type(data)({k: _dp_gather_same(v, group) for k, v in data.items()})
    if isinstance(data, (tuple, list)):
        return type(data)(_dp_gather_same(v, group) for v in data)
    if not isinstance(data, torch.Tensor):
        return data
    return dp_gather(data if data.dim() else data.reshape(1), group=group)


def _dp_gather_object(obj: Any, group: dist.ProcessGroup) -> list:
    """accelerate's ``gather_object`` over ``group``: the ranks' lists, concatenated."""
    if dist.get_world_size(group) == 1:
        return list(obj)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return [x for part in parts for x in part]


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(module, name):  # a module that does not import it (distillation: no gather)
        yield
        return
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _Rollouts:
    """Mixin for a trainer family that generates its inputs (see the module docstring); placed
    before the shared :class:`~dtensor_ulysses.hf.trainers.base._UlyssesTrainer`. A family names
    its TRL classes in :attr:`_du_trl_classes` (the module whose ``gather`` functions the dp view
    replaces)."""

    _du_trl_classes: tuple[str, ...] = ()
    _du_dims: ParallelDims
    args: Any
    model: Any
    accelerator: Any

    def _du_seed_as_stock_rank(self) -> None:
        """The random stream of the stock rank with this dp index (generation, shuffles)."""
        from accelerate.utils import set_seed

        set_seed(self.args.seed + self._du_dims.dp_rank)

    # ------------------------------------------------------------------------------------------
    # the stock step's collectives over dp
    # ------------------------------------------------------------------------------------------
    def _du_trl_module(self) -> Any:
        cls = next(c for c in type(self).__mro__ if c.__name__ in self._du_trl_classes)
        return sys.modules[cls.__module__]

    @contextlib.contextmanager
    def _du_dp_view(self) -> Iterator[None]:
        acc = self.accelerator
        base = type(acc)
        group = self._du_dims.dp_mesh.get_group()
        module = self._du_trl_module()
        acc.__class__ = type(f"Dp{base.__name__}", (_DpAccelerator, base), {})
        try:
            with (
                _patched(module, "gather", lambda t: _dp_gather_same(t, group)),
                _patched(module, "gather_object", lambda o: _dp_gather_object(o, group)),
            ):
                yield
        finally:
            acc.__class__ = base

    def _du_sp_root(self) -> int:
        """The global rank of sp rank 0 of this rank's group."""
        return dist.get_global_rank(self._du_dims.sp_mesh.get_group(), 0)

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        with self._du_dp_view():
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]

    # ------------------------------------------------------------------------------------------
    # rollouts
    # ------------------------------------------------------------------------------------------
    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        hf: Any = _state.base_model(self.model)
        hf._is_fsdp_managed_module = True  # generate(synced_gpus=True): every rank steps
        # the root unit's weights (embeddings, head) gathered for the whole generation: a PEFT
        # model's generate calls the inner model, not the root's hooks
        root: Any = self.model
        try:
            with plain_attention(hf):
                if not getattr(self, "_du_root_ready", False):  # FSDP2 sets up from the root's
                    with torch.no_grad():  # first forward: one token through it, every rank
                        root(input_ids=torch.zeros((1, 1), dtype=torch.long,
                                                   device=self.accelerator.device))  # fmt: skip
                    self._du_root_ready = True
                root.unshard()
                out = super()._generate_single_turn(*args, **kwargs)  # type: ignore[misc]
        finally:
            root.reshard()
            del hf._is_fsdp_managed_module
        if self._du_dims.sp > 1:  # one set of rollouts per sp group: sp rank 0's (GRPO
            box = [out]  # returns (completion_ids, logprobs), RLOO completion_ids)
            dist.broadcast_object_list(box, src=self._du_sp_root(),
                                       group=self._du_dims.sp_mesh.get_group())  # fmt: skip
            out = box[0]
        return out
