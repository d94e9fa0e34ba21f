"""Notebook code behaves like importable code: the reinforcement-learning tutorial's
batched pattern (an agent answering many small calls of module-level helpers from
observers, tests/data/batched_rl.py), pasted into a kernel, gives what the same program
imported from a module gives, and what it gives as a script with ``mp.spawn``; and rpcnb
ships the notebook's code once, not with every message (it used to re-pickle notebook code
for every call, which made the pasted program 1.8-2.2x slower).

Untimed: what it costs against importable code and the script is measured in turns, with
medians, by ``bench/notebook_code.py`` in ``make bench`` (target 1.2x; docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import run_watched

PROGRAM = Path(__file__).parents[1] / "data" / "batched_rl.py"
STEPS, REPEATS = 40, 2
CALLS = 2 * (10 + STEPS * REPEATS)
# counts the code objects rpcnb marshals and unmarshals in a process (rpcnb.wire.notebook's
# marshal module, wrapped; the real one does the work)
COUNT_MARSHAL = """
import marshal as _marshal
import rpcnb.wire.notebook as _nb

class _CountingMarshal:
    dumps_calls = loads_calls = 0

    def dumps(self, *args):
        type(self).dumps_calls += 1
        return _marshal.dumps(*args)

    def loads(self, *args):
        type(self).loads_calls += 1
        return _marshal.loads(*args)

    def __getattr__(self, name):
        return getattr(_marshal, name)

_nb.marshal = _CountingMarshal()
"""
SHIPPED = ("(lambda m: (m.dumps_calls, m.loads_calls))"
           "(__import__('rpcnb.wire.notebook').wire.notebook.marshal)")
# counts the messages a process pickles on cloudpickle's path, not the C pickler's alone
COUNT_FULL = """
import rpcnb.paths.serialize as _serialize

def _counting_pickler_class(_made=_serialize._pickler_class):
    _counting_pickler_class.calls += 1
    return _made()

_counting_pickler_class.calls = 0
_serialize._pickler_class = _counting_pickler_class
"""
FULL = "__import__('rpcnb.paths.serialize').paths.serialize._pickler_class.calls"


def run_script(out: Path) -> dict:
    returncode, output, _, seen = run_watched(
        [sys.executable, str(PROGRAM), str(out), str(STEPS), str(REPEATS)], timeout=180,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert returncode == 0, output.decode(errors="replace")[-3000:]
    assert len(seen) >= 4, "the script ran its three ranks in processes of their own"
    return json.loads(out.read_text())


def test_pasted_code_gives_what_importable_code_gives_and_ships_once(kernel_factory, tmp_path):
    source = PROGRAM.read_text()
    pasted = source[:source.index("# --- launcher (not pasted) ---")]
    kernel = kernel_factory(env={"PYTHONPATH": str(PROGRAM.parent)})
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2")
    kernel.execute(COUNT_MARSHAL)
    kernel.execute(f"%%remote --all\n{COUNT_MARSHAL}")
    kernel.execute(COUNT_FULL)
    kernel.execute(f"%%remote --all\n{COUNT_FULL}")
    kernel.execute(pasted)  # the classes and helpers, defined in a cell
    kernel.execute("import json, batched_rl  # the same, importable")

    def drive(call: str) -> dict:
        out = kernel.execute(f"print(json.dumps({call}(3, {STEPS}, {REPEATS})))", timeout=300)
        result = json.loads(out.stdout)
        assert result["calls"] == CALLS, result
        return result

    def shipped() -> dict:
        return {"worker0": tuple(kernel.value(SHIPPED)),
                **{w: tuple(kernel.value(f"__import__('rpcnb').run({w!r}, {SHIPPED!r}, "
                                         "fetch=True)")) for w in ("worker1", "worker2")}}

    first = drive("drive")
    after_first = shipped()
    assert after_first["worker0"][0] > 0, "the pasted code went by value (marshalled here)"
    assert after_first["worker1"][1] > 0 and after_first["worker2"][1] > 0, after_first

    def full() -> int:
        return kernel.value(FULL) + sum(
            kernel.value(f"__import__('rpcnb').run({w!r}, {FULL!r}, fetch=True)")
            for w in ("worker1", "worker2"))

    before = full()
    again = drive("drive")
    # the same calls again: nothing is marshalled or unmarshalled any more, anywhere
    assert shipped() == after_first, (after_first, shipped())
    # and the pasted helpers travel as the bytes they were shipped as once, so the calls
    # take the C pickler as importable ones do; the full path is left to the two
    # rpc.remote(Observer) and the six calls of Observer.run_episode (a method that reads
    # the notebook class Agent, which can change in place): 8 of 180 (it was all of them)
    took = full() - before
    assert took < 10, f"{took} messages of the pasted program took cloudpickle's path"

    before = full()
    importable = drive("batched_rl.drive")
    # the importable program's messages (functions by name, RRefs, small tensors: the
    # tutorials' _remote_method) take the C pickler alone, as torch's own pickler would;
    # only its two rpc.remote(Observer) (a class) and rpcnb's own cells take the full path
    took = full() - before
    assert took < 10, f"{took} messages took cloudpickle's path in a run of {CALLS} calls"
    script = run_script(tmp_path / "script.json")
    # the same program, the same policy (seeded): the same actions, all three ways
    assert first["totals"] == again["totals"] == importable["totals"] == script["totals"], \
        (first, again, importable, script)
    kernel.execute("%rpc_shutdown")
