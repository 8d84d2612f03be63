"""Prefix-cache block hashes chained from the weights' epoch at each request's start: a prompt submitted after a
weight update never reuses KV blocks that older weights computed (they are recomputed); under the same weights,
prompts share them.

Why: transformers' block sharing keys a block by its tokens, not by the weights that computed its KV. Sync rounds
clear the ledger each round; an engine that keeps requests in flight across updates cannot, so async engines ran
without sharing. Here every hash chain starts from the epoch its request (a forked sample: its parent) started in,
`bump_weight_epoch` at each update, and a new prompt matches only the current epoch's chains. The start epoch, not
the epoch a block completes in: a block completed after an update still holds KV the old weights wrote (measured: a
turn reusing one was 2.6 nats off). Requests in flight keep their blocks (partial rollouts, as before).

`_upstream_patches.install_epoch_hashes` puts both on transformers' classes (process-wide, once). Upstream surface
(tests/unit/test_contracts.py): `cache_allocator.compute_block_hash(parent_hash, tokens)` called by
name in the allocators' `match_prefix_blocks` / `mark_complete_blocks`; `PagedAttentionCache.mark_complete_blocks
(state, complete_blocks)`, called for every request of every step; a forked state copies its parent's attributes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from transformers.generation.continuous_batching.cache_allocators import cache_allocator

__all__ = ["bump_weight_epoch", "epoch_hash", "weight_epoch", "with_start_epoch", "with_two_tokens_left"]

_upstream_hash = cache_allocator.compute_block_hash
_lock = threading.Lock()
_epoch = 0
_marking = threading.local()  # the epoch of the request whose blocks are being hashed (`mark_complete_blocks`)
#: Where a request's start epoch is kept: an attribute of its `RequestState`, set at its first forward (the step it
#: was scheduled in, so before any update can land) and copied with the state when it forks its samples.
_STATE_EPOCH = "_trl_cb_weight_epoch"


def weight_epoch() -> int:
    return _epoch


def bump_weight_epoch() -> int:
    """The weights changed (call while no engine step runs): prompts from now on match only new chains."""
    global _epoch
    with _lock:
        _epoch += 1
        return _epoch


def epoch_hash(parent_hash: int | None, tokens: list[int]) -> int:
    """`compute_block_hash` with a chain's first block hung off its request's start epoch (a new prompt's: the current
    one); later blocks chain from their parent as upstream's do."""
    if parent_hash is None:
        parent_hash = getattr(_marking, "epoch", None)
        parent_hash = _epoch if parent_hash is None else parent_hash
    return _upstream_hash(parent_hash, tokens)


def with_start_epoch(mark: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
    """`PagedAttentionCache.mark_complete_blocks` hashing a request's blocks from the epoch it started in (kept on its
    state at its first forward, copied to its forked samples)."""

    def mark_complete_blocks(self: Any, state: Any, complete_blocks: Any) -> None:
        _marking.epoch = state.__dict__.setdefault(_STATE_EPOCH, _epoch)
        try:
            mark(self, state, complete_blocks)
        finally:
            _marking.epoch = None

    return mark_complete_blocks


def with_two_tokens_left(search: Callable[[str, list[int]], int]) -> Callable[[str, list[int]], int]:
    """`PagedAttentionCache.search_prefix_match(request_id, prompt_ids)` (`search`) matching whole pages of all but the
    prompt's last token, so that at least two prompt tokens are left to prefill.

    Why: transformers' match leaves one, but a request with samples to fork prefills all but its last token before it
    forks, which then leaves it an empty forward (it fails: "cannot reshape tensor of 0 elements"). The cost: at most
    one page less reused, for a prompt one token past a page boundary."""

    def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
        return search(request_id, prompt_ids[:-1])

    return search_prefix_match
