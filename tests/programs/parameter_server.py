"""A parameter server with trainers.

worker1 holds the model in a ``ParameterServer``, a singleton that
``get_parameter_server()`` creates on first use behind a module-level lock. Each trainer
(worker2, worker3, ...) gets an RRef to it with ``rpc.remote("worker1",
get_parameter_server)``, runs the forward pass on the server through that RRef, and
updates the server's parameters with distributed autograd and ``DistributedOptimizer``.
The driver (worker0) steps the trainers in turn, so the result does not depend on timing.

Result: the loss per trainer and step, the final parameters, how many parameter servers
the trainers met (one), and what each trainer printed.
"""

import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, rpc_sync

WORLD_SIZE = 4  # worker0 drives, worker1 serves the parameters, the rest train
SERVER_NAME = "worker1"
STEPS = 4
BATCH = 16
LR = 0.1


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, inp):
        return self.model(inp)

    def get_param_rrefs(self):
        return [RRef(param) for param in self.model.parameters()]

    def object_id(self):
        return id(self)

    def flat_parameters(self):
        return torch.cat([p.detach().flatten() for p in self.model.parameters()]).tolist()


param_server = None
global_lock = threading.Lock()


def get_parameter_server():
    """The one ParameterServer of this process, created on first use."""
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server


class TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_server_rref = rpc.remote(SERVER_NAME, get_parameter_server)

    def get_global_param_rrefs(self):
        return _remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return _remote_method(ParameterServer.forward, self.param_server_rref, x)


def make_data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, BATCH, 8, generator=g)
    y = (x[..., :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(-1)
    return x, y


class Trainer:
    def __init__(self, rank):
        self.name = rpc.get_worker_info().name
        self.net = TrainerNet()
        self.opt = DistributedOptimizer(optim.SGD, self.net.get_global_param_rrefs(), lr=LR)
        self.inputs, self.targets = make_data(seed=rank)

    def train_step(self, step):
        with dist_autograd.context() as cid:
            out = self.net(self.inputs[step])
            loss = F.cross_entropy(out, self.targets[step])
            dist_autograd.backward(cid, [loss])
            self.opt.step(cid)
        print(f"{self.name}: training done for step {step}")
        return loss.item()

    def server_id(self):
        return _remote_method(ParameterServer.object_id, self.net.param_server_rref)


def run(world_size):
    trainers = [rpc.remote(f"worker{rank}", Trainer, args=(rank,))
                for rank in range(2, world_size)]
    losses = [[] for _ in trainers]
    for step in range(STEPS):
        for i, trainer in enumerate(trainers):
            losses[i].append(_remote_method(Trainer.train_step, trainer, step))
    server = rpc.remote(SERVER_NAME, get_parameter_server)
    servers = {_remote_method(Trainer.server_id, t) for t in trainers}
    servers.add(_remote_method(ParameterServer.object_id, server))
    return {
        "losses": losses,
        "parameters": _remote_method(ParameterServer.flat_parameters, server),
        "parameter_servers": len(servers),
    }


# --- launcher (not pasted) ---

if __name__ == "__main__":
    from launch import main

    main(run, WORLD_SIZE)
