import contextlib
import os
import subprocess
import uuid

import pytest

from tieroffload import aio


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
