"""Decode attention through the paged cache's block table: no host reads, shapes fixed by the padded row count, so a
decode step can be captured once and replayed as an accelerator graph (`decode_graphs.py`); the kernel names.

Why: `varlen_attention` plans decode buckets from host-side lengths (a device-to-host read per forward) in shapes that
change every step; a graph replays its capture's shapes and host decisions. Here each row's key count (`seq_lens`,
from the engine's `cu_seq_lens_k`) and pages (the engine's kernel block table: page ids of the layer's page view, -1
past its pages) are read on the device. The new key is written at its position through the block table (padding
rows, `seq_lens == 0`, to the write-trash row; a sliding-window layer's pages: a ring of W slots, `_upstream_window`:
at slot `(seq_lens - 1) % W`), then attended by one of three kernels: `flash`, torch's varlen flash kernel reading the
pages (CUDA, fp16/bf16, pages of a multiple of 256, a torch whose `varlen_attn` takes a block table); `triton`,
trl_cb's kernel reading the pages, writing the new keys in the same launch (`triton_decode.py`; no windows); `gather`
(any device or dtype, softcap, sinks): each row's pages gathered into one padded batch, one masked SDPA call: the
reference the others are checked against once per engine (`cuda_kernels.choose`).
Invariant: every row with `seq_lens > 0` gets exact causal attention of its query over keys `[0, seq_lens)` (a ring:
slots `[0, min(seq_lens, W))`, the last W keys in ring order); padding rows get a finite, unused output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import triton_decode
from .masked_attention import masked_attention

__all__ = [
    "FLASH",
    "FLASH_PAGE_MULTIPLE",
    "REFERENCE",
    "REFERENCE_KERNELS",
    "TRITON",
    "BlockTableLayer",
    "Kernels",
    "attend",
    "attend_padded",
    "gather_pages",
    "write_new_keys",
]

#: torch's in-tree flash kernel (FlashAttention-2) reads paged KV only in pages of a multiple of 256 tokens.
FLASH_PAGE_MULTIPLE = 256
FLASH, TRITON, REFERENCE = "flash", "triton", "gather"


@dataclass(frozen=True)
class Kernels:
    """An engine's attention kernels (`cuda_kernels.choose`): `packed` for packed steps (prefill, mixed; `FLASH` or
    `REFERENCE`), `paged` for block-table decode steps (`FLASH`, `TRITON` or `REFERENCE`)."""

    packed: str = REFERENCE
    paged: str = REFERENCE


#: What an engine runs unless `cuda_kernels.choose` found a fused kernel that agrees with the reference (CPU, tests).
REFERENCE_KERNELS = Kernels()


@dataclass
class BlockTableLayer:
    """One layer's decode inputs in block-table form (from `_upstream_cache.block_table_layer`)."""

    new_keys: torch.Tensor  # (R, Hkv, D): this step's key of each row
    new_values: torch.Tensor  # (R, Hkv, Dv)
    key_pages: torch.Tensor  # (pages, page, Hkv, D): the layer's cache as pages
    value_pages: torch.Tensor  # (pages, page, Hkv, Dv)
    block_table: torch.Tensor  # (R, max_pages) int32: page ids of each row, -1 past its pages
    cu_seq_lens_k: torch.Tensor  # (R + 1,) int32: cumulative key counts (the new key included), flat for padding
    write_trash: int  # a token row of the layer's cache that nothing reads
    kernel: str = REFERENCE  # `Kernels.paged` of this engine
    window: int | None = None  # a sliding-window layer's W: its pages are a ring of W slots

    @property
    def seq_lens(self) -> torch.Tensor:  # (R,) int32: keys up to and including the new one (absolute)
        return self.cu_seq_lens_k[1:] - self.cu_seq_lens_k[:-1]

    @property
    def visible(self) -> torch.Tensor:  # (R,) int64: the keys the query attends to, slots [0, visible)
        seq_lens = self.seq_lens.to(torch.int64)
        return seq_lens if self.window is None else seq_lens.clamp(max=self.window)

    @property
    def pages_read(self) -> int:  # block-table columns that can hold a visible key (a ring's pages only)
        width = self.block_table.shape[1]
        return width if self.window is None else min(width, -(-self.window // self.key_pages.shape[1]))


def write_new_keys(layer: BlockTableLayer) -> None:
    """Write each row's new key and value at its position (`seq_lens - 1`) through the block table; padding rows write
    to the trash row; a windowed layer writes at the ring slot `position % W`. All on the device: no host read."""
    page = layer.key_pages.shape[1]
    seq_lens = layer.seq_lens.to(torch.int64)  # (R,)
    position = (seq_lens - 1).clamp(min=0)  # (R,)
    if layer.window is not None:
        position = position % layer.window
    page_ids = layer.block_table.to(torch.int64).gather(1, (position // page)[:, None]).squeeze(1)  # (R,)
    rows = torch.where(seq_lens > 0, page_ids * page + position % page, layer.write_trash)  # (R,) token rows
    key_rows = layer.key_pages.view(-1, *layer.key_pages.shape[2:])  # (pages * page, Hkv, D), same storage
    value_rows = layer.value_pages.view(-1, *layer.value_pages.shape[2:])
    key_rows.index_copy_(0, rows, layer.new_keys.to(key_rows.dtype))
    value_rows.index_copy_(0, rows, layer.new_values.to(value_rows.dtype))


def attend(
    query: torch.Tensor,  # (R, H, D): one query token per row
    layer: BlockTableLayer,
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (R, H, Dv)
    """Write the new keys (`write_new_keys`), then attend each row's query to its keys with `layer.kernel`."""
    if query.shape[0] != layer.block_table.shape[0]:
        raise ValueError(
            f"Block-table decode takes one query per row: {query.shape[0]} queries for {layer.block_table.shape[0]}"
            " rows."
        )
    if layer.kernel == TRITON and softcap is None and sinks is None and layer.window is None:  # writes the new keys
        return triton_decode.paged_decode_attention(
            query, layer.new_keys, layer.new_values, layer.key_pages, layer.value_pages, layer.block_table,
            layer.cu_seq_lens_k, layer.write_trash, scaling,
        )  # fmt: skip
    write_new_keys(layer)
    if layer.kernel == FLASH and softcap is None and sinks is None:
        return _flash(query, layer, scaling)
    return _gather(query, layer, scaling, softcap, sinks)


def gather_pages(layer: BlockTableLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's readable pages in one padded batch: keys (R, L, Hkv, D), values (R, L, Hkv, Dv), L = `pages_read`
    pages; a row's key j is its slot j (slots past its keys hold anything: mask them with `visible`)."""
    pages = layer.block_table[:, : layer.pages_read].to(torch.int64).clamp(min=0)  # (R, P): -1 reads page 0
    return layer.key_pages[pages].flatten(1, 2), layer.value_pages[pages].flatten(1, 2)


def attend_padded(
    query: torch.Tensor,  # (R, H, D): one query token per row
    keys: torch.Tensor,  # (R, Hkv, L, D): each row's slots
    values: torch.Tensor,  # (R, Hkv, L, Dv)
    visible: torch.Tensor,  # (R,): row r attends to its slots [0, visible[r])
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (R, H, Dv)
    """One masked attention call over padded rows (GQA packed into the query rows); a padding row (`visible` 0) sees
    its first slot: a finite, unused output."""
    rows, num_heads, head_dim = query.shape
    num_kv = keys.shape[1]
    n_rep = num_heads // num_kv
    mask = torch.arange(keys.shape[2], device=query.device)[None, :] < visible.clamp(min=1)[:, None]  # (R, L)
    q = query.reshape(rows, num_kv, n_rep, head_dim)  # (R, Hkv, n_rep, D)
    grouped_sinks = None if sinks is None else sinks.reshape(num_kv, n_rep)
    out = masked_attention(q, keys, values, mask[:, None, None, :], False, scaling, softcap, grouped_sinks, n_rep)
    return out.reshape(rows, num_heads, values.shape[-1])


def _gather(
    query: torch.Tensor,
    layer: BlockTableLayer,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    keys, values = gather_pages(layer)
    return attend_padded(query, keys.transpose(1, 2), values.transpose(1, 2), layer.visible, scaling, softcap, sinks)


def _flash(query: torch.Tensor, layer: BlockTableLayer, scaling: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    rows = query.shape[0]
    page = layer.key_pages.shape[1]
    cu_q = torch.arange(rows + 1, dtype=torch.int32, device=query.device)  # one query per row (made per call: a
    # tensor made during a graph capture holds nothing until the graph replays)
    visible = layer.visible.to(torch.int32)
    cu_k = layer.cu_seq_lens_k if layer.window is None else torch.nn.functional.pad(visible.cumsum(0), (1, 0))
    out = varlen_attn(
        query,
        layer.key_pages,
        layer.value_pages,
        cu_q,
        cu_k.to(torch.int32),
        1,
        layer.pages_read * page,  # static upper bound: no host read of the lengths
        scale=scaling,
        enable_gqa=query.shape[1] != layer.key_pages.shape[2],
        seqused_k=visible,
        block_table=layer.block_table[:, : layer.pages_read].to(torch.int32).contiguous(),  # a ring: its first columns
    )
    return out
