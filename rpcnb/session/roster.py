"""Who is in the group: names and ranks claimed in the store (never reused), members
admitted by the leader (they proved they know the secret), targets resolved to live
members, and dead members removed from torch's dynamic group so it stays usable.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from rpcnb import errors
from rpcnb.errors import RpcnbError, WorkerDiedError, WorkerUnreachableError
from rpcnb.session import protocol, rendezvous, state, workersets
from rpcnb.session.members import Member, Status
from rpcnb.session.state import ALL, Session
from rpcnb.wire import _gather, _torch

MAX_RANK = 32767  # torch's worker ids are int16
KEEPER_KIND = "keeper"  # a kept group's first member (rpcnb.keeper): runs no cells


def fixed_rank() -> int | None:
    """The rank this process must keep (None before its first group): torch's distributed
    autograd keeps the first worker id a process had and refuses any other one later, so a
    process keeps its first rank in every group it is in after that."""
    return _torch.FIRST_AGENT.rank


def keep_rank(rank: int) -> None:
    """This process's agent started with ``rank``: the one it keeps (``fixed_rank``)."""
    _torch.FIRST_AGENT.rank = rank


# --------------------------------------------------------------------------- claims


def claim_rank(store: Any, rank: int) -> bool:
    """Take ``rank`` in this group's store; False when someone had it."""
    mine = f"{os.getpid()}-{uuid.uuid4().hex}"
    return bool(store.compare_set(rendezvous.rank_key(rank), "", mine).decode() == mine)


def next_rank(store: Any) -> int:
    """A rank nobody in this group had: counted up, skipping ranks already claimed."""
    while True:
        rank = int(store.add(rendezvous.NEXT_RANK_KEY, 1))
        if rank > MAX_RANK:
            raise RpcnbError(f"This group has used up its ranks ({MAX_RANK}): start a new group.")
        if claim_rank(store, rank):
            return rank


def claim_name(store: Any, name: str) -> None:
    """Take ``name`` for good in this group (RpcnbError NAME_TAKEN if it was ever used)."""
    mine = f"{os.getpid()}-{uuid.uuid4().hex}"
    got = store.compare_set(rendezvous.name_key(name), "", mine).decode()
    if got != mine:
        raise RpcnbError(errors.NAME_TAKEN.format(name=name))


def publish(store: Any, name: str, devices: list[str],
            device_map: dict[str, Any] | None) -> None:
    """Put ``name``'s devices and device map where a later joiner checks its own map
    against them before it joins (torch would only find a mismatch inside init_rpc, and
    then hang for rpc_timeout holding the group's token)."""
    key = rendezvous.DEVICES_KEY
    entry = {"devices": list(devices), "device_map": device_map or {}}
    while True:
        old = store.get(key).decode() if store.check([key]) else ""
        table = json.loads(old) if old else {}
        table[name] = entry
        new = json.dumps(table, sort_keys=True)
        if store.compare_set(key, old, new).decode() == new:
            return


def published(store: Any) -> dict[str, dict[str, Any]]:
    """Every member's devices and device map, as ``publish`` put them."""
    key = rendezvous.DEVICES_KEY
    return json.loads(store.get(key).decode()) if store.check([key]) else {}


# --------------------------------------------------------------------------- admission


def admit(s: Session, name: str, rank: int, info: dict[str, Any], proof: str) -> Any:
    """On the leader: ``name`` asks to be admitted. Without the secret it is dropped from
    torch's group before rpcnb lists it or sends it anything (None); with it, it becomes
    a member, watched by pid, and learns who else is in."""
    if not rendezvous.verify(rendezvous.proof(s.secret, name, rank), proof):
        threading.Thread(target=forget, args=(s, name), name="rpcnb-refuse", daemon=True).start()
        return None
    s.add_member(Member(name, rank, info["host"], info["pid"], info["kind"], info["devices"],
                        info.get("gpus", ""), address=info.get("address", "")))
    if info.get("facts"):
        s.note_facts(name, info["facts"])
    admitted = s.admitted()
    names_changed(s)
    for other, _ in admitted:  # the others' views of the group take it in too
        if other not in (s.name, name) and not s.is_unreachable(other):
            with contextlib.suppress(Exception):
                protocol.call_async(s.token, other, "member_joined", name, rank, timeout=5)
    return admitted


def learn_member(s: Session, name: str, rank: int) -> None:
    """The leader admitted ``name`` as ``rank`` (``admit``): this member counts it from now
    on, also when the death of an earlier process of that name (``%rpc_restart``: another
    rank) reached it after the leader's ``member_back``."""
    m = s.members.get(name)
    if m is not None and m.status is Status.DEAD and m.rank == rank:
        return  # this very process died since it was admitted
    if m is None or not m.alive or m.rank != rank:
        s.add_member(Member(name, rank))
    names_changed(s)


def death_heard(s: Session, name: str, how: str, rank: int = -1) -> None:
    """The leader says ``name`` died (``how``; ``rank``: which process of that name, -1
    when not known), or ``name`` says it leaves (``how`` is "left"). The death of an
    earlier process of a name admitted again since (a restart) is not this one's."""
    m = s.members.get(name)
    if rank >= 0 and m is not None and m.alive and m.rank != rank:
        return
    if m is None and rank >= 0:
        s.add_member(Member(name, rank))
    s.mark_dead(name, how)
    member_gone(s, name)


def live_names(s: Session, ask: bool = True) -> list[str]:
    """Members that are alive and admitted, by rank (``ask``: a member this one has not
    heard of is asked about from the leader)."""
    names = [n for n in _torch.member_names() if not s.is_dead(n)]
    if ask and not s.is_leader and any(n not in s.members for n in names):
        refresh(s)
    return [n for n in names if n in s.members]


def refresh(s: Session) -> None:
    """Non-leaders learn who was admitted from the leader."""
    try:
        admitted = protocol.call(s.token, s.leader, "registry", timeout=5)
    except Exception:
        return
    for name, rank in admitted:
        if name not in s.members:
            s.add_member(Member(name, rank), replace=False)


def expand(s: Session, spec: str | Iterable[str]) -> list[str]:
    """The members a worker set names (``rpcnb.session.workersets``: ``worker1-8``,
    ``worker2,worker5-7``, ``@HOST``; a string, or strings each a set), checked against the
    members this process knows, the dead included; RpcnbError saying what there is. A host
    names the workers there, as ``--all`` does: not this process, not a kept group's keeper."""
    records = s.records()
    skip = (s.name, s.leader) if s.kept_group or s.options.keeper else (s.name,)
    try:
        return workersets.expand(spec, [m.name for m in sorted(records, key=lambda m: m.rank)],
                                 {m.name: m.host for m in records if m.host and m.name not in skip})
    except ValueError as exc:
        raise RpcnbError(str(exc)) from None


def resolve(s: Session, target: str | Iterable[str] | None) -> tuple[list[str], bool]:
    """Worker names for ``target`` (a name, a worker set such as ``worker1-8`` or
    ``worker2,worker5-7``, a list of those, torch's WorkerInfo, or ALL); and whether the
    result is a dict (several targets named)."""
    if type(target) is str and "," not in target and "-" not in target and target != ALL \
            and not target.startswith("@"):
        m = s.members.get(target)  # one admitted member, alive: every cell to one worker
        if m is not None and m.status is Status.ALIVE:
            return [target], False
    live = live_names(s)
    if target is None or target == ALL:
        # a kept group's leader is its keeper, which runs no cells (rpcnb.membership.kept)
        skip = (s.name, s.leader) if s.kept_group or s.options.keeper \
            else (s.name,)
        names = [n for n in live if n not in skip]
        if not names:
            raise RpcnbError(errors.NO_WORKERS)
        return names, True
    if isinstance(target, str):
        parts, many = [target], workersets.is_several(target)
    elif isinstance(target, Iterable):  # a list, a set, a dict of results keyed by name
        parts, many = [_name_of(s, p) for p in target], True
    else:
        parts, many = [_name_of(s, target)], False  # torch's WorkerInfo, or an error
    names = []
    for p in expand(s, parts):
        if s.is_dead(p):
            raise WorkerDiedError(s.death_message(p), p)
        if s.is_unreachable(p):
            raise WorkerUnreachableError(s.unreachable_message(p), p)
        if p not in live:
            raise RpcnbError(errors.UNKNOWN_WORKER.format(name=p, known=", ".join(live)))
        if p not in names:
            names.append(p)
    if not names:
        raise RpcnbError(errors.UNKNOWN_WORKER.format(name=str(target), known=", ".join(live)))
    return names, many


def _name_of(s: Session, item: Any) -> str:
    """A member's name given as a name or a torch ``WorkerInfo``; anything else is an error
    that says what to give instead (a rank: the name of the member that has it)."""
    if isinstance(item, str):
        return item
    name = getattr(item, "name", None)
    if isinstance(name, str):
        return name
    hint = ""
    if type(item) is int:
        ranked = [n for n, r in s.admitted() if r == item]
        hint = f" (rank {item} is {ranked[0]!r})" if ranked else ""
    raise RpcnbError(errors.BAD_TARGET.format(got=repr(item), kind=type(item).__name__,
                                              hint=hint))


# --------------------------------------------------------------------------- torch's names
#
# torch's all-gather and barriers (rpc.api._all_gather, _barrier, _wait_all_workers) wait for
# the names each member holds: itself and the members it knows alive and admitted, made
# current as members are admitted, die, leave or are replaced (rpcnb.wire._gather).


def names_changed(s: Session) -> set[str]:
    """This member's view of the group's names, made current where torch reads it."""
    names = _callers(s, live_names(s, ask=False))
    _gather.set_names(names)
    return names


def _callers(s: Session, live: Iterable[str]) -> set[str]:
    """``live`` and this member, without a kept group's keeper, its leader (it runs no
    code of the user's, so it never calls torch's all-gather: waiting for it would hang).
    The keeper's workers have ``keeper`` in their options; the attached kernel ``kept``."""
    keeper = s.leader if s.options.keeper or s.kept_group else None
    return {n for n in live if n != keeper} | {s.name}


def member_gone(s: Session, name: str) -> None:
    """``name`` died or left (marked in the session already): out of this member's view,
    and out of the rounds of torch's all-gather it took part in."""
    names_changed(s)
    _gather.forget_rounds(name)


def follow_names() -> None:
    """This process's torch all-gather and barriers wait for the current group's names,
    and fail, naming it, when a member they wait for died or left."""
    _gather.install(_current_names, _gone)


def _current_names() -> set[str] | None:
    s = state.active()
    if s is None or s.closing:
        return None  # in no rpcnb group: torch's own all-gather
    names = _callers(s, live_names(s))
    _gather.set_names(names)
    return names


def _gone(names: Iterable[str]) -> dict[str, str]:
    """Which of ``names`` died or left, each with what to say of it."""
    s = state.active()
    try:
        members = set(_torch.member_names())
    except Exception:  # no agent: the group ended
        members = set()
    said = {}
    for name in names:
        if s is not None and s.is_dead(name):
            said[name] = s.death_message(name)
        elif name not in members:
            said[name] = errors.NOT_A_MEMBER.format(name=name, known=", ".join(sorted(members)))
    return said


def say_left(s: Session) -> None:
    """This member leaves by itself: every other member marks it as left (``member_died``
    with how ``"left"``) before torch's agent leaves, waiting 5 s at most."""
    sent = []
    for other in live_names(s, ask=False):
        if other != s.name and not s.is_unreachable(other):
            with contextlib.suppress(Exception):
                sent.append(protocol.call_async(s.token, other, "member_died", s.name, "left",
                                                timeout=5))
    for fut in sent:
        with contextlib.suppress(Exception):
            fut.wait()


# --------------------------------------------------------------------------- partitions

def publish_unreachable(s: Session, store: Any) -> None:
    """On the leader: which members cannot be reached now, and since when, for whoever
    wants to join (``refuse_join_while_unreachable``)."""
    said = json.dumps(s.unreachable())
    store.set(rendezvous.UNREACHABLE_KEY, said)


def refuse_join_while_unreachable(store: Any) -> None:
    """Before anyone joins: RpcnbError while members are unreachable (torch's join asks
    every member and would wait for its timeout, then fail with a store timeout)."""
    if not store.check([rendezvous.UNREACHABLE_KEY]):
        return
    found = json.loads(store.get(rendezvous.UNREACHABLE_KEY).decode() or "{}")
    if not found:
        return
    names = sorted(found)
    since = time.strftime("%H:%M:%S", time.localtime(min(found.values())))
    raise RpcnbError(errors.JOIN_WHILE_UNREACHABLE.format(
        names=", ".join(names), since=since, them="it" if len(names) == 1 else "they"))


# --------------------------------------------------------------------------- removal


def forget(s: Session, name: str, steal_any: bool = False) -> None:
    """Remove ``name`` from torch's dynamic group (it died, or was refused), here and in
    every other member, so later joins and the final shutdown do not wait for it."""
    def tell(other: str, info: Any) -> None:
        if s.is_unreachable(other):  # it would not hear it; it learns at its next call
            return
        protocol.call(s.token, other, "drop_member", info, timeout=5)

    _torch.remove_member(name, tell, steal_any=steal_any)


def broadcast_death(s: Session, name: str, how: str, rank: int = -1) -> None:
    """Tell every other live member that ``name`` (the process of ``rank``) died, so their
    calls fail fast too."""
    for other in live_names(s):
        if other not in (s.name, name):
            try:
                protocol.call_async(s.token, other, "member_died", name, how, rank, timeout=5)
            except Exception:
                pass
