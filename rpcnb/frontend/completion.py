"""Tab and Shift-Tab in a ``%%remote`` cell, answered from the namespace of the worker the
cell runs on (the first one, for several or ``--all``), and Tab on the magic's own line.

``install(ip)`` (``%load_ext rpcnb``) puts two hooks in place and ``uninstall(ip)``
(``%unload_ext rpcnb``) takes them away:

- ``line_matcher``, a matcher of IPython's completer (``IPCompleter.custom_matchers``), for
  the line of ``%%remote``/``%remote`` itself: worker names and the magic's flags, read
  from its parser (``plans.flags_of``). Any other line gets no completion from it.
- In a kernel, wrappers of ipykernel's ``do_complete`` and ``do_inspect`` on the kernel
  object. A request whose cursor is in the body of a ``%%remote`` cell sends the body, the
  cursor moved into it, to the worker (``rpcnb.observe.names``) and answers in the whole
  cell's coordinates. Every other request is the kernel's own method, unchanged. A
  completion the worker does not answer within ``names.ASK_S`` (0.5 s) is the kernel's own;
  an inspection says the worker did not answer (the kernel's object of that name would be
  another object). The reply's metadata says who answered (``rpcnb``: member, answered,
  waited, seconds).

Why the body is not a matcher too: IPython lets a matcher suppress the others only when it
has completions, so a name the worker lacks would still be completed from the kernel's
namespace; and Shift-Tab has no hook but the kernel's ``do_inspect``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from IPython.core.completer import (
    CompletionContext,
    SimpleCompletion,
    SimpleMatcherResult,
    context_matcher,
)

from rpcnb import errors
from rpcnb.frontend import plans
from rpcnb.session import state
from rpcnb.session.members import Status

# a %%remote cell: blank lines, the magic's line, and the body from the next line on
_CELL = re.compile(r"\s*%%remote(?=[ \t\n])([^\n]*)\n")
# the line of %remote or %%remote, up to the cursor, past the magic's name
_LINE = re.compile(r"\s*(%%?)remote(?=[ \t])")
WRAPPED = ("do_complete", "do_inspect")  # the kernel's methods wrapped


# -- where a cell runs ---------------------------------------------------------------------


def remote_body(code: str, cursor: int) -> tuple[str, int] | None:
    """``(the magic's arguments, where the body starts)`` when ``cursor`` is in the body
    of a ``%%remote`` cell; None for any other cell, or a cursor on the magic's line."""
    m = _CELL.match(code)
    if m is None or cursor < m.end():
        return None
    return m.group(1), m.end()


def _member(s: Any, line: str) -> str | None:
    """The worker a ``%%remote`` line runs its cell on first, while it is alive and
    reachable; None for a line that names none (yet), or names no such worker."""
    try:
        args = plans.parse(plans.remote, line)
    except Exception:  # a line being typed
        return None
    alive = [m.name for m in sorted(s.records(), key=lambda m: m.rank)
             if m.status is Status.ALIVE]
    if args.all:
        return next((n for n in alive if n != s.name), None)
    first = next(iter(plans.csv(args.target) or []), None)
    return first if first in alive else None


def worker_names() -> list[str]:
    """The members a ``%%remote`` line may name, by rank (none without a group)."""
    s = state.active()
    if s is None:
        return []
    return [m.name for m in sorted(s.records(), key=lambda m: m.rank)
            if m.alive and m.name != s.name]


# -- the magic's line ----------------------------------------------------------------------


def line_completions(full_text: str, cursor_line: int, before: str,
                     workers: list[str]) -> tuple[str, list[tuple[str, str]]] | None:
    """What Tab offers on a ``%%remote``/``%remote`` line, the cursor after ``before``:
    ``(the fragment they replace, [(text, type)])``, worker names (``workers``) where the
    target goes and the flags not given yet; None off such a line, and where the line form's
    expression or a flag's value goes."""
    m = _LINE.match(before)
    if m is None:
        return None
    cell = m.group(1) == "%%"
    if cell:  # a cell magic's line is the cell's first line that is not blank
        lines = full_text.split("\n")
        if cursor_line != next((i for i, ln in enumerate(lines) if ln.strip()), 0):
            return None
    words = before[m.end():]
    tokens = words.split()
    fragment = "" if not words or words[-1].isspace() else tokens.pop()
    flags = plans.flags_of(plans.remote)
    target: str | None = None
    value_next = False
    for token in tokens:
        if value_next:
            value_next = False
        elif token.startswith("-"):
            value_next = flags.get(token, False)
        elif target is None:
            target = token
        else:
            return None  # %remote's expression
    if value_next:
        return None  # the value of -o, --push, --timeout
    offered = [(f, "flag") for f in flags if f.startswith(fragment) and f not in tokens
               and not (f == "--all" and target is not None)]  # a target, or --all
    if fragment.startswith("-"):
        return fragment, offered
    if target is not None or "--all" in tokens:
        return (fragment, offered) if not fragment and cell else None
    *listed, part = fragment.split(",")
    names = [(n, "worker") for n in workers if n.startswith(part) and n not in listed]
    return part, names + (offered if not fragment else [])


@context_matcher()
def line_matcher(context: CompletionContext) -> SimpleMatcherResult:
    """IPython's matcher for the ``%%remote``/``%remote`` line (``line_completions``): its
    completions alone, where it has some."""
    found = line_completions(context.full_text, context.cursor_line, context.text_until_cursor,
                             worker_names())
    if not found or not found[1]:
        return {"completions": [], "suppress": False}
    fragment, items = found
    return {"completions": [SimpleCompletion(text, type=kind) for text, kind in items],
            "matched_fragment": fragment, "suppress": True, "ordered": True}


# -- the body: the kernel's requests -------------------------------------------------------


def _asked(code: str, cursor: int) -> tuple[Any, str, int] | None:
    """``(session, member, where the body starts)`` for a request in a ``%%remote``
    cell's body while this kernel is in a group; None otherwise."""
    body = remote_body(code, cursor)
    s = state.active()
    if body is None or s is None:
        return None
    member = _member(s, body[0])
    return None if member is None else (s, member, body[1])


def _note(reply: Any, member: str, answered: bool, t0: float, waited: float) -> Any:
    """The reply, its metadata saying who answered: ``rpcnb``: the member asked, whether
    it answered, the seconds waited for it and in all."""
    if isinstance(reply, dict):
        reply.setdefault("metadata", {})["rpcnb"] = {
            "member": member, "answered": answered, "waited": round(waited, 4),
            "seconds": round(time.perf_counter() - t0, 4)}
    return reply


def complete(original: Callable[..., Any], code: str, cursor_pos: int | None) -> Any:
    """ipykernel's ``do_complete``, from the worker's namespace in a ``%%remote`` body."""
    from rpcnb.observe import names

    cursor = len(code) if cursor_pos is None else cursor_pos
    asked = _asked(code, cursor)
    if asked is None:
        return original(code, cursor_pos)
    s, member, off = asked
    t0 = time.perf_counter()
    found = names.complete(s, member, code[off:], cursor - off)
    waited = time.perf_counter() - t0
    if found is None:  # busy, slow or gone: the notebook's own completion
        return _note(original(code, cursor_pos), member, False, t0, waited)
    start, end = (found[0][0] + off, found[0][1] + off) if found else (cursor, cursor)
    return _note({
        "status": "ok", "matches": [c[2] for c in found],
        "cursor_start": start, "cursor_end": end,
        "metadata": {"_jupyter_types_experimental": [
            {"start": a + off, "end": b + off, "text": t, "type": k, "signature": sig}
            for a, b, t, k, sig in found]},
    }, member, True, t0, waited)


def inspect(original: Callable[..., Any], shell: Any, code: str, cursor_pos: int,
            detail_level: int = 0, omit_sections: Any = ()) -> Any:
    """ipykernel's ``do_inspect``, the worker's object in a ``%%remote`` body."""
    from rpcnb.observe import names

    asked = _asked(code, cursor_pos)
    if asked is None:
        return original(code, cursor_pos, detail_level, omit_sections)
    s, member, off = asked
    t0 = time.perf_counter()
    found = names.inspect(s, member, code[off:], cursor_pos - off, detail_level,
                          sorted(omit_sections or ()))
    waited = time.perf_counter() - t0
    if found is None:  # not the kernel's object of that name: another object
        from IPython.utils.tokenutil import token_at_cursor

        said = errors.INSPECT_SILENT.format(name=member, seconds=names.ASK_S,
                                            what=token_at_cursor(code, cursor_pos))
        return _note({"status": "ok", "data": {"text/plain": said}, "metadata": {},
                      "found": True}, member, False, t0, waited)
    data = dict(found["data"])
    if not getattr(shell, "enable_html_pager", False):
        data.pop("text/html", None)  # as ipykernel does
    return _note({"status": "ok", "data": data, "metadata": {}, "found": bool(found["found"])},
                 member, True, t0, waited)


class _Hook:
    """One of the kernel's methods wrapped (``original`` kept, for ``uninstall``)."""

    def __init__(self, original: Callable[..., Any], call: Callable[..., Any]) -> None:
        self.original = original
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.original, *args, **kwargs)


def install(ip: Any) -> None:
    """Tab and Shift-Tab for ``%%remote`` in ``ip`` (again: nothing more)."""
    matchers = ip.Completer.custom_matchers
    if line_matcher not in matchers:
        matchers.insert(0, line_matcher)
    kernel = getattr(ip, "kernel", None)
    if kernel is None:  # a terminal IPython: the magic's line only
        return
    for name in WRAPPED:
        if isinstance(vars(kernel).get(name), _Hook):
            continue
        if name == "do_complete":
            setattr(kernel, name, _Hook(getattr(kernel, name), complete))
        else:
            setattr(kernel, name, _Hook(getattr(kernel, name),
                                        lambda orig, *a, **k: inspect(orig, ip, *a, **k)))


def uninstall(ip: Any) -> None:
    """Take ``install``'s hooks away: the kernel's own completion and inspection again."""
    matchers = ip.Completer.custom_matchers
    while line_matcher in matchers:
        matchers.remove(line_matcher)
    kernel = getattr(ip, "kernel", None)
    for name in WRAPPED if kernel is not None else ():
        if isinstance(vars(kernel).get(name), _Hook):
            delattr(kernel, name)
