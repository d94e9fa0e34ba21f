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

The group's buffers, stats and peers' mappings are a ``Pool`` its session owns
(``Session.paths.shm``). Buffers are files in /dev/shm named ``rpcnb-<group>-<pid>-<n>``;
their creator unlinks them when it leaves, and the group's first kernel removes a dead
member's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rpcnb import settings, text
from rpcnb.machine import SHM_DIR, give_back_memory, shm_free_bytes
from rpcnb.session import state

HEADER = 4096  # one page: byte 0 is the buffer's state; data starts page-aligned
FREE, IN_FLIGHT = 0, 1
DEFAULT_THRESHOLD = 1 << 20  # 1 MB
DEFAULT_POOL_BYTES = 4 << 30  # at most this much shared memory per process
RESERVE = 16 << 20  # /dev/shm left for everything else when rpcnb makes a buffer
COUNTS = ("sent", "sent_bytes", "received", "fallbacks", "trimmed")
STATS = (*COUNTS, "pool_bytes", "buffers", "in_flight", "mapped_bytes")  # Pool.stats()'s keys

NO_ROOM = (
    "/dev/shm has {free} free, so a {size} tensor goes over TensorPipe instead of rpcnb's "
    "shared memory (slower). In a container, give it more room: docker run --shm-size=2g, "
    "or mount an emptyDir with medium: Memory at /dev/shm in Kubernetes."
)


class _Local(threading.local):
    off = False  # inside suppressed(); a class default: a missing attribute costs 0.5 us

    def __init__(self) -> None:
        # the header bytes set by the messages this thread is pickling, (mapping, byte,
        # bytes copied): a buffer taken, a buffer marked in transit. A serializer notes
        # the length before a message; it calls give_back() with it if the pickling
        # fails (nothing was sent), else drops what is past it
        self.taken: list[tuple[mmap.mmap, int, int]] = []


# the process's, one per thread (as a message's pickling is): read by rpcnb.paths.serialize
# for each message with tensors (.taken), whichever group the process is in
THREAD = _Local()


@dataclass
class _Segment:
    name: str
    size: int  # data bytes (without the header)
    fd: int
    mm: mmap.mmap
    used: float = 0.0  # time.monotonic() when it was last handed out

    @property
    def free(self) -> bool:
        """No receiver holds it: not the first (byte 0), nor one it went on to (1 + rank)."""
        return self.mm.find(b"\x01", 0, HEADER) < 0


class Pool:
    """The shared-memory path of this process's group (``Session.paths.shm``): the buffers
    it sends from, their stats, the peers' buffers it mapped, its ``RPCNB_SHM`` settings,
    read as the member starts. Made for a group on one host (peers' buffers can arrive);
    ``activate`` opens it for sending; ``close`` (the teardown, once torch's agent has
    left) gives it back. RPC threads send and receive at once: it changes under ``lock``."""

    def __init__(self, group: str) -> None:
        self.group = group  # in the buffers' names
        self.enabled: bool = settings.flag("RPCNB_SHM")  # this member sends this way
        self.threshold: int = settings.number("RPCNB_SHM_THRESHOLD")  # bytes, from which
        self.limit: int = settings.number("RPCNB_SHM_POOL_BYTES")  # of buffers, at most
        self.idle: float = settings.number("RPCNB_SHM_IDLE_S")  # seconds, then given back
        self.active = False  # opened for sending (activate), not closed since
        self.on_full: Any = None  # told once, the first time /dev/shm has no room
        self.full_reported = False
        self.every_second: list[Callable[[], object]] = []  # also run by the trimmer
        self.lock = threading.RLock()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.buffers: list[_Segment] = []
        self.pool_bytes = 0
        self.made = 0  # buffers made so far (their names count them)
        self.peer_maps: dict[str, tuple[mmap.mmap, float]] = {}  # name -> (mapping, used)
        # tensors here over peers' buffers, by their storage's address: (buffer name,
        # mapping size); rpcnb.paths.zerocopy sends such a tensor on by handle
        self.origins: dict[int, tuple[str, int]] = {}
        self.forwarded: dict[str, int] = {}  # buffer name -> tensors here holding a slot

    def activate(self, on_full: Any = None) -> None:
        """Open the path for sending (this member joined a single-host group with it on):
        ``on_full`` hears the first time there is no room in /dev/shm."""
        self.on_full, self.full_reported, self.active = on_full, False, True
        sweep()
        threading.Thread(target=self._trimmer, name="rpcnb-shm-trim", daemon=True).start()

    def close(self) -> None:
        """This process leaves: unlink its buffers, forget peers' mappings."""
        self.active = False
        with self.lock:
            for seg in self.buffers:
                _unlink(seg.name)
                with contextlib.suppress(OSError):
                    os.close(seg.fd)
            # Mappings stay valid for tensors still alive; they are unmapped when freed.
            self.buffers.clear()
            self.pool_bytes = 0
            self.peer_maps.clear()

    def _trimmer(self) -> None:
        while self.active:
            time.sleep(1.0)
            if self.trim(self.idle):
                # the tensors those buffers carried were freed with them: large blocks freed
                # by RPC threads stay in glibc's per-thread arenas until trimmed, and a worker
                # that moved a few 100 MB tensors would keep their size for good
                give_back_memory()
            for hook in self.every_second:
                hook()

    def trim(self, idle: float) -> int:
        """Give back buffers (own and mapped from peers) unused for ``idle`` seconds;
        returns how many bytes."""
        now = time.monotonic()
        freed = 0
        with self.lock:
            for seg in [s for s in self.buffers if s.free and now - s.used > idle]:
                self.buffers.remove(seg)
                self.pool_bytes -= seg.size
                freed += seg.size
                _unlink(seg.name)
                with contextlib.suppress(OSError):
                    os.close(seg.fd)
                with contextlib.suppress(BufferError, ValueError):
                    seg.mm.close()
            for name, (mm, used) in list(self.peer_maps.items()):
                if now - used > idle:
                    size = len(mm)
                    try:
                        mm.close()  # BufferError while a tensor still uses it: kept
                    except BufferError:
                        continue
                    del self.peer_maps[name]
                    freed += size
        if freed:
            self.count("trimmed", freed)
        return freed

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:  # counters are bumped from several RPC threads at once
            self.counts[key] += n

    def stats(self) -> dict[str, int]:
        """Counts: tensors sent and received this way, fallbacks, pool size, in flight."""
        with self.lock:
            return dict(self.counts, pool_bytes=self.pool_bytes, buffers=len(self.buffers),
                        in_flight=sum(not seg.free for seg in self.buffers),
                        mapped_bytes=sum(len(mm) for mm, _ in self.peer_maps.values()))

    def open_here(self) -> bool:
        """May this thread send this way now: opened, on, not inside ``suppressed()``."""
        return self.active and self.enabled and not THREAD.off

    def wants(self, tensor: Any) -> bool:
        """Should this tensor take the shared-memory path?"""
        # most tensors are small; a sparse one has no nbytes, and takes no path of ours
        if not (self.active and self.enabled) or THREAD.off \
                or tensor.layout is not strided() or tensor.nbytes < self.threshold:
            return False
        return (
            tensor.is_cpu
            and not tensor.requires_grad  # distributed autograd needs TensorPipe's tensor table
            and not tensor.is_quantized
        )

    def _no_room(self, nbytes: int, free: int) -> None:
        self.count("fallbacks")
        if self.on_full is None or self.full_reported:
            return
        self.full_reported = True
        # told on a thread of its own: this runs under the pool's lock, and the hook may
        # call another member
        said = NO_ROOM.format(free=text.size(free, "MB", 0), size=text.size(nbytes, "MB", 0))
        threading.Thread(target=self.on_full, args=(said,),
                         name="rpcnb-shm-full", daemon=True).start()

    def _new_segment(self, size: int, nbytes: int) -> _Segment | None:
        """A buffer of ``size`` data bytes, its pages reserved in /dev/shm now (None when
        they cannot be: over the pool's limit, or no room). Under ``lock``."""
        if self.pool_bytes + size > self.limit:
            return None
        free = shm_free_bytes(SHM_DIR)
        if HEADER + size > free - RESERVE:
            self._no_room(nbytes, free)
            return None
        self.made += 1
        name = f"rpcnb-{self.group}-{os.getpid()}-{self.made}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve every page now: tmpfs fails here with ENOSPC when it is full, instead
            # of raising SIGBUS later at a write into a page it cannot back.
            os.posix_fallocate(fd, 0, HEADER + size)
            # MAP_POPULATE faults every page in now, once, instead of on each send.
            mm = mmap.mmap(fd, HEADER + size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError:
            os.close(fd)
            _unlink(name)
            self._no_room(nbytes, shm_free_bytes(SHM_DIR))
            return None
        self.pool_bytes += size
        return _Segment(name, size, fd, mm)

    def _acquire(self, nbytes: int) -> _Segment | None:
        """A free buffer of at least ``nbytes`` (at most twice that), marked in flight."""
        with self.lock:
            best = None
            for seg in self.buffers:
                if seg.free and nbytes <= seg.size <= 2 * nbytes:
                    if best is None or seg.size < best.size:
                        best = seg
            if best is None:
                size = 1 << max(nbytes - 1, 1).bit_length()  # next power of two
                best = self._new_segment(size, nbytes)
                if best is None:
                    return None
                self.buffers.append(best)
            best.mm[0] = IN_FLIGHT
            THREAD.taken.append((best.mm, 0, 0))  # at once: an interrupt in the copy gives it back
            best.used = time.monotonic()
            return best

    def export(self, tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
        """Copy ``tensor`` into a pool buffer; the reduce tuple that rebuilds it remotely."""
        import torch

        nbytes = tensor.element_size() * tensor.nelement()
        seg = self._acquire(nbytes)
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
            THREAD.taken.pop()  # _acquire's record
            self.count("fallbacks")
            return None
        self.count("sent")
        self.count("sent_bytes", nbytes)
        THREAD.taken[-1] = (seg.mm, 0, nbytes)  # give_back takes the counts back too
        return _rebuild, (seg.name, HEADER + seg.size, str(tensor.dtype), tuple(tensor.shape))

    def peer_map(self, name: str, total: int) -> mmap.mmap:
        """A peer's buffer ``name`` of ``total`` bytes, mapped here (once)."""
        with self.lock:
            known = self.peer_maps.get(name)
            mm = known[0] if known is not None else None
            if mm is None or mm.closed or len(mm) != total:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                finally:
                    os.close(fd)
            self.peer_maps[name] = (mm, time.monotonic())
            return mm

    def origin_of(self, tensor: Any) -> tuple[str, int, int] | None:
        """(buffer name, mapping size, storage bytes) when ``tensor``'s storage is a peer's
        pool buffer mapped here; None otherwise."""
        if not self.origins:  # nothing mapped from a peer: the common case, without the lock
            return None
        storage = tensor.untyped_storage()
        with self.lock:
            found = self.origins.get(storage.data_ptr())
        return None if found is None else (found[0], found[1], storage.nbytes())

    def in_transit(self, name: str, total: int, rank: int) -> int | None:
        """Mark a peer's buffer (mapped here) as sent on by the member of ``rank``: the
        header byte for the receiver to clear once it holds the buffer; None when this
        member has ``TOKENS`` sends of it in transit already (then copy it)."""
        if not 0 <= rank < (HEADER - TOKENS_AT) // TOKENS:
            return None
        with self.lock:
            known = self.peer_maps.get(name)
            if known is None or known[0].closed:
                return None
            mm = known[0]
            for pos in range(TOKENS_AT + rank * TOKENS, TOKENS_AT + (rank + 1) * TOKENS):
                if mm[pos] == 0:  # only this member sets its bytes; receivers clear them
                    THREAD.taken.append((mm, pos, 0))  # first: an interrupt between the two
                    mm[pos] = 1                         # leaves a record of a byte still 0
                    return pos
        return None

    def map_forwarded(self, name: str, total: int, nbytes: int, slot: int, token: int) -> Any:
        """A storage over a peer's pool buffer another member sent on by handle: this
        process's header byte (``1 + slot``, its rank) holds the buffer until every tensor
        here over it is freed; the sender's in-transit byte ``token`` is cleared."""
        import torch

        if not 0 <= slot < SLOTS:
            raise ValueError(f"rank {slot} has no slot in a shared-memory buffer's header")
        mm = self.peer_map(name, total)
        with self.lock:
            self.forwarded[name] = self.forwarded.get(name, 0) + 1
            mm[1 + slot] = 1
            mm[token] = 0
        view = memoryview(mm)[HEADER:HEADER + nbytes]
        raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
        ptr = raw.untyped_storage().data_ptr()
        with self.lock:
            self.origins[ptr] = (name, total)
        weakref.finalize(view, self._unhold, name, mm, slot, ptr)
        del view
        self.count("received")
        return raw.untyped_storage()

    def _unhold(self, name: str, mm: mmap.mmap, slot: int, ptr: int) -> None:
        with self.lock:
            self.origins.pop(ptr, None)
            left = self.forwarded.get(name, 0) - 1
            if left > 0:
                self.forwarded[name] = left
                return
            self.forwarded.pop(name, None)
            with contextlib.suppress(ValueError):
                mm[1 + slot] = 0

    def rebuild(self, name: str, total: int, dtype: str, shape: tuple[int, ...]) -> Any:
        """On the receiver: a tensor over the sender's buffer, handed back when freed."""
        import torch

        mm = self.peer_map(name, total)
        count = math.prod(shape)
        torch_dtype = getattr(torch, dtype.replace("torch.", ""))
        view = memoryview(mm)[HEADER:HEADER + count * torch_dtype.itemsize]
        tensor = torch.frombuffer(view, dtype=torch_dtype, count=count).view(shape)
        ptr = tensor.untyped_storage().data_ptr()
        with self.lock:
            self.origins[ptr] = (name, total)
        weakref.finalize(view, self._release, mm, ptr)
        del view  # only the tensor's storage holds it now
        self.count("received")
        return tensor

    def _release(self, mm: mmap.mmap, ptr: int = 0) -> None:
        with self.lock:
            self.origins.pop(ptr, None)
        with contextlib.suppress(ValueError):  # already closed
            mm[0] = FREE


def active() -> Pool | None:
    """The pool of this process's group (None: in no group, or in one across hosts)."""
    s = state.active()
    paths = None if s is None else s.paths
    return None if paths is None else paths.shm


def set_enabled(flag: bool) -> None:
    """Turn the path on or off in this process's group (the sender decides; the next
    group reads ``RPCNB_SHM`` again)."""
    pool = active()
    if pool is not None:
        pool.enabled = bool(flag)


def is_enabled() -> bool:
    """Whether this process sends through shared memory when it can."""
    pool = active()
    return pool.enabled if pool is not None else settings.flag("RPCNB_SHM")


def is_active() -> bool:
    """On, and this process is in a group whose members all run on this host."""
    pool = active()
    return pool is not None and pool.active and pool.enabled


def deactivate() -> None:
    """Give this process's buffers back now (a worker whose kernel died)."""
    pool = active()
    if pool is not None:
        pool.close()


def stats() -> dict[str, int]:
    """The group's ``Pool.stats()`` (all 0 outside a single-host group)."""
    pool = active()
    return pool.stats() if pool is not None else dict.fromkeys(STATS, 0)


def open_here() -> bool:
    """May this thread send through rpcnb's shared memory now (``Pool.open_here``)."""
    pool = active()
    return pool is not None and pool.open_here()


def wants(tensor: Any) -> bool:
    """Should this tensor take the shared-memory path?"""
    pool = active()
    return pool is not None and pool.wants(tensor)


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Inside this block, this thread's pickling uses TensorPipe's path."""
    old = THREAD.off
    THREAD.off = True
    try:
        yield
    finally:
        THREAD.off = old


@functools.cache
def strided() -> Any:
    """``torch.strided`` (this module imports no torch until a tensor is asked about)."""
    import torch

    return torch.strided


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


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


COPY_CHUNK = 8 << 20  # bytes below which one memmove is as fast as several


@functools.cache
def _copiers() -> Any:
    """A thread pool for large copies, made at the first one."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=3, thread_name_prefix="rpcnb-copy")


os.register_at_fork(after_in_child=_copiers.cache_clear)  # a child has none of its threads


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """memmove ``nbytes`` from address ``src`` to ``dst``, split over up to 4 threads
    (this one and a small pool of rpcnb's own, ``rpcnb-copy``) when the copy is large
    and this process may use several cores: one thread's memmove does not reach the
    memory bandwidth a core pair has (15.5 against 8 ms for 100 MB on the 2-core
    reference machine). ctypes releases the GIL for each part. Torch's own parallel copy
    would start its intra-op thread pool in a process that had none, and leaves those
    threads spinning after each copy."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    parts = min(4, cores, nbytes // COPY_CHUNK)
    if parts < 2:
        ctypes.memmove(dst, src, nbytes)
        return
    step = -(-nbytes // parts) + 63 & ~63  # parts on cache-line bounds
    spans = [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]
    copiers = _copiers()
    others = [copiers.submit(ctypes.memmove, dst + off, src + off, n) for off, n in spans[1:]]
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


def give_back(mark: int) -> None:
    """The message pickled since ``THREAD.taken`` had ``mark`` entries was never sent (its
    pickling failed): the buffers it took are free again, and those it marked in transit
    are not."""
    records = THREAD.taken
    pool = active()  # the message was pickled in this group: its pool took them
    with pool.lock if pool is not None else contextlib.nullcontext():
        while len(records) > mark:
            mm, pos, nbytes = records.pop()
            with contextlib.suppress(ValueError):  # a peer's buffer, unmapped since
                mm[pos] = FREE
            if nbytes and pool is not None:
                pool.counts["sent"] -= 1
                pool.counts["sent_bytes"] -= nbytes


# The header's bytes: 0 the first receiver's; 1 + rank a member holding the buffer sent on
# to it; from TOKENS_AT, TOKENS per rank: that member's sends of it still in transit.
TOKENS_AT = 2048
TOKENS = 4
SLOTS = TOKENS_AT - 1  # members of rank 0 .. SLOTS-1 can hold a buffer sent on by handle


NO_POOL = "this process is in no single-host group: it maps no peer's buffer"


def _rebuild(name: str, total: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """On the receiver: ``Pool.rebuild`` of this process's group (the name messages carry)."""
    pool = active()
    if pool is None:
        raise OSError(NO_POOL)
    return pool.rebuild(name, total, dtype, shape)


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
