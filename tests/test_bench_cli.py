"""``tieroffload-bench`` as a command: its help without the ``bench`` extra, output paths checked
before the sweep, and child processes (fio) that never outlive it."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import mounted
from test_bench import assert_one_line_error, run_cli

WITHOUT_EXTRA = ("import sys\n"
                 "for m in ('tqdm', 'aiofiles', 'matplotlib'):\n"
                 "    sys.modules[m] = None  # the bench extra is not installed\n"
                 "from tieroffload.cli.bench import main\n"
                 "sys.exit(main(sys.argv[1:]))\n")


def without_extra(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRA, *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("args", [["--help"], ["nvme", "--help"]])
def test_help_works_without_the_bench_extra(args):
    proc = without_extra(*args)
    assert proc.returncode == 0, proc.stderr
    assert "usage: tieroffload-bench" in proc.stdout and proc.stderr == ""
    if args == ["--help"]:
        assert "tieroffload[bench]" in proc.stdout


def test_nvme_without_the_bench_extra_is_one_line_naming_it(tmp_path):
    proc = without_extra("nvme", "--dir", str(tmp_path), "--quick")
    assert_one_line_error(proc, "nvme needs the bench extra", "pip install 'tieroffload[bench]'")
    assert os.listdir(tmp_path) == []


def test_json_at_a_folder_is_refused_before_measuring(tmp_path):
    (tmp_path / "out").mkdir()
    proc = run_cli("--dir", str(tmp_path), "--quick", "--json", str(tmp_path / "out"))
    assert_one_line_error(proc, "--json", "is a directory")
    assert os.listdir(tmp_path) == ["out"]


def test_json_on_a_read_only_file_system_is_refused_before_measuring(tmp_path):
    with mounted("tmpfs", "ro") as where:
        proc = run_cli("--dir", str(tmp_path), "--quick", "--json", f"{where}/o.json")
        assert_one_line_error(proc, "--json", "not writable")
    assert os.listdir(tmp_path) == []


def test_a_plot_that_is_no_image_is_refused_before_measuring(tmp_path):
    proc = run_cli("--dir", str(tmp_path), "--quick", "--plot", str(tmp_path / "r.txt"))
    assert_one_line_error(proc, "--plot", "not an image file name")
    assert os.listdir(tmp_path) == []


def test_json_and_plot_at_one_path_are_refused_before_measuring(tmp_path):
    same = str(tmp_path / "same.png")
    proc = run_cli("--dir", str(tmp_path), "--quick", "--json", same, "--plot", same)
    assert_one_line_error(proc, "--json and --plot name the same file")
    assert os.listdir(tmp_path) == []


def test_report_refuses_a_plot_that_is_no_image(tmp_path):
    run = tmp_path / "run.csv"
    run.write_text("step\n1\n")
    proc = subprocess.run([sys.executable, "-m", "tieroffload.cli.bench", "report", str(run),
                           "--plot", str(tmp_path / "dash.csv")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "not an image file name" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and sorted(os.listdir(tmp_path)) == ["run.csv"]


CHILD = textwrap.dedent("""
    import sys
    from tieroffload.cli.bench import common
    print("ready", flush=True)
    try:
        common.run_child(["sleep", "300"])
    except KeyboardInterrupt:
        sys.exit(130)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


WORKERS = textwrap.dedent("""
    from tieroffload.cli.bench.aggregate import _Workers
    if __name__ == "__main__":
        workers = _Workers(2)
        print("ready", flush=True)
        import time
        time.sleep(300)
""")


def test_the_aggregate_workers_die_with_the_bench_when_it_is_killed():
    """The spawned processes of --procs wait on a queue whose write end they hold too, so no
    EOF tells them the bench died: killed outright, the bench takes them with it."""
    bench = subprocess.Popen([sys.executable, "-c", WORKERS], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "ready"
        workers = [p.pid for p in psutil.Process(bench.pid).children()
                   if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2, workers
        bench.kill()
        bench.wait(timeout=30)
        deadline = time.monotonic() + 60  # a worker may still be importing torch
        while not all(_gone(w) for w in workers):
            assert time.monotonic() < deadline, "a worker outlived the bench"
            time.sleep(0.1)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_child_process_dies_with_the_bench(sig):
    """The bench's children (fio) run through ``common.run_child``: a bench interrupted (its
    KeyboardInterrupt) or killed outright takes its child with it."""
    bench = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not (kids := psutil.Process(bench.pid).children()):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = kids[0].pid
        bench.send_signal(sig)
        bench.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, "the child outlived the bench"
            time.sleep(0.05)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
