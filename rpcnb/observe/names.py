"""The names in a member's namespace, as the notebook asks for them: Tab completion and
Shift-Tab inspection in a ``%%remote`` cell (``complete``, ``inspect``), and each worker's
variables (``who``, ``%rpc_who``).

The member asked answers the ``complete``, ``inspect`` and ``variables`` requests
(``rpcnb.membership.handlers``) on torch's RPC thread, never behind its cell runner: a
worker running a cell answers as soon as the GIL lets it. The caller gives completion and
inspection ``ASK_S`` seconds and falls back to the kernel's own answer without one, so Tab
never waits on a busy worker (``rpcnb.frontend.completion``).

The member completes with IPython's completer over its namespace (its shell's
``IPCompleter``, a copy of its own so a joined kernel's completion is not disturbed)
without Jedi: Jedi's first inference over torch takes 0.8 to 4.5 s (``w.`` of a tensor,
``tor``), past the time limit; IPython's own matchers take milliseconds and complete the
attributes of the live objects (``dir()``). Inspection is the shell's
``object_inspect_mime``, as ipykernel's ``do_inspect`` does in a kernel.
"""

from __future__ import annotations

import functools
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from rpcnb import errors, text
from rpcnb.observe import values

COMPLETE, INSPECT, VARIABLES = "complete", "inspect", "variables"  # the requests
ASK_S = 0.5  # what completion and inspection wait for a member's answer, at most
WHO_S = 2.0  # what %rpc_who waits for each member's answer, at most
SKIP = frozenset({"In", "Out", "exit", "quit", "get_ipython", "open"})  # IPython's own names

# -- on the member asked ---------------------------------------------------------------


class _Completer:
    """The IPCompleter that answers other members' requests in ``shell``'s namespace: a
    copy of the shell's own, without Jedi, used by one request at a time (it keeps state
    between calls)."""

    def __init__(self, shell: Any) -> None:
        from IPython.core.completer import IPCompleter

        self.shell = shell
        self.lock = threading.Lock()
        self.completer = IPCompleter(shell=shell, namespace=shell.user_ns,
                                     global_namespace=shell.user_global_ns, parent=shell)
        self.completer.use_jedi = False
        # the shell's own for import, %run, %cd
        self.completer.custom_completers = shell.Completer.custom_completers

    def completions(self, code: str, cursor: int) -> list[Any]:
        from IPython.core.completer import provisionalcompleter, rectify_completions

        with self.lock, provisionalcompleter():
            made, shell = self.completer, self.shell
            made.namespace, made.global_namespace = shell.user_ns, shell.user_global_ns
            return list(rectify_completions(code, made.completions(code, cursor)))


@functools.lru_cache(maxsize=1)
def _completer_of(shell: Any) -> _Completer:
    """This process's completer for requests, kept: one, for the shell last asked for."""
    return _Completer(shell)


def complete_here(s: Any, code: str, cursor: int) -> list[tuple[int, int, str, str, str]] | None:
    """The completions of ``code`` at ``cursor`` in this member's namespace, as
    ``(start, end, text, type, signature)`` with one start and end for all (IPython's
    ``rectify_completions``, as ipykernel does); None without an IPython shell."""
    shell = getattr(s.runner, "shell", None)
    if shell is None:
        return None
    found = _completer_of(shell).completions(code, cursor)
    return [(c.start, c.end, c.text, c.type or "", c.signature or "") for c in found]


def inspect_here(s: Any, code: str, cursor: int, detail_level: int = 0,
                 omit_sections: list[str] | tuple[str, ...] = ()) -> dict[str, Any] | None:
    """What Shift-Tab shows of the name at ``cursor`` in ``code`` (IPython's inspector:
    type, signature, docstring), as ipykernel's ``do_inspect`` answers (``found``,
    ``data``); None without an IPython shell."""
    shell = getattr(s.runner, "shell", None)
    if shell is None:
        return None
    from IPython.utils.tokenutil import token_at_cursor

    name = token_at_cursor(code, cursor)
    try:
        data = shell.object_inspect_mime(name, detail_level=detail_level,
                                         omit_sections=tuple(omit_sections))
    except KeyError:
        return {"found": False, "data": {}}
    return {"found": True, "data": dict(data)}


def variables_here(s: Any) -> list[dict[str, Any]]:
    """This member's variables, by name: what ``values.describe`` says of each (type; shape,
    dtype, device and bytes of tensors and arrays; len), without IPython's own names, those
    a fresh shell holds, modules and names that start with ``_``, as IPython's ``%who``."""
    runner = s.runner
    if runner is None:
        return []
    hidden = getattr(runner.shell, "user_ns_hidden", {})
    absent = object()
    rows = []
    for name, value in sorted(list(runner.namespace.items()), key=lambda item: item[0]):
        if name.startswith("_") or name in SKIP or isinstance(value, types.ModuleType) \
                or hidden.get(name, absent) is value:
            continue
        try:
            info = values.describe(value, preview=False)
        except Exception as exc:  # a broken __len__ must not hide the other variables
            info = {"type": type(value).__qualname__, "error": repr(exc)}
        rows.append({"name": name, **info})
    return rows


# -- on the caller -----------------------------------------------------------------------


def ask(s: Any, member: str, op: str, *args: Any, within: float = ASK_S) -> Any:
    """``member``'s answer to ``op(*args)``, or None when none came within ``within``
    seconds (busy, slow, gone) or it failed."""
    from rpcnb.session import protocol

    done = threading.Event()
    try:
        fut = protocol.call_async(s.token, member, op, *args, timeout=within)
    except Exception:
        return None
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(within):
        return None
    try:
        return fut.wait()
    except Exception:
        return None


def complete(s: Any, member: str, code: str, cursor: int,
             within: float = ASK_S) -> list[tuple[int, int, str, str, str]] | None:
    """``complete_here`` on ``member``, or None (no answer within ``within`` seconds)."""
    return ask(s, member, COMPLETE, code, cursor, within=within)


def inspect(s: Any, member: str, code: str, cursor: int, detail_level: int = 0,
            omit_sections: list[str] | tuple[str, ...] = (),
            within: float = ASK_S) -> dict[str, Any] | None:
    """``inspect_here`` on ``member``, or None (no answer within ``within`` seconds)."""
    return ask(s, member, INSPECT, code, cursor, int(detail_level), list(omit_sections),
               within=within)


@dataclass
class MemberVariables:
    """One member's variables (``rows``, as ``variables_here`` describes them), or why
    there are none (``state``: "answered", "dead", "unreachable", "silent")."""

    name: str
    state: str = "answered"
    how: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """One line: how many variables, or why none are shown."""
        if self.state == "dead":
            return errors.WHO_DEAD.format(name=self.name, how=self.how)
        if self.state == "unreachable":
            return errors.WHO_UNREACHABLE.format(name=self.name)
        if self.state == "silent":
            return errors.WHO_SILENT.format(name=self.name, seconds=self.how)
        n = len(self.rows)
        return f"{self.name}: {n} variable{'' if n == 1 else 's'}" if n else \
            f"{self.name}: {errors.WHO_NONE}"

    def table(self) -> str:
        """The variables as a plain-text table: name, type, shape, dtype, device, size."""
        rows = [("variable", "type", "shape", "dtype", "device", "size")]
        for r in self.rows:
            sized = "shape" in r
            rows.append((
                r["name"], r["type"],
                text.shape(r["shape"]) if sized else (f"len {r['len']}" if "len" in r else ""),
                r.get("dtype", ""), r.get("device", ""),
                text.size(r["nbytes"]) if sized else ""))
        return text.table(rows)

    def __str__(self) -> str:
        return self.summary() + ("\n" + self.table() if self.rows else "")


@dataclass
class Variables:
    """What ``%rpc_who`` shows: each member's variables; ``print()`` it."""

    members: list[MemberVariables]

    def get(self, name: str) -> MemberVariables:
        return next(m for m in self.members if m.name == name)

    def __str__(self) -> str:
        return "\n\n".join(str(m) for m in self.members)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def who(workers: list[str] | None = None, *, timeout: float = WHO_S) -> Variables:
    """Each worker's variables: name, type, and for tensors and arrays shape, dtype,
    device and size (``%rpc_who``).

    Args:
        workers: the members to ask, by name (default: every member but this process).
        timeout: seconds each member gets to answer; one that does not is named.

    Returns:
        A ``Variables``, one table per member; ``print()`` it.

    Raises:
        rpcnb.RpcnbError: this process is in no group; a name that is no member; a
            group with no workers.
    """
    from rpcnb.session import protocol, roster, state

    s = state.current()
    workers = roster.expand(s, workers) if workers else None  # a worker set: worker1-8
    live = roster.live_names(s)
    dead, unreachable = s.dead(), s.unreachable()
    names: list[str] = []
    for name in workers or [n for n in live if n != s.name]:
        if name not in live and name not in dead:
            raise errors.RpcnbError(errors.UNKNOWN_WORKER.format(name=name, known=", ".join(live)))
        if name not in names:
            names.append(name)
    if not names:
        raise errors.RpcnbError(errors.NO_WORKERS)
    asked: dict[str, Any] = {}
    found: dict[str, MemberVariables] = {}
    for name in names:
        if name in dead:
            found[name] = MemberVariables(name, "dead", dead[name])
        elif name in unreachable:
            found[name] = MemberVariables(name, "unreachable")
        elif name == s.name:
            found[name] = MemberVariables(name, rows=variables_here(s))
        else:
            try:
                asked[name] = protocol.call_async(s.token, name, VARIABLES, timeout=timeout)
            except Exception as exc:
                found[name] = MemberVariables(name, "silent", _why(exc, timeout))
    for name, fut in asked.items():
        try:
            found[name] = MemberVariables(name, rows=fut.wait())
        except Exception as exc:
            how = s.how_gone(name)
            found[name] = MemberVariables(name, "dead", how) if how is not None else \
                MemberVariables(name, "silent", _why(exc, timeout))
    return Variables([found[n] for n in names])


def _why(exc: BaseException, timeout: float) -> str:
    """How long a member that did not answer was given, and what failed when it was not
    the time limit."""
    said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{timeout:g} s" if "time" in said.lower() else f"{timeout:g} s ({said})"
