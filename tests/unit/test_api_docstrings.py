"""The docstrings of ``rpcnb.__all__`` (what docs/api.md renders with autodoc and napoleon)
are in one style, Google's, and stay true to the code: every parameter has its line under
``Args:`` and no line names a parameter the function lacks, a function that returns
something says what under ``Returns:`` (``Yields:`` for a context manager), every raised
type under ``Raises:`` is a builtin exception or one of rpcnb's public errors, and the
``Attributes:`` of a class are attributes it has."""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import re

import pytest

import rpcnb

# where each public name lives (``rpcnb`` itself loads them lazily; rpcnb.init would also
# start the workers' launcher)
HOMES = {name: "rpcnb.api" for name in ("add_workers", "group", "init", "interrupt", "jobs",
                                       "join", "restart", "run", "run_bg", "shutdown")}
HOMES |= {"attach": "rpcnb.integrations.ipyparallel", "copying": "rpcnb.paths.zerocopy",
          "load_ipython_extension": "rpcnb"}
CLASSES = ["CompositeRemoteError", "Group", "RemoteError", "RpcnbError", "WorkerDiedError",
           "WorkerUnreachableError"]
RAISE_NOTHING = {"copying", "load_ipython_extension"}  # of their own
SECTION = re.compile(r"^(Args|Returns|Yields|Raises|Attributes):\n((?:    .*\n|\n)*)", re.M)


def sections(obj) -> dict[str, list[str]]:
    """Each Google-style section of ``obj``'s docstring: the names its entries start with."""
    doc = inspect.getdoc(obj) or ""
    found = {}
    for m in SECTION.finditer(doc + "\n"):
        entries = re.findall(r"^    (\S[^:\n]*?):", m.group(2), re.M)
        found[m.group(1)] = entries if m.group(1) != "Returns" else [m.group(2).strip()]
    return found


def public(name: str):
    return getattr(importlib.import_module(HOMES[name]), name)


def test_every_public_name_is_checked_here():
    assert sorted([*HOMES, *CLASSES, "ALL"]) == sorted(rpcnb.__all__)


@pytest.mark.parametrize("name", sorted(HOMES))
def test_the_function_documents_its_parameters_returns_and_raises(name):
    func = public(name)
    found = sections(func)
    params = [("**" if p.kind is p.VAR_KEYWORD else "") + p.name
              for p in inspect.signature(func).parameters.values()]
    assert found.get("Args", []) == params, f"{name}: Args: {found.get('Args')} != {params}"
    returns = inspect.signature(func).return_annotation
    if name == "copying":
        assert "Yields" in found
    elif returns not in (None, "None"):
        assert found.get("Returns", [""])[0], f"{name} returns {returns}: no Returns: section"
        first = re.sub(r"``[^`]*``", "", found["Returns"][0].splitlines()[0])
        assert ":" not in first, f"{name}: napoleon reads 'X: ...' in Returns: as a type X"
    else:
        assert "Returns" not in found, f"{name} returns None"
    if name in RAISE_NOTHING:
        assert "Raises" not in found
        return
    assert found.get("Raises"), f"{name}: no Raises: section"
    for raised in found["Raises"]:
        if raised.startswith("rpcnb."):
            assert raised.removeprefix("rpcnb.") in CLASSES, f"{name}: {raised}"
        else:
            assert isinstance(getattr(builtins, raised, None), type), f"{name}: {raised}"
            assert issubclass(getattr(builtins, raised), BaseException), f"{name}: {raised}"


def test_the_classes_document_attributes_they_have():
    from rpcnb.errors import CompositeRemoteError, RemoteError, WorkerDiedError
    from rpcnb.session.members import Group

    remote = RemoteError("worker1", "ZeroDivisionError", "division by zero", "tb")
    samples = {
        "Group": Group("worker0", "worker0", "/tmp/x/connection.json", []),
        "RemoteError": remote,
        "WorkerDiedError": WorkerDiedError("died", "worker1"),
        "CompositeRemoteError": CompositeRemoteError({"worker1": remote, "worker2": remote}),
    }
    for name, sample in samples.items():
        documented = sections(type(sample)).get("Attributes")
        assert documented, f"{name}: no Attributes: section"
        for attr in documented:
            assert hasattr(sample, attr), f"{name} has no attribute {attr!r}"
    assert sorted(sections(Group)["Attributes"]) == sorted(f.name for f in dataclasses.fields(Group))
