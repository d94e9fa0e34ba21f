"""What Tab offers on the line of ``%%remote``/``%remote`` and where a ``%%remote`` cell's
body starts (rpcnb/frontend/completion.py), and how ``%rpc_who`` writes a member's
variables (rpcnb/observe/names.py): pure functions, no kernel."""

from __future__ import annotations

import pytest

from rpcnb import errors
from rpcnb.frontend import plans
from rpcnb.frontend.completion import line_completions, remote_body
from rpcnb.observe.names import MemberVariables, Variables

WORKERS = ["worker1", "worker2"]
FLAGS = list(plans.flags_of(plans.remote))


def offered(before: str, full: str | None = None, line: int = 0) -> tuple[str, list[str]] | None:
    found = line_completions(before if full is None else full, line, before, WORKERS)
    return None if found is None else (found[0], [text for text, _ in found[1]])


def test_the_flags_are_the_parsers():
    assert FLAGS == ["--all", "-o", "--fetch", "--push", "--timeout", "--bg", "--copy",
                     "--local", "--profile"]
    assert {f for f, valued in plans.flags_of(plans.remote).items() if valued} == \
        {"-o", "--push", "--timeout"}


@pytest.mark.parametrize(("before", "expected"), [
    ("%%remote ", ("", WORKERS + FLAGS)),
    ("%%remote w", ("w", WORKERS)),
    ("%%remote worker2", ("worker2", ["worker2"])),
    ("%%remote worker1,", ("", ["worker2"])),
    ("%%remote worker1,worker2,", ("", [])),
    ("%%remote worker1 ", ("", [f for f in FLAGS if f != "--all"])),
    ("%%remote worker1 --f", ("--f", ["--fetch"])),
    ("%%remote --fetch worker1 --f", ("--f", [])),
    ("%%remote --all ", ("", [f for f in FLAGS if f != "--all"])),
    ("%%remote --all w", None),
    ("%%remote -o ", None),
    ("%%remote --push a,", None),
    ("%%remote --timeout 3 w", ("w", WORKERS)),
    ("%remote ", ("", WORKERS + FLAGS)),
    ("%remote --b", ("--b", ["--bg"])),
    ("%remote worker1 ", None),
    ("%remote worker1 x.sha", None),
    ("%%remote", None),
    ("%%remotex ", None),
    ("x = 1", None),
])
def test_the_magics_line(before, expected):
    assert offered(before) == expected


def test_a_cell_magic_only_on_its_first_line_a_line_magic_on_any():
    assert offered("%%remote w", "\n\n%%remote w\nx", 2) == ("w", WORKERS)
    assert offered("%%remote w", "x = 1\n%%remote w", 1) is None
    assert offered("%remote w", "x = 1\n%remote w", 1) == ("w", WORKERS)


def test_where_the_body_starts():
    code = "%%remote worker1 --fetch\nw.ab\nprint(1)"
    assert remote_body(code, code.index("w.ab") + 4) == (" worker1 --fetch", code.index("w.ab"))
    assert remote_body(code, 5) is None  # on the magic's line
    assert remote_body("\n  %%remote worker1\nx", 21) == (" worker1", 20)
    assert remote_body("%%remote\nx", 10) == ("", 9)
    assert remote_body("%%remote worker1", 16) is None  # no body yet
    assert remote_body("x = 1\n%%remote worker1\ny", 24) is None  # not a cell magic
    assert remote_body("%%remotely worker1\ny", 20) is None


def test_the_variables_table():
    rows = [
        {"name": "n", "type": "int"},
        {"name": "t", "type": "torch.Tensor", "shape": [3, 4], "dtype": "float16",
         "device": "cpu", "nbytes": 24, "requires_grad": False},
        {"name": "v", "type": "numpy.ndarray", "shape": [5], "dtype": "int64",
         "device": "cpu", "nbytes": 40},
        {"name": "xs", "type": "list", "len": 3},
    ]
    found = MemberVariables("worker1", rows=rows)
    assert str(found).splitlines() == [
        "worker1: 4 variables",
        "variable  type           shape   dtype    device  size",
        "n         int",
        "t         torch.Tensor   (3, 4)  float16  cpu     24 B",
        "v         numpy.ndarray  (5,)    int64    cpu     40 B",
        "xs        list           len 3",
    ]
    assert MemberVariables("worker1", rows=rows[:1]).summary() == "worker1: 1 variable"
    assert str(MemberVariables("worker2")) == f"worker2: {errors.WHO_NONE}"
    assert MemberVariables("worker2", "dead", "killed by SIGKILL").summary() == \
        "worker2: dead (killed by SIGKILL); its namespace is lost."
    assert MemberVariables("worker2", "silent", "2 s").summary().startswith(
        "worker2: did not answer within 2 s")
    both = Variables([found, MemberVariables("worker2")])
    assert str(both) == f"{found}\n\nworker2: {errors.WHO_NONE}"
    assert both.get("worker2").rows == []
