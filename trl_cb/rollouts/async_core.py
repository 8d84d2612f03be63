"""`AsyncRollouts`: the one async rollout core, generating ahead of the trainer on any `RolloutBackend`.

A backend submits a group and reports finished ones (in-process engine: `engine_backend.EngineBackend`; rollout
servers: `serving.remote_rollouts.ServerBackend`), as vLLM's `EngineCoreClient` has an in-process and a remote client.
The core owns everything else, once (details: docs/async.md, docs/architecture.md):
- Bounded: at most `capacity_groups = (prefetch_depth + 1) * groups_per_step` groups submitted and not handed out.
- Exactly once, FIFO: every submitted group is handed out or dropped (counted) once, whole, in stream order, whichever
  group finished first.
- Versions: staleness is `rollout_groups.staleness`; groups above `max_staleness` are dropped unless `keep_stale`.
- Errors raised by the backend, Ctrl-C (`guards.deferred_interrupts`) and `TimeoutError` reach the caller of `take`.
- Resumable: `consumed_groups` counts stream items handed out or dropped; restarting the stream there replays nothing.
- Metrics: one `TakeMeter` (`async_metrics.py`), the same definitions for every backend.
The trainers feed it from a `PromptStream`: the endless, seeded order of a dataset's prompts, resumable at any item.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Generic, Required, TypedDict, TypeVar

from ..engine import guards
from .async_metrics import AsyncMetrics, TakeMeter
from .rollout_groups import RolloutGroup, staleness

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncBounds",
    "AsyncOptions",
    "AsyncRolloutSource",
    "AsyncRollouts",
    "PromptStream",
    "RolloutBackend",
    "validate_async_bounds",
]

#: Longest single wait for a finished group inside `take` (Ctrl-C and the timeout are checked between waits).
POLL_SECONDS = 0.05


class RolloutBackend(ABC):
    """Where groups are generated. The core calls it from the trainer's thread only."""

    #: Whether groups generate while no `take` runs (overlap, servers): then a wrapper may submit from its own thread.
    generates_between_takes: bool = False

    @abstractmethod
    def start(self, capacity_groups: int) -> None:
        """Get ready for up to `capacity_groups` groups in flight (build an engine, start workers)."""

    @abstractmethod
    def submit(self, group: RolloutGroup) -> None:
        """Start generating `group` (row, prompt and `submitted_version` set); fill in its samples when done."""

    @abstractmethod
    def poll(self, timeout: float) -> list[RolloutGroup]:
        """The submitted groups that finished since the previous call, in any order, each reported once; waits up to
        `timeout` s when there is none. Raises the error that stopped a group's generation."""

    @abstractmethod
    def stop(self) -> None:
        """Hard-stop: groups in flight are abandoned. Safe to call twice."""

    def flush(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """The groups `submit`ted since the previous call form one top-up: a backend that batches requests may send
        them now, together (called after every top-up that submitted something)."""

    def validate(self, prompt_ids: list[int]) -> None:  # noqa: B027 - optional hook, a no-op by default
        """`ValueError` if this backend cannot generate `prompt_ids` (the core names the stream item)."""

    def running(self, timeout: float | None) -> AbstractContextManager[None]:
        """Held for the whole of a `take`: the backend may need exclusive use of a shared model meanwhile."""
        return contextlib.nullcontext()

    def begin_weight_update(self, new_version: int) -> None:  # noqa: B027 - optional hook
        """The trainer will change the weights: tokens sampled from `end_weight_update` on are `new_version`'s."""

    def end_weight_update(self) -> None:  # noqa: B027 - optional hook
        """The trainer's weights changed (see `begin_weight_update`)."""


class AsyncRolloutSource(ABC):
    """What the trainers' async bridge drives: the core on one process, or `trainers.remote.ScatteredRemoteRollouts`
    sharing the main process's core between ranks."""

    def __init__(self, groups_per_step: int) -> None:
        #: Groups each `take` returns to this process.
        self.groups_per_step = groups_per_step
        #: Stream items handed to the trainer or dropped, in stream order (the resume position).
        self.consumed_groups = 0
        #: The trainer's weight version: updates (in-process) or pushes (servers) so far.
        self.policy_version = 0

    @abstractmethod
    def start(self) -> None:
        """Start generating ahead (a no-op once started)."""

    @abstractmethod
    def stop(self) -> None:
        """Hard-stop; groups in flight are abandoned. Safe to call twice."""

    @abstractmethod
    def take(self, num_groups: int) -> tuple[list[RolloutGroup], AsyncMetrics]:
        """Block until `num_groups` acceptable groups are ready; return them (stream order) and this take's metrics."""

    @abstractmethod
    def begin_weight_update(self) -> None:
        """Before the optimizer changes the weights."""

    @abstractmethod
    def end_weight_update(self) -> None:
        """After the optimizer changed the weights."""

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        self.begin_weight_update()
        try:
            yield
        finally:
            self.end_weight_update()


BackendT = TypeVar("BackendT", bound=RolloutBackend)


class AsyncBounds(TypedDict, total=False):
    """`AsyncRollouts`' optional settings, as keywords."""

    prefetch_depth: int
    max_staleness: int
    keep_stale: bool
    timeout: float | None


class AsyncOptions(AsyncBounds, total=False):
    """`AsyncRollouts`' settings, as keywords (what a backend's controller and the trainers pass on)."""

    num_generations: Required[int]
    groups_per_step: Required[int]


class AsyncRollouts(AsyncRolloutSource, Generic[BackendT]):
    """Keeps `capacity_groups` groups submitted to `backend` ahead of the trainer (see the module docstring).

    Args:
        backend: Generates the groups.
        prompt_stream: An endless iterator of `(row, prompt_ids)` pairs, in the order they should be sampled.
        num_generations: Samples per prompt (G).
        groups_per_step: Groups the trainer consumes per call of `take`.
        prefetch_depth: Steps of prompts kept submitted ahead of the current one.
        max_staleness: Largest accepted staleness, in weight updates.
        keep_stale: Keep (and IS-correct) groups above `max_staleness` instead of dropping them.
        timeout: Seconds `take` may wait for rollouts before raising `TimeoutError` (`None`: no limit).
        clock: Read for the metrics only (start and end of each take).
    """

    def __init__(
        self,
        backend: BackendT,
        prompt_stream: Iterator[tuple[Any, list[int]]],
        num_generations: int,
        groups_per_step: int,
        prefetch_depth: int = 1,
        max_staleness: int = 1,
        keep_stale: bool = False,
        timeout: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        validate_async_bounds(max_staleness, prefetch_depth)
        if groups_per_step <= 0 or num_generations <= 0:
            raise ValueError(f"groups_per_step and G must be > 0, got {groups_per_step}, {num_generations}.")
        super().__init__(groups_per_step)
        self.backend = backend
        self.prompt_stream = prompt_stream
        self.num_generations = num_generations
        self.prefetch_depth = prefetch_depth
        self.max_staleness = max_staleness
        self.keep_stale = keep_stale
        self.timeout = timeout
        self._queue: deque[RolloutGroup] = deque()  # submitted, not handed out: stream order
        self._unfinished: dict[int, RolloutGroup] = {}  # by id: in `_queue`, not reported finished
        self._drawn = 0  # stream items drawn so far
        self._started = False
        self._meter = TakeMeter(clock)

    @property
    def capacity_groups(self) -> int:
        return (self.prefetch_depth + 1) * self.groups_per_step

    @property
    def pending_groups(self) -> tuple[RolloutGroup, ...]:
        """The groups submitted and not yet handed out or dropped, in stream order (a snapshot, for diagnostics and
        benchmarks: a group's samples are filled in once its backend has them)."""
        return tuple(self._queue)

    @property
    def outstanding_groups(self) -> int:
        """Groups submitted and not yet handed out or dropped (never more than `capacity_groups`)."""
        return len(self._queue)

    def start(self) -> None:
        """Start the backend and fill it (a no-op when started)."""
        if self._started:
            return
        self.backend.start(self.capacity_groups)
        self._started = True
        self._top_up()

    def stop(self) -> None:
        """Hard-stop the backend (in-flight groups are abandoned). Safe to call twice."""
        self.backend.stop()
        self._started = False
        self._queue.clear()
        self._unfinished.clear()

    def begin_weight_update(self) -> None:
        if self._started:
            self.backend.begin_weight_update(self.policy_version + 1)

    def end_weight_update(self) -> None:
        """Bump the policy version: tokens sampled from now on are the new weights'."""
        if self._started:
            self.policy_version += 1
            self.backend.end_weight_update()

    def take(self, num_groups: int) -> tuple[list[RolloutGroup], AsyncMetrics]:
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.take() called before start().")
        started = self._meter.clock()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        taken: list[RolloutGroup] = []
        dropped, wait = 0, 0.0
        with self.backend.running(self.timeout), guards.deferred_interrupts() as interrupts:
            while True:
                interrupts.check()  # Ctrl-C: raise now; the backend's `running` restores its state on the way out
                self._finished(self.backend.poll(wait))
                dropped += self._hand_out(taken, num_groups)
                self._top_up()
                if len(taken) == num_groups:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"No rollouts within {self.timeout} s ({len(taken)}/{num_groups} groups).")
                wait = POLL_SECONDS
        self.consumed_groups += len(taken) + dropped
        if dropped:
            logger.info("Dropped %d rollout group(s) older than max_staleness=%d.", dropped, self.max_staleness)
        inflight = len(self._unfinished)
        metrics = self._meter.build(
            started, taken, dropped, self.policy_version, len(self._queue) - inflight, inflight, self.capacity_groups
        )
        return taken, metrics

    def accepts(self, group: RolloutGroup) -> bool:
        """The staleness rule: `group` is trained on unless it is older than `max_staleness` (and not `keep_stale`)."""
        return self.keep_stale or staleness(group, self.policy_version) <= self.max_staleness

    def _finished(self, groups: list[RolloutGroup]) -> None:
        for group in groups:
            if self._unfinished.pop(id(group), None) is group:  # a group abandoned by `stop` is ignored
                self._meter.finished(group)

    def _hand_out(self, taken: list[RolloutGroup], num_groups: int) -> int:
        """Move finished groups from the head of the queue into `taken` (FIFO: no bias towards short completions);
        return how many were dropped for staleness."""
        dropped = 0
        while self._queue and id(self._queue[0]) not in self._unfinished and len(taken) < num_groups:
            group = self._queue.popleft()
            if self.accepts(group):
                taken.append(group)
            else:
                dropped += 1
        return dropped

    def _top_up(self) -> None:
        submitted = 0
        while len(self._queue) < self.capacity_groups:
            row, prompt_ids = next(self.prompt_stream)
            item, self._drawn = self._drawn, self._drawn + 1
            try:
                self.backend.validate(prompt_ids)
            except ValueError as err:
                raise ValueError(f"Async prompt stream item {item}: {err}") from None
            group = RolloutGroup(row=row, prompt_ids=list(prompt_ids), submitted_version=self.policy_version)
            self._queue.append(group)
            self._unfinished[id(group)] = group
            self.backend.submit(group)
            submitted += 1
        if submitted:
            self.backend.flush()


def validate_async_bounds(max_staleness: int | None, prefetch_depth: int) -> None:
    """`ValueError` unless the staleness bound (`None`: derived later) and the prefetch depth are >= 0."""
    if (max_staleness is not None and max_staleness < 0) or prefetch_depth < 0:
        raise ValueError(f"max_staleness and prefetch_depth must be >= 0, got {max_staleness}, {prefetch_depth}.")


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
