"""A Hugging Face GPT-2 saved in shards, loaded two ways in fresh processes, one after the
other in one run: transformers' own ``from_pretrained`` (everything resident) and
``tieroffload.from_pretrained`` under CPU budgets (built on meta, shards streamed to NVMe).
Reports each one's peak RSS while loading (against the budget and the largest shard) and greedy
``generate`` tokens/s with the KV cache, and checks that the tokens are the same.

    python bench/hf_pretrained.py --dir /mnt/nvme --budgets 64MiB,256MiB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> None:
    """One load and one generate, in this (fresh) process; prints a JSON line."""
    import torch
    import transformers

    import tieroffload
    from tieroffload.utils.memory import peak_rss, reset_peak_rss, rss
    from tieroffload.utils.sizes import parse_bytes

    torch.set_num_threads(os.cpu_count() or 1)
    with torch.device("meta"):  # the modeling code imported: the base counts it
        transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2))
    base = rss()
    reset_peak_rss()
    t = time.perf_counter()
    if args.budget == "resident":
        model = transformers.GPT2LMHeadModel.from_pretrained(args.weights)
        model.eval()
    else:
        policy = tieroffload.Policy(params="nvme", nvme_dir=args.dir, device="cpu",
                                    cpu_budget=parse_bytes(args.budget))
        model = tieroffload.from_pretrained(args.weights, policy)
    load_s = time.perf_counter() - t
    load_peak = peak_rss()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt),
                        generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=args.new, do_sample=False, use_cache=True, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
    reset_peak_rss()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    gen_s = time.perf_counter() - t
    res = dict(budget=args.budget, base_rss=base, load_peak_rss=load_peak, load_s=load_s,
               gen_peak_rss=peak_rss(), tokens_per_s=args.new / gen_s,
               tokens=out[0, args.prompt:].tolist())
    if args.budget != "resident":
        st = tieroffload.stats(model)
        res.update(peak_resident=st["peak_resident"], read=st["bytes_read"]["nvme"])
        tieroffload.close(model, restore=False)
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="NVMe scratch directory (weights and swap)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--shard", default="64MB", help="save_pretrained's max_shard_size")
    ap.add_argument("--budgets", default="64MiB,256MiB")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    import torch
    import transformers

    from tieroffload.utils.sizes import format_bytes

    root = tempfile.mkdtemp(dir=args.dir)
    weights = os.path.join(root, "weights")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.d, n_layer=args.layers,
                                     n_head=max(1, args.d // 64), n_positions=1024)
    transformers.GPT2LMHeadModel(config).save_pretrained(weights, max_shard_size=args.shard)
    shards = [os.path.getsize(os.path.join(weights, f)) for f in os.listdir(weights)
              if f.endswith(".safetensors")]
    total = sum(shards)
    print(f"GPT-2 {args.layers} x {args.d}, vocab {args.vocab}: {format_bytes(total)} in "
          f"{len(shards)} shards, the largest {format_bytes(max(shards))}")
    rows = []
    for budget in ["resident", *args.budgets.split(",")]:
        cmd = [sys.executable, __file__, "--child", "--weights", weights, "--budget", budget,
               "--dir", root, "--prompt", str(args.prompt), "--new", str(args.new)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"{'budget':>10} {'RSS base':>9} {'load peak':>10} {'load s':>7} {'gen peak':>9} "
          f"{'tok/s':>7}")
    for r in rows:
        print(f"{r['budget']:>10} {format_bytes(r['base_rss']):>9} "
              f"{format_bytes(r['load_peak_rss']):>10} {r['load_s']:7.2f} "
              f"{format_bytes(r['gen_peak_rss']):>9} {r['tokens_per_s']:7.2f}")
    print(f"greedy tokens equal to transformers' own: {same}")
    print("load peak above base: " + ", ".join(
        f"{r['budget']} {format_bytes(r['load_peak_rss'] - r['base_rss'])}" for r in rows))
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
