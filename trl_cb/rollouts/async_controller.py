"""`AsyncRolloutController`: the async core (`async_core.py`) on this process's CB engine, the trainer's own.

The engine's own thread produces; the core, called from the trainer's thread, keeps it fed and hands whole groups to
the trainer (bounded, exactly once, FIFO, staleness, resume, metrics: `async_core.py`). Where the engine runs is the
backend's business (details and measurements: docs/async.md, docs/architecture.md):
- `engine_backend.EngineBackend` (the default): on the training module, taking turns with the trainer (the engine runs
  only inside `take`, holding the module lock);
- `overlap.OverlapEngineBackend` (`overlap=True`): on a view of the training weights, generating through the trainer's
  forward and backward and paused only for the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Unpack

from transformers import PreTrainedModel

from .async_core import AsyncOptions, AsyncRollouts
from .engine_backend import EngineBackend, LocalEngineBackend
from .generator import ContinuousBatchingGenerator
from .overlap import OverlapEngineBackend

__all__ = ["AsyncRolloutController"]


class AsyncRolloutController(AsyncRollouts[LocalEngineBackend]):
    """The async core on the trainer's engine: `AsyncRollouts(EngineBackend(...), ...)`, or with `overlap=True`
    `AsyncRollouts(OverlapEngineBackend(...), ...)`.

    Args:
        generator: The trainer's generator (its engine is reused; block sharing is turned off).
        module: The plain transformers model the engine runs (single process or DDP: parameters are local).
        prompt_stream, num_generations, groups_per_step, prefetch_depth, max_staleness, keep_stale, timeout: as for
            `AsyncRollouts`.
        max_prompt_len: Covers every prompt the stream will yield (the engine is sized for it; a longer prompt raises
            `ValueError` at submission): the trainer passes its dataset's longest prompt.
        overlap: Run the engine on a view of the weights, alongside the trainer (`overlap.py`).
        engine_threads: With `overlap`, on CPU: the engine's intra-op threads (`None`: the caller's count).
    """

    def __init__(
        self,
        generator: ContinuousBatchingGenerator,
        module: PreTrainedModel,
        prompt_stream: Iterator[tuple[Any, list[int]]],
        *,
        max_prompt_len: int,
        overlap: bool = False,
        engine_threads: int | None = None,
        **options: Unpack[AsyncOptions],
    ) -> None:
        num_generations = options["num_generations"]
        if overlap:
            backend: LocalEngineBackend = OverlapEngineBackend(
                generator, module, num_generations, max_prompt_len, engine_threads
            )
        elif engine_threads is not None:
            raise ValueError("engine_threads sets the overlapping engine's threads: it needs overlap=True.")
        else:
            backend = EngineBackend(generator, module, num_generations, max_prompt_len)
        super().__init__(backend, prompt_stream, **options)
        self.generator = generator
        self.module = module
