"""Worker sets: one grammar for naming several members wherever rpcnb takes workers, and
the same grammar for the labels it prints, so that a label pasted as a target names the
same members.

    worker3              one member
    worker1-8            a range: worker1, worker2, ..., worker8 (``worker1-worker8`` too)
    worker2,worker5-7    a list of names and ranges (spaces around the commas are allowed)
    @gpu-node-3          every member on that host, as ``%rpc_workers`` shows it

``expand`` turns a set into names, checked against the members a group knows;
``rpcnb.text.worker_set`` writes names as the shortest set (runs of three or more as a
range). Member names hold no
``-`` (``rpcnb.wire.options.check_name``), so a ``-`` always means a range.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from rpcnb import text

# a range of numbered names: PREFIX<first>-[PREFIX]<last>
_RANGE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*?)(\d+)-(?:\1)?(\d+)$")

NOT_A_SET = (
    "{item!r} is not a worker set: write names (worker3), ranges (worker1-8), lists "
    "(worker2,worker5-7) or @HOST for a host's members."
)
NAMES_NO_ONE = "{item} names no member of this group (it has {known})."
NAMES_MISSING = "{item} names {missing}, which {are} not in this group (it has {known})."
NO_HOST = "No member runs on host {host!r} (the group's hosts: {hosts})."


def items(spec: str | Iterable[str]) -> list[str]:
    """The items of a set (a string, or strings each a set), in order, without blanks."""
    texts = [spec] if isinstance(spec, str) else list(spec)
    return [item.strip() for text in texts for item in text.split(",") if item.strip()]


def is_several(spec: str) -> bool:
    """Whether ``spec`` can name more than one member (a list, a range, a host)."""
    return "," in spec or any("-" in item or item.startswith("@") for item in items(spec))


def expand(spec: str | Iterable[str], known: Sequence[str],
           hosts: Mapping[str, str] | None = None) -> list[str]:
    """The members ``spec`` names, in its order, each once. A plain name is kept as it is
    (the caller says what it knows of it); a range must name only members in ``known``,
    a host (``@HOST``, ``hosts``: member -> its host) at least one. ValueError naming the
    item and saying what there is, otherwise."""
    names: list[str] = []
    for item in items(spec):
        for name in _one(item, known, hosts or {}):
            if name not in names:
                names.append(name)
    return names


def _one(item: str, known: Sequence[str], hosts: Mapping[str, str]) -> list[str]:
    if item.startswith("@"):
        host = item[1:]
        found = [n for n in known if hosts.get(n) == host]
        if not found:
            raise ValueError(NO_HOST.format(host=host, hosts=", ".join(
                sorted(set(hosts.values()))) or "none known"))
        return found
    if "-" not in item:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item):
            raise ValueError(NOT_A_SET.format(item=item))
        return [item]
    m = _RANGE.match(item)
    if m is None or int(m.group(2)) > int(m.group(3)):
        raise ValueError(NOT_A_SET.format(item=item))
    prefix, first, last = m.group(1), int(m.group(2)), int(m.group(3))
    names = [f"{prefix}{i}" for i in range(first, last + 1)]
    missing = [n for n in names if n not in known]
    if len(missing) == len(names):
        raise ValueError(NAMES_NO_ONE.format(item=item, known=text.worker_set(known) or "no members"))
    if missing:
        raise ValueError(NAMES_MISSING.format(item=item, missing=text.worker_set(missing),
                                              are="is" if len(missing) == 1 else "are",
                                              known=text.worker_set(known)))
    return names
