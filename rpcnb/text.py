"""Plain text for people: the tables %rpc_workers, %rpc_probe, %rpc_who and %rpc_channels
--text print, byte sizes and shapes as every display of rpcnb writes them, and sets of
workers as rpcnb names them (``worker_set``: ``worker1-32``, ``worker2,worker5-7``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_UNITS = (("GB", 30), ("MB", 20), ("KB", 10))


def table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first one is the header) as left-aligned columns two spaces apart,
    without trailing spaces, so a long last column (a reason, say) is not padded."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def size(nbytes: float, unit: str | None = None, decimals: int | None = 1) -> str:
    """``nbytes`` for people: ``"1.5 GB"``, ``"300.0 MB"``, ``"512 B"``.

    ``unit`` fixes the unit (``"MB"`` for a column of memory sizes, written
    ``"8,192 MB"``); ``decimals=None`` writes a whole number of units without decimals
    (``"1 KB"``, ``"256 MB"``, but ``"1.5 MB"``), as sizes a user chose are written."""
    if unit is None:
        unit, shift = next(((u, s) for u, s in _UNITS if nbytes >= 1 << s), ("B", 0))
    else:
        shift = dict(_UNITS, B=0)[unit]
    if shift == 0 and unit is not None and decimals != 0 and nbytes == int(nbytes):
        return f"{int(nbytes)} B"
    value = nbytes / (1 << shift)
    if decimals is None:
        decimals = 0 if value == int(value) else 1
    return f"{value:,.{decimals}f} {unit}"


def shape(dims: Sequence[int]) -> str:
    """A tensor's or array's shape as Python writes the tuple: ``"(2, 3)"``, ``"(4,)"``, ``"()"``."""
    return f"({', '.join(map(str, dims))}{',' if len(dims) == 1 else ''})"


_NUMBERED = re.compile(r"^(.*?)(\d+)$")  # a numbered name: PREFIX<number>


def worker_set(names: Iterable[str]) -> str:
    """``names`` as the shortest set: ``worker1-32``, ``worker2,worker5-7``,
    ``kernel_12,worker1-4``. Names that share a prefix are sorted by number; a run of three
    or more numbers in a row is a range. ``rpcnb.session.workersets.expand`` of it gives the
    same names."""
    numbered: dict[str, list[int]] = {}
    order: list[tuple[str, int | None, str]] = []  # (prefix or name, number, name)
    for name in dict.fromkeys(names):  # each once, first seen first
        m = _NUMBERED.match(name)
        if m is None or m.group(2).startswith("0") and m.group(2) != "0" or not m.group(1):
            order.append((name, None, name))
        else:
            prefix, n = m.group(1), int(m.group(2))
            if prefix not in numbered:
                order.append((prefix, 0, ""))
            numbered.setdefault(prefix, []).append(n)
    out: list[str] = []
    for key, number, name in order:
        if number is None:
            out.append(name)
            continue
        out.extend(_runs(key, sorted(numbered[key])))
    return ",".join(out)


def _runs(prefix: str, numbers: list[int]) -> list[str]:
    out: list[str] = []
    start = 0
    for i in range(1, len(numbers) + 1):
        if i < len(numbers) and numbers[i] == numbers[i - 1] + 1:
            continue
        run = numbers[start:i]
        if len(run) >= 3:
            out.append(f"{prefix}{run[0]}-{run[-1]}")
        else:
            out.extend(f"{prefix}{n}" for n in run)
        start = i
    return out
