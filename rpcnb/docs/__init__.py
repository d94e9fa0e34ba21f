"""rpcnb's documentation, where a message points to it: the page's URL on the published
site, and a command that prints the page from the installed package, which works offline
(``python -m rpcnb.docs [PAGE]``: print a page, or list them). The pages travel in the
wheel (``rpcnb/_docs``); in a clone they are read from ``docs/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

SITE = "https://rpcnb.readthedocs.io/en/latest/"  # pyproject.toml's Documentation URL
HERE = Path(__file__).resolve().parent.parent  # the rpcnb package
UNKNOWN = "rpcnb.docs: there is no page {page!r}; the pages are: {pages}."


def url(page: str, anchor: str = "") -> str:
    """The published URL of ``page`` (``"security"``), at ``anchor`` if given."""
    return f"{SITE}{page}.html" + (f"#{anchor}" if anchor else "")


def ref(page: str, anchor: str = "") -> str:
    """How a message names a page: its URL, and the command that prints it here."""
    return f"{url(page, anchor)}, or `python -m rpcnb.docs {page}` offline"


def folder() -> Path | None:
    """Where this installation's pages are: the wheel's copy, else a clone's docs/."""
    for where in (HERE / "_docs", HERE.parent / "docs"):
        if (where / "index.md").is_file():
            return where
    return None


def pages() -> list[str]:
    where = folder()
    return sorted(p.stem for p in where.glob("*.md")) if where is not None else []


def text(page: str) -> str:
    """The page's Markdown source; ValueError naming the pages there are."""
    where = folder()
    path = where / f"{page.removesuffix('.md')}.md" if where is not None else None
    if path is None or not path.is_file():
        raise ValueError(UNKNOWN.format(page=page, pages=", ".join(pages()) or "none found"))
    return path.read_text()


def main(argv: list[str] | None = None) -> int:
    """Print a page, or list them; 2 for a page there is not."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m rpcnb.docs PAGE   (prints a page of rpcnb's documentation)\n"
              f"pages: {', '.join(pages())}\nonline: {SITE}")
        return 0
    try:
        print(text(args[0]))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0
