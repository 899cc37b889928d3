"""Per-rank functions for tests/hf/test_hf.py (spawned processes import them by module path), and
the small random-init transformers models they use (saved locally, no downloads)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dtensor_ulysses import train as du_train
from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh
from tests.reference import reference_adamw

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA; sp=4 > 2 kv heads replicates them
    max_position_embeddings=128,
)
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
S, G = 19, 4  # uneven over sp=2 ([10, 9]) and sp=4 ([5, 5, 5, 4]); global batch of 4 rows
LR = 1e-2


def make_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**SMALL, tie_word_embeddings=False)
    if arch == "qwen2":  # q/k/v bias, tied embeddings
        return tf.Qwen2Config(**SMALL, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k norm, explicit head_dim
        return tf.Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=False)
    if arch == "mistral":
        return tf.MistralConfig(**SMALL, sliding_window=None, tie_word_embeddings=False)
    if arch == "llama_dropout":  # attention dropout: refused
        return tf.LlamaConfig(**SMALL, attention_dropout=0.1)
    if arch == "gemma3_bidirectional":  # bidirectional attention: refused
        return tf.Gemma3TextConfig(**SMALL, head_dim=8, use_bidirectional_attention=True)
    raise ValueError(arch)


def save_model(arch: str, directory: Path, seed: int = 0) -> Path:
    """A random-init model of ``arch`` saved with save_pretrained (every weight perturbed, so
    biases and norms are not their trivial init)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return directory


def global_batch(packed: bool, seed: int = 1):
    """``[G, S]`` ids, HF-convention labels and position ids; packed: documents per row, labels
    -100 on each document's first token (no target across a document boundary)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (G, S), generator=g)
    labels = ids.clone()
    pos = torch.arange(S).expand(G, S).clone()
    docs = [[S] for _ in range(G)]
    if packed:
        docs = [[7, 5, 7], [19], [3, 16], [10, 9]]  # row 0's second doc spans the sp=2 cut
        for b, lengths in enumerate(docs):
            start = 0
            for n in lengths:
                pos[b, start : start + n] = torch.arange(n)
                labels[b, start] = -100 if start else labels[b, start]
                start += n
    return ids, labels, pos, docs


def _cfg(model_dir: str, dp: int, sp: int, **kw):
    base = dict(
        hf_model=model_dir, dp=dp, sp=sp, lr=LR, warmup_steps=0, decay_steps=10,
        min_lr_ratio=0.1, weight_decay=0.1, seq_len=S, batch_size=G, tiled_loss=False,
        loss_chunk_tokens=None, tiled_mlp=False, activation_checkpointing=False,
        offload_activations=False, offload_params=False, offload_optimizer=False,
        head_chunks=1, attention_backend="sdpa", allow_uneven_heads=False,
    )  # fmt: skip
    base.update(kw)
    return du_train.TrainConfig(**base)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_three_steps(rank: int, world: int, model_dirs: dict, layouts: list, packed: bool, kw):
    """For each arch and (dp, sp): step-1 loss and full gradients, and three steps of losses."""
    from dtensor_ulysses import hf

    out: dict = {}
    ids, labels, pos, _ = global_batch(packed)
    for arch, model_dir in model_dirs.items():
        for dp, sp in layouts:
            mesh = init_mesh(dp, sp, device_type="cpu")
            cfg = _cfg(model_dir, dp, sp, **kw)
            model, opt, sched = du_train.build(cfg, mesh, torch.device("cpu"))
            b = G // dp
            rows = slice(mesh.get_local_rank("dp") * b, (mesh.get_local_rank("dp") + 1) * b)
            batch = {"input_ids": ids[rows], "labels": labels[rows], "position_ids": pos[rows]}
            sb = hf.shard_batch(batch, mesh)
            group = flatten_dp_sp(mesh).get_group()
            losses, grads = [], {}
            for step in range(3):
                local_sum, n_valid = du_train.forward_backward(model, sb, group)
                if step == 0:
                    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                total = local_sum.reshape(1)
                dist.all_reduce(total, group=group)
                losses.append(total.item() / n_valid)
            out[(arch, dp, sp)] = {"losses": losses, "grads": grads}
    return out if rank == 0 else None


def reference_three_steps(model_dir: str, packed: bool, attn: str = "sdpa"):
    """The same model on one process with stock attention and plain PyTorch: step-1 loss and
    gradients, three steps of losses. Packed: every document run on its own."""
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses.train import lr_lambda

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn)  # fmt: skip
    opt = reference_adamw(model, LR)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(SimpleNamespace(warmup_steps=0, decay_steps=10, min_lr_ratio=0.1))
    )
    ids, labels, pos, docs = global_batch(packed)
    losses, grads = [], {}
    for step in range(3):
        total, count = 0.0, 0
        loss_sum = torch.zeros(())
        for b in range(G):
            start = 0
            for n in docs[b]:
                x, y = ids[b : b + 1, start : start + n], labels[b : b + 1, start : start + n]
                logits = model(input_ids=x).logits
                loss_sum = loss_sum + F.cross_entropy(
                    logits[0, :-1], y[0, 1:], ignore_index=-100, reduction="sum"
                )
                count += int((y[0, 1:] != -100).sum())
                start += n
        loss = loss_sum / count
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.item()
        losses.append(total)
    assert not math.isnan(losses[0])
    return {"losses": losses, "grads": grads}


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(directory: Path, text: str, vocab_size: int = 90):
    """A small BPE trained locally on ``text``, with a chat template; saved to ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, limit_alphabet=40)
    tok.train_from_iterator([text], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>", additional_special_tokens=specials[3:],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def hf_features(rank: int, world: int, dirs: dict, out_dir: str, tok_dir: str, data: dict):
    """At dp=1, sp=world: refusals, the guard, the plain apply_ulysses path, idempotency,
    save/load round trip, and evaluation/chat batches. Returns plain data for the parent."""
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses import hf

    mesh = init_mesh(1, world, device_type="cpu")
    res: dict = {"refused": {}}
    for arch in ("llama_dropout", "gemma3_bidirectional"):
        model = AutoModelForCausalLM.from_pretrained(dirs[arch], dtype=torch.float32)
        try:
            hf.apply_ulysses(model, mesh)
        except hf.UnsupportedModelError as e:
            res["refused"][arch] = str(e)

    # dropout on the hidden states (a LoRA adapter's, injected with peft into the model):
    # parallelize warns once, from rank 0; a model without it does not warn
    import warnings

    from peft import LoraConfig, inject_adapter_in_model

    res["dropout_warnings"] = {}
    for lora_dropout in (0.05, 0.0):
        model = AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout,
                          target_modules=["q_proj", "v_proj"])  # fmt: skip
        model = inject_adapter_in_model(lora, model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf.parallelize(model, mesh)
        res["dropout_warnings"][lora_dropout] = [
            str(w.message) for w in caught if "dropout" in str(w.message)
        ]

    # the plain path: apply_ulysses, feed the slice (position ids filled in / packed), twice
    ids, _, pos, _ = global_batch(packed=True)
    sizes = [10, 9] if world == 2 else [5, 5, 5, 4]
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    model = AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32)
    hf.apply_ulysses(model, mesh)
    hf.apply_ulysses(model, mesh)  # idempotent
    res["plain"] = model(input_ids=ids[:, sl]).logits.detach()
    res["plain_packed"] = model(input_ids=ids[:, sl], position_ids=pos[:, sl]).logits.detach()
    res["slice"] = (lo, lo + sizes[rank])

    # the guard: layer 1 given a config of its own with stock attention
    import copy

    model = AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32)
    hf.apply_ulysses(model, mesh)
    attn = model.model.layers[1].self_attn
    attn.config = copy.copy(attn.config)
    attn.config._attn_implementation = "sdpa"
    try:
        model(input_ids=ids[:, sl])
    except hf.UnroutedAttentionError as e:
        res["guard"] = str(e)

    # one step through the trainer pieces, then save and reload
    cfg = _cfg(dirs["llama"], 1, world, activation_checkpointing=True)
    model, opt, sched = du_train.build(cfg, mesh, torch.device("cpu"))
    group = flatten_dp_sp(mesh).get_group()
    sb = hf.shard_batch({"input_ids": ids, "position_ids": pos}, mesh)
    du_train.train_step(model, sb, opt, sched, group=group)
    hf.save_pretrained(model, out_dir)
    model.eval()
    with torch.no_grad():
        res["trained_logits"] = model(sb.input_ids, sb.position_ids, layout=sb.layout).detach()

    # chat corpus and evaluation under sp
    tok = hf.load_tokenizer(tok_dir)
    corpus = hf.load_corpus([data["chat"], data["text"]], tok, 16)
    batches = list(
        hf.eval_batches(corpus, global_batch_size=2, dp_rank=0, dp=1, sp_rank=rank, sp=world,
                        pack_docs=True)
    )  # fmt: skip
    res["eval"] = hf.evaluate(model, batches, group)
    return res


def run_jobs(rank: int, world: int, jobs: list):
    """Several workers of this module in one world (a world costs seconds to start)."""
    return [globals()[name](rank, world, *args) for name, args in jobs]


def host_data_per_depth(rank: int, world: int, depths: list, backend: str = "sdpa") -> dict:
    """Per model depth: tensors made from host data (``aten.lift_fresh``) and reads back to the
    host (``aten._local_scalar_dense``) in one packed forward/backward of a transformers Llama
    through ``apply_ulysses`` and ``shard_batch`` (after a warm-up step: per-plan caches)."""
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses import hf
    from tests.workers import OpCounts

    count = OpCounts("lift_fresh", "_local_scalar_dense")
    mesh = init_mesh(1, world, device_type="cpu")
    ids, labels, pos, _ = global_batch(packed=True)
    out = {}
    for depth in depths:
        torch.manual_seed(0)
        cfg = make_config("llama")
        cfg.num_hidden_layers = depth
        dtype = torch.bfloat16 if backend == "flash_attn" else torch.float32
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        hf.apply_ulysses(model, mesh, backend=backend)
        for step in range(2):
            with count if step else contextlib.nullcontext():
                sb = hf.shard_batch(
                    {"input_ids": ids, "labels": labels, "position_ids": pos}, mesh,
                    count_valid=False,
                )  # fmt: skip
                out_logits = model(input_ids=sb.input_ids, position_ids=sb.position_ids,
                                   ulysses_layout=sb.layout).logits  # fmt: skip
                out_logits.float().square().mean().backward()
        out[depth] = dict(count.counts)
    return out
