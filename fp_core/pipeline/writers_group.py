"""The writer processes' own gloo group, for collective and sharded saves with
``writer="process"`` (trainer side; the writers' side is ``_join`` in ``writer_main``).

The writers form the group at the first collective save (:func:`join_writers`) and run every
collective save's protocol in it, so a trainer killed after its fence does not fail the save.
A writer that dies breaks that group for its peers, so at every collective save each rank
tells the others, through the trainers' store, whether its writer is still the one that
joined (:class:`WritersGroup`); the save after one that was told otherwise forms the group
again, on every rank (docs/notes/process-writer-collective.md).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import secrets
import time
from typing import Any

from .process_writer import WriterProcess

log = logging.getLogger("fastpersist")

_joins = itertools.count()  # writers' groups joined by this process: the same order on every rank


def _underlying(store: Any) -> Any:
    """The store under any prefixes (where the writers, its clients, set their keys)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _store_address(store: Any) -> tuple | None:
    """Where another process reaches the trainers' store: ``("tcp", host, port)`` of the
    TCPStore under any prefixes, else None."""
    import torch.distributed as dist

    store = _underlying(store)
    if isinstance(store, dist.TCPStore):
        return ("tcp", store.host, store.port)
    return None


def _attempt() -> str:
    """This run's attempt under torchrun (its store may outlive a restart, keys and all)."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


def join_writers(writer: WriterProcess | None, timeout_s: float) -> tuple[str, int] | None:
    """Make the writer processes of every rank a gloo group of their own, for collective
    saves (called by every rank of the world, on the caller's thread, at the same save).

    The ranks first agree, through the trainers' default store (no collective on a group
    the background thread may be using), that every one of them has a writer process
    (``writer`` is None where this rank could not start one) and a store the writers can
    reach. If so, every rank hands its writer a ``join``, in its job order: the writers meet
    at the trainers' store itself (its host and port, as this rank reached it: across
    nodes too), under a prefix of their own; a writer already in a group leaves it first.
    Every rank waits until every writer has joined. Returns the store key under which the
    ranks agreed (unique to this join) and the join's job number, or None: collective saves
    stay on the thread writer, on every rank."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"fastpersist/writers/{_attempt()}/{next(_joins)}"
    where = _store_address(store)
    can = writer is not None and writer.alive and where is not None
    if rank == 0:
        store.set(f"{key}/nonce", secrets.token_hex(8))  # unique under any prefix: a restart's store keeps keys
    store.set(f"{key}/ok/{rank}", "1" if can else "0")
    store.wait([f"{key}/ok/{r}" for r in range(world)] + [f"{key}/nonce"], datetime.timedelta(seconds=timeout_s))
    if not all(store.get(f"{key}/ok/{r}") == b"1" for r in range(world)):
        return None
    assert writer is not None
    nonce = store.get(f"{key}/nonce").decode()
    prefix = f"fastpersist-writers/{nonce}"
    seq = writer.next_seq()
    writer.send(("join", seq, {"store": where, "rank": rank, "world": world, "timeout": timeout_s,
                                             "prefix": prefix, "joined": f"{prefix}.joined"}))
    # The writers form the group in their job order, at the trainers' store: wait for them
    # here, so that a trainer killed after this save's fence (the store's host too) never
    # leaves its writer unable to join. Rank 0 decides for all, so every rank takes the same
    # route even at the timeout's edge.
    verdict, raw = f"{key}/verdict", _underlying(store)
    if rank == 0:
        ok = "1"
        try:
            raw.wait([f"{prefix}.joined/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
            failed = [(r, v) for r in range(world) if (v := raw.get(f"{prefix}.joined/{r}")) != b"1"]
            if failed:
                ok = "0 " + "; ".join(f"rank {r}: {v.decode(errors='replace')[2:]}" for r, v in failed)
        except Exception as e:  # noqa: BLE001 - a store timeout: some writer never joined
            ok = f"0 not every writer joined within {timeout_s:.0f} s ({type(e).__name__})"
        store.set(verdict, ok)
    store.wait([verdict], datetime.timedelta(seconds=2 * timeout_s))
    said = store.get(verdict).decode(errors="replace")
    if said != "1":
        log.warning("fastpersist: the checkpoint writer processes could not form their group (%s): collective "
                    "saves go to the thread writer", said[2:])
        return None
    return f"{key}/{nonce}", seq


class WritersGroup:
    """This rank's view of the writers' group: which writer process joined it, and the
    per-save check that every rank's writer is still that one.

    At collective save ``n`` every rank adds itself to ``n``'s count in the store (and to
    its ``gone`` count where its writer is not the one that joined: it died, or another
    was started; or where a job of its writer in the group failed); at save ``n + 1``
    every rank reads save ``n``'s counts, the same on every rank, and forms the group again
    where one was gone. No rank waits at a save for the
    others (they normally finished save ``n`` a checkpoint interval ago), and the writers
    need the store only to form the group: a trainer killed after its fence, the store's
    host included, does not fail its writer's save."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.writer: WriterProcess | None = None  # the writer process this rank joined with
        self.route: bool | None = None  # None: not decided yet; False: the thread writer's
        self._key = ""
        self._saves = 0
        self._join_seq = 0

    def join(self, writer: WriterProcess | None) -> None:
        """Every rank: form the group (again); ``route`` False if any rank has no writer."""
        joined = join_writers(writer, self.timeout_s)
        self.route = joined is not None
        self.writer = writer if joined is not None else None
        self._key, self._join_seq = joined if joined is not None else ("", 0)
        self._saves = 0

    def must_rejoin(self) -> bool:
        """Every rank, at a collective save: was some rank's writer gone at the previous one?"""
        if not self.route or self._saves == 0:
            return False
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        store, world = _get_default_store(), dist.get_world_size()
        prev = f"{self._key}/{self._saves - 1}"
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0005
        while store.add(f"{prev}/arrived", 0) < world:  # a rank not yet past the previous save
            if time.monotonic() > deadline:
                from ..parallel.distributed import CollectiveSaveError

                raise CollectiveSaveError(f"not every rank reached collective save {self._saves - 1} of the "
                                          f"writers' group within {self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        gone = store.add(f"{prev}/gone", 0)
        if dist.get_rank() == 0 and self._saves >= 2:  # every rank has read the one before
            older = f"{self._key}/{self._saves - 2}"
            for k in ("arrived", "gone"):
                store.delete_key(f"{older}/{k}")
        return gone > 0

    def report(self, writer: WriterProcess | None) -> bool:
        """Every rank, at a collective save after :meth:`must_rejoin`: count this rank in;
        True where ``writer`` is the live writer process that joined the group (this save
        goes to it)."""
        from torch.distributed.distributed_c10d import _get_default_store

        here = writer is not None and writer is self.writer and writer.alive
        # a writer whose job in the group failed since it joined may have left the group's
        # collectives out of step (a rank that skipped a save, a peer that died): it still
        # takes this save (its peers' writers wait for it), and the group forms again next
        stale = here and writer is not None and writer.group_failed_at >= self._join_seq
        store = _get_default_store()
        prefix = f"{self._key}/{self._saves}"
        if not here or stale:
            store.add(f"{prefix}/gone", 1)  # before arrived: a reader that sees every arrival sees it
        store.add(f"{prefix}/arrived", 1)
        self._saves += 1
        return here


__all__ = ["WritersGroup", "join_writers"]
