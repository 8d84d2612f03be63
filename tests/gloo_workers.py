"""Two spawned worker processes on one gloo rendezvous, for tests of collectives: started, awaited with a deadline,
and killed on failure (only the two started here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

from trl_cb.serving.weight_sync import free_port


def run_two_workers(worker: Callable[..., None], report: Path, label: str, timeout: float = 120.0) -> float:
    """Run `worker(rank, port, str(report))` on 2 spawned processes; return the seconds they took."""
    context = mp.start_processes(worker, (free_port(), str(report)), nprocs=2, join=False, start_method="spawn")
    start, deadline = time.monotonic(), time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, f"{label} workers did not finish within {timeout:.0f} s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    elapsed = time.monotonic() - start
    print(f"\n2-process {label}: {elapsed:.1f} s")
    return elapsed
