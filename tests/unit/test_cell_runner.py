"""Where a remote cell runs (rpcnb.cells.runner), without a group: a cell run again is
taken from the code cache, with IPython's syntax still honoured and its traceback naming
the cell that ran; a loop of cells leaves no lines behind in linecache; a cell's result
reads back the same after pickling, every field.

The shell is IPython's real one; the pickler is torch's RPC pickler with rpcnb's hooks.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("IPython")

from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from rpcnb.cells import runner  # noqa: E402
from rpcnb.cells.runner import CellResult  # noqa: E402


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    # a line magic as IPython syntax that starts no process (`!echo` would run /bin/sh)
    sh.register_magic_function(lambda line: line.split(), "line", "words")
    yield sh
    sh.user_ns.pop("said", None)


def test_a_cell_with_ipython_syntax_run_again_still_runs_as_ipython(shell):
    ns = shell.user_ns
    cell = "said = %words hello $n\nlen(said)"
    for i in range(3):  # the first run compiles it; the others take the compiled code
        ns["n"] = i
        value, has_value = runner.run_source(cell, f"<w cell {i}>", ns, shell)
        assert list(ns["said"]) == ["hello", str(i)] and (value, has_value) == (2, True)
    # a doctest prompt inside a string: IPython strips it each time the cell runs (its
    # transform is not idempotent, so a cell's text is transformed every time, never
    # taken as plain because its transformed form was run before)
    cell = 'x = """\n>>> >>> 1\n"""\n'
    runner.run_source(cell, "<w cell 3>", ns, shell)
    runner.run_source(shell.transform_cell(cell), "<w cell 4>", ns, shell)
    assert ns["x"] == "\n1\n"


def test_a_cell_run_again_names_itself_in_its_traceback(shell):
    cell = "def f(x):\n    return 1 / x\nf(0)"
    for i in (1, 2):
        filename = f"<worker1 cell {i}>"
        with pytest.raises(ZeroDivisionError) as caught:
            runner.run_source(cell, filename, shell.user_ns, shell)
        tb = runner.format_exception(caught.value, filename)
        # the function made by the cell, too, names the run it was made in
        assert f'File "{filename}", line 3' in tb and f'File "{filename}", line 2, in f' in tb
        other = "<worker1 cell 2>" if i == 1 else "<worker1 cell 1>"
        assert other not in tb


def _deepest(exc: BaseException) -> Any:
    """The code of the frame an exception was raised in."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    assert tb is not None
    return tb.tb_frame.f_code


def test_a_plain_cell_run_again_runs_its_first_code_and_its_traceback_names_this_run(shell):
    import linecache

    ns = shell.user_ns
    cell = "import traceback\ntry:\n    1 / d\nexcept ZeroDivisionError:\n    traceback.print_exc()\n1 / d"
    ran = []
    for i in (1, 2, 3):
        ns["d"] = 0
        with pytest.raises(ZeroDivisionError) as caught:
            runner.run_source(cell, f"<worker1 cell {i}>", ns, shell)
        ran.append(_deepest(caught.value))
        tb = runner.format_exception(caught.value, f"<worker1 cell {i}>")
        assert f'File "<worker1 cell {i}>", line 6' in tb and "1 / d" in tb, tb
        assert "cell 1>" not in tb or i == 1, tb  # shown under this run's name
    # the second and third runs took the code of the first, compiled once, not a copy
    assert ran[1] is ran[2] and ran[1].co_filename == "<worker1 cell 1>"
    # while it runs, its lines are there for a traceback the cell prints itself, also
    # when linecache was cleared between two runs (torch.compile's workers clear it)
    prints = ("import io, traceback\nout = io.StringIO()\ntry:\n    1 / (d - 1)"
              "\nexcept ZeroDivisionError:\n    traceback.print_exc(file=out)\nout.getvalue()")
    ns["d"] = 1
    first = runner.run_source(prints, "<worker1 cell 4>", ns, shell)[0]
    linecache.clearcache()
    again = runner.run_source(prints, "<worker1 cell 5>", ns, shell)[0]
    assert "1 / (d - 1)" in first and "1 / (d - 1)" in again, again
    # a cell of IPython syntax is transformed each time, and renamed after each run
    ns["d"] = 0
    for i in (6, 7):
        with pytest.raises(ZeroDivisionError) as caught:
            runner.run_source("x = %words 1\n1 / d", f"<worker1 cell {i}>", ns, shell)
        assert _deepest(caught.value).co_filename == f"<worker1 cell {i}>"


def test_the_name_of_a_run_holds_through_chained_errors_and_a_code_cache_cleared_meanwhile(shell):
    ns = shell.user_ns
    # an error raised while another is handled: both parts name the run
    cell = "try:\n    1 / 0\nexcept ZeroDivisionError:\n    raise ValueError('bad')"
    for i in (1, 2):
        with pytest.raises(ValueError) as caught:
            runner.run_source(cell, f"<w chained {i}>", ns, shell)
        tb = runner.format_exception(caught.value, f"<w chained {i}>")
        assert tb.count(f'File "<w chained {i}>"') == 2 and "1 / 0" in tb, tb
        assert i == 1 or "<w chained 1>" not in tb, tb
    # more cells than the code cache keeps ran while this one did (another thread, or the
    # cell itself): its traceback keeps its frames, its name and its line
    ns["others"] = lambda: [runner.run_source(f"v = {k}", f"<w other {k}>", {}, shell)
                            for k in range(runner._CODE_KEPT + 10)]
    ns["busy"] = False
    cell = "if busy: others()\n1 / 0"
    with pytest.raises(ZeroDivisionError):
        runner.run_source(cell, "<w evicted 1>", ns, shell)
    ns["busy"] = True
    with pytest.raises(ZeroDivisionError) as caught:
        runner.run_source(cell, "<w evicted 2>", ns, shell)
    assert cell not in runner.COMPILED.code  # dropped while it ran
    tb = runner.format_exception(caught.value, "<w evicted 2>")
    assert 'File "<w evicted 2>", line 2' in tb and "1 / 0" in tb, tb


def test_a_loop_of_cells_leaves_no_lines_behind_but_what_may_be_asked_for(shell):
    import inspect
    import linecache

    ns = shell.user_ns
    old, before = dict(linecache.cache), len(linecache.cache)
    for i in range(300):  # rpcnb.run(w, "x = ...") in a loop: no entry per cell stays,
        runner.run_source("y = 2 * 21\ny", f"<w loop {i}>", ns, shell)
    # only the one its kept code reads, under the name of its first run
    assert set(linecache.cache) - set(old) == {"<w loop 0>"}
    assert len(linecache.cache) == before + 1
    # a cell that defines a function keeps its lines: its source and tracebacks need them
    runner.run_source("def g():\n    return 1 / 0", "<w def>", ns, shell)
    assert inspect.getsource(ns["g"]) == "def g():\n    return 1 / 0"
    # a cell that fails keeps its lines for its traceback, with the failing line shown
    with pytest.raises(ZeroDivisionError) as caught:
        runner.run_source("z = 1\nz / 0", "<w fails>", ns, shell)
    assert "z / 0" in runner.format_exception(caught.value, "<w fails>")
    # so does a generator expression's (a code object of its own on every Python)
    assert runner.run_source("sum(k * 2 for k in range(3))", "<w gen>", ns, shell) == (6, True)
    assert "<w gen>" in linecache.cache
    # a cell that clears linecache itself (torch.compile's workers do) still just runs
    assert runner.run_source("linecache.clearcache()\n5", "<w clears>",
                             {"linecache": linecache}, shell) == (5, True)


def test_a_cells_result_reads_back_the_same_after_pickling():
    value = {"loss": torch.arange(6.0).reshape(2, 3), "step": 7}
    # (an RRef needs a group: a stand-in value in its field; tests/kernel carry real ones)
    result = CellResult("worker1", False, "rref", value, True, "ValueError", "bad", "tb", 0.25,
                        4, True, {"table": "t", "trace": b"{}", "cuda": False})
    for name in (f.name for f in dataclasses.fields(CellResult)):  # every field set
        assert getattr(result, name) != getattr(CellResult("w", True), name), name
    back = pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    assert torch.equal(back.value.pop("loss"), value.pop("loss"))
    assert back == result
    from rpcnb.wire import _torch

    rpc_pickler = _torch.rpc_pickler()
    ok = CellResult("worker1", True, value=torch.ones(3), has_value=True, duration=0.5)
    again = rpc_pickler.deserialize(*rpc_pickler.serialize(ok))
    assert type(again) is CellResult and again.ok and again.has_value
    assert torch.equal(again.value, ok.value) and again.duration == 0.5


def test_a_cells_result_travels_as_its_fields_in_order_under_this_protocol():
    # CellResult pickles as its fields in order (runner.CellResult.__reduce__), and most
    # results travel as a tuple instead (CellResult.wire): members of a group must agree on
    # both, and they agree on rendezvous.PROTOCOL. A change of either needs PROTOCOL
    # raised, and this test written anew.
    from rpcnb.session import rendezvous

    assert CellResult("w", True, duration=0.5, outputs=2).wire() == (0.5, 2)
    assert CellResult("w", True, value=7, has_value=True, duration=0.5).wire() == (0.5, 0, 7)
    for other in (CellResult("w", False, ename="E"), CellResult("w", True, rref="r"),
                  CellResult("w", True, copy_tensors=True),
                  CellResult("w", True, profile={"table": ""})):
        assert other.wire() is other
    fields = tuple(f.name for f in dataclasses.fields(CellResult))
    assert (rendezvous.PROTOCOL, fields) == ("4", (
        "worker", "ok", "rref", "value", "has_value", "ename", "evalue", "traceback",
        "duration", "outputs", "copy_tensors", "profile"))


def test_the_caller_reads_every_form_a_result_travels_in():
    # what the worker's wire() sends, through torch's RPC pickler, as the caller reads it
    import queue

    from rpcnb.cells import call as calls
    from rpcnb.errors import RemoteError
    from rpcnb.wire import _torch

    rpc_pickler = _torch.rpc_pickler()
    sent = [CellResult("w1", True, duration=0.25, outputs=2),
            CellResult("w1", True, value={"step": 7}, has_value=True, duration=0.5),
            CellResult("w1", True, rref="an RRef", has_value=True, duration=0.125),
            CellResult("w1", False, ename="ValueError", evalue="bad", traceback="tb")]
    read = []
    for result in sent:
        fut = torch.futures.Future()
        fut.set_result(rpc_pickler.deserialize(*rpc_pickler.serialize(result.wire())))
        c = calls.Call("id", "w1", queue.SimpleQueue(), future=fut)
        c.read_result()
        assert c.done
        read.append((c.result, c.outputs, c.ran, c.error))
    assert read[:3] == [(None, 2, 0.25, None), ({"step": 7}, 0, 0.5, None),
                        ("an RRef", 0, 0.125, None)]
    error = read[3][3]
    assert isinstance(error, RemoteError) and (error.worker, error.ename) == ("w1", "ValueError")


def test_a_cells_future_is_made_while_the_runner_is_idle_and_handed_out_once():
    import time

    from rpcnb.cells.runner import CellRunner, Job

    r = CellRunner("w", {}, None)
    thread = r.start_thread()
    try:
        futures: list[Any] = []
        for i in range(5):
            fut = r.future()
            assert all(fut is not f for f in futures)  # never one a cell had
            r.submit(Job("token", f"call{i}", "me", f"x = {i}", False, {}, fut))
            duration, outputs = fut.wait()  # a cell with no value answers as a plain tuple
            assert duration >= 0 and outputs == 0 and r.namespace["x"] == i
            futures.append(fut)
            # once it answered, the runner makes the next cell's Future while it waits
            deadline = time.monotonic() + 5
            while not r._spare and time.monotonic() < deadline:
                time.sleep(0.001)
            assert len(r._spare) == 1 and not r._spare[0].done()
        # two requests at once (two RPC threads): the second makes its own
        first, second = r.future(), r.future()
        assert first is not second and not first.done() and not second.done()
    finally:
        r.stop()
        thread.join(5)
    assert not thread.is_alive()
