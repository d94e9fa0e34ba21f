"""The attributes rpcnb replaces in torch (its RPC pickler's methods, the tensor extractor,
rpc_sync/rpc_async/remote's entry points: ``rpcnb.wire._torch``), each noted as it is
replaced, so that ``restore`` can put them back exactly as they were
(``rpcnb.paths.serialize.uninstall``). Imports nothing of torch."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["NOT_OURS", "replace", "replaced", "restore"]

NOT_OURS = ("{name} was replaced again after rpcnb replaced it (by another library?): rpcnb "
            "cannot put torch's own back without undoing that too; leave it installed.")

_ABSENT = object()  # the attribute was not the object's own (a method of its class)
_lock = threading.Lock()
# (object, attribute, what it was, what rpcnb put there), in the order they were replaced
_replaced: list[tuple[Any, str, Any, Any]] = []


def _own(owner: Any, name: str) -> Any:
    return vars(owner).get(name, _ABSENT)


def replace(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, noted with what ``owner`` held before."""
    with _lock:
        _replaced.append((owner, name, _own(owner, name), value))
        setattr(owner, name, value)


def replaced(owner: Any, name: str) -> bool:
    """Whether rpcnb's replacement of ``owner.name`` is in place now."""
    with _lock:
        return any(o is owner and n == name and _own(owner, name) is ours
                   for o, n, _, ours in _replaced)


def restore() -> None:
    """Put back everything ``replace`` replaced, newest first, as it was (an attribute that
    was not the object's own is deleted again). A RuntimeError, with nothing changed, when
    one of them no longer holds rpcnb's value: someone replaced it since, and putting
    torch's back would undo theirs."""
    with _lock:
        for owner, name, _before, ours in _replaced:
            if _own(owner, name) is not ours:
                where = getattr(owner, "__name__", type(owner).__name__)
                raise RuntimeError(NOT_OURS.format(name=f"{where}.{name}"))
        while _replaced:
            owner, name, before, _ours = _replaced.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
