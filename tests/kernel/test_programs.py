"""Plain torch RPC programs, pasted into a notebook, give their script's results.

Each program in ``tests/programs/`` is an ordinary torch RPC script: its definitions at
module level, then, below ``MARKER``, a launcher that runs it under ``mp.spawn`` +
``rpc.init_rpc`` (``tests/programs/launch.py``). A test pastes the definitions into a real
kernel that ran ``%load_ext rpcnb`` and ``%rpc_init --workers N`` (the programs of three
ranks one after another in the module's group, reset between them), calls the same driver
``run(WORLD_SIZE)`` in a cell, and compares the result with the script's number for number
(allclose for floats). It also compares what the program printed: the script's terminal
against the driver cell's output.

The script's side is recorded (``tests/programs/baselines.py``): when the program, launch.py,
torch, Python and the CPU capability are those of the recorded baseline, the test compares
with it instead of running the script again; otherwise it runs the script in its own
processes, as the baseline was made, and warns (``StaleBaseline``) that it should be
recorded again: ``python tests/programs/baselines.py``. One test always runs a script, to
check that the script side is real (separate processes, started by mp.spawn).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import Kernel, worker_pids
from programs import baselines
from programs.baselines import MARKER, ScriptRun, run_script

PROGRAMS = baselines.PROGRAMS
CELL_TIMEOUT = 120
RESULT = "RESULT "  # the driver cell prints the result as one line after this
# rpcnb prefixes output that reaches the notebook from another member
WORKER_PREFIX = re.compile(r"^\[worker\d+\] ", re.MULTILINE)
RTOL, ATOL = 1e-5, 1e-6


class DriverCellFailed(AssertionError):
    """The cell that calls run(WORLD_SIZE) raised."""


class ResultsDiffer(AssertionError):
    """The notebook's result is not the script's."""


class OutputDiffers(AssertionError):
    """The driver cell did not print what the script printed."""


@dataclass
class Baseline:
    """What the program gives as a script: recorded, or from a run in this session."""

    result: Any
    stdout: str


def definitions(name: str) -> str:
    """What a user pastes into a cell: the program's source down to the launcher."""
    source = (PROGRAMS / f"{name}.py").read_text()
    assert MARKER in source, f"{name}.py has no {MARKER!r} line"
    return source.split(MARKER)[0]


def world_size(name: str) -> int:
    for node in ast.parse(definitions(name)).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "WORLD_SIZE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name}.py defines no WORLD_SIZE")


def run_in_notebook(kernel: Kernel, name: str, shared: bool = False) -> tuple[Any, str]:
    """The program pasted into ``kernel``: the result of ``run(WORLD_SIZE)`` in a cell, and
    everything else that cell printed. ``shared``: the kernel is the module's group (the
    programs of three ranks run one after another in it, as a user pastes one program
    after another into the same notebook), else a kernel of its own, started for it."""
    if shared:
        assert len(worker_pids(kernel)) == world_size(name), name
    else:
        kernel.execute("%load_ext rpcnb")
        kernel.execute(f"%rpc_init --workers {world_size(name) - 1}")
    kernel.execute(definitions(name))
    out = kernel.execute(f"import json\nprint({RESULT!r} + json.dumps(run(WORLD_SIZE)))",
                         timeout=CELL_TIMEOUT, allow_error=True)
    if out.error:
        raise DriverCellFailed("the driver cell failed:\n" + out.traceback)
    lines = out.stdout.splitlines()
    found = [line for line in lines if line.startswith(RESULT)]
    assert len(found) == 1, f"the driver cell printed no result line:\n{out.stdout}"
    printed = "\n".join(line for line in lines if not line.startswith(RESULT))
    return json.loads(found[0][len(RESULT):]), printed


def assert_same(script: Any, notebook: Any, where: str = "result") -> None:
    """Equal structure and equal values; floats allclose."""
    if isinstance(script, dict):
        assert isinstance(notebook, dict) and script.keys() == notebook.keys(), (
            f"{where}: keys {sorted(script)} in the script, "
            f"{sorted(notebook) if isinstance(notebook, dict) else notebook!r} in the notebook")
        for key in script:
            assert_same(script[key], notebook[key], f"{where}[{key!r}]")
    elif isinstance(script, list):
        assert isinstance(notebook, list) and len(script) == len(notebook), (
            f"{where}: {script!r} in the script, {notebook!r} in the notebook")
        for i, (a, b) in enumerate(zip(script, notebook, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(script, float) or isinstance(notebook, float):
        assert math.isclose(script, notebook, rel_tol=RTOL, abs_tol=ATOL), (
            f"{where}: {script!r} in the script, {notebook!r} in the notebook")
    else:
        assert script == notebook, f"{where}: {script!r} in the script, {notebook!r} in the notebook"


def printed_lines(text: str) -> list[str]:
    """A program's printed lines in sorted order: its processes print concurrently."""
    return sorted(line for line in WORKER_PREFIX.sub("", text).splitlines() if line.strip())


# Script runs of this session by program, so that the test of the script side itself reuses
# one (each run starts WORLD_SIZE + 1 Pythons that import torch: about 10 s here).
SCRIPT_RUNS: dict[str, ScriptRun] = {}


def script_baseline(name: str, tmp_path: Path) -> Baseline:
    """The recorded baseline of ``name`` when its key matches; else the script, run now."""
    entry = baselines.recorded(name)
    if entry is not None:
        return Baseline(entry["result"], entry["stdout"])
    run = SCRIPT_RUNS[name] = run_script(name, tmp_path)
    warnings.warn(baselines.StaleBaseline(
        f"{name}.py: no recorded baseline for this source, launch.py, torch, Python and CPU "
        f"({baselines.BASELINES.name}), so the script ran ({run.seconds:.0f} s); record it: "
        f"{baselines.RECORD} {name}"), stacklevel=2)
    return Baseline(run.result, run.stdout)


def check_program(name: str, kernel: Kernel, tmp_path: Path, shared: bool = False) -> Baseline:
    script = script_baseline(name, tmp_path)
    notebook, printed = run_in_notebook(kernel, name, shared)
    try:
        assert_same(script.result, notebook)
    except AssertionError as e:
        raise ResultsDiffer(str(e)) from None
    in_cell, in_script = printed_lines(printed), printed_lines(script.stdout)
    if in_cell != in_script:
        missing = sorted((Counter(in_script) - Counter(in_cell)).elements())
        extra = sorted((Counter(in_cell) - Counter(in_script)).elements())
        raise OutputDiffers(f"the driver cell's output lacks {len(missing)} of the script's "
                            f"{len(in_script)} lines {missing} and has {extra} besides:\n"
                            f"{printed}")
    return script


def test_rl_agent_observer(group, tmp_path):
    check_program("rl_agent_observer", group, tmp_path, shared=True)


def test_parameter_server(kernel, tmp_path):
    check_program("parameter_server", kernel, tmp_path)


def test_batch_parameter_server(group, tmp_path):
    check_program("batch_parameter_server", group, tmp_path, shared=True)


def test_rnn_model_parallel(group, tmp_path):
    check_program("rnn_model_parallel", group, tmp_path, shared=True)


def test_remote_module(group, tmp_path):
    check_program("remote_module", group, tmp_path, shared=True)


def test_pipeline(group, tmp_path):
    script = check_program("pipeline", group, tmp_path, shared=True)
    # and the pipeline computes what the unsplit model computes
    for split, whole in (("outputs", "unsplit_outputs"), ("outputs_after", "unsplit_outputs_after"),
                         ("losses", "unsplit_losses")):
        assert_same(script.result[whole], script.result[split], f"{split} vs {whole}")


def test_script_runs_in_separate_processes(tmp_path):
    """The script side is real: one process per rank, each started by mp.spawn; and its
    recorded baseline, when current, is what it gives."""
    name = "remote_module"
    run = SCRIPT_RUNS.get(name) or run_script(name, tmp_path)
    entry = baselines.recorded(name)
    if entry is not None:
        assert_same(entry["result"], run.result, "the recorded result")
        assert printed_lines(entry["stdout"]) == printed_lines(run.stdout)
    names = [f"worker{r}" for r in range(world_size(name))]
    assert sorted(run.pids) == names
    pids = [run.pids[n][0] for n in names]
    assert len(set(pids)) == len(pids), f"two ranks share a process: {run.pids}"
    assert os.getpid() not in pids and run.script_pid not in pids
    # each is a child of the script, seen while it ran, and had exited when the script did
    assert all(run.pids[n][1] == run.script_pid for n in names), run.pids
    assert set(pids) <= run.seen, f"{pids} were not the script's children ({run.seen})"
    assert not set(pids) & run.alive_at_exit
