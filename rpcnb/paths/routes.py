"""Which path each tensor in a message takes, as rpcnb's picklers (``rpcnb.paths.serialize``)
meet it: by handle when it is already in shared memory (``rpcnb.paths.zerocopy``), rpcnb's
shared memory in a single-host group (``rpcnb.paths.shm``), UCX where the group asked for
it (``rpcnb.paths.ucx``), else the message's tensor table, which TensorPipe sends with
device maps and all. NumPy, CuPy and other DLPack arrays go as tensors
(``rpcnb.paths.arrays``). It sits on every tensor sent: the tests that tell for most
tensors come first (each frame costs a round trip about a microsecond, right after a
thread's wake-up: docs/benchmarks.md).

The paths of a group are a ``Paths`` its session owns (``Session.paths``): made when a
member starts, opened once torch's agent runs, given back by the session's teardown.

``tensor_at`` and ``rebuild_empty`` are named in messages: members of a group agree on
them through ``rendezvous.PROTOCOL``. Outside a group a tensor in the table is named as
torch's own pickler names it, for a peer that runs torch alone.
"""

from __future__ import annotations

import functools
import math
import pickle
import time
from dataclasses import dataclass
from typing import Any

from rpcnb import telemetry
from rpcnb.paths import arrays, shm, ucx, zerocopy
from rpcnb.session import state


class Paths:
    """The data paths of this process's group, which its session owns (``Session.paths``):
    rpcnb's shared memory (``shm``: a ``shm.Pool`` on one host, else None), zero copy
    (``zero_copy``: a ``zerocopy.Handles``) and UCX (``ucx``: a ``ucx.Link`` where the
    group asked for it, else None).

    Made as the member starts, before torch's agent (``rpcnb.membership.start``), so a
    peer's buffer can be mapped as soon as one arrives; ``activate`` opens what the group
    asked for once the agent runs; the session's teardown gives them back
    (``close_shm``, ``close_ucx``) once the agent has left. ``reduce_tensor`` asks them,
    in that order, for each tensor a message holds."""

    def __init__(self, s: Any) -> None:
        self.shm: shm.Pool | None = shm.Pool(s.group_id) if s.one_host else None
        self.zero_copy = zerocopy.Handles(self.shm, s.rank, s.options.zero_copy)
        self.ucx: ucx.Link | None = None
        # the least threshold of the paths open for sending (set by activate): a smaller
        # tensor (most) goes to the table at once
        self.smallest: float = math.inf

    def activate(self, s: Any, on_full: Any = None) -> None:
        """Open the paths group ``s`` asked for; ``on_full`` hears the first time
        /dev/shm has no room."""
        if self.shm is not None and s.options.shm:
            self.shm.every_second.append(self.zero_copy.trim)  # held replies let go in time
            self.shm.activate(on_full)
            self.smallest = self.shm.threshold
        if s.options.ucx:
            self.ucx = ucx.Link(s)
            self.smallest = min(self.smallest, self.ucx.threshold)

    def close_shm(self) -> None:
        """Give the shared memory back, and zero copy's holds with it."""
        if self.shm is not None:
            self.shm.close()
        self.zero_copy.forget()

    def close_ucx(self) -> None:
        if self.ucx is not None:
            self.ucx.close()


@dataclass(frozen=True)
class Torch:
    """What routes needs of torch, found once it is imported (``found``)."""

    tables: Any  # torch's thread-local RPC tensor tables (send_tables, recv_tables)
    strided: Any  # torch.strided
    receiver: Any  # torch's own name for a tensor in the table


@functools.cache
def found() -> Torch:
    """``Torch``, looked up at the first tensor (this module imports no torch)."""
    import torch

    from rpcnb.wire import _torch

    return Torch(_torch.tensor_tables(), torch.strided, _torch.tensor_receiver())


def reduce_tensor(tensor: Any) -> Any:
    """The first path of this process's group (``Paths``) that takes ``tensor``: by handle
    if it is already in shared memory (``rpcnb.paths.zerocopy``); rpcnb's shared memory in
    a single-host group (``rpcnb.paths.shm``; faster there than UCX, docs/ucx.md); UCX in a
    group that asked for it (``rpcnb.paths.ucx``: CUDA tensors, other hosts, or no room in
    /dev/shm); else TensorPipe's own (the message's tensor table, read back by
    ``tensor_at``)."""
    of_torch = found()
    s = state.active()
    paths: Any = None if s is None else s.paths  # a Paths
    if tensor.is_cpu:
        if paths is not None:
            shared = paths.zero_copy.export(tensor)
            if shared is not None:
                return shared
    elif tensor.layout is of_torch.strided and tensor.data_ptr() == 0:  # a sparse one has no data_ptr
        return _empty_device_tensor(tensor)
    # the paths take dense tensors from their thresholds on (a sparse one has no nbytes)
    if paths is not None and tensor.layout is of_torch.strided \
            and tensor.nbytes >= paths.smallest:
        pool, link = paths.shm, paths.ucx
        if pool is not None and pool.wants(tensor):
            start, t0 = telemetry.now(), time.perf_counter()
            reduced = pool.export(tensor)
            if reduced is not None:
                telemetry.record(telemetry.current_peer(), "tensor", start,
                                 time.perf_counter() - t0,
                                 tensor.element_size() * tensor.nelement(), channel="rpcnb_shm")
                return reduced
        if link is not None and link.wants(tensor):
            reduced = link.export(tensor, s)
            if reduced is not None:
                return reduced
    # torch's own reducer's work: into the table TensorPipe sends with the message, device
    # maps and all; read back by tensor_at in a group (every member has it), else by
    # torch's own receiver (outside a group, the peer may be running torch alone)
    tensors = of_torch.tables.send_tables
    tensors.append(tensor)
    return (of_torch.receiver if s is None else tensor_at), (len(tensors) - 1,)


def tensor_at(index: int) -> Any:
    """Tensor ``index`` of the message being unpickled here: torch's
    ``_InternalRPCPickler._tensor_receiver``, by a shorter reference (a global, where
    torch's is ``getattr`` of a class: less to pickle and to look up, on every tensor).
    Every member of a group has it: they agree on ``rendezvous.PROTOCOL``."""
    return found().tables.recv_tables[index]


def _empty_device_tensor(tensor: Any) -> tuple[Any, tuple[Any, ...]]:
    """An empty CUDA tensor (or CuPy array) owns no memory: TensorPipe's CUDA channels ask
    the driver which device its null pointer is on, and abort the sending process (torch
    2.11-2.14). It travels as its shape and dtype, made empty again on the device the
    device map gives it (the same device for a reply; the host where the receiver lacks it)."""
    from rpcnb.wire import _torch

    device = str(tensor.device)
    peer = telemetry.current_peer()
    if peer:
        device = _torch.cuda_routes()[0].get(peer, {}).get(device, device)
    return rebuild_empty, (tuple(tensor.shape), tensor.dtype, device, tensor.requires_grad)


def rebuild_empty(shape: tuple[int, ...], dtype: Any, device: str, requires_grad: bool) -> Any:
    import torch

    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            device = "cpu"
    return torch.empty(shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def reduce_array(lib: str, array: Any) -> Any:
    reduced = arrays.reduce_array(array, lib, host=not _device_route(array))
    return reduced if reduced is not None else array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _device_route(array: Any) -> bool:
    """Can this array's tensor travel on its device? A CPU one always; a CUDA one when a
    device map takes its device to the peer (for a reply: when the agent has the device),
    as torch requires of a CUDA tensor. Otherwise it goes as a host copy, which the
    receiver's library puts back on its own current device (as CuPy's pickling did)."""
    if arrays.is_host(array):
        return True
    from rpcnb.wire import _torch

    maps, devices = _torch.cuda_routes()
    peer = telemetry.current_peer()
    where = arrays.device(array)
    return where in maps.get(peer, {}) if peer else where in devices
