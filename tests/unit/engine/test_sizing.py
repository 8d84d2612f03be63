"""Workload-based cache sizing (trl_cb/sizing.py)."""

from __future__ import annotations

import pytest
import torch

from trl_cb.engine.sizing import (
    CPU_MIN_BATCH_TOKENS,
    MAX_BATCH_TOKENS_CAP,
    CacheSize,
    Workload,
    size_cache,
)

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_shared_prompt_pages_are_counted_once():
    """8 samples of 4 prompts of 100 tokens, 48 new, 32-token pages: 3 full prompt pages per prompt (shared by its
    samples) + per sample at most ceil((31 + 48) / 32) = 3 pages, against 5 pages per sample unshared."""
    w = Workload(num_requests=32, max_prompt_len=100, max_new_tokens=48, prefill_tokens=400, num_prompts=4)
    assert size_cache(w, 32, GPU).num_blocks == 4 * 3 + 32 * 3
    assert size_cache(w, 32, GPU, shared_prompts=False).num_blocks == 32 * 5
    alone = Workload(num_requests=32, max_prompt_len=100, max_new_tokens=48, prefill_tokens=100)  # a server's
    assert size_cache(alone, 32, GPU).num_blocks == 32 * 5


def test_every_request_fits_at_full_length():
    w = Workload(num_requests=32, max_prompt_len=100, max_new_tokens=48, prefill_tokens=800)
    size = size_cache(w, page_size=32, device=GPU)
    assert size.num_blocks == 32 * 5  # ceil(148 / 32) = 5 pages (a fork copies a partial page, shares the rest)
    assert size.max_batch_tokens == 1024  # next power of two >= 32 decode tokens + 800 prefill tokens


def test_one_forward_holds_every_decode_token_and_the_whole_prefill():
    """No mixed prefill/decode steps when it fits: a decode token per request plus the unique prompts' tokens."""
    w = Workload(num_requests=512, max_prompt_len=16, max_new_tokens=32, prefill_tokens=1024)
    assert size_cache(w, 32, CPU).max_batch_tokens == size_cache(w, 32, GPU).max_batch_tokens == 2048  # not 1024
    w = Workload(num_requests=100, max_prompt_len=40, max_new_tokens=256, prefill_tokens=1600)
    assert size_cache(w, 32, CPU).max_batch_tokens == size_cache(w, 32, GPU).max_batch_tokens == 2048
    small = Workload(num_requests=4, max_prompt_len=10, max_new_tokens=8, prefill_tokens=10)
    assert size_cache(small, 32, CPU).max_batch_tokens == CPU_MIN_BATCH_TOKENS  # CPU forwards: at least this
    assert size_cache(small, 32, GPU).max_batch_tokens == 64
    huge = Workload(num_requests=20_000, max_prompt_len=10, max_new_tokens=10, prefill_tokens=10)
    assert size_cache(huge, 256, GPU).max_batch_tokens == size_cache(huge, 256, CPU).max_batch_tokens
    assert size_cache(huge, 256, GPU).max_batch_tokens == MAX_BATCH_TOKENS_CAP


def test_holds_compares_capacity_only():
    big, small = CacheSize(32, 100, 64), CacheSize(32, 80, 128)
    assert big.holds(small) and not small.holds(big)
    assert not CacheSize(16, 1000, 64).holds(CacheSize(32, 10, 64)), "different page sizes never match"


def test_union_only_grows():
    a = Workload(8, 100, 48, 400)
    b = Workload(16, 50, 64, 300)
    assert a.union(b) == Workload(16, 100, 64, 400)


@pytest.mark.parametrize(
    ("page", "prompt_len", "new", "samples"),
    [(8, 7, 9, 4), (8, 16, 8, 3), (16, 17, 23, 4), (8, 23, 1, 8), (8, 25, 15, 1), (32, 128, 24, 2)],
)
@pytest.mark.parametrize(
    ("graphs", "sharing"), [(False, True), (True, True), (False, False)], ids=["cpu", "block-tables", "no-sharing"]
)
def test_the_sized_cache_holds_every_request_at_once(
    tokenizer, monkeypatch, page, prompt_len, new, samples, graphs, sharing
):
    """Every request runs to its limit (EOS never sampled), forked from prompts whose length ends mid-page, on a page
    or just past one: the workload-sized cache holds them all at once. Nothing is offloaded to the CPU
    (`OffloadingManager.offload_requests`), and no row ever waits a step for room (the scheduler caps a step's key
    reads at the cache's size): the seeded samples equal those of a cache four times as large."""
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    from tests.conftest import sampling_config
    from tests.graph_fakes import use_fake_graphs
    from trl_cb import ContinuousBatchingGenerator
    from trl_cb.offline.tiny import tiny_model

    if graphs:
        use_fake_graphs(monkeypatch)

    def refuse(self, *args, **kwargs):
        raise AssertionError("a request was offloaded: the cache was sized too small")

    monkeypatch.setattr(OffloadingManager, "offload_requests", refuse)
    model = tiny_model(tokenizer)
    with torch.no_grad():  # EOS never sampled: its logit 0 against logits spread ~40x wider
        model.lm_head.weight.mul_(40.0)
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tokenizer), (prompt_len,), generator=g).tolist() for _ in range(3)]
    cfg = sampling_config(tokenizer, max_new_tokens=new)
    runs, exact_blocks = [], 0
    for scale in (1, 4):
        engine = {"page_size": page, "allow_block_sharing": sharing}
        with ContinuousBatchingGenerator(model, cfg, engine) as gen:
            if scale > 1:
                gen._pool.cb_kwargs["num_blocks"] = scale * exact_blocks
            torch.manual_seed(0)
            result = gen.generate(prompts, num_generations=samples)
            if scale == 1:
                exact_blocks = gen.cache_size.num_blocks
                shared = graphs and sharing
                workload = Workload(3 * samples, prompt_len, new, 3 * prompt_len, 3)
                assert exact_blocks == size_cache(workload, page, shared_prompts=shared).num_blocks
        assert [len(c) for c in result.completion_ids] == [new] * (3 * samples)
        runs.append((result.completion_ids, result.logprobs))
    (ids, logprobs), (ids_large, logprobs_large) = runs
    assert ids == ids_large, "rows waited for room in the exactly sized cache: other samples"
    gap = max(abs(a - b) for x, y in zip(logprobs, logprobs_large) for a, b in zip(x, y))
    assert gap < 1e-5  # the same tokens from the same logits (a batch laid out otherwise sums in another order)
