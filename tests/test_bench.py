"""``tieroffload-bench nvme``: a small run gives JSON the policy loads, bad input gives a one-line
error and exit code 2, and the scratch file never outlives the run (errors and Ctrl-C included)."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import mounted

from tieroffload import IOConfig, aio
from tieroffload.aio import throughput
from tieroffload.cli import bench
from tieroffload.cli.bench import common, report

BENCH = [sys.executable, "-m", "tieroffload.cli.bench", "nvme"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=timeout)


def scratch_files(directory) -> list:
    return [n for n in os.listdir(directory) if n.startswith(".tieroffload-bench-")]


def test_quick_run_writes_json_that_the_policy_loads(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "out.json"
    args = ["--dir", str(disk), "--size", "16M", "--quick", "--json", str(out)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        args += ["--plot", str(tmp_path / "out.png")]
    started = time.monotonic()
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 30
    assert "recommended:" in proc.stdout and "GB/s" in proc.stdout
    assert os.listdir(disk) == []

    data = json.loads(out.read_text())
    assert data["size"] == 16 << 20 and data["quick"] is True
    assert data["runs"] and data["summary"]
    for r in data["runs"]:
        assert r["bytes"] > 0 and r["seconds"] > 0 and r["gbps"] > 0, r
    for r in data["summary"]:
        assert r["gbps"] > 0 and (r["ratio_to_fio"] is None or r["ratio_to_fio"] > 0), r
    engines = {r["engine"] for r in data["runs"]}
    assert {"python", "aiofiles"} <= engines
    assert {f"tieroffload/{b}" for b in aio.backends()} <= engines

    cfg = IOConfig.from_json(out)
    assert cfg.to_dict() == data["recommended"]
    assert cfg == IOConfig.from_dict(data["recommended"])
    assert cfg.backend in aio.backends()
    assert data["recommended_figures"]["read_gbps"] > 0
    assert data["recommended_figures"]["write_gbps"] > 0
    if has_mpl:
        assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_fio_the_run_says_so_and_has_no_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "FIO", "no-such-fio-here")
    result = bench.run_nvme(tmp_path, "8M", quick=True, progress=False)
    assert any("fio is not installed" in n for n in result["notes"])
    assert all(r["ratio_to_fio"] is None for r in result["summary"])
    assert result["recommended_figures"]["read_ratio_to_fio"] is None
    assert "recommended:" in bench.format_table(result)
    assert result["aggregate"] == []  # one directory, one process: nothing to add
    assert "aggregate" not in bench.format_table(result)
    assert os.listdir(tmp_path) == []


def test_recommendation_prefers_less_memory_in_flight_when_within_three_percent():
    def rows(engine, bs, qd, gbps):
        return [{"engine": engine, "direction": d, "block_size": bs, "queue_depth": qd,
                 "gbps": gbps, "runs": 1, "ratio_to_fio": None} for d in ("read", "write")]

    summary = (rows("tieroffload/io_uring", 8 << 20, 128, 3.00)
               + rows("tieroffload/threads", 1 << 20, 32, 2.95)
               + rows("tieroffload/io_uring", 1 << 20, 8, 2.50)
               + rows("fio", 128 << 10, 1, 9.0))
    recommended, figures = report.recommend(summary)
    assert recommended == {"backend": "threads", "block_size": 1 << 20, "queue_depth": 32,
                           "threads": 32}
    assert figures["read_gbps"] == 2.95


def assert_one_line_error(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_directory(tmp_path):
    proc = run_cli("--dir", str(tmp_path / "nope"), "--quick")
    assert_one_line_error(proc, str(tmp_path / "nope"), "no such directory")


def test_directory_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    proc = run_cli("--dir", str(f), "--quick")
    assert_one_line_error(proc, str(f), "not a directory")
    assert os.listdir(tmp_path) == ["file"]


def test_directory_that_is_not_writable():
    with mounted("tmpfs", "ro") as where:
        proc = run_cli("--dir", where, "--quick")
        assert_one_line_error(proc, where, "not writable", "Read-only file system")
        assert os.listdir(where) == []


@pytest.mark.parametrize("size, words", [
    ("abc", ["--size", "not a size: 'abc'"]),
    ("100P", ["not enough free space", "--size 100P", "GB free"]),
    ("1M", ["--size must be at least 8M", "not 1048576 bytes"]),
    ("1K", ["--size must be at least 8M", "not 1024 bytes"]),  # once "not 0 bytes"
])
def test_bad_size(tmp_path, size, words):
    proc = run_cli("--dir", str(tmp_path), "--size", size, "--quick")
    assert_one_line_error(proc, *words)
    assert os.listdir(tmp_path) == []


def test_output_into_a_missing_directory_fails_before_measuring(tmp_path):
    proc = run_cli("--dir", str(tmp_path), "--quick", "--json", str(tmp_path / "no" / "o.json"))
    assert_one_line_error(proc, "--json", "no such directory")
    assert os.listdir(tmp_path) == []


def test_plot_without_matplotlib_fails_before_measuring(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from tieroffload.cli.bench import main; "
            f"sys.exit(main(['nvme', '--dir', {str(tmp_path)!r}, '--quick', '--plot', 'x.png']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert_one_line_error(proc, "--plot needs matplotlib", "pip install matplotlib")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_removes_the_scratch_file(tmp_path, sig):
    proc = subprocess.Popen([*BENCH, "--dir", str(tmp_path), "--size", "512M", "--quick"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not scratch_files(tmp_path):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the scratch file never appeared"
            time.sleep(0.05)
        time.sleep(1.5)  # into the sweep: past the fill, measurements in flight
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert os.listdir(tmp_path) == []


def test_several_directories_and_processes(tmp_path):
    """Two directories (on one device here) and two processes: the aggregate rows, in the table
    and the JSON, and no file left behind in either directory."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = tmp_path / "out.json"
    started = time.monotonic()
    proc = run_cli("--dir", str(a), "--dir", str(b), "--procs", "2", "--size", "16M", "--quick",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 30
    assert os.listdir(a) == [] and os.listdir(b) == []
    assert "recommended:" in proc.stdout
    assert "aggregate at the recommended setting" in proc.stdout
    assert "these directories share one device: their bandwidths do not add" in proc.stdout
    assert "processes sharing a drive divide its bandwidth" in proc.stdout

    data = json.loads(out.read_text())
    assert data["dirs"] == [str(a), str(b)] and data["procs"] == 2
    rows = data["aggregate"]
    assert sorted((r["dirs"], r["procs"], r["direction"]) for r in rows) == sorted(
        (k, p, d) for k in (1, 2) for p in (1, 2) for d in ("read", "write"))
    for r in rows:
        assert len(r["per_proc_gbps"]) == r["procs"], r
        assert all(g > 0 for g in r["per_proc_gbps"]) and r["total_gbps"] > 0, r
        # The total spans the common start to the last finish: no more than the sum.
        assert r["total_gbps"] <= sum(r["per_proc_gbps"]) * 1.001, r
    table = bench.format_table(data)
    for r in rows:
        assert f"{r['total_gbps']:.2f}" in table


def test_missing_second_directory(tmp_path):
    proc = run_cli("--dir", str(tmp_path), "--dir", str(tmp_path / "nope"), "--quick")
    assert_one_line_error(proc, str(tmp_path / "nope"), "no such directory")
    assert os.listdir(tmp_path) == []


def two_dirs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    return a, b


@pytest.mark.parametrize("kw, words", [
    ({"procs": 0}, ["--procs must be at least 1, not 0"]),
    ({"same": True}, ["--dir names", "twice"]),
    ({"free": 24 << 20}, ["not enough free space", "--size 16M per process x --procs 2",
                          "GB free"]),
])
def test_bad_input_with_several_directories(tmp_path, monkeypatch, kw, words):
    a, b = two_dirs(tmp_path)
    if "free" in kw:  # room for one process's 16M, not for two
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda d: real(d)._replace(free=kw["free"]))
    dirs = [a, tmp_path / "a" / "."] if kw.get("same") else [a, b]
    with pytest.raises(bench.BenchError) as e:
        bench.run_nvme(dirs, "16M", quick=True, progress=False, procs=kw.get("procs", 2))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert os.listdir(a) == [] and os.listdir(b) == []


def test_a_failing_aggregate_removes_its_files(tmp_path, monkeypatch):
    a, b = two_dirs(tmp_path)

    real = throughput.stream

    def fail(f, bufs, size, write):
        if not isinstance(f, aio.StripedFile):  # one directory: goes well
            return real(f, bufs, size, write)
        assert all(os.path.exists(p) for p in f.paths)  # striped over both directories
        raise OSError("the disk is on fire")

    monkeypatch.setattr(throughput, "stream", fail)
    with pytest.raises(OSError, match="the disk is on fire"):
        bench.run_nvme([a, b], "8M", quick=True, progress=False)
    assert os.listdir(a) == [] and os.listdir(b) == []
