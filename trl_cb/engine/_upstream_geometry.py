"""Cache geometry per layer group: each group of layers the engine caches together gets pages of its own shape.

Why: transformers' engine sizes every cache slot from one KV-head count and one head size of the whole config
(`find_num_key_value_heads`, `find_head_dim`). Gemma 4's global layers are wider than its sliding ones (a
heterogeneous config: `per_layer_config`), and multi-head latent attention (DeepSeek-V2/V3) caches its compressed
latent, one head whose "keys" are `kv_lora_rank` wide and "values" (the shared rotary key) `qk_rope_head_dim` wide,
expanded by the model's own layer after the read. While an engine is built (`per_group_geometry`), each allocator is
built for its group's shape and the memory model counts a whole-model block's exact bytes.
Invariants: a model whose layers all have upstream's shape gets upstream's cache untouched (nothing is patched); one
group holds one shape, else `ValueError` before anything is allocated; keys and values of different widths share
pages of the wider width, the narrower zero-padded on write and cut on read (`PaddedAllocator`): exact (the padding is
never read), at a memory cost `docs/models.md` measures. Upstream surface (tests/unit/test_contracts.py): the cache
module's `ATTN_TYPE_TO_ALLOCATOR`, `PagedAttentionMemoryHandler(bytes_per_block=...)`, `find_head_dim`,
`find_num_key_value_heads`; the allocators' `(index, config, num_key_value_heads, ..., layer_indices)` and `update`.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching import cache as _cb_cache
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

__all__ = [
    "LATENT_FAMILIES",
    "PaddedAllocator",
    "SlotShape",
    "expands_cached_keys",
    "layer_shapes",
    "per_group_geometry",
    "upstream_shape",
]

#: Families whose attention layer caches its compressed latent and expands it after the read (`expand_kv`), measured
#: exact through the engine (tests/unit/checks/test_compat_matrix.py).
LATENT_FAMILIES = frozenset({"deepseek_v2", "deepseek_v3"})

_lock = threading.Lock()


@dataclass(frozen=True)
class SlotShape:
    """What one layer writes to the cache per token: `kv_heads` heads of `key_width` keys and `value_width` values."""

    kv_heads: int
    key_width: int
    value_width: int

    @property
    def width(self) -> int:
        """The pages' width: both keys and values are stored this wide."""
        return max(self.key_width, self.value_width)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of one token's keys and values as stored (both `width` wide)."""
        return 2 * self.kv_heads * self.width * dtype.itemsize


def layer_shapes(text_config: Any) -> list[SlotShape]:
    """Each decoder layer's `SlotShape`, from the config alone. `ValueError` for a latent-attention family outside
    `LATENT_FAMILIES` (its layer may hand the cache something else)."""
    layers = text_config.num_hidden_layers
    if expands_cached_keys(text_config):
        if getattr(text_config, "model_type", None) not in LATENT_FAMILIES:
            raise ValueError(f"latent attention of model_type={text_config.model_type!r} is not measured exact")
        return [SlotShape(1, text_config.kv_lora_rank, text_config.qk_rope_head_dim)] * layers
    if getattr(text_config, "is_heterogeneous", False):
        configs: Sequence[Any] = text_config.per_layer_config
    else:
        configs = [text_config] * layers
    return [SlotShape(find_num_key_value_heads(c), find_head_dim(c), find_head_dim(c)) for c in configs]


def upstream_shape(text_config: Any) -> SlotShape | None:
    """The one shape transformers' engine gives every slot; None where it cannot read one (per-layer head sizes)."""
    try:
        head_dim = find_head_dim(text_config)
        return SlotShape(find_num_key_value_heads(text_config), head_dim, head_dim)
    except (RuntimeError, ValueError):
        return None


def group_shape(shapes: Sequence[SlotShape], layer_indices: Sequence[int]) -> SlotShape:
    """The one shape of a group's layers; `ValueError` naming them where they differ."""
    found = {shapes[i] for i in layer_indices}
    if len(found) != 1:
        raise ValueError(f"layers {list(layer_indices)} are cached together but have different shapes: {found}")
    return found.pop()


class PaddedAllocator(FullAttentionCacheAllocator):
    """Full-attention pages `width` wide for a group whose keys and values differ in width: the narrower is
    zero-padded on write and cut on read, so the layer gets back exactly the widths it wrote."""

    shape: SlotShape

    def update(
        self,
        key_states: torch.Tensor,  # (T, kv_heads, key_width)
        value_states: torch.Tensor,  # (T, kv_heads, value_width)
        layer_idx: int,
        read_index: torch.Tensor,
        write_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.shape.width
        keys, values = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (key_states, value_states))
        keys, values = super().update(keys, values, layer_idx, read_index, write_index)
        return keys[..., : self.shape.key_width], values[..., : self.shape.value_width]


def _group_allocator(base: type, shapes: Sequence[SlotShape], sliding_window: int | None) -> type:
    """`ATTN_TYPE_TO_ALLOCATOR`'s entry for `base`: a class whose construction returns upstream's `base` (or, for
    keys and values of different widths, `PaddedAllocator`) built for the group's shape. A subclass, so that what
    reads the entry's class attributes (`supports_block_table`, `layer_type`) reads upstream's; the instance is
    upstream's own class, so trl_cb's direct reads of full-attention pages apply unchanged."""

    def build(cls: type, *, config: Any, num_key_value_heads: int, layer_indices: list[int], **kwargs: Any) -> Any:
        shape = group_shape(shapes, layer_indices)
        built = base
        if shape.key_width != shape.value_width:
            if base is not FullAttentionCacheAllocator:
                raise ValueError(f"{base.__name__}: keys and values of different widths ({shape}) are not served")
            built = type("PaddedAllocator", (PaddedAllocator,), {"shape": shape})
        group_config = types.SimpleNamespace(head_dim=shape.width, sliding_window=sliding_window)
        return built(config=group_config, num_key_value_heads=shape.kv_heads, layer_indices=layer_indices, **kwargs)

    return type(base.__name__, (base,), {"__new__": build})


def expands_cached_keys(text_config: Any) -> bool:
    """Whether the model's attention layer expands what it reads from the cache (latent attention): a kernel that
    reads the pages as keys and values (block-table decode) would skip that."""
    return getattr(text_config, "kv_lora_rank", None) is not None


def _memory_handler(upstream: type, block_bytes: Callable[[torch.dtype, int], int]) -> type:
    """upstream's memory model with a whole-model block's exact bytes (upstream's assumes one slot shape)."""

    class MemoryHandler(upstream):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.bytes_per_block = block_bytes(self.cache_dtype, self.cb_config.page_size)

    return MemoryHandler


@contextlib.contextmanager
def per_group_geometry(text_config: Any) -> Iterator[None]:
    """While an engine is built for a model with `text_config`: each allocator sized for its group's shape, the memory
    model for the exact block bytes and, conservatively, for the widest slot and the most KV heads of any layer.
    Process-wide for the duration (it patches names of transformers' cache module), serialised by a lock; a model
    whose layers all have upstream's shape builds upstream's cache, nothing patched."""
    shapes = layer_shapes(text_config)
    if {upstream_shape(text_config)} == set(shapes):
        yield
        return
    widest, most_heads = max(s.width for s in shapes), max(s.kv_heads for s in shapes)
    sliding_window = getattr(text_config, "sliding_window", None)
    allocators = {
        kind: _group_allocator(base, shapes, sliding_window) for kind, base in _cb_cache.ATTN_TYPE_TO_ALLOCATOR.items()
    }

    def block_bytes(dtype: torch.dtype, page_size: int) -> int:
        return page_size * sum(s.bytes_per_token(dtype) for s in shapes)

    patched = {
        "ATTN_TYPE_TO_ALLOCATOR": allocators,
        "PagedAttentionMemoryHandler": _memory_handler(_cb_cache.PagedAttentionMemoryHandler, block_bytes),
        "find_head_dim": lambda config: widest,
        "find_num_key_value_heads": lambda config: most_heads,
    }
    with _lock:
        saved = {name: getattr(_cb_cache, name) for name in patched}
        for name, value in patched.items():
            setattr(_cb_cache, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(_cb_cache, name, value)
