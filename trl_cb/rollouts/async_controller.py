"""`AsyncRolloutController`: keeps the CB engine generating across training steps, with bounded staleness.

The engine's own thread produces; the controller, called from the trainer's thread, keeps it fed with the prompts of
the next `prefetch_depth` steps and hands whole groups (all G samples of a prompt) to the trainer. No thread of its
own, so nothing to leak. Invariants (details and measurements: docs/async.md, docs/architecture.md):
- Bounded: at most `(prefetch_depth + 1) * groups_per_step` groups submitted and not consumed.
- Exactly once: every submitted group is handed out or dropped (counted) once, never split; FIFO order.
- Versions: a token sampled between weight updates k-1 and k has version k-1; staleness of a group = current version
  - its oldest token's; groups above `max_staleness` are dropped unless `keep_stale`. IS uses recorded logprobs.
- Exclusive: the engine runs only inside `take`, holding `guards.module_lock(module)`, in eval mode on the generation
  weights; whenever it is held the module has its own training tensors and mode.
- Errors in the engine, and Ctrl-C inside `take`, reach the trainer's thread; `stop` hard-stops (nothing drains).
- Resumable: `consumed_groups` counts stream items handed out or dropped; restarting the stream there replays nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..engine import _upstream, guards
from ..engine.sizing import Workload
from .engine_hold import EngineHold
from .generator import ContinuousBatchingGenerator
from .rollout_groups import InFlightGroups, RolloutGroup

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


@dataclass
class AsyncMetrics:
    """Emitted every step, every name, zeros included."""

    queue_depth: int = 0
    inflight_groups: int = 0
    wait_time_s: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    dropped_groups: int = 0
    dropped_total: int = 0
    tokens_per_s: float = 0.0
    engine_occupancy: float = 0.0
    policy_version: int = 0

    def as_dict(self, prefix: str = "async/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in vars(self).items()}


class AsyncRolloutController:
    """Feeds a persistent CB engine ahead of the trainer and returns finished groups (see module docstring).

    Args:
        generator: The trainer's generator (its engine is reused; block sharing is turned off).
        module: The plain transformers model the engine runs (single process or DDP: parameters are local).
        prompt_stream: An endless iterator of `(row, prompt_ids)` pairs, in the order they should be sampled.
        num_generations: Samples per prompt (G).
        groups_per_step: Groups the trainer consumes per call of `take`.
        prefetch_depth: Steps of prompts kept submitted ahead of the current one.
        max_staleness: Largest accepted staleness, in weight updates.
        keep_stale: Keep (and IS-correct) groups above `max_staleness` instead of dropping them.
        timeout: Seconds `take` may wait for rollouts before raising `TimeoutError` (`None`: no limit).
    """

    def __init__(
        self,
        generator: ContinuousBatchingGenerator,
        module: PreTrainedModel,
        prompt_stream: Iterator[tuple[Any, list[int]]],
        num_generations: int,
        groups_per_step: int,
        prefetch_depth: int = 1,
        max_staleness: int = 1,
        keep_stale: bool = False,
        timeout: float | None = None,
    ) -> None:
        validate_async_bounds(max_staleness, prefetch_depth)
        if groups_per_step <= 0 or num_generations <= 0:
            raise ValueError(f"groups_per_step and G must be > 0, got {groups_per_step}, {num_generations}.")
        _check_async_safe(module)
        self.generator = generator
        self.module = module
        self.prompt_stream = prompt_stream
        self.num_generations = num_generations
        self.groups_per_step = groups_per_step
        self.prefetch_depth = prefetch_depth
        self.max_staleness = max_staleness
        self.keep_stale = keep_stale
        self.timeout = timeout
        self.policy_version = 0
        self._groups = InFlightGroups()
        self._manager: _upstream.ContinuousBatchingManager | None = None
        self._dropped_total = 0
        self._since = time.perf_counter()
        self._hold = EngineHold(generator, module)
        self._max_prompt_len = 0
        #: Stream items handed to the trainer or dropped, in stream order (the resume position; see module docs).
        self.consumed_groups = 0
        self._drawn = 0  # stream items drawn so far
        self._lock = guards.module_lock(module)
        self._close_priority = 0  # at exit, release the held engine before generators are closed
        guards.close_at_exit(self)

    # ------------------------------------------------------------------------------------------------ lifecycle

    @property
    def capacity_groups(self) -> int:
        return (self.prefetch_depth + 1) * self.groups_per_step

    def start(self, max_prompt_len: int) -> None:
        """Build (or reuse) the engine, sized for every group that may be in flight, and fill it.

        `max_prompt_len` must cover every prompt the stream will yield (a longer one raises `ValueError` at
        submission): the trainer passes its dataset's longest prompt."""
        if self._manager is not None:
            return
        max_new = int(self.generator.generation_config.max_new_tokens)
        requests = self.capacity_groups * self.num_generations
        workload = Workload(requests, max_prompt_len, max_new, self.capacity_groups * max_prompt_len)
        self._max_prompt_len = max_prompt_len
        with guards.acquired(self._lock), guards.deferred_interrupts():
            self._hold.apply_generation_weights()  # the engine (and its KV cache dtype) is built on these weights
            try:
                self._manager = self._hold.manager = self.generator.engine_for(self.module, workload)
            except BaseException:
                self._hold.restore_training_weights()
                raise
            self._hold.mode_before_run = self.module.training
            self._hold.hold()  # the trainer owns the model; the engine runs only inside `take`
        self._top_up()

    def stop(self) -> None:
        """Hard-stop the engine (in-flight groups are abandoned, not generated; the thread has exited on return) and
        give the module back its train/eval mode. Safe to call twice; interrupt-safe like `generator.close`."""
        with guards.deferred_interrupts(), guards.acquired(self._lock):
            self._stop()

    def _stop(self) -> None:
        manager = self._manager
        if manager is not None:
            # Ask for the hard stop while the engine is still held: once released, the loop exits after at most one
            # batch instead of generating what is in flight. That batch runs in eval mode, like every engine forward.
            _upstream.request_hard_stop(manager)
            self.module.eval()
            self._hold.apply_generation_weights()  # that batch must read the weights the KV cache was built with
        self._hold.depth = 0
        try:
            self._hold.unpause()
            self.generator.close()
            if manager is not None:
                self.module.train(self._hold.mode_before_run)
            self._manager = self._hold.manager = None
            self._groups.clear()
        finally:
            self._hold.restore_training_weights()

    def _close_at_exit(self) -> None:
        if self._manager is not None and self._lock.acquire(timeout=10):
            try:
                self._stop()
            finally:
                self._lock.release()

    # ------------------------------------------------------------------------------------------ holds, updates

    def hold(self) -> None:
        """Pause the engine (reentrant; `engine_hold.py`): it runs only inside `take`."""
        self._hold.hold()

    def release(self) -> None:
        self._hold.release()

    def begin_weight_update(self) -> None:
        """Hold the engine for an in-place weight update and record where each in-flight request stands."""
        if self._manager is None:
            return
        self.hold()
        self._groups.mark_weight_update(self._manager, self.policy_version + 1)

    def end_weight_update(self) -> None:
        """Bump the policy version and release the hold: in-flight requests continue on the new weights."""
        if self._manager is None:
            return
        self.policy_version += 1
        self.release()

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        self.begin_weight_update()
        try:
            yield
        finally:
            self.end_weight_update()

    # ---------------------------------------------------------------------------------------------- consumption

    def take(
        self, num_groups: int, on_wait: Callable[[float], None] | None = None
    ) -> tuple[list[RolloutGroup], AsyncMetrics]:
        """Block until `num_groups` acceptable groups are ready; return them (oldest first) and this step's metrics."""
        if self._manager is None:
            raise RuntimeError("AsyncRolloutController.take() called before start().")
        start = time.perf_counter()
        deadline = None if self.timeout is None else start + self.timeout
        taken: list[RolloutGroup] = []
        dropped = 0
        with guards.acquired(self._lock, self.timeout), guards.deferred_interrupts() as interrupts:
            with self._hold.running():
                dropped = self._fill(taken, num_groups, deadline, interrupts)
        self._dropped_total += dropped
        self.consumed_groups += len(taken) + dropped
        if dropped:
            logger.info("Dropped %d rollout group(s) older than max_staleness=%d.", dropped, self.max_staleness)
        now = time.perf_counter()
        staleness = [self.policy_version - g.oldest_version for g in taken]
        metrics = AsyncMetrics(
            queue_depth=len(self._groups.ready),
            inflight_groups=len(self._groups.pending),
            wait_time_s=now - start,
            staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            dropped_groups=dropped,
            dropped_total=self._dropped_total,
            tokens_per_s=self._groups.take_token_count() / max(now - self._since, 1e-9),
            engine_occupancy=self._groups.inflight_requests / max(self.capacity_groups * self.num_generations, 1),
            policy_version=self.policy_version,
        )
        self._since = now
        return taken, metrics

    # ------------------------------------------------------------------------------------------------ internals

    def _fill(
        self,
        taken: list[RolloutGroup],
        num_groups: int,
        deadline: float | None,
        interrupts: guards.InterruptShield,
    ) -> int:
        """Move acceptable groups into `taken` (FIFO: no bias towards short completions); return how many were
        dropped for staleness."""
        dropped = 0
        while len(taken) < num_groups:
            interrupts.check()  # Ctrl-C: raise now; `running` holds the engine again on the way out
            self._groups.collect(self._manager)
            while self._groups.ready and len(taken) < num_groups:
                group = self._groups.ready.popleft()
                if self.policy_version - group.oldest_version > self.max_staleness and not self.keep_stale:
                    dropped += 1
                    continue
                taken.append(group)
            self._top_up()
            if len(taken) < num_groups:
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"No rollouts within {self.timeout} s ({len(taken)}/{num_groups} groups).")
                self._groups.wait(self._manager, _POLL_SECONDS)
        return dropped

    def _top_up(self) -> None:
        max_new = int(self.generator.generation_config.max_new_tokens)
        while len(self._groups) < self.capacity_groups:
            row, prompt_ids = next(self.prompt_stream)
            self._drawn += 1
            self._validate(prompt_ids)
            self._groups.submit(self._manager, row, prompt_ids, self.num_generations, max_new, self.policy_version)

    def _validate(self, prompt_ids: list[int]) -> None:
        """The synchronous checks, then the length the engine was sized for (a longer prompt cannot be scheduled)."""
        item = self._drawn - 1  # this prompt's place in the stream
        try:
            self.generator.validate_prompts([prompt_ids], self.module)
        except ValueError as err:
            raise ValueError(f"Async prompt stream item {item}: {err}") from None
        if len(prompt_ids) > self._max_prompt_len:
            raise ValueError(
                f"Async prompt stream item {item} has {len(prompt_ids)} tokens, more than max_prompt_len="
                f"{self._max_prompt_len} the engine was sized for in start(); pass the longest prompt of the stream."
            )


def validate_async_bounds(max_staleness: int | None, prefetch_depth: int) -> None:
    """`ValueError` unless the staleness bound (`None`: derived later) and the prefetch depth are >= 0."""
    if (max_staleness is not None and max_staleness < 0) or prefetch_depth < 0:
        raise ValueError(f"max_staleness and prefetch_depth must be >= 0, got {max_staleness}, {prefetch_depth}.")


def _check_async_safe(module: torch.nn.Module) -> None:
    """The engine keeps the attention implementation it was built with for its whole life, while the trainer trains
    between rounds: refuse implementations CB would switch on the shared config (eager -> paged|eager), which would
    route the training forward through the paged path. (Dropout needs no check: the engine only samples with the
    module in eval mode.)"""
    if _upstream.attention_implementation(module) in ("eager", "paged|eager"):
        raise ValueError(
            "async_generation needs an attention implementation the engine can share with training (sdpa or flash); "
            "with 'eager' the engine would switch the shared config to 'paged|eager' under the training forward."
        )
