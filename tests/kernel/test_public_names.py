"""Every public name of rpcnb resolves from the package as users write it (``rpcnb.init``,
``rpcnb.run``, ...). Looking up ``rpcnb.init`` or ``rpcnb.add_workers`` starts this
process's workers' launcher (it imports torch while this process does), a real process:
so this runs here, and what it started is stopped by pid. The list of names itself is
checked in tests/unit/test_public_surface.py."""

from __future__ import annotations

import os

from conftest import children_of, stopped

import rpcnb
from rpcnb.procs import launch
from rpcnb.procs.processes import kill_all


def test_every_public_name_is_there():
    before = set(children_of(os.getpid()))
    try:
        for name in rpcnb.__all__:
            assert getattr(rpcnb, name) is not None, name
    finally:
        started = set(children_of(os.getpid())) - before
        launcher = launch.current_launcher()
        if launcher is not None and launcher.pid in started:
            launch.stop_launcher()  # the one this test started, not one it found running
        kill_all(sorted(started))
    assert not stopped(started), "processes left running"
