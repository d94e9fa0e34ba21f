"""torch's own RPC tests in an rpcnb group: a sample of the bodies of ``RpcTest`` and
``DistAutogradTest`` (torch/testing/_internal/distributed/rpc/, shipped in the torch wheel)
on four ranks, a kernel as worker0 and its three workers, each body on every rank at once
(``scripts/conformance.py``; ``make conformance`` runs every one that applies, against
torch's own way). The sample is ``conformance.SAMPLE_RULE``'s pick; a test of torch's
profiler runs in a group of its own, started for it.

worker0 is the module's kernel (``group``, the test process's shared kernel), as in a
notebook: it may have led other groups before this one (torch's RRef context follows each
group's agent there, docs/existing-code.md, "A kernel's next group")."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import conformance  # noqa: E402

GROUP_INIT = "%rpc_init --workers 3"  # worker0 and three workers: the four ranks torch's tests want
START = f"import sys\nsys.path.insert(0, {str(SCRIPTS)!r})\nimport conformance"

# conformance.sample(), written out so that collecting it needs no torch
# (test_the_sample_follows_its_rule checks it): tests of a fresh group last
SAMPLE = [
    "DistAutogradTest.test_backward_complex_python_udf",
    "DistAutogradTest.test_backward_rref_multi",
    "DistAutogradTest.test_backward_without_rpc",
    "DistAutogradTest.test_grad_only_on_return_value_remote",
    "DistAutogradTest.test_multiple_backward",
    "DistAutogradTest.test_rpc_complex_args",
    "RpcTest.test_all_gather",
    "RpcTest.test_all_gather_timeout",
    "RpcTest.test_async_class_rref_proxy",
    "RpcTest.test_async_function_multi_chained_async",
    "RpcTest.test_async_function_nested_remote",
    "RpcTest.test_async_function_with_future_ctor_remote",
    "RpcTest.test_callback_in_rpc",
    "RpcTest.test_callback_with_ret",
    "RpcTest.test_custom_exception_throw_during_reconstruction",
    "RpcTest.test_deadlock",
    "RpcTest.test_default_timeout_used",
    "RpcTest.test_future_nested_callback",
    "RpcTest.test_multi_builtin_remote_ret",
    "RpcTest.test_multi_layer_nested_async_rpc",
    "RpcTest.test_nested_rref",
    "RpcTest.test_py_built_in",
    "RpcTest.test_py_raise_in_user_func",
    "RpcTest.test_py_rref_args",
    "RpcTest.test_py_tensors_in_container",
    "RpcTest.test_remote_with_exception",
    "RpcTest.test_return_future_remote",
    "RpcTest.test_rpc_barrier_all",
    "RpcTest.test_rpc_barrier_multithreaded",
    "RpcTest.test_rpc_barrier_partial_subset",
    "RpcTest.test_rpc_barrier_subset",
    "RpcTest.test_rpc_timeouts",
    "RpcTest.test_rref_proxy_class",
    "RpcTest.test_rref_proxy_tensor_self",
    "RpcTest.test_rref_timeout",
    "RpcTest.test_rref_type_owner_non_blocking",
    "RpcTest.test_rref_type_with_error_non_blocking",
    "RpcTest.test_stress_heavy_rpc",
    "RpcTest.test_user_rref_backward",
    "RpcTest.test_wait_all_exit_early_python",
    "RpcTest.test_wait_all_timeout",
    "RpcTest.test_wait_all_with_exception",
    "RpcTest.test_profiler_with_remote_builtin_single_threaded",
]

# tests where a group differs from torch's own way on purpose, and why (make conformance
# says which): none now
DIFFERS: dict[str, str] = {}


def test_the_sample_follows_its_rule():
    assert conformance.sample() == SAMPLE, conformance.SAMPLE_RULE


@pytest.mark.parametrize("test_id", [
    pytest.param(t, marks=pytest.mark.xfail(strict=True, reason=DIFFERS[t])) if t in DIFFERS
    else t for t in SAMPLE])
def test_torch_rpc_test_passes_in_a_group(test_id: str, shared_group: Any, tmp_path: Path):
    suite, name = test_id.split(".")
    case = conformance.classify(suite, name)
    assert not case.why_not
    shared_group.test = f"{__name__}::{test_id}"
    if case.fresh and shared_group.kernel is not None:  # torch's profiler leaves its state
        shared_group.stop("the case wants a fresh kernel (torch's profiler keeps its state)")
    kernel = shared_group.get()
    out = tmp_path / "result.json"
    try:
        said = kernel.execute(f"{START}\nconformance.run_to_file({test_id!r}, {str(out)!r}, 60)",
                              timeout=150, allow_error=True)
        assert said.error is None, said.traceback
        result = json.loads(out.read_text())
    finally:  # a test that failed may have left its state: the next gets a new group
        if test_id not in DIFFERS and (not out.exists() or
                                       json.loads(out.read_text())["status"] != "pass"):
            shared_group.stop("the case failed (it may have left its state)")
    assert result["status"] == "pass", result["error"]
