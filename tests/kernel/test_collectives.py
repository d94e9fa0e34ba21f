"""Collectives next to RPC: with --collectives gloo the workers form a torch.distributed
process group (worker1 is rank 0), so all_reduce, all_gather, barrier and DDP run in
%%remote --all cells beside RPC; a collective that not every rank joins fails within the
time limit, naming who never came, and the group goes on."""

from __future__ import annotations

import time

import pytest

COLL = "import torch\nimport torch.distributed as dist\n"


# conftest.group: one group for the module, with a process group of its workers
GROUP_INIT = "%rpc_init --workers 2 --collectives gloo --collective-timeout 5"


@pytest.fixture
def coll_group(group):
    out = group.init_output.stdout
    assert "the workers form a process group (gloo): worker1..worker2 are ranks 0..1" in out
    return group


def test_all_reduce_all_gather_barrier_and_rpc_in_the_same_processes(coll_group):
    k = coll_group
    got = k.execute("%%remote --all --fetch\n" + COLL +
                    "t = torch.tensor([float(dist.get_rank() + 1)])\ndist.all_reduce(t)\n"
                    "every = [torch.zeros(1) for _ in range(dist.get_world_size())]\n"
                    "dist.all_gather(every, torch.tensor([float(dist.get_rank())]))\n"
                    "dist.barrier()\n"
                    "(dist.get_rank(), dist.get_world_size(), float(t), [float(e) for e in every])")
    assert got.text == ("{'worker1': (0, 2, 3.0, [0.0, 1.0]), "
                        "'worker2': (1, 2, 3.0, [0.0, 1.0])}"), got.text
    # torch RPC in the same processes, next to the process group
    rpc = k.execute("%%remote worker1 --fetch\nimport torch.distributed.rpc as rpc\n"
                    "float(rpc.rpc_sync('worker2', torch.add, args=(torch.ones(1), 1)))")
    assert rpc.text == "2.0"
    # gloo listens on loopback only, as TensorPipe does
    addrs = k.execute("%%remote --all --fetch\nimport os\nos.environ['GLOO_SOCKET_IFNAME']")
    assert addrs.text == "{'worker1': 'lo', 'worker2': 'lo'}"


def test_ddp_averages_gradients_across_the_workers(coll_group):
    got = coll_group.execute(
        "%%remote --all --fetch\n" + COLL +
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nmodel = DDP(torch.nn.Linear(4, 1))\n"
        "torch.manual_seed(100 + dist.get_rank())  # different data on each rank\n"
        "model(torch.randn(8, 4)).sum().backward()\n"
        "[round(float(g), 5) for g in model.module.weight.grad.flatten()]")
    grads = eval(got.text)  # noqa: S307 - the kernel's own output
    assert grads["worker1"] == grads["worker2"]  # averaged over both ranks
    assert any(abs(g) > 0 for g in grads["worker1"])


def test_a_collective_on_one_worker_fails_in_time_naming_who_never_came(coll_group):
    k = coll_group
    t0 = time.monotonic()
    out = k.execute("%%remote worker1\n" + COLL + "dist.all_reduce(torch.ones(1))",
                    allow_error=True, timeout=60)
    took = time.monotonic() - t0
    assert out.error is not None and took < 20, took
    assert "worker2 (rank 1) never came" in out.traceback, out.traceback
    assert "formed again" in out.stderr, out.stderr
    # the group goes on: the kernel, both workers, and collectives on every rank
    assert k.execute("1 + 1").text == "2"
    again = k.execute("%%remote --all --fetch\n" + COLL +
                      "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
    assert again.text == "{'worker1': 2.0, 'worker2': 2.0}"


def test_resizing_is_refused_and_shutdown_lets_a_new_group_form(rpcnb_kernel):
    k = rpcnb_kernel  # it shuts its group down: the shared kernel, lent in no group
    k.execute(GROUP_INIT)
    out = k.execute("%rpc_restart worker1", allow_error=True)
    assert "form a process group (--collectives gloo) of a fixed size (2)" in out.stderr
    out = k.execute("%rpc_init --add 1", allow_error=True)
    assert "adding 1 worker(s) would leave it out" in out.stderr
    k.execute("%rpc_shutdown")
    k.execute("%rpc_init --workers 2 --collectives gloo")
    again = k.execute("%%remote --all --fetch\n" + COLL +
                      "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
    assert again.text == "{'worker1': 2.0, 'worker2': 2.0}"
    k.execute("%rpc_shutdown")


def test_collectives_flags_say_where_they_do_not_apply(rpcnb_kernel):
    out = rpcnb_kernel.execute("%rpc_init --collectives gloo", allow_error=True)
    assert "--collectives needs workers" in out.stderr
    out = rpcnb_kernel.execute("%rpc_init --join /nowhere/connection.json --name w9 --collectives gloo",
                         allow_error=True)
    assert "joined kernels, headless workers and ipyparallel engines cannot" in out.stderr
    out = rpcnb_kernel.execute("%rpc_init --workers 1 --collective-timeout 3", allow_error=True)
    assert "--collective-timeout goes with --collectives" in out.stderr


def test_interrupting_a_collective_that_waits_for_a_rank(rpcnb_kernel):
    """A cell stuck in a collective that not every rank joined: the kernel's interrupt ends
    the cell at once, and the group (collectives included) works again afterwards."""
    rpcnb_kernel.execute("%rpc_init --workers 2 --collectives gloo --collective-timeout 8")
    t0 = time.monotonic()
    out = rpcnb_kernel.execute("%%remote worker1\n" + COLL + "dist.all_reduce(torch.ones(1))",
                         allow_error=True, timeout=60, interrupt_after=2)
    took = time.monotonic() - t0
    assert out.error is not None and out.error["ename"] == "KeyboardInterrupt", out.error
    assert took < 6, took
    assert "worker1 still waits inside a collective" in out.stderr, out.stderr
    assert rpcnb_kernel.execute("1 + 1").text == "2"  # the kernel at once
    # the next remote cell waits for worker1's collective to give up, forms the process
    # group again, and then collectives work on every rank
    again = rpcnb_kernel.execute("%%remote --all --fetch\n" + COLL +
                           "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)", timeout=60)
    assert again.text == "{'worker1': 2.0, 'worker2': 2.0}", again.text + again.stderr
    assert "formed again" in again.stderr, again.stderr
