"""The caller's side of a remote cell: send it to one or more workers, print their output
into this cell as it arrives (in order), turn their results into RRefs, values or
errors, and interrupt them when the notebook is interrupted or ``timeout`` passes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import re
import sys
import time
from collections.abc import Iterable
from typing import Any

from rpcnb import errors, progress, telemetry, waiting
from rpcnb.cells import profiles
from rpcnb.cells.messages import Aside, Done, Output, from_wire
from rpcnb.cells.waiter import LOCAL, Call, Sent, wait
from rpcnb.errors import RemoteError
from rpcnb.paths import calls, zerocopy
from rpcnb.session import protocol, roster, state
from rpcnb.session.state import Session


def run(target: str | Iterable[str] | None, source: str, *, fetch: bool = False,
        push: dict[str, Any] | None = None, timeout: float | None = None,
        zero_copy: bool = True, local: bool = False, profile: bool = False) -> Any:
    """Run ``source`` on the target worker(s) as a cell and wait for it.

    Output streams into this process's stdout/stderr/display while the cell runs. An
    interrupt of this process (the notebook's stop button) interrupts the cell on the
    workers too. ``%%remote``.

    Args:
        target: a worker's name, several (``"w1,w2"`` or a list; they run in parallel), or
            ``ALL`` (or None) for every member but this process.
        source: the cell's code; IPython syntax (magics, ``!`` commands) works.
        fetch: send the last expression's value back instead of an RRef to it.
        push: values to put into the worker's namespace first, by name (functions and
            classes defined in the notebook travel by value).
        timeout: interrupt the cell after this many seconds (default: no limit).
        zero_copy: False: tensors already in shared memory among ``push`` (and, with
            ``fetch``, in the value) are copied instead of shared by handle
            (``rpcnb.paths.zerocopy``).
        local: also run the cell here, in this process's namespace (the notebook's), while
            the workers run it (``%%remote --local``, as ipyparallel's ``%%px --local``);
            its result is under ``"local"``. Its output is printed as a local cell's.
        profile: run the cell under ``torch.profiler`` on each worker (``%%remote
            --profile``): each worker's top operators are printed, and its Chrome/Perfetto
            trace is written on this host (with several workers, also one file with all
            of them on one timeline); ``rpcnb.cells.profiles.folder`` says where.

    Returns:
        An RRef to the last expression's value (None if there is none), the value itself
        with ``fetch=True``, or ``{name: result}`` when several workers (or ``ALL``) are
        named or ``local`` is set (None when no one had a value).

    Raises:
        rpcnb.RemoteError: the code raised on the worker (``.worker`` names it, ``.traceback``
            is the remote traceback); ``CompositeRemoteError`` when several workers raised.
        rpcnb.WorkerDiedError: a worker died before or during the cell, or had left the group.
        rpcnb.WorkerUnreachableError: a worker's host answered nothing for a few seconds
            (a partition, a lost host); the cell may still run there.
        TimeoutError: ``timeout`` passed; the message says whether the cell stopped or
            still runs on the worker.
        KeyboardInterrupt: this process was interrupted while it waited.
        rpcnb.RpcnbError: this process is in no group; a name that is no worker of the group;
            ``ALL`` in a group without other members.
        ValueError: an empty ``source``, a ``timeout`` not above 0, or a ``push`` value
            that cannot be pickled.
    """
    s = state.current()
    s.show_notices()
    names, many = prepare(s, target, source, timeout)
    busy = [f"{w} ({', '.join(f'[{i}]' for i in ids)})"
            for w, ids in background_on(s, names).items()]
    if busy:
        print(errors.QUEUED_BEHIND.format(workers="; ".join(busy)), file=sys.stderr)
    sent = send(s, names, source, fetch, push, zero_copy, profile)
    sent.told.update(w.split(" ")[0] for w in busy)  # said already
    try:
        if local:
            try:
                sent.local = run_here(source)
            except KeyboardInterrupt:
                sent.interrupt(s)
                raise
        wait(s, sent, timeout, prefix=many or local)
    except BaseException:
        _left_in_a_collective(s, sent)
        raise
    finally:
        sent.forget(s)
    _collective_timeouts(s, sent, names)
    if profile:
        profiles.show({c.worker: c.profile for c in sent.calls.values() if c.profile})
    return sent.outcome(many or local)


# a collective's own time limit, as gloo and NCCL say it
COLLECTIVE_TIMED_OUT = re.compile(r"gloo.*[Tt]imed out|Timed out waiting|[Ww]atchdog caught "
                                  r"collective operation timeout|NCCL.*[Tt]imeout")


def _collective_timeouts(s: Session, sent: Sent, names: list[str]) -> None:
    """A collective that timed out in a group whose workers form a process group: the error
    names the ranks that never came, and the process group is formed again (a timed-out
    collective leaves the ranks out of step)."""
    info = s.collectives
    if info is None:  # most groups: no process group, no collective to time out
        return
    timed_out = [c for c in sent.calls.values() if isinstance(c.error, RemoteError)
                 and COLLECTIVE_TIMED_OUT.search(c.error.evalue + c.error.traceback)]
    if not timed_out:
        return
    ranks = info.ranks
    missing = [f"{w} (rank {r})" for w, r in sorted(ranks.items(), key=lambda x: x[1])
               if w not in names]
    note = errors.COLLECTIVE_TIMEOUT.format(
        ran=", ".join(n for n in names if n in ranks) or "no rank",
        missing=", ".join(missing) or "a rank")
    for c in timed_out:
        e = c.error
        assert isinstance(e, RemoteError)
        c.error = RemoteError(e.worker, e.ename, f"{e.evalue}\n{note}", f"{e.traceback}\n{note}")
    _reform(s)


_LOCAL_RUNS = itertools.count(1)


def run_here(source: str) -> tuple[Any, BaseException | None]:
    """Run ``source`` in this process's user namespace (the notebook's, else __main__'s):
    its value (None without one) and its error, as a RemoteError naming ``local``."""
    import __main__
    from rpcnb.cells import output, runner

    sh = output.shell()
    ns = sh.user_ns if sh is not None else vars(__main__)
    # a name per run, as a worker's cells have: the lines of a function one defined stay
    # under its own name, whatever runs next
    filename = f"<local cell {next(_LOCAL_RUNS)}>"
    try:
        value, _ = runner.run_source(source, filename, ns, sh)
        return value, None
    except Exception as exc:
        return None, RemoteError(LOCAL, type(exc).__name__, runner.safe_str(exc),
                                 runner.format_exception(exc, filename))


def prepare(s: Session, target: str | Iterable[str] | None, source: str,
            timeout: float | None) -> tuple[list[str], bool]:
    """Check a cell before it is sent: the worker names, and whether several are named."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(errors.EMPTY_CELL.format(target=target or "the workers"))
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    return roster.resolve(s, target)


def background_on(s: Session, names: list[str]) -> dict[str, list[int]]:
    """The ids of the background cells still running (or queued) on each of ``names``."""
    busy: dict[str, list[int]] = {}
    for job in [j for j in s.jobs().values() if not j.ready()]:
        for w in job.pending_workers():
            if w in names:
                busy.setdefault(w, []).append(job.id)
    return busy


def _reform(s: Session) -> None:
    """Form the workers' process group again (``membership.collectives.reform``); say so."""
    if s.collectives is not None:
        try:
            said = s.collectives.reform()
        except Exception as exc:  # the group itself still works; say so and go on
            said = f"rpcnb: forming the workers' process group again failed: {exc}"
        if said:
            print(said, file=sys.stderr)


def _left_in_a_collective(s: Session, sent: Sent) -> None:
    """A cell given up on (interrupted, cancelled, timed out) while workers of a group with
    collectives still run it: they may wait inside a collective, which no interrupt stops
    (gloo and NCCL wait in C++ until their time limit) and which leaves the ranks out of
    step. Say so; the next cell waits for them, then forms the process group again."""
    info = s.collectives
    late = [c for c in sent.calls.values() if not c.done and c.future is not None]
    if info is None or not late:
        return
    s.left_in_collectives(c.future for c in late)
    print(errors.COLLECTIVE_LEFT_WAITING.format(
        workers=", ".join(c.worker for c in late), verb="waits" if len(late) == 1 else "wait",
        timeout=info.timeout), file=sys.stderr)


def _settle_collectives(s: Session) -> None:
    """Before a cell: the cells left inside a collective have ended (within the collective
    time limit), and the process group is formed again, so the ranks are in step."""
    pending = s.take_collectives_left()
    if not pending:  # every cell passes here: nothing to do
        return
    limit = s.collectives.timeout if s.collectives is not None else 0.0
    waiting.until(lambda: all(f.done() for f in pending), limit + 30, 0.05)
    _reform(s)


_AS_IS = contextlib.nullcontext()  # reusable: no context made per call where none is needed


def send(s: Session, names: list[str], source: str, fetch: bool,
         push: dict[str, Any] | None, zero_copy: bool = True, profile: bool = False) -> Sent:
    """Send the cell to each of ``names``; their output goes to the returned ``Sent``
    (``zero_copy=False``: shared tensors in ``push`` and the fetched value are copied)."""
    _settle_collectives(s)
    # SimpleQueue: Queue builds a Condition and a lock per wait; swapping it saved 0.1-0.15x
    # of a no-op cell's round trip in paired runs (docs/benchmarks.md)
    sent = Sent({}, queue.SimpleQueue(), telemetry.now(), time.perf_counter(),
                transfers=progress.Transfers(progress.large_transfer(s.one_host)))
    # a cell without --push (most) skips the walk over its values
    pushed = progress.payload_bytes(list(push.values()), free=zerocopy.by_handle
                                    if zero_copy else None) if push else 0
    # run_cell's zero_copy and profile, when not the defaults
    extra: tuple[bool, ...] = (zero_copy, True) if profile else (() if zero_copy else (False,))
    inbox = sent.inbox
    try:
        for name in names:
            if pushed:
                sent.transfers.start(name, f"--push to {name}:", pushed)
            call = Call(os.urandom(16).hex(), name, inbox)  # uuid4's bits, no UUID
            cid = call.call_id
            s.add_call(call)
            sent.calls[cid] = call
            try:
                with _AS_IS if zero_copy else zerocopy.copying():
                    call.future = calls.request(
                        s.token, name, "run_cell",
                        (cid, s.name, source, fetch, dict(push or {}), *extra), 0)
            except Exception as exc:  # it could not be pickled: nothing was sent
                errors.raise_from(_push_error(push or {}, exc), exc)
            # called with the future as its one argument, which put takes as ``block``: a
            # partial holds the GIL on torch's thread for less than a lambda, and the waiting
            # thread wakes as soon as that thread lets the GIL go (docs/benchmarks.md)
            call.future.add_done_callback(functools.partial(inbox.put, Done(cid)))
    except BaseException:
        sent.transfers.close(ok=False)
        sent.forget(s)
        raise
    return sent


def _push_error(push: dict[str, Any], exc: Exception) -> Exception:
    """ValueError naming the --push value that cannot be sent, if that is what failed."""
    from rpcnb.paths import shm
    from rpcnb.wire import _torch

    for name, value in push.items():
        try:
            with shm.suppressed():  # a dry run: no buffer taken
                _torch.rpc_pickler().serialize(value)
        except Exception as err:
            return ValueError(errors.PUSH_NOT_PICKLABLE.format(
                name=name, type=type(value).__qualname__, reason=err))
    return exc


def deliver(s: Session, call_id: str, worker: str, seq: int, items: list[Any]) -> None:
    """Batch ``seq`` of a remote cell's output arrived (as ``Capture`` sends it): hand it
    to the call that waits for it."""
    call = s.call(call_id)
    if call is not None:
        call.inbox.put(Output(call_id, worker, seq, from_wire(items)))


def aside(s: Session, call_id: str, worker: str, items: list[Any]) -> None:
    """Output outside a cell's batches (a transfer's progress): shown when it arrives."""
    call = s.call(call_id)
    if call is not None:
        call.inbox.put(Aside(call_id, worker, from_wire(items)))


def interrupt(worker: str) -> None:
    """Interrupt whatever remote cell ``worker`` is running for this process (the cell
    ends with KeyboardInterrupt; the worker and its namespace stay).

    Args:
        worker: the name of the worker running the cell; nothing happens when it runs
            none for this process.

    Raises:
        rpcnb.RpcnbError: this process is in no group.
    """
    s = state.current()
    for cid in [c.call_id for c in s.calls_to(worker)]:
        protocol.call(s.token, worker, "interrupt", cid, timeout=5)
