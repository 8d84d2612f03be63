"""The decode fast path's plan: a steady step's rows as row-aligned arrays, scheduled from the last step's, and the
request states written lazily from a log of what fast steps sampled.

Why: reading and writing hundreds of request objects per step is the host cost of a decode step that grows with rows
(~10 us per row per step on CPU); with the plan a step reads back only the rows upstream's update took and touches
no request object for the rest (docs/architecture.md, "One decode step").
Invariants: a plan's arrays equal what the request states say (or will say once written); a request's state holds
every token it sampled whenever code other than the fast path reads it (`_Pending`). Tested against upstream's
per-request path in tests/unit/engine/test_decode_fast_path.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, compress
from typing import Any

import numpy as np
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.requests import (
    TMP_TOKEN_ID,
    FutureRequestState,
    RequestState,
    RequestStatus,
)

__all__ = ["Batch", "DecodeFastPathStats", "fast_scheduler", "subset_rows", "update_planned", "write_pending"]


@dataclass
class DecodeFastPathStats:
    """Batches prepared per path since the engine was built: `fast` advanced in place, `slow` by upstream; and
    `continued`: batches the scheduler built from the last fast step's plan alone."""

    fast: int = 0
    slow: int = 0
    continued: int = 0  # of the scheduled steps: continued from the last step's plan (no request state read)


class Batch(list):
    """A fast step's rows (`FutureRequestState`s, in the scheduler's order) with what the engine knows of them as
    row-aligned arrays (`plan`), so that prepare and update read arrays instead of hundreds of request objects.
    Upstream code sees a list."""

    plan: _Plan


@dataclass
class _Plan:
    """What a fast step knows of its rows, set by the scheduler and completed by the update (numpy, row-aligned).

    Invariants: `past[i]` is row i's `position_offset` and `input_ids[i]` its `tokens_to_process[0]` when scheduled;
    `generated[i]` its `len(generated_tokens)`; `eos` holds every row's EOS ids (a superset check: a row whose token is
    in it goes through upstream's exact update); `plain` is False for rows that stream or record timestamps;
    `completes[i]` whether the row's entry carries `complete_blocks`. `source`/`kept`: the batch this one continues
    (the last fast step's rows, `kept` the indices of it this one keeps, None for all) or None. After the update, `on`
    marks the rows updated inline (their states are as the plan says, one token further) and `tokens` the tokens."""

    states: list[RequestState]
    past: np.ndarray  # (n,) int64
    input_ids: np.ndarray  # (n,) int64
    generated: np.ndarray  # (n,) int64
    limit: np.ndarray  # (n,) int64: `_new_tokens_limit`
    plain: np.ndarray  # (n,) bool
    completes: np.ndarray  # (n,) bool
    eos: np.ndarray  # (k,) int64: the union of the rows' EOS ids
    source: list | None = None
    kept: np.ndarray | None = None
    on: np.ndarray | None = None
    tokens: np.ndarray | None = None
    pending: _Pending | None = None  # lazy request states (None: every step writes them)
    slots: np.ndarray | None = None  # (n,) int64: each row's slot in `pending`
    written: bool = False  # `write_pending` wrote this plan's lazy states


class _Pending:
    """Tokens and logprobs that fast steps sampled and that their request states do not hold yet: a slot per request
    of a steady run (the rows of the plan that started it), a column per step.

    Why: writing every row's token, logprob, position and next input into its request object costs ~1 us per row per
    step in Python, the largest host cost of a decode step at hundreds of rows. A request's state is written once,
    when something is about to read it: before upstream's update takes the row (it finishes, completes a page, ...),
    before anything but the fast path schedules or prepares a step, and on `write_pending_states`.
    Invariant: slot j's state holds its tokens up to column `start[j]` (exclusive); the columns after are here."""

    def __init__(self, states: list[RequestState]) -> None:
        self.states = states
        self.start = np.zeros(len(states), dtype=np.int64)
        self.col = 0  # the next step's column
        self.tokens = np.zeros((len(states), 64), dtype=np.int64)
        self.values: np.ndarray | None = None  # (slots, columns) or (slots, columns, 2): logprobs, (processed, policy)

    def add(self, slots: np.ndarray, tokens: np.ndarray, logprobs: list | None) -> int:
        """Log one step's rows (their slots, tokens and the engine's logprobs: floats, pairs or None); its column."""
        col = self.col
        if col == self.tokens.shape[1]:
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)], axis=1)
            if self.values is not None:
                self.values = np.concatenate([self.values, np.zeros_like(self.values)], axis=1)
        self.tokens[slots, col] = tokens
        if logprobs is not None:
            pairs = bool(logprobs) and isinstance(logprobs[0], tuple)
            if self.values is None:
                shape = (len(self.states), self.tokens.shape[1]) + ((2,) if pairs else ())
                self.values = np.zeros(shape, dtype=np.float64)
            if pairs:
                self.values[slots, col] = np.fromiter(chain.from_iterable(logprobs), np.float64).reshape(-1, 2)
            else:
                self.values[slots, col] = logprobs
        self.col = col + 1
        return col

    def write(self, slot: int, end: int) -> None:
        """Append slot `slot`'s logged tokens (and logprobs) before column `end` to its request state."""
        begin = int(self.start[slot])
        if end <= begin:
            return
        state = self.states[slot]
        state.generated_tokens.extend(self.tokens[slot, begin:end].tolist())
        if self.values is not None:
            values = self.values[slot, begin:end]
            state.logprobs.extend(values.tolist() if values.ndim == 1 else map(tuple, values.tolist()))
        self.start[slot] = end


def write_pending(batch: list | None) -> None:
    """Write the lazy states of `batch`'s plan: after its update, each row that went on holds its tokens, its next
    input token and its position (`past + 1`), as upstream's update leaves it. A plan whose update has not run writes
    its source's (the error paths: the rows are failed). Idempotent."""
    plan = getattr(batch, "plan", None)  # a list upstream scheduled has none
    if plan is not None and plan.on is None:
        plan = None if plan.source is None else plan.source.plan
    if plan is None or plan.pending is None or plan.on is None or plan.written:
        return
    plan.written = True
    pending, end = plan.pending, plan.pending.col
    for state, slot, past, token in zip(
        compress(plan.states, plan.on.tolist()),
        plan.slots[plan.on].tolist(),
        (plan.past[plan.on] + 1).tolist(),
        plan.tokens[plan.on].tolist(),
    ):
        pending.write(slot, end)
        state.position_offset = past
        state.tokens_to_process = [token]


def fast_scheduler(
    scheduler: Any,
    cache: Any,
    allocators: list[FullAttentionCacheAllocator],
    slow: Callable,
    stats: DecodeFastPathStats,
    last: list[Batch | None],
    lazy: bool,
    block_tables: bool = False,
) -> Callable:
    """`schedule_batch`: the next step continued from the last fast step's plan where it can be, else read from the
    request states (`_steady_batch`, after the lazy states are written), else upstream's. `last[0]`: the last fast
    batch (None after any other step). `allocators`: the cache's, one group (read rows) or several (block tables)."""
    name = next(iter(cache.cache_allocators))  # `complete_blocks` key (prefix sharing: one full-attention group)
    # A block-table step reads no key rows (`max_kv_read` 0); a request at the table's length takes upstream's path.
    limit = cache.max_decode_fast_path_length if block_tables else None

    def schedule_batch(token_budget: int, cache_budget: int) -> tuple[list | None, bool, int, int]:
        batch, previous = None, last[0]
        if _may_be_steady(scheduler, token_budget) and previous is not None and previous.plan.on is not None:
            batch = _continued_batch(scheduler, cache, allocators, name, cache_budget, previous, limit)
            stats.continued += bool(batch)
        if not batch:
            write_pending(previous)  # anything below reads the request states
            if batch is None and _may_be_steady(scheduler, token_budget):
                batch = _steady_batch(scheduler, cache, allocators, name, cache_budget, previous, limit, lazy)
        last[0] = batch or None
        if not batch:
            return slow(token_budget, cache_budget)
        scheduler.starved_requests = []
        if block_tables:
            return batch, True, len(batch), 0
        return batch, False, len(batch), int(batch.plan.past.sum())

    return schedule_batch


def _may_be_steady(scheduler: Any, token_budget: int) -> bool:
    """Whether no request waits to join or fork and every active one fits the step (else upstream schedules)."""
    n = len(scheduler.active_requests)
    if (scheduler.waiting_requests and not scheduler.block_new_requests) or scheduler._requests_to_fork:
        return False
    return 0 < n <= token_budget and n <= scheduler.max_requests_per_batch


def _steady_batch(
    scheduler: Any,
    cache: Any,
    allocators: list[FullAttentionCacheAllocator],
    name: str,
    cache_budget: int,
    last: Batch | None,
    limit: int | None = None,
    lazy: bool = False,
) -> Batch | list:
    """Every active request, one decode token each, read from the request states (which then start a lazy run,
    `_Pending`, with `lazy`); an empty list where
    `_process_candidates` could decide otherwise (a request not decoding, forking, past the table, or whose page
    cannot be allocated).

    A request's entry of the last fast batch (`last`, same order) is reused when it holds the same values: a step
    allocates no object per request, since hundreds of new objects per step would set off the cyclic garbage
    collector's full passes over the engine process (tens to hundreds of ms each, docs/benchmark-log.md)."""
    decoding = RequestStatus.DECODING
    states = list(scheduler.active_requests.values())
    for state in states:
        if state.status != decoding or state.num_children or len(state.tokens_to_process) != 1:
            return []
    n = len(states)
    past = np.fromiter((s.position_offset for s in states), np.int64, n)
    eos_lists = {id(s._eos_token_ids): s._eos_token_ids for s in states}
    plan = _Plan(
        states,
        past,
        np.fromiter((s.tokens_to_process[0] for s in states), np.int64, n),
        np.fromiter((len(s.generated_tokens) for s in states), np.int64, n),
        np.fromiter((s._new_tokens_limit for s in states), np.int64, n),
        np.fromiter((not (s.streaming or s.record_timestamps) for s in states), bool, n),
        np.zeros(n, dtype=bool),
        np.array(sorted({t for ids in eos_lists.values() for t in ids}), dtype=np.int64),
    )
    if lazy:
        plan.pending, plan.slots = _Pending(states), np.arange(n, dtype=np.int64)
    previous = [] if last is None else last
    reuse = _reusable_rows(states, previous)
    return _planned_batch(cache, allocators, name, cache_budget, plan, previous, reuse, limit)


def _reusable_rows(states: list[RequestState], last: list[FutureRequestState]) -> np.ndarray:
    """For each of `states`, the index of its entry in `last` (same order, some dropped), -1 where it has none."""
    rows, j = np.full(len(states), -1, dtype=np.int64), 0
    for i, state in enumerate(states):
        while j < len(last) and last[j].state is not state:
            j += 1
        if j < len(last):
            rows[i] = j
    return rows


def _continued_batch(
    scheduler: Any,
    cache: Any,
    allocators: list[FullAttentionCacheAllocator],
    name: str,
    cache_budget: int,
    last: Batch,
    limit: int | None,
) -> Batch | list | None:
    """The step after the fast step `last`, from `last`'s plan: its rows minus the finished ones, each one position
    further. Only the rows upstream's update handled (finishing, first token, completed page, EOS candidate) are
    read back from their states. None where the active requests are not exactly those rows (a request joined, was
    cancelled or forked): the caller reads every state then."""
    previous = last.plan
    active = scheduler.active_requests
    keep = previous.on.copy()
    past = previous.past + 1  # prepare advanced every row one position
    input_ids, generated = previous.tokens.copy(), previous.generated + 1
    decoding = RequestStatus.DECODING
    for i in np.flatnonzero(~previous.on).tolist():  # the rows upstream updated: read back
        state = previous.states[i]
        if active.get(state.request_id) is not state:
            continue  # finished
        if state.status != decoding or state.num_children or len(state.tokens_to_process) != 1:
            return []
        keep[i] = True
        past[i], input_ids[i] = state.position_offset, state.tokens_to_process[0]
        generated[i] = len(state.generated_tokens)
    kept = np.flatnonzero(keep)
    n = len(kept)
    if n != len(active) or n == 0 or next(reversed(active)) != previous.states[kept[-1]].request_id:
        return None  # the active requests changed otherwise (new requests are added at the end of the dict)
    whole = n == len(previous.states)
    states = previous.states if whole else [previous.states[i] for i in kept.tolist()]
    plan = _Plan(
        states,
        past if whole else past[kept],
        input_ids if whole else input_ids[kept],
        generated if whole else generated[kept],
        previous.limit if whole else previous.limit[kept],
        previous.plain if whole else previous.plain[kept],
        np.zeros(n, dtype=bool),
        previous.eos,
        source=last,
        kept=None if whole else kept,
        pending=previous.pending,
        slots=None if previous.slots is None else previous.slots if whole else previous.slots[kept],
    )
    rows = np.arange(len(previous.states), dtype=np.int64) if whole else kept
    return _planned_batch(cache, allocators, name, cache_budget, plan, last, rows, limit)


def _planned_batch(
    cache: Any,
    allocators: list[FullAttentionCacheAllocator],
    name: str,
    cache_budget: int,
    plan: _Plan,
    last: list[FutureRequestState],
    reuse: np.ndarray,
    limit: int | None,
) -> Batch | list:
    """The batch of `plan`'s rows (each row's entry of `last` at `reuse[i]` reused where it holds the same values,
    -1: none), after upstream's per-request checks as array checks: the key budget (read rows) or the table's length
    (block tables), and a page for each row at a page start (allocated here, as upstream's scheduler does). An empty
    list where upstream must decide."""
    past, states, n = plan.past, plan.states, len(plan.states)
    if limit is not None:  # block tables: nothing read by index, only the table's length bounds a row
        if int(past.max()) >= limit:
            return []
    else:  # upstream: a row past the remaining budget stops the batch, as does an exhausted budget before the last
        read = np.cumsum(past)
        if read[-1] > cache_budget or (n > 1 and read[-2] >= cache_budget):
            return []
    page = allocators[0].tokens_per_page  # every group's (the engine's page size)
    for i in np.flatnonzero(past % page == 0).tolist():  # only a row at a page start can need a new page
        state, position = states[i], int(past[i])
        if any(a.needs_new_blocks(state.request_id, position, 1) for a in allocators):  # a ring: until it is full
            state.position_offset = position  # what the allocator reads (a lazy state's may be behind)
            if not cache.can_store_request_tokens(state, 1):
                return []  # allocation failed: the slow path starves or offloads
    if cache.use_prefix_sharing:
        plan.completes = (past + 1) % page == 0  # `count_new_complete_blocks`
    reusable = reuse >= 0
    if isinstance(last, Batch):  # an entry of `last` carries `complete_blocks` where its plan completes a page
        reusable &= ~last.plan.completes[np.maximum(reuse, 0)]
    reusable &= ~plan.completes
    if reusable.all():
        batch = Batch(map(last.__getitem__, reuse.tolist()))
    else:
        batch = Batch()
        for i, (state, j, completes) in enumerate(zip(states, reuse.tolist(), plan.completes.tolist())):
            reused = reusable[i]
            batch.append(last[j] if reused else FutureRequestState(state, True, {name: 1} if completes else {}, 1))
    batch.plan = plan
    return batch


def update_planned(batch: Batch, tokens: list[int], logprobs: list | None) -> tuple:
    """The inline update of the fast scheduler's batch from its plan (the same rule as `_fast_update`'s per-row one,
    as array checks: every row of a plan is decoding, and a token among any row's EOS ids goes to upstream, which
    checks it exactly); returns the rows left to upstream's `update_batch`. Records `on` and `tokens` in the plan."""
    plan = batch.plan
    tok = np.array(tokens, dtype=np.int64)
    on = (plan.generated > 0) & (plan.generated < plan.limit - 1) & plan.plain & ~plan.completes
    for eos in plan.eos.tolist():  # one or two ids in practice: a comparison each beats `np.isin`'s sort
        on &= tok != eos
    plan.on, plan.tokens = on, tok
    if plan.pending is not None:
        return _update_lazily(batch, tok, tokens, logprobs)
    states = plan.states
    every = bool(on.all())
    mask = None if every else on.tolist()
    rows = zip(states, tokens) if every else compress(zip(states, tokens), mask)
    for state, token in rows:
        state.generated_tokens.append(token)
        state.tokens_to_process = [token]
    if logprobs is not None:
        for state, logprob in zip(states, logprobs) if every else compress(zip(states, logprobs), mask):
            state.logprobs.append(logprob)
    return subset_rows(batch, tokens, logprobs, [] if every else np.flatnonzero(~on).tolist())


def _update_lazily(batch: Batch, tok: np.ndarray, tokens: list[int], logprobs: list | None) -> tuple:
    """`update_planned` on a lazy plan: every row's token and logprob logged (`_Pending`), and only the rows left to
    upstream's update written to their states first (their earlier tokens, their position and placeholder input, as
    after upstream's prepare): upstream then appends this step's token itself."""
    plan = batch.plan
    pending = plan.pending
    col = pending.add(plan.slots, tok, logprobs)
    rest = np.flatnonzero(~plan.on).tolist()
    for i in rest:
        slot = int(plan.slots[i])
        pending.write(slot, col)
        pending.start[slot] = col + 1  # upstream's update appends this step's token
        state = plan.states[i]
        state.position_offset = int(plan.past[i]) + 1
        state.tokens_to_process = [TMP_TOKEN_ID]
    return subset_rows(batch, tokens, logprobs, rest)


def subset_rows(requests: list, tokens: list[int], logprobs: list | None, rest: list[int]) -> tuple:
    """`(requests, tokens, logprobs)` of the rows `rest` (indices) only."""
    kept = ([requests[i] for i in rest], [tokens[i] for i in rest], None)
    if logprobs is not None:
        kept = (kept[0], kept[1], [logprobs[i] for i in rest])
    return kept
