"""The overlap engine's own CUDA stream E: every kernel the engine's thread queues (batch preparation, forward,
sampling, read-back) goes to one stream created once per overlap backend on the model's device. On the default
stream the engine's steps and the trainer's forward and backward would be one queue, and nothing would overlap.

Invariants (the only points where E and the trainer's current stream T meet):
- start (`adopt`): E waits for T (warm-up and generation-dtype copies were written on T);
- optimizer step (`before_weight_write`, inside the pause): T waits for E, so no queued engine kernel still reads a
  weight the optimizer writes; resume (`after_weight_write`, before the engine leaves the pause): E waits for T, so
  the engine's next step reads the optimizer's writes and the refreshed generation copies;
- stop (`synchronize`): E has finished before its memory (KV cache, copies) returns to the caching allocator.
The trainer reads nothing E writes on the device: results cross as host lists, read on the engine's thread after E
finished (upstream's read-back synchronises it). CPU: no stream (`for_device`). docs/async.md, "The engine's CUDA
stream".
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching import ContinuousBatchingManager

from . import _upstream_patches

__all__ = ["EngineStream"]

#: The stream API (`Stream`, `current_stream`, `stream`); tests put a recording fake here to check the ordering on CPU.
_cuda: Any = torch.cuda


class EngineStream:
    """E and the upstream streams the engine's steps use (`adopt`), ordered against the caller's stream T."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = _cuda.Stream(device=device)
        self._streams = [self.stream]  # E, plus upstream's own streams under async batching

    @classmethod
    def for_device(cls, device: torch.device) -> EngineStream | None:
        """A stream on CUDA devices, `None` elsewhere (CPU: nothing to order)."""
        return cls(device) if device.type == "cuda" else None

    def adopt(self, manager: ContinuousBatchingManager) -> None:
        """Before the engine's thread starts: it runs its whole loop on E, the forward included; E starts after what
        the caller queued so far."""
        self._streams = [self.stream, *_upstream_patches.adopt_compute_stream(manager, self.stream)]
        _upstream_patches.run_loop_in(manager, lambda: _cuda.stream(self.stream))
        self.after_weight_write()

    def before_weight_write(self) -> None:
        """The caller's stream waits for the engine's queued work (call inside the pause, before writing weights)."""
        trainer = _cuda.current_stream(self.device)
        for stream in self._streams:
            trainer.wait_stream(stream)

    def after_weight_write(self) -> None:
        """The engine's streams wait for the caller's queued work (call after writing weights, before resuming)."""
        trainer = _cuda.current_stream(self.device)
        for stream in self._streams:
            stream.wait_stream(trainer)

    def synchronize(self) -> None:
        """Block until the engine's queued work is done (before its memory is released)."""
        for stream in self._streams:
            stream.synchronize()
