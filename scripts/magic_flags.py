"""The flag tables of ``docs/magics.md``, written from the magics' own parsers.

Each magic's section of ``docs/magics.md`` holds its table between two markers,
``<!-- flags:NAME -->`` and ``<!-- /flags:NAME -->`` (``NAME`` as the magic is called,
without ``%``: ``rpc_init``, ``remote``, ``rpc_probe``, ...). Everything between them is
generated: one row per argument of the magic's ``magic_arguments`` parser (the ``.parser``
of its method on ``rpcnb.frontend.magics.RpcMagics``, what ``%rpc_init?`` shows) with its
value name, default and help. Everything around them is written by hand.

``python scripts/magic_flags.py`` rewrites the tables in ``docs/magics.md``;
``--check`` only says whether they are current (exit 1 when not). ``scripts/build_docs.py``
writes them into its staged copy before Sphinx runs, so the site always shows the parsers'
flags, and ``tests/unit/test_docs_flags.py`` fails when the committed file is stale, when a
magic has no table, or when the docs name a flag that no parser has.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAGICS_MD = ROOT / "docs" / "magics.md"
BLOCK = re.compile(r"(<!-- flags:(?P<name>\w+) -->\n)(?P<body>.*?)(<!-- /flags:(?P=name) -->)", re.S)
STALE = "{path}: the flag tables differ from the parsers: run `python scripts/magic_flags.py`"
_SPECIAL = re.compile(r"([\\`*_\[\]<>|])")  # what Markdown would read as markup


def parsers() -> dict[str, argparse.ArgumentParser | None]:
    """Every magic of ``%load_ext rpcnb`` by name (line and cell magics of one name share a
    method), with its parser; None for a magic that takes no arguments."""
    from rpcnb.frontend.magics import RpcMagics

    found: dict[str, argparse.ArgumentParser | None] = {}
    for names in RpcMagics.magics.values():
        for name, method in names.items():
            found.setdefault(name, getattr(getattr(RpcMagics, method), "parser", None))
    return found


def _escape(text: str) -> str:
    return _SPECIAL.sub(r"\\\1", " ".join(text.split()))


def _value(action: argparse.Action) -> str:
    if not action.option_strings:
        return {"?": "(positional, optional)", "*": "(positional, any number)",
                "+": "(positional, one or more)"}.get(str(action.nargs), "(positional)")
    if action.nargs == 0:  # store_true and the like: a switch
        return ""
    return f"`{action.metavar or action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def table(name: str, parser: argparse.ArgumentParser | None) -> str:
    """The Markdown between one magic's markers (blank lines around the table)."""
    actions = [] if parser is None else [
        a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    if not actions:
        return f"\n`%{name}` takes no arguments.\n\n"
    rows = ["| flag | value | default | help |", "| --- | --- | --- | --- |"]
    for action in actions:
        flag = ", ".join(action.option_strings) or action.dest
        rows.append(f"| `{flag}` | {_value(action)} | {_default(action)} | "
                    f"{_escape(action.help or '')} |")
    return "\n" + "\n".join(rows) + "\n\n"


def render(text: str, found: dict[str, Any] | None = None) -> str:
    """``text`` with every flag block rewritten from the parsers; KeyError for a block whose
    magic does not exist."""
    found = parsers() if found is None else found

    def block(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in found:
            raise KeyError(f"<!-- flags:{name} -->: rpcnb has no magic %{name}")
        return m.group(1) + table(name, found[name]) + m.group(4)

    return BLOCK.sub(block, text)


def missing(text: str, found: dict[str, Any] | None = None) -> list[str]:
    """The magics that have no flag block in ``text``."""
    found = parsers() if found is None else found
    blocks = {m.group("name") for m in BLOCK.finditer(text)}
    return [name for name in found if name not in blocks]


def write(path: Path = MAGICS_MD) -> bool:
    """Rewrite the flag blocks of ``path``; whether anything changed."""
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def stale(path: Path = MAGICS_MD) -> bool:
    """Whether the flag blocks of ``path`` differ from what the parsers give."""
    text = path.read_text(encoding="utf-8")
    return render(text) != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when the tables are stale or a magic has none")
    parser.add_argument("path", nargs="?", type=Path, default=MAGICS_MD,
                        help="the page to rewrite (docs/magics.md)")
    args = parser.parse_args(argv)
    lacking = missing(args.path.read_text(encoding="utf-8"))
    for name in lacking:
        print(f"{args.path}: no <!-- flags:{name} --> block for %{name}", file=sys.stderr)
    if args.check:
        if stale(args.path):
            print(STALE.format(path=args.path), file=sys.stderr)
            return 1
        return 1 if lacking else 0
    if write(args.path):
        print(f"{args.path}: flag tables rewritten")
    return 1 if lacking else 0


if __name__ == "__main__":
    sys.exit(main())
