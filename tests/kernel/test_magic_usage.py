"""Every magic answers malformed input with a one-line usage error, never a traceback:
hypothesis writes the malformed lines, a real kernel runs them."""

from __future__ import annotations

import ast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# each magic: (its name, how it is called, flags that take a value, flags that do not,
# flags whose value is a number)
MAGICS = {
    "rpc_init": ("line", ["--workers", "--name", "--join", "--timeout", "--threads",
                          "--channels", "--transports", "--device-map", "--gpus", "--token",
                          "--port", "--host", "--add", "--engines", "--launcher",
                          "--cluster-args", "--attach", "--interface"],
                 ["--allow-remote", "--no-shm"],
                 ["--workers", "--timeout", "--threads", "--port", "--add", "--engines"]),
    "remote": ("cell", ["-o", "--push", "--timeout"], ["--all", "--fetch", "--bg"],
               ["--timeout"]),
    "remote ": ("line", ["-o", "--push", "--timeout"], ["--all", "--fetch", "--bg"],
                ["--timeout"]),
    "rpc_workers": ("line", [], [], []),
    "rpc_shutdown": ("line", ["--timeout"], [], ["--timeout"]),
    "rpc_probe": ("line", ["--sizes", "--repeats"], ["--tensorpipe"], ["--repeats"]),
    "rpc_channels": ("line", ["--interval"], ["--text"], ["--interval"]),
    "rpc_devmap": ("line", ["--topology", "--name"], [], []),
    "rpc_jobs": ("line", [], ["--all"], []),
    "rpc_restart": ("line", [], [], []),
    "rpc_doctor": ("line", [], ["--json", "--text"], []),
}

WORD = st.text(alphabet="abcxyz019_.,:", min_size=1, max_size=6)


@st.composite
def malformed(draw: st.DrawFn, magic: str) -> str:
    _, valued, plain, numeric = MAGICS[magic]
    tokens: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        if valued and draw(st.booleans()):
            flag = draw(st.sampled_from(valued))
            tokens += [flag, "1" if flag in numeric else draw(WORD)]
        elif plain:
            tokens.append(draw(st.sampled_from(plain)))
    breakers = [
        st.builds(lambda w: f"'{w}", WORD),  # an unbalanced quote
        st.builds(lambda w: f'"{w}', WORD),
        st.builds(lambda w: f"--zz{w}", WORD),  # a flag that does not exist
    ]
    if numeric:
        breakers.append(st.builds(lambda f, w: f"{f} x{w}", st.sampled_from(numeric), WORD))
    if valued:  # a flag that needs a value, last and without one
        breakers.append(st.sampled_from(valued).map(lambda f: f"{f}"))
    breaker = draw(st.one_of(breakers))
    if breaker in valued:
        return " ".join([*tokens, breaker])
    at = draw(st.integers(0, len(tokens)))
    words = tokens[:at] + [breaker] + tokens[at:]
    if magic == "remote ":  # the line form: flags, the worker, then the expression
        return " ".join([*words, "worker1", "1 + 1"])
    return " ".join(words)


CALL = """\
from IPython.core.error import UsageError
try:
    if {kind!r} == 'cell':
        get_ipython().run_cell_magic({name!r}, {line!r}, 'x = 1')
    else:
        get_ipython().run_line_magic({name!r}, {line!r})
    _r = ('ran', '')
except UsageError as e:
    _r = ('usage', str(e))
except BaseException as e:
    _r = ('other', type(e).__name__ + ': ' + str(e))
print(repr(_r))
"""


@pytest.fixture
def loaded(kernel):
    kernel.execute("%load_ext rpcnb")
    return kernel


@pytest.mark.parametrize("magic", sorted(MAGICS))
def test_malformed_input_is_a_one_line_usage_error(loaded, magic):
    kind = MAGICS[magic][0]

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(malformed(magic))
    def check(line: str) -> None:
        out = loaded.execute(CALL.format(kind=kind, name=magic.strip(), line=line))
        how, message = ast.literal_eval(out.stdout.strip())
        assert how == "usage", (line, how, message)
        assert message and "\n" not in message, (line, message)
        assert "Traceback" not in message

    check()


def test_what_the_user_sees_is_the_usage_line_alone(loaded):
    for line in ("%rpc_probe 'worker1", "%rpc_channels --interval \"", "%rpc_devmap '",
                 "%rpc_jobs --nope", "%rpc_restart"):
        out = loaded.execute(line, allow_error=True)
        assert out.error is None, line  # no exception, no traceback
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("UsageError: "), (line, out.stderr)
