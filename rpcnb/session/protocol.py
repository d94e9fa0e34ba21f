"""How members ask each other for things.

Every rpcnb request between members is one torch RPC to ``entry(token, op, args)``:
``entry`` checks the group token first, then runs the operation ``op`` from the table
that ``rpcnb.membership.handlers`` fills (all of rpcnb's operations are listed there, and nowhere
else). ``call``, ``call_async``, ``send_async`` and ``remote`` send such requests.

A request that carries a payload says its size (``nbytes``): its time limit grows with it
(``rpcnb.wire.limits``), so a large one over a slow link is not cut off at the limit of a
small one.

``entry`` is ``async_execution``: an operation that waits (a remote cell) returns a torch
Future and frees torch's RPC thread at once; the others return a value, handed back in a
finished Future. An exception raised by an operation reaches the caller as torch raises
any remote exception.

Importing this module imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from rpcnb.session import state
from rpcnb.wire import _torch

UNKNOWN_OP = "rpcnb has no operation {op!r} here: is this member's rpcnb the same version?"
NOT_SERVING = "this process answers no rpcnb requests (rpcnb.membership.handlers is not installed)"

# the operations this process answers, ``{name: handler(session, *args)}``: the process's,
# the same in each of its groups, given once by rpcnb.membership.handlers (``serve``)
_ops: dict[str, Callable[..., Any]] = {}


def serve(ops: dict[str, Callable[..., Any]]) -> None:
    """Answer requests with ``ops`` (``{name: handler(session, *args)}``)."""
    _ops.update(ops)


def operations() -> list[str]:
    """The names of the operations this process answers."""
    return sorted(_ops)


@rpc.functions.async_execution
def entry(token: Any, op: Any, args: Any) -> torch.futures.Future:
    """The one torch RPC target of rpcnb: token first, then the operation."""
    s = state.verified(token)
    if not _ops:
        raise RuntimeError(NOT_SERVING)
    handler = _ops.get(op) if isinstance(op, str) else None
    if handler is None:
        raise RuntimeError(UNKNOWN_OP.format(op=op))
    result = handler(s, *args)
    if isinstance(result, torch.futures.Future):
        return result
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(result)
    return done


# telemetry names a call to ``entry`` by its operation (the second argument), not "entry"
entry.rpcnb_op_index = 1  # type: ignore[attr-defined]


def _timeout(timeout: float | None, nbytes: int) -> float:
    if timeout is not None and nbytes <= 0:  # most requests: the limit they name
        return timeout
    if nbytes > 0:
        from rpcnb.wire import limits

        return limits.grown(rpc.get_rpc_timeout() if timeout is None else timeout, nbytes)
    return _torch.UNSET_RPC_TIMEOUT if timeout is None else timeout


def call(token: str, to: str, op: str, *args: Any, timeout: float | None = 5.0,
         nbytes: int = 0) -> Any:
    """Ask member ``to`` to run ``op(*args)`` and wait for the answer (``timeout`` in
    seconds; None: the group's RPC timeout; 0: none); a request that carries ``nbytes``
    bytes gets the time they take at the floor rate on top (``rpcnb.wire.limits``)."""
    return rpc.rpc_sync(to, entry, args=(token, op, args), timeout=_timeout(timeout, nbytes))


def call_async(token: str, to: str, op: str, *args: Any, timeout: float | None = 5.0,
               nbytes: int = 0) -> torch.futures.Future:
    """``call`` without waiting: a torch Future of the answer."""
    return rpc.rpc_async(to, entry, args=(token, op, args), timeout=_timeout(timeout, nbytes))


def ask_each(token: str, names: list[str], op: str, *args: Any,
             timeout: float | None = 5.0) -> dict[str, torch.futures.Future]:
    """``op`` sent to each of ``names`` at once: the futures by name. A member it could not
    be sent to (one that left meanwhile) is left out."""
    futures = {}
    for name in names:
        try:
            futures[name] = call_async(token, name, op, *args, timeout=timeout)
        except Exception:
            pass
    return futures


def send_async(token: str, to: str, op: str, args: tuple[Any, ...],
               timeout: float) -> torch.futures.Future | None:
    """``call_async(token, to, op, *args, timeout=timeout)`` without torch's Python around
    ``rpc_async`` (``wire._torch.send_python_call``), or None where that Python has work to
    do (no agent; a torch profiler on): then ``call_async`` is the way. ``timeout`` in
    seconds, 0 for none. ``rpcnb.paths.calls.request`` sends a remote cell's request so."""
    return _torch.send_python_call(to, entry, (token, op, args), timeout)


def remote(token: str, to: str, op: str, *args: Any) -> Any:
    """An RRef owned by ``to`` to the value ``op(*args)`` returns there."""
    return rpc.remote(to, entry, args=(token, op, args))
