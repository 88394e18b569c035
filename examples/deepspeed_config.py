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
from tieroffload.testing.deepspeed import article_config
from tieroffload.testing.models import GPT, token_batch

VOCAB, SEQ = 256, 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="scratch-deepspeed", help="the config's nvme_path")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    config = article_config(args.dir)
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
