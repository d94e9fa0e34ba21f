"""docs/architecture.md says what the code does, where a test can tell: the requests it
lists are the handler table's, every interval it states about a named constant is that
constant, and every module it names exists. Nothing here starts a process: the code is
imported, or read."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rpcnb"
PAGE = ROOT / "docs" / "architecture.md"
TEXT = PAGE.read_text(encoding="utf-8")
MB = 1 << 20


def _handlers_on_the_page() -> list[str]:
    """The request names of the ``handlers`` paragraph, in the order written."""
    start = TEXT.index("**`handlers`.** Everything another member can ask of this one")
    end = TEXT.index("`tests/kernel/test_security.py`", start)
    return [n for n in re.findall(r"`([a-z_]+)`", TEXT[start:end]) if n != "handlers"]


def test_the_page_lists_every_request_of_the_handler_table_and_no_other():
    from rpcnb.membership.handlers import OPERATIONS

    listed = _handlers_on_the_page()
    twice = sorted({n for n in listed if listed.count(n) > 1})
    assert not twice, f"docs/architecture.md lists these requests twice: {twice}"
    missing = sorted(set(OPERATIONS) - set(listed))
    unknown = sorted(set(listed) - set(OPERATIONS))
    assert not missing and not unknown, (
        "docs/architecture.md's `handlers` paragraph differs from "
        f"rpcnb.membership.handlers.OPERATIONS: missing {missing}, not in the table {unknown}")


def _constant(module: str, name: str) -> Callable[[], float]:
    return lambda: float(getattr(importlib.import_module(module), name))


def _default(module: str, function: str, parameter: str) -> Callable[[], float]:
    def read() -> float:
        target = importlib.import_module(module)
        for part in function.split("."):
            target = getattr(target, part)
        return float(inspect.signature(target).parameters[parameter].default)
    return read


# (the statement, with the number as its group; the code's value; the unit the page uses)
SECONDS, MS, MINUTES, ONE, MEGABYTES = 1.0, 1e-3, 60.0, 1.0, float(MB)
STATEMENTS: list[tuple[str, Callable[[], float], float]] = [
    (r"every (\d+) ms a batch", _constant("rpcnb.cells.output", "FLUSH_INTERVAL"), MS),
    (r"coalesced and sent every (\d+) ms", _constant("rpcnb.cells.output", "FLUSH_INTERVAL"), MS),
    (r"`failures\.watch` looks every ([\d.]+) s", _constant("rpcnb.membership.failures", "POLL"),
     SECONDS),
    (r"is pinged every (second) \(`failures\.Reach`\)",
     _constant("rpcnb.membership.failures", "PING_EVERY"), SECONDS),
    (r"Pings unanswered for\s+([\d.]+) s", _constant("rpcnb.membership.failures", "UNREACHABLE_S"),
     SECONDS),
    (r"gone after ([\d.]+) s when that host answers", _constant("rpcnb.worker", "LEADER_SILENT_S"),
     SECONDS),
    (r"after ([\d.]+) minutes when it does not",
     _constant("rpcnb.worker", "LEADER_UNREACHABLE_S"), MINUTES),
    (r"does not answer\s+`%rpc_workers` in ([\d.]+) s", _constant("rpcnb.membership.view", "ASK_S"),
     SECONDS),
    (r"The caller waits up to ([\d.]+) s for\s+the cell to stop",
     _constant("rpcnb.cells.waiter", "INTERRUPT_GRACE"), SECONDS),
    (r"waits ([\d.]+) s for the stacks", _constant("rpcnb.observe.stacks", "ASK_S"), SECONDS),
    (r"([\d.]+) s for a completion", _constant("rpcnb.observe.names", "ASK_S"), SECONDS),
    (r"and ([\d.]+) s for\s+`%rpc_who`", _constant("rpcnb.observe.names", "WHO_S"), SECONDS),
    (r"printed nothing for ([\d.]+) s", _constant("rpcnb.cells.console", "QUEUE_CHECK"), SECONDS),
    (r"at most (once) a second", _constant("rpcnb.frontend.panel", "PERIOD"), SECONDS),
    (r"been empty for ([\d.]+) s", _constant("rpcnb.sandbox.netns", "LINGER_S"), SECONDS),
    (r"Every (second) it writes its record", _constant("rpcnb.keeper", "POLL_S"), SECONDS),
    (r"every ([\d.]+) s what the workers answer", _constant("rpcnb.keeper", "MEMORY_EVERY"), SECONDS),
    (r"up to (\d+) sources", _constant("rpcnb.cells.runner", "_CODE_KEPT"), ONE),
    (r"`RPCNB_UCX_TCP_THRESHOLD` \((\d+) MB\)", _constant("rpcnb.paths.ucx", "DEFAULT_TCP_THRESHOLD"),
     MEGABYTES),
    (r"floor rate \((\d+) MB/s", _constant("rpcnb.wire.limits", "DEFAULT_MIN_RATE"), MEGABYTES),
    (r"arguments hold (\d+) MB or more", _constant("rpcnb.wire.limits", "GROW_FROM"), MEGABYTES),
    (r"the last `HELD_CHARS`, (\d+) MB", _constant("rpcnb.cells.output", "HELD_CHARS"), MEGABYTES),
    (r"the last\s+`KEEP_ENDED`, (\d+), ended", _constant("rpcnb.cells.orphans", "KEEP_ENDED"), ONE),
    (r"`Capture\.close\(\)` waits (\d+) s",
     _default("rpcnb.cells.output", "Capture.close", "timeout"), SECONDS),
    (r"`leave\.shutdown_group`, (\d+) s by default",
     _default("rpcnb.membership.leave", "shutdown_group", "timeout"), SECONDS),
]
WORDS = {"second": 1.0, "once": 1.0}
# "every 50 ms", "every 0.2 s", "every second": each such statement is one of STATEMENTS
EVERY = re.compile(r"every (?:[\d.]+ (?:ms|s|minutes?)|second|minute)\b", re.I)


@pytest.mark.parametrize(("statement", "value", "unit"), STATEMENTS,
                         ids=[s[0][:40] for s in STATEMENTS])
def test_an_interval_on_the_page_is_the_codes(statement, value, unit):
    found = list(re.finditer(statement, TEXT))
    assert found, (f"docs/architecture.md no longer says /{statement}/: say it again, or change "
                   "this test's STATEMENTS to what the page says now")
    code = value()
    for m in found:
        said = WORDS.get(m.group(1).lower()) or float(m.group(1))
        assert said * unit == pytest.approx(code), (
            f"docs/architecture.md says {m.group(0)!r}; the code has {code / unit:g}")


def test_every_interval_the_page_states_is_checked():
    checked = [m.span() for s, _, _ in STATEMENTS for m in re.finditer(s, TEXT)]
    loose = [m.group(0) for m in EVERY.finditer(TEXT)
             if not any(a <= m.start() < b for a, b in checked)]
    assert not loose, (
        f"docs/architecture.md states {loose}: tie each to its constant in this test's "
        "STATEMENTS (or say it without a figure)")


def _module_file(path: str) -> bool:
    """``membership/failures.py``, ``rpcnb/wire/_torch.py``, ``bench/run.py``,
    ``widgets/dom.py``: under the repository, rpcnb/ or a folder of rpcnb/."""
    return any(p.is_file() for p in [ROOT / path, PACKAGE / path,
                                     *(d / path for d in PACKAGE.iterdir() if d.is_dir())])


def _defines(module_file: Path, name: str) -> bool:
    """Whether a module's source defines ``name`` at its top level (read, not imported)."""
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name).split(".")[0] == name for a in node.names):
            return True
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and isinstance(
                node.value, (ast.List, ast.Tuple)):  # a lazily loaded public name (rpcnb.init)
            if name in [e.value for e in node.value.elts if isinstance(e, ast.Constant)]:
                return True
    return False


def _a_name_the_code_gives(text: str) -> bool:
    """A dotted name that is no module but a string the code uses (a comm target)."""
    quoted = (f'"{text}"', f"'{text}'")
    return any(q in path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")
               for q in quoted)


def _dotted(name: str) -> bool:
    """``rpcnb.keeper``, ``rpcnb.api.attach``, ``rpcnb.procs.forkserver``: a module, or a
    name a module defines."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a name inside a module, not a submodule
            continue
        if spec is None or spec.origin is None:
            continue
        rest = parts[cut:]
        return not rest or _defines(Path(spec.origin), rest[0])
    return False


def test_every_module_path_the_page_names_exists():
    code_spans = re.findall(r"`([^`\n]+)`", TEXT)
    paths = {p for span in code_spans for p in re.findall(r"(?<![\w.])((?:[\w]+/)*\w+\.py)\b", span)}
    dotted = {d for span in code_spans for d in re.findall(r"\brpcnb(?:\.\w+)+", span)}
    assert "membership/failures.py" in paths and "rpcnb.keeper" in dotted  # the reader works
    missing = sorted(p for p in paths if not _module_file(p))
    missing += sorted(d for d in dotted if not _dotted(d) and not _a_name_the_code_gives(d))
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


def test_the_layer_picture_names_existing_modules_and_folders():
    picture = TEXT[TEXT.index("## Layers"):]
    picture = picture[picture.index("```\n") + 4:]
    picture = picture[:picture.index("```")]
    files = set(re.findall(r"(?<![\w.])(\w+\.py)\b", picture))
    folders = set(re.findall(r"(?m)(?:^|\| )(\w+)/", picture))
    assert {"api.py", "settings.py"} <= files and {"membership", "paths"} <= folders
    missing = sorted(f for f in files if not _module_file(f))
    missing += sorted(f"{d}/" for d in folders
                      if not any((base / d / "__init__.py").is_file()
                                 for base in [PACKAGE, *(p for p in PACKAGE.iterdir() if p.is_dir())]))
    assert not missing, f"docs/architecture.md's layer picture names what rpcnb lacks: {missing}"
