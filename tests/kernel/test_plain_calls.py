"""Plain torch RPC calls in an rpcnb group (rpcnb.wire._torch.hook_calls): ``rpc_sync`` and
``rpc_async`` of a Python function go from rpcnb's call hook straight to torch's C++ send,
without torch's Python around it, and are counted; the calls whose Python torch has work
for still take torch's own way and work: builtin operators written in Python, an
``async_execution`` function, a call under a torch profiler, a name that is no member
(torch's own error).

The test process is worker0 (the Python API), with a real worker process.
"""

from __future__ import annotations

import json
import sys

import cloudpickle
import pytest
import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api

from rpcnb import telemetry

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker has no tests/


@rpc.functions.async_execution
def async_double(x):
    fut = torch.futures.Future()
    fut.set_result(x * 2)
    return fut


def test_a_plain_call_goes_straight_to_the_send_and_the_rest_goes_torchs_way(api_group,
                                                                            monkeypatch):
    monkeypatch.delenv("RPCNB_CALL_TIMES", raising=False)
    torch_way = []  # the functions torch's own _invoke_rpc sent
    enable = api._enable_rpc_profiler
    monkeypatch.setattr(api, "_enable_rpc_profiler",
                        lambda *a: torch_way.append(a[2]) or enable(*a))
    a = torch.arange(3.0)
    before = telemetry.summary("worker1")["calls"]
    assert rpc.rpc_sync("worker1", json.dumps, args=([1, 2],)) == "[1, 2]"
    assert rpc.rpc_async("worker1", json.dumps, args=({"k": a.tolist()},)).wait() \
        == '{"k": [0.0, 1.0, 2.0]}'
    assert rpc.rpc_sync("worker1", torch.clone, args=(a,)).tolist() == [0.0, 1.0, 2.0]
    assert torch_way == [torch.clone]  # a builtin: torch's way; the two Python calls not
    assert telemetry.summary("worker1")["calls"] == before + 3

    # torch.einsum is a Python function torch sends as the operator aten::einsum
    assert rpc.rpc_sync("worker1", torch.einsum, args=("i,i->", [a, a])).item() == 5.0
    assert rpc.rpc_sync("worker1", async_double, args=(a,)).tolist() == [0.0, 2.0, 4.0]
    assert torch_way[1:] == [torch.einsum, async_double]

    # under a profiler, torch's Python decides whether to record the call (its legacy
    # profiler does): torch's way
    with torch.autograd.profiler.profile():
        assert rpc.rpc_sync("worker1", json.dumps, args=(3,)) == "3"
    assert torch_way[-1] is json.dumps

    with pytest.raises(RuntimeError, match="could not find destination name nobody"):
        rpc.rpc_sync("nobody", json.dumps, args=(1,))
    assert telemetry.summary("worker1")["calls"] == before + 6


def test_sparse_tensors_go_as_arguments_and_come_back(api_group):
    # a sparse tensor has no nbytes: the time limit grown by a call's payload counts its
    # values and indices, and neither of rpcnb's paths takes it
    coo = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    csr = torch.ones(2, 3).to_sparse_csr()
    assert rpc.rpc_sync("worker1", torch.add, args=(coo, coo)).to_dense().tolist() \
        == [2.0, 0.0, 4.0, 0.0]
    back = rpc.rpc_sync("worker1", json.loads, args=("[1]",)), \
        rpc.rpc_async("worker1", torch.Tensor.to_dense, args=(csr,)).wait()
    assert back[0] == [1] and torch.equal(back[1], torch.ones(2, 3))
    assert torch.equal(rpc.remote("worker1", torch.Tensor.to_dense, args=(coo,)).to_here(),
                       torch.tensor([1.0, 0.0, 2.0, 0.0]))


def test_in_a_group_a_tensor_in_a_message_is_named_by_rpcnbs_short_name(api_group):
    # every member reads routes.tensor_at (rendezvous.PROTOCOL 4): one global to pickle and
    # to look up where torch's reducer names getattr of a class; after a message of many
    # strings, the thread's kept pickler holds none of them
    from rpcnb.paths import serialize
    from rpcnb.wire import _torch

    udf = _torch.python_udf()
    serialize._serialize(None, udf(json.dumps, ([str(i) for i in range(60)],), {}))
    data, tensors = serialize._serialize(None, udf(json.dumps, (torch.ones(2), 1), {}))
    assert b"tensor_at" in data and b"_tensor_receiver" not in data and len(tensors) == 1
    assert rpc.rpc_sync("worker1", torch.Tensor.sum, args=(torch.ones(5),)).item() == 5.0
    kept = serialize.INSTALLED.kept  # this thread's picklers
    assert kept.plain is not None and kept.plain[1].memo.copy() == {}
