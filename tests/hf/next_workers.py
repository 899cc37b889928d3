"""Per-rank functions and tiny configs for tests/hf/test_families_next.py (issue 41, part A):
multi-head latent attention (DeepSeek-V3, DeepSeek-V2, GLM-4.7-Flash ``glm4_moe_lite``),
Gemma 4 text and SmolLM3 under ``apply_ulysses``, and ``--hf-model`` on per-expert MoE
checkpoints (Mixtral, Qwen3-MoE, GLM-4-MoE).

Legend: ``G`` rows of the global batch, ``S`` tokens per row (19: uneven over sp=2 and sp=4),
``W`` the sliding window (8: shorter than ``S``, longer than an sp=4 slice of 5).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from tests import hf_workers as W

S, G = W.S, W.G
WINDOW = 8
LAYOUTS = ((1, 2), (2, 2), (1, 4))
FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "gemma4_text", "smollm3")
# float64 (SDPA's reference runs in float64; eager attention's softmax is float32); MoE experts
# in the eager loop (grouped_mm has no float64)
DTYPE, EXPERTS = torch.float64, {"experts_implementation": "eager"}
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
               tie_word_embeddings=False)  # fmt: skip
_MLA_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1)  # fmt: skip
# the latent attention dims: (kv_lora_rank r, q_lora_rank, rope dr, nope dn, v dv). With 4 heads
# N * (dqk + dv) = 4 * (12 + 6) = 72 elements of k and v per token; the latent is r + dr.
MLA = {
    "deepseek_v3": (14, 12, 4, 8, 6),  # L = 18: latent at sp=2 (36 < 72), heads at sp=4 (72)
    "deepseek_v2": (28, None, 4, 8, 6),  # L = 32: latent at sp=2 (64 < 72), heads at sp=4
    "glm4_moe_lite": (8, 12, 4, 8, 6),  # L = 12: latent at sp=2 and sp=4 (48 < 72)
}


def make_config(family: str, **over: Any):
    """A tiny config of ``family`` with its features on; ``over`` replaces settings."""
    from transformers import AutoConfig

    if family in MLA:
        r, q_r, dr, dn, dv = MLA[family]
        kw = dict(_COMMON, **_MLA_MOE, kv_lora_rank=r, q_lora_rank=q_r, qk_rope_head_dim=dr,
                  qk_nope_head_dim=dn, v_head_dim=dv)  # fmt: skip
    elif family == "deepseek_v32":  # sparse attention (a top-k indexer): refused
        kw = dict(_COMMON, **_MLA_MOE, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4,
                  qk_nope_head_dim=8, v_head_dim=6, index_n_heads=2, index_head_dim=8,
                  index_topk=4, num_hidden_layers=1)  # fmt: skip
    elif family == "gemma4_text":
        # sliding layers: head dim 8, 2 kv heads, window 8; global layers: head dim 16, ONE kv
        # head (sp=4 replicates it), keys equal values; per-layer input embeddings; layers 2
        # and 3 attend with the keys and values of layers 0 and 1 (KV sharing)
        kw = dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                  global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                  num_kv_shared_layers=2, hidden_size_per_layer_input=4,
                  vocab_size_per_layer_input=96)  # fmt: skip
    elif family == "smollm3":  # layers 1 and 3 without RoPE; a sliding window on every layer
        kw = dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=2,
                  use_sliding_window=True, sliding_window=WINDOW, max_window_layers=4,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    else:
        raise ValueError(family)
    kw.update(over)
    return AutoConfig.for_model(family, **kw)


def save_model(family: str, directory: Path, seed: int = 0, **over: Any) -> str:
    """A random-init model saved locally; every weight perturbed (norms, routers too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **over), dtype=DTYPE, **EXPERTS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return str(directory)


def load(model_dir: str, attn: str | None = None):
    from transformers import AutoModelForCausalLM

    kw = {} if attn is None else {"attn_implementation": attn}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, **EXPERTS, **kw)


def reference(model_dir: str, packed: bool) -> dict:
    """The stock model on one process (SDPA, float64): the mean cross entropy over the batch's
    targets and every gradient; packed: every document run on its own."""
    model = load(model_dir, "sdpa")
    ids, labels, _, docs = W.global_batch(packed)
    total, count = torch.zeros((), dtype=DTYPE), 0
    for b in range(G):
        start = 0
        for n in docs[b]:
            logits = model(input_ids=ids[b : b + 1, start : start + n]).logits[0]
            y = labels[b, start + 1 : start + n]
            total = total + F.cross_entropy(logits[:-1], y, ignore_index=-100, reduction="sum")
            count += int((y != -100).sum())
            start += n
    loss = total / count
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"loss": loss.item(), "grads": grads}


_MESHES: dict = {}


def _mesh(dp: int, sp: int, world: int) -> tuple[DeviceMesh, int]:
    """A ``(dp, sp)`` mesh on all ranks; for ``dp * sp < world`` independent copies (each on
    the whole batch). Returns the mesh and this rank's dp index."""
    copies = world // (dp * sp)
    if (dp, sp) not in _MESHES:
        grid = torch.arange(world).view(copies * dp, sp)
        _MESHES[(dp, sp)] = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "sp"))
    return _MESHES[(dp, sp)], (dist.get_rank() // sp) % dp


def equivalence(rank: int, world: int, dirs: dict, packed: bool) -> dict:
    """Per family and layout: the loss and every gradient (summed over the ranks sharing a
    batch), and each latent layer's exchange (``"latent"`` / ``"heads"``)."""
    from dtensor_ulysses import hf

    out: dict = {}
    ids, labels, pos, _ = W.global_batch(packed)
    n_valid = int((labels[:, 1:] != -100).sum())
    for family, model_dir in dirs.items():
        for dp, sp in LAYOUTS:
            mesh, dp_rank = _mesh(dp, sp, world)
            model = load(model_dir)
            hf.apply_ulysses(model, mesh["sp"])
            rows = slice(dp_rank * G // dp, (dp_rank + 1) * G // dp)
            batch = {"input_ids": ids[rows], "labels": labels[rows]}
            if packed:
                batch["position_ids"] = pos[rows]
            sb = hf.shard_batch(batch, mesh, count_valid=False)
            logits = model(input_ids=sb.input_ids, position_ids=sb.position_ids,
                           ulysses_layout=sb.layout).logits  # fmt: skip
            loss_sum = F.cross_entropy(logits.flatten(0, 1), sb.labels.flatten(),
                                       ignore_index=-100, reduction="sum")  # fmt: skip
            (loss_sum / n_valid).backward()
            group = dist.group.WORLD if dp > 1 else mesh.get_group("sp")
            total = loss_sum.detach().clone()
            dist.all_reduce(total, group=group)
            grads = {}
            for n, p in model.named_parameters():
                g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                dist.all_reduce(g, group=group)
                grads[n] = g
            state = model.model.__dict__["_du_ulysses_state"]
            out[(family, dp, sp)] = {"loss": total.item() / n_valid, "grads": grads,
                                     "latent": dict(state.latent)}  # fmt: skip
    return out if rank == 0 else None


def _layer_bytes(model, layer, x, layout, mesh) -> dict:
    """The collectives of one attention layer's forward and backward (this rank)."""
    from dtensor_ulysses.debug import CommCounter

    base = model.model
    rotary = base.rotary_emb
    pos = torch.arange(layout.offset(mesh.get_local_rank("sp")),
                       layout.offset(mesh.get_local_rank("sp")) + x.shape[1])[None]  # fmt: skip
    kw: dict = {"ulysses_layout": layout, "attention_mask": None}
    if hasattr(layer, "layer_type"):  # Gemma 4: rotary per layer type, shared kv states
        kw["position_embeddings"] = rotary(x, pos, layer.layer_type)
    else:
        kw["position_embeddings"] = rotary(x, pos)
    extra = layer.__dict__.get("_du_test_kwargs", {})
    with CommCounter() as fwd:
        y = layer(x, **kw, **extra)[0]
    with CommCounter() as bwd:
        y.sum().backward()
    return {
        "forward": [(c.kind, c.bytes) for c in fwd.calls],
        "backward": sorted((c.kind, c.bytes) for c in bwd.calls),
    }


def features(rank: int, world: int, dirs: dict, refuse_dirs: dict) -> dict:
    """At sp=world: the bytes of one latent attention layer on each path (GLM-4.7-Flash:
    latent; DeepSeek-V3: heads), of Gemma 4's KV-sharing layers; the guard with a layer left
    unrouted; the refusals at construction."""
    from dtensor_ulysses import hf
    from dtensor_ulysses.plan import seq_split

    res: dict = {}
    mesh, _ = _mesh(1, world, world)
    sizes = seq_split(S, world)
    lo = sum(sizes[:rank])
    ids, _, _, _ = W.global_batch(False)
    x_ids = ids[:, lo : lo + sizes[rank]]
    layout = hf.shard_batch({"input_ids": ids}, mesh).layout
    res["sizes"] = sizes

    for family in ("glm4_moe_lite", "deepseek_v3"):
        model = load(dirs[family])
        hf.apply_ulysses(model, mesh["sp"])
        model(input_ids=x_ids)  # the first forward (guard) done
        x = torch.randn(G, sizes[rank], 32, dtype=DTYPE, requires_grad=True)
        res[f"bytes_{family}"] = _layer_bytes(model, model.model.layers[0].self_attn, x, layout,
                                              mesh)  # fmt: skip

    # Gemma 4: the whole model's attention collectives, forward and backward (layers 2 and 3
    # reuse the k, v layers 0 and 1 exchanged: only q and o move for them)
    from dtensor_ulysses.debug import CommCounter

    model = load(dirs["gemma4_text"])
    hf.apply_ulysses(model, mesh["sp"])
    model(input_ids=x_ids)
    with CommCounter() as fwd:
        logits = model(input_ids=x_ids, ulysses_layout=layout).logits
    with CommCounter() as bwd:
        logits.sum().backward()
    res["bytes_gemma4"] = {"forward": [(c.kind, c.bytes) for c in fwd.calls],
                           "backward": sorted((c.kind, c.bytes) for c in bwd.calls)}  # fmt: skip

    # the guard: one layer of each new kind given its own config (stock attention, its slice
    # only); DeepSeek-V3 at sp=4 runs the heads path, so its stock call does not fail by shape
    for family, layer in (("deepseek_v3", 1), ("gemma4_text", 1), ("smollm3", 1)):
        model = load(dirs[family])
        hf.apply_ulysses(model, mesh["sp"])
        attn = model.model.layers[layer].self_attn
        attn.config = copy.copy(attn.config)
        attn.config._attn_implementation = "sdpa"
        try:
            model(input_ids=x_ids)
            res[f"guard_{family}"] = "no error"
        except hf.UnroutedAttentionError as e:
            res[f"guard_{family}"] = str(e)

    # refusals at construction, one line each
    for name, (model_dir, kw) in refuse_dirs.items():
        try:
            hf.apply_ulysses(load(model_dir), mesh["sp"], **kw)
            res[f"refused_{name}"] = "no error"
        except (hf.UnsupportedModelError, ValueError) as e:
            res[f"refused_{name}"] = f"{type(e).__name__}: {e}"
    return res


def hf_model_moe(rank: int, world: int, dirs: dict, out_root: str) -> dict:
    """``--hf-model`` on per-expert MoE checkpoints at (dp, sp) = (2, 2): load into the FSDP2
    shards, step-1 loss (with the router loss where the stock model adds one) and every
    gradient, one optimizer step, save_pretrained; rank 0 returns the trained full weights."""
    from types import SimpleNamespace

    from dtensor_ulysses import hf
    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh

    out: dict = {}
    ids, labels, pos, _ = W.global_batch(False)
    mesh = init_mesh(2, world // 2, device_type="cpu")
    for family, model_dir in dirs.items():
        cfg = W._cfg(model_dir, 2, world // 2, attention_backend="auto")
        model, opt, _ = du_train.build(cfg, mesh, torch.device("cpu"))
        b = G // 2
        rows = slice(mesh.get_local_rank("dp") * b, (mesh.get_local_rank("dp") + 1) * b)
        sb = hf.shard_batch({"input_ids": ids[rows], "labels": labels[rows],
                             "position_ids": pos[rows]}, mesh)  # fmt: skip
        group = flatten_dp_sp(mesh).get_group()
        local_sum, n_valid = du_train.forward_backward(model, sb, group)
        total = local_sum.reshape(1).clone()
        dist.all_reduce(total, group=group)
        grads = {n: W._full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        saved = str(Path(out_root) / f"saved_{family}")
        hf.save_pretrained(model, saved)
        trained = {n: W._full(p.detach()).clone() for n, p in model.named_parameters()}
        out[family] = SimpleNamespace(loss=total.item() / n_valid, grads=grads, trained=trained,
                                      saved=saved).__dict__  # fmt: skip
    return out if rank == 0 else None


def trainers(rank: int, world: int, specs: list) -> list:
    """``with_ulysses(transformers.Trainer)`` runs (tests/hf/trainer_workers.py), last in a world
    (a trainer may tear the process group down)."""
    from tests.hf import trainer_workers as T

    return T.run_specs(rank, world, specs)


def run_jobs(rank: int, world: int, jobs: list):
    """Several jobs in one spawned world; returns each job's result."""
    return [globals()[name](rank, world, *args) for name, args in jobs]
