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

Design: while any `ContinuousBatchingGenerator` that asked for it is alive, one parked thread of ours owns a
2-thread team (it ran one 2-way parallel op, then blocks on a queue: no CPU). libgomp then counts more team threads
than CPUs and every team in the process waits politely, whatever the engine thread does. It changes the wait policy
of all of the process's torch work, so it is opt-in by engine: `cb_openmp_guard` (trainer config) /
`openmp_guard` (generator); unset means on only for a CPU engine with an OpenMP torch using more than one thread
(`guard_helps`). Cost on an idle machine: sub-millisecond ops wait for a woken worker (5-10% of a quiet tiny step).
`OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` set by the user are read by libgomp at load and still win where they make
waiting passive.

Deadlock-freedom: a holder's release may run inside a garbage-collection finalizer, on any thread, at any
allocation — also while that thread holds `_lock`. Releases therefore never take a lock: they `put` on a
`queue.SimpleQueue` (whose `put` is reentrant by contract), and the guard thread itself applies them under `_lock`
and exits when the count reaches zero.

Scope: only libgomp has this managed-thread throttle; with Intel's OpenMP (`KMP_BLOCKTIME`) or a torch built
without OpenMP the guard is a harmless parked thread. With one torch thread there are no teams and nothing to do.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["guard_helps", "hold_polite_waits", "hold_polite_waits_while_alive", "polite_waits_held"]

#: Elements of the op the guard runs: between one and two of ATen's 32,768-element grains, so `parallel_for` forks
#: exactly a 2-thread team (one parked worker) whatever the machine's core count.
_GUARD_OP_NUMEL = 40_000
_THREAD_NAME = "trl_cb-openmp-guard"

#: Taken by ordinary code (`hold_polite_waits`) and by the guard thread, never by a release.
_lock = threading.Lock()
_holders = 0
_thread: threading.Thread | None = None
#: Releases (each an optional event to set once applied); `put` is safe from finalizers and signal handlers.
_releases: queue.SimpleQueue[threading.Event | None] = queue.SimpleQueue()


def guard_helps(device: torch.device) -> bool:
    """Whether an engine on `device` benefits: CPU, torch parallelised with OpenMP, more than one thread."""
    return (
        device.type == "cpu"
        and torch.get_num_threads() > 1
        and "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    )


def _guard(ready: threading.Event) -> None:
    global _holders, _thread
    try:
        torch.ones(_GUARD_OP_NUMEL).add_(1)  # one 2-way parallel region: this thread now owns a parked team
    except Exception:  # noqa: BLE001 - no team, no throttle; releases must still be applied below
        logger.warning("OpenMP guard could not run its parallel op; waits keep libgomp's policy.", exc_info=True)
    finally:
        ready.set()
    while True:
        applied = _releases.get()
        with _lock:
            _holders -= 1
            done = _holders == 0
            if done:
                _thread = None  # a later hold starts a new guard
        if applied is not None:
            applied.set()
        if done:
            return  # the OpenMP team is freed on thread exit


def hold_polite_waits() -> Callable[[], None]:
    """Keep the guard thread alive until the returned `release` is called (idempotent; reference counted).

    Blocks until the guard's team exists, so the policy holds from the caller's next op on. `release()` waits until
    the guard has applied it."""
    global _holders, _thread
    with _lock:
        _holders += 1
        if _thread is None:
            ready = threading.Event()
            _thread = threading.Thread(target=_guard, args=(ready,), name=_THREAD_NAME, daemon=True)
            _thread.start()
            ready.wait()
            logger.debug("OpenMP guard thread started: parked OpenMP workers now sleep instead of spinning.")
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        applied = threading.Event()
        _releases.put(applied)
        applied.wait()

    return release


def hold_polite_waits_while_alive(owner: object) -> None:
    """Hold the guard until `owner` is garbage collected (or the interpreter exits). The finalizer only queues the
    release (see module docstring), so it cannot deadlock whatever the collecting thread holds."""
    hold_polite_waits()
    weakref.finalize(owner, _releases.put, None)


def polite_waits_held() -> bool:
    """Whether the guard thread is alive (some holder holds it)."""
    thread = _thread
    return thread is not None and thread.is_alive()
