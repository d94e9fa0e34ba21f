"""What users' notebooks and scripts name, listed, so that moving files cannot break them:
``rpcnb.*``, the magics and their flags, the kernelspec, the provisioner's entry point and
the documented commands. A change here is a change users see: it goes in the changelog."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
from pathlib import Path

import rpcnb

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = [
    "ALL", "CompositeRemoteError", "Group", "RemoteError", "RpcnbError", "WorkerDiedError",
    "WorkerUnreachableError",
    "add_workers", "attach", "copying", "group", "init", "interrupt", "jobs", "join",
    "load_ipython_extension", "restart", "run", "run_bg", "shutdown",
]

MAGICS = {
    ("line", "rpc_init"): ["--add", "--allow-remote", "--attach", "--channels", "--cluster-args",
                           "--collective-timeout", "--collectives",
                           "--device-map", "--engines", "--gpus", "--host", "--interface",
                           "--join", "--keep", "--launcher", "--name", "--no-shm",
                           "--no-zero-copy",
                           "--port", "--threads", "--timeout", "--token", "--transports",
                           "--ucx", "--workers"],
    ("line", "remote"): ["--all", "--bg", "--copy", "--fetch", "--local", "--profile", "--push",
                         "--timeout", "-o", "target"],
    ("cell", "remote"): ["--all", "--bg", "--copy", "--fetch", "--local", "--profile", "--push",
                         "--timeout", "-o", "target"],
    ("line", "rpc_restart"): ["name"],
    ("line", "rpc_jobs"): ["--all", "id"],
    ("line", "rpc_shutdown"): ["--group", "--timeout"],
    ("line", "rpc_groups"): [],
    ("line", "rpc_probe"): ["--repeats", "--sizes", "--tensorpipe", "workers"],
    ("line", "rpc_stacks"): ["--all", "--full", "--timeout", "workers"],
    ("line", "rpc_doctor"): ["--json", "--text"],
    ("line", "rpc_channels"): ["--interval", "--text"],
    ("line", "rpc_devmap"): ["--name", "--topology"],
    ("line", "rpc_workers"): [],
    ("line", "rpc_who"): ["workers"],
}


def test_every_public_name_is_listed():
    # that each resolves from the package: tests/kernel/test_public_names.py (rpcnb.init's
    # lookup starts the workers' launcher, a process)
    assert sorted(rpcnb.__all__) == PUBLIC


def test_the_magics_and_their_flags():
    from rpcnb.frontend.magics import RpcMagics

    found = {}
    for kind, names in RpcMagics.magics.items():
        for name, method in names.items():
            parser = getattr(getattr(RpcMagics, method), "parser", None)
            found[(kind, name)] = [] if parser is None else sorted(
                option for action in parser._actions
                for option in (action.option_strings or [action.dest]))
    assert found == MAGICS


def test_the_kernelspec_runs_in_the_users_namespace_with_its_provisioner():
    spec = json.loads((ROOT / "kernelspec" / "kernel.json").read_text())
    assert spec["argv"][:5] == ["python", "-m", "rpcnb.netns", "run", "--"]
    assert spec["display_name"] == "Python 3 (rpcnb)"
    name = spec["metadata"]["kernel_provisioner"]["provisioner_name"]
    assert name == "rpcnb-isolated"
    found = [e for e in importlib.metadata.entry_points(group="jupyter_client.kernel_provisioners")
             if e.name == name]
    assert len(found) == 1
    assert found[0].load().__name__ == "IsolatedProvisioner"


def test_the_documented_commands_have_their_modules():
    from rpcnb import netns, worker

    assert callable(worker.main)
    assert "rpcnb.sandbox.netns" in inspect.getsource(netns)
    from rpcnb.sandbox import netns as sandboxed

    assert callable(sandboxed.main)
