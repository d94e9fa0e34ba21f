"""The tables of environment variables in ``docs/settings.md``: rpcnb's own, written from
``rpcnb.settings.SETTINGS`` (between ``<!-- settings -->`` and ``<!-- /settings -->``), and
the other tools' that rpcnb reads or sets, from ``rpcnb.settings.BORROWED`` (between
``<!-- borrowed -->`` and ``<!-- /borrowed -->``).

``python scripts/settings_table.py`` rewrites it; ``--check`` only says whether it is
current (exit 1 when not). ``scripts/build_docs.py`` writes it into its staged copy before
Sphinx runs, and ``tests/unit/test_settings.py`` fails when the committed page is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_MD = ROOT / "docs" / "settings.md"
BLOCK = re.compile(r"(<!-- settings -->\n)(?P<body>.*?)(<!-- /settings -->)", re.S)
BORROWED_BLOCK = re.compile(r"(<!-- borrowed -->\n)(?P<body>.*?)(<!-- /borrowed -->)", re.S)
STALE = "{path}: the table of variables differs from rpcnb.settings: run `python scripts/settings_table.py`"


def table() -> str:
    from rpcnb.settings import SETTINGS

    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for s in SETTINGS.values():
        takes = {"flag": " (yes or no)", "int": " (bytes)"}.get(s.kind, "")
        rows.append(f"| `{s.name}`{takes} | {s.page_default()} | {s.doc} |")
    return "\n" + "\n".join(rows) + "\n\n"


def borrowed_table() -> str:
    from rpcnb.settings import BORROWED

    rows = ["| variable | when unset | what it does |", "| --- | --- | --- |"]
    rows += [f"| `{b.name}` | {b.default} | {b.doc} |" for b in BORROWED.values()]
    return "\n" + "\n".join(rows) + "\n\n"


def rendered(text: str) -> str:
    for block, name in ((BLOCK, "settings"), (BORROWED_BLOCK, "borrowed")):
        if not block.search(text):
            raise SystemExit(f"{SETTINGS_MD}: no <!-- {name} --> block")
    text = BLOCK.sub(lambda m: m.group(1) + table() + m.group(3), text)
    return BORROWED_BLOCK.sub(lambda m: m.group(1) + borrowed_table() + m.group(3), text)


def write(path: Path = SETTINGS_MD) -> bool:
    """Rewrite the block in ``path``; whether it changed."""
    text = path.read_text()
    new = rendered(text)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    if "--check" in argv:
        if rendered(SETTINGS_MD.read_text()) != SETTINGS_MD.read_text():
            print(STALE.format(path=SETTINGS_MD), file=sys.stderr)
            return 1
        return 0
    print(f"{SETTINGS_MD}: " + ("table rewritten" if write() else "current"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
