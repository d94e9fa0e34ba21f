"""Zero-copy for CPU tensors that already live in shared memory, between members on one
host: sent by handle, and the receiver maps the same pages.

A tensor whose storage torch keeps in shared memory (``share_memory_()``, a tensor that
came through a ``torch.multiprocessing`` queue, or one that arrived here this way) is not
copied: only a handle travels (the sender's pid and the storage's file descriptor, or the
file-system strategy's name), and the receiver builds a tensor over the same pages. So is
a tensor over another member's pool buffer (one that arrived by ``rpcnb.paths.shm``'s copy
path) when it is sent on: the receiver maps the buffer too and takes its slot in the
buffer's header (``shm.Pool.map_forwarded``), so the buffer's creator reuses it only when
every holder has let go. The sender marks the buffer in transit in the same header (a
byte of its own, which the receiver clears once it holds the buffer), so nothing is held
for a reply. This
has **sharing semantics**, as ``torch.multiprocessing``'s queues do: a write on either
side is seen by the other, for as long as both hold the tensor (docs/channels.md, "The
shared-memory paths"). Every other large CPU tensor keeps copy semantics (``rpcnb.paths.shm``).

Off per group (``%rpc_init --no-zero-copy``, ``rpcnb.init(zero_copy=False)``,
``RPCNB_ZERO_COPY=0``; ``--no-shm`` turns it off too), per call (``rpcnb.run(...,
zero_copy=False)``, ``%%remote --copy``) and for a block of code (``with
rpcnb.copying():``): the tensor is then copied like any other.

The sender keeps each storage it sent alive until the call it went with has completed
(the receiver has mapped it by then), and a reply's storage for ``RPCNB_ZERO_COPY_HOLD_S``
seconds, so a tensor dropped right after ``rpc_async`` still reaches the receiver. The
receiver checks that the descriptor still names the same file (its inode), so it never
maps anything else. What the group's zero copy holds and counts is a ``Handles`` its
session owns (``Session.paths.zero_copy``), given back with the shared memory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from rpcnb import errors, settings, telemetry
from rpcnb.paths import shm
from rpcnb.session import state

CHANNEL = "zero_copy"  # the path's name in telemetry, the channel monitor and %rpc_channels
STATS = ("sent", "sent_bytes", "received", "received_bytes")


class _Local(threading.local):
    copy = False  # inside copying()


# the process's, one per thread: copying() is a block of a thread's code, in any group
_local = _Local()


class Handles:
    """Zero copy in this process's group (``Session.paths.zero_copy``): the storages it
    holds until their receivers have mapped them (by key), its counts, and whether the
    group (``zero_copy``) and ``RPCNB_ZERO_COPY`` let it send by handle, read as the member
    starts. Made with the group's paths; ``forget`` (the teardown, with the shared memory)
    holds nothing more."""

    def __init__(self, pool: shm.Pool | None, rank: int, group_on: bool) -> None:
        self.pool = pool  # the group's shared memory: zero copy is open only where it is
        self.rank = rank  # this member's: its byte in a forwarded pool buffer's header
        self.on = group_on and settings.flag("RPCNB_ZERO_COPY")
        self.hold_s: float = settings.number("RPCNB_ZERO_COPY_HOLD_S")  # a reply's storage
        self.lock = threading.Lock()
        self.keys = itertools.count(1)
        self.held: dict[int, tuple[Any, float]] = {}  # key -> (storage, monotonic deadline)
        self.counts = dict.fromkeys(STATS, 0)

    def is_on(self) -> bool:
        """Whether this process sends shared tensors by handle now (this thread included)."""
        return self.on and not _local.copy and self.pool is not None and self.pool.open_here()

    def release(self, keys: list[int]) -> None:
        """The call these storages went with has completed: stop holding them."""
        with self.lock:
            for key in keys:
                self.held.pop(key, None)

    def trim(self) -> None:
        """Stop holding storages whose reply had ``hold_s`` seconds to arrive."""
        now = time.monotonic()
        with self.lock:
            for key in [k for k, (_, until) in self.held.items() if until < now]:
                del self.held[key]

    def forget(self) -> None:
        """This process left its group: hold nothing."""
        with self.lock:
            self.held.clear()

    def stats(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts, held=len(self.held))

    def count(self, **more: int) -> None:
        with self.lock:
            for key, n in more.items():
                self.counts[key] += n

    def can_share(self, tensor: Any) -> bool:
        """Whether ``tensor`` is in shared memory that this path could hand over by handle."""
        return (tensor.is_cpu and not tensor.requires_grad and tensor.layout == shm.strided()
                and tensor.untyped_storage().is_shared() and self.is_on())

    def by_handle(self, tensor: Any) -> bool:
        """Whether ``export`` would hand ``tensor`` over by handle (shared memory, or a
        peer's pool buffer), so that its bytes take no time to arrive: a transfer of it
        needs no progress bar, nor the message that starts one."""
        if not getattr(tensor, "is_cpu", False) or tensor.requires_grad \
                or tensor.layout != shm.strided() or tensor.is_quantized:
            return False
        pool = self.pool
        return (tensor.untyped_storage().is_shared()
                or (pool is not None and pool.origin_of(tensor) is not None)) and self.is_on()

    def export(self, tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
        """The reduce tuple that maps ``tensor``'s shared storage on the receiver, or None
        when it is not shared memory this path can hand over (or the path is off)."""
        # the tests that tell first: most tensors are neither shared nor over a peer's pool
        # buffer (this sits on every tensor sent; a tensor's attribute is about 70 ns here);
        # untyped_storage().is_shared() is tensor.is_shared() without its TypedStorage (1.4 us).
        # The layout comes first: a sparse tensor has no storage to ask.
        if not tensor.is_cpu or tensor.layout is not shm.strided():
            return None
        pool = self.pool
        shared = tensor.untyped_storage().is_shared()
        origin = None if shared or pool is None else pool.origin_of(tensor)
        if not (shared or origin) or tensor.requires_grad or tensor.is_quantized \
                or not self.is_on():
            return None
        start, t0 = telemetry.now(), time.perf_counter()
        where = self._where(tensor, shared, origin)
        if where is None:
            return None
        nbytes = tensor.element_size() * tensor.nelement()
        self.count(sent=1, sent_bytes=nbytes)
        telemetry.record(telemetry.current_peer(), "tensor", start, time.perf_counter() - t0,
                         nbytes, channel=CHANNEL)
        return _rebuild, (where, str(tensor.dtype), tensor.storage_offset(),
                          tuple(tensor.shape), tuple(tensor.stride()))

    def _where(self, tensor: Any, shared: bool, origin: Any) -> tuple[Any, ...] | None:
        """The handle the receiver maps ``tensor``'s storage by (held until it has)."""
        from rpcnb.wire import _torch

        handle = _torch.shared_storage_handle(tensor) if shared else None
        if handle is None:
            # a tensor over a peer's pool buffer (it arrived by rpcnb_shm, or so): the
            # buffer's name; the receiver takes a slot in its header, so its creator keeps it
            pool = self.pool
            origin = origin or (pool.origin_of(tensor) if pool is not None else None)
            token = None if origin is None or pool is None \
                else pool.in_transit(origin[0], origin[1], self.rank)
            # a pool buffer is kept by its in-transit byte, not held here
            return None if origin is None or token is None else ("pool", *origin, token)
        if handle[0] == "fd":
            where: tuple[Any, ...] = ("fd", os.getpid(), handle[1],
                                      os.fstat(handle[1]).st_ino, handle[2])
        else:
            where = handle
        key = next(self.keys)
        with self.lock:
            self.held[key] = (tensor.untyped_storage(), time.monotonic() + self.hold_s)
        sending = telemetry.SENDING
        if sending.peer is not None:  # a call (not a reply): released once it completes
            if sending.handed is None:
                sending.handed = []
            sending.handed.append(key)
        return where


def handles() -> Handles | None:
    """Zero copy of this process's group (None: in no group)."""
    s = state.active()
    paths = None if s is None else s.paths
    return None if paths is None else paths.zero_copy


def is_on() -> bool:
    """Whether this process sends shared tensors by handle now (this thread included)."""
    h = handles()
    return h is not None and h.is_on()


@contextlib.contextmanager
def copying() -> Iterator[None]:
    """Inside this block, this thread copies shared tensors too (copy semantics).

    ``with rpcnb.copying():`` every call this thread makes inside the block copies the
    tensors already in shared memory (``share_memory_()``, ``torch.multiprocessing``) that
    it sends, instead of sending them by handle, which shares their pages with the
    receiver. Blocks nest; the setting before the block is back after it.

    Yields:
        None: the block runs with copy semantics.
    """
    old = _local.copy
    _local.copy = True
    try:
        yield
    finally:
        _local.copy = old


def stats() -> dict[str, int]:
    """Tensors (and bytes) sent and received by handle, storages held for calls in flight
    (all 0 outside a group)."""
    h = handles()
    return h.stats() if h is not None else dict.fromkeys((*STATS, "held"), 0)


def can_share(tensor: Any) -> bool:
    """Whether ``tensor`` is in shared memory that this path could hand over by handle."""
    h = handles()
    return h is not None and h.can_share(tensor)


def by_handle(tensor: Any) -> bool:
    """``Handles.by_handle`` of this process's group (False outside one)."""
    h = handles()
    return h is not None and h.by_handle(tensor)


def _rebuild(where: tuple[Any, ...], dtype: str, offset: int, shape: tuple[int, ...],
             stride: tuple[int, ...]) -> Any:
    """On the receiver: a tensor over the sender's shared storage (the same pages)."""
    import torch

    from rpcnb.wire import _torch

    if where[0] == "pool":
        _, name, total, nbytes, token = where
        pool, h = shm.active(), handles()
        try:
            if pool is None or h is None:
                raise OSError(shm.NO_POOL)
            storage = pool.map_forwarded(name, total, nbytes, h.rank, token)
        except (OSError, ValueError) as exc:
            raise RuntimeError(errors.ZERO_COPY_UNREACHABLE.format(
                where=f"buffer {name}", reason=exc)) from None
    elif where[0] == "fd":
        _, pid, fd, ino, size = where
        try:
            local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            raise RuntimeError(errors.ZERO_COPY_UNREACHABLE.format(
                where=f"process {pid}", reason=exc)) from None
        try:
            if os.fstat(local).st_ino != ino:
                raise RuntimeError(errors.ZERO_COPY_UNREACHABLE.format(
                    where=f"process {pid}", reason="the tensor was freed before it arrived"))
            storage = _torch.storage_from_fd(local, size)
        finally:
            os.close(local)
    else:
        _, manager, name, size = where
        try:
            storage = _torch.storage_from_name(manager, name, size)
        except RuntimeError as exc:
            raise RuntimeError(errors.ZERO_COPY_UNREACHABLE.format(
                where=name.decode(errors="replace"), reason=exc)) from None
    torch_dtype = getattr(torch, dtype.replace("torch.", ""))
    tensor = torch.empty(0, dtype=torch_dtype).set_(storage, offset, shape, stride)
    h = handles()
    if h is not None:
        h.count(received=1, received_bytes=tensor.element_size() * tensor.nelement())
    return tensor
