"""The two-process gloo group a weight sync runs on (`weight_sync.py`), kept apart from accelerate's default group.

The trainer (rank 0) is the master of a `TCPStore` on a port of its host the OS picks (`listen_store`), listening
before the server is told to join; the server (rank 1) connects to the address the trainer gives it
(`address_towards`: the trainer's address on its route to the server). Tensors are
broadcast from rank 0; dtypes travel by name. `store_alive` tells a live owner (its store answers, even mid-step)
from a dead one (connection closed, or a timeout for a host that vanished).
"""

from __future__ import annotations

import datetime
import logging
import socket
import urllib.parse

import torch
import torch.distributed as dist

from ..errors import RolloutServerError

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS's choice)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def address_towards(url: str) -> str:
    """This machine's IPv4 address on the route to `url`'s host: what that host can connect back to. No packet is
    sent (a UDP socket's `connect` only picks the route); loopback for a server on this machine."""
    parsed = urllib.parse.urlsplit(url)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((parsed.hostname or "127.0.0.1", parsed.port or 80))
            return sock.getsockname()[0]
    except OSError as exc:
        raise RolloutServerError(f"no route to {url} to tell the server where to join the weight sync: {exc}") from exc


def listen_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The trainer's side: the group's master store, listening on a port the OS picks (`store.port`) before the
    server hears of it.

    Why: a store client that connects before its master listens retries with a back-off, which cost every training
    run 0.43-0.6 s at its first weight push when the trainer announced a port and only then opened it; picking the
    port while binding also leaves no window in which another process can take it (`free_port`'s race)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, world_size=2, is_master=True, timeout=timeout, wait_for_workers=False)


def join_group(store: dist.TCPStore, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """The gloo group of the two ranks that share `store` (each blocks until the other joins, up to the timeout)."""
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))


def open_group(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, dist.ProcessGroup]:
    """The server's side (rank 1): connect to the trainer's store at `host:port` and join its group."""
    store = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return store, join_group(store, 1, timeout_s)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def store_alive(store: dist.TCPStore, timeout_s: float) -> bool:
    """Whether the trainer serving `store` (its master) answers within `timeout_s` (see `release_if_owner_gone`)."""
    try:
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        store.check(["trl_cb/owner-probe"])
        return True
    except Exception as exc:  # DistNetworkError / DistStoreError: connection closed, reset, or timed out
        logger.info("weight-sync owner probe failed: %s", (str(exc).splitlines() or [type(exc).__name__])[0])
        return False
