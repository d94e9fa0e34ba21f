"""The package's shape stays as docs/architecture.md draws it: one-way layers (checked by
import-linter's contracts in pyproject.toml, imports inside functions included: that check
runs lint-imports, a process, in tests/build/test_import_contract.py), no import cycle, no
module over ~600 lines, and torch's private names in rpcnb/wire/_torch.py,
rpcnb/wire/_gather.py (torch's all-gather) and rpcnb/wire/_rref_context.py (torch's RRef
context) only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rpcnb"
MAX_LINES = 600


def cycles(package: str) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in edges.get(m, []):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle():
    assert cycles("rpcnb") == []


def test_the_cycle_check_catches_an_upward_import_inside_a_function(tangled: Path,
                                                                    monkeypatch):
    # lint-imports' contract catches it too: tests/build/test_import_contract.py
    monkeypatch.syspath_prepend(str(tangled))
    for name in [m for m in sys.modules if m == "rpcnb" or m.startswith("rpcnb.")]:
        monkeypatch.delitem(sys.modules, name)
    found = cycles("rpcnb")
    assert any("rpcnb.session.state" in group and "rpcnb.api" in group for group in found)


MAX_TOP_MODULES = 12
FOLDERS = ["cells", "docs", "frontend", "integrations", "membership", "observe", "paths", "procs",
           "sandbox", "session", "wire"]


def test_the_folders_are_the_layers():
    """Every folder of rpcnb/ is a row of the layers contract, and at most 12 modules are
    left at the top, so the folder list reads as the architecture."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == FOLDERS
    text = (ROOT / "pyproject.toml").read_text()
    layers = text.split('containers = ["rpcnb"]', 1)[1].split("]", 1)[0]
    rows = {name.strip() for row in layers.split('"')[1::2] for name in row.split("|")}
    assert set(FOLDERS) <= rows
    assert {p.removesuffix(".py") for p in top} - {"__init__"} <= rows


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_too_long(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines: split it by job"


# Private torch names rpcnb uses; they belong in rpcnb/wire/_torch.py, with the versions checked
# (and rpcnb/wire/_gather.py: torch's all-gather and barriers, rebuilt for a changing group;
# rpcnb/wire/_rref_context.py: torch's RRef context in a process's later groups).
TORCH_PRIVATE = ("_torch.py", "_gather.py", "_rref_context.py")
PRIVATE = {
    "_get_current_rpc_agent", "_internal_rpc_pickler", "_thread_local_tensor_tables",
    "_init_counter", "_init_rpc_backend", "_set_profiler_node_id", "_update_group_membership",
    "_jit_internal", "_TensorExtractor", "_extract_tensors", "_invoke_rpc", "_get_future",
    "_tensor_str", "_get_backend_options", "_dispatch_table", "_tensor_reducer", "_tensor_receiver",
    "_class_reducer_dict", "_py_rref_reducer", "_rref_reducer", "_script_module_reducer",
    "_init", "_C", "_utils",
}


def private_torch_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    torch_names: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add((alias.asname or alias.name).split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(p.startswith("_") for p in node.module.split(".")):  # type: ignore[union-attr]
                found.append(f"from {node.module} import ...")
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append(f"from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if (isinstance(base, ast.Name) and base.id in torch_names) or node.attr in PRIVATE:
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py")
                                         if not (p.parent.name == "wire" and p.name in TORCH_PRIVATE)),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_private_torch_names_stay_in_one_module(path: Path):
    assert private_torch_uses(path) == [], f"move these into rpcnb/wire/_torch.py: {path.name}"


@pytest.mark.parametrize("name", TORCH_PRIVATE)
def test_the_private_name_check_finds_them(name: str):
    assert private_torch_uses(PACKAGE / "wire" / name), "the check would never fail"


def rpc_sends(path: Path) -> list[str]:
    """Where ``path`` makes a torch RPC itself (rpc_sync, rpc_async, remote, or
    ``_torch.send_python_call``, which sends any function as rpc_async does)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) \
                and ((node.func.attr in ("rpc_sync", "rpc_async", "remote")
                      and node.func.value.id == "rpc")
                     or (node.func.attr == "send_python_call" and node.func.value.id == "_torch")):
            found.append(f"line {node.lineno}: {node.func.value.id}.{node.func.attr}")
    return found


def test_rpcnb_sends_its_requests_through_protocol_only():
    # one RPC target (protocol.entry, token-checked) means no other rpcnb function can be
    # called by another member, with or without the token
    elsewhere = {str(p.relative_to(ROOT)): rpc_sends(p) for p in PACKAGE.rglob("*.py")
                 if p.name != "protocol.py" and rpc_sends(p)}
    assert elsewhere == {}
    in_protocol = rpc_sends(PACKAGE / "session" / "protocol.py")
    assert in_protocol, "the check would never fail"
    assert any("send_python_call" in s for s in in_protocol), "nor see the direct send"
