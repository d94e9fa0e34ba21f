"""The table that opens ``docs/benchmarks.md``, written from the benchmarks' JSON files.

The page holds it between ``<!-- bench:table -->`` and ``<!-- /bench:table -->``. Everything
between the markers is generated: one row per comparison a user makes (a no-op call, a
``%%remote`` cell, 100 MB each way, a shared tensor, fan-out, start-up, idle cost, the CUDA
RPC recipe), rpcnb against torch alone, Ray, ipyparallel and the machine's floor, each row
with the run it comes from and that run's machine. Every figure is read from the JSON that
the named command writes (``SOURCES``); a row whose figures no JSON holds is left out, and
an empty cell is a figure that run did not measure. Everything around the markers is
written by hand.

``python scripts/bench_table.py`` rewrites the block in ``docs/benchmarks.md``; ``--check``
only says whether it is current (exit 1 when not). ``make bench`` and ``make bench-ray``
run it after their run, ``scripts/build_docs.py`` writes it into its staged copy before
Sphinx runs, and ``tests/unit/test_bench_table.py`` fails when the committed block and the
JSON files disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tables import rpcnb_column  # noqa: E402  (the one rule for a shm figure)

PAGE = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- bench:table -->\n)(?P<body>.*?)(<!-- /bench:table -->)", re.S)
STALE = "{path}: the benchmark table differs from the JSON files: run `python scripts/bench_table.py`"
MB = 1 << 20


@dataclass(frozen=True)
class Source:
    """A JSON file and the command whose latest run wrote it."""

    number: int  # how the table refers to it: (1), (2), ...
    path: str  # relative to the repository root
    command: str


SOURCES = {
    "bench": Source(1, "bench/results/latest.json", "make bench"),
    "ray": Source(2, "bench/results/overhead.json", "make bench-ray"),
    "gpu": Source(3, "bench/results/gpu.json", "make gpu-check"),
}

COLUMNS = ["", "rpcnb", "torch", "Ray", "ipyparallel", "floor", "run, machine"]


@dataclass
class Row:
    what: str
    source: str  # a key of SOURCES
    rpcnb: str
    torch: str = ""
    ray: str = ""
    ipyparallel: str = ""
    floor: str = ""


@dataclass
class Table:
    rows: list[Row] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # "row: why"


# -- figures -----------------------------------------------------------------------------


def ms(value: float) -> str:
    """Milliseconds with the digits that mean something at that size."""
    if value < 1:
        return f"{value:.3f} ms"
    if value < 10:
        return f"{value:.2f} ms"
    if value < 100:
        return f"{value:.1f} ms"
    return f"{value:.0f} ms"


def ms_list(values: list[float]) -> str:
    """``0.70 / 0.99 / 1.48 ms``: one unit for the lot."""
    return " / ".join(ms(v)[:-3] for v in values) + " ms"


def seconds(value: float) -> str:
    return f"{value:.2f} s"


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def _overhead(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["call"]: r for r in doc["rows"]}


# -- rows: each reads one JSON; a KeyError (or an empty list) means "not measured" --------


def _pipe(rows: dict[str, dict[str, Any]]) -> str:
    """The floor of a call between two processes, where the run measured it."""
    floor = rows.get("pipe round trip", {}).get("floor_ms")
    return ms(floor) + " (pipe round trip)" if floor else ""


def noop_groups(data: dict[str, Any]) -> Row:
    rows = _overhead(data["ray"])
    ray = rows.get("ray actor call", {}).get("ray_ms")
    return Row("no-op call, `rpcnb.run` (groups of two)", "ray",
               ms(rows["rpcnb.run no-op"]["rpcnb_ms"]),
               torch=ms(rows["rpc_sync python fn"]["torch_ms"]), ray=ms(ray) if ray else "",
               floor=_pipe(rows))


def noop_kernel(data: dict[str, Any]) -> Row:
    rt = data["bench"]["results"]["roundtrip"]
    return Row("no-op call from a notebook kernel", "bench", ms(rt["rpcnb.run"]["median_ms"]),
               torch=ms(rt["rpc_sync"]["median_ms"]),
               ipyparallel=ms(rt["ipp apply_sync"]["median_ms"]),
               floor=_pipe(_overhead(data["bench"]["results"].get("overhead", {"rows": []}))))


def remote_cell(data: dict[str, Any]) -> Row:
    rt = data["bench"]["results"]["roundtrip"]
    return Row("a `%%remote` cell, timed in the kernel", "bench", ms(rt["%%remote"]["median_ms"]),
               ipyparallel=ms(rt["%%px"]["median_ms"]))


def whole_cell(data: dict[str, Any]) -> Row:
    cells = data["bench"]["results"]["roundtrip_cells"]
    return Row("the same cell, sent from the front end", "bench",
               ms(cells["%%remote"]["median_ms"]), ipyparallel=ms(cells["%%px"]["median_ms"]),
               floor=ms(cells["empty cell"]["median_ms"]) + " (empty cell)")


def _transfer(data: dict[str, Any], mb: int) -> tuple[dict[str, Any], str]:
    xfer = data["bench"]["results"]["transfer"]
    return xfer["sizes"][str(mb)], xfer["shm"]


def tensor_one_way(data: dict[str, Any]) -> Row:
    size, shm = _transfer(data, 100)
    figure, shown = rpcnb_column(size, shm)
    return Row("100 MB CPU tensor, one way", "bench", ms(figure) if figure is not None else shown,
               torch=ms(size["tensorpipe"]["median_ms"]),
               floor=ms(size["memcpy"]["median_ms"]) + " (memcpy)")


def array_one_way(data: dict[str, Any]) -> Row:
    size, _ = _transfer(data, 100)
    sends, n = size.get("shm_sends", {}), size["numpy"]["n"]
    rpcnb = ms(size["numpy"]["median_ms"])
    if sends.get("numpy", n) < n:  # the array path's counters saw fewer sends than calls
        rpcnb += f" ({sends.get('numpy', 0)}/{n} via shm)"
    return Row("100 MB NumPy array, one way", "bench", rpcnb,
               torch=ms(size["numpy pickled"]["median_ms"]) + " (pickled)",
               floor=ms(size["memcpy"]["median_ms"]) + " (memcpy)")


def there_and_back(data: dict[str, Any]) -> Row:
    rows = _overhead(data["bench"]["results"]["overhead"])
    return Row("100 MB there and back (`--push`, `--fetch`)", "bench",
               ms(rows["push+fetch 100 MB"]["rpcnb_ms"]),
               floor=ms(rows["memcpy 100 MB"]["rpcnb_ms"]) + " (memcpy)")


def shared_tensor(data: dict[str, Any]) -> Row:
    entry = data["bench"]["results"]["curves"]["one_way"]["sizes"][str(512 * MB)]
    samples, taken = entry["samples_ms"], entry["taken"]
    rpcnb = ms(median(samples["zero-copy"]))
    if taken.get("zero-copy", 0) < len(samples["zero-copy"]):
        rpcnb += f" ({taken.get('zero-copy', 0)}/{len(samples['zero-copy'])} by handle)"
    return Row("512 MB `share_memory_()` tensor, one way", "bench", rpcnb,
               torch=ms(median(samples["tensorpipe"])),
               floor=ms(median(samples["memcpy"])) + " (memcpy)")


def fan_out(data: dict[str, Any]) -> Row:
    fan = data["bench"]["results"]["fanout"]
    counts = sorted({int(k.split()[-1]) for k in fan})
    if not counts:
        raise KeyError("fanout")
    return Row(f"no-op cell to {' / '.join(map(str, counts))} workers", "bench",
               ms_list([fan[f"magic {n}"]["median_ms"] for n in counts]),
               torch=ms_list([fan[f"raw {n}"]["median_ms"] for n in counts]))


def start_up(data: dict[str, Any]) -> Row:
    samples = data["bench"]["results"]["startup_cold_warm"]["samples"]
    return Row("start-up: a fresh kernel with 2 workers to its first result", "bench",
               seconds(median(samples["rpcnb cold"])), torch=seconds(median(samples["script"])),
               ipyparallel=seconds(median(samples["ipyparallel"])))


def start_up_n(data: dict[str, Any]) -> Row:
    init = data["bench"]["results"]["curves"]["init"]
    counts = sorted(init, key=int)
    if not counts:
        raise KeyError("init")
    totals = [median([r["total_s"] for r in init[n]]) for n in counts]
    return Row(f"start-up of {' / '.join(counts)} workers", "bench",
               " / ".join(f"{t:.2f}" for t in totals) + " s")


def warm_start(data: dict[str, Any]) -> Row:
    samples = data["bench"]["results"]["startup_cold_warm"]["samples"]
    return Row("start-up of 2 workers again, after `%rpc_shutdown`", "bench",
               seconds(median(samples["rpcnb warm"])))


def idle(data: dict[str, Any]) -> Row:
    got = data["bench"]["results"]["idle"]
    return Row(f"idle: {got['workers']} workers and their kernel, CPU over {got['seconds']:g} s",
               "bench", f"{got['pct_of_one_core']:.1f} % of a core")


def cuda_there_and_back(data: dict[str, Any]) -> Row:
    gpu = data["gpu"]
    m = gpu["median_ms"]
    return Row(f"{gpu['size_mb']} MB CUDA tensor there and back", "gpu", ms(m["rpcnb"]),
               torch=f"{ms(m['raw'])} (device map); {ms(m['staged'])} (through the CPU)")


def cupy_push(data: dict[str, Any]) -> Row:
    gpu = data["gpu"]
    m = gpu["median_ms"]
    return Row(f"{gpu['size_mb']} MB CuPy array, `--push`", "gpu",
               f"{ms(m['push cupy'])} (a CUDA tensor: {ms(m['push tensor'])})",
               torch=ms(m["push cupy pickled"]) + " (pickled)")


def _recipe(data: dict[str, Any], mode: str) -> Row:
    m = data["gpu"]["median_ms"]
    return Row(f"the CUDA RPC recipe, {mode.upper()} mode", "gpu",
               f"{ms(m[f'recipe {mode}'])}; {ms(m[f'recipe {mode}, rpcnb shm'])} (`shm,uv`)",
               torch=f"{ms(m[f'recipe {mode}, torch uv'])} (`uv`); "
                     f"{ms(m[f'recipe {mode}, torch'])} (`shm,uv`)")


def recipe_cpu(data: dict[str, Any]) -> Row:
    return _recipe(data, "cpu")


def recipe_cuda(data: dict[str, Any]) -> Row:
    return _recipe(data, "cuda")


ROWS: list[Callable[[dict[str, Any]], Row]] = [
    noop_groups, noop_kernel, remote_cell, whole_cell, tensor_one_way, array_one_way,
    there_and_back, shared_tensor, fan_out, start_up, start_up_n, warm_start, idle,
    cuda_there_and_back, cupy_push, recipe_cpu, recipe_cuda,
]


# -- the table ---------------------------------------------------------------------------


def load(root: Path = ROOT) -> dict[str, Any]:
    """Each source's JSON by key; a missing file is left out."""
    data = {}
    for key, source in SOURCES.items():
        path = root / source.path
        if path.is_file():
            data[key] = json.loads(path.read_text(encoding="utf-8"))
    return data


def table(data: dict[str, Any]) -> Table:
    got = Table()
    for make in ROWS:
        try:
            got.rows.append(make(data))
        except (KeyError, IndexError, TypeError, statistics.StatisticsError) as exc:
            got.left_out.append(f"{make.__name__}: no {exc} in the JSON files")
    return got


def machine(key: str, doc: dict[str, Any]) -> tuple[str, str]:
    """(a short name for the table, the whole line) of the machine a JSON was measured on."""
    m = doc.get("machine")
    if not m:
        return ("not recorded", "not recorded in the JSON")
    if "gpu" in m:  # bench.gpu's
        return (m["gpu"], f"{m['gpus']} x {m['gpu']} (map {m['map']}), torch {m['torch']}, "
                          f"Python {m['python']}")
    load = m.get("loadavg_start"), m.get("loadavg_end")
    line = (f"{m['cpus_usable']} CPUs usable of {m['cpu_count']} ({m['cpu_model']}), "
            f"{m['mem_gib']} GiB, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
            f"ipyparallel {m['ipyparallel']}{', Ray ' + m['ray'] if m.get('ray') else ''}; "
            f"rpcnb at `{m['git_commit']}`"
            f"{' with uncommitted changes' if m.get('rpcnb_tree_dirty') else ''}; "
            f"{m['date'][:10]}")
    if all(load):
        line += f", load {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end"
    return f"{m['cpus_usable']}-CPU {m['cpu_model']}", line


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(data: dict[str, Any]) -> str:
    """What goes between the markers (blank lines around it)."""
    got = table(data)
    names = {key: machine(key, doc) for key, doc in data.items()}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in got.rows:
        number = SOURCES[row.source].number
        cells = [row.what, row.rpcnb, row.torch, row.ray, row.ipyparallel, row.floor,
                 f"({number}) {names[row.source][0]}"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    used = sorted({row.source for row in got.rows}, key=lambda k: SOURCES[k].number)
    lines.append("")
    for key in used:
        source = SOURCES[key]
        lines.append(f"({source.number}) `{source.command}`, `{source.path}`: "
                     f"{names[key][1]}.")
        lines.append("")
    return "\n" + "\n".join(lines) + "\n"


def render(text: str, data: dict[str, Any] | None = None) -> str:
    """``text`` with its table block rewritten from ``data`` (the JSON files by default);
    KeyError when it has no block."""
    data = load() if data is None else data
    if not BLOCK.search(text):
        raise KeyError("no <!-- bench:table --> ... <!-- /bench:table --> block")
    return BLOCK.sub(lambda m: m.group(1) + markdown(data) + m.group(3), text, count=1)


def write(path: Path = PAGE) -> bool:
    """Rewrite the block of ``path``; whether anything changed."""
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def stale(path: Path = PAGE) -> bool:
    text = path.read_text(encoding="utf-8")
    return render(text) != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when the table differs from the JSON files")
    parser.add_argument("path", nargs="?", type=Path, default=PAGE,
                        help="the page to rewrite (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    for why in table(load()).left_out:
        print(f"left out: {why}", file=sys.stderr)
    if args.check:
        if stale(args.path):
            print(STALE.format(path=args.path), file=sys.stderr)
            return 1
        return 0
    if write(args.path):
        print(f"{args.path}: benchmark table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
