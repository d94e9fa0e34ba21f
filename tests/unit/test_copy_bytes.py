"""shm.copy_bytes, the parallel memmove the shared-memory path copies with: every byte
lands where it should, whatever the size and split (odd sizes, sizes just past a part's
bound), with no part touching memory past the end; and its threads are a fixed few."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from rpcnb.paths import shm

MB = 1 << 20


@pytest.mark.parametrize("nbytes", [0, 1, 63, 8 * MB - 1, 16 * MB, 16 * MB + 3, 33 * MB + 7])
def test_every_byte_lands_and_nothing_past_the_end(nbytes):
    src = ctypes.create_string_buffer(os.urandom(nbytes), nbytes)
    guard = b"\xa5" * 64
    dst = ctypes.create_string_buffer(nbytes + 64)
    ctypes.memmove(ctypes.addressof(dst) + nbytes, guard, 64)
    shm.copy_bytes(ctypes.addressof(dst), ctypes.addressof(src), nbytes)
    assert dst.raw[:nbytes] == src.raw[:nbytes]
    assert dst.raw[nbytes:nbytes + 64] == guard


def test_its_threads_are_a_fixed_few():
    n = 40 * MB
    src, dst = ctypes.create_string_buffer(n), ctypes.create_string_buffer(n)
    shm.copy_bytes(ctypes.addressof(dst), ctypes.addressof(src), n)
    before = threading.active_count()
    for _ in range(20):
        shm.copy_bytes(ctypes.addressof(dst), ctypes.addressof(src), n)
    assert threading.active_count() == before
    assert sum(t.name.startswith("rpcnb-copy") for t in threading.enumerate()) <= 3
