"""Checkpoints of the whole training state, from whatever tier it lives in, streamed one unit
(and one optimizer chunk) at a time, so a model larger than RAM can be saved and resumed.

A checkpoint is a directory: ``tensors.bin`` (raw bytes), ``manifest.json`` (for each tensor:
key, dtype, shape, offset, size and CRC-32) and ``extra.pt`` (optimizer hyperparameters, the
non-tensor state and the caller's ``extra``: plain types and tensors only, loaded with
``weights_only=True`` so that a crafted file cannot run code, and checksummed like the tensors).
Everything is private to the user (0700 directories, 0600 files).

It is written under ``<path>.tmp-<pid>``, fsynced, and swapped into place in one step
(renameat2's RENAME_EXCHANGE), so a reader of ``<path>`` meets the old checkpoint or the new,
never none: a failure (a full disk) leaves the previous one as it was. Where the file system
cannot swap, the old one is moved aside first; a kill between the two renames then leaves no
``<path>`` but a complete copy beside it, which the next load or save puts back in place.
Leftovers of dead processes are then removed, a live one's never. A load reads through
descriptors it opened once, so a save that replaces ``<path>`` meanwhile is never mixed in.
Loading checks the whole manifest against the model and the optimizer, and the sizes and
checksums of everything, before it changes anything.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import shutil
import stat
import zlib
from typing import Any, BinaryIO

import torch
from torch import nn

from ..optim.paged import PagedOptimizer
from ..utils.dist import distributed
from ..utils.paths import exchange

FORMAT = "tieroffload-checkpoint"
VERSION = 1
READ = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt, or does not fit the model."""


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, from a copy: ``.numpy()`` would make the original's storage
    non-resizable, and offloaded storage must stay resizable."""
    t = t.detach().to("cpu", copy=True).contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class _Writer:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.entries: list[dict[str, Any]] = []

    def add(self, key: str, t: torch.Tensor) -> None:
        mv = _bytes(t)
        self.entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                             "shape": list(t.shape), "offset": self.f.tell(),
                             "nbytes": len(mv), "crc32": zlib.crc32(mv)})
        self.f.write(mv)


def _create(path: str) -> BinaryIO:
    """A new file only this user may read (0600)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600), "wb")


def _mkdir(path: str) -> None:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # whatever the umask


def _crc(f: BinaryIO) -> tuple[int, int]:
    """(bytes, CRC-32) of an open file, from its start."""
    crc = n = 0
    f.seek(0)
    while block := f.read(READ):
        crc, n = zlib.crc32(block, crc), n + len(block)
    return n, crc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(path: str) -> list[tuple[str, int]]:
    """(directory, pid) of ``<path>.tmp-<pid>`` and ``<path>.old-<pid>`` beside ``path``."""
    out = []
    for d in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        tail = d.rsplit("-", 1)[-1]
        try:
            st = os.lstat(d)
        except OSError:
            continue
        # Only our own saves' leftovers: a directory another user planted beside the
        # checkpoint is never adopted, nor removed.
        if tail.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            out.append((d, int(tail)))
    return out


def _recover(path: str) -> None:
    """Where ``path`` is missing, puts back the newest complete copy a killed save left beside
    it (a new one whose manifest was written, else the old one); then removes the leftovers of
    dead processes. A live process's temporary directory is never touched."""
    dead = [(d, pid) for d, pid in _leftovers(path) if not _alive(pid)]
    if not os.path.exists(path):
        complete = []
        for d, _ in dead:
            if not _complete(d):
                continue
            new = ".tmp-" in d[len(path):]
            complete.append((new, os.path.getmtime(os.path.join(d, "manifest.json")), d))
        if complete:
            os.rename(max(complete)[2], path)
            _fsync_dir(os.path.dirname(path))
    for d, _ in dead:
        if os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, extra: Any = None) -> None:
    """Saves parameters, buffers, optimizer state and ``extra`` (e.g. the scheduler's
    ``state_dict()`` and the step) into the directory ``path``. Under torch.distributed every
    rank calls it: each writes its own ``rank<r>/`` part, and rank 0 writes the one manifest
    and renames the whole into place once every rank has finished (or removes it if one
    failed)."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"checkpoint directory's parent does not exist: {parent}")
    dist = distributed()
    rank = dist.get_rank() if dist else 0
    token = [f"{path}.tmp-{os.getpid()}"]
    if dist:
        dist.broadcast_object_list(token, src=0)  # one temporary name for every rank
    tmp = token[0]
    if rank == 0:
        _recover(path)
        shutil.rmtree(tmp, ignore_errors=True)
        _mkdir(tmp)
    if dist:
        dist.barrier()
    part = os.path.join(tmp, f"rank{rank}") if dist else tmp
    try:
        if part != tmp:
            _mkdir(part)
        meta: Any = _write(part, model, optimizer, extra)
        _fsync_dir(part)
    except BaseException as e:
        meta = e
    metas = [meta]
    if dist:
        metas = [None] * dist.get_world_size()
        dist.all_gather_object(metas, meta if not isinstance(meta, BaseException)
                               else f"rank {rank}: {meta!r}")
    failed = [m for m in metas if not isinstance(m, dict)]
    try:
        if failed:
            raise meta if isinstance(meta, BaseException) else CheckpointError(
                f"checkpoint {path} not saved: {failed[0]}")
        if rank == 0:
            manifest = metas[0] if not dist else {
                "format": FORMAT, "version": VERSION, "world_size": len(metas), "ranks": metas}
            with _create(os.path.join(tmp, "manifest.json")) as f:
                f.write(json.dumps(manifest).encode())
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _replace(tmp, path, parent)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if dist:
            dist.barrier()  # nobody goes on before the checkpoint is in place


def _replace(tmp: str, path: str, parent: str) -> None:
    """Puts the complete checkpoint ``tmp`` in place of ``path``: in one step where the file
    system can (a reader of ``path`` sees the old or the new, never none), else by moving the
    old aside first. The old one is then removed; a failure leaves ``path`` as it was."""
    if os.path.lexists(path) and exchange(tmp, path):
        _fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)  # the old checkpoint, now
        return
    old = f"{path}.old-{os.getpid()}"
    if os.path.lexists(path):
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if os.path.lexists(old):
            os.rename(old, path)
        raise
    _fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def _write(tmp: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           extra: Any) -> dict[str, Any]:
    state = getattr(model, "_tieroffload", None)
    scalars: dict[str, Any] = {}
    loss_scale = None
    with _create(os.path.join(tmp, "tensors.bin")) as f:
        w = _Writer(f)
        if state is not None:
            for u in state.units:  # one unit resident at a time
                with state.resident([u]):
                    for name, p in zip(u.names, u.params):
                        w.add(f"param/{name}", p)
        else:
            for name, p in model.named_parameters():
                w.add(f"param/{name}", p)
        for name, b in model.named_buffers():
            w.add(f"buffer/{name}", b)
        groups = None
        if isinstance(optimizer, PagedOptimizer):
            index = optimizer._index()
            for chunk in optimizer.chunks:
                with optimizer.resident(chunk):
                    for p, st in optimizer.entries(chunk):
                        for k, v in st.items():
                            key = f"optim/{index[id(p)]}/{k}"
                            if isinstance(v, torch.Tensor):
                                w.add(key, v)
                            else:
                                scalars[key] = v
            groups = optimizer.state_dict_groups()
            if optimizer.scaler is not None:
                loss_scale = optimizer.scaler.state_dict()
        elif optimizer is not None:
            sd = optimizer.state_dict()
            for i, st in sd["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        w.add(f"optim/{i}/{k}", v)
                    else:
                        scalars[f"optim/{i}/{k}"] = v
            groups = sd["param_groups"]
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    epath = os.path.join(tmp, "extra.pt")
    try:
        with _create(epath) as f:
            torch.save({"param_groups": groups, "scalars": scalars, "loss_scale": loss_scale,
                        "extra": extra}, f)
            f.flush()
            os.fsync(f.fileno())
        # what load will accept: refused now, while the previous checkpoint is in place
        torch.load(epath, weights_only=True)
    except OSError:  # the disk: not the value
        raise
    except Exception as e:  # a lambda, an open file, a type weights_only refuses
        raise CheckpointError(f"extra holds a value that cannot be saved and loaded safely "
                              f"(use dicts, lists, numbers, strings and tensors): "
                              f"{e}".splitlines()[0]) from e
    with open(epath, "rb") as f:
        nbytes, crc = _crc(f)
    return {"format": FORMAT, "version": VERSION, "size": size, "tensors": w.entries,
            "extra": {"nbytes": nbytes, "crc32": crc}}


MAX_MANIFEST = 1 << 30  # bytes of manifest.json: about 5 M tensors


class _Opened:
    """A checkpoint directory opened once. Its files are read through descriptors taken from
    it, so a save that replaces ``path`` meanwhile is never mixed in: a load reads one
    checkpoint whole, or fails. Only the caller's own (or root's) directory and regular files
    are read: no symlink inside it, no FIFO or device, nothing another user could have
    planted."""

    def __init__(self, path: str, parent: _Opened | None = None) -> None:
        """``path``, or (with ``parent``) its last part inside the parent opened."""
        self.path = path
        # ``path`` may be a symbolic link (``latest -> step-1000``): its target's owner is
        # checked; inside, nothing is followed.
        where, flags = ((os.path.basename(path), os.O_NOFOLLOW) if parent is not None
                        else (path, 0))
        try:
            self.fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | flags,
                              dir_fd=parent.fd if parent is not None else None)
        except OSError as e:
            raise CheckpointError(f"no checkpoint at {path} ({e.strerror})") from e
        self._files: dict[str, BinaryIO] = {}
        try:
            self._check_owner(os.fstat(self.fd), path)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_owner(st: os.stat_result, what: str) -> None:
        if st.st_uid not in (os.geteuid(), 0):
            raise CheckpointError(
                f"checkpoint {what} belongs to uid {st.st_uid}, not to this user (uid "
                f"{os.geteuid()}) or root: another user could have planted it; copy it into a "
                "directory of your own to load it")

    def open(self, name: str) -> BinaryIO:
        """A file of the checkpoint, opened for reading once, closed with the checkpoint."""
        if name in self._files:
            return self._files[name]
        where = os.path.join(self.path, name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)
        except OSError as e:
            why = "is a symbolic link, never followed" if e.errno == errno.ELOOP else \
                f"cannot be opened: {e.strerror}"
            raise CheckpointError(f"checkpoint file {where} {why}") from e
        f = self._files[name] = os.fdopen(fd, "rb")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint file {where} is not a regular file")
        self._check_owner(st, where)
        return f

    def manifest(self) -> dict[str, Any]:
        f = self.open("manifest.json")
        where = os.path.join(self.path, "manifest.json")
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST:
            raise CheckpointError(f"checkpoint manifest {where} has {size} bytes, over the "
                                  f"{MAX_MANIFEST} a manifest can need")
        try:
            meta = json.loads(f.read())
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"checkpoint manifest {where} is unreadable: "
                                  f"{type(e).__name__}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT \
                or meta.get("version") != VERSION:
            raise CheckpointError(f"{where} is not a {FORMAT} version {VERSION}")
        return meta

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _complete(path: str) -> bool:
    """``path`` holds a checkpoint whose manifest and data size are whole."""
    try:
        with _Opened(path) as ck:
            meta = ck.manifest()
            if "ranks" not in meta:
                _check_size(ck, meta)
    except CheckpointError:
        return False
    return True


# The dtypes a checkpoint may hold: what parameters, buffers and optimizer state use.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
SCALAR_DTYPES = ("float32", "float64", "int64")  # an optimizer's step count


def _check_size(ck: _Opened, meta: dict[str, Any]) -> BinaryIO:
    """The data file has the manifest's size, and every entry is well formed and lies inside
    it: a known dtype, a shape of sizes, exactly its elements' bytes (a short entry would
    leave the rest of a tensor unread and unchecked). Returns the data file, open."""
    path = ck.path
    data = os.path.join(path, "tensors.bin")
    f = ck.open("tensors.bin")
    size = os.fstat(f.fileno()).st_size
    if size != meta.get("size"):
        raise CheckpointError(f"checkpoint data {data} is truncated: {size} bytes, the "
                              f"manifest says {meta['size']}")
    keys: set[str] = set()
    for e in meta["tensors"]:
        try:
            key, dtype, shape = e["key"], DTYPES[e["dtype"]], e["shape"]
            offset, nbytes = e["offset"], e["nbytes"]
            ok = (isinstance(key, str) and all(type(n) is int and n >= 0 for n in shape)
                  and type(offset) is int and type(nbytes) is int and type(e["crc32"]) is int)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise CheckpointError(f"checkpoint {path}: manifest entry {e!r:.200} is malformed")
        if key in keys:
            raise CheckpointError(f"checkpoint {path}: {key} is in the manifest twice")
        keys.add(key)
        want = math.prod(shape) * dtype.itemsize
        if nbytes != want or offset < 0 or offset + nbytes > size:
            raise CheckpointError(
                f"checkpoint {path}: {key} ({e['dtype']}{shape}) claims bytes "
                f"{offset}..{offset + nbytes}; it needs {want} bytes inside the {size} of "
                "tensors.bin")
    return f


def _verify(ck: _Opened, meta: dict[str, Any], data: BinaryIO) -> BinaryIO:
    """Checks the sizes and checksums of ``extra.pt`` and of every tensor in ``data``; returns
    ``extra.pt``, open."""
    path = ck.path
    extra = meta.get("extra")
    if extra is None:
        raise CheckpointError(f"checkpoint {path} has no checksum of extra.pt (saved by an "
                              "older tieroffload): save it again")
    ef = ck.open("extra.pt")
    got = _crc(ef)
    if got != (extra["nbytes"], extra["crc32"]):
        raise CheckpointError(f"checkpoint {path} is corrupt: extra.pt ({got[0]} bytes) fails "
                              f"its checksum")
    for e in meta["tensors"]:
        data.seek(e["offset"])
        crc, left = 0, e["nbytes"]
        while left:
            block = data.read(min(READ, left))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
        if left or crc != e["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {e['key']} (bytes "
                                  f"{e['offset']}..{e['offset'] + e['nbytes']}) fails its "
                                  "checksum")
    return ef


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Restores what ``save_checkpoint`` saved into ``model`` (offloaded with any policy, or
    not) and ``optimizer``; returns ``extra``. Refuses a truncated or corrupt checkpoint, or one
    that does not fit the model, before changing anything."""
    path = os.path.abspath(os.fspath(path))
    dist = distributed()
    if not dist or dist.get_rank() == 0:
        _recover(path)  # a save killed half way: put its complete copy back, clear leftovers
    if dist:
        dist.barrier()
    with _Opened(path) as top:
        meta = top.manifest()
        if "ranks" not in meta:
            return _load(top, meta, model, optimizer)
        world = dist.get_world_size() if dist else 1  # saved by several ranks: read our part
        ranks = meta.get("ranks")
        if world != meta.get("world_size") or not isinstance(ranks, list) or len(ranks) != world:
            raise CheckpointError(f"checkpoint {path} was saved by {meta.get('world_size')} ranks "
                                  f"({len(ranks) if isinstance(ranks, list) else 'no'} parts); "
                                  f"this run has {world}")
        rank = dist.get_rank() if dist else 0
        with _Opened(os.path.join(path, f"rank{rank}"), top) as part:
            return _load(part, meta["ranks"][rank], model, optimizer)


def _load(ck: _Opened, meta: dict[str, Any], model: nn.Module,
          optimizer: torch.optim.Optimizer | None) -> Any:
    """``load_checkpoint`` from one opened directory and its manifest."""
    path = ck.path
    # Opened at once, and held: a save that replaces the directory meanwhile cannot take them.
    for name in ("tensors.bin", "extra.pt"):
        ck.open(name)
    f = _check_size(ck, meta)
    ef = _verify(ck, meta, f)
    entries = {e["key"]: e for e in meta["tensors"]}
    try:
        ef.seek(0)
        saved = torch.load(ef, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: extra.pt is unreadable: {e}") from e
    state = getattr(model, "_tieroffload", None)
    params = ([(n, p) for u in state.units for n, p in zip(u.names, u.params)]
              if state is not None else list(model.named_parameters()))
    for kind, name, p in ([("param", n, p) for n, p in params]
                          + [("buffer", n, b) for n, b in model.named_buffers()]):
        e = entries.get(f"{kind}/{name}")
        if e is None:
            raise CheckpointError(f"checkpoint {path} has no {kind} {name!r}")
        if e["shape"] != list(p.shape) or e["dtype"] != str(p.dtype).removeprefix("torch."):
            raise CheckpointError(f"checkpoint {path}: {name} is {e['dtype']}{e['shape']}, the "
                                  f"model has {p.dtype}{list(p.shape)}")
    if optimizer is not None:
        _check_optimizer(path, optimizer, saved, entries)

    def fill(t: torch.Tensor, key: str) -> None:
        """From the data file opened and checked above: the bytes the checksums covered."""
        e = entries[key]
        f.seek(e["offset"])
        host = torch.empty(t.shape, dtype=t.dtype)  # see _bytes
        got = f.readinto(memoryview(host.view(-1).view(torch.uint8).numpy()))
        if got != e["nbytes"]:
            raise CheckpointError(f"checkpoint {path}: {key} read {got} of its "
                                  f"{e['nbytes']} bytes")
        t.copy_(host)

    try:
        with torch.no_grad():
            if state is not None:
                for u in state.units:
                    with state.resident([u], writeback=state.mover is not None):
                        for name, p in zip(u.names, u.params):
                            fill(p.data, f"param/{name}")
                        state.mark_loaded(u.params)
            else:
                for name, p in model.named_parameters():
                    fill(p.data, f"param/{name}")
            for name, b in model.named_buffers():
                fill(b, f"buffer/{name}")
        if optimizer is not None:
            _load_optimizer(optimizer, saved, entries, fill)
    except OSError as e:  # everything was checked: the disk failed part way
        raise CheckpointError(
            f"checkpoint {path}: {type(e).__name__} [{e.errno}] {e.strerror} while loading it, "
            "after the checks: the model and optimizer are now partly loaded; load it again "
            "once the disk is sound") from e
    return saved["extra"]


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                    entries: dict[str, dict[str, Any]], fill: Any) -> None:
    scalars = saved["scalars"]

    def state_of(i: int) -> dict[str, Any] | None:
        prefix = f"optim/{i}/"
        st: dict[str, Any] = {k[len(prefix):]: v for k, v in scalars.items()
                              if k.startswith(prefix)}
        for key, e in entries.items():
            if key.startswith(prefix):
                t = torch.empty(e["shape"], dtype=DTYPES[e["dtype"]])
                fill(t, key)
                st[key[len(prefix):]] = t
        return st or None

    if isinstance(optimizer, PagedOptimizer):
        optimizer.load_groups(saved["param_groups"])
        if optimizer.scaler is not None and saved.get("loss_scale"):
            optimizer.scaler.load_state_dict(saved["loss_scale"])
        index = optimizer._index()
        for chunk in optimizer.chunks:
            optimizer.load_chunk(chunk, lambda p: state_of(index[id(p)]))
    else:
        n = sum(len(g["params"]) for g in saved["param_groups"])
        state = {i: st for i in range(n) if (st := state_of(i)) is not None}
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _check_optimizer(path: str, optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                     entries: dict[str, dict[str, Any]]) -> None:
    """Refuses, before anything is written, optimizer state that does not fit ``optimizer``:
    none saved, other param groups, or a state tensor of another shape or dtype than the one
    the optimizer keeps for that parameter (its own dtype, or fp32 where it has a master)."""
    groups = saved["param_groups"]
    if groups is None:
        raise CheckpointError(f"checkpoint {path} has no optimizer state; load it without the "
                              "optimizer")
    mine = optimizer.param_groups
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine]:
        raise CheckpointError(f"checkpoint {path}: optimizer param groups of "
                              f"{[len(g['params']) for g in groups]} parameters, this optimizer "
                              f"has {[len(g['params']) for g in mine]}")
    params = [p for g in mine for p in g["params"]]
    scalar: dict[str, tuple[bool, str]] = {}  # state name -> (a scalar, the first key)
    masters = ({id(c.params[i]) for c in optimizer.chunks for i in c.masters}
               if isinstance(optimizer, PagedOptimizer) else set())
    for key, e in entries.items():
        if not key.startswith("optim/"):
            continue
        _, i, name = key.split("/", 2)
        if not i.isdigit() or int(i) >= len(params):
            raise CheckpointError(f"checkpoint {path}: {key} is for no parameter of this "
                                  f"optimizer ({len(params)} parameters)")
        p = params[int(i)]
        if p.dim() > 0:  # one state name is a scalar (step) for every parameter, or for none
            first = scalar.setdefault(name, (len(e["shape"]) == 0, key))
            if first[0] != (len(e["shape"]) == 0):
                raise CheckpointError(f"checkpoint {path}: {key} is {e['dtype']}{e['shape']} "
                                      f"where {first[1]} is {'' if first[0] else 'not '}a "
                                      "scalar")
        if len(e["shape"]) == 0 and p.dim() > 0:  # a scalar such as step
            if e["dtype"] not in SCALAR_DTYPES:
                raise CheckpointError(f"checkpoint {path}: {key} is a {e['dtype']} scalar; "
                                      f"an optimizer's scalars are one of {SCALAR_DTYPES}")
            continue
        want = "float32" if id(p) in masters else str(p.dtype).removeprefix("torch.")
        if e["shape"] != list(p.shape) or e["dtype"] != want:
            raise CheckpointError(f"checkpoint {path}: {key} is {e['dtype']}{e['shape']}, this "
                                  f"optimizer keeps {want}{list(p.shape)} for that parameter")
