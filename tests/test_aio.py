"""The async I/O engine: bytes that round-trip, errors that name what failed, fallbacks."""

import asyncio
import errno
import logging
import os
import platform
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from conftest import mounted

from tieroffload import aio

ALIGN = 4096


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_backends_lists_threads_always():
    assert aio.backends()[-1] == "threads"
    assert set(aio.backends()) <= {"io_uring", "threads"}


@pytest.mark.parametrize("direct", [True, False])
def test_many_requests_in_flight_round_trip(engine, tmp_path, direct):
    """Hundreds of requests of odd sizes at scattered offsets, all in flight at once, written and
    read back bit-exactly, and checked against os.pread."""
    rng = np.random.default_rng(1)
    unit = ALIGN if direct else 1
    sizes = [int(s) * unit for s in rng.integers(1, 200 if direct else 300_000, 300)]
    offsets = np.cumsum([0] + [s + int(g) * unit for s, g in zip(sizes, rng.integers(0, 5, 300))])
    path = tmp_path / "data"
    data = [random_bytes(s, i) for i, s in enumerate(sizes)]
    srcs = [aio.aligned_empty(s) for s in sizes]
    for src, d in zip(srcs, data):
        src.copy_(torch.from_numpy(d))
    with aio.open(path, "w+", engine=engine, direct=direct) as f:
        assert f.direct == direct
        futs = [f.pwrite(src, int(off)) for src, off in zip(srcs, offsets)]
        assert [fu.result() for fu in futs] == sizes
        outs = [aio.aligned_empty(s) for s in sizes]
        futs = [f.pread(out, int(off)) for out, off in zip(outs, offsets)]
        assert [fu.result() for fu in futs] == sizes
    fd = os.open(path, os.O_RDONLY)
    try:
        for out, d, off in zip(outs, data, offsets):
            np.testing.assert_array_equal(out.numpy(), d)
            assert os.pread(fd, len(d), int(off)) == d.tobytes()
    finally:
        os.close(fd)


def test_many_files_at_once(engine, tmp_path):
    n = 256 << 10
    files = [aio.open(tmp_path / f"f{i}", "w+", engine=engine) for i in range(8)]
    srcs = [aio.aligned_empty(n) for _ in files]
    for i, s in enumerate(srcs):
        s.fill_(i + 1)
    futs = [f.pwrite(s) for f, s in zip(files, srcs)]
    assert all(fu.result() == n for fu in futs)
    outs = [aio.aligned_empty(n) for _ in files]
    futs = [f.pread(o) for f, o in zip(files, outs)]
    assert all(fu.result() == n for fu in futs)
    for f in files:
        f.close()
    for i, o in enumerate(outs):
        assert bool((o == i + 1).all())


def test_numpy_and_buffer_objects(engine, tmp_path):
    data = random_bytes(10_000, 7)
    with aio.open(tmp_path / "x", "w+", engine=engine, direct=False) as f:
        assert f.pwrite(data, 0).result() == 10_000
        assert f.pwrite(b"hello", 10_000).result() == 5
        out = bytearray(10_005)
        assert f.pread(out, 0).result() == 10_005
        assert bytes(out) == data.tobytes() + b"hello"
        floats = np.zeros(2500, dtype=np.float32)
        f.pread(floats, 0).result()
        assert floats.tobytes() == data.tobytes()


@pytest.mark.parametrize("backend", aio.backends())
@pytest.mark.parametrize("direct", [True, False])
def test_short_transfers_are_resubmitted(tmp_path, backend, direct):
    """The engine pretends the kernel moved at most 4 KiB per call: every request then finishes
    through the resubmission path, and the bytes must still be exact."""
    eng = aio.Engine(backend, queue_depth=8, block_size=1 << 20, _short_io=ALIGN)
    n = 3 << 20
    src = aio.aligned_empty(n)
    src.copy_(torch.from_numpy(random_bytes(n, 3)))
    out = aio.aligned_empty(n)
    with aio.open(tmp_path / "s", "w+", engine=eng, direct=direct) as f:
        assert f.pwrite(src, ALIGN).result() == n
        assert f.pread(out, ALIGN).result() == n
    assert torch.equal(out, src)
    with open(tmp_path / "s", "rb") as raw:
        raw.seek(ALIGN)
        assert raw.read() == src.numpy().tobytes()
    eng.close()


def test_read_past_end_of_file(engine, tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"\1" * 10_000)
    with aio.open(path, "r", engine=engine, direct=False) as f:
        buf = bytearray(20_000)
        with pytest.raises(aio.AIOError) as ei:
            f.pread(buf, 0).result()
        assert ei.value.errno == errno.ENODATA
        assert ei.value.offset == 10_000
        assert ei.value.filename == str(path)
        assert "10000 bytes" in str(ei.value)
        # Engine still usable after the error.
        assert f.pread(buf, 0, 10_000).result() == 10_000
        assert bytes(buf[:10_000]) == b"\1" * 10_000
    path.write_bytes(b"\2" * 3 * ALIGN)
    with aio.open(path, "r", engine=engine) as f:
        assert f.direct
        buf = aio.aligned_empty(4 * ALIGN)
        with pytest.raises(aio.AIOError) as ei:
            f.pread(buf, 0).result()
        assert ei.value.errno == errno.ENODATA and ei.value.offset == 3 * ALIGN


def test_missing_file_and_directory(engine, tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        aio.open(tmp_path / "nope", "r", engine=engine)
    assert isinstance(ei.value, aio.AIOError)
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(tmp_path / "nope")
    with pytest.raises(aio.AIOError) as ei:
        aio.open(tmp_path / "no-dir" / "f", "w+", engine=engine)
    assert ei.value.errno == errno.ENOENT


def test_closed_engine_and_file(tmp_path):
    eng = aio.Engine("threads")
    f = aio.open(tmp_path / "c", "w+", engine=eng)
    buf = aio.aligned_empty(ALIGN)
    f.pwrite(buf).result()
    eng.close()
    with pytest.raises(aio.AIOError) as ei:
        f.pwrite(buf)
    assert ei.value.errno == errno.EBADF and "engine is closed" in str(ei.value)
    f.close()
    with pytest.raises(aio.AIOError) as ei:
        f.pread(buf)
    assert ei.value.errno == errno.EBADF and "file is closed" in str(ei.value)
    with pytest.raises(aio.AIOError):
        aio.open(tmp_path / "c", "r", engine=eng)


def test_read_only_file_refuses_write(engine, tmp_path):
    (tmp_path / "ro").write_bytes(b"\0" * ALIGN)
    with aio.open(tmp_path / "ro", "r", engine=engine) as f:
        with pytest.raises(aio.AIOError) as ei:
            f.pwrite(aio.aligned_empty(ALIGN))
        assert ei.value.errno == errno.EBADF


def test_o_direct_misalignment_is_refused_and_writes_nothing(engine, tmp_path):
    path = tmp_path / "a"
    path.write_bytes(b"\7" * 4 * ALIGN)
    big = aio.aligned_empty(4 * ALIGN + 1)
    with aio.open(path, "r+", engine=engine) as f:
        assert f.direct
        cases = {"address": (big[1:ALIGN + 1], 0), "size": (big[:ALIGN + 100], 0),
                 "offset": (big[:ALIGN], 100)}
        for what, (buf, off) in cases.items():
            with pytest.raises(aio.AlignmentError) as ei:
                f.pwrite(buf, off)
            assert ei.value.errno == errno.EINVAL
            assert what in str(ei.value) and "direct=False" in str(ei.value)
    assert path.read_bytes() == b"\7" * 4 * ALIGN


def test_bad_buffers_are_refused(engine, tmp_path):
    with aio.open(tmp_path / "b", "w+", engine=engine, direct=False) as f:
        f.pwrite(b"\0" * 100).result()
        with pytest.raises(ValueError, match="contiguous"):
            f.pread(torch.zeros(10, 10)[:, 1])
        with pytest.raises(ValueError, match="too small"):
            f.pread(bytearray(10), 0, 20)
        with pytest.raises(ValueError, match="read-only"):
            f.pread(b"immutable")
        with pytest.raises(TypeError, match="buffer"):
            f.pread(12345)
        if torch.cuda.is_available():
            with pytest.raises(ValueError, match="CPU"):
                f.pread(torch.zeros(10, device="cuda"))


def test_full_disk_dev_full(engine):
    """/dev/full fails every write with ENOSPC (and refuses O_DIRECT, so this also falls back)."""
    with aio.open("/dev/full", "r+", engine=engine) as f:
        with pytest.raises(aio.AIOError) as ei:
            f.pwrite(aio.aligned_empty(ALIGN), 0).result()
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == "/dev/full"


def test_full_disk_real_file_system(engine):
    with mounted("tmpfs", "size=1m") as where:
        path = os.path.join(where, "big")
        buf = aio.aligned_empty(2 << 20)
        with aio.open(path, "w+", engine=engine) as f:
            with pytest.raises(aio.AIOError) as ei:
                f.pwrite(buf).result()
            assert ei.value.errno == errno.ENOSPC
            # Blocks are written in parallel, so a later block may take the last free page and
            # the one at offset 0 fail; at most 1 MiB fits, so some block at or below it fails.
            assert 0 <= ei.value.offset <= 1 << 20
            assert ei.value.offset % engine.block_size == 0
            with pytest.raises(aio.AIOError) as ei:
                f.allocate(4 << 20)
            assert ei.value.errno == errno.ENOSPC and "4194304" in str(ei.value)
            # Still usable once there is room again. (Without the truncate, the page at offset
            # 0 may be one the failed write never got, and the disk is still full.)
            os.truncate(path, 0)
            assert f.pwrite(buf[:ALIGN], 0).result() == ALIGN


@pytest.mark.parametrize("backend", aio.backends())
def test_file_size_limit_efbig(tmp_path, backend):
    code = textwrap.dedent(f"""
        import errno, resource
        from tieroffload import aio
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        eng = aio.Engine({backend!r}, block_size=256 << 10)
        with aio.open({str(tmp_path / "big")!r}, "w+", engine=eng) as f:
            try:
                f.pwrite(aio.aligned_empty(2 << 20)).result()
            except aio.AIOError as e:
                print(e.errno == errno.EFBIG, e.offset)
            print(f.pwrite(aio.aligned_empty(4096), 0).result())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(1 << 20), "4096"]


def test_file_system_without_o_direct_falls_back(engine, caplog):
    with mounted("ramfs") as where:
        path = os.path.join(where, "r")
        data = random_bytes(5000, 9)
        with caplog.at_level(logging.WARNING, logger="tieroffload.aio"):
            f = aio.open(path, "w+", engine=engine)
        assert not f.direct
        assert any("refuses O_DIRECT" in r.getMessage() for r in caplog.records)
        f.pwrite(data, 0).result()
        out = np.zeros(5000, dtype=np.uint8)
        f.pread(out, 0).result()
        f.close()
        np.testing.assert_array_equal(out, data)


def test_asyncio_gather_many_reads(engine, tmp_path):
    n, count = ALIGN * 4, 200
    src = aio.aligned_empty(n * count)
    src.copy_(torch.from_numpy(random_bytes(n * count, 11)))
    outs = [aio.aligned_empty(n) for _ in range(count)]

    async def main(f):
        await f.pwrite(src, 0)
        return await asyncio.gather(*(f.pread(o, i * n) for i, o in enumerate(outs)))

    with aio.open(tmp_path / "g", "w+", engine=engine) as f:
        got = asyncio.run(main(f))
    assert got == [n] * count
    assert torch.equal(torch.cat(outs), src)


def test_asyncio_error_propagates(engine, tmp_path):
    (tmp_path / "e").write_bytes(b"")

    async def main(f):
        await f.pread(aio.aligned_empty(ALIGN), 0)

    with aio.open(tmp_path / "e", "r", engine=engine) as f, pytest.raises(aio.AIOError) as ei:
        asyncio.run(main(f))
    assert ei.value.errno == errno.ENODATA


def test_done_callback_and_dropped_future(engine, tmp_path):
    seen = []
    called = threading.Event()

    def record(fu: aio.Future) -> None:
        seen.append(fu.result())
        called.set()

    with aio.open(tmp_path / "d", "w+", engine=engine) as f:
        fut = f.pwrite(aio.aligned_empty(1 << 20), 0)
        fut.add_done_callback(record)
        fut.result()
        # As with concurrent.futures, result() may return before the I/O thread has run the
        # callback (a CI run saw it): wait for it rather than race it.
        assert called.wait(5)
        # A future dropped at once: the file keeps the buffer alive until the kernel is done.
        f.pread(aio.aligned_empty(1 << 20), 0)
    assert seen == [1 << 20]
    fut.add_done_callback(lambda fu: seen.append(fu.result()))  # done: runs here, at once
    assert seen == [1 << 20] * 2


@pytest.mark.parametrize("backend", aio.backends())
def test_a_read_waited_on_runs_before_the_writes_queued_ahead_of_it(tmp_path, backend):
    """A write behind must not hold up the read that compute is blocked on: result() moves
    the request's queued pieces ahead of the others, which still complete, bytes intact."""
    eng = aio.Engine(backend=backend, queue_depth=1, block_size=64 << 10, threads=1)
    order: list[str] = []
    data = [random_bytes(1 << 20, i) for i in range(97)]
    srcs = [aio.aligned_empty(1 << 20) for _ in data]
    for src, d in zip(srcs, data):
        src.copy_(torch.from_numpy(d))
    with aio.open(tmp_path / "d", "w+", engine=eng) as f:
        f.pwrite(srcs[96], 96 << 20).result()
        writes = []
        for i in range(96):
            writes.append(f.pwrite(srcs[i], i << 20))
            writes[-1].add_done_callback(lambda fu: order.append("w"))
        out = aio.aligned_empty(1 << 20)
        read = f.pread(out, 96 << 20)
        read.add_done_callback(lambda fu: order.append("r"))
        assert read.result() == 1 << 20
        assert [w.result() for w in writes] == [1 << 20] * 96
    eng.close()
    np.testing.assert_array_equal(out.numpy(), data[96])
    with open(tmp_path / "d", "rb") as g:
        assert all(g.read(1 << 20) == d.tobytes() for d in data)
    assert order.count("w") == 96
    assert order.index("r") < 48, f"the read finished after {order.index('r')} of 96 writes"


DROPPED_ENGINE_CHILD = r"""
import sys, time
from tieroffload import aio

def run(path, backend):
    eng = aio.Engine(backend=backend, queue_depth=4, block_size=4096)
    f = aio.open(path, "w+", engine=eng)
    buf = aio.aligned_empty(4096)
    buf.fill_(7)
    f.pwrite(buf, 0).add_done_callback(lambda fu: time.sleep(0.5))  # in an I/O thread

run(sys.argv[1], sys.argv[2])  # the file, the engine and the future are dropped here
with open(sys.argv[1], "rb") as g:
    assert g.read(4096) == bytes([7]) * 4096
print("closed")
"""


@pytest.mark.parametrize("backend", aio.backends())
def test_an_engine_dropped_while_a_done_callback_runs_closes_without_a_hang(tmp_path, backend):
    """Dropping the last reference to an engine closes it; a callback still running in its
    I/O thread needs the GIL to finish, so the close must wait for it without holding it."""
    out = subprocess.run([sys.executable, "-c", DROPPED_ENGINE_CHILD, str(tmp_path / "d"),
                          backend], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "closed"


def test_default_engine(tmp_path):
    with aio.open(tmp_path / "z", "w+") as f:
        assert f.engine is aio.default_engine()
        assert f.pwrite(aio.aligned_empty(ALIGN)).result() == ALIGN


def test_aligned_empty():
    for n in (1, 4095, 4096, 10 << 20):
        t = aio.aligned_empty(n)
        assert t.dtype == torch.uint8 and t.numel() == n
        assert t.data_ptr() % 4096 == 0
        t.fill_(3)
    assert aio.aligned_empty(0).numel() == 0
    with pytest.raises(ValueError):
        aio.aligned_empty(-1)


def test_bad_engine_settings():
    with pytest.raises(ValueError, match="backend"):
        aio.Engine("spdk")
    with pytest.raises(ValueError, match="queue_depth"):
        aio.Engine(queue_depth=0)
    with pytest.raises(ValueError, match="block_size"):
        aio.Engine(block_size=1000)


SECCOMP_CHILD = r"""
import ctypes, logging, sys
# Docker's default profile answers io_uring_setup (425) with EPERM: do the same here.
class Filt(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filt))]
ins = (Filt * 4)(Filt(0x20, 0, 0, 0), Filt(0x15, 0, 1, 425), Filt(0x06, 0, 0, 0x50000 | 1),
                 Filt(0x06, 0, 0, 0x7FFF0000))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.byref(Prog(4, ins)), 0, 0) == 0, ctypes.get_errno()
logging.basicConfig(stream=sys.stdout, format="%(message)s")
from tieroffload import aio
print(aio.backends())
print(aio.Engine("auto").backend, aio.Engine("io_uring").backend)
"""


@pytest.mark.skipif("io_uring" not in aio.backends(), reason="io_uring not available here")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="syscall number")
def test_io_uring_blocked_by_seccomp_falls_back():
    out = subprocess.run([sys.executable, "-c", SECCOMP_CHILD], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "['threads']"
    assert sum("io_uring is unavailable" in line and "EPERM" in line for line in lines) == 1
    assert lines[-1] == "threads threads"


def test_aligned_empty_takes_a_size_string():
    buf = aio.aligned_empty("1M", pin=False)
    assert buf.numel() == 1 << 20 and buf.data_ptr() % ALIGN == 0
    assert aio.aligned_empty("8KiB", pin=False).numel() == 8192


@pytest.mark.parametrize("nbytes, err", [("1Q", ValueError), (None, TypeError),
                                         (1.5, TypeError), (True, TypeError), (-1, ValueError)])
def test_aligned_empty_refuses_what_is_not_a_size_naming_it(nbytes, err):
    with pytest.raises(err, match="aligned_empty: nbytes") as e:
        aio.aligned_empty(nbytes, pin=False)
    assert "\n" not in str(e.value) and repr(nbytes).strip("'") in str(e.value)


@pytest.mark.parametrize("d", [[], "auto", 3, {"recommended": []}])
def test_io_config_from_dict_of_a_non_dict_is_a_type_error_naming_what_it_needs(d):
    from tieroffload.aio.config import IOConfig

    with pytest.raises(TypeError, match="IOConfig.from_dict needs a dict of I/O settings") as e:
        IOConfig.from_dict(d)
    assert "\n" not in str(e.value)


def test_io_config_from_json_names_the_file_and_where_it_is_not_json(tmp_path):
    from tieroffload.aio.config import IOConfig

    path = tmp_path / "io.json"
    path.write_text('{\n  "block_size": 1048576,\n  "queue_depth": ,\n}\n')
    with pytest.raises(ValueError) as e:
        IOConfig.from_json(path)
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and "column" in msg and "\n" not in msg
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match="needs a dict") as e:
        IOConfig.from_json(path)
    assert str(path) in str(e.value)
    path.write_text('{"recommended": {"queue_depth": 0}}')
    with pytest.raises(ValueError, match="queue_depth") as e:
        IOConfig.from_json(path)
    assert str(path) in str(e.value)
    path.write_text('{"recommended": {"queue_depth": 8}}')
    assert IOConfig.from_json(path).queue_depth == 8
