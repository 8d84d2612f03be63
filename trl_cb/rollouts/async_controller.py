"""Async rollouts: keep the CB engine busy across training steps, with bounded staleness.

Roles: the CB engine's own thread is the producer (it never waits for a step boundary); `AsyncRolloutController`,
called from the trainer's thread, keeps it fed with prompts for upcoming steps, collects finished *groups* (all G
samples of a prompt), tags every token with the policy version that sampled it, and hands whole groups to the
trainer. There is no extra thread, so there is nothing to leak. The engine and the trainer never run a forward of the
model at the same time (see `hold`): the engine runs while the trainer waits for rollouts, with its batch kept full
by the in-flight stragglers and the prompts of the next `prefetch_depth` steps, and it never drains at a step
boundary: requests in flight stay in flight across training steps and weight updates.

Invariants:
- Bounded: at most `(prefetch_depth + 1) * groups_per_step` groups are submitted-but-not-consumed at any time.
- Every submitted group is either handed to the trainer exactly once or dropped exactly once (counted); a group is
  never split.
- Versions: `policy_version` counts weight updates made under `weight_update()`. A token sampled before update k
  and after update k-1 has version k-1. Updates happen while the engine is paused; requests in flight then continue
  on the new weights (partial rollouts) on top of the KV cache they have.
- Staleness of a group = current version - the oldest version of any of its tokens. Groups above `max_staleness`
  are dropped (or kept, if `keep_stale`), and IS always uses the behaviour logprobs recorded when each token was
  sampled, so tokens from before and after an update are both corrected.
- Groups are handed out in submission order (FIFO), so short completions are not favoured; a straggler delays only
  its own group while the engine keeps working on later prompts.
- Errors inside the engine (a failed request, a dead thread) are raised in the trainer's thread on its next call.
- Precision: with bf16/fp16 training the engine samples from low-precision copies of the weights (the generator's
  `generation_weights`), applied only while the engine may run and refreshed from the training weights each time it
  is released; whenever it is held, the module holds its own training tensors (dtype and values untouched), so the
  trainer and the optimizer never see a copy. The KV cache is built in the generation dtype, as in the sync path.
- Every prompt is validated before submission (the synchronous generator's checks, plus the prompt length the engine
  was sized for in `start`): a bad row raises `ValueError` naming it instead of failing inside the engine.
- Exclusive: the engine runs only while `lifecycle.module_lock(module)` is held (in `start`, `take`, `stop`), so a
  synchronous generator round on the same model waits instead of running alongside it. Ctrl-C inside `take` is
  raised once the engine is held again; `stop` hard-stops the engine (in-flight groups are abandoned, not generated).
- Resumable: `consumed_groups` counts the stream items handed out or dropped; a resumed run that restarts the stream
  there replays no trained prompt (in-flight, unconsumed groups are regenerated).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from ..engine import _upstream
from ..engine import guards as lifecycle
from ..engine.sizing import Workload
from ..errors import EngineDiedError, GenerationError
from .generator import ContinuousBatchingGenerator, validate_prompts

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


@dataclass
class RolloutGroup:
    """All samples of one prompt, in submission order, with per-token behaviour logprobs and policy versions.

    `logprobs` are of the processed distribution each token was sampled from, `policy_logprobs` of the same
    sampler's `log_softmax(logits / T)` (TRL's training quantity; what IS compares): see `GenerationResult`."""

    row: Any  # the dataset row the prompt came from (rewards need its other fields)
    prompt_ids: list[int]
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    policy_logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    submitted_version: int = 0

    @property
    def oldest_version(self) -> int:
        return min((v[0] for v in self.versions if v), default=self.submitted_version)


@dataclass
class _Pending:
    group: RolloutGroup
    request_ids: list[str]
    # per request: generated-token counts at each weight update while it was in flight, as (count, new version)
    boundaries: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)


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
        if prefetch_depth < 0 or max_staleness < 0 or groups_per_step <= 0 or num_generations <= 0:
            raise ValueError("prefetch_depth and max_staleness must be >= 0; groups_per_step and G must be > 0.")
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
        self._pending: deque[_Pending] = deque()  # submission order
        self._ready: deque[RolloutGroup] = deque()
        self._by_request: dict[str, _Pending] = {}
        self._manager: _upstream.ContinuousBatchingManager | None = None
        self._next_id = 0
        self._dropped_total = 0
        self._tokens_since = 0
        self._since = time.perf_counter()
        self._holds = 0
        self._hold_stack: contextlib.ExitStack | None = None
        self._weights_stack: contextlib.ExitStack | None = None  # generation-dtype copies applied (engine may run)
        self._mode_before_run = module.training
        self._max_prompt_len = 0
        #: Stream items handed to the trainer or dropped, in stream order (the resume position; see module docs).
        self.consumed_groups = 0
        self._drawn = 0  # stream items drawn so far
        self._lock = lifecycle.module_lock(module)
        self._close_priority = 0  # at exit, release the held engine before generators are closed
        lifecycle.close_at_exit(self)

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
        with lifecycle.acquired(self._lock), lifecycle.deferred_interrupts():
            self._apply_generation_weights()  # the engine (and its KV cache dtype) is built on the generation weights
            try:
                self._manager = self.generator.engine_for(self.module, workload)
            except BaseException:
                self._restore_training_weights()
                raise
            self._mode_before_run = self.module.training
            self.hold()  # the trainer owns the model; the engine runs only inside `take`
        self._top_up()

    def stop(self) -> None:
        """Hard-stop the engine (in-flight groups are abandoned, not generated; the thread has exited on return) and
        give the module back its train/eval mode. Safe to call twice; interrupt-safe like `generator.close`."""
        with lifecycle.deferred_interrupts(), lifecycle.acquired(self._lock):
            self._stop()

    def _stop(self) -> None:
        manager = self._manager
        if manager is not None:
            # Ask for the hard stop while the engine is still held: once released, the loop exits after at most one
            # batch instead of generating what is in flight. That batch runs in eval mode, like every engine forward.
            _upstream.request_hard_stop(manager)
            self.module.eval()
            self._apply_generation_weights()  # that batch must read the weights the KV cache was built with
        self._holds = 0
        try:
            if self._hold_stack is not None:
                self._hold_stack.close()
                self._hold_stack = None
            self.generator.close()
            if manager is not None:
                self.module.train(self._mode_before_run)
            self._manager = None
            self._pending.clear()
            self._by_request.clear()
            self._ready.clear()
        finally:
            self._restore_training_weights()

    def _close_at_exit(self) -> None:
        if self._manager is not None and self._lock.acquire(timeout=10):
            try:
                self._stop()
            finally:
                self._lock.release()

    # ------------------------------------------------------------------------------------------ holds, updates

    def hold(self) -> None:
        """Pause the engine (reentrant): no engine forward runs until every `hold` is matched by a `release`.

        Why the engine runs only inside `take`: a CB forward and another forward of the same module running at the
        same time corrupt each other's results (measured: logprobs off by up to 1.5 nats; two plain concurrent
        forwards are exact), and the engine must sample in eval mode while the trainer needs train mode (TRL's
        default gradient checkpointing changes the forward; TRL's logging reads `model.training`). So the engine is
        held from `start` on and released only while the trainer waits for rollouts.
        """
        if self._manager is None:
            return
        if self._holds == 0:
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(self._manager.pause())
                self._hold_stack = stack
            except RuntimeError:
                # A dead engine runs nothing, so there is nothing to hold; its own error is reported by `take`.
                if self._manager.is_running() and _upstream.engine_fatal_error(self._manager) is None:
                    raise
            self._restore_training_weights()  # paused: the trainer (and its optimizer) sees its own tensors
            self.module.train(self._mode_before_run)
        self._holds += 1

    def release(self) -> None:
        if self._holds == 0:
            return
        self._holds -= 1
        if self._holds == 0:
            self._let_engine_run()

    def _let_engine_run(self) -> None:
        # The engine must sample from the model in eval mode: in train mode TRL's default gradient checkpointing
        # (and any dropout) changes the forward (measured: logprobs off by up to 2 nats).
        self._mode_before_run = self.module.training
        self.module.eval()
        self._apply_generation_weights()  # refreshed from the (possibly just updated) training weights
        if self._hold_stack is not None:
            self._hold_stack.close()
            self._hold_stack = None

    def _apply_generation_weights(self) -> None:
        """Point the module at the generator's generation-dtype copies (bf16/fp16 training; else a no-op)."""
        if self._weights_stack is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.generator.generation_weights(self.module))
            self._weights_stack = stack

    def _restore_training_weights(self) -> None:
        if self._weights_stack is not None:
            stack, self._weights_stack = self._weights_stack, None
            stack.close()

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Let the engine run (drop every hold) for the duration, then restore the same number of holds."""
        depth = self._holds
        for _ in range(depth):
            self.release()
        try:
            yield
        finally:
            for _ in range(depth):
                self.hold()

    def begin_weight_update(self) -> None:
        """Hold the engine for an in-place weight update and record where each in-flight request stands."""
        if self._manager is None:
            return
        self.hold()
        lengths = _upstream.inflight_generated_lengths(self._manager)
        new_version = self.policy_version + 1
        for rid, pending in self._by_request.items():
            if rid not in pending.outputs:  # finished requests keep their (older) versions
                pending.boundaries.setdefault(rid, []).append((lengths.get(rid, 0), new_version))

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
        with lifecycle.acquired(self._lock, self.timeout), lifecycle.deferred_interrupts() as interrupts:
            with self._running():
                dropped = self._fill(taken, num_groups, deadline, interrupts)
        self._dropped_total += dropped
        self.consumed_groups += len(taken) + dropped
        if dropped:
            logger.info("Dropped %d rollout group(s) older than max_staleness=%d.", dropped, self.max_staleness)
        now = time.perf_counter()
        staleness = [self.policy_version - g.oldest_version for g in taken]
        inflight = sum(len(p.request_ids) - len(p.outputs) for p in self._pending)
        metrics = AsyncMetrics(
            queue_depth=len(self._ready),
            inflight_groups=len(self._pending),
            wait_time_s=now - start,
            staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            dropped_groups=dropped,
            dropped_total=self._dropped_total,
            tokens_per_s=self._tokens_since / max(now - self._since, 1e-9),
            engine_occupancy=inflight / max(self.capacity_groups * self.num_generations, 1),
            policy_version=self.policy_version,
        )
        self._tokens_since, self._since = 0, now
        return taken, metrics

    # ------------------------------------------------------------------------------------------------ internals

    def _fill(
        self,
        taken: list[RolloutGroup],
        num_groups: int,
        deadline: float | None,
        interrupts: lifecycle.InterruptShield,
    ) -> int:
        """Move acceptable groups into `taken` (FIFO: no bias towards short completions); return how many were
        dropped for staleness."""
        dropped = 0
        while len(taken) < num_groups:
            interrupts.check()  # Ctrl-C: raise now; `_running` holds the engine again on the way out
            self._collect()
            while self._ready and len(taken) < num_groups:
                group = self._ready.popleft()
                if self.policy_version - group.oldest_version > self.max_staleness and not self.keep_stale:
                    dropped += 1
                    continue
                taken.append(group)
            self._top_up()
            if len(taken) < num_groups:
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"No rollouts within {self.timeout} s ({len(taken)}/{num_groups} groups).")
                self._wait_for_result()
        return dropped

    def _top_up(self) -> None:
        max_new = int(self.generator.generation_config.max_new_tokens)
        while len(self._pending) + len(self._ready) < self.capacity_groups:
            row, prompt_ids = next(self.prompt_stream)
            self._drawn += 1
            self._validate(prompt_ids, max_new)
            request_id = f"a{self._next_id}"
            self._next_id += 1
            rids = _upstream.add_forked_request(self._manager, prompt_ids, request_id, self.num_generations, max_new)
            pending = _Pending(
                RolloutGroup(row=row, prompt_ids=prompt_ids, submitted_version=self.policy_version), rids
            )
            self._pending.append(pending)
            for rid in rids:
                self._by_request[rid] = pending

    def _validate(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """The synchronous checks, then the length the engine was sized for (a longer prompt cannot be scheduled)."""
        item = self._drawn - 1  # this prompt's place in the stream
        try:
            validate_prompts([prompt_ids], self.module, max_new_tokens, self.generator._cb_kwargs)
        except ValueError as err:
            raise ValueError(f"Async prompt stream item {item}: {err}") from None
        if len(prompt_ids) > self._max_prompt_len:
            raise ValueError(
                f"Async prompt stream item {item} has {len(prompt_ids)} tokens, more than max_prompt_len="
                f"{self._max_prompt_len} the engine was sized for in start(); pass the longest prompt of the stream."
            )

    def _wait_for_result(self) -> None:
        result = self._manager.get_result(timeout=_POLL_SECONDS)
        if result is not None:
            self._accept(result)
            return
        error = _upstream.engine_fatal_error(self._manager)
        if error is not None or not self._manager.is_running():
            raise EngineDiedError(
                "The continuous batching engine stopped during async generation"
                + (f": {error!r}" if error is not None else ".")
            ) from error

    def _collect(self) -> None:
        while (result := self._manager.get_result(timeout=0)) is not None:
            self._accept(result)
        while self._pending and len(self._pending[0].outputs) == len(self._pending[0].request_ids):
            self._ready.append(self._finish(self._pending.popleft()))

    def _accept(self, result: Any) -> None:
        pending = self._by_request.get(result.request_id)
        if pending is None:
            logger.warning("Dropping a result for unknown request %s.", result.request_id)
            return
        if not result.is_finished():
            return
        if result.error is not None:
            raise GenerationError(result.request_id, str(result.error))
        pending.outputs[result.request_id] = result
        self._tokens_since += len(result.generated_tokens)

    def _finish(self, pending: _Pending) -> RolloutGroup:
        group = pending.group
        for rid in pending.request_ids:
            out = pending.outputs[rid]
            del self._by_request[rid]
            processed, policy = _upstream.output_logprobs(out)
            versions = [group.submitted_version] * len(out.generated_tokens)
            for count, version in pending.boundaries.get(rid, []):
                for i in range(count, len(versions)):
                    versions[i] = version
            group.completion_ids.append(list(out.generated_tokens))
            group.logprobs.append(processed)
            group.policy_logprobs.append(policy)
            group.versions.append(versions)
        return group


class PromptStream:
    """Endless stream of `(row, prompt_ids)`: row indices in a fresh seeded shuffle per epoch, from any position.

    `PromptStream(..., start=p)` yields exactly what the stream started at 0 would yield from its p-th item on
    (epoch shuffles are replayed from the seed), which is what checkpoint resume needs: no prompt a finished step
    trained on comes back.
    """

    def __init__(self, num_rows: int, seed: int, fetch: Callable[[int], tuple[Any, list[int]]], start: int = 0):
        if num_rows <= 0:
            raise ValueError("The prompt stream needs a non-empty dataset.")
        self.num_rows, self.fetch = num_rows, fetch
        self._rng = random.Random(seed)
        epoch, offset = divmod(start, num_rows)
        for _ in range(epoch):  # replay earlier epochs' shuffles: the RNG must be where the original run left it
            self._next_order()
        self._order = self._next_order()
        self._offset = offset

    def _next_order(self) -> list[int]:
        order = list(range(self.num_rows))
        self._rng.shuffle(order)
        return order

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> tuple[Any, list[int]]:
        if self._offset == self.num_rows:
            self._order, self._offset = self._next_order(), 0
        index = self._order[self._offset]
        self._offset += 1
        return self.fetch(index)


def default_max_staleness(prefetch_depth: int, optimizer_steps_per_take: float) -> int:
    """The staleness bound that drops nothing by construction when the trainer takes rollouts once every
    `optimizer_steps_per_take` (k) optimizer steps.

    Why: groups are consumed FIFO and the queue holds `prefetch_depth + 1` takes' worth, so a group submitted during
    take j is consumed by take j + prefetch_depth + 1 at the latest, and its first token was sampled at take j or
    later: its staleness is at most (prefetch_depth + 1) * k weight updates. A bound of 2 with k = 4 (GA=1,
    steps_per_generation=4) dropped 43% of the groups.
    """
    return (prefetch_depth + 1) * max(1, math.ceil(optimizer_steps_per_take))


def _check_async_safe(module: torch.nn.Module) -> None:
    """The engine keeps the attention implementation it was built with for its whole life, while the trainer trains
    between rounds: refuse implementations CB would switch on the shared config (eager -> paged|eager), which would
    route the training forward through the paged path. (Dropout needs no check: the engine only samples with the
    module in eval mode.)"""
    if module.config._attn_implementation in ("eager", "paged|eager"):
        raise ValueError(
            "async_generation needs an attention implementation the engine can share with training (sdpa or flash); "
            "with 'eager' the engine would switch the shared config to 'paged|eager' under the training forward."
        )
