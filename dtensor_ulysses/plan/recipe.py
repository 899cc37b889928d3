"""The parallel recipe's options: one documented, torch-free dataclass and its one ``check``.

The degrees ``(dp, ring, sp)`` live in :class:`~dtensor_ulysses.parallel.ParallelDims`; the
options that say *how* the model is parallelized live here, in :class:`ParallelOptions`. Every
front door builds one and checks it once: the trainer's flags (``TrainConfig.options()``),
``du.parallelize``, ``hf.parallelize``, ``with_ulysses(cls, sp, **options)``; the memory
preflight and the memory tracer read their feature names from it (:data:`MEMORY_OPTIONS`).

:meth:`ParallelOptions.check` holds every rule *between* options, each refusal a ``ValueError``
that names the numbers and the fix, spelled for the caller: ``spelling="flag"`` writes
``--offload-activations``, ``spelling="keyword"`` writes ``offload_activations=True``. Adding an
option is one field (with its line of doc), its rules in ``check``, and the code that reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dtensor_ulysses.plan.splits import check_sp_for_heads

__all__ = ["ATTENTION_BACKENDS", "MEMORY_OPTIONS", "ParallelOptions"]

# every kernel name of attention.kernels, spelled here to stay torch-free (a test holds them
# equal); one the running torch lacks (torch_varlen) is refused where the kernel is chosen
ATTENTION_BACKENDS = ("auto", "flash_attn", "sdpa", "flex", "torch_varlen", "blockwise")


@dataclass(frozen=True)
class ParallelOptions:
    """How the model is parallelized (the degrees are :class:`ParallelDims`'). Defaults: off."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (one block input kept per block)."""
    offload_activations: bool = False
    """With checkpointing: keep each block's input on the host until its recompute."""
    offload_params: bool = False
    """Parameters, gradients and optimizer states on the host (FSDP2's CPU offload)."""
    offload_optimizer: bool = False
    """The AdamW states on the host (the trainer's host AdamW); parameters stay on device."""
    head_chunks: int = 1
    """Attention in this many stages of heads per block (head-chunked Ulysses; 1: off)."""
    overlap_comm: bool = False
    """Hide the all-to-alls behind compute (k/v move while q is projected; head stages)."""
    compile: str | None = None
    """A ``torch.compile`` backend, per block (``None``: eager; ``"inductor"`` the default)."""
    attention_backend: str = "auto"
    """The local attention kernel: ``"auto"`` (chosen per layer kind) or a kernel name."""
    allow_uneven_heads: bool = False
    """Accept q heads not divisible by sp (ranks hold ceil or floor of ``N / sp`` heads)."""
    tiled_loss: bool = False
    """The loss from the final hidden states in chunks of rows (no ``[B, s, V]`` logits)."""
    loss_chunk_tokens: int | None = None
    """Rows per loss chunk with ``tiled_loss`` (``None``: ``plan.splits.default_loss_chunk``)."""
    tiled_mlp: bool = False
    """Each MLP in chunks of rows, recomputed per chunk in backward (ALST's tiled MLP)."""
    mlp_chunk_tokens: int | None = None
    """Rows per MLP chunk with ``tiled_mlp`` (``None``: the model dim, capped)."""
    mixed_precision: Any = field(default="auto", compare=False)
    """FSDP2's ``MixedPrecisionPolicy``, ``None`` (full precision) or ``"auto"`` (bf16 compute
    and fp32 reduction on CUDA, fp32 elsewhere)."""

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: dict[str, Any], *, door: str) -> ParallelOptions:
        """The options of a keyword front door (``door``, e.g. ``"with_ulysses"``); an unknown
        name is a ``ValueError`` listing the valid ones."""
        unknown = sorted(set(options) - set(cls.fields()))
        if unknown:
            raise ValueError(
                f"unknown {door} option(s) {unknown}; the options are {list(cls.fields())}"
            )
        return cls(**options)

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

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{say('attention_backend', self.attention_backend)} is not a kernel; choose "
                f"one of {list(ATTENTION_BACKENDS)}"
            )
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
        if hf_model and self.overlap_comm:
            raise ValueError(
                f"{say('overlap_comm')} applies to the built-in model only, not to a "
                f"transformers model"
            )
        if n_heads is not None and sp is not None:
            check_sp_for_heads(
                n_heads, sp, what=heads_name, allow_uneven=self.allow_uneven_heads,
                uneven_option=say("allow_uneven_heads"),
            )  # fmt: skip


# the options that change a rank's memory (the preflight's and the tracer's features)
MEMORY_OPTIONS = (
    "activation_checkpointing",
    "tiled_loss",
    "loss_chunk_tokens",
    "tiled_mlp",
    "mlp_chunk_tokens",
    "head_chunks",
    "offload_activations",
    "offload_optimizer",
    "offload_params",
)
