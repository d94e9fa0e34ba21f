"""Device maps for TensorPipe: parse them (torch's dict form or DI-engine's string form),
check them against TensorPipe's rules before any process starts, write them back, and
apply them to ``TensorPipeRpcBackendOptions``.

A device map says, for each peer, which of this worker's devices a tensor leaves from and
which of the peer's devices it lands on; responses travel the inverse way. This module is
pure Python: importing it does not import torch (``apply``, ``from_torch_options`` and
``machine_devices`` import it when called).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

__all__ = [
    "DeviceMap",
    "Pair",
    "Problem",
    "machine_devices",
]

# -- messages: one sentence each, naming the peer and the device and saying what to do -----

INVALID_DEVICE = (
    "{device!r} in the map for {peer} is not a device TensorPipe can map ({reason}): "
    "write 'cuda:N' with N >= 0, or 'cpu'."
)
REASON_NEGATIVE = "negative index"
REASON_NO_INDEX = "no index"
REASON_NOT_A_NUMBER = "index is not a number"
REASON_UNKNOWN_TYPE = "only cuda and cpu devices can be mapped"

DUPLICATED_DEVICE = (
    "duplicated device: {device} is mapped to {targets} on {peer}; keep one entry for {device}."
)
DUPLICATED_TARGET = (
    "duplicated target device: {sources} map to the same device {device} on {peer}; a "
    "device map is one-to-one, so send each of them to a different device of {peer}."
)
LOCAL_TOO_FEW = (
    "{me} has only {count} CUDA device{s} ({available}), so {device} in the map for {peer} "
    "does not exist here; map one of those instead."
)
LOCAL_NO_CUDA = (
    "The map for {peer} sends from {device}, but this machine has no CUDA devices; remove "
    "that entry or run {me} on a machine with a GPU."
)
REMOTE_TOO_FEW = (
    "{peer} has only {count} CUDA device{s} ({available}), so {device} in the map for "
    "{peer} does not exist there; map onto one of those instead."
)
REMOTE_NO_CUDA = (
    "{peer} has no CUDA devices, so the map for {peer} cannot land on {device}; map onto "
    "'cpu' or remove that entry."
)
UNKNOWN_PEER = (
    "The device map names {peer}, which is not in the group ({known}): "
    "fix the name or remove its entries."
)
SELF_MAP = (
    "The device map maps {peer} to itself, which this group does not allow; remove the "
    "entries for {peer}."
)

# Parse errors (raised as ValueError by DeviceMap.parse).
PARSE_ITEM = (
    "{item!r} is not <peer>_<local gpu>_<peer gpu> (like 1_0_1): write the peer's rank or "
    "name, then two GPU indices, joined by '_'."
)
PARSE_INDEX = "{field!r} in {item!r} is not a GPU index: write a whole number such as 0 or 1."
PARSE_SPEC = (
    "A device map is a dict like {{'worker1': {{0: 1}}}} or a string like '1_0_1,2_0_2', "
    "not {kind}: pass one of those."
)
PARSE_PEER = (
    "{peer!r} is not a worker: name a peer by its name (a non-empty string) "
    "or by its rank (an int >= 0)."
)
PARSE_PEER_MAP = (
    "The map for {peer} is {kind}, not a dict of local device to peer device: write it like "
    "{{0: 1}} or {{'cuda:0': 'cuda:1'}}."
)
PARSE_DEVICE = (
    "{device!r} in the map for {peer} is not a device: "
    "write a GPU index, 'cuda:N', 'cpu' or a torch.device."
)

# Writing back.
CANNOT_WRITE_PAIR = (
    "{peer}: {local} -> {remote} cannot be written as <peer>_<local gpu>_<peer gpu>, which "
    "holds only CUDA-to-CUDA pairs: use the dict form (to_dict or to_python) for this map."
)
CANNOT_WRITE_PEER = (
    "The peer name {peer!r} cannot be written as <peer>_<local gpu>_<peer gpu> (empty, "
    "all digits, or holding ',' or surrounding spaces): pass its rank in ranks= or use the "
    "dict form."
)

_CUDA = re.compile(r"cuda:(-?[0-9]+)")
_INDEX = re.compile(r"-?[0-9]+")
_RANK = re.compile(r"[0-9]+")
_WORKER_RANK = re.compile(r"worker([0-9]+)")


@dataclass(frozen=True)
class Pair:
    """One entry of a device map: tensors on ``local`` sent to ``peer`` land on ``remote``."""

    peer: str
    local: str
    remote: str


@dataclass(frozen=True)
class Problem:
    """One thing TensorPipe would refuse; ``device`` is None for a problem with the peer."""

    peer: str
    device: str | None
    message: str

    def __str__(self) -> str:
        return self.message


def machine_devices() -> list[str]:
    """This machine's CUDA devices as ``["cuda:0", ...]`` (empty without a GPU); for
    ``DeviceMap.validate(local_devices=...)``. Imports torch."""
    import torch

    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _kind(value: object) -> str:
    return f"a {type(value).__name__}"


def _normalise(device: object, peer: str) -> str:
    """The device as TensorPipe spells it (``cuda:N`` / ``cpu``); text that is no device
    is kept as written so that ``validate`` can say what is wrong with it."""
    if isinstance(device, bool):
        raise ValueError(PARSE_DEVICE.format(device=device, peer=peer))
    if isinstance(device, int):
        return f"cuda:{device}"
    if isinstance(device, str):
        text = device.strip().lower()
    elif hasattr(device, "type") and hasattr(device, "index"):  # a torch.device
        text = str(device)
    else:
        raise ValueError(PARSE_DEVICE.format(device=device, peer=peer))
    if _INDEX.fullmatch(text):
        return f"cuda:{int(text)}"
    match = _CUDA.fullmatch(text)
    if match:
        return f"cuda:{int(match.group(1))}"
    return text


def _invalid_reason(device: str) -> str | None:
    """Why ``device`` (normalised) cannot be in a TensorPipe device map, or None."""
    if device == "cpu":
        return None
    match = _CUDA.fullmatch(device)
    if match:
        return REASON_NEGATIVE if int(match.group(1)) < 0 else None
    if device == "cuda":
        return REASON_NO_INDEX
    if device.startswith("cuda:"):
        return REASON_NOT_A_NUMBER
    return REASON_UNKNOWN_TYPE


def _cuda_index(device: str) -> int | None:
    match = _CUDA.fullmatch(device)
    return int(match.group(1)) if match else None


def _sort_key(device: str) -> tuple[int, int, str]:
    if device == "cpu":
        return (0, 0, "")
    index = _cuda_index(device)
    if index is not None:
        return (1, index, "")
    return (2, 0, device)


def _cuda_set(devices: Iterable[object]) -> list[str]:
    """The valid CUDA devices among ``devices``, sorted; anything else is ignored."""
    found = set()
    for device in devices:
        try:
            text = _normalise(device, "")
        except ValueError:
            continue
        if _cuda_index(text) is not None and _invalid_reason(text) is None:
            found.add(text)
    return sorted(found, key=_sort_key)


def _plural(count: int) -> str:
    return "" if count == 1 else "s"


def _peer_name(peer: object, names: Mapping[int, str]) -> str:
    if isinstance(peer, bool):
        raise ValueError(PARSE_PEER.format(peer=peer))
    if isinstance(peer, int):
        if peer < 0:
            raise ValueError(PARSE_PEER.format(peer=peer))
        return names.get(peer, f"worker{peer}")
    if isinstance(peer, str) and peer.strip():
        return peer.strip()
    raise ValueError(PARSE_PEER.format(peer=peer))


class DeviceMap:
    """This worker's device maps, ``{peer: {local device: peer device}}``, as a list of
    :class:`Pair` (a list, because the string form can name one device twice and
    ``validate`` must be able to say so).

    ``me`` is this worker's name (used in messages and for calls to oneself); ``names``
    maps ranks to worker names: it turns ranks in the string form into names, and when
    given, ``validate`` reports peers that are not among them.
    """

    def __init__(
        self,
        pairs: Iterable[Pair] = (),
        *,
        me: str | None = None,
        names: Mapping[int, str] | None = None,
    ) -> None:
        # Exact repeats are dropped: torch accepts the same local -> remote twice.
        self.pairs: tuple[Pair, ...] = tuple(dict.fromkeys(pairs))
        self.me = me
        self.names: dict[int, str] | None = dict(names) if names is not None else None

    # -- reading --------------------------------------------------------------------------

    @classmethod
    def parse(
        cls,
        spec: Mapping[Any, Mapping[Any, Any]] | str | DeviceMap | None,
        *,
        me: str | None = None,
        names: Mapping[int, str] | None = None,
    ) -> DeviceMap:
        """A device map from torch's dict form (``{"worker1": {0: 1}}``; ints are CUDA
        indices, ``"cuda:N"``, ``"cpu"`` and ``torch.device`` work too, and an int peer is
        a rank) or DI-engine's string form (``"1_0_1,2_0_2"``: ``<peer>_<local gpu>_<peer
        gpu>``, the peer a rank or a name, split from the right so names may hold ``_``).

        Raises ValueError when ``spec`` cannot be read at all. Devices that can be read
        but that TensorPipe would refuse (``"cuda:-1"``, ``"gpu0"``) are kept, and
        :meth:`validate` reports them, all at once.
        """
        rank_names: Mapping[int, str] = names or {}
        if spec is None:
            return cls(me=me, names=names)
        if isinstance(spec, DeviceMap):
            return cls(
                spec.pairs,
                me=me if me is not None else spec.me,
                names=names if names is not None else spec.names,
            )
        if isinstance(spec, str):
            return cls(_parse_string(spec, rank_names), me=me, names=names)
        if not isinstance(spec, Mapping):
            raise ValueError(PARSE_SPEC.format(kind=_kind(spec)))
        pairs = []
        for raw_peer, device_map in spec.items():
            peer = _peer_name(raw_peer, rank_names)
            if not isinstance(device_map, Mapping):
                raise ValueError(PARSE_PEER_MAP.format(peer=peer, kind=_kind(device_map)))
            for local, remote in device_map.items():
                pairs.append(Pair(peer, _normalise(local, peer), _normalise(remote, peer)))
        return cls(pairs, me=me, names=names)

    @classmethod
    def from_torch_options(
        cls,
        options: TensorPipeRpcBackendOptions,
        *,
        me: str | None = None,
        names: Mapping[int, str] | None = None,
    ) -> DeviceMap:
        """The device maps already set on a ``TensorPipeRpcBackendOptions``."""
        pairs = [
            Pair(peer, str(local), str(remote))
            for peer, device_map in options.device_maps.items()
            for local, remote in device_map.items()
        ]
        return cls(pairs, me=me, names=names)

    # -- what it says -------------------------------------------------------------------

    @property
    def peers(self) -> tuple[str, ...]:
        """The peers this map names, in the order they first appear."""
        return tuple(dict.fromkeys(pair.peer for pair in self.pairs))

    def local_devices(self, peer: str | None = None) -> list[str]:
        """The local devices this map sends from (to ``peer``, or to anyone), sorted:
        ``cpu`` first, then CUDA devices by index."""
        found = {pair.local for pair in self.pairs if peer is None or pair.peer == peer}
        return sorted(found, key=_sort_key)

    def inverse(self, peer: str) -> dict[str, str]:
        """``{peer device: local device}``: where ``peer``'s responses land here."""
        out: dict[str, str] = {}
        for pair in self.pairs:
            if pair.peer != peer:
                continue
            if pair.remote in out:
                raise ValueError(self._duplicated_target(peer, pair.remote))
            out[pair.remote] = pair.local
        return out

    def __iter__(self) -> Iterator[Pair]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMap):
            return NotImplemented
        return set(self.pairs) == set(other.pairs)

    def __hash__(self) -> int:
        return hash(frozenset(self.pairs))

    # -- checking ---------------------------------------------------------------------------

    def validate(
        self,
        local_devices: list[str] | None = None,
        peer_devices: dict[str, list[str]] | None = None,
        *,
        allow_self: bool = True,
    ) -> list[Problem]:
        """Every problem TensorPipe would raise at ``init_rpc`` (and some it would only hit
        at send time), without starting anything. Never raises.

        ``local_devices``: the devices this machine has (``machine_devices()``), None when
        unknown; ``peer_devices``: the same per peer, for the peers known. Entries other
        than valid ``cuda:N`` are ignored (``cpu`` is always there). Maps to oneself are
        valid in TensorPipe (``cuda_xth`` carries them); ``allow_self=False`` reports them.
        """
        me = self.me or "this worker"
        known = set(self.names.values()) if self.names is not None else None
        local_cuda = _cuda_set(local_devices) if local_devices is not None else None
        remote_cuda = {peer: _cuda_set(devs) for peer, devs in (peer_devices or {}).items()}
        if self.me is not None and local_cuda is not None:
            remote_cuda.setdefault(self.me, local_cuda)

        problems: list[Problem] = []
        for peer in self.peers:
            pairs = [pair for pair in self.pairs if pair.peer == peer]
            if known is not None and peer not in known and peer != self.me:
                listed = ", ".join(sorted(known)) or "no workers"
                problems.append(Problem(peer, None, UNKNOWN_PEER.format(peer=peer, known=listed)))
            if not allow_self and peer == self.me:
                problems.append(Problem(peer, None, SELF_MAP.format(peer=peer)))
            for pair in pairs:
                problems.extend(self._device_problems(pair, me, local_cuda, remote_cuda))
            problems.extend(self._one_to_one_problems(peer, pairs))
        # A device used by several pairs would repeat the same sentence.
        return list(dict.fromkeys(problems))

    def check(
        self,
        local_devices: list[str] | None = None,
        peer_devices: dict[str, list[str]] | None = None,
        *,
        allow_self: bool = True,
    ) -> DeviceMap:
        """:meth:`validate`, raising ValueError with every message (one a line) when there
        are problems; returns the map itself otherwise."""
        problems = self.validate(local_devices, peer_devices, allow_self=allow_self)
        if problems:
            raise ValueError("\n".join(problem.message for problem in problems))
        return self

    @staticmethod
    def _device_problems(
        pair: Pair,
        me: str,
        local_cuda: list[str] | None,
        remote_cuda: dict[str, list[str]],
    ) -> list[Problem]:
        problems = []
        peer = pair.peer
        for device, here in ((pair.local, True), (pair.remote, False)):
            reason = _invalid_reason(device)
            if reason is not None:
                message = INVALID_DEVICE.format(device=device, peer=peer, reason=reason)
                problems.append(Problem(peer, device, message))
                continue
            if device == "cpu":
                continue
            available = local_cuda if here else remote_cuda.get(peer)
            if available is None or device in available:
                continue
            count = len(available)
            if here and count == 0:
                message = LOCAL_NO_CUDA.format(peer=peer, device=device, me=me)
            elif here:
                message = LOCAL_TOO_FEW.format(
                    me=me,
                    count=count,
                    s=_plural(count),
                    available=", ".join(available),
                    device=device,
                    peer=peer,
                )
            elif count == 0:
                message = REMOTE_NO_CUDA.format(peer=peer, device=device)
            else:
                message = REMOTE_TOO_FEW.format(
                    peer=peer,
                    count=count,
                    s=_plural(count),
                    available=", ".join(available),
                    device=device,
                )
            problems.append(Problem(peer, device, message))
        return problems

    def _one_to_one_problems(self, peer: str, pairs: list[Pair]) -> list[Problem]:
        problems = []
        targets: dict[str, list[str]] = {}
        sources: dict[str, list[str]] = {}
        for pair in pairs:
            targets.setdefault(pair.local, []).append(pair.remote)
            sources.setdefault(pair.remote, []).append(pair.local)
        for local, remotes in targets.items():
            if len(remotes) > 1:
                message = DUPLICATED_DEVICE.format(
                    device=local, targets=" and ".join(remotes), peer=peer
                )
                problems.append(Problem(peer, local, message))
        for remote, locals_ in sources.items():
            if len(locals_) > 1:
                problems.append(Problem(peer, remote, self._duplicated_target(peer, remote)))
        return problems

    def _duplicated_target(self, peer: str, remote: str) -> str:
        locals_ = [pair.local for pair in self.pairs if pair.peer == peer and pair.remote == remote]
        return DUPLICATED_TARGET.format(sources=" and ".join(locals_), device=remote, peer=peer)

    # -- writing back -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, dict[str, str]]:
        """``{peer: {local: remote}}`` with plain strings; ValueError when a local device is
        mapped twice for one peer (a dict cannot hold that)."""
        out: dict[str, dict[str, str]] = {}
        for pair in self.pairs:
            device_map = out.setdefault(pair.peer, {})
            if pair.local in device_map:
                remotes = [
                    p.remote for p in self.pairs if (p.peer, p.local) == (pair.peer, pair.local)
                ]
                raise ValueError(
                    DUPLICATED_DEVICE.format(
                        device=pair.local, targets=" and ".join(remotes), peer=pair.peer
                    )
                )
            device_map[pair.local] = pair.remote
        return out

    def to_string(self, ranks: Mapping[str, int] | None = None) -> str:
        """DI-engine's form, ``1_0_1,2_0_2``. Peers are written as ranks where known:
        from ``ranks`` ({name: rank}) when given, else from ``names``, else ``workerN``
        is written as N, which is how :meth:`parse` reads ranks back."""
        if ranks is None:
            ranks = {name: rank for rank, name in (self.names or {}).items()}
            if self.names is None:
                for peer in self.peers:
                    match = _WORKER_RANK.fullmatch(peer)
                    if match and f"worker{int(match.group(1))}" == peer:
                        ranks[peer] = int(match.group(1))
        items = []
        for pair in self.pairs:
            local, remote = _cuda_index(pair.local), _cuda_index(pair.remote)
            if local is None or remote is None or local < 0 or remote < 0:
                raise ValueError(
                    CANNOT_WRITE_PAIR.format(peer=pair.peer, local=pair.local, remote=pair.remote)
                )
            if pair.peer in ranks:
                peer = str(ranks[pair.peer])
            elif (
                _RANK.fullmatch(pair.peer)
                or "," in pair.peer
                or pair.peer != pair.peer.strip()
                or not pair.peer
            ):
                raise ValueError(CANNOT_WRITE_PEER.format(peer=pair.peer))
            else:
                peer = pair.peer
            items.append(f"{peer}_{local}_{remote}")
        return ",".join(items)

    def to_python(self, options_var: str = "options") -> str:
        """Python lines that set this map on a ``TensorPipeRpcBackendOptions`` named
        ``options_var``, one ``set_device_map`` per peer. Devices are written as strings:
        torch 2.13 turns an int device into "the current accelerator", which raises on a
        machine without one."""
        lines = [
            f"{options_var}.set_device_map({peer!r}, {device_map!r})"
            for peer, device_map in self.to_dict().items()
        ]
        return "\n".join(lines) + ("\n" if lines else "")

    def apply(
        self,
        options: TensorPipeRpcBackendOptions,
        *,
        devices: Iterable[str | int | torch.device] | None = None,
    ) -> None:
        """Set this map on ``options`` (``set_device_map`` once per peer), after
        :meth:`check` without device lists.

        ``devices``, when given, goes to ``options.set_devices`` (sorted). Without it the
        options' devices stay as they are: when empty, torch derives them at
        ``init_rpc`` from this map and from the maps other workers have onto this one.
        Listing only this map's local devices would make torch refuse a peer that maps
        onto another device of this worker ("unexpected target devices").
        """
        self.check()
        for peer, device_map in self.to_dict().items():
            as_torch_takes: dict[Any, Any] = dict(device_map)
            options.set_device_map(peer, as_torch_takes)
        if devices is not None:
            listed: list[Any] = sorted(
                {_normalise(d, self.me or "this worker") for d in devices}, key=_sort_key
            )
            options.set_devices(listed)

    # -- display ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        extra = f", me={self.me!r}" if self.me is not None else ""
        try:
            return f"DeviceMap.parse({self.to_dict()!r}{extra})"
        except ValueError:
            return f"DeviceMap({list(self.pairs)!r}{extra})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        title = f"DeviceMap for {self.me}" if self.me else "DeviceMap"
        if not self.pairs:
            p.text(f"{title}: empty (CPU tensors only)")
            return
        p.text(f"{title}:")
        for peer in self.peers:
            entries = ", ".join(f"{q.local} -> {q.remote}" for q in self.pairs if q.peer == peer)
            p.break_()
            p.text(f"  {peer}: {entries}")


def _parse_string(spec: str, names: Mapping[int, str]) -> list[Pair]:
    pairs = []
    for raw_item in spec.split(","):
        item = raw_item.strip()
        if not item:
            continue
        fields = [field.strip() for field in item.rsplit("_", 2)]
        if len(fields) != 3 or not fields[0]:
            raise ValueError(PARSE_ITEM.format(item=item))
        peer_field, local_field, remote_field = fields
        for field in (local_field, remote_field):
            if not _INDEX.fullmatch(field):
                raise ValueError(PARSE_INDEX.format(field=field, item=item))
        if _RANK.fullmatch(peer_field):
            peer = _peer_name(int(peer_field), names)
        else:
            peer = peer_field
        pairs.append(Pair(peer, f"cuda:{int(local_field)}", f"cuda:{int(remote_field)}"))
    return pairs
