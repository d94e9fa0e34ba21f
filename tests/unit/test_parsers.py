"""The magics' line parsers, fuzzed: any line gives parsed flags or one UsageError."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from rpcnb.frontend.magics import parse_init_line, parse_remote_line

TOKENS = st.sampled_from([
    "worker1", "worker1,worker2", "--all", "-o", "r", "--fetch", "--push", "a,b",
    "--timeout", "1", "-1", "nan", "x.sum()", "'", '"', "{x}", "$y", "--", "-", ",",
    "--workers", "2", "--join", "file:///tmp/x", "--name", "alice", "--threads", "0",
    "--channels", "basic,cma", "--transports", "uv", "--device-map", "1_0_1", "--no-shm",
    "--bogus", "é", "\\t",
])
LINES = st.one_of(st.text(max_size=60), st.lists(TOKENS, max_size=8).map(" ".join))


@settings(max_examples=400, deadline=None)
@given(LINES, st.one_of(st.none(), st.text(max_size=20)))
def test_remote_line_parses_or_raises_usage_error(line, cell):
    try:
        args, code = parse_remote_line(line, cell)
    except UsageError as exc:
        assert str(exc)  # a message, never an empty error
        return
    assert args.all or args.target
    if cell is None:
        assert code.strip()
    else:
        assert code == cell


@settings(max_examples=400, deadline=None)
@given(LINES)
def test_init_line_parses_or_raises_usage_error(line):
    try:
        args = parse_init_line(line)
    except UsageError as exc:
        assert str(exc)
        return
    assert isinstance(args.workers, int)


def test_line_form_splits_flags_target_and_expression():
    args, code = parse_remote_line("--fetch worker1 x.sum() + {y}", None)
    assert (args.fetch, args.target, code) == (True, "worker1", "x.sum() + {y}")
    args, code = parse_remote_line("--all --timeout 2 len('a b')", None)
    assert (args.all, args.timeout, code) == (True, 2.0, "len('a b')")
    args, code = parse_remote_line("-o r worker2 1", None)
    assert (args.output, args.target, code) == ("r", "worker2", "1")


def test_cell_form_flags():
    args, code = parse_remote_line("worker1,worker2 --push a,b -o out", "x = 1\n")
    assert (args.target, args.push, args.output, code) == ("worker1,worker2", "a,b", "out",
                                                             "x = 1\n")
