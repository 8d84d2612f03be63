"""`EngineLoop`: the thread that steps the rollout server's one persistent CB engine for every concurrent request.

Requests become groups (a prompt and its `n` samples, prefilled once and forked) that join the running batch as soon
as the engine has room. Invariants:
- One thread, the engine loop, touches the engine and the in-flight groups; callers post operations to it and wait.
- Weights change between two engine steps (`manager.pause()`): in-flight requests keep their KV prefix and continue
  on the new weights; every token records the weight version that sampled it.
- Bounded: at most `max_num_seqs` sequences in the engine; more wait in a queue (`_Waiting`, `queue_groups`).
- Mixed sampling settings share the engine: with `per_request`, each group carries its own temperature / top_k /
  top_p to transformers' per-request warpers (`request_settings.py`), exact per request; the engine gains a warper the
  first time a group needs one (grow-only). Other differences (and every one without `per_request`) need a rebuild:
  groups the engine can take pass those waiting for one, each passed at most `max_num_seqs` times (none starves).
- Every group submitted ends once: finished, failed (engine error, bad settings, `ServerShuttingDown`) or cancelled.
- Prefix reuse (`share_prefixes`): a prompt starting with KV pages an earlier request left prefills only the rest;
  every weight update starts a new epoch of block hashes, so nothing cached before an update is reused after it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from ..checks.generation_settings import sampling_signature
from ..engine import _upstream, _upstream_prefix
from ..engine._upstream import NO_EOS
from ..engine.sizing import Workload
from ..rollouts.generator import ContinuousBatchingGenerator
from ..rollouts.inflight_update import paused_for_weight_update
from ..rollouts.rollout_groups import InFlightGroups, PartialSample, RolloutGroup
from .prompt_scoring import PromptScores, score_prompts
from .request_settings import engine_settings, only_temperature, warpers_needed

logger = logging.getLogger(__name__)

#: Longest wait of the engine loop between looks at its operation queue.
_POLL_SECONDS = 0.005
#: Prompt lengths the engine is sized for are rounded up to a power of two, at least this: varying prompt lengths
#: then rarely force a rebuild (which waits for the engine to empty).
_MIN_SIZED_PROMPT = 256


class ServerShuttingDown(RuntimeError):
    """The server is stopping (`EngineLoop.shut_down`): the group was not, or not wholly, generated. Retryable: the
    routes answer it 503 with `Retry-After`, which the trainer's client retries (on another replica)."""


@dataclass(eq=False)
class Ticket:
    """One prompt's `n` samples, from submission to its end; `done` is set once `group` or `error` is."""

    prompt_ids: list[int]
    n: int
    config: GenerationConfig
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # per-request warper settings, set when scheduled
    ignore_eos: bool = False  # the engine requests get no EOS id
    passed: int = 0  # groups admitted ahead of it while it waited for a rebuild (bounded: `_next`)
    plan: tuple[Any, GenerationConfig, Any] | None = None  # (warpers, engine config, signature), cached
    group: RolloutGroup | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[Ticket], None] | None = None
    watcher: Callable[[PartialSample], bool] | None = None  # sees each step of each sample (`SampleWatcher`)
    watch_error: BaseException | None = None  # what the watcher raised: the group fails with it, the engine goes on

    def finish(self, group: RolloutGroup | None = None, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.group, self.error = group, error
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # e.g. the waiting request's event loop is gone: nobody to tell, the engine goes on
                logger.debug("on_done callback failed", exc_info=True)


class _Waiting(deque):
    """The groups waiting for room: FIFO, except that on a running engine a group it can take passes older groups
    that need a rebuild (other settings, a longer prompt), so that groups with the same settings batch together
    instead of a rebuild per switch. A group is passed at most `bound` (`max_num_seqs`) times; then nothing passes
    it, the engine drains and is rebuilt for it: none starves."""

    def next(self, fits: Callable[[Ticket], bool], running: bool, bound: int) -> Ticket:
        head = self[0]
        if not running or fits(head) or head.passed >= bound:
            return head
        return next((ticket for ticket in itertools.islice(self, 1, None) if fits(ticket)), head)

    def admit(self, ticket: Ticket) -> None:
        """Take `ticket` out for the engine; every older group it passes counts it."""
        for older in self:
            if older is ticket:
                break
            older.passed += 1
        self.remove(ticket)


@dataclass
class ServingStats:
    """What `/metrics` reports about generation (every name always present)."""

    groups_finished: int = 0
    groups_cancelled: int = 0
    tokens_generated: int = 0
    engine_builds: int = 0
    weight_updates_in_flight: int = 0  # updates applied while requests were generating
    started: float = field(default_factory=time.time)


class EngineLoop:
    """The engine loop of one rollout server (see the module docstring).

    Args:
        generator: The server's generator (its engine is built on demand and kept).
        model: The served model (eval mode; never trained here).
        max_num_seqs: Most sequences in the engine at once (its cache is sized for that many).
        per_request: The generator's engine is built with `per_request_processors=True`: groups carry their own
            temperature / top_k / top_p (see the module docstring).
    """

    def __init__(
        self,
        generator: ContinuousBatchingGenerator,
        model: torch.nn.Module,
        max_num_seqs: int,
        per_request: bool = False,
        share_prefixes: bool = True,
    ) -> None:
        self.generator = generator
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.per_request = per_request
        self.share_prefixes = share_prefixes
        self._vocab = int(model.config.get_text_config().vocab_size)  # what "no top-k" means per request
        self._warpers: frozenset[str] = frozenset()  # per-request warpers the engine has (grow-only)
        self.version = 0
        self.paused = False
        self.stats = ServingStats()
        self._ops: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting = _Waiting()
        self._groups = InFlightGroups()
        self._manager: _upstream.ContinuousBatchingManager | None = None
        self._signature: Any = None
        self._workload: Workload | None = None
        self._pause_hold: contextlib.ExitStack | None = None
        self._stopping = False
        self._shutting_down = False  # set by `shut_down` on any thread: no new operation is accepted
        self._thread = threading.Thread(target=self._loop, name="trl_cb-serving-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ called by any thread

    def submit(
        self,
        prompts: list[list[int]],
        n: int,
        config: GenerationConfig,
        on_done: Callable[[Ticket], None] | None = None,
        watchers: list[Callable[[PartialSample], bool]] | None = None,
        ignore_eos: bool = False,
    ) -> list[Ticket]:
        """Queue each prompt as a group of `n` samples; `on_done(ticket)` runs (on the engine loop) as each ends, in
        whatever order they finish; `watchers[i]`, if set, sees every step of prompt i's samples (`Ticket.watcher`).
        With `ignore_eos`, EOS does not end the samples (only their budget, or a watcher, does)."""
        watchers = watchers or [None] * len(prompts)
        tickets = [
            Ticket(list(prompt), n, config, on_done=on_done, watcher=watcher, ignore_eos=ignore_eos)
            for prompt, watcher in zip(prompts, watchers, strict=True)
        ]
        self._post(lambda: self._waiting.extend(tickets))
        return tickets

    def cancel(self, tickets: list[Ticket]) -> None:
        """Drop groups nobody waits for any more (a client went away): queued ones never start, running ones stop. A
        no-op once shutting down: the loop fails them all anyway."""
        with contextlib.suppress(ServerShuttingDown):
            self._post(lambda: [self._cancel(ticket) for ticket in tickets if not ticket.done.is_set()])

    def apply_weights(self, copy: Callable[[], None], version: int) -> None:
        """Run `copy` (which writes new weights into the model) between two engine steps, then serve `version`."""
        self._call(lambda: self._apply_weights(copy, version))

    def score(self, prompts: list[list[int]], top: int = 0) -> tuple[PromptScores, int]:
        """Each prompt's token logprobs under the served weights, with the `top` most likely tokens at each position
        (`prompt_scoring.score_prompts`), and their version: run on the loop, so no weight update lands inside it
        (the engine's own steps go on meanwhile). A prompt sent several times is scored once."""
        unique = list(dict.fromkeys(map(tuple, prompts)))
        out: list[tuple[PromptScores, int]] = []
        self._call(lambda: out.append((score_prompts(self.model, [list(p) for p in unique], top), self.version)))
        scores, version = out[0]
        by_prompt = dict(zip(unique, scores, strict=True))
        return [by_prompt[tuple(p)] for p in prompts], version

    def set_paused(self, paused: bool) -> None:
        """Pause: the engine holds its requests and cache and runs no step until resumed; new groups queue."""
        self._call(lambda: self._set_paused(paused))

    def queue_depth(self) -> tuple[int, int]:
        """(groups waiting for room, groups in the engine), as last seen by the loop."""
        return len(self._waiting), len(self._groups.pending)

    def shut_down(self) -> None:
        """Begin stopping, without waiting (safe in a signal handler, on the event loop's thread): the loop ends, every
        group queued or running fails with `ServerShuttingDown` (also while paused), and so does any later
        submission. Called when the server receives SIGINT/SIGTERM, so its clients get a retryable 503 while the HTTP
        server still answers, not a 500 when it cancels their requests."""
        with contextlib.suppress(ServerShuttingDown):  # already stopping or stopped
            self._post(lambda: setattr(self, "_stopping", True))
        self._shutting_down = True

    def close(self) -> None:
        """Stop the loop, fail what is left (`ServerShuttingDown`), and hard-stop the engine."""
        if self._thread.is_alive():
            self.shut_down()
            self._thread.join(timeout=30)
        self.generator.close()

    # ----------------------------------------------------------------------------------- the engine loop only

    def _post(self, op: Callable[[], None]) -> None:
        if self._shutting_down or not self._thread.is_alive():
            raise ServerShuttingDown("the rollout server is shutting down")
        self._ops.put(op)

    def _call(self, op: Callable[[], None]) -> None:
        """Run `op` on the loop and wait for it; its exception is raised here."""
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                op()
            except BaseException as exc:  # handed to the caller
                failure.append(exc)
            finally:
                done.set()

        self._post(run)
        done.wait()
        if failure:
            raise failure[0]

    def _loop(self) -> None:
        while not self._stopping:
            try:
                idle = self.paused or not (self._groups.pending or self._waiting)
                self._run_ops(block=idle)
                if self._manager is not None and not self.paused:
                    self._collect()
                self._schedule()
                if self._manager is not None and self._groups.pending and not self.paused:
                    self._groups.wait(self._manager, _POLL_SECONDS)
            except Exception as exc:  # the engine died: fail its groups, serve the next ones on a new engine
                logger.exception("rollout engine failed; its requests are answered with the error")
                self._fail_all(exc, waiting=False)
                self._drop_engine()
        self._fail_all(ServerShuttingDown("the rollout server is shutting down"), waiting=True)
        self._drop_engine()

    def _run_ops(self, block: bool) -> None:
        try:
            op = self._ops.get(timeout=0.05) if block else self._ops.get_nowait()
        except queue.Empty:
            return
        op()
        while True:
            try:
                self._ops.get_nowait()()
            except queue.Empty:
                return

    def _collect(self) -> None:
        self._groups.collect(self._manager)
        while self._groups.ended_early:  # samples their watchers ended: stopped in the engine
            self._manager.cancel_request(self._groups.ended_early.pop())
        while self._groups.ready:
            group = self._groups.ready.popleft()
            ticket: Ticket = group.row
            group.row = None
            self.stats.groups_finished += 1
            self.stats.tokens_generated += sum(len(ids) for ids in group.completion_ids)
            if only_temperature(ticket.processor_kwargs, self._vocab):  # one quantity, as without warpers
                # the same lists (read only from here on): an answer sends them once, found by identity
                group.policy_logprobs = list(group.logprobs)
            ticket.finish(group, error=ticket.watch_error)

    def _schedule(self) -> None:
        """Move queued groups into the engine while they fit (in `_Waiting.next`'s order); rebuild it (only once
        empty) when one cannot fit."""
        while self._waiting and not self.paused:
            fits = lambda t: self._fits(t, self._plan(t)[2])  # noqa: E731
            ticket = self._waiting.next(fits, self._manager is not None, self.max_num_seqs)
            warpers, engine_config, signature = self._plan(ticket)
            if not self._fits(ticket, signature):
                if self._groups.pending:
                    return  # the engine must empty before it is rebuilt for this group
                try:
                    self._build(ticket, engine_config, signature)
                    self._warpers = warpers or frozenset()
                except Exception as exc:  # settings, prompt or cache the engine refuses: this group fails, not all
                    self._waiting.remove(ticket)
                    ticket.finish(error=exc)
                    continue
            if self._groups.inflight_requests + ticket.n > self.max_num_seqs and self._groups.pending:
                return
            self._waiting.admit(ticket)
            max_new = int(ticket.config.max_new_tokens)
            group = RolloutGroup(row=ticket, prompt_ids=ticket.prompt_ids, submitted_version=self.version)
            watcher = _guarded(ticket) if ticket.watcher is not None else None
            eos = NO_EOS if ticket.ignore_eos else None
            self._groups.submit(self._manager, group, ticket.n, max_new, ticket.processor_kwargs, watcher, eos)

    def _plan(self, ticket: Ticket) -> tuple[frozenset[str], GenerationConfig, Any]:
        """(warpers, engine config, signature) of `ticket` on the current engine (`_plan_of`, cached)."""
        vocab = self._vocab
        warpers = self._warpers | warpers_needed(ticket.config, vocab) if self.per_request else None
        return _plan_of(ticket, warpers, vocab)

    def _fits(self, ticket: Ticket, signature: Any) -> bool:
        """Whether the running engine can take `ticket` as it is (same settings, within its sizes)."""
        return (
            self._manager is not None
            and signature == self._signature
            and len(ticket.prompt_ids) <= self._workload.max_prompt_len
            and int(ticket.config.max_new_tokens) <= self._workload.max_new_tokens
        )

    def _build(self, ticket: Ticket, engine_config: GenerationConfig, signature: Any) -> None:
        self._drop_engine()
        self.generator.generation_config = self.generator.checked_generation_config(engine_config)
        self.generator.validate_prompts([ticket.prompt_ids], self.model)
        previous, workload = self._workload, _sized_workload(ticket, self.model, self.max_num_seqs)
        if previous is not None and (signature == self._signature or self.per_request):  # grow, never thrash
            workload = workload.union(previous)
        self._manager = self.generator.engine_for(self.model, workload, share_prefixes=self.share_prefixes)
        self._groups.alternatives = _upstream.recorded_alternatives(self._manager)
        self._signature, self._workload = signature, workload
        self.stats.engine_builds += 1
        if self.paused:
            self._hold_pause()

    def _apply_weights(self, copy: Callable[[], None], version: int) -> None:
        # The one pause/apply/resume mechanism, shared with in-process overlap (rollouts/inflight_update.py).
        with paused_for_weight_update(self._manager, self._groups, version) as inflight:
            self.stats.weight_updates_in_flight += inflight
            copy()
            self.version = version
            if self.share_prefixes:  # blocks cached under the old weights are never matched again
                _upstream_prefix.bump_weight_epoch()

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self._hold_pause()
        elif self._pause_hold is not None:
            self._pause_hold.close()
            self._pause_hold = None

    def _hold_pause(self) -> None:
        if self._manager is not None and self._pause_hold is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._manager.pause())
            self._pause_hold = stack

    def _cancel(self, ticket: Ticket) -> None:
        if ticket in self._waiting:
            self._waiting.remove(ticket)
        elif self._manager is not None:
            for rid in self._groups.discard(ticket):
                self._manager.cancel_request(rid)
        self.stats.groups_cancelled += 1
        ticket.finish(error=RuntimeError("cancelled"))

    def _fail_all(self, error: BaseException, waiting: bool) -> None:
        for pending in list(self._groups.pending):
            pending.group.row.finish(error=error)
        self._groups.clear()
        while waiting and self._waiting:
            self._waiting.popleft().finish(error=error)

    def _drop_engine(self) -> None:
        if self._pause_hold is not None:
            with contextlib.suppress(Exception):
                self._pause_hold.close()
            self._pause_hold = None
        if self._manager is not None:
            self._manager = None
            self._groups.alternatives = None
            self.generator.close()


def _guarded(ticket: Ticket) -> Callable[[PartialSample], bool]:
    """`ticket.watcher`, with what it raises kept for the ticket (its samples end; the engine loop goes on)."""

    def watch(partial: PartialSample) -> bool:
        try:
            return ticket.watch_error is not None or ticket.watcher(partial)
        except Exception as exc:
            logger.exception("a request's watcher failed; its group fails")
            ticket.watch_error = exc
            return True

    return watch


def _plan_of(ticket: Ticket, warpers: frozenset[str] | None, vocab_size: int) -> tuple[Any, GenerationConfig, Any]:
    """(warpers, engine config, signature) of `ticket` on an engine with these per-request `warpers` (None: an engine
    without per-request warpers, built from the group's own config); cached on the ticket until the warpers grow.
    Sets its `processor_kwargs`."""
    if ticket.plan is None or ticket.plan[0] != warpers:
        engine_config, ticket.processor_kwargs = (
            (ticket.config, {}) if warpers is None else engine_settings(ticket.config, warpers, vocab_size)
        )
        ticket.plan = (warpers, engine_config, sampling_signature(engine_config))
    return ticket.plan


def _sized_workload(ticket: Ticket, model: torch.nn.Module, max_num_seqs: int) -> Workload:
    """The workload an engine built for `ticket` is sized for: `max_num_seqs` sequences of its prompt length rounded
    up to a power of two (at least `_MIN_SIZED_PROMPT`, within the model's positions) plus its `max_new_tokens`."""
    prompt_len = max(_MIN_SIZED_PROMPT, 1 << (len(ticket.prompt_ids) - 1).bit_length())
    limit = getattr(model.config, "max_position_embeddings", None)
    max_new = int(ticket.config.max_new_tokens)
    if limit is not None:
        prompt_len = max(len(ticket.prompt_ids), min(prompt_len, int(limit) - max_new))
    return Workload(
        num_requests=max(max_num_seqs, ticket.n),
        max_prompt_len=prompt_len,
        max_new_tokens=max_new,
        prefill_tokens=prompt_len,
    )
