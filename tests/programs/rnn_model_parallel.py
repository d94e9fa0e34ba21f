"""An RNN split across workers: the embedding table on worker1, the LSTM on worker2, the
decoder on the driver (worker0).

``RNNModel`` on the driver holds RRefs to the remote pieces (made with ``rpc.remote``),
runs the forward pass through them with ``_remote_method``, and trains all three with
distributed autograd and one ``DistributedOptimizer`` over the parameters' RRefs.

Result: the loss per step, the decoder's final parameters, and where each piece lives.
"""

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

WORLD_SIZE = 3
NTOKEN, NINP, NHID, NLAYERS = 12, 8, 16, 2
SEQ_LEN, BATCH, STEPS = 6, 4, 6
LR = 0.05


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module):
    return [RRef(param) for param in module.parameters()]


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp, dropout=0.0):
        super().__init__()
        torch.manual_seed(1)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input):
        return self.drop(self.encoder(input))


class LSTMBlock(nn.Module):
    def __init__(self, ninp, nhid, nlayers):
        super().__init__()
        torch.manual_seed(2)
        self.lstm = nn.LSTM(ninp, nhid, nlayers)

    def forward(self, emb, hidden):
        return self.lstm(emb, hidden)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid):
        super().__init__()
        torch.manual_seed(3)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight.data.uniform_(-0.1, 0.1)
        self.decoder.bias.data.zero_()

    def forward(self, output):
        return self.decoder(output)


class RNNModel(nn.Module):
    def __init__(self, emb_worker, rnn_worker, ntoken, ninp, nhid, nlayers):
        super().__init__()
        self.emb_rref = rpc.remote(emb_worker, EmbeddingTable, args=(ntoken, ninp))
        self.rnn_rref = rpc.remote(rnn_worker, LSTMBlock, args=(ninp, nhid, nlayers))
        self.decoder = Decoder(ntoken, nhid)

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_rref, input)
        output, hidden = _remote_method(LSTMBlock.forward, self.rnn_rref, emb, hidden)
        return self.decoder(output), hidden

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_rref))
        remote_params.extend(_remote_method(_parameter_rrefs, self.rnn_rref))
        remote_params.extend(_parameter_rrefs(self.decoder))
        return remote_params


def repackage_hidden(h):
    """Detach the hidden state from its history (truncated backpropagation)."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def make_batches():
    g = torch.Generator().manual_seed(4)
    # a sequence that mostly counts up, so there is something to learn
    start = torch.randint(0, NTOKEN, (1, BATCH), generator=g)
    steps = torch.arange(STEPS * SEQ_LEN + 1).unsqueeze(1)
    noise = (torch.rand(STEPS * SEQ_LEN + 1, BATCH, generator=g) < 0.1).long()
    tokens = (start + steps + noise) % NTOKEN
    for i in range(STEPS):
        chunk = tokens[i * SEQ_LEN:(i + 1) * SEQ_LEN + 1]
        yield chunk[:-1], chunk[1:]


def run(world_size):
    model = RNNModel("worker1", "worker2", NTOKEN, NINP, NHID, NLAYERS)
    opt = DistributedOptimizer(optim.Adam, model.parameter_rrefs(), lr=LR)
    hidden = (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))
    losses = []
    for step, (data, target) in enumerate(make_batches()):
        with dist_autograd.context() as context_id:
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = F.cross_entropy(output.view(-1, NTOKEN), target.reshape(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
        print(f"Training step {step}")
    return {
        "losses": losses,
        "decoder": torch.cat([p.detach().flatten() for p in model.decoder.parameters()])
        .tolist(),
        "placement": [model.emb_rref.owner().name, model.rnn_rref.owner().name],
    }


# --- launcher (not pasted) ---

if __name__ == "__main__":
    from launch import main

    main(run, WORLD_SIZE)
