"""Steady-state decode fast path: a step's batch advanced in place instead of rebuilt per request.

Why: at hundreds of rows transformers' per-request Python in every step (the scheduler's `_process_candidates`,
`prepare_batch_tensors`, `update_batch`) is the largest part of a CPU decode step (docs/benchmark-log.md).
When every active request decodes one token and none joins or forks, the scheduler continues the last step's plan
(`_upstream_decode_plan`), `_advance` / `_advance_table` move the previous tensors (positions + 1, write row + 1
inside a page, each row's new key appended to its read rows or its block-table row; a row at a page start re-read
from its block table), or build them from the plan and the block tables (the first step after a prefill, a join or a
fork), and `_fast_update` takes the rows that go on, leaving the others to upstream's `update_batch`.
Invariant: a fast step leaves the tensors the forward reads as upstream's path would, and the request states as it
would once written (tests/unit/engine/test_decode_fast_path.py: same tokens and logprobs, the rows checked per step).
Where it fits (`fast_path_fits`): synchronous engines without a dense mask, in either layout: read rows (CPU,
unpadded; one full-attention group) or block tables (decode graphs, padded; full-attention groups and sliding-window
rings, `_upstream_window`). Upstream surface: tests/unit/test_contracts.py, docs/architecture.md ("Upstream surface").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.requests import (
    TMP_TOKEN_ID,
    FutureRequestState,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.scheduler import FIFOScheduler, PrefillFirstScheduler

from . import _upstream_sampling as _sampling
from . import _upstream_window
from ._upstream_cache import read_index_rows
from ._upstream_decode_plan import (
    Batch,
    DecodeFastPathStats,
    fast_scheduler,
    subset_rows,
    update_planned,
    write_pending,
)

__all__ = [
    "FAST_PATH_ATTR",
    "DecodeFastPathStats",
    "FastPath",
    "decode_fast_path_stats",
    "fast_path_fits",
    "with_fast_path",
    "write_pending_states",
    "writing_states_first",
]

#: Where `_upstream_patches.install` keeps a processor's `FastPath` (read by the stats and the lazy-state writer).
FAST_PATH_ATTR = "_trl_cb_decode_fast_path"


@dataclass
class FastPath:
    """What `with_fast_path` builds for one processor: its three methods, which `_upstream_patches.install` sets, and
    the state they share: the counters and the fast scheduler's last batch (a one-item list the scheduler rebinds)."""

    schedule: Callable
    prepare: Callable
    update: Callable
    stats: DecodeFastPathStats
    last: list[Batch | None]


@dataclass
class _Previous:
    """The last batch prepared with only single-token decode rows, as the IOs hold it (numpy: a small numpy op costs
    ~1 us on the host against ~5 us for a torch op, and a fast step is a few dozen of them)."""

    marker: list  # the IOs' `requests_in_batch` object right after; any other object there means something else ran
    states: list[RequestState]
    positions: np.ndarray  # (n,) int64: each row's position (its past length)
    writes: np.ndarray  # (n,) int64: the storage row its new key was written to
    key_lengths: np.ndarray  # (n,) int64: keys read per row (positions + 1)
    total: int  # key_lengths.sum(): the read rows the IOs hold


def decode_fast_path_stats(manager: ContinuousBatchingManager) -> DecodeFastPathStats | None:
    """The counters of `manager`'s fast path; None where it is not installed."""
    fast = getattr(manager.batch_processor, FAST_PATH_ATTR, None)
    return None if fast is None else fast.stats


def fast_path_fits(processor: Any) -> bool:
    """Whether the fast path serves this batch processor (where: the module docstring)."""
    ios, cache, scheduler = processor.inputs_and_outputs, processor.cache, processor.scheduler
    allocators = list(cache.cache_allocators.values())
    if ios.block_table.numel() > 0:  # every group read through block tables: full attention, sliding-window rings
        ring = _upstream_window.reads_block_tables
        layout = all(type(a) is FullAttentionCacheAllocator or ring(a) for a in allocators)
    else:  # read rows: one full-attention group, unpadded, on the CPU
        layout = (
            len(allocators) == 1
            and type(allocators[0]) is FullAttentionCacheAllocator
            and cache.read_cache_limit is None
            and ios.read_index_storage.device.type == "cpu"
            and not processor.model_runner.pad_inputs
        )
    return (
        layout
        and type(ios) is ContinuousBatchingIOs
        and type(scheduler) in (FIFOScheduler, PrefillFirstScheduler)
        and ios.attention_mask is None
    )


def with_fast_path(
    processor: Any, schedule: Callable, prepare: Callable, update: Callable, states_read_per_step: bool = False
) -> FastPath:
    """The scheduler's `schedule_batch`, the IOs' `prepare_batch_tensors` and the processor's `update_batch` with the
    fast path in front of `schedule` / `prepare` / `update` (upstream's, or what `_upstream_patches` composed before:
    the read rows and block-table padding for `prepare`, the recorder's `prepare_batch_update` that `update` calls once
    per step). Counters: `decode_fast_path_stats`. Call only where `fast_path_fits`. `states_read_per_step`: something
    in the step reads the request states (a hybrid's step plan reads positions), so they cannot be written lazily."""
    ios, cache, scheduler = processor.inputs_and_outputs, processor.cache, processor.scheduler
    allocators = list(cache.cache_allocators.values())
    block_tables = ios.block_table.numel() > 0
    stats = DecodeFastPathStats()
    # request states written once per request instead of once per step, unless the step or a processor (every row's
    # tokens) reads them
    processors = processor.logit_processor.logits_processor
    lazy = not states_read_per_step and not any(isinstance(p, _sampling.PerRequestProcessor) for p in processors)
    last: list[Batch | None] = [None]  # the fast scheduler's last batch
    if block_tables:
        host = _HostInputs(ios)

        def advance(last: Any, batch: list, processors: Any, num_q_tokens: int, max_kv_read: int) -> Any:
            return _advance_table(ios, allocators, host, last, batch, processors, num_q_tokens)

    else:

        def advance(last: Any, batch: list, processors: Any, num_q_tokens: int, max_kv_read: int) -> Any:
            return _advance(ios, allocators[0], last, batch, processors, max_kv_read)

    return FastPath(
        fast_scheduler(scheduler, cache, allocators, schedule, stats, last, lazy, block_tables),
        _fast_prepare(ios, stats, prepare, block_tables, advance),
        _fast_update(ios, update),
        stats,
        last,
    )


def write_pending_states(processor: Any) -> None:
    """Bring every request state of `processor`'s fast path up to date (tokens, logprobs, position), as upstream's
    per-step updates would have left it. Call where code outside the engine step reads request states: between two
    steps (under `manager.pause()`) or on the engine thread; nothing happens without a fast path."""
    fast = getattr(processor, FAST_PATH_ATTR, None)
    if fast is not None:
        write_pending(fast.last[0])


def writing_states_first(processor: Any, method: Callable) -> Callable:
    """`method` (an error path of upstream's batch processor) run after `write_pending_states(processor)`."""

    @functools.wraps(method)
    def with_states_written(*args: Any, **kwargs: Any) -> Any:
        write_pending_states(processor)
        return method(*args, **kwargs)

    return with_states_written


def _fast_prepare(
    ios: ContinuousBatchingIOs,
    stats: DecodeFastPathStats,
    slow: Callable,
    block_tables: bool,
    advance: Callable[[Any, list, Any, int, int], Any],
) -> Callable:
    """`prepare_batch_tensors`: a steady step (every row one decode token; in the block-table layout a step the
    scheduler sent through block tables, in the read-row layout an unpadded one) is prepared by
    `advance(last, batch, processors, num_q_tokens, max_kv_read)`, from the last fast step where it continues it
    (`last`; None after any other step) and else from the request states; any other step is `slow` (upstream's)."""
    previous: list[Any] = [None]

    def prepare_batch_tensors(requests_in_batch: list, logits_processors: Any, use_decode_fast_path: bool,
                              num_q_tokens: int, max_kv_read: int, use_padding: bool) -> None:  # fmt: skip
        last = previous[0]
        layout_fits = use_decode_fast_path if block_tables else not use_padding
        planned = isinstance(requests_in_batch, Batch)  # the fast scheduler's: one decode token per row
        steady = layout_fits and (planned or all(f.query_length == 1 and f.has_new_token for f in requests_in_batch))
        if steady and last is not None and ios.requests_in_batch is not last.marker:
            last = None  # something else ran since: not a continuation
        if steady:
            stats.fast += 1
            previous[0] = advance(last, requests_in_batch, logits_processors, num_q_tokens, max_kv_read)
            return
        stats.slow += 1
        previous[0] = None
        if planned:
            write_pending(requests_in_batch)  # upstream's prepare reads the request states
        slow(requests_in_batch, logits_processors, use_decode_fast_path, num_q_tokens, max_kv_read, use_padding)

    return prepare_batch_tensors


def _advance(
    ios: ContinuousBatchingIOs,
    allocator: FullAttentionCacheAllocator,
    last: _Previous | None,
    batch: list[FutureRequestState],
    logits_processors: Any,
    max_kv_read: int,
) -> _Previous:
    """Prepare `batch` in place: from `last` where its rows are a subsequence of `last`'s, each one position further,
    else from the request states and block tables alone (the first decode step after a prefill, a join or a fork, or
    after a step the fast path did not prepare). Host arrays through numpy views of the IOs' CPU tensors."""
    read_storage = ios.read_index_storage[0].numpy()
    advanced = None if last is None else _rows_from_last(allocator, last, batch, read_storage)
    states, positions, input_ids, writes, rows = advanced or _rows_from_states(allocator, batch)
    n = len(states)
    key_lengths = positions + 1  # (n,)
    cu_k = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(key_lengths, out=cu_k[1:])
    total = int(cu_k[-1])
    # 4) the request states, as upstream's loop leaves them (a lazy plan's are written when read: `_Pending`)
    _advance_states(batch, states)
    # 5) the static tensors and counters the forward and `update_batch` read
    ios.num_q_tokens, ios.max_kv_read, ios.num_request_in_batch = n, max_kv_read, n
    ios.use_block_table = False
    ios.true_write_sizes, ios.true_read_sizes = [n], [total]
    ios.input_ids[:n].numpy()[:] = input_ids
    ios.position_ids[:n].numpy()[:] = positions
    steps = np.arange(n + 1, dtype=np.int32)
    ios.cumulative_seqlens_q[: n + 1].numpy()[:] = steps
    ios.logits_indices[:n].numpy()[:] = steps[:n]
    ios.output_ids[:, :n].numpy()[:] = 0
    ios.max_length_q, ios.total_seqlen_q = 1, n
    longest = int(key_lengths.max())
    for layer_type, cumulative in ios.cumulative_seqlens_k.items():
        cumulative[: n + 1].numpy()[:] = cu_k
        ios.max_length_k[layer_type] = longest
        ios.total_seqlen_k[layer_type] = total
    ios.write_index_storage[0, :n].numpy()[:] = writes
    read_storage[:total] = rows
    # per-request processor arguments (and trl_cb's request processors, which read the histories here)
    logits_processors.prepare_tensor_args(batch, arg_storage=ios._bulk_input_tensor[ios.static_inputs :])
    ios.requests_in_batch = batch
    ios.req_id_to_new_token_position = {}  # read by the asynchronous IOs only, which the fast path does not serve
    return _Previous(batch, states, positions, writes, key_lengths, total)


def _rows_from_last(
    allocator: FullAttentionCacheAllocator, last: _Previous, batch: list[FutureRequestState], read_storage: np.ndarray
) -> tuple[list[RequestState], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """`(states, positions, input_ids, writes, read rows)` of `batch` advanced from `last` (None: not a steady
    continuation of it): each row's write row the next slot inside its page (the block table's at a page start), its
    read rows its previous keys and then its new key."""
    # 1) map each row to its row in the previous batch (same order, finished requests dropped)
    states, mapped = _rows_of(batch, last)
    if mapped is None:
        return None
    kept, positions, input_ids = mapped
    n = len(states)
    # 2) write rows: the next slot inside a page, the block table's slot at a page start
    page, stride = allocator.tokens_per_page, allocator.block_physical_stride
    writes = (last.writes if kept is None else last.writes[kept]) + 1  # (n,)
    page_starts = np.flatnonzero(positions % page == 0).tolist()
    for i in page_starts:
        writes[i] = allocator.block_table[states[i].request_id][int(positions[i]) // page] * stride
    # 3) read rows: each row's previous keys, then its new key
    old_rows, old_lengths = read_storage[: last.total], last.key_lengths
    if kept is not None:
        row_mask = np.zeros(len(last.states), dtype=bool)
        row_mask[kept] = True
        old_rows, old_lengths = old_rows[np.repeat(row_mask, old_lengths)], old_lengths[kept]
    rows = np.insert(old_rows, np.cumsum(old_lengths), writes)  # write i after row i's old keys (stable order)
    if page_starts:  # completing the previous page may have swapped it for a shared one: read the block tables
        key_lengths = positions + 1
        at_start = np.zeros(n, dtype=bool)
        at_start[page_starts] = True
        requests = [(states[i].request_id, int(key_lengths[i])) for i in page_starts]
        rows[np.repeat(at_start, key_lengths)] = read_index_rows(allocator, requests).numpy()
    return states, positions, input_ids, writes, rows


def _rows_from_states(
    allocator: FullAttentionCacheAllocator, batch: list[FutureRequestState]
) -> tuple[list[RequestState], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(states, positions, input_ids, writes, read rows)` of `batch` from the request states (or the scheduler's
    plan) and the block tables alone: each row's write row its position's slot, its read rows keys `[0, position]`."""
    states, _ = _rows_of(batch, None)
    plan = getattr(batch, "plan", None)
    n = len(states)
    if plan is not None:
        positions, input_ids = plan.past, plan.input_ids
    else:
        positions = np.fromiter((s.position_offset for s in states), np.int64, n)  # (n,)
        input_ids = np.fromiter((s.tokens_to_process[0] for s in states), np.int32, n)  # the token sampled last
    page, stride, tables = allocator.tokens_per_page, allocator.block_physical_stride, allocator.block_table
    writes = np.fromiter(
        (tables[s.request_id][p // page] * stride + p % page for s, p in zip(states, positions.tolist())), np.int64, n
    )
    requests = [(s.request_id, length) for s, length in zip(states, (positions + 1).tolist())]
    return states, positions, input_ids, writes, read_index_rows(allocator, requests).numpy()


def _advance_states(batch: list[FutureRequestState], states: list[RequestState]) -> None:
    """Each row's state one position further, its next input a placeholder, as upstream's prepare leaves it; nothing
    for a lazy plan's rows."""
    plan = getattr(batch, "plan", None)
    if plan is not None and plan.pending is not None:
        return
    for state in states:
        state.position_offset += 1
        state.tokens_to_process = [TMP_TOKEN_ID]


def _rows_of(
    batch: list[FutureRequestState], last: _Previous | _PreviousTable | None
) -> tuple[list[RequestState], tuple[np.ndarray | None, np.ndarray, np.ndarray] | None]:
    """`(states, mapped)` of `batch`: `mapped` as `_map_rows` gives it against `last` (None: no continuation of it),
    read from the scheduler's plan where it has one (`Batch`: no request object read), else from the states."""
    plan = getattr(batch, "plan", None)
    if plan is None:
        states = [f.state for f in batch]
        return states, None if last is None else _map_rows(states, last.states, last.positions)
    if last is None:
        return plan.states, None
    if plan.source is not None and plan.source is last.marker:
        return plan.states, (plan.kept, plan.past, plan.input_ids)
    return plan.states, _map_rows(plan.states, last.states, last.positions)


def _map_rows(
    states: list[RequestState], previous_states: list[RequestState], previous_positions: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray] | None:
    """`(kept, positions, input_ids)` when `states` are `previous_states` minus some, in the same order, each one
    position further: `kept` (n,) the previous rows kept (None when all are), positions (n,) int64, the token each
    row samples from (n,) int32. None otherwise (the step is not a steady continuation)."""
    n = len(states)
    kept = None
    if n != len(previous_states) or any(a is not b for a, b in zip(states, previous_states)):
        keep, j = [], 0
        for state in states:
            while j < len(previous_states) and previous_states[j] is not state:
                j += 1
            if j == len(previous_states):
                return None
            keep.append(j)
            j += 1
        kept = np.array(keep, dtype=np.int64)
    positions = np.fromiter((s.position_offset for s in states), np.int64, n)  # (n,)
    input_ids = np.fromiter((s.tokens_to_process[0] for s in states), np.int32, n)  # the token sampled last step
    expected = previous_positions if kept is None else previous_positions[kept]
    if not np.array_equal(positions, expected + 1):
        return None
    return kept, positions, input_ids


@dataclass
class _PreviousTable:
    """The last block-table batch (see `_Previous`): its rows' states and positions, and its padded row count."""

    marker: list
    states: list[RequestState]
    positions: np.ndarray  # (n,) int64
    rows: int  # padded rows of that step


class _HostInputs:
    """Host copies of a block-table step's inputs (the IOs' small-input rows and block table), written with numpy and
    sent in two copies per step on the engine's compute stream, ahead of the forward that reads them. On the CPU they
    are the IOs' own tensors (nothing sent). Each input's row is found from the address of the IOs' view of it."""

    def __init__(self, ios: ContinuousBatchingIOs) -> None:
        bulk, table = ios._bulk_input_tensor[: ios.static_inputs], ios.block_table
        self.same = bulk.device.type == "cpu"
        pin = not self.same and torch.cuda.is_available()
        self.bulk = bulk if self.same else torch.zeros(bulk.shape, dtype=bulk.dtype, pin_memory=pin)
        self.table = table if self.same else torch.full(table.shape, -1, dtype=table.dtype, pin_memory=pin)
        self.bulk_np, self.table_np = self.bulk.numpy(), self.table.numpy()
        row_bytes = bulk.stride(0) * bulk.element_size()

        def row(tensor: torch.Tensor) -> int:  # which row of the small-input tensor `tensor` views
            return (tensor.data_ptr() - bulk.data_ptr()) // row_bytes

        self.input_ids, self.positions = row(ios.input_ids), row(ios.position_ids)
        self.cu_q, self.logits_indices = row(ios.cumulative_seqlens_q), row(ios.logits_indices)
        self.cu_k = [row(t) for t in ios.cumulative_seqlens_k.values()]

    def send(self, ios: ContinuousBatchingIOs, rows: int) -> None:
        if self.same:
            return
        stream = ios.compute_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            ios._bulk_input_tensor[: ios.static_inputs, : rows + 1].copy_(self.bulk[:, : rows + 1], non_blocking=True)
            ios.block_table[:, :rows].copy_(self.table[:, :rows], non_blocking=True)

    def fill_table_rows(self, allocator: FullAttentionCacheAllocator, states: list[RequestState], rows: range) -> None:
        """Each row of `rows` from its request's block ids (kernel entries: block id x pages per block stride)."""
        stride = allocator.block_physical_stride // allocator.tokens_per_page
        table = self.table_np[allocator.index]
        for i in rows:
            blocks = allocator.block_table[states[i].request_id]
            table[i, : len(blocks)] = np.asarray(blocks, dtype=np.int64) * stride
            table[i, len(blocks) :] = -1


def _advance_table(
    ios: ContinuousBatchingIOs,
    allocators: list[FullAttentionCacheAllocator],
    host: _HostInputs,
    last: _PreviousTable | None,
    batch: list[FutureRequestState],
    logits_processors: Any,
    rows: int,
) -> _PreviousTable:
    """Prepare the block-table step `batch`, padded to `rows`: from `last` when it is a steady continuation of it
    (`_map_rows`: only the table rows of rows at a page start re-read), else from the request states alone (every
    table row read from the allocators: the first decode step after a prefill or a fork, or after a step the fast path
    did not prepare). One table per allocator (a sliding-window ring's too); every group's key count the absolute
    length (`_upstream_window`). Padding rows: no keys (flat `cu_seq_lens_k`), table rows -1."""
    states, mapped = _rows_of(batch, last)
    n = len(states)
    plan = getattr(batch, "plan", None)
    if mapped is not None:
        kept, positions, input_ids = mapped
        # 1) block table rows: the kept rows moved up; a row at a page start re-read (it has a new page, and
        #    completing the previous one may have swapped it for a shared one); padding rows -1
        at_start = np.flatnonzero(positions % allocators[0].tokens_per_page == 0).tolist()
        for allocator in allocators:
            table = host.table_np[allocator.index]
            if kept is not None:
                table[:n] = table[kept]
            table[n : max(rows, last.rows)] = -1
            host.fill_table_rows(allocator, states, at_start)
    else:
        if plan is not None:
            positions, input_ids = plan.past, plan.input_ids
        else:
            positions = np.fromiter((s.position_offset for s in states), np.int64, n)  # (n,)
            input_ids = np.fromiter((s.tokens_to_process[0] for s in states), np.int32, n)  # the token sampled last
        for allocator in allocators:
            host.fill_table_rows(allocator, states, range(n))
            host.table_np[allocator.index][n:] = -1
    # 2) the request states, as upstream's loop leaves them (a lazy plan's are written when read: `_Pending`)
    _advance_states(batch, states)
    # 3) the small inputs (rows: input ids, positions, cu_seq_lens_q, logits indices, cu_seq_lens_k per layer type)
    bulk = host.bulk_np
    steps = np.arange(rows + 1, dtype=np.int32)
    bulk[host.input_ids, :rows] = 0
    bulk[host.input_ids, :n] = input_ids
    bulk[host.positions, :rows] = 0
    bulk[host.positions, :n] = positions
    bulk[host.cu_q, : rows + 1] = np.minimum(steps, n)  # padding rows hold no query
    bulk[host.logits_indices, :rows] = np.where(steps[:rows] < n, steps[:rows], 0)
    cu_k = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(positions + 1, out=cu_k[1 : n + 1])
    cu_k[n + 1 :] = cu_k[n]
    for cu_k_row in host.cu_k:
        bulk[cu_k_row, : rows + 1] = cu_k
    host.send(ios, rows)
    # 4) the counters the forward, the graph key and `update_batch` read
    ios.num_q_tokens, ios.max_kv_read, ios.num_request_in_batch = rows, 0, n
    ios.use_block_table = True
    ios.true_write_sizes, ios.true_read_sizes = [0] * len(allocators), [0] * len(allocators)
    ios.max_length_q, ios.total_seqlen_q = 1, n
    for layer_type in ios.cumulative_seqlens_k:
        ios.max_length_k[layer_type] = int(positions.max()) + 1
        ios.total_seqlen_k[layer_type] = int(cu_k[n])
    logits_processors.prepare_tensor_args(batch, arg_storage=ios._bulk_input_tensor[ios.static_inputs :])
    ios.requests_in_batch = batch
    ios.req_id_to_new_token_position = {}  # read by the asynchronous IOs only, which the fast path does not serve
    return _PreviousTable(batch, states, positions, rows)


def _fast_update(ios: ContinuousBatchingIOs, slow: Callable) -> Callable:
    """`update_batch` with the common row inline: a decoding request that gets one more token and goes on (not EOS,
    below its limit, not its first token, no streaming, timestamps or completed page). Every other row (finishing,
    first token, completed page, ...) goes through upstream's `update_batch`, run on those rows only. A batch of the
    fast scheduler (`Batch`) is decided from its plan's arrays (and the plan records which rows went on, for the next
    step's scheduler); any other batch row by row from the request states."""
    decoding = RequestStatus.DECODING

    def update_batch() -> None:
        requests, tokens, logprobs = ios.prepare_batch_update()
        if isinstance(requests, Batch):
            return _run_on(ios, slow, update_planned(requests, tokens, logprobs))
        if not all(f.has_new_token for f in requests):  # token k belongs to the k-th row with a new token
            return _run_on(ios, slow, (requests, tokens, logprobs))
        rest = []
        for i, future_state in enumerate(requests):
            state, token = future_state.state, tokens[i]
            generated = state.generated_tokens
            if (
                token in state._eos_token_ids
                or not 0 < len(generated) < state._new_tokens_limit - 1
                or state.status != decoding
                or state.streaming
                or state.record_timestamps
                or future_state.complete_blocks
            ):
                rest.append(i)
                continue
            generated.append(token)
            state.tokens_to_process = [token]
            if logprobs is not None:
                state.logprobs.append(logprobs[i])
        return _run_on(ios, slow, subset_rows(requests, tokens, logprobs, rest))

    return update_batch


def _run_on(ios: ContinuousBatchingIOs, update: Callable, rows: tuple) -> None:
    """Run upstream's `update_batch` on `rows` (requests, tokens, logprobs) instead of the step's whole batch; it still
    delivers finished requests and forks what waits to be forked."""
    own = ios.__dict__.get("prepare_batch_update")  # a wrapper installed on the instance (policy logprobs), or None
    ios.prepare_batch_update = lambda: rows
    try:
        update()
    finally:
        if own is None:
            del ios.prepare_batch_update
        else:
            ios.prepare_batch_update = own
