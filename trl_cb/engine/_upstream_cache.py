"""The paged cache's storage, reached directly: write a layer's new keys, hand back the storage and its read index.

Why: `PagedAttentionCache.update` writes the new keys and then gathers every key of every request of the batch into one
packed tensor, per layer and per step; `varlen_attention` then gathers again into its padded per-request layout. On
CPU those two copies of all keys are the largest per-layer cost of a decode step. Reading the storage through the
composed index (`read_index[padded positions]`) does one gather instead of two, with identical values.
Only full-attention layers take this path (write, then read back past and new keys: reading the storage is exact). A
sliding-window layer reads before it writes, so `paged_layer` returns None and the caller uses `cache.update`.
The read index itself (every key position of every request, per step) is built by `read_index_rows` from the block
tables with a few tensor ops, not as a Python list of ints (`install_read_index_rows`, CPU without padding).
Upstream surface (pinned in tests/unit/test_contracts.py): `cache.layer_to_allocator`, the allocator's `index`,
`layer_type`, `block_table`, `tokens_per_page`, `block_physical_stride`, `get_read_indices` and
`_kv_token_views[layer]`; the engine's `read_index` / `write_index` / per-layer-type `cu_seq_lens_k` kwargs; and
`ContinuousBatchingIOs.prepare_batch_tensors` with its `requests_in_batch`, `read_index_storage`, `true_read_sizes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching import ContinuousBatchingManager, PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator

__all__ = ["PagedLayer", "install_read_index_rows", "paged_layer", "read_index_rows"]


@dataclass
class PagedLayer:
    """One layer's keys after the write: packed key `i` of the batch is `key_storage[read_index[i]]`, or
    `key_storage[i]` when `read_index` is None (nothing was read from the cache: the storage is the new keys)."""

    key_storage: torch.Tensor  # (slots, Hkv, D)
    value_storage: torch.Tensor  # (slots, Hkv, Dv)
    read_index: torch.Tensor | None  # (Tk,) int64


def paged_layer(
    cache: PagedAttentionCache,
    layer_idx: int,
    key_states: torch.Tensor,  # (1, Hkv, T, D): the forward's new keys
    value_states: torch.Tensor,
    kwargs: dict,  # the attention kwargs; this layer's `cu_seq_lens_k` is selected in place, as `cache.update` does
) -> PagedLayer | None:
    """Write this layer's new keys and values to the cache; None (nothing written) where `cache.update` must run."""
    allocator = cache.layer_to_allocator[layer_idx]
    if type(allocator) is not FullAttentionCacheAllocator or kwargs.get("block_table") is not None:
        return None
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    read_index = kwargs["read_index"][allocator.index]
    write_index = kwargs["write_index"][allocator.index]
    new_keys = key_states[0].transpose(0, 1)  # (T, Hkv, D)
    new_values = value_states[0].transpose(0, 1)
    k_cache, v_cache = allocator._kv_token_views[layer_idx]
    k_cache.index_copy_(0, write_index, new_keys)
    v_cache.index_copy_(0, write_index, new_values)
    if read_index.numel() == 0:  # only fresh prefills: the new keys are every key
        return PagedLayer(new_keys, new_values, None)
    return PagedLayer(k_cache, v_cache, read_index)


def read_index_rows(allocator: FullAttentionCacheAllocator, requests: Sequence[tuple[str, int]]) -> torch.Tensor:
    """Storage rows of keys `[0, length)` of each `(request_id, length)`, request after request: what the allocator's
    `get_read_indices(request_id, past, query)` returns for `past + query == length`, concatenated (int64, CPU)."""
    page, stride = allocator.tokens_per_page, allocator.block_physical_stride
    blocks, starts, lengths = [], [], []
    for request_id, length in requests:
        pages = -(-length // page)
        blocks.extend(allocator.block_table[request_id][:pages])
        starts.extend(range(0, pages * page, page))
        lengths.extend([length] * pages)
    offsets = torch.arange(page)
    rows = torch.tensor(blocks, dtype=torch.int64)[:, None] * stride + offsets  # (pages, page) every page whole
    keep = torch.tensor(starts)[:, None] + offsets < torch.tensor(lengths)[:, None]  # a last page ends mid-page
    return rows[keep]


def _no_reads(request_id: str, past_length: int, query_length: int) -> list[int]:
    return []


def install_read_index_rows(manager: ContinuousBatchingManager) -> None:
    """Build full-attention read indices with `read_index_rows` instead of per-token Python lists (CPU, no padding or
    block table: the batches `varlen_attention` reads). While the engine prepares a batch the allocators report no
    reads; right after, each full-attention group's rows are written where the engine keeps them."""
    processor = manager.batch_processor
    ios = processor.inputs_and_outputs
    allocators = enumerate(processor.cache.cache_allocators.values())
    groups = [(i, a) for i, a in allocators if type(a) is FullAttentionCacheAllocator]
    if not groups or ios.read_index_storage.device.type != "cpu":
        return
    prepare = ios.prepare_batch_tensors

    def prepare_with_rows(requests_in_batch: list, logits_processors: Any, use_decode_fast_path: bool,
                          num_q_tokens: int, max_kv_read: int, use_padding: bool) -> None:  # fmt: skip
        args = (requests_in_batch, logits_processors, use_decode_fast_path, num_q_tokens, max_kv_read, use_padding)
        if use_padding or max_kv_read == 0 or (use_decode_fast_path and ios.block_table.numel() > 0):
            return prepare(*args)
        for _, allocator in groups:
            allocator.get_read_indices = _no_reads
        try:
            prepare(*args)
        finally:
            for _, allocator in groups:
                del allocator.get_read_indices
        requests = [(f.state.request_id, f.state.position_offset) for f in ios.requests_in_batch]
        for i, allocator in groups:
            rows = read_index_rows(allocator, requests)
            ios.read_index_storage[i, : rows.numel()] = rows
            ios.true_read_sizes[i] = rows.numel()

    ios.prepare_batch_tensors = prepare_with_rows
