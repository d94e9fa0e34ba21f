"""The ES module each widget serves: the shared DOM helpers of dom.js, then its own file."""

from __future__ import annotations

import pathlib

HERE = pathlib.Path(__file__).parent


def esm(name: str) -> str:
    """dom.js, then the widget's module ``name`` (beside this file), as one ES module."""
    return (HERE / "dom.js").read_text() + "\n" + (HERE / name).read_text()
