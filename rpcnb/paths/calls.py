"""Around every rpc_sync / rpc_async / remote this process makes (``rpcnb.paths.serialize``
hooks them on install): the call's record in ``rpcnb.telemetry``, the peer its tensors go
to (for the same-host paths), the shared storages it hands over by handle (released when
it completes), and a builtin operator whose tensors would take rpcnb's paths sent as a
Python call of the same operator. It sits on every call a user's code makes, so it does
as little as it can: each microsecond here shows several times over in a round trip
(docs/benchmarks.md)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from rpcnb import telemetry
from rpcnb.errors import WorkerUnreachableError
from rpcnb.paths import shm, zerocopy
from rpcnb.session import state


@dataclass(frozen=True)
class Found:
    """What this module calls of torch (``found``)."""

    tensor: Any  # torch.Tensor
    rref_future: Any  # rpcnb.wire._torch.rref_future
    is_builtin: Any  # rpcnb.wire._torch.is_builtin
    call_instead: Any  # rpcnb.wire._torch.call_instead


@functools.cache
def found() -> Found:
    """``Found``, looked up at the first call: rpcnb.wire._torch imports torch, which this
    module must not do when it is imported (serialize.install imports it from torch's
    import hook)."""
    import torch

    from rpcnb.wire import _torch

    return Found(torch.Tensor, _torch.rref_future, _torch.is_builtin, _torch.call_instead)


@functools.cache
def protocol() -> Any:
    """rpcnb.session.protocol (``send_async``, ``call_async``), imported at the first
    request (it imports torch)."""
    from rpcnb.session import protocol

    return protocol


def record_call(to: Any, func: Any, args: Any, kwargs: Any, send: Any, sync: bool) -> Any:
    """Around every rpc_sync / rpc_async / remote: the call counted in telemetry, and
    timed only while someone looks (``telemetry.timing()``: a channel monitor or the
    JupyterLab panel, or ``RPCNB_CALL_TIMES=1``). An ``rpc_sync`` is timed on the
    caller's thread, in its wait (``_Timed``); an ``rpc_async`` or ``remote`` by a callback
    on TensorPipe's thread when it completes. Storages sent by handle are released once
    the call has completed."""
    peer = to if type(to) is str else str(getattr(to, "name", to))
    s = state.active()
    if s is not None and s.is_unreachable(peer) \
            and getattr(func, "rpcnb_op_index", None) is None:
        # fails now, naming it, instead of after torch's timeout; rpcnb's own requests (the
        # pings that find it back) still go
        raise WorkerUnreachableError(s.unreachable_message(peer), peer)
    if (args or kwargs) and found().is_builtin(func) and _takes_our_paths(args, kwargs):
        # a builtin's tensors go in C++ through TensorPipe: sent as a Python call of the
        # same operator, they take shared memory (or go by handle) as any call's
        result, shared = _sent_to(peer, found().call_instead, send, run_builtin,
                                  (func, tuple(args or ()), dict(kwargs or {})), None)
    else:
        result, shared = _sent_to(peer, send)
    # across hosts, a plain call in flight when its member becomes unreachable fails then,
    # not after torch's timeout (rpcnb's own requests have their own ways: pings, cells)
    watch = s is not None and not s.one_host and getattr(func, "rpcnb_op_index", None) is None
    timing = telemetry.timing()
    if not (shared or watch or timing):
        telemetry.count(peer)
        return result  # most calls: counted, and nothing more to do
    if sync:
        if timing or shared:
            result = _Timed(result, peer, func, args, kwargs, shared, timing)
        else:
            telemetry.count(peer)
        return InFlight(s, peer, result) if watch else result
    is_rref = not hasattr(result, "add_done_callback")
    if watch and not is_rref and not _cuda_route(peer):
        result = InFlight(s, peer, result).future()
    if not (shared or timing):
        telemetry.count(peer)
        return result
    try:
        fut = found().rref_future(result) if is_rref else result
    except Exception:
        return result
    if shared:
        _release_when_done(fut, shared)
    if timing:
        telemetry.watch(fut, peer, ("remote:" if is_rref else "") + _op(func, args),
                        telemetry.tensor_bytes(args, kwargs))
    else:
        telemetry.count(peer)
    return result


def request(token: str, to: str, op: str, args: tuple[Any, ...], timeout: float) -> Any:
    """``protocol.call_async(token, to, op, *args, timeout=timeout)``: the future of rpcnb's
    request ``op`` to ``to``, sent without torch's Python around ``rpc_async`` nor
    ``record_call`` (``protocol.send_async``), doing what ``record_call`` does for an rpcnb
    request: the peer its tensors go to, storages it hands over released once it completes,
    the call counted. ``timeout`` in seconds, 0 for none. A remote cell's request goes this
    way (``rpcnb.cells.call``): on a no-op cell, that Python was 27 of the caller's 73 us
    before the send (docs/benchmarks.md). While calls are timed (``telemetry.timing()``),
    it goes ``call_async``'s way, which times it."""
    requests = protocol()
    if telemetry.timing():
        return requests.call_async(token, to, op, *args, timeout=timeout)
    fut, shared = _sent_to(to, requests.send_async, token, to, op, args, timeout)
    if fut is None:  # no agent (for torch's error), or a torch profiler records RPCs
        return requests.call_async(token, to, op, *args, timeout=timeout)
    telemetry.count(to)
    if shared:
        _release_when_done(fut, shared)
    return fut


def _sent_to(peer: str, send: Any, *args: Any) -> tuple[Any, Any]:
    """``send(*args)`` with ``peer`` as where its tensors go (the same-host paths read it):
    what it returned, and the storages it handed over by handle (None when none), with
    the zero copy that holds them (``Held``)."""
    now = telemetry.SENDING
    old_peer, old_handed = now.peer, now.handed
    now.peer, now.handed = peer, None
    try:
        result = send(*args)
        return result, None if now.handed is None else Held(zerocopy.handles(), now.handed)
    finally:
        now.peer, now.handed = old_peer, old_handed


@dataclass(frozen=True)
class Held:
    """Storages a call handed over by handle, by their keys in the group's zero copy
    that holds them until the call completes (the receiver has mapped them by then)."""

    handles: Any  # zerocopy.Handles of the group the call was made in
    keys: list[int]

    def release(self, _fut: Any = None) -> None:
        if self.handles is not None:
            self.handles.release(self.keys)


def _release_when_done(fut: Any, shared: Held) -> None:
    """Release storages handed over by handle once the call completes."""
    fut.add_done_callback(shared.release)


class InFlight:
    """A plain call to a member on another host, in flight: its wait (``rpc_sync``) or its
    future (``rpc_async``: a future of ours, completed by the call's) ends with
    WorkerUnreachableError as soon as the session marks the member unreachable
    (``Session.mark_unreachable`` calls ``fail``), instead of after torch's timeout. The
    call itself goes on; should an answer come later, it is dropped."""

    __slots__ = ("_s", "_peer", "_inner", "_lock", "_done", "_error", "_out")

    def __init__(self, s: Any, peer: str, inner: Any) -> None:
        import threading

        self._s, self._peer, self._inner = s, peer, inner
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._out: Any = None
        s.watch_call(peer, self)
        raw = inner._fut if isinstance(inner, _Timed) else inner
        raw.add_done_callback(self._completed)
        if s.is_unreachable(peer):  # marked between the send and the watch
            self.fail(WorkerUnreachableError(s.unreachable_message(peer), peer))

    def _completed(self, fut: Any) -> None:
        self._s.unwatch_call(self._peer, self)
        with self._lock:
            if self._done.is_set():
                return  # failed already: the late answer is dropped
            self._done.set()
            out = self._out
        if out is not None:
            try:
                out.set_result(fut.wait())
            except Exception as exc:
                out.set_exception(exc)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            out = self._out
        self._s.unwatch_call(self._peer, self)
        if out is not None:
            out.set_exception(error)

    def wait(self) -> Any:
        """``rpc_sync``'s wait: the call's value, or the error that ended it first."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._inner.wait()

    def future(self) -> Any:
        """For ``rpc_async``: a future completed by the call, or failed by ``fail``."""
        import torch

        out: Any = torch.futures.Future()
        with self._lock:
            self._out = out
            done, error = self._done.is_set(), self._error
        if done:  # completed or failed before the future was asked for
            if error is not None:
                out.set_exception(error)
            else:
                try:
                    out.set_result(self._inner.wait())
                except Exception as exc:
                    out.set_exception(exc)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _cuda_route(peer: str) -> bool:
    """Whether this process maps devices onto ``peer``: its futures carry CUDA streams,
    which a future of ours would not."""
    from rpcnb.wire import _torch

    maps, _devices = _torch.cuda_routes()
    return bool(maps.get(peer))


def run_builtin(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where a builtin operator's call arrives as a Python call: the operator itself."""
    return func(*args, **kwargs)


def _takes_our_paths(args: Any, kwargs: Any) -> bool:
    """Whether a tensor among the arguments (one level deep) would take rpcnb's shared
    memory or go by handle, were the call a Python one."""
    pool = shm.active()
    if pool is None or not pool.open_here():  # neither path is open (zerocopy's needs shm's)
        return False
    handles, tensor = zerocopy.handles(), found().tensor
    for group in (args or (), (kwargs or {}).values()):
        for item in group:
            for t in (item if isinstance(item, (list, tuple)) else (item,)):
                if type(t) is tensor and t.is_cpu and (
                        pool.wants(t) or (handles is not None and handles.can_share(t))):
                    return True
    return False


def _op(func: Any, args: Any) -> str:
    index = getattr(func, "rpcnb_op_index", None)
    if index is not None and isinstance(args, tuple) and len(args) > index:
        return str(args[index])  # rpcnb's own request: named by its operation
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", "call"))


class _Timed:
    """The future of an ``rpc_sync`` call, which ``rpc_sync`` waits on at once: timed (or
    counted), and its shared storages released, in that wait, on the caller's thread. What
    the record says of the call (its name, its bytes) is worked out once it is back."""

    __slots__ = ("_fut", "_peer", "_call", "_shared", "_timed", "_start", "_t0")

    def __init__(self, fut: Any, peer: str, func: Any, args: Any, kwargs: Any,
                 shared: Held | None, timed: bool) -> None:
        self._fut, self._peer, self._call = fut, peer, (func, args, kwargs)
        self._shared, self._timed = shared, timed
        self._start, self._t0 = time.time(), time.perf_counter()

    def wait(self) -> Any:
        ok = False
        try:
            value = self._fut.wait()
            ok = True
            return value
        finally:
            if self._timed:
                took = time.perf_counter() - self._t0
                func, args, kwargs = self._call
                telemetry.record(self._peer, _op(func, args), self._start, took,
                                 telemetry.tensor_bytes(args, kwargs) if args or kwargs else 0,
                                 ok=ok)
            else:
                telemetry.count(self._peer)
            if self._shared is not None:
                self._shared.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fut, name)
