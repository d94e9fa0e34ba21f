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
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from rpcnb import errors
from rpcnb.cells.background import jobs
from rpcnb.cells.background import start as run_bg
from rpcnb.cells.call import interrupt, run
from rpcnb.errors import RpcnbError
from rpcnb.membership import leave
from rpcnb.membership.view import group
from rpcnb.observe.names import who
from rpcnb.paths import ucx as ucx_path
from rpcnb.procs import launch
from rpcnb.session import state
from rpcnb.session.members import Group
from rpcnb.session.state import ALL, is_initialized
from rpcnb.session.teardown import Teardown
from rpcnb.wire import options

__all__ = ["ALL", "Group", "add_workers", "group", "init", "interrupt", "is_initialized",
           "jobs", "join", "restart", "run", "run_bg", "shutdown", "who"]


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
         zero_copy: bool = True, collectives: str | None = None,
         collective_timeout: float | None = None, keep: Any = None) -> Group:
    """Start a group: this process becomes ``name`` (rank 0) and starts ``workers`` workers.

    The workers are named ``worker1``..``workerN``. By default the rendezvous is a file in
    a private temporary directory, so the group is reachable from this host only; ``port``
    serves it over TCP on ``host`` (loopback unless ``allow_remote``). Either way a random
    secret, kept in the connection file, is needed to join. ``%rpc_init --workers N``.

    Args:
        workers: how many worker processes to start (0: none).
        name: this process's name in the group.
        threads: TensorPipe's RPC threads per process.
        timeout: the timeout of torch's RPC calls, in seconds (remote cells have none).
        channels: the TensorPipe channels to allow, in priority order (default: all).
        transports: the TensorPipe transports to allow, in priority order (default: ``uv``).
        shm: large CPU tensors go through rpcnb's shared memory (False: over TensorPipe only).
        device_map: this process's map (torch's dict form or DI-engine's ``"1_0_1"``
            string), checked against every member's devices before anything starts;
            ``"auto"`` maps every GPU to the same index on every other member that has it,
            for every member (DI-engine's default).
        gpus: which of this kernel's GPUs each worker gets (``"0,1"``: one each;
            ``"0+1,2+3"``: two each; ``"auto"``: round-robin; ``"none"``); a worker numbers
            its GPUs from ``cuda:0``, as torch does in a process that sees only those.
            Default: the workers see what this process sees.
        port: serve the rendezvous over TCP on this port (0: any free one) instead of a file.
        host: with ``port``, the address to listen on (loopback unless ``allow_remote``).
        allow_remote: accept a ``host`` or ``interface`` that other machines can reach.
        interface: the network interface TensorPipe listens on (default: the one that owns
            ``host``); anything but ``lo`` needs ``allow_remote``.
        ucx: move large tensors over UCX (``rpcnb.paths.ucx``; needs
            ``pip install 'rpcnb[ucx]'``, ``'rpcnb[ucx-cu13]'`` for a torch built with
            CUDA 13). Default: the ``RPCNB_UCX`` variable.
        zero_copy: a tensor already in shared memory goes by handle, sharing its pages with
            the receiver (False: it is copied, as every other tensor is).
        collectives: ``"gloo"``, ``"nccl"`` or ``"auto"`` (nccl where every worker has a
            CUDA device, else gloo): the workers also form a ``torch.distributed`` process
            group, ranks in worker order (worker1 is rank 0), world size ``workers``, for
            ``all_reduce``, ``barrier``, DDP in their cells (``rpcnb.membership.collectives``).
        collective_timeout: seconds a collective waits for every rank (default 60); one
            that not every rank joins fails after it, naming the ranks that never came.
        keep: the workers outlive this process (a kernel restart, a crash): a process of
            its own, the keeper, leads the group and this process attaches to it
            (``attach`` attaches again). The group ends when no process has been attached
            for ``keep`` (seconds, or ``"30m"``, ``"2h"``; ``True``: an hour), or at
            ``shutdown``. ``%rpc_init --keep``.

    Returns:
        The group, this process and its workers (``print()`` it for a table).

    Raises:
        rpcnb.RpcnbError: this process is already in a group; ``port`` is busy or ``host``
            cannot be bound; an earlier group of this process fixed another interface; a
            worker failed to start or did not join in time (the start is undone: nothing
            is left running); ``ucx`` is on and ucxx is not installed.
        ValueError: an argument that cannot work, named in the message: an invalid
            ``name`` or one that clashes with a worker's, ``workers`` below 0,
            ``threads`` below 1, ``timeout`` not above 0, unknown ``channels`` or
            ``transports``, ``gpus`` or ``device_map`` that do not fit the members'
            devices, ``port`` out of range, a ``host`` that is not numeric, not this
            machine's, or not loopback without ``allow_remote``, an unknown ``interface`` or
            one other than ``lo`` without ``allow_remote``, ``host`` or ``allow_remote``
            without ``port``.
    """
    launch.apply_quiet_env()  # before torch is imported, if it is not yet
    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    options.check_name(name)
    if keep is not None and keep is not False:
        return _start_kept(workers, keep, name, dict(
            threads=threads, timeout=timeout, channels=list(channels or []) or None,
            transports=list(transports or []) or None, shm=shm, gpus=gpus, port=port,
            host=host, allow_remote=allow_remote, interface=interface, ucx=ucx,
            zero_copy=zero_copy, collectives=collectives,
            collective_timeout=collective_timeout,
            device_map=device_map if isinstance(device_map, (str, type(None))) else None))
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be a whole number >= 0, not {workers!r}.")
    names = [f"worker{i}" for i in range(1, workers + 1)]
    if name in names:
        raise ValueError(errors.NAME_CLASH.format(name=name, n=workers))
    opts = options.validate(threads, timeout, channels, transports, shm=shm,
                            zero_copy=zero_copy, ucx=ucx_path.option(ucx))
    if collectives is not None or collective_timeout is not None:
        from rpcnb.membership import collectives as coll  # only then: it imports torch

        coll.check(collectives, collective_timeout)
        if not collectives or not workers:
            raise ValueError(errors.COLLECTIVES_NEED_WORKERS if collectives else
                             "collective_timeout goes with collectives.")
    devices = options.plan_devices(name, names, gpus, device_map)
    from rpcnb.membership import founding, handlers

    meeting = founding.Meeting.checked(port, host, allow_remote, interface)
    # members may join from elsewhere: no shared memory
    opts = opts.replace(device_map=devices.maps.get(name), one_host=not meeting.remote)
    handlers.install()
    founding.found_group(name, names, opts, devices, meeting, collectives=collectives,
                         collective_timeout=collective_timeout)
    return group()


def _start_kept(workers: int, keep: Any, name: str, kwargs: dict[str, Any]) -> Group:
    """``init(..., keep=...)``: a keeper starts the group, this process attaches."""
    from rpcnb.membership import kept

    seconds = kept.duration(None if keep is True else keep)
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(errors.KEEP_NEEDS_WORKERS)
    rec = kept.spawn(kept.new_name(), workers, seconds, kwargs)
    return attach(rec.name, name=None if name == "worker0" else name)


def attach(group: str | None = None, *, name: str | None = None) -> Group:
    """Make this process the driver of a kept group again (``%rpc_init --attach``): it
    joins the group, whose workers kept their names, namespaces and running cells.

    Args:
        group: the kept group's name (``groups()`` lists them); None: the one there is.
        name: this process's name in the group (default ``kernel_PID``).

    Returns:
        The group, this process included.

    Raises:
        rpcnb.RpcnbError: this process is already in a group; no kept group (of that
            name); several and none named; another kernel is attached (named).
    """
    from rpcnb.membership import kept

    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    rec = kept.find(group)
    claim = kept.claim(rec)  # the second kernel to attach is told which one is
    t0 = time.monotonic()
    try:
        view = join(rec.connection, name or f"kernel_{os.getpid()}")
    except BaseException:
        kept.release(rec.name, claim)
        raise
    s = state.current()
    s.kept_group = rec.name
    s.teardown.push("kept group's claim", functools.partial(kept.release, rec.name, claim))
    seconds = time.monotonic() - t0
    from rpcnb.membership import view as views

    views.ask_busy(s)  # the cells the workers still run, said in the report
    view = views.group(refresh=False)
    print(kept.report(rec, view, seconds))
    from rpcnb.cells import background

    # the cells the kernel before left running (or that ended since): this kernel's now
    for line in background.adopted_lines(background.adopt(s)):
        print(line)
    return view


def groups() -> list[Any]:
    """The kept groups of this user (``%rpc_groups``): each one's record (name, keeper
    pid, workers, since when, which kernel is attached, since when none is)."""
    from rpcnb.membership import kept

    return kept.groups()


def end_group(group: str, timeout: float = 15.0) -> bool:
    """End the kept group ``group`` without attaching (``%rpc_shutdown --group``): its
    keeper stops every worker and removes what the group left. Whether it was running."""
    from rpcnb.membership import kept

    if not kept.read(group):
        raise RpcnbError(errors.KEPT_UNKNOWN.format(
            name=group, known=", ".join(r.name for r in kept.groups()) or "none"))
    return kept.end(group, timeout)


def join(address: str, name: str, *, token: str | None = None,
         threads: int = options.DEFAULT_THREADS, timeout: float | None = None,
         shm: bool = True, device_map: Any = None, interface: str | None = None,
         kind: str = "kernel", ucx: bool | None = None, zero_copy: bool = True) -> Group:
    """Join a group as ``name``; remote cells sent to ``name`` run in this namespace.

    ``%rpc_init --join ADDR --name NAME``.

    Args:
        address: the connection file %rpc_init printed (or its directory, or the
            file:// store beside it); from another host, ``tcp://HOST:PORT`` with ``token``.
        name: this process's name in the group; names are never reused in one group.
        token: with a ``tcp://`` address, the group's secret, from its connection file.
        threads: TensorPipe's RPC threads per process.
        timeout: the timeout of torch's RPC calls, in seconds (default 60).
        shm: large CPU tensors go through rpcnb's shared memory (False: over TensorPipe only).
        device_map: this process's map, as for ``init``, checked against the devices of the
            members already in the group before joining.
        interface: from another host, the network interface TensorPipe listens on
            (default: the interface that reaches HOST).
        kind: what ``%rpc_workers`` shows as this member's kind.
        ucx: as for ``init``; give it when the group's first kernel did.
        zero_copy: as for ``init``.

    Returns:
        The group, this process included (``print()`` it for a table).

    Raises:
        rpcnb.RpcnbError: this process is already in a group; no group answers at ``address``;
            a ``tcp://`` address without ``token``; the group refused the secret (a wrong
            token, another group's connection file); ``name`` is taken in the group; an
            earlier group of this process fixed another interface; ``ucx`` is on and ucxx
            is not installed.
        ValueError: an invalid ``name``, ``threads`` below 1 or ``timeout`` not above 0;
            an ``address`` that is no rendezvous address; a ``device_map`` that does not fit
            the members' devices, or another member's map that sends to a GPU this process
            lacks; an unknown ``interface``.
    """
    launch.apply_quiet_env()
    opts = options.validate(threads, timeout if timeout is not None
                            else options.DEFAULT_RPC_TIMEOUT, shm=shm, zero_copy=zero_copy,
                            ucx=ucx_path.option(ucx))
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
    the RRefs it owned). A stuck process is killed first.

    ``%rpc_restart WORKER``.

    Args:
        name: the worker to replace, one that this process started; or a worker set
            (``worker1-4``, ``worker2,worker5-7``), replaced one after another.

    Returns:
        The group, with the fresh process under ``name``.

    Raises:
        rpcnb.RpcnbError: this process is in no group or is not its first kernel; ``name`` is
            this process, a kernel that joined, or no worker of the group; the fresh
            process failed to start or did not join in time.
    """
    from rpcnb.membership import resize
    from rpcnb.session import roster

    for one in roster.expand(state.current(), name):
        print(resize.restart(one))
    return group()


@_launcher_kept_only_if_used
def add_workers(n: int, gpus: str | None = None) -> Group:
    """Start ``n`` more workers in the running group (on the first kernel); ``gpus`` as
    for ``init``.

    ``%rpc_init --add N``.

    Args:
        n: how many workers to start; they are named on from the highest ``workerK`` the
            group has used.
        gpus: which of this kernel's GPUs each new worker gets, as for ``init``.

    Returns:
        The group, with the new workers.

    Raises:
        ValueError: ``n`` is not a whole number above 0, or ``gpus`` does not fit this
            machine's GPUs.
        rpcnb.RpcnbError: this process is in no group or is not its first kernel; the group has
            device maps (torch fixes a member's map when it starts, so the members running
            could not send CUDA tensors to new ones); a worker failed to start or did not
            join in time.
    """
    from rpcnb.membership import resize

    print(resize.describe_added(resize.add_workers(n, gpus)))
    return group()


def shutdown(timeout: float = 10.0) -> None:
    """Leave the group. On the first kernel: every worker leaves first, then this one.

    Bounded: a worker that has not left after ``timeout`` seconds is killed (a process
    this kernel started) or dropped from the group (a joined kernel). No worker process
    is left behind, and ``init`` works again afterwards. On a kernel that joined, only
    this kernel leaves and the group goes on. ``%rpc_shutdown``.

    Args:
        timeout: seconds the other members get to leave before they are stopped
            (SIGTERM, then SIGKILL) or dropped.

    Raises:
        rpcnb.RpcnbError: this process is in no group.
    """
    s = state.current()
    kept_group = s.kept_group
    if s.is_leader:
        leave.shutdown_group(s, timeout)
    else:
        leave.leave_group(timeout, tell=True)
    if kept_group and not s.is_leader:  # a kept group's driver ends the group itself
        from rpcnb.membership import kept

        kept.end(kept_group, timeout)
