"""torch's own RPC tests in an rpcnb group, against the same tests run torch's way.

PyTorch ships the bodies of its RPC tests in the wheel: ``RpcTest``
(torch/testing/_internal/distributed/rpc/rpc_test.py) and ``DistAutogradTest``
(dist_autograd_test.py), written for four ranks named worker0..worker3. Two ways run them:

- **rpcnb**: a process is worker0 of an rpcnb group with three workers (``rpcnb.init(3)``),
  and each test's body runs on the four ranks at once: on the workers as a cell
  (``rpcnb.run``), in worker0 on a thread. Its ``@dist_init`` does not start or end RPC:
  the group is already running, and the next test runs in it too. A test that uses
  ``torch.distributed``'s process group (``initialize_pg``, ``dist.barrier``) finds one
  over the four ranks (gloo). A test that needs torch's state as a fresh process has it
  (it uses torch's profiler, whose state stays behind; counts RRef ids from 0; reads
  torch's debug counters) runs in a group of its own, and so does the rest after a test
  that did not pass. Each group is led by a fresh interpreter: RRefs passed through
  worker0 work in a process's first group only (docs/existing-code.md).
- **torch**: torch's own harness (``MultiProcessTestCase`` with the TensorPipe fixture, as
  torch's ``test/distributed/rpc/test_tensorpipe_agent.py`` generates it): four fresh
  processes per test, each starting a static TensorPipe group of its own in ``init_rpc``
  and ending it after the test. The processes are forked from a process that imported
  torch and nothing else (torch spawns them: the same fresh processes, a few seconds
  sooner each).

Which tests can run inside a running group is read from their source (the test, and the
methods and module functions it calls): not those that start or end RPC themselves, end
members on purpose, need CUDA or the faulty agent, or need no RPC at all; each is listed
with its reason. ``SAMPLE_RULE`` picks the sample that ``make test`` runs
(tests/kernel/test_torch_conformance.py).

    python scripts/conformance.py                  # make conformance: both ways, compared
    python scripts/conformance.py --only rpcnb     # one way
    python scripts/conformance.py -k barrier       # the tests whose names contain it
    python scripts/conformance.py --list           # which tests apply, and why not

It prints the tests whose outcome differs between the two ways, then the counts, and
writes everything to test-results/conformance.json.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import functools
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import types
import unittest
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
OUT = ROOT / "test-results" / "conformance.json"
WORLD = 4  # torch's RPC tests are written for four ranks (RpcAgentTestFixture.world_size)
TEST_TIMEOUT = 120.0  # seconds one test may take, either way

SUITES = {
    "RpcTest": "torch.testing._internal.distributed.rpc.rpc_test",
    "DistAutogradTest": "torch.testing._internal.distributed.rpc.dist_autograd_test",
}


def suite_class(suite: str) -> type:
    import importlib

    return getattr(importlib.import_module(SUITES[suite]), suite)  # type: ignore[no-any-return]


# -- which tests apply, read from their source ------------------------------------------


@dataclass
class Case:
    """One test: ``suite.name``; ``why_not`` says why it cannot run in a running group
    ("" when it can); ``pg``: it uses a torch.distributed process group; ``fresh``: it
    runs in a group of its own (``fresh_why``: torch's profiler, RRef ids, debug info)."""

    suite: str
    name: str
    why_not: str = ""
    pg: bool = False
    fresh: bool = False
    fresh_why: str = ""
    topic: str = ""

    @property
    def id(self) -> str:
        return f"{self.suite}.{self.name}"


def _dist_init_args(fn: Any) -> dict[str, Any] | None:
    """The arguments of the ``@dist_init`` that made ``fn`` (None: it is not one)."""
    from torch.testing._internal import dist_utils

    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename != dist_utils.__file__ or code.co_name != "new_test_method":
        return None
    return dict(inspect.getclosurevars(fn).nonlocals)


def _plain(fn: Any) -> Any:
    """``fn`` without its ``@dist_init`` (and the decorators above it)."""
    while True:
        args = _dist_init_args(fn)
        if args is not None:
            fn = args["old_test_method"]
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            return fn


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


@dataclass
class Reading:
    """What a test and everything it calls in its module do."""

    calls: set[str] = field(default_factory=set)  # dotted names called
    strings: set[str] = field(default_factory=set)  # string constants (f-strings' parts)
    self_attrs: set[str] = field(default_factory=set)  # self.X read
    decorators: list[str] = field(default_factory=list)
    dist_init: list[dict[str, Any]] = field(default_factory=list)
    skipped: str = ""


def read(cls: type, name: str) -> Reading:
    """Read test ``name`` of ``cls``: its source, and that of the methods (``self.X``) and
    module functions it calls, transitively."""
    module = sys.modules[cls.__module__]
    found = Reading()
    top = getattr(cls, name)
    if getattr(top, "__unittest_skip__", False):
        found.skipped = str(getattr(top, "__unittest_skip_why__", ""))
    todo, seen = [top], set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        layer = fn  # each decorator's layer: @dist_init may sit under others (mock.patch)
        while layer is not None:
            args = _dist_init_args(layer)
            if args is not None:
                found.dist_init.append({k: v for k, v in args.items() if k != "old_test_method"})
                layer = args["old_test_method"]
            else:
                layer = getattr(layer, "__wrapped__", None)
        plain = _plain(fn)
        try:
            source = textwrap.dedent(inspect.getsource(plain))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.decorators += [_dotted(d.func if isinstance(d, ast.Call) else d)
                                     for d in node.decorator_list]
            elif isinstance(node, ast.Call):
                found.calls.add(_dotted(node.func))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.strings.add(node.value)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                found.self_attrs.add(node.attr)
                member = inspect.getattr_static(cls, node.attr, None)
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member):
                    todo.append(getattr(cls, node.attr))
            elif isinstance(node, ast.Name):
                other = module.__dict__.get(node.id)
                if inspect.isfunction(other) and other.__module__ == module.__name__:
                    todo.append(other)
    return found


def _called(reading: Reading, *names: str) -> list[str]:
    return sorted(c for c in reading.calls if c.rsplit(".", 1)[-1] in names or c in names)


def classify(suite: str, name: str) -> Case:
    """Whether ``suite.name`` can run inside a running group, from its source."""
    r = read(suite_class(suite), name)
    case = Case(suite, name, topic=topic_of(suite, name))
    why = ""
    if r.skipped:
        why = f"torch skips it here: {r.skipped}"
    elif any(not a.get("setup_rpc", True) for a in r.dist_init):
        why = "starts and ends RPC itself (@dist_init(setup_rpc=False))"
    elif _called(r, "init_rpc"):
        why = f"starts RPC itself ({', '.join(_called(r, 'init_rpc'))})"
    elif _called(r, "rpc.shutdown", "shutdown"):
        why = f"ends RPC itself ({', '.join(_called(r, 'rpc.shutdown', 'shutdown'))})"
    elif _called(r, "wait_until_node_failure", "exit", "_exit", "kill"):
        why = ("ends members on purpose (" + ", ".join(
            _called(r, "wait_until_node_failure", "exit", "_exit", "kill")) + ")")
    elif any("gpu" in d.lower() or "cuda" in d.lower() for d in r.decorators):
        why = "needs CUDA (" + ", ".join(d for d in r.decorators
                                        if "gpu" in d.lower() or "cuda" in d.lower()) + ")"
    elif any(a.get("faulty_messages") or a.get("messages_to_delay") for a in r.dist_init) \
            or any("faulty" in c.lower() for c in r.calls):
        why = "needs the faulty agent (fault injection)"
    elif {"rpc_backend_options", "init_method", "rpc_backend"} & r.self_attrs:
        why = "builds RPC options or an agent of its own (self." + ", self.".join(sorted(
            {"rpc_backend_options", "init_method", "rpc_backend"} & r.self_attrs)) + ")"
    elif not r.dist_init:
        why = "uses no RPC group (no @dist_init): nothing for a group to change"
    case.why_not = why
    case.pg = bool(_called(r, "initialize_pg") or any(c.startswith("dist.") for c in r.calls))
    case.fresh_why = fresh_state(r)
    case.fresh = bool(case.fresh_why)
    return case


def fresh_state(r: Reading) -> str:
    """Why a test needs torch's state as a fresh process has it ("": it does not): torch's
    way gives every test four new processes, a group runs the next test in the same ones."""
    if any("profil" in c.lower() or "record_function" in c for c in r.calls):
        return "torch's profiler: its state stays behind"
    if any("local_id=" in text for text in r.strings):
        return "expects RRef ids counted from a fresh process's 0"
    if _called(r, "_get_debug_info", "_rref_context_get_debug_info"):
        return "counts a process's RRefs or autograd contexts (debug info)"
    return ""


def cases(pattern: str = "") -> list[Case]:
    """Every test of the suites (whose id contains ``pattern``), classified."""
    out = []
    for suite in SUITES:
        cls = suite_class(suite)
        for name in sorted(n for n in dir(cls) if n.startswith("test")):
            if pattern in f"{suite}.{name}":
                out.append(classify(suite, name))
    return out


# -- the sample make test runs ----------------------------------------------------------

# (topic, words of the test's name); a test's topic is the first that matches; the
# DistAutogradTest suite is one topic
TOPICS = [
    ("all-gather and barriers", ("all_gather", "barrier")),
    ("profiler", ("profil", "record_function")),
    ("timeouts", ("timeout",)),
    ("async execution", ("async",)),
    ("exceptions", ("raise", "exception", "error", "throw")),
    ("futures", ("future", "callback", "wait_all")),
    ("RRefs", ("rref",)),
]
SAMPLE_RULE = (
    "Every applicable test of the all-gather and barriers topic; from each other topic "
    "(profiler, timeouts, async execution, exceptions, futures, RRefs, distributed "
    "autograd, other calls) tests evenly spaced in name order, QUOTA[topic] of them "
    "(the profiler's one: each needs a group of its own)."
)
QUOTA = {"profiler": 1, "timeouts": 4, "async execution": 5, "exceptions": 5, "futures": 5,
         "RRefs": 6, "distributed autograd": 6, "other calls": 5}


def topic_of(suite: str, name: str) -> str:
    if suite == "DistAutogradTest" and not any(w in name for w in ("profil",)):
        return "distributed autograd"
    for topic, words in TOPICS:
        if any(w in name for w in words):
            return topic
    return "other calls"


def sample(all_cases: list[Case] | None = None) -> list[str]:
    """The ids of the sample (``SAMPLE_RULE``), tests of a fresh group last."""
    by_topic: dict[str, list[Case]] = {}
    for case in all_cases if all_cases is not None else cases():
        if not case.why_not:
            by_topic.setdefault(case.topic, []).append(case)
    picked: list[Case] = []
    for topic, found in by_topic.items():
        found.sort(key=lambda c: c.id)
        quota = QUOTA.get(topic, len(found))
        if quota >= len(found):
            picked += found
            continue
        step = len(found) / quota
        picked += [found[math.floor(i * step + step / 2)] for i in range(quota)]
    picked.sort(key=lambda c: (c.fresh, c.id))
    return [c.id for c in picked]


# -- one rank's part, in an rpcnb group ---------------------------------------------------

_classes: dict[str, type] = {}
_fresh_state: dict[str, dict[str, Any]] = {}
_KEPT = (int, float, bool, str, type(None), list, set, dict)


class _Same:
    """A global kept as the very object (a function, a class: a test may delete one)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _snapshot(module: types.ModuleType) -> dict[str, Any]:
    """The module's globals as a fresh process has them: counters, flags, lists, futures
    and tensors by value (a test may change them), everything else as the object."""
    import torch

    said: dict[str, Any] = {}
    for key, value in vars(module).items():
        if key.startswith("__"):
            continue
        if isinstance(value, concurrent.futures.Future):
            said[key] = None
        elif type(value) in _KEPT or isinstance(value, torch.Tensor):
            said[key] = copy.deepcopy(value)
        else:
            said[key] = _Same(value)
    return said


def _restore(module: types.ModuleType, said: dict[str, Any]) -> None:
    """Put the module's globals back as ``_snapshot`` found them (containers in place)."""
    import torch

    for key, value in said.items():
        now = vars(module).get(key)
        if isinstance(value, _Same):
            if now is not value.value:  # deleted or rebound (test_function_not_on_callee)
                setattr(module, key, value.value)
        elif isinstance(now, concurrent.futures.Future):
            setattr(module, key, concurrent.futures.Future())
        elif isinstance(now, list) and isinstance(value, list):
            now[:] = copy.deepcopy(value)
        elif isinstance(now, (set, dict)) and type(now) is type(value):
            now.clear()
            now.update(copy.deepcopy(value))
        elif isinstance(value, torch.Tensor):
            setattr(module, key, value.detach().clone().requires_grad_(value.requires_grad))
        else:
            setattr(module, key, copy.deepcopy(value))


def in_group_class(suite: str) -> type:
    """``suite`` mixed with torch's TensorPipe fixture and TestCase, as torch generates it,
    its ``@dist_init`` methods without the wrapper: the group is running already."""
    if suite in _classes:
        return _classes[suite]
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    base = suite_class(suite)
    for other in SUITES:  # both modules' state, before any test of either ran here
        _fresh_state.setdefault(SUITES[other], _snapshot(sys.modules[suite_class(other).__module__]))
    plain = {}
    for key in dir(base):
        member = inspect.getattr_static(base, key, None)
        if inspect.isfunction(member) and _dist_init_args(member) is not None:
            plain[key] = _plain(member)
    cls = type(f"InGroup{suite}", (base, TensorPipeRpcAgentTestFixture, TestCase), plain)
    cls.__module__ = __name__  # a test sends its bound methods: by this name, as torch's do
    globals()[cls.__name__] = cls
    _classes[suite] = cls
    return cls


def run_rank(suite: str, name: str, pg_file: str) -> dict[str, Any]:
    """Run test ``suite.name``'s body as this member's rank (its number: workerN is rank
    N): ``{"rank", "status" (pass, fail, skip), "error"}``."""
    import torch.distributed.rpc as rpc
    from torch.testing._internal import common_utils

    me = rpc.get_worker_info()
    rank = int(me.name.removeprefix("worker"))
    out: dict[str, Any] = {"rank": rank, "status": "pass", "error": ""}
    if me.id != rank:
        return {**out, "status": "fail", "error": f"{me.name} has rank {me.id}: tests need {rank}"}
    cls = in_group_class(suite)
    test = cls(name)
    test.rank = rank
    test.worker_id = rank
    test.file_name = pg_file
    common_utils.set_rng_seed()
    timeout = rpc.get_rpc_timeout()
    t0 = time.perf_counter()
    try:
        getattr(test, name)()
    except unittest.SkipTest as exc:
        out.update(status="skip", error=str(exc))
    except Exception:
        out.update(status="fail", error=traceback.format_exc(limit=-6))
    finally:
        rpc._set_rpc_timeout(timeout)  # some tests change the group's for good
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def reset() -> bool:
    """The test modules' globals as a fresh process has them (on every rank, before any
    rank starts the next test: a rank's test calls functions of the others' modules)."""
    for suite in SUITES:
        in_group_class(suite)
    for module, said in _fresh_state.items():
        _restore(sys.modules[module], said)
    return True


def form_pg(pg_file: str) -> bool:
    """This member as its rank of a gloo process group over the four ranks."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    if dist.is_initialized():
        return False
    rank = int(rpc.get_worker_info().name.removeprefix("worker"))
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    return True


def end_pg() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- the rpcnb way: this process leads -----------------------------------------------------

WORKERS = [f"worker{i}" for i in range(1, WORLD)]


class InGroup:
    """Runs cases on the four ranks of the rpcnb group this process is worker0 of
    (``rpcnb.init(3)``: ``run_group``'s, or a kernel's ``%rpc_init --workers 3``)."""

    def __init__(self) -> None:
        self.session: Any = None
        self.pg_file = ""  # the process group's rendezvous ("": none formed)
        self.used = False  # a test ran in this group
        self.files: list[str] = []  # the process groups' rendezvous folders, removed at close

    def close(self) -> None:
        """This process leaves its process group; the rendezvous files go."""
        end_pg()
        for folder in self.files:
            shutil.rmtree(folder, ignore_errors=True)

    def prepare(self) -> None:
        """For the group running now: the workers import this module; no process group."""
        import rpcnb
        from rpcnb.session import state

        s = state.current()
        if s is self.session:
            return
        end_pg()
        self.session, self.used, self.pg_file = s, False, ""
        rpcnb.run(WORKERS, f"import sys\nif {str(HERE)!r} not in sys.path: "
                  f"sys.path.insert(0, {str(HERE)!r})\nimport conformance", timeout=120)

    def _everywhere(self, call: str, local: Any, timeout: float) -> dict[int, Any]:
        """``conformance.CALL`` on the workers (a cell each) and ``local()`` here, at once."""
        import rpcnb

        box: dict[str, Any] = {}

        def here() -> None:
            try:
                box["value"] = local()
            except BaseException as exc:  # reported as this rank's failure
                box["value"] = {"rank": 0, "status": "fail",
                                "error": "".join(traceback.format_exception(exc)[-6:])}

        thread = threading.Thread(target=here, name="conformance-worker0", daemon=True)
        thread.start()
        results: dict[int, Any] = {}
        try:
            got = rpcnb.run(WORKERS, f"import conformance\nconformance.{call}", fetch=True,
                            timeout=timeout)
            for wname, value in got.items():
                results[int(wname.removeprefix("worker"))] = value
        except Exception as exc:
            said = getattr(exc, "errors", None) or {}
            for wname in WORKERS:
                err = said.get(wname, exc)
                results[int(wname.removeprefix("worker"))] = {
                    "rank": int(wname.removeprefix("worker")), "status": "fail",
                    "error": f"{type(err).__name__}: {err}"[-2000:]}
            done = getattr(exc, "results", None) or {}
            for wname, value in done.items():
                if wname in WORKERS:
                    results[int(wname.removeprefix("worker"))] = value
        thread.join(timeout)
        if thread.is_alive():
            results[0] = {"rank": 0, "status": "timeout", "error": f"still running after {timeout} s"}
            self.session = None  # this rank is stuck: the group cannot be trusted
        else:
            results[0] = box["value"]
        return results

    def run(self, case: Case, timeout: float = TEST_TIMEOUT) -> dict[str, Any]:
        """Run ``case`` on the four ranks: its status (pass: on every rank; skip: any
        rank skipped; fail, timeout) and each rank's."""
        self.prepare()
        t0 = time.perf_counter()
        if case.pg and not self.pg_file:
            folder = tempfile.mkdtemp(prefix="rpcnb-conformance-pg-")
            self.files.append(folder)
            self.pg_file = os.path.join(folder, "store")
            formed = self._everywhere(f"form_pg({self.pg_file!r})",
                                      functools.partial(form_pg, self.pg_file), 90)
            if any(not isinstance(v, bool) for v in formed.values()):
                self.pg_file = ""
                return verdict(formed, 0.0)
        reset_ = self._everywhere("reset()", reset, 60)
        if any(v is not True for v in reset_.values()):
            return verdict(reset_, 0.0)
        self.used = True
        ranks = self._everywhere(f"run_rank({case.suite!r}, {case.name!r}, {self.pg_file!r})",
                                 functools.partial(run_rank, case.suite, case.name,
                                                   self.pg_file), timeout)
        result = verdict(ranks, time.perf_counter() - t0)
        if self.pg_file and result["status"] != "pass":
            # a rank that failed before a dist.barrier() left the others' counts behind
            self._everywhere("end_pg()", end_pg, 60)
            self.pg_file = ""
        return result


RUNNER = InGroup()  # a kernel's, kept across its cells (a %reset leaves modules alone)


def run_to_file(test_id: str, out: str, timeout: float = TEST_TIMEOUT) -> str:
    """In a kernel that leads a group of three workers: run ``test_id`` there (``InGroup``),
    its result as JSON in ``out``; its status."""
    suite, name = test_id.split(".")
    result = RUNNER.run(classify(suite, name), timeout)
    Path(out).write_text(json.dumps(result))
    return str(result["status"])


def verdict(ranks: dict[int, Any], seconds: float) -> dict[str, Any]:
    """One test's outcome from its ranks'."""
    statuses = {r: (v.get("status") if isinstance(v, dict) else
                    "pass" if isinstance(v, bool) else "fail") for r, v in ranks.items()}
    if "timeout" in statuses.values():
        status = "timeout"
    elif "fail" in statuses.values():
        status = "fail"
    elif "skip" in statuses.values():
        status = "skip"
    else:
        status = "pass"
    first = next((v for r, v in sorted(ranks.items())
                  if isinstance(v, dict) and v.get("status") != "pass"), None)
    return {"status": status, "seconds": round(seconds, 3),
            "ranks": {str(r): v for r, v in sorted(ranks.items())},
            "error": (f"rank {first['rank']}: {first.get('error', '')}" if first else "")}


def run_group(todo: list[Case], out: Path, log: Any = print) -> None:
    """The cases of ``todo`` in order in one rpcnb group this process starts
    (``rpcnb.init(3)``), until one does not pass (it may have left its state behind); the
    results so far in ``out`` after each."""
    import rpcnb

    runner = InGroup()
    results: dict[str, Any] = {}
    rpcnb.init(WORLD - 1)
    try:
        for case in todo:
            results[case.id] = result = runner.run(case)
            out.write_text(json.dumps(results))
            log(f"rpcnb {result['status']:7} {result['seconds']:6.2f} s {case.id}")
            if result["status"] not in ("pass", "skip"):
                break
    finally:
        runner.close()
        rpcnb.shutdown()


def run_in_rpcnb(todo: list[Case], log: Any = print) -> dict[str, dict[str, Any]]:
    """Every case of ``todo`` in rpcnb groups, each led by a fresh interpreter (torch's
    tests expect the state a fresh process has: RRef ids, the profiler's, the modules'
    globals): the cases that share a group in one, each test of a fresh group in one of its
    own, and after a test that did not pass the rest in a new one."""
    remaining = sorted(todo, key=lambda c: (c.fresh, c.id))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rpcnb-conformance-") as tmp:
        while remaining:
            batch = [remaining[0]] if remaining[0].fresh else [c for c in remaining if not c.fresh]
            out = Path(tmp) / f"group{len(results)}.json"
            try:
                ran = subprocess.run([sys.executable, __file__, "--rpcnb-child", str(out),
                                      *[c.id for c in batch]], timeout=TEST_TIMEOUT * len(batch) + 120,
                                     stdout=sys.stderr)
                said = f"its worker0 exited with {ran.returncode}"
            except subprocess.TimeoutExpired:
                said = "its worker0 did not end in time"
            got = json.loads(out.read_text()) if out.exists() else {}
            if not got:  # nothing ran: the group did not start, or its first test crashed it
                got = {batch[0].id: {"status": "fail", "seconds": 0.0, "ranks": {},
                                     "error": f"the group stopped: {said}"}}
            results.update(got)
            remaining = [c for c in remaining if c.id not in results]
            log(f"[{len(results)}/{len(todo)}] done")
    return results


# -- torch's way ----------------------------------------------------------------------


def torch_class(suite: str) -> type:
    """``suite`` as torch's test_tensorpipe_agent.py generates it (rpc_utils.generate_tests),
    its four processes forked instead of spawned."""
    import torch.multiprocessing as tmp
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )
    from torch.testing._internal.distributed.rpc_utils import SpawnHelper

    class ForkHelper(SpawnHelper):
        def _spawn_processes(self) -> None:
            self._start_processes(tmp.get_context("fork").Process)

    cls = type(f"TensorPipe{suite}", (suite_class(suite), TensorPipeRpcAgentTestFixture,
                                      ForkHelper), {})
    cls.__module__ = __name__
    globals()[cls.__name__] = cls
    return cls


def run_torch_way(todo: list[Case], log: Any = print) -> dict[str, dict[str, Any]]:
    """Every case of ``todo`` the way torch runs it (in this process: start none of
    rpcnb's here)."""
    results = {}
    classes = {suite: torch_class(suite) for suite in SUITES}
    for i, case in enumerate(sorted(todo, key=lambda c: c.id)):
        outcome = unittest.TestResult()
        t0 = time.perf_counter()
        classes[case.suite](case.name).run(outcome)
        seconds = round(time.perf_counter() - t0, 3)
        if outcome.errors or outcome.failures:
            text = (outcome.errors + outcome.failures)[0][1]
            status = "timeout" if "timed out after" in text else "fail"
            results[case.id] = {"status": status, "seconds": seconds, "error": text[-3000:]}
        elif outcome.skipped:
            results[case.id] = {"status": "skip", "seconds": seconds,
                                "error": outcome.skipped[0][1]}
        else:
            results[case.id] = {"status": "pass", "seconds": seconds, "error": ""}
        log(f"[{i + 1}/{len(todo)}] torch {results[case.id]['status']:7} {seconds:6.2f} s {case.id}")
    return results


def torch_way_in_child(todo: list[Case], out: Path) -> dict[str, dict[str, Any]]:
    """``run_torch_way`` in a fresh interpreter (one that never led a group), its results
    through ``out``."""
    env = dict(os.environ, DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(int(TEST_TIMEOUT)))
    subprocess.run([sys.executable, __file__, "--torch-child", str(out),
                    *[c.id for c in todo]], env=env, check=True)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


# -- the report -----------------------------------------------------------------------


def report(all_cases: list[Case], rpcnb_way: dict[str, Any], torch_way: dict[str, Any]) -> str:
    lines = []
    applicable = [c for c in all_cases if not c.why_not]
    skipped = [c for c in all_cases if c.why_not]
    both = [c for c in applicable if c.id in rpcnb_way and c.id in torch_way]
    differ = [c for c in both if rpcnb_way[c.id]["status"] != torch_way[c.id]["status"]]
    import torch

    lines.append(f"torch {torch.__version__}: {len(all_cases)} tests of "
                 f"{', '.join(SUITES)}; {len(applicable)} can run in a running group, "
                 f"{len(skipped)} cannot.")
    for way, got in (("rpcnb group", rpcnb_way), ("torch's way", torch_way)):
        if got:
            counts: dict[str, int] = {}
            for c in applicable:
                if c.id in got:
                    counts[got[c.id]["status"]] = counts.get(got[c.id]["status"], 0) + 1
            lines.append(f"  {way}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                         + f" (of {sum(counts.values())})")
    if both:
        lines.append(f"Tests whose outcome differs ({len(differ)} of {len(both)}):")
        for c in differ:
            lines.append(f"  {c.id}: rpcnb {rpcnb_way[c.id]['status']}, torch "
                         f"{torch_way[c.id]['status']}")
            for way, got in (("rpcnb", rpcnb_way), ("torch", torch_way)):
                said = gist(got[c.id].get("error") or "")
                if said:
                    lines.append(f"    {way}: {said}")
    return "\n".join(lines)


def gist(error: str) -> str:
    """The line of a test's error that says what went wrong (its exception's, else its
    last), without torch's hint on how to run it again."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip() and not ln.startswith(
        ("To execute this test", "This message can be suppressed", "    python "))]
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*", ln)]
    return ((raised or lines or [""])[-1])[:240]


def listing(all_cases: list[Case]) -> str:
    by_reason: dict[str, list[str]] = {}
    for c in all_cases:
        if c.why_not:
            by_reason.setdefault(c.why_not, []).append(c.id)
    lines = [f"{sum(not c.why_not for c in all_cases)} of {len(all_cases)} tests can run in a "
             "running group. The others:"]
    for reason, ids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {reason} ({len(ids)}): {', '.join(i.split('.', 1)[1] for i in ids)}")
    fresh: dict[str, list[str]] = {}
    for c in all_cases:
        if c.fresh and not c.why_not:
            fresh.setdefault(c.fresh_why, []).append(c.id)
    lines.append("Each in a fresh group (torch's way gives every test fresh processes):")
    for reason, ids in sorted(fresh.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {reason} ({len(ids)}): {', '.join(ids)}")
    lines.append(f"Sample ({SAMPLE_RULE}):")
    lines.append("  " + ", ".join(sample(all_cases)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only the tests whose SUITE.NAME contains this")
    ap.add_argument("--only", choices=("rpcnb", "torch"), help="run one way only")
    ap.add_argument("--sample", action="store_true", help="only the sample make test runs")
    ap.add_argument("--list", action="store_true", help="say which tests apply, run none")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--torch-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rpcnb-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("ids", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rpcnb_child:
        by_id = {c.id: c for c in cases()}
        run_group([by_id[i] for i in args.ids], args.rpcnb_child, log=_log)
        return 0
    if args.torch_child:
        wanted = set(args.ids)
        todo = [c for c in cases() if c.id in wanted]
        args.torch_child.write_text(json.dumps(run_torch_way(todo, log=_log)))
        return 0
    all_cases = cases(args.k)
    if args.list:
        print(listing(all_cases))
        return 0
    todo = [c for c in all_cases if not c.why_not]
    if args.sample:
        picked = set(sample(cases()))
        todo = [c for c in todo if c.id in picked]
    t0 = time.monotonic()
    torch_way = {} if args.only == "rpcnb" else torch_way_in_child(
        todo, args.out.with_suffix(".torch.json"))
    rpcnb_way = {} if args.only == "torch" else run_in_rpcnb(todo, log=_log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "cases": [asdict(c) for c in all_cases], "rpcnb": rpcnb_way, "torch": torch_way,
        "seconds": round(time.monotonic() - t0, 1)}, indent=1))
    print(report(all_cases, rpcnb_way, torch_way))
    print(f"(everything in {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out})")
    differ = [i for i in rpcnb_way if i in torch_way and rpcnb_way[i]["status"] != torch_way[i]["status"]]
    return 1 if differ else 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import conformance  # the module's own name: workers import it by that name

    sys.exit(conformance.main())
