"""Block-table decode attention as one Triton kernel that reads each row's pages where they are.

Why: without a torch whose `varlen_attn` takes a block table (torch 2.11 has none), the reference kernel gathers every
row's pages (the table's full width) per layer and step, after a dozen small kernels that write the new keys
(`paged_decode`): at hundreds of rows, most of a step's attention time and kernels. Here one launch per layer: one
program per (row, KV head) stores the new key and value through the block table, then walks the cached keys `BLOCK_N`
at a time with an online softmax in float32 (FlashAttention's recurrence) started from the new key in registers; the
GQA heads of a KV head are the rows of one `tl.dot`, so each key is read once. The loop's trip count is read on the
device, so a CUDA graph replays it with new lengths.
Invariant: a row with `seq_len > 0` gets causal attention over keys `[0, seq_len)`, the new ones as the cache stores
them; fp16/bf16 take tensor-core products with float32 accumulation, the probabilities split into two half-precision
terms for the value product (~16 mantissa bits where a flash kernel keeps bf16's 8), float32 takes IEEE products; a
padding row writes the trash row and gets a finite, unused output. No soft-cap or sinks (the reference takes those).
Not chosen by engines yet (`cuda_kernels.choose`: its bf16 gap to the trainer's forward); CPU tests interpret it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["available", "paged_decode_attention"]

#: Keys per iteration of a program's loop (a power of two; a block may span pages: each key finds its own page); half
#: that for heads wider than 128 (the float32 tiles stay in registers).
BLOCK_N = 64
#: `tl.dot` takes at least 16 rows: a KV head's GQA query heads, padded.
MIN_DOT_ROWS = 16


@functools.cache
def available() -> bool:
    """Whether Triton imports (it ships with torch's CUDA builds; CPU builds have none unless installed)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is an absent one
        return False
    return True


@functools.cache
def _kernel() -> Any:
    """The kernel, jitted on first use (so `TRITON_INTERPRET`, read at jit time, can be set before; tests clear this
    cache to switch). Its body lives in `_triton_paged_kernel` (Triton's interpreter resolves `tl` in the kernel's
    module globals)."""
    import triton

    from ._triton_paged_kernel import paged_decode_kernel

    return triton.jit(paged_decode_kernel)


def paged_decode_attention(
    query: torch.Tensor,  # (R, H, D): one query token per row
    new_keys: torch.Tensor,  # (R, Hkv, D): this step's key of each row, not yet in the cache
    new_values: torch.Tensor,  # (R, Hkv, Dv)
    key_pages: torch.Tensor,  # (pages, page, Hkv, D): the layer's cache as pages
    value_pages: torch.Tensor,  # (pages, page, Hkv, Dv)
    block_table: torch.Tensor,  # (R, max_pages) int32: page ids of each row, -1 past its pages
    cu_seq_lens_k: torch.Tensor,  # (R + 1,) int32: cumulative key counts (the new key included), flat for padding
    write_trash: int,  # a token row of the cache (page x page size + slot) that nothing reads
    scaling: float | None,
) -> torch.Tensor:  # (R, H, Dv)
    """Write each row's new key and value at its position (`seq_len - 1`; padding rows: `write_trash`) and attend its
    query to its `seq_len` keys, read through its block table (see the module docstring). One kernel launch."""
    import triton

    rows, num_heads, head_dim = query.shape
    page, num_kv, value_dim = key_pages.shape[1], key_pages.shape[2], value_pages.shape[-1]
    n_rep = num_heads // num_kv
    query, new_keys, new_values = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, new_keys, new_values))
    if key_pages.stride(-1) != 1 or value_pages.stride(-1) != 1:
        raise ValueError("The paged cache's head dimension must be contiguous.")
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    cu_k = cu_seq_lens_k if cu_seq_lens_k.dtype == torch.int32 else cu_seq_lens_k.to(torch.int32)
    out = query.new_empty(rows, num_heads, value_dim)
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    block_n = BLOCK_N if max(head_dim, value_dim) <= 128 else BLOCK_N // 2
    _kernel()[(rows, num_kv)](
        query, new_keys, new_values, key_pages, value_pages, out, table, cu_k,
        query.stride(0), query.stride(1), new_keys.stride(0), new_keys.stride(1), new_values.stride(0),
        new_values.stride(1), key_pages.stride(0), key_pages.stride(1), key_pages.stride(2), value_pages.stride(0),
        value_pages.stride(1), value_pages.stride(2), out.stride(0), out.stride(1), table.stride(0), table.shape[1],
        write_trash, scale,
        N_REP=n_rep, BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(n_rep)), D=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), DV=value_dim,
        BLOCK_DV=max(16, triton.next_power_of_2(value_dim)), PAGE=page, BLOCK_N=block_n,
        HALF_DOTS=half_dots(query),
    )  # fmt: skip
    return out


def half_dots(query: torch.Tensor) -> bool:
    """Tensor-core products in the inputs' half precision (float32 accumulation) for fp16/bf16 inputs; float32 IEEE
    products otherwise, and for bf16 off a GPU (Triton's CPU interpreter rounds float32 to bf16 wrongly)."""
    return query.dtype == torch.float16 or (query.dtype == torch.bfloat16 and query.is_cuda)
