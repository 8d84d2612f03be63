"""`EngineBackend`: the async core's backend on the trainer's own CB engine, taking turns with the trainer.

`LocalEngineBackend` is what it shares with the overlap backend (`overlap.OverlapEngineBackend`, the engine on a view
of the weights, alongside the trainer): groups submitted to and collected from one CB engine of this process.

- No thread of its own, so nothing to leak; the engine is sized once for `capacity_groups * G` requests and the
  longest prompt (`max_prompt_len`), and a longer prompt is refused naming its stream item.
- Versions: a token sampled between weight updates k-1 and k has version k-1 (`InFlightGroups.mark_weight_update`,
  called with the engine held). IS uses the recorded logprobs.
- Exclusive (`EngineBackend`): the engine runs only inside `take`, holding `guards.module_lock(module)`, in eval mode
  on the generation weights; whenever it is held the module has its own training tensors and mode.
- Errors in the engine, and Ctrl-C inside `take`, reach the trainer's thread; `stop` hard-stops (nothing drains).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..engine import _upstream, guards
from ..engine.sizing import Workload
from .async_core import RolloutBackend
from .engine_hold import EngineHold
from .generator import ContinuousBatchingGenerator
from .rollout_groups import InFlightGroups, RolloutGroup

__all__ = ["EngineBackend", "LocalEngineBackend"]


@dataclass(eq=False, repr=False)
class LocalEngineBackend(RolloutBackend):
    """What both in-process backends share: groups submitted to, and collected from, one CB engine of this process
    (`manager`, built by the subclass's `start`), and the prompt checks. `EngineBackend` runs it on the training
    module, taking turns with the trainer; `overlap.OverlapEngineBackend` on a view of it, alongside the trainer.

    Args:
        generator: The trainer's generator (its engine is reused; block sharing is turned off).
        module: The plain transformers model being trained (single process or DDP: parameters are local).
        num_generations: Samples per prompt (G), unless a group names its own.
        max_prompt_len: Covers every prompt the stream will yield (the engine is sized for it; a longer prompt raises
            `ValueError` at submission): the trainer passes its dataset's longest prompt.
    """

    generator: ContinuousBatchingGenerator
    module: PreTrainedModel
    num_generations: int
    max_prompt_len: int
    manager: _upstream.ContinuousBatchingManager | None = field(default=None, init=False)
    #: Prompts reuse the KV blocks of earlier ones under the same weights (multi-turn: `multi_turn.with_turns`).
    share_prefixes: bool = field(default=False, init=False)
    _groups: InFlightGroups = field(default_factory=InFlightGroups, init=False)

    def workload(self, capacity_groups: int) -> Workload:
        """Every group that may be in flight (`capacity_groups` x G requests) with the longest prompt."""
        max_new = int(self.generator.generation_config.max_new_tokens)
        requests = capacity_groups * self.num_generations
        return Workload(requests, self.max_prompt_len, max_new, capacity_groups * self.max_prompt_len, capacity_groups)

    def validate(self, prompt_ids: list[int]) -> None:
        """The synchronous checks, then the length the engine was sized for (a longer prompt cannot be scheduled)."""
        self.generator.validate_prompts([prompt_ids], self.module)
        if len(prompt_ids) > self.max_prompt_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, more than max_prompt_len={self.max_prompt_len} the engine was "
                "sized for; pass the longest prompt of the stream."
            )

    def submit(self, group: RolloutGroup) -> None:
        max_new = group.max_new_tokens or int(self.generator.generation_config.max_new_tokens)
        self._groups.submit(self.manager, group, group.num_samples or self.num_generations, max_new)

    def poll(self, timeout: float) -> list[RolloutGroup]:
        self._groups.collect(self.manager)
        if not self._groups.ready and timeout > 0:
            self._groups.wait(self.manager, timeout)  # `EngineDiedError` if the engine stopped meanwhile
            self._groups.collect(self.manager)
        finished = list(self._groups.ready)
        self._groups.ready.clear()
        return finished


@dataclass(eq=False, repr=False)
class EngineBackend(LocalEngineBackend):
    """The trainer's CB engine as a `RolloutBackend`: it shares the training module, so it runs only while held by
    `running` (the module lock, eval mode, generation weights) and is paused otherwise (`engine_hold.py`)."""

    hold: EngineHold = field(init=False)
    lock: threading.RLock = field(init=False)

    def __post_init__(self) -> None:
        _check_async_safe(self.module)
        self.hold = EngineHold(self.generator, self.module)
        self.lock = guards.module_lock(self.module)
        self._close_priority = 0  # at exit, release the held engine before generators are closed
        guards.close_at_exit(self)

    def start(self, capacity_groups: int) -> None:
        """Build (or reuse) the engine, sized for every group that may be in flight, and hold it."""
        if self.manager is not None:
            return
        workload = self.workload(capacity_groups)
        with guards.acquired(self.lock), guards.deferred_interrupts():
            self.hold.apply_generation_weights()  # the engine (and its KV cache dtype) is built on these weights
            try:
                engine = self.generator.engine_for(self.module, workload, share_prefixes=self.share_prefixes)
                self.manager = self.hold.manager = engine
            except BaseException:
                self.hold.restore_training_weights()
                raise
            self.hold.mode_before_run = self.module.training
            self.hold.hold()  # the trainer owns the model; the engine runs only inside `take`

    @contextlib.contextmanager
    def running(self, timeout: float | None) -> Iterator[None]:
        """The module lock (waited for at most `timeout` s), interrupts deferred, the engine released meanwhile."""
        with guards.acquired(self.lock, timeout), guards.deferred_interrupts(), self.hold.running():
            yield

    def begin_weight_update(self, new_version: int) -> None:
        """Hold the engine for an in-place weight update and record where each in-flight request stands."""
        if self.manager is None:
            return
        self.hold.hold()
        self._groups.mark_weight_update(self.manager, new_version)

    def end_weight_update(self) -> None:
        """Release the hold: in-flight requests continue on the new weights."""
        if self.manager is not None:
            self.hold.release()

    def stop(self) -> None:
        """Hard-stop the engine (the thread has exited on return) and give the module back its train/eval mode.
        Interrupt-safe like `generator.close`."""
        with guards.deferred_interrupts(), guards.acquired(self.lock):
            self._stop()

    def _stop(self) -> None:
        manager = self.manager
        if manager is not None:
            # Ask for the hard stop while the engine is still held: once released, the loop exits after at most one
            # batch instead of generating what is in flight. That batch runs in eval mode, like every engine forward.
            _upstream.request_hard_stop(manager)
            self.module.eval()
            self.hold.apply_generation_weights()  # that batch must read the weights the KV cache was built with
        self.hold.depth = 0
        try:
            self.hold.unpause()
            self.generator.close()
            if manager is not None:
                self.module.train(self.hold.mode_before_run)
            self.manager = self.hold.manager = None
            self._groups.clear()
        finally:
            self.hold.restore_training_weights()

    def _close_at_exit(self) -> None:
        if self.manager is not None and self.lock.acquire(timeout=10):
            try:
                self._stop()
            finally:
                self.lock.release()


def _check_async_safe(module: torch.nn.Module) -> None:
    """The engine keeps the attention implementation it was built with for its whole life, while the trainer trains
    between rounds: refuse implementations CB would switch on the shared config (eager -> paged|eager), which would
    route the training forward through the paged path. (Dropout needs no check: the engine only samples with the
    module in eval mode.)"""
    if _upstream.attention_implementation(module) in ("eager", "paged|eager"):
        raise ValueError(
            "cb_async_generation needs an attention implementation the engine can share with training (sdpa or "
            "flash); with 'eager' the engine would switch the shared config to 'paged|eager' under the training "
            "forward."
        )
