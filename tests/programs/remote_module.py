"""RemoteModule from the driver: a two-layer network whose layers live on worker1 and
worker2 as ``torch.distributed.nn.RemoteModule``s, trained from worker0 with distributed
autograd and ``DistributedOptimizer`` over their ``remote_parameters()``.

Result: the outputs on a fixed input before and after training (``forward`` and
``forward_async``), the loss per step, and where each module lives.
"""

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

WORLD_SIZE = 3
STEPS = 8
LR = 0.05


class Body(nn.Module):
    def __init__(self, d_in, d_hidden, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class Head(nn.Module):
    def __init__(self, d_hidden, d_out, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(d_hidden, d_out)

    def forward(self, h):
        return self.fc(h)


def make_data(n=32, d_in=6):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], dim=1)
    return x, y


def run(world_size):
    body = RemoteModule("worker1/cpu", Body, args=(6, 16, 1))
    head = RemoteModule(f"worker{world_size - 1}/cpu", Head, args=(16, 2, 2))
    x, y = make_data()
    probe = x[:4]

    opt = DistributedOptimizer(optim.SGD, body.remote_parameters() + head.remote_parameters(),
                               lr=LR)
    before = head(body(probe))
    losses = []
    for _ in range(STEPS):
        with dist_autograd.context() as context_id:
            loss = F.mse_loss(head(body(x)), y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())

    hidden = body.forward_async(probe).wait()
    after = head.forward_async(hidden).wait()
    return {
        "outputs_before": before.tolist(),
        "outputs_after": after.tolist(),
        "losses": losses,
        "placement": [body.get_module_rref().owner().name,
                      head.get_module_rref().owner().name],
    }


# --- launcher (not pasted) ---

if __name__ == "__main__":
    from launch import main

    main(run, WORLD_SIZE)
