"""The inside of the rooms stays readable (docs/architecture.md, "State and messages"):
scripts/shape.py measures it with ``ast``, and these are the limits. A new piece of state
goes on an object its owner holds (the Session for a group's), a wait with a time limit
through rpcnb.waiting, an environment variable through rpcnb.settings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("shape_script", ROOT / "scripts" / "shape.py")
assert spec and spec.loader
shape = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = shape  # its dataclasses look their module up
spec.loader.exec_module(shape)

MEASURED = shape.measure()

# what each measure may count at most, and what to do instead
LIMITS = {
    # the process's current session (state.begin and end) and the device map the editor
    # applied for the next group (options.keep_device_map)
    "globals": (3, "keep the state on an object its owner holds, or use functools.cache"),
    "module_state": (12, "keep the state on an object its owner holds (the Session for a "
                         "group's), or name one object per concern the process holds"),
    # each one a concern of the whole process (its session, torch's pickler and RRef context,
    # the notebook code it shipped, its calls, its warm launcher, its output routing...)
    "process_objects": (18, "a group's state belongs on the Session, not on an object the "
                            "module keeps for the process"),
    "long_functions": (0, f"split it into steps that read as a sequence (at most "
                          f"{shape.LIMIT} lines of code each)"),
    "polling_loops": (5, "wait with rpcnb.waiting.until (or on an Event, a queue, a future)"),
    "environment": (0, "read it with rpcnb.settings (settings.other for another tool's)"),
    "session_lock": (0, "take the session's lock through a method of the Session"),
}


@pytest.mark.parametrize("measure", sorted(LIMITS))
def test_the_rooms_stay_within_their_limits(measure: str):
    found = getattr(MEASURED, measure)
    limit, instead = LIMITS[measure]
    where = "\n".join(f"  {f.where}  {f.what}" for f in found)
    assert len(found) <= limit, f"{measure}: {len(found)} (at most {limit}): {instead}\n{where}"


def test_each_measure_finds_what_it_looks_for(tmp_path: Path):
    """A module with one of each finds one of each: the limits above can fail."""
    package = tmp_path / "rpcnb"
    (package / "cells").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(shape.LIMIT + 1))
    (package / "cells" / "bad.py").write_text(
        "import os, time, threading\n"
        "_seen = {}\n_flag = None\n"
        "def note(k):\n    _seen[k] = 1\n"
        "def flip():\n    global _flag\n    _flag = 1\n"
        "def wait(deadline):\n    while time.monotonic() < deadline:\n        time.sleep(0.1)\n"
        "def where():\n    return os.environ.get('TP_SOCKET_IFNAME')\n"
        "def locked(s):\n    with s.lock:\n        pass\n"
        f"def long():\n{body}\n")
    old_root = shape.ROOT
    shape.ROOT = tmp_path
    try:
        found = shape.measure(package)
    finally:
        shape.ROOT = old_root
    counts = found.counts()
    assert counts == {"globals": 1, "module_state": 2, "process_objects": 0,
                      "long_functions": 1, "polling_loops": 1, "environment": 1,
                      "session_lock": 1}, counts
