"""LoRA on a base that stays on NVMe: a Llama built from its config (nothing downloaded), saved
as safetensors shards, loaded with ``tieroffload.from_pretrained`` (its weights streamed to
NVMe, never all in RAM), LoRA-trained with PEFT (only the adapters train; the frozen base is
read, never written back), merged into the base and generated from, all under one budget.
Needs ``pip install transformers peft``.

    python examples/lora_finetune.py --dir /mnt/nvme --layers 8 --d 512 --budget 8MiB
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
    p.add_argument("--dir", default="scratch-lora")
    p.add_argument("--budget", default="2MiB")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, seq = 256, 32
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.d, intermediate_size=2 * args.d,
                         num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=seq)
    created = not os.path.isdir(args.dir)
    base_dir, swap_dir = os.path.join(args.dir, "base"), os.path.join(args.dir, "swap")
    os.makedirs(swap_dir, exist_ok=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(base_dir, max_shard_size="200KB")
    print(f"base saved as {len([f for f in os.listdir(base_dir) if f.endswith('.safetensors')])}"
          " shards")

    policy = tieroffload.Policy(params="nvme", nvme_dir=swap_dir, device="cpu",
                                cpu_budget=args.budget)
    model = tieroffload.from_pretrained(base_dir, policy)  # built on meta, streamed to NVMe
    model.train()
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))
    lora.print_trainable_parameters()
    # The adapters are plain parameters: any torch optimizer steps them.
    opt = torch.optim.AdamW([q for q in lora.parameters() if q.requires_grad], lr=1e-2)
    try:
        written = tieroffload.stats(model)["written_by_kind"]["nvme"]["params"]
        for step in range(args.steps):
            x, _ = token_batch(step, 8, seq, vocab)
            loss = lora(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step:3d}  loss {loss.item():.3f}")
        again = tieroffload.stats(model)["written_by_kind"]["nvme"]["params"] - written
        print(f"base bytes written to NVMe while training: {again}")
        lora.save_pretrained(os.path.join(args.dir, "adapter"))
        merged = lora.merge_and_unload()  # the same offloaded model, adapters folded in
        x, _ = token_batch(99, 1, 8, vocab)
        out = merged.generate(x, max_new_tokens=8, do_sample=False)
        print("generated:", out[0, 8:].tolist())
        st = tieroffload.stats(merged)
        print(f"NVMe read {format_bytes(st['bytes_read']['nvme'])}, written "
              f"{format_bytes(st['bytes_written']['nvme'])}; peak resident parameters "
              f"{format_bytes(st['peak_resident'])} of a {args.budget} budget")
    finally:
        tieroffload.close(model, restore=False)
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
