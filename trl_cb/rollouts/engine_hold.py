"""Who may run a forward of the shared module now: the async engine or the trainer, never both.

A CB forward and another forward of the same module at the same time corrupt each other's results (measured: logprobs
off by up to 1.5 nats), and the engine must sample in eval mode on the generation weights while the trainer needs its
own mode and tensors. So the engine is paused ("held", reentrant) except while released; on every hold the module
gets back its training tensors and mode, on the last release the generation weights and eval mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers import PreTrainedModel

from ..engine import _upstream
from .generator import ContinuousBatchingGenerator

__all__ = ["EngineHold"]


class EngineHold:
    """Holds (pauses) one engine running `module`; `manager` is set once the engine exists (no-op before)."""

    def __init__(self, generator: ContinuousBatchingGenerator, module: PreTrainedModel) -> None:
        self.generator = generator
        self.module = module
        self.manager: _upstream.ContinuousBatchingManager | None = None
        self.depth = 0
        #: The module's train/eval mode while the trainer owns it (restored on every hold).
        self.mode_before_run = module.training
        self._pause: contextlib.ExitStack | None = None
        self._weights: contextlib.ExitStack | None = None  # generation-dtype copies applied (engine may run)

    def hold(self) -> None:
        """Pause the engine (reentrant): no engine forward runs until every `hold` is matched by a `release`."""
        if self.manager is None:
            return
        if self.depth == 0:
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(self.manager.pause())
                self._pause = stack
            except RuntimeError:
                # A dead engine runs nothing, so there is nothing to hold; its own error is reported by `take`.
                if self.manager.is_running() and _upstream.engine_fatal_error(self.manager) is None:
                    raise
            self.restore_training_weights()  # paused: the trainer (and its optimizer) sees its own tensors
            self.module.train(self.mode_before_run)
        self.depth += 1

    def release(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            # The engine must sample in eval mode: in train mode TRL's default gradient checkpointing (and any
            # dropout) changes the forward (measured: logprobs off by up to 2 nats).
            self.mode_before_run = self.module.training
            self.module.eval()
            self.apply_generation_weights()  # refreshed from the (possibly just updated) training weights
            self.unpause()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Let the engine run (drop every hold) for the duration, then restore the same number of holds."""
        depth = self.depth
        for _ in range(depth):
            self.release()
        try:
            yield
        finally:
            for _ in range(depth):
                self.hold()

    def unpause(self) -> None:
        """Let the engine run whatever the depth (`release` at depth 0, or a stop that must let it exit)."""
        if self._pause is not None:
            self._pause.close()
            self._pause = None

    def apply_generation_weights(self) -> None:
        """Point the module at the generator's generation-dtype copies (bf16/fp16 training; else a no-op)."""
        if self._weights is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.generator.generation_weights(self.module))
            self._weights = stack

    def restore_training_weights(self) -> None:
        if self._weights is not None:
            stack, self._weights = self._weights, None
            stack.close()
