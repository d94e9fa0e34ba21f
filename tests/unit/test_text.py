"""Byte sizes and tables as every display of rpcnb writes them (rpcnb.text)."""

from __future__ import annotations

import pytest

from rpcnb import text


@pytest.mark.parametrize("nbytes, kwargs, said", [
    (512, {}, "512 B"),
    (1 << 20, {}, "1.0 MB"),                  # RRef sizes, transfers: one decimal
    (1536 << 20, {}, "1.5 GB"),
    (1024, {"decimals": None}, "1 KB"),       # sizes a user chose (%rpc_probe --sizes)
    (1536, {"decimals": None}, "1.5 KB"),
    (256 << 20, {"decimals": None}, "256 MB"),
    (32 << 20, {"unit": "MB", "decimals": 0}, "32 MB"),   # memory columns, /dev/shm
    (8 << 30, {"unit": "MB", "decimals": 0}, "8,192 MB"),
    (0, {"unit": "MB", "decimals": 0}, "0 MB"),
])
def test_sizes_read_as_people_write_them(nbytes, kwargs, said):
    assert text.size(nbytes, **kwargs) == said


def test_a_table_has_no_trailing_spaces():
    out = text.table([("name", "why"), ("worker1", "gone"), ("w2", "")])
    assert out.splitlines() == ["name     why", "worker1  gone", "w2"]
