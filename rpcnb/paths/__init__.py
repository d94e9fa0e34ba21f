"""Where a tensor's bytes go: the pickler that picks the path (``serialize``), same-host
shared memory (``shm``), tensors already shared sent by handle (``zerocopy``), the opt-in
UCX path (``ucx``) and DLPack arrays as tensors (``arrays``).
"""
