"""Every magic answers malformed input with a one-line usage error, never a traceback:
hypothesis writes the malformed lines from the magics' own parsers (the flags, which take a
value, which a number, which a choice), one real kernel of this module runs them."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field

import pytest
from conftest import Kernel, stopped
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcnb.frontend.magics import RpcMagics


@dataclass
class Flags:
    """What a magic's parser takes: flags with a value, switches, flags whose value is a
    number, and the choices of those that have them."""

    valued: list[str] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    numeric: list[str] = field(default_factory=list)
    choices: dict[str, list[str]] = field(default_factory=dict)


def flags_of(kind: str, name: str) -> Flags:
    """Read from the magic's IPython magic_arguments parser (none: it takes no flags)."""
    method = getattr(RpcMagics, RpcMagics.magics[kind][name])
    parser: argparse.ArgumentParser | None = getattr(method, "parser", None)
    found = Flags()
    for action in parser._actions if parser is not None else []:
        if not action.option_strings:
            continue  # a positional (a worker's name): any word is one
        flag = action.option_strings[0]
        if action.nargs == 0:
            found.plain.append(flag)
            continue
        found.valued.append(flag)
        if action.type in (int, float):
            found.numeric.append(flag)
        if action.choices is not None:
            found.choices[flag] = [str(c) for c in action.choices]
    return found


# every magic rpcnb's magics class registers, as (kind, name): %remote is a line magic and
# a cell magic, fuzzed as both
MAGICS = sorted((kind, name) for kind, names in RpcMagics.magics.items() for name in names)
WORD = st.text(alphabet="abcxyz019_.,:", min_size=1, max_size=6)


@st.composite
def malformed(draw: st.DrawFn, kind: str, name: str) -> str:
    """Well-formed flags around one breaker that makes the line malformed."""
    flags = flags_of(kind, name)
    given: list[str] = []  # a flag, with its value where it takes one
    for _ in range(draw(st.integers(0, 3))):
        if flags.valued and draw(st.booleans()):
            flag = draw(st.sampled_from(flags.valued))
            if flag in flags.choices:
                value = draw(st.sampled_from(flags.choices[flag]))
            else:
                value = "1" if flag in flags.numeric else draw(WORD)
            given.append(f"{flag} {value}")
        elif flags.plain:
            given.append(draw(st.sampled_from(flags.plain)))
    breakers = [
        st.builds(lambda w: f"'{w}", WORD),  # an unbalanced quote
        st.builds(lambda w: f'"{w}', WORD),
        st.builds(lambda w: f"--zz{w}", WORD),  # a flag that does not exist
    ]
    if flags.numeric:  # a number flag with something else
        breakers.append(st.builds(lambda f, w: f"{f} x{w}", st.sampled_from(flags.numeric), WORD))
    if flags.choices:  # a value that is not among the flag's choices
        breakers.append(st.builds(lambda f, w: f"{f} zz{w}", st.sampled_from(sorted(flags.choices)),
                                  WORD))
    if flags.plain:  # a switch given a value
        breakers.append(st.builds(lambda f, w: f"{f}={w}", st.sampled_from(flags.plain), WORD))
    if flags.valued:  # a flag that needs a value, last and without one
        breakers.append(st.sampled_from(flags.valued))
    breaker = draw(st.one_of(breakers))
    if breaker in flags.valued:
        return " ".join([*given, breaker])
    at = draw(st.integers(0, len(given)))
    words = given[:at] + [breaker] + given[at:]
    if (kind, name) == ("line", "remote"):  # the line form: flags, the worker, the expression
        return " ".join([*words, "worker1", "1 + 1"])
    return " ".join(words)


def each_flag_broken(kind: str, name: str) -> list[str]:
    """Every flag of the magic, broken each way that applies to it, one line each."""
    flags = flags_of(kind, name)
    lines = [*flags.valued,  # without its value
             *(f"{f} x1" for f in flags.numeric), *(f"{f} zz" for f in flags.choices),
             *(f"{f}=1" for f in flags.plain)]
    if (kind, name) == ("line", "remote"):
        return [line if line in flags.valued else f"{line} worker1 1 + 1" for line in lines]
    return lines


# Runs each (kind, name, line) and prints what came of each: ('ran', ''), ('usage',
# message) for a UsageError, or ('other', the exception) for anything else
CALL = """\
from IPython.core.error import UsageError
_results = []
for _kind, _name, _line in {calls!r}:
    try:
        if _kind == 'cell':
            get_ipython().run_cell_magic(_name, _line, 'x = 1')
        else:
            get_ipython().run_line_magic(_name, _line)
        _results.append(('ran', ''))
    except UsageError as e:
        _results.append(('usage', str(e)))
    except BaseException as e:
        _results.append(('other', type(e).__name__ + ': ' + str(e)))
print(repr(_results))
"""


def run_lines(kernel: Kernel, calls: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    out = kernel.execute(CALL.format(calls=calls))
    return ast.literal_eval(out.stdout.strip())


def assert_usage_line(line: str, how: str, message: str) -> None:
    assert how == "usage", (line, how, message)
    assert message and "\n" not in message, (line, message)
    assert "Traceback" not in message

# the (kind, name) of every magic the kernel has from an rpcnb module after %load_ext
REGISTERED = """\
_mm = get_ipython().magics_manager
print(repr(sorted((kind, name) for kind, table in _mm.magics.items()
                  for name, func in table.items()
                  if (getattr(func, '__module__', '') or '').startswith('rpcnb')
                  and name != 'debug')))
"""
# %debug is IPython's own, which rpcnb wraps (rpcnb.frontend.debugging): a line that names
# no worker goes to IPython as it is; %debug WORKER is tested in test_console.py


@pytest.fixture(scope="module")
def loaded():
    """One kernel with rpcnb loaded for the whole module (no group: every line here fails
    before it could start one); every process it started is stopped by pid at the end."""
    k = Kernel()
    try:
        k.execute("%load_ext rpcnb")
        yield k
    finally:
        k.close()
        left = stopped(k.known)
        assert not left, f"processes left running: {left}"


def test_every_magic_rpcnb_registers_is_fuzzed(loaded):
    out = loaded.execute(REGISTERED)
    found = ast.literal_eval(out.stdout.strip())
    assert found, "no magic of rpcnb was found in the kernel"
    assert sorted(map(tuple, found)) == MAGICS


@pytest.mark.parametrize("kind, name", MAGICS, ids=[f"{k}-{n}" for k, n in MAGICS])
def test_malformed_input_is_a_one_line_usage_error(loaded, kind, name):
    flags = flags_of(kind, name)
    examples = 25 + 2 * len(flags.valued + flags.plain)  # %rpc_init: each of its 24 flags

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(malformed(kind, name))
    def check(line: str) -> None:
        [(how, message)] = run_lines(loaded, [(kind, name, line)])
        assert_usage_line(line, how, message)

    check()


@pytest.mark.parametrize("kind, name", MAGICS, ids=[f"{k}-{n}" for k, n in MAGICS])
def test_each_flag_broken_alone_is_a_one_line_usage_error(loaded, kind, name):
    # every flag, not only those the fuzzing happened to draw
    lines = each_flag_broken(kind, name)
    for line, (how, message) in zip(lines, run_lines(loaded, [(kind, name, ln) for ln in lines]),
                                    strict=True):
        assert_usage_line(line, how, message)


def test_what_the_user_sees_is_the_usage_line_alone(loaded):
    for line in ("%rpc_probe 'worker1", "%rpc_channels --interval \"", "%rpc_devmap '",
                 "%rpc_jobs --nope", "%rpc_restart", "%rpc_init --collectives mpi",
                 "%rpc_init --ucx --collective-timeout soon", "%rpc_workers now",
                 "%%remote --profile --zz\nx = 1"):
        out = loaded.execute(line, allow_error=True)
        assert out.error is None, line  # no exception, no traceback
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("UsageError: "), (line, out.stderr)
