"""Which path a tensor takes: TensorPipe's transports and channels, and a model that
predicts TensorPipe's choice for every pair of members.

TensorPipe picks one transport per pipe and, per (source device, target device) pair, the
highest-priority channel both sides find viable (DESIGN.md, "TensorPipe channel choice").
Each member reports the facts that choice depends on (``local_facts``, read by
``rpcnb.machine``, sent to the leader when the member registers);
``predict`` turns them into a transport and channels per pair, with the reason; and
``observed`` reads what TensorPipe's own verbose log says it did, to check the model.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from rpcnb import telemetry, text
from rpcnb.machine import Facts, process_facts
from rpcnb.session import protocol, roster, state
from rpcnb.wire.options import CHANNELS, TRANSPORTS

# =========================================================================== the model
#
# TensorPipe decides per pipe. The side that accepts the pipe (the callee of the first
# call) reads the caller's "brochure" (its transports and channels, each with a domain or
# device descriptor) and walks its *own* transports and channels from the highest
# priority down, taking the first one the caller also registered and whose descriptors
# say the two can talk. So the pipe ``a -> b`` follows ``b``'s priorities. A transport or
# channel that is not viable on a process is never registered there, so never
# advertised. The descriptors, as TensorPipe builds them (tensorpipe/transport/shm and
# tensorpipe/channel/cma, cuda_ipc, ...):
#   shm transport   boot id + network namespace; viable when a memfd can be mapped
#   uv transport    always compatible;  ibv: libibverbs + an IB device on both sides
#   cma channel     boot id + pid ns + user ns + uid/gid (real = effective = saved)
#                   + permitted capabilities; viable when dumpable, yama ptrace_scope
#                   0 or 1, and process_vm_readv on itself works (seccomp)
#   mpt_uv, basic   always compatible
#   cuda_xth        same process;  cuda_ipc: same boot id, other pid, NVML peer access
#   cuda_gdr        IB NIC + nv_peer_mem on both sides;  cuda_basic: any CUDA pair


CPU_CHANNELS = ("cma", "mpt_uv", "basic")
CUDA_CHANNELS = ("cuda_xth", "cuda_ipc", "cuda_gdr", "cuda_basic")

NOT_IN_GROUP = "{name!r} is not a member of the group ({known}): name a member shown by %rpc_workers."


def local_facts() -> dict[str, Any]:
    """This process's facts, as a plain dict: the machine's (``rpcnb.machine``), with its
    name and TensorPipe settings when it is in a group. Other members get them with the
    ``facts`` request."""
    facts = process_facts()
    s = state.active()
    if s is not None:
        facts["name"] = s.name
        facts["transports"] = list(s.options.transports)
        facts["channels"] = list(s.options.channels) if s.options.channels else None
    return facts


def gather(names: list[str] | None = None, timeout: float = 10.0) -> dict[str, Facts]:
    """Every live member's facts: reported when it registered, else asked over RPC once,
    then kept with the group (a later group in this process has its own worker1)."""
    s = state.current()
    live = roster.live_names(s)
    wanted = live if names is None else names
    for name in wanted:
        if name not in live:
            raise ValueError(NOT_IN_GROUP.format(name=name, known=", ".join(live)))
    known = s.facts_of(wanted)
    futs = {}
    for name in wanted:
        if name == s.name and name not in known:
            s.note_facts(name, local_facts())
        elif name not in known:
            futs[name] = protocol.call_async(s.token, name, "facts", timeout=timeout)
    for name, fut in futs.items():
        s.note_facts(name, fut.wait())
    return {name: Facts.from_dict(facts) for name, facts in s.facts_of(wanted).items()}


# -- what each process registers ---------------------------------------------------------


def _priorities(configured: list[str] | None, defaults: dict[str, int]) -> dict[str, int]:
    """Name -> priority: torch's defaults, or the list order when one was given."""
    if configured is None:
        return dict(defaults)
    n = len(configured)
    return {name: n - 1 - i for i, name in enumerate(configured) if name in defaults}


def _cma_blocker(f: Facts) -> str | None:
    """Why cma is not viable on this process, or None (tensorpipe/channel/cma)."""
    if not (f.uids[0] == f.uids[1] == f.uids[2] and f.gids[0] == f.gids[1] == f.gids[2]):
        return f"{f.name}'s real, effective and saved uids/gids differ"
    if not f.dumpable:
        return f"{f.name} is not dumpable"
    if f.ptrace_scope is not None and f.ptrace_scope >= 2:
        return f"ptrace_scope={f.ptrace_scope} on {f.host}"
    if f.lsms is not None and "yama" in f.lsms and f.ptrace_scope is None:
        return f"yama is active on {f.host} but its ptrace_scope cannot be read"
    if not f.cma_selftest:
        return f"process_vm_readv is blocked in {f.name} (a seccomp filter)"
    return None


def viable(f: Facts) -> dict[str, str | None]:
    """For every transport and channel: None when viable on ``f``, else why not."""
    out: dict[str, str | None] = {
        "shm": None if f.memfd else f"{f.name} cannot map a memfd",
        "ibv": None if (f.ibverbs and f.ib_devices) else f"no InfiniBand device on {f.host}",
        "uv": None,
        "cma": _cma_blocker(f),
        "mpt_uv": None,
        "basic": None,
    }
    no_cuda = ("this torch has no CUDA" if not f.cuda_built
               else f"{f.name} sees no CUDA device" if not f.cuda_devices else None)
    for name in CUDA_CHANNELS:
        out[name] = no_cuda
    if no_cuda is None and not (f.ib_devices and f.nv_peer_mem):
        out["cuda_gdr"] = f"no InfiniBand NIC with nv_peer_mem on {f.host}"
    return out


def registered(f: Facts, kind: str) -> dict[str, int]:
    """The transports (kind='transport') or channels ``f`` registered, with priorities."""
    defaults = TRANSPORTS if kind == "transport" else CHANNELS
    configured = f.transports if kind == "transport" else f.channels
    ok = viable(f)
    return {n: p for n, p in _priorities(configured, defaults).items() if ok.get(n) is None}


def _not_offered(name: str, f: Facts, kind: str) -> str:
    configured = f.transports if kind == "transport" else f.channels
    if configured is not None and name not in configured:
        flag = "--transports" if kind == "transport" else "--channels"
        if kind == "transport" and list(configured) == ["uv"]:
            return f"off in {f.name}: rpcnb's default transport is uv ({flag} shm,uv allows it)"
        return f"not in {f.name}'s {flag}"
    return viable(f).get(name) or f"{f.name} does not offer {name}"


# -- the prediction ------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """What TensorPipe will use, and why (and why not the ones above it)."""

    name: str
    reason: str
    passed: tuple[str, ...] = ()  # higher-priority candidates, each "name: why not"


@dataclass(frozen=True)
class PairPrediction:
    """The pipe ``src -> dst``: calls from src to dst and their responses."""

    src: str
    dst: str
    transport: Choice
    channels: dict[str, Choice]  # "cpu->cpu", "cuda:0->cuda:1" (src device -> dst device)

    def channel_names(self) -> set[str]:
        """The channels TensorPipe opens for this pipe: those chosen for a device pair
        ("none", a pair no channel carries, opens nothing)."""
        return {c.name for c in self.channels.values() if c.name != "none"}

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src, "dst": self.dst,
            "transport": asdict(self.transport),
            "channels": {pair: asdict(c) for pair, c in self.channels.items()},
        }


def _same_host(a: Facts, b: Facts) -> bool:
    return a.boot_id == b.boot_id


def _transport_fit(name: str, a: Facts, b: Facts) -> str | None:
    """Why transport ``name`` cannot join a and b (None: it can)."""
    if name == "shm":
        if not _same_host(a, b):
            return "different hosts (boot ids differ)"
        if a.net_ns != b.net_ns:
            return f"different network namespaces ({a.net_ns} vs {b.net_ns})"
    return None


def _transport_reason(name: str, a: Facts, b: Facts) -> str:
    if name == "shm":
        return f"shm: same host ({a.host}) and same network namespace"
    if name == "ibv":
        return f"ibv: InfiniBand on both ({', '.join(a.ib_devices)} / {', '.join(b.ib_devices)})"
    iface = b.socket_ifname or "the interface its host name resolves to"
    return f"uv: TCP, {b.name} listens on {iface}"


def _cma_fit(a: Facts, b: Facts) -> str | None:
    if not _same_host(a, b):
        return "different hosts"
    if a.pid_ns != b.pid_ns:
        return f"different pid namespaces ({a.pid_ns} vs {b.pid_ns})"
    if a.user_ns != b.user_ns:
        return f"different user namespaces ({a.user_ns} vs {b.user_ns})"
    if a.uids[0] != b.uids[0] or a.gids[0] != b.gids[0]:
        return f"different users (uid {a.uids[0]} vs {b.uids[0]})"
    checks_caps = a.lsms is None or "capability" in a.lsms
    if checks_caps and a.cap_permitted != b.cap_permitted:
        return "different permitted capabilities"
    return None


def _cma_reason(a: Facts, b: Facts) -> str:
    scope = "no yama" if b.ptrace_scope is None else f"ptrace_scope={b.ptrace_scope}"
    return f"cma: same host, {scope}, uid {b.uids[0]}"


def _cuda_fit(name: str, a: Facts, da: dict[str, Any], b: Facts, db: dict[str, Any]) -> str | None:
    if name == "cuda_xth":
        return "different processes" if (a.pid, a.boot_id) != (b.pid, b.boot_id) else None
    if name == "cuda_ipc":
        if not _same_host(a, b):
            return "different hosts"
        if a.pid == b.pid:
            return "same process"
        row = b.p2p.get(db["uuid"], {})
        back = b.p2p.get(da["uuid"], {})
        if da["uuid"] not in row:
            return f"peer access between {da['uuid'][:8]} and {db['uuid'][:8]} is unknown to {b.name}"
        if not (row[da["uuid"]] and back.get(db["uuid"], False)):
            return "no peer-to-peer access between the two GPUs"
        return None
    return None  # cuda_gdr and cuda_basic: viability already decided


def _choose(kind: str, names: list[str], a: Facts, b: Facts,
            fit: Any, reason: Any) -> Choice:
    """Walk ``names`` as ``b`` (the accepting side) orders them; the first that both
    registered and that ``fit`` accepts wins. Its reason says why each better one was
    passed over."""
    defaults = TRANSPORTS if kind == "transport" else CHANNELS
    mine, theirs = registered(a, kind), registered(b, kind)
    order = sorted(names, key=lambda n: (n not in theirs, -theirs.get(n, 0), -defaults[n]))
    passed: list[str] = []
    for name in order:
        if name not in theirs:
            break  # the rest were never offered by b; explained below
        why = _not_offered(name, a, kind) if name not in mine else fit(name)
        if why:
            passed.append(f"{name}: {why}")
            continue
        # also say why better ones by default were not there at all
        skipped = [f"{n}: {_not_offered(n, b if n not in theirs else a, kind)}"
                   for n in names if (n not in theirs or n not in mine)
                   and defaults[n] > defaults[name] and not any(p.startswith(n + ":") for p in passed)]
        passed = sorted(passed + skipped, key=lambda p: -defaults[p.split(":")[0]])
        text = reason(name)
        if passed:
            text += f" ({'; '.join(passed)})"
        return Choice(name, text, tuple(passed))
    passed += [f"{n}: {_not_offered(n, b if n not in theirs else a, kind)}"
               for n in names if n not in theirs or n not in mine
               if not any(p.startswith(n + ":") for p in passed)]
    what = "transport" if kind == "transport" else "channel"
    return Choice("none", f"no {what} both offer and can use: the pipe cannot carry this",
                  tuple(passed))


_CUDA_REASONS = {
    "cuda_xth": "cuda_xth: same process",
    "cuda_ipc": "cuda_ipc: same host, peer-to-peer access between the GPUs",
    "cuda_gdr": "cuda_gdr: GPUDirect RDMA over InfiniBand",
    "cuda_basic": "cuda_basic: copied through host memory",
}


_CPU_CUDA_REASON = ("cuda_basic: the only channel that pairs a CPU with a GPU (TensorPipe "
                    "opens it for every pipe between two CUDA members)")


def predict_pair(a: Facts, b: Facts) -> PairPrediction:
    """The transport and the channel per device pair of the pipe ``a -> b``."""
    transport = _choose("transport", list(TRANSPORTS), a, b,
                        lambda n: _transport_fit(n, a, b),
                        lambda n: _transport_reason(n, a, b))

    def cpu_fit(name: str) -> str | None:
        return _cma_fit(a, b) if name == "cma" else None

    def cpu_reason(name: str) -> str:
        if name == "cma":
            return _cma_reason(a, b)
        if name == "mpt_uv":
            return "mpt_uv: TCP over 16 lanes"
        return f"basic: the data rides the {transport.name} transport"

    channels = {"cpu->cpu": _choose("channel", list(CPU_CHANNELS), a, b, cpu_fit, cpu_reason)}
    for dev_a in a.cuda_devices:
        for dev_b in b.cuda_devices:
            label = f"cuda:{dev_a['index']}->cuda:{dev_b['index']}"
            channels[label] = _choose(
                "channel", list(CUDA_CHANNELS), a, b,
                lambda n, x=dev_a, y=dev_b: _cuda_fit(n, a, x, b, y),
                lambda n: _CUDA_REASONS[n])
    # cuda_basic is the one channel that also advertises the CPU (staging through it), so
    # TensorPipe pairs a CPU with a GPU through it whenever both sides registered it
    if "cuda_basic" in registered(a, "channel") and "cuda_basic" in registered(b, "channel"):
        for dev_b in b.cuda_devices:
            channels[f"cpu->cuda:{dev_b['index']}"] = Choice("cuda_basic", _CPU_CUDA_REASON)
        for dev_a in a.cuda_devices:
            channels[f"cuda:{dev_a['index']}->cpu"] = Choice("cuda_basic", _CPU_CUDA_REASON)
    return PairPrediction(a.name, b.name, transport, channels)


def predict(facts: dict[str, Facts]) -> dict[tuple[str, str], PairPrediction]:
    """Every ordered pair of distinct members: ``(src, dst) -> PairPrediction``."""
    return {(a, b): predict_pair(fa, fb)
            for a, fa in facts.items() for b, fb in facts.items() if a != b}


def predict_group(names: list[str] | None = None) -> dict[tuple[str, str], PairPrediction]:
    """``predict`` over the live group (facts gathered over RPC)."""
    return predict(gather(names))


def ucx_paths() -> dict[tuple[str, str], str]:
    """(sender, receiver) -> "ucx: <transport>" for every pair that moved a tensor over
    UCX, as the senders recorded it (asked of every live member)."""
    s = state.current()
    out: dict[tuple[str, str], str] = {}
    for name in roster.live_names(s):
        try:
            stats = (telemetry.peer_stats() if name == s.name
                     else protocol.call(s.token, name, "peer_stats", timeout=5))
        except Exception:
            continue
        for peer, st in stats.items():
            if st.get("ucx"):
                out[(name, peer)] = st["ucx"]
    return out


def describe_ucx(paths: dict[tuple[str, str], str]) -> str:
    """The lines %rpc_channels adds for pairs that moved tensors over UCX ("" if none)."""
    if not paths:
        return ""
    return "\n\nover UCX (measured):\n" + "\n".join(
        f"  {src} -> {dst}: {path}" for (src, dst), path in sorted(paths.items()))


# -- what TensorPipe says it did ---------------------------------------------------------

# Pipe names: "<me>_to_<peer>" for the pipe this process opened, "<me>[lN]_from_<peer>"
# for one it accepted. Connection and channel renames at TP_VERBOSE_LOGGING >= 7 (the
# channel renames already at 4) tie a transport and each channel to its pipe.
VERBOSE_LEVEL = 7
_CONN = re.compile(r"Connection \S+ was renamed to (?P<pipe>\S+?)\.(?P<role>[dr])\.tr_(?P<name>\w+)\s*$")
_CHAN = re.compile(r"Channel \S+ was renamed to (?P<pipe>\S+?)\.ch_(?P<name>[a-z_]+)\s*$")
_ACCEPTED = re.compile(r"^(?P<me>.+)\[l\d+\]_from_(?P<peer>.+)$")
_OPENED = re.compile(r"^(?P<me>.+)_to_(?P<peer>.+)$")


def _pipe_direction(pipe: str) -> tuple[str, str] | None:
    """(src, dst) of the pipe: src opened it, dst accepted it."""
    m = _ACCEPTED.match(pipe)
    if m:
        return m.group("peer"), m.group("me")
    m = _OPENED.match(pipe)
    if m:
        return m.group("me"), m.group("peer")
    return None


def observed(log_text: str) -> dict[tuple[str, str], dict[str, Any]]:
    """From TensorPipe's verbose log (TP_VERBOSE_LOGGING=7): for each pipe ``(src, dst)``
    the transport it settled on and the channels it opened."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for line in log_text.splitlines():
        m = _CONN.search(line)
        if m:
            key = _pipe_direction(m.group("pipe"))
            if key:
                # the descriptor connection first goes over the bootstrap transport, then
                # is replaced by one over the chosen transport: the last one counts
                out.setdefault(key, {"transport": None, "channels": set()})["transport"] = m.group("name")
            continue
        m = _CHAN.search(line)
        if m:
            key = _pipe_direction(m.group("pipe"))
            if key:
                out.setdefault(key, {"transport": None, "channels": set()})["channels"].add(m.group("name"))
    return out


def describe(predictions: dict[tuple[str, str], PairPrediction]) -> str:
    """A plain-text table of the predictions (what %rpc_channels prints without widgets)."""
    rows = [("from", "to", "transport", "device pair", "channel", "why")]
    for (src, dst), p in sorted(predictions.items()):
        for i, (pair, c) in enumerate(p.channels.items()):
            rows.append((src if i == 0 else "", dst if i == 0 else "",
                         p.transport.name if i == 0 else "", pair, c.name, c.reason))
    table = text.table(rows)
    # the transport's reason is the same for most pairs: list each distinct one once
    transports = sorted({f"{p.transport.name}: {p.transport.reason.split(': ', 1)[-1]}"
                         for p in predictions.values()})
    return table + "\n\ntransport: " + "\n           ".join(transports)


def describe_paths(stats: dict[str, dict[str, Any]]) -> str:
    """The tensors this process sent by rpcnb's own paths, per peer (``stats``:
    ``telemetry.peer_stats()``): ``rpcnb_shm`` copied through a shared-memory buffer,
    ``zero_copy`` handed over by handle (shared pages). Empty when there were none."""
    rows: list[tuple[str, ...]] = [("to", "path", "tensors", "MB")]
    for peer, st in sorted(stats.items()):
        for path, n in sorted((st.get("paths") or {}).items()):
            rows.append((peer, path, str(n["tensors"]), f"{n['bytes'] / (1 << 20):.1f}"))
    if len(rows) == 1:
        return ""
    return "tensors this process sent by rpcnb's own paths:\n" + text.table(rows)
