"""Notebook functions whose globals cannot change in place travel as bytes made once
(rpcnb.wire.notebook.shipped): a message holding them takes the C pickler alone, and a
rebinding in the notebook makes new bytes, so a receiver still gets the notebook's latest
assignment. The receiving side is a second, real Python process."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import run_watched

from rpcnb.paths import serialize
from rpcnb.wire import _torch, notebook

UDF = _torch.python_udf()
MAIN: dict = {}  # this process's notebook namespace (an IPython shell made by another test replaces it)
NAMES = ("SCALE", "ITEMS", "nb_scale", "nb_items", "nb_helper", "nb_outer", "nb_fact",
         "nb_call_method", "NbAgent")

# Reads a pickled list of shipped bytes, and calls each function they stand for with 5:
# its result, and which function object it was (the same bytes give the same object).
RECEIVER = textwrap.dedent("""
    import json, pickle, sys
    from rpcnb.wire import notebook
    seen, out = [], []
    for blob in pickle.loads(open(sys.argv[1], "rb").read()):
        func = notebook.load_shipped(blob)
        if func not in seen:
            seen.append(func)
        out.append([func(5), seen.index(func)])
    print(json.dumps(out))
""")


# rpcnb's pickler in torch for this module's tests, torch's own again after them
pytestmark = pytest.mark.usefixtures("rpcnb_pickler")


@pytest.fixture(autouse=True)
def notebook_cell():
    """Code defined as a notebook cell defines it: in ``__main__``."""
    global MAIN
    MAIN = notebook.namespace()
    yield lambda source: exec(compile(textwrap.dedent(source), "<cell>", "exec",
                                      dont_inherit=True), MAIN)  # not this file's __future__
    for name in NAMES:
        MAIN.pop(name, None)


def receive(tmp_path, blobs: list[bytes]) -> list[list[int]]:
    """What another process makes of ``blobs``, read in order."""
    path = tmp_path / "blobs.pickle"
    path.write_bytes(pickle.dumps(blobs))
    returncode, out, err, _ = run_watched([sys.executable, "-c", RECEIVER, str(path)],
                                          timeout=60, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
    assert returncode == 0, err.decode()
    return json.loads(out)


def test_a_steady_notebook_function_is_plain_and_reads_back(notebook_cell):
    notebook_cell("""
        SCALE = 2
        def nb_scale(x):
            return x * SCALE
    """)
    f = MAIN["nb_scale"]
    message = UDF(f, (3, torch.ones(2)), {"k": "v"})
    assert serialize.plain(message)
    data, tensors = serialize._serialize(None, message)
    back = _torch.rpc_pickler().deserialize(data, tensors)
    assert back.func is f and back.args[0] == 3  # back home: the very function
    assert notebook.shipped(f) is notebook.shipped(f)  # made once


def test_a_rebinding_makes_new_bytes_that_carry_it(notebook_cell, tmp_path):
    notebook_cell("""
        SCALE = 2
        def nb_scale(x):
            return x * SCALE
    """)
    f = MAIN["nb_scale"]
    first = notebook.shipped(f)
    notebook_cell("SCALE = 3")
    second = notebook.shipped(f)
    assert first and second and second != first
    # the same bytes twice give one function there; the new ones, that function with
    # the notebook's latest assignment
    assert receive(tmp_path, [first, first, second]) == [[10, 0], [10, 0], [15, 0]]


def test_a_redefined_helper_makes_new_bytes_for_its_callers(notebook_cell, tmp_path):
    notebook_cell("""
        def nb_helper(x):
            return x + 1
        def nb_outer(x):
            return nb_helper(x) * 2
        def nb_fact(n):
            return 1 if n <= 1 else n * nb_fact(n - 1)
    """)
    outer, fact = MAIN["nb_outer"], MAIN["nb_fact"]
    first = notebook.shipped(outer)
    notebook_cell("""
        def nb_helper(x):
            return x + 100
    """)
    second = notebook.shipped(outer)
    assert second != first
    assert [r[0] for r in receive(tmp_path, [first, second, notebook.shipped(fact)])] == [12, 210, 120]


def test_what_can_change_in_place_is_pickled_with_every_message(notebook_cell):
    notebook_cell("""
        ITEMS = [1, 2]
        def nb_items(x):
            return x + len(ITEMS)
        class NbAgent:
            def select_action(self, x):
                return x
    """)
    f = MAIN["nb_items"]
    assert notebook.shipped(f) is None
    # an annotation naming a notebook class would carry that class in the bytes
    notebook_cell("""
        def nb_scale(x: NbAgent):
            return x
    """)
    assert notebook.shipped(MAIN["nb_scale"]) is None
    assert not serialize.plain(UDF(f, (), {}))
    # a method of a notebook class is a notebook function like any other
    assert serialize.plain(UDF(MAIN["NbAgent"].select_action, (None, 1), {}))
    notebook_cell("ITEMS.append(3)")
    data, tensors = serialize._serialize(None, UDF(f, (1,), {}))
    assert _torch.rpc_pickler().deserialize(data, tensors).func(1) == 4


def test_the_tutorials_pasted_call_takes_the_c_pickler(notebook_cell, monkeypatch):
    notebook_cell("""
        def nb_call_method(method, obj, *args):
            return method(obj, *args)
        class NbAgent:
            def select_action(self, x):
                return x
    """)
    message = UDF(MAIN["nb_call_method"], [MAIN["NbAgent"].select_action, 0, torch.zeros(4)], {})
    made = []
    monkeypatch.setattr(serialize, "_pickler_class",
                        lambda made_before=serialize._pickler_class: made.append(1) or made_before())
    data, tensors = serialize._serialize(None, message)
    assert not made, "cloudpickle's path was taken"
    back = _torch.rpc_pickler().deserialize(data, tensors)
    assert back.func is MAIN["nb_call_method"] and back.args[0] is MAIN["NbAgent"].select_action


def test_a_value_assigned_again_is_a_new_assignment(notebook_cell, tmp_path):
    # SCALE = 1 is the same int object both times; the receiver took SCALE = 2 in between
    notebook_cell("""
        SCALE = 1
        def nb_scale(x):
            return SCALE
        def nb_items(x):
            return SCALE
    """)
    first = notebook.shipped(MAIN["nb_scale"])
    notebook_cell("SCALE = 2")
    other = notebook.shipped(MAIN["nb_items"])
    notebook_cell("SCALE = 1")
    again = notebook.shipped(MAIN["nb_scale"])
    assert again != first
    assert [r[0] for r in receive(tmp_path, [first, other, again])] == [1, 2, 1]


def test_helpers_anywhere_in_the_bytes_are_checked(notebook_cell, tmp_path):
    notebook_cell("""
        SCALE = 1000
        def nb_helper(x):
            return SCALE
        def nb_outer(x):
            return nb_helper(x)
        def nb_scale(x, h=nb_helper):
            return h(x)
        ITEMS = (nb_helper,)
        def nb_items(x):
            return ITEMS[0](x)
    """)
    callers = [MAIN[name] for name in ("nb_outer", "nb_scale", "nb_items")]
    before = [notebook.shipped(f) for f in callers]
    notebook_cell("SCALE = 2000")
    notebook.shipped(MAIN["nb_helper"])  # the helper shipped alone, with its new global
    after = [notebook.shipped(f) for f in callers]
    assert all(a != b for a, b in zip(after, before, strict=True))
    assert [r[0] for r in receive(tmp_path, before + after)] == [1000] * 3 + [2000] * 3
    notebook_cell("SCALE = [7]")  # now it can change in place: so can all of them
    assert [notebook.shipped(f) for f in callers] == [None, None, None]


def test_a_function_that_lost_its_bytes_meanwhile_goes_by_value(notebook_cell):
    # plain() saw it shipped; another thread rebinds its global to a list before pickling
    notebook_cell("""
        ITEMS = 3
        def nb_items(x):
            return ITEMS
    """)
    message = UDF(MAIN["nb_items"], (1,), {})
    kind = serialize._plainness(message, 0)
    assert kind & serialize._NOTEBOOK
    notebook_cell("ITEMS = [1, 2]")
    assert notebook.shipped(MAIN["nb_items"]) is None
    with pytest.raises(serialize._Unshipped):  # never pickled by name
        serialize._serialize_plain(message, kind & serialize._NOTEBOOK)
    data, tensors = serialize._serialize(None, message)  # cloudpickle's path
    assert b"load_shipped" not in data
    assert _torch.rpc_pickler().deserialize(data, tensors).func(1) == [1, 2]
