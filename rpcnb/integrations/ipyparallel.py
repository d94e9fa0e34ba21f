"""ipyparallel engines as members of a group.

ipyparallel already starts engines locally, with MPI, over SSH and under Slurm, PBS or
LSF, and talks to them over authenticated (HMAC-signed) ZMQ connections. ``start`` runs
an ipyparallel ``Cluster`` with one of those launchers; ``attach`` takes a cluster (or a
client of one) that the user already runs. Either way this process starts a group (as
``rpcnb.init`` does, with no worker processes of its own) and each engine K joins it as
``worker<K+1>``: a function of this module runs on the engine through ipyparallel and
calls ``rpcnb.api.join`` there with the group's secret as an argument, so the secret
travels only inside ipyparallel's signed messages, never in a file, an environment
variable or a command line. An engine is an IPython kernel: the cells ``%%remote`` sends
it run in its own user namespace, the one ``%%px`` runs in.

``%rpc_shutdown`` asks every engine to leave the group like a joined kernel: the engines of
an attached cluster keep running; a cluster that ``start`` started is stopped.
"""

from __future__ import annotations

import ast
import os
import shlex
import socket
import time
from typing import Any

from rpcnb import errors
from rpcnb.errors import RpcnbError
from rpcnb.procs import launch
from rpcnb.session import state
from rpcnb.session.members import Group

# ipyparallel's engine launchers by the names its Cluster takes
LAUNCHERS = ("local", "mpi", "ssh", "slurm", "pbs", "lsf", "sge", "htcondor")
START_TIMEOUT = 180.0  # seconds for the engines to start and join


# --------------------------------------------------------------------------- input


def parse_cluster_args(text: str | dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--cluster-args``: space-separated ``key=value`` items (shell quoting; values read
    as Python literals where they are one). ``Class.trait=value`` items are ipyparallel
    configuration (``MPILauncher.mpi_args=[...]``); the others are ``Cluster`` arguments
    (``profile_dir=...``, ``controller_ip=...``). Returns (arguments, configuration)."""
    if text is None:
        return {}, {}
    items = text.items() if isinstance(text, dict) else _items(text)
    kwargs: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for key, value in items:
        if "." in key:
            cls, _, trait = key.rpartition(".")
            config.setdefault(cls, {})[trait] = value
        else:
            kwargs[key] = value
    return kwargs, config


def _items(text: str) -> list[tuple[str, Any]]:
    # split on blanks outside quotes and keep the quotes, so that a value such as
    # ['--oversubscribe'] reaches literal_eval whole; a quoted item loses its quotes
    words = _split(text)
    if len(words) == 1 and _unquote(words[0]) != words[0]:  # IPython keeps "..." of a magic's line
        words = _split(_unquote(words[0]))
    out = []
    for word in words:
        word = _unquote(word)
        key, eq, raw = word.partition("=")
        if not eq or not key or not all(part.isidentifier() for part in key.split(".")):
            raise ValueError(errors.BAD_CLUSTER_ARGS.format(item=word, reason="not key=value"))
        out.append((key, _literal(raw)))
    return out


def _split(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=False)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError as exc:
        raise ValueError(errors.BAD_CLUSTER_ARGS.format(item=text, reason=exc)) from None


def _unquote(word: str) -> str:
    if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"":
        return word[1:-1]
    return word


def _literal(raw: str) -> Any:
    """A Python literal where ``raw`` is one (``3``, ``['-x']``, ``'a b'``), else the text."""
    for text in (raw, _unquote(raw)):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
    return _unquote(raw)


def _ipyparallel() -> Any:
    try:
        import ipyparallel
    except ImportError:
        raise RpcnbError(errors.NEEDS_IPYPARALLEL) from None
    return ipyparallel


# --------------------------------------------------------------------------- the API


def start(engines: int, launcher: str = "local", cluster_args: str | dict[str, Any] | None = None,
          *, timeout: float = START_TIMEOUT, **init_kwargs: Any) -> Group:
    """Start an ipyparallel cluster of ``engines`` engines with ``launcher`` and make this
    process the first member of a new group with the engines as ``worker1``..``workerN``.

    ``cluster_args`` go to ipyparallel (see ``parse_cluster_args``); ``init_kwargs`` are
    ``rpcnb.init``'s (``port``, ``host``, ``allow_remote``, ``interface``, ...): engines on
    other hosts need a group that listens on a network (``port`` and ``host``).
    ``%rpc_shutdown`` stops the cluster."""
    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    if not isinstance(engines, int) or isinstance(engines, bool) or engines < 1:
        raise ValueError(errors.BAD_ENGINES.format(engines=engines))
    if launcher not in LAUNCHERS:
        raise ValueError(errors.BAD_LAUNCHER.format(launcher=launcher, known=", ".join(LAUNCHERS)))
    kwargs, config = parse_cluster_args(cluster_args)
    ipp = _ipyparallel()
    from traitlets.config import Config

    kwargs.setdefault("log_level", 30)
    cluster = ipp.Cluster(n=engines, engine_launcher_class=launcher, config=Config(config),
                          **kwargs)
    try:
        client = cluster.start_and_connect_sync(n=engines, activate=True)  # %%px works
    except Exception as exc:
        said = _engines_said(cluster)
        _stop(cluster, None)
        raise RpcnbError(errors.CLUSTER_FAILED.format(launcher=launcher, reason=_first(exc))
                         + said) from None
    return _make_group(client, cluster, owned=True, timeout=timeout, init_kwargs=init_kwargs)


def attach(client_or_cluster: Any, *, targets: Any = None, timeout: float = START_TIMEOUT,
           **init_kwargs: Any) -> Group:
    """Make this process the first member of a new group whose other members are the
    engines of a running ipyparallel cluster (a ``Cluster``, a ``Client``, or a profile
    name / cluster id / profile directory to connect to), ``worker<K+1>`` for engine K.
    ``%rpc_shutdown`` leaves the engines running. ``%rpc_init --attach CLUSTER``.

    Args:
        client_or_cluster: an ipyparallel ``Cluster`` or ``Client``, or a cluster id,
            ``PROFILE:ID``, a profile name or a profile directory to connect to.
        targets: some engine ids only (one id or several; default: every engine).
        timeout: seconds the engines get to join.
        **init_kwargs: the group's settings, as for ``init`` (``port``, ``host`` and
            ``allow_remote`` for engines on other hosts, ``interface``, ``threads``, ...).

    Returns:
        The group, this process and the engines as its members.

    Raises:
        rpcnb.RpcnbError: this process is already in a group; ipyparallel is not installed; no
            running cluster answers to the name; the cluster has no engines; engines run
            on other hosts and ``port`` is not given; an engine failed or timed out
            joining; and what ``init`` raises.
        ValueError: ``client_or_cluster`` is none of the above; and what ``init`` raises.
    """
    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    ipp = _ipyparallel()
    if isinstance(client_or_cluster, str):
        client = connect(client_or_cluster)
    elif isinstance(client_or_cluster, ipp.Cluster):
        client = client_or_cluster.connect_client_sync()
    elif isinstance(client_or_cluster, ipp.Client):
        client = client_or_cluster
    else:
        raise ValueError(errors.BAD_ATTACH.format(what=type(client_or_cluster).__name__))
    return _make_group(client, None, owned=False, timeout=timeout, init_kwargs=init_kwargs,
                       targets=targets)


def connect(where: str) -> Any:
    """A client of the running cluster ``where``: a cluster id (``ipcluster list``),
    ``PROFILE:CLUSTER_ID`` (PROFILE a name or a directory), a profile name or directory
    (its one running cluster), or a cluster file."""
    import glob

    ipp = _ipyparallel()
    where = os.path.expanduser(where)
    tries: list[dict[str, Any]] = []
    head, colon, cluster_id = where.rpartition(":")
    if os.path.isfile(where):
        tries.append({"cluster_file": where})
    elif colon and head:
        tries.append({"profile_dir" if os.path.isdir(head) else "profile": head,
                      "cluster_id": cluster_id})
    elif os.path.isdir(where):
        tries += [{"cluster_file": f} for f in glob.glob(os.path.join(where, "security",
                                                                      "cluster-*.json"))]
    else:
        tries += [{"cluster_id": where}, {"profile": where, "cluster_id": ""}]
        from IPython.paths import get_ipython_dir

        tries += [{"cluster_file": f} for f in glob.glob(os.path.join(
            get_ipython_dir(), f"profile_{where}", "security", "cluster-*.json"))]
    for attempt in tries:
        try:
            cluster = ipp.Cluster.from_file(**attempt)
            client = cluster.connect_client_sync()
            client.wait_for_engines(timeout=10, block=True)
            return client
        except Exception:
            continue
    raise RpcnbError(errors.ATTACH_NOT_FOUND.format(where=where))


def client() -> Any:
    """The ipyparallel client of this group's engines (``%%px`` uses it once activated)."""
    s = state.current()
    if not s.cluster:
        raise RpcnbError(errors.NO_CLUSTER)
    return s.cluster["client"]


def _make_group(client: Any, cluster: Any, *, owned: bool, timeout: float,
                init_kwargs: dict[str, Any], targets: Any = None) -> Group:
    """The group of this process and the client's engines (see ``start``)."""
    launch.apply_quiet_env()  # before rpcnb.api imports torch
    from rpcnb import api

    ids = sorted(client.ids) if targets is None else sorted(
        [targets] if isinstance(targets, int) else targets)
    try:
        if not ids:
            raise RpcnbError(errors.NO_ENGINES)
        # the start's whole time limit: an engine that has just registered may take long
        # to run its first task on a busy machine
        where = _ask(client, ids, _where, timeout=timeout)
        here = _where()
        elsewhere = {eid: w["host"] for eid, w in where.items()
                     if w["boot_id"] != here["boot_id"] or w["netns"] != here["netns"]}
        if elsewhere and init_kwargs.get("port") is None:
            hosts = ", ".join(sorted(set(elsewhere.values())))
            raise RpcnbError(errors.ENGINES_ELSEWHERE.format(hosts=hosts))
        api.init(0, **init_kwargs)
    except BaseException:
        _stop(cluster if owned else None, client)
        raise
    s = state.current()
    try:
        conn = s.connection_path
        assert conn is not None
        # same host and network namespace: the private connection file (the store is a
        # file there, or loopback); elsewhere: the group's TCP address and the secret
        join_at = {eid: (s.init_method if eid in elsewhere or s.init_method.startswith("tcp://")
                         else str(conn)) for eid in ids}
        names = {eid: f"worker{eid + 1}" for eid in ids}
        o = s.options  # what api.join takes of the group's options, for every engine
        options = {"threads": o.threads, "timeout": o.timeout, "shm": o.shm, "ucx": o.ucx,
                   "zero_copy": o.zero_copy}
        # --interface names this host's interface; an engine elsewhere finds its own,
        # the one that reaches the group's address
        interface = {eid: None if eid in elsewhere else init_kwargs.get("interface")
                     for eid in ids}
        pending = {eid: client[eid].apply_async(_join_engine, join_at[eid], names[eid],
                                                s.secret, options, interface[eid])
                   for eid in ids}
        _wait(pending, names, timeout)
        s.set_cluster({"client": client, "cluster": cluster, "owned": owned,
                       "engines": {names[eid]: eid for eid in ids}})
        # once the group has ended (after every other step of its teardown)
        s.teardown.push("ipyparallel cluster", lambda: _stop(cluster if owned else None, client),
                        last=True)
    except BaseException:
        api.shutdown(timeout=5)
        _stop(cluster if owned else None, client)
        raise
    return api.group()


def _ask(client: Any, ids: list[int], func: Any, timeout: float) -> dict[int, Any]:
    pending = {eid: client[eid].apply_async(func) for eid in ids}
    _wait(pending, {eid: f"engine {eid}" for eid in ids}, timeout, late=errors.ENGINE_SILENT)
    return {eid: ar.get() for eid, ar in pending.items()}


def _wait(pending: dict[int, Any], names: dict[int, str], timeout: float,
          late: str = errors.ENGINE_TIMEOUT) -> None:
    """Until every engine answered; RpcnbError naming the first engine that failed
    (``late``: the message for one that did not answer in time)."""
    deadline = time.monotonic() + timeout
    for eid, ar in pending.items():
        try:
            ar.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception as exc:
            if type(exc).__name__ == "TimeoutError":
                raise RpcnbError(late.format(engine=eid, name=names[eid],
                                             timeout=timeout)) from None
            raise RpcnbError(errors.ENGINE_FAILED.format(engine=eid, name=names[eid],
                                                         reason=_first(exc))) from None


def _first(exc: BaseException) -> str:
    """An exception in one line (ipyparallel's RemoteError: the engine's exception)."""
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]


def _engines_said(cluster: Any, lines: int = 8) -> str:
    """The last ``lines`` of what each engine printed (its log, fetched by its launcher: over
    ssh for the ssh launcher), for an error about engines that did not register; empty when
    none printed anything or the launcher cannot tell (never raises)."""
    parts = []
    try:
        sets = list(getattr(cluster, "engines", {}).values())
    except Exception:
        return ""
    for engine_set in sets:
        for key, launcher in sorted(getattr(engine_set, "launchers", {}).items()):
            try:
                text = launcher.get_output() or ""
            except Exception:
                continue
            tail = [line for line in text.strip().splitlines() if line.strip()][-lines:]
            if tail:
                parts.append(f"\nengine {key} printed:\n" + "\n".join("  " + t for t in tail))
    return "".join(parts)


def _stop(cluster: Any, client: Any) -> None:
    """Close the client; stop the cluster when it is ours (never raises)."""
    if client is not None:
        try:
            client.close()
        except Exception:
            pass
    if cluster is not None:
        try:
            cluster.stop_cluster_sync()
        except Exception:
            pass


# --------------------------------------------------------------------------- on the engine


def _where() -> dict[str, Any]:
    """Where an engine is (runs there): host, boot id, network namespace, pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return {"host": socket.gethostname(), "boot_id": boot, "netns": netns, "pid": os.getpid()}


def _join_engine(address: str, name: str, secret: str, options: dict[str, Any],
                 interface: str | None) -> dict[str, Any]:
    """Runs on the engine: join the group as ``name`` (remote cells then run in the
    engine's own namespace; ``options``: ``api.join``'s threads, timeout, shm, ucx and
    zero_copy); what it says about itself."""
    from rpcnb import api as engine_session

    group = engine_session.join(address, name, token=secret, interface=interface,
                                kind="engine", **options)
    me = next(m for m in group.members if m.name == name)
    return {"name": name, "pid": me.pid, "host": me.host, "address": me.address}
