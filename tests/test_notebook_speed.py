"""Notebook code costs what importable code costs: the reinforcement-learning tutorial's
batched pattern (an agent answering many small calls of module-level helpers from
observers, tests/data/batched_rl.py), pasted into a kernel, runs within 1.2x of the same
program imported from a module in the same kernel (rpcnb used to re-pickle notebook code
for every message: 1.8-2.2x). The same program run as a script with ``mp.spawn`` takes
turns with both and is reported beside them (bench/notebook_code.py compares all of it in
``make bench``). Ratios of medians, so the machine's speed cancels out; everything uses
TensorPipe over TCP (``uv``), rpcnb's default."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from conftest import run_watched

PROGRAM = Path(__file__).parent / "data" / "batched_rl.py"
STEPS, REPEATS, ROUNDS = 150, 3, 5
TARGET = 1.2


def script_seconds(out: Path) -> float:
    returncode, output, _, seen = run_watched(
        [sys.executable, str(PROGRAM), str(out), str(STEPS), str(REPEATS)], timeout=180,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert returncode == 0, output.decode(errors="replace")[-3000:]
    assert len(seen) >= 4, "the script ran its three ranks in processes of their own"
    result = json.loads(out.read_text())
    assert result["calls"] == 2 * (10 + STEPS * REPEATS)
    return float(result["seconds"])


def test_pasted_code_costs_what_importable_code_costs(kernel_factory, tmp_path):
    source = PROGRAM.read_text()
    pasted = source[:source.index("# --- launcher (not pasted) ---")]
    kernel = kernel_factory(env={"PYTHONPATH": str(PROGRAM.parent)})
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2")
    kernel.execute(pasted)  # the classes and helpers, defined in a cell
    kernel.execute("import json, batched_rl  # the same, importable")
    times: dict[str, list[float]] = {"pasted": [], "importable": [], "script": []}
    for _ in range(ROUNDS):  # in turns, so that load from elsewhere falls on all three
        for way, call in (("pasted", "drive"), ("importable", "batched_rl.drive")):
            out = kernel.execute(f"print(json.dumps({call}(3, {STEPS}, {REPEATS})))", timeout=300)
            result = json.loads(out.stdout)
            assert result["calls"] == 2 * (10 + STEPS * REPEATS)
            times[way].append(result["seconds"])
        times["script"].append(script_seconds(tmp_path / "script.json"))
    med = {way: statistics.median(v) for way, v in times.items()}
    print(f"batched RL, {2 * STEPS * REPEATS} calls: pasted {med['pasted']:.3f} s, "
          f"importable {med['importable']:.3f} s, script {med['script']:.3f} s")
    assert med["pasted"] / med["importable"] <= TARGET, times
    kernel.execute("%rpc_shutdown")
