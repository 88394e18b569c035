"""Async file I/O between host memory and NVMe over the native engine, the swap space carved
from it, and host page pools. This layer knows nothing of ``torch.nn``.

``aio.open(path, mode)`` gives a ``File`` whose ``pread``/``pwrite`` return a ``Future``
(``result()`` or ``await``); failures are ``AIOError``, an ``OSError`` naming the errno, the path
and the offset.
"""

from .buffers import aligned_empty
from .engine import AIOError, AlignmentError, Engine, Future, backends, default_engine
from .files import File, Gather, StripedFile, open, stripe_share

__all__ = ["AIOError", "AlignmentError", "Engine", "File", "Future", "Gather", "StripedFile",
           "aligned_empty", "backends", "default_engine", "open", "stripe_share"]
