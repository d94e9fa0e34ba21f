"""rpcnb's same-host shared-memory path for large CPU tensors.

When every member of the group runs on this host, a CPU tensor of at least ``threshold``
bytes that rpcnb's pickler meets (call arguments and results, ``--push``, ``--fetch``,
``to_here()``) is copied once into a pre-faulted shared-memory buffer from this
process's pool, and only the buffer's name travels. The receiver maps the buffer and
wraps it as a tensor without copying. The buffer goes back to the sender's pool when the
receiving tensor (and every view of it) is freed, so copy semantics hold: the sender
never writes into a buffer a receiver still sees, and the receiver's writes never reach
the sender's tensor. A receiver that sends such a tensor on hands over the same buffer
(``rpcnb.paths.zerocopy``, ``map_forwarded``): each further holder sets its byte (1 + its rank)
in the header, and the buffer is free only when the whole header is zero.

Tensors that need autograd, CUDA tensors, small tensors and other hosts keep TensorPipe's
path. ``RPCNB_SHM=0`` (or ``%rpc_init --no-shm``) turns the path off.

Every buffer's pages are reserved in /dev/shm when it is made (``posix_fallocate``), and
only when /dev/shm has room for it besides a reserve: a full /dev/shm (a container's 64 MB
default) is a tensor sent over TensorPipe instead, with one warning for the group, never
a SIGBUS on a page that was not there. Buffers idle for ``RPCNB_SHM_IDLE_S`` seconds
(default 30) are given back, on both sides.

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
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rpcnb import settings, text
from rpcnb.machine import SHM_DIR, give_back_memory, shm_free_bytes

HEADER = 4096  # one page: byte 0 is the buffer's state; data starts page-aligned
FREE, IN_FLIGHT = 0, 1
DEFAULT_THRESHOLD = 1 << 20  # 1 MB
DEFAULT_POOL_BYTES = 4 << 30  # at most this much shared memory per process

_lock = threading.RLock()


class _Local(threading.local):
    off = False  # inside suppressed(); a class default: a missing attribute costs 0.5 us

    def __init__(self) -> None:
        # the header bytes set by the messages this thread is pickling, (mapping, byte,
        # bytes copied): a buffer taken, a buffer marked in transit. A serializer notes
        # the length before a message; it calls give_back() with it if the pickling
        # fails (nothing was sent), else drops what is past it
        self.taken: list[tuple[mmap.mmap, int, int]] = []


_local = _Local()
THREAD = _local  # read by rpcnb.paths.serialize for each message with tensors: .taken
_enabled = settings.flag("RPCNB_SHM")
THRESHOLD = settings.number("RPCNB_SHM_THRESHOLD")
_pool_limit = settings.number("RPCNB_SHM_POOL_BYTES")
_idle = settings.number("RPCNB_SHM_IDLE_S")
RESERVE = 16 << 20  # /dev/shm left for everything else when rpcnb makes a buffer
_group: str | None = None  # set while this process is in a single-host group
_stats = {"sent": 0, "sent_bytes": 0, "received": 0, "fallbacks": 0, "trimmed": 0}
_on_full: Any = None  # called once per group with the reason the first time there is no room
_full_reported = False

NO_ROOM = (
    "/dev/shm has {free} free, so a {size} tensor goes over TensorPipe instead of rpcnb's "
    "shared memory (slower). In a container, give it more room: docker run --shm-size=2g, "
    "or mount an emptyDir with medium: Memory at /dev/shm in Kubernetes."
)


@dataclass
class _Segment:
    name: str
    size: int  # data bytes (without the header)
    fd: int
    mm: mmap.mmap
    used: float = 0.0  # time.monotonic() when it was last handed out

    @property
    def state(self) -> int:
        return self.mm[0]

    @property
    def free(self) -> bool:
        """No receiver holds it: neither the first one (byte 0) nor a member it was sent
        on to by handle (byte 1 + that member's rank, ``map_forwarded``)."""
        return self.mm.find(b"\x01", 0, HEADER) < 0


_pool: list[_Segment] = []
_pool_bytes = 0
_counter = 0
_peer_maps: dict[str, tuple[mmap.mmap, float]] = {}  # name -> (mapping, last used)


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


def activate(group: str, on_full: Any = None) -> None:
    """Called when this process joins a single-host group named ``group``; ``on_full``
    hears the first time there is no room in /dev/shm."""
    global _group, _on_full, _full_reported
    _group, _on_full, _full_reported = group, on_full, False
    sweep()
    threading.Thread(target=_trimmer, args=(group,), name="rpcnb-shm-trim", daemon=True).start()


_trim_hooks: list[Any] = []  # also called by the trimmer, every second (rpcnb.paths.zerocopy)
_leave_hooks: list[Any] = []  # also called when this process leaves its group


def on_trim(hook: Any) -> None:
    """Call ``hook()`` every second while this process is in a single-host group."""
    _trim_hooks.append(hook)


def on_deactivate(hook: Any) -> None:
    """Call ``hook()`` when this process leaves its group."""
    _leave_hooks.append(hook)


def _trimmer(group: str) -> None:
    while _group == group:
        time.sleep(1.0)
        if trim(_idle):
            # the tensors those buffers carried were freed with them: large blocks freed
            # by RPC threads stay in glibc's per-thread arenas until trimmed, and a worker
            # that moved a few 100 MB tensors would keep their size for good
            give_back_memory(min_interval=0)
        for hook in _trim_hooks:
            hook()


def trim(idle: float) -> int:
    """Give back buffers (own and mapped from peers) unused for ``idle`` seconds; returns
    how many bytes."""
    global _pool_bytes
    now = time.monotonic()
    freed = 0
    with _lock:
        for seg in list(_pool):
            if seg.free and now - seg.used > idle:
                _pool.remove(seg)
                _pool_bytes -= seg.size
                freed += seg.size
                _unlink(seg.name)
                with contextlib.suppress(OSError):
                    os.close(seg.fd)
                with contextlib.suppress(BufferError, ValueError):
                    seg.mm.close()
        for name, (mm, used) in list(_peer_maps.items()):
            if now - used > idle:
                size = len(mm)
                try:
                    mm.close()  # BufferError while a tensor still uses it: kept
                except BufferError:
                    continue
                del _peer_maps[name]
                freed += size
    if freed:
        _count("trimmed", freed)
    return freed


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
    for hook in _leave_hooks:
        hook()


def _no_room(nbytes: int, free: int) -> None:
    global _full_reported
    _count("fallbacks")
    if _on_full is None or _full_reported:
        return
    _full_reported = True
    # told on a thread of its own: this runs under the pool's lock, and the hook may call
    # another member
    said = NO_ROOM.format(free=text.size(free, "MB", 0), size=text.size(nbytes, "MB", 0))
    threading.Thread(target=_on_full, args=(said,),
                     name="rpcnb-shm-full", daemon=True).start()


def stats() -> dict[str, int]:
    """Counts: tensors sent and received this way, fallbacks, pool size, in flight."""
    with _lock:
        return dict(_stats, pool_bytes=_pool_bytes, buffers=len(_pool),
                    in_flight=sum(not seg.free for seg in _pool),
                    mapped_bytes=sum(len(mm) for mm, _ in _peer_maps.values()))


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Inside this block, this thread's pickling uses TensorPipe's path."""
    old = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = old


def is_suppressed() -> bool:
    """Inside ``suppressed()`` (rpcnb.paths.ucx honours it too)."""
    return _local.off


def open_here() -> bool:
    """May this thread send through rpcnb's shared memory now: on, in a single-host group,
    not inside ``suppressed()``."""
    return _enabled and _group is not None and not _local.off


def wants(tensor: Any) -> bool:
    """Should this tensor take the shared-memory path?"""
    # most tensors are small; a sparse one has no nbytes, and takes no path of ours
    if not open_here() or tensor.layout is not (_STRIDED or strided()) \
            or tensor.nbytes < THRESHOLD:
        return False
    return (
        tensor.is_cpu
        and not tensor.requires_grad  # distributed autograd needs TensorPipe's tensor table
        and not tensor.is_quantized
    )


_STRIDED: Any = None


def strided() -> Any:
    """``torch.strided`` (this module imports no torch until a tensor is asked about)."""
    global _STRIDED
    if _STRIDED is None:
        import torch

        _STRIDED = torch.strided
    return _STRIDED


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def _new_segment(size: int, nbytes: int) -> _Segment | None:
    """A buffer of ``size`` data bytes whose pages are reserved in /dev/shm now (None
    when they cannot be: over the pool's limit, or no room)."""
    global _counter, _pool_bytes
    if _pool_bytes + size > _pool_limit:
        return None
    free = shm_free_bytes(SHM_DIR)
    if HEADER + size > free - RESERVE:
        _no_room(nbytes, free)
        return None
    _counter += 1
    name = f"rpcnb-{_group}-{os.getpid()}-{_counter}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve every page now: tmpfs fails here with ENOSPC when it is full, instead
        # of raising SIGBUS later at a write into a page it cannot back.
        os.posix_fallocate(fd, 0, HEADER + size)
        # MAP_POPULATE faults every page in now, once, instead of on each send.
        mm = mmap.mmap(fd, HEADER + size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except OSError:
        os.close(fd)
        _unlink(name)
        _no_room(nbytes, shm_free_bytes(SHM_DIR))
        return None
    _pool_bytes += size
    return _Segment(name, size, fd, mm)


def _acquire(nbytes: int) -> _Segment | None:
    """A free buffer of at least ``nbytes`` (at most twice that), marked in flight."""
    with _lock:
        best = None
        for seg in _pool:
            if seg.free and nbytes <= seg.size <= 2 * nbytes:
                if best is None or seg.size < best.size:
                    best = seg
        if best is None:
            size = 1 << max(nbytes - 1, 1).bit_length()  # next power of two
            best = _new_segment(size, nbytes)
            if best is None:
                return None
            _pool.append(best)
        best.mm[0] = IN_FLIGHT
        _local.taken.append((best.mm, 0, 0))  # at once: an interrupt in the copy gives it back
        best.used = time.monotonic()
        return best


COPY_CHUNK = 8 << 20  # bytes below which one memmove is as fast as several
_copiers: Any = None  # a thread pool for large copies, made at the first one


def _forget_copiers() -> None:
    global _copiers
    _copiers = None  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_copiers)


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """memmove ``nbytes`` from address ``src`` to ``dst``, split over up to 4 threads
    (this one and a small pool of rpcnb's own, ``rpcnb-copy``) when the copy is large
    and this process may use several cores: one thread's memmove does not reach the
    memory bandwidth a core pair has (15.5 against 8 ms for 100 MB on the 2-core
    reference machine). ctypes releases the GIL for each part. Torch's own parallel copy
    would start its intra-op thread pool in a process that had none, and leaves those
    threads spinning after each copy."""
    global _copiers
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    parts = min(4, cores, nbytes // COPY_CHUNK)
    if parts < 2:
        ctypes.memmove(dst, src, nbytes)
        return
    if _copiers is None:
        from concurrent.futures import ThreadPoolExecutor

        _copiers = ThreadPoolExecutor(max_workers=3, thread_name_prefix="rpcnb-copy")
    step = -(-nbytes // parts) + 63 & ~63  # parts on cache-line bounds
    spans = [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]
    others = [_copiers.submit(ctypes.memmove, dst + off, src + off, n) for off, n in spans[1:]]
    ctypes.memmove(dst, src, spans[0][1])
    stopped = None
    for fut in others:  # an interrupt waits for them too: none writes after this returns
        while True:
            try:
                fut.result()
                break
            except KeyboardInterrupt as exc:
                stopped = exc
    if stopped is not None:
        raise stopped


def export(tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """Copy ``tensor`` into a pool buffer; the reduce tuple that rebuilds it remotely."""
    import torch

    nbytes = tensor.element_size() * tensor.nelement()
    seg = _acquire(nbytes)
    if seg is None:
        return None
    try:
        dst = torch.frombuffer(seg.mm, dtype=tensor.dtype, count=tensor.nelement(),
                               offset=HEADER)
        if tensor.is_contiguous():
            # memmove in parallel parts, GIL released (copy_bytes says why not torch's
            # copy_)
            copy_bytes(dst.data_ptr(), tensor.data_ptr(), nbytes)
        else:
            dst.view(tensor.shape).copy_(tensor)
        del dst
    except Exception:
        seg.mm[0] = FREE
        _local.taken.pop()  # _acquire's record
        _count("fallbacks")
        return None
    _count("sent")
    _count("sent_bytes", nbytes)
    _local.taken[-1] = (seg.mm, 0, nbytes)  # give_back takes the counts back too
    return _rebuild, (seg.name, HEADER + seg.size, str(tensor.dtype), tuple(tensor.shape))


def give_back(mark: int) -> None:
    """The message pickled since ``THREAD.taken`` had ``mark`` entries was never sent (its
    pickling failed): the buffers it took are free again, and those it marked in transit
    are not."""
    records = _local.taken
    with _lock:
        while len(records) > mark:
            mm, pos, nbytes = records.pop()
            with contextlib.suppress(ValueError):  # a peer's buffer, unmapped since
                mm[pos] = FREE
            if nbytes:
                _stats["sent"] -= 1
                _stats["sent_bytes"] -= nbytes


def _peer_map(name: str, total: int) -> mmap.mmap:
    with _lock:
        known = _peer_maps.get(name)
        mm = known[0] if known is not None else None
        if mm is None or mm.closed or len(mm) != total:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
        _peer_maps[name] = (mm, time.monotonic())
        return mm


# Tensors here over peers' buffers, by their storage's address: (buffer name, mapping
# size). rpcnb.paths.zerocopy sends such a tensor on by handle instead of copying it again.
_origins: dict[int, tuple[str, int]] = {}
_forwarded: dict[str, int] = {}  # buffer name -> tensors here that hold it by a slot


def _release(mm: mmap.mmap, ptr: int = 0) -> None:
    with _lock:
        _origins.pop(ptr, None)
    with contextlib.suppress(ValueError):  # already closed
        mm[0] = FREE


def origin_of(tensor: Any) -> tuple[str, int, int] | None:
    """(buffer name, mapping size, storage bytes) when ``tensor``'s storage is a peer's
    pool buffer mapped here; None otherwise."""
    if not _origins:  # nothing mapped from a peer: the common case, without the lock
        return None
    storage = tensor.untyped_storage()
    with _lock:
        found = _origins.get(storage.data_ptr())
    return None if found is None else (found[0], found[1], storage.nbytes())


# The header's bytes: 0 the first receiver's; 1 + rank a member holding the buffer sent on
# to it; from TOKENS_AT, TOKENS per rank: that member's sends of it still in transit.
TOKENS_AT = 2048
TOKENS = 4
SLOTS = TOKENS_AT - 1  # members of rank 0 .. SLOTS-1 can hold a buffer sent on by handle


def in_transit(name: str, total: int, rank: int) -> int | None:
    """Mark a peer's buffer (mapped here) as being sent on by the member of ``rank``; the
    header byte to pass to the receiver, which clears it once it holds the buffer. None
    when this member has ``TOKENS`` sends of it in transit already (then copy it)."""
    if not 0 <= rank < (HEADER - TOKENS_AT) // TOKENS:
        return None
    with _lock:
        known = _peer_maps.get(name)
        if known is None or known[0].closed:
            return None
        mm = known[0]
        for pos in range(TOKENS_AT + rank * TOKENS, TOKENS_AT + (rank + 1) * TOKENS):
            if mm[pos] == 0:  # only this member sets its bytes; receivers clear them
                _local.taken.append((mm, pos, 0))  # first: an interrupt between the two
                mm[pos] = 1                         # leaves a record of a byte still 0
                return pos
    return None


def map_forwarded(name: str, total: int, nbytes: int, slot: int, token: int) -> Any:
    """A storage over a peer's pool buffer that another member sent on by handle: this
    process's byte in the header (``1 + slot``, its rank) says it holds the buffer, so its
    creator does not reuse it until every tensor here over it is freed; then the sender's
    in-transit byte ``token`` is cleared."""
    import torch

    if not 0 <= slot < SLOTS:
        raise ValueError(f"rank {slot} has no slot in a shared-memory buffer's header")
    mm = _peer_map(name, total)
    with _lock:
        _forwarded[name] = _forwarded.get(name, 0) + 1
        mm[1 + slot] = 1
        mm[token] = 0
    view = memoryview(mm)[HEADER:HEADER + nbytes]
    raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
    ptr = raw.untyped_storage().data_ptr()
    with _lock:
        _origins[ptr] = (name, total)
    weakref.finalize(view, _unhold, name, mm, slot, ptr)
    del view
    _count("received")
    return raw.untyped_storage()


def _unhold(name: str, mm: mmap.mmap, slot: int, ptr: int) -> None:
    with _lock:
        _origins.pop(ptr, None)
        left = _forwarded.get(name, 0) - 1
        if left > 0:
            _forwarded[name] = left
            return
        _forwarded.pop(name, None)
        with contextlib.suppress(ValueError):
            mm[1 + slot] = 0


def _rebuild(name: str, total: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """On the receiver: a tensor over the sender's buffer, handed back when freed."""
    import torch

    mm = _peer_map(name, total)
    count = 1
    for dim in shape:
        count *= dim
    torch_dtype = getattr(torch, dtype.replace("torch.", ""))
    view = memoryview(mm)[HEADER:HEADER + count * torch_dtype.itemsize]
    tensor = torch.frombuffer(view, dtype=torch_dtype, count=count).view(shape)
    ptr = tensor.untyped_storage().data_ptr()
    with _lock:
        _origins[ptr] = (name, total)
    weakref.finalize(view, _release, mm, ptr)
    del view  # only the tensor's storage holds it now
    _count("received")
    return tensor


def remove_segments_of(pid: int, group: str | None = None) -> int:
    """Unlink every buffer a (dead) process left in /dev/shm; returns how many. Once it
    has exited, that includes the files torch.multiprocessing's file-system strategy made
    for it (``torch_<pid>_*``): its torch_shm_manager, which would unlink them, is
    stopped with it. Processes that mapped them keep their pages."""
    pattern = f"rpcnb-{group or '*'}-{pid}-*"
    found = glob.glob(os.path.join(SHM_DIR, pattern))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        found += [path for path in glob.glob(os.path.join(SHM_DIR, f"torch_{pid}_*"))
                  if _owned(path)]
    except PermissionError:
        pass
    for path in found:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return len(found)


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except OSError:
        return False


def leftovers(group: str | None = None) -> list[str]:
    """Buffers of ``group`` (or of any rpcnb group) still in /dev/shm."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"rpcnb-{group or '*'}-*")))
