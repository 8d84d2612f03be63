"""Size the CB cache from the workload, never from "how much memory is free".

Why: without `num_blocks`/`max_batch_tokens`, transformers sizes the KV cache from free device memory (on CPU, ~60 %
of *system* RAM) and, with sdpa, allocates a dense attention mask proportional to it: several GiB, seconds per call,
and a process that stays slow afterwards (docs/index.md, "Sizing"). A training step knows its workload exactly, so
we ask for that: every request's longest possible sequence, rounded up to pages; with block sharing a prompt's full
pages are counted once for its samples (a fork shares them and owns a copy of the partial page). `max_memory_percent`
remains the hard cap that transformers enforces when it checks the footprint.

Invariant: the cache returned holds every request of the workload at its maximum length at the same time, so no
request is ever preempted or starved for lack of blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import cuda_kernels

#: Upper bound on tokens per forward; larger batches buy nothing on CPU and little on GPU.
MAX_BATCH_TOKENS_CAP = 8192
#: Least token budget per forward on CPU when the user sets none, with trl_cb's attention (`varlen_attention.py`: each
#: query attends to its own request's keys, so a step costs ~ tokens x own length and larger batches amortise the
#: per-step CPU work; measurements: docs/benchmark-log.md, "Attention path").
CPU_MIN_BATCH_TOKENS = 256
#: Page size used on CPU when the user sets none: small pages waste less cache (one partial page per request); with
#: trl_cb's attention the page size does not change the speed, and 32 keeps prompt pages shareable between samples.
CPU_PAGE_SIZE = 32


@dataclass(frozen=True)
class Workload:
    """What one generation round asks of the engine."""

    num_requests: int  # sequences to sample (prompts x samples per prompt)
    max_prompt_len: int
    max_new_tokens: int
    prefill_tokens: int  # tokens of the unique prompts (forked samples share their prompt's prefill)
    #: Prompts the requests are forked from (their G samples share the prompt's full pages). None: an open workload
    #: (a server's: requests arrive on their own, each with its own prompt, and the engine may be asked for more).
    num_prompts: int | None = None

    def union(self, other: Workload) -> Workload:
        """The smallest workload both fit in (used when re-sizing so the engine only grows)."""
        prompts = None if None in (self.num_prompts, other.num_prompts) else max(self.num_prompts, other.num_prompts)
        return Workload(
            num_requests=max(self.num_requests, other.num_requests),
            max_prompt_len=max(self.max_prompt_len, other.max_prompt_len),
            max_new_tokens=max(self.max_new_tokens, other.max_new_tokens),
            prefill_tokens=max(self.prefill_tokens, other.prefill_tokens),
            num_prompts=prompts,
        )


@dataclass(frozen=True)
class CacheSize:
    page_size: int
    num_blocks: int
    max_batch_tokens: int

    def holds(self, other: CacheSize) -> bool:
        """True when a cache of this size can serve a workload that needs `other` (same page size).

        Only capacity counts: a smaller token budget per forward just splits a large prefill over more steps.
        """
        return self.page_size == other.page_size and self.num_blocks >= other.num_blocks


#: Page size on an accelerator when the user sets none and decode steps do not read pages with the flash kernel:
#: a request wastes at most one partial page, so small pages keep the cache near the tokens it holds.
GPU_PAGE_SIZE = 64


def default_page_size(device: torch.device, dtype: torch.dtype | None = None) -> int:
    """The page size we pick when the user sets none: small on CPU; on CUDA the flash block-table kernel's (256,
    `cuda_kernels.FLASH_PAGE_MULTIPLE`) where it can serve the decode steps (half precision), else `GPU_PAGE_SIZE`."""
    if device.type == "cpu":
        return CPU_PAGE_SIZE
    if dtype is not None and cuda_kernels.paged_flash_available(device, dtype, cuda_kernels.FLASH_PAGE_MULTIPLE):
        return cuda_kernels.FLASH_PAGE_MULTIPLE
    return GPU_PAGE_SIZE


def size_cache(
    workload: Workload, page_size: int, device: torch.device | None = None, shared_prompts: bool = True
) -> CacheSize:
    """Blocks and batch tokens for `workload` with `page_size`-token pages (see module docstring). With
    `shared_prompts` (the engine's block sharing: a fork shares its prompt's full pages), a prompt's full pages are
    counted once for its samples, each of which holds at most its prompt's partial page and its completion."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}.")
    requests, prompt, new = workload.num_requests, workload.max_prompt_len, workload.max_new_tokens
    num_blocks = requests * math.ceil((prompt + new) / page_size)  # every request at its longest, alone
    if shared_prompts and workload.num_prompts is not None:
        shared = workload.num_prompts * (prompt // page_size) + requests * math.ceil((page_size - 1 + new) / page_size)
        num_blocks = min(num_blocks, shared)
    # One forward holds one decode token per running request and the whole prefill (up to `MAX_BATCH_TOKENS_CAP`):
    # a prefill split over several forwards runs them beside the decode rows of the requests already forked, and such
    # mixed steps take upstream's per-request path (null model, 512 rows, CPU: 30 ms per mixed step against 13 ms per
    # decode step, seven of them per round at a 512-token budget; docs/benchmark-log.md, "Prefill in one forward").
    # A power of two keeps the shape stable while prompt lengths jitter between steps; CPU forwards get at least
    # `CPU_MIN_BATCH_TOKENS` (larger batches amortise the per-step CPU work).
    wanted = max(workload.num_requests + workload.prefill_tokens, 64)
    floor = CPU_MIN_BATCH_TOKENS if device is not None and device.type == "cpu" else 0
    max_batch_tokens = min(MAX_BATCH_TOKENS_CAP, max(floor, 1 << (wanted - 1).bit_length()))
    return CacheSize(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
