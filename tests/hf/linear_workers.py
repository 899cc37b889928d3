"""Per-rank functions for tests/hf/test_linear_attention.py: Qwen3.5, Qwen3.5-MoE and Qwen3-Next
(Gated DeltaNet hybrids) under ``apply_ulysses``, and the tiny random models they use."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
VOCAB, S, G = 96, 71, 4  # S: two delta-rule chunks (64); uneven over sp=2 and sp=4
DOCS = [[30, 5, 36], [71], [3, 68], [40, 31]]  # packed documents per row
LAYOUTS = ((1, 2), (2, 2), (1, 4))
# float64 (the delta-rule kernel itself computes in fp32: the gradients of A_log, summed over
# tokens of both signs, agree to ~1e-7 in float64 but only ~5e-4 in fp32); MoE experts in the
# eager loop (grouped_mm has no float64)
DTYPE, _EXPERTS = torch.float64, {"experts_implementation": "eager"}
_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


def make_config(family: str):
    """Tiny config: both layer kinds; linear key heads != value heads (2 value heads each)."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
        linear_value_head_dim=4, linear_conv_kernel_dim=4, layer_types=_LAYER_TYPES,
        tie_word_embeddings=False,
    )  # fmt: skip
    # the router loss on (and weighty): with_ulysses must make it global (hf/models/moe.py)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, output_router_logits=True,
               router_aux_loss_coef=0.1)  # fmt: skip
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**common, **moe)
    if family == "qwen3_next":  # output gate and partial rotary (0.5) in full attention
        return tf.Qwen3NextConfig(**common, **moe, partial_rotary_factor=0.5)
    if family == "qwen3_next_uneven":  # 6 key heads: sp=4 divides neither them nor 6 * 2
        return tf.Qwen3NextConfig(
            **{**common, "linear_num_key_heads": 6, "linear_num_value_heads": 12}, **moe
        )
    raise ValueError(family)


def save_model(family: str, directory: Path, seed: int = 0) -> str:
    """A random-init model saved locally; every weight perturbed (norms, A_log, dt_bias too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family), dtype=DTYPE, **_EXPERTS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return str(directory)


def global_batch(packed: bool, seed: int = 1):
    """``ids[G, S]``, next-token targets ``[G, S]`` (-100: none) and position ids (restarting at
    0 per document when packed; no target across a document boundary)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (G, S), generator=g)
    tgt = torch.full((G, S), -100)
    tgt[:, :-1] = ids[:, 1:]
    pos = torch.arange(S).expand(G, S).clone()
    if packed:
        for b, lengths in enumerate(DOCS):
            start = 0
            for n in lengths:
                pos[b, start : start + n] = torch.arange(n)
                tgt[b, start + n - 1] = -100
                start += n
    return ids, tgt, pos


def reference(model_dir: str, packed: bool) -> dict:
    """The stock model on one process: mean loss over the batch's targets and every gradient;
    packed: every document run on its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, **_EXPERTS)
    ids, tgt, _ = global_batch(packed)
    docs = DOCS if packed else [[S]] * G
    total = torch.zeros(())
    for b in range(G):
        start = 0
        for n in docs[b]:
            logits = model(input_ids=ids[b : b + 1, start : start + n]).logits[0]
            total = total + F.cross_entropy(
                logits, tgt[b, start : start + n], ignore_index=-100, reduction="sum"
            )
            start += n
    loss = total / int((tgt != -100).sum())
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


_MESHES: dict = {}


def _mesh(dp: int, sp: int, world: int) -> tuple[DeviceMesh, int, int]:
    """A ``(dp, sp)`` mesh on all ``world`` ranks, sp contiguous; for ``dp * sp < world`` the
    ranks form ``world / (dp * sp)`` independent copies (sub-meshes: each copy sees the same
    batch). Returns the mesh, this rank's dp index and the number of copies."""
    rank = dist.get_rank()
    copies = world // (dp * sp)
    if (dp, sp) not in _MESHES:
        grid = torch.arange(world).view(copies * dp, sp)
        _MESHES[(dp, sp)] = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "sp"))
    return _MESHES[(dp, sp)], (rank // sp) % dp, copies


def _spy_kernel(model, seen: list):
    """Record the q shape each call of the delta-rule kernel of ``model``'s modeling file
    receives; returns the function that removes the spy."""
    mod = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    inner = mod.torch_chunk_gated_delta_rule

    def spy(query, *args, **kwargs):
        seen.append(tuple(query.shape))
        return inner(query, *args, **kwargs)

    mod.torch_chunk_gated_delta_rule = spy
    return lambda: setattr(mod, "torch_chunk_gated_delta_rule", inner)


def equivalence(rank: int, world: int, dirs: dict, packed: bool) -> dict:
    """For each family and layout: the loss and every gradient (summed over the ranks that
    share a batch), plus what the layer saw (local input rows, the kernel's q shape)."""
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses import hf
    from dtensor_ulysses.plan import seq_split

    out: dict = {}
    ids, tgt, pos = global_batch(packed)
    for family, model_dir in dirs.items():
        for dp, sp in LAYOUTS:
            mesh, dp_rank, copies = _mesh(dp, sp, world)
            sp_rank = mesh.get_local_rank("sp")
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, **_EXPERTS)
            hf.apply_ulysses(model, mesh)
            sizes = seq_split(S, sp)
            lo = sum(sizes[:sp_rank])
            cols = slice(lo, lo + sizes[sp_rank])
            rows = slice(dp_rank * G // dp, (dp_rank + 1) * G // dp)
            seen_in: list = []
            gdn = model.model.layers[0].linear_attn
            hook = gdn.register_forward_hook(lambda m, a, k, o: seen_in.append(tuple(o.shape)),
                                             with_kwargs=True)  # fmt: skip
            seen_kernel: list = []
            unspy = _spy_kernel(model, seen_kernel)
            kw = {"position_ids": pos[rows, cols]} if packed else {}
            try:
                logits = model(input_ids=ids[rows, cols], **kw).logits
            finally:
                hook.remove()
                unspy()
            loss_sum = F.cross_entropy(logits.flatten(0, 1), tgt[rows, cols].flatten(),
                                       ignore_index=-100, reduction="sum")  # fmt: skip
            (loss_sum / int((tgt != -100).sum())).backward()
            # the ranks of one copy share the batch: sum their losses and gradients
            group = dist.group.WORLD if dp > 1 else mesh.get_group("sp")
            total = loss_sum.detach().clone()
            dist.all_reduce(total, group=group)
            grads = {}
            for n, p in model.named_parameters():
                g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                dist.all_reduce(g, group=group)
                grads[n] = g
            out[(family, dp, sp)] = {
                "loss": total.item() / int((tgt != -100).sum()),
                "grads": grads,
                "layer_out": seen_in,
                "kernel_q": seen_kernel,
                "copies": copies,
            }
    return out if rank == 0 else None


def features(rank: int, world: int, dirs: dict) -> dict:
    """At sp=world: the closed-form bytes of one Gated DeltaNet layer, the guard with a layer
    left unrouted, uneven key heads (refused, then accepted with allow_uneven_heads)."""
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses import hf
    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.plan import seq_split

    res: dict = {}
    mesh, _, _ = _mesh(1, world, world)
    sizes = seq_split(S, world)
    lo = sum(sizes[:rank])
    ids, _, _ = global_batch(False)
    x_ids = ids[:, lo : lo + sizes[rank]]

    # bytes of one layer: its forward and backward all-to-alls on the layer's own call
    model = AutoModelForCausalLM.from_pretrained(dirs["qwen3_next"], dtype=DTYPE, **_EXPERTS)
    hf.apply_ulysses(model, mesh)
    model(input_ids=x_ids)  # the first forward (guard) done
    gdn = model.model.layers[0].linear_attn
    layout = hf.shard_batch({"input_ids": ids}, mesh).layout
    x = torch.randn(G, sizes[rank], 32, dtype=DTYPE, requires_grad=True)
    with CommCounter() as fwd:
        y = gdn(x, ulysses_layout=layout)
    with CommCounter() as bwd:
        y.sum().backward()
    res["bytes"] = {
        "forward": [c.bytes for c in fwd.calls if c.kind == "all_to_all"],
        "backward": [c.bytes for c in bwd.calls if c.kind == "all_to_all"],
        "other": [c.kind for c in fwd.calls + bwd.calls if c.kind != "all_to_all"],
        "sizes": sizes,
    }

    # the guard: layer 2's Gated DeltaNet given back its stock forward
    model = AutoModelForCausalLM.from_pretrained(dirs["qwen3_5"], dtype=DTYPE, **_EXPERTS)
    hf.apply_ulysses(model, mesh)
    del model.model.layers[2].linear_attn.forward
    try:
        model(input_ids=x_ids)
    except hf.UnroutedAttentionError as e:
        res["guard"] = str(e)

    # 6 key heads on sp=4: refused, then run with ceil/floor key heads per rank
    model = AutoModelForCausalLM.from_pretrained(dirs["qwen3_next_uneven"], dtype=DTYPE, **_EXPERTS)
    try:
        hf.apply_ulysses(model, mesh)
    except ValueError as e:
        res["uneven_refused"] = f"{type(e).__name__}: {e}"
    hf.apply_ulysses(model, mesh, allow_uneven_heads=True)
    logits = model(input_ids=x_ids).logits
    (logits.pow(2).sum() / (G * S * VOCAB)).backward()  # the ranks sum to the full mean
    res["uneven_logits"] = logits.detach()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[n] = g
    res["uneven_grads"] = grads
    res["slice"] = (lo, lo + sizes[rank])
    return res


def trainers(rank: int, world: int, specs: list) -> list:
    """``with_ulysses(transformers.Trainer)`` runs (tests/hf/trainer_workers.py), last in a world
    (a trainer may tear the process group down)."""
    from tests.hf import trainer_workers as T

    return T.run_specs(rank, world, specs)


def run_jobs(rank: int, world: int, jobs: list):
    """Several jobs in one spawned world; returns each job's result (rank 0's, or all)."""
    return [globals()[name](rank, world, *args) for name, args in jobs]
