import contextlib
import functools
import os
import subprocess
import uuid
import weakref

import pytest
import torch

import tieroffload
from tieroffload import aio


def pytest_configure(config):
    """One compute thread per process (the tests' own and their children), unless
    OMP_NUM_THREADS says otherwise: the models here are tiny, and on a machine of few cores,
    shared, OpenMP's threads spend far longer waiting for each other than the ops take (the
    optimizer tests ran 4 to 10 times slower with two). Every comparison is within a process,
    so its reference runs with the same count; tests of core lending set their own."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_report_header(config):
    return f"tieroffload aio backends: {aio.backends()}"


@pytest.fixture(scope="session", autouse=True)
def expected_backends():
    """CI sets TIEROFFLOAD_EXPECT_BACKENDS so that a build that silently lost io_uring fails."""
    want = os.environ.get("TIEROFFLOAD_EXPECT_BACKENDS")
    if want:
        assert aio.backends() == want.split(","), (
            f"expected backends {want}, this build has {aio.backends()}")


@pytest.fixture(params=aio.backends())
def engine(request):
    eng = aio.Engine(backend=request.param, queue_depth=32, block_size=64 << 10)
    assert eng.backend == request.param
    yield eng
    eng.close()


@contextlib.contextmanager
def mounted(fstype: str, options: str = ""):
    """Mounts a scratch file system (root only); skips the test where mounting is not allowed."""
    where = f"/tmp/tieroffload-{fstype}-{uuid.uuid4().hex[:8]}"
    os.makedirs(where)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, where]
    if os.geteuid() != 0 or subprocess.run(cmd, capture_output=True).returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount {fstype} here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        os.rmdir(where)


@pytest.fixture(autouse=True)
def closes_what_it_opened(monkeypatch):
    """Every model that ``tieroffload.offload`` offloaded and every optimizer that
    ``tieroffload.optimizer`` made during the test is closed at its teardown, even where an
    assert failed before the test's own close(): its swap files and threads never outlive it.
    Weak references only: a test that checks what garbage collection frees sees the same."""
    opened: list[weakref.ref] = []
    offload, optimizer = tieroffload.offload, tieroffload.optimizer

    @functools.wraps(offload)
    def tracked_offload(model, *args, **kwargs):
        out = offload(model, *args, **kwargs)
        opened.append(weakref.ref(model))
        return out

    @functools.wraps(optimizer)
    def tracked_optimizer(*args, **kwargs):
        out = optimizer(*args, **kwargs)
        opened.append(weakref.ref(out))
        return out

    monkeypatch.setattr(tieroffload, "offload", tracked_offload)
    monkeypatch.setattr(tieroffload, "optimizer", tracked_optimizer)
    yield
    for ref in reversed(opened):  # optimizers before their models
        obj = ref()
        if obj is None:
            continue
        with contextlib.suppress(Exception):
            if isinstance(obj, torch.nn.Module):
                tieroffload.close(obj, restore=False)
            else:
                obj.close(apply=False)
