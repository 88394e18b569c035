"""Per-step figures: windowed stats, bytes by kind, the memory split, and the Monitor with its
writers, dashboard, trace and Trainer callback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import gpt_step, nvme_policy

import tieroffload
from tieroffload.core.stats import KINDS, TIERS
from tieroffload.testing.models import GPT

MiB = 1 << 20


def _nvme_policy(tmp_path, **kw):
    return nvme_policy(tmp_path, optimizer="nvme", grads="nvme", cpu_budget=96 << 10, **kw)


_step = gpt_step


def test_memory_parts_are_never_negative_and_add_up_to_rss_after_the_heap_is_trimmed(tmp_path):
    """A heap that kept a freed block and had its pages trimmed (as start_peak does) counts
    them free in mallinfo although they are not in RAM: the split used to give heap_free
    more than RSS and ``other`` a large negative figure."""
    script = textwrap.dedent(f"""
        import torch, tieroffload
        from tieroffload.testing.models import GPT
        from tieroffload.utils import memory
        model = GPT(97, 64, 2, 4, 16)
        tieroffload.offload(model, tieroffload.Policy(params="nvme", device="cpu",
            nvme_dir={str(tmp_path)!r}, cpu_budget="1GiB"))  # heap blocks up to 128 MiB
        t = torch.ones(256 << 20, dtype=torch.uint8)
        keep = torch.ones(1 << 20, dtype=torch.uint8)  # above it: the heap cannot shrink
        del t
        memory.trim_heap()
        m = tieroffload.stats(model)["memory"]
        print(m)
        assert all(v >= 0 for v in m.values()), m
        assert sum(v for k, v in m.items() if k != "rss") == m["rss"], m
        assert abs(m["rss"] - memory.rss()) < 16 << 20, (m["rss"], memory.rss())
        tieroffload.close(model)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_stats_split_bytes_by_kind_and_the_kinds_add_up_to_the_totals(tmp_path):
    torch.manual_seed(0)
    model = GPT(97, 64, 3, 4, 16)
    tieroffload.offload(model, _nvme_policy(tmp_path, activations="nvme",
                                            activation_threshold=1024))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    for i in range(2):
        _step(model, opt, i)
    st = tieroffload.stats(model)
    io, act = st["io"], st["activations"]
    for t in TIERS:
        acts = (act["bytes_read"], act["bytes_written"]) if t == "nvme" else (0, 0)
        assert sum(io["read"][t].values()) == st["bytes_read"][t] + acts[0]
        assert sum(io["written"][t].values()) == st["bytes_written"][t] + acts[1]
    for kind in KINDS:  # every kind went to NVMe and back
        assert io["read"]["nvme"][kind] > 0 and io["written"]["nvme"][kind] > 0, kind
    # The gradients written are the trainable parameters' bytes, once per step.
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert io["written"]["nvme"]["grads"] >= 2 * grads
    assert abs(sum(io["wait_s"].values()) - st["wait_s"] - act["wait_s"]) < 1e-9
    opt.close()
    tieroffload.close(model, restore=False)


def test_a_window_counts_since_its_reset_and_its_peaks_are_its_own(tmp_path):
    torch.manual_seed(0)
    model = GPT(97, 64, 3, 4, 16)
    tieroffload.offload(model, _nvme_policy(tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    _step(model, opt, 0)
    first = tieroffload.stats(model, window=True, reset=True)
    assert first["bytes_read"] == tieroffload.stats(model)["bytes_read"]  # since offload
    _step(model, opt, 1)
    total = tieroffload.stats(model)
    second = tieroffload.stats(model, window=True, reset=True)
    for t in TIERS:
        assert second["bytes_read"][t] == total["bytes_read"][t] - first["bytes_read"][t]
        for k in KINDS:
            assert second["io"]["written"][t][k] == (total["io"]["written"][t][k]
                                                     - first["io"]["written"][t][k])
    assert second["hits"] + second["late"] + second["misses"] > 0
    assert 0 < second["peak_resident"] <= total["peak_resident"]
    # Nothing ran since the reset: an empty window, whose peak is what is held now.
    empty = tieroffload.stats(model, window=True)
    assert empty["bytes_read"] == {"cpu": 0, "nvme": 0} and empty["misses"] == 0
    assert empty["peak_resident"] == empty["resident"]
    assert empty["peak_rss"] >= empty["memory"]["rss"]
    opt.close()
    tieroffload.close(model, restore=False)


def _monitored_run(tmp_path, steps=3, trace_steps=(), writers=None, activations=True):
    """Trains a small GPT with everything on NVMe under a monitor; returns the records and,
    per step, the difference of the cumulative stats() across it."""
    from tieroffload.monitor import CSVWriter, JSONLinesWriter, TensorBoardWriter

    torch.manual_seed(0)
    model = GPT(97, 64, 3, 4, 16)
    kw = dict(activations="nvme", activation_threshold=1024) if activations else {}
    (tmp_path / "swap").mkdir()
    tieroffload.offload(model, _nvme_policy(tmp_path / "swap", **kw))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    if writers is None:
        writers = [CSVWriter(tmp_path / "run.csv"), JSONLinesWriter(tmp_path / "run.jsonl"),
                   TensorBoardWriter(tmp_path / "tb")]
    mon = tieroffload.Monitor(model, opt, writers=writers, trace_steps=trace_steps,
                              trace_dir=tmp_path, disk=(2.0, 1.0))
    records, deltas = [], []
    before = tieroffload.stats(model)
    for i in range(steps):
        loss = _step(model, opt, i)
        records.append(mon.step(loss=loss))
        after = tieroffload.stats(model)
        deltas.append({d: {t: {k: after["io"][d][t][k] - before["io"][d][t][k] for k in KINDS}
                           for t in TIERS} for d in ("read", "written")})
        before = after
    mon.close()
    opt.close()
    tieroffload.close(model, restore=False)
    return records, deltas


def test_monitor_records_each_step_and_the_csv_jsonl_and_tensorboard_read_back_exact(tmp_path):
    import csv
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    records, deltas = _monitored_run(tmp_path)
    with open(tmp_path / "run.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    lines = [json.loads(s) for s in (tmp_path / "run.jsonl").read_text().splitlines()]
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    assert [r["step"] for r in records] == [1, 2, 3] and len(rows) == len(lines) == 3
    for rec, row, line, delta in zip(records, rows, lines, deltas):
        assert line == rec
        for d in ("read", "written"):
            for t in TIERS:
                for k in KINDS:
                    key = f"{d}_{t}_{k}"
                    # the bytes of the step, as stats() counts them, to the byte everywhere
                    assert rec[key] == delta[d][t][k], key
                    assert int(row[key]) == rec[key], key
                    tb = ea.Tensors(f"io/{key}")[rec["step"] - 1]
                    assert tb.step == rec["step"]
                    assert tensor_util.make_ndarray(tb.tensor_proto).item() == rec[key], key
                assert rec[f"{d}_{t}"] == sum(rec[f"{d}_{t}_{k}"] for k in KINDS)
        assert rec["read_nvme_params"] > 0 and rec["written_nvme_grads"] > 0
        assert rec["read_nvme_activations"] > 0
        # the paged optimizer applies a step's update in the next forward, writing its state
        assert (rec["written_nvme_optimizer"] > 0) == (rec["step"] > 1)
        assert rec["forward_s"] > 0 and rec["backward_s"] > 0 and rec["optimizer_s"] > 0
        assert rec["forward_s"] + rec["backward_s"] + rec["optimizer_s"] <= rec["wall_s"]
        assert rec["wait_s"] == sum(rec[f"wait_{k}_s"] for k in KINDS)
        assert rec["disk_read_gbps"] == 2.0 and rec["lr"] == 1e-3
        assert float(row["loss"]) == rec["loss"] and rec["loss"] > 0
        assert rec["hits"] + rec["late"] + rec["misses"] > 0
        parts = [rec[k] for k in rec if k.startswith("mem_")]
        assert min(parts) >= 0 and sum(parts) == rec["rss"] <= rec["peak_rss"]
        assert 0 < rec["peak_resident"] <= 96 << 10


def test_a_traced_step_is_a_chrome_trace_whose_io_adds_up_to_the_bytes_moved(tmp_path):
    import json

    records, _ = _monitored_run(tmp_path, steps=3, trace_steps=[2], writers=[])
    assert not (tmp_path / "trace_step1.json").exists()
    trace = json.loads((tmp_path / "trace_step2.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in events:
        assert {"name", "cat", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0
    rec = records[1]
    io = [e for e in events if e["cat"] == "io"]
    assert all(lanes[e["tid"]].startswith("io ") for e in io)
    for d, verb in (("read", "read"), ("written", "write")):
        for k in KINDS:
            moved = sum(rec[f"{d}_{t}_{k}"] for t in TIERS)
            traced = sum(e["args"]["bytes"] for e in io
                         if e["args"]["kind"] == k and e["args"]["direction"] == verb)
            assert traced == moved, (d, k)
    names = {e["name"] for e in events}
    assert {"forward", "backward", "forward blocks.0", "backward blocks.0"} <= names
    assert any(e["cat"] == "wait" for e in events)
    # On one lane, two events are apart or one holds the other: never half over each other.
    by_lane: dict[int, list] = {}
    for e in events:
        by_lane.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_lane.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[float] = []
        for a, b in spans:
            while open_ends and open_ends[-1] <= a + 1e-3:
                open_ends.pop()
            assert not open_ends or b <= open_ends[-1] + 1e-3, (a, b, open_ends)
            open_ends.append(b)


def test_io_and_waits_show_as_record_function_ranges_in_a_torch_profile(tmp_path):
    torch.manual_seed(0)
    model = GPT(97, 64, 3, 4, 16)
    tieroffload.offload(model, _nvme_policy(tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    _step(model, opt, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, opt, 1)
    names = {e.key for e in prof.key_averages()}
    assert "tieroffload.wait.params" in names
    opt.close()
    tieroffload.close(model, restore=False)


def test_a_trainer_callback_writes_one_record_per_step_with_the_logged_loss(tmp_path):
    import csv

    transformers = __import__("pytest").importorskip("transformers")
    from tieroffload.monitor import CSVWriter
    from tieroffload.monitor.callback import MonitorCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            ids = torch.arange(i, i + 12) % 100
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        attn_implementation="eager"))
    (tmp_path / "swap").mkdir()
    tieroffload.offload(model, tieroffload.Policy(params="nvme", nvme_dir=str(tmp_path / "swap"),
                                                  device="cpu", cpu_budget=64 << 10))
    cb = MonitorCallback(writers=[CSVWriter(tmp_path / "run.csv")])
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
        learning_rate=1e-3, logging_steps=2, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[cb])
    trainer.train()
    with open(tmp_path / "run.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert float(rows[1]["loss"]) == logged[2]["loss"] and rows[0]["loss"] == ""
    assert all(float(r["read_nvme_params"]) > 0 and float(r["optimizer_s"]) > 0 for r in rows)
    assert all(float(r["backward_s"]) > 0 and r["lr"] != "" for r in rows)
    tieroffload.close(model)


def test_the_dashboard_of_a_monitored_run_is_drawn_from_its_csv(tmp_path):
    from tieroffload.cli.bench import main
    from tieroffload.cli.bench.report_plot import plot_dashboard

    _monitored_run(tmp_path, steps=3)
    fig = plot_dashboard(tmp_path / "run.csv", tmp_path / "dash.png")
    assert [ax.get_ylabel() for ax in fig.axes] == ["GiB", "GB/s", "% of step time", "loss"]
    io = fig.axes[1]
    assert {"disk read (measured)", "all read", "parameters read"} <= {
        line.get_label() for line in io.get_lines()}
    assert (tmp_path / "dash.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path / "run.csv"), "--plot", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 10_000
    assert main(["report", str(tmp_path / "run.jsonl")]) == 2  # not a monitor's CSV


def test_a_deepspeed_config_s_monitor_sections_give_the_writers(tmp_path):
    import csv

    from tieroffload.monitor import CSVWriter, TensorBoardWriter
    from tieroffload.monitor.config import writers_from_deepspeed

    config = {"tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"),
                              "job_name": "run1"},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"),
                              "job_name": "run1"},
              "wandb": {"enabled": False}}
    writers = writers_from_deepspeed(config)
    assert [type(w) for w in writers] == [TensorBoardWriter, CSVWriter]
    for w in writers:
        w.close()
    records, _ = _monitored_run(tmp_path, steps=2, writers=writers_from_deepspeed(config))
    with open(tmp_path / "csv" / "run1" / "run.csv", newline="") as f:
        assert [int(r["read_nvme_params"]) for r in csv.DictReader(f)] == [
            r["read_nvme_params"] for r in records]
    assert list((tmp_path / "tb" / "run1").glob("events.out.tfevents.*"))


def test_a_monitor_refuses_a_model_that_is_not_offloaded():
    with __import__("pytest").raises(ValueError, match=r"offload\(model, policy\) before"):
        tieroffload.Monitor(GPT(97, 32, 1, 4, 16))


def test_the_wandb_writer_logs_each_record_offline(tmp_path, monkeypatch):
    __import__("pytest").importorskip("wandb")
    from tieroffload.monitor import WandbWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _monitored_run(tmp_path, steps=2, activations=False,
                   writers=[WandbWriter(project="tieroffload-test", dir=str(tmp_path))])
    assert list(tmp_path.rglob("*.wandb"))


def test_monitor_step_refuses_a_scalar_that_is_no_number_naming_it_and_counts_nothing():
    model = tieroffload.offload(torch.nn.Linear(4, 4), tieroffload.Policy(params="cpu",
                                                                       device="cpu"))
    monitor = tieroffload.Monitor(model)
    try:
        with pytest.raises(TypeError, match="Monitor.step: loss must be a number.*'x'"):
            monitor.step(loss="x")
        assert monitor.step_count == 0
        assert monitor.step(loss=torch.tensor(2.5))["loss"] == 2.5
    finally:
        monitor.close()
        tieroffload.close(model)


def test_monitor_step_after_the_model_was_closed_says_so():
    model = tieroffload.offload(torch.nn.Linear(4, 4), tieroffload.Policy(params="cpu",
                                                                       device="cpu"))
    monitor = tieroffload.Monitor(model)
    tieroffload.close(model)
    try:
        with pytest.raises(RuntimeError, match="the model was closed"):
            monitor.step()
    finally:
        monitor.close()


@pytest.mark.parametrize("steps, words", [("3", "must be a list of step numbers"),
                                          ([0], "holds 0; steps are counted from"),
                                          ([2.0], "holds 2.0"), ([True], "holds True")])
def test_trace_steps_that_would_never_be_traced_are_refused_naming_them(steps, words):
    model = tieroffload.offload(torch.nn.Linear(4, 4), tieroffload.Policy(params="cpu",
                                                                       device="cpu"))
    try:
        with pytest.raises((TypeError, ValueError), match=words):
            tieroffload.Monitor(model, trace_steps=steps)
        with pytest.raises(ValueError, match=r"start_step \+ 1 = 6"):
            tieroffload.Monitor(model, trace_steps=[5], start_step=5)
    finally:
        tieroffload.close(model)


def test_a_monitor_refuses_another_model_s_optimizer_and_a_step_once_closed(tmp_path):
    model = tieroffload.offload(torch.nn.Linear(4, 4), tieroffload.Policy(params="cpu",
                                                                       device="cpu"))
    other = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    try:
        with pytest.raises(ValueError, match="steps none of the monitored model's parameters"):
            tieroffload.Monitor(model, other)
        with pytest.raises(TypeError, match="optimizer must be the torch.optim.Optimizer"):
            tieroffload.Monitor(model, "adam")
        with pytest.raises(TypeError, match="start_step must be a step count"):
            tieroffload.Monitor(model, start_step="a")
        from tieroffload.monitor import CSVWriter
        with pytest.raises(TypeError, match=r"writers must be a list of writers"):
            tieroffload.Monitor(model, writers=CSVWriter(tmp_path / "run.csv"))
        monitor = tieroffload.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
        monitor.close()
        with pytest.raises(RuntimeError, match="the monitor is closed"):
            monitor.step()
    finally:
        tieroffload.close(model)
