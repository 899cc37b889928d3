"""Per-rank functions for tests/hf/test_hybrids.py: the state-space and convolution hybrids
(Nemotron-H, Granite 4.0-H, Falcon-H1: Mamba-2; LFM2, LFM2-MoE: short convolutions; OLMo
hybrid: Gated DeltaNet with its own projections) under
``apply_ulysses``, and the tiny random models they use (each family's own config class).

Every feature is shorter than the sequence and than a rank's slice: Mamba-2 scan chunks of 8 and
conv kernels of 4, LFM2 kernels of 3, on rows of S = 71 tokens (18 or 17 per rank at sp=4).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.hf.linear_workers import _mesh

FAMILIES = (
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "lfm2",
    "lfm2_moe",
    "olmo_hybrid",
    "kimi_linear_kda",
)
VOCAB, S, G = 96, 71, 4
DOCS = [[30, 5, 36], [71], [3, 68], [40, 31]]  # packed documents per row (one of 3 tokens)
LAYOUTS = ((1, 2), (2, 2), (1, 4))
DTYPE, _EXPERTS = torch.float64, {"experts_implementation": "eager"}
# Mamba-2 shapes of the tiny configs: 8 heads of 4, state 8; Nemotron-H 2 groups (replicated
# over pairs of ranks at sp=4), Granite and Falcon-H1 1 group (replicated at every sp)
MAMBA = dict(heads=8, head_dim=4, state=8)
MAMBA_GROUPS = {"nemotron_h": 2, "granitemoehybrid": 1, "falcon_h1": 1}


def make_config(family: str):
    """Tiny config of ``family``'s own class: both layer kinds, features shorter than a slice."""
    import transformers as tf

    att = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    if family == "nemotron_h":  # mamba, attention, mamba, MoE, MLP blocks
        return tf.NemotronHConfig(
            **att, head_dim=8, intermediate_size=48,
            layers_block_type=["mamba", "attention", "mamba", "moe", "mlp"],
            mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8, conv_kernel=4,
            chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1,
        )  # fmt: skip
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **att, intermediate_size=48, num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=4,
            mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
            mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=16, output_router_logits=True, router_aux_loss_coef=0.1,
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
            logits_scaling=1.5,
        )  # fmt: skip
    if family == "falcon_h1":  # attention and Mamba-2 side by side; muP; the gate without norm
        return tf.FalconH1Config(
            **att, intermediate_size=48, num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=8,
            mamba_d_head=4, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_chunk_size=8, mamba_rms_norm=False, ssm_in_multiplier=0.7,
            ssm_out_multiplier=1.3, attention_in_multiplier=0.9, attention_out_multiplier=1.1,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], key_multiplier=0.8,
        )  # fmt: skip
    if family == "olmo_hybrid":  # Gated DeltaNet: 4 key heads, 2 value heads each; beta in [0, 2]
        return tf.OlmoHybridConfig(
            **att, intermediate_size=48, num_hidden_layers=3, pad_token_id=0, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
            linear_value_head_dim=4, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        )  # fmt: skip
    if family.startswith("kimi_linear"):  # KDA (4 heads of 8, conv 4); "_mla": beside MLA
        types = ["linear_attention", "full_attention" if family.endswith("mla") else
                 "linear_attention", "linear_attention"]  # fmt: skip
        # MLA expands every head from the latent (no kv groups), as Kimi Linear's own configs
        return tf.KimiLinearConfig(
            **{**att, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3,
            num_local_experts=4, num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, layer_types=types,
            linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    lfm = dict(intermediate_size=48, num_hidden_layers=3, conv_L_cache=3,
               layer_types=["conv", "full_attention", "conv"])  # fmt: skip
    if family == "lfm2":
        return tf.Lfm2Config(**att, **lfm)
    if family == "lfm2_moe":
        return tf.Lfm2MoeConfig(**att, **lfm, moe_intermediate_size=16, num_dense_layers=1,
                                num_experts=4, num_experts_per_tok=2)  # fmt: skip
    if family == "falcon_6heads":  # 6 Mamba heads: sp=4 does not divide them
        cfg = make_config("falcon_h1")
        cfg.mamba_n_heads, cfg.mamba_d_ssm = 6, 24
        return cfg
    raise ValueError(family)


def save_model(family: str, directory: Path, seed: int = 0) -> str:
    """A random-init model saved locally; every weight perturbed (norms, A_log, D, dt_bias)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family), dtype=DTYPE, **_EXPERTS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return str(directory)


def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, **_EXPERTS)


def global_batch(packed: bool, seed: int = 1):
    """``ids[G, S]``, next-token targets (-100: none) and position ids (restarting per document
    when packed; no target across a document boundary)."""
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


def _loss_of(model, logits, tgt):
    """The summed cross-entropy (and, for MoE families, nothing else: the router loss is a
    with_ulysses matter; this test holds the layers)."""
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="sum")


def reference(model_dir: str, packed: bool) -> dict:
    """The stock model on one process: mean loss and every gradient; packed: each document
    run on its own."""
    model = load(model_dir)
    ids, tgt, _ = global_batch(packed)
    docs = DOCS if packed else [[S]] * G
    total = torch.zeros((), dtype=DTYPE)
    for b in range(G):
        start = 0
        for n in docs[b]:
            logits = model(input_ids=ids[b : b + 1, start : start + n], use_cache=False).logits
            total = total + _loss_of(model, logits, tgt[b : b + 1, start : start + n])
            start += n
    loss = total / int((tgt != -100).sum())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def _mixers(model) -> list:
    from dtensor_ulysses.hf.models.mixers import is_sequence_mixer

    return [m for m in model.modules() if is_sequence_mixer(m)]


def equivalence(rank: int, world: int, dirs: dict, packed: bool) -> dict:
    """For each family and layout: the loss and every gradient (summed over the ranks that
    share a batch), and the shape of each mixer's input on this rank."""
    from dtensor_ulysses import hf
    from dtensor_ulysses.plan import seq_split

    out: dict = {}
    ids, tgt, pos = global_batch(packed)
    for family, model_dir in dirs.items():
        for dp, sp in LAYOUTS:
            mesh, dp_rank, _ = _mesh(dp, sp, world)
            sp_rank = mesh.get_local_rank("sp")
            model = load(model_dir)
            hf.apply_ulysses(model, mesh)
            sizes = seq_split(S, sp)
            lo = sum(sizes[:sp_rank])
            cols = slice(lo, lo + sizes[sp_rank])
            rows = slice(dp_rank * G // dp, (dp_rank + 1) * G // dp)
            seen: list = []
            hooks = [m.register_forward_hook(lambda m, a, k, o: seen.append(tuple(o.shape)),
                                             with_kwargs=True) for m in _mixers(model)]  # fmt: skip
            kw = {"position_ids": pos[rows, cols]} if packed else {}
            try:
                logits = model(input_ids=ids[rows, cols], **kw).logits
            finally:
                for h in hooks:
                    h.remove()
            loss_sum = _loss_of(model, logits, tgt[rows, cols])
            (loss_sum / int((tgt != -100).sum())).backward()
            group = dist.group.WORLD if dp > 1 else mesh.get_group("sp")
            total = loss_sum.detach().clone()
            dist.all_reduce(total, group=group)
            grads = {}
            for n, p in model.named_parameters():
                if p.grad is None:  # the same parameters on every rank (e.g. expert biases)
                    continue
                g = p.grad.clone()
                dist.all_reduce(g, group=group)
                grads[n] = g
            out[(family, dp, sp)] = {"loss": total.item() / int((tgt != -100).sum()),
                                     "grads": grads, "mixer_out": sorted(set(seen))}  # fmt: skip
    return out if rank == 0 else None


def _spy(model, fn_name: str, seen: list):
    """Record the shape of the first argument of each call of ``fn_name`` in ``model``'s
    modeling file (the Mamba-2 scan, the convolution); returns the function that removes it."""
    import sys

    mod = sys.modules[type(model).__module__]
    inner = getattr(mod, fn_name)

    def spy(x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return inner(x, *args, **kwargs)

    setattr(mod, fn_name, spy)
    return lambda: setattr(mod, fn_name, inner)


def _one_layer_comm(layer, D: int, layout, s: int) -> dict:
    """The collectives of one routed mixer's own call on random input, forward and backward."""
    from dtensor_ulysses.debug import CommCounter

    x = torch.randn(G, s, D, dtype=DTYPE, requires_grad=True)
    with CommCounter() as fwd:
        y = layer(x, ulysses_layout=layout)
    with CommCounter() as bwd:
        y.sum().backward()
    return {"forward": [(c.kind, c.bytes) for c in fwd.calls],
            "backward": [(c.kind, c.bytes) for c in bwd.calls]}  # fmt: skip


def features(rank: int, world: int, dirs: dict) -> dict:
    """At sp=world: the scan's input shapes, the exchanged bytes of one Mamba-2 layer and of one
    short convolution, the guard with a mixer left unrouted, the refusals (Mamba heads that sp
    does not divide, slices shorter than the halo)."""
    from dtensor_ulysses import hf
    from dtensor_ulysses.plan import seq_split

    res: dict = {}
    mesh, _, _ = _mesh(1, world, world)
    sizes = seq_split(S, world)
    lo = sum(sizes[:rank])
    ids, _, _ = global_batch(False)
    x_ids = ids[:, lo : lo + sizes[rank]]
    layout = hf.shard_batch({"input_ids": ids}, mesh).layout
    for family, layer_of, fn_name in (
        ("nemotron_h", lambda m: m.model.layers[0].mixer, "mamba2_chunk_scan"),
        ("lfm2", lambda m: m.model.layers[0].conv, "causal_conv1d_fn"),
        ("kimi_linear_kda", lambda m: m.model.layers[0].self_attn, "chunk_kimi_delta_attention"),
    ):
        model = load(dirs[family])
        hf.apply_ulysses(model, mesh)
        seen: list = []
        unspy = _spy(model, fn_name, seen)
        try:
            model(input_ids=x_ids)  # the first forward (guard) done
        finally:
            unspy()
        res[f"{family}_kernel"] = sorted(set(seen))
        res[f"{family}_bytes"] = _one_layer_comm(layer_of(model), 32, layout, sizes[rank])
        # the guard: the mixer given back its stock forward
        model = load(dirs[family])
        hf.apply_ulysses(model, mesh)
        del layer_of(model).forward
        try:
            model(input_ids=x_ids)
        except hf.UnroutedAttentionError as e:
            res[f"{family}_guard"] = str(e)
    res["sizes"] = sizes
    # Mamba heads that sp does not divide: refused at construction, the valid sp named
    model = load(dirs["falcon_6heads"])
    try:
        hf.apply_ulysses(model, mesh)
    except ValueError as e:
        res["heads_refused"] = f"{type(e).__name__}: {e}"
    # slices shorter than the halo: refused with the numbers
    model = load(dirs["lfm2"])
    hf.apply_ulysses(model, mesh)
    short = seq_split(4, world)
    slo = sum(short[:rank])
    try:
        model(input_ids=ids[:, slo : slo + short[rank]])
    except ValueError as e:
        res["short_refused"] = f"{type(e).__name__}: {e}"
    return res


def trainers(rank: int, world: int, specs: list) -> list:
    """``with_ulysses(transformers.Trainer)`` runs (tests/hf/trainer_workers.py), last in a world
    (a trainer may tear the process group down)."""
    from tests.hf import trainer_workers as T

    return T.run_specs(rank, world, specs)


def run_jobs(rank: int, world: int, jobs: list):
    """Several jobs in one spawned world; returns each job's result (rank 0's, or all)."""
    return [globals()[name](rank, world, *args) for name, args in jobs]
