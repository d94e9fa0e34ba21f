"""The magics' line parsers, fuzzed: any line gives the flags it holds, each with its value
and type, or one UsageError of one line. Which flags there are, their types and choices,
are read from the parsers themselves (rpcnb.frontend.plans' init_flags and remote_flags)."""

from __future__ import annotations

import argparse
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from rpcnb.frontend import plans
from rpcnb.frontend.magics import parse_init_line, parse_remote_line

TOKENS = st.sampled_from([
    "worker1", "worker1,worker2", "--all", "-o", "r", "--fetch", "--push", "a,b",
    "--timeout", "1", "-1", "nan", "x.sum()", "'", '"', "{x}", "$y", "--", "-", ",",
    "--workers", "2", "--join", "file:///tmp/x", "--name", "alice", "--threads", "0",
    "--channels", "basic,cma", "--transports", "uv", "--device-map", "1_0_1", "--no-shm",
    "--bogus", "é", "\\t", "--collectives", "gloo", "nccl", "--collective-timeout", "2.5",
    "--ucx", "--no-zero-copy", "--copy", "--local", "--profile", "--bg", "--port", "x",
])
LINES = st.one_of(st.text(max_size=60), st.lists(TOKENS, max_size=8).map(" ".join))


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags by their option string (positionals aside)."""
    return {action.option_strings[0]: action for action in parser._actions
            if action.option_strings}


INIT = flags(plans.rpc_init.parser)  # type: ignore[attr-defined]
REMOTE = flags(plans.remote.parser)  # type: ignore[attr-defined]


def assert_types(args: Any, actions: dict[str, argparse.Action]) -> None:
    """Each flag's value is of its flag's kind: a bool for a switch, a number for a number
    flag, one of its choices, or a string; None (or its default) when it was not given."""
    for flag, action in actions.items():
        value = getattr(args, action.dest)
        if action.nargs == 0:
            assert isinstance(value, bool) or value is action.default, (flag, value)
        elif value is None or value is action.default:
            continue
        elif action.choices is not None:
            assert value in action.choices, (flag, value)
        elif action.type in (int, float):
            assert type(value) is action.type, (flag, value)
        else:
            assert isinstance(value, str), (flag, value)


def assert_one_line(exc: UsageError, line: str) -> None:
    message = str(exc)
    assert message.strip(), line  # a message, never an empty error
    if "\n" not in line and "\r" not in line:  # a magic's line never holds a line break
        assert "\n" not in message and "\r" not in message, (line, message)


@settings(max_examples=400, deadline=None)
@given(LINES, st.one_of(st.none(), st.text(max_size=20)))
def test_any_remote_line_parses_or_raises_one_usage_line(line, cell):
    try:
        args, code = parse_remote_line(line, cell)
    except UsageError as exc:
        assert_one_line(exc, line)
        return
    assert_types(args, REMOTE)
    assert bool(args.all) != bool(args.target), (line, args)  # a target or --all, not both
    if args.target:
        assert args.target in line  # as written (shlex splits on ASCII whitespace only)
    assert args.output is None or args.output.isidentifier()
    assert args.timeout is None or args.timeout > 0
    if cell is None:  # the line form: the expression is the line's last part, as written
        assert code.strip() and code == code.strip() and line.rstrip().endswith(code)
    else:
        assert code == cell


@settings(max_examples=400, deadline=None)
@given(LINES)
def test_any_init_line_parses_or_raises_one_usage_line(line):
    try:
        args = parse_init_line(line)
    except UsageError as exc:
        assert_one_line(exc, line)
        return
    assert_types(args, INIT)


# -- lines made of the flags: each comes back with its value --------------------------------

WORD = st.text(alphabet="abcxyz0189_.,:/=+@{}$", min_size=1, max_size=8)


def value_of(action: argparse.Action) -> st.SearchStrategy[Any]:
    if action.choices is not None:
        return st.sampled_from(list(action.choices))
    if action.type is int:
        return st.integers(-3, 10**6)
    if action.type is float:  # positive: argparse takes -1e-05 for a flag
        return st.floats(0.001, 1e6)
    return WORD


@st.composite
def flag_words(draw: st.DrawFn, actions: dict[str, argparse.Action],
               skip: tuple[str, ...] = ()) -> tuple[list[list[str]], dict[str, Any]]:
    """Some of the flags, in any order, each with a value of its kind; what each should
    come back as, by its dest."""
    chosen = draw(st.lists(st.sampled_from(sorted(set(actions) - set(skip))), unique=True))
    words, expected = [], {}
    for flag in chosen:
        action = actions[flag]
        if action.nargs == 0:
            words.append([flag])
            expected[action.dest] = True
        else:
            value = draw(value_of(action))
            words.append([flag, repr(value) if isinstance(value, float) else str(value)])
            expected[action.dest] = value
    return words, expected


def assert_given(args: Any, actions: dict[str, argparse.Action],
                 expected: dict[str, Any]) -> None:
    """The flags given came back with their values, of their types; the others with their
    defaults."""
    for action in actions.values():
        got = getattr(args, action.dest)
        if action.dest in expected:
            assert got == expected[action.dest] and type(got) is type(expected[action.dest]), (
                action.dest, got, expected[action.dest])
        else:
            assert got == action.default, (action.dest, got)


@settings(max_examples=300, deadline=None)
@given(flag_words(INIT))
def test_each_init_flag_comes_back_with_its_value_and_type(made):
    words, expected = made
    args = parse_init_line(" ".join(w for pair in words for w in pair))
    assert_given(args, INIT, expected)
    assert_types(args, INIT)


TARGETS = st.lists(st.text(alphabet="abcwxyz0129_", min_size=1, max_size=7), min_size=1,
                   max_size=3).map(",".join)
EXPRESSIONS = st.builds(lambda head, rest: (head + rest).rstrip() or head,
                        st.sampled_from(["x", "f(", "1", "[", "len('a b')", "'", "{y}", "$z"]),
                        st.text(alphabet=st.characters(blacklist_characters="\n\r"), max_size=20))
REMOTE_VALUED = ("-o", "--timeout")  # values with rules of their own, drawn below


@settings(max_examples=300, deadline=None)
@given(flag_words(REMOTE, skip=("--all", *REMOTE_VALUED)), st.booleans(), TARGETS,
       st.one_of(st.none(), st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)),
       st.one_of(st.none(), st.floats(0.001, 1e6)), EXPRESSIONS,
       st.one_of(st.none(), st.text(max_size=30)))
def test_each_remote_flag_comes_back_with_its_value_and_type(made, to_all, target, output,
                                                              timeout, expr, cell):
    words, expected = made
    if output is not None:
        words.append(["-o", output])
        expected["output"] = output
    if timeout is not None:
        words.append(["--timeout", repr(timeout)])
        expected["timeout"] = timeout
    if to_all:
        words.append(["--all"])
        expected["all"] = True
    flag_part = [w for pair in words for w in pair]
    if cell is None:  # %remote [flags] WORKER EXPR, or %remote --all [flags] EXPR
        line = " ".join([*flag_part, *([] if to_all else [target]), expr])
    else:  # %%remote WORKER [flags], the flags after the target
        line = " ".join([*([] if to_all else [target]), *flag_part])
    args, code = parse_remote_line(line, cell)
    assert args.target == (None if to_all else target)
    assert_given(args, REMOTE, expected)
    assert_types(args, REMOTE)
    assert code == (expr.strip() if cell is None else cell)


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
