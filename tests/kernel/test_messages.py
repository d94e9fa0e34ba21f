"""Messages rpcnb unpickles itself (rpcnb.paths.serialize): a call of a function the
receiver lacks fails there with torch's own words, and the group goes on."""

from __future__ import annotations

import pytest
import torch.distributed.rpc as rpc

import bench.targets
from bench.targets import noop


def test_a_function_the_worker_lacks_fails_with_torchs_words(api_group):
    def only_here():
        return 1

    # importable by name here (so it travels by reference), missing on the worker
    only_here.__module__, only_here.__qualname__ = "bench.targets", "only_here"
    bench.targets.only_here = only_here
    try:
        with pytest.raises(Exception) as caught:
            rpc.rpc_sync("worker1", only_here)
        said = str(caught.value)
        assert "only_here" in said and "defined on both caller and callee" in said, said
        assert rpc.rpc_sync("worker1", noop) is None  # the worker goes on
    finally:
        del bench.targets.only_here
