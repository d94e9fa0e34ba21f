"""A second network "host" on this machine: a network namespace joined to this one by a
veth pair on a private /30. Used by the tests' ``netns`` fixture (tests/conftest.py) and
by ``bench.ucx``; needs root and iproute2."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def veth_pair(ns: str, link: str, net: str) -> Iterator[dict[str, str]]:
    """Namespace ``ns`` with ``{link}b`` at ``{net}.2``, joined to ``{link}a`` here at
    ``{net}.1`` (``net``: the first three octets); both removed at the end."""
    here, there = f"{link}a", f"{link}b"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
        ["ip", "link", "set", there, "netns", ns],
        ["ip", "addr", "add", f"{net}.1/30", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/30", "dev", there],
        ["ip", "netns", "exec", ns, "ip", "link", "set", there, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield {"ns": ns, "here": here, "there": there, "addr": f"{net}.1"}
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
