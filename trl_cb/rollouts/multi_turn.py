"""`MultiTurnBackend`: multi-turn (tool / environment) rollouts for the async core, on any `RolloutBackend`.

Why a backend around a backend: the core hands out whole groups and knows nothing of turns; the in-process engine,
overlap and servers generate one turn. Between turns each sample's `Conversation` runs what the turn asked for (tools,
its environment) on a worker thread, and its next turn (prompt, turns so far, tool results; `n=1`) is submitted while
other samples, groups and the trainer go on. The core sees a group once all its samples are done.

Invariants (docs/async.md, "Multi-turn"): every model token keeps the logprobs and version the engine recorded (a
turn in flight at an update is a partial rollout); tool tokens get logprob 0.0, mask 0 (`tool_masks`: out of the loss
and IS, as TRL's sync loop marks them) and their previous token's version; a completion never exceeds
`max_completion_length`; a `Conversation` that raises ends the run (tool failures are its business: TRL's semantics).
Inner backends are called under one lock only: from `poll` on the trainer's thread and, for backends that generate
between takes, from a driver thread that submits next turns while the trainer trains.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..engine import _upstream_prefix
from .async_core import AsyncRollouts, RolloutBackend
from .rollout_groups import RolloutGroup

logger = logging.getLogger(__name__)

__all__ = ["Conversation", "MultiTurnBackend", "OpenConversation", "with_turns"]

#: How often the driver thread (and a waiting `poll`) looks for finished turns and tool results.
_PUMP_S = 0.005


class Conversation(ABC):
    """One sample's multi-turn loop, seen from the rollout producer (a trainer implements it: TRL's tool loop,
    `trainers/tool_turns.py`). Called from one worker thread at a time."""

    #: This sample's prompt ids (an environment's first observation included).
    prompt_ids: list[int]

    @abstractmethod
    def after_turn(self, context: list[int], turn_ids: list[int]) -> list[int] | None:
        """The model generated `turn_ids` after `context` (the prompt and the completion so far). Run what the turn
        asks for; return the ids to append before the next turn (tool results, as the chat template renders them),
        or None when the sample is done."""


#: `open(row, sample_index, prompt_ids) -> Conversation`: one conversation per sample (resets its environment).
OpenConversation = Callable[[Any, int, list[int]], Conversation]


@dataclass(eq=False)
class _Sample:
    parent: _Parent
    index: int
    conversation: Conversation | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    turns: int = 0
    done: bool = False

    def add_turn(self, ids: list[int], logprobs: Any, policy: Any, versions: Any) -> None:
        self.completion_ids += [int(t) for t in ids]
        self.logprobs += [float(v) for v in logprobs]
        self.policy_logprobs += [float(v) for v in policy]
        self.versions += [int(v) for v in versions]
        self.tool_mask += [1] * len(ids)
        self.turns += 1

    def add_tool_tokens(self, ids: list[int], version: int) -> None:
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.policy_logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else version] * len(ids)
        self.tool_mask += [0] * len(ids)


@dataclass(eq=False)
class _Parent:
    group: RolloutGroup  # the core's
    samples: list[_Sample] = field(default_factory=list)
    opened: int = 0


class MultiTurnBackend(RolloutBackend):
    """`inner` generating each turn, `open_conversation` deciding what follows it (see the module docstring).

    Args:
        inner: The backend that generates (its groups may carry `num_samples` and `max_new_tokens`).
        open_conversation: Makes one sample's `Conversation` (run on a worker thread: it may reset an environment).
        num_generations: Samples per group (G).
        max_completion_length: Longest completion (every turn and tool result of a sample together).
        max_turn_tokens: Most tokens of one turn (within what is left of the completion; default: all of it).
        version: The policy version now (the core's), for the groups this layer submits.
        workers: Threads running conversations (tool calls) at once.
        concurrent: `inner` generates outside `take` (overlap, servers): next turns are submitted as soon as the tools
            answer, by a driver thread; otherwise at the next `poll`.
    """

    def __init__(
        self,
        inner: RolloutBackend,
        open_conversation: OpenConversation,
        num_generations: int,
        max_completion_length: int,
        version: Callable[[], int],
        workers: int = 8,
        concurrent: bool = False,
        max_turn_tokens: int | None = None,
    ) -> None:
        self.inner = inner
        self.max_turn_tokens = max_turn_tokens or max_completion_length
        self.open_conversation = open_conversation
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.version = version
        self.concurrent = concurrent
        self._workers = max(1, workers)
        self._lock = threading.RLock()
        self._results: queue.SimpleQueue[tuple[Callable[[], None] | None, BaseException | None]] = queue.SimpleQueue()
        self._finished: list[RolloutGroup] = []
        self._executor: ThreadPoolExecutor | None = None
        self._driver: threading.Thread | None = None
        self._stopped = threading.Event()
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------------------ RolloutBackend

    def start(self, capacity_groups: int) -> None:
        with self._lock:
            self.inner.start(capacity_groups)
        if self._executor is None:
            self._stopped.clear()
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="trl_cb-turns")
            if self.concurrent:
                self._driver = threading.Thread(target=self._drive, name="trl_cb-turns-driver", daemon=True)
                self._driver.start()

    def validate(self, prompt_ids: list[int]) -> None:
        self.inner.validate(prompt_ids)

    def submit(self, group: RolloutGroup) -> None:
        """Open the group's conversations (worker threads); its first turn is submitted once all are open."""
        parent = _Parent(group)
        parent.samples = [_Sample(parent, k) for k in range(self.num_generations)]
        for sample in parent.samples:
            self._run(self._opened, sample, self.open_conversation, group.row, sample.index, list(group.prompt_ids))

    def poll(self, timeout: float) -> list[RolloutGroup]:
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            with self._lock:
                finished, self._finished = self._finished, []
            if finished or time.monotonic() >= deadline:
                return finished
            time.sleep(min(_PUMP_S, max(0.0, deadline - time.monotonic())))

    def stop(self) -> None:
        self._stopped.set()
        if self._driver is not None:
            self._driver.join(timeout=10)
            self._driver = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        with self._lock:
            self.inner.stop()
            self._finished.clear()

    def running(self, timeout: float | None) -> AbstractContextManager[None]:
        return self.inner.running(timeout)

    def begin_weight_update(self, new_version: int) -> None:
        with self._lock:
            self.inner.begin_weight_update(new_version)
            if getattr(self.inner, "share_prefixes", False):  # the engine is paused: later turns recompute
                _upstream_prefix.bump_weight_epoch()

    def end_weight_update(self) -> None:
        with self._lock:
            self.inner.end_weight_update()

    # --------------------------------------------------------------------------------------- the loop

    def _run(self, then: Callable[..., None], sample: _Sample, work: Callable[..., Any], *args: Any) -> None:
        """`work(*args)` on a worker thread; `then(sample, result)` later, under the lock, from `_pump`."""
        future: Future = self._executor.submit(work, *args)

        def done(f: Future) -> None:
            if f.cancelled():
                return
            error = f.exception()
            self._results.put((None, error) if error is not None else (lambda: then(sample, f.result()), None))

        future.add_done_callback(done)

    def _pump(self) -> None:
        """Finished turns in, conversations' answers in, next turns out (raises a conversation's error)."""
        if self._error is not None:
            raise self._error
        with self._lock:
            for group in self.inner.poll(0):
                self._turn_finished(group)
            submitted = False
            while True:
                try:
                    apply, error = self._results.get_nowait()
                except queue.Empty:
                    break
                if error is not None:
                    self._error = error
                    raise error
                submitted |= bool(apply())
            if submitted:
                self.inner.flush()

    def _drive(self) -> None:
        while not self._stopped.wait(_PUMP_S):
            try:
                self._pump()
            except BaseException as exc:  # handed to the trainer's next `poll`
                self._error = self._error or exc
                return

    def _opened(self, sample: _Sample, conversation: Conversation) -> bool:
        sample.conversation = conversation
        parent = sample.parent
        parent.opened += 1
        if parent.opened < len(parent.samples):
            return False
        prompts = [s.conversation.prompt_ids for s in parent.samples]
        if all(p == prompts[0] for p in prompts):  # one prompt: prefilled once, forked into G samples
            self._submit_turn(parent, prompts[0], len(prompts), None)
        else:  # an environment gave each sample its own observation: one request each
            for s in parent.samples:
                self._submit_turn(s, s.conversation.prompt_ids, 1, None)
        return True

    def _submit_turn(self, owner: _Parent | _Sample, prompt_ids: list[int], n: int, max_new: int | None) -> None:
        group = RolloutGroup(row=owner, prompt_ids=list(prompt_ids), submitted_version=self.version())
        group.num_samples, group.max_new_tokens = n, max_new
        self.inner.submit(group)

    def _turn_finished(self, group: RolloutGroup) -> None:
        owner = group.row
        samples = owner.samples if isinstance(owner, _Parent) else [owner]
        for k, sample in enumerate(samples):
            ids = group.completion_ids[k]
            sample.add_turn(ids, group.logprobs[k], group.policy_logprobs[k], group.versions[k])
            context = sample.conversation.prompt_ids + sample.completion_ids[: len(sample.completion_ids) - len(ids)]
            self._run(self._answered, sample, sample.conversation.after_turn, context, list(map(int, ids)))

    def _answered(self, sample: _Sample, suffix: list[int] | None) -> bool:
        left = self.max_completion_length - len(sample.completion_ids) - len(suffix or [])
        if suffix is None or left <= 0:
            return self._sample_done(sample)
        sample.add_tool_tokens(list(suffix), self.version())
        context = sample.conversation.prompt_ids + sample.completion_ids
        self._submit_turn(sample, context, 1, min(left, self.max_turn_tokens))
        return True

    def _sample_done(self, sample: _Sample) -> bool:
        sample.done = True
        parent = sample.parent
        if all(s.done for s in parent.samples):
            group = parent.group
            group.completion_ids = [s.completion_ids for s in parent.samples]
            group.logprobs = [s.logprobs for s in parent.samples]
            group.policy_logprobs = [s.policy_logprobs for s in parent.samples]
            group.versions = [s.versions for s in parent.samples]
            group.tool_masks = [s.tool_mask for s in parent.samples]
            group.conversations = [s.conversation for s in parent.samples]
            self._finished.append(group)
        return False


def with_turns(
    rollouts: AsyncRollouts,
    open_conversation: OpenConversation,
    max_completion_length: int,
    workers: int,
    max_turn_tokens: int | None = None,
) -> MultiTurnBackend:
    """Make `rollouts` (not started yet) multi-turn: its backend generates each turn, a `MultiTurnBackend` around it
    runs the conversations; versions are the core's."""
    inner = rollouts.backend
    if hasattr(inner, "share_prefixes"):  # an in-process engine: a turn reuses its earlier turns' KV blocks
        inner.share_prefixes = True
    turns = MultiTurnBackend(
        inner,
        open_conversation,
        rollouts.num_generations,
        max_completion_length,
        version=lambda: rollouts.policy_version,
        workers=workers,
        concurrent=inner.generates_between_takes,
        max_turn_tokens=max_turn_tokens,
    )
    rollouts.backend = turns
    return turns
