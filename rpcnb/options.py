"""A group's settings, checked before any process starts: member names, TensorPipe's
transports and channels (names and priorities), threads, timeout, the device map; and
the ``TensorPipeRpcBackendOptions`` built from them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from rpcnb import errors

DEFAULT_THREADS = 16
DEFAULT_TRANSPORTS = ["uv"]
DEFAULT_RPC_TIMEOUT = 60.0

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

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


def check_name(name: str) -> None:
    """A member name: letters, digits, '_' and '-' (ValueError with BAD_NAME otherwise)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(errors.BAD_NAME.format(name=name))


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


def validate(threads: int = DEFAULT_THREADS, timeout: float = DEFAULT_RPC_TIMEOUT,
             channels: Iterable[str] | None = None,
             transports: Iterable[str] | None = None) -> dict[str, Any]:
    """Check TensorPipe settings before any process starts; return them as plain data."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, not {threads!r}.")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    opts: dict[str, Any] = {"threads": threads, "timeout": float(timeout)}
    if channels:
        opts["channels"] = check_names(list(channels), "channel")
    opts["transports"] = (check_names(list(transports), "transport") if transports
                          else list(DEFAULT_TRANSPORTS))
    return opts


def check_device_map(spec: Any, me: str, names: dict[int, str] | None = None) -> dict[str, Any]:
    """Parse and validate a device map (dict or DI-engine string) for this machine before
    anything starts; its plain dict form. Raises ValueError naming peer and device."""
    from rpcnb.devicemap import DeviceMap
    from rpcnb.machine import cuda_devices

    dm = DeviceMap.parse(spec, me=me, names=names)
    dm.check(local_devices=cuda_devices())
    return dm.to_dict()


def backend_options(options: dict[str, Any], init_method: str) -> Any:
    """torch's ``TensorPipeRpcBackendOptions`` for the settings ``validate`` returned."""
    import torch.distributed.rpc as rpc

    kwargs: dict[str, Any] = {
        "init_method": init_method,
        "num_worker_threads": int(options.get("threads", DEFAULT_THREADS)),
        "rpc_timeout": float(options.get("timeout", DEFAULT_RPC_TIMEOUT)),
    }
    if options.get("channels"):
        kwargs["_channels"] = list(options["channels"])
    # TensorPipe's shm transport busy-polls: each idle member burns about a third of a
    # core (measured, docs/benchmarks.md). uv (TCP on loopback) idles at zero, and large
    # tensors take cma or rpcnb's shared memory anyway. --transports shm,uv brings it back.
    kwargs["_transports"] = list(options.get("transports") or DEFAULT_TRANSPORTS)
    opts = rpc.TensorPipeRpcBackendOptions(**kwargs)
    if options.get("device_map"):
        from rpcnb.devicemap import DeviceMap

        DeviceMap.parse(options["device_map"]).apply(opts)
    return opts


# The map %rpc_devmap's "apply" keeps for this kernel's next %rpc_init / --join.
_applied: dict[str, Any] | None = None


def keep_device_map(device_map: dict[str, Any] | None) -> None:
    """Keep ``device_map`` (dict form) for this kernel's next ``%rpc_init`` / ``--join``."""
    global _applied
    _applied = dict(device_map) if device_map else None


def applied_device_map() -> dict[str, Any] | None:
    """The map the device-map editor applied, or None."""
    return dict(_applied) if _applied else None
