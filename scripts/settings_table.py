"""The table of ``RPCNB_*`` variables in ``docs/settings.md``, written from
``rpcnb.settings.SETTINGS`` (between ``<!-- settings -->`` and ``<!-- /settings -->``).

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
STALE = "{path}: the table of variables differs from rpcnb.settings: run `python scripts/settings_table.py`"


def table() -> str:
    from rpcnb.settings import SETTINGS

    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for s in SETTINGS.values():
        takes = {"flag": " (yes or no)", "int": " (bytes)"}.get(s.kind, "")
        rows.append(f"| `{s.name}`{takes} | {s.page_default()} | {s.doc} |")
    return "\n" + "\n".join(rows) + "\n\n"


def rendered(text: str) -> str:
    if not BLOCK.search(text):
        raise SystemExit(f"{SETTINGS_MD}: no <!-- settings --> block")
    return BLOCK.sub(lambda m: m.group(1) + table() + m.group(3), text)


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
