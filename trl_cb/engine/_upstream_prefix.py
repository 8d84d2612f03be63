"""Prefix-cache block hashes chained from the weights' epoch at each request's start: a prompt submitted after a
weight update never reuses KV blocks that older weights computed (they are recomputed); under the same weights,
prompts share them.

Why: transformers' block sharing keys a block by its tokens, not by the weights that computed its KV. Sync rounds
clear the ledger each round; an engine that keeps requests in flight across updates cannot, so async engines ran
without sharing. Here every hash chain starts from the epoch its request (a forked sample: its parent) started in,
`bump_weight_epoch` at each update, and a new prompt matches only the current epoch's chains. The start epoch, not
the epoch a block completes in: a block completed after an update still holds KV the old weights wrote (measured: a
turn reusing one was 2.6 nats off). Requests in flight keep their blocks (partial rollouts, as before).

Upstream surface (tests/unit/test_contracts.py): `cache_allocator.compute_block_hash(parent_hash, tokens)` called by
name in `match_prefix_blocks` / `mark_complete_blocks(request_id, ...)`; `PagedAttentionCache.search_prefix_match
(request_id, prompt_ids)` at each request's (re)start, `PagedAttentionCache.free_blocks(request_id, ...)`.
"""

from __future__ import annotations

import threading
from typing import Any

from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import cache_allocator

__all__ = ["bump_weight_epoch", "install_epoch_hashes", "weight_epoch"]

_upstream_hash = cache_allocator.compute_block_hash
_lock = threading.Lock()
_epoch = 0
_request_epochs: dict[str, int] = {}  # request id -> the epoch it (re)started in
_marking = threading.local()  # the epoch of the request whose blocks are being hashed (`mark_complete_blocks`)
_installed = False
_CHILD = "__child#"  # how upstream names a forked sample's request: f"{parent}__child#{i}"


def weight_epoch() -> int:
    return _epoch


def bump_weight_epoch() -> int:
    """The weights changed (call while no engine step runs): prompts from now on match only new chains."""
    global _epoch
    with _lock:
        _epoch += 1
        return _epoch


def _epoch_hash(parent_hash: int | None, tokens: list[int]) -> int:
    # A chain's first block hangs off its request's start epoch; later blocks chain from their parent as upstream's.
    if parent_hash is None:
        parent_hash = getattr(_marking, "epoch", None)
        parent_hash = _epoch if parent_hash is None else parent_hash
    return _upstream_hash(parent_hash, tokens)


def install_epoch_hashes() -> bool:
    """Chain the block hashes of this process's engines from the weight epoch (idempotent; process-wide: an epoch
    only ever makes fewer blocks match, which is safe for every engine). Returns True (block sharing may be on)."""
    global _installed
    with _lock:
        if _installed:
            return True
        _installed = True
    search, free = PagedAttentionCache.search_prefix_match, PagedAttentionCache.free_blocks
    mark = cache_allocator.CacheAllocator.mark_complete_blocks

    def search_prefix_match(self: Any, request_id: str, prompt_ids: list[int]) -> int:
        _request_epochs[request_id] = _epoch  # the request (re)starts: its blocks chain from now
        return search(self, request_id, prompt_ids)

    def free_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
        if _CHILD not in request_id:  # a parent may finish before its children mark their blocks: kept for them
            _request_epochs.setdefault(request_id, _epoch)
        else:
            _request_epochs.pop(request_id, None)
        free(self, request_id, *args, **kwargs)

    def mark_complete_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
        # A forked sample started with its parent (`_upstream.add_forked_request`'s ids): it shares its parent's epoch
        parent = request_id.split(_CHILD, 1)[0]
        _marking.epoch = _request_epochs.get(request_id, _request_epochs.get(parent, _epoch))
        try:
            mark(self, request_id, *args, **kwargs)
        finally:
            _marking.epoch = None

    cache_allocator.compute_block_hash = _epoch_hash
    PagedAttentionCache.search_prefix_match = search_prefix_match
    PagedAttentionCache.free_blocks = free_blocks
    cache_allocator.CacheAllocator.mark_complete_blocks = mark_complete_blocks
    return True
