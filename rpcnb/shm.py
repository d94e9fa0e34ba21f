"""rpcnb's same-host shared-memory path for large CPU tensors.

When every member of the group runs on this host, a CPU tensor of at least ``threshold``
bytes that rpcnb's pickler meets (call arguments and results, ``--push``, ``--fetch``,
``to_here()``) is copied once into a pre-faulted shared-memory buffer from this
process's pool, and only the buffer's name travels. The receiver maps the buffer and
wraps it as a tensor without copying. The buffer goes back to the sender's pool when the
receiving tensor (and every view of it) is freed, so copy semantics hold: the sender
never writes into a buffer a receiver still sees, and the receiver's writes never reach
the sender's tensor.

Tensors that need autograd, CUDA tensors, small tensors and other hosts keep TensorPipe's
path. ``RPCNB_SHM=0`` (or ``%rpc_init --no-shm``) turns the path off.

Buffers are files in /dev/shm named ``rpcnb-<group>-<pid>-<n>``; their creator unlinks
them when it leaves, and the group's first kernel removes a dead member's.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HEADER = 4096  # one page: byte 0 is the buffer's state; data starts page-aligned
FREE, IN_FLIGHT = 0, 1
DEFAULT_THRESHOLD = 1 << 20  # 1 MB
DEFAULT_POOL_BYTES = 4 << 30  # at most this much shared memory per process
SHM_DIR = "/dev/shm"

_lock = threading.Lock()
_local = threading.local()
_enabled = os.environ.get("RPCNB_SHM", "1").lower() not in ("0", "false", "no", "off")
_threshold = int(os.environ.get("RPCNB_SHM_THRESHOLD", DEFAULT_THRESHOLD))
_pool_limit = int(os.environ.get("RPCNB_SHM_POOL_BYTES", DEFAULT_POOL_BYTES))
_group: str | None = None  # set while this process is in a single-host group
_stats = {"sent": 0, "sent_bytes": 0, "received": 0, "fallbacks": 0}


@dataclass
class _Segment:
    name: str
    size: int  # data bytes (without the header)
    fd: int
    mm: mmap.mmap

    @property
    def state(self) -> int:
        return self.mm[0]


_pool: list[_Segment] = []
_pool_bytes = 0
_counter = 0
_peer_maps: dict[str, mmap.mmap] = {}


def _count(key: str, n: int = 1) -> None:
    with _lock:  # counters are bumped from several RPC threads at once
        _stats[key] += n


def set_enabled(flag: bool) -> None:
    """Turn the path on or off in this process (the sender decides)."""
    global _enabled
    _enabled = bool(flag)


def is_enabled() -> bool:
    """Whether this process sends through shared memory when it can."""
    return _enabled


def is_active() -> bool:
    """On, and this process is in a group whose members all run on this host."""
    return _enabled and _group is not None


def activate(group: str) -> None:
    """Called when this process joins a single-host group named ``group``."""
    global _group
    _group = group
    sweep()


def sweep() -> int:
    """Unlink buffers left by processes that died without cleaning up (for example a
    whole process group killed at once); returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, "rpcnb-*-*-*")):
        try:
            pid = int(os.path.basename(path).rsplit("-", 2)[1])
            if os.stat(path).st_uid != os.getuid():
                continue
        except (ValueError, OSError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
        except PermissionError:
            pass
    return removed


def deactivate() -> None:
    """Called when this process leaves: unlink its buffers, forget peers' mappings."""
    global _group, _pool_bytes
    _group = None
    with _lock:
        for seg in _pool:
            _unlink(seg.name)
            with contextlib.suppress(OSError):
                os.close(seg.fd)
        # Mappings stay valid for tensors still alive; they are unmapped when freed.
        _pool.clear()
        _pool_bytes = 0
        _peer_maps.clear()


def stats() -> dict[str, int]:
    """Counts: tensors sent and received this way, fallbacks, pool size, in flight."""
    with _lock:
        return dict(_stats, pool_bytes=_pool_bytes, buffers=len(_pool),
                    in_flight=sum(seg.state == IN_FLIGHT for seg in _pool))


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Inside this block, this thread's pickling uses TensorPipe's path."""
    old = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = old


def wants(tensor: Any) -> bool:
    """Should this tensor take the shared-memory path?"""
    if not _enabled or _group is None or getattr(_local, "off", False):
        return False
    import torch

    return (
        tensor.device.type == "cpu"
        and not tensor.requires_grad  # distributed autograd needs TensorPipe's tensor table
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.element_size() * tensor.nelement() >= _threshold
    )


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def _new_segment(size: int) -> _Segment | None:
    global _counter, _pool_bytes
    if _pool_bytes + size > _pool_limit:
        return None
    _counter += 1
    name = f"rpcnb-{_group}-{os.getpid()}-{_counter}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, HEADER + size)
        # MAP_POPULATE faults every page in now, once, instead of on each send.
        mm = mmap.mmap(fd, HEADER + size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except OSError:
        os.close(fd)
        _unlink(name)
        return None
    _pool_bytes += size
    return _Segment(name, size, fd, mm)


def _acquire(nbytes: int) -> _Segment | None:
    """A free buffer of at least ``nbytes`` (at most twice that), marked in flight."""
    with _lock:
        best = None
        for seg in _pool:
            if seg.state == FREE and nbytes <= seg.size <= 2 * nbytes:
                if best is None or seg.size < best.size:
                    best = seg
        if best is None:
            size = 1 << max(nbytes - 1, 1).bit_length()  # next power of two
            best = _new_segment(size)
            if best is None:
                return None
            _pool.append(best)
        best.mm[0] = IN_FLIGHT
        return best


def export(tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """Copy ``tensor`` into a pool buffer; the reduce tuple that rebuilds it remotely."""
    import torch

    nbytes = tensor.element_size() * tensor.nelement()
    seg = _acquire(nbytes)
    if seg is None:
        _count("fallbacks")
        return None
    try:
        dst = torch.frombuffer(seg.mm, dtype=tensor.dtype, count=tensor.nelement(),
                               offset=HEADER)
        if tensor.is_contiguous():
            # One plain memmove (GIL released). torch's parallel copy_ is no faster here
            # (memory bound), wakes its thread pool first, and leaves those threads
            # spinning after it, taking the cores the RPC that follows needs.
            ctypes.memmove(dst.data_ptr(), tensor.data_ptr(), nbytes)
        else:
            dst.view(tensor.shape).copy_(tensor)
        del dst
    except Exception:
        seg.mm[0] = FREE
        _count("fallbacks")
        return None
    _count("sent")
    _count("sent_bytes", nbytes)
    return _rebuild, (seg.name, HEADER + seg.size, str(tensor.dtype), tuple(tensor.shape))


def _peer_map(name: str, total: int) -> mmap.mmap:
    with _lock:
        mm = _peer_maps.get(name)
        if mm is None or len(mm) != total:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
            _peer_maps[name] = mm
        return mm


def _release(mm: mmap.mmap) -> None:
    with contextlib.suppress(ValueError):  # already closed
        mm[0] = FREE


def _rebuild(name: str, total: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """On the receiver: a tensor over the sender's buffer, handed back when freed."""
    import torch

    mm = _peer_map(name, total)
    count = 1
    for dim in shape:
        count *= dim
    torch_dtype = getattr(torch, dtype.replace("torch.", ""))
    view = memoryview(mm)[HEADER:HEADER + count * torch_dtype.itemsize]
    weakref.finalize(view, _release, mm)
    tensor = torch.frombuffer(view, dtype=torch_dtype, count=count).view(shape)
    del view  # only the tensor's storage holds it now
    _count("received")
    return tensor


def remove_segments_of(pid: int, group: str | None = None) -> int:
    """Unlink every buffer a (dead) process left in /dev/shm; returns how many."""
    pattern = f"rpcnb-{group or '*'}-{pid}-*"
    found = glob.glob(os.path.join(SHM_DIR, pattern))
    for path in found:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return len(found)


def leftovers(group: str | None = None) -> list[str]:
    """Buffers of ``group`` (or of any rpcnb group) still in /dev/shm."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"rpcnb-{group or '*'}-*")))
