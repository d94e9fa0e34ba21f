"""Many workers' errors read like one: the same error on 32 workers is one traceback
labelled with the set, each different error shows once, and every worker's own error is
kept (rpcnb.errors.CompositeRemoteError)."""

from __future__ import annotations

from rpcnb.errors import CompositeRemoteError, RemoteError


def remote(worker: str, cell: int, ename: str = "ZeroDivisionError",
           evalue: str = "division by zero") -> RemoteError:
    tb = (f"Traceback (most recent call last):\n  File \"<{worker} cell {cell}>\", line 2, in "
          f"<module>\n    1 / 0\n{ename}: {evalue}\n")
    return RemoteError(worker, ename, evalue, tb)


def test_the_same_error_on_32_workers_is_one_traceback_labelled_with_the_set():
    errors = {f"worker{i}": remote(f"worker{i}", cell=3 + i % 2) for i in range(1, 33)}
    exc = CompositeRemoteError(errors)
    assert str(exc) == "32 workers raised ZeroDivisionError: division by zero (worker1-32)"
    lines = exc._render_traceback_()
    assert lines[0] == "CompositeRemoteError: " + str(exc)
    assert lines.count("RemoteError: ZeroDivisionError on worker1-32") == 1
    assert sum("Traceback" in line for line in lines) == 1  # one traceback, not 32
    assert len(lines) < 12, lines
    assert "%debug NAME opens its frames" in lines[-1]
    assert exc.errors == errors and exc.errors["worker7"].traceback.count("<worker7 cell 4>")


def test_different_errors_show_once_each_and_the_first_line_stays_short():
    errors = {f"worker{i}": remote(f"worker{i}", 1) if i % 2 else
              remote(f"worker{i}", 1, "KeyError", "'missing'") for i in range(1, 33)}
    exc = CompositeRemoteError(errors)
    assert [len(k) for k in exc.kinds] == [16, 16]
    assert str(exc).startswith("32 workers raised 2 different errors: ZeroDivisionError "
                               "(worker1,worker3,worker5,")
    assert len(str(exc)) <= 200
    lines = exc._render_traceback_()
    assert sum("Traceback" in line for line in lines) == 2
    many = {f"worker{i}": remote(f"worker{i}", 1, f"Error{i}", "x" * 300) for i in range(1, 9)}
    exc = CompositeRemoteError(many)
    lines = exc._render_traceback_()
    assert sum("Traceback" in line for line in lines) == 4  # then the others are named
    assert any(line.startswith("... and 4 more different errors: Error5 (worker5)")
               for line in lines), lines
    assert len(str(exc)) <= 200


def test_two_workers_that_raised_differently_read_as_before():
    exc = CompositeRemoteError({"worker1": remote("worker1", 1),
                                "worker2": remote("worker2", 1, "KeyError", "'k'")})
    assert str(exc) == ("2 workers raised 2 different errors: ZeroDivisionError (worker1); "
                        "KeyError (worker2)")
    lines = exc._render_traceback_()
    assert "RemoteError: ZeroDivisionError on worker1" in lines
    assert "RemoteError: KeyError on worker2" in lines
