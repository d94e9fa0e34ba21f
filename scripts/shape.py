"""How the inside of rpcnb's rooms reads, measured with ``ast``: the state modules keep,
the length of functions, the hand-written polling loops, the environment read outside
``rpcnb/settings.py`` and the session's lock taken outside ``rpcnb/session/``.

    python scripts/shape.py            # a table, and each finding with its place
    python scripts/shape.py --json     # the counts only

``tests/unit/test_shape.py`` holds the package to its limits (docs/architecture.md,
"State and messages").
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rpcnb"

# what a module-level name is made with when it holds state that changes in place
MUTABLE_MAKERS = {
    "dict", "list", "set", "deque", "defaultdict", "OrderedDict", "Counter", "WeakSet",
    "WeakValueDictionary", "WeakKeyDictionary", "Lock", "RLock", "Event", "Condition",
    "Semaphore", "BoundedSemaphore", "count", "Queue", "SimpleQueue", "local",
}
# methods that change a container, a lock or a counter in place
MUTATORS = {
    "append", "appendleft", "extend", "add", "update", "pop", "popleft", "popitem", "clear",
    "remove", "discard", "setdefault", "insert", "acquire", "release", "set", "put",
    "put_nowait", "get", "get_nowait", "wait", "notify", "notify_all", "move_to_end",
}


@dataclass
class Finding:
    where: str  # path:line
    what: str


@dataclass
class Shape:
    globals: list[Finding] = field(default_factory=list)
    # module-level containers, locks and counters that functions change, and names that
    # functions rebind (``global``)
    module_state: list[Finding] = field(default_factory=list)
    # objects of rpcnb's own classes a module makes at import: the process's named state
    process_objects: list[Finding] = field(default_factory=list)
    long_functions: list[Finding] = field(default_factory=list)  # over LIMIT code lines
    polling_loops: list[Finding] = field(default_factory=list)
    environment: list[Finding] = field(default_factory=list)  # read outside settings.py
    session_lock: list[Finding] = field(default_factory=list)  # outside rpcnb/session/

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in self.__dataclass_fields__}


LIMIT = 60  # code lines a function may have


def code_lines(node: ast.AST, source_lines: list[str]) -> int:
    """Lines of ``node`` that hold code: not blank, not only a comment, not its docstring."""
    body = getattr(node, "body", [])
    skip: set[int] = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip = set(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    count = 0
    for n in range(node.lineno, (node.end_lineno or node.lineno) + 1):  # type: ignore[attr-defined]
        line = source_lines[n - 1].strip()
        if n in skip or not line or line.startswith("#"):
            continue
        count += 1
    return count


def _name_of(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _walk_own(node: ast.AST):
    """The nodes of a function or loop, nested functions and classes left out."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))


def _is_time_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _name_of(node.func) in ("monotonic", "time", "perf_counter") \
        and (not isinstance(node.func, ast.Attribute) or _name_of(node.func.value) == "time")


def _is_sleep(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _name_of(node.func) == "sleep"


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        env = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in ("get", "setdefault") and _is_environ(f.value):
                env = node.args[0] if node.args else None
            elif f.attr == "getenv" and _name_of(f.value) == "os":
                env = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_environ(node.value):
            env = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            env = node.left
        if env is not None or (isinstance(node, ast.Call) and _name_of(node.func) == "getenv"):
            name = env.value if isinstance(env, ast.Constant) else "?"
            found.append((node.lineno, str(name)))
    return found


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and _name_of(node.value) == "os"


def measure_file(path: Path, shape: Shape) -> None:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    rel = path.relative_to(ROOT)

    # global statements, and the names they rebind
    rebound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            shape.globals.append(Finding(f"{rel}:{node.lineno}", ", ".join(node.names)))
            rebound.update(node.names)

    # module-level names holding state that functions change
    made_mutable: dict[str, int] = {}
    for node in tree.body:
        targets: list[ast.AST] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) \
                    or (isinstance(value, ast.Call) and _name_of(value.func) in MUTABLE_MAKERS):
                made_mutable[t.id] = node.lineno
    changed: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in _walk_own(fn):
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]):
                    if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                        changed.add(t.value.id)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in MUTATORS and isinstance(n.func.value, ast.Name):
                changed.add(n.func.value.id)
            elif isinstance(n, ast.With):
                for item in n.items:
                    if isinstance(item.context_expr, ast.Name):
                        changed.add(item.context_expr.id)
            elif isinstance(n, ast.Call) and _name_of(n.func) == "next" and n.args \
                    and isinstance(n.args[0], ast.Name):
                changed.add(n.args[0].id)
    module_names = {t.id for node in tree.body
                    for t in (node.targets if isinstance(node, ast.Assign) else
                              [node.target] if isinstance(node, ast.AnnAssign) else [])
                    if isinstance(t, ast.Name)}
    for name in sorted((set(made_mutable) & changed) | (rebound & module_names)):
        line = made_mutable.get(name) or next(
            (node.lineno for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             and any(isinstance(t, ast.Name) and t.id == name
                     for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))), 0)
        shape.module_state.append(Finding(f"{rel}:{line}", name))

    # long functions
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = code_lines(node, lines)
            if n > LIMIT:
                shape.long_functions.append(Finding(f"{rel}:{node.lineno}", f"{node.name} ({n} lines)"))

    # a loop that sleeps and looks at the clock or a deadline: a deadline loop written by
    # hand (rpcnb.waiting.until and Deadline are the one way)
    for node in ast.walk(tree):
        if isinstance(node, (ast.While, ast.For)):
            own = list(_walk_own(node))
            if isinstance(node, ast.While):
                own += list(ast.walk(node.test))
            # a wait on an Event, a queue or a thread is woken by what it waits for: only
            # sleeping between looks is polling
            naps = [n for n in own if _is_sleep(n)]
            clock = any(_is_time_call(n) for n in own) or any(
                isinstance(n, ast.Name) and ("deadline" in n.id or n.id in ("until", "late"))
                for n in own)
            if naps and clock:
                kind = "while" if isinstance(node, ast.While) else "for"
                shape.polling_loops.append(Finding(f"{rel}:{node.lineno}",
                                                   f"{kind} ... {_name_of(naps[0].func)}"))

    # environment variables read anywhere but rpcnb/settings.py
    if rel.as_posix() != "rpcnb/settings.py":
        for line, name in _environment_reads(tree):
            shape.environment.append(Finding(f"{rel}:{line}", name))

    # the session's lock, outside rpcnb/session/
    if rel.parts[1] != "session":
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "lock" \
                    and _name_of(node.value) in ("s", "session", "sess", "_session", "me"):
                shape.session_lock.append(Finding(f"{rel}:{node.lineno}", ast.unparse(node)))


def _classes(root: Path) -> set[str]:
    """The classes rpcnb defines whose objects can change (not frozen dataclasses, enums,
    exceptions or named tuples)."""
    found: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            frozen = any(isinstance(d, ast.Call) and any(
                k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value
                for k in d.keywords) for d in node.decorator_list)
            bases = {_name_of(b) for b in node.bases}
            if not frozen and not bases & {"Enum", "IntEnum", "StrEnum", "NamedTuple", "Exception"} \
                    and not any(b.endswith(("Error", "Exception")) for b in bases):
                found.add(node.name)
    return found


def measure(root: Path = PACKAGE) -> Shape:
    shape = Shape()
    classes = _classes(root)
    for path in sorted(root.rglob("*.py")):
        measure_file(path, shape)
        # an object of rpcnb's own made at import and kept by the module: the process's
        # state with a name and typed fields (what loose module state becomes), listed
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) \
                    and _name_of(node.value.func) in classes:
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                made = f"{ast.unparse(target)} = {_name_of(node.value.func)}(...)"
                shape.process_objects.append(Finding(f"{path.relative_to(ROOT)}:{node.lineno}",
                                                     made))
    return shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = measure()
    if args.json:
        print(json.dumps(shape.counts()))
        return 0
    for name, found in vars(shape).items():
        modules = len({f.where.split(":")[0] for f in found})
        print(f"{name}: {len(found)} in {modules} modules")
        for f in found:
            print(f"  {f.where}  {f.what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
