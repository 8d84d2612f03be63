"""Async rollout groups in flight: all G samples of a prompt, submitted together, handed out whole.

Invariants: a group is ready only when every one of its requests has finished (in any order: the async core hands
groups out FIFO); every token carries the policy version that sampled it (a request in flight across a weight update
gets the new version from the token count recorded at that update on). The age of a group is defined here once
(`oldest_version`, `staleness`) for the async core, its metrics and the server.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from ..engine import _upstream, _upstream_sampling

logger = logging.getLogger(__name__)

__all__ = [
    "InFlightGroups",
    "PartialSample",
    "RolloutGroup",
    "SampleWatcher",
    "TokenValues",
    "as_lists",
    "oldest_version",
    "staleness",
]

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
    #: Samples to generate (`None`: the backend's G) and the most new tokens each (`None`: the generation config's):
    #: set for the turns of multi-turn rollouts (`multi_turn.py`).
    num_samples: int | None = None
    max_new_tokens: int | None = None
    #: Multi-turn rollouts only: per sample, 1 for model tokens and 0 for tool tokens, and its `Conversation`.
    tool_masks: list[list[int]] | None = None
    conversations: list[Any] | None = None
    #: Per sample (None where it asked for none), per token: the likeliest tokens of its sampled distribution and
    #: their logprobs (OpenAI's `top_logprobs`, set by a rollout server's engine: `InFlightGroups.alternatives`).
    top_logprobs: list[Any] | None = None

    @property
    def oldest_version(self) -> int:
        return oldest_version(self.versions, self.submitted_version)


def staleness(group: RolloutGroup, policy_version: int) -> int:
    """Weight updates between `group`'s oldest token and `policy_version`: what `max_staleness` bounds."""
    return policy_version - group.oldest_version


@dataclass(frozen=True)
class PartialSample:
    """One sample of a watched group after one more engine step: everything it has sampled so far (lists)."""

    index: int  # the sample's position in its group
    token_ids: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    versions: list[int]


#: Watches a group's samples step by step (`InFlightGroups.submit(watcher=...)`), on the thread that collects results;
#: returns True to end that sample now, with what it has so far (e.g. a stop string appeared).
SampleWatcher = Callable[[PartialSample], bool]


@dataclass
class _Pending:
    group: RolloutGroup
    request_ids: list[str]
    # per request: generated-token counts at each weight update while it was in flight, as (count, new version)
    boundaries: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    watcher: SampleWatcher | None = None

    def versions(self, rid: str, count: int) -> list[int]:
        """Per token of request `rid`'s first `count` tokens: the version that sampled it."""
        versions = [self.group.submitted_version] * count
        for start, version in self.boundaries.get(rid, []):
            for i in range(start, count):
                versions[i] = version
        return versions


class InFlightGroups:
    """The groups submitted to one engine and not yet handed out (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: deque[_Pending] = deque()  # submission order
        self.ready: deque[RolloutGroup] = deque()
        #: Requests a watcher ended before the engine finished them: the caller cancels them in the engine.
        self.ended_early: list[str] = []
        self._by_request: dict[str, _Pending] = {}
        self._next_id = 0
        #: Where a finished request's `top_logprobs` are taken from (the engine's `TopLogprobs.pop`), if anywhere.
        self.alternatives: Callable[[str], Any] | None = None

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
        watcher: SampleWatcher | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> None:
        """Fork `group`'s prompt into `num_samples` requests; its samples are filled in when all have finished. With a
        `watcher`, the engine streams every step of these requests and the watcher sees each (and may end a sample
        early: its tokens so far are its result, and its request is listed in `ended_early`). `eos_token_id`: the
        requests' own EOS ids (`_upstream.NO_EOS`: none), else the engine's."""
        request_id = f"a{self._next_id}"
        self._next_id += 1
        rids = _upstream.add_forked_request(
            manager,
            group.prompt_ids,
            request_id,
            num_samples,
            max_new_tokens,
            processor_kwargs,
            streaming=watcher is not None,
            eos_token_id=eos_token_id,
        )
        pending = _Pending(group, rids, watcher=watcher)
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
                    self._take_alternatives(rid)
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
        self.ended_early.clear()
        self._by_request.clear()

    def _accept(self, result: Any) -> None:
        rid = result.request_id
        pending = self._by_request.get(rid)
        if pending is None:  # a discarded (cancelled) group's request
            logger.debug("Dropping a result for unknown request %s.", rid)
            return
        if rid in pending.outputs:  # ended early by its watcher: later steps are not part of the sample
            return
        if _upstream.finished_output(result) is None:
            if pending.watcher is not None and pending.watcher(self._partial(pending, result)):
                pending.outputs[rid] = result
                self.ended_early.append(rid)
            return
        if pending.watcher is not None:  # the last step, seen like every other one
            pending.watcher(self._partial(pending, result))
        pending.outputs[rid] = result

    @staticmethod
    def _partial(pending: _Pending, output: Any) -> PartialSample:
        processed, policy = _upstream_sampling.output_logprobs(output)
        tokens = list(output.generated_tokens)
        index = pending.request_ids.index(output.request_id)
        return PartialSample(index, tokens, processed, policy, pending.versions(output.request_id, len(tokens)))

    def _take_alternatives(self, rid: str) -> Any:
        return self.alternatives(rid) if self.alternatives is not None else None

    def _finish(self, pending: _Pending) -> RolloutGroup:
        group = pending.group
        alternatives = [self._take_alternatives(rid) for rid in pending.request_ids]
        if any(a is not None for a in alternatives):
            group.top_logprobs = alternatives
        for rid in pending.request_ids:
            out = pending.outputs[rid]
            del self._by_request[rid]
            processed, policy = _upstream_sampling.output_logprobs(out)
            versions = pending.versions(rid, len(out.generated_tokens))
            group.completion_ids.append(list(out.generated_tokens))
            group.logprobs.append(processed)
            group.policy_logprobs.append(policy)
            group.versions.append(versions)
        return group
