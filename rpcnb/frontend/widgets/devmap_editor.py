"""The device-map editor: pick, for each local device, the device it lands on at each
peer; see TensorPipe's objections as you edit, and the map written three ways.

Peers and devices come from the live group, or from a declared topology
(``{"worker0": 2, "worker1": 2}`` or ``"worker0=2,worker1=2"``: CUDA devices per member)
to plan on a machine without GPUs; a topology given while a group runs overrides the
devices of the members it names. "Apply" keeps the map (``rpcnb.wire.options.applied_device_map``)
for the next ``%rpc_init`` or ``--join`` of this kernel: maps are fixed when a process
joins.
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from rpcnb.frontend.widgets.dom import esm
from rpcnb.wire.devicemap import DeviceMap
from rpcnb.wire.options import keep_device_map

BAD_TOPOLOGY = (
    "{spec!r} is not a topology: write {{'worker0': 2, 'worker1': 2}} or 'worker0=2,worker1=2' "
    "(CUDA devices per member)."
)
NO_MEMBERS = (
    "There is no group to edit a map for: run %rpc_init first, or declare the members with "
    "--topology worker0=2,worker1=2."
)
NOT_APPLIED = "Not applied: fix the problems listed above first."
APPLIED = (
    "Applied: the next %rpc_init (or %rpc_init --join) of this kernel uses this map "
    "unless --device-map is given."
)
APPLIED_EMPTY = "Applied: no device map (CPU tensors only) for the next %rpc_init or --join."


def parse_topology(spec: Any) -> dict[str, list[str]]:
    """``{"w0": 2}`` / ``{"w0": ["cuda:0"]}`` / ``"w0=2,w1=1"`` -> ``{name: ["cuda:0", ...]}``."""
    items: list[tuple[Any, Any]]
    if isinstance(spec, str):
        items = []
        for part in spec.split(","):
            if not part.strip():
                continue
            name, sep, count = part.partition("=")
            if not sep:
                raise ValueError(BAD_TOPOLOGY.format(spec=spec))
            items.append((name.strip(), count.strip()))
    elif isinstance(spec, dict):
        items = list(spec.items())
    else:
        raise ValueError(BAD_TOPOLOGY.format(spec=spec))
    out: dict[str, list[str]] = {}
    for name, devices in items:
        if not isinstance(name, str) or not name:
            raise ValueError(BAD_TOPOLOGY.format(spec=spec))
        if isinstance(devices, (int, str)) and str(devices).isdigit():
            out[name] = [f"cuda:{i}" for i in range(int(devices))]
        elif isinstance(devices, (list, tuple)):
            out[name] = [str(d) for d in devices]
        else:
            raise ValueError(BAD_TOPOLOGY.format(spec=spec))
    return out


class DeviceMapEditor(anywidget.AnyWidget):
    """``DeviceMapEditor()`` (live group) or ``DeviceMapEditor(topology=...)``; ``%rpc_devmap``."""

    _esm = esm("devmap_editor.js")

    me = traitlets.Unicode("").tag(sync=True)
    source = traitlets.Unicode("").tag(sync=True)  # where peers and devices came from
    local_devices = traitlets.List(traitlets.Unicode()).tag(sync=True)
    peers = traitlets.List(traitlets.Dict()).tag(sync=True)  # [{name, host, devices}]
    mapping = traitlets.Dict().tag(sync=True)  # peer -> {local: remote}; "" = not mapped
    problems = traitlets.List(traitlets.Dict()).tag(sync=True)  # [{peer, device, message}]
    forms = traitlets.Dict().tag(sync=True)  # dict / string / python
    applied = traitlets.Unicode("").tag(sync=True)

    def __repr__(self) -> str:
        state = f"{len(self.problems)} problem(s)" if self.problems else "valid"
        return (f"<DeviceMapEditor for {self.me}: {self.forms.get('string') or 'empty map'}, "
                f"{state}>")

    def __init__(self, topology: Any = None, me: str | None = None,
                 initial: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from rpcnb.session import state

        declared = parse_topology(topology) if topology is not None else {}
        hosts: dict[str, str] = {}
        devices: dict[str, list[str]] = {}
        self._ranks: dict[str, int] = {}
        if state.is_initialized():
            from rpcnb.membership.view import group as current_group

            group = current_group()
            for m in group.members:
                if m.alive:
                    hosts[m.name] = m.host
                    devices[m.name] = list(m.devices)
                    self._ranks[m.name] = m.rank
            name = group.me
            self.source = "live group" + (" with a declared topology" if declared else "")
            if initial is None:
                initial = state.current().options.device_map
        else:
            if not declared:
                raise ValueError(NO_MEMBERS)
            name = me or "worker0"
            self.source = "declared topology"
        for member, devs in declared.items():
            devices[member] = devs
            hosts.setdefault(member, "declared")
        if name not in devices:
            devices[name] = []
        self.me = name
        self.local_devices = devices[name]
        self.peers = [{"name": n, "host": hosts.get(n, ""), "devices": devices[n]}
                      for n in devices if n != name]
        start = DeviceMap.parse(initial, me=name) if initial else DeviceMap(me=name)
        mapping: dict[str, dict[str, str]] = {p["name"]: {} for p in self.peers}
        for pair in start:
            mapping.setdefault(pair.peer, {})[pair.local] = pair.remote
        self.observe(self._validate, names=["mapping"])
        self.mapping = mapping
        self._validate()
        self.on_msg(self._on_msg)

    # -- the model ------------------------------------------------------------------------

    def device_map(self) -> DeviceMap:
        """The map as edited (entries left "not mapped" are dropped)."""
        spec = {peer: {local: remote for local, remote in entries.items() if remote}
                for peer, entries in self.mapping.items()}
        return DeviceMap.parse({p: m for p, m in spec.items() if m}, me=self.me)

    def _validate(self, change: Any = None) -> None:
        dm = self.device_map()
        peer_devices = {p["name"]: list(p["devices"]) for p in self.peers}
        problems = dm.validate(list(self.local_devices), peer_devices)
        self.problems = [{"peer": p.peer, "device": p.device or "", "message": p.message}
                         for p in problems]
        forms: dict[str, str] = {}
        try:
            forms["dict"] = repr(dm.to_dict())
        except ValueError as exc:
            forms["dict"] = str(exc)
        try:
            forms["string"] = dm.to_string(ranks=self._ranks or None)
        except ValueError as exc:
            forms["string"] = str(exc)
        try:
            forms["python"] = dm.to_python().rstrip("\n") or "# no device map"
        except ValueError as exc:
            forms["python"] = str(exc)
        self.forms = forms
        self.applied = ""

    def apply(self) -> DeviceMap:
        """Keep the map for the next ``%rpc_init`` / ``--join``; ValueError if invalid."""
        if self.problems:
            self.applied = NOT_APPLIED
            raise ValueError(NOT_APPLIED)
        dm = self.device_map()
        keep_device_map(dm.to_dict() or None)
        self.applied = APPLIED if len(dm) else APPLIED_EMPTY
        return dm

    def _on_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        if isinstance(content, dict) and content.get("event") == "apply":
            try:
                self.apply()
            except ValueError:
                pass
