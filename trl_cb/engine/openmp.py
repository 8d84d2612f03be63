"""Keep CPU training fast on a loaded machine: make OpenMP threads sleep, not spin, while they wait for work.

Why (mechanism and figures: docs/index.md "CPU threads", docs/benchmark-log.md "Threads and load"): libgomp's parked
workers spin ~300,000 iterations after each parallel region unless the process has more OpenMP team threads than
CPUs; spinning is fast on an idle machine and up to 20x slower when other processes want the cores. While a holder
lives (a generator with `openmp_guard` / `cb_openmp_guard`; unset: on only where `guard_helps`), one parked thread of
ours owns a 2-thread team and blocks on a queue (no CPU), so every team in the process waits politely. Process-wide.

Invariants: reference counted (the guard lives while any holder does); a release never takes a lock, so a release
from a garbage-collection finalizer cannot deadlock whatever the collecting thread holds: it is queued
(`queue.SimpleQueue.put` is reentrant) and applied by the guard thread, which exits when the count reaches zero.
With Intel's OpenMP or a torch without OpenMP the guard is a harmless parked thread.
Small CPU engine steps (decode) run on one intra-op thread (`step_threads`): with polite waits every parallel region
pays a wake-up, which costs more than a small step's parallel work gains (docs/benchmark-log.md, "Per-token cost").
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "SINGLE_THREAD_STEP_WORK",
    "guard_helps",
    "hold_polite_waits",
    "hold_polite_waits_while_alive",
    "polite_waits_held",
    "step_threads",
]

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


#: An engine step whose work (query tokens x hidden size) is below this runs on one intra-op thread. Measured on
#: 2 cores (engine thread, polite waits): a 32-row decode forward of the 64-wide model takes 1.8-2.0 ms on one thread
#: vs 3.5-5.9 ms on two, of the 256-wide 8-layer one 20 vs 21-28 ms; an 800-token prefill of the latter 235-245 vs
#: 150-167 ms.
SINGLE_THREAD_STEP_WORK = 65_536


def step_threads(num_tokens: int, hidden_size: int, threads: int) -> int:
    """Intra-op threads for a CPU engine step of `num_tokens` query tokens: 1 below `SINGLE_THREAD_STEP_WORK`, else
    `threads` (the process's setting)."""
    return 1 if num_tokens * hidden_size < SINGLE_THREAD_STEP_WORK else threads


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
