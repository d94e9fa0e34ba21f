"""A group's options are one typed, frozen object: checked once, held by each member's
session, and sent to a worker as JSON that comes back the same."""

from __future__ import annotations

import dataclasses

import pytest

from rpcnb.wire import options
from rpcnb.wire.options import GroupOptions


def test_the_options_a_worker_gets_on_its_command_line_come_back_the_same():
    opts = options.validate(4, 30, ["cma", "basic"], ["shm", "uv"], shm=True, zero_copy=False,
                            ucx=True).replace(one_host=False, keeper=True,
                                              device_map={"worker1": {"cuda:0": "cuda:1"}})
    assert GroupOptions.from_json(opts.to_json()) == opts
    assert opts.channels == ("cma", "basic") and opts.transports == ("shm", "uv")
    assert GroupOptions.from_json(GroupOptions().to_json()) == GroupOptions()


def test_the_options_are_checked_and_cannot_change_in_place():
    opts = options.validate()
    assert (opts.threads, opts.timeout, opts.transports, opts.channels) == (16, 60.0, ("uv",), None)
    assert options.validate(shm=False, zero_copy=True).zero_copy is False  # only with shm
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.timeout = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        options.validate(0)
    with pytest.raises(ValueError, match="Unknown TensorPipe channel 'fast'"):
        options.validate(channels=["fast"])
