"""Ending a trainer's pending collectives at once, from another thread, when the driver knows the group is broken.

gloo has no abort: measured with torch 2.13, ``ProcessGroupGloo.abort()`` returns at once and leaves a collective
that waits on a live but silent peer waiting until the collective's timeout. With more than two trainers a
survivor blocked on another survivor (not on the lost rank) therefore noticed a lost worker only at
``dask-dl.train.timeout`` (120 s by default). What does end such a wait is its connection closing: gloo then
raises "Connection closed by peer" on both ends, at once.

So a trainer notes, while it forms its group, which TCP listeners gloo (and rank 0's rendezvous store) opened in
its process and which connections were opened meanwhile (:func:`before_group`, :func:`group_sockets`). To abort,
it shuts down (``shutdown(SHUT_RDWR)``, on a duplicate of the descriptor, so that gloo still closes its own)
every connection to one of its own group listeners and, among those opened while the group formed, every
connection to another rank's group listener (:func:`shut_group_sockets`). Dask's own connections are neither:
they reach the workers' and the scheduler's listeners. Every pending send and receive of the group then fails,
and the trainer leaves its epoch as after a peer's crash.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

__all__ = ["GroupSockets", "before_group", "group_sockets", "shut_group_sockets"]

logger = logging.getLogger("dask_dl.train")

_Pair = tuple[tuple[str, int], tuple[str, int]]


@dataclass(frozen=True)
class GroupSockets:
    """The TCP endpoints of one trainer's process group, as opened in its worker process."""

    #: ports of the listeners opened while the group formed (gloo's, and rank 0's rendezvous store)
    listeners: frozenset[int]
    #: (local, remote) addresses of the connections opened meanwhile
    opened: frozenset[_Pair]


def _connections() -> list:
    return psutil.Process().net_connections(kind="tcp")


def _pair(connection) -> _Pair:
    return (connection.laddr.ip, connection.laddr.port), (connection.raddr.ip, connection.raddr.port)


def before_group() -> GroupSockets:
    """This process's listeners and connections now, before it joins a group."""
    listeners, opened = set(), set()
    for c in _connections():
        if c.status == psutil.CONN_LISTEN:
            listeners.add(c.laddr.port)
        elif c.raddr:
            opened.add(_pair(c))
    return GroupSockets(frozenset(listeners), frozenset(opened))


def group_sockets(before: GroupSockets) -> GroupSockets:
    """The listeners and connections opened since ``before``: the group's."""
    now = before_group()
    return GroupSockets(now.listeners - before.listeners, now.opened - before.opened)


def shut_group_sockets(mine: GroupSockets, peers: Iterable[int]) -> int:
    """Shut down this process's connections of the group; return how many.

    ``peers`` are the group listener ports of every rank (the driver gathers them at setup): a connection this
    rank opened to another rank's listener is shut here, since that rank may be unable to (stopped, or gone).
    """
    ports = set(peers) | mine.listeners
    shut = 0
    for c in _connections():
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        pair = _pair(c)
        if c.laddr.port not in mine.listeners and not (pair in mine.opened and c.raddr.port in ports):
            continue
        try:
            with socket.socket(fileno=os.dup(c.fd)) as s:
                # the descriptor may have been closed and reused since the listing: shut only the same connection
                if (s.getsockname()[:2], s.getpeername()[:2]) == pair:
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
        except OSError as exc:  # gloo closed it meanwhile: nothing left to shut
            logger.debug("could not shut down the group connection %s: %s", pair, exc)
    return shut
