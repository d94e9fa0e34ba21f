"""The RRefs this kernel holds, as the RPC panel lists them: found in the notebook's
namespace (bound to a name, or an item of a dict, list or tuple bound to one, IPython's
output cache included), and dropped everywhere at once by the panel's "free" button.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

MAX_ITEMS = 10_000  # a dict or list longer than this is not searched for RRefs
IPYTHON_OUTPUTS = ("_", "__", "___")  # IPython's last outputs (also kept by its displayhook)


def _rref_class() -> Any:
    """torch's RRef type, or None while torch.distributed.rpc was never imported (then
    nothing can hold an RRef)."""
    mod = sys.modules.get("torch._C._distributed_rpc")
    return getattr(mod, "PyRRef", None)


@dataclass
class Held:
    """One RRef and every place in the namespace that holds it."""

    rref: Any
    names: list[str] = field(default_factory=list)  # as the user would write them
    places: list[tuple[Any, ...]] = field(default_factory=list)  # (name,) or (name, key)


def rref_key(rref: Any) -> str:
    """What tells RRefs apart: torch's ids of the RRef and of this fork."""
    return repr(rref)


def _is_ipython_name(name: str) -> bool:
    return name in IPYTHON_OUTPUTS or (name.startswith("_") and name[1:].isdigit())


def find_rrefs(namespace: dict[str, Any]) -> dict[str, Held]:
    """The RRefs in ``namespace``: bound to a name, or an item of a dict, list or tuple
    bound to a name (one level; IPython's ``Out`` included). Key: ``rref_key``."""
    cls = _rref_class()
    found: dict[str, Held] = {}
    if cls is None:
        return found
    seen: set[int] = set()  # Out and _oh are one dict

    def add(rref: Any, label: str, place: tuple[Any, ...]) -> None:
        held = found.setdefault(rref_key(rref), Held(rref))
        if label not in held.names:
            held.names.append(label)
        held.places.append(place)

    try:
        items = list(namespace.items())
    except RuntimeError:  # changed while we read it (a cell runs): next time
        return found
    for name, value in items:
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(value, cls):
            add(value, name, (name,))
        elif isinstance(value, (dict, list, tuple)) and id(value) not in seen \
                and len(value) <= MAX_ITEMS:
            seen.add(id(value))
            try:
                pairs = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            except RuntimeError:
                continue
            for key, item in pairs:
                if isinstance(item, cls):
                    add(item, f"{name}[{key!r}]", (name, key))
    for held in found.values():  # the user's own names first, IPython's Out and _N last
        held.names.sort(key=lambda n: (n.startswith("Out[") or n.startswith("_oh[")
                                       or _is_ipython_name(n), n))
    return found


def drop(shell: Any, key: str) -> list[str]:
    """Drop every reference this kernel's namespace (and IPython's output cache) holds to
    the RRef ``key``; the names it had. When the last one goes, torch tells the owner."""
    ns = shell.user_ns
    held = find_rrefs(ns).get(key)
    if held is None:
        return []
    for place in held.places:
        name = place[0]
        try:
            if len(place) == 1:
                if name in IPYTHON_OUTPUTS:
                    ns[name] = ""  # as IPython starts them
                else:
                    del ns[name]
                continue
            container = ns[name]
            if isinstance(container, tuple):
                ns[name] = tuple(x for x in container if x is not held.rref)
            elif isinstance(container, dict):
                container.pop(place[1], None)
        except (KeyError, TypeError):
            continue
    for name in {p[0] for p in held.places if len(p) == 2}:  # lists: every occurrence
        container = ns.get(name)
        if isinstance(container, list):
            container[:] = [x for x in container if x is not held.rref]
    hook = getattr(shell, "displayhook", None)
    for attr in IPYTHON_OUTPUTS:
        if getattr(hook, attr, None) is held.rref:
            setattr(hook, attr, "")
    last = getattr(shell, "last_execution_result", None)
    if last is not None and getattr(last, "result", None) is held.rref:
        last.result = None
    names = held.names
    del held
    return names
