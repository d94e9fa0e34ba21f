"""Which messages take the C pickler alone (rpcnb.paths.serialize.plain): those that
pickle the same without cloudpickle. Anything that must travel by value (lambdas, local
functions, modules the user registered by value, notebook code whose globals can change in
place) must not."""

from __future__ import annotations

import json
import math
import sys
import types

import cloudpickle
import pytest
import torch

from rpcnb.paths import serialize
from rpcnb.session import state
from rpcnb.wire import _torch

UDF = _torch.python_udf()


# rpcnb's pickler in torch for this module's tests, torch's own again after them
pytestmark = pytest.mark.usefixtures("rpcnb_pickler")



def importable(x):
    return x


def test_calls_of_importable_functions_with_plain_values_are_plain():
    for args in [(), (1, 2.5, "s", b"b", None, True), (torch.ones(3),), ([1, 2], {"k": (3, 4)})]:
        assert serialize.plain(UDF(importable, args, {}))
    assert serialize.plain(UDF(json.dumps, ({"a": 1},), {"indent": 1}))
    assert serialize.plain(UDF(math.sqrt, (2.0,), None))  # a builtin, by name
    assert serialize.plain(torch.zeros(2)) and serialize.plain({"loss": 0.5})


def test_what_must_travel_by_value_is_not_plain():
    def local(x):
        return x

    assert not serialize.plain(UDF(local, (), {}))
    assert not serialize.plain(UDF(lambda x: x, (), {}))
    # a notebook function reading a notebook global that can change in place (steady ones
    # travel as bytes made once: tests/kernel/test_shipped_code.py)
    namespace = sys.modules["__main__"].__dict__
    exec("NB_ITEMS = []\ndef nb_count():\n    return len(NB_ITEMS)\n", namespace)
    try:
        assert not serialize.plain(UDF(namespace["nb_count"], (), {}))
    finally:
        del namespace["NB_ITEMS"], namespace["nb_count"]
    assert not serialize.plain(UDF(importable, (local,), {}))  # code among the arguments
    assert not serialize.plain(UDF(importable, (object(),), {}))  # an object of any type
    assert not serialize.plain(UDF(importable, ([0] * 100,), {}))  # long: cloudpickle's check


def test_a_module_registered_by_value_is_never_sent_by_name():
    assert serialize.plain(UDF(importable, (), {}))
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        assert not serialize.plain(UDF(importable, (), {}))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert serialize.plain(UDF(importable, (), {}))


class Holder:
    def method(self, x):
        return x


def test_importable_functions_among_the_arguments_are_plain():
    # the tutorials' _remote_method(Agent.select_action, rref, ...): a method of an
    # importable class, passed as a value, goes by name as cloudpickle would send it
    assert serialize.plain(UDF(importable, [Holder.method, 0, torch.zeros(4)], {}))
    assert serialize.plain(UDF(importable, (json.dumps,), {}))
    data, tensors = serialize._serialize(None, UDF(importable, [Holder.method, 2], {}))
    back = _torch.rpc_pickler().deserialize(data, tensors)
    assert back.args[0] is Holder.method and back.args[1] == 2


def test_arguments_read_in_place_give_what_the_full_walk_gives():
    # the tutorials' _call_method(Cls.method, rref, tensor): a function found importable
    # before and a tensor are read in plainness's own loop, without a frame each
    args = (Holder.method, torch.zeros(2), 1)
    first = serialize._plainness(UDF(json.dumps, args, None), 0)  # finds Holder.method
    again = serialize._plainness(UDF(json.dumps, args, None), 0)  # reads it in place
    assert first == again == serialize._NEEDS_TABLE
    assert serialize._plainness(UDF(json.dumps, (Holder.method, 2), None), 0) \
        == serialize._NO_TENSORS
    # a module registered by value afterwards: its functions go by value, found before or not
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        assert not serialize.plain(UDF(json.dumps, args, None))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert serialize.plain(UDF(json.dumps, args, None))


def test_a_function_found_importable_before_and_rebound_since_goes_by_value():
    # importlib.reload of a helper module, with a function of it kept from before: cloudpickle
    # sends that one by value; found importable once, it must not fail by name now
    module = types.ModuleType("rpcnb_test_reloaded")
    sys.modules[module.__name__] = module
    try:
        exec("def bump(x=1):\n    return x + 1\n", module.__dict__)
        kept = module.bump
        assert serialize.plain(UDF(kept, (), {}))  # found importable, remembered
        exec("def bump(x=1):\n    return x + 2\n", module.__dict__)  # the reload
        for message in (UDF(kept, (), {}), UDF(importable, (kept, torch.ones(2)), {})):
            data, tensors = serialize._serialize(None, message)
            back = _torch.rpc_pickler().deserialize(data, tensors)
            sent = back.func if back.func is not importable else back.args[0]
            assert sent() == 2  # the function kept, not the module's new one
        assert serialize.plain(UDF(module.bump, (), {}))  # the new one goes by name
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("message", [UDF(importable, (1, "x", torch.arange(4)), {"k": [1.0]})])
def test_a_plain_message_reads_back_the_same(message):
    data, tensors = serialize._serialize(None, message)
    back = _torch.rpc_pickler().deserialize(data, tensors)
    assert back.func is importable and back.args[:2] == (1, "x")
    assert torch.equal(back.args[2], torch.arange(4)) and back.kwargs == {"k": [1.0]}


def test_rpcnb_dataclasses_are_plain_when_their_fields_are():
    from rpcnb.cells.runner import CellResult

    assert serialize.plain(CellResult("worker1", True, value=3.5, has_value=True))
    assert not serialize.plain(CellResult("worker1", True, value=object(), has_value=True))
    assert not serialize.plain(CellResult("worker1", True, copy_tensors=True))


@pytest.mark.parametrize("source, plain", [
    ("None", True), ("x = 1\ny = x * 2\n", True), ("def f():\n    return 1\n", True),
    ("%time x", False), ("x?", False), ("files = !ls", False), ("  x = 1", False),
    ("/f 1", False), (",f a b", False), (">>> 1 + 1", False), ("s = 'why?'", False),
])
def test_only_plain_python_skips_ipythons_transformers(source, plain):
    from IPython.core.interactiveshell import InteractiveShell

    from rpcnb.cells.runner import plain_python

    assert plain_python(source) is plain
    if plain:  # what skipping saves must be what IPython would have done: nothing
        shell = InteractiveShell.instance()
        assert shell.transform_cell(source).rstrip("\n") == source.rstrip("\n")


def test_outside_a_group_a_tensor_is_named_as_torch_names_it():
    # in a group every member reads rpcnb.paths.routes.tensor_at (a shorter name, agreed
    # through rendezvous.PROTOCOL); outside one, the peer may be running torch alone, which
    # must read rpcnb's message with its own pickler
    from torch.distributed.rpc.internal import _InternalRPCPickler

    assert state.active() is None
    for message in (UDF(importable, (torch.arange(3), 2), {}),  # the C pickler's path
                    UDF(lambda t: t, (torch.arange(3),), {})):  # cloudpickle's
        data, tensors = serialize._serialize(None, message)
        assert b"tensor_at" not in data and len(tensors) == 1
        back = _InternalRPCPickler().deserialize(data, tensors)
        assert torch.equal(back.args[0], torch.arange(3))
