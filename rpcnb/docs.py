"""``python -m rpcnb.docs [PAGE]``: print a page of rpcnb's documentation from the
installed package (offline), or list the pages; ``rpcnb.doclinks`` finds them."""

from __future__ import annotations

import sys

from rpcnb import doclinks


def main(argv: list[str] | None = None) -> int:
    """Print a page, or list them; 2 for a page there is not."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m rpcnb.docs PAGE   (prints a page of rpcnb's documentation)\n"
              f"pages: {', '.join(doclinks.pages())}\nonline: {doclinks.SITE}")
        return 0
    try:
        print(doclinks.text(args[0]))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
