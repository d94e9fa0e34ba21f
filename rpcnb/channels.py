"""Which path a tensor takes: TensorPipe's transports and channels.

TensorPipe picks one transport per pipe and, per (source device, target device) pair, the
highest-priority channel both sides find viable. This module knows their names and
priorities (DESIGN.md, "TensorPipe channel choice").
"""

from __future__ import annotations

# name -> priority, as registered by torch 2.x
TRANSPORTS = {"shm": 200, "ibv": 100, "uv": 0}
CHANNELS = {
    "cma": 1200,
    "mpt_uv": 1100,
    "basic": 1000,
    "cuda_xth": 400,
    "cuda_ipc": 300,
    "cuda_gdr": 200,
    "cuda_basic": 0,
}

UNKNOWN_NAME = "Unknown TensorPipe {kind} {name!r}: choose from {known}."


def check_names(names: list[str], kind: str) -> list[str]:
    """Validate a ``--channels``/``--transports`` list; return it cleaned, order kept."""
    known = CHANNELS if kind == "channel" else TRANSPORTS
    out: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name not in known:
            raise ValueError(UNKNOWN_NAME.format(kind=kind, name=name, known=", ".join(known)))
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"The {kind} list is empty: name at least one of {', '.join(known)}.")
    if kind == "channel" and not any(n in out for n in ("basic", "mpt_uv", "cma")):
        raise ValueError("The channel list has no CPU channel: include basic (always viable).")
    return out
