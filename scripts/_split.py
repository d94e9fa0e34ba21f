import statistics, time, sys
import torch, rpcnb
import torch.distributed.rpc as rpc
def identity(t): return t
def sink(t): return None
rpcnb.init(1, device_map={"worker1": {"cuda:0": "cuda:0"}})
try:
    t = torch.randn(100 * 2**20 // 4, device="cuda:0")
    rpcnb.run("worker1", "import torch\nkept = torch.randn(100 * 2**20 // 4, device='cuda:0')")
    ways = {
        "raw identity": lambda: rpc.rpc_sync("worker1", identity, args=(t,)),
        "raw one-way": lambda: rpc.rpc_sync("worker1", sink, args=(t,)),
        "rpcnb push only": lambda: rpcnb.run("worker1", "None", push={"t": t}, fetch=True),
        "rpcnb fetch only": lambda: rpcnb.run("worker1", "kept", fetch=True),
        "rpcnb push+fetch": lambda: rpcnb.run("worker1", "t", push={"t": t}, fetch=True),
        "rpcnb noop": lambda: rpcnb.run("worker1", "None", fetch=True),
    }
    res = {k: [] for k in ways}
    for fn in ways.values(): fn()
    for _ in range(15):
        for k, fn in ways.items():
            torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
            res[k].append((time.perf_counter() - t0) * 1e3)
    for k, v in res.items():
        print(f"{k:20s} {statistics.median(v):8.2f} ms", flush=True)
finally:
    rpcnb.shutdown()
