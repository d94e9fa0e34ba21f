"""Every public name of rpcnb resolves from the package as users write it (``rpcnb.init``,
``rpcnb.run``, ...), and stays a function once every module is loaded. Looking up
``rpcnb.init`` or ``rpcnb.add_workers`` starts this process's workers' launcher (it
imports torch while this process does), a real process: so this runs here, and what it
started is stopped by pid. The list of names itself is checked in
tests/unit/test_public_surface.py."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from conftest import started_here, stopped

import rpcnb
from rpcnb.procs import launch
from rpcnb.procs.processes import kill_all


@pytest.fixture
def launcher_stopped():
    """What the test started (the launcher, when it was not running) is stopped by pid."""
    before = set(started_here())
    try:
        yield
    finally:
        started = set(started_here()) - before
        launcher = launch.current_launcher()
        if launcher is not None and launcher.pid in started:
            launch.stop_launcher()  # the one this test started, not one it found running
        kill_all(sorted(started))
    assert not stopped(started), "processes left running"


def test_every_public_name_is_there(launcher_stopped):
    for name in rpcnb.__all__:
        assert getattr(rpcnb, name) is not None, name


def test_the_public_functions_stay_functions_once_every_module_is_loaded(launcher_stopped):
    """A subpackage named like a public function (rpcnb.group) would replace it as an
    attribute of rpcnb the moment it is imported."""
    for info in pkgutil.walk_packages(rpcnb.__path__, "rpcnb."):
        importlib.import_module(info.name)
    for name in ("add_workers", "attach", "copying", "group", "init", "interrupt", "jobs",
                 "join", "restart", "run", "run_bg", "shutdown"):
        assert inspect.isfunction(getattr(rpcnb, name)), name
    assert rpcnb.group.__module__ == "rpcnb.membership.view"

