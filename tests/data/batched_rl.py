"""The reinforcement-learning tutorial's pattern, small: an agent on worker0 answers many
tiny ``select_action`` calls from observers on the other workers, through module-level
helpers ``_call_method`` / ``_remote_method`` and RRefs. It runs as a script (``mp.spawn``,
functions sent by reference), imported in a kernel, and pasted into a kernel (the part
above the launcher marker, functions defined in cells: rpcnb ships them by value):
tests/kernel/test_notebook_code_ships_once.py compares the results, bench/notebook_code.py the
times.

    python batched_rl.py OUT STEPS REPEATS
"""

import statistics
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args), kwargs=kwargs)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine = nn.Linear(4, 2)

    def forward(self, x):
        return torch.softmax(self.affine(x), dim=-1)


class Observer:
    def __init__(self):
        self.state = torch.zeros(4)

    def run_episode(self, agent_rref, ob_id, steps):
        total = 0.0
        for _ in range(steps):
            action = _remote_method(Agent.select_action, agent_rref, ob_id, self.state)
            self.state = self.state + (0.01 if action else -0.01)
            total += float(action)
        return total


class Agent:
    def __init__(self, world_size):
        torch.manual_seed(0)
        self.policy = Policy()
        self.lock = threading.Lock()
        self.calls = 0
        self.agent_rref = RRef(self)
        self.ob_rrefs = [remote(f"worker{i}", Observer) for i in range(1, world_size)]

    def select_action(self, ob_id, state):
        with self.lock:
            self.calls += 1
            with torch.no_grad():
                return int(self.policy(state).argmax())

    def run(self, steps):
        futs = [rpc_async(ob.owner(), _call_method,
                          args=(Observer.run_episode, ob, self.agent_rref, i, steps))
                for i, ob in enumerate(self.ob_rrefs)]
        return [f.wait() for f in futs]


def drive(world_size, steps, repeats):
    agent = Agent(world_size)
    agent.run(10)  # warm-up: pipes open, code shipped once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        totals = agent.run(steps)
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "calls": agent.calls, "totals": totals}


# --- launcher (not pasted) ---

def _worker(rank, world_size, store, out, steps, repeats):
    import json
    import os

    os.environ["TP_SOCKET_IFNAME"] = "lo"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", _transports=["uv"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank == 0:
        result = drive(world_size, steps, repeats)
        with open(out, "w") as f:
            json.dump(result, f)
    rpc.shutdown()


if __name__ == "__main__":
    import os
    import sys
    import tempfile

    import torch.multiprocessing as mp

    out, steps, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = os.path.join(tempfile.mkdtemp(prefix="rpcnb-rl-"), "store")
    mp.spawn(_worker, args=(3, store, out, steps, repeats), nprocs=3)
