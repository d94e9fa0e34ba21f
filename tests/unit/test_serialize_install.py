"""rpcnb.paths.serialize.install() patches torch for the whole process (its RPC pickler's
methods, the tensor extractor, rpc_sync/rpc_async/remote's entry points); uninstall() puts
torch's own back exactly, so a test that installs leaves nothing behind for the next."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import _jit_internal  # noqa: E402
from torch.distributed import rpc  # noqa: E402
from torch.distributed.rpc import api, internal  # noqa: E402

from rpcnb.paths import serialize  # noqa: E402
from rpcnb.session import state  # noqa: E402
from rpcnb.wire import notebook, patches  # noqa: E402


def torch_as_it_is() -> dict[str, Any]:
    """What install replaces, by identity (the pickler's own attributes: none before)."""
    p = internal._internal_rpc_pickler
    return {
        "pickler.serialize": vars(p).get("serialize"),
        "pickler.deserialize": vars(p).get("deserialize"),
        "_TensorExtractor": _jit_internal._TensorExtractor,
        "api._invoke_rpc": api._invoke_rpc,
        "api.remote": api.remote,
        "rpc.remote": rpc.remote,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


@pytest.fixture
def uninstalled():
    """torch as rpcnb found it (unless a group of this process needs rpcnb's pickler);
    as it was after the test."""
    if state.is_initialized():
        pytest.skip("this process is in a group, whose members need rpcnb's pickler")
    before = serialize.is_installed()
    serialize.uninstall()
    yield
    serialize.uninstall()
    if before:
        serialize.install()


def test_install_then_uninstall_leaves_torch_as_it_was(uninstalled):
    torch_before, replaced_before = torch_as_it_is(), dict(notebook.REPLACED)
    assert torch_before["pickler.serialize"] is None  # torch's own: its class's method
    serialize.install()
    installed = torch_as_it_is()
    assert serialize.is_installed()
    assert not any(installed[k] is torch_before[k] for k in installed), installed
    serialize.uninstall()
    assert same(torch_as_it_is(), torch_before)
    assert not serialize.is_installed() and notebook.REPLACED == replaced_before
    assert not hasattr(_jit_internal._TensorExtractor, "_rpcnb")
    serialize.uninstall()  # again: nothing left to undo
    assert same(torch_as_it_is(), torch_before)


def test_install_works_again_after_uninstall(uninstalled):
    serialize.install()
    first = torch_as_it_is()
    serialize.uninstall()
    serialize.install()
    again = torch_as_it_is()
    assert serialize.is_installed()
    assert again["pickler.serialize"].__func__ is serialize._serialize
    assert not any(again[k] is first[k] for k in again)  # hooked anew, not left over
    message = internal.PythonUDF(len, ([1, 2],), {})
    data, tensors = internal._internal_rpc_pickler.serialize(message)
    assert internal._internal_rpc_pickler.deserialize(data, tensors).args == ([1, 2],)


def test_uninstall_refuses_to_undo_what_another_library_put_on_top(uninstalled, monkeypatch):
    serialize.install()
    installed = torch_as_it_is()

    def theirs(*args: Any, **kwargs: Any) -> Any:
        return installed["api._invoke_rpc"](*args, **kwargs)

    monkeypatch.setattr(api, "_invoke_rpc", theirs)  # another library's hook, after rpcnb's
    with pytest.raises(RuntimeError, match="_invoke_rpc was replaced again"):
        serialize.uninstall()
    assert api._invoke_rpc is theirs and serialize.is_installed()  # nothing was changed
    assert same({k: v for k, v in torch_as_it_is().items() if k != "api._invoke_rpc"},
                {k: v for k, v in installed.items() if k != "api._invoke_rpc"})
    monkeypatch.undo()  # theirs gone: rpcnb's is on top again and can go
    serialize.uninstall()
    assert not patches.replaced(api, "_invoke_rpc")
