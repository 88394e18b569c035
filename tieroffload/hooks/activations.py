"""Activations saved for backward, paged out during forward and prefetched back for backward
(``Policy(activations="cpu" | "nvme")``).

Autograd's saved-tensor hooks hand each saved tensor to ``pack``; a tensor smaller than the
threshold, or one that is a parameter (or a view of one), stays where it is. The others are
saved by *storage*: several views of one storage (q, k and v split from one projection) become
one record, written once, and each comes back as the same view of a restored storage, with the
same strides, so backward computes bit for bit what it would have. Writes run on a worker
thread while forward goes on; a record keeps its source storage until its write is done, and
forward waits before it pages out more than the prefetch window and one record more (so a slow
disk slows forward rather than growing memory). When backward unpacks record i, the records
just before it in forward order are already being read back, up to the prefetch window.

Unlike ``torch.autograd.graph.save_on_cpu`` the copies overlap compute, and NVMe is a tier.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import weakref
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..aio.engine import error_for
from ..aio.swap import SwapSpace
from ..compat.autograd import saved_tensors_hooks_disabled, top_pack_hook
from ..compat.tensors import storage_key, version
from ..core.devices import pinned_empty
from ..core.mover import Mover, Ticket, timed_wait
from ..core.stats import Stats

log = logging.getLogger("tieroffload")


@dataclass
class ActivationStats:
    """The activation pager's counters (``stats(model)["activations"]``)."""

    offloaded: int = 0       # saved tensors handed to a lower tier
    kept: int = 0            # below the threshold, parameters, other devices: left in place
    bytes_written: int = 0   # storage bytes sent to the tier
    bytes_read: int = 0      # storage bytes read back for backward
    hits: int = 0            # unpacked with the bytes already there (prefetched or unwritten)
    misses: int = 0          # fetched on demand
    wait_s: float = 0.0      # time forward and backward waited on activation I/O
    peak_inflight: int = 0   # bytes held by writes not yet done


class _Record:
    """One saved storage: in memory until written, then in the tier until read back."""

    __slots__ = ("seq", "nbytes", "padded", "source", "host", "offset", "write", "read",
                 "restored", "pending", "refs", "dead", "crc", "saved", "__weakref__")

    def __init__(self, seq: int, source: torch.UntypedStorage, padded: int) -> None:
        self.seq = seq
        self.nbytes = source.nbytes()
        self.padded = padded
        self.source: torch.UntypedStorage | None = source  # until its write is done
        self.host: torch.Tensor | None = None     # the bytes in RAM (tier "cpu" on CUDA)
        self.offset: int | None = None            # its extent in the swap space
        self.write: Ticket | None = None
        self.read: Ticket | None = None
        self.restored: torch.UntypedStorage | None = None  # read back, not yet all unpacked
        self.pending = 0  # handles not yet unpacked since the last read
        self.refs = 0     # live handles
        self.dead = False
        self.crc: int | None = None  # of the bytes written (Policy(checksum=True))
        # The first tensor saved into it: while it lives, so does the storage (see _live).
        self.saved: weakref.ref[torch.Tensor] | None = None


class _Handle:
    """What autograd keeps instead of a saved tensor: its record and how to view it."""

    __slots__ = ("pager", "record", "dtype", "size", "stride", "offset")

    def __init__(self, pager: ActivationPager, record: _Record, t: torch.Tensor) -> None:
        self.pager = pager
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        record.refs += 1
        record.pending += 1

    def __del__(self) -> None:
        self.pager._drop(self.record)


class _Hooks:
    """One forward's saved-tensor hooks. Retired, they come off autograd's stack where they are
    on its top, and pass every tensor through where they are not (hooks pushed over them and
    left there): nothing saved after their forward reaches the pager."""

    def __init__(self, pager: ActivationPager) -> None:
        self.pager = pager
        self.live = True
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, pager.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        return self.pager.pack(t) if self.live else t

    def retire(self) -> None:
        self.live = False
        if top_pack_hook() == self.pack:
            self.ctx.__exit__(None, None, None)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ActivationPager:
    """Saved-tensor hooks that page activations to ``tier`` ("cpu" or "nvme")."""

    def __init__(self, tier: str, device: torch.device, threshold: int,
                 window: tuple[int, int | None], swap: SwapSpace | None,
                 param_storages: Callable[[], Iterable[torch.Tensor]],
                 delay: Callable[[], None] | None = None, max_inflight: int = 256 << 20,
                 checksum: bool = False, ledger: Stats | None = None) -> None:
        if tier not in ("cpu", "nvme"):
            raise ValueError(f'activations must be "cpu", "nvme" or None, not {tier!r}')
        self.tier = tier
        self.device = device
        self.cuda = device.type == "cuda"
        self.threshold = threshold
        self.window_units, self.window_bytes = window
        self.swap = swap
        self.params = param_storages
        self.max_inflight = max_inflight
        self.checksum = checksum and tier == "nvme"  # CRC-32 of each record, checked on read
        self.stats = ActivationStats()
        self.ledger = ledger or Stats()  # counts the pinned host copies (on CUDA)
        self.active = not (tier == "cpu" and not self.cuda)
        if not self.active:
            log.info('activations="cpu" with compute on the CPU: they are in RAM already, so '
                     "they stay where they are")
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._order: list[weakref.ref[_Record]] = []  # forward order, for backward's prefetch
        self._writing: list[_Record] = []
        self._inflight = 0
        self._param_ids: set[int] = set()
        self._by_storage: dict[tuple[int, int], weakref.ref[_Record]] = {}
        # An own worker, so that activation I/O never queues behind parameter moves.
        self.mover = Mover(device, 0, 0, Stats(), delay)
        self._hooks: _Hooks | None = None  # those of the forward running

    # -- the hooks -----------------------------------------------------------------------------

    def begin(self) -> None:
        """Starts a forward: saved tensors from here on go through ``pack``. Hooks a forward
        left behind (a KeyboardInterrupt skips ``end``) come off first."""
        self._retire_hooks()
        off = saved_tensors_hooks_disabled()
        if off is not None:
            if not torch.is_grad_enabled():
                return  # nothing is saved for backward
            raise RuntimeError(
                f"tieroffload: activations={self.tier!r} pages what forward saves through "
                f"autograd's saved-tensor hooks, which are disabled here ({off}): run the "
                "forward outside torch.autograd.graph.disable_saved_tensors_hooks, or offload "
                "with activations=None")
        with self._lock:
            self._order = [r for r in self._order if r() is not None]
            self._by_storage.clear()  # dedupe within one forward
            self._param_ids = {storage_key(p.untyped_storage()) for p in self.params()}
        self._hooks = _Hooks(self)
        self._hooks.ctx.__enter__()

    def end(self) -> None:
        """Ends the forward (also when it raised an Exception): the hooks come off."""
        self._retire_hooks()
        self.retire()

    def _retire_hooks(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.retire()

    def pack(self, t: torch.Tensor) -> Any:
        if not self._offloadable(t):
            self.stats.kept += 1
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), version(t))
        self.retire()
        with self._lock:
            record = self._live(key)
        if record is None:
            self._throttle(storage.nbytes())
        with self._lock:
            record = self._live(key)
            if record is None:
                record = self._page_out(storage)
                record.saved = weakref.ref(t)
                self._by_storage[key] = weakref.ref(record)
            handle = _Handle(self, record, t)
            self.stats.offloaded += 1
        return handle

    def unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h
        r = h.record
        with self._lock:
            storage = r.source if r.source is not None else r.restored
            if storage is None:
                self.stats.misses += 1
                self._read(r)
            else:
                self.stats.hits += 1
            self._prefetch_before(r)
        if storage is None:
            timed_wait(r.read, self.stats)
            with self._lock:
                storage = r.restored
        with self._lock:
            r.pending -= 1
            if r.pending <= 0:
                r.restored = None  # autograd holds what it unpacked; the rest is ours no more
                r.read = None
        return torch.empty(0, dtype=h.dtype, device=storage.device).set_(
            storage, h.offset, h.size, h.stride)

    # -- moves ---------------------------------------------------------------------------------

    def _offloadable(self, t: torch.Tensor) -> bool:
        if not self.active or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if t.layout is not torch.strided or t.is_quantized or t.device.type != self.device.type:
            return False
        if t.is_conj() or t.is_neg():  # lazy flags over the bytes: saved as they are
            return False
        storage = t.untyped_storage()
        return storage.nbytes() >= self.threshold and storage_key(storage) not in self._param_ids

    def _live(self, key: tuple[int, int]) -> _Record | None:
        """The record of a storage saved earlier in this forward, unchanged since (the key has
        its version): while its write is on its way the record holds the storage, after it
        the first tensor saved into it must still live (else the address may be another
        storage's now). A storage saved twice is paged once either way, so that each step
        pages the same records however fast the writes are: the swap space stays flat."""
        ref = self._by_storage.get(key)
        r = ref() if ref is not None else None
        if r is None or r.dead:
            return None
        if r.source is not None:
            return r
        t = r.saved() if r.saved is not None else None
        return r if t is not None and t.untyped_storage().data_ptr() == key[0] else None

    def _padded(self, n: int) -> int:
        align = self.swap.align if self.swap is not None else 4096
        return -(-max(n, 1) // align) * align

    def _page_out(self, storage: torch.UntypedStorage) -> _Record:
        r = _Record(next(self._seq), storage, self._padded(storage.nbytes()))
        if self.tier == "nvme":  # a full disk fails here, before the record is tracked
            r.offset = self.swap.alloc(r.padded)
        self._order.append(weakref.ref(r))
        self._writing.append(r)
        self._inflight += r.nbytes
        self.stats.peak_inflight = max(self.stats.peak_inflight, self._inflight)
        self.stats.bytes_written += r.nbytes
        if self.cuda or self.tier == "nvme":
            # Pinned on CUDA; on the CPU O_DIRECT needs an aligned copy of the bytes.
            r.host = pinned_empty(r.padded, self.cuda, self.ledger)
        src, host, offset = _bytes_of(storage), r.host, r.offset
        file = self.swap.file if self.tier == "nvme" else None

        def job() -> None:  # on the worker: its CUDA stream waits for the compute stream
            host[:r.nbytes].copy_(src, non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            if self.checksum:
                r.crc = zlib.crc32(host[:r.nbytes].numpy())
            if file is not None:
                file.pwrite(host, offset, r.padded).result()

        r.write = self.mover.submit(job, "activations", r.nbytes, self.tier, write=True)
        return r

    def _read(self, r: _Record) -> None:
        """Starts bringing ``r`` back (called under the lock, with its source gone)."""
        if r.read is not None:
            return
        if r.pending <= 0:  # a second backward over a retained graph
            r.pending = r.refs
        # On CUDA the destination is allocated here, on the stream that will use it.
        dst = torch.empty(r.padded, dtype=torch.uint8, device=self.device) if self.cuda else None
        host, offset = r.host, r.offset
        file = self.swap.file if self.tier == "nvme" else None

        def job() -> None:
            buf = host
            if file is not None:
                buf = pinned_empty(r.padded, self.cuda, self.ledger)
                file.pread(buf, offset, r.padded).result()
                if r.crc is not None and zlib.crc32(buf[:r.nbytes].numpy()) != r.crc:
                    raise error_for(errno.EIO, f"checksum mismatch: the {r.nbytes} bytes of "
                                    f"saved activation {r.seq} read back differ from those "
                                    "written", file.path, offset)
            if dst is None:
                r.restored = buf.untyped_storage()
                return
            dst.copy_(buf, non_blocking=True)
            torch.cuda.current_stream().synchronize()  # buf may go once the copy has read it
            r.restored = dst.untyped_storage()

        self.stats.bytes_read += r.nbytes
        r.read = self.mover.submit(job, "activations", r.nbytes, self.tier)

    def _prefetch_before(self, r: _Record) -> None:
        """Starts reading the records saved just before ``r``: backward needs them next."""
        try:
            i = next(k for k in range(len(self._order) - 1, -1, -1)
                     if self._order[k]() is r)
        except StopIteration:
            return
        units, nbytes = 0, 0
        for ref in reversed(self._order[:i]):
            q = ref()
            if q is None or q.dead or q.pending <= 0:  # gone, or all its handles unpacked
                continue
            if units >= self.window_units or (self.window_bytes is not None
                                              and nbytes + q.nbytes > self.window_bytes):
                break
            units += 1
            nbytes += q.nbytes
            if q.source is None and q.restored is None and q.read is None:
                self._read(q)

    def retire(self, block: bool = False) -> None:
        """Lets go of the sources (and host copies, for NVMe) of records whose writes are done.
        Runs on the thread that packs, so a storage's address is reused only once its record
        is out of the dedupe map."""
        while True:
            with self._lock:
                if not self._writing:
                    return
                r = self._writing[0]
                if not r.write.done():
                    if not block:
                        return
                    ticket = r.write
                else:
                    ticket = None
            if ticket is not None:
                timed_wait(ticket, self.stats)
                continue
            try:
                r.write.wait()  # re-raises what the worker met
            except BaseException:
                # Raised once: the record keeps its source (unpacked from memory, as if never
                # paged) and leaves the queue, so later passes and close() go on.
                with self._lock:
                    self._writing.pop(0)
                    self._inflight -= r.nbytes
                    self._free(r)
                raise
            with self._lock:
                self._writing.pop(0)
                self._inflight -= r.nbytes
                r.source = None
                if self.tier == "nvme":
                    r.host = None
                if r.dead:
                    self._free(r)

    def _throttle(self, nbytes: int) -> None:
        """Before a storage of ``nbytes`` is paged out, forward waits for the oldest writes
        until it fits beside those still in flight: at most the prefetch window and one record
        more (units, or bytes), and never over ``max_inflight`` bytes. A slow disk slows
        forward; it never makes it hold more than the planner counts."""
        while True:
            with self._lock:
                if not self._writing:
                    return
                if (len(self._writing) <= self.window_units
                        and self._inflight + nbytes <= self.max_inflight
                        and (self.window_bytes is None or self._inflight <= self.window_bytes)):
                    return
                ticket = self._writing[0].write
            timed_wait(ticket, self.stats)
            self.retire()

    def _drop(self, r: _Record) -> None:
        with self._lock:
            r.refs -= 1
            if r.refs > 0:
                return
            r.dead = True
            r.restored = None
            if r.source is None:  # with a write in flight, retire frees it
                self._free(r)
        self.retire()

    def held(self) -> tuple[list[tuple[int, int]], int]:
        """Host memory the records hold: the ranges of their aligned copies and of what was
        read back (mapped by us), and the bytes of saved storages still waiting to be written
        (from malloc, where they are on the CPU)."""
        ranges, heap = [], 0
        with self._lock:
            for ref in self._order:
                r = ref()
                if r is None:
                    continue
                for st in (r.host.untyped_storage() if r.host is not None else None, r.restored):
                    if st is not None and st.device.type == "cpu":
                        ranges.append((st.data_ptr(), st.nbytes()))
                if r.source is not None and r.source.device.type == "cpu":
                    heap += r.source.nbytes()
        return ranges, heap

    def _free(self, r: _Record) -> None:
        if r.offset is not None and self.swap is not None:
            self.swap.free(r.offset, r.padded)
            r.offset = None
        r.host = None

    def close(self) -> None:
        self._retire_hooks()
        self.retire(block=True)
        self.mover.close()
