"""`RemoteRolloutController`: the async core (`rollouts/async_core.py`) on rollout servers (`ServerBackend`).

The servers hold their own weights and generate all the time; the core gives the in-process controller's contract
(bounded, exactly once, FIFO whichever replica finished first, staleness, resume, metrics; docs/async.md). What this
backend adds:
- Versions: each token carries the server-reported version that sampled it. The owner pushes weights before `start`
  and after each optimizer step and reports them (`weights_pushed`): staleness counts from the version pushed.
- Never hangs: `take` waits in short slices and raises `TimeoutError` past `timeout`; a failed group raises its
  `RolloutServerError` (the client has already tried every replica).
- Threads O(replicas): groups are dealt round-robin to one queue per replica, each served by `streams_per_replica`
  workers; a free worker sends its queued groups (at most `capacity_groups / workers`) as one streaming request
  (`RolloutClient.stream_generate`, failing over to the other replicas) and reports each group as it arrives.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Unpack

from ..rollouts.async_core import AsyncBounds, AsyncRollouts, RolloutBackend
from ..rollouts.rollout_groups import RolloutGroup
from .client import RemoteGenerationResult, RolloutClient
from .protocol import MAX_PROMPTS

logger = logging.getLogger(__name__)

#: Slice the workers wait in for queued groups, so that they notice `stop` promptly.
_WAIT_SLICE_S = 0.1


class ServerBackend(RolloutBackend):
    """Rollout servers as a `RolloutBackend` (see the module docstring); finished groups, or the error that ended
    them, reach `poll` through one thread-safe queue."""

    generates_between_takes = True

    def __init__(
        self,
        client: RolloutClient,
        num_generations: int,
        sampling: dict[str, Any],
        validate: Callable[[list[int]], None] | None = None,
        streams_per_replica: int = 2,
    ) -> None:
        self.client = client
        self.num_generations = num_generations
        self.sampling = sampling
        self.validator = validate
        self.streams_per_replica = max(1, streams_per_replica)
        self.workers: list[threading.Thread] = []
        # per replica: batches of submitted groups (at most `_batch_limit` each), not yet in a stream
        self._unsent: list[queue.SimpleQueue[list[RolloutGroup]]] = []
        self._pending: list[list[RolloutGroup]] = []  # per replica: submitted since the last `flush`
        self._done: queue.SimpleQueue[tuple[RolloutGroup, BaseException | None]] = queue.SimpleQueue()
        self._dealt = 0  # groups dealt to the replicas' queues so far
        self._batch_limit = 1
        self._stopped = False

    def start(self, capacity_groups: int) -> None:
        """Start `streams_per_replica` workers per replica."""
        if self.workers:
            return
        replicas = max(1, len(self.client.urls))
        self._unsent = [queue.SimpleQueue() for _ in range(replicas)]
        self._pending = [[] for _ in range(replicas)]
        count = self.streams_per_replica * replicas
        # Each stream takes at most its share of a full window, so the first fill spreads over every stream.
        self._batch_limit = min(MAX_PROMPTS, max(1, math.ceil(capacity_groups / count)))
        for k in range(count):
            worker = threading.Thread(target=self._work, args=(k,), name=f"trl_cb-remote-stream-{k}", daemon=True)
            worker.start()
            self.workers.append(worker)

    def validate(self, prompt_ids: list[int]) -> None:
        if self.validator is not None:
            self.validator(prompt_ids)

    def submit(self, group: RolloutGroup) -> None:
        live = max(1, min(len(self._unsent), len(self.client.urls)))  # a dropped replica gets no new groups
        self._pending[self._dealt % live].append(group)
        self._dealt += 1

    def flush(self) -> None:
        """Queue each replica's new groups as whole batches of at most `_batch_limit`: how many streaming requests a
        top-up becomes depends on its size only, not on when a worker wakes up (one stream per group, before, when
        the workers raced the submitting thread)."""
        limit = self._batch_limit
        for unsent, pending in zip(self._unsent, self._pending, strict=True):
            kinds: dict[tuple[int | None, int | None], list[RolloutGroup]] = {}
            for group in pending:  # one request asks for one n and max_tokens (multi-turn turns differ in both)
                kinds.setdefault((group.num_samples, group.max_new_tokens), []).append(group)
            for same in kinds.values():
                for begin in range(0, len(same), limit):
                    unsent.put(same[begin : begin + limit])
            pending.clear()

    def poll(self, timeout: float) -> list[RolloutGroup]:
        finished: list[RolloutGroup] = []
        try:
            item = self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait()
            while True:
                group, error = item
                if error is not None:
                    raise error
                finished.append(group)
                item = self._done.get_nowait()
        except queue.Empty:
            return finished

    def stop(self) -> None:
        """Stop sending; idle workers end within `_WAIT_SLICE_S`, streams in flight are abandoned (daemon threads; a
        server cancels a group whose client has gone when the process exits)."""
        self._stopped = True

    def _work(self, index: int) -> None:
        """Worker `index` of replica `index % replicas`: take that replica's next queued batch, stream it (from that
        replica first), repeat."""
        replica = index % len(self._unsent)
        unsent = self._unsent[replica]
        while not self._stopped:
            try:
                batch = unsent.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                continue
            if not self._stopped:
                self._fetch(batch, replica)

    def _fetch(self, batch: list[RolloutGroup], index: int) -> None:
        delivered: set[int] = set()

        def deliver(i: int, result: RemoteGenerationResult) -> None:
            group = batch[i]
            group.completion_ids = result.completion_ids
            group.logprobs = result.logprobs
            group.policy_logprobs = result.policy_logprobs
            group.versions = result.token_weight_versions
            delivered.add(i)
            self._done.put((group, None))

        prompts = [group.prompt_ids for group in batch]
        n, sampling = batch[0].num_samples or self.num_generations, dict(self.sampling)
        if batch[0].max_new_tokens is not None:
            sampling["max_tokens"] = batch[0].max_new_tokens
        try:
            self.client.stream_generate(prompts, n, deliver, preferred=index, **sampling)
        except BaseException as exc:  # raised to the trainer by `poll`, once for every group not delivered
            for i, group in enumerate(batch):
                if i not in delivered:
                    self._done.put((group, exc))


class RemoteRolloutController(AsyncRollouts[ServerBackend]):
    """The async core on rollout servers (see the module docstring).

    Args:
        client: The servers' client (its `known_versions` gate every completion).
        prompt_stream, num_generations, groups_per_step, prefetch_depth, max_staleness, keep_stale, timeout: as for
            `AsyncRollouts`.
        sampling: `/v1/completions` sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`).
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
        validate: Callable[[list[int]], None] | None = None,
        streams_per_replica: int = 2,
        **options: Unpack[AsyncBounds],
    ) -> None:
        backend = ServerBackend(client, num_generations, sampling, validate, streams_per_replica)
        super().__init__(backend, prompt_stream, num_generations, groups_per_step, **options)
        self.server_backend = backend  # also when a multi-turn backend wraps it (`multi_turn.with_turns`)
        self.client = client

    def start(self, policy_version: int | None = None) -> None:
        """Request the first `capacity_groups` groups. The servers already serve the version the owner pushed
        (`policy_version` here, or told by `weights_pushed`): they never sample weights the trainer did not send."""
        if policy_version is not None:
            self.weights_pushed(policy_version)
        super().start()

    def weights_pushed(self, policy_version: int) -> None:
        """The servers now serve `policy_version` (applied between engine steps, mid-request): staleness counts
        from it."""
        self.policy_version = policy_version
