"""Policies: plain-data round trips, and DeepSpeed configs read into them."""

import json
import logging
import re

import pytest

from tieroffload import IOConfig, Policy

# ZeRO-Infinity, as DeepSpeed's configuration docs show it.
DS_INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_max_live_parameters": 1e9,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "train_batch_size": 16,
}
# ZeRO-Offload to CPU, with Hugging Face's "auto" placeholders.
DS_OFFLOAD_AUTO = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "stage3_prefetch_bucket_size": "auto",
        "stage3_max_live_parameters": "auto",
    },
}


def test_dict_and_json_round_trip(tmp_path):
    p = Policy(params="nvme", nvme_dir="/mnt/nvme", device="cpu", cpu_budget="2GiB",
               prefetch="512MiB", io=IOConfig(block_size=8 << 20, queue_depth=8),
               optimizer="nvme", grads="nvme")
    d = p.to_dict()
    assert d["cpu_budget"] == 2 << 30 and d["io"]["block_size"] == 8 << 20
    assert Policy.from_dict(json.loads(json.dumps(d))) == p
    p.to_json(tmp_path / "p.json")
    assert Policy.from_json(tmp_path / "p.json") == p
    with pytest.raises(ValueError, match="unknown policy settings"):
        Policy.from_dict({**d, "offload_everything": True})


def test_zero_infinity_config_converts(tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_INFINITY))
    with caplog.at_level(logging.INFO, logger="tieroffload"):
        p = Policy.from_deepspeed(path)
    assert (p.params, p.optimizer, p.nvme_dir) == ("nvme", "nvme", "/local_nvme")
    assert p.io == IOConfig(block_size=1 << 20, queue_depth=8, threads=1)
    assert p.prefetch == f"{int(5e8) * 2}B" and p.cpu_budget == int(1e9) * 2
    text = " ".join(r.getMessage() for r in caplog.records)
    for key in ("offload_param.buffer_count", "offload_optimizer.fast_init", "aio.single_submit",
                "zero_optimization.stage"):
        assert key in text  # reported as decided by tieroffload, not dropped in silence
    assert "2 bytes an element" in text


def test_zero_offload_with_auto_values(caplog):
    with caplog.at_level(logging.WARNING, logger="tieroffload"):
        p = Policy.from_deepspeed(DS_OFFLOAD_AUTO)
    assert (p.params, p.optimizer) == ("cpu", "cpu")
    assert p.prefetch == Policy().prefetch and p.cpu_budget is None
    assert "zero_optimization.stage3_prefetch_bucket_size" in caplog.text


def test_unknown_and_conflicting_deepspeed_settings(caplog):
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/a",
                                                   "bogus_knob": 3}}}
    with caplog.at_level(logging.WARNING, logger="tieroffload"):
        Policy.from_deepspeed(cfg)
    assert "does not know" in caplog.text and "offload_param.bogus_knob" in caplog.text
    two = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/a"},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}}
    with pytest.raises(ValueError, match="two nvme_path"):
        Policy.from_deepspeed(two)
    with pytest.raises(ValueError, match="device 'disk'"):
        Policy.from_deepspeed({"zero_optimization": {"offload_param": {"device": "disk"}}})


@pytest.mark.parametrize("cfg, words", [
    ({"zero_optimization": {"stage": 7}}, "stage must be 0, 1, 2 or 3, not 7"),
    ({"zero_optimization": {"stage": "three"}}, "stage must be 0, 1, 2 or 3, not 'three'"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme"}}},
     "offload_param needs stage 3, not stage 1"),
    ({"zero_optimization": {"stage3_max_live_parameters": "12 parsecs"}},
     "stage3_max_live_parameters must be a whole number >= 0, not '12 parsecs'"),
    ({"zero_optimization": {"stage3_max_live_parameters": -5}},
     "stage3_max_live_parameters must be a whole number >= 0, not -5"),
    ({"zero_optimization": [3]}, "zero_optimization must be a dict"),
    ([3], "a DeepSpeed config is a dict"),
    ({"aio": {"queue_depth": 1.5}}, "aio.queue_depth must be a whole number"),
])
def test_bad_deepspeed_configs_name_the_key(cfg, words):
    """Found by an outside trial: stage 7 was taken, "12 parsecs" failed in int() without
    naming the key, -5 was reported as a doubled cpu_budget."""
    with pytest.raises(ValueError, match=re.escape(words)):
        Policy.from_deepspeed(cfg)
