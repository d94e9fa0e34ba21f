"""An outsider that knows one member's TensorPipe address and nothing else of the group
(no connection file, no secret), run by tests/test_security.py in a fresh Python: it
starts its own torch RPC agent on a store of its own, tells the agent that the member
joined its group, and asks the member to run Python (``eval``).

    outsider.py STORE_PATH NAME ADDRESS MARKER

Prints one line: RAN (the member ran it) or REFUSED <the first line of the error>.
"""

from __future__ import annotations

import sys

import torch.distributed.rpc as rpc
from torch.distributed.rpc import api

store_path, name, address, marker = sys.argv[1:5]
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store_path}", rpc_timeout=20,
                                       _transports=["uv"])
rpc.init_rpc("eve", rank=9, rpc_backend_options=opts)
agent = api._get_current_rpc_agent()
agent.store.set(f"addrs/{name}", address)
agent._update_group_membership(rpc.WorkerInfo(name, 1), [], {}, True)
try:
    rpc.rpc_sync(name, eval, args=(f"open({marker!r}, 'w').write('ran')",), timeout=10)
    print("RAN", flush=True)
except Exception as exc:
    print("REFUSED", (str(exc).splitlines() or [repr(exc)])[0][:300], flush=True)
rpc.shutdown(graceful=False)
