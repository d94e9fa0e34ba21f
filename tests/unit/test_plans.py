"""%rpc_init's line as the call it stands for (rpcnb.frontend.plans), without a kernel:
each flag lands in the right argument, and each line that cannot be carried out is one
UsageError that names what to do, before anything starts."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from rpcnb import errors
from rpcnb.frontend import plans


def test_workers_start_a_group_with_this_kernel_as_worker0():
    plan = plans.plan_init("--workers 2")
    assert plan.action == "init" and plan.workers == 2 and plan.starts_workers
    assert plan.kwargs["name"] == "worker0"
    assert plan.kwargs["host"] == "127.0.0.1"  # loopback unless asked
    assert plan.kwargs["shm"] is True and plan.kwargs["zero_copy"] is True
    assert plan.kwargs["allow_remote"] is False


def test_every_flag_lands_in_its_argument():
    plan = plans.plan_init("--workers 1 --name lead --threads 4 --timeout 7.5 --channels basic,cma "
                           "--transports uv --no-shm --no-zero-copy --port 0 --host 10.0.0.1 "
                           "--allow-remote --interface eth0 --gpus auto")
    assert plan.kwargs == {
        "name": "lead", "threads": 4, "timeout": 7.5, "channels": ["basic", "cma"],
        "transports": ["uv"], "shm": False, "zero_copy": False, "port": 0,
        "host": "10.0.0.1", "allow_remote": True, "interface": "eth0", "gpus": "auto",
        "ucx": None,
    }


def test_join_takes_the_address_and_the_name():
    plan = plans.plan_init("--join /tmp/g/connection.json --name alice --token abc")
    assert plan.action == "join" and not plan.starts_workers
    assert (plan.address, plan.name) == ("/tmp/g/connection.json", "alice")
    assert plan.kwargs["token"] == "abc"


def test_a_device_map_is_read_from_the_line_or_the_notebook_or_the_editor():
    spec = "{'worker1': {0: 1}}"
    assert plans.plan_init(f"--workers 1 --device-map \"{spec}\"").kwargs["device_map"] == \
        {"worker1": {0: 1}}
    ns = {"dm": {"worker1": {"cuda:0": "cuda:0"}}}
    assert plans.plan_init("--workers 1 --device-map dm", ns).kwargs["device_map"] == ns["dm"]
    kept = {"worker1": {"cuda:1": "cuda:0"}}
    assert plans.plan_init("--workers 1", applied_device_map=kept).kwargs["device_map"] == kept
    assert "device_map" not in plans.plan_init("--workers 1").kwargs


def test_engines_and_attach_are_ipyparallel_clusters():
    plan = plans.plan_init("--engines 3 --launcher mpi --cluster-args n=3")
    assert (plan.action, plan.workers, plan.launcher, plan.cluster_args) == \
        ("engines", 3, "mpi", "n=3")
    assert not plan.starts_workers  # ipyparallel starts the engines, not our launcher
    plan = plans.plan_init("--attach default:1234")
    assert (plan.action, plan.address) == ("attach", "default:1234")


def test_add_goes_alone():
    plan = plans.plan_init("--add 2 --gpus 1")
    assert (plan.action, plan.workers, plan.kwargs) == ("add", 2, {"gpus": "1"})
    with pytest.raises(UsageError, match="goes alone"):
        plans.plan_init("--add 2 --workers 1")


@pytest.mark.parametrize("line, message", [
    ("--join x", plans.JOIN_NEEDS_NAME),
    ("--join x --name a --workers 2", plans.JOIN_NO_WORKERS),
    ("--join x --name a --port 1", plans.JOIN_NO_LISTEN),
    ("--join x --name a --gpus 0", plans.JOIN_NO_GPUS),
    ("--join x --name a --channels basic", plans.JOIN_NO_CHANNELS),
    ("--workers 1 --token t", plans.TOKEN_WITH_JOIN),
    ("--workers 1 --host 10.0.0.1", plans.HOST_WITH_PORT),
    ("--engines 2 --workers 2", errors.ENGINES_AND_WORKERS),
    ("--engines 2 --join x", plans.CLUSTER_OR_JOIN),
    ("--engines 2 --attach c", plans.ENGINES_OR_ATTACH),
    ("--engines 2 --gpus 0", plans.GPUS_NOT_ENGINES),
    ("--launcher mpi", errors.LAUNCHER_NEEDS_ENGINES),
    ("--workers 'two", plans.UNREADABLE.format(reason="No closing quotation")),
])
def test_a_line_that_cannot_be_carried_out_says_what_to_do(line, message):
    with pytest.raises(UsageError) as exc:
        plans.plan_init(line)
    assert str(exc.value) == message


def test_a_device_map_that_cannot_be_read_is_refused_before_anything_starts():
    with pytest.raises(UsageError):
        plans.plan_init("--workers 1 --device-map \"{'worker1': {0: \"")


@pytest.mark.parametrize("line, cell, target, code", [
    ("worker1 x.sum()", None, "worker1", "x.sum()"),
    ("--fetch worker1,worker2 1 + 1", None, "worker1,worker2", "1 + 1"),
    ("--all -o r len(a)", None, None, "len(a)"),
    ("worker2 --push a,b", "a + b\n", "worker2", "a + b\n"),
])
def test_remote_lines_split_into_flags_and_code(line, cell, target, code):
    args, got = plans.parse_remote_line(line, cell)
    assert (args.target, got) == (target, code)


def test_a_member_name_with_a_dash_is_refused_before_anything_starts():
    # torch keeps a dynamic group's members as "name-rank" and splits at '-': a member named
    # "my-kernel" made every later member (a restart, --add, a join) time out after 60 s
    import pytest

    from rpcnb import errors
    from rpcnb.wire import options

    for bad in ("my-kernel", "kernel-4242", "-x", "1abc", "a b", ""):
        with pytest.raises(ValueError) as info:
            options.check_name(bad)
        assert str(info.value) == errors.BAD_NAME.format(name=bad)
    for good in ("kernel_4242", "worker1", "_x", "A" * 64):
        options.check_name(good)
