"""The attributes rpcnb replaces in torch (its RPC pickler's methods, the tensor extractor,
rpc_sync/rpc_async/remote's entry points: ``rpcnb.wire._torch``), each noted as it is
replaced, so that ``restore`` can put them back exactly as they were
(``rpcnb.paths.serialize.uninstall``). Imports nothing of torch."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NOT_OURS", "PATCHES", "Patches", "original", "replace", "replaced", "restore"]

NOT_OURS = ("{name} was replaced again after rpcnb replaced it (by another library?): rpcnb "
            "cannot put torch's own back without undoing that too; leave it installed.")

_ABSENT = object()  # the attribute was not the object's own (a method of its class)


@dataclass
class Patches:
    """What rpcnb replaced, in the order it did: the process's (``PATCHES``), for as long
    as the replacements stay (``restore`` empties it)."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # held to read or change ``done``
    # (object, attribute, what it was, what rpcnb put there), oldest first
    done: list[tuple[Any, str, Any, Any]] = field(default_factory=list)


PATCHES = Patches()


def _own(owner: Any, name: str) -> Any:
    return vars(owner).get(name, _ABSENT)


def replace(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, noted with what ``owner`` held before."""
    with PATCHES.lock:
        PATCHES.done.append((owner, name, _own(owner, name), value))
        setattr(owner, name, value)


def replaced(owner: Any, name: str) -> bool:
    """Whether rpcnb's replacement of ``owner.name`` is in place now."""
    with PATCHES.lock:
        return any(o is owner and n == name and _own(owner, name) is ours
                   for o, n, _, ours in PATCHES.done)


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before rpcnb first replaced it (None when rpcnb has not)."""
    with PATCHES.lock:
        for o, n, before, _ours in PATCHES.done:
            if o is owner and n == name:
                return None if before is _ABSENT else before
    return None


def restore() -> None:
    """Put back everything ``replace`` replaced, newest first, as it was (an attribute that
    was not the object's own is deleted again). A RuntimeError, with nothing changed, when
    one of them no longer holds rpcnb's value: someone replaced it since, and putting
    torch's back would undo theirs."""
    with PATCHES.lock:
        done = PATCHES.done
        for owner, name, _before, ours in done:
            if _own(owner, name) is not ours:
                where = getattr(owner, "__name__", type(owner).__name__)
                raise RuntimeError(NOT_OURS.format(name=f"{where}.{name}"))
        while done:
            owner, name, before, _ours = done.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
