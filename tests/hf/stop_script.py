"""A ``with_ulysses(transformers.Trainer)`` training script for tests/hf/test_stops.py, run by
torchrun: a tiny random Llama on random token rows (the same on every rank: seeded), a constant
learning rate (so that the number of steps does not change the schedule), the Trainer's own
checkpointing (``save_strategy="no"``: only a stop saves), one JSON line per logged step on
rank 0. Each ``--one-run OUT STEPS LOSSES [RESUME]`` is one training run, in this process, one
after the other; ``--stop-collectives FILE`` first records, per rank, what the stop callback
issues (:func:`stop_collectives`).

    torchrun --nproc-per-node 2 tests/hf/stop_script.py --one-run DIR 1000 L.jsonl
    torchrun --nproc-per-node 2 tests/hf/stop_script.py --one-run DIR 6 L.jsonl DIR/checkpoint-4
"""

from __future__ import annotations

import argparse
import json


def train(out: str, steps: int, losses: str, resume: str | None) -> None:
    """One run of ``steps`` steps into ``out`` (from ``resume``, a checkpoint, if given)."""
    import torch
    import transformers as tf

    from dtensor_ulysses.hf import with_ulysses

    class Losses(tf.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                with open(losses, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)  # fmt: skip
    model = tf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 96, (24,), generator=g).tolist()} for _ in range(64)]
    for r in rows:
        r["labels"] = r["input_ids"]
    args = tf.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=3e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = with_ulysses(tf.Trainer, sp=2)(
        model=model, args=args, train_dataset=rows, callbacks=[Losses()]
    )
    trainer.train(resume_from_checkpoint=resume)


def stop_collectives(path: str) -> None:
    """Write (``path.rank{r}``) the collectives of the stop callback at a step's end: with no
    stop, after SIGUSR1 reached rank 1 only, and at the last step."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from transformers import TrainerControl

    import dtensor_ulysses as du
    from dtensor_ulysses._exit import catch_stop_signals, stop_signal_received
    from dtensor_ulysses.hf.trainers._stops import _AgreedStop

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = SimpleNamespace(device=torch.device("cpu"))
    world_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    out = {}
    with catch_stop_signals():
        for case in ("none", "usr1_on_rank1", "last_step"):
            if case == "usr1_on_rank1" and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
                deadline = time.monotonic() + 30
                while not stop_signal_received():
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            step = 10 if case == "last_step" else 3
            callback, control = _AgreedStop(), TrainerControl()
            with du.CommCounter() as comm:
                callback.on_step_end(args, SimpleNamespace(global_step=step, max_steps=10), control)
            out[case] = {
                "collectives": comm.by_kind(),
                "on_the_world": all(c.group_name == world_name for c in comm.calls),
                "stop": callback.stop,
                "step": callback.step,
                "flags": [control.should_log, control.should_save, control.should_training_stop],
            }
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump(out, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--one-run", nargs="+", action="append", default=[],
                   metavar="OUT STEPS LOSSES [RESUME]")  # fmt: skip
    p.add_argument("--stop-collectives", default=None, metavar="FILE")
    a = p.parse_args()
    if a.stop_collectives:
        stop_collectives(a.stop_collectives)
    for run in a.one_run:
        out, steps, losses, *resume = run
        train(out, int(steps), losses, resume[0] if resume else None)


if __name__ == "__main__":
    main()
