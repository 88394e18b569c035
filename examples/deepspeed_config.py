"""A DeepSpeedExamples-style ZeRO-Infinity config (ZeRO-3, parameters and optimizer state on
NVMe, CPU activation checkpointing, WarmupLR, bf16, accumulation 2, clipping 1.0) run through
``tieroffload.initialize`` on the embedded GPT: the training loop is DeepSpeed's, only the import
line differs. Prints what each key became, then the loss and learning rate of each step.

    python examples/deepspeed_config.py --dir /mnt/nvme --steps 20
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil

import torch
import torch.nn.functional as F

import tieroffload
from tieroffload.testing.models import GPT, token_batch

VOCAB, SEQ = 256, 32


def ds_config(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 4,
        "wall_clock_breakdown": True,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 5e5,
            "stage3_prefetch_bucket_size": 1e5,
        },
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                     "contiguous_memory_optimization": False,
                                     "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="scratch-deepspeed", help="the config's nvme_path")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    config = ds_config(args.dir)
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, d=128, layers=2, heads=4, seq=SEQ)
    engine, optimizer, _, lr_scheduler = tieroffload.initialize(model=model, config=config)
    try:
        print("what each key became:")
        for key, what in engine.plan.became.items():
            print(f"  {key:42s} {what}")
        policy = engine.module._tieroffload.policy
        print(f"  {'(the policy)':42s} {policy}")
        for step in range(args.steps * engine.gradient_accumulation_steps()):
            x, y = token_batch(step, engine.train_micro_batch_size_per_gpu(), SEQ, VOCAB)
            loss = F.cross_entropy(engine(x).float().view(-1, VOCAB), y.reshape(-1))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                print(f"step {engine.global_steps:3d}  loss {loss.item():.3f}  "
                      f"lr {engine.get_lr()[0]:.2e}  grad norm {engine.get_global_grad_norm():.3f}")
    finally:
        tieroffload.close(engine.module, restore=False)  # its optimizer and swap space too
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
