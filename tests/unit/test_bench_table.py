"""docs/benchmarks.md opens with the table ``scripts/bench_table.py`` writes from the bench
JSON files: the committed table is what the JSON files give (a figure rerun, or edited by
hand, without running the script fails here), every row names its run and machine, and a
row whose figures no JSON holds is left out rather than filled in."""

from __future__ import annotations

import copy
import difflib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "scripts" / "bench_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench_table = _load_script()
DATA = bench_table.load()


def _rows(markdown: str) -> dict[str, list[str]]:
    """The table's rows by their first cell."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith(("|  | rpcnb", "| ---")):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_the_committed_table_is_the_json_files():
    text = PAGE.read_text(encoding="utf-8")
    generated = bench_table.render(text, DATA)
    diff = "".join(difflib.unified_diff(text.splitlines(True), generated.splitlines(True),
                                        "docs/benchmarks.md", "from the bench JSON files"))
    assert generated == text, (
        "docs/benchmarks.md's table differs from the bench JSON files: run "
        f"`python scripts/bench_table.py` and commit docs/benchmarks.md\n{diff}")


def test_the_page_opens_with_the_table():
    text = PAGE.read_text(encoding="utf-8")
    first_section = text.split("\n## ", 2)[1]
    assert first_section.startswith("At a glance") and "<!-- bench:table -->" in first_section


def test_every_json_the_table_reads_is_committed():
    for key, source in bench_table.SOURCES.items():
        assert (ROOT / source.path).is_file(), f"{source.path} ({source.command}) is missing"
        assert key in DATA


def test_every_row_names_its_run_and_machine():
    block = bench_table.markdown(DATA)
    rows = _rows(block)
    assert len(rows) == len(bench_table.ROWS) - len(bench_table.table(DATA).left_out)
    for cells in rows.values():
        run = cells[-1]
        number = int(run[1:run.index(")")])
        source = next(s for s in bench_table.SOURCES.values() if s.number == number)
        assert run[run.index(")") + 1:].strip(), f"{cells[0]}: no machine"
        assert f"({number}) `{source.command}`, `{source.path}`: " in block


def test_a_figure_that_changes_in_a_json_changes_the_table():
    data = copy.deepcopy(DATA)
    rows = {r["call"]: r for r in data["ray"]["rows"]}
    rows["rpcnb.run no-op"]["rpcnb_ms"] = 0.123456
    data["gpu"]["median_ms"]["recipe cuda"] = 77.7
    text = PAGE.read_text(encoding="utf-8")
    changed = bench_table.render(text, data)
    assert changed != text
    got = _rows(changed)
    assert got["no-op call, `rpcnb.run` (groups of two)"][1] == "0.123 ms"
    assert got["the CUDA RPC recipe, CUDA mode"][1].startswith("77.7 ms;")


def test_a_json_missing_leaves_its_rows_and_machine_out():
    data = {k: v for k, v in DATA.items() if k != "gpu"}
    block = bench_table.markdown(data)
    assert "H200" not in block and "(3)" not in block and "CUDA" not in block
    assert bench_table.table(data).left_out  # each of its rows, with why


def test_a_figure_no_json_holds_is_left_out_not_filled_in():
    data = copy.deepcopy(DATA)
    del data["bench"]["results"]["idle"]
    got = bench_table.table(data)
    assert not any(row.what.startswith("idle") for row in got.rows)
    assert any(why.startswith("idle:") for why in got.left_out)
    # Ray not measured in that run: the cell is empty, the row stays
    data["ray"]["rows"] = [r for r in data["ray"]["rows"] if r["call"] != "ray actor call"]
    row = bench_table.noop_groups(data)
    assert row.ray == "" and row.rpcnb and row.torch


def test_an_rpcnb_figure_needs_its_path_to_have_carried_the_sends():
    data = copy.deepcopy(DATA)
    size = data["bench"]["results"]["transfer"]["sizes"]["100"]
    size["shm_sends"]["rpcnb"] = 0
    assert bench_table.tensor_one_way(data).rpcnb == "n/a (shm path not taken)"
    entry = data["bench"]["results"]["curves"]["one_way"]["sizes"][str(512 << 20)]
    entry["taken"]["zero-copy"] = 1
    assert "(1/" in bench_table.shared_tensor(data).rpcnb


def test_a_json_without_its_machine_says_so():
    name, line = bench_table.machine("bench", {})
    assert name == "not recorded" and "not recorded" in line
    name, line = bench_table.machine("bench", DATA["bench"])
    assert DATA["bench"]["machine"]["cpu_model"] in name
    assert DATA["bench"]["machine"]["torch"] in line


def test_a_page_without_the_block_is_refused():
    with pytest.raises(KeyError, match="bench:table"):
        bench_table.render("# Performance\n\nno table\n", DATA)


@pytest.mark.parametrize(("value", "shown"), [(0.5904, "0.590 ms"), (5.907, "5.91 ms"),
                                              (64.19, "64.2 ms"), (733.1, "733 ms")])
def test_milliseconds_keep_the_digits_that_mean_something(value, shown):
    assert bench_table.ms(value) == shown
