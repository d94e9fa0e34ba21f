"""Everything another member can ask of this one, in one table.

Every request reaches ``rpcnb.session.protocol.entry``, which checks the group token before it
looks an operation up here; a request without the token runs nothing. Each handler takes
this process's session first, then the request's arguments. ``install()`` puts the
table in place; a process does it before it joins a group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from rpcnb import telemetry
from rpcnb.cells import call, comms, console, messages, output, printer
from rpcnb.cells.runner import Job
from rpcnb.membership import collectives, leave, resize, start, view
from rpcnb.observe import channels, doctor, names, stacks, values
from rpcnb.paths import serialize, ucx
from rpcnb.session import protocol, roster
from rpcnb.session.state import Session
from rpcnb.wire import _torch

NO_RUNNER = "rpcnb: this member runs no remote cells"
NOT_LEADER = "rpcnb: only the group's first kernel admits members"
NOT_KEEPER = "rpcnb: only the group's first member (a kept group's keeper) changes the group"


# -- remote cells ------------------------------------------------------------------------


def run_cell(s: Session, call_id: str, caller: str, source: str, fetch: bool,
             push: dict[str, Any], zero_copy: bool = True,
             profile: bool = False) -> torch.futures.Future:
    """Queue a cell on this member's runner; the future completes with its result
    (``CellResult.wire``: most as a tuple) (``zero_copy=False``: a fetched tensor in shared
    memory is copied, not shared)."""
    if s.runner is None:
        raise RuntimeError(NO_RUNNER)
    fut: torch.futures.Future = s.runner.future()
    s.runner.submit(Job(s.token, call_id, caller, source, fetch, push, fut,
                        zero_copy=bool(zero_copy), profile=bool(profile)))
    return fut


def interrupt(s: Session, call_id: str) -> bool:
    """Interrupt the cell ``call_id`` (or drop it from the queue)."""
    if s.runner is None:
        raise RuntimeError(NO_RUNNER)
    return bool(s.runner.interrupt(call_id))


def adopt(s: Session, member: str) -> list[dict[str, Any]]:
    """A kernel that attached to this kept group takes over the cells whose caller went
    away (``rpcnb.cells.orphans``): what each is, and what it printed meanwhile."""
    if s.runner is None:
        return []
    return s.runner.orphans.adopt(str(member))


def orphan_result(s: Session, call_id: str, member: str) -> torch.futures.Future:
    """The result of the adopted cell ``call_id``, once it ends; its output goes to
    ``member`` from now on."""
    if s.runner is None:
        raise RuntimeError(NO_RUNNER)
    return s.runner.orphans.result(str(call_id), str(member))


def ask(s: Session, call_id: str | None, worker: str, prompt: str,
        password: bool) -> torch.futures.Future:
    """A worker running a cell (or a call) of this process asks for a line of input; the
    future completes with ``(kind, text)`` once the user answered (``rpcnb.cells.console``)."""
    fut: torch.futures.Future = torch.futures.Future()
    console.route(s, call_id, console.Question(str(worker), str(prompt), bool(password), fut))
    return fut


def cell_position(s: Session, call_id: str) -> str | None:
    """What this member runs while the cell ``call_id`` waits in its queue (None: the
    cell runs, ended, or is unknown here)."""
    if s.runner is None:
        return None
    return s.runner.position(call_id)


def deliver(s: Session, call_id: str | None, worker: str, seq: int, items: list[Any]) -> None:
    """A batch of output from a cell this process sent (or, with ``call_id=None``, from a
    worker process outside any cell: shown wherever this process is)."""
    if call_id is None:
        lines = printer.Printer(prefix=True, on_comm=comms.relay)
        lines.show(worker, [i for i in messages.from_wire(items)
                            if isinstance(i, (messages.Stream, messages.Comm))])
        lines.finish()
        return
    call.deliver(s, call_id, worker, seq, items)


def aside(s: Session, call_id: str, worker: str, items: list[Any]) -> None:
    """Output of a cell this process sent, outside its batches' order (a transfer's
    progress): shown when it arrives."""
    call.aside(s, call_id, worker, items)


def comm(s: Session, comm_id: str, kind: str, msg: dict[str, Any]) -> bool:
    """The front end said something to a widget made here (``rpcnb.cells.comms``)."""
    return comms.incoming(comm_id, kind, msg)


def collectives_join(s: Session, backend: str, rank: int, world: int, where: dict[str, Any],
                     timeout: float) -> int:
    """Become ``rank`` of the workers' process group (``rpcnb.membership.collectives``)."""
    return collectives.join(s, backend, rank, world, where, timeout)


def collectives_gpu(s: Session, rank: int) -> str | None:
    """The UUID of the GPU this worker would use as ``rank`` under NCCL (None: no CUDA)."""
    return collectives.gpu_for(rank)


def reverse_map(s: Session, joiner: Any, reverse: dict[Any, Any]) -> None:
    """A later member's device map onto this one, reversed: replies to it with CUDA
    tensors go back through it (``rpcnb.wire._torch.reverse_maps_to_teach``)."""
    _torch.learn_reverse_map(joiner, reverse)


def collectives_end(s: Session) -> None:
    """Leave the workers' process group (it is formed again)."""
    collectives.end()


def unpark(s: Session, key: str) -> Any:
    """A value parked by ``make_rref``, now owned by the RRef this request creates."""
    return s.unpark(key)


# -- the group ---------------------------------------------------------------------------


def register(s: Session, name: str, rank: int, info: dict[str, Any], proof: str) -> Any:
    """On the leader: a new member asks to be admitted (see ``roster.admit``)."""
    if not s.is_leader:
        raise RuntimeError(NOT_LEADER)
    return roster.admit(s, name, rank, info, proof)


def shm_full(s: Session, message: str) -> None:
    """A member found /dev/shm full: the group's one warning (on the leader)."""
    start.report_shm_full(s, message)


def ucx_pull(s: Session, tag: int, receiver: str, address: bytes) -> str:
    """A member unpickling a message from this one wants the tensor under ``tag`` over
    UCX (see ``rpcnb.paths.ucx``)."""
    return ucx.pull(s, tag, receiver, address)


def registry(s: Session) -> list[tuple[str, int]]:
    """Who was admitted (other members' ``roster.live_names`` ask the leader)."""
    return s.admitted()


def member_died(s: Session, name: str, how: str, rank: int = -1) -> None:
    """The leader says ``name`` (the process of ``rank``) died, or ``name`` says it leaves
    (``how`` is "left")."""
    roster.death_heard(s, str(name), str(how), int(rank))
    if s.runner is not None:  # its cells here run on, kept for a kernel that attaches
        s.runner.caller_gone(str(name))


def member_joined(s: Session, name: str, rank: int) -> None:
    """The leader admitted ``name``."""
    roster.learn_member(s, str(name), int(rank))
    if s.runner is not None:
        s.runner.orphans.caller_back(str(name))


def member_back(s: Session, name: str) -> None:
    """The leader started ``name`` again (``%rpc_restart``)."""
    s.revive(name)
    roster.names_changed(s)
    if s.runner is not None:
        s.runner.orphans.caller_back(str(name))


def drop_member(s: Session, info: Any) -> None:
    """The leader removes a dead member from torch's group: drop it here too."""
    _torch.drop_locally(info)
    roster.member_gone(s, info.name)


def resize_group(s: Session, what: str, *args: Any) -> Any:
    """On a kept group's keeper (its leader): the attached kernel restarts or adds workers
    (``%rpc_restart``, ``%rpc_init --add``, the panel's restart button)."""
    if not s.is_leader:
        raise RuntimeError(NOT_KEEPER)
    return resize.keeper_resize(str(what), *args)


def leave_now(s: Session) -> bool:
    """The leader asks this member to leave (a worker process then exits)."""
    def go() -> None:
        leave.leave_group(timeout=10.0)
        if s.runner is not None:
            s.runner.stop()  # a worker process's main thread then ends the process

    threading.Thread(target=go, name="rpcnb-leave", daemon=True).start()
    return True


# -- describing ------------------------------------------------------------------------


def describe_self(s: Session) -> dict[str, Any]:
    return start.self_info(s)


def running(s: Session) -> dict[str, Any] | None:
    """The cell this member runs now and its current line (%rpc_jobs, the panel)."""
    return view.running_now(s)


def thread_stacks(s: Session, full: bool = False) -> dict[str, Any]:
    """Every thread's Python stack now, the cell's first (``rpcnb.observe.stacks``).
    Answered here on torch's RPC thread, also while the cell's thread is in a C call."""
    return stacks.here(s, bool(full))


def describe_rref(s: Session, rref: Any) -> dict[str, Any]:
    return values.describe(rref.local_value())


def complete(s: Session, code: str, cursor: int) -> list[tuple[int, int, str, str, str]] | None:
    """Tab in a ``%%remote`` cell: completions from this member's namespace
    (``rpcnb.observe.names``). Answered here on torch's RPC thread, not behind the cell
    runner, so a busy member answers when the GIL lets it."""
    return names.complete_here(s, str(code), int(cursor))


def inspect_object(s: Session, code: str, cursor: int, detail_level: int = 0,
            omit_sections: list[str] | tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Shift-Tab in a ``%%remote`` cell: the object under the cursor, as IPython's
    inspector shows it here."""
    return names.inspect_here(s, str(code), int(cursor), int(detail_level), omit_sections)


def variables(s: Session) -> list[dict[str, Any]]:
    """This member's variables (``%rpc_who``, the panel's "variables")."""
    return names.variables_here(s)


def facts(s: Session) -> dict[str, Any]:
    return channels.local_facts()


def doctor_report(s: Session) -> dict[str, Any]:
    return doctor.local_report()


def peer_stats(s: Session) -> dict[str, dict[str, Any]]:
    telemetry.looked_at()  # a monitor looks at this member's calls: time them from now on
    return telemetry.peer_stats()


def probe_echo(s: Session) -> None:
    """Nothing, for the round trip of an empty call."""
    return None


def probe_sink(s: Session, tensor: Any) -> int:
    """A tensor in, its size back."""
    return int(tensor.element_size() * tensor.nelement())


OPERATIONS: dict[str, Callable[..., Any]] = {
    "run_cell": run_cell,
    "interrupt": interrupt,
    "deliver": deliver,
    "aside": aside,
    "ask": ask,
    "adopt": adopt,
    "orphan_result": orphan_result,
    "cell_position": cell_position,
    "comm": comm,
    "collectives": collectives_join,
    "collectives_end": collectives_end,
    "collectives_gpu": collectives_gpu,
    "reverse_map": reverse_map,
    "unpark": unpark,
    "register": register,
    "registry": registry,
    "shm_full": shm_full,
    ucx.PULL: ucx_pull,
    "member_died": member_died,
    "member_joined": member_joined,
    "member_back": member_back,
    "drop_member": drop_member,
    "leave": leave_now,
    "resize": resize_group,
    "describe_self": describe_self,
    "describe_rref": describe_rref,
    "running": running,
    stacks.OP: thread_stacks,
    names.COMPLETE: complete,
    names.INSPECT: inspect_object,
    names.VARIABLES: variables,
    "facts": facts,
    "doctor": doctor_report,
    "peer_stats": peer_stats,
    "probe_echo": probe_echo,
    "probe_sink": probe_sink,
}


def install() -> None:
    """Answer other members' requests with ``OPERATIONS`` (idempotent), and deliver the
    output of plain Python calls to the member that made them."""
    protocol.serve(OPERATIONS)
    serialize.on_call(output.capture_call)
