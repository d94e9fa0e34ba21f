"""A group's settings, checked before any process starts: member names, TensorPipe's
transports and channels (names and priorities), threads, timeout, the device map; and
the ``TensorPipeRpcBackendOptions`` built from them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rpcnb import errors, settings

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
BAD_GPUS = (
    "--gpus {spec!r} is not a GPU plan: write this kernel's GPU indices, one entry per "
    "worker (0,1; 0+1,2+3 for two each), auto (round-robin) or none."
)
GPUS_COUNT = (
    "--gpus {spec!r} has {given} entries for {workers} workers: give one entry per worker, "
    "or a single one for all of them."
)
GPU_MISSING = (
    "--gpus {spec!r}: this kernel sees {count} GPU{s}{available}, so GPU {index} does not "
    "exist here; use auto, none, or indices below {count}."
)

# no "-": torch keeps the members of a dynamic group as "name-rank" entries and splits them
# at "-", so every member that joins after one named "a-b" waits for "a" and times out
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def check_name(name: str) -> None:
    """A member name: letters, digits and '_' (ValueError with BAD_NAME otherwise)."""
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


@dataclass(frozen=True)
class GroupOptions:
    """A member's settings of its group, checked before anything starts (``validate``).
    Every member holds its own (``Session.options``); a worker gets its copy as JSON on its
    command line (``to_json``, ``from_json``), with its own device map."""

    threads: int = DEFAULT_THREADS  # TensorPipe's RPC threads
    timeout: float = DEFAULT_RPC_TIMEOUT  # torch's RPC timeout, seconds (cells have none)
    # large CPU tensors between members on one host go through rpcnb's shared memory
    # (rpcnb.paths.shm, copy semantics)
    shm: bool = True
    # a CPU tensor already in shared memory goes by handle (rpcnb.paths.zerocopy, sharing
    # semantics; only with shm)
    zero_copy: bool = True
    ucx: bool = False  # large tensors over UCX (rpcnb.paths.ucx)
    channels: tuple[str, ...] | None = None  # TensorPipe's channels, by priority (None: all)
    transports: tuple[str, ...] = tuple(DEFAULT_TRANSPORTS)  # TensorPipe's transports
    # every member runs on this host (no --allow-remote): shared memory is possible
    one_host: bool = True
    device_map: dict[str, Any] | None = None  # this member's device map (dict form)
    # the group's first member is a kept group's keeper: left out of all-gathers and --all
    keeper: bool = False

    def replace(self, **changes: Any) -> GroupOptions:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GroupOptions:
        data = json.loads(text)
        for name in ("channels", "transports"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        return cls(**data)


def validate(threads: int = DEFAULT_THREADS, timeout: float = DEFAULT_RPC_TIMEOUT,
             channels: Iterable[str] | None = None,
             transports: Iterable[str] | None = None, *, shm: bool = True,
             zero_copy: bool = True, ucx: bool = False) -> GroupOptions:
    """Check a group's settings before any process starts (ValueError saying which and
    what it takes); see ``GroupOptions``."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, not {threads!r}.")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    return GroupOptions(
        threads=threads, timeout=float(timeout), shm=bool(shm),
        zero_copy=bool(shm) and bool(zero_copy), ucx=bool(ucx),
        channels=tuple(check_names(list(channels), "channel")) if channels else None,
        transports=tuple(check_names(list(transports), "transport")) if transports
        else tuple(DEFAULT_TRANSPORTS))


def check_device_map(spec: Any, me: str, names: dict[int, str] | None = None,
                     peer_devices: dict[str, list[str]] | None = None,
                     local_devices: list[str] | None = None) -> dict[str, Any]:
    """Parse and validate a device map (dict or DI-engine string) before anything starts,
    against this machine's devices (or ``local_devices``) and, for the peers given, theirs;
    its plain dict form. Raises ValueError naming the member and the device."""
    from rpcnb.machine import cuda_devices
    from rpcnb.wire.devicemap import DeviceMap

    dm = DeviceMap.parse(spec, me=me, names=names)
    dm.check(local_devices=cuda_devices() if local_devices is None else local_devices,
             peer_devices=peer_devices)
    return dm.to_dict()


@dataclass
class DevicePlan:
    """The devices of a group this kernel starts, decided before anything starts."""

    devices: dict[str, list[str]]  # member -> its CUDA devices, as torch numbers them there
    visible: dict[str, str | None]  # worker -> its CUDA_VISIBLE_DEVICES (None: inherited)
    maps: dict[str, dict[str, Any]]  # member -> its device map (dict form)


def device_map_spec(text: str, namespace: dict[str, Any]) -> Any:
    """A device map as the user writes it (``--device-map``, the panel's start form): a
    dict literal, DI-engine's string, or the name of a variable in ``namespace``."""
    import ast

    text = text.strip().strip("'\"")
    if text.startswith("{"):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"--device-map {text!r} is not a valid dict literal: {exc}.") from None
    if text.isidentifier() and text in namespace:
        return namespace[text]
    return text


def plan_devices(me: str, workers: list[str], gpus: str | None = None,
                 device_map: Any = None) -> DevicePlan:
    """Which GPUs each worker gets (``--gpus``) and every member's device map
    (``--device-map``: this kernel's, or ``"auto"`` for every member), checked against the
    devices each member will have. ValueError naming the member and device otherwise."""
    from rpcnb.machine import cuda_devices, visible_gpu_ids

    mine = cuda_devices()
    ids = visible_gpu_ids(len(mine))
    plan = plan_gpus(gpus, len(workers), ids)
    devices = {me: mine}
    visible: dict[str, str | None] = {}
    for k, worker in enumerate(workers):
        if plan is None:
            devices[worker], visible[worker] = list(mine), None
        else:
            devices[worker] = [f"cuda:{j}" for j in range(len(plan[k]))]
            visible[worker] = ",".join(ids[i] for i in plan[k])
    maps: dict[str, dict[str, Any]] = {}
    if isinstance(device_map, str) and device_map.strip().lower() == "auto":
        maps = auto_device_maps(devices)
    elif device_map is not None:
        ranks = {0: me, **{i: n for i, n in enumerate(workers, start=1)}}
        maps[me] = check_device_map(device_map, me, ranks, local_devices=mine,
                                    peer_devices={w: devices[w] for w in workers})
    return DevicePlan(devices, visible, maps)


def backend_options(options: GroupOptions, init_method: str) -> Any:
    """torch's ``TensorPipeRpcBackendOptions`` for the settings ``validate`` returned."""
    import torch.distributed.rpc as rpc

    kwargs: dict[str, Any] = {"init_method": init_method, "num_worker_threads": options.threads,
                              "rpc_timeout": options.timeout}
    if options.channels:
        kwargs["_channels"] = list(options.channels)
    # TensorPipe's shm transport busy-polls: each idle member burns about a third of a
    # core (measured, docs/benchmarks.md). uv (TCP on loopback) idles at zero, and large
    # tensors take cma or rpcnb's shared memory anyway. --transports shm,uv brings it back.
    kwargs["_transports"] = list(options.transports or DEFAULT_TRANSPORTS)
    opts = rpc.TensorPipeRpcBackendOptions(**kwargs)
    if options.device_map:
        from rpcnb.wire.devicemap import DeviceMap

        DeviceMap.parse(options.device_map).apply(opts)
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


def plan_gpus(spec: str | None, workers: int, visible: list[str]) -> list[list[int]] | None:
    """Which of this kernel's GPUs (indices into ``visible``) each started worker uses,
    from ``--gpus``: ``"0,1"`` one each, ``"0+1,2"`` several, ``"auto"`` round-robin
    over the visible GPUs (none when there are none), ``"none"`` no GPU. None (no
    ``--gpus``): workers see what this kernel sees."""
    if spec is None:
        return None
    text = str(spec).strip().lower()
    if text == "none":
        return [[] for _ in range(workers)]
    if text == "auto":
        return [[i % len(visible)] if visible else [] for i in range(workers)]
    entries = [e.strip() for e in text.split(",")]
    plan: list[list[int]] = []
    for entry in entries:
        parts = [p.strip() for p in entry.split("+")]
        if not entry or not all(p.isdigit() for p in parts):
            raise ValueError(BAD_GPUS.format(spec=spec))
        indices = [int(p) for p in parts]
        for index in indices:
            if index >= len(visible):
                count = len(visible)
                available = f" (cuda:0..cuda:{count - 1})" if count else ""
                raise ValueError(GPU_MISSING.format(spec=spec, count=count, index=index,
                                                    s="" if count == 1 else "s",
                                                    available=available))
        plan.append(indices)
    if len(plan) == 1:
        plan = plan * workers
    if len(plan) != workers:
        raise ValueError(GPUS_COUNT.format(spec=spec, given=len(plan), workers=workers))
    return plan


MAPS_ONTO_ME = (
    "{peer}'s device map sends to {me}'s {device}, but {me} has {have}: join with that "
    "GPU visible, or start the group with another map."
)


def join_device_map(me: str, spec: Any, mine: list[str],
                    members: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """A joining kernel's map (``spec``: a map, ``"auto"``, or None) checked, before it
    joins, against the devices of the members already in (``members``: what
    ``roster.published`` returns), and their maps onto this kernel against its devices."""
    from rpcnb.wire.devicemap import DeviceMap

    peers = {name: info["devices"] for name, info in members.items() if name != me}
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        mapped = auto_device_maps({me: mine, **peers}).get(me)
    elif spec is not None:
        mapped = check_device_map(spec, me, local_devices=mine, peer_devices=peers)
    else:
        mapped = None
    for peer, info in members.items():
        onto_me = (info.get("device_map") or {}).get(me)
        for remote in (onto_me or {}).values():
            if remote not in mine:
                have = ", ".join(mine) if mine else "no CUDA devices"
                raise ValueError(MAPS_ONTO_ME.format(peer=peer, me=me, device=remote, have=have))
    if mapped:
        DeviceMap.parse(mapped, me=me).check(local_devices=mine, peer_devices=peers)
    return mapped


def auto_device_maps(devices: dict[str, list[str]]) -> dict[str, dict[str, dict[str, str]]]:
    """DI-engine's default map for every member: each of its GPUs to the same index on
    every other member that has it (``{member: {peer: {"cuda:0": "cuda:0"}}}``), so a
    CUDA tensor goes device to device between any two members."""
    maps: dict[str, dict[str, dict[str, str]]] = {}
    for me, mine in devices.items():
        for peer, theirs in devices.items():
            common = [d for d in mine if d in theirs]
            if peer != me and common:
                maps.setdefault(me, {})[peer] = {d: d for d in common}
    return maps


UCX_ENV = "RPCNB_UCX"


def ucx_option(flag: bool | None = None, check: bool = True) -> bool:
    """The UCX path's option (``rpcnb.paths.ucx``): ``flag`` when given, else whether
    ``RPCNB_UCX`` asks for it; with ``check``, RpcnbError with UCX_MISSING when it is on
    and ucxx is not installed (imports nothing: the kernel asks before it starts
    anything, the warm launcher included)."""
    on = bool(flag) if flag is not None else settings.flag(UCX_ENV)
    if on and check:
        try:
            found = importlib.util.find_spec("ucxx") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise errors.RpcnbError(errors.UCX_MISSING.format(extra=ucx_extra()))
    return on


def torch_cuda_version() -> str | None:
    """The CUDA version this torch was built with (``torch.version.cuda``: "13.0", or None
    for a CPU build), read from torch's ``version.py`` without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9.]+)['\"]", text, re.M)
        return found.group(1) if found else None
    return None


def ucx_extra(cuda: str | None = None) -> str:
    """rpcnb's extra whose ucxx matches torch's CUDA major (``cuda``, by default this
    torch's): ``ucx-cu13`` for CUDA 13, else ``ucx`` (ucxx-cu12, which also runs without a
    GPU). ucxx's wheels pin cuda-bindings to their CUDA major, as a CUDA 13 torch does."""
    cuda = torch_cuda_version() if cuda is None else cuda
    return "ucx-cu13" if cuda and cuda.split(".")[0] == "13" else "ucx"
