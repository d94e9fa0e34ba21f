"""How a new group comes to be on its first member: ``found_group`` makes this process the
leader (rank 0) of a group it founds and starts the group's worker processes, as
``start.join_member`` makes a process a member of a group that runs. ``api.init`` checks
its arguments and hands the start to it; ``Meeting.checked`` is its check of where the
group meets.

It reads as ``join_member`` does: check, the rendezvous (the group's folder and its
store), the member's start (``start.start_member``), what a joiner checks and what the
group claims in the store, then what only a leader does: start the workers, wait until
each has registered, form the collectives, watch for deaths. Each thing set up registers
its cleanup on the group's teardown stack as it comes up; a failure at any step unwinds
the stack before the error is raised.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcnb import errors, machine, settings
from rpcnb.membership import collectives as coll
from rpcnb.membership import failures, kept, start
from rpcnb.procs import launch
from rpcnb.session import fence, rendezvous, roster
from rpcnb.session.members import Member
from rpcnb.session.state import Session
from rpcnb.session.teardown import Teardown
from rpcnb.wire import _torch, options

NEEDS_PORT = ("--host/--allow-remote need --port: a group reachable from other hosts meets "
              "over TCP.")


@dataclass(frozen=True)
class Meeting:
    """Where a new group meets: a store file in the group's folder (``port`` None: nothing
    listens) or a TCP store on ``host:port`` (0: any free port), and the interface
    TensorPipe listens on."""

    port: int | None = None
    host: str = "127.0.0.1"
    interface: str = "lo"
    remote: bool = False  # other hosts may join: no shared memory, TensorPipe on interface

    @classmethod
    def checked(cls, port: int | None, host: str, allow_remote: bool,
                interface: str | None) -> Meeting:
        """``init``'s ``port``, ``host``, ``allow_remote`` and ``interface``, checked
        against each other and this machine (ValueError with what to do)."""
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
        if remote and interface is None:
            iface = machine.interface_of(host)
        if port is None and (remote or allow_remote):
            raise ValueError(NEEDS_PORT)
        return cls(port, host, iface, remote)


@dataclass(frozen=True)
class _Rendezvous:
    """The store a new group meets at, once it exists: ``init_method`` for every member;
    ``client``, this process's own client of a TCP store it serves (its agent's store);
    ``listen``, that store's address."""

    group_dir: Path
    init_method: str
    client: Any = None
    listen: tuple[str, int] | None = None


def found_group(name: str, workers: list[str], opts: options.GroupOptions,
                devices: options.DevicePlan, meeting: Meeting, *,
                collectives: str | None = None,
                collective_timeout: float | None = None) -> Session:
    """Make this process member ``name`` (rank 0, the leader) of a new group that meets at
    ``meeting``, and start its ``workers`` with their GPUs and maps from ``devices``. When
    this returns each worker has registered, the ``collectives`` process group (if any) is
    formed and the death watcher runs. The arguments were checked (``api.init``); a failure
    at any step unwinds what came up before the error is raised."""
    _torch.check_interface(meeting.interface if meeting.remote
                           else settings.other("TP_SOCKET_IFNAME"))
    if workers:
        launch.warm_up()  # already running when %rpc_init or rpcnb.init started it
    rendezvous.sweep_groups()  # what killed kernels left behind, their secrets included
    secret = rendezvous.new_secret()
    # everything this start sets up registers its cleanup here as it comes up; a failure
    # at any step unwinds it, and so does every later way out of the group (Session.teardown)
    teardown = Teardown()
    try:
        place = _meet(meeting, opts.timeout, teardown)
        keeper = kept.this_is_the_keeper()
        if keeper:  # the workers (opts go to them) leave it out of all-gathers and --all
            opts = opts.replace(keeper=True)
        runner = _leader_runner(name, keeper, teardown)
        # TensorPipe listens on TP_SOCKET_IFNAME; the workers inherit it (for this group)
        s = start.start_member(name, roster.fixed_rank() or 0, place.init_method, opts,
                               leader=name, runner=runner, group_dir=place.group_dir,
                               secret=secret, store=place.client, teardown=teardown,
                               env={"TP_SOCKET_IFNAME": meeting.interface} if meeting.remote
                               else None)
        _open(s, place, meeting)
        _claim(s, [name, *workers], devices)
        start.launch_workers(s, workers, opts, devices)
        start.wait_ready(s)
        if collectives:
            print(coll.form(s, collectives, workers, collective_timeout or coll.DEFAULT_TIMEOUT))
        start.watch_in_background(s, failures.watch)
    except BaseException:
        teardown.close()
        raise
    return s


def _meet(meeting: Meeting, timeout: float, teardown: Teardown) -> _Rendezvous:
    """The group's private folder (mode 0700) and its store: the file ``store`` in it, or
    a TCP store this process serves."""
    group_dir = Path(tempfile.mkdtemp(prefix="rpcnb-"))
    teardown.push("group folder", functools.partial(shutil.rmtree, group_dir, ignore_errors=True))
    if meeting.port is None:
        return _Rendezvous(group_dir, f"file://{group_dir / 'store'}")
    # this process serves the store; its agent is a client of it, like the others
    # (torch keeps an agent's store alive after shutdown: the server must not be it)
    served = [rendezvous.serve_store(meeting.host, meeting.port, timeout)]
    port = served[0][1]
    teardown.push("rendezvous store", served.clear)  # it listens while the list holds it
    init_method = f"tcp://{meeting.host}:{port}"
    client = rendezvous.open_store(init_method, timeout, prefixed=False)
    return _Rendezvous(group_dir, init_method, client, (meeting.host, port))


def _leader_runner(name: str, keeper: bool, teardown: Teardown) -> Any:
    """The runner of the leader's remote cells (a kept group's keeper runs none)."""
    runner = start.kernel_runner(name, roster.KEEPER_KIND if keeper else "kernel")
    teardown.push("cell runner", runner.stop)
    return runner


def _open(s: Session, place: _Rendezvous, meeting: Meeting) -> None:
    """The group opens: its connection file, and in its store what a joiner checks before
    it joins torch's group (``rendezvous.check_group``) and, across hosts, this host for
    the fences of members on other hosts."""
    s.connection_path = rendezvous.write_connection(
        place.group_dir, rendezvous.Connection(place.init_method, s.secret, s.name))
    if place.listen is not None:
        s.listen = place.listen
        if meeting.remote:
            print(rendezvous.REMOTE_EXPOSES.format(host=meeting.host, port=place.listen[1],
                                                   iface=meeting.interface))
    store = _torch.store()
    rendezvous.announce_group(store, s.secret, s.name)
    if meeting.remote:
        fence.announce(store, s.secret, fence.my_addresses(meeting.host), wait=0)


def _claim(s: Session, members: list[str], devices: options.DevicePlan) -> None:
    """The leader's name and rank, taken for good, and every member's devices and map
    where joiners check theirs; the leader is its own first member."""
    store = _torch.store()
    roster.claim_name(store, s.name)
    roster.claim_rank(store, s.rank)
    for member in members:
        roster.publish(store, member, devices.devices[member], devices.maps.get(member))
    s.add_member(Member(s.name, s.rank, socket.gethostname(), os.getpid(), "kernel",
                        machine.cuda_devices()))
