"""Functions the benchmarks call on workers and engines.

They live in an importable module (not ``__main__``) so that torch RPC and ipyparallel
send them by reference: the figures then measure the call, not shipping code by value.
Workers and engines find this module through ``PYTHONPATH`` (``bench.run`` sets it to the
repository root).
"""

from __future__ import annotations

from typing import Any

import torch


def noop() -> None:
    return None


def one() -> int:
    return 1


class Counter:
    """An object a worker owns, used through an RRef as the PyTorch RPC tutorials do."""

    def __init__(self) -> None:
        self.n = 0

    def step(self, state: Any) -> int:
        self.n += 1
        return self.n


def call_method(method: Any, rref: Any, *args: Any) -> Any:
    """The tutorials' ``_call_method``: ``method`` of the object ``rref`` holds, run where
    that object lives (``rpc_sync(rref.owner(), call_method, args=[Cls.method, rref, ...])``)."""
    return method(rref.local_value(), *args)


def consume(t: Any) -> int:
    """Receive a tensor and answer with something tiny, so the round trip is one-way data."""
    return int(t.numel())


def consume_array(a: Any) -> int:
    """``consume`` for a NumPy array: its size, or -1 if it arrived as something else."""
    import numpy

    return int(a.size) if type(a) is numpy.ndarray else -1


def uses_torch() -> Any:
    """A function that refers to a package: shipped by reference, since it is importable."""
    return torch.float32
