"""This process's membership in an RPC group: init, join, run, shutdown, the registry.

The first kernel (``init``) is rank 0, holds the rendezvous store (a file under a private
temporary directory, so nothing listens) and leaves last. Other kernels ``join``; worker
processes are started by ``launch``. Names and ranks are never reused in one group.

rpcnb also repairs what torch's dynamic membership cannot: when a member dies, the first
kernel removes it from the group so later joins and the final shutdown do not hang.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpcnb import errors, launch, rendezvous, telemetry
from rpcnb.errors import RemoteError, RpcnbError, WorkerDiedError

DEFAULT_THREADS = 16
DEFAULT_TRANSPORTS = ["uv"]
DEFAULT_RPC_TIMEOUT = 60.0
START_TIMEOUT = 120.0
INTERRUPT_GRACE = 3.0  # seconds a cell gets to stop after an interrupt
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")
_TOKEN_KEY = "RpcGroupManagementToken"
ALL = "--all"


# --------------------------------------------------------------------------- state


@dataclass
class Member:
    """What rpcnb knows about one member of the group."""

    name: str
    rank: int
    host: str = ""
    pid: int | None = None
    kind: str = "process"  # "process" (started by rpcnb) or "kernel"
    devices: list[str] = field(default_factory=list)
    alive: bool = True
    how: str = ""  # how it died or left
    calls: int = 0
    recent_ms: float | None = None


@dataclass
class Group:
    """The group as seen from this process; ``print()`` it for a table."""

    me: str
    leader: str
    address: str  # the connection file (or tcp:// address) another kernel joins with
    members: list[Member]
    remote: bool = False  # reachable from other hosts (--allow-remote)

    @property
    def join_line(self) -> str:
        """The line another kernel on this host runs to join."""
        return f"%rpc_init --join {self.address} --name NAME"

    def table(self) -> str:
        """The members as a plain-text table."""
        rows = [("name", "rank", "host", "pid", "kind", "devices", "alive", "calls", "recent")]
        for m in self.members:
            rows.append((
                m.name + (" (this kernel)" if m.name == self.me else ""),
                str(m.rank), m.host, str(m.pid or "-"), m.kind,
                ",".join(m.devices) or "cpu",
                "yes" if m.alive else f"no: {m.how}",
                str(m.calls),
                "-" if m.recent_ms is None else f"{m.recent_ms:.2f} ms",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def __str__(self) -> str:
        return (f"rpcnb group of {sum(m.alive for m in self.members)} "
                f"(this process is {self.me}, {self.leader} holds the rendezvous)\n"
                f"{self.table()}\n"
                f"Join from another kernel on this host:\n  {self.join_line}"
                + ("\nFrom another host: %rpc_init --join tcp://HOST:PORT --token TOKEN "
                   "--name NAME (the token is in the connection file)" if self.remote else ""))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


@dataclass
class _Call:
    call_id: str
    worker: str
    inbox: queue.Queue[tuple[str, str, int, list[Any]]]
    future: Any = None
    next_seq: int = 0
    held: dict[int, list[Any]] = field(default_factory=dict)
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    warned: bool = False
    started: float = field(default_factory=time.monotonic)


class _Session:
    def __init__(self, name: str, rank: int, leader: str, init_method: str,
                 options: dict[str, Any], group_dir: Path | None, runner: Any,
                 secret: str = "") -> None:
        self.name = name
        self.secret = secret
        self.token = rendezvous.call_token(secret)
        self.connection_path: Path | None = None
        self.listen: tuple[str, int] | None = None  # a TCP store this process serves
        self.rank = rank
        self.leader = leader
        self.init_method = init_method
        self.options = options
        self.group_dir = group_dir  # only on the leader, which owns it
        self.runner = runner
        self.procs: dict[str, launch.LocalWorker] = {}
        self.members: dict[str, Member] = {}
        self.dead: dict[str, str] = {}
        self.calls: dict[str, _Call] = {}
        self.lock = threading.RLock()
        self.closing = False
        self.watcher: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.name == self.leader

    def live_names(self) -> list[str]:
        """Members that are alive and admitted (proved they know the group's secret)."""
        infos = sorted(_agent().get_worker_infos(), key=lambda w: w.id)
        names = [w.name for w in infos if w.name not in self.dead]
        if not self.is_leader and any(n not in self.members for n in names):
            self.refresh_registry()
        return [n for n in names if n in self.members]

    def refresh_registry(self) -> None:
        """Non-leaders learn who was admitted from the leader."""
        import torch.distributed.rpc as rpc

        try:
            admitted = rpc.rpc_sync(self.leader, _registry, args=(self.token,), timeout=5)
        except Exception:
            return
        with self.lock:
            for name, rank in admitted:
                self.members.setdefault(name, Member(name, rank))


_session: _Session | None = None


def _require() -> _Session:
    if _session is None:
        raise RpcnbError(errors.NOT_INITIALIZED)
    return _session


def is_initialized() -> bool:
    """Whether this process is in a group now."""
    return _session is not None


def active() -> _Session | None:
    """This process's session, or None (compare by identity to tell groups apart)."""
    return _session


def current() -> _Session:
    """This process's session (raises RpcnbError when it is in no group)."""
    return _require()


# --------------------------------------------------------------------------- membership


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(errors.BAD_NAME.format(name=name))


def _rpc_options(options: dict[str, Any], init_method: str) -> Any:
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
    kwargs["_transports"] = list(options.get("transports") or DEFAULT_TRANSPORTS)  # old callers
    opts = rpc.TensorPipeRpcBackendOptions(**kwargs)
    if options.get("device_map"):
        from rpcnb.devicemap import DeviceMap

        DeviceMap.parse(options["device_map"]).apply(opts)
    return opts


def check_device_map(spec: Any, me: str, names: dict[int, str] | None = None) -> dict[str, Any]:
    """Parse and validate a device map (dict or DI-engine string) for this machine before
    anything starts; its plain dict form. Raises ValueError naming peer and device."""
    from rpcnb.devicemap import DeviceMap, machine_devices

    dm = DeviceMap.parse(spec, me=me, names=names)
    dm.check(local_devices=machine_devices())
    return dm.to_dict()


def validate_options(threads: int = DEFAULT_THREADS, timeout: float = DEFAULT_RPC_TIMEOUT,
                     channels: Iterable[str] | None = None,
                     transports: Iterable[str] | None = None) -> dict[str, Any]:
    """Check TensorPipe settings before any process starts; return them as plain data."""
    from rpcnb import channels as ch

    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, not {threads!r}.")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    opts: dict[str, Any] = {"threads": threads, "timeout": float(timeout)}
    if channels:
        opts["channels"] = ch.check_names(list(channels), "channel")
    opts["transports"] = (ch.check_names(list(transports), "transport") if transports
                          else list(DEFAULT_TRANSPORTS))
    return opts


# torch's distributed autograd keeps the first worker id a process had and refuses any
# other one later; so a process keeps its first rank in every group it is in after that.
_autograd_rank: int | None = None


def _claim_rank(store: Any, rank: int) -> bool:
    mine = f"{os.getpid()}-{uuid.uuid4().hex}"
    return bool(store.compare_set(f"rpcnb/rank/{rank}", "", mine).decode() == mine)


def _next_rank(store: Any) -> int:
    """A rank nobody in this group had: counted up, skipping ranks already claimed."""
    while True:
        rank = int(store.add("rpcnb/next_rank", 1))
        if rank > 32767:  # torch's worker ids are int16
            raise RpcnbError("This group has used up its ranks (32767): start a new group.")
        if _claim_rank(store, rank):
            return rank


def _claim_name(store: Any, name: str) -> None:
    mine = f"{os.getpid()}-{uuid.uuid4().hex}"
    got = store.compare_set(f"rpcnb/used/{name}", "", mine).decode()
    if got != mine:
        raise RpcnbError(errors.NAME_TAKEN.format(name=name))


def start_member(name: str, rank: int, init_method: str, options: dict[str, Any], *,
                 leader: str, runner: Any, secret: str, group_dir: Path | None = None,
                 store: Any = None) -> _Session:
    """init_rpc with dynamic membership and make this process an rpcnb member.

    ``store``: a store this process serves itself (the leader of a TCP group); otherwise
    torch connects to ``init_method``."""
    global _session
    launch.apply_quiet_env()
    import torch.distributed.rpc as rpc

    from rpcnb import serialize, worker

    serialize.install()
    from rpcnb import shm

    # torch prefixes the store with a per-process init counter; every rpcnb group uses a
    # fresh store, so a kernel re-initialising after shutdown must start from 0 again.
    rpc._init_counter = 0  # type: ignore[attr-defined]
    backend_options = _rpc_options(options, init_method)
    if store is None:
        rpc.init_rpc(name, rank=rank, rpc_backend_options=backend_options)
    else:
        _init_rpc_with_store(name, rank, store, backend_options)
    global _autograd_rank
    _autograd_rank = rank
    if options.get("shm", True) and options.get("one_host", True):
        shm.activate(_group_id(init_method))
    _session = _Session(name, rank, leader, init_method, options, group_dir, runner, secret)
    worker._runner = runner
    from rpcnb import channels

    telemetry.clear()  # a new group: its worker1 is not the last group's worker1
    channels.forget()
    channels.local_facts()  # read now, at join: what TensorPipe decided by
    return _session


def _init_rpc_with_store(name: str, rank: int, store: Any, options: Any) -> None:
    """rpc.init_rpc for a dynamic group, on a store we made (bound to one address)."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import backend_registry

    store.set_timeout(datetime.timedelta(seconds=options.rpc_timeout))
    prefixed = dist.PrefixStore(rendezvous.STORE_PREFIX, store)
    rpc._init_counter = 1  # type: ignore[attr-defined]  # as init_rpc leaves it
    dist_autograd._init(rank)
    rpc._set_profiler_node_id(rank)  # type: ignore[attr-defined]
    rpc._init_rpc_backend(backend_registry.BackendType.TENSORPIPE,  # type: ignore[attr-defined]
                          prefixed, name, rank, None, options)


def _group_id(init_method: str) -> str:
    """A short id of the group (names its shared-memory buffers)."""
    return rendezvous.Connection(init_method, "", "").group_id


def _kernel_runner(name: str) -> Any:
    """A cell runner over this kernel's (or script's) own namespace."""
    from rpcnb import worker

    shell = _shell()
    if shell is not None:
        ns = shell.user_ns
    else:
        import __main__

        ns = __main__.__dict__
    runner = worker.CellRunner(name, ns, shell)
    worker.install_routing(shell)
    runner.start_thread()
    return runner


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return None
    return get_ipython()


def init(workers: int = 0, *, name: str = "worker0", threads: int = DEFAULT_THREADS,
         timeout: float = DEFAULT_RPC_TIMEOUT, channels: Iterable[str] | None = None,
         transports: Iterable[str] | None = None, shm: bool = True,
         device_map: Any = None, port: int | None = None, host: str = "127.0.0.1",
         allow_remote: bool = False) -> Group:
    """Start a group: this process becomes ``name`` (rank 0) and starts ``workers`` workers.

    The workers are named ``worker1``..``workerN``. ``device_map`` (torch's dict form or
    DI-engine's ``"1_0_1"`` string) is this process's map, checked before anything
    starts. By default the rendezvous is a file in a private temporary directory, so the
    group is reachable from this host only; ``port`` serves it over TCP on ``host``
    (loopback unless ``allow_remote``). Either way a random secret, kept in the connection
    file, is needed to join.
    """
    launch.apply_quiet_env()  # before torch is imported, if it is not yet
    if _session is not None:
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=_session.name))
    _check_name(name)
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be a whole number >= 0, not {workers!r}.")
    names = [f"worker{i}" for i in range(1, workers + 1)]
    if name in names:
        raise ValueError(errors.NAME_CLASH.format(name=name, n=workers))
    options = validate_options(threads, timeout, channels, transports)
    options["shm"] = bool(shm)
    if device_map is not None:
        ranks = {0: name, **{i: n for i, n in enumerate(names, start=1)}}
        options["device_map"] = check_device_map(device_map, name, ranks)
    if port is not None and not (isinstance(port, int) and 0 <= port < 65536):
        raise ValueError(f"--port must be a TCP port number (0-65535), not {port!r}.")
    host = rendezvous.check_host(host, allow_remote)
    remote = not ipaddress.ip_address(host).is_loopback
    if remote:
        options["one_host"] = False  # members may join from elsewhere: no shared memory
        iface = rendezvous.interface_of(host)
    if port is None and (remote or allow_remote):
        raise ValueError("--host/--allow-remote need --port: a group reachable from other "
                         "hosts meets over TCP.")

    secret = rendezvous.new_secret()
    group_dir = Path(tempfile.mkdtemp(prefix="rpcnb-"))
    session: _Session | None = None
    try:
        own_store = None
        if port is None:
            init_method = f"file://{group_dir / 'store'}"
        else:
            own_store, port = rendezvous.serve_store(host, port, options["timeout"])
            init_method = f"tcp://{host}:{port}"
            if remote:
                os.environ["TP_SOCKET_IFNAME"] = iface  # TensorPipe listens there too
        conn = rendezvous.Connection(init_method, secret, name)
        runner = _kernel_runner(name)
        my_rank = _autograd_rank if _autograd_rank is not None else 0
        session = start_member(name, my_rank, init_method, options, leader=name,
                               runner=runner, group_dir=group_dir, secret=secret,
                               store=own_store)
        session.connection_path = rendezvous.write_connection(group_dir, conn)
        if port is not None:
            session.listen = (host, port)
        if remote:
            print(rendezvous.REMOTE_EXPOSES.format(host=host, port=port, iface=iface))
        store = _agent_store()
        store.set("rpcnb/leader", name)
        _claim_name(store, name)
        _claim_rank(store, my_rank)
        session.members[name] = Member(name, 0, socket.gethostname(), os.getpid(), "kernel",
                                       _devices())
        # the device map is this kernel's own; workers start without one
        worker_options = {k: v for k, v in options.items() if k != "device_map"}
        for wname in names:
            _claim_name(store, wname)
            rank = _next_rank(store)
            session.procs[wname] = launch.start_worker(wname, rank, init_method, name,
                                                       group_dir, worker_options, secret)
        _wait_joined(session, list(session.procs.values()))
        for w in session.procs.values():
            session.members[w.name] = Member(w.name, w.rank, socket.gethostname(), w.pid,
                                             "process")
        if session.procs:  # each worker reports its channel facts (in the background)
            from rpcnb import channels as channel_model

            threading.Thread(target=_quietly, args=(channel_model.gather, list(session.procs)),
                             name="rpcnb-facts", daemon=True).start()
        session.watcher = threading.Thread(target=_watch, args=(session,),
                                           name="rpcnb-watch", daemon=True)
        session.watcher.start()
    except BaseException:
        _abort(session, group_dir)
        raise
    return group()


def _devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _agent() -> Any:
    """The TensorPipe agent (typed Any: its dynamic-group methods have no stubs)."""
    import torch.distributed.rpc as rpc

    return rpc.api._get_current_rpc_agent()


def _agent_store() -> Any:
    return _agent().store


def _wait_joined(session: _Session, started: list[launch.LocalWorker]) -> None:
    import torch.distributed.rpc as rpc

    agent = rpc.api._get_current_rpc_agent()
    deadline = time.monotonic() + START_TIMEOUT
    waiting = {w.name: w for w in started}
    while waiting:
        joined = {w.name for w in agent.get_worker_infos()}
        for wname in list(waiting):
            w = waiting[wname]
            if wname in joined:
                del waiting[wname]
            elif not w.alive():
                raise RpcnbError(errors.START_FAILED.format(name=wname, how=w.how_died(),
                                                            log=w.log_tail()))
            elif time.monotonic() > deadline:
                raise RpcnbError(errors.START_TIMEOUT.format(name=wname, timeout=START_TIMEOUT,
                                                             log=w.log_tail()))
        if waiting:
            time.sleep(0.02)


def _abort(session: _Session | None, group_dir: Path | None) -> None:
    """Undo a half-done init: stop what started, leave nothing running."""
    global _session
    if session is not None:
        from rpcnb import shm

        for w in session.procs.values():
            w.stop(grace=0.5)
            shm.remove_segments_of(w.pid)
        _local_shutdown(graceful=False)
        shm.deactivate()
        if session.runner is not None:
            session.runner.stop()
    _session = None
    if group_dir is not None:
        shutil.rmtree(group_dir, ignore_errors=True)


def join(address: str, name: str, *, token: str | None = None,
         threads: int = DEFAULT_THREADS, timeout: float | None = None, shm: bool = True,
         device_map: Any = None) -> Group:
    """Join a group as ``name``; remote cells sent to ``name`` run in this namespace.

    ``address`` is the connection file %rpc_init printed (or its directory, or the
    file:// store beside it); from another host, ``tcp://HOST:PORT`` with ``token``.
    """
    launch.apply_quiet_env()
    if _session is not None:
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=_session.name))
    _check_name(name)
    mapped = check_device_map(device_map, name) if device_map is not None else None
    conn = rendezvous.read_connection(address, token)
    store = rendezvous.open_store(conn.address)
    try:
        leader = store.get("rpcnb/leader").decode()
    except Exception as exc:
        raise RpcnbError(errors.JOIN_NOT_FOUND.format(addr=address)) from exc
    _claim_name(store, name)
    if _autograd_rank is None:
        rank = _next_rank(store)
    elif not _claim_rank(store, _autograd_rank):
        raise RpcnbError(errors.RANK_FIXED.format(rank=_autograd_rank))
    else:
        rank = _autograd_rank
    opts = validate_options(threads, timeout if timeout is not None else DEFAULT_RPC_TIMEOUT)
    opts["shm"] = shm
    if conn.is_tcp:
        host, _, port = conn.address[len("tcp://"):].rpartition(":")
        if not ipaddress.ip_address(host.strip("[]")).is_loopback:
            opts["one_host"] = False
            os.environ["TP_SOCKET_IFNAME"] = rendezvous.interface_towards(host, int(port))
    if mapped:
        opts["device_map"] = mapped
    runner = _kernel_runner(name)
    try:
        session = start_member(name, rank, conn.address, opts, leader=leader, runner=runner,
                               secret=conn.secret)
    except BaseException:
        runner.stop()
        raise
    import torch.distributed.rpc as rpc

    from rpcnb import channels, worker

    info = worker.self_info()
    info["facts"] = channels.local_facts()
    try:
        admitted = rpc.rpc_sync(leader, _register, timeout=10, args=(
            name, rank, info, rendezvous.proof(conn.secret, name, rank)))
    except Exception:
        admitted = None
    if not admitted:  # the leader already dropped us from the group: just go
        leave_group(timeout=5, graceful=False)
        raise RpcnbError(rendezvous.REFUSED.format(leader=leader))
    worker._leave_hook = lambda: leave_group()
    with session.lock:
        for other, other_rank in admitted:
            session.members.setdefault(other, Member(other, other_rank))
        session.members[name] = Member(name, rank, info["host"], info["pid"], "kernel",
                                       info["devices"])
    view = group()
    lead = next((m for m in view.members if m.name == leader), None)
    if lead is not None and lead.pid and lead.host == info["host"]:
        threading.Thread(target=_watch_leader, args=(session, lead.pid), name="rpcnb-watch",
                         daemon=True).start()
    return view


LEADER_DIED = (
    "rpcnb: {leader}, the group's first kernel, is gone, and the group with it; this kernel "
    "left too. %rpc_init starts a new group (or joins another)."
)


def _watch_leader(s: _Session, pid: int) -> None:
    """In a joined kernel: when the first kernel dies the group cannot go on (it held the
    rendezvous); leave at once instead of failing at the next call."""
    while _session is s and not s.closing:
        time.sleep(0.5)
        if not launch.pid_alive(pid):
            _mark_dead(s, s.leader, "its kernel process is gone")
            print(LEADER_DIED.format(leader=s.leader), file=sys.stderr)
            leave_group(timeout=5, graceful=False)
            return


def _register(name: str, rank: int, info: dict[str, Any], proof: str) -> Any:
    """On the leader: a kernel asks to be admitted. Without the secret it is dropped from
    the group before rpcnb lists it or sends it anything; with it, it is watched (pid)."""
    s = _session
    if s is None:
        return None
    if not rendezvous.verify(rendezvous.proof(s.secret, name, rank), proof):
        threading.Thread(target=_forget_member, args=(name,), daemon=True).start()
        return None
    with s.lock:
        s.members[name] = Member(name, rank, info["host"], info["pid"], info["kind"],
                                 info["devices"])
        admitted = [(m.name, m.rank) for m in s.members.values()]
    if info.get("facts"):
        from rpcnb import channels

        channels.remember(s.init_method, name, info["facts"])
    return admitted


def _quietly(func: Any, *args: Any) -> None:
    try:
        func(*args)
    except Exception:
        pass  # best effort: asked again when needed


def _registry(token: str) -> list[tuple[str, int]]:
    """On the leader: who was admitted (for other members' ``live_names``)."""
    s = verified(token)
    with s.lock:
        return [(m.name, m.rank) for m in s.members.values() if m.alive]


def verified(token: str) -> _Session:
    """The session, if ``token`` is the group's; every rpcnb request goes through this."""
    s = _session
    if s is None or not rendezvous.verify(s.token, token):
        raise PermissionError(rendezvous.BAD_TOKEN)
    return s


def _watch(s: _Session) -> None:
    """On the leader: notice dead members within a fraction of a second, and clean up."""
    host = socket.gethostname()
    while not s.closing:
        time.sleep(0.2)
        with s.lock:
            candidates = []
            for w in s.procs.values():
                if not w.left and w.name not in s.dead and not w.alive():
                    candidates.append((w.name, w.how_died()))
            for m in s.members.values():
                if (m.kind == "kernel" and m.name != s.name and m.alive and m.host == host
                        and m.pid and m.name not in s.dead and not launch.pid_alive(m.pid)):
                    candidates.append((m.name, "its kernel process is gone"))
        for name, how in candidates:
            if s.closing:
                return
            _mark_dead(s, name, how)
            pid = s.members[name].pid if name in s.members else None
            if pid:
                from rpcnb import shm

                shm.remove_segments_of(pid)
            try:
                _forget_member(name)
            except Exception as exc:  # keep watching; report in the log
                print(f"rpcnb: could not remove {name} from the group: {exc}", file=sys.__stderr__)
            _broadcast_death(s, name, how)


def _mark_dead(s: _Session, name: str, how: str) -> None:
    with s.lock:
        s.dead[name] = how
        if name in s.members:
            s.members[name].alive = False
            s.members[name].how = how
        for call in s.calls.values():
            if call.worker == name:
                call.inbox.put(("__dead__", name, -1, []))


def _member_died(token: str, name: str, how: str) -> None:
    """On any member: the leader says ``name`` died."""
    _mark_dead(verified(token), name, how)


def _broadcast_death(s: _Session, name: str, how: str) -> None:
    import torch.distributed.rpc as rpc

    for other in s.live_names():
        if other not in (s.name, name):
            try:
                rpc.rpc_async(other, _member_died, args=(s.token, name, how), timeout=5)
            except Exception:
                pass


def _forget_member(name: str, steal_any: bool = False) -> None:
    """Remove a dead member from torch's dynamic group, as a graceful leave would have.

    Takes the group token (stealing it if the dead member held it, which happens when it
    died while joining), drops the member from the store's list and from every live
    agent, then releases the token and wakes whoever waited for the dead one's token.
    """
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc._utils import _update_group_membership

    agent = _agent()
    store = agent.store
    try:
        info = agent.get_worker_info(name)
    except Exception:
        return  # it never joined, or is already gone
    mine = f"Token_for_rpcnb_forget_{name}_{uuid.uuid4().hex[:8]}"
    stolen = ""
    deadline = time.monotonic() + 10
    while True:
        cur = store.compare_set(_TOKEN_KEY, "", mine).decode()
        if cur == mine:
            break
        if cur.startswith(f"Token_for_{name}_") or steal_any:
            if store.compare_set(_TOKEN_KEY, cur, mine).decode() == mine:
                stolen = cur
                break
        if time.monotonic() > deadline:
            raise RpcnbError(f"the group token stays held by {cur!r}")
        time.sleep(0.05)
    try:
        entries = store.get("names/_ALL_WORKER_INFOS").decode().split(",")
        keep = [e for e in entries if e and e != f"{name}-{info.id}"]
        store.set("names/_ALL_WORKER_INFOS", "".join(e + "," for e in keep))
        for w in agent.get_worker_infos():
            if w.name == name:
                continue
            if w.name == agent.get_worker_info().name:
                agent._update_group_membership(info, [], {}, False)
            else:
                try:
                    rpc.rpc_sync(w.name, _update_group_membership,
                                 args=(info, [], {}, False), timeout=5)
                except Exception:
                    pass
    finally:
        store.set(_TOKEN_KEY, "")
        store.set(mine, "Done")
        if stolen:
            store.set(stolen, "Done")


# --------------------------------------------------------------------------- running cells


def resolve(target: str | Iterable[str] | None) -> tuple[list[str], bool]:
    """Worker names for ``target`` ('w1', 'w1,w2', a list, or rpcnb.ALL); and whether the
    result is a dict (several targets named)."""
    s = _require()
    live = s.live_names()
    if target is None or target == ALL:
        names = [n for n in live if n != s.name]
        if not names:
            raise RpcnbError(errors.NO_WORKERS)
        return names, True
    if isinstance(target, str):
        parts = [p.strip() for p in target.split(",")]
        many = "," in target
    else:
        parts = [str(p).strip() for p in target]
        many = True
    names = []
    for p in parts:
        if not p:
            continue
        if p in s.dead:
            raise WorkerDiedError(_death_message(s, p), p)
        if p not in live:
            raise RpcnbError(errors.UNKNOWN_WORKER.format(name=p, known=", ".join(live)))
        if p not in names:
            names.append(p)
    if not names:
        raise RpcnbError(errors.UNKNOWN_WORKER.format(name=str(target), known=", ".join(live)))
    return names, many


def _death_message(s: _Session, name: str) -> str:
    how = s.dead.get(name, "")
    if how == "left":
        return errors.WORKER_LEFT.format(name=name)
    msg = errors.WORKER_DIED.format(name=name, how=how or "unknown cause")
    proc = s.procs.get(name)
    if proc is not None:
        msg += f"\nIts log ends with:\n{proc.log_tail(8)}"
    return msg


def run(target: str | Iterable[str] | None, source: str, *, fetch: bool = False,
        push: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
    """Run ``source`` on the target worker(s) as a cell and wait for it.

    Output streams into this process's stdout/stderr/display while the cell runs. Returns
    an RRef to the last expression's value (None if there is none), the value itself with
    ``fetch=True``, or ``{name: result}`` when several workers (or ``ALL``) are named
    (None when no worker had a value).
    Raises RemoteError (with ``.worker``) for an exception on the worker.
    """
    s = _require()
    if not isinstance(source, str) or not source.strip():
        raise ValueError(errors.EMPTY_CELL.format(target=target or "the workers"))
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    names, many = resolve(target)
    import torch.distributed.rpc as rpc

    from rpcnb import worker

    inbox: queue.Queue[tuple[str, str, int, list[Any]]] = queue.Queue()
    calls: dict[str, _Call] = {}
    start = telemetry.now()
    t0 = time.perf_counter()
    try:
        for name in names:
            call = _Call(uuid.uuid4().hex, name, inbox)
            with s.lock:
                s.calls[call.call_id] = call
            calls[call.call_id] = call
            call.future = rpc.rpc_async(
                name, worker._run_cell,
                args=(s.token, call.call_id, s.name, source, fetch, dict(push or {})),
                timeout=0,
            )
            call.future.add_done_callback(
                lambda _f, cid=call.call_id: inbox.put(("__done__", cid, -1, [])))
        _wait(s, calls, inbox, timeout, prefix=many)
    finally:
        with s.lock:
            for cid in calls:
                s.calls.pop(cid, None)
    elapsed = time.perf_counter() - t0
    for call in calls.values():
        telemetry.record(call.worker, "cell", start, elapsed, ok=call.error is None)
    failures = {c.worker: c.error for c in calls.values() if c.error is not None}
    if failures:
        remote = {w: e for w, e in failures.items() if isinstance(e, RemoteError)}
        other = [e for e in failures.values() if not isinstance(e, RemoteError)]
        if other:
            raise other[0]
        if len(remote) == 1:
            raise next(iter(remote.values()))
        raise errors.CompositeRemoteError(remote)
    results = {c.worker: c.result for c in calls.values()}
    if many:
        # statements only (no value anywhere): show nothing, as a single cell would
        return results if any(r is not None for r in results.values()) else None
    return results[names[0]]


class _Printer:
    """Writes worker output into this process's cell, prefixed per line when several run."""

    def __init__(self, prefix: bool) -> None:
        self.prefix = prefix
        self.partial: dict[tuple[str, str], str] = {}

    def stream(self, worker: str, name: str, text: str) -> None:
        out = sys.stdout if name == "stdout" else sys.stderr
        if not self.prefix:
            out.write(text)
            return
        key = (worker, name)
        buf = self.partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self.partial[key] = rest
        if lines:
            out.write("".join(f"[{worker}] {line}\n" for line in lines))

    def display(self, kind: str, payload: dict[str, Any]) -> None:
        try:
            from IPython.display import clear_output, publish_display_data
        except ImportError:  # pragma: no cover
            return
        if _shell() is None:
            if kind == "display":
                print(payload["data"].get("text/plain", ""))
            return
        if kind == "clear":
            clear_output(wait=payload.get("wait", False))
        else:
            publish_display_data(payload["data"], payload.get("metadata") or None,
                                 transient=payload.get("transient") or None,
                                 update=payload.get("update", False))

    def finish(self) -> None:
        for (worker, name), rest in self.partial.items():
            if rest:
                out = sys.stdout if name == "stdout" else sys.stderr
                out.write(f"[{worker}] {rest}\n")
        self.partial.clear()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass


def _deliver(token: str, call_id: str | None, worker: str, seq: int,
             items: list[Any]) -> None:
    """RPC target on the caller: a batch of a remote cell's output."""
    s = verified(token)
    if call_id is None:  # output of a worker outside any cell: show it where we are
        printer = _Printer(prefix=True)
        for kind, payload in items:
            if kind in ("stdout", "stderr"):
                printer.stream(worker, kind, payload)
        printer.finish()
        return
    with s.lock:
        call = s.calls.get(call_id)
    if call is not None:
        call.inbox.put((call_id, worker, seq, items))


def _wait(s: _Session, calls: dict[str, _Call], inbox: queue.Queue[Any],
          timeout: float | None, prefix: bool) -> None:
    printer = _Printer(prefix)
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted_at: float | None = None
    reason: BaseException | None = None

    def render(msg: tuple[str, str, int, list[Any]]) -> None:
        cid, wname, seq, items = msg
        if cid in ("__dead__", "__done__"):
            return
        call = calls.get(cid)
        if call is None:
            return
        call.held[seq] = items
        while call.next_seq in call.held:
            for kind, payload in call.held.pop(call.next_seq):
                if kind in ("stdout", "stderr"):
                    printer.stream(wname, kind, payload)
                else:
                    printer.display(kind, payload)
            call.next_seq += 1

    def drain() -> None:
        while True:
            try:
                render(inbox.get_nowait())
            except queue.Empty:
                return

    def interrupt_all() -> None:
        import torch.distributed.rpc as rpc

        from rpcnb import worker

        for c in calls.values():
            if not c.done and c.worker not in s.dead:
                try:
                    rpc.rpc_async(c.worker, worker._interrupt, args=(s.token, c.call_id),
                                  timeout=5)
                except Exception:
                    pass

    try:
        while True:
            try:
                try:
                    render(inbox.get(timeout=0.05))
                except queue.Empty:
                    pass
                for call in calls.values():
                    if not call.done:
                        _check_call(s, call)
                if all(c.done for c in calls.values()):
                    drain()
                    break
                now = time.monotonic()
                if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE:
                    break
                if deadline is not None and now > deadline and interrupted_at is None:
                    reason = TimeoutError()
                    interrupted_at = now
                    interrupt_all()
            except KeyboardInterrupt:
                if interrupted_at is not None:
                    raise
                reason = KeyboardInterrupt()
                interrupted_at = time.monotonic()
                interrupt_all()
    finally:
        printer.finish()
    if isinstance(reason, KeyboardInterrupt):
        raise KeyboardInterrupt
    if isinstance(reason, TimeoutError):
        late = [c.worker for c in calls.values()
                if not c.done or (c.error is not None and isinstance(c.error, RemoteError)
                                  and c.error.ename == "KeyboardInterrupt")]
        if late:
            raise TimeoutError(errors.CALL_TIMEOUT.format(name=", ".join(late),
                                                          timeout=timeout))


STOPPED_NOTICE = (
    "rpcnb: {name} (pid {pid}) is stopped (SIGSTOP or a debugger), so the cell waits: "
    "`kill -CONT {pid}` resumes it; interrupt the kernel to give up."
)


def _check_call(s: _Session, call: _Call) -> None:
    """Finish ``call`` if its future is done or its worker is known dead."""
    proc = s.procs.get(call.worker)
    if proc is not None and not call.warned and time.monotonic() - call.started > 1.0 \
            and proc.stopped():
        call.warned = True
        print(STOPPED_NOTICE.format(name=call.worker, pid=proc.pid), file=sys.stderr)
    fut = call.future
    if fut.done():
        call.done = True
        try:
            res = fut.wait()
        except Exception as exc:
            call.error = _call_failure(s, call.worker, exc)
            return
        _drain_until(call, res.outputs)
        if res.ok:
            call.result = res.value if res.has_value and res.rref is None else res.rref
        else:
            call.error = RemoteError(res.worker, res.ename, res.evalue, res.traceback)
        return
    if call.worker in s.dead:
        call.done = True
        call.error = WorkerDiedError(_death_message(s, call.worker), call.worker)


def _drain_until(call: _Call, count: int) -> None:
    # Output batches were delivered before the result was sent; they are in the inbox.
    deadline = time.monotonic() + 2
    while call.next_seq + len(call.held) < count and time.monotonic() < deadline:
        time.sleep(0.001)


def _call_failure(s: _Session, worker: str, exc: BaseException) -> BaseException:
    """Turn a transport error into 'worker X died (how)' when that is what happened."""
    proc = s.procs.get(worker)
    if proc is not None and not proc.left:
        # The watcher notices the exit within a fraction of a second, and cleans up.
        deadline = time.monotonic() + 3
        while worker not in s.dead and time.monotonic() < deadline:
            time.sleep(0.02)
    if worker in s.dead:
        return WorkerDiedError(_death_message(s, worker), worker)
    return WorkerDiedError(f"The call to {worker!r} failed: {exc}", worker)


def interrupt(worker: str) -> None:
    """Interrupt whatever remote cell ``worker`` is running for this process (the cell
    ends with KeyboardInterrupt; the worker and its namespace stay)."""
    import torch.distributed.rpc as rpc

    from rpcnb import worker as w

    s = _require()
    with s.lock:
        ids = [c.call_id for c in s.calls.values() if c.worker == worker]
    for cid in ids:
        rpc.rpc_sync(worker, w._interrupt, args=(s.token, cid), timeout=5)


# --------------------------------------------------------------------------- group view


def group(refresh: bool = True) -> Group:
    """The group now: every member with host, pid, devices, liveness, calls and latency."""
    import torch.distributed.rpc as rpc

    from rpcnb import worker

    s = _require()
    agent = rpc.api._get_current_rpc_agent()
    admitted = set(s.live_names()) | {s.name}
    infos = {w.name: w.id for w in agent.get_worker_infos() if w.name in admitted}
    futs = {}
    if refresh:
        for name in infos:
            if name != s.name and name not in s.dead:
                try:
                    futs[name] = (time.perf_counter(),
                                  rpc.rpc_async(name, worker._describe_self,
                                                args=(s.token,), timeout=5))
                except Exception:
                    pass
    for name, (t0, fut) in futs.items():
        try:
            info = fut.wait()
        except Exception as exc:
            with s.lock:
                m = s.members.setdefault(name, Member(name, infos[name]))
                m.alive, m.how = False, f"not answering ({exc})"
            continue
        telemetry.record(name, "describe", telemetry.now(), time.perf_counter() - t0)
        with s.lock:
            m = s.members.setdefault(name, Member(name, infos[name]))
            m.host, m.pid, m.kind, m.devices = info["host"], info["pid"], info["kind"], info["devices"]
    rows = []
    with s.lock:
        if s.name not in s.members:
            s.members[s.name] = Member(s.name, s.rank, socket.gethostname(), os.getpid(),
                                       "kernel", _devices())
        names = set(infos) | set(s.dead)
        for name in names:
            m = s.members.setdefault(name, Member(name, infos.get(name, -1)))
            if name in s.dead:
                m.alive, m.how = False, s.dead[name]
            stats = telemetry.summary(name)
            m.calls, m.recent_ms = stats["calls"], stats["recent_ms"]
            rows.append(m)
    rows.sort(key=lambda m: m.rank)
    address = str(s.connection_path) if s.connection_path else s.init_method
    return Group(s.name, s.leader, address, rows, remote=bool(s.options.get("one_host") is False))


# --------------------------------------------------------------------------- leaving


def _local_shutdown(graceful: bool, timeout: float = 10.0) -> bool:
    """rpc.shutdown() bounded in time; True if it finished."""
    import torch.distributed.rpc as rpc

    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            rpc.shutdown(graceful=graceful, timeout=timeout)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, name="rpcnb-shutdown", daemon=True)
    t.start()
    t.join(timeout + 5)
    return not t.is_alive()


def leave_group(timeout: float = 10.0, graceful: bool = True) -> None:
    """This member leaves the group (the leader uses ``shutdown`` instead)."""
    global _session
    s = _session
    if s is None:
        return
    s.closing = True
    _local_shutdown(graceful=graceful, timeout=timeout)
    from rpcnb import shm

    shm.deactivate()
    if s.runner is not None and not getattr(s.runner, "_on_main", False):
        s.runner.stop()
    _session = None


def shutdown(timeout: float = 10.0) -> None:
    """Leave the group. On the first kernel: every worker leaves first, then this one.

    Bounded: a worker that has not left after ``timeout`` seconds is killed (a process
    this kernel started) or dropped from the group (a joined kernel). No worker process
    is left behind, and ``init`` works again afterwards.
    """
    global _session
    s = _require()
    if not s.is_leader:
        leave_group(timeout)
        return
    import torch.distributed.rpc as rpc

    from rpcnb import worker

    s.closing = True
    if s.watcher is not None:
        s.watcher.join(1)
    others = [n for n in s.live_names() if n != s.name]
    for name in others:
        if name in s.procs:
            s.procs[name].left = True
            if s.procs[name].stopped():  # it cannot leave; do not wait for it
                s.procs[name].stop(grace=0.2)
        try:
            rpc.rpc_async(name, worker._leave, args=(s.token,), timeout=5)
        except Exception:
            pass
    deadline = time.monotonic() + timeout
    agent = rpc.api._get_current_rpc_agent()
    while time.monotonic() < deadline:
        gone = {n for n, w in s.procs.items() if not w.alive()}
        remaining = {w.name for w in agent.get_worker_infos()} - {s.name} - set(s.dead) - gone
        if not remaining:
            break
        time.sleep(0.05)
    launch.wait_exit(list(s.procs.values()), max(0.5, deadline - time.monotonic()))
    for w in s.procs.values():
        if w.alive():
            w.stop(grace=1.0)
    still = {w.name for w in agent.get_worker_infos()} - {s.name}
    for name in still:
        try:
            # whoever holds the group token now is gone or stuck: take it
            _forget_member(name, steal_any=True)
        except Exception:
            pass
    _local_shutdown(graceful=True, timeout=5.0)
    from rpcnb import shm

    shm.deactivate()
    for w in s.procs.values():  # a worker that was killed could not clean up after itself
        shm.remove_segments_of(w.pid, _group_id(s.init_method))
    if s.runner is not None:
        s.runner.stop()
    _session = None
    if s.group_dir is not None:
        shutil.rmtree(s.group_dir, ignore_errors=True)
