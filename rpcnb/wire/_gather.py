"""torch's all-gather and barriers in a group whose members change: ``rpc.api._all_gather``,
``_barrier`` (every member, or a named subset) and ``_wait_all_workers``, which libraries and
pasted training scripts call to synchronise members.

torch fills ``api._ALL_WORKER_NAMES`` once, inside ``init_rpc``: in a dynamic group (rpcnb's)
it never learns of a member that joined later, nor of one that left or died, so an
all-gather waits for someone who never comes, or finishes without those who do. Here
``set_names`` keeps it current (the session layer calls it as members are admitted, die,
leave or are replaced), and ``install`` replaces ``_all_gather`` and ``_barrier`` with
torch's algorithm (the smallest name leads; the others send it their object, it sends the
whole back; torch's own ``_gather_to_leader`` and ``_broadcast_to_followers`` on the wire)
that differs in three places:

- no names given means the group's names now (the session's ``view``), not init_rpc's;
- a round's key names each member with its rank, so a member replaced under the same name
  (``%rpc_restart``: a new rank) starts counting rounds afresh with everyone else;
- it waits in slices, and fails as soon as a member it waits for died or left (the
  session's ``gone``): ``WorkerDiedError`` naming it, also out of ``_barrier``, which
  otherwise logs torch's errors and returns as torch's does.

Outside an rpcnb group (``view`` says None) torch's own run. Checked against torch 2.11 and
2.13 (torch/distributed/rpc/api.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch.distributed.rpc import api
from torch.distributed.rpc.constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

from rpcnb import errors
from rpcnb.errors import WorkerDiedError
from rpcnb.waiting import Deadline
from rpcnb.wire import patches

SLICE = 0.05  # seconds between two looks at who is gone, while a round waits

View = Callable[[], "set[str] | None"]
Gone = Callable[[Iterable[str]], dict[str, str]]


@dataclass
class Members:
    """Where rpcnb's all-gather asks about the group (``install``): the process's
    (``MEMBERS``), as the session layer set it; both None before it did."""

    view: View | None = None  # the group's names now (None: this process is in no rpcnb group)
    gone: Gone | None = None  # which of the names given died or left, each with what to say


MEMBERS = Members()
_torch_all_gather = api._all_gather
_torch_barrier = api._barrier


def set_names(names: Iterable[str]) -> None:
    """This member's view of the group's names, where torch's functions read it."""
    api._ALL_WORKER_NAMES = set(names)


def names() -> set[str]:
    """The names ``_all_gather`` and ``_wait_all_workers`` wait for by default."""
    return set(api._ALL_WORKER_NAMES)


def install(view: View, gone: Gone) -> None:
    """Use rpcnb's ``_all_gather`` and ``_barrier`` (once; ``patches.restore`` undoes it):
    ``view()`` is the group's names now (None: this process is in no rpcnb group), ``gone``
    the names among those given that died or left, each with what to say of it."""
    MEMBERS.view, MEMBERS.gone = view, gone
    if not patches.replaced(api, "_all_gather"):
        patches.replace(api, "_all_gather", _all_gather)
        patches.replace(api, "_barrier", _barrier)


def forget_rounds(name: str) -> None:
    """Drop the rounds ``name`` took part in (it died or left): one that never finished
    would keep what the others had sent, under a key no round uses again (a key names
    each member's rank, and ranks are never reused)."""
    def took_part(key: Any) -> bool:
        return f",{name}:" in "," + str(key).split("#", 1)[0]

    with api._all_gather_dict_lock:
        for key in [k for k in api._all_gather_sequence_id_to_states if took_part(k)]:
            del api._all_gather_sequence_id_to_states[key]
        for key in [k for k in api._all_gather_sequence_id if took_part(k)]:
            del api._all_gather_sequence_id[key]


def _all_gather(obj: Any, worker_names: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    return _gather(obj, worker_names, timeout, "_all_gather")


def _gather(obj: Any, worker_names: Any, timeout: float, what: str) -> Any:
    """torch's ``_all_gather`` as the module says; ``what``: which of torch's functions the
    user called, for the message when a member is gone."""
    view = MEMBERS.view() if MEMBERS.view is not None else None
    if view is None or MEMBERS.gone is None:
        return _torch_all_gather(obj, worker_names, timeout)
    wanted = set(worker_names) if worker_names else view
    _fail_if_gone(what, wanted)
    agent = api._get_current_rpc_agent()
    me = agent.get_worker_info().name
    leader = min(wanted)
    key = ",".join(f"{n}:{agent.get_worker_info(n).id}" for n in sorted(wanted))
    with api._all_gather_dict_lock:
        number = api._all_gather_sequence_id.get(key, 0)
        api._all_gather_sequence_id[key] = number + 1
    sequence_id = f"{key}#{number}"
    if timeout == UNSET_RPC_TIMEOUT:  # torch's three cases, as torch's _all_gather has them
        rpc_timeout, signal_timeout = api.get_rpc_timeout(), None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, signal_timeout = timeout, None
    else:
        rpc_timeout = signal_timeout = timeout
    try:
        if leader == me:
            api._gather_to_leader(sequence_id, me, obj, wanted)
        else:
            _wait(api.rpc_async(leader, api._gather_to_leader,
                                args=(sequence_id, me, obj, wanted), timeout=rpc_timeout),
                  what, wanted)
        with api._all_gather_dict_lock:
            states = api._all_gather_sequence_id_to_states[sequence_id]
        deadline = Deadline.after(signal_timeout)
        # not waiting.until: it waits on torch's event, and between two slices looks
        # whether a member of the round is gone
        while not states.proceed_signal.wait(SLICE):
            _fail_if_gone(what, wanted)
            if deadline.passed():
                break  # torch goes on with what it has when its signal times out
        if leader == me:
            _broadcast(states, sequence_id, leader, wanted, rpc_timeout, what)
    except BaseException:
        with api._all_gather_dict_lock:
            api._all_gather_sequence_id_to_states.pop(sequence_id, None)
        raise
    with api._all_gather_dict_lock:
        api._all_gather_sequence_id_to_states.pop(sequence_id, None)
    return states.gathered_objects


def _broadcast(states: Any, sequence_id: str, leader: str, wanted: set[str],
               rpc_timeout: float, what: str) -> None:
    """The leader sends the whole to every other member (torch's phase 2)."""
    futures = {name: api.rpc_async(name, api._broadcast_to_followers,
                                   args=(sequence_id, states.gathered_objects),
                                   timeout=rpc_timeout)
               for name in wanted - {leader}}
    failed = []
    for name, fut in futures.items():
        try:
            _wait(fut, what, wanted)
        except RuntimeError as exc:
            if isinstance(exc, WorkerDiedError):
                raise
            failed.append((name, exc))
    if failed:
        _fail_if_gone(what, {name for name, _ in failed})
        raise RuntimeError(  # torch's words: tests and callers match them
            f"Followers {[name for name, _ in failed]} timed out in _all_gather "
            f"after {rpc_timeout:.2f} seconds. The first exception is {failed[0][1]}")


def _wait(fut: Any, what: str, wanted: set[str]) -> Any:
    """``fut.wait()``, failing early when a member of the round is gone."""
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    while not done.wait(SLICE):
        _fail_if_gone(what, wanted)
    return fut.wait()


def _fail_if_gone(what: str, wanted: set[str]) -> None:
    assert MEMBERS.gone is not None
    gone = MEMBERS.gone(wanted)
    if gone:
        name = sorted(gone)[0]
        raise WorkerDiedError(errors.GATHER_GONE.format(
            what=what, names=", ".join(sorted(wanted)), said=gone[name]), name)


def _barrier(worker_names: Any) -> None:
    # torch's _barrier logs a failed round and returns; a member that died or left is
    # raised instead: the barrier can never be passed
    try:
        _gather(None, set(worker_names), UNSET_RPC_TIMEOUT, "_barrier")
    except WorkerDiedError:
        raise
    except RuntimeError:
        api.logger.exception("Failed to complete barrier")
