"""torch's RRef context in a process's later groups: the private torch names that keep
it working, in one place (as ``_torch`` and ``_gather`` hold the others; checked against
torch 2.11 and 2.13).

Importing this module imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.distributed.rpc import api

# torch's RRefContext is a process-wide singleton built on the process's *first* agent
# (rref_context.cpp: ``static RRefContext* context = new RRefContext(getCurrentRpcAgent())``)
# and never rebuilt. After rpc.shutdown() and a new group in the same process (a kernel's
# %rpc_shutdown then %rpc_init, or a --join after a leave), everything it does goes through
# that shut-down agent: RRef.owner() fails ("could not find destination id 1"), and so do
# torch's RRef proxies (``rref.rpc_sync().forward(x)``, the CUDA RPC recipe), an RRef a
# worker hands back to this process (``rpc_sync("worker0", f, args=(rref,))``: the RRef
# programs of torch's tutorials). (The deletes of the RRefs this process drops in a later
# group stay lost: the first shutdown marked the context destroyed, and torch sends none.)
#
# So while a later group of rpcnb's runs, its agent is the context's agent, and between
# groups the context is torch's again. The context's first member is ``const
# std::shared_ptr<RpcAgent> agent_`` (rref_context.h; the class has no virtual methods).
# As a later group starts, rpcnb moves the first agent's reference out of it (kept here)
# and a new reference to the running agent in (taken with torch's own
# ``RpcAgent::getCurrentRpcAgent()``); once that group's agent has shut down and torch has
# cleared its current agent, rpcnb puts the first agent's reference back and hands the
# running agent's to torch's ``currentRpcAgent_``, whose reset (torch's own) releases it:
# the agent is freed, its threads with it, as after a group without rpcnb. Only where that
# is known to be sound: x86-64 Linux (the function returns its shared_ptr through a pointer
# passed as the first argument), libtorch_cpu exporting the three names, and every two
# words overwritten being the very reference that was checked or put there before (the
# first agent's: found in a context built on it). Anywhere else the context stays as torch
# left it and owner()/owner_name() are answered from the running agent instead (the
# proxies work, an RRef handed back does not).
_CONTEXT = "_ZN5torch11distributed3rpc11RRefContext11getInstanceEv"
_CURRENT_AGENT = "_ZN5torch11distributed3rpc8RpcAgent18getCurrentRpcAgentEv"
_CURRENT_AGENT_SLOT = "_ZN5torch11distributed3rpc8RpcAgent16currentRpcAgent_E"
Words = tuple[int, int]  # a shared_ptr's two words: the object, its control block


@dataclasses.dataclass
class RRefContextAgent:
    """Which agent torch's RRef context of this process works through, as rpcnb left it."""

    started: int = 0  # agents this process started (rpcnb's groups)
    first: Words | None = None  # the reference to the first agent the context was built on
    lent: Words | None = None  # the running agent's reference the context holds for now
    kept: Any = None  # the first agent's reference, moved out of the context while lent

    def agent_started(self) -> None:
        """An agent of rpcnb's is running: make it the context's."""
        self.started += 1
        try:
            follows = self._lend()
        except Exception:  # an unexpected library: torch's context as it was
            follows = False
        if not follows and self.started >= 2:
            _answer_rref_owners_from_the_current_agent()

    def agent_stopped(self) -> None:
        """The agent of rpcnb's group has shut down: the context is torch's again."""
        if self.lent is None:
            return
        try:
            self._give_back()
        except Exception:
            pass

    @staticmethod
    @functools.cache
    def _library() -> Any:
        import ctypes
        import os
        import platform
        import sys

        if sys.platform != "linux" or platform.machine() != "x86_64":
            return None
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        try:
            found = getattr(lib, _CONTEXT), getattr(lib, _CURRENT_AGENT)
            slot = ctypes.c_void_p.in_dll(lib, _CURRENT_AGENT_SLOT)
        except (AttributeError, ValueError):
            return None
        context, current = found
        context.restype, context.argtypes = ctypes.c_void_p, []
        current.restype, current.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        return context, current, ctypes.addressof(slot)

    @staticmethod
    def _at(address: int) -> Any:
        import ctypes

        return (ctypes.c_void_p * 2).from_address(address)

    @staticmethod
    def _words(pair: Any) -> Words:
        return int(pair[0] or 0), int(pair[1] or 0)

    def _lend(self) -> bool:
        import ctypes

        lib = self._library()
        if lib is None or not api._is_current_rpc_agent_set():
            return False
        context, current, current_slot = lib
        running = self._words(self._at(current_slot))  # torch's reference: read, not taken
        slot = self._at(context())  # the context is built here if it was not
        there = self._words(slot)
        if self.first is None:
            if there != running:
                return False  # a context built on an agent rpcnb did not start
            self.first = running
            return True
        if self.lent is not None or there != self.first:
            return False
        taken = (ctypes.c_void_p * 2)()
        current(ctypes.addressof(taken))  # a reference of rpcnb's to the running agent
        if self._words(taken) != running:
            return False
        self.kept = (ctypes.c_void_p * 2)(slot[0], slot[1])  # the first agent's, moved out
        slot[0], slot[1] = taken[0], taken[1]  # and the running agent's, moved in
        self.lent = running
        return True

    def _give_back(self) -> None:
        lib = self._library()
        if lib is None or api._is_current_rpc_agent_set():
            return  # the agent did not shut down: the context keeps it
        context, _current, current_slot = lib
        torch_slot, slot = self._at(current_slot), self._at(context())
        if self._words(torch_slot) != (0, 0) or self._words(slot) != self.lent:
            return
        torch_slot[0], torch_slot[1] = slot[0], slot[1]  # torch's reset releases it
        slot[0], slot[1] = self.kept[0], self.kept[1]
        self.lent = self.kept = None
        torch._C._distributed_rpc._reset_current_rpc_agent()


RREF_CONTEXT = RRefContextAgent()


def note_agent_started() -> None:
    """An agent of rpcnb's started in this process (right after init_rpc, before any
    member can send it an RRef): torch's RRef context works through it."""
    RREF_CONTEXT.agent_started()


def note_agent_stopped() -> None:
    """The agent of rpcnb's group has shut down: torch's RRef context is as torch left it."""
    RREF_CONTEXT.agent_stopped()


def _answer_rref_owners_from_the_current_agent() -> None:
    import re

    from torch._C._distributed_rpc import PyRRef

    if getattr(PyRRef.owner, "rpcnb_current_agent", False):
        return
    first_agents_owner = PyRRef.owner
    pattern = re.compile(r"could not find destination id (\d+)")

    def owner(self: Any) -> Any:
        try:
            owner_id = first_agents_owner(self).id
        except RuntimeError as exc:
            found = pattern.search(str(exc))
            if found is None:
                raise
            owner_id = int(found.group(1))
        for info in api._get_current_rpc_agent().get_worker_infos():
            if info.id == owner_id:
                return info
        raise RuntimeError(
            f"this RRef's owner (member id {owner_id}) is not in the group running now: "
            "an RRef lives as long as the group that made it; make it again in this group")

    def owner_name(self: Any) -> str:
        return str(owner(self).name)

    owner.rpcnb_current_agent = True  # type: ignore[attr-defined]
    owner.__doc__, owner_name.__doc__ = PyRRef.owner.__doc__, PyRRef.owner_name.__doc__
    PyRRef.owner = owner  # type: ignore[method-assign]
    PyRRef.owner_name = owner_name  # type: ignore[method-assign]
