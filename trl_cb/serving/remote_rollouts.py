"""`RemoteRolloutController`: async rollouts from rollout servers, generating while the trainer trains.

The servers hold their own weights and generate all the time; the contract is the local `AsyncRolloutController`'s
(docs/async.md), so the trainers' async bridge uses either:
- Bounded: at most `(prefetch_depth + 1) * groups_per_step` groups requested and not consumed.
- Exactly once, FIFO: groups are handed out (or dropped for staleness, counted) in request order, whichever replica
  served them; `consumed_groups` is the prompt stream's resume position.
- Versions: each token carries the server-reported version that sampled it; staleness = the trainer's version - a
  group's oldest token's. The owner pushes weights before `start` and after each optimizer step and reports them.
- Never hangs: `take` waits in short slices and raises `TimeoutError` past `timeout`; a failed group raises its
  `RolloutServerError` (the client has already tried every replica).
- Threads O(replicas): groups are dealt round-robin to one queue per replica, each served by `streams_per_replica`
  workers; a free worker sends its queued groups (at most `capacity_groups / workers`) as one streaming request
  (`RolloutClient.stream_generate`, failing over to the other replicas) and hands out each group as it arrives.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..rollouts.async_controller import AsyncMetrics, validate_async_bounds
from ..rollouts.rollout_groups import RolloutGroup
from .client import RemoteGenerationResult, RolloutClient
from .protocol import MAX_PROMPTS

logger = logging.getLogger(__name__)

#: Slice `take` waits in, so that Ctrl-C reaches the trainer promptly.
_WAIT_SLICE_S = 0.1


@dataclass(eq=False)
class _Request:
    group: RolloutGroup
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class RemoteRolloutController:
    """Keeps `capacity_groups` groups requested from the servers ahead of the trainer (see the module docstring).

    Args:
        client: The servers' client (its `known_versions` gate every completion).
        prompt_stream: Endless `(row, prompt_ids)` pairs, in the order they should be sampled.
        num_generations: Samples per prompt (G).
        groups_per_step: Groups `take` returns.
        sampling: `/v1/completions` sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`).
        prefetch_depth, max_staleness, keep_stale, timeout: as for `AsyncRolloutController`.
        validate: Checks one prompt before it is requested (`ValueError` naming it), e.g. against the model's limits.
        streams_per_replica: Worker threads (each one streaming request at a time) per replica.
    """

    def __init__(
        self,
        client: RolloutClient,
        prompt_stream: Iterator[tuple[Any, list[int]]],
        num_generations: int,
        groups_per_step: int,
        sampling: dict[str, Any],
        prefetch_depth: int = 1,
        max_staleness: int = 1,
        keep_stale: bool = False,
        timeout: float | None = None,
        validate: Callable[[list[int]], None] | None = None,
        streams_per_replica: int = 2,
    ) -> None:
        validate_async_bounds(max_staleness, prefetch_depth)
        if groups_per_step <= 0 or num_generations <= 0:
            raise ValueError(f"groups_per_step and G must be > 0, got {groups_per_step}, {num_generations}.")
        self.client = client
        self.prompt_stream = prompt_stream
        self.num_generations = num_generations
        self.groups_per_step = groups_per_step
        self.sampling = sampling
        self.prefetch_depth = prefetch_depth
        self.max_staleness = max_staleness
        self.keep_stale = keep_stale
        self.timeout = timeout
        self.validate = validate
        self.policy_version = 0
        #: Stream items handed to the trainer or dropped, in stream order (the resume position).
        self.consumed_groups = 0
        self._requests: deque[_Request] = deque()
        self._dropped_total = 0
        self._since = time.perf_counter()
        self._drawn = 0  # stream items drawn so far
        self._started = False
        self._stopped = False
        self.streams_per_replica = max(1, streams_per_replica)
        self._unsent: list[queue.SimpleQueue[_Request]] = []  # per replica: requested, not yet in a stream
        self._dealt = 0  # groups dealt to the replicas' queues so far
        self._workers: list[threading.Thread] = []
        self._batch_limit = 1

    @property
    def capacity_groups(self) -> int:
        return (self.prefetch_depth + 1) * self.groups_per_step

    def start(self, policy_version: int) -> None:
        """Request the first `capacity_groups` groups; the servers already serve `policy_version`, which the owner
        pushed (they never sample with weights the trainer did not send)."""
        if self._started:
            return
        self.policy_version = policy_version
        self._started = True
        replicas = max(1, len(self.client.urls))
        self._unsent = [queue.SimpleQueue() for _ in range(replicas)]
        count = self.streams_per_replica * replicas
        # Each stream takes at most its share of a full window, so the first fill spreads over every stream.
        self._batch_limit = min(MAX_PROMPTS, max(1, math.ceil(self.capacity_groups / count)))
        for k in range(count):
            worker = threading.Thread(target=self._work, args=(k,), name=f"trl_cb-remote-stream-{k}", daemon=True)
            worker.start()
            self._workers.append(worker)
        self._top_up()

    def stop(self) -> None:
        """Stop requesting; idle workers end within `_WAIT_SLICE_S`, streams in flight are abandoned (daemon
        threads; a server cancels a group whose client has gone when the process exits)."""
        self._stopped = True
        self._requests.clear()

    @property
    def num_threads(self) -> int:
        """Worker threads started (`streams_per_replica` x replicas)."""
        return len(self._workers)

    def weights_pushed(self, policy_version: int) -> None:
        """The servers now serve `policy_version` (applied between engine steps, mid-request): staleness counts
        from it."""
        self.policy_version = policy_version

    def take(self, num_groups: int) -> tuple[list[RolloutGroup], AsyncMetrics]:
        """Block until `num_groups` acceptable groups are ready; return them (oldest request first) and metrics."""
        if not self._started:
            raise RuntimeError("RemoteRolloutController.take() called before start().")
        start = time.perf_counter()
        deadline = None if self.timeout is None else start + self.timeout
        taken: list[RolloutGroup] = []
        dropped = 0
        while len(taken) < num_groups:
            self._top_up()
            head = self._requests[0]
            while not head.done.wait(_WAIT_SLICE_S):
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"No rollouts within {self.timeout} s ({len(taken)}/{num_groups} groups).")
            self._requests.popleft()
            if head.error is not None:
                raise head.error
            if self.policy_version - head.group.oldest_version > self.max_staleness and not self.keep_stale:
                dropped += 1
                continue
            taken.append(head.group)
        self._top_up()
        self._dropped_total += dropped
        self.consumed_groups += len(taken) + dropped
        if dropped:
            logger.info("Dropped %d rollout group(s) older than max_staleness=%d.", dropped, self.max_staleness)
        now = time.perf_counter()
        staleness = [self.policy_version - g.oldest_version for g in taken]
        tokens = sum(len(ids) for g in taken for ids in g.completion_ids)
        ready = sum(r.done.is_set() for r in self._requests)
        metrics = AsyncMetrics(
            queue_depth=ready,
            inflight_groups=len(self._requests) - ready,
            wait_time_s=now - start,
            staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            dropped_groups=dropped,
            dropped_total=self._dropped_total,
            tokens_per_s=tokens / max(now - self._since, 1e-9),
            engine_occupancy=(len(self._requests) - ready) / max(self.capacity_groups, 1),
            policy_version=self.policy_version,
        )
        self._since = now
        return taken, metrics

    def _top_up(self) -> None:
        while not self._stopped and len(self._requests) < self.capacity_groups:
            row, prompt_ids = next(self.prompt_stream)
            self._drawn += 1
            if self.validate is not None:
                try:
                    self.validate(prompt_ids)
                except ValueError as err:
                    raise ValueError(f"Async prompt stream item {self._drawn - 1}: {err}") from None
            group = RolloutGroup(row=row, prompt_ids=list(prompt_ids), submitted_version=self.policy_version)
            request = _Request(group)
            self._requests.append(request)
            live = max(1, min(len(self._unsent), len(self.client.urls)))  # a dropped replica gets no new groups
            self._unsent[self._dealt % live].put(request)
            self._dealt += 1

    def _work(self, index: int) -> None:
        """Worker `index` of replica `index % replicas`: take that replica's queued groups (bounded), stream them
        (from that replica first), repeat."""
        replica = index % len(self._unsent)
        unsent, limit = self._unsent[replica], self._batch_limit
        while not self._stopped:
            try:
                batch = [unsent.get(timeout=_WAIT_SLICE_S)]
            except queue.Empty:
                continue
            while len(batch) < limit:
                try:
                    batch.append(unsent.get_nowait())
                except queue.Empty:
                    break
            if not self._stopped:
                self._fetch(batch, replica)

    def _fetch(self, batch: list[_Request], index: int) -> None:
        def deliver(i: int, result: RemoteGenerationResult) -> None:
            request, group = batch[i], batch[i].group
            group.completion_ids = result.completion_ids
            group.logprobs = result.logprobs
            group.policy_logprobs = result.policy_logprobs
            group.versions = result.token_weight_versions
            request.done.set()

        prompts = [request.group.prompt_ids for request in batch]
        try:
            self.client.stream_generate(prompts, self.num_generations, deliver, preferred=index, **self.sampling)
        except BaseException as exc:  # handed to the trainer by `take`, for every group not delivered
            for request in batch:
                if not request.done.is_set():
                    request.error = exc
                    request.done.set()
