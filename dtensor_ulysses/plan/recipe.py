"""The parallel recipe's options: one documented, torch-free dataclass and its one ``check``.

The degrees ``(dp, ring, sp)`` live in :class:`~dtensor_ulysses.parallel.ParallelDims`; the
options that say *how* the model is parallelized live here, in :class:`ParallelOptions`. Each
front door builds one once, checks it once, and passes the object down:

* the trainer (``python -m dtensor_ulysses.train``): ``validate`` builds it from the flags,
  checks it and keeps it in the resolved configuration; the model spec, the memory preflight
  and the memory tracer take it from there;
* ``du.parallelize(model, mesh, options)``, ``hf.parallelize(model, mesh, options)``,
  ``with_ulysses(cls, sp, options)`` and ``UlyssesAccelerator(sp=, options=)``: the object, or the
  same names as keywords (:meth:`ParallelOptions.at_door`: one or the other, never both).

Each field declares which doors take it as a keyword (:data:`DOORS`; a door refuses other
names) and whether it changes a rank's memory (:data:`MEMORY_OPTIONS`, the preflight's and the
tracer's features), so the set of names is written here only.

:meth:`ParallelOptions.check` holds every rule *between* options, each refusal a ``ValueError``
that names the numbers and the fix, spelled for the caller: ``spelling="flag"`` writes
``--offload-activations``, ``spelling="keyword"`` writes ``offload_activations=True``. Adding an
option is one field (with its line of doc and its doors), its rules in ``check``, and the code
that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dtensor_ulysses.plan.splits import check_head_chunks, check_sp_for_heads

__all__ = [
    "ACCELERATE",
    "ATTENTION_BACKENDS",
    "DOORS",
    "HF_PARALLELIZE",
    "MEMORY_OPTIONS",
    "PARALLELIZE",
    "TRAINER",
    "WITH_ULYSSES",
    "ParallelOptions",
    "check_kernel_name",
]

# every kernel name of attention.kernels, spelled here to stay torch-free (a test holds them
# equal); one the running torch lacks (torch_varlen) is refused where the kernel is chosen
ATTENTION_BACKENDS = ("auto", "flash_attn", "sdpa", "flex", "torch_varlen", "blockwise")

# The front doors that take the options as keywords (a field names the doors it applies at).
PARALLELIZE = "du.parallelize"  # the built-in model's recipe
HF_PARALLELIZE = "hf.parallelize"  # a transformers model's recipe (also hf.load_pretrained)
WITH_ULYSSES = "with_ulysses"  # the Trainer door: the model's recipe and the loss
TRAINER = "the trainer"  # python -m dtensor_ulysses.train: its flags
ACCELERATE = (
    "UlyssesAccelerator"  # the accelerate door: the model's recipe (precision: accelerate's)
)
DOORS = (PARALLELIZE, HF_PARALLELIZE, WITH_ULYSSES, TRAINER, ACCELERATE)
_BUILTIN = (PARALLELIZE, TRAINER)  # the built-in model's engine and blocks only
_LOSS = (WITH_ULYSSES, TRAINER)  # the doors that own the loss
_TRAINER = (TRAINER,)  # the trainer's own: its host AdamW, its built-in model's tiled MLP
_PYTHON = (PARALLELIZE, HF_PARALLELIZE, WITH_ULYSSES)  # an FSDP2 policy object, not a flag


def _option(default: Any, doors: tuple[str, ...], *, memory: bool = False, **kw: Any) -> Any:
    """A :class:`ParallelOptions` field: its default, the doors that take it, and whether it
    changes a rank's memory."""
    return field(default=default, metadata={"doors": doors, "memory": memory}, **kw)


def check_kernel_name(
    name: Any,
    said: str,
    choices: Sequence[str] = ATTENTION_BACKENDS,
    *,
    error: type[ValueError] = ValueError,
) -> None:
    """The one refusal of an unknown kernel name: ``said`` is how the caller wrote it
    (``--attention-backend fast``, ``attention_backend='fast'``, ``backend='fast'``).

    Raises:
        ValueError: (``error``, a ``ValueError``) ``name`` is not in ``choices``.
    """
    if name not in choices:
        raise error(f"{said} is not an attention kernel; choose one of {list(choices)}")


@dataclass(frozen=True)
class ParallelOptions:
    """How the model is parallelized (the degrees are :class:`ParallelDims`'). Defaults: off.

    The whole recipe travels as this one object: each part of the library reads the fields it
    applies (``du.parallelize`` the engine, checkpointing, compile and FSDP2 fields; the tiled
    loss and MLP are the model's, the host AdamW the optimizer's). Change a field with
    ``dataclasses.replace`` (a family's reference model is the policy's recipe without
    checkpointing).
    """

    activation_checkpointing: bool = _option(False, DOORS, memory=True)
    """Recompute each block's activations in backward (one block input kept per block)."""
    offload_activations: bool = _option(False, DOORS, memory=True)
    """With checkpointing: keep each block's input on the host until its recompute."""
    offload_params: bool = _option(False, DOORS, memory=True)
    """Parameters, gradients and optimizer states on the host (FSDP2's CPU offload)."""
    offload_optimizer: bool = _option(False, _TRAINER, memory=True)
    """The AdamW states on the host (the trainer's host AdamW); parameters stay on device."""
    head_chunks: int = _option(1, DOORS, memory=True)
    """Attention in this many stages of heads per block (head-chunked Ulysses; 1: off)."""
    overlap_comm: bool = _option(False, _BUILTIN)
    """Hide the all-to-alls behind compute (k/v move while q is projected; head stages)."""
    compile: str | None = _option(None, _BUILTIN)
    """A ``torch.compile`` backend, per block (``None``: eager; ``True`` is ``"inductor"``)."""
    attention_backend: str = _option("auto", DOORS)
    """The local attention kernel: ``"auto"`` (chosen per layer kind) or a kernel name."""
    allow_uneven_heads: bool = _option(False, DOORS)
    """Accept q heads not divisible by sp (ranks hold ceil or floor of ``N / sp`` heads)."""
    tiled_loss: bool = _option(False, _LOSS, memory=True)
    """The loss from the final hidden states in chunks of rows (no ``[B, s, V]`` logits)."""
    loss_chunk_tokens: int | None = _option(None, _LOSS, memory=True)
    """Rows per loss chunk with ``tiled_loss`` (``None``: ``plan.splits.default_loss_chunk``)."""
    tiled_mlp: bool = _option(False, _TRAINER, memory=True)
    """Each MLP in chunks of rows, recomputed per chunk in backward (ALST's tiled MLP)."""
    mlp_chunk_tokens: int | None = _option(None, _TRAINER, memory=True)
    """Rows per MLP chunk with ``tiled_mlp`` (``None``: the model dim, capped)."""
    mixed_precision: Any = _option("auto", _PYTHON, compare=False)
    """FSDP2's ``MixedPrecisionPolicy``, ``None`` (full precision) or ``"auto"`` (bf16 compute
    and fp32 reduction on CUDA, fp32 elsewhere)."""

    def __post_init__(self) -> None:
        # compile=True is torch.compile's default backend; False and "" are no compile
        if self.compile is True:
            object.__setattr__(self, "compile", "inductor")
        elif self.compile is False or self.compile == "":
            object.__setattr__(self, "compile", None)

    @classmethod
    def fields(cls, door: str | None = None) -> tuple[str, ...]:
        """The option names in declaration order; with ``door`` (one of :data:`DOORS`), those
        that door takes."""
        return tuple(
            f.name for f in dataclasses.fields(cls) if door is None or door in f.metadata["doors"]
        )

    @classmethod
    def from_options(cls, options: dict[str, Any], *, door: str) -> ParallelOptions:
        """The options of a keyword front door (``door``, one of :data:`DOORS`); a name that
        door does not take is a ``ValueError`` listing the ones it does."""
        known = cls.fields(door) if door in DOORS else cls.fields()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"unknown {door} option(s) {unknown}; the options are {list(known)} (fields of "
                f"dtensor_ulysses.plan.ParallelOptions)"
            )
        return cls(**options)

    @classmethod
    def at_door(
        cls,
        options: ParallelOptions | None,
        keywords: dict[str, Any],
        *,
        door: str,
        whole: bool = False,
    ) -> ParallelOptions:
        """The options a front door was called with: a :class:`ParallelOptions` (positional)
        or keywords (:meth:`from_options`), not both.

        Args:
            options: the object, or ``None``.
            keywords: the keyword options (``{}`` with an object).
            door: the door (one of :data:`DOORS`), for the messages and the names it takes.
            whole: the door is the whole path (``with_ulysses``): an object's fields that it
                does not apply, set away from their defaults, are refused (no other code on
                that path would apply them).

        Raises:
            TypeError: ``options`` is not a :class:`ParallelOptions`.
            ValueError: both an object and keywords; an unknown keyword; with ``whole``, a
                field the door does not apply.
        """
        if options is None:
            return cls.from_options(keywords, door=door)
        if not isinstance(options, cls):
            raise TypeError(
                f"{door} takes its options as a dtensor_ulysses.plan.ParallelOptions (or as "
                f"keywords), got {type(options).__name__}"
            )
        if keywords:
            first = sorted(keywords)[0]
            raise ValueError(
                f"{door}: pass the options as a ParallelOptions or as keywords, not both (got "
                f"the object and {sorted(keywords)}); change a field of the object with "
                f"dataclasses.replace(options, {first}=...)"
            )
        if whole:
            default = cls()
            unused = [
                f"{name}={getattr(options, name)!r}"
                for name in cls.fields()
                if name not in cls.fields(door) and getattr(options, name) != getattr(default, name)
            ]
            if unused:
                raise ValueError(
                    f"{door} does not apply {', '.join(unused)}; the options it applies are "
                    f"{list(cls.fields(door))}"
                )
        return options

    def say(self, name: str, spelling: str, value: Any = True) -> str:
        """How the caller wrote option ``name`` (``--head-chunks 4`` or ``head_chunks=4``)."""
        if spelling == "flag":
            flag = "--" + name.replace("_", "-")
            return flag if value is True else f"{flag} {value}"
        return f"{name}={value!r}"

    def check(
        self,
        spelling: str = "keyword",
        *,
        n_heads: int | None = None,
        sp: int | None = None,
        ring: int = 1,
        local_tokens: int | None = None,
        hf_model: bool = False,
        heads_name: str = "q heads",
    ) -> None:
        """Every rule between options (and with the degrees and shapes given), checked once.

        Args:
            spelling: ``"flag"`` (the trainer's command line) or ``"keyword"`` (the Python
                front doors): how messages name the options.
            n_heads: the model's q heads (with ``sp``: heads against sp).
            sp: the Ulysses degree.
            ring: the ring degree.
            local_tokens: the tokens of the busiest rank's slice (the chunk sizes' bound).
            hf_model: the model is a transformers model (options of the built-in model only
                are refused).
            heads_name: how the heads message names them (e.g. ``"heads of model 'tiny'"``).

        Raises:
            ValueError: a combination that cannot run, naming the numbers and the fix.
        """

        def say(name: str, value: Any = True) -> str:
            return self.say(name, spelling, value)

        check_kernel_name(self.attention_backend, say("attention_backend", self.attention_backend))
        if isinstance(self.head_chunks, bool) or not isinstance(self.head_chunks, int):
            raise ValueError(f"{say('head_chunks', self.head_chunks)} is not an int (1: off)")
        if self.head_chunks < 1:
            raise ValueError(f"{say('head_chunks', self.head_chunks)} must be >= 1 (1: off)")
        for kind, on, chunk in (
            ("loss", self.tiled_loss, self.loss_chunk_tokens),
            ("mlp", self.tiled_mlp, self.mlp_chunk_tokens),
        ):
            name = f"{kind}_chunk_tokens"
            if chunk is None:
                continue
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
                raise ValueError(f"{say(name, chunk)} is not a positive int; e.g. 2048")
            if not on:
                raise ValueError(f"{say(name, chunk)} needs {say(f'tiled_{kind}')}")
            if local_tokens is not None and chunk > local_tokens:
                raise ValueError(
                    f"{say(name, chunk)} must be between 1 and the {local_tokens} tokens a rank "
                    f"holds; a chunk of all of them is {say(f'tiled_{kind}')} off"
                )
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                f"{say('offload_activations')} moves the one input a checkpointed block keeps to "
                f"the host; add {say('activation_checkpointing')}"
            )
        if self.offload_activations and self.compile:
            raise ValueError(
                f"{say('offload_activations')} with {say('compile', self.compile)}: "
                f"torch.compile cannot trace the saved-tensor hooks that move checkpoints to the "
                f"host; drop one of them"
            )
        if self.offload_optimizer and self.offload_params:
            raise ValueError(
                f"{say('offload_params')} already keeps the optimizer states on the host; pass "
                f"one of {say('offload_params')} and {say('offload_optimizer')}"
            )
        if self.compile and ring > 1:
            raise ValueError(
                f"{say('compile', self.compile)} with ring={ring}: dynamo does not trace ring "
                f"attention's point-to-point exchange (torch.distributed.P2POp) into the block's "
                f"one graph; drop the compile or the ring"
            )
        if hf_model:
            for name in ("overlap_comm", "compile", "tiled_mlp"):
                if getattr(self, name):
                    raise ValueError(
                        f"{say(name, getattr(self, name))} applies to the built-in model only, "
                        f"not to a transformers model"
                    )
        if n_heads is not None and sp is not None:
            check_sp_for_heads(
                n_heads, sp, what=heads_name, allow_uneven=self.allow_uneven_heads,
                uneven_option=say("allow_uneven_heads"),
            )  # fmt: skip
            if self.head_chunks != 1:
                said = say("head_chunks", self.head_chunks).removesuffix(str(self.head_chunks))
                check_head_chunks(n_heads, sp, self.head_chunks, name=said)


# the options that change a rank's memory (the preflight's and the tracer's features)
MEMORY_OPTIONS = tuple(f.name for f in dataclasses.fields(ParallelOptions) if f.metadata["memory"])
