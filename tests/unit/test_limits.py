"""Time limits that grow with what a call carries (rpcnb.wire.limits): the group's
timeout for a small call, that plus its bytes at the floor rate for a large one."""

from __future__ import annotations

import pytest

from rpcnb import progress
from rpcnb.wire import limits


@pytest.fixture
def rate(monkeypatch):
    def set_rate(value: str | None) -> float:
        if value is None:
            monkeypatch.delenv(limits.MIN_RATE_ENV, raising=False)
        else:
            monkeypatch.setenv(limits.MIN_RATE_ENV, value)
        return limits.floor_rate()

    return set_rate


def test_a_limit_grows_with_the_bytes(rate):
    assert rate(None) == 1 << 20
    assert limits.grown(60, 0) == 60  # a small call keeps the group's figure
    assert limits.grown(60, 1 << 30) == 60 + 1024  # 1 GB at 1 MB/s: 17 min more
    assert limits.grown(0, 1 << 30) == 0  # no limit stays none
    assert rate("2e6") == 2e6
    assert limits.grown(5, 24_000_000) == 17


def test_a_bad_rate_is_an_error_naming_the_variable(rate):
    with pytest.raises(ValueError, match="RPCNB_MIN_RATE='fast' is not a number"):
        rate("fast")
    with pytest.raises(ValueError, match="RPCNB_MIN_RATE='0'"):
        rate("0")


def test_an_output_batch_is_sized():
    items = [("stdout", "x" * 1000), ("display_data", {"data": {"image/png": "y" * 5000},
                                                       "metadata": {}}), ("stderr", "z")]
    assert 6001 <= progress.payload_bytes(items, depth=4) < 6100  # the kinds count too
    assert progress.payload_bytes({"buffers": [b"a" * 300]}, depth=3) == 300


def test_a_plain_call_grows_only_when_large(monkeypatch):
    torch = pytest.importorskip("torch")
    from rpcnb.wire import _torch

    monkeypatch.setenv(limits.MIN_RATE_ENV, str(1 << 20))
    monkeypatch.setattr(_torch.rpc, "get_rpc_timeout", lambda: 60.0)
    unset = _torch.UNSET_RPC_TIMEOUT
    assert _torch.payload_timeout((torch.ones(10), 1, "a"), None) == unset
    big = torch.ones(4 << 20, dtype=torch.uint8)
    assert _torch.payload_timeout((big,), None) == 64
    assert _torch.payload_timeout(([big, big],), {"b": b"x" * (2 << 20)}) == 70
    assert _torch.payload_timeout((), {"t": big}) == 64
    weights = torch.nn.Parameter(torch.ones(1 << 20))  # a subclass of Tensor, 4 MB
    assert _torch.payload_timeout((weights,), None) == 64
    # the tutorials' _call_method(Cls.method, rref, x): a function counts nothing, the
    # tensor beside it its bytes
    assert _torch.payload_timeout((test_a_plain_call_grows_only_when_large, big), None) == 64
    assert _torch.payload_timeout((len, "a", None, 2.0), None) == unset
