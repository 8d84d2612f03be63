"""Keep CPU training fast on a loaded machine: make OpenMP threads sleep, not spin, while they wait for work.

Mechanism (torch's CPU wheels use GNU OpenMP, libgomp; measured on 2 cores, docs/benchmarks.md "Threads and load"):
every OS thread that runs a parallelised torch op owns an OpenMP team whose workers stay parked between ops. After
each parallel region a parked worker *spins* (up to `GOMP_SPINCOUNT`, 300,000 iterations, ~1-2 ms of CPU) before it
sleeps, unless libgomp counts more team threads in the process than CPUs it may use; then it spins only 1,000
iterations ("throttled"). A plain torch process with one thread pool (torch threads = cores) is therefore in spin
mode. That wins on an idle machine (fine-grained ops find their workers awake) and loses badly as soon as other
processes want the cores: spinning workers burn the time slices the busy thread needs, and each region's barrier
waits for a descheduled teammate. Measured: a tiny forward+backward 16 ms idle, but 0.8-4 s per step under two
busy processes in spin mode, against 37-45 ms throttled (`OMP_WAIT_POLICY=PASSIVE`, or any extra idle torch thread).

So trl_cb's speed used to hinge on whether an idle torch thread happened to exist: the generator stops its engine
thread between rounds, which put the training step back into spin mode (10x slower under load), while async
rollouts, whose engine thread lives on, stayed fast.

Design: while any `ContinuousBatchingGenerator` is alive, one parked thread of ours owns a 2-thread team (it ran one
2-way parallel op, then blocks on an event: no CPU). libgomp then counts more team threads than CPUs and every
team in the process waits politely, whatever the engine thread does. Cost on an idle machine: sub-millisecond ops
wait for a woken worker (a tiny forward+backward 16 -> 33 ms in isolation; see the benchmark for whole steps).
`OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` set by the user are read by libgomp at load and still win where they make
waiting passive. Set `TRL_CB_OPENMP_GUARD=0` to opt out (e.g. on a dedicated, otherwise idle machine).

Scope: only libgomp has this managed-thread throttle; with Intel's OpenMP (`KMP_BLOCKTIME`) or a torch built
without OpenMP the guard is a harmless parked thread. With one torch thread there are no teams and nothing to do.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["hold_polite_waits", "hold_polite_waits_while_alive", "polite_waits_held"]

#: Elements of the op the guard runs: between one and two of ATen's 32,768-element grains, so `parallel_for` forks
#: exactly a 2-thread team (one parked worker) whatever the machine's core count.
_GUARD_OP_NUMEL = 40_000
_THREAD_NAME = "trl_cb-openmp-guard"

_lock = threading.Lock()
_holders = 0
_stop: threading.Event | None = None
_thread: threading.Thread | None = None


def _guard(stop: threading.Event, ready: threading.Event) -> None:
    try:
        torch.ones(_GUARD_OP_NUMEL).add_(1)  # one 2-way parallel region: this thread now owns a parked team
    finally:
        ready.set()
    stop.wait()


def hold_polite_waits() -> Callable[[], None]:
    """Keep the guard thread alive until the returned `release` is called (idempotent; reference counted).

    Blocks until the guard's team exists, so the policy holds from the caller's next op on.
    """
    global _holders, _stop, _thread
    if os.environ.get("TRL_CB_OPENMP_GUARD", "1") == "0":
        return lambda: None
    with _lock:
        _holders += 1
        if _thread is None:
            _stop, ready = threading.Event(), threading.Event()
            _thread = threading.Thread(target=_guard, args=(_stop, ready), name=_THREAD_NAME, daemon=True)
            _thread.start()
            ready.wait()
            logger.debug("OpenMP guard thread started: parked OpenMP workers now sleep instead of spinning.")
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        _release()

    return release


def hold_polite_waits_while_alive(owner: object) -> None:
    """Hold the guard until `owner` is garbage collected (or the interpreter exits, before daemon threads die)."""
    weakref.finalize(owner, hold_polite_waits())


def _release() -> None:
    global _holders, _stop, _thread
    with _lock:
        _holders -= 1
        if _holders > 0 or _thread is None:
            return
        stop, thread, _stop, _thread = _stop, _thread, None, None
    assert stop is not None
    stop.set()
    thread.join()  # its OpenMP team is freed on thread exit


def polite_waits_held() -> bool:
    """Whether the guard thread is alive (some generator holds it)."""
    return _thread is not None and _thread.is_alive()
