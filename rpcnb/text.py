"""Plain text for people: the tables %rpc_workers, %rpc_probe, %rpc_who and %rpc_channels
--text print, and byte sizes and shapes as every display of rpcnb writes them."""

from __future__ import annotations

from collections.abc import Sequence

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
