"""Async rollout groups in flight: all G samples of a prompt, submitted together, handed out whole.

Invariants: a group is ready only when every one of its requests has finished (in any order: the async core hands
groups out FIFO); every token carries the policy version that sampled it (a request in flight across a weight update
gets the new version from the token count recorded at that update on). The age of a group is defined here once
(`oldest_version`, `staleness`) for the async core, its metrics and the server.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from ..engine import _upstream, _upstream_sampling

logger = logging.getLogger(__name__)

__all__ = ["InFlightGroups", "RolloutGroup", "TokenValues", "as_lists", "oldest_version", "staleness"]

#: One sequence's per-token values (ids, logprobs or versions): a list (the in-process engine, JSON answers) or a 1-D
#: tensor (binary answers from rollout servers, `serving/frames.py`: no Python object per token until one is needed).
TokenValues: TypeAlias = list[int] | list[float] | torch.Tensor


def as_lists(rows: Sequence[TokenValues]) -> list[list[Any]]:
    """`rows` as Python lists (TRL's input format: its decoding and padding read lists), each tensor converted once."""
    return [row.tolist() if isinstance(row, torch.Tensor) else row for row in rows]


def oldest_version(versions: Sequence[TokenValues], default: int) -> int:
    """The policy version of the oldest token among `versions` (per sequence, per token); `default` (the version at
    submission) when no token was sampled yet."""
    return min((int(v.min()) if isinstance(v, torch.Tensor) else min(v) for v in versions if len(v)), default=default)


@dataclass
class RolloutGroup:
    """All samples of one prompt, in submission order, with per-token behaviour logprobs and policy versions.

    `logprobs` are of the processed distribution each token was sampled from, `policy_logprobs` of the same
    sampler's `log_softmax(logits / T)` (TRL's training quantity; what IS compares): see `GenerationResult`."""

    row: Any  # the dataset row the prompt came from (rewards need its other fields)
    prompt_ids: list[int]
    # per sample: lists (in-process engine) or read-only 1-D tensors (binary answers from servers, `as_lists`)
    completion_ids: list[TokenValues] = field(default_factory=list)
    logprobs: list[TokenValues] = field(default_factory=list)
    policy_logprobs: list[TokenValues] = field(default_factory=list)
    versions: list[TokenValues] = field(default_factory=list)
    submitted_version: int = 0

    @property
    def oldest_version(self) -> int:
        return oldest_version(self.versions, self.submitted_version)


def staleness(group: RolloutGroup, policy_version: int) -> int:
    """Weight updates between `group`'s oldest token and `policy_version`: what `max_staleness` bounds."""
    return policy_version - group.oldest_version


@dataclass
class _Pending:
    group: RolloutGroup
    request_ids: list[str]
    # per request: generated-token counts at each weight update while it was in flight, as (count, new version)
    boundaries: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)


class InFlightGroups:
    """The groups submitted to one engine and not yet handed out (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: deque[_Pending] = deque()  # submission order
        self.ready: deque[RolloutGroup] = deque()
        self._by_request: dict[str, _Pending] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.pending) + len(self.ready)

    @property
    def inflight_requests(self) -> int:
        return sum(len(p.request_ids) - len(p.outputs) for p in self.pending)

    def submit(
        self,
        manager: _upstream.ContinuousBatchingManager,
        group: RolloutGroup,
        num_samples: int,
        max_new_tokens: int,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Fork `group`'s prompt into `num_samples` requests; its samples are filled in when all have finished."""
        request_id = f"a{self._next_id}"
        self._next_id += 1
        rids = _upstream.add_forked_request(
            manager, group.prompt_ids, request_id, num_samples, max_new_tokens, processor_kwargs
        )
        pending = _Pending(group, rids)
        self.pending.append(pending)
        for rid in rids:
            self._by_request[rid] = pending

    def mark_weight_update(self, manager: _upstream.ContinuousBatchingManager, new_version: int) -> None:
        """Tokens generated from here on by each unfinished request are sampled by `new_version`. Call with the engine
        paused. Results already out are taken first: a request that finished before the pause has left the scheduler
        but not the output queue, and all of its tokens keep their old versions."""
        while (result := manager.get_result(timeout=0)) is not None:
            self._accept(result)
        generated_lengths = _upstream.inflight_generated_lengths(manager)
        for rid, pending in self._by_request.items():
            if rid not in pending.outputs:  # finished requests keep their (older) versions
                pending.boundaries.setdefault(rid, []).append((generated_lengths.get(rid, 0), new_version))

    def collect(self, manager: _upstream.ContinuousBatchingManager) -> None:
        """Take every result the engine has now (no waiting) and move each group to `ready` as soon as all its
        requests have finished (order is the caller's business: the async core keeps submission order)."""
        while (result := manager.get_result(timeout=0)) is not None:
            self._accept(result)
        for pending in [p for p in self.pending if len(p.outputs) == len(p.request_ids)]:
            self.pending.remove(pending)
            self.ready.append(self._finish(pending))

    def discard(self, row: Any) -> list[str]:
        """Forget the pending group submitted with `row` (compared by identity); return its request ids, which the
        caller cancels in the engine. Results that still arrive for them are ignored."""
        for pending in list(self.pending):
            if pending.group.row is row:
                self.pending.remove(pending)
                for rid in pending.request_ids:
                    self._by_request.pop(rid, None)
                return [rid for rid in pending.request_ids if rid not in pending.outputs]
        return []

    def wait(self, manager: _upstream.ContinuousBatchingManager, timeout: float) -> None:
        """Wait up to `timeout` s for one result; `EngineDiedError` if the engine stopped meanwhile."""
        result = manager.get_result(timeout=timeout)
        if result is not None:
            self._accept(result)
            return
        _upstream.check_alive(manager, "during async generation")

    def clear(self) -> None:
        self.pending.clear()
        self.ready.clear()
        self._by_request.clear()

    def _accept(self, result: Any) -> None:
        pending = self._by_request.get(result.request_id)
        if pending is None:  # a discarded (cancelled) group's request
            logger.debug("Dropping a result for unknown request %s.", result.request_id)
            return
        if _upstream.finished_output(result) is None:
            return
        pending.outputs[result.request_id] = result

    def _finish(self, pending: _Pending) -> RolloutGroup:
        group = pending.group
        for rid in pending.request_ids:
            out = pending.outputs[rid]
            del self._by_request[rid]
            processed, policy = _upstream_sampling.output_logprobs(out)
            versions = [group.submitted_version] * len(out.generated_tokens)
            for count, version in pending.boundaries.get(rid, []):
                for i in range(count, len(versions)):
                    versions[i] = version
            group.completion_ids.append(list(out.generated_tokens))
            group.logprobs.append(processed)
            group.policy_logprobs.append(policy)
            group.versions.append(versions)
        return group
