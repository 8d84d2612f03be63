"""Which fused CUDA attention kernels an engine uses, decided once per engine by checking each against the reference.

Why: trl_cb's attention paths (`varlen_attention` for packed steps, `paged_decode` for block-table decode steps) are
exact by construction with their reference kernels (gathers and masked SDPA calls, `masked_attention.py`); the
block-table reference gathers every row's pages per layer and step, which is what a decode step at hundreds of rows
spends its time on. On CUDA, torch's varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`) attends packed
sequences in one call (no per-request loop, no host read of the lengths) and, in recent torch releases, reads the paged
cache itself through a block table; where it reads none, trl_cb's Triton kernel (`triton_decode.py`) reads the pages
in place instead. Whether each is present, and whether it gives the reference's answer, depends on the build: so each
engine runs them and the reference on random batches of its model's shape (decode rows, prefill chunks with a past, a
window, a padding row) and uses one only where the largest gap is within half-precision noise.
Invariant: `choose` names a kernel only after that check passed on this device, dtype and shape; any error or
disagreement is logged and answered with `REFERENCE`, never with a kernel that was not checked. Packed steps and
decode steps are chosen separately (`Kernels`): paged decode prefers flash, then Triton. fp32, soft-cap and sinks
always take the reference (the fused kernels have no soft-cap or sinks here, and flash no fp32).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch

from . import paged_decode, triton_decode, varlen_attention
from .paged_decode import FLASH, FLASH_PAGE_MULTIPLE, REFERENCE, REFERENCE_KERNELS, TRITON, BlockTableLayer, Kernels

logger = logging.getLogger(__name__)

__all__ = [
    "FLASH",
    "REFERENCE",
    "REFERENCE_KERNELS",
    "TOLERANCE",
    "TRITON",
    "Kernels",
    "choose",
    "flash_available",
    "paged_flash_available",
]

#: Largest output gap accepted between a fused kernel and the reference, on outputs of unit scale in fp16/bf16.
TOLERANCE = 2e-2


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA, half precision, and a torch with `varlen_attn`."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def paged_flash_available(device: torch.device, dtype: torch.dtype, page_size: int) -> bool:
    """`flash_available`, pages of a multiple of `FLASH_PAGE_MULTIPLE` tokens, and a `varlen_attn` that reads block
    tables."""
    if not flash_available(device, dtype) or page_size % FLASH_PAGE_MULTIPLE:
        return False
    from torch.nn.attention.varlen import varlen_attn

    return "block_table" in inspect.signature(varlen_attn).parameters


def triton_available(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA, half precision, and Triton importable (`triton_decode`)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and triton_decode.available()


def choose(
    device: torch.device,
    dtype: torch.dtype,
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softcap: float | None = None,
    sinks: bool = False,
) -> Kernels:
    """Each path's fused kernel where it is available and agrees with the reference on this shape, else `REFERENCE`
    (see the module docstring)."""
    if softcap is not None or sinks:
        return REFERENCE_KERNELS
    heads = (num_heads, num_kv_heads, head_dim)
    packed = REFERENCE
    if flash_available(device, dtype) and _agrees("packed flash", _packed_gap, device, dtype, *heads):
        packed = FLASH
    paged = REFERENCE
    # Not TRITON yet: on an H200 its bf16 logprobs were 0.117 nats from the trainer's bf16 forward where the reference
    # is 1e-6 (docs/benchmarks.md); it is measured (`benchmarks/decode_kernels.py`) and tested, not chosen.
    for kernel, available in ((FLASH, paged_flash_available(device, dtype, page_size)),):
        if available and _agrees(f"paged {kernel}", _paged_gap, device, dtype, page_size, *heads, kernel):
            paged = kernel
            break
    kernels = Kernels(packed, paged)
    logger.info("Engine attention on %s: packed steps %s, decode steps %s.", device, packed, paged)
    return kernels


def _agrees(name: str, gap_of: Callable[..., float], *args: object) -> bool:
    """Whether the kernel `gap_of(*args)` measures is within `TOLERANCE` of the reference (a failure is a no)."""
    try:
        gap = gap_of(*args)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use it
        logger.warning("The %s attention kernel failed its check (%s): the engine uses its reference.", name, err)
        return False
    if not gap < TOLERANCE:
        logger.warning("The %s attention kernel is %.3g off the reference: the engine uses its reference.", name, gap)
        return False
    logger.info("The %s attention kernel is %.1e off the reference.", name, gap)
    return True


def _paged_gap(
    device: torch.device,
    dtype: torch.dtype,
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kernel: str = FLASH,
) -> float:
    """Largest gap between the block-table `kernel` and the reference on rows of 1, a page, a page + 1 and three
    pages of keys (and a padding row, whose output is unused)."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, page_size, page_size + 1, 3 * page_size, 0]
    max_pages, num_pages = 4, 16
    pages = torch.randperm(num_pages - 1, generator=g)[: 3 * max_pages].reshape(3, max_pages) + 1  # page 0: trash
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    for row, length in enumerate(lengths):
        used = -(-length // page_size)
        table[row, :used] = pages[row % 3, :used]
    cu_k = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_k[1:] = torch.tensor(lengths).cumsum(0)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    key_pages, value_pages = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(2))
    new = torch.randn(len(lengths), num_kv_heads, head_dim, generator=g).to(device, dtype)
    query = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(device, dtype)
    outs = []
    for name in (kernel, REFERENCE):
        layer = BlockTableLayer(
            new, new, key_pages.clone(), value_pages.clone(), table.to(device), cu_k.to(device), 0, name
        )
        outs.append(paged_decode.attend(query, layer, None).float())
    real = slice(0, len(lengths) - 1)
    return (outs[0][real] - outs[1][real]).abs().max().item()


def _packed_gap(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> float:
    """Largest gap between the two packed kernels on decode rows, a fresh prefill and chunks with a past, with and
    without a sliding window."""
    g = torch.Generator().manual_seed(1)
    lengths = [(1, 1), (1, 37), (9, 9), (5, 70), (1, 200), (16, 16)]  # (queries, keys) per request
    cu_q, cu_k = [0], [0]
    for len_q, len_k in lengths:
        cu_q.append(cu_q[-1] + len_q)
        cu_k.append(cu_k[-1] + len_k)
    q = torch.randn(cu_q[-1], num_heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(cu_k[-1], num_kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(cu_k[-1], num_kv_heads, head_dim, generator=g).to(device, dtype)
    cu = [torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k)]
    longest = (max(a for a, _ in lengths), max(b for _, b in lengths))
    gap = 0.0
    for window in (None, 24):
        flash = varlen_attention.packed_varlen_attention(q, k, v, *cu, window, None, kernel=FLASH, max_lengths=longest)
        reference = varlen_attention.packed_varlen_attention(q, k, v, *cu, window, None)
        gap = max(gap, (flash.float() - reference.float()).abs().max().item())
    return gap
