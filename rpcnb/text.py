"""Plain-text tables: what %rpc_workers, %rpc_probe and %rpc_channels --text print."""

from __future__ import annotations

from collections.abc import Sequence


def table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first one is the header) as left-aligned columns two spaces apart,
    without trailing spaces, so a long last column (a reason, say) is not padded."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)
