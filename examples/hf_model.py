"""A Hugging Face model built from its config (nothing downloaded), trained with its parameters,
gradients and AdamW state on NVMe. Needs ``pip install transformers``.

    python examples/hf_model.py --dir /mnt/nvme --layers 12 --d 768 --budget 256MiB
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

import tieroffload
from tieroffload.testing.models import token_batch
from tieroffload.utils.sizes import format_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="scratch-hf")
    p.add_argument("--budget", default="16MiB")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, seq = 512, 64
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=args.d, n_layer=args.layers,
                        n_head=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)  # lm_head is tied to the token embedding
    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    tieroffload.offload(model, tieroffload.Policy(
        params="nvme", optimizer="nvme", grads="nvme", nvme_dir=args.dir, device="cpu",
        cpu_budget=args.budget))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    try:
        for step in range(args.steps):
            x, _ = token_batch(step, 8, seq, vocab)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step:3d}  loss {loss.item():.3f}")
        st = tieroffload.stats(model)
        print(f"NVMe read {format_bytes(st['bytes_read']['nvme'])}, written "
              f"{format_bytes(st['bytes_written']['nvme'])}; peak resident parameters "
              f"{format_bytes(st['peak_resident'])} of a {args.budget} budget")
    finally:
        tieroffload.close(model, restore=False)  # its optimizer and swap space too
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
