"""Ulysses in your own ``accelerate`` loop: a stock loop, plus the two lines marked ``Ulysses``.

On CPU with a tiny model built on the spot (``--model DIR`` for a local checkpoint)::

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --sp 2
    accelerate launch --config_file cp2.yaml examples/accelerate_loop.py  # sp: its cp_size
    torchrun --standalone --nproc-per-node 4 examples/accelerate_loop.py --sp 2  # dp = 2
    python examples/accelerate_loop.py --stock   # the stock loop, one process: the losses and
                                                 # gradient norms the dp = 1 runs above print

``cp2.yaml``: an accelerate config with FSDP2 and ``parallelism_config_cp_size: 2`` on 2
processes (docs/how-to/accelerate.md shows one).
"""

from __future__ import annotations

import argparse

from _tiny import TEXTS, tiny_model_and_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=None, help="default: the accelerate config's cp_size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default=None, help="a local model directory (default: tiny)")
    p.add_argument("--out", default="runs/accelerate_loop")
    p.add_argument("--stock", action="store_true", help="the stock Accelerator")
    a = p.parse_args()

    import torch
    from accelerate import Accelerator
    from transformers import DataCollatorForLanguageModeling

    from dtensor_ulysses.hf import UlyssesAccelerator  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(a.model)
    rows = [tokenizer(t) for t in TEXTS]  # right padding, labels -100 there
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate)
    if a.stock:
        accelerator = Accelerator(gradient_accumulation_steps=2)
    else:
        accelerator = UlyssesAccelerator(sp=a.sp, gradient_accumulation_steps=2)  # Ulysses
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            accelerator.print(f"step {step} loss {loss.item():.6f} grad_norm {norm.item():.6f}")
            if step == a.steps:
                break
    accelerator.unwrap_model(model).save_pretrained(a.out)  # every rank: full weights


if __name__ == "__main__":
    main()
