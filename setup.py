"""Builds tieroffload's native I/O engine (C++17, pybind11, no PyTorch headers).

io_uring support needs liburing (Debian: liburing-dev). Without it the build still succeeds,
says so, and the engine offers only the portable thread-pool backend.
"""

import os
import shutil
import subprocess
import sys
import tempfile

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

URING_TEST = """#include <liburing.h>
int main(void) { struct io_uring r; return io_uring_queue_init(2, &r, 0) < 0; }
"""


def have_liburing() -> bool:
    """True when a program that includes liburing.h and links -luring builds here."""
    if os.environ.get("TIEROFFLOAD_NO_URING") == "1":
        print("tieroffload: TIEROFFLOAD_NO_URING=1, building without io_uring", file=sys.stderr)
        return False
    cc = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write(URING_TEST)
        ok = subprocess.run([cc, src, "-o", os.path.join(tmp, "probe"), "-luring"],
                            capture_output=True).returncode == 0
    if not ok:
        print("tieroffload: liburing not found (install liburing-dev for the io_uring backend); "
              "building with the thread-pool backend only", file=sys.stderr)
    return ok


uring = have_liburing()
ext = Pybind11Extension(
    "tieroffload._native",
    sorted(os.path.join("native", f) for f in os.listdir("native") if f.endswith(".cpp")),
    include_dirs=["native"],
    define_macros=[("TIEROFFLOAD_HAVE_LIBURING", "1")] if uring else [],
    libraries=["uring"] if uring else [],
    extra_compile_args=["-O2", "-Wall"],
    cxx_std=17,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
