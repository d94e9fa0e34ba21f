"""GPU memory per member in %rpc_workers: allocated, reserved and total per device as each
member's torch sees it, "no GPU" where there is none."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: "
                    "tests/gpu/test_gpus.py checks the figures there")
def test_every_member_says_no_gpu_here(group):
    table = group.execute("%rpc_workers").text
    header, *rows = [ln for ln in table.splitlines() if ln.startswith(("name", "worker"))]
    assert header.rstrip().endswith("gpu memory"), header
    assert len(rows) == 3 and all(r.rstrip().endswith("no GPU") for r in rows), table
    got = group.execute("%%remote worker1 --fetch\nfrom rpcnb import machine\n"
                        "machine.gpu_memory()")
    assert got.text == "[]"
