"""Workload-based cache sizing (trl_cb/sizing.py)."""

from __future__ import annotations

import torch

from trl_cb.engine.sizing import (
    CPU_DENSE_MASK_MAX_BATCH_TOKENS,
    CPU_MAX_BATCH_TOKENS,
    MAX_BATCH_TOKENS_CAP,
    CacheSize,
    Workload,
    size_cache,
)

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_every_request_fits_at_full_length():
    w = Workload(num_requests=32, max_prompt_len=100, max_new_tokens=48, prefill_tokens=800)
    size = size_cache(w, page_size=32, device=GPU)
    assert size.num_blocks == 32 * (5 + 1)  # ceil(148 / 32) = 5 pages, + 1 for a fork's partial-page copy
    assert size.max_batch_tokens == 1024  # next power of two >= max(32 requests, 800 prefill tokens)


def test_cpu_caps_tokens_per_forward(monkeypatch):
    w = Workload(num_requests=100, max_prompt_len=40, max_new_tokens=256, prefill_tokens=1600)
    assert size_cache(w, 32, CPU).max_batch_tokens == CPU_MAX_BATCH_TOKENS  # prefill is chunked on CPU
    assert size_cache(w, 32, GPU).max_batch_tokens == 2048
    w = Workload(num_requests=1000, max_prompt_len=40, max_new_tokens=256, prefill_tokens=160)
    assert size_cache(w, 32, CPU).max_batch_tokens == 1024  # but every request decodes in one forward
    assert size_cache(w, 32, GPU).max_batch_tokens == 1024
    monkeypatch.setenv("TRL_CB_ATTENTION", "upstream")  # dense-mask attention: smaller forwards
    assert size_cache(w, 32, CPU).max_batch_tokens == CPU_DENSE_MASK_MAX_BATCH_TOKENS
    huge = Workload(num_requests=20_000, max_prompt_len=10, max_new_tokens=10, prefill_tokens=10)
    assert size_cache(huge, 256, GPU).max_batch_tokens == MAX_BATCH_TOKENS_CAP


def test_holds_compares_capacity_only():
    big, small = CacheSize(32, 100, 64), CacheSize(32, 80, 128)
    assert big.holds(small) and not small.holds(big)
    assert not CacheSize(16, 1000, 64).holds(CacheSize(32, 10, 64)), "different page sizes never match"


def test_union_only_grows():
    a = Workload(8, 100, 48, 400)
    b = Workload(16, 50, 64, 300)
    assert a.union(b) == Workload(16, 100, 64, 400)
