"""The continuous-batching manager internals the overlap engine's CUDA stream (`engine_stream.py`) relies on: where
the loop thread's target is looked up, and which streams the batch processor runs its steps on.

Pinned by tests/unit/test_contracts.py (`TestStreamContract`), so an upstream rename fails one cheap test instead of
leaving the engine's kernels on the device's default stream, queued behind the trainer's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from transformers.generation.continuous_batching import ContinuousBatchingManager

__all__ = ["LOOP_ATTRIBUTE", "adopt_compute_stream", "run_loop_in"]

#: The manager method `start()` hands to `threading.Thread(target=...)` (with the caller's arguments since 5.24),
#: looked up on the instance at `start()`.
LOOP_ATTRIBUTE = "_run_generation_loop"
#: Manager attribute (ours): the loop already runs inside a context (`run_loop_in` is idempotent).
_WRAPPED = "_trl_cb_loop_context"


def run_loop_in(
    manager: ContinuousBatchingManager, context: Callable[[], contextlib.AbstractContextManager[Any]]
) -> None:
    """Make every later `start()` run the engine's whole loop (batch preparation, forwards, read-back) inside
    `context()`, entered on the engine's own thread. Call before `start()`; a second call is a no-op."""
    if getattr(manager, _WRAPPED, False):
        return
    loop = getattr(manager, LOOP_ATTRIBUTE)

    @functools.wraps(loop)  # the thread keeps upstream's name (leak checks look for it)
    def loop_in_context(*args: Any, **kwargs: Any) -> None:  # 5.24 passes `use_inference_mode`, 5.23 nothing
        with context():
            loop(*args, **kwargs)

    setattr(manager, LOOP_ATTRIBUTE, loop_in_context)
    setattr(manager, _WRAPPED, True)


def adopt_compute_stream(manager: ContinuousBatchingManager, stream: Any) -> list[Any]:
    """Make `stream` the batch processor's compute stream, so the forward and sampling run on the same stream as the
    rest of the engine's thread (one in-order queue: no cross-stream hazard inside the engine). Only for synchronous
    IOs with a stream (a device that has streams; on CPU there is none and nothing changes).

    Returns the upstream streams still in use that the caller must order against the trainer as it orders `stream`:
    none, or with `use_async_batching` its compute, host-to-device and device-to-host streams (kept: their
    double-buffering is ordered by upstream's own events)."""
    processor = manager.batch_processor
    ios = processor.inputs_and_outputs
    if processor.use_async_batching:
        return [s for s in (ios.compute_stream, ios.h2d_stream, ios.d2h_stream) if s is not None]
    if ios.compute_stream is not None:
        ios.compute_stream.synchronize()  # the warm-up ran on it: done before `stream` takes over
        ios.compute_stream = stream
        processor.offloading_manager._compute_stream = stream  # its copies are ordered on the compute stream
    return []
