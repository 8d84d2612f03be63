"""The paged cache's storage, reached directly: write a layer's new keys, hand back the storage and its read index.

Why: `PagedAttentionCache.update` writes the new keys, then gathers every key of the batch into one packed tensor per
layer and step; `varlen_attention` gathers again into its per-request layout. On CPU those two copies are the largest
per-layer cost of a decode step; reading the storage through `read_index[padded positions]` is one gather, same
values. Full-attention layers only (they write, then read past and new keys); a sliding-window layer reads before it
writes, so `paged_layer` returns None and the caller uses `cache.update`. `read_index_rows` builds the read index from
the block tables with tensor ops (`with_read_index_rows`). Who writes the cache depends on the release
(`ATTENTION_UPDATES_CACHE`): up to 5.23 the attention function (it gets `cache`), from 5.24 the model's attention
layer; `engine_layer` hides it, and on 5.24 `with_direct_reads` keeps the one-gather reads and the cache out
of the model's output (`drop_paged_cache_from_outputs`). Upstream surface (tests/unit/test_contracts.py):
`cache.layer_to_allocator`, the allocator's `index`, `layer_type`, `block_table`, `tokens_per_page`,
`block_physical_stride`, `get_read_indices`, `_kv_token_views[layer]`; the engine's `read_index` / `write_index` /
per-layer-type `cu_seq_lens_k` kwargs; `ContinuousBatchingIOs.prepare_batch_tensors` (`requests_in_batch`,
`read_index_storage`, `true_read_sizes`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import _upstream_geometry, _upstream_window
from .paged_decode import REFERENCE_KERNELS, BlockTableLayer, Kernels, gather_pages, write_new_keys

__all__ = [
    "ATTENTION_UPDATES_CACHE",
    "GATHERED_SLOTS_KWARG",
    "KERNELS_ATTR",
    "PagedLayer",
    "block_table_layer",
    "drop_paged_cache_from_outputs",
    "engine_layer",
    "kernels_of",
    "latent_block_table_read",
    "with_direct_reads",
    "with_read_index_rows",
    "paged_layer",
    "read_index_rows",
]

#: Whether the engine's attention function writes the paged cache (transformers <= 5.23: it receives `cache`), or
#: the model's attention layer does before calling it (5.24: `cache.update(key, value, layer_idx, kwargs=kwargs)`).
#: Read from upstream's own sdpa function, which takes `cache` exactly where the attention function is the writer.
ATTENTION_UPDATES_CACHE: bool = "cache" in inspect.signature(sdpa_attention_forward).parameters
#: Attribute (ours) of the key view the 5.24 `update` wrapper returns: its read index, for `engine_layer`. On the
#: tensor rather than in the kwargs because a KV-shared layer (Gemma-3n) receives that same view from its source layer.
_READ_INDEX_ATTR = "_trl_cb_read_index"
#: Attention kwargs (ours): a block-table step's write-trash row, where padding rows write their key; on every engine
#: step, the kernels chosen for the engine (`cuda_kernels.Kernels`, kept on the cache as `KERNELS_ATTR`).
_WRITE_TRASH_KWARG = "_trl_cb_write_trash"
_KERNEL_KWARG = "_trl_cb_kernels"
KERNELS_ATTR = "_trl_cb_kernels"
#: Attention kwarg (ours) of a block-table step: the layer's ring width W where its pages are a sliding-window ring.
_WINDOW_KWARG = "_trl_cb_window"
#: Attribute (ours) of a block-table step's new keys: the layer's block-table kwargs, for a KV-shared layer (Gemma
#: 3n/4), which gets those same keys from its source layer and runs no cache update of its own.
_BLOCK_TABLE_ATTR = "_trl_cb_block_table"
#: Attention kwarg (ours) of a latent layer's block-table step: its keys arrive gathered from the pages (and expanded
#: by the model's layer), this many slots per row (`latent_block_table_read`).
GATHERED_SLOTS_KWARG = "_trl_cb_gathered_slots"
_BLOCK_TABLE_KWARGS = ("k_cache", "v_cache", "block_table", "cu_seq_lens_k", _WRITE_TRASH_KWARG, _KERNEL_KWARG,
                       _WINDOW_KWARG)  # fmt: skip


@dataclass
class PagedLayer:
    """One layer's keys after the write: packed key `i` of the batch is `key_storage[read_index[i]]`, or
    `key_storage[i]` when `read_index` is None (nothing was read from the cache: the storage is the new keys)."""

    key_storage: torch.Tensor  # (slots, Hkv, D)
    value_storage: torch.Tensor  # (slots, Hkv, Dv)
    read_index: torch.Tensor | None  # (Tk,) int64
    kernel: str = "gather"  # the engine's packed-step kernel (`cuda_kernels.Kernels.packed`)


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


def engine_layer(
    cache: object,
    module: torch.nn.Module,
    key_states: torch.Tensor,  # (1, Hkv, T, D): new keys (5.23), or what the model's `cache.update` returned (5.24)
    value_states: torch.Tensor,
    kwargs: dict,  # the attention kwargs
) -> PagedLayer | None:
    """This layer's keys in an engine forward, with the new keys written to the cache; None outside an engine.

    5.23 (`cache` is the engine's, passed to the attention function): write here, directly (`paged_layer`) or, for
    sliding-window layers, through `cache.update`'s packed copy. 5.24 (no `cache`;
    the engine's `write_index` kwarg marks its forwards): the model's layer has written them already, and returned
    either the packed keys or, through `with_direct_reads`, the storage and its read index. A KV-shared layer
    (Gemma-3n) runs no update: it gets the keys its source layer of the same type got, and its type's key lengths here.
    """
    if isinstance(cache, PagedAttentionCache):
        kwargs[_KERNEL_KWARG] = kernels_of(cache)
        layer = paged_layer(cache, module.layer_idx, key_states, value_states, kwargs)
        if layer is not None:
            layer.kernel = kwargs[_KERNEL_KWARG].packed
            return layer
        key_states, value_states = cache.update(
            key_states=key_states, value_states=value_states, layer_idx=module.layer_idx, kwargs=kwargs
        )
    elif ATTENTION_UPDATES_CACHE or "write_index" not in kwargs:
        return None
    elif isinstance(kwargs["cu_seq_lens_k"], dict):  # no `cache.update` selected this layer's group: a KV-shared layer
        per_type = kwargs["cu_seq_lens_k"]
        layer_type = getattr(module, "layer_type", None)
        if layer_type not in per_type:
            raise ValueError(f"Layer {module.layer_idx} reads shared keys of an unknown attention type: {layer_type}")
        kwargs["cu_seq_lens_k"], kwargs["max_length_k"] = per_type[layer_type], kwargs["max_length_k"][layer_type]
    read_index = getattr(key_states, _READ_INDEX_ATTR, None)
    kernel = kwargs.get(_KERNEL_KWARG, REFERENCE_KERNELS).packed
    return PagedLayer(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), read_index, kernel)


def with_direct_reads(
    cache: PagedAttentionCache, model: PreTrainedModel, attention_name: str, update: Callable
) -> Callable | None:
    """transformers 5.24+ (None before, where the attention function writes the cache): the engine cache's `update`
    keeping `attention_name`'s one-gather reads. While the model runs `attention_name`, a full-attention layer's new
    keys are written by `paged_layer` and the storage is returned with its read index on the key view (`engine_layer`
    takes it back), instead of upstream's packed copy of every key; a block-table step's kwargs get the layer's
    write-trash row; anything else goes to `update` unchanged. Every engine step's kwargs carry the engine's kernel
    choice. The caller also keeps the cache out of the model's output (`drop_paged_cache_from_outputs`)."""
    if ATTENTION_UPDATES_CACHE:
        return None
    latent = _upstream_geometry.expands_cached_keys(model.config.get_text_config())  # its layer expands what it reads

    def update_with_direct_reads(
        key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kwargs is not None:
            kwargs[_KERNEL_KWARG] = kernels_of(cache)
        if kwargs is not None and model.config._attn_implementation == attention_name:
            layer = paged_layer(cache, layer_idx, key_states, value_states, kwargs)
            if layer is not None:
                keys = layer.key_storage.transpose(0, 1)[None]  # (1, Hkv, slots, D): a fresh view every call
                setattr(keys, _READ_INDEX_ATTR, layer.read_index)
                return keys, layer.value_storage.transpose(0, 1)[None]
        if kwargs is not None and kwargs.get("block_table") is not None:
            _mark_block_table_step(cache, layer_idx, kwargs)
            if latent:
                update(key_states=key_states, value_states=value_states, layer_idx=layer_idx, kwargs=kwargs)
                return latent_block_table_read(key_states, value_states, kwargs)
        return update(key_states=key_states, value_states=value_states, layer_idx=layer_idx, kwargs=kwargs)

    return update_with_direct_reads


def latent_block_table_read(
    key_states: torch.Tensor,  # (1, 1, R, Dk): this step's latent "keys", one per row
    value_states: torch.Tensor,  # (1, 1, R, Dv): its rotary "values"
    kwargs: dict,  # a block-table step's kwargs, filled by upstream's `cache.update` and `_mark_block_table_step`
) -> tuple[torch.Tensor, torch.Tensor]:  # (1, 1, R * L, Dk), (1, 1, R * L, Dv)
    """A latent layer's block-table step (5.24): its layer expands what the cache returns, so no kernel may read its
    pages as keys. Write this step's latents through the block table (zero-padded to the pages' width), return every
    row's L slots gathered and cut to the widths written; the attention function attends row r to its first
    `seq_lens[r]` slots (`GATHERED_SLOTS_KWARG`). Shapes fixed by the padded rows and the table: graph-safe."""
    pages = kwargs["k_cache"]
    key_width, value_width = key_states.shape[-1], value_states.shape[-1]

    def padded(states: torch.Tensor) -> torch.Tensor:  # (R, 1, width)
        return torch.nn.functional.pad(states[0].transpose(0, 1), (0, pages.shape[-1] - states.shape[-1]))

    layer = BlockTableLayer(
        new_keys=padded(key_states),
        new_values=padded(value_states),
        key_pages=pages,
        value_pages=kwargs["v_cache"],
        block_table=kwargs["block_table"],
        cu_seq_lens_k=kwargs["cu_seq_lens_k"],
        write_trash=kwargs[_WRITE_TRASH_KWARG],
    )
    write_new_keys(layer)
    keys, values = gather_pages(layer)  # (R, L, 1, width)
    rows, slots = keys.shape[:2]
    kwargs[GATHERED_SLOTS_KWARG] = slots
    keys = keys[..., :key_width].reshape(1, rows * slots, 1, key_width).transpose(1, 2)
    return keys, values[..., :value_width].reshape(1, rows * slots, 1, value_width).transpose(1, 2)


def block_table_layer(
    cache: object,
    module: torch.nn.Module,
    key_states: torch.Tensor,  # (1, Hkv, R, D): this step's keys, one per row (not yet written)
    value_states: torch.Tensor,
    kwargs: dict,  # the attention kwargs of a block-table (decode) step
) -> BlockTableLayer:
    """A decode step's inputs in block-table form (`paged_decode.BlockTableLayer`), the new keys not yet written.

    Upstream's `cache.update` fills `kwargs` for a block-table step without writing anything (a flash kernel writes):
    the layer's `block_table` row, its page views `k_cache` / `v_cache` and its `cu_seq_lens_k`. Up to 5.23 the
    attention function gets `cache` and calls it here; from 5.24 the model's layer called it (through
    `with_direct_reads`, which also hands over the allocator's write-trash row and ring width). A KV-shared layer ran
    no update: it reads its source layer's pages, found on the keys it shares (writing that key again is a no-op)."""
    if isinstance(cache, PagedAttentionCache):
        cache.update(key_states=key_states, value_states=value_states, layer_idx=module.layer_idx, kwargs=kwargs)
        _mark_block_table_step(cache, module.layer_idx, kwargs)
    if "k_cache" in kwargs:
        setattr(key_states, _BLOCK_TABLE_ATTR, {name: kwargs[name] for name in _BLOCK_TABLE_KWARGS})
    else:
        source = getattr(key_states, _BLOCK_TABLE_ATTR, None)
        if source is None:
            raise ValueError(f"Layer {module.layer_idx} reads keys in a block-table step that no cache update gave")
        kwargs = {**kwargs, **source}
    return BlockTableLayer(
        new_keys=key_states[0].transpose(0, 1),
        new_values=value_states[0].transpose(0, 1),
        key_pages=kwargs["k_cache"],
        value_pages=kwargs["v_cache"],
        block_table=kwargs["block_table"],
        cu_seq_lens_k=kwargs["cu_seq_lens_k"],
        write_trash=kwargs[_WRITE_TRASH_KWARG],
        kernel=kwargs[_KERNEL_KWARG].paged,
        window=kwargs[_WINDOW_KWARG],
    )


def _mark_block_table_step(cache: PagedAttentionCache, layer_idx: int, kwargs: dict) -> None:
    allocator = cache.layer_to_allocator[layer_idx]
    kwargs[_WRITE_TRASH_KWARG] = allocator.write_trash_index
    kwargs[_KERNEL_KWARG] = kernels_of(cache)
    kwargs[_WINDOW_KWARG] = _upstream_window.window_of(allocator)


def kernels_of(cache: object) -> Kernels:
    """The attention kernels chosen for the engine owning `cache` (`REFERENCE_KERNELS` until one is chosen)."""
    return getattr(cache, KERNELS_ATTR, REFERENCE_KERNELS)


def drop_paged_cache_from_outputs(model: PreTrainedModel) -> None:
    """Keep the engine's `PagedAttentionCache` out of `model`'s outputs (transformers 5.24+; idempotent).

    From 5.24 the engine passes its cache as the model's `cache` argument, and many models (Gemma-2, Llama, ...)
    return it unconditionally (`BaseModelOutputWithPast(cache=cache)`). Under accelerate's mixed precision the
    trainer's forward wrapper then converts every output with a half-precision `dtype` to fp32 and calls `.float()` on
    the cache (`AttributeError` in the engine loop). A forward hook on the base model returns its output without a
    paged cache; every other output (a training forward's `DynamicCache`, or none) passes through untouched."""
    base = model.base_model
    if getattr(base, "_trl_cb_drops_paged_cache", False):
        return
    base.register_forward_hook(_without_paged_cache)
    base._trl_cb_drops_paged_cache = True


def _without_paged_cache(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    if isinstance(getattr(output, "cache", None), PagedAttentionCache):
        return type(output)(**{name: value for name, value in output.items() if name != "cache"})
    return output


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


def with_read_index_rows(processor: Any, prepare: Callable) -> Callable | None:
    """`prepare_batch_tensors` building full-attention read indices with `read_index_rows` instead of per-token Python
    lists (CPU, no padding or block table: the batches `varlen_attention` reads); None where nothing fits. While the
    engine prepares a batch the allocators report no reads; right after, each full-attention group's rows are written
    where the engine keeps them."""
    ios = processor.inputs_and_outputs
    allocators = enumerate(processor.cache.cache_allocators.values())
    groups = [(i, a) for i, a in allocators if type(a) is FullAttentionCacheAllocator]
    if not groups or ios.read_index_storage.device.type != "cpu":
        return None

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

    return prepare_with_rows
