"""How a process becomes a member: ``start_member`` (init_rpc with dynamic membership,
under rpcnb's session), ``register`` (ask the leader to be admitted), and on the leader
``launch_workers`` / ``wait_ready`` for the worker processes it starts. ``join_member``
puts the steps in order for a process that joins a running group, as
``founding.found_group`` does for the first member of a new one.

A member becomes visible to torch's group inside ``init_rpc``, before it has finished
setting itself up. So nobody counts it as a member until it has registered with the
leader, which it does last: the leader admits it, and only admitted members are listed,
sent cells or asked anything.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rpcnb import errors, machine, settings, telemetry
from rpcnb.cells.output import install_routing, shell
from rpcnb.cells.runner import CellRunner
from rpcnb.errors import RpcnbError
from rpcnb.membership import leave, view
from rpcnb.observe import channels
from rpcnb.paths import routes, serialize, shm
from rpcnb.procs import launch
from rpcnb.session import fence, protocol, rendezvous, roster, state
from rpcnb.session.members import Member, WorkerSpec
from rpcnb.session.state import Session
from rpcnb.session.teardown import Teardown
from rpcnb.waiting import until
from rpcnb.wire import _rref_context, _torch, options

START_TIMEOUT = 120.0


def start_member(name: str, rank: int, init_method: str, opts: options.GroupOptions, *,
                 leader: str, runner: Any, secret: str, group_dir: Path | None = None,
                 store: Any = None, env: dict[str, str] | None = None,
                 teardown: Teardown | None = None) -> Session:
    """init_rpc with dynamic membership, with this process's session already in place
    (requests that arrive while init_rpc runs are answered, or refused, by it).

    ``store``: a store this process serves itself (the leader of a TCP group); otherwise
    torch connects to ``init_method``. ``env``: environment variables for this group
    (``TP_SOCKET_IFNAME``), put back when it ends. Each thing it sets up registers its
    cleanup on ``teardown`` (the caller's stack, with what the caller set up before); if
    it fails, the whole stack unwinds before the error is raised."""
    launch.apply_quiet_env()
    serialize.install()
    s = Session(name, rank, leader, init_method, opts, secret, runner=runner,
                group_dir=group_dir, teardown=teardown)
    try:
        _start_member(s, init_method, store, env)
    except BaseException:
        s.teardown.close()
        raise
    telemetry.clear()  # a new group: its worker1 is not the last group's worker1
    return s


def _stop_agent(s: Session) -> bool:
    """torch's agent leaves (as the session's leaving says); once it has, torch's RRef
    context is as torch left it (``_rref_context.note_agent_stopped``). Whether it left."""
    left = leave.local_shutdown(graceful=s.leaving[0], timeout=s.leaving[1])
    if left:
        _rref_context.note_agent_stopped()
    return left


def _start_member(s: Session, init_method: str, store: Any, env: dict[str, str] | None) -> None:
    name, rank, opts = s.name, s.rank, s.options
    state.begin(s)
    s.teardown.push("session", lambda: state.end(s))  # also puts the environment back
    # the group's data paths, given back after torch's agent has left (messages in flight
    # may still use them)
    s.paths = paths = routes.Paths(s)
    s.teardown.push("shared memory", paths.close_shm)
    s.teardown.push("UCX", paths.close_ucx)
    for key, value in (env or {}).items():
        s.set_env(key, value)
    iface = settings.other("TP_SOCKET_IFNAME")
    _torch.check_interface(iface)
    # torch prefixes the store with a per-process init counter; every rpcnb group uses
    # a fresh store, so a kernel re-initialising after shutdown starts from 0 again.
    _torch.reset_init_counter()
    backend = options.backend_options(opts, init_method)
    fenced = not s.one_host and init_method.startswith("tcp://")
    before = set(fence.listeners().values()) if fenced else set()
    if store is None:
        import torch.distributed.rpc as rpc

        rpc.init_rpc(name, rank=rank, rpc_backend_options=backend)
    else:
        _torch.init_rpc_with_store(name, rank, store, backend)
    _rref_context.note_agent_started()
    roster.follow_names()  # torch's all-gather and barriers follow the group's members
    s.teardown.push("torch's RPC agent", lambda: _stop_agent(s))
    if fenced:  # before anything else: strangers' bytes can end TensorPipe (fence's why)
        _fence(s, before)
    if backend.device_maps:  # before anyone replies with a CUDA tensor (_torch's why)
        for peer, me, reverse in _torch.reverse_maps_to_teach():
            protocol.call(s.token, peer, "reverse_map", me, reverse, timeout=30)
    _torch.note_interface(iface)
    roster.keep_rank(rank)
    # RemoteModule's forward refers to a module torch generates when torch.distributed.nn
    # is imported: a forward request can arrive before the request that would import it
    import torch.distributed.nn  # noqa: F401
    paths.activate(s, on_full=_shm_full(s))  # what the group asked for: shm, UCX


def _fence(s: Session, before: set[str]) -> None:
    """Let only the group's hosts reach the listeners torch's agent just opened."""
    host = s.init_method[len("tcp://"):].rpartition(":")[0].strip("[]")
    # its own client, quick to give up: the store goes with the first kernel
    store = rendezvous.open_store(s.init_method, timeout=2.0)
    f = fence.fence(store, s.secret, before, fence.my_addresses(host))
    if f is None:
        print(f"rpcnb: {errors.NOT_FENCED}", file=sys.stderr)
    else:
        s.teardown.push("fence", f.stop)


def _shm_full(s: Session) -> Any:
    """What this member does the first time /dev/shm has no room: the leader says it (once
    for the group, in the cell that is running)."""
    def tell(message: str) -> None:
        if s.is_leader:
            report_shm_full(s, message)
        else:
            protocol.call_async(s.token, s.leader, "shm_full", message, timeout=5)

    return tell


def report_shm_full(s: Session, message: str) -> None:
    """On the leader: the one warning of the group about a full /dev/shm."""
    if s.first_shm_warning():
        print(f"rpcnb: {message}", file=sys.stderr)


def self_info(s: Session) -> dict[str, Any]:
    """This member's pid, host, kind and devices (what %rpc_workers shows of it)."""
    import torch

    runner = s.runner
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "kind": s.kind,
        "devices": machine.cuda_devices(),
        "gpus": settings.other("CUDA_VISIBLE_DEVICES") if runner and runner.on_main else "",
        "cells": runner.cells_run if runner is not None else 0,
        "torch": torch.__version__,
        "memory": view.memory_info(),
        "address": view.listen_address(),
        "running": view.running_now(s),
    }



def register(s: Session, timeout: float = 10.0) -> list[tuple[str, int]] | None:
    """Ask the leader to admit this member (with the join proof): the admitted members,
    or None when the leader refused (or is gone)."""
    info = self_info(s)
    info["facts"] = channels.local_facts()
    try:
        admitted = protocol.call(s.token, s.leader, "register", s.name, s.rank, info,
                                 rendezvous.proof(s.secret, s.name, s.rank), timeout=timeout)
    except Exception:
        return None
    if not admitted:
        return None
    for other, other_rank in admitted:
        s.add_member(Member(other, other_rank), replace=False)
    s.add_member(Member(s.name, s.rank, info["host"], info["pid"], info["kind"],
                        info["devices"], info["gpus"], address=info["address"]))
    roster.names_changed(s)
    return list(admitted)


def kernel_runner(name: str, kind: str = "kernel") -> CellRunner:
    """A cell runner over this kernel's (or script's) own namespace, on its own thread.
    ``kind`` is what %rpc_workers calls this member ("kernel", or "engine" for an
    ipyparallel engine, whose namespace is the one ``%%px`` runs in)."""
    sh = shell()
    if sh is not None:
        ns = sh.user_ns
    else:
        import __main__

        ns = __main__.__dict__
    runner = CellRunner(name, ns, sh)
    runner.kind_name = kind
    install_routing(sh)
    runner.start_thread()
    return runner


def join_member(address: str, name: str, opts: options.GroupOptions, runner: Any, *,
                token: str | None = None, device_map: Any = None,
                interface: str | None = None, teardown: Teardown | None = None) -> Session:
    """Make this process member ``name`` of the group at ``address`` (a connection file,
    its directory or file:// store, or tcp://HOST:PORT with ``token``), its remote cells
    run by ``runner``; registered with the leader when this returns (RpcnbError when the
    leader refused it). Everything that can be checked is checked before anything is
    claimed. Across hosts TensorPipe listens on ``interface`` (default: the one that
    reaches the group's host). ``founding.found_group`` is its mirror for a new group."""
    launch.apply_quiet_env()
    if state.is_initialized():
        raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    options.check_name(name)
    mine = machine.cuda_devices()
    if device_map is not None and not (isinstance(device_map, str)
                                       and device_map.strip().lower() == "auto"):
        options.check_device_map(device_map, name, local_devices=mine)  # before any I/O
    conn = rendezvous.read_connection(address, token)
    env: dict[str, str] = {}
    if interface:
        env["TP_SOCKET_IFNAME"] = machine.check_interface_name(interface)
    if conn.is_tcp:
        host, _, port = conn.address[len("tcp://"):].rpartition(":")
        if not machine.is_loopback(host.strip("[]")):
            opts = opts.replace(one_host=False)
            env.setdefault("TP_SOCKET_IFNAME", machine.interface_towards(host.strip("[]"), int(port)))
    _torch.check_interface(env.get("TP_SOCKET_IFNAME", settings.other("TP_SOCKET_IFNAME")))
    store = rendezvous.open_store(conn.address)
    leader = rendezvous.check_group(store, conn.secret, address)
    roster.refuse_join_while_unreachable(store)
    mapped = options.join_device_map(name, device_map, mine, roster.published(store))
    if mapped:
        opts = opts.replace(device_map=mapped)
    roster.claim_name(store, name)
    fixed = roster.fixed_rank()
    if fixed is None:
        rank = roster.next_rank(store)
    elif not roster.claim_rank(store, fixed):
        raise RpcnbError(errors.RANK_FIXED.format(rank=fixed))
    else:
        rank = fixed
    roster.publish(store, name, mine, mapped)
    if not opts.one_host:  # the fenced members let this host in first
        if not fence.announce(store, conn.secret, fence.my_addresses(host.strip("[]"))):
            print(f"rpcnb: {errors.FENCE_SLOW}", file=sys.stderr)
    s = start_member(name, rank, conn.address, opts, leader=leader, runner=runner,
                     secret=conn.secret, env=env, teardown=teardown)
    if register(s) is None:
        # refused (the wrong secret): leave torch's group the way any member leaves, so
        # nobody waits for this one later
        leave.leave_group(timeout=5)
        raise RpcnbError(rendezvous.REFUSED.format(leader=leader))
    return s


def launch_workers(s: Session, names: list[str], opts: options.GroupOptions,
                   devices: options.DevicePlan) -> None:
    """On the leader: claim a name and a rank for each worker, and start its process with
    its GPUs (``CUDA_VISIBLE_DEVICES``) and its device map from ``devices``."""
    store = _torch.store()
    env: dict[str, str] = {}
    if machine.ib_devices():  # DI-engine's caveat: fork and RDMA (libibverbs) together
        env.update(IBV_FORK_SAFE="1", RDMAV_FORK_SAFE="1")
    for wname in names:
        roster.claim_name(store, wname)
        rank = roster.next_rank(store)
        assert s.group_dir is not None
        wopts = opts.replace(device_map=devices.maps.get(wname))
        wenv = dict(env)
        if devices.visible.get(wname) is not None:
            wenv["CUDA_VISIBLE_DEVICES"] = str(devices.visible[wname])
        proc = start_worker(s, wname, rank, wopts, wenv)
        s.add_worker(wname, proc, WorkerSpec(wopts, wenv))
        s.teardown.push(worker_step(wname), functools.partial(stop_worker, s, proc))


def worker_step(name: str) -> str:
    """The name of worker ``name``'s step on its group's teardown stack."""
    return f"worker {name}"


def stop_worker(s: Session, w: launch.LocalWorker, grace: float = 1.0) -> None:
    """A worker this process started: stopped if it has not left (a leaving worker is
    told to go first), and the shared memory it could not give back itself removed."""
    w.left = True  # the death watcher does not report an exit it was told about
    if w.alive():
        w.stop(grace=grace)
    shm.remove_segments_of(w.pid, s.group_id)


def start_worker(s: Session, name: str, rank: int, wopts: options.GroupOptions,
                 wenv: dict[str, str]) -> launch.LocalWorker:
    """On the leader: worker ``name``'s process (forked by the warm launcher), or
    RpcnbError with what the launcher said when it could not start one."""
    assert s.group_dir is not None
    try:
        return launch.start_worker(name, rank, s.init_method, s.name, s.group_dir, wopts.to_json(),
                                   s.secret, env=wenv)
    except launch.LauncherFailed as exc:
        raise RpcnbError(errors.LAUNCHER_FAILED.format(name=name, why=exc)) from None


def wait_ready(s: Session, timeout: float = START_TIMEOUT,
               names: list[str] | None = None) -> None:
    """On the leader: until every started worker (or each of ``names``) has registered,
    showing each one's state as it goes (``progress.Board``); a worker that exits first
    fails the start at once, with its log."""
    from rpcnb import progress

    waiting = {n: w for n, w in s.workers_started().items() if names is None or n in names}
    board = progress.Board(f"rpcnb: starting {len(waiting)} worker(s)", list(waiting))
    for wname, w in waiting.items():
        board.set(wname, f"starting (pid {w.pid})")

    def all_registered() -> bool:  # and a worker that exited ends the wait with its log
        for wname, w in list(waiting.items()):
            if s.is_admitted(wname):
                del waiting[wname]
                board.set(wname, "ready")
            elif not w.alive():
                board.set(wname, f"failed: {w.how_died()}")
                raise RpcnbError(errors.START_FAILED.format(name=wname, how=w.how_died(),
                                                            log=w.log_tail()))
        return not waiting

    t0 = time.monotonic()
    try:
        if not until(all_registered, timeout):
            wname, w = next(iter(waiting.items()))
            board.set(wname, "did not start in time")
            raise RpcnbError(errors.START_TIMEOUT.format(name=wname, timeout=timeout,
                                                         log=w.log_tail()))
    finally:
        board.close(f"rpcnb: {len(board.rows)} worker(s) started in "
                    f"{time.monotonic() - t0:.1f} s")


def watch_in_background(s: Session, target: Any, *args: Any) -> None:
    """Run a watcher thread (``rpcnb-watch``) for this group."""
    s.watcher = threading.Thread(target=target, args=(s, *args), name="rpcnb-watch",
                                 daemon=True)
    s.watcher.start()
    s.teardown.push("death watcher", functools.partial(_stop_watching, s))


def _stop_watching(s: Session) -> None:
    s.closing = True  # the watcher ends its loop, and reports no exit from here on
    if s.watcher is not None and s.watcher is not threading.current_thread():
        s.watcher.join(1)
