"""Host buffers for the engine: the address and size of a tensor, array or buffer object, and
page-aligned (optionally CUDA-pinned) tensors that O_DIRECT accepts."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .. import _native
from ..utils.sizes import parse_bytes


def memory_of(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, object to keep alive) of a CPU tensor, numpy array or buffer object."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"buffer must be a CPU tensor, not one on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("buffer tensor must be contiguous")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer array must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise ValueError("buffer array is read-only; a read needs a writable buffer")
        return buf.ctypes.data, buf.nbytes, buf
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"buffer must be a CPU tensor, a numpy array or a buffer object, "
                        f"not {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError("buffer must be contiguous")
    if writable and mv.readonly:
        raise ValueError(f"buffer {type(buf).__name__} is read-only; a read needs a writable one")
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, (buf, mv, arr)


def aligned_empty(nbytes: int | str, pin: bool | None = None,
                  on_free: Callable[[], None] | None = None) -> torch.Tensor:
    """An uninitialised ``torch.uint8`` tensor of ``nbytes`` (an int, or a size such as
    ``"1MiB"``) that O_DIRECT accepts: page aligned, exactly sized (no power-of-two rounding),
    and pinned for CUDA when a GPU is present (or ``pin=True``). Its memory goes back to the OS
    when the tensor and every view of it are freed; ``on_free`` is called then (after the
    pages are unregistered)."""
    if isinstance(nbytes, str):
        try:
            nbytes = parse_bytes(nbytes)
        except ValueError as e:
            raise ValueError(f"aligned_empty: nbytes is {e}") from None
    elif isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"aligned_empty: nbytes must be an int or a size such as '1MiB', not "
                        f"{type(nbytes).__name__} ({nbytes!r})")
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, not {nbytes}")
    if pin is None:
        pin = torch.cuda.is_available()
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = _native.AlignedBuffer(nbytes)
    if pin:
        cudart = torch.cuda.cudart()
        addr = buf.address
        rc = cudart.cudaHostRegister(addr, nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with {rc}")

        def unregister() -> None:
            cudart.cudaHostUnregister(addr)
            if on_free is not None:
                on_free()

        buf.set_on_free(unregister)
    elif on_free is not None:
        buf.set_on_free(on_free)
    return torch.frombuffer(buf, dtype=torch.uint8)


def bytes_view(buf: Any) -> Any:
    """A sliceable byte view of ``buf`` that ``File`` accepts."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("buffer tensor must be contiguous")
        return buf.reshape(-1).view(torch.uint8)
    mv = memoryview(buf)
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


