"""rpcnb's Python API: what the magics call, and what scripts and tests use.

``init`` makes this process the first member of a new group (rank 0, it holds the
rendezvous: a file under a private directory, so nothing listens) and starts worker
processes; ``join`` makes it a member of a running group; ``run`` sends a cell;
``group`` shows the group; ``shutdown`` leaves (the first kernel last, after everyone
else). Names and ranks are never reused in one group. torch is imported when a group
starts, not before.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from rpcnb import errors, machine
from rpcnb.cells.background import jobs
from rpcnb.cells.background import start as run_bg
from rpcnb.cells.call import interrupt, run
from rpcnb.errors import RpcnbError
from rpcnb.membership import leave
from rpcnb.membership.view import group
from rpcnb.paths import ucx as ucx_path
from rpcnb.procs import launch
from rpcnb.session import rendezvous, roster, state
from rpcnb.session.state import ALL, Group, Member, is_initialized
from rpcnb.session.teardown import Teardown
from rpcnb.wire import _torch, options

__all__ = ["ALL", "Group", "add_workers", "group", "init", "interrupt", "is_initialized",
           "jobs", "join", "restart", "run", "run_bg", "shutdown"]


P = ParamSpec("P")
R = TypeVar("R")


def _launcher_kept_only_if_used(fn: Callable[P, R]) -> Callable[P, R]:
    """A start that fails before any worker was forked stops the launcher that
    ``%rpc_init`` started for it: bad input leaves nothing running."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            launch.stop_unused_launcher()
            raise

    return wrapper


@_launcher_kept_only_if_used
def init(workers: int = 0, *, name: str = "worker0", threads: int = options.DEFAULT_THREADS,
         timeout: float = options.DEFAULT_RPC_TIMEOUT, channels: Iterable[str] | None = None,
         transports: Iterable[str] | None = None, shm: bool = True,
         device_map: Any = None, gpus: str | None = None, port: int | None = None,
         host: str = "127.0.0.1", allow_remote: bool = False,
         interface: str | None = None, ucx: bool | None = None,
         zero_copy: bool = True) -> Group:
    """Start a group: this process becomes ``name`` (rank 0) and starts ``workers`` workers.

    The workers are named ``worker1``..``workerN``. ``gpus`` says which of this kernel's
    GPUs each worker gets (``"0,1"``: one each; ``"0+1,2+3"``: two each; ``"auto"``:
    round-robin; ``"none"``); a worker numbers its GPUs from ``cuda:0``, as torch does in a
    process that sees only those. ``device_map`` (torch's dict form or DI-engine's
    ``"1_0_1"`` string) is this process's map, checked against every member's devices
    before anything starts; ``"auto"`` maps every GPU to the same index on every other
    member that has it, for every member (DI-engine's default). By default the rendezvous
    is a file in a private temporary directory, so the group is reachable from this host
    only; ``port`` serves it over TCP on ``host``
    (loopback unless ``allow_remote``). Either way a random secret, kept in the connection
    file, is needed to join. TensorPipe listens on the interface that owns ``host``, or on
    ``interface`` when it is given (anything but ``lo`` needs ``allow_remote``).
    ``ucx`` (default: the ``RPCNB_UCX`` variable) moves large tensors over UCX
    (``rpcnb.paths.ucx``; needs ``pip install 'rpcnb[ucx]'``, ``'rpcnb[ucx-cu13]'`` for a torch
    built with CUDA 13).
    """
    launch.apply_quiet_env()  # before torch is imported, if it is not yet
    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    options.check_name(name)
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be a whole number >= 0, not {workers!r}.")
    names = [f"worker{i}" for i in range(1, workers + 1)]
    if name in names:
        raise ValueError(errors.NAME_CLASH.format(name=name, n=workers))
    opts = options.validate(threads, timeout, channels, transports, shm=shm, zero_copy=zero_copy)
    opts["ucx"] = ucx_path.option(ucx)
    devices = options.plan_devices(name, names, gpus, device_map)
    if name in devices.maps:
        opts["device_map"] = devices.maps[name]
    if port is not None and not (isinstance(port, int) and 0 <= port < 65536):
        raise ValueError(f"--port must be a TCP port number (0-65535), not {port!r}.")
    host = rendezvous.check_host(host, allow_remote)
    remote = not ipaddress.ip_address(host).is_loopback
    iface = "lo"
    if interface is not None:
        iface = machine.check_interface_name(interface)
        if iface != "lo" and not allow_remote:
            raise ValueError(errors.INTERFACE_NEEDS_FLAG.format(iface=iface))
        remote = remote or iface != "lo"
    if remote:
        opts["one_host"] = False  # members may join from elsewhere: no shared memory
        if interface is None:
            iface = machine.interface_of(host)
    if port is None and (remote or allow_remote):
        raise ValueError("--host/--allow-remote need --port: a group reachable from other "
                         "hosts meets over TCP.")

    _torch.check_interface(iface if remote else os.environ.get("TP_SOCKET_IFNAME", ""))
    if workers:
        launch.warm_up()  # already running when %rpc_init or rpcnb.init started it
    from rpcnb.membership import failures, handlers, start

    handlers.install()
    rendezvous.sweep_groups()  # what killed kernels left behind, their secrets included
    secret = rendezvous.new_secret()
    # everything this start sets up registers its cleanup here as it comes up; a failure
    # at any step unwinds it, and so does every later way out of the group (Session.teardown)
    teardown = Teardown()
    try:
        group_dir = Path(tempfile.mkdtemp(prefix="rpcnb-"))
        teardown.push("group folder", functools.partial(shutil.rmtree, group_dir, ignore_errors=True))
        served: list[Any] = []  # the TCP store's server, only here: it listens while held
        if port is None:
            init_method = f"file://{group_dir / 'store'}"
        else:
            # this process serves the store; its agent is a client of it, like the others
            # (torch keeps an agent's store alive after shutdown: the server must not be it)
            server, port = rendezvous.serve_store(host, port, opts["timeout"])
            served.append(server)
            del server
            teardown.push("rendezvous store", served.clear)
            init_method = f"tcp://{host}:{port}"
        runner = start.kernel_runner(name)
        teardown.push("cell runner", runner.stop)
        my_rank = roster.fixed_rank() or 0
        # TensorPipe listens on TP_SOCKET_IFNAME; the workers inherit it (for this group)
        client = None if not served else rendezvous.open_store(
            init_method, opts["timeout"], prefixed=False)
        s = start.start_member(name, my_rank, init_method, opts, leader=name,
                               runner=runner, group_dir=group_dir, secret=secret,
                               store=client, teardown=teardown,
                               env={"TP_SOCKET_IFNAME": iface} if remote else None)
        s.connection_path = rendezvous.write_connection(
            group_dir, rendezvous.Connection(init_method, secret, name))
        if port is not None:
            s.listen = (host, port)
        if remote:
            print(rendezvous.REMOTE_EXPOSES.format(host=host, port=port, iface=iface))
        store = _torch.store()
        # what a joiner checks before it joins torch's group (rendezvous.check_group)
        store.set("rpcnb/protocol", rendezvous.PROTOCOL)
        store.set("rpcnb/keycheck", rendezvous.key_check(secret))
        store.set("rpcnb/leader", name)
        roster.claim_name(store, name)
        roster.claim_rank(store, my_rank)
        for member in [name, *names]:
            roster.publish(store, member, devices.devices[member], devices.maps.get(member))
        s.add_member(Member(name, my_rank, socket.gethostname(), os.getpid(), "kernel",
                            machine.cuda_devices()))
        start.launch_workers(s, names, opts, devices)
        start.wait_ready(s)
        start.watch_in_background(s, failures.watch)
    except BaseException:
        teardown.close()
        raise
    return group()


def join(address: str, name: str, *, token: str | None = None,
         threads: int = options.DEFAULT_THREADS, timeout: float | None = None,
         shm: bool = True, device_map: Any = None, interface: str | None = None,
         kind: str = "kernel", ucx: bool | None = None, zero_copy: bool = True) -> Group:
    """Join a group as ``name``; remote cells sent to ``name`` run in this namespace.

    ``address`` is the connection file %rpc_init printed (or its directory, or the
    file:// store beside it); from another host, ``tcp://HOST:PORT`` with ``token``.
    There TensorPipe listens on ``interface`` (default: the interface that reaches HOST).
    ``ucx``: as for ``init``; give it when the group's first kernel did.
    """
    launch.apply_quiet_env()
    opts = options.validate(threads, timeout if timeout is not None
                            else options.DEFAULT_RPC_TIMEOUT, shm=shm, zero_copy=zero_copy)
    opts["ucx"] = ucx_path.option(ucx)
    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    options.check_name(name)
    from rpcnb.membership import failures, handlers, start

    handlers.install()
    teardown = Teardown()  # as in init: every way out unwinds what was set up
    runner = start.kernel_runner(name, kind)
    teardown.push("cell runner", runner.stop)
    try:
        s = start.join_member(address, name, opts, runner, token=token,
                              device_map=device_map, interface=interface, teardown=teardown)
        view = group()
        lead = next((m for m in view.members if m.name == s.leader), None)
        me = next(m for m in view.members if m.name == name)
        if lead is not None and lead.pid and lead.host == me.host:
            start.watch_in_background(s, failures.watch_leader, lead.pid)
    except BaseException:
        teardown.close()
        raise
    return view


def restart(name: str) -> Group:
    """Replace worker ``name`` (dead, stuck or running) with a fresh process under the same
    name, GPUs and device map, on the first kernel; prints what was lost (its namespace,
    the RRefs it owned). A stuck process is killed first."""
    from rpcnb.membership import resize

    print(resize.restart(name))
    return group()


@_launcher_kept_only_if_used
def add_workers(n: int, gpus: str | None = None) -> Group:
    """Start ``n`` more workers in the running group (on the first kernel); ``gpus`` as
    for ``init``."""
    from rpcnb.membership import resize

    print(resize.describe_added(resize.add_workers(n, gpus)))
    return group()


def shutdown(timeout: float = 10.0) -> None:
    """Leave the group. On the first kernel: every worker leaves first, then this one.

    Bounded: a worker that has not left after ``timeout`` seconds is killed (a process
    this kernel started) or dropped from the group (a joined kernel). No worker process
    is left behind, and ``init`` works again afterwards.
    """
    s = state.current()
    if s.is_leader:
        leave.shutdown_group(s, timeout)
    else:
        leave.leave_group(timeout)
