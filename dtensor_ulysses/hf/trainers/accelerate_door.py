"""The accelerate door: a user's own ``accelerate.Accelerator`` loop trains with Ulysses on FSDP2.

Legend: ``P`` processes, ``dp x sp = P``; ``B`` rows of a dp group's micro-batch, ``S`` their
full length, ``s`` this sp rank's slice of it, ``V`` the vocabulary.

A stock loop adopts it by changing the line that builds the accelerator::

    from dtensor_ulysses.hf import UlyssesAccelerator
    accelerator = UlyssesAccelerator(gradient_accumulation_steps=2, sp=2)  # was Accelerator(...)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss                 # unchanged: the model's own loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Launched on ``P`` processes (``torchrun``, or ``accelerate launch`` with flags or a config file,
GPU or CPU), it logs what the same loop logs on ``dp`` processes under the stock
``Accelerator`` (one process at ``dp = 1``) on the same global batch: every loss, gradient
norm and evaluation metric, and the same updates.

* **The degree** comes from accelerate's own parallelism configuration, where accelerate users
  put the context-parallel degree: ``parallelism_config=ParallelismConfig(dp_shard_size=A,
  cp_size=N)``, or the ``parallelism_config_*`` keys of an ``accelerate`` config file /
  ``accelerate launch`` flags (``--parallelism_config_cp_size N``); ``cp_size`` is taken as the
  Ulysses degree, and accelerate's own context parallelism (ring attention) stays off for this
  accelerator. Or explicitly: ``sp=N``. ``dp = P / sp``.
* **One mesh**: the ``("dp", "sp")`` mesh (``sp`` innermost, as accelerate orders
  ``(dp_shard, cp)``) is built once, here, and is the accelerator's
  ``torch_device_mesh``; FSDP2 shards over its flattened ``dp x sp`` ranks (what accelerate's
  FSDP2 does over ``dp_shard x cp``). accelerate itself runs as a plain multi-process
  accelerator (``MULTI_GPU``, or ``MULTI_CPU`` on a machine without GPUs): its
  ``parallelism_config`` is ``None`` and its FSDP plugin unused; an FSDP2 plugin's
  ``activation_checkpointing`` and ``cpu_offload`` are honoured.
* **prepare**: each model (a transformers causal LM, or a PEFT model around one: LoRA and the
  other adapters on the layers' weights, added before ``prepare``) is checked
  (:func:`~dtensor_ulysses.hf.models.routing.check_supported`: refused with the reason),
  starts from rank 0's weights, and goes through
  :func:`~dtensor_ulysses.hf.models.parallelize.parallelize_root` (every attention layer through
  the engine, optional activation checkpointing, ``fully_shard`` over ``dp x sp`` with
  gradients summed); the optimizer built on the model's parameters before ``prepare`` is moved
  to the sharded ones (as accelerate's FSDP2 does). Data loaders are sharded over the ``dp``
  ranks only: every rank of an sp group reads the same rows (accelerate's sampler, epochs and
  ``skip_first_batches`` unchanged). Learning-rate schedulers step ``dp`` times per optimizer
  step (the stock accelerator steps them once per process, and the stock loop has ``dp``).
* **The model's forward** (hooks on the prepared model) takes the dp group's full rows, as the
  loader gives them, and runs this rank's slice (:func:`~dtensor_ulysses.hf.shard_batch`: labels
  shifted over the full row, padding and packed documents as the engine's layout). Its
  ``loss`` is the stock model's on those rows: the cross entropy summed over every slice,
  divided by the rows' valid targets (or by ``num_items_in_batch`` when given, as
  transformers does), plus the weighted router loss of a Mixture-of-Experts model over the
  rows' tokens when the stock forward adds one. Its value is that number on every rank of the
  sp group (one all-reduce); its gradient is this rank's part divided by ``dp``, so FSDP2's sum
  over ``dp x sp`` is the stock loop's gradient averaged over its ``dp`` processes, and
  ``accelerator.backward`` (its division by the accumulation steps) is the stock one. Any
  differentiable function of the loss keeps this property. ``logits`` is this rank's
  ``[B, s, V]`` slice in training; without gradients (``torch.no_grad()``: evaluation) the
  full ``[B, S, V]`` (gathered over sp), so metrics read what they read on one process.
  Packed documents (position ids restarting at 0) are kept apart exactly where the stock model
  keeps them apart (see ``_SliceStep.isolates``).
* **The rest of the loop**: ``accumulate`` (FSDP2 skips the gradient reduce-scatter between
  synchronizing micro-batches, as under accelerate's FSDP2), ``clip_grad_norm_`` (the norm of
  the sharded gradients, a plain tensor), ``gather_for_metrics`` (over the dp ranks only, the
  last batch's duplicates dropped as stock), ``get_state_dict`` (the full state on the main
  process), ``save_state`` / ``load_state`` (the full weights, as a single-process run writes
  them, and the full optimizer state keyed by parameter name; each rank loads its shard), and
  ``unwrap_model(model).save_pretrained(dir)`` called on every rank (full weights gathered; a
  PEFT model writes its adapter, as stock).
* **The data-parallel view**: ``num_processes`` is ``dp``, and ``gather`` / ``reduce`` run over
  the dp ranks, so what a loop computes from them (schedule lengths scaled by
  ``num_processes``, token counts gathered by hand for ``num_items_in_batch``, gathered
  evaluation losses cut to the dataset's length, throughput) is the stock loop's at ``dp``.
  ``process_index``, ``is_main_process`` and the files per process stay the ``P`` processes'
  (``state.num_processes`` is ``P``).

Refused in one line, before step 1: DeepSpeed or Megatron-LM as the accelerate backend, FSDP1,
accelerate's ``dynamo_backend`` (``torch.compile`` of the whole model) and fp8,
an FSDP2 ``mixed_precision_policy`` (precision is accelerate's ``mixed_precision``, as
autocast), tensor parallelism, accelerate's DeepSpeed sequence parallelism (``sp_size``),
``dp_replicate_size > 1``, ``sp=`` and ``cp_size`` that disagree, accelerate's own context
parallelism already on in this process, a process count that the degrees do not fit (both
numbers named), a launch that started one process (``accelerate launch`` without
``--multi_gpu`` on a machine without GPUs: the fix named), batches dispatched by rank 0,
models the routing refuses, PEFT's prompt learning (virtual tokens or a key/value prefix per
sequence; LoRA and the other adapters on the layers run), models other than causal LMs
(vision-language models: use
:func:`~dtensor_ulysses.hf.with_ulysses`), and batch keys or model arguments a slice cannot
honour.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import InitProcessGroupKwargs, ParallelismConfig, recursively_apply
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from dtensor_ulysses._exit import leave_together_at_exit
from dtensor_ulysses.data import IGNORE_INDEX
from dtensor_ulysses.hf.batch import ShardedBatch, shard_batch
from dtensor_ulysses.hf.models.moe import load_balancing_loss, router_loss_config
from dtensor_ulysses.hf.models.parallelize import parallelize_root
from dtensor_ulysses.hf.models.routing import (
    UnsupportedModelError,
    check_supported,
)
from dtensor_ulysses.hf.models.vision import is_vision_language
from dtensor_ulysses.hf.trainers import _accel, _state
from dtensor_ulysses.hf.trainers.base import _gather_seq, _targets
from dtensor_ulysses.hf.trainers.refusals import (
    _refusals_in_one_line,
    _refuse_attention_dropout,
    _refuse_batch_keys,
    _single_process_launch,
)
from dtensor_ulysses.models import cross_entropy_sum
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan import ParallelOptions
from dtensor_ulysses.plan.recipe import ACCELERATE

__all__ = ["UlyssesAccelerator"]

# the batch keys a slice reads; keyword arguments passed through to the model unchanged
_READ = {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"}
_PASS = {"use_cache", "output_router_logits", "return_dict", "logits_to_keep"}
_SETTINGS_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


# ----------------------------------------------------------------------------------------------
# the degrees: accelerate's parallelism configuration (or sp=), checked against the launch
# ----------------------------------------------------------------------------------------------
def _user_parallelism(config: ParallelismConfig | None) -> ParallelismConfig | None:
    """The parallelism configuration the stock ``Accelerator`` would use: the one given, else
    (as accelerate reads a config file / ``accelerate launch`` flags) the environment's."""
    if config is not None:
        return config
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return ParallelismConfig()
    return None


def _degrees(sp: int | None, config: ParallelismConfig | None, world: int) -> ParallelDims:
    """``(dp, sp)`` for ``world`` processes (``0``: no launcher) from ``sp=`` and accelerate's
    configuration.

    Raises:
        ValueError: a setting the door cannot run, disagreeing degrees, or a process count the
            degrees do not fit (both numbers named).
    """
    if sp is not None and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
        raise ValueError(f"sp={sp!r} is not a positive int; use sp >= 1 (e.g. sp=2)")
    cp = dp_shard = 1
    if config is not None:
        if (config.tp_size or 1) > 1:
            raise ValueError(
                f"parallelism_config tp_size={config.tp_size}: tensor parallelism cannot run "
                f"with the Ulysses door; set tp_size=1"
            )
        if (config.sp_size or 1) > 1:
            raise ValueError(
                f"parallelism_config sp_size={config.sp_size} is accelerate's DeepSpeed "
                f"sequence parallelism; for Ulysses on FSDP2 give the degree as cp_size="
                f"{config.sp_size} (or sp={config.sp_size}) and set sp_size=1"
            )
        if (config.dp_replicate_size or 1) > 1:
            raise ValueError(
                f"parallelism_config dp_replicate_size={config.dp_replicate_size}: the door "
                f"shards over all dp x sp ranks (no replicated groups); use dp_shard_size="
                f"{config.dp_replicate_size * (config.dp_shard_size or 1)} instead"
            )
        cp, dp_shard = config.cp_size or 1, config.dp_shard_size or 1
    if sp is not None and cp > 1 and sp != cp:
        raise ValueError(
            f"sp={sp} and parallelism_config cp_size={cp}: the door takes cp_size as the "
            f"Ulysses degree, and accelerate's own context parallelism (ring attention) cannot "
            f"run beside it; give one degree (sp={sp} with cp_size=1, or cp_size alone)"
        )
    degree = sp if sp is not None else cp
    if sp is None and cp == 1 and config is None:
        raise ValueError(
            "UlyssesAccelerator needs the Ulysses degree: pass sp=N, or "
            "parallelism_config=ParallelismConfig(cp_size=N) (or the parallelism_config_cp_size "
            "key of the accelerate config)"
        )
    if world == 0:  # no launcher: one process
        if degree > 1:
            raise ValueError(_single_process_launch(f"UlyssesAccelerator(sp={degree})", degree))
        raise ValueError(
            "UlyssesAccelerator(sp=1) runs under a distributed launch (torchrun --nproc-per-node "
            "P, or accelerate launch --multi_gpu --num_processes P); on one process use the "
            "stock Accelerator"
        )
    if dp_shard > 1:  # the configuration names the whole layout
        if dp_shard * degree != world:
            raise ValueError(
                f"parallelism_config dp_shard_size={dp_shard} x cp_size={degree} = "
                f"{dp_shard * degree} processes, but the launch started {world}; launch "
                f"{dp_shard * degree} processes or set dp_shard_size={max(world // degree, 1)}"
            )
        return ParallelDims(dp=dp_shard, sp=degree)
    if world % degree:
        raise ValueError(
            f"sp={degree} does not divide the {world} processes of this launch; launch a "
            f"multiple of {degree} processes (accelerate launch --num_processes, torchrun "
            f"--nproc-per-node) or choose sp among the divisors of {world}"
        )
    return ParallelDims(dp=world // degree, sp=degree)


def _fsdp_options(plugin: Any) -> dict[str, Any]:
    """The options an accelerate FSDP plugin asks for that the door honours.

    Raises:
        ValueError: FSDP1, or an explicit FSDP2 mixed-precision policy.
    """
    if plugin is None:
        return {}
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            f"the accelerate FSDP plugin has fsdp_version={plugin.fsdp_version}: the door "
            f"shards with FSDP2 over dp x sp; set fsdp_version: 2 (or drop the FSDP config)"
        )
    if getattr(plugin, "mixed_precision_policy", None) is not None:
        raise ValueError(
            "the accelerate FSDP2 plugin sets a mixed_precision_policy: under the door the "
            "precision is the accelerator's mixed_precision ('bf16': autocast, as without FSDP); "
            "drop the policy and pass mixed_precision='bf16'"
        )
    out: dict[str, Any] = {}
    if getattr(plugin, "activation_checkpointing", False):
        out["activation_checkpointing"] = True
    offload = getattr(plugin, "cpu_offload", None)  # FSDP2's OffloadPolicy() offloads nothing
    if isinstance(offload, CPUOffloadPolicy):
        out["offload_params"] = True
    return out


@contextlib.contextmanager
def _without(names: tuple[str, ...]) -> Iterator[None]:
    """The environment without ``names`` inside the block (restored after)."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# ----------------------------------------------------------------------------------------------
# the accelerator
# ----------------------------------------------------------------------------------------------
class UlyssesAccelerator(_accel._UlyssesAccelerator, Accelerator):
    """An ``accelerate.Accelerator`` whose prepared models train with Ulysses on FSDP2 over the
    ``("dp", "sp")`` mesh (see the module docstring for what each method does).

    Args:
        sp: the Ulysses degree; default: the ``cp_size`` of accelerate's parallelism
            configuration (``parallelism_config=`` or the accelerate config / launch flags).
        options: the recipe, a :class:`~dtensor_ulysses.plan.ParallelOptions`; or, instead,
            its fields this door applies as keywords (``ParallelOptions.fields(ACCELERATE)``):
            ``activation_checkpointing`` (also turned on by an FSDP2 plugin's
            ``activation_checkpointing`` or a model whose gradient checkpointing was enabled),
            ``offload_activations``, ``offload_params`` (also an FSDP2 plugin's
            ``cpu_offload``), ``head_chunks``, ``attention_backend``, ``allow_uneven_heads``.
            The precision is accelerate's ``mixed_precision`` (autocast).
        **kwargs: ``accelerate.Accelerator``'s arguments, by keyword (and the options' fields,
            when ``options`` is not given).

    Raises:
        ValueError: a setting the door cannot make exact, or a launch whose process count does
            not fit the degrees (one line under a launch).
    """

    _du_dims: ParallelDims  # bound to the mesh
    _du_options: ParallelOptions
    _du_compute_dtype: torch.dtype | None

    @_refusals_in_one_line
    def __init__(
        self,
        *args: Any,
        sp: int | None = None,
        options: ParallelOptions | None = None,
        **kwargs: Any,
    ) -> None:
        # the recipe: a ParallelOptions, or its fields this door applies as keywords (the
        # precision is accelerate's mixed_precision, not an FSDP2 policy)
        keywords = {k: kwargs.pop(k) for k in ParallelOptions.fields(ACCELERATE) if k in kwargs}
        chosen = ParallelOptions.at_door(options, keywords, door=ACCELERATE, whole=True)
        if args:  # Accelerator's positional order, as keywords
            names = list(inspect.signature(Accelerator.__init__).parameters)[1:]
            kwargs.update(zip(names, args))
        _refuse_backends(kwargs)
        config = _user_parallelism(kwargs.pop("parallelism_config", None))
        world = int(os.environ.get("WORLD_SIZE", "0"))  # 0: no launcher
        dims = _degrees(sp, config, world)
        plugin = kwargs.pop("fsdp_plugin", None)
        if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()  # the config file's fsdp_* keys
        options = replace(chosen, **_fsdp_options(plugin), mixed_precision=None)
        options.check(hf_model=True)
        # the process group first (NCCL with gloo for host tensors on CUDA), then accelerate
        # as a plain multi-process accelerator on it (on CPU: MULTI_CPU)
        timeout = next((h.timeout for h in kwargs.get("kwargs_handlers") or []
                        if isinstance(h, InitProcessGroupKwargs)), None)  # fmt: skip
        cpu = bool(kwargs.pop("cpu", False)) or not torch.cuda.is_available()
        mesh = dims.build_mesh(
            "cpu" if cpu else "cuda", timeout_s=timeout.total_seconds() if timeout else None
        )
        self._du_dims, self._du_options = ParallelDims.from_mesh(mesh), options
        with _without(_SETTINGS_ENV):
            super().__init__(cpu=cpu, **kwargs)
        kind = str(self.distributed_type)
        if self.parallelism_config is not None and self.parallelism_config.cp_enabled:
            raise ValueError(
                f"accelerate's own context parallelism (cp_size="
                f"{self.parallelism_config.cp_size}, ring attention) is already on in this "
                f"process (an Accelerator built before this one); build only the "
                f"UlyssesAccelerator, which takes cp_size as the Ulysses degree"
            )
        if self.state.num_processes != world or kind.endswith(("FSDP", "DEEPSPEED", "MEGATRON")):
            raise ValueError(
                f"accelerate runs {kind} on {self.state.num_processes} of the {world} processes "
                f"(an accelerator state created before this one?); build the UlyssesAccelerator "
                f"first in the script"
            )
        self._du_compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            str(self.mixed_precision)
        )
        self._du_moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        self.state.device_mesh = mesh  # the one mesh: accelerate's torch_device_mesh
        leave_together_at_exit()
        if dist.get_rank() == 0:
            where = f"sp={sp}" if sp is not None else "parallelism_config cp_size"
            print(
                f"UlyssesAccelerator: sequence parallelism on: mesh dp={dims.dp} x sp="
                f"{dims.sp} ({world} processes, {mesh.device_type}; the degree from {where})",
                flush=True,
            )

    # ------------------------------------------------------------------------------------------
    # prepare
    # ------------------------------------------------------------------------------------------
    @_refusals_in_one_line
    def prepare(self, *args: Any, device_placement: Any = None):
        result = super().prepare(*args, device_placement=device_placement)
        self._du_switch_optimizers()
        return result

    def prepare_model(self, model: nn.Module, device_placement: Any = None,
                      evaluation_mode: bool = False):  # fmt: skip
        if not isinstance(model, FSDPModule):
            model = self._du_parallelize(model)
        return super().prepare_model(model, device_placement, evaluation_mode)

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None):
        out = super().prepare_optimizer(optimizer, device_placement=device_placement)
        self._du_switch_optimizers()
        return out

    def prepare_scheduler(self, scheduler: Any):
        out = super().prepare_scheduler(scheduler)
        if type(out) is AcceleratedScheduler:
            out.__class__ = _DpScheduler
            out.dp = self._du_dims.dp
        return out

    def prepare_data_loader(self, data_loader: Any, device_placement: Any = None,
                            slice_fn_for_dispatch: Any = None):  # fmt: skip
        if device_placement is None:
            device_placement = self.device_placement
        dispatch = self.dispatch_batches
        if dispatch is None:  # accelerate's rule
            dispatch = bool(device_placement) and isinstance(
                data_loader.dataset, torch.utils.data.IterableDataset
            )
        if dispatch and not getattr(data_loader, "_is_accelerate_prepared", False):
            raise ValueError(
                "the data loader would be dispatched (rank 0 reads each batch and sends every "
                "process its own part; accelerate's default for an IterableDataset), but the sp "
                "ranks of a dp group need the same rows; pass dataloader_config="
                "DataLoaderConfiguration(dispatch_batches=False)"
            )
        return super().prepare_data_loader(
            data_loader, device_placement=device_placement,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
        )  # fmt: skip

    def _du_parallelize(self, model: nn.Module) -> nn.Module:
        hf: Any = _state.base_model(model)
        name = type(hf).__name__
        if is_vision_language(hf):
            raise UnsupportedModelError(
                f"{name}: vision-language models are not supported by the accelerate door yet "
                f"(their images are split over the sp group inside the Trainer door); train it "
                f"with with_ulysses(transformers.Trainer or trl.SFTTrainer, sp=...)"
            )
        if not name.endswith("ForCausalLM"):
            raise UnsupportedModelError(
                f"{name}: the door trains causal language models (...ForCausalLM), whose loss is "
                f"the token cross entropy of the labels"
            )
        _refuse_prompt_learning(model, name)
        check_supported(hf)
        _refuse_attention_dropout(model, None)
        options = self._du_options
        on = getattr(hf, "is_activation_checkpointing", None)  # transformers >= 5.x spelling
        if on is None:
            on = getattr(hf, "is_gradient_checkpointing", False)
        if on:  # transformers' checkpointing becomes ours: per layer, inside FSDP2
            getattr(hf, "activation_checkpointing_disable", hf.gradient_checkpointing_disable)()
            options = replace(options, activation_checkpointing=True)
        old = {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}
        attn_implementation = hf.config._attn_implementation  # the stock model's
        group = self._du_dims.flat_mesh.get_group()
        moved = _state.start_from_rank0(model, group, self.device)
        if moved and dist.get_rank() == 0:
            more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
            print(
                f"UlyssesAccelerator: {len(moved)} tensor(s) differed between ranks "
                f"({', '.join(moved[:3])}{more}); every rank now starts from rank 0's",
                flush=True,
            )
        model = parallelize_root(
            model, hf, self._du_dims.world_mesh, options, compute_dtype=self._du_compute_dtype
        )
        new = dict(model.named_parameters(remove_duplicate=False))
        for key, (n, p) in old.items():
            if n in new and new[n] is not p:
                self._du_moved[key] = (weakref.ref(p), new[n])
        _SliceStep(self, model, hf, attn_implementation).install()
        if dist.get_rank() == 0:
            print(_describe(hf, self._du_dims, options, self._du_compute_dtype), flush=True)
        return model

    def _du_switch_optimizers(self) -> None:
        """Point every prepared optimizer at the sharded parameters (its parameters from before
        ``prepare`` replaced by name), and give it the full-state ``state_dict``."""
        for opt in self._optimizers:
            for group in opt.param_groups:
                params = group["params"]
                for i, p in enumerate(params):
                    entry = self._du_moved.get(id(p))
                    if entry is not None and entry[0]() is p:
                        params[i] = entry[1]
            if type(opt) is AcceleratedOptimizer:
                owner = self._du_owner(opt)
                if owner is not None:
                    opt.__class__ = _FullStateOptimizer
                    opt._du_model = owner

    def _du_owner(self, opt: Any) -> nn.Module | None:
        """The prepared model that holds every parameter of ``opt`` (``None``: no prepared
        model's)."""
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for model in self._models:
            if isinstance(model, FSDPModule) and isinstance(model, nn.Module):
                own = {id(p) for p in model.parameters()}
                if ids <= own:
                    return model
                if ids & own:
                    raise ValueError(
                        f"an optimizer holds {len(ids & own)} parameters of a prepared model "
                        f"and {len(ids - own)} others: its state could not be saved as one "
                        f"model's; build one optimizer per model"
                    )
        return None

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if isinstance(model, FSDPModule):  # no reduce-scatter until the synchronizing step
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            with super().no_sync(model):
                yield

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None) -> Iterator[None]:  # fmt: skip
        """Nothing to do: the prepared model splits the sequence itself; the buffers stay
        whole (accelerate's own context parallelism is off under the door)."""
        yield

    # ------------------------------------------------------------------------------------------
    # the data-parallel view: what the loop sees of the processes is the stock loop's dp
    # ------------------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        """``dp``: the processes of the stock loop this one equals (the launch has
        ``dp x sp``: ``state.num_processes``)."""
        return self._du_dims.dp

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.state.num_processes - 1

    def gather(self, tensor: Any) -> Any:
        """accelerate's ``gather`` over the dp ranks (one value per dp group, as the stock
        loop's processes give them); tensors of unequal length in dim 1 are padded with -100."""
        return _dp_gather_nested(tensor, self._du_dims.dp_mesh.get_group())

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """accelerate's ``reduce`` (``"sum"``, ``"mean"``, ``"none"``) over the dp ranks."""
        group = self._du_dims.dp_mesh.get_group()

        def one(t: torch.Tensor) -> torch.Tensor:
            if reduction == "none":
                return t
            out = t.clone()
            dist.all_reduce(out, group=group)
            return out / dist.get_world_size(group) if reduction == "mean" else out

        return recursively_apply(one, tensor, error_on_other_type=True)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's ``gather_for_metrics`` over the dp ranks only (the sp ranks of a dp
        group hold the same rows): the last batch's duplicated rows dropped as stock."""
        group = self._du_dims.dp_mesh.get_group()
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        if tensors:
            data = self.gather(input_data)
        else:
            parts: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, input_data, group=group)
            data = [x for part in parts for x in part]
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        if not tensors:
            return data[: state.remainder]
        return recursively_apply(lambda t: t[: state.remainder], data)

    # ------------------------------------------------------------------------------------------
    # files
    # ------------------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """The full state of a prepared model on the main process (``{}`` elsewhere); call on
        every process."""
        if isinstance(model, FSDPModule):
            return _state.full_model_state(model)
        return super().get_state_dict(model, unwrap=unwrap)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:  # fmt: skip
        handle = self.register_load_state_pre_hook(self._du_load_models)
        try:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            handle.remove()

    def _du_load_models(self, models: list, input_dir: str) -> None:
        """The prepared models' full weights from ``save_state``'s files, each rank keeping its
        shard (the stock loader would copy full tensors into shards)."""
        for model in list(models):
            if not (isinstance(model, FSDPModule) and isinstance(model, nn.Module)):
                continue
            i = self._models.index(model)
            stem = "model" if i == 0 else f"model_{i}"
            safe = os.path.join(input_dir, f"{stem}.safetensors")
            pt = os.path.join(input_dir, f"pytorch_{stem}.bin")  # safe_serialization=False
            if os.path.isfile(safe):
                full = load_file(safe)
            elif os.path.isfile(pt):
                full = torch.load(pt, map_location="cpu", weights_only=True)
            else:
                raise ValueError(f"{input_dir!r} has no {stem}.safetensors to load model {i} from")
            _load_full(model, full, input_dir)
            models.remove(model)


class _DpScheduler(AcceleratedScheduler):
    """accelerate's scheduler, stepped ``dp`` times per optimizer step (the stock one steps once
    per process, and ``dp`` processes make the stock loop's global batch)."""

    dp: int

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer or self.split_batches:
            return super().step(*args, **kwargs)
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return None
        if any(opt.step_was_skipped for opt in self.optimizers):
            return None
        for _ in range(self.dp):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
        return None


class _FullStateOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer whose state dict is the full one keyed by parameter names (on the
    main process; a collective), as a single-process run writes it; loading keeps each rank's
    shard."""

    _du_model: nn.Module

    def state_dict(self) -> dict:
        return _state.optimizer_state(self._du_model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        _state.load_optimizer_state(self._du_model, self.optimizer, state_dict)


# ----------------------------------------------------------------------------------------------
# the model's forward: full rows in, this rank's slice through the model, the stock loss out
# ----------------------------------------------------------------------------------------------
class _SliceStep:
    """The hooks a prepared model gets: the pre-hook slices the call's rows; the post-hook
    turns the slice's output into the stock model's (loss, router loss, logits)."""

    def __init__(self, accelerator: UlyssesAccelerator, model: nn.Module, hf: Any,
                 attn_implementation: str) -> None:  # fmt: skip
        self.dims = accelerator._du_dims
        self.sp_group = self.dims.sp_mesh.get_group()
        self.model, self.hf = model, hf
        self.router = router_loss_config(hf)
        self.attn_implementation = str(attn_implementation)
        self.call: tuple[ShardedBatch, Any, dict] | None = None  # the forward under way

    def install(self) -> None:
        self.model.register_forward_pre_hook(self.pre, with_kwargs=True)
        self.model.register_forward_hook(self.post, with_kwargs=True)
        # the full weights from unwrap_model(model).save_pretrained(dir), on every rank
        self.model.__dict__["save_pretrained"] = self.save_pretrained

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        batch = dict(kwargs)
        if args:
            if len(args) > 1 or "input_ids" in batch:
                raise ValueError(
                    "call the prepared model with keyword arguments (model(**batch)); only "
                    "input_ids may be positional"
                )
            batch["input_ids"] = args[0]
        if batch.get("past_key_values") is not None:
            raise UnsupportedModelError(
                "a KV cache (past_key_values) cannot be used under Ulysses: each rank holds one "
                "slice of the sequence; generate on one device from the saved weights"
            )
        if batch.get("return_dict") is False:
            raise ValueError("return_dict=False: the door returns the model's output object")
        if batch.get("logits_to_keep", 0) not in (0, None):
            raise ValueError(
                f"logits_to_keep={batch['logits_to_keep']}: each rank holds one slice of the "
                f"sequence; compute the logits of every position (logits_to_keep=0)"
            )
        num_items = batch.pop("num_items_in_batch", None)
        _refuse_batch_keys(batch, _READ, _PASS, "the prepared model")
        other = sorted(k for k, v in batch.items() if k not in _READ | _PASS and v is not None)
        if other:
            raise ValueError(
                f"model arguments {other} are not supported by the prepared model (it takes the "
                f"dp group's full rows: {sorted(_READ)}, and {sorted(_PASS)}; hidden states and "
                f"attention weights would be this rank's slice); leave them out"
            )
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("pass input_ids, a [B, S] tensor of the dp group's full rows")
        labels = _labels(batch)
        rows = {**batch, "labels": labels}
        pos: torch.Tensor | None = batch.get("position_ids")
        if pos is not None and not self.isolates(batch):
            # positions restart, the documents attend to each other (see isolates): the
            # layout from the padding alone, the positions cut as given
            del rows["position_ids"]
            sb = shard_batch(rows, self.dims, count_valid=False)
            lo, s = sb.layout.offset(self.dims.sp_rank), sb.input_ids.shape[1]
            sb.position_ids = pos.to(ids.device).expand(ids.shape)[:, lo : lo + s]
        else:
            sb = shard_batch(rows, self.dims, count_valid=False)
        n = None
        if labels is not None:
            n = num_items if num_items is not None else _targets({**batch, "labels": labels})
        want_router = batch.get(
            "output_router_logits", getattr(self.hf.config, "output_router_logits", False)
        )
        extra = {k: batch[k] for k in ("output_router_logits", "return_dict") if k in batch}
        extra["use_cache"] = False
        if want_router and self.router is not None:
            extra["output_router_logits"] = True
        self.call = (sb, n, batch)
        return (), {**sb.model_inputs(), **extra}

    def isolates(self, batch: Mapping[str, Any]) -> bool:
        """Whether the stock model keeps packed documents (position ids restarting at 0) apart:
        transformers derives documents from the position ids only without an
        ``attention_mask``, and then, with flash-attention, for one row only, otherwise only
        without a KV cache (``use_cache``, default the config's, builds one even in training).
        Where it does not, the documents attend to each other (their positions restart)."""
        if batch.get("attention_mask") is not None:
            return False
        if "flash" in self.attn_implementation:
            return int(batch["input_ids"].shape[0]) == 1
        use_cache = batch.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.hf.config, "use_cache", None)
        if use_cache is None:
            use_cache = getattr(self.hf.config.get_text_config(), "use_cache", False)
        return not use_cache

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        assert self.call is not None
        (sb, n, batch), self.call = self.call, None
        dp = self.dims.dp
        local = None
        if n is not None:  # the stock loss: the rows' cross entropy / their valid targets
            local = cross_entropy_sum(output.logits, sb.labels) / n
        router = None
        if kwargs.get("output_router_logits") and getattr(output, "router_logits", None):
            assert self.router is not None
            mask = batch.get("attention_mask")
            if mask is not None:  # this rank's columns of its rows
                lo = sb.layout.offset(self.dims.sp_rank)
                mask = mask[:, lo : lo + sb.input_ids.shape[1]]
            router = load_balancing_loss(output.router_logits, self.router.num_experts,
                                         self.router.top_k, self.sp_group, valid=mask)  # fmt: skip
            output.aux_loss = router.value
            if local is not None:
                local = local + self.router.coef * router.share.to(local.dtype)
        if local is not None:
            total = local.detach().clone()
            if self.dims.sp > 1:
                dist.all_reduce(total, group=self.sp_group)
            # the value: the stock loss of the dp group's rows; the gradient: this rank's part
            # of the average over the dp groups (FSDP2 sums over dp x sp)
            share = local / dp
            output.loss = total + (share - share.detach())
        if not torch.is_grad_enabled():  # evaluation: the full logits, as the stock model's
            output.logits = _gather_seq(output.logits, sb.layout, self.dims)
        return output

    def save_pretrained(self, save_directory: Any, *args: Any, state_dict: dict | None = None,
                        is_main_process: bool = True, **kwargs: Any) -> None:  # fmt: skip
        """transformers' ``save_pretrained`` with the full weights: without ``state_dict``
        they are gathered (a collective: call on every rank; the main process writes)."""
        if state_dict is None:
            state_dict = _state.full_model_state(self.model)
            is_main_process = is_main_process and dist.get_rank() == 0
            if not is_main_process:
                return
        cls: Any = type(self.model)
        cls.save_pretrained(self.model, save_directory, *args, state_dict=state_dict,
                            is_main_process=is_main_process, **kwargs)  # fmt: skip


def _labels(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """Unshifted labels equivalent to the batch's (``shift_labels`` as transformers reads
    them: already shifted, ``labels`` then unused), or ``None``.

    Raises:
        ValueError: a target the stock model counts that no slice can (a target at a padded
            position or from one: left padding; a last ``shift_labels`` column that is a target).
    """
    ids = batch["input_ids"]
    shifted = batch.get("shift_labels")
    if shifted is not None:
        shifted = shifted.to(ids.device, torch.int64)
        if (shifted[:, -1] != IGNORE_INDEX).any():
            raise ValueError(
                "shift_labels has targets in its last column (no next token there); pad it "
                "with -100: shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]"
            )
        labels = torch.full_like(shifted, IGNORE_INDEX)
        labels[:, 1:] = shifted[:, :-1]
    else:
        given = batch.get("labels")
        if given is None:
            return None
        labels = given.to(ids.device, torch.int64)
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = mask.to(labels.device).bool()
        stock = labels[:, 1:] != IGNORE_INDEX
        lost = stock & ~(mask[:, 1:] & mask[:, :-1])
        if lost.any():
            b = int(lost.nonzero()[0, 0])
            raise ValueError(
                f"row {b} has a target at or after a padded position (labels not -100 where "
                f"attention_mask is 0, or left padding: the first real token as the target of "
                f"padding), which the stock model counts and a sequence slice cannot; pad on "
                f"the right and set labels to -100 at padding (DataCollatorForLanguageModeling "
                f"does)"
            )
    return labels


def _dp_gather_nested(data: Any, group: dist.ProcessGroup) -> Any:
    """:func:`~dtensor_ulysses.hf.trainers._accel.dp_gather` through mappings too."""
    if isinstance(data, Mapping):
        return type(data)({k: _dp_gather_nested(v, group) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (tuple, list)):
        return type(data)(_dp_gather_nested(d, group) for d in data)
    return _accel.dp_gather(data, group=group)


def _load_full(model: nn.Module, full: dict[str, torch.Tensor], where: str) -> None:
    """Fill the sharded ``model`` from a full state dict (names of ``model.state_dict()``);
    each rank keeps its shard.

    Raises:
        ValueError: a weight of the model missing (tied output heads excepted).
    """
    own = model.state_dict()
    hf: Any = _state.base_model(model)
    tied = bool(getattr(hf.config.get_text_config(), "tie_word_embeddings", False))
    missing = [k for k in own if k not in full and not (tied and "lm_head" in k)]
    if missing:
        raise ValueError(f"{where!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    kept: dict[str, Any] = {k: v for k, v in full.items() if k in own}
    set_model_state_dict(model, kept, options=StateDictOptions(full_state_dict=True, strict=False))


def _refuse_prompt_learning(model: nn.Module, name: str) -> None:
    """PEFT's prompt learning (prompt tuning, P-tuning, prefix tuning, ...) adds virtual tokens,
    or a key/value prefix, to every sequence inside the model's forward: a rank's slice would get
    its own copy. Adapters on the layers (LoRA and the like) are token-wise and run as they are.

    Raises:
        UnsupportedModelError: a prompt-learning adapter on ``model``.
    """
    configs = getattr(model, "peft_config", None) if _state.is_peft(model) else None
    found = [f"{adapter!r} ({getattr(cfg.peft_type, 'value', cfg.peft_type)})"
             for adapter, cfg in (configs or {}).items()
             if getattr(cfg, "is_prompt_learning", False)]  # fmt: skip
    if found:
        raise UnsupportedModelError(
            f"{name} has the PEFT prompt-learning adapter {', '.join(found)}: it adds virtual "
            f"tokens (or a key/value prefix) to every sequence, which a rank's sequence slice "
            f"cannot hold; use an adapter on the layers' weights (LoRA, IA3, ...)"
        )


def _refuse_backends(kwargs: dict) -> None:
    """DeepSpeed, Megatron-LM, accelerate's tensor-parallel plugin, its ``torch.compile`` of the
    model and fp8, from the arguments or the environment an accelerate config sets."""
    on = lambda name: os.environ.get(name, "false").lower() == "true"  # noqa: E731
    if (
        kwargs.get("deepspeed_plugin")
        or kwargs.get("deepspeed_plugins")
        or on("ACCELERATE_USE_DEEPSPEED")
    ):
        raise ValueError(
            "DeepSpeed is the accelerate backend (a deepspeed plugin or the config's "
            "distributed_type: DEEPSPEED): it shards and reduces the model itself; the door "
            "shards with FSDP2 - launch with distributed_type MULTI_GPU or FSDP (fsdp_version 2)"
        )
    if kwargs.get("megatron_lm_plugin") or on("ACCELERATE_USE_MEGATRON_LM"):
        raise ValueError("Megatron-LM is the accelerate backend; the door shards with FSDP2")
    if kwargs.get("torch_tp_plugin") is not None:
        raise ValueError("torch_tp_plugin: tensor parallelism cannot run with the Ulysses door")
    plugin = kwargs.get("dynamo_plugin")
    dynamo = str(kwargs.get("dynamo_backend") or getattr(plugin, "backend", None)
                 or os.environ.get("ACCELERATE_DYNAMO_BACKEND") or "no")  # fmt: skip
    if dynamo.lower().removeprefix("dynamobackend.") != "no":
        raise ValueError(
            f"dynamo_backend={dynamo}: accelerate's torch.compile of the whole model is not "
            f"supported under the door (its forward slices the batch); set dynamo_backend='no'"
        )
    precision = str(kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION"))
    if precision.lower() == "fp8":
        raise ValueError("mixed_precision='fp8' is not supported under the door; use 'bf16'")


def _describe(hf: Any, dims: ParallelDims, options: ParallelOptions,
              compute: torch.dtype | None) -> str:  # fmt: skip
    """One line per prepared model: its heads per rank, the kernel per layer kind, precision,
    features."""
    from dtensor_ulysses.attention import describe_kernels, model_kernels

    n = hf.config.get_text_config().num_attention_heads
    per_rank = f"{n // dims.sp} per rank" if n % dims.sp == 0 else f"uneven over {dims.sp} ranks"
    name = next(c.__name__ for c in type(hf).__mro__ if not issubclass(c, FSDPModule))
    params = str(next(iter(hf.parameters())).dtype).replace("torch.", "")
    precision = (f"{str(compute).replace('torch.', '')} autocast ({params} parameters)"
                 if compute is not None else f"{params} compute")  # fmt: skip
    features = [f for f, on in (("activation checkpointing", options.activation_checkpointing),
                                ("offloaded activations", options.offload_activations),
                                ("offloaded parameters", options.offload_params),
                                (f"head chunks {options.head_chunks}", options.head_chunks > 1),
                                ("uneven heads", options.allow_uneven_heads)) if on]  # fmt: skip
    return (
        f"UlyssesAccelerator: {name} {n} q heads ({per_rank}), attention kernel "
        f"{describe_kernels(model_kernels(hf))}, {precision}, features: "
        f"{', '.join(features) or 'none'}"
    )
