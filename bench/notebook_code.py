"""Notebook code costs what importable code costs: the reinforcement-learning tutorial's
batched pattern (an agent answering many small calls of module-level helpers from
observers, ``tests/data/batched_rl.py``), pasted into a kernel, against the same program
imported from its module in the same kernel, and run as a script with ``mp.spawn``, the
three in turns (``ROUNDS`` rounds; medians). Everything uses TensorPipe over TCP (``uv``),
rpcnb's default. Targets: pasted within 1.2x of importable (rpcnb used to re-pickle notebook
code for every message: 1.8-2.2x), and within 1.2x of the script (issue 28).

A bench module for ``bench.run`` / ``bench.report`` (see ``bench.curves`` for the protocol).
``tests/kernel/test_notebook_code_ships_once.py`` checks the same program's results and messages, untimed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SECTION = "notebook_code"
PROGRAM = Path(__file__).resolve().parents[1] / "tests" / "data" / "batched_rl.py"
STEPS, REPEATS = 150, 3
ROUNDS = 15  # this VM swings 2x between runs minutes apart: many short rounds, in turns
TARGET = 1.2


def script_seconds(out: Path, steps: int) -> float:
    """The program as a plain script: three processes started by ``mp.spawn``."""
    proc = subprocess.run([sys.executable, str(PROGRAM), str(out), str(steps), str(REPEATS)],
                          capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the script failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return float(json.loads(out.read_text())["seconds"])


def measure(ctx: Any) -> dict[str, Any]:
    own = ctx.cfg.get(SECTION, {})  # bench.run's SMOKE
    rounds, steps = (own.get("rounds", 2), own.get("steps", 50)) if ctx.quick else (ROUNDS, STEPS)
    ctx.log(f"notebook code: batched RL, pasted / importable / script, {rounds} rounds")
    source = PROGRAM.read_text()
    pasted = source[:source.index("# --- launcher (not pasted) ---")]
    times: dict[str, list[float]] = {"pasted": [], "importable": [], "script": []}
    where = str(PROGRAM.parent)
    k = ctx.new_kernel()
    try:
        ctx.cell(k, "%load_ext rpcnb")
        ctx.cell(k, f"%rpc_init --workers 2 {ctx.rpc_args}".strip(), timeout=300)
        # the module is importable in the kernel and on both workers (functions of a
        # module travel by reference)
        ctx.cell(k, f"import sys\nsys.path.insert(0, {where!r})")
        ctx.cell(k, f"%%remote --all\nimport sys\nsys.path.insert(0, {where!r})")
        ctx.cell(k, pasted)
        ctx.cell(k, "import batched_rl")
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(rounds):  # in turns: load from elsewhere falls on all three
                for way, call in (("pasted", "drive"), ("importable", "batched_rl.drive")):
                    got = ctx.cell(k, f"B.emit({call}(3, {steps}, {REPEATS}))", timeout=600)
                    assert got["calls"] == 2 * (10 + steps * REPEATS), got
                    times[way].append(got["seconds"])
                times["script"].append(script_seconds(Path(tmp) / "script.json", steps))
    finally:
        ctx.close_kernel(k, ["B.stop_rpcnb()"])
    return {"steps": steps, "repeats": REPEATS, "calls": 2 * steps * REPEATS,
            "samples_s": times, "median_s": {w: statistics.median(v) for w, v in times.items()}}


def report(section: dict[str, Any], results: dict[str, Any]) -> Any:
    from bench.report import Part, target

    part = Part(title="Notebook code against importable code")
    med = section["median_s"]
    rows = [["batched RL", "median s", "vs importable", "runs s"]]
    for way in ("pasted", "importable", "script"):
        runs = " ".join(f"{x:.3f}" for x in section["samples_s"][way])
        rows.append([way, f"{med[way]:.3f}", f"{med[way] / med['importable']:.2f}x", runs])
    part.tables.append((f"{section['calls']} small calls of module-level helpers "
                        "(tests/data/batched_rl.py), pasted into a cell, imported, and as a "
                        "script with mp.spawn, in turns", rows))
    for against in ("importable", "script"):  # the script: what a user would run instead
        ratio = med["pasted"] / med[against]
        part.targets.append(target(f"pasted batched RL <= {TARGET:g}x {against}", ratio, TARGET,
                                   ratio <= TARGET,
                                   f"{ratio:.2f}x ({med['pasted']:.3f} vs {med[against]:.3f} s)"))
    return part
