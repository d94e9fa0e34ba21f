"""A batch-updating parameter server with ``@rpc.functions.async_execution``.

The server on worker0 holds a model. Each trainer (worker1, worker2, ...) fetches it,
computes gradients on its own batch and pushes them with ``update_and_fetch_model``. That
function returns a ``torch.futures.Future`` at once, which completes with the updated
model only when every trainer has pushed its gradients for the round: the server counts
the pushes under a lock, averages the gradients, steps its optimizer and completes the
future.

Result: the loss per trainer and round, the model's parameters after the last round, and
what the server and the trainers printed.
"""

import threading

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch import optim
from torch.distributed.rpc import RRef, rpc_async

WORLD_SIZE = 3  # worker0 serves the parameters, the rest train
ROUNDS = 5
BATCH = 8
IN_FEATURES, OUT_FEATURES = 6, 2
LR = 0.05


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size):
        torch.manual_seed(0)
        self.model = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            print(f"PS got {self.curr_update_size}/{self.batch_update_size} updates")
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                print("PS updated model")
                self.future_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, ps_rref):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        self.name = rpc.get_worker_info().name

    def get_next_batches(self):
        g = torch.Generator().manual_seed(rpc.get_worker_info().id)
        w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
        for _ in range(ROUNDS):
            inputs = torch.randn(BATCH, IN_FEATURES, generator=g)
            yield inputs, inputs @ w

    def train(self):
        m = self.ps_rref.rpc_sync().get_model()
        losses = []
        for round_, (inputs, labels) in enumerate(self.get_next_batches()):
            print(f"{self.name} processing round {round_}")
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            )
        print(f"{self.name} training done")
        return losses


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref)
    return trainer.train()


def run(world_size):
    ps = BatchUpdateParameterServer(world_size - 1)
    ps_rref = RRef(ps)
    futs = [rpc_async(f"worker{rank}", run_trainer, args=(ps_rref,))
            for rank in range(1, world_size)]
    losses = torch.futures.wait_all(futs)
    return {
        "losses": losses,
        "parameters": [p.detach().flatten().tolist() for p in ps.model.parameters()],
    }


# --- launcher (not pasted) ---

if __name__ == "__main__":
    from launch import main

    main(run, WORLD_SIZE)
