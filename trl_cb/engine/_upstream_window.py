"""Sliding-window layers in block-table decode steps: upstream's ring of pages, read and written through a block table.

Why: transformers' sliding-window allocator keeps each request's last W keys in a ring of `ceil(W / page)` pages (the
key of position p in ring slot `p % W`) but offers no block table, so every windowed family (Mistral, Gemma 2/3/4,
gpt-oss, ...) decoded eagerly, without graphs. A decode query at position p sees keys p - W + 1 .. p: once its key is
written at slot `p % W` (over key p - W, which it must not see), those are exactly the ring's slots
`[0, min(p + 1, W))`, in ring order; attention does not depend on the keys' order (their positions are in their
rotary embedding). So the ring's block ids fill the block table as a full-attention group's do, and in block-table
steps a windowed group's key count is the request's absolute length p + 1 (upstream's is `min(p + 1, W)`), from which
`paged_decode` finds the slot to write and the slots to read on the device (no host read: graph-safe).
Invariants: packed (prefill, mixed) steps see upstream's ring unchanged; windowed block tables only on synchronous
IOs (`windowed_block_tables_fit`). Upstream surface (tests/unit/test_contracts.py): `SlidingAttentionCacheAllocator`
(`sliding_window`, `get_seqlen_k`, `fill_block_table`, `get_cache_for_block_table`), the cache's
`max_decode_fast_path_length` and `max_blocks_per_request`, the IOs' `use_block_table`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
    SlidingAttentionCacheAllocator,
)

__all__ = [
    "RingMethods",
    "decode_fast_path_length",
    "reads_block_tables",
    "ring_methods",
    "rings",
    "window_of",
    "windowed_block_tables_fit",
]

#: (`fill_block_table`, `get_cache_for_block_table`, `get_seqlen_k`) of one ring allocator.
RingMethods = tuple[Callable[..., None], Callable[[int], Any], Callable[[int, int], int]]


def window_of(allocator: object) -> int | None:
    """The ring's W for a sliding-window allocator, None for any other (its pages hold every key)."""
    return allocator.sliding_window if isinstance(allocator, SlidingAttentionCacheAllocator) else None


def rings(cache: Any) -> list[SlidingAttentionCacheAllocator]:
    """The cache's sliding-window allocators."""
    return [a for a in cache.cache_allocators.values() if isinstance(a, SlidingAttentionCacheAllocator)]


def reads_block_tables(allocator: object) -> bool:
    """Whether `allocator` is a ring that `_upstream_patches.install` gave the block-table methods (`ring_methods`)."""
    return window_of(allocator) is not None and allocator.supports_block_table


def windowed_block_tables_fit(continuous_batching_config: Any) -> bool:
    """Whether a model's windowed layers may decode through block tables: only on synchronous IOs, whose
    `use_block_table` is the step being prepared (`ring_methods`' key counts read it)."""
    return not continuous_batching_config.use_async_batching


def ring_methods(allocator: SlidingAttentionCacheAllocator, ios: Any) -> RingMethods:
    """The three methods a ring allocator gets where block tables are on (`_upstream_patches.install` sets them):
    its block ids in the table and its page views, as a full-attention group's; its key count absolute in the
    block-table steps `ios` prepares, upstream's (`min(past + query, W)`) in every other step."""
    upstream_seqlen_k = allocator.get_seqlen_k

    def fill_block_table(request_id: str, past_length: int, query_length: int, block_table: Any) -> None:
        FullAttentionCacheAllocator.fill_block_table(allocator, request_id, past_length, query_length, block_table)

    def get_cache_for_block_table(layer_idx: int) -> Any:
        return FullAttentionCacheAllocator.get_cache_for_block_table(allocator, layer_idx)

    def get_seqlen_k(past_length: int, query_length: int) -> int:
        if ios.use_block_table:
            return past_length + query_length
        return upstream_seqlen_k(past_length, query_length)

    return fill_block_table, get_cache_for_block_table, get_seqlen_k


def decode_fast_path_length(cache: Any) -> int:
    """The longest request the scheduler sends through block tables once every allocator has one: as upstream computes
    it (`_infer_max_decode_fast_path_length`), a request's table holding `max_blocks_per_request` pages."""
    return min(a.tokens_per_page for a in cache.cache_allocators.values()) * cache.max_blocks_per_request
