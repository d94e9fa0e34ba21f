"""A two-stage pipeline: a model split in two, stage one on worker1 and stage two on
worker2, fed with micro-batches.

For each micro-batch the driver asks stage one for its output as an RRef
(``p1_rref.remote().forward(x_rref)``) and hands that RRef to stage two
(``p2_rref.rpc_async().forward(y_rref)``), so micro-batches overlap; the outputs are
gathered with ``torch.futures.wait_all``. Training uses distributed autograd and
``DistributedOptimizer``. The driver also runs the same model unsplit, on one process.

Result: the pipeline's outputs and losses, and the unsplit model's, which must agree.
"""

import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, remote

WORLD_SIZE = 3
IN, HIDDEN, OUT = 10, 32, 4
BATCH, SPLIT_SIZE, STEPS = 24, 6, 5
LR = 0.05


class Stage1(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self._lock = threading.Lock()
        self.seq = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                                 nn.ReLU())

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = self.seq(x)
        return out

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class Stage2(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self._lock = threading.Lock()
        self.seq = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = self.seq(x)
        return out

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class DistNet(nn.Module):
    def __init__(self, split_size, workers):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = remote(workers[0], Stage1)
        self.p2_rref = remote(workers[1], Stage2)

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


def make_data():
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(STEPS, BATCH, IN, generator=g)
    ys = torch.sin(xs[..., :OUT]) + 0.1 * xs[..., OUT:2 * OUT]
    return xs, ys


def run(world_size):
    model = DistNet(SPLIT_SIZE, ["worker1", "worker2"])
    unsplit = nn.Sequential(Stage1().seq, Stage2().seq)
    xs, ys = make_data()
    first = model(xs[0])
    unsplit_first = unsplit(xs[0]).detach()

    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=LR)
    unsplit_opt = optim.SGD(unsplit.parameters(), lr=LR)
    losses, unsplit_losses = [], []
    for step in range(STEPS):
        with dist_autograd.context() as context_id:
            loss = F.mse_loss(model(xs[step]), ys[step])
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
        unsplit_opt.zero_grad()
        unsplit_loss = F.mse_loss(unsplit(xs[step]), ys[step])
        unsplit_loss.backward()
        unsplit_opt.step()
        unsplit_losses.append(unsplit_loss.item())
        print(f"Step {step} done")
    return {
        "outputs": first.tolist(),
        "unsplit_outputs": unsplit_first.tolist(),
        "outputs_after": model(xs[0]).tolist(),
        "unsplit_outputs_after": unsplit(xs[0]).detach().tolist(),
        "losses": losses,
        "unsplit_losses": unsplit_losses,
    }


# --- launcher (not pasted) ---

if __name__ == "__main__":
    from launch import main

    main(run, WORLD_SIZE)
