"""The one-gather key reads and tensor-built read indices (`engine/_upstream_cache.py`) against transformers' own.

Exactness end to end (CB logprobs = teacher-forced ones, with controls) is `test_attention.py`'s; these tests pin
the two pieces on their own: the read rows equal the allocator's per-token lists on every step of a real engine, and
transformers' own read path (`cache.update`'s packed copy) gives the same samples and logprobs.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_cache, _upstream_decode, openmp


def _generate(model, tokenizer, prompts, **config: object):
    cfg: GenerationConfig = sampling_config(tokenizer, max_new_tokens=40)
    with ContinuousBatchingGenerator(model, cfg, {"max_batch_tokens": 48, "page_size": 16, **config}) as gen:
        torch.manual_seed(0)
        return gen.generate([p[:30] for p in prompts[:3]], num_generations=2)


def test_read_rows_equal_the_allocators_lists_on_every_step(sharp_model, tokenizer, prompts, monkeypatch):
    """Every batch the engine prepares: `read_index_rows` == the concatenated `get_read_indices` lists. Page size 16
    and 30-token prompts cross page boundaries, mid-page ends and chunked prefills (48 tokens per step). The decode
    fast path is off: it advances the previous rows instead (test_decode_fast_path.py checks those)."""
    monkeypatch.setattr(_upstream_decode, "fast_path_fits", lambda processor: False)
    checked = []
    rows_fn = _upstream_cache.read_index_rows

    def compare(allocator, requests):
        rows = rows_fn(allocator, requests)
        lists = [FullAttentionCacheAllocator.get_read_indices(allocator, rid, 0, n) for rid, n in requests]
        upstream = [i for rows_of_one in lists for i in rows_of_one]
        assert rows.tolist() == upstream
        checked.append(len(requests))
        return rows

    monkeypatch.setattr(_upstream_cache, "read_index_rows", compare)
    _generate(sharp_model, tokenizer, prompts)
    assert len(checked) > 20 and max(checked) == 6, "the engine did not build read rows on its decode steps"


def test_read_rows_control_a_shifted_page_is_seen(sharp_model, tokenizer, prompts):
    """Control: the comparison above fails when a row is off by one page."""
    cfg = sampling_config(tokenizer, max_new_tokens=4)
    with ContinuousBatchingGenerator(sharp_model, cfg, {"page_size": 16}) as g:
        g.generate([prompts[0][:40]], num_generations=1)
        engine = g._pool.engine.manager  # noqa: SLF001 - reach the allocator the engine used
        allocator = next(iter(engine.batch_processor.cache.cache_allocators.values()))
    allocator.block_table["probe"] = [3, 1, 2]
    gen_rows = _upstream_cache.read_index_rows(allocator, [("probe", 37)]).tolist()
    upstream = FullAttentionCacheAllocator.get_read_indices(allocator, "probe", 30, 7)
    assert gen_rows == upstream
    allocator.block_table["probe"] = [1, 3, 2]
    assert _upstream_cache.read_index_rows(allocator, [("probe", 37)]).tolist() != upstream


def test_packed_copy_path_gives_identical_rollouts(sharp_model, tokenizer, prompts, monkeypatch):
    """Reads through transformers' `cache.update` (its packed copy of every key: the reference) sample the same tokens
    as the one-gather reads, logprobs equal to 1e-5."""
    calls = []
    paged = _upstream_cache.paged_layer
    monkeypatch.setattr(_upstream_cache, "paged_layer", lambda *a: calls.append(1) or paged(*a))
    direct = _generate(sharp_model, tokenizer, prompts)
    assert calls, "the direct-read path did not run"
    monkeypatch.setattr(_upstream_cache, "paged_layer", lambda *a: calls.append(1))  # returns None: upstream's path
    calls.clear()
    packed = _generate(sharp_model, tokenizer, prompts)
    assert calls, "the reference run did not go through the direct-read hook"
    assert packed.completion_ids == direct.completion_ids
    worst = max(abs(a - b) for x, y in zip(packed.logprobs, direct.logprobs) for a, b in zip(x, y))
    assert worst <= 1e-5


@pytest.mark.parametrize(("tokens", "hidden", "expected"), [(32, 64, 1), (16, 2048, 1), (800, 64, 1), (800, 256, 2)])
def test_step_threads_policy(tokens, hidden, expected):
    assert openmp.step_threads(tokens, hidden, 2) == expected


def test_engine_steps_set_threads_on_the_engine_thread_only(model, tokenizer, prompts):
    """Decode steps run on one intra-op thread, prefill steps past the threshold on the caller's count; the caller's
    setting is untouched, and a thread started after the round takes the caller's count, not the engine's."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread: nothing to switch")
    seen: dict[str, set[int]] = {"decode": set(), "prefill": set()}

    def record(module, args, kwargs):
        if threading.current_thread() is threading.main_thread():
            return  # model checks and warm-up forwards run on the caller's thread
        tokens = kwargs["input_ids"].shape[-1]
        small = tokens * model.config.hidden_size < openmp.SINGLE_THREAD_STEP_WORK
        seen["decode" if small else "prefill"].add(torch.get_num_threads())

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    long_prompts = [(p * 40)[:1100] for p in prompts[:2]]  # 1100 tokens x 64 wide: above the one-thread threshold
    cfg = sampling_config(tokenizer, max_new_tokens=6)
    with ContinuousBatchingGenerator(model, cfg, {"max_batch_tokens": 1200}) as gen:
        gen.generate(long_prompts, num_generations=2)
    handle.remove()
    assert seen == {"decode": {1}, "prefill": {threads}}
    assert torch.get_num_threads() == threads
    fresh: list[int] = []
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [threads]


@pytest.mark.parametrize("hook", [True, False], ids=["filtered", "control-unfiltered"])
def test_engine_cache_stays_out_of_mixed_precision_outputs(tokenizer, prompts, monkeypatch, hook):
    """accelerate's mixed precision wraps the trainer's model forward to convert half-precision outputs to fp32; from
    transformers 5.24 Gemma-2 (like many models) returns the engine's bf16 `PagedAttentionCache` in its output, and
    the wrapper called `.float()` on it (`AttributeError` in the engine loop). With the output filter generation
    runs; control: without it, 5.24 fails that way (5.23 never returned the engine's cache)."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    from tests.unit.engine.test_precision import tiny_gemma2
    from trl_cb.errors import GenerationError

    model = tiny_gemma2(tokenizer, torch.bfloat16)
    model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)  # as accelerate.prepare does
    if not hook:
        monkeypatch.setattr(_upstream_cache, "_without_paged_cache", lambda module, args, output: output)
    cfg = sampling_config(tokenizer, max_new_tokens=4)

    def run() -> None:
        with ContinuousBatchingGenerator(model, cfg, {"page_size": 16}) as gen:
            gen.generate([prompts[0][:20]], num_generations=1)

    if hook or _upstream_cache.ATTENTION_UPDATES_CACHE:
        run()
    else:
        with pytest.raises(GenerationError, match="has no attribute 'float'"):
            run()
