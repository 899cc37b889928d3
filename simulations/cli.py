"""Command line: ``python -m simulations {predict,plan,compare,published,validate,trace}``.

Kept in one file (~450 lines): the parser of every subcommand and its text output, side by side.

    python -m simulations predict --model llama3-8b --seq-len 131072 --dp 1 --sp 8 --gpu h100 --json
    python -m simulations plan --model llama3-8b --gpus 8 --gpu h100 --json
    python -m simulations compare --model llama3-8b --seq-len 131072 --sp 8 --gpu h100
    python -m simulations published [--row M3] [--json]
    python -m simulations validate [--skip-comm] [--skip-memory]
    python -m simulations trace --model llama3-8b --seq-len 131072 --dp 1 --sp 8 --gpu h100 \
        --tiled-loss --tiled-mlp --layers 2 --json          # the real step, fake tensors
    python -m simulations trace --model llama3-8b --sp 8 --gpu h100 --find-max [features] --json
    python -m simulations trace --model llama3-8b --sp 8 --find-max --host-memory 128 [features]
    python -m simulations trace --model tiny --seq-len 8192 --dp 1 --sp 1 --device cpu --json
    python -m simulations trace --model llama3-8b --sp 8 --step dpo --find-max [features]
    python -m simulations trace --model llama3-8b --sp 8 --step grpo --generations 8 \
        --beta 0.04 --find-max [features]    # the DPO / GRPO step (memtrace/steps.py)
    python -m simulations trace --model llama3-8b --sp 8 --step vl --images 16 \
        --image-patches 1024 --find-max      # a vision-language step (memtrace/vision_step.py)
    python -m simulations trace-check [--config plain]   # the CPU trace against a real run

Bad input prints ``error: <what and how to fix it>`` and exits 2 (no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dtensor_ulysses.plan import PRESETS, get_shape
from simulations.config import AC_MODES, DTYPE_BYTES, IMPLEMENTATIONS, METHODS, Workload
from simulations.hardware import GPUS
from simulations.planner import plan
from simulations.predict import Prediction, compare_methods, predict

__all__ = ["main"]

GiB = 2**30


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser, *, layout: bool) -> None:
    p.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--gpu", default="h100", help=f"GPU profile: {', '.join(GPUS)}")
    if layout:
        p.add_argument("--seq-len", type=int, required=True, help="sequence length S (tokens)")
        p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
        p.add_argument("--sp", type=int, default=1, help="sequence-parallel degree")
        p.add_argument("--gpus", type=int, default=None, help="total GPUs (must be dp * sp)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per dp rank per step")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--ac", default="full", choices=AC_MODES, help="activation checkpointing")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--offload-params", action="store_true")
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--tiled-loss", action="store_true")
    _chunk_options(p)
    p.add_argument("--attention", default="ulysses", choices=METHODS)
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp: the Ulysses part of sp")
    p.add_argument("--reduce-dtype", default="fp32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--sharding", default="fsdp", choices=("fsdp", "ddp"))
    p.add_argument(
        "--impl",
        default="dtensor-ulysses",
        choices=IMPLEMENTATIONS,
        help="accounting profile (see simulations/profiles.py)",
    )
    p.add_argument(
        "--pack-docs",
        action="store_true",
        help="packed documents: attention and positions restart at each document (the step's "
        "layout carries the document starts: no extra communication)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot", metavar="FILE.png", default=None, help="also write plots (needs matplotlib)"
    )


def _chunk_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loss-chunk-tokens", type=int, default=None, help="tokens per loss tile")
    p.add_argument("--mlp-chunk-tokens", type=int, default=None, help="tokens per MLP tile")
    p.add_argument(
        "--head-chunks", type=int, default=1, help="Ulysses attention in K head stages (1: off)"
    )


def _trace_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--gpu", default="h100", help=f"GPU profile: {', '.join(GPUS)}")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length S (tokens)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel degree")
    p.add_argument("--ac", default="full", choices=AC_MODES, help="activation checkpointing")
    p.add_argument("--tiled-loss", action="store_true")
    p.add_argument("--tiled-mlp", action="store_true")
    _chunk_options(p)
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--offload-params", action="store_true")
    p.add_argument(
        "--layers", type=int, default=None,
        help="trace L and L+1 blocks (L >= 5) and extrapolate linearly to the model's depth",
    )  # fmt: skip
    p.add_argument(
        "--find-max", action="store_true",
        help="bisect to the longest fitting sequence (no --seq-len)",
    )  # fmt: skip
    p.add_argument(
        "--granularity", type=int, default=None,
        help="--find-max grid, tokens (default 1024 * sp)",
    )  # fmt: skip
    p.add_argument(
        "--headroom", type=float, default=None, metavar="FRACTION",
        help="--find-max also reports the longest sequence whose peak stays within this "
        "fraction of the usable memory (default: 0.9, the trainer's --memory-headroom; 1: skip)",
    )  # fmt: skip
    p.add_argument(
        "--host-memory", type=float, default=None, metavar="GIB",
        help="--find-max: host memory a rank may hold, GiB (a node's memory / its ranks); the "
        "longest sequence then fits both, and the report says which binds (default: no limit)",
    )  # fmt: skip
    p.add_argument(
        "--breakdown", type=int, default=0, metavar="N",
        help="list the N largest tensors alive at the device peak (with --seq-len)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="the run traced: cuda (bf16 mixed precision, the default) or cpu (the trainer on a "
        "CPU: fp32, gloo; checked against a real run by `trace-check`)",
    )  # fmt: skip
    p.add_argument(
        "--step", default="sft", choices=("sft", "dpo", "grpo", "distill", "vl"),
        help="the step traced: sft (the trainer's), dpo (policy on a chosen and a rejected row "
        "of --seq-len tokens each, a frozen reference model, TRL's sigmoid loss), grpo "
        "(--generations rows of --seq-len prompt+completion tokens; reference when --beta > 0, "
        "old-policy log-probs when --num-iterations > 1; TRL's dapo loss), distill (on-policy "
        "distillation: a student row of --seq-len prompt+completion tokens, a frozen teacher of "
        "the same preset, TRL's chunked generalized JSD) or vl (a "
        "vision-language SFT step: each rank of the sp group encodes its share of --images "
        "whole images through a ViT-like tower, the features are all-gathered and merged at the "
        "row's first images x patches tokens; a 'vision' phase)",
    )  # fmt: skip
    p.add_argument(
        "--beta", type=float, default=None,
        help="dpo: the temperature (default 0.1); grpo: the KL coefficient (default 0: no "
        "reference model); distill: the divergence, 0 forward KL to 1 reverse KL (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--generations", type=int, default=None, metavar="G",
        help="grpo: completions per prompt, the rows of a dp rank's micro-batch (default 8)",
    )  # fmt: skip
    p.add_argument(
        "--num-iterations", type=int, default=None,
        help="grpo: updates per generation batch (default 1; > 1 adds the old policy's "
        "log-probs)",
    )  # fmt: skip
    p.add_argument(
        "--generation", default=None, choices=("round", "layer"),
        help="grpo: also trace the rollout round before the step (a 'generate' phase: the "
        "weights gathered once for the round, or the root and two layers at a time, and the KV "
        "cache of this rank's ceil(G / sp) rows at --seq-len tokens)",
    )  # fmt: skip
    p.add_argument(
        "--images", type=int, default=None, metavar="N",
        help="vl: images in the row of each dp rank (default 4)",
    )  # fmt: skip
    p.add_argument(
        "--image-patches", type=int, default=None, metavar="P",
        help="vl: patches per image, one image token each (default 1024)",
    )  # fmt: skip
    p.add_argument(
        "--vision-layers", type=int, default=None, metavar="L",
        help="vl: the vision tower's blocks (default 4; SigLIP-so400m 27, Qwen2.5-VL 32)",
    )  # fmt: skip
    p.add_argument(
        "--vision-hidden", type=int, default=None, metavar="D",
        help="vl: the vision tower's width, a multiple of 64 (default 1024; SigLIP-so400m "
        "1152, Qwen2.5-VL 1280)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


VL_OPTIONS = ("images", "image_patches", "vision_layers", "vision_hidden")  # --step vl's


def _step_options(a: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """``--step``'s options as ``TraceCase.step_options`` (checked: each belongs to the step)."""
    given = {k: getattr(a, k) for k in ("beta", "generations", "num_iterations", "generation",
                                        *VL_OPTIONS)}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    allowed = {"sft": (), "dpo": ("beta",),
               "grpo": ("beta", "generations", "num_iterations", "generation"),
               "distill": ("beta",), "vl": VL_OPTIONS}  # fmt: skip
    grpo = "grpo (--generations, --num-iterations and --generation are GRPO's)"
    owner = {"beta": "dpo, grpo or distill", "generations": grpo, "num_iterations": grpo,
             "generation": grpo, **dict.fromkeys(VL_OPTIONS, "vl")}  # fmt: skip
    wrong = [k for k in given if k not in allowed[a.step]]
    if wrong:
        flags = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise ValueError(
            f"{flags} do(es) not apply to --step {a.step}: use --step {owner[wrong[0]]}"
        )
    for k in VL_OPTIONS:
        if given.get(k, 1) < 1:
            raise ValueError(f"--{k.replace('_', '-')} {given[k]} must be >= 1")
    if given.get("beta", 0) < 0:
        raise ValueError(f"--beta {given['beta']} must be >= 0 (e.g. 0.1 for DPO, 0.04 for GRPO)")
    if a.step == "distill" and given.get("beta", 0) > 1:
        raise ValueError(
            f"--beta {given['beta']}: distillation's beta is in [0, 1] (0 forward KL, 0.5 JSD, "
            f"1 reverse KL)"
        )
    if given.get("generations", 1) < 1:
        raise ValueError(f"--generations {given['generations']} must be >= 1 (TRL's default 8)")
    if given.get("num_iterations", 1) < 1:
        raise ValueError(f"--num-iterations {given['num_iterations']} must be >= 1 (default 1)")
    if a.step != "sft" and get_shape(a.model).linear is not None:
        raise ValueError(
            f"--step {a.step} traces the built-in model; {a.model} is a hybrid (a transformers "
            f"model): trace it with --step sft"
        )
    return tuple(sorted(given.items()))


def _options(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        gpu=a.gpu,
        micro_batch=a.micro_batch,
        dtype=a.dtype,
        ac=a.ac,
        offload_optimizer=a.offload_optimizer,
        offload_params=a.offload_params,
        offload_activations=a.offload_activations,
        tiled_mlp=a.tiled_mlp,
        tiled_loss=a.tiled_loss,
        loss_chunk_tokens=a.loss_chunk_tokens,
        mlp_chunk_tokens=a.mlp_chunk_tokens,
        head_chunks=a.head_chunks,
        attention=a.attention,
        ulysses_degree=a.ulysses_degree,
        reduce_dtype=a.reduce_dtype,
        sharding=a.sharding,
        impl=a.impl,
        pack_docs=a.pack_docs,
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m simulations",
        description="Cost model of Ulysses sequence parallelism and its alternatives.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict", help="communication, memory and time of one layout")
    _common(p, layout=True)
    p = sub.add_parser("compare", help="one layout under every attention method")
    _common(p, layout=True)
    p = sub.add_parser("plan", help="rank the (dp, sp) layouts for a GPU count")
    _common(p, layout=False)
    p.add_argument("--gpus", type=int, required=True, help="total GPUs")
    p.add_argument("--seq-len", type=int, default=None, help="target sequence (optional)")
    p = sub.add_parser("published", help="the published rows against the model")
    p.add_argument("--row", default=None, help="one row id (C1..C4, M1..M4, T1..T3, HW)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("validate", help="measured vs predicted, and every published row")
    p.add_argument("--skip-comm", action="store_true", help="skip the gloo communication runs")
    p.add_argument("--skip-memory", action="store_true", help="skip the fake-tensor memory trace")
    p = sub.add_parser(
        "trace", help="trace the real training step with fake tensors: device peak, host bytes"
    )
    _trace_parser(p)
    sub.add_parser(
        "trace-check", add_help=False,
        help="the CPU trace against the real CPU step's peak memory (VmHWM); --help for more",
    )  # fmt: skip
    return ap


# ----------------------------------------------------------------------------------------------
# human-readable output
# ----------------------------------------------------------------------------------------------
def _b(x: float) -> str:
    for unit, k in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= k:
            return f"{x / k:,.2f} {unit}"
    return f"{x:,.0f} B"


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_prediction(p: Prediction) -> str:
    """The human-readable report of one prediction."""
    w = p.workload
    m = w.shape
    head = (
        f"{m.name} ({m.n_params / 1e9:.2f}B params), S={w.seq_len:,}, dp={w.dp}, sp={w.sp} "
        f"({w.attention}), {w.world}x {w.gpu.name}, B={w.micro_batch}, {w.dtype}, ac={w.ac}"
    )
    out = [head]
    out.append(
        f"attention imbalance {p.attention_imbalance:.3f}x (busiest rank's heads / mean), "
        f"token imbalance {w.token_imbalance:.3f}x"
    )
    ranks = p.per_sp_rank()
    if ranks is not None and (
        p.attention_imbalance > 1 or w.token_imbalance > 1 or len(set(ranks["kv_heads"])) > 1
    ):
        rows = []
        for r, a2a in enumerate(ranks["all_to_all_bytes_per_layer"]):
            fwd = a2a["forward_qkv"] + a2a["forward_o"]
            bwd = a2a["backward_o"] + a2a["backward_qkv"]
            tokens, n, k = ranks["tokens"][r], ranks["q_heads"][r], ranks["kv_heads"][r]
            rows.append(
                (r, f"{tokens:,}", n, k, _b(fwd), _b(bwd), _b(ranks["memory_peak_bytes"][r]))
            )
        out.append("")
        out.append(
            f"Uneven layout, per sp rank (busiest: comm rank {ranks['comm_rank']}, memory rank "
            f"{ranks['memory_rank']})"
        )
        header = ("rank", "tokens", "q heads", "kv heads", "a2a layer fwd", "a2a layer bwd", "peak")
        out.append(_table(rows, header))
    out.append("")
    c = p.comm
    comm_rows = [
        (
            k,
            c.calls_by_kind[k],
            _b(c.bytes_by_kind[k]),
            _b(c.wire_by_kind[k]),
            _b(c.per_layer["forward"][k]),
            _b(c.per_layer["backward"][k]),
        )
        for k in c.bytes_by_kind
    ]
    out.append("Communication per rank per step (bytes = input buffers; sent = on the wire)")
    out.append(
        _table(comm_rows, ("collective", "calls", "bytes", "sent", "layer fwd", "layer bwd"))
    )
    out.append("")
    mem = p.memory
    mem_rows = [(k, _b(v)) for k, v in mem.components.items() if v]
    mem_rows += [("peak", _b(mem.peak)), ("capacity", _b(mem.capacity))]
    out.append(f"Memory per rank at the peak ({mem.peak_moment}); fits: {mem.fits}")
    out.append(_table(mem_rows, ("component", "bytes")))
    if mem.cpu_bytes:
        out.append(f"host memory per rank (offloaded): {_b(mem.cpu_bytes)}")
    out.append("")
    t = p.time
    time_rows = [
        ("step time", f"{p.step_time_s:.4g} s"),
        ("  compute (matmul / attention / memory-bound)",
         f"{t.compute:.4g} s ({t.matmul:.3g} / {t.attention:.3g} / {t.memory_bound:.3g})"),
        ("    of which load imbalance (busiest rank)", f"{t.imbalance:.4g} s"),
        ("  communication exposed (total)", f"{t.comm_exposed:.4g} s ({t.comm_total:.4g} s)"),
        ("  offload exposed", f"{t.offload_exposed:.4g} s"),
        ("tokens/s (job)", f"{p.tokens_per_s:,.0f}"),
        ("TFLOP/s per GPU (model FLOPs)", f"{p.tflops_per_gpu:.1f}"),
        ("MFU", f"{p.mfu:.1%}"),
    ]  # fmt: skip
    out.append(_table(time_rows, ("time", "value")))
    return "\n".join(out)


def _format_plan(pl) -> str:
    rows = []
    for x in pl.layouts:
        tps = f"{x.tokens_per_s:,.0f}" if x.fits else "-"
        mfu = f"{x.prediction.mfu:.1%}" if x.prediction and x.fits else "-"
        max_s = f"{x.max_seq_len:,}" if x.valid else "-"
        at_s = f"{x.eval_seq_len:,}" if x.eval_seq_len else "-"
        imb = f"{x.attention_imbalance:.3f}" if x.valid else "-"
        rows.append((x.dp, x.sp, x.ring, max_s, at_s, tps, mfu, imb, x.why))
    head = f"{pl.model} on {pl.gpus}x {pl.gpu}" + (
        f", target S={pl.seq_len:,}" if pl.seq_len else ""
    )  # ring > 1: Ulysses x Ring over dp x ring x sp GPUs (the library's mesh)
    header = ("dp", "sp", "ring", "max S", "at S", "tokens/s", "MFU", "imbalance", "why")
    return head + "\n" + _table(rows, header)


def _format_compare(res: dict) -> str:
    rows = []
    for method, p in res.items():
        if isinstance(p, str):
            rows.append((method, "-", "-", "-", "-", p))
            continue
        rows.append(
            (
                method,
                _b(p.comm.total_wire),
                _b(p.memory.peak),
                f"{p.step_time_s:.4g} s",
                f"{p.mfu:.1%}",
                "fits" if p.fits else "OOM",
            )
        )
    return _table(rows, ("method", "sent/step", "peak", "step", "MFU", "memory"))


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------
def _cmd_predict(a) -> int:
    p = predict(a.model, a.seq_len, dp=a.dp, sp=a.sp, gpus=a.gpus, **_options(a))
    print(json.dumps(p.to_dict(), indent=2) if a.json else format_prediction(p))
    if a.plot:
        from simulations.plots import plot_workload

        plot_workload(p.workload, a.plot)
    return 0


def _cmd_compare(a) -> int:
    w = Workload(shape=a.model, seq_len=a.seq_len, dp=a.dp, sp=a.sp, gpus=a.gpus, **_options(a))
    res = compare_methods(w)
    if a.json:
        obj = {k: (v if isinstance(v, str) else v.to_dict()) for k, v in res.items()}
        print(json.dumps(obj, indent=2))
    else:
        print(_format_compare(res))
    if a.plot:
        from simulations.plots import plot_workload

        plot_workload(w, a.plot)
    return 0


def _cmd_plan(a) -> int:
    pl = plan(
        a.model,
        a.gpus,
        a.gpu,
        seq_len=a.seq_len,
        **{k: v for k, v in _options(a).items() if k != "gpu"},
    )
    print(json.dumps(pl.to_dict(), indent=2) if a.json else _format_plan(pl))
    if a.plot:
        from simulations.plots import plot_plan

        plot_plan(pl, a.plot, **{k: v for k, v in _options(a).items() if k != "gpu"})
    return 0


def _cmd_published(a) -> int:
    from simulations.published import check_all, check_row

    checks = check_row(a.row) if a.row else check_all()
    if a.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        rows = [(c.row, c.status.upper(), c.item, c.published, c.predicted, c.band) for c in checks]
        print(_table(rows, ("row", "status", "item", "published", "predicted", "band")))
    return 0 if all(c.ok for c in checks) else 1


def _cmd_validate(a) -> int:
    from simulations.validate import run

    return run(comm=not a.skip_comm, memory=not a.skip_memory)


def _trace_case(a):
    from simulations import _trace
    from simulations.config import Workload

    if a.find_max == (a.seq_len is not None):
        raise ValueError("give --seq-len S, or --find-max (without --seq-len)")
    if a.breakdown and a.find_max:
        raise ValueError(
            "--breakdown N lists one step's peak: use it with --seq-len, not --find-max"
        )
    if a.find_max and a.device == "cpu":
        raise ValueError(
            "--find-max bisects against a GPU's memory; with --device cpu give --seq-len S"
        )
    if a.host_memory is not None and not a.find_max:
        raise ValueError(
            "--host-memory bounds the --find-max search; with --seq-len the report's host_bytes "
            "is the figure to compare with it"
        )
    if a.host_memory is not None and not a.host_memory > 0:
        raise ValueError(
            f"--host-memory {a.host_memory} must be > 0 GiB per rank (a node's memory divided "
            f"by its ranks, e.g. 256 for 2 TB and 8 GPUs)"
        )
    if a.breakdown < 0:
        raise ValueError(f"--breakdown={a.breakdown} must be >= 0 (a number of tensors)")
    feats = tuple(
        (k, getattr(a, k))
        for k in _trace.FEATURE_FLAGS
        if getattr(a, k) not in (None, False) and not (k == "head_chunks" and a.head_chunks == 1)
    )
    if a.layers is not None and a.layers < 5:
        raise ValueError(
            f"--layers={a.layers}: extrapolation needs traces of at least 5 blocks (the two "
            f"first, the two last and one between); use --layers 5"
        )
    if a.layers is not None and get_shape(a.model).linear is not None:
        raise ValueError(
            f"--layers={a.layers}: extrapolation assumes identical blocks, but {a.model} mixes "
            f"linear-attention and full-attention layers; trace it without --layers"
        )
    case = _trace.TraceCase(
        a.model, a.seq_len or 1024 * a.sp, a.dp, a.sp, ac=a.ac, features=feats,
        extrapolate_from=a.layers, gpu=a.gpu, device=a.device, step=a.step,
        step_options=_step_options(a),
    )  # fmt: skip
    Workload(**{**_workload_kwargs(case)})  # validate the options (clear errors) before tracing
    if case.step == "vl":  # the images fit the row, the tower's width divides into heads
        _trace.vision_spec(case, check_len=not a.find_max)  # --find-max: from the images up
    return case


def _workload_kwargs(case) -> dict[str, Any]:
    return dict(
        shape=case.model, seq_len=case.seq_len, dp=case.dp, sp=case.sp, ac=case.ac,
        gpu=case.gpu, **dict(case.features),
    )  # fmt: skip


def _format_trace(obj: dict) -> str:
    on = obj["gpu"] or "cpu (fp32)"
    head = (
        f"{obj['model']} S={obj['seq_len']:,} dp={obj['dp']} sp={obj['sp']} on {on} "
        f"(features: {', '.join(obj['features']) or 'none'}; layers {obj['layers']}, traced "
        f"{obj['traced_layers']})"
    )
    step = obj.get("step", {"kind": "sft"})
    if step["kind"] != "sft":
        opts = ", ".join(f"{k} {v}" for k, v in step.items() if k != "kind")
        head += f"\n{step['kind'].upper()} step: {opts}"
    rows = [
        (ph, _b(v["device_peak_bytes"]), *(_b(x) for x in v["by_category"].values()))
        for ph, v in obj["phases"].items()
    ]
    cats = tuple(next(iter(obj["phases"].values()))["by_category"])
    out = [head, _table(rows, ("phase", "device peak", *cats)), ""]
    if obj["gpu"] is None:
        out.append(
            f"peak {_b(obj['peak_bytes'])} (device + host alive at once: one memory on a CPU); "
            f"device peak {_b(obj['device_peak_bytes'])} ({obj['peak_phase']}), host "
            f"{_b(obj['host_bytes'])}"
        )
    else:
        out.append(
            f"device peak {_b(obj['device_peak_bytes'])} ({obj['peak_phase']}) of "
            f"{_b(obj['capacity_bytes'])} usable: {'fits' if obj['fits'] else 'DOES NOT FIT'}; "
            f"host {_b(obj['host_bytes'])}; simulator {_b(obj['predicted']['device_peak_bytes'])}"
            + (
                ""
                if step["kind"] == "sft"
                else " (an SFT step of as many rows: no "
                + ("vision tower)" if step["kind"] == "vl" else "reference)")
            )
        )
    if "max_seq_len" in obj:
        hcap = obj.get("host_capacity_bytes")
        out.append(
            f"longest fitting sequence: {obj['max_seq_len']:,} (grid {obj['granularity']:,}; "
            + (f"within {_b(hcap)} of host per rank; " if hcap else "")
            + f"{obj['binding']} memory binds)"
            + (
                f"; with {1 - obj['headroom']:.0%} headroom (peak <= {obj['headroom']:.0%} of "
                f"the usable memory"
                + (" and of the host memory" if hcap else "")
                + f"): {obj['max_seq_len_with_headroom']:,} "
                + (
                    f"({obj['binding_with_headroom']} binds)"
                    if "binding_with_headroom" in obj
                    else "(nothing fits)"
                )
                if "max_seq_len_with_headroom" in obj
                else ""
            )
        )
    if obj.get("breakdown"):
        depth = obj["traced_layers"][-1]
        out += ["", f"alive at the device peak, largest first (traced with {depth} blocks):"]
        rows = [(_b(r["bytes"]), r["category"], r["op"], r["where"]) for r in obj["breakdown"]]
        out.append(_table(rows, ("bytes", "category", "op", "allocated at")))
    return "\n".join(out)


def _find_max_with_headroom(a, case, g: int, best: int, log) -> dict[str, Any]:
    """The longest sequence whose traced peak stays within ``--headroom`` of the usable memory
    (a second search, started at ``headroom * best``); empty for ``--headroom 1``."""
    from simulations import _trace
    from simulations.hardware import get_gpu

    frac = _trace.TRAINER_HEADROOM if a.headroom is None else a.headroom
    if not 0 < frac <= 1:
        raise ValueError(f"--headroom {frac} must be a fraction in (0, 1], e.g. 0.9")
    if frac == 1:
        return {}
    cap = int(get_gpu(a.gpu).usable_bytes * frac)
    hcap = _host_bytes(a)
    hcap = int(hcap * frac) if hcap else None  # the trainer's preflight: the same fraction
    if log:
        on_host = f", host <= {hcap / 2**30:.2f} GiB" if hcap else ""
        log(f"with {1 - frac:.0%} headroom (peak <= {cap / 2**30:.2f} GiB{on_host}):")
    within, _, rep = _trace.find_max(
        case, granularity=g, start=max(g, int(best * frac)), log=log, capacity=cap,
        host_capacity=hcap,
    )  # fmt: skip
    out: dict[str, Any] = {"headroom": frac, "max_seq_len_with_headroom": within}
    if rep is not None:
        out["binding_with_headroom"] = rep["binding"]
        out["device_peak_bytes_with_headroom"] = rep["device_peak_bytes"]
        out["host_bytes_with_headroom"] = rep["host_bytes"]
    return out


def _host_bytes(a) -> int | None:
    """``--host-memory`` in bytes (None: no host limit)."""
    return int(a.host_memory * 2**30) if a.host_memory is not None else None


def _cmd_trace(a) -> int:
    from simulations import _trace

    case = _trace_case(a)
    log = None if a.json else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.find_max:
        g = a.granularity or 1024 * a.sp
        if g < 1:
            raise ValueError(f"--granularity={g} must be >= 1")
        best, probes, rep = _trace.find_max(
            case, granularity=g, log=log, host_capacity=_host_bytes(a)
        )
        if rep is None:
            obj: dict[str, Any] = {"model": a.model, "gpu": a.gpu, "dp": a.dp, "sp": a.sp,
                                   "fits": False, "max_seq_len": 0}  # fmt: skip
            if a.host_memory is not None:
                obj["host_capacity_bytes"] = _host_bytes(a)
            print(json.dumps(obj, indent=2) if a.json else f"nothing fits (grid {g:,} tokens)")
            return 1
        obj = dict(rep, max_seq_len=best, granularity=g, probes=probes)
        obj.update(_find_max_with_headroom(a, case, g, best, log))
    else:
        obj = _trace.report(case, breakdown=a.breakdown)
    print(json.dumps(obj, indent=2) if a.json else _format_trace(obj))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["trace-check"]:  # its own options (simulations/trace_check.py)
        from simulations.trace_check import main as trace_check

        try:
            return trace_check(args[1:])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    a = _parser().parse_args(args)
    cmd = {
        "predict": _cmd_predict,
        "compare": _cmd_compare,
        "plan": _cmd_plan,
        "published": _cmd_published,
        "validate": _cmd_validate,
        "trace": _cmd_trace,
    }[a.cmd]
    try:
        if getattr(a, "plot", None):
            from simulations.plots import require_matplotlib

            require_matplotlib()  # fail before any work, not after printing the report
        return cmd(a)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m simulations published | head`: the reader left
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)  # the exit's flush must not raise again
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a program the shell's pipe stopped
    except ImportError as e:
        if "matplotlib" in str(e):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
