"""Per-rank functions and tiny configs for tests/hf/test_families.py: every model family of
issue 30 with its features on (windows and chunks shorter than the sequence, softcapping, sinks,
the router loss), under ``apply_ulysses`` and ``with_ulysses(transformers.Trainer)``.

Legend: ``G`` rows of the global batch, ``S`` tokens per row, ``W`` the sliding window (in
transformers' convention: a query sees itself and ``W - 1`` keys before it), ``C`` the chunk.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh
from tests import hf_workers as W

S, G = W.S, W.G  # 19 tokens (sp=4: slices of 5, shorter than the window), 4 rows
WINDOW, CHUNK = 8, 6  # both shorter than S; the window longer than an sp=4 slice
MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
SMALL = dict(W.SMALL)
FAMILIES = ("gemma2", "gemma3_text", "gpt_oss", "mistral", "qwen2", "mixtral", "qwen3_moe",
            "glm4_moe", "llama4_text", "olmo3")  # fmt: skip
# what each family has on in the test (the model table of docs/how-to/huggingface.md)
FEATURES = {
    "gemma2": ("window", "softcap"),
    "gemma3_text": ("window",),  # its attention passes no softcap (set in the config here)
    "gpt_oss": ("window", "sinks", "router loss"),
    "mistral": ("window",),
    "qwen2": ("window",),
    "mixtral": ("window", "router loss"),
    "qwen3_moe": ("window", "router loss"),
    "glm4_moe": ("MoE without a router loss",),
    "llama4_text": ("chunk", "NoPE temperature", "MoE"),
    "olmo3": ("window",),
}


def make_config(family: str, **over: Any):
    """A tiny fp32 config of ``family`` with its features on; ``over`` replaces settings."""
    from transformers import AutoConfig

    s = dict(SMALL)
    two = ["sliding_attention", "full_attention"]
    kw: dict[str, Any] = {
        "gemma2": dict(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                       query_pre_attn_scalar=8, final_logit_softcapping=None),
        "gemma3_text": dict(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                            query_pre_attn_scalar=8, layer_types=two),
        "gpt_oss": dict(head_dim=8, sliding_window=WINDOW, num_local_experts=4, **MOE,
                        intermediate_size=16),
        "mistral": dict(sliding_window=WINDOW),
        "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "mixtral": dict(sliding_window=WINDOW, num_local_experts=4, **MOE),
        "qwen3_moe": dict(head_dim=8, num_experts=4, moe_intermediate_size=16, **MOE,
                          use_sliding_window=True, sliding_window=WINDOW),
        "glm4_moe": dict(head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                         topk_group=1),
        # layer 0 chunked (RoPE), layer 1 full attention without RoPE, with the temperature
        "llama4_text": dict(head_dim=8, intermediate_size_mlp=64, num_local_experts=2,
                            num_experts_per_tok=1, attention_chunk_size=CHUNK,
                            no_rope_layers=[1, 0], interleave_moe_layer_step=1, floor_scale=4,
                            attn_scale=0.5),
        "olmo3": dict(sliding_window=WINDOW, layer_types=two),
    }[family]  # fmt: skip
    s.update(kw)
    s.update(over)
    if family == "gpt_oss":
        s["intermediate_size"] = kw["intermediate_size"]
    return AutoConfig.for_model(family, **s)


def save_family(family: str, directory: Path, seed: int = 0, **over: Any) -> str:
    """A random-init ``family`` model saved with save_pretrained, every weight perturbed (sinks,
    routers, norms: not their trivial init)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **over), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "sinks" in name else 0.05))
    model.save_pretrained(directory)
    return str(directory)


def _load(model_dir: str, attn: str | None = "eager"):
    from transformers import AutoModelForCausalLM

    kw = {} if attn is None else {"attn_implementation": attn}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    model.config.use_cache = False
    return model


def _router(model) -> Any:
    from dtensor_ulysses.hf import router_loss_config

    rc = router_loss_config(model)
    return rc if rc is not None and rc.enabled else None


def reference(model_dir: str, packed: bool, per_document: bool = True) -> dict:
    """The stock model on one process (eager attention), global batch: loss and every gradient.

    Plain rows: the stock ``loss`` (its mean cross entropy plus ``coef * aux_loss`` for an MoE
    with the router loss on). Packed: every document run on its own (the cross entropy summed
    over documents / the batch's targets), and the router loss by the modeling file's own
    ``load_balancing_loss_func`` over the router logits of every document's tokens; or, with
    ``per_document=False``, the stock model on the packed rows with their position ids (its
    own packed-sequence masks)."""
    model = _load(model_dir)
    ids, labels, pos, docs = W.global_batch(packed)
    rc = _router(model)
    if not packed:
        loss = model(input_ids=ids, labels=labels).loss
    elif not per_document:
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
    else:
        ce, count, layers = torch.zeros(()), 0, None
        for b in range(G):
            start = 0
            for n in docs[b]:
                x, y = ids[b : b + 1, start : start + n], labels[b : b + 1, start : start + n]
                out = model(input_ids=x, output_router_logits=rc is not None)
                ce = ce + F.cross_entropy(out.logits[0, :-1], y[0, 1:], reduction="sum")
                count += int((y[0, 1:] != -100).sum())
                if rc is not None:
                    rl = list(out.router_logits)
                    layers = rl if layers is None else [torch.cat(p) for p in zip(layers, rl)]
                start += n
        loss = ce / count
        if rc is not None:
            stock = sys.modules[type(model).__module__].load_balancing_loss_func
            loss = loss + rc.coef * stock(tuple(layers), rc.num_experts, rc.top_k, None)
    loss.backward()
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for n, p in model.named_parameters()
    }
    return {"loss": loss.item(), "grads": grads}


def apply_case(rank: int, world: int, model_dir: str, dp: int, sp: int, packed: bool,
               options: dict) -> dict | None:  # fmt: skip
    """``apply_ulysses`` on a plain model (full weights on every rank), this rank's slice of
    its dp rows: ``CE sum / N + coef * router share``, gradients summed over the ranks that
    share the batch. ``(dp, sp) = (1, 2)`` in a 4-rank world: two independent sp=2 groups, each
    on the whole batch (a 2-rank sub-mesh). Rank 0's loss and gradients."""
    from dtensor_ulysses import hf
    from dtensor_ulysses.models import cross_entropy_sum

    sub = dp * sp < world
    mesh = init_mesh(world // sp, sp, device_type="cpu")
    group = mesh["sp"].get_group() if sub else flatten_dp_sp(mesh).get_group()
    model = _load(model_dir, attn=None)
    hf.apply_ulysses(model, mesh["sp"], **options)
    ids, labels, pos, _ = W.global_batch(packed)
    n_valid = int((labels[:, 1:] != -100).sum())
    b = G // dp
    r = 0 if sub else mesh.get_local_rank("dp")
    batch = {"input_ids": ids[r * b : (r + 1) * b], "labels": labels[r * b : (r + 1) * b]}
    if packed:
        batch["position_ids"] = pos[r * b : (r + 1) * b]
    sb = hf.shard_batch(batch, mesh, count_valid=False)
    rc = _router(model)
    out = model(input_ids=sb.input_ids, position_ids=sb.position_ids, ulysses_layout=sb.layout,
                output_router_logits=rc is not None)  # fmt: skip
    loss = cross_entropy_sum(out.logits, sb.labels) / n_valid
    if rc is not None:
        rl = hf.load_balancing_loss(out.router_logits, rc.num_experts, rc.top_k, group)
        loss = loss + rc.coef * rl.share
    loss.backward()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[n] = g
    return {"loss": total.item(), "grads": grads} if rank == 0 else None


def run_cases(rank: int, world: int, cases: list) -> list:
    """Many ``apply_case`` calls in one world (a world costs seconds to start)."""
    out = []
    for model_dir, dp, sp, packed, options in cases:
        try:
            out.append(apply_case(rank, world, model_dir, dp, sp, packed, options))
        except Exception as e:  # the parent says which case, with the message
            raise RuntimeError(f"{model_dir} at (dp, sp) = ({dp}, {sp}), packed={packed}") from e
    return out


def refusal(rank: int, world: int, model_dir: str, backend: str) -> str:
    """The message of ``apply_ulysses(model, backend=...)`` for a backend that cannot run the
    model's features (raised before any forward)."""
    from dtensor_ulysses import hf

    mesh = init_mesh(1, world, device_type="cpu")
    try:
        hf.apply_ulysses(_load(model_dir, attn=None), mesh["sp"], backend=backend)
    except hf.UnsupportedModelError as e:
        return str(e)
    return "no error"


def run_jobs(rank: int, world: int, jobs: list) -> list:
    """``("cases", [apply cases])``, ``("specs", [trainer specs])`` and ``("hf_model", (dirs,
    dp, sp))`` (the trainer's ``--hf-model`` build, plain rows) jobs in one world."""
    from tests.hf import trainer_workers as T

    out = []
    for kind, payload in jobs:
        if kind == "cases":
            out.append(run_cases(rank, world, payload))
        elif kind == "specs":
            out.append(T.run_specs(rank, world, payload))
        elif kind == "refusal":
            out.append(refusal(rank, world, *payload))
        else:
            dirs, dp, sp = payload
            out.append(W.train_three_steps(rank, world, dirs, [(dp, sp)], False,
                                           {"attention_backend": "auto"}))  # fmt: skip
    return out


def main(argv: list[str]) -> None:
    """Under torchrun: the trainer specs of the JSON file ``argv[0]``; rank 0 pickles the
    results to ``argv[1]``. The process then ends as a user's script does (no ``os._exit``):
    with_ulysses' teardown at exit is what makes the status 0."""
    import json
    import pickle

    from tests.hf import trainer_workers as T

    specs = json.loads(Path(argv[0]).read_text())
    results = [T.run(spec) for spec in specs]
    if dist.get_rank() == 0:
        Path(argv[1]).write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
