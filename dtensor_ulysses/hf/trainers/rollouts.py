"""On-policy rollouts under :func:`~dtensor_ulysses.hf.with_ulysses`: what the trainers that build
their inputs by generation (TRL's ``GRPOTrainer``, ``RLOOTrainer``; its ``DistillationTrainer``)
share.

Legend: ``n`` rollouts (rows) of this dp group's round, ``P`` ranks of its sp group, ``r``
this rank's rollouts (its contiguous ``1/P`` share).

* **The stock rank's step, over dp.** The sp ranks of a group are replicas of one stock rank for
  everything outside the model's forward: the stock trainer's gathers and reductions over its
  ranks (``accelerator.gather`` / ``reduce`` / ``num_processes`` / ``process_index`` and the
  module-level ``gather`` / ``gather_object`` of its TRL module) run over dp
  (:meth:`_Rollouts._du_dp_view`), and every rank draws from the random stream of the stock rank
  with its dp index.
* **One generation per sp group.** A round's ``n`` rollouts are split into ``P`` contiguous
  shares (:func:`rollout_shares`); each rank makes its own share with the stock trainer's own
  ``_generate`` (tokenization, ``_generate_single_turn``, the tool loop, a ``rollout_func``), and
  the shares are exchanged with one ``all_gather_object`` over sp. The stock ``_generate`` then
  runs again on the whole round, with its generation steps *replayed* from the shares, so its
  bookkeeping (decoding, completion lengths, tool metrics, token counts) is the stock rank's.
  A ``rollout_func`` is called once per dp group, by sp rank 0, with the stock rank's prompts
  (its output, whatever it computes, is the stock rank's; it is the user's generation, not
  split here). Decoding work per rank falls as ``1/P``.
* **Weights gathered once per round** (:data:`~dtensor_ulysses.plan.generation.GATHER_MODES`):
  every FSDP2 unit is all-gathered when the round starts and resharded when it ends, so decoding
  needs no collective; when that does not fit the preflight's estimate (or
  ``ds3_gather_for_generation=False``), each decoder layer is gathered per decoding step and
  every rank steps until the slowest is done (``synced_gpus``; single-turn rollouts only).
* **Decoding that does not depend on the split.** Greedy decoding is row-wise. Sampling draws
  each rollout's tokens from its own generator (:class:`_PerRolloutSampler`: the processed
  distribution of transformers' logits processors and warpers, one ``torch.multinomial`` per
  rollout and token), seeded by the run's seed, the dp index, the step, the round and the
  rollout's index in its dp group (and its turn): the same seed gives the same rollouts at every
  sp. The stock trainer draws all rows of a rank from one stream, so its samples differ (the
  distribution is the same). Rounds run on a copy of torch's random stream (``fork_rng``), so
  the trainer's own draws (shuffles) do not depend on what the rollouts drew.
* **Tools and environments once per rollout per dp group.** Each rollout's environment is
  made, ``reset`` and stepped, and its tools called, on the one sp rank that owns the rollout;
  the ``reset`` observations are shared with one ``all_gather_object`` (every rank builds the
  same prompts). TRL's pool of instances is kept per rank: across the sp group as many instances
  as on the stock rank. A family scores each rollout on its owner too
  (:meth:`_Rollouts._du_owned_rollouts`: the environments a reward reads are there).

What a family provides: the TRL class names (:attr:`_Rollouts._du_trl_classes`, whose module's
``gather`` functions the dp view replaces) and a call to :meth:`_Rollouts._du_init_rollouts`
after the stock ``__init__``; it inherits ``_generate_and_score_completions`` (the dp view and
the round), ``_generate`` (the shares and the replay), ``_generate_single_turn`` and
``_tool_call_loop`` (the shares' decoding and tools; the replay), the stock step past the shared
base's token-row methods (``get_batch_samples``, ``prediction_step``, ``compute_loss`` in the dp
view with its gradient divided by dp, as FSDP2 sums over dp where DDP averages), and the helpers
:meth:`_Rollouts._du_own_rows`, :meth:`_Rollouts._du_owned_rollouts`,
:meth:`_Rollouts._du_sp_gather_object`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtensor_ulysses._torch_private import fsdp_param_dtype
from dtensor_ulysses.hf.models.causal_lm import config_head_dim
from dtensor_ulysses.hf.models.routing import plain_attention
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.hf.trainers._accel import dp_gather, dp_gather_object
from dtensor_ulysses.hf.trainers._generation import all_gathered, patched, set_up, synced_steps
from dtensor_ulysses.hf.trainers.base import _UlyssesTrainer
from dtensor_ulysses.hf.trainers.refusals import UnsupportedTrainerError
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan.generation import (
    GenerationMemory,
    choose_weight_gathering,
    kv_cache_bytes,
)
from dtensor_ulysses.plan.preflight import HEADROOM
from dtensor_ulysses.plan.splits import seq_split

__all__ = ["rollout_shares"]


def rollout_shares(n: int, sp: int, *, first_only: bool = False) -> list[tuple[int, int]]:
    """Each sp rank's ``[lo, hi)`` of a round's ``n`` rollouts: contiguous, balanced (the first
    ``n % sp`` ranks one more), or every rollout on rank 0 (``first_only``: a
    ``rollout_func``)."""
    if first_only:
        return [(0, n)] + [(n, n)] * (sp - 1)
    sizes = seq_split(n, sp) if n >= sp else [1] * n + [0] * (sp - n)
    starts = [sum(sizes[:k]) for k in range(sp)]
    return [(lo, lo + size) for lo, size in zip(starts, sizes)]


# ----------------------------------------------------------------------------------------------
# the stock trainer's collectives, over dp
# ----------------------------------------------------------------------------------------------
class _DpAccelerator:
    """Mixin placed over the accelerator's class inside :meth:`_Rollouts._du_dp_view`; with
    ``_du_local`` set (a rank making its share of a round), ``gather`` keeps this rank's
    values (the shares are exchanged afterwards)."""

    _du_dims: ParallelDims  # set by _accel.install
    _du_local: bool = False

    @property
    def process_index(self) -> int:
        return self._du_dims.dp_rank

    @property
    def num_processes(self) -> int:
        return self._du_dims.dp

    def gather(self, tensor: Any) -> Any:
        if self._du_local:
            return tensor
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


# ----------------------------------------------------------------------------------------------
# a round's state
# ----------------------------------------------------------------------------------------------
class _EnvironmentSlot:
    """What TRL's pool hands out for one rollout inside a round: ``reset`` returns the rollout's
    observation (made on its owner, shared over sp); on the owner, everything else is the real
    environment's."""

    def __init__(self, observation: Any, real: Any) -> None:
        self.__dict__["_du_observation"] = observation
        self.__dict__["_du_real"] = real

    def reset(self, **kwargs: Any) -> Any:
        return self.__dict__["_du_observation"]

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__["_du_real"]
        if real is None:
            raise RuntimeError(
                f"environment attribute {name!r} read on an sp rank that does not own the rollout "
                f"(with_ulysses steps each environment on its owner only)"
            )
        return getattr(real, name)


@dataclass
class _Round:
    """One round of rollouts of this dp group (see the module docstring)."""

    n: int
    shares: list[tuple[int, int]]
    key: tuple  # what the per-rollout seeds are drawn from (seed, dp, mode, step, round)
    phase: str = ""  # "own": making this rank's share; "replay": the stock bookkeeping
    recorded: dict[str, Any] = field(default_factory=dict)  # this rank's share's outputs
    merged: dict[str, Any] = field(default_factory=dict)  # every share's, in rollout order
    envs: list[Any] | None = None  # the environments of this rank's rollouts (real)
    streams: _RolloutStreams | None = None


class _RolloutStreams:
    """Which of this rank's rollouts each row of a ``_generate_single_turn`` call continues, and
    how many turns each has had: the first call holds every rollout of the share in order, a
    tool-loop call a subset, each row the rollout's whole history (prompt, completion so far,
    tool results) in rollout order."""

    def __init__(self, first: int) -> None:
        self.first = first  # the index of this rank's first rollout in its dp group's round
        self.seqs: list[list[int]] | None = None
        self.turns: list[int] = []

    def rows_of(self, prompt_ids: Sequence[Sequence[int]]) -> list[int]:
        rows = [list(p) for p in prompt_ids]
        if self.seqs is None:
            self.seqs, self.turns = rows, [0] * len(rows)
            return list(range(len(rows)))
        out, j = [], 0
        for row in rows:
            while j < len(self.seqs) and row[: len(self.seqs[j])] != self.seqs[j]:
                j += 1
            if j == len(self.seqs):
                raise RuntimeError("a generation row continues none of this rank's rollouts")
            out.append(j)
            j += 1
        return out

    def advance(self, index: list[int], rows: Sequence[Sequence[int]],
                completions: Sequence[Sequence[int]]) -> None:  # fmt: skip
        assert self.seqs is not None
        for i, row, c in zip(index, rows, completions):
            self.seqs[i] = list(row) + list(c)
            self.turns[i] += 1


def _seed(*key: Any) -> int:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _sampler_class() -> type:
    from transformers import LogitsProcessor

    class _PerRolloutSampler(LogitsProcessor):
        """Last of the logits processors: draws each row's next token from the processed
        distribution with the row's own generator, and leaves only that token possible (so
        transformers' own draw picks it)."""

        def __init__(self, seeds: list[int], device: torch.device) -> None:
            self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

        def __call__(self, input_ids: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
            probs_BV = torch.softmax(scores_BV.float(), dim=-1)
            out_BV = torch.full_like(scores_BV, float("-inf"))
            for b, g in enumerate(self.generators):
                token = torch.multinomial(probs_BV[b], 1, generator=g)
                out_BV[b, token] = 0.0
            return out_BV

    return _PerRolloutSampler


def _cat(parts: list[Any]) -> Any:
    """The shares' outputs of one call, in rollout order: lists concatenated, counts summed,
    tuples element by element, dicts key by key (a value that is not a list: the first
    share's), ``None`` where every share has ``None``."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, tuple):
        return tuple(_cat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _cat([p.get(k) for p in parts]) if isinstance(first[k], list) else first[k]
                for k in first}  # fmt: skip
    if isinstance(first, list):
        return [x for p in parts for x in p]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(parts)
    return first


class _Rollouts:
    """Mixin for a trainer family that generates its inputs (see the module docstring); placed
    before the shared :class:`~dtensor_ulysses.hf.trainers.base._UlyssesTrainer`. A family names
    its TRL classes in :attr:`_du_trl_classes` and calls :meth:`_du_init_rollouts` after the
    stock ``__init__``."""

    _du_trl_classes: tuple[str, ...] = ()
    _du_dims: ParallelDims
    _du_gathering: str = "round"
    _du_round_state: _Round | None = None
    args: Any
    model: Any
    model_wrapped: Any
    accelerator: Any
    state: Any
    environments: Any
    _environment_pool: Any

    # ------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------
    def _du_init_rollouts(self, *, multi_turn: bool = False) -> None:
        """After the stock ``__init__``: the stock rank's random stream, this rank's pool of
        environments (TRL's probes), how the weights are held while generating (printed by
        rank 0). ``multi_turn``: tools, environments or a ``rollout_func`` (their rounds need
        the weights gathered once: ranks make different numbers of generation calls).

        Raises:
            UnsupportedTrainerError: multi-turn rollouts whose weights cannot be gathered once.
        """
        self._du_seed_as_stock_rank()
        pool = getattr(self, "_environment_pool", None)
        self._du_env_pool = {name: list(p) for name, p in (pool or {}).items()}
        self._du_rounds: dict[tuple, int] = {}
        mode, why = self._du_choose_gathering()
        if mode == "layer" and multi_turn:
            fix = ("set ds3_gather_for_generation=True" if not self._du_gather_requested()
                   else "use more ranks (smaller shards), a smaller generation batch or "
                        "max_completion_length")  # fmt: skip
            raise UnsupportedTrainerError(
                f"multi-turn rollouts (tools, environments, rollout_func) need the weights "
                f"gathered once per round (each sp rank makes its own number of generation "
                f"calls), but: {why}; {fix}"
            )
        self._du_gathering = mode
        if dist.get_rank() == 0:
            print(f"with_ulysses: generation: one per sp group ({self._du_dims.sp} ranks share "
                  f"each dp group's rollouts), {why}", flush=True)  # fmt: skip

    def _du_seed_as_stock_rank(self) -> None:
        """The random stream of the stock rank with this dp index (shuffles)."""
        from accelerate.utils import set_seed

        set_seed(self.args.seed + self._du_dims.dp_rank)

    def _du_generation_memory(self) -> GenerationMemory:
        """This rank's memory during a round, from the model and the arguments (see
        :mod:`~dtensor_ulysses.plan.generation`)."""
        hf: Any = _state.base_model(self.model)
        world = dist.get_world_size()
        units: list[Any] = [m for m in self.model.modules() if isinstance(m, FSDPModule)]

        def nbytes(params: Any) -> int:
            return sum(p.numel() * p.element_size() for p in params)  # DTensor: global shape

        compute = _compute_bytes(self.model)
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        blocks = units[1:]  # modules() yields the root unit first
        own = {id(p) for u in blocks for p in u.parameters()}
        root = sum(p.numel() for p in self.model.parameters() if id(p) not in own)
        layer = max((sum(p.numel() for p in u.parameters()) for u in blocks), default=0)
        ref = getattr(self, "ref_model", None)
        resident = nbytes(self.model.parameters()) // world + 8 * trainable // world
        if ref is not None:
            resident += nbytes(ref.parameters()) // world
        cfg = hf.config.get_text_config()
        rows = self.args.per_device_train_batch_size * getattr(self.args, "steps_per_generation", 1)
        rows = -(-rows // self._du_dims.sp)
        tokens = int(getattr(self.args, "max_completion_length", 0) or 0)
        kv = kv_cache_bytes(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None)
                            or cfg.num_attention_heads, config_head_dim(cfg), compute, rows,
                            tokens)  # fmt: skip
        return GenerationMemory(resident=resident, gathered_weights=total * compute,
                                layer_weights=(root + 2 * layer) * compute,
                                kv_cache=kv)  # fmt: skip

    def _du_gather_requested(self) -> bool:
        """TRL's ``ds3_gather_for_generation`` (default ``True``): gather the weights once."""
        return bool(getattr(self.args, "ds3_gather_for_generation", True))

    def _du_choose_gathering(self) -> tuple[str, str]:
        return choose_weight_gathering(self._du_generation_memory(), self.args.device.type,
                                       requested=self._du_gather_requested(),
                                       headroom=HEADROOM)  # fmt: skip

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
        if issubclass(base, _DpAccelerator):  # nested (the loss inside an evaluation)
            yield
            return
        group = self._du_dims.dp_mesh.get_group()
        module = self._du_trl_module()
        acc.__class__ = type(f"Dp{base.__name__}", (_DpAccelerator, base), {})
        try:
            with (
                patched(module, "gather", lambda t: _dp_gather_same(t, group)),
                patched(module, "gather_object", lambda o: dp_gather_object(o, group)),
            ):
                yield
        finally:
            acc.__class__ = base

    def _du_sp_group(self) -> dist.ProcessGroup:
        return self._du_dims.sp_mesh.get_group()

    def _du_sp_root(self) -> int:
        """The global rank of sp rank 0 of this rank's group."""
        return dist.get_global_rank(self._du_sp_group(), 0)

    def _du_sp_gather_object(self, obj: Any) -> list[Any]:
        """Every sp rank's ``obj``, in sp rank order (one ``all_gather_object``)."""
        if self._du_dims.sp == 1:
            return [obj]
        parts: list[Any] = [None] * self._du_dims.sp
        dist.all_gather_object(parts, obj, group=self._du_sp_group())
        return parts

    # ------------------------------------------------------------------------------------------
    # the stock step (its batches are prompts, not token rows)
    # ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any):
        # the stock trainer's, past the shared base's token-row version
        return super(_UlyssesTrainer, self).get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, device
        )

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None):  # fmt: skip
        with self._du_dp_view():
            out = super(_UlyssesTrainer, self).compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs,
                num_items_in_batch=num_items_in_batch,
            )  # fmt: skip
        loss = out[0] if return_outputs else out
        # the value is the stock rank's loss; FSDP2 sums gradients over dp where DDP averages
        loss = loss.detach() + (loss - loss.detach()) / self._du_dims.dp
        return (loss, out[1]) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: Any = None):  # fmt: skip
        # the stock trainer's (rollouts and loss as in training, through the methods above)
        return super(_UlyssesTrainer, self).prediction_step(  # type: ignore[misc]
            model, inputs, prediction_loss_only, ignore_keys
        )

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # the stock trainer counts prompt + completion tokens itself (over dp)
        super(_UlyssesTrainer, self)._track_num_input_tokens(inputs)  # type: ignore[misc]

    # ------------------------------------------------------------------------------------------
    # a round
    # ------------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: Any) -> Any:
        with self._du_dp_view(), self._du_round(inputs):
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]

    @contextlib.contextmanager
    def _du_round(self, inputs: Sequence[Any]) -> Iterator[_Round]:
        mode = "train" if self.model.training else "eval"
        step = int(getattr(self.state, "global_step", 0))
        at = (mode, step)
        if at not in self.__dict__.get("_du_rounds", {}):
            self._du_rounds = {at: 0}
        k = self._du_rounds[at]
        self._du_rounds[at] = k + 1
        dp = self._du_dims.dp_rank
        first_only = getattr(self, "rollout_func", None) is not None
        shares = rollout_shares(len(inputs), self._du_dims.sp, first_only=first_only)
        rnd = _Round(len(inputs), shares, (self.args.seed, dp, mode, step, k))
        self._du_round_state = rnd
        pool = getattr(self, "_environment_pool", None)
        try:
            if getattr(self, "environment_factories", None) is not None:
                self._du_prepare_environments(rnd, inputs)
            yield rnd
        finally:
            self._du_round_state = None
            if pool is not None:
                self._environment_pool = pool

    def _du_own_rows(self, n: int) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of the round's ``n`` rollouts (outside a round: all)."""
        rnd = self._du_round_state
        if rnd is None or rnd.n != n:
            return (0, n)
        return rnd.shares[self._du_dims.sp_rank]

    @contextlib.contextmanager
    def _du_owned_rollouts(self, lo: int, hi: int) -> Iterator[None]:
        """While inside, ``self.environments`` is this rank's rollouts' real environments (the
        ones a reward reads), and torch's random stream a copy."""
        rnd = self._du_round_state
        old = getattr(self, "environments", None)
        if rnd is not None and rnd.envs is not None:
            self.environments = rnd.envs
        try:
            with _fork_rng(self.accelerator.device):
                yield
        finally:
            if rnd is not None and rnd.envs is not None:
                self.environments = old

    def _du_prepare_environments(self, rnd: _Round, inputs: Sequence[Any]) -> None:
        """Make (from this rank's pool), and ``reset`` with TRL's arguments, the environments
        of this rank's rollouts; share the observations over sp; hand TRL's pool one slot per
        rollout in order (so TRL's own draw gives rollout ``i`` slot ``i``)."""
        factories: dict = self.environment_factories  # type: ignore[attr-defined]
        multi = bool(getattr(self, "_multi_environment", False))
        names = [x.get("environment") if multi else None for x in inputs]
        lo, hi = rnd.shares[self._du_dims.sp_rank]
        own: list[Any] = []
        observations: list[Any] = []
        cursor = dict.fromkeys(factories, 0)
        with _fork_rng(self.accelerator.device):
            for i in range(lo, hi):
                name = names[i]
                if name not in factories:  # TRL's own check names it
                    own.append(None)
                    observations.append(None)
                    continue
                pool = self.__dict__.setdefault("_du_env_pool", {}).setdefault(name, [])
                if cursor[name] == len(pool):
                    pool.append(factories[name]())
                env = pool[cursor[name]]
                cursor[name] += 1
                x = inputs[i]
                kwargs = {k: v for k, v in x.items() if k != "environment"} if multi else x
                own.append(env)
                observations.append(env.reset(**kwargs))
        shared = [o for part in self._du_sp_gather_object(observations) for o in part]
        slots: dict[Any, list[_EnvironmentSlot]] = {name: [] for name in factories}
        for i, name in enumerate(names):
            if name in slots:
                real = own[i - lo] if lo <= i < hi else None
                slots[name].append(_EnvironmentSlot(shared[i], real))
        rnd.envs = own
        self._environment_pool = slots

    # ------------------------------------------------------------------------------------------
    # generation: this rank's share, the exchange, the replay
    # ------------------------------------------------------------------------------------------
    def _generate(self, prompts: list) -> Any:
        rnd = self._du_round_state
        if rnd is None or rnd.n != len(prompts):  # a call outside a round: a round of its own
            dp = self._du_dims.dp_rank
            rnd = _Round(len(prompts), rollout_shares(len(prompts), self._du_dims.sp),
                         (self.args.seed, dp, "call", 0, 0))  # fmt: skip
            self._du_round_state, outer = rnd, self._du_round_state
            try:
                return self._generate(prompts)
            finally:
                self._du_round_state = outer
        lo, hi = rnd.shares[self._du_dims.sp_rank]
        with self._du_generation():
            if hi > lo:
                with self._du_own_share(rnd, lo, hi):
                    super()._generate(prompts[lo:hi])  # type: ignore[misc]
            elif self._du_gathering == "layer":  # every rank steps in sync: decode a copy
                with self._du_own_share(rnd, 0, 1):
                    super()._generate(prompts[:1])  # type: ignore[misc]
                rnd.recorded = {}
        parts = self._du_sp_gather_object(rnd.recorded if hi > lo else None)
        rnd.merged = {k: _cat([p.get(k) if p else None for p in parts])
                      for k in ("turn", "loop", "rollout")}  # fmt: skip
        rnd.phase = "replay"
        old_func = getattr(self, "rollout_func", None)
        if old_func is not None:
            self.rollout_func = lambda *_: rnd.merged["rollout"]
        try:
            return super()._generate(prompts)  # type: ignore[misc]
        finally:
            rnd.phase = ""
            if old_func is not None:
                self.rollout_func = old_func

    @contextlib.contextmanager
    def _du_own_share(self, rnd: _Round, lo: int, hi: int) -> Iterator[None]:
        """While this rank makes rollouts ``lo:hi``: the per-rollout state of TRL's round
        (environments, tool dicts, environment names) cut to them, the metrics and token count
        the stock ``_generate`` updates set aside (the replay updates them), ``gather`` local,
        and the outputs of the generation steps recorded."""
        saved = {k: getattr(self, k) for k in ("_metrics", "_sync_tool_dicts",
                 "_async_tool_dicts", "_batch_environments", "environments", "rollout_func")
                 if hasattr(self, k)}  # fmt: skip
        tokens_seen = self.state.num_input_tokens_seen
        self._metrics: dict[str, Any] = {"train": defaultdict(list), "eval": defaultdict(list)}
        names = getattr(self, "_batch_environments", None)
        if names is not None and len(names) == rnd.n:
            self._batch_environments = names[lo:hi]
        if rnd.envs is not None:
            self.environments = rnd.envs
        if getattr(self, "tools", None) and hasattr(self, "_sync_tool_dicts"):
            if rnd.envs is not None:
                self._sync_tool_dicts, self._async_tool_dicts = self._du_tool_dicts(rnd.envs)
            else:
                self._sync_tool_dicts = self._sync_tool_dicts[lo:hi]
                self._async_tool_dicts = self._async_tool_dicts[lo:hi]
        func = saved.get("rollout_func")
        if func is not None:

            def recorded(prompts: list, trainer: Any) -> Any:
                out = func(prompts, trainer)
                rnd.recorded["rollout"] = out
                return out

            self.rollout_func = recorded
        rnd.phase, rnd.recorded, rnd.streams = "own", {}, _RolloutStreams(lo)
        self.accelerator._du_local = True
        try:
            yield
        finally:
            self.accelerator._du_local = False
            rnd.phase = ""
            for k, v in saved.items():
                setattr(self, k, v)
            self.state.num_input_tokens_seen = tokens_seen

    def _du_tool_dicts(self, envs: list[Any]) -> tuple[list[dict], list[dict]]:
        """TRL's per-rollout tool dicts (standalone tools and the environment's public methods
        but ``reset`` / ``get_reward``, by name; coroutines apart) for these environments."""
        sync, coro = [], []
        for env in envs:
            methods = [] if env is None else [
                getattr(env, name)
                for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
                if name not in ("reset", "get_reward") and not name.startswith("_")
            ]  # fmt: skip
            s: dict[str, Any] = {}
            a: dict[str, Any] = {}
            for tool in list(self._standalone_tools) + methods:  # type: ignore[attr-defined]
                (a if inspect.iscoroutinefunction(tool) else s)[tool.__name__] = tool
            sync.append(s)
            coro.append(a)
        return sync, coro

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        rnd = self._du_round_state
        if rnd is not None and rnd.phase == "replay":
            return rnd.merged["turn"]
        if rnd is None or rnd.phase != "own":  # a direct call: every rank decodes every row
            with self._du_generation():
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)  # type: ignore[misc]
        first = "turn" not in rnd.recorded
        with self._du_sampling(rnd, prompt_ids) as done:
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)  # type: ignore[misc]
            done(out[0] if isinstance(out, tuple) else out)
        if first:
            rnd.recorded["turn"] = out
        return out

    def _tool_call_loop(self, *args: Any, **kwargs: Any) -> Any:
        rnd = self._du_round_state
        if rnd is not None and rnd.phase == "replay":
            return rnd.merged["loop"]
        out = super()._tool_call_loop(*args, **kwargs)  # type: ignore[misc]
        if rnd is not None and rnd.phase == "own":
            rnd.recorded["loop"] = out
        return out

    @contextlib.contextmanager
    def _du_sampling(self, rnd: _Round, prompt_ids: Any) -> Iterator[Any]:
        """While inside, the policy's ``generate`` draws each row from its rollout's own
        generator (when the generation config samples); call the yielded function with the
        completions to advance the rollouts' histories."""
        config = getattr(self, "generation_config", None)
        streams = rnd.streams
        if config is None or not getattr(config, "do_sample", False) or streams is None:
            yield lambda completions: None
            return
        index = streams.rows_of(prompt_ids)
        seeds = [_seed(*rnd.key, streams.first + i, streams.turns[i]) for i in index]
        sampler = _sampler_class()(seeds, self.accelerator.device)
        from transformers import LogitsProcessorList

        target = self.accelerator.unwrap_model(self.model_wrapped)
        had = target.__dict__.get("generate")
        target.__dict__["generate"] = functools.partial(
            target.generate, logits_processor=LogitsProcessorList([sampler])
        )
        try:
            yield lambda completions: streams.advance(index, prompt_ids, completions)
        finally:
            if had is None:
                del target.__dict__["generate"]
            else:
                target.__dict__["generate"] = had

    @contextlib.contextmanager
    def _du_generation(self) -> Iterator[None]:
        """The weights held for a round (every rank enters together: the gathers are
        collectives), the model's own attention on whole rows, no gradients, a copy of torch's
        random stream."""
        hf: Any = _state.base_model(self.model)
        root: Any = self.model
        with plain_attention(hf), torch.no_grad(), _fork_rng(self.accelerator.device):
            if self._du_gathering == "round":  # every unit gathered once, until the round ends
                with all_gathered(root, hf, self.accelerator.device):
                    yield
                return
            # the root for the round, each layer per step: every rank steps in sync
            set_up(root, self.accelerator.device)
            with synced_steps(hf, True):
                root.unshard()
                try:
                    yield
                finally:
                    root.reshard()


def _compute_bytes(model: Any) -> int:
    """Bytes per element the policy generates in: FSDP2's mixed-precision parameter dtype,
    else the parameters'."""
    dtype = fsdp_param_dtype(model) or next(iter(model.parameters())).dtype
    return torch.empty((), dtype=dtype).element_size()


@contextlib.contextmanager
def _fork_rng(device: torch.device) -> Iterator[None]:
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
