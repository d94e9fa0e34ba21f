"""Run by tests/kernel/test_channel_model.py in a fresh Python with TP_VERBOSE_LOGGING set (the
level is read once per process): make calls between every pair of members, then write
rpcnb's prediction and what TensorPipe's own log says it chose, as JSON.

    channel_driver.py group OUT [CHANNELS]       rpcnb.init(2): worker0..worker2
    channel_driver.py member OUT STORE NAME RANK  one of two plain TensorPipe members
    channel_driver.py cuda OUT                    rpcnb.init(1), a CUDA tensor each way
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TP_VERBOSE_LOGGING"] = str(7)
import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

from rpcnb.observe import channels  # noqa: E402

CALL_ALL = """
import torch, torch.distributed.rpc as rpc
for peer in {peers!r}:
    rpc.rpc_sync(peer, torch.add, args=(torch.ones(64), 1))
"""


def merged(logs: list[str]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for text in logs:
        for (src, dst), seen in channels.observed(text).items():
            entry = out.setdefault(f"{src}->{dst}", {"transport": None, "channels": []})
            if seen["transport"]:
                entry["transport"] = seen["transport"]
            entry["channels"] = sorted(set(entry["channels"]) | seen["channels"])  # type: ignore[arg-type]
    return out


def predicted(preds: dict) -> dict[str, dict[str, object]]:
    return {f"{a}->{b}": {"transport": p.transport.name, "channels": sorted(p.channel_names()),
                          "reason": p.channels["cpu->cpu"].reason}
            for (a, b), p in preds.items()}


def group(out: str, chosen: str) -> None:
    import rpcnb
    from rpcnb.session import roster, state

    rpcnb.init(2, channels=chosen.split(",") if chosen else None)
    try:
        preds = channels.predict_group()
        names = roster.live_names(state.current())
        for name in names[1:]:
            rpcnb.run(name, CALL_ALL.format(peers=[n for n in names if n != name]))
            rpc.rpc_sync(name, torch.add, args=(torch.ones(64), 1))
        logs = [w.log_path.read_text() for w in state.current().procs.values()]
        with open(out, "w") as f:
            json.dump({"predicted": predicted(preds), "observed": merged(logs)}, f)
    finally:
        rpcnb.shutdown()


def cuda(out: str) -> None:
    """worker0 -> worker1 with a device map: CUDA tensors take a CUDA channel."""
    import rpcnb
    from rpcnb.session import state

    rpcnb.init(1, device_map={"worker1": {"cuda:0": "cuda:0"}})
    try:
        preds = channels.predict_group()
        back = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(4, device="cuda:0"), 1))
        assert back.device.type == "cuda"
        logs = [w.log_path.read_text() for w in state.current().procs.values()]
        with open(out, "w") as f:
            json.dump({"predicted": predicted(preds), "observed": merged(logs)}, f)
    finally:
        rpcnb.shutdown()


def member(out: str, store: str, name: str, rank: int) -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", rpc_timeout=60)
    rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=opts)
    peer = rpc.get_worker_info(1 - rank).name
    rpc.rpc_sync(peer, torch.add, args=(torch.ones(64), 1))
    if rank == 0:
        mine = channels.Facts.from_dict(channels.local_facts())
        mine.name = name
        theirs = channels.Facts.from_dict(rpc.rpc_sync(peer, channels.local_facts))
        theirs.name = peer
        preds = channels.predict({name: mine, peer: theirs})
        with open(out, "w") as f:
            json.dump({"predicted": predicted(preds)}, f)
    rpc.shutdown()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "group":
        group(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
    elif mode == "cuda":
        cuda(sys.argv[2])
    else:
        member(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
