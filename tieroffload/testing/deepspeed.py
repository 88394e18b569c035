"""The DeepSpeedExamples article's ZeRO-Infinity config, for examples, benches and tests."""

from __future__ import annotations


def article_config(nvme: str, *, lr: float = 3e-3, weight_decay: float = 0.01,
                   warmup_steps: int = 4, max_live: float = 5e5, prefetch: float = 1e5,
                   steps_per_print: int = 4, wall_clock_breakdown: bool = True) -> dict:
    """ZeRO-3 with parameters and optimizer state on NVMe under ``nvme``, CPU activation
    checkpointing, AdamW with WarmupLR (log warm-up to ``lr``), bf16, micro batch 2,
    accumulation 2, clipping 1.0: the article's settings, with its sizes as keywords."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": wall_clock_breakdown,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": weight_decay}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": lr,
                                                     "warmup_num_steps": warmup_steps}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": max_live,
            "stage3_prefetch_bucket_size": prefetch,
        },
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                     "contiguous_memory_optimization": False,
                                     "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
    }
